-- Sharded checkpoints of tensor-parallel models (#mpi, 1-4 CPU ranks;
-- docs/fsdp-checkpoints.md, "Boxes"): a TP slice is saved as boxes of the
-- whole parameter (one a section: GPT-2's fused c_attn has three), a
-- rank's FSDP shard of its slice (FSDP x TP) as intervals of those boxes,
-- and any saved layout loads into any other. GPT-2 (fused q|k|v, a tied
-- embedding) and Llama (GQA) with vocabularies that do not split evenly
-- (259, 257; and 9 rows over 4 ranks: the last holds none), f32 and bf16
-- parameters, AdamW after two steps on random tokens: saved from one
-- layout of the world (one process's model, FSDP, TP, TP x data parallel,
-- TP x FSDP), loaded into every other with other initial weights: the
-- gathered parameters, moments and step are the saver's bit for bit; the
-- next step's loss at the saver's layout is the uninterrupted run's bit
-- for bit, at another within f32 (bf16) rounding. The boxes' geometry is
-- checked element by element against a brute-force enumeration.
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local FS = require 'spec.fsdp_support'
local H = require 'spec.fsdp_ckpt_helpers'
local dist = require 'moonshard.dist'
local hf = require 'models.hf'
local ck = require 'moonshard.fsdp_checkpoint'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

-- a deterministic generator (an LCG) of integers in [0, n)
local function lcg(seed)
  local s = seed
  return function(n)
    s = (s * 1103515245 + 12345) % 2147483648
    return math.floor(s / 65536) % n
  end
end

describe('sharded checkpoints: boxes (the geometry)', function()
  it('runs_of cuts an interval of a box\'s flattening into at most 2N - 1 contiguous runs that hold it exactly',
    function()
    local r = lcg(11)
    for _ = 1, 300 do
      local N = 1 + r(4)
      local sizes, offsets, n = {}, {}, 1
      for d = 1, N do sizes[d] = 1 + r(5); offsets[d] = r(3); n = n * sizes[d] end
      local s = r(n)
      local e = s + 1 + r(n - s)
      local runs = ck._runs_of({ offsets = offsets, sizes = sizes }, s, e)
      assert.is_true(#runs <= 2 * N - 1)
      local seen, total = {}, 0
      for _, R in ipairs(runs) do
        -- every element of the run, in order: flat positions R.flat, R.flat + 1, ...
        local pos = R.flat
        local idx = {}
        local function walk(d)
          if d > N then
            local f = 0
            for k = 1, N do f = f * sizes[k] + (idx[k] - offsets[k]) end
            assert.are.equal(pos, f)
            assert.is_nil(seen[f])
            seen[f] = true
            pos, total = pos + 1, total + 1
            return
          end
          for i = R.lo[d], R.hi[d] - 1 do idx[d] = i; walk(d + 1) end
        end
        walk(1)
      end
      assert.are.equal(e - s, total)
      for f = s, e - 1 do assert.is_true(seen[f]) end
    end
  end)

  it('parts_of maps an element range of a TP slice (sections, a vocabulary\'s rows) to intervals of boxes of the '
    .. 'whole parameter, element by element', function()
    local r = lcg(5)
    for _ = 1, 200 do
      local N = 1 + r(3)
      local L = {}
      local n = 1
      for d = 1, N do L[d] = 1 + r(4); n = n * L[d] end
      local d = 1 + r(N)
      local S = 1 + r(3)
      local size, rank = 1 + r(3), 0
      rank = r(size)
      L[d] = L[d] * S
      n = n * S
      local piece = L[d] / S
      local Wsh = {}
      for k = 1, N do Wsh[k] = L[k] end
      Wsh[d] = L[d] * size
      local segs = {}
      for s = 0, S - 1 do segs[#segs + 1] = { l = s * piece, g = s * (Wsh[d] / S) + rank * piece, n = piece } end
      local reg = { entry = { shape = L, wshape = Wsh, split = { shape = Wsh, dim = d, segs = segs } } }
      local a = r(n)
      local b = a + 1 + r(n - a)
      -- the range's elements hold their own L-flat index
      local vals = {}
      for x = a, b - 1 do vals[#vals + 1] = x end
      local flat = T.tensor(vals, { dtype = 'f64' })
      local covered = 0
      for _, p in ipairs(ck._parts_of(reg, a, b - a)) do
        local buf = p.at and flat:narrow(1, p.at + 1, p.numel) or nil
        if not buf then
          buf = T.empty({ p.numel }, { dtype = 'f64' })
          for _, m in ipairs(p.moves) do
            -- (the spec's own copy of part_gather's moves)
            if m.rows then
              local fv = flat:narrow(1, m.at + 1, m.rows * m.row):view({ m.rows, m.row }):narrow(2, 1, m.seg)
              buf:narrow(1, m.bo + 1, m.rows * m.seg):view({ m.rows, m.seg }):copy_(fv)
            else
              buf:narrow(1, m.bo + 1, m.n):copy_(flat:narrow(1, m.at + 1, m.n))
            end
          end
        end
        local got = buf:totable()
        -- element i of the part: box-flat p.start + i -> whole coordinates -> local coordinates -> L-flat
        for i = 0, p.numel - 1 do
          local f = p.start + i
          local idx = {}
          for k = N, 1, -1 do idx[k] = f % p.box.sizes[k]; f = math.floor(f / p.box.sizes[k]) end
          local lf = 0
          for k = 1, N do
            local gi = idx[k] + p.box.offsets[k]
            local li = gi
            if k == d then
              li = nil
              for _, g in ipairs(segs) do if gi >= g.g and gi < g.g + g.n then li = g.l + gi - g.g end end
            end
            lf = lf * L[k] + li
          end
          assert.are.equal(lf, got[i + 1])
        end
        covered = covered + p.numel
      end
      assert.are.equal(b - a, covered)
    end
  end)
end)

describe('sharded checkpoints with tensor parallelism #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  local D
  setup(function()
    dist.init { backend = 'mpi', timeout = 300 }
    D = H.shared_tmpdir()
  end)
  teardown(function()
    ck._inject_failure = nil
    dist.barrier()
    if dist.rank() == 0 and D and D:match('fsdp%-ckpt$') then os.execute("rm -rf '" .. D .. "'") end
    dist.destroy()
  end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local tp, fsdp = ms.tp, ms.fsdp
  local OPTS = { lr = 1e-2, weight_decay = 0.1, eps = 1e-6 }

  -- 12 heads (12 kv heads of 24 for the Llama): splits over 1-4 ranks;
  -- vocabularies of 259 and 257 split unevenly over 2-4 ranks, 9 over 4
  -- leaves the last rank no rows
  local cases = {
    { 'gpt2', require 'models.gpt2', 'GPT2Block', { vocab_size = 259, n_positions = 32, n_embd = 48, n_layer = 2,
      n_head = 12, resid_pdrop = 0, embd_pdrop = 0, attn_pdrop = 0, bos_token_id = hf.null, eos_token_id = hf.null } },
    { 'llama', require 'models.llama', 'LlamaDecoderLayer', { vocab_size = 257, hidden_size = 48,
      intermediate_size = 96, num_hidden_layers = 2, num_attention_heads = 24, num_key_value_heads = 12,
      max_position_embeddings = 32 } },
    { 'gpt2 V=9', require 'models.gpt2', 'GPT2Block', { vocab_size = 9, n_positions = 32, n_embd = 24, n_layer = 1,
      n_head = 12, resid_pdrop = 0, embd_pdrop = 0, attn_pdrop = 0, bos_token_id = hf.null, eos_token_id = hf.null } },
  }

  -- the layouts of this world: one process's model on every rank (plain),
  -- FSDP over the world, TP over the world, and with an even world TP 2
  -- with data-parallel copies (tp_dp) or FSDP (tp_fsdp) across
  local layouts = { { name = 'plain' }, { name = 'fsdp', fsdp = true }, { name = 'tp', tp = W } }
  if W % 2 == 0 then
    layouts[#layouts + 1] = { name = 'tp_fsdp', tp = 2, fsdp = true }
    if W > 2 then layouts[#layouts + 1] = { name = 'tp_dp', tp = 2 } end
  end

  local function make(case, lay, dtype, seed)
    ms.manual_seed(seed)
    local m = case[2].new(case[4])
    if dtype ~= 'f32' then m:to(dtype) end
    local mesh
    if lay.tp then
      mesh = dist.mesh { replicate = W / lay.tp, shard = lay.tp }
      tp.parallelize(m, { group = mesh.shard })
    end
    local opt
    if lay.fsdp then
      fsdp.fully_shard(m, { policy = fsdp.policy.by_class { case[3] }, group = mesh and mesh.replicate or nil })
      opt = fsdp.AdamW(m, OPTS)
    else
      opt = ms.optim.AdamW(m, OPTS)
    end
    return m, opt
  end

  local function batch(case, step)
    local ids, tg = FS.lcg_rows(40 + step, 2, 8)
    local V = case[4].vocab_size
    for _, rows in ipairs({ ids, tg }) do
      for _, row in ipairs(rows) do for j = 1, #row do row[j] = row[j] % V end end
    end
    return T.tensor(ids, { dtype = 'i64' }), T.tensor(tg, { dtype = 'i64' })
  end
  local function step(case, m, opt, s)
    local x, y = batch(case, s)
    local l = m(x, y)
    l:backward()
    opt:step()
    opt:zero_grad()
    return l:item()
  end
  local function loss(case, m, s)
    local x, y = batch(case, s)
    return ms.autograd.no_grad(function() return m(x, y):item() end)
  end

  -- name -> { p =, exp_avg =, exp_avg_sq =, step = }: every parameter and
  -- its moments whole (gathered over TP and FSDP), on every rank
  local function full_state(m, opt, lay)
    local out = {}
    if lay.tp and lay.fsdp then
      local msd, st = tp.fsdp_full_tensors(m, opt)
      for name in m:named_parameters() do
        local s = st[name] or {}
        out[name] = { p = msd[name], exp_avg = s.exp_avg, exp_avg_sq = s.exp_avg_sq, step = s.step }
      end
    elseif lay.tp then
      local msd = tp.full_state_dict(m)
      local osd = tp.full_optimizer_state(m, opt)
      local name_of, i = {}, 0
      local by_id = {}
      for name, p in m:named_parameters() do by_id[tonumber(p.id)] = by_id[tonumber(p.id)] or name end
      for _, g in ipairs(opt.param_groups) do
        for _, p in ipairs(g.params) do i = i + 1; name_of[i] = by_id[tonumber(p.id)] end
      end
      for name in m:named_parameters() do out[name] = { p = msd[name] } end
      for _, e in ipairs(osd.meta.state) do
        local o = out[name_of[e.index]]
        o.exp_avg, o.exp_avg_sq, o.step = osd.tensors[e.index .. '.exp_avg'], osd.tensors[e.index .. '.exp_avg_sq'], e.step
      end
    elseif lay.fsdp then
      local params, st = ck.gather(m, { optimizer = opt })
      for _, e in ipairs(params) do
        local s = st[e.name] or {}
        out[e.name] = { p = e.tensor, exp_avg = s.exp_avg, exp_avg_sq = s.exp_avg_sq, step = s.step }
      end
    else
      for name, p in m:named_parameters() do
        local s = opt.state[tonumber(p.id)] or {}
        out[name] = out[name] or { p = p, exp_avg = s.exp_avg, exp_avg_sq = s.exp_avg_sq, step = s.step }
      end
    end
    -- (copies: the model goes on training)
    for _, o in pairs(out) do
      for _, k in ipairs({ 'p', 'exp_avg', 'exp_avg_sq' }) do if o[k] then o[k] = o[k]:clone() end end
    end
    return out
  end

  local function bits_equal(a, b, what)
    assert.is_not_nil(a, what)
    assert.is_not_nil(b, what)
    assert.are.same(b.shape, a.shape, what)
    -- (bf16 parameters under FSDP have f32 masters: the values in the
    -- loaded model's dtype)
    local d = (a:to('f64') - b:to(a.dtype):to('f64')):abs():max():item()
    assert.are.equal(0, d, what)
  end
  local function same_state(got, ref, what)
    local n = 0
    for name, r in pairs(ref) do
      local g = got[name]
      assert.is_not_nil(g, what .. name)
      bits_equal(g.p:view(r.p.shape), r.p, what .. name)
      bits_equal(g.exp_avg:view(r.exp_avg.shape), r.exp_avg, what .. name .. ' exp_avg')
      bits_equal(g.exp_avg_sq:view(r.exp_avg_sq.shape), r.exp_avg_sq, what .. name .. ' exp_avg_sq')
      assert.are.equal(r.step, g.step, what .. name .. ' step')
      n = n + 1
    end
    assert.is_true(n >= 8)
  end

  local count = 0
  local function saved_from(case, A, dtype)
    count = count + 1
    local dir = ('%s/%s-%s-%s-%d'):format(D, case[1]:gsub('[^%w]', ''), A.name, dtype, count)
    local m, opt = make(case, A, dtype, 7)
    step(case, m, opt, 1)
    step(case, m, opt, 2)
    local ref = full_state(m, opt, A)
    ck.save_sharded(m, dir, { optimizer = opt, extra = { layout = A.name } })
    dist.barrier()   -- (a plain model's save is rank 0's alone)
    return dir, ref, m, opt
  end

  for _, case in ipairs(cases) do
    for _, dtype in ipairs({ 'f32', 'bf16' }) do
      if not (case[1] == 'gpt2 V=9' and dtype == 'bf16') then
        it(('%s, %s parameters: saved from every layout, loaded into every other: parameters, moments and step bit '
          .. 'for bit; the next step\'s loss'):format(case[1], dtype), function()
          for _, A in ipairs(layouts) do
            local dir, ref, am, aopt = saved_from(case, A, dtype)
            local index = ck.read_index(dir)
            -- a TP layout's pieces are boxes (version 2); none other's
            assert.are.equal((A.tp and W > 1) and 2 or 1, index.version, A.name)
            local a_next = step(case, am, aopt, 3)   -- (the uninterrupted run)
            local a_loss4 = loss(case, am, 4)
            for _, B in ipairs(layouts) do
              local what = ('%s %s, saved %s, loaded %s (W %d): '):format(case[1], dtype, A.name, B.name, W)
              local m, opt = make(case, B, dtype, 99)   -- (other weights: the load must replace them)
              local info = ck.load_sharded(m, dir, { optimizer = opt, verify = true })
              assert.are.equal(A.name, info.extra.layout)
              same_state(full_state(m, opt, B), ref, what)
              local l = step(case, m, opt, 3)
              if B.name == A.name then
                assert.are.equal(a_next, l, what .. 'the next loss')
                assert.are.equal(a_loss4, loss(case, m, 4), what .. 'the loss after it')
              else
                local tol = dtype == 'f32' and 1e-5 or 2e-2
                assert.is_true(FS.rel(l, a_next) <= tol, ('%sthe next loss %.9g, the saver\'s %.9g'):format(what, l,
                  a_next))
              end
            end
          end
        end)
      end
    end
  end

  it('FSDP x TP: shards cut the slices\' rows (partial rows), and every rank writes its own pieces, TP-replicated '
    .. 'parameters\' once', function()
    if W ~= 4 then pending('four ranks: TP 2 x FSDP 2'); return end
    local case = cases[1]
    local A = layouts[4]
    local dir = saved_from(case, A, 'f32')
    local index = ck.read_index(dir)
    local cut, writers = false, {}
    for name, list in pairs(index.pieces) do
      for _, pc in ipairs(list) do
        writers[pc.rank] = true
        if pc.box then
          local row = 1
          for d = 2, #pc.box.sizes do row = row * pc.box.sizes[d] end
          if pc.start % row ~= 0 or (pc.start + pc.numel) % row ~= 0 then cut = true end
        end
      end
      -- each element once
      local n = 0
      for _, pc in ipairs(list) do n = n + pc.numel end
      local e
      for _, x in ipairs(index.params) do if x.name == name then e = x end end
      if e then assert.are.equal(e.numel, n, name) end
    end
    assert.is_true(cut)
    for r = 0, 3 do assert.is_true(writers[r], 'rank ' .. r .. ' wrote no piece') end
    -- c_attn's weight: 3 sections x 2 TP ranks = 6 boxes, their pieces split over the 2 FSDP ranks
    local boxes = {}
    for _, pc in ipairs(index.pieces['transformer.h.0.attn.c_attn.weight']) do
      boxes[table.concat(pc.box.offsets, ',')] = true
    end
    local nb = 0
    for _ in pairs(boxes) do nb = nb + 1 end
    assert.are.equal(6, nb)
  end)

  it('a version-1 checkpoint (element ranges, written before boxes: spec/fixtures/fsdp_ckpt_v1, FSDP over 2 ranks) '
    .. 'loads into every layout: the values the old code gathered, bit for bit', function()
    local fx = T.root .. '/spec/fixtures/fsdp_ckpt_v1'
    local case = { 'gpt2 v1', require 'models.gpt2', 'GPT2Block', { vocab_size = 16, n_positions = 8, n_embd = 8,
      n_layer = 1, n_head = 2, resid_pdrop = 0, embd_pdrop = 0, attn_pdrop = 0, bos_token_id = hf.null,
      eos_token_id = hf.null } }
    local want = ms.load_safetensors(fx .. '/expected.safetensors')
    local _, meta = require('moonshard.safetensors').header(fx .. '/expected.safetensors')
    local ref = {}
    for name, t in pairs(want) do
      if not name:find(':') then
        ref[name] = { p = t, exp_avg = want['exp_avg:' .. name], exp_avg_sq = want['exp_avg_sq:' .. name],
          step = tonumber(meta.step) }
      end
    end
    assert.are.equal(1, ck.read_index(fx .. '/ckpt').version)
    local lays = { { name = 'plain' }, { name = 'fsdp', fsdp = true } }
    if W <= 2 then lays[#lays + 1] = { name = 'tp', tp = W } end
    if W % 2 == 0 then lays[#lays + 1] = { name = 'tp_fsdp', tp = 2, fsdp = true } end
    for _, B in ipairs(lays) do
      local m, opt = make(case, B, 'f32', 99)
      local info = ck.load_sharded(m, fx .. '/ckpt', { optimizer = opt, verify = true })
      assert.are.equal('f2d9182', info.extra.written_by)
      same_state(full_state(m, opt, B), ref, 'v1 into ' .. B.name .. ': ')
    end
  end)

  it('errors name the folder, the file and the parameter', function()
    local case = cases[2]
    local A = layouts[#layouts]
    local dir = saved_from(case, A, 'f32')
    -- a model whose parameter has another shape
    local other = { name = 'tp', tp = W }
    local c2 = { case[1], case[2], case[3], {} }
    for k, v in pairs(case[4]) do c2[4][k] = v end
    c2[4].vocab_size = 263
    local m, opt = make(c2, other, 'f32', 3)
    local ok, err = pcall(ck.load_sharded, m, dir, { optimizer = opt })
    assert.is_false(ok)
    assert.matches('parameter model.embed_tokens.weight has shape (257, 48) in ' .. dir .. ', (263, 48) in the model',
      err, 1, true)
    -- a rank file's bytes changed: the CRC-32 check (verify = true) names it
    H.on_rank0(function()
      local path = dir .. '/' .. ck.rank_file(0, W)
      local f = assert(io.open(path, 'r+b'))
      local size = f:seek('end')
      f:seek('set', size - 4)
      local b = f:read(4)
      f:seek('set', size - 4)
      f:write(string.char((b:byte(1) + 1) % 256) .. b:sub(2))
      f:close()
    end)
    local m2, opt2 = make(case, other, 'f32', 3)
    ok, err = pcall(ck.load_sharded, m2, dir, { optimizer = opt2, verify = true })
    assert.is_false(ok)
    if dist.rank() == 0 then
      assert.matches(dir .. '/' .. ck.rank_file(0, W) .. ': checksum mismatch', err, 1, true)
    end
    -- a rank file missing
    H.on_rank0(function() os.remove(dir .. '/' .. ck.rank_file(W - 1, W)) end)
    ok, err = pcall(ck.load_sharded, m2, dir, { optimizer = opt2 })
    assert.is_false(ok)
    assert.matches(dir .. '/' .. ck.rank_file(W - 1, W) .. ' is missing', err, 1, true)
  end)
end)
