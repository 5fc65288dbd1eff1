-- Context parallelism with v narrower or wider than q/k (#mpi, 1-4 ranks;
-- tools/run_mpi_specs.sh): ring attention (moonshard.cp) with k and v at
-- their own head widths travelling in one buffer, against the whole
-- sequence in one process (f64, load-balanced and contiguous, GQA; a
-- finite-difference check through the ring); the padded path it takes where
-- a GPU's kernels lack the widths (stubbed here); nn.MLAttention (DeepSeek's
-- q/k 192 and v 128, scaled down) ringing with its own widths.
local ms = require 'moonshard'
local dist = require 'moonshard.dist'
local A = require 'moonshard.autograd'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('context parallelism with Dv != D #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 120 } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local cp, nnf, nn = ms.cp, ms.nn.functional, ms.nn

  local function maxrel(a, b)
    local d = (a - b):abs():max():item()
    local s = b:abs():max():item()
    return d / math.max(s, 1e-30)
  end

  -- q, k (width D) and v (width Dv) of the whole sequence, the same on every rank
  local function qkv(B, H, Hkv, Tn, D, Dv, seed)
    ms.manual_seed(seed)
    local q = ms.randn({ B, H, Tn, D }, { dtype = 'f64' })
    local k = ms.randn({ B, Hkv, Tn, D }, { dtype = 'f64' })
    local v = ms.randn({ B, Hkv, Tn, Dv }, { dtype = 'f64' })
    for _, t in ipairs({ q, k, v }) do t:requires_grad_(true) end
    return q, k, v
  end

  local function run(ctx, q, k, v, r)
    local y
    if ctx then
      y = cp.unshard(cp.attention(cp.shard(q, ctx, 3), cp.shard(k, ctx, 3), cp.shard(v, ctx, 3), ctx), ctx, 3)
    else
      y = nnf.scaled_dot_product_attention(q, k, v, { causal = true })
    end
    ;(y * r):sum():backward()
    local g = { q.grad:clone(), k.grad:clone(), v.grad:clone() }
    for _, t in ipairs({ q, k, v }) do t:zero_grad() end
    return y:detach(), g
  end

  for _, lb in ipairs({ true, false }) do
    for _, w in ipairs({ { 12, 8, 4, 2 }, { 6, 10, 4, 4 }, { 8, 4, 6, 3 } }) do
      local D, Dv, H, Hkv = w[1], w[2], w[3], w[4]
      it(('ring attention equals the whole sequence\'s at q/k %d, v %d (f64, %s, H %d / Hkv %d)'):format(D, Dv,
        lb and 'load-balanced' or 'contiguous', H, Hkv), function()
        local ctx = cp.context(dist.get_world_group(), { load_balance = lb })
        local Tn = 24
        local q, k, v = qkv(2, H, Hkv, Tn, D, Dv, 13)
        ms.manual_seed(5)
        local r = ms.randn({ 2, H, Tn, Dv }, { dtype = 'f64' })
        local y1, g1 = run(ctx, q, k, v, r)
        local y0, g0 = run(nil, q, k, v, r)
        assert.are.same({ 2, H, Tn, Dv }, y1.shape)
        assert.is_true(maxrel(y1, y0) < 1e-12, 'out ' .. maxrel(y1, y0))
        for i = 1, 3 do
          assert.is_true(maxrel(g1[i], g0[i]) < 1e-11, ({ 'dq', 'dk', 'dv' })[i] .. ' ' .. maxrel(g1[i], g0[i]))
        end
      end)
    end
  end

  it('a finite-difference check through shard, the ring and unshard (f64, v narrower)', function()
    local ctx = cp.context(nil)
    local q, k, v = qkv(1, 2, 1, 2 * W * 2, 6, 4, 3)
    local worst = A.gradcheck(function()
      return cp.unshard(cp.attention(cp.shard(q, ctx, 3), cp.shard(k, ctx, 3), cp.shard(v, ctx, 3), ctx), ctx, 3)
    end, { q, k, v })
    assert.is_true(worst < 1e-7, 'gradcheck ' .. worst)
  end)

  it('padded to widths a GPU\'s kernels take (stubbed): the same output and gradients (f64)', function()
    if W == 1 then return end   -- (one rank: sdpa, its own spec)
    local real = nnf.attention_widths
    local ctx = cp.context(nil)
    local q, k, v = qkv(1, 4, 2, 24, 10, 6, 17)
    ms.manual_seed(9)
    local r = ms.randn({ 1, 4, 24, 6 }, { dtype = 'f64' })
    local y0, g0 = run(nil, q, k, v, r)
    nnf.attention_widths = function() return 16, 8 end
    local ok, y1, g1 = pcall(run, ctx, q, k, v, r)
    nnf.attention_widths = real
    assert.is_true(ok, tostring(y1))
    assert.is_true(maxrel(y1, y0) < 1e-12, 'out ' .. maxrel(y1, y0))
    for i = 1, 3 do assert.is_true(maxrel(g1[i], g0[i]) < 1e-11, 'grad ' .. i) end
    -- and where no kernel takes them: an error naming the shapes
    nnf.attention_widths = function() return nil, 'no kernel' end
    local sq, sk, sv = cp.shard(q:detach(), ctx, 3), cp.shard(k:detach(), ctx, 3), cp.shard(v:detach(), ctx, 3)
    local ok2, err = pcall(cp.attention, sq, sk, sv, ctx)
    nnf.attention_widths = real
    assert.is_false(ok2)
    assert.matches('takes none of q 1x4x%d+x10', err)
  end)

  it('nn.MLAttention (q/k 12, v 8) rings with its own widths: the output and every gradient (f64)', function()
    ms.manual_seed(31)
    local function build()
      ms.manual_seed(31)
      local att = nn.MLAttention { dim = 16, n_head = 2, q_lora_rank = 6, kv_lora_rank = 8, qk_nope_head_dim = 8,
        qk_rope_head_dim = 4, v_head_dim = 8, scale = 0.3 }:to('f64')
      for name, p in att:named_parameters() do
        if name:match('norm') then ms.normal_(p, 1, 0.2) else ms.normal_(p, 0, 0.4) end
      end
      return att
    end
    local Tn = 4 * W
    local x = ms.randn({ 2, Tn, 16 }, { dtype = 'f64', seed = 77 })
    local r = ms.randn({ 2, Tn, 16 }, { dtype = 'f64', seed = 78 })
    local ref = build()
    local y0 = ref(x)
    ;(y0 * r):sum():backward()
    local m = build()
    local ctx = cp.apply(m, nil)
    local y = cp.unshard(m(cp.shard(x, ctx)), ctx)
    ;(y * r):sum():backward()
    assert.is_true(maxrel(y:detach(), y0:detach()) < 1e-12, 'out ' .. maxrel(y:detach(), y0:detach()))
    local pr = {}
    for name, p in ref:named_parameters() do pr[name] = p end
    for name, p in m:named_parameters() do
      local g = p.grad:clone()
      dist.all_reduce(g, 'sum')   -- (each rank's share of the whole gradient)
      local e = maxrel(g, pr[name].grad)
      assert.is_true(e < 1e-10, name .. ' ' .. e)
    end
    m.unfused = true
    local ok, err = pcall(m, cp.shard(x, ctx))
    assert.is_false(ok)
    assert.matches('unfused', err)
    cp.remove(m)
  end)
end)
