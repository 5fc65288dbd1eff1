-- ms.cuda.graph on a GPU (docs/cuda-graphs.md): a captured region replays
-- with the bits of the eager one on new inputs copied into its static
-- tensors; a Llama training step (forward, backward, AdamW) replayed 5
-- times gives the losses and weights of 5 eager steps, bit for bit; each
-- refusal names its op and leaves the process eager and usable; replays
-- make no cudaMalloc and no host sync; freeing a graph gives its pool back.
-- Run on a GPU host: bash tools/run_specs.sh --tags=gpu spec/gpu_graph_spec.lua
local ms = require 'moonshard'
local F = require 'moonshard.ops'
local S = require 'spec.support'

-- bit for bit: the same shape and every element equal (in f64, exact for
-- every float dtype; a NaN fails)
local function same_bits(a, b)
  assert.are.same(a.shape, b.shape)
  local d = (a:to('cpu'):double() - b:to('cpu'):double()):abs()
  return d:numel() == 0 or d:max():item() == 0
end

local function on_cuda(t) return t:to('cuda') end

-- fn() inside a capture must fail with an error containing each of `words`,
-- and leave no capture, no pool, and an eager op that works
local function refused(fn, opts, words)
  local pool0 = ms.cuda.memory_stats().graph_pool
  local ok, err = pcall(ms.cuda.graph, fn, opts)
  assert.is_false(ok, 'the capture went through')
  err = tostring(err)
  assert.is_truthy(err:find('the capture was aborted', 1, true), err)
  for _, w in ipairs(words) do assert.is_truthy(err:find(w, 1, true), w .. ' not in: ' .. err) end
  assert.is_false(ms.cuda.is_capturing())
  assert.are.equal(pool0, ms.cuda.memory_stats().graph_pool)
  local xc = ms.randn({ 8, 16 }, { seed = 5 })
  local want = (F.matmul(xc, xc, false, true) + 1):sum():item()
  local got = (F.matmul(on_cuda(xc), on_cuda(xc), false, true) + 1):sum():item()
  assert.is_true(math.abs(got - want) <= 1e-4 * math.abs(want), got .. ' vs ' .. want)
  ms.cuda.synchronize()
end

describe('cuda.graph #gpu', function()
  setup(function() assert.is_true(ms.cuda.is_available(), 'no CUDA device') end)

  it('replays elementwise ops and a matmul with the bits of eager runs on new inputs', function()
    local x = on_cuda(ms.randn({ 64, 128 }, { seed = 1 }))
    local w = on_cuda(ms.randn({ 128, 96 }, { seed = 2 }))
    local b = on_cuda(ms.randn({ 96 }, { seed = 3 }))
    local function fn()
      local h = F.matmul(x, w)
      local y = ms.gelu(h + b) * 0.5
      return y, (y * y):sum(), ms.silu(x):to('bf16')
    end
    local g = ms.cuda.graph(fn, { warmup = 1 })
    assert.are.equal(3, #g.outputs)
    for i = 1, 3 do
      x:copy_(ms.randn({ 64, 128 }, { seed = 10 + i }))
      g:replay()
      local want = { fn() }
      for k = 1, 3 do assert.is_true(same_bits(g.outputs[k], want[k]), 'replay ' .. i .. ' output ' .. k) end
    end
    -- the outputs follow the inputs (the replays ran): not the first input's
    local first = ms.gelu(F.matmul(on_cuda(ms.randn({ 64, 128 }, { seed = 1 })), w) + b) * 0.5
    assert.is_false(same_bits(g.outputs[1], first))
    g:free()
    g:free()   -- (twice is fine)
    assert.has_error(function() g:replay() end, 'graph:replay: the graph was freed')
  end)

  it('replays a Llama training step: 5 replays on 5 batches give the losses and weights of 5 eager steps', function()
    local llama = require 'models.llama'
    local B, Tn, V = 2, 32, 256
    local function make()
      ms.manual_seed(7)
      local m = llama.new('tiny'):to('cuda')   -- (dropout 0)
      return m, ms.optim.AdamW(m, { lr = 3e-3, weight_decay = 0.1 })
    end
    local function step(m, o, x, y)
      o:zero_grad({ set_to_none = false })
      local loss = m(x, y)
      loss:backward()
      o:step()
      return loss
    end
    local x0, y0 = S.token_batch(B, Tn, V, 99)
    x0, y0 = on_cuda(x0), on_cuda(y0)
    local batches = {}
    for i = 1, 5 do
      local x, y = S.token_batch(B, Tn, V, 100 + i)
      batches[i] = { on_cuda(x), on_cuda(y) }
    end
    -- eager: 3 steps on the static batch (the graph's warm-up), then the 5
    local ma, oa = make()
    for _ = 1, 3 do step(ma, oa, x0, y0) end
    local la = {}
    for i = 1, 5 do la[i] = step(ma, oa, batches[i][1], batches[i][2]):item() end
    -- graph: the same start, 3 warm-up steps inside cuda.graph, then 5 replays
    local mb, ob = make()
    local xs, ys = x0:clone(), y0:clone()
    local g = ms.cuda.graph(function() return step(mb, ob, xs, ys) end, { warmup = 3 })
    for i = 1, 5 do
      xs:copy_(batches[i][1])
      ys:copy_(batches[i][2])
      local loss = g:replay()
      local lb = loss:item()
      assert.are.equal(la[i], lb, ('step %d: eager %.9g, replay %.9g'):format(i, la[i], lb))
    end
    assert.is_true(la[5] ~= la[1])   -- (the batches and the weights moved)
    local pb = {}
    for n, p in mb:named_parameters() do pb[n] = p end
    for n, p in ma:named_parameters() do
      assert.is_true(same_bits(p, pb[n]), n)
      local sa, sb = oa.state[tonumber(p.id)], ob.state[tonumber(pb[n].id)]
      assert.are.equal(8, sb.step)
      assert.are.equal(sa.step, sb.step)
      assert.is_true(same_bits(sa.exp_avg, sb.exp_avg) and same_bits(sa.exp_avg_sq, sb.exp_avg_sq), n)
    end
    g:free()
  end)

  it('reads the lr at each replay (a schedule needs no new capture)', function()
    local x = on_cuda(ms.randn({ 16, 32 }, { seed = 21 }))
    local function make()
      local w = on_cuda(ms.randn({ 32, 8 }, { seed = 22 }))
      w.requires_grad = true
      return w, ms.optim.AdamW({ w }, { lr = 1e-2 })
    end
    local function step(w, o)
      o:zero_grad({ set_to_none = false })
      local loss = (x:matmul(w) ^ 2):mean()
      loss:backward()
      o:step()
      return loss
    end
    local wa, oa = make()
    local wb, ob = make()
    step(wa, oa)
    local g = ms.cuda.graph(function() return step(wb, ob) end, { warmup = 1 })
    for i = 1, 4 do
      oa:set_lr(1e-2 / (i + 1))
      ob:set_lr(1e-2 / (i + 1))
      step(wa, oa)
      g:replay()
    end
    assert.is_true(same_bits(wa, wb))
    g:free()
  end)

  describe('refuses, naming the op, and the process goes on eagerly', function()
    local x
    before_each(function() x = on_cuda(ms.randn({ 64, 64 }, { seed = 31 })) end)

    it('item()', function()
      refused(function() return (x * 2):sum():item() end, { warmup = 1 }, { 'item', 'capture' })
    end)
    it('a copy to the host', function()
      refused(function() return (x * 2):to('cpu') end, { warmup = 0 }, { 'a copy from the device to the host' })
    end)
    it('synchronize', function()
      refused(function() ms.cuda.synchronize() end, { warmup = 0 }, { 'synchronize' })
    end)
    it('dropout with p > 0 (a random draw)', function()
      refused(function() return ms.nn.functional.dropout(x, 0.5, true) end, { warmup = 1 }, { 'rand_', 'dropout' })
    end)
    it('a CPU tensor op', function()
      refused(function() return ms.ones({ 4 }) + 1 end, { warmup = 0 }, { 'on cpu tensors' })
    end)
    it('a GEMM shape not tuned yet', function()
      local prev = ms.cuda.gemm_tune(true)
      ms.cuda.gemm_tune_file(nil)
      local a = on_cuda(ms.randn({ 192, 320 }, { seed = 32 }))
      local w = on_cuda(ms.randn({ 320, 224 }, { seed = 33 }))
      refused(function() return F.matmul(a, w) end, { warmup = 0 }, { 'matmul', 'tuned', 'M=192' })
      -- after a warm-up the same shape captures
      local g = ms.cuda.graph(function() return F.matmul(a, w) end, { warmup = 1 })
      g:replay()
      assert.is_true(same_bits(g.outputs[1], F.matmul(a, w)))
      g:free()
      ms.cuda.gemm_tune(prev)
    end)
    it('an optimizer\'s first step (state made inside the capture)', function()
      local w = on_cuda(ms.randn({ 64, 8 }, { seed = 34 }))
      w.requires_grad = true
      local o = ms.optim.AdamW({ w }, { lr = 1e-3 })
      local function fwd_bwd()
        o:zero_grad({ set_to_none = false })
        x:matmul(w):sum():backward()
      end
      fwd_bwd()   -- (its GEMMs tuned, .grad made: the step is what is refused)
      refused(function() fwd_bwd(); o:step() end, { warmup = 0 }, { 'AdamW:step', 'no optimizer state yet' })
      assert.is_nil(o.state[tonumber(w.id)])
    end)
  end)

  it('replays make no cudaMalloc and no host sync; freeing the graph gives its pool back', function()
    local x = on_cuda(ms.randn({ 128, 256 }, { seed = 41 }))
    local w = on_cuda(ms.randn({ 256, 256 }, { seed = 42 }))
    -- the intermediates freed as it goes: the capture reuses their blocks
    local function fn()
      local h = x
      for _ = 1, 4 do
        local m = F.matmul(h, w)
        local a = ms.silu(m)
        m:free()
        if h ~= x then h:free() end
        h = a * 0.1
        a:free()
      end
      return h
    end
    local before = ms.cuda.memory_stats()
    local g = ms.cuda.graph(fn, { warmup = 2 })
    local captured = ms.cuda.memory_stats()
    assert.is_true(captured.graph_pool > before.graph_pool, 'no pool')
    for _ = 1, 10 do g:replay() end
    local after = ms.cuda.memory_stats()
    assert.are.equal(captured.num_mallocs, after.num_mallocs)
    assert.are.equal(captured.num_allocs, after.num_allocs)
    assert.are.equal(captured.num_host_syncs, after.num_host_syncs)
    local out = g.outputs[1]
    assert.is_true(same_bits(out, fn()))
    local sum = out:sum():item()
    local pre = ms.cuda.memory_stats()
    g:free()
    local freed = ms.cuda.memory_stats()
    assert.are.equal(before.graph_pool, freed.graph_pool)
    assert.are.equal(pre.reserved, freed.reserved)     -- back to the cache, not to the driver
    assert.are.equal(pre.num_frees, freed.num_frees)
    assert.are.equal(sum, out:sum():item())            -- the output stays readable
    ms.cuda.empty_cache()                              -- the cache's blocks, the pool's among them, go
    assert.is_true(ms.cuda.memory_stats().reserved < freed.reserved)
  end)
end)
