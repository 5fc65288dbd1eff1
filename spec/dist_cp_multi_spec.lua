-- Context parallelism on GPUs over NCCL (#multi: tools/run_multi_specs.sh
-- on a host with 2 or more GPUs). spec/dist_cp_spec.lua (#mpi) holds the
-- exact f64 checks; this file runs the ring with CUDA tensors and the
-- flash-attention kernels: f32 and bf16 against the whole sequence's
-- attention on the same GPU (head dims 64 and 128, grouped-query heads,
-- both layouts), a Llama with its tokens split under bf16 autocast and
-- FSDP over the group against the whole model, and allocated memory flat
-- over steps.
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local S = require 'spec.support'
local dist = require 'moonshard.dist'
local llama = require 'models.llama'

local launched = os.getenv('RANK') ~= nil and os.getenv('MS_DEVICE') == 'cuda'

describe('context parallelism on GPUs (NCCL) #multi', function()
  if not launched then
    it('runs under the launcher on GPUs (tools/run_multi_specs.sh)', function() pending('not launched with --device cuda') end)
    return
  end
  setup(function() dist.init { timeout = tonumber(os.getenv('MS_MULTI_TIMEOUT') or 300) } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('WORLD_SIZE'))
  local cp, nnf = ms.cp, ms.nn.functional

  local function maxrel(a, b)
    local d = (a:to('f32') - b:to('f32')):abs():max():item()
    return d / math.max(b:to('f32'):abs():max():item(), 1e-30)
  end

  local function run(ctx, q, k, v, r)
    local y
    if ctx then
      y = cp.unshard(cp.attention(cp.shard(q, ctx, 3), cp.shard(k, ctx, 3), cp.shard(v, ctx, 3), ctx), ctx, 3)
    else
      y = nnf.scaled_dot_product_attention(q, k, v, { causal = true })
    end
    ;(y:to('f32') * r):sum():backward()
    local g = { q.grad:clone(), k.grad:clone(), v.grad:clone() }
    for _, t in ipairs({ q, k, v }) do t:zero_grad() end
    return y:detach(), g
  end

  for _, dtype in ipairs({ 'f32', 'bf16' }) do
    for _, D in ipairs({ 64, 128 }) do
      for _, lb in ipairs({ true, false }) do
        it(('ring attention against the whole sequence on the GPU (%s, D %d, %s)'):format(dtype, D,
          lb and 'load-balanced' or 'contiguous'), function()
          local ctx = cp.context(nil, { load_balance = lb })
          local Tn, H, Hkv = 256 * W, 8, 2
          ms.manual_seed(3)   -- the same on every rank
          local q = ms.randn({ 2, H, Tn, D }):cuda():to(dtype):requires_grad_(true)
          local k = ms.randn({ 2, Hkv, Tn, D }):cuda():to(dtype):requires_grad_(true)
          local v = ms.randn({ 2, Hkv, Tn, D }):cuda():to(dtype):requires_grad_(true)
          local r = ms.randn({ 2, H, Tn, D }):cuda()
          local y1, g1 = run(ctx, q, k, v, r)
          local y0, g0 = run(nil, q, k, v, r)
          local tol = dtype == 'f32' and 1e-4 or 2e-2
          assert.is_true(maxrel(y1, y0) < tol, 'out ' .. maxrel(y1, y0))
          for i = 1, 3 do
            local e = maxrel(g1[i], g0[i])
            assert.is_true(e < tol, ({ 'dq', 'dk', 'dv' })[i] .. ' ' .. e)
          end
        end)
      end
    end
  end

  local cfg = { vocab_size = 1024, hidden_size = 256, intermediate_size = 512, num_hidden_layers = 2,
    num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 512 * W }
  local function build()
    ms.manual_seed(7)
    local c = {}
    for kk, vv in pairs(cfg) do c[kk] = vv end
    return llama.new(c)
  end

  it('a Llama with its tokens split (f32): the loss and every gradient, averaged over the group', function()
    local Tn = 128 * W
    local ids, tgt = FS.lcg_batch(5, 2, Tn)
    ids, tgt = ids:cuda(), tgt:cuda()
    local ref = build():to('cuda')
    local l0 = ref(ids, tgt)
    l0:backward()
    local m = build():to('cuda')
    local ctx = cp.apply(m, nil)
    local l = m(cp.shard(ids, ctx), cp.shard(tgt, ctx))
    l:backward()
    local lt = l:detach():clone()
    dist.all_reduce(lt, 'sum')
    assert.is_true(math.abs(lt:item() / W - l0:item()) < 1e-4 * math.abs(l0:item()))
    local pr = {}
    for name, p in ref:named_parameters() do pr[name] = p end
    for name, p in m:named_parameters() do
      local g = p.grad:clone()
      dist.all_reduce(g, 'sum')
      local e = maxrel(g / W, pr[name].grad)
      assert.is_true(e < 1e-3, name .. ' ' .. e)
    end
  end)

  it('FSDP over the group with bf16 parameters: steps follow the whole model, memory flat from step 2', function()
    local Tn = 128 * W
    local ids, tgt = FS.lcg_batch(9, 2, Tn)
    ids, tgt = ids:cuda(), tgt:cuda()
    local ref = nnf.set_precision(build():to('cuda'), { compute = 'bf16' })
    local m = build():to('cuda')
    ms.fsdp.fully_shard(m, { policy = ms.fsdp.policy.by_class { llama.Layer },
      mixed_precision = { param = 'bf16', reduce = 'f32' } })
    local ctx = cp.apply(m, nil)
    local o0 = ms.optim.AdamW(ref:parameters(), { lr = 1e-3 })
    local o1 = ms.fsdp.AdamW(m, { lr = 1e-3 })
    local mi, mt = cp.shard(ids, ctx), cp.shard(tgt, ctx)
    local losses, ref_losses, alloc = {}, {}, {}
    for s = 1, 4 do
      o0:zero_grad(); o1:zero_grad()
      local l0 = ref(ids, tgt)
      l0:backward()
      o0:step()
      local l = m(mi, mt)
      l:backward()
      o1:step()
      local lt = l:detach():to('f32')
      dist.all_reduce(lt, 'sum')
      losses[s], ref_losses[s] = lt:item() / W, l0:item()
      ms.cuda.synchronize()
      S.settle()
      alloc[s] = ms.cuda.memory_stats().allocated
    end
    for s = 1, 4 do
      assert.is_true(math.abs(losses[s] - ref_losses[s]) < 2e-2 * ref_losses[s], ('step %d: %g vs %g'):format(s,
        losses[s], ref_losses[s]))
    end
    assert.is_true(losses[4] < losses[1])
    assert.are.equal(alloc[2], alloc[4])
  end)
end)
