-- DeepSeek's sequence-wise balance loss under context parallelism (#mpi,
-- 1-4 ranks; docs/moe.md): an MoE layer given the world's cp context, each
-- rank its load-balanced chunks of every sequence. Against the whole
-- sequences in one process, in f64: nn.moe.seq_aux_loss's value on every
-- rank (1e-12), the router's gradient averaged over the ranks and each
-- rank's input gradient over the group's size (1e-10); the same through a
-- session (seq_aux_begin / seq_aux_end), checkpointed too; sigmoid and
-- softmax scores, per sequence and over the batch.
local ms = require 'moonshard'
local dist = require 'moonshard.dist'
local A = require 'moonshard.autograd'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('the sequence-wise balance loss under context parallelism #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 120 } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local moe, cp = ms.nn.moe, ms.cp

  local function maxrel(a, b)
    return (a - b):abs():max():item() / math.max(b:abs():max():item(), 1e-30)
  end

  local function layer(cfg)
    ms.manual_seed(5)
    local m = ms.nn.MoE(cfg):to('f64')
    if cfg.router_bias then m.gate.e_score_correction_bias:copy_(ms.randn({ cfg.experts }, { seed = 8 }) * 0.3) end
    return m
  end

  -- the loss of x (B, T, H) through layer m (cp: its context, x sharded by
  -- it; nil: the whole sequences), direct (seq_aux_loss) or through a
  -- session, optionally checkpointed; -> value, the router's gradient
  -- averaged over the ranks, x's gradient (each rank's chunks divided by
  -- the group's size, gathered back to the whole sequences)
  local function run(cfg, x, ctx, how, opts)
    local m = layer(cfg)
    m.gate.weight:requires_grad_()
    local xi = x:detach():clone():requires_grad_()
    local h = xi
    if ctx then
      cp.apply(m, ctx, { need_attention = false })
      h = cp.shard(xi, ctx)
    end
    local loss
    if how == 'direct' then
      m(h)
      loss = moe.seq_aux_loss({ m }, 0.3, opts)
    else
      local box = moe.seq_aux_begin({ m }, { alpha = 0.3, choice = opts.choice, per_sequence = opts.per_sequence })
      local y = how == 'checkpointed' and A.checkpoint(function(t) return m(t) end, h) or m(h)
      loss = moe.seq_aux_end((y * 0):sum():reshape({ 1 }), box)
    end
    local v = loss:item()
    loss:backward()
    local gw = m.gate.weight.grad:clone()
    if ctx then dist.all_reduce(gw, 'avg') end
    local gx = xi.grad:clone()
    -- (the shard's backward gathers every rank's part: the group's size
    -- times the whole sequences' gradient, as the ranks' own losses are
    -- the whole loss each)
    if ctx then gx = gx * (1 / W) end
    moe.seq_aux_begin({ m }, nil)
    A.clear_tape()
    return v, gw, gx
  end

  local cases = {
    { 'sigmoid, groups, routing bias, the k best scores', { dim = 6, hidden = 8, experts = 8, top_k = 2,
      score = 'sigmoid', n_group = 4, topk_group = 2, router_bias = true }, { choice = 'scores' } },
    { 'softmax, the routing\'s experts', { dim = 6, hidden = 8, experts = 6, top_k = 2 }, { choice = 'routing' } },
    { 'softmax, over the batch', { dim = 6, hidden = 8, experts = 6, top_k = 3 }, { per_sequence = false } },
  }
  for _, c in ipairs(cases) do
    it(c[1] .. ': the value on every rank, the averaged router gradient, the input gradient', function()
      local ctx = cp.context(dist.get_world_group())
      local x = ms.randn({ 3, 4 * W, 6 }, { dtype = 'f64', seed = 21 })
      for _, how in ipairs({ 'direct', 'session', 'checkpointed' }) do
        local v0, gw0, gx0 = run(c[2], x, nil, how, c[3])
        local v, gw, gx = run(c[2], x, ctx, how, c[3])
        assert.is_true(math.abs(v - v0) <= 1e-12 * v0, ('%s: %.17g against %.17g'):format(how, v, v0))
        assert.is_true(maxrel(gw, gw0) <= 1e-10, how .. ' router ' .. maxrel(gw, gw0))
        assert.is_true(maxrel(gx, gx0) <= 1e-10, how .. ' input ' .. maxrel(gx, gx0))
      end
    end)
  end
end)
