-- moonshard.fsdp_checkpoint — checkpoints of fully sharded models
-- (ms.fsdp.fully_shard): sharded (every rank writes its own shards) and
-- full (gathered, a Hugging Face safetensors file written by rank 0).
-- A sharded checkpoint loads into any world size, any strategy and any
-- wrapping policy: pieces are described by parameter name and element
-- range, never by flat offsets. docs/fsdp-checkpoints.md has the details.
--
--   local ckpt = require 'moonshard.fsdp_checkpoint'   -- (ms.fsdp.checkpoint)
--   ckpt.save_sharded(model, 'runs/x/step-200', { optimizer = opt, step = 200, extra = { data = loader:state() } })
--   local info = ckpt.load_sharded(model, 'runs/x/step-200', { optimizer = opt })  -- info.step, info.extra
--   ckpt.save_full(model, 'runs/x/model.safetensors')  -- rank 0 writes; HF names, tied weights once
--   ckpt.load_full(model, 'runs/x/model.safetensors')  -- each rank reads only its slices
--
-- Every call is collective when the model is sharded: all ranks of the
-- world call it with the same arguments. A model that was not passed to
-- fully_shard is handled as one rank holding every parameter whole (so a
-- sharded checkpoint loads into a plain model in one process, and a plain
-- model saves one that loads into a sharded one). A pipeline stage
-- (ms.pp.pipeline, under fully_shard or not) saves and loads its own
-- parameters, under the whole model's names: every rank of the world takes
-- part, and the checkpoint is the whole model's (pipeline_writes). A
-- tensor-parallel model (ms.tp, under fully_shard or not) saves its slices
-- as boxes of the whole parameters (tp.boxes), and an expert-parallel one
-- its experts: every rank of the world takes part, each piece written by
-- the lowest rank that holds it (owners), and any saved layout loads into
-- any other.
--
-- A sharded checkpoint is a folder:
--   rank-<r>-of-<W>.safetensors  rank r's pieces: 'param:<name>:<start>' (f32,
--                                1-d, numel elements of parameter <name> from
--                                element <start>; 'param:<name>:<offsets>:<start>'
--                                of a box of it, version 2), 'exp_avg:<name>:<start>',
--                                'exp_avg_sq:<name>:<start>' (AdamW; SGD with
--                                momentum: 'momentum_buffer:<name>:<start>'), and in
--                                __metadata__['moonshard.fsdp'] the JSON
--                                description (parameters, pieces, steps)
--   index.json                   written last by rank 0: format, world size,
--                                strategy, step, extra, parameters (name,
--                                shape, dtype), files (bytes, crc32), the
--                                piece table, the optimizer's hyper-parameters
-- Saving writes <dir>.tmp/ and swaps it with <dir> only once index.json is
-- in it (renameat2 RENAME_EXCHANGE: atomic), so a failed save leaves the
-- previous checkpoint as it was; a folder without index.json is incomplete.
local ffi = require 'ffi'
local json = require 'dkjson'
local T = require 'moonshard.tensor'
local S = require 'moonshard.safetensors'
local dist = require 'moonshard.dist'
local C = T.C

local M = {}
M.format = 'moonshard.fsdp_checkpoint'
M.version = 2   -- (version 1: element-range pieces only; written when no piece has a box)
M.index_name = 'index.json'

local function no_grad(fn) return require('moonshard.autograd').no_grad(fn) end
local function fsdp() return require 'moonshard.fsdp' end
local function crc32_file(path) return require('moonshard.checkpoint').crc32_file(path) end

local function fail(fmt, ...) error('fsdp_checkpoint: ' .. fmt:format(...), 0) end

local shape_str = T.shape_str
local function same_shape(a, b)
  if #a ~= #b then return false end
  for i = 1, #a do if a[i] ~= b[i] then return false end end
  return true
end
local function numel_of(shape)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  return n
end

-- ------------------------------------------------------------- files

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
local function sh(cmd)
  local r = os.execute(cmd)
  return r == 0 or r == true
end

local function file_size(path)
  local f = io.open(path, 'rb')
  if not f then return nil end
  local n = f:seek('end')
  f:close()
  return n
end

local function is_dir(path) return sh('test -d ' .. q(path)) end

local function write_atomic(path, s)
  local tmp = path .. '.tmp'
  local f, err = io.open(tmp, 'wb')
  if not f then fail('cannot write %s: %s', tmp, tostring(err)) end
  local ok, werr = f:write(s)
  local cok, cerr = f:close()
  if not ok or not cok then os.remove(tmp); fail('cannot write %s: %s', tmp, tostring(werr or cerr)) end
  local rok, rerr = os.rename(tmp, path)
  if not rok then os.remove(tmp); fail('cannot rename %s to %s: %s', tmp, path, tostring(rerr)) end
end

-- JSON with sorted keys (stable files)
local function encode(obj, compact) return require('moonshard.checkpoint').encode(obj, compact) end

local function read_json(path, what)
  local f, err = io.open(path, 'rb')
  if not f then return nil, err end
  local s = f:read('*a')
  f:close()
  local v, _, jerr = json.decode(s, 1, nil)
  if type(v) ~= 'table' then fail('%s is not valid JSON (%s)', path, tostring(jerr or what)) end
  return v
end

-- exchange two folders atomically where the kernel can (Linux renameat2
-- RENAME_EXCHANGE); else two renames, with the old one put back on failure
local renameat2
do
  pcall(ffi.cdef, 'int renameat2(int olddirfd, const char *oldpath, int newdirfd, const char *newpath, unsigned int flags);')
  local ok, fn = pcall(function() return ffi.C.renameat2 end)
  if ok then renameat2 = fn end
end
local AT_FDCWD, RENAME_EXCHANGE = -100, 2

-- put folder `tmp` in place of `dir` (which may not exist); the old
-- contents are removed afterwards
local function swap_in(tmp, dir)
  if is_dir(dir) then
    if renameat2 and renameat2(AT_FDCWD, tmp, AT_FDCWD, dir, RENAME_EXCHANGE) == 0 then
      sh('rm -rf ' .. q(tmp))
      return
    end
    local old = dir .. '.old'
    sh('rm -rf ' .. q(old))
    local ok, err = os.rename(dir, old)
    if not ok then fail('cannot move %s aside to %s: %s', dir, old, tostring(err)) end
    ok, err = os.rename(tmp, dir)
    if not ok then
      os.rename(old, dir)
      fail('cannot rename %s to %s: %s', tmp, dir, tostring(err))
    end
    sh('rm -rf ' .. q(old))
  else
    local ok, err = os.rename(tmp, dir)
    if not ok then fail('cannot rename %s to %s: %s', tmp, dir, tostring(err)) end
  end
end

-- the safetensors header of a file: entries by name, its metadata and the
-- absolute offset of the data section (cached per call through `cache`)
local function header_of(path, cache)
  local h = cache and cache[path]
  if h then return h end
  local entries, meta = S.header(path)
  local f = io.open(path, 'rb')
  if not f then fail('cannot open %s', path) end
  local b = f:read(8)
  f:close()
  local n = 0
  for i = 8, 1, -1 do n = n * 256 + b:byte(i) end
  h = { path = path, entries = entries, meta = meta, data_start = 8 + n }
  if cache then cache[path] = h end
  return h
end

local esize = { f64 = 8, f32 = 4, bf16 = 2, f16 = 2, i64 = 8, i32 = 4, u8 = 1, bool = 1 }

-- copy elements [off, off + n) of tensor entry `name` of the file into
-- dest (a 1-d tensor of n elements, any dtype: converted)
local function read_range(h, name, off, n, dest)
  local e = h.entries[name]
  if not e then fail('%s has no tensor %s', h.path, name) end
  local es = esize[e.dtype]
  local pos = h.data_start + e.data_offsets[1] + off * es
  if off + n > (e.data_offsets[2] - e.data_offsets[1]) / es then
    fail('%s: tensor %s has %d elements, asked for [%d, %d)', h.path, name,
      (e.data_offsets[2] - e.data_offsets[1]) / es, off, off + n)
  end
  if n == 0 then return end
  if dest.dtype == e.dtype and dest:is_contiguous() and dest.device_id < 0 then
    if C.ms_file_read_into(h.path, pos, n * es, dest) ~= 0 then
      fail('%s: tensor %s: %s', h.path, name, ffi.string(C.ms_last_error()))
    end
  else
    local tmp = T.empty({ n }, { dtype = e.dtype })
    if C.ms_file_read_into(h.path, pos, n * es, tmp) ~= 0 then
      tmp:free()
      fail('%s: tensor %s: %s', h.path, name, ffi.string(C.ms_last_error()))
    end
    dest:copy_(tmp)
    tmp:free()
  end
end

-- --------------------------------------------------------- the model side

local function fsdp_state(model) return type(model) == 'table' and rawget(model, '_fsdp') or nil end
M.is_sharded = function(model) return fsdp_state(model) ~= nil end

local function world()
  if dist.is_initialized() then return dist.rank(), dist.world_size() end
  return 0, 1
end

-- the model's parameters (named_parameters order, a tied tensor once):
-- list of { name =, shape =, dtype =, numel =, t =, wshape =, split = },
-- and id -> entry. shape, numel: what this rank holds; wshape: the whole
-- parameter's shape, split: where the rank's tensor lies in it (a
-- tensor-parallel slice, tp.boxes; nil: the whole)
local function model_params(model)
  local list, by_id = {}, {}
  local tpm = rawget(model, '_tp') and require('moonshard.tp')
  for name, p in model:named_parameters() do
    local id = tonumber(p.id)
    if not by_id[id] then
      local split = tpm and tpm.boxes(model, name, p.shape) or nil
      local e = { name = name, shape = p.shape, dtype = p.dtype, numel = p:numel(), t = p,
        wshape = split and split.shape or p.shape, split = split }
      list[#list + 1] = e
      by_id[id] = e
    end
  end
  return list, by_id
end

-- the persistent buffers (state_dict entries that are no parameter)
local function model_buffers(model, by_id)
  local sd, keys = model:state_dict()
  local out, seen = {}, {}
  for _, k in ipairs(keys) do
    local t = sd[k]
    local id = tonumber(t.id)
    if not by_id[id] and not seen[id] then
      seen[id] = true
      out[#out + 1] = { name = k, shape = t.shape, dtype = t.dtype, numel = t:numel(), t = t }
    end
  end
  return out
end

-- the parameter names of a unit, in the order of its flat parameter:
-- unit.param_names when fsdp gives them, else its views matched to
-- model:named_parameters() by tensor identity
local function unit_names(u, by_id)
  local fp = u.fp
  if type(u.param_names) == 'table' and #u.param_names == fp.nparams then return u.param_names end
  local views = u.views or fp.param_views
  local names = {}
  if views then
    for i = 1, fp.nparams do
      local e = views[i] and by_id[tonumber(views[i].id)]
      if not e then break end
      names[i] = e.name
    end
  end
  if #names ~= fp.nparams and u.slots then  -- fsdp's own bookkeeping (module, name, index)
    names = {}
    for _, s in ipairs(u.slots) do if s.k and not names[s.k] then names[s.k] = s.name end end
  end
  if #names ~= fp.nparams then
    fail('cannot name the %d parameters of unit %q (no param_names, views or slots match named_parameters())',
      fp.nparams, tostring(u.name))
  end
  return names
end

-- What the optimizer steps, per "holder" (a unit's master shard, or a
-- parameter of a plain model): a list of ranges { off =, n =, t = } of the
-- holder's elements, t the tensor the optimizer steps (the holder itself,
-- or a view of it: fsdp.AdamW steps a decay and a no-decay range of each
-- shard), sorted by off. Found by storage: any optimizer parameter that is
-- a contiguous view of a holder's storage is a range of it.
local function opt_ranges(opt, ctx)
  local by_storage = {}
  local holders = {}
  for _, r in ipairs(ctx.regions) do
    local h = r.holder
    local id = tonumber(h.id)
    if not holders[id] then
      holders[id] = { h = h, ranges = {} }
      local key = tostring(ffi.cast('void *', h.storage))
      by_storage[key] = by_storage[key] or {}
      table.insert(by_storage[key], holders[id])
    end
  end
  for _, g in ipairs(opt.param_groups or {}) do
    for _, p in ipairs(g.params) do
      for _, e in ipairs(by_storage[tostring(ffi.cast('void *', p.storage))] or {}) do
        local off = tonumber(p.offset) - tonumber(e.h.offset)
        local n = p:numel()
        if off >= 0 and off + n <= e.h:numel() and p:is_contiguous() then
          table.insert(e.ranges, { off = off, n = n, t = p })
        end
      end
    end
  end
  for _, e in pairs(holders) do table.sort(e.ranges, function(a, b) return a.off < b.off end) end
  return holders
end

-- the parts of a region [r.hoff, r.hoff + r.numel) of its holder that the
-- optimizer steps: list of { range =, a =, b = } (a, b: 0-based, in the
-- region); none for a frozen parameter; an error names the parameter when
-- some part of a trainable one is not stepped
local function region_ranges(map, r)
  if r.frozen then return {} end   -- requires_grad off: no optimizer state, none saved
  local e = map[tonumber(r.holder.id)]
  local out, at = {}, r.hoff
  for _, rg in ipairs(e and e.ranges or {}) do
    local a, b = math.max(at, rg.off), math.min(r.hoff + r.numel, rg.off + rg.n)
    if b > a then
      if a > at then break end
      out[#out + 1] = { range = rg, a = a - r.hoff, b = b - r.hoff }
      at = b
    end
  end
  if at < r.hoff + r.numel then
    fail('the optimizer does not step parameter %s (elements [%d, %d)); for a sharded model use ms.fsdp.AdamW(model)',
      r.name, r.start + at - r.hoff, r.start + r.numel)
  end
  return out
end

-- a 1-d view of elements [a, b) of a state tensor
local function flat_range(t, a, b) return t:view({ t:numel() }):narrow(1, a + 1, b - a) end

-- ------------------------------------------------------------ boxes
-- A piece of a parameter is an interval [start, start + numel) of the
-- row-major flattening of a box of it (offsets and sizes per dim); without
-- a box (nil: the whole parameter, version 1's pieces) an element range.
-- A region (below) is an element range of the tensor a rank holds: the
-- whole parameter, or a tensor-parallel slice (entry.split, tp.boxes),
-- whose every section is a box of the whole parameter: its "parts".

local function box_key(box)
  if not box then return '' end
  return table.concat(box.offsets, ',') .. '+' .. table.concat(box.sizes, ',')
end
local function whole_box(shape)
  local off, size = {}, {}
  for i = 1, #shape do off[i] = 0; size[i] = shape[i] end
  if #shape == 0 then off[1], size[1] = 0, 1 end   -- (a 0-dim parameter: one element)
  return { offsets = off, sizes = size }
end

-- the parts of elements [start, start + numel) of region r's tensor:
-- list of { box = (nil: the whole parameter), start =, numel = (an
-- interval of the box's flattening), at = (offset in the range: the part
-- is contiguous there) or moves = (the pieces of the range it is made of,
-- at most four: { at =, bo =, n = } runs, { at =, bo =, rows =, row =,
-- seg = } a block of `rows` runs of `seg` elements `row` apart; at: in
-- the range, bo: in the part) }
local function parts_of(r, start, numel)
  start, numel = start or r.start, numel or r.numel
  local sp = r.entry and r.entry.split
  if not sp then return numel > 0 and { { start = start, numel = numel, at = 0 } } or {} end
  local L, d = r.entry.shape, sp.dim
  local inner = 1
  for i = d + 1, #L do inner = inner * L[i] end
  local row = L[d] * inner           -- one index of the dims before d
  local a, b = start, start + numel
  local out = {}
  for _, g in ipairs(sp.segs) do
    local seg, lo = g.n * inner, g.l * inner   -- the section's run in each row, and where it starts
    local function before(x)   -- the section's elements at range positions < x
      local o = math.floor(x / row)
      return o * seg + math.max(0, math.min(seg, x - o * row - lo))
    end
    local sk, ek = before(a), before(b)
    if ek > sk then
      local box = whole_box(r.entry.wshape)
      box.offsets[d], box.sizes[d] = g.g, g.n
      local p = { box = box, start = sk, numel = ek - sk }
      -- the section's elements of row o, k-th of them <-> range position
      local function pos(k) local o = math.floor(k / seg); return o * row + lo + (k - o * seg) - a end
      local o1, o2 = math.floor(sk / seg), math.floor((ek - 1) / seg)
      if o1 == o2 then p.at = pos(sk)
      else
        local mv = {}
        local f1 = sk % seg == 0 and o1 or o1 + 1          -- the first full row
        local f2 = ek % seg == 0 and o2 + 1 or o2           -- after the last full row
        if f1 > o1 then mv[#mv + 1] = { at = pos(sk), bo = 0, n = (o1 + 1) * seg - sk } end
        -- the full rows but the last: a strided block from the section's
        -- first element of row f1 (rows of `row`, `seg` of each), which
        -- ends inside the range; the last full row a run
        if f2 - 1 > f1 then
          mv[#mv + 1] = { at = pos(f1 * seg), bo = f1 * seg - sk, rows = f2 - 1 - f1, row = row, seg = seg }
        end
        if f2 > f1 then mv[#mv + 1] = { at = pos((f2 - 1) * seg), bo = (f2 - 1) * seg - sk, n = seg } end
        if f2 <= o2 then mv[#mv + 1] = { at = pos(f2 * seg), bo = f2 * seg - sk, n = ek - f2 * seg } end
        p.moves = mv
      end
      out[#out + 1] = p
    end
  end
  return out
end

-- the views of one move: (of the region's 1-d tensor `flat`, of the part's
-- contiguous 1-d `buf`)
local function move_views(m, flat, buf)
  if not m.rows then return flat:narrow(1, m.at + 1, m.n), buf:narrow(1, m.bo + 1, m.n) end
  local fv = flat:narrow(1, m.at + 1, m.rows * m.row):view({ m.rows, m.row }):narrow(2, 1, m.seg)
  local bv = buf:narrow(1, m.bo + 1, m.rows * m.seg):view({ m.rows, m.seg })
  return fv, bv
end

-- part p's elements of `flat` as one contiguous tensor: a view, or a copy
-- (the second result: true) joined from its moves
local function part_gather(p, flat)
  if p.at then return flat:narrow(1, p.at + 1, p.numel), false end
  local buf = T.empty({ p.numel }, { dtype = flat.dtype, device = flat.device_id })
  for _, m in ipairs(p.moves) do
    local fv, bv = move_views(m, flat, buf)
    bv:copy_(fv)
  end
  return buf, true
end

-- the contiguous boxes of interval [s, e) of box B's flattening (at most
-- 2 N - 1 for N dims): list of { k = (its dim: a run of indices there,
-- one index of each dim before it, every index of the dims after it),
-- lo =, hi = (global index bounds, per dim), flat = (its first element's
-- place in B's flattening) }
local function runs_of(B, s, e)
  local N = #B.sizes
  local unit = {}
  unit[N] = 1
  for d = N - 1, 0, -1 do unit[d] = unit[d + 1] * B.sizes[d + 1] end
  local out = {}
  local function emit(k, at, c)
    local lo, hi = {}, {}
    for d = 1, N do
      local i = math.floor(at / unit[d]) % B.sizes[d]
      if d < k then lo[d], hi[d] = i, i + 1
      elseif d == k then lo[d], hi[d] = i, i + c
      else lo[d], hi[d] = 0, B.sizes[d] end
      lo[d], hi[d] = lo[d] + B.offsets[d], hi[d] + B.offsets[d]
    end
    out[#out + 1] = { k = k, lo = lo, hi = hi, flat = at }
  end
  local pos, k = s, N
  while k > 1 and pos < e do   -- up: to the boundaries of the coarser dims
    local up = unit[k - 1]
    if pos % up ~= 0 then
      local nb = (math.floor(pos / up) + 1) * up
      if nb > e then break end
      emit(k, pos, (nb - pos) / unit[k])
      pos = nb
    end
    k = k - 1
  end
  for kk = k, N do             -- down: whole runs of each dim, coarse to fine
    local c = math.floor((e - pos) / unit[kk])
    if c > 0 then emit(kk, pos, c); pos = pos + c * unit[kk] end
  end
  return out, unit
end

-- the strided view of box I (global bounds lo, hi) inside run R of box B,
-- over `t`: a 1-d tensor holding B's flattening from element `base`; the
-- view has one dim per dim of B from `k0` (<= R.k) on
local function run_view(t, base, B, unit, R, lo, hi, k0)
  local N = #B.sizes
  local k = R.k
  local first = R.flat + (lo[k] - R.lo[k]) * unit[k] - base
  local shape = { hi[k] - lo[k] }
  for d = k + 1, N do shape[#shape + 1] = B.sizes[d] end
  local v = t:narrow(1, first + 1, shape[1] * unit[k]):view(shape)
  for d = k + 1, N do
    if hi[d] - lo[d] ~= B.sizes[d] then v = v:narrow(d - k + 1, lo[d] - B.offsets[d] + 1, hi[d] - lo[d]) end
  end
  for _ = k0, k - 1 do v = v:unsqueeze(1) end
  return v
end

M._parts_of, M._runs_of = parts_of, runs_of   -- (specs)

-- This rank's part of the model, as "regions": each a range of elements of
-- one named parameter and where it lives here:
--   { name =, start =, numel =, dest = (1-d view, numel elements), holder = (the
--     tensor the optimizer steps), hoff = (offset of dest in holder, 0-based),
--     unit = }
-- plus `params` (every parameter of the model), the world, the strategy.
local regions_
local function regions(model)
  local ctx
  no_grad(function() ctx = regions_(model) end)
  return ctx
end
function regions_(model)
  local params, by_id = model_params(model)
  local st = fsdp_state(model)
  local ctx = { params = params, by_id = by_id, buffers = model_buffers(model, by_id), regions = {}, param = {} }
  for _, e in ipairs(params) do ctx.param[e.name] = e end
  -- an expert-parallel model: the experts other ranks hold (ms.ep)
  if rawget(model, '_ep_train') then ctx.remote = require('moonshard.ep').remote_names(model) end
  -- a pipeline stage (ms.pp): the other stages' parameters are held by
  -- other ranks, and the ranks of every stage write (pipeline_writes)
  local ppm = package.loaded['moonshard.pp']
  local pipe = ppm and ppm.of(model)
  if pipe then
    ctx.pipe = pipe
    ctx.remote = ctx.remote or {}
    for _, e in ipairs(pipe.names) do if not ctx.param[e[1]] then ctx.remote[e[1]] = true end end
  end
  if not st then
    ctx.rank, ctx.world_size, ctx.strategy, ctx.sharded = 0, 1, 'NONE', false
    -- a plain model is one process's: under mpirun only rank 0 writes
    ctx.skip_write = dist.is_initialized() and dist.rank() ~= 0
    if (pipe or rawget(model, '_tp') or rawget(model, '_ep_train')) and dist.is_initialized() then
      -- (a plain pipeline stage, tensor-parallel slices or experts: every
      -- rank takes part, one copy of each piece writes: owners)
      ctx.rank, ctx.world_size = world()
      ctx.skip_write, ctx.collective = false, true
    end
    for _, e in ipairs(params) do
      if not e.t:is_contiguous() then fail('parameter %s is not contiguous', e.name) end
      ctx.regions[#ctx.regions + 1] = { name = e.name, start = 0, numel = e.numel, entry = e,
        dest = e.t:view({ e.numel }), holder = e.t, hoff = 0, write = true, frozen = not e.t.requires_grad }
    end
    return ctx
  end
  ctx.rank, ctx.world_size = world()
  ctx.sharded, ctx.collective = true, true
  local units = fsdp().units(model)
  ctx.strategy = st.strategy or (units[1] and units[1].strategy) or 'FULL_SHARD'
  ctx.units = units
  for _, u in ipairs(units) do
    local fp = u.fp
    local names = unit_names(u, by_id)
    u._ckpt_names = names
    -- every region is a candidate: replicas (NO_SHARD, the replica groups
    -- of HYBRID_SHARD, the tensor-parallel ranks' copies of a replicated
    -- parameter's shard) hold the same pieces, and the lowest rank that
    -- holds a piece writes it (owners, at the save); tied weights:
    -- pipeline_writes
    for i = 1, fp.nparams do
      local sl = fp.layout:slice(fp.rank, i)
      if sl.numel > 0 then
        ctx.regions[#ctx.regions + 1] = { name = names[i], start = sl.param_start, numel = sl.numel,
          entry = ctx.param[names[i]], dest = fp.shard:narrow(1, sl.shard_offset + 1, sl.numel), holder = fp.shard,
          hoff = sl.shard_offset, unit = u, write = true, frozen = u.frozen and u.frozen[i] or false }
      end
    end
  end
  return ctx
end

-- a collective over small host tensors, run on the backend's device (NCCL
-- works on the rank's GPU, MPI on the CPU): fn gets the tensors there; the
-- results come back as host tables, one per tensor, and nothing is left
local function host_collective(fn, ...)
  local dev = dist.device()
  local hosts, devs = { ... }, {}
  for i, h in ipairs(hosts) do devs[i] = dev ~= 'cpu' and h:to(dev) or h end
  fn(unpack(devs))
  local out = {}
  for i, d in ipairs(devs) do
    local back = d ~= hosts[i] and d:to('cpu') or d
    out[i] = back:totable()
    if back ~= d then back:free() end
    if d ~= hosts[i] then d:free() end
    hosts[i]:free()
  end
  return unpack(out)
end

-- agree over the world on success: raises on every rank when any failed
-- (the failing rank with its own message)
local function agree(ctx, ok, err, what)
  if ctx.collective and ctx.world_size > 1 then
    local v = host_collective(function(t) dist.all_reduce(t, 'min') end, T.tensor({ ok and 1 or 0 }, { dtype = 'f32' }))
    local all = v[1] == 1
    if not all then
      if not ok then error(err, 0) end
      fail('%s failed on another rank (see its error)', what)
    end
  end
  if not ok then error(err, 0) end
end

-- which of a pipeline stage's ranks write what (ms.pp; a collective over
-- the world): a weight tied between the first and the last stage (GPT-2's
-- wte) is written by the first stage alone; without FSDP the data-parallel
-- copies of a stage hold the same tensors and the lowest rank of them
-- writes (under FSDP each rank writes its own shard, as regions_ says);
-- the persistent buffers are written by that rank of the stage whose
-- forwards update them (pp's buffer owners)
local function pipeline_writes(ctx)
  local pipe = ctx.pipe
  local lowest = true
  if ctx.world_size > 1 then
    local _, all = host_collective(function(mine, g) dist.all_gather_into(g, mine) end,
      T.tensor({ pipe.stage }, { dtype = 'f64' }), T.empty({ ctx.world_size }, { dtype = 'f64' }))
    for r = 0, ctx.rank - 1 do if all[r + 1] == pipe.stage then lowest = false; break end end
  end
  local tied = {}
  if not pipe.first then for _, e in ipairs(pipe.tied or {}) do tied[e[3]] = true end end
  -- (the stage's data-parallel copies: the lowest rank that holds a piece
  -- writes it, owners)
  for _, r in ipairs(ctx.regions) do
    if tied[r.name] then r.write = false end
  end
  local owner = {}
  for _, e in ipairs(pipe.buffers or {}) do owner[e[1]] = e[2] end
  ctx.buffer_writes = {}
  if lowest then
    for _, b in ipairs(ctx.buffers) do
      if (owner[b.name] or 0) == pipe.stage then ctx.buffer_writes[#ctx.buffer_writes + 1] = b end
    end
  end
end

-- owners(ctx, cands) -> set of the indices of `cands` (this rank's
-- candidate pieces: { r = region, p = part }) that it writes. A piece that
-- several ranks hold (data-parallel copies, HYBRID_SHARD's replicas, the
-- tensor-parallel ranks' copies of a replicated parameter, the expert
-- copies) is written by the lowest of them: every rank's pieces' keys
-- (parameter, box, interval) are all-gathered as pairs of hashes (a
-- collective over the world; nothing for one process). Rank 0 checks that
-- the pieces written cover every parameter exactly (the index, below).
local function key_hash(s)
  local a, b = 0, 0
  for i = 1, #s do
    local c = s:byte(i)
    a = (a * 131 + c) % 67108859
    b = (b * 257 + c) % 67108837
  end
  return a, b
end
local function owners(ctx, cands)
  local keep = {}
  for i = 1, #cands do keep[i] = true end
  if not (ctx.collective and ctx.world_size > 1) then return keep end
  local W = ctx.world_size
  local _, counts = host_collective(function(mine, g) dist.all_gather_into(g, mine) end,
    T.tensor({ #cands }, { dtype = 'f64' }), T.empty({ W }, { dtype = 'f64' }))
  local most = 1
  for r = 1, W do most = math.max(most, counts[r]) end
  local h = {}
  for i, c in ipairs(cands) do
    h[2 * i - 1], h[2 * i] = key_hash(c.r.name .. '|' .. box_key(c.p.box) .. '|' .. c.p.start .. '|' .. c.p.numel)
  end
  for i = 2 * #cands + 1, 2 * most do h[i] = -1 end
  local _, all = host_collective(function(mine, g) dist.all_gather_into(g, mine) end,
    T.tensor(h, { dtype = 'f64' }), T.empty({ 2 * most * W }, { dtype = 'f64' }))
  local lowest = {}
  for r = 0, W - 1 do
    for i = 1, counts[r + 1] do
      local k = all[r * 2 * most + 2 * i - 1] .. ':' .. all[r * 2 * most + 2 * i]
      if lowest[k] == nil then lowest[k] = r end
    end
  end
  for i = 1, #cands do keep[i] = lowest[h[2 * i - 1] .. ':' .. h[2 * i]] == ctx.rank end
  return keep
end

local function rank_file(r, W) return ('rank-%05d-of-%05d.safetensors'):format(r, W) end
M.rank_file = rank_file

local function hyper_of(opt)
  local groups = {}
  for i, g in ipairs(opt.param_groups or {}) do
    groups[i] = { lr = g.lr, betas = g.betas, eps = g.eps, weight_decay = g.weight_decay, momentum = g.momentum,
      dampening = g.dampening, nesterov = g.nesterov }
  end
  return { type = opt.type, groups = groups }
end

-- the per-element state tensors of the optimizer's kind, each saved as
-- '<field>:<name>:<start>' pieces: AdamW's two moments, SGD's momentum
-- buffer (none for SGD without momentum)
local function state_fields(opt)
  local g = opt.param_groups and opt.param_groups[1] or {}
  if g.betas ~= nil then return { 'exp_avg', 'exp_avg_sq' } end
  if g.momentum ~= nil then return (g.momentum or 0) ~= 0 and { 'momentum_buffer' } or {} end
  return { 'exp_avg', 'exp_avg_sq' }
end
-- whether state entry s holds every field
local function has_fields(s, fields)
  if not s then return false end
  for _, f in ipairs(fields) do if not s[f] then return false end end
  return true
end
M.state_fields = state_fields

-- ------------------------------------------------------------ sharded save

-- specs of bin/train's runs (which cannot set M._inject_failure):
-- MS_FSDP_CKPT_INJECT="stage[:rank[:text]]" injects a failure at `stage`
-- on `rank` (every rank without it) into the saves whose folder's path
-- holds `text` (every save without it). Stages: 'rank_file' (before the
-- rank's file is queued), 'disk' (the file lands on /dev/full: the
-- writer's thread fails, ENOSPC), 'after_rank_file', 'kill' (the rank is
-- killed by SIGKILL once its file is queued: a crash while the file is
-- being written), 'index' (rank 0, before index.json)
local function env_inject(dir)
  local e = os.getenv('MS_FSDP_CKPT_INJECT')
  if not e or e == '' then return nil end
  local stage, r, text = e:match('^([%w_]+):?(%d*):?(.*)$')
  if not stage then fail('MS_FSDP_CKPT_INJECT=%s: expected stage[:rank[:text]]', e) end
  if text ~= '' and not dir:find(text, 1, true) then return nil end
  return { stage = stage, rank = tonumber(r) }
end

-- save_sharded(model, dir, { optimizer =, step =, extra = }) -> dir
-- Collective. `extra`: a JSON-able table stored in index.json. `step`:
-- defaults to the optimizer's step count.
function M.save_sharded(model, dir, opts)
  opts = opts or {}
  if type(dir) ~= 'string' or dir == '' then fail('save_sharded: dir must be a folder path, got %s', tostring(dir)) end
  dir = dir:gsub('/+$', '')
  local ctx = regions(model)
  if ctx.pipe then pipeline_writes(ctx) end
  if ctx.skip_write then
    if opts.writer then return { ready = function() return true end, finish = function() return dir end } end
    return dir
  end
  -- the rank's file goes through a writer thread: the synchronous saves'
  -- (waited for below), or opts.writer's, whose pending save is returned
  local writer = opts.writer or require('moonshard.checkpoint').sync_writer()
  local stage = opts.writer ~= nil and opts.stage ~= false
  local opt = opts.optimizer
  local rank, W = ctx.rank, ctx.world_size
  local tmp = dir .. '.tmp'
  local inject = M._inject_failure or env_inject(dir)   -- specs: { stage =, rank = }
  local function injected(stage)
    if inject and inject.stage == stage and (inject.rank == nil or inject.rank == rank) then
      fail('injected failure at %s on rank %d', stage, rank)
    end
  end

  -- 1. rank 0 makes a clean <dir>.tmp/
  local ok, err = true, nil
  if rank == 0 then
    ok, err = pcall(function()
      if opts.extra ~= nil and type(opts.extra) ~= 'table' then fail('save_sharded: extra must be a table') end
      sh('rm -rf ' .. q(tmp))
      if not sh('mkdir -p ' .. q(tmp)) then fail('cannot create %s', tmp) end
    end)
  end
  agree(ctx, ok, err, 'save_sharded (creating ' .. tmp .. ')')

  -- 2. every rank writes its pieces: the parts of its regions (a
  -- tensor-parallel slice's sections are boxes of the parameter), each
  -- piece held by several ranks written by the lowest of them (owners)
  local path = tmp .. '/' .. rank_file(rank, W)
  local owned, job = {}, nil
  local hyper = opt and hyper_of(opt)   -- (now: a pending save completes steps later)
  local cands = {}
  -- (a parameter that tensor parallelism leaves whole: the first TP rank's
  -- copy, whose FSDP shards may lie elsewhere than the other TP ranks'
  -- when the slices before it in a unit differ: an uneven vocabulary)
  -- (an expert-parallel model's experts under --tp --ep: whole on one rank
  -- of the TP group, each TP rank holding its own; written by their ranks)
  local tpi = rawget(model, '_tp')
  local tp_first = not tpi or tpi.rank == 0
  local mine_ep = tpi and rawget(model, '_ep_train') and require('moonshard.ep').local_names(model) or {}
  ok, err = pcall(function()
    for _, r in ipairs(ctx.regions) do
      if r.write and (tp_first or (r.entry and r.entry.split) or mine_ep[r.name]) then
        for _, p in ipairs(parts_of(r)) do cands[#cands + 1] = { r = r, p = p } end
      end
    end
  end)
  -- (a collective: every rank takes part, also one that failed above)
  local keep = owners(ctx, ok and cands or {})
  if ok then ok, err = pcall(function()
    local omap = opt and opt_ranges(opt, ctx)
    local fields = opt and state_fields(opt) or {}
    local tensors, pieces = {}, {}
    local moments = {}   -- region -> { step =, [field] = its 1-d state } (nil: none to save)
    local function moments_of(r)
      local m = moments[r]
      if m then return m end
      m = { step = 0 }
      moments[r] = m
      -- the moments of the region: a view when one optimizer range holds
      -- it (the usual case), else a copy joined from several
      local parts = region_ranges(omap, r)
      local step, have = 0, #fields > 0
      for _, pt in ipairs(parts) do
        local st = opt.state and opt.state[tonumber(pt.range.t.id)]
        -- (SGD keeps no step count: a momentum buffer stands for one)
        if has_fields(st, fields) then step = math.max(step, st.step or 1) else have = false end
      end
      m.step = have and step or 0
      if have and step > 0 then
        for _, f in ipairs(fields) do
          local t
          if #parts == 1 then
            local pt = parts[1]
            local o = r.hoff + pt.a - pt.range.off
            t = flat_range(opt.state[tonumber(pt.range.t.id)][f], o, o + r.numel)
          else
            t = T.zeros({ r.numel }, { dtype = 'f32' })
            owned[#owned + 1] = t
            for _, pt in ipairs(parts) do
              local o = r.hoff + pt.a - pt.range.off
              t:narrow(1, pt.a + 1, pt.b - pt.a):copy_(flat_range(opt.state[tonumber(pt.range.t.id)][f], o, o + pt.b - pt.a))
            end
          end
          m[f] = t
        end
      end
      return m
    end
    local function put(t, made) if made then owned[#owned + 1] = t end; return t end
    for i, c in ipairs(cands) do
      if keep[i] then
        local r, p = c.r, c.p
        local key = r.name .. ':' .. (p.box and (table.concat(p.box.offsets, ',') .. ':') or '') .. p.start
        local pc = { param = r.name, start = p.start, numel = p.numel, tensor = 'param:' .. key, box = p.box }
        tensors[pc.tensor] = put(part_gather(p, r.dest))
        if opt then
          local m = moments_of(r)
          pc.step = m.step
          if m.step > 0 then
            for _, f in ipairs(fields) do
              pc[f] = f .. ':' .. key
              tensors[pc[f]] = put(part_gather(p, m[f]))
            end
          end
        end
        pieces[#pieces + 1] = pc
      end
    end
    if ctx.buffer_writes or rank == 0 then
      for _, b in ipairs(ctx.buffer_writes or ctx.buffers) do
        local pc = { param = b.name, start = 0, numel = b.numel, tensor = 'buffer:' .. b.name, buffer = true }
        tensors[pc.tensor] = b.t:contiguous():view({ b.numel })
        pieces[#pieces + 1] = pc
      end
    end
    local boxed = false
    for _, pc in ipairs(pieces) do if pc.box then boxed = true end end
    local desc = { format = M.format, version = boxed and 2 or 1, rank = rank, world_size = W,
      strategy = ctx.strategy, pieces = pieces, params = {} }
    for i, e in ipairs(ctx.params) do desc.params[i] = { name = e.name, shape = e.wshape, dtype = e.dtype } end
    injected('rank_file')
    if inject and inject.stage == 'disk' and (inject.rank == nil or inject.rank == rank) then
      sh('ln -s /dev/full ' .. q(path))   -- (specs: the writes fail in the writer's thread, ENOSPC)
    end
    -- (sorted keys: the same state gives the same bytes, synchronous or in
    -- the background, whatever order this process's tables iterate in)
    job = writer:safetensors(path, tensors, { ['moonshard.fsdp'] = encode(desc, true) }, stage)
    if inject and inject.stage == 'kill' and (inject.rank == nil or inject.rank == rank) then
      sh('kill -KILL $PPID')   -- (the shell's parent: this process)
    end
    injected('after_rank_file')
  end) end
  if stage or not ok then
    -- (staged: the copies are the writer's now; failed: nothing may read them)
    if not ok then pcall(writer.wait, writer) end
    for _, t in ipairs(owned) do t:free() end
    owned = {}
  end
  if not ok then os.remove(path) end

  -- the rest: once the file is written (at once, or at the pending save's finish)
  local function conclude()
    -- what every rank wrote: ok, bytes, crc32 (the all-gather is also the
    -- barrier after which rank 0 may write the index)
    local info = { 0, 0, 0 }
    if ok then
      pcall(writer.wait, writer)   -- (its report may be another save's: the job's own result decides)
      for _, t in ipairs(owned) do t:free() end
      local n, crc
      ok, n, crc = pcall(writer.result, writer, job)
      if ok then info = { 1, n, crc } else err = n; os.remove(path) end
    end
    local all = {}
    if ctx.collective and W > 1 then
      local _, v = host_collective(function(mine, g) dist.all_gather_into(g, mine) end,
        T.tensor(info, { dtype = 'f64' }), T.empty({ 3 * W }, { dtype = 'f64' }))
      for r = 0, W - 1 do all[r] = { v[3 * r + 1], v[3 * r + 2], v[3 * r + 3] } end
    else
      all[0] = info
    end
    local failed = {}
    for r = 0, W - 1 do if all[r][1] ~= 1 then failed[#failed + 1] = r end end
    if #failed > 0 then
      if rank == 0 then sh('rm -rf ' .. q(tmp)) end
      if not ok then error(err, 0) end
      fail('save_sharded %s: rank(s) %s could not write their files (see their errors); %s is unchanged', dir,
        table.concat(failed, ', '), dir)
    end

    -- 3. rank 0 writes the index, then swaps <dir>.tmp in
    ok, err = true, nil
    if rank == 0 then
      ok, err = pcall(function()
        local index = { format = M.format, version = 1, world_size = W, strategy = ctx.strategy,
          extra = opts.extra, params = {}, buffers = {}, files = {}, pieces = {} }
        for i, e in ipairs(ctx.params) do
          index.params[i] = { name = e.name, shape = e.wshape, dtype = e.dtype, numel = numel_of(e.wshape) }
        end
        local listed = {}
        for _, e in ipairs(index.params) do listed[e.name] = true end
        for i, b in ipairs(ctx.buffers) do index.buffers[i] = { name = b.name, shape = b.shape, dtype = b.dtype } end
        local max_step = 0
        for r = 0, W - 1 do
          local name = rank_file(r, W)
          index.files[r + 1] = { rank = r, file = name, bytes = all[r][2], crc32 = all[r][3] }
          local h = header_of(tmp .. '/' .. name)
          local desc = json.decode(h.meta['moonshard.fsdp'] or 'null', 1, nil)
          if type(desc) ~= 'table' then fail('%s/%s has no moonshard.fsdp description', tmp, name) end
          -- parameters rank 0 does not hold (an expert-parallel model's other
          -- experts, ms.ep): listed after the one before them in this rank's
          -- order and after those lower ranks put there (lower experts), so
          -- the index keeps the whole model's order
          -- (one merge pass a rank: both lists are in the model's order)
          local mine, pos = {}, {}
          for _, e in ipairs(desc.params or {}) do mine[e.name] = true end
          for i, x in ipairs(index.params) do pos[x.name] = i end
          local old, merged, j = index.params, {}, 1
          for _, e in ipairs(desc.params or {}) do
            if listed[e.name] then
              local at = pos[e.name]
              while at and j <= at do merged[#merged + 1] = old[j]; j = j + 1 end
            else
              listed[e.name] = true
              while old[j] and not mine[old[j].name] do merged[#merged + 1] = old[j]; j = j + 1 end
              merged[#merged + 1] = { name = e.name, shape = e.shape, dtype = e.dtype, numel = numel_of(e.shape) }
            end
          end
          while old[j] do merged[#merged + 1] = old[j]; j = j + 1 end
          index.params = merged
          for _, pc in ipairs(desc.pieces) do
            local list = index.pieces[pc.param]
            if not list then list = {}; index.pieces[pc.param] = list end
            list[#list + 1] = { rank = r, start = pc.start, numel = pc.numel, tensor = pc.tensor, box = pc.box,
              exp_avg = pc.exp_avg, exp_avg_sq = pc.exp_avg_sq, momentum_buffer = pc.momentum_buffer, step = pc.step }
            if pc.step and pc.step > max_step then max_step = pc.step end
            if pc.box then index.version = 2 end
          end
        end
        -- sorted by box (none first), then start
        for _, list in pairs(index.pieces) do
          table.sort(list, function(a, b)
            local ka, kb = box_key(a.box), box_key(b.box)
            if ka ~= kb then return ka < kb end
            return a.start < b.start
          end)
        end
        -- every parameter's pieces hold each of its elements once (the
        -- owners' choice, checked)
        for _, e in ipairs(index.params) do
          local n = 0
          for _, pc in ipairs(index.pieces[e.name] or {}) do n = n + pc.numel end
          if n ~= e.numel then
            fail('save_sharded %s: the ranks\' pieces of parameter %s %s hold %d elements, the parameter %d (a layout '
              .. 'this save does not handle); %s is unchanged', dir, e.name, shape_str(e.shape), n, e.numel, dir)
          end
        end
        if opt then index.optimizer = hyper; index.optimizer.step = max_step end
        index.step = opts.step or (opt and max_step) or nil
        injected('index')
        local s = encode(index)
        write_atomic(tmp .. '/' .. M.index_name, s .. '\n')
        sh('sync -f ' .. q(tmp) .. ' 2>/dev/null')
        swap_in(tmp, dir)
      end)
      if not ok then sh('rm -rf ' .. q(tmp)) end
    end
    agree(ctx, ok, err, 'save_sharded (index of ' .. dir .. ')')
    return dir
  end

  if not opts.writer then return conclude() end
  -- a pending save: p:ready() (this rank's file is written), p:finish()
  -- (collective: every rank calls it, at the same point of its work)
  local done
  return {
    ready = function() return writer:idle() end,
    finish = function()
      done = done or conclude()
      return done
    end,
  }
end

-- ------------------------------------------------------------ sharded load

-- read_index(dir) -> the index table, or raises naming what is wrong
function M.read_index(dir)
  local path = dir .. '/' .. M.index_name
  local index, err = read_json(path)
  if not index then
    if not is_dir(dir) then fail('%s: no such checkpoint folder', dir) end
    fail('%s is missing: %s is incomplete (a save that did not finish?) or not a sharded checkpoint%s',
      path, dir, is_dir(dir .. '.tmp') and (' (an unfinished save is in ' .. dir .. '.tmp)') or '')
  end
  if index.format ~= M.format then fail('%s: format %s, expected %s', path, tostring(index.format), M.format) end
  if type(index.version) ~= 'number' or index.version > M.version then
    fail('%s: version %s, this moonshard reads up to %d', path, tostring(index.version), M.version)
  end
  return index
end

-- check the checkpoint's parameters against the model's: every model
-- parameter present with its shape (and, strict, nothing else)
local function check_params(ctx, saved, where, strict)
  local have = {}
  for _, e in ipairs(saved) do have[e.name] = e end
  local used = {}
  for _, e in ipairs(ctx.params) do
    local s = have[e.name]
    -- (a tensor-parallel slice: the whole parameter's shape)
    if not s then fail('%s has no parameter %s (shape %s in the model)', where, e.name, shape_str(e.wshape)) end
    if not same_shape(s.shape, e.wshape) then
      fail('parameter %s has shape %s in %s, %s in the model', e.name, shape_str(s.shape), where, shape_str(e.wshape))
    end
    used[e.name] = true
  end
  if strict then
    for _, s in ipairs(saved) do
      if not used[s.name] and not (ctx.remote and ctx.remote[s.name]) then
        fail('%s has parameter %s %s, which the model does not have (strict = false ignores it)', where, s.name,
          shape_str(s.shape))
      end
    end
  end
end

-- the pieces of a parameter that have the box `key` (box_key) and the
-- others
local function by_box(pieces, key)
  local same, other = {}, {}
  for _, pc in ipairs(pieces or {}) do
    if box_key(pc.box) == key then same[#same + 1] = pc else other[#other + 1] = pc end
  end
  return same, other
end

-- the intersection of two runs (runs_of): lo, hi and its element count
local function meet_runs(R, Q)
  local lo, hi, n = {}, {}, 1
  for d = 1, #R.lo do
    lo[d], hi[d] = math.max(R.lo[d], Q.lo[d]), math.min(R.hi[d], Q.hi[d])
    if hi[d] <= lo[d] then return nil end
    n = n * (hi[d] - lo[d])
  end
  return lo, hi, n
end

local READ_MAX = 16777216   -- elements a read of a piece's part of another box brings in at most (chunked beyond)

-- fill dest (1-d, contiguous: part p = { box =, start =, numel = } of
-- parameter `name`, whole shape `wshape`) from the pieces that overlap it;
-- `field`: 'tensor' or a state field ('exp_avg', 'exp_avg_sq',
-- 'momentum_buffer'). A piece of the same box is an element range: the
-- overlap is read into dest (a seek and a read). One of another box (a
-- whole parameter saved by FSDP or one process, loaded into a
-- tensor-parallel slice; another tensor-parallel size): both intervals are
-- cut into contiguous runs (runs_of), and each pair's intersection is read
-- as whole rows of the saved run (contiguous in the file, READ_MAX
-- elements at most a read) and copied, strided, into place.
local function fill_part(dest, name, wshape, p, pieces, open, field, where)
  local key = box_key(p.box)
  local same, other = by_box(pieces, key)
  local a0, a1 = p.start, p.start + p.numel
  local function tensor_of(pc)
    local tname = pc[field]
    if not tname then
      fail('%s has no %s for parameter %s (elements [%d, %d)%s)', where, field, name, pc.start, pc.start + pc.numel,
        pc.box and (' of box ' .. box_key(pc.box)) or '')
    end
    return tname
  end
  if #other == 0 then
    local covered = a0
    for _, pc in ipairs(same) do
      local a, b = math.max(a0, pc.start), math.min(a1, pc.start + pc.numel)
      if b > a then
        if a > covered then break end
        read_range(open(pc), tensor_of(pc), a - pc.start, b - a, dest:narrow(1, a - a0 + 1, b - a))
        if b > covered then covered = b end
      end
    end
    if covered < a1 then
      fail('%s holds no data for parameter %s elements [%d, %d)%s', where, name, covered, a1,
        p.box and (' of box ' .. key) or '')
    end
    return
  end
  -- (a device tensor is filled through a host copy: strided copies there)
  local work = dest
  if dest.device_id >= 0 then work = T.empty({ p.numel }, { dtype = dest.dtype }) end
  local n = 0
  for _, pc in ipairs(same) do
    local a, b = math.max(a0, pc.start), math.min(a1, pc.start + pc.numel)
    if b > a then
      read_range(open(pc), tensor_of(pc), a - pc.start, b - a, work:narrow(1, a - a0 + 1, b - a))
      n = n + (b - a)
    end
  end
  local B = p.box or whole_box(wshape)
  local truns, tunit = runs_of(B, a0, a1)
  for _, pc in ipairs(other) do
    local PB = pc.box or whole_box(wshape)
    local sruns, sunit = runs_of(PB, pc.start, pc.start + pc.numel)
    for _, R in ipairs(truns) do
      for _, Q in ipairs(sruns) do
        local lo, hi = meet_runs(R, Q)
        if lo then
          local h, tname = open(pc), tensor_of(pc)
          local e = h.entries[tname]
          if not e then fail('%s has no tensor %s', h.path, tname) end
          local k = Q.k
          local per = math.max(1, math.floor(READ_MAX / sunit[k]))
          local k0 = math.min(R.k, k)
          for r0 = lo[k], hi[k] - 1, per do
            local r1 = math.min(hi[k], r0 + per)
            local clo, chi = {}, {}
            for d = 1, #lo do clo[d], chi[d] = lo[d], hi[d] end
            clo[k], chi[k] = r0, r1
            local off = Q.flat + (r0 - Q.lo[k]) * sunit[k]   -- (in the saved box's flattening)
            local cnt = (r1 - r0) * sunit[k]
            local tmp = T.empty({ cnt }, { dtype = e.dtype })
            local okr, rerr = pcall(read_range, h, tname, off - pc.start, cnt, tmp)
            if not okr then tmp:free(); error(rerr, 0) end
            local sv = run_view(tmp, off, PB, sunit, Q, clo, chi, k0)
            local dv = run_view(work, a0, B, tunit, R, clo, chi, k0)
            dv:copy_(sv)
            tmp:free()
            local c = 1
            for d = 1, #clo do c = c * (chi[d] - clo[d]) end
            n = n + c
          end
        end
      end
    end
  end
  if work ~= dest then
    if n == p.numel then dest:copy_(work) end
    work:free()
  end
  if n ~= p.numel then
    fail('%s holds %s for parameter %s: %d of the %d elements [%d, %d) of %s', where,
      n < p.numel and 'no data' or 'overlapping pieces', name, n, p.numel, a0, a1,
      p.box and ('box ' .. key) or 'the parameter')
  end
end

-- fill the elements [start, start + numel) of region r's tensor held by
-- `flat` (1-d, those elements) from `pieces`: part by part (parts_of), a
-- part that is not contiguous in flat filled in a buffer and spread
local function fill_region(flat, r, start, numel, pieces, open, field, where)
  local wshape = r.entry and r.entry.wshape or { r.numel }
  for _, p in ipairs(parts_of(r, start, numel)) do
    if p.at then
      fill_part(flat:narrow(1, p.at + 1, p.numel), r.name, wshape, p, pieces, open, field, where)
    else
      local buf = T.empty({ p.numel }, { dtype = flat.dtype, device = flat.device_id })
      local ok, err = pcall(fill_part, buf, r.name, wshape, p, pieces, open, field, where)
      if ok then
        for _, m in ipairs(p.moves) do
          local fv, bv = move_views(m, flat, buf)
          fv:copy_(bv)
        end
      end
      buf:free()
      if not ok then error(err, 0) end
    end
  end
end

-- the pieces among `pieces` that hold some of elements [start, start +
-- numel) of region r's tensor
local function pieces_meeting(r, start, numel, pieces)
  local out, seen = {}, {}
  local wshape = r.entry and r.entry.wshape or { r.numel }
  for _, p in ipairs(parts_of(r, start, numel)) do
    local key = box_key(p.box)
    local truns
    for _, pc in ipairs(pieces or {}) do
      if not seen[pc] then
        local hit = false
        if box_key(pc.box) == key then
          hit = pc.start < p.start + p.numel and pc.start + pc.numel > p.start
        else
          truns = truns or runs_of(p.box or whole_box(wshape), p.start, p.start + p.numel)
          for _, Q in ipairs(runs_of(pc.box or whole_box(wshape), pc.start, pc.start + pc.numel)) do
            for _, R in ipairs(truns) do if meet_runs(R, Q) then hit = true; break end end
            if hit then break end
          end
        end
        if hit then seen[pc] = true; out[#out + 1] = pc end
      end
    end
  end
  return out
end

-- the state of one optimizer range (its fields created zero when it never
-- stepped)
local function range_state(opt, rg, fields)
  local id = tonumber(rg.t.id)
  local s = opt.state[id]
  if not has_fields(s, fields) then
    local dt = rg.t.dtype == 'f64' and 'f64' or 'f32'
    s = s or {}
    s.step = s.step or 0
    for _, f in ipairs(fields) do
      if not s[f] then s[f] = T.zeros(rg.t.shape, { dtype = dt, device = rg.t.device_id }) end
    end
    opt.state[id] = s
  end
  return s
end

-- the moments of a whole holder (fresh tensors shaped like it, zero where
-- the optimizer has no state) and the largest step; nil when none at all
local function holder_state(opt, map, h)
  local e = map[tonumber(h.id)]
  local ea, eq, step, any
  for _, rg in ipairs(e and e.ranges or {}) do
    local s = opt.state and opt.state[tonumber(rg.t.id)]
    if s and s.exp_avg and s.exp_avg_sq then
      if not any then
        any = true
        ea = T.zeros({ h:numel() }, { dtype = s.exp_avg.dtype, device = s.exp_avg.device_id })
        eq = T.zeros({ h:numel() }, { dtype = s.exp_avg_sq.dtype, device = s.exp_avg_sq.device_id })
        step = 0
      end
      ea:narrow(1, rg.off + 1, rg.n):copy_(flat_range(s.exp_avg, 0, rg.n))
      eq:narrow(1, rg.off + 1, rg.n):copy_(flat_range(s.exp_avg_sq, 0, rg.n))
      step = math.max(step, s.step or 0)
    end
  end
  if not any then return nil end
  return ea, eq, step
end

-- after the shards changed, as after an optimizer step: the low-precision
-- copies are refreshed and every unsharded copy is stale (the next forward
-- all-gathers the loaded values)
local function refresh(model, ctx)
  if not ctx.sharded then return end
  local f = fsdp()
  if f.after_step then f.after_step(model)
  else
    for _, u in ipairs(ctx.units) do if u.reshard then u:reshard() end end
    f.unshard(model)
  end
end

local function apply_hyper(opt, saved)
  if not saved or type(saved.groups) ~= 'table' or #saved.groups ~= #(opt.param_groups or {}) then return end
  for i, g in ipairs(opt.param_groups) do
    for k, v in pairs(saved.groups[i]) do g[k] = v end
  end
end

-- load_sharded(model, dir, { optimizer =, strict = true, verify = false })
-- -> { step =, extra =, world_size =, strategy = } (the index's).
-- Collective. strict: a parameter of the checkpoint that the model lacks is
-- an error; verify: compare the CRC-32 of the files read with the index's.
function M.load_sharded(model, dir, opts)
  opts = opts or {}
  if type(dir) ~= 'string' then fail('load_sharded: dir must be a folder path, got %s', tostring(dir)) end
  dir = dir:gsub('/+$', '')
  local ctx = regions(model)
  local opt = opts.optimizer
  local ok, res = pcall(function()
    local index = M.read_index(dir)
    check_params(ctx, index.params or {}, dir, opts.strict ~= false)
    -- every rank file there, with the size the index gives
    local files = {}
    for r = 0, index.world_size - 1 do
      local f = index.files[r + 1]
      local path = dir .. '/' .. (f and f.file or rank_file(r, index.world_size))
      local n = file_size(path)
      if not n then fail('%s is missing (the file of rank %d of the %d that saved %s)', path, r, index.world_size, dir) end
      if f and f.bytes and n ~= f.bytes then
        fail('%s has %d bytes, the index says %d (truncated?)', path, n, f.bytes)
      end
      files[r] = path
    end
    -- verify: the CRC-32 of the files this rank reads (rank 0: all of them)
    if opts.verify then
      local need = {}
      if ctx.rank == 0 then for r = 0, index.world_size - 1 do need[r] = true end end
      for _, r in ipairs(ctx.regions) do
        for _, pc in ipairs(pieces_meeting(r, r.start, r.numel, index.pieces[r.name])) do need[pc.rank] = true end
      end
      for rk in pairs(need) do
        local f = index.files[rk + 1]
        local crc = crc32_file(files[rk])
        if f and f.crc32 and crc ~= f.crc32 then
          fail('%s: checksum mismatch (crc32 %08x, the index says %08x)', files[rk], crc, f.crc32)
        end
      end
    end
    if opt and not index.optimizer then fail('%s holds no optimizer state (saved without one)', dir) end
    local cache = {}
    local function open(pc) return header_of(files[pc.rank], cache) end
    no_grad(function()
      local F = require 'moonshard.ops'
      for _, u in ipairs(ctx.units or {}) do F.fill_(u.fp.shard, 0) end   -- padding stays zero
      for _, r in ipairs(ctx.regions) do
        fill_region(r.dest, r, r.start, r.numel, index.pieces[r.name], open, 'tensor', dir)
      end
      for _, b in ipairs(ctx.buffers) do
        local pcs = index.pieces[b.name]
        if pcs then
          local tmp = T.empty({ b.numel }, { dtype = b.dtype })
          fill_part(tmp, b.name, b.shape, { start = 0, numel = b.numel }, pcs, open, 'tensor', dir)
          b.t:copy_(tmp:view(b.shape))
          tmp:free()
        elseif opts.strict ~= false then
          fail('%s has no buffer %s', dir, b.name)
        end
      end
      if opt then
        local omap = opt_ranges(opt, ctx)
        local fields = state_fields(opt)
        local seen = {}
        for _, r in ipairs(ctx.regions) do
          local pcs = index.pieces[r.name]
          if r.numel == 0 and not r.frozen then
            -- (a parameter this rank holds none of: a vocabulary's last
            -- TP ranks; its empty state made, with the saved step, as a step
            -- would have made it)
            local e = omap[tonumber(r.holder.id)]
            for _, rg in ipairs(e and e.ranges or {}) do
              if rg.n == 0 then range_state(opt, rg, fields).step = index.optimizer.step or 0 end
            end
          end
          for _, pt in ipairs(region_ranges(omap, r)) do
            local s = range_state(opt, pt.range, fields)
            local id = tonumber(pt.range.t.id)
            if not seen[id] then
              seen[id] = true
              for _, f in ipairs(fields) do F.fill_(s[f], 0) end
              s.step = 0
            end
            -- parameter elements [p0, p1) <-> range elements [o, o + p1 - p0)
            local p0, p1 = r.start + pt.a, r.start + pt.b
            local o = r.hoff + pt.a - pt.range.off
            local step = 0
            for _, pc in ipairs(pieces_meeting(r, p0, p1 - p0, pcs)) do step = math.max(step, pc.step or 0) end
            if step > 0 then
              for _, f in ipairs(fields) do
                fill_region(flat_range(s[f], o, o + p1 - p0), r, p0, p1 - p0, pcs, open, f, dir)
              end
            end
            s.step = math.max(s.step, step)
          end
        end
        apply_hyper(opt, index.optimizer)
      end
    end)
    return index
  end)
  agree(ctx, ok, res, 'load_sharded ' .. dir)
  local index = res
  refresh(model, ctx)
  return { step = index.step, extra = index.extra, world_size = index.world_size, strategy = index.strategy }
end

-- tag_groups(layout, saved) -> saved's groups (a one-process optimizer
-- state's meta.groups), copied, each with .decay: whether it is the
-- decayed group, read from `layout` (optim.build_groups(model, {}, true)
-- of the model that saved them: the no-decay group is the one with
-- weight_decay = 0)
function M.tag_groups(layout, saved)
  local r = {}
  for gi, g in ipairs(layout) do
    local mg = {}
    for k, v in pairs(saved and saved[gi] or {}) do mg[k] = v end
    mg.decay = g.weight_decay ~= 0
    r[gi] = mg
  end
  return r
end

-- load_moments(model, opt, by_name, groups, piece): AdamW moments of whole
-- parameters into fsdp.AdamW `opt` (its pieces of the units' shards):
-- by_name[name] = { exp_avg =, exp_avg_sq =, step = } (tensors in the
-- parameter's shape, or pieces of it: piece(name, t) -> the model's own
-- piece of t (a tensor-parallel slice) and whether it is new; default t
-- itself). A shard piece gets the moments of the elements it holds (the
-- padding zeros) and the largest step among them; `groups` (a one-process
-- optimizer state's meta.groups, each with .decay = whether it is the
-- decayed parameters' group) sets the lr, betas, eps and weight decay of
-- fsdp.AdamW's group of the same kind. Not a collective.
function M.load_moments(model, opt, by_name, groups, piece)
  if fsdp_state(model) == nil then fail('load_moments: the model is not under fully_shard') end
  if type(opt) ~= 'table' or type(opt.fsdp_pieces) ~= 'table' then fail('load_moments: opt is not an fsdp optimizer') end
  local optim = require 'moonshard.optim'
  no_grad(function()
    local sliced = {}
    for name, e in pairs(by_name) do
      local ea, made = e.exp_avg, false
      local eq = e.exp_avg_sq
      if piece then ea, made = piece(name, ea); eq = piece(name, eq) end
      sliced[name] = { ea = ea, eq = eq, step = e.step, made = made }
    end
    for _, pc in ipairs(opt.fsdp_pieces) do
      local u, fp = pc.unit, pc.unit.fp
      local a0 = fp.rank * fp.shard_numel + pc.off   -- the piece's first flat element
      local ea, eq, step = nil, nil, nil
      for k = 1, fp.nparams do
        local s = sliced[u.param_names[k]]
        local o, n = fp.layout.offsets[k], fp.layout.numels[k]
        local lo, hi = math.max(o, a0), math.min(o + n, a0 + pc.n)
        if s and hi > lo then
          if s.ea:numel() ~= n then
            fail('load_moments: %s\'s moments have %d elements, the parameter %d', u.param_names[k], s.ea:numel(), n)
          end
          if ea == nil then
            local dt = optim.state_dtype(pc.p)
            ea = T.zeros({ pc.n }, { dtype = dt, device = pc.p.device })
            eq = T.zeros({ pc.n }, { dtype = dt, device = pc.p.device })
          end
          local function put(dst, src)
            local c = src:is_contiguous() and src or src:contiguous()
            local flat = c:view({ c:numel() })
            T.raw_copy_(dst:narrow(1, lo - a0 + 1, hi - lo), flat:narrow(1, lo - o + 1, hi - lo))
          end
          put(ea, s.ea); put(eq, s.eq)
          step = math.max(step or 0, s.step or 0)
        end
      end
      local id = tonumber(pc.p.id)
      local old = opt.state[id]
      if old then for _, v in pairs(old) do if T.is_tensor(v) then v:free() end end end
      opt.state[id] = ea and { exp_avg = ea, exp_avg_sq = eq, step = step } or nil
    end
    for _, s in pairs(sliced) do if s.made then s.ea:free(); s.eq:free() end end
  end)
  -- the hyper-parameters of the saved group of the same kind (decayed or
  -- not: groups[i].decay) for each group
  local kinds = rawget(opt, 'fsdp_group_decays') or {}
  for gi, g in ipairs(opt.param_groups) do
    for _, mg in ipairs(groups or {}) do
      if mg.decay == (kinds[gi] ~= false) then
        for _, k in ipairs({ 'lr', 'betas', 'eps', 'weight_decay' }) do if mg[k] ~= nil then g[k] = mg[k] end end
        break
      end
    end
  end
  return opt
end

-- ------------------------------------------------------------ full state

local function gather_flat(fp, src)
  local flat = T.empty({ fp.total }, { dtype = src.dtype, device = src.device_id })   -- NCCL: on the GPU
  if fp.world_size == 1 then flat:copy_(src)
  else dist.all_gather_into(flat, src, { group = fp.group }) end
  return flat
end

-- gather(model, { optimizer = }) -> params, state. Collective. params: a
-- list of { name =, tensor = } (the model's named_parameters order, a tied
-- tensor once, full shapes, the master dtype), every rank; state (with an
-- optimizer): name -> { exp_avg =, exp_avg_sq =, step = }.
function M.gather(model, opts)
  opts = opts or {}
  local ctx = regions(model)
  local opt = opts.optimizer
  if opt and state_fields(opt)[1] ~= 'exp_avg' then
    error(('fsdp_checkpoint.gather: the optimizer state gathered whole is AdamW\'s (exp_avg, exp_avg_sq); this '
      .. 'optimizer keeps %s (save_sharded / load_sharded take it)'):format(
      #state_fields(opt) > 0 and table.concat(state_fields(opt), ', ') or 'none'), 2)
  end
  local out, state = {}, opt and {} or nil
  local full = {}
  no_grad(function()
    local omap = opt and opt_ranges(opt, ctx)
    if not ctx.sharded then
      for _, e in ipairs(ctx.params) do
        full[e.name] = e.t:clone()
        if opt then
          local ea, eq, step = holder_state(opt, omap, e.t)
          if ea then state[e.name] = { exp_avg = ea:view(e.shape), exp_avg_sq = eq:view(e.shape), step = step } end
        end
      end
    else
      for _, u in ipairs(ctx.units) do
        local fp = u.fp
        local names = u._ckpt_names
        local flat = gather_flat(fp, fp.shard)
        local fa, fq, step
        if opt then
          -- collective: every rank gathers, also one whose shard never stepped
          local ea, eq
          ea, eq, step = holder_state(opt, omap, fp.shard)
          local has, st = { ea and 1 or 0 }, { step or 0 }
          if fp.world_size > 1 then
            has, st = host_collective(function(h, s)
              dist.all_reduce(h, 'max', { group = fp.group })
              dist.all_reduce(s, 'max', { group = fp.group })
            end, T.tensor(has, { dtype = 'f32' }), T.tensor(st, { dtype = 'f64' }))
          end
          if has[1] == 1 then
            ea = ea or T.zeros({ fp.shard:numel() }, { dtype = 'f32', device = fp.shard.device_id })
            eq = eq or T.zeros({ fp.shard:numel() }, { dtype = 'f32', device = fp.shard.device_id })
            fa, fq, step = gather_flat(fp, ea), gather_flat(fp, eq), st[1]
          end
          if ea then ea:free(); eq:free() end
        end
        for i = 1, fp.nparams do
          local function piece(f)
            return f:narrow(1, fp.layout.offsets[i] + 1, fp.layout.numels[i]):clone():view(ctx.param[names[i]].shape)
          end
          full[names[i]] = piece(flat)
          if fa then state[names[i]] = { exp_avg = piece(fa), exp_avg_sq = piece(fq), step = step } end
        end
        flat:free()
        if fa then fa:free(); fq:free() end
      end
    end
  end)
  for _, e in ipairs(ctx.params) do out[#out + 1] = { name = e.name, tensor = full[e.name] } end
  return out, state, ctx
end

-- save_full(model, path, { dtype = }) -> path. Collective: every unit is
-- all-gathered (f32 master values), rank 0 writes one safetensors file
-- with the model's names (those of the Hugging Face checkpoints: the
-- state_dict names, a tied tensor once under its first name, metadata
-- format = pt), then a barrier. dtype: converts on the way (default: the
-- master dtype, f32).
-- A sharded model's is streamed: each unit is all-gathered in turn and
-- rank 0 hands its tensors to a safetensors stream (S.stream) as host
-- copies, so a rank holds one unit's gathered parameters at a time, not
-- the model's (the file lists them unit by unit). LoRA adapters to merge
-- need the whole model: gathered first, as for a plain model.
-- An expert-parallel model's expert unit (ms.ep) goes in as every expert
-- of its layer: the unit gathered over the experts' copies, then the
-- experts over the group (ep.gather_experts).
local function save_full_streamed(model, path, opts, ctx)
  local ep = rawget(model, '_ep_train') and require('moonshard.ep')
  local entries = {}
  for _, u in ipairs(ctx.units) do
    local fp = u.fp
    local lay = ep and u.experts and ep.layer_of(model, u.module)
    if lay then
      for _, name in ipairs(lay.names) do
        entries[#entries + 1] = { name = name, shape = lay.shapes[name], dtype = opts.dtype or fp.shard.dtype }
      end
    else
      for i = 1, fp.nparams do
        local name = u._ckpt_names[i]
        entries[#entries + 1] = { name = name, shape = ctx.param[name].shape, dtype = opts.dtype or fp.shard.dtype }
      end
    end
  end
  for _, b in ipairs(ctx.buffers) do entries[#entries + 1] = { name = b.name, shape = b.shape, dtype = b.dtype } end
  local writes = ctx.rank == 0
  local st
  local ok, err = true, nil
  if writes then ok, err = pcall(function() st = S.stream(path, entries, { format = 'pt' }) end) end
  -- (every rank gathers every unit, whatever rank 0's stream does: the
  -- collectives stay matched; rank 0's failure is agreed on at the end)
  no_grad(function()
    for _, u in ipairs(ctx.units) do
      local fp = u.fp
      local flat = gather_flat(fp, fp.shard)
      local lay = ep and u.experts and ep.layer_of(model, u.module)
      if lay then
        -- (every rank of every group gathers; rank 0's group's is written)
        local mine = {}
        for i = 1, fp.nparams do
          mine[u._ckpt_names[i]] = flat:narrow(1, fp.layout.offsets[i] + 1, fp.layout.numels[i])
        end
        local all = ep.gather_experts(model, u.module, function(name) return mine[name] end, flat.dtype, writes)
        for _, v in pairs(mine) do v:free() end
        if writes and ok then
          ok, err = pcall(function()
            for _, name in ipairs(lay.names) do
              local h = all[name]
              all[name] = nil
              if h.device ~= 'cpu' or h.dtype ~= (opts.dtype or h.dtype) then
                local c = h:to({ device = 'cpu', dtype = opts.dtype or h.dtype, copy = true })
                h:free()
                h = c
              end
              st:put(h)   -- (the stream's now: any shape of its element count)
            end
          end)
        end
        for _, t in pairs(all) do t:free() end
      elseif writes and ok then
        ok, err = pcall(function()
          for i = 1, fp.nparams do
            local piece = flat:narrow(1, fp.layout.offsets[i] + 1, fp.layout.numels[i])
            local h = piece:to({ device = 'cpu', dtype = opts.dtype or piece.dtype, copy = true })
            piece:free()
            st:put(h)
          end
        end)
      end
      flat:free()
      if M._on_unit_saved then M._on_unit_saved(u) end   -- (specs: what a rank holds now)
    end
  end)
  if writes and ok then
    ok, err = pcall(function()
      for _, b in ipairs(ctx.buffers) do st:put(b.t:to({ device = 'cpu', copy = true }):contiguous()) end
      st:finish()
    end)
  end
  if writes and not ok and st then st:cancel(err) end
  agree(ctx, ok, err, 'save_full ' .. path)
  return path
end

function M.save_full(model, path, opts)
  opts = opts or {}
  if type(path) ~= 'string' or path == '' then fail('save_full: path must be a file path, got %s', tostring(path)) end
  local ctx0 = regions(model)
  local merge = opts.merge_lora ~= false and require('moonshard.nn').has_lora(model)
  if ctx0.sharded and not merge then return save_full_streamed(model, path, opts, ctx0) end
  if merge and rawget(model, '_ep_train') then
    -- (the merge gathers the model whole first, which holds only this
    -- rank's experts: the file would lack the others)
    fail('save_full %s: an expert-parallel model (ms.ep) with LoRA adapters to merge: not supported (merge_lora = '
      .. 'false writes the adapters as they are)', path)
  end
  local params, _, ctx = M.gather(model)
  local ok, err = true, nil
  if ctx.rank == 0 and not ctx.skip_write then
    ok, err = pcall(function()
      local out, conv = {}, {}
      for _, e in ipairs(params) do
        if opts.dtype and opts.dtype ~= e.tensor.dtype then
          out[e.name] = e.tensor:to({ dtype = opts.dtype, copy = true })
          conv[#conv + 1] = out[e.name]
        else
          out[e.name] = e.tensor
        end
      end
      for _, b in ipairs(ctx.buffers) do out[b.name] = b.t:contiguous() end
      -- LoRA adapters merged into their weights (opts.merge_lora, default
      -- on): the file is the plain model's
      local nnm = require('moonshard.nn')
      if opts.merge_lora ~= false and nnm.has_lora(model) then
        local made
        out, made = nnm.lora_merged(model, out)
        for _, t in ipairs(made) do conv[#conv + 1] = t end
      end
      local sok, serr = pcall(S.save, path, out, { format = 'pt' })
      for _, t in ipairs(conv) do t:free() end
      if not sok then error(serr, 0) end
    end)
  end
  for _, e in ipairs(params) do e.tensor:free() end
  agree(ctx, ok, err, 'save_full ' .. path)
  return path
end

-- load_full(model, path, { strict = true }): a full safetensors file (as
-- save_full or Hugging Face write it) into the model; a sharded model's
-- ranks each read only their slices. Names go through the model family's
-- fix_state_dict (older HF names) when it has one. Collective.
function M.load_full(model, path, opts)
  opts = opts or {}
  if type(path) ~= 'string' then fail('load_full: path must be a file path, got %s', tostring(path)) end
  local ctx = regions(model)
  local ok, err = pcall(function()
    if not file_size(path) then fail('%s: no such file', path) end
    local h = header_of(path)
    -- model name -> file name
    local names = {}
    for k in pairs(h.entries) do names[k] = k end
    local fam = model.family
    if fam and fam.fix_state_dict then names = fam.fix_state_dict(names, model.config) end
    local saved = {}
    for mname, fname in pairs(names) do
      local e = h.entries[fname]
      saved[#saved + 1] = { name = mname, shape = e.shape }
    end
    table.sort(saved, function(a, b) return a.name < b.name end)
    check_params(ctx, saved, path, opts.strict == true)   -- HF files may carry more (strict = true refuses)
    local function pieces_of(name)
      local e = h.entries[names[name]]
      if not e then return nil end
      return { { rank = 0, start = 0, numel = numel_of(e.shape), tensor = names[name] } }
    end
    local function open() return h end
    no_grad(function()
      local F = require 'moonshard.ops'
      for _, u in ipairs(ctx.units or {}) do F.fill_(u.fp.shard, 0) end
      for _, r in ipairs(ctx.regions) do
        fill_region(r.dest, r, r.start, r.numel, pieces_of(r.name), open, 'tensor', path)
      end
      for _, b in ipairs(ctx.buffers) do
        local pcs = pieces_of(b.name)
        if pcs then
          local tmp = T.empty({ b.numel }, { dtype = b.dtype })
          fill_part(tmp, b.name, b.shape, { start = 0, numel = b.numel }, pcs, open, 'tensor', path)
          b.t:copy_(tmp:view(b.shape))
          tmp:free()
        elseif opts.strict ~= false then
          fail('%s has no buffer %s', path, b.name)
        end
      end
    end)
  end)
  agree(ctx, ok, err, 'load_full ' .. path)
  refresh(model, ctx)
  return model
end

return M
