-- Vocabulary-parallel fused linear cross-entropy over MPI on CPU tensors,
-- run by every rank under mpirun (tools/run_mpi_specs.sh: 1, 2, 3 and 4
-- ranks). Every rank draws the whole problem from the same seeds, computes
-- the unsharded result alone, and checks what the group computes from its
-- rows of W against it: loss, z-loss and accuracy (the full vocabulary's,
-- on every rank), grad_x (complete on every rank), grad_W and grad_bias (its
-- rows). Vocabularies are prime or smaller than the group (a rank with no
-- rows), chunks do not divide BT, and every option is used.
-- The #multi part does the same over NCCL with one GPU per rank (f32 and
-- bf16), under the launcher as tools/run_multi_specs.sh starts
-- spec/dist_nccl_spec.lua.
local ms = require 'moonshard'
local dist = require 'moonshard.dist'
local flce = require 'moonshard.flce'

local F = ms.raw
local FLCE = ms.nn.functional.fused_linear_cross_entropy
local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

local S = require 'spec.support'
local relerr, errmsg = S.relerr, S.errmsg

-- the same problem on every rank
local function problem(BT, H, V, seed, ignored)
  local x = ms.randn({ BT, H }, { dtype = 'f64', seed = seed })
  local W = F.mul(ms.randn({ V, H }, { dtype = 'f64', seed = seed + 1 }), 0.5)
  local ids = F.mul(ms.rand({ BT }, { dtype = 'f64', seed = seed + 2 }), V):to('i64')
  local drop = F.lt(ms.rand({ BT }, { dtype = 'f64', seed = seed + 3 }), ignored or 0.15)
  local t = F.where(drop, ms.full({ BT }, -100, { dtype = 'i64' }), ids)
  local bias = F.mul(ms.randn({ V }, { dtype = 'f64', seed = seed + 4 }), 0.3)
  local cw = F.add(F.abs(ms.randn({ V }, { dtype = 'f64', seed = seed + 5 })), 0.1)
  return x, W, t, bias, cw
end

local DEV = 'cpu'   -- the ranks' device: cpu (MPI) or cuda:LOCAL_RANK (NCCL)
local function leaf(t, dtype) return t:to({ dtype = dtype, device = DEV, copy = true }):requires_grad_() end

-- loss, z, acc and gradients; `rows` = {start, n} takes W's rows (and
-- bias', ce_weight's) [start, start + n) and runs on the world group
local function run(x, W, t, o, dtype, g, rows, layout)
  local xl = leaf(x, dtype)
  local Wsrc, bsrc, csrc = W, o.bias, o.ce_weight
  if rows then
    Wsrc = W:narrow(1, rows[1] + 1, rows[2])
    bsrc = bsrc and bsrc:narrow(1, rows[1] + 1, rows[2])
    csrc = csrc and csrc:narrow(1, rows[1] + 1, rows[2])
  end
  local Wl = leaf(Wsrc, dtype)
  local oo = {}
  for k, v in pairs(o) do oo[k] = v end
  oo.bias = bsrc and leaf(bsrc, dtype) or nil
  oo.ce_weight = csrc and csrc:to({ dtype = dtype, device = DEV }) or nil
  oo.return_z_loss, oo.return_accuracy = true, true
  if rows then
    oo.group = dist.get_world_group()
    for k, v in pairs(layout or {}) do oo[k] = v end
  end
  local loss, z, acc = FLCE(xl, Wl, t:to(DEV), oo)
  loss:backward(g and g:to({ dtype = dtype, device = DEV }) or nil)
  return { loss = loss, z = z, acc = acc:item(), gx = xl.grad, gW = Wl.grad, gb = oo.bias and oo.bias.grad }
end

-- the group's result for this rank against the whole problem's
local function check(x, W, t, o, dtype, bound, layout, rows)
  local R, G = dist.rank(), dist.world_size()
  local V = W.shape[1]
  local g = o.reduction == 'none' and ms.randn({ t:numel() }, { dtype = 'f64', seed = 77 }) or nil
  local whole = run(x, W, t, o, dtype, g)
  local a, n
  if rows then a, n = rows[1], rows[2] else a, n = flce.vocab_shard(V, R, G) end
  local part = run(x, W, t, o, dtype, g, { a, n }, layout)
  local what = ('V=%d rank %d/%d rows [%d,%d) %s'):format(V, R, G, a, a + n, dtype)
  -- V = 1: the exact loss and gradients are 0 and both results are rounding
  -- noise (~1e-8 here), which the two paths round differently: a relative
  -- error of noise says nothing, so an absolute difference under 1e-6
  -- passes too (gradient entries are ~1e-2 otherwise)
  local function close(got, want, name)
    local e = relerr(got, want)
    local abs = relerr(F.sub(got:to('cpu'):double(), want:to('cpu'):double()), ms.zeros(want.shape, { dtype = 'f64' }))
    assert.is_true(e <= bound or abs <= 1e-6, ('%s: %s relative error %.3g (absolute %.3g)'):format(what, name, e, abs))
  end
  for _, k in ipairs({ 'loss', 'z', 'gx' }) do close(part[k], whole[k], k) end
  -- on the GPU the two GEMMs' shapes differ: a near-tie may round apart
  local tol = DEV == 'cpu' and 0 or 1 / t:numel() + 1e-9
  assert.is_true(math.abs(whole.acc - part.acc) <= tol, what .. ': accuracy')
  if n > 0 then
    close(part.gW, whole.gW:narrow(1, a + 1, n), 'grad_W')
    if o.bias then close(part.gb, whole.gb:narrow(1, a + 1, n), 'grad_bias') end
  else
    assert.are.same({ 0, W.shape[2] }, part.gW.shape)
  end
end

describe('vocabulary-parallel fused_linear_cross_entropy over MPI #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end

  local R, G
  setup(function()
    dist.init { backend = 'mpi', timeout = 60 }
    R, G = dist.rank(), dist.world_size()
  end)
  teardown(function() dist.destroy() end)

  it('equals the unsharded loss and gradients for every option and reduction (f64 and f32)', function()
    for _, shape in ipairs({ { 37, 9, 1009 }, { 20, 6, 3 }, { 1, 5, 64 } }) do
      local x, W, t, bias, cw = problem(shape[1], shape[2], shape[3], 100 + shape[3])
      for _, o in ipairs({
        {},
        { reduction = 'sum', chunk_size = 7 },
        { reduction = 'none', softcap = 3, chunk_size = 5 },
        { label_smoothing = 0.1, lse_square_scale = 1e-3 },
        { bias = bias, ce_weight = cw, label_smoothing = 0.05, softcap = 4, lse_square_scale = 1e-3, chunk_size = 11 },
        { bias = bias, ce_weight = cw, reduction = 'none', label_smoothing = 0.2 },
      }) do
        check(x, W, t, o, 'f64', 1e-12)
        check(x, W, t, o, 'f32', 1e-5)
      end
    end
  end)

  it('finds the split from vocab_size (flat-parameter rule), from the row counts, or takes vocab_start', function()
    local x, W, t = problem(16, 4, 101, 300)
    local a, n = flce.vocab_shard(101, R, G)
    check(x, W, t, {}, 'f64', 1e-12, { vocab_size = 101 })
    check(x, W, t, {}, 'f64', 1e-12, {})   -- counts gathered from the group
    -- another uneven split: rank r holds r + 1 units of rows, the last one the rest
    local unit = math.floor(101 / (G * (G + 1) / 2))
    local start = unit * R * (R + 1) / 2
    local rows = R == G - 1 and 101 - start or unit * (R + 1)
    check(x, W, t, { label_smoothing = 0.1 }, 'f64', 1e-12, { vocab_start = start, vocab_size = 101 }, { start, rows })
    assert.are.equal(math.min(101, a + n) - a, n)
  end)

  it('gives the ranks without rows a (0, H) grad_W, and all-ignored targets a 0 loss', function()
    local x, W, t = problem(12, 5, 2, 400)
    check(x, W, t, { ce_weight = F.add(F.abs(ms.randn({ 2 }, { dtype = 'f64', seed = 9 })), 0.5) }, 'f64', 1e-12)
    local xa, Wa, ta = problem(6, 3, 50, 500, 1.0)
    local a, n = flce.vocab_shard(50, R, G)
    local r = run(xa, Wa, ta, { lse_square_scale = 1e-2 }, 'f64', nil, { a, n })
    assert.are.equal(0, r.loss:item())
    assert.are.equal(0, F.sum(F.abs(r.gx)):item())
  end)

  it('refuses a split that does not fit and bad targets, on every rank alike', function()
    local x, W, t = problem(8, 4, 40, 600)
    local a, n = flce.vocab_shard(40, R, G)
    local Wl = W:narrow(1, a + 1, n)
    local group = dist.get_world_group()
    if G > 1 then
      assert.matches('rank %d+ of %d+ holds', errmsg(function()
        FLCE(x, W, t, { group = group, vocab_size = 40 })   -- every rank passes all 40 rows
      end))
    end
    assert.matches('not within a vocabulary of 40', errmsg(function()
      FLCE(x, Wl, t, { group = group, vocab_start = 40 - n + 1, vocab_size = 40 })
    end))
    local bad = ms.tensor({ 1, 2, 3, 40, 5, 6, 7, 8 }, { dtype = 'i64' })
    assert.matches('target 40 at position 3 is out of range for 40 classes', errmsg(function()
      FLCE(x, Wl, bad, { group = group, vocab_size = 40 })
    end))
    -- the group still works afterwards
    check(x, W, t, {}, 'f64', 1e-12, { vocab_size = 40 })
  end)
end)

describe('vocabulary-parallel fused_linear_cross_entropy over NCCL #multi', function()
  if not (os.getenv('RANK') ~= nil and os.getenv('MS_DEVICE') == 'cuda') then
    it('runs under the launcher with one GPU per rank', function() pending('not launched on GPUs') end)
    return
  end
  setup(function()
    dist.init { backend = 'nccl', timeout = 30 }
    DEV = dist.device()
  end)
  teardown(function()
    dist.destroy()
    DEV = 'cpu'
  end)

  it('equals the unsharded result on the GPU: f32 within 1e-4, bf16 within 2e-2, every option', function()
    local fails = {}
    for _, shape in ipairs({ { 37, 64, 1009 }, { 64, 32, 4096 }, { 20, 16, 1 } }) do
      local x, W, t, bias, cw = problem(shape[1], shape[2], shape[3], 700 + shape[3])
      for oi, o in ipairs({
        {},
        { reduction = 'sum', chunk_size = 7 },
        { reduction = 'none', softcap = 3, chunk_size = 16 },
        { bias = bias, ce_weight = cw, label_smoothing = 0.05, softcap = 4, lse_square_scale = 1e-3, chunk_size = 11 },
      }) do
        -- a failed check is kept, not raised: the ranks stay in step (the
        -- collectives of the next case), and every failure is reported
        for _, c in ipairs({ { 'f32', 1e-4 }, { 'bf16', 2e-2 } }) do
          local ok, err = pcall(check, x, W, t, o, c[1], c[2], { vocab_size = shape[3] })
          if not ok then fails[#fails + 1] = ('option %d: %s'):format(oi, tostring(err)) end
        end
      end
    end
    assert.are.same({}, fails)
  end)
end)
