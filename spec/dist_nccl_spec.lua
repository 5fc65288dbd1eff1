-- Collectives over NCCL on CUDA tensors, one GPU per rank (#multi: run by
-- tools/run_multi_specs.sh on a host with 2 or more GPUs, every rank running
-- this file under the launcher). The same checks as the MPI spec — every
-- op and dtype on sizes that do not divide evenly, sub-groups, the mesh,
-- values each rank computes alone — plus what only the GPU path has: the
-- communication stream waits for the compute stream (no host sync), the
-- allocator does not reuse a buffer a collective still reads, a
-- collective that a peer never joins is aborted by the watchdog, and
-- collectives recorded into a CUDA graph run at each replay (host waits
-- and polls inside a capture refused by name).
local ms = require 'moonshard'
local dist = require 'moonshard.dist'
local S = require 'spec.support'

local launched = os.getenv('RANK') ~= nil and os.getenv('MS_DEVICE') == 'cuda'

local dtypes = { 'f32', 'bf16', 'f64', 'i64' }
local sizes = { 1, 7, 1001, 1000003 }
local ops = { 'sum', 'avg', 'max', 'min' }

local val = S.collective_val

-- val(r, i) depends on i mod 46 only: big tensors are one period, tiled
local function fill(n, dtype, r)
  local period = {}
  for j = 0, 45 do period[j + 1] = val(r, j, dtype) end
  local k = math.ceil(n / 46)
  local t = ms.tensor(period, { dtype = 'f64' }):view(1, 46):expand(k, 46):contiguous():view(k * 46)
  return t:narrow(1, 1, n):contiguous():to(dtype):cuda()
end

local reduce = S.reduce_expect

local bounds = { f32 = 1e-6, bf16 = 1e-2, f64 = 1e-12, i64 = 0 }

-- compares on the host, at most 4096 positions spread over the tensor
local function check(t, n, expect_at, dtype, what)
  local host = t:cpu():to('f64')
  local step = math.max(1, math.floor(n / 4096))
  for i = 0, n - 1, step do
    local got, want = host:get(i + 1), expect_at(i)
    local tol = bounds[dtype] * math.max(1, math.abs(want))
    if math.abs(got - want) > tol then
      error(('%s: element %d is %s, expected %s'):format(what, i + 1, tostring(got), tostring(want)), 2)
    end
  end
end

describe('dist over NCCL #multi', function()
  if not launched then
    it('runs under the launcher on a multi-GPU host (tools/run_multi_specs.sh)', function()
      pending('not started by bin/train --device cuda')
    end)
    return
  end

  local R, W
  setup(function()
    dist.init { backend = 'nccl', timeout = 120 }
    R, W = dist.rank(), dist.world_size()
  end)
  teardown(function() dist.destroy() end)

  it('shares a GEMM tuning file between the ranks: both append, both read the records back untimed', function()
    local path = ('/tmp/ms-gemm-tune-%s-%s.txt'):format(os.getenv('MASTER_PORT') or 'p', os.getenv('MS_DIST_TOKEN') or 't')
    if R == 0 then os.remove(path) end
    dist.barrier()
    local old = ms.cuda.gemm_tune(true)
    local ok, err = pcall(function()
      ms.cuda.gemm_tune_file(path)
      ms.cuda.gemm_clear_plans()
      local a = ms.randn({ 2056, 776 }, { seed = 7 }):bf16():cuda()
      local b = ms.randn({ 776, 1544 }, { seed = 8 }):bf16():cuda()
      local s0 = ms.cuda.gemm_tune_stats()
      local first = ms.matmul(a, b):cpu()
      local s1 = ms.cuda.gemm_tune_stats()
      local mine = s1.tuned - s0.tuned
      local tot = ms.tensor({ mine }, { dtype = 'f64' }):cuda()
      dist.all_reduce(tot, 'sum')
      local all = tot:cpu():get(1)
      dist.barrier()
      local n = 0
      for l in io.lines(path) do
        assert.is_truthy(l:match('^ms%-gemm%-tune 1 %d+ %S+ 0 '), l)   -- the device index not recorded
        n = n + 1
      end
      assert.are.equal(all, n, 'one whole line a plan each rank tuned')
      ms.cuda.gemm_clear_plans()
      ms.cuda.gemm_tune_file(path)   -- read again: the peers' lines too
      local again = ms.matmul(a, b):cpu()
      local s2 = ms.cuda.gemm_tune_stats()
      assert.are.equal(s1.tuned, s2.tuned, 'timed again')
      assert.is_true(s2.from_file > s1.from_file)
      assert.are.equal(0, S.relerr(again, first), 'the recorded algorithm: the same bits')
    end)
    ms.cuda.gemm_tune_file(nil)
    ms.cuda.gemm_tune(old)
    dist.barrier()
    if R == 0 then os.remove(path) end
    assert(ok, err)
  end)

  it('uses the GPU of its local rank', function()
    assert.are.equal('nccl', dist.backend())
    assert.are.equal('cuda:' .. dist.local_rank(), dist.device())
    assert.are.equal(tonumber(os.getenv('RANK')), R)
    assert.are.equal('0', os.getenv('NCCL_NVLS_ENABLE'))
  end)

  for _, dtype in ipairs(dtypes) do
    for _, n in ipairs(sizes) do
      it(('all_gather_into %s, %d per rank'):format(dtype, n), function()
        local out = ms.empty({ n * W }, { dtype = dtype, device = 'cuda' })
        dist.all_gather_into(out, fill(n, dtype, R))
        check(out, n * W, function(k) return val(math.floor(k / n), k % n, dtype) end, dtype, 'all_gather_into')
      end)

      for _, op in ipairs(ops) do
        it(('reduce_scatter %s %s, %d per rank'):format(op, dtype, n), function()
          local out = ms.empty({ n }, { dtype = dtype, device = 'cuda' })
          dist.reduce_scatter(out, fill(n * W, dtype, R), op)
          check(out, n, function(i)
            local vals = {}
            for r = 0, W - 1 do vals[#vals + 1] = val(r, R * n + i, dtype) end
            return reduce(op, vals, dtype)
          end, dtype, 'reduce_scatter ' .. op)
        end)

        it(('all_reduce %s %s, %d elements'):format(op, dtype, n), function()
          local t = fill(n, dtype, R)
          dist.all_reduce(t, op)
          check(t, n, function(i)
            local vals = {}
            for r = 0, W - 1 do vals[#vals + 1] = val(r, i, dtype) end
            return reduce(op, vals, dtype)
          end, dtype, 'all_reduce ' .. op)
        end)
      end

      it(('broadcast %s, %d elements'):format(dtype, n), function()
        for _, root in ipairs({ 0, W - 1 }) do
          local t = fill(n, dtype, R)
          dist.broadcast(t, root)
          check(t, n, function(i) return val(root, i, dtype) end, dtype, 'broadcast from ' .. root)
        end
      end)
    end
  end

  it('all_reduce_coalesced: the values all_reduce gives each tensor, packed (the CUDA default: cast_flat and '
    .. 'split_flat_ kernels) in buckets of every size and unpacked, f32 / bf16 / f64 / i64, sum and avg', function()
    local specs = { { { 3, 4 }, 'f32' }, { { 5 }, 'f64' }, { { 2, 3 }, 'bf16' }, { { 0 }, 'f32' }, { { 4 }, 'i64' },
      { { 7 }, 'f32' }, { { 1 }, 'f64' }, { { 6, 2 }, 'f32' }, { { 9000 }, 'bf16' }, { { 3, 9001 }, 'f32' } }
    local function make(r) return S.coalesced_list(r, specs, 'cuda') end
    for _, op in ipairs({ 'sum', 'avg' }) do
      for _, how in ipairs({ { 1, nil }, { 40, nil }, { 2 ^ 30, nil }, { 2 ^ 30, false } }) do
        local got, want = make(R), make(R)
        dist.all_reduce_coalesced(got, op, { bucket_bytes = how[1], pack = how[2] })
        for k, t in ipairs(want) do
          if t:numel() > 0 then dist.all_reduce(t, op) end
          assert.are.same(t.shape, got[k].shape)
          assert.are.equal(t.dtype, got[k].dtype)
          local d = t:numel() > 0 and (t:to('cpu'):to('f64') - got[k]:to('cpu'):to('f64')):abs():max():item() or 0
          assert.are.equal(0, d, ('tensor %d (%s), %s, buckets of %d bytes, pack %s'):format(k, t.dtype, op, how[1],
            tostring(how[2])))
        end
      end
    end
  end)

  it('orders the collective after the compute stream\'s work, without a host sync', function()
    -- a long chain of GEMMs writes the input; all_reduce is issued at once
    local a = ms.randn({ 4096, 4096 }, { seed = 7, device = 'cuda' })
    local x = a
    local t0 = os.clock()
    for _ = 1, 30 do x = ms.raw.matmul(x, a) * (1 / 64) end
    local y = x:mul(0) + (R + 1)
    local w = dist.all_reduce(y, 'sum', { async = true })
    local issued = os.clock() - t0
    local done_at_once = w:is_done()
    w:wait()
    assert.is_false(done_at_once, 'the collective finished before the GEMMs it depends on')
    assert.is_true(issued < 1.0, ('issuing took %.2f s of CPU: something synchronised'):format(issued))
    local s = W * (W + 1) / 2
    check(y:view(4096 * 4096), 4096 * 4096, function() return s end, 'f32', 'ordered all_reduce')
  end)

  it('keeps a buffer the collective reads from being reused when its tensor is freed', function()
    local n = 4194304
    local out = ms.empty({ n * W }, { dtype = 'bf16', device = 'cuda' })
    local a = ms.randn({ 4096, 4096 }, { seed = 3, device = 'cuda' })
    for _ = 1, 10 do a = ms.raw.matmul(a, a) * (1 / 64) end   -- keep the compute stream busy
    local inp = ms.full({ n }, R + 1, { dtype = 'bf16', device = 'cuda' })
    local w = dist.all_gather_into(out, inp, { async = true })
    inp:free()
    -- a new tensor of the same size, written at once on the compute stream
    local other = ms.full({ n }, -5, { dtype = 'bf16', device = 'cuda' })
    w:wait()
    check(out, n * W, function(k) return math.floor(k / n) + 1 end, 'bf16', 'all_gather of a freed input')
    assert.are.equal(-5, other:float():get(1))
  end)

  it('runs asynchronously on its own stream; wait orders the current stream', function()
    local n = 1048576
    local works, outs = {}, {}
    for k = 1, 4 do
      outs[k] = ms.empty({ n * W }, { dtype = 'bf16', device = 'cuda' })
      works[k] = dist.all_gather_into(outs[k], ms.full({ n }, R + k, { dtype = 'bf16', device = 'cuda' }),
        { async = true })
    end
    for k = 4, 1, -1 do works[k]:wait() end
    for k = 1, 4 do
      check(outs[k], n * W, function(i) return math.floor(i / n) + k end, 'bf16', 'async all_gather ' .. k)
    end
    ms.cuda.synchronize()
    for k = 1, 4 do assert.is_true(works[k]:is_done()) end
  end)

  -- CUDA graphs (docs/cuda-graphs.md, docs/dist.md): a collective issued
  -- in a capture is recorded (the communication stream forked and joined
  -- back by its wait) and every replay runs it on what the static inputs
  -- then hold; what would wait or poll on the host is refused by name, and
  -- the world stays usable after each refusal
  it('records collectives into a CUDA graph: each replay runs them; host waits and border-crossing waits refused',
    function()
    local function world_ok(what)   -- an eager collective after it: the communicator is fine
      local e = ms.full({ 7 }, 1, { dtype = 'f32', device = 'cuda' })
      dist.all_reduce(e, 'sum')
      assert.are.equal(W, e:cpu():get(7), what)
    end
    local x = ms.full({ 1001 }, R + 1, { dtype = 'f32', device = 'cuda' })
    local done_msg, after
    local g = ms.cuda.graph(function()
      local t = x * 2
      local w = dist.all_reduce(t, 'sum', { async = true })
      local ok, e = pcall(w.is_done, w)   -- (refused: a poll of recorded work)
      done_msg = not ok and tostring(e) or 'is_done answered'
      w:wait()
      local m = t + 1
      dist.all_reduce(m, 'max')           -- (joined by its own wait)
      dist.check_joined('spec')
      after = w
      return t, m
    end, { warmup = 1 })
    assert.is_truthy(done_msg:find('is_done during CUDA graph capture', 1, true), done_msg)
    local sum = W * (W + 1) / 2
    for k = 1, 3 do
      x:copy_(ms.full({ 1001 }, k * (R + 1), { dtype = 'f32', device = 'cuda' }))
      local t, m = g:replay()
      dist.watch('spec replay ' .. k)
      local ht, hm = t:cpu(), m:cpu()
      assert.are.equal(2 * k * sum, ht:get(1), 'replay ' .. k)
      assert.are.equal(2 * k * sum, ht:get(1001), 'replay ' .. k)
      assert.are.equal(2 * k * sum + 1, hm:get(500), 'replay ' .. k)
    end
    -- the captured handle after the capture: no poll, no wait
    local ok, err = pcall(after.is_done, after)
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find('recorded into a CUDA graph', 1, true), tostring(err))
    ok, err = pcall(after.wait, after)
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find('capture that has ended', 1, true), tostring(err))
    g:free()
    world_ok('after the replays')
    -- refused inside a capture, each naming its op (the capture discarded)
    local function refused(fn, word)
      local ok2, e2 = pcall(ms.cuda.graph, fn, { warmup = 0 })
      assert.is_false(ok2, word)
      assert.is_truthy(tostring(e2):find(word, 1, true), word .. ' not in: ' .. tostring(e2))
      world_ok(word)
    end
    refused(function() dist.barrier() end, 'barrier during CUDA graph capture')
    refused(function() dist.watch('inside') end, 'watch (inside) during CUDA graph capture')
    local pre = dist.all_reduce(ms.ones({ 3 }, { device = 'cuda' }), 'sum', { async = true })
    refused(function() pre:wait() end, 'was issued before the CUDA graph capture')
    pre:wait()   -- (eagerly: fine)
    -- an async collective left unwaited: check_joined waits for it, then names it
    refused(function()
      dist.all_reduce(ms.ones({ 5 }, { device = 'cuda' }) * 1, 'sum', { async = true })
      dist.check_joined('the step')
    end, 'the step: 1 collective issued in the CUDA graph capture and not waited for (all_reduce)')
  end)

  it('times its collectives on the GPU when asked (dist.timing / dist.timeline)', function()
    local n = 4194304
    local a = ms.randn({ 4096, 4096 }, { seed = 5, device = 'cuda' })
    local ref = ms.cuda.event { timing = true }
    ms.cuda.synchronize()
    dist.timing(true)
    ref:record()
    for _ = 1, 10 do a = ms.raw.matmul(a, a) * (1 / 64) end   -- the compute stream is busy when they are issued
    local out = ms.empty({ n * W }, { dtype = 'bf16', device = 'cuda' })
    local w1 = dist.all_gather_into(out, ms.full({ n }, R + 1, { dtype = 'bf16', device = 'cuda' }), { async = true })
    local y = ms.full({ 1001 }, R + 1, { device = 'cuda' })
    local w2 = dist.all_reduce(y, 'sum', { async = true })
    w1:wait()
    dist.timing(false)
    local w3 = dist.all_reduce(ms.ones({ 7 }, { device = 'cuda' }), 'sum', { async = true })   -- not logged
    w2:wait(); w3:wait()
    ms.cuda.synchronize()
    local tl = dist.timeline(ref)
    assert.are.equal(2, #tl)
    assert.is_truthy(tl[1].desc:find('all_gather', 1, true), tl[1].desc)
    assert.is_truthy(tl[2].desc:find('all_reduce', 1, true), tl[2].desc)
    local eps = 0.05   -- event timestamps have ~0.5 us resolution; streams are not exactly simultaneous
    for i, e in ipairs(tl) do
      assert.is_true(e.issued > 1, ('entry %d issued at %.3f ms: before the GEMMs it follows'):format(i, e.issued))
      assert.is_true(e.start >= e.issued - eps and e.stop >= e.start, ('entry %d: %.3f %.3f %.3f'):format(i, e.issued, e.start, e.stop))
    end
    assert.is_true(tl[2].start >= tl[1].stop - eps, 'one communication stream: the second starts after the first')
    assert.is_number(tl[1].wait)
    assert.is_true(tl[1].resumed >= tl[1].stop - eps and tl[1].resumed >= tl[1].wait - eps)
    assert.is_number(tl[2].wait)   -- a logged collective's wait is timed even after the timing stopped
    check(out, n * W, function(i) return math.floor(i / n) + 1 end, 'bf16', 'timed all_gather')
    -- a new timing clears the log
    dist.timing(true); dist.timing(false)
    assert.are.equal(0, #dist.timeline(ref))
  end)

  it('gathers registered tensors with the copy engines (copy_register / gather_into), after a fence', function()
    local n = 3000001   -- odd byte counts: the copies need no alignment
    for _, dtype in ipairs({ 'bf16', 'f32' }) do
      local src = fill(n, dtype, R)
      local reg = dist.copy_register(src)
      assert.is_not_nil(reg, 'every rank on one host: the registration must succeed')
      local out = ms.empty({ n * W }, { dtype = dtype, device = 'cuda' })
      dist.all_reduce(ms.zeros({ 1 }, { device = 'cuda' }), 'max')   -- fence: every member's src is written
      local w = reg:gather_into(out)
      w:wait(); w:free()
      check(out, n * W, function(i) return val(math.floor(i / n), i % n % 46, dtype) end, dtype, 'copy_gather ' .. dtype)
      -- the members write their tensors again (in place), fence, gather: the new values
      ms.cuda.synchronize()
      dist.barrier()   -- every copy that read the old values is done (the host saw its work end)
      src:copy_(fill(n, dtype, R + W))
      dist.all_reduce(ms.zeros({ 1 }, { device = 'cuda' }), 'max')
      w = reg:gather_into(out)
      w:wait(); w:free()
      check(out, n * W, function(i) return val(math.floor(i / n) + W, i % n % 46, dtype) end, dtype,
        'copy_gather after a rewrite ' .. dtype)
      local ok, err = pcall(reg.gather_into, reg, ms.empty({ n }, { dtype = dtype, device = 'cuda' }))
      assert.is_false(ok)
      assert.matches('must hold', err, 1, true)
      reg:free()
    end
    -- an MPI-only argument error names the tensor
    local ok, err = pcall(dist.copy_register, ms.ones({ 4 }))
    assert.is_false(ok)
    assert.matches('copy_register', err, 1, true)
  end)

  it('works in place as NCCL defines it', function()
    local n = 1001
    local out = ms.zeros({ n * W }, { dtype = 'f32', device = 'cuda' })
    out:narrow(1, R * n + 1, n):copy_(fill(n, 'f32', R))
    dist.all_gather_into(out, out:narrow(1, R * n + 1, n))
    check(out, n * W, function(k) return val(math.floor(k / n), k % n, 'f32') end, 'f32', 'in-place all_gather')
  end)

  it('refuses CPU tensors and tensors on another GPU', function()
    local ok, err = pcall(dist.all_reduce, ms.ones({ 3 }), 'sum')
    assert.is_false(ok)
    assert.matches('works on cuda:' .. dist.local_rank(), err, 1, true)
  end)

  it('makes sub-groups and every mesh of the world', function()
    for r = 0, W - 1 do
      local g = dist.new_group({ r })
      assert.are.equal(r == R, g:is_member())
      if g:is_member() then
        local t = ms.full({ 9 }, 4, { dtype = 'f32', device = 'cuda' })
        g:all_reduce(t, 'sum')
        check(t, 9, function() return 4 end, 'f32', 'group of one')
      end
    end
    for S = 1, W do
      if W % S == 0 then
        local m = dist.mesh { replicate = W / S, shard = S }
        local col = R % S
        local n = 5
        local part = ms.empty({ n }, { dtype = 'f64', device = 'cuda' })
        m.shard:reduce_scatter(part, fill(n * S, 'f64', R), 'sum')
        m.replicate:all_reduce(part, 'sum')
        check(part, n, function(i)
          local s = 0
          for r = 0, W - 1 do s = s + val(r, col * n + i, 'f64') end
          return s
        end, 'f64', ('mesh %dx%d'):format(W / S, S))
        m.shard:free()
        m.replicate:free()
      end
    end
    dist.barrier()
  end)

  it('aborts a collective that a peer never joins, with a message naming it; the world carries on', function()
    local g = dist.new_group({ 0, 1 })
    if R == 0 then
      g:set_timeout(3)
      local t = ms.ones({ 5 }, { device = 'cuda' })
      -- the first collective of a group connects its peers, so NCCL may
      -- already block in the enqueue: then the call itself fails after the
      -- time-out; otherwise the watchdog aborts the queued work
      local t0 = os.time()
      local ok0, w = pcall(dist.all_reduce, t, 'sum', { group = g, async = true })
      if ok0 then
        while not g:is_broken() and os.time() - t0 < 20 do os.execute('sleep 0.1') end
        assert.is_true(g:is_broken(), 'the watchdog did not abort within 20 s')
        local ok, err = pcall(w.wait, w)
        assert.is_false(ok)
        assert.matches('did not complete within 3 s', err, 1, true)
      else
        assert.is_true(os.time() - t0 <= 20, 'the enqueue took more than 20 s to give up')
        assert.matches('all_reduce sum of f32 (5) cuda:' .. tostring(ms.cuda.current_device()), w, 1, true)
        assert.matches('group [0,1]', w, 1, true)
        assert.matches('timed out enqueuing', w, 1, true)
        assert.is_true(g:is_broken(), 'the group is not marked broken after the failed enqueue')
      end
      local ok2, err2 = pcall(dist.all_reduce, t, 'sum', { group = g })
      assert.is_false(ok2)
      assert.matches('is broken', err2, 1, true)
    elseif R == 1 then
      os.execute('sleep 5')
      g:abort()   -- rank 1 never joins; it gives its side up
    end
    dist.barrier()
    local t = ms.ones({ 3 }, { device = 'cuda' })
    dist.all_reduce(t, 'sum')
    check(t, 3, function() return W end, 'f32', 'world after the abort')
  end)
end)

-- the collective timeline's switch and its argument checks, on any machine
describe('dist.timing and dist.timeline (the collective timeline)', function()
  local ffi = require 'ffi'
  it('turns on and off with the NCCL backend built, logging nothing without collectives; says why without it', function()
    if dist.is_available('nccl') then
      dist.timing(true)
      dist.timing(false)
      assert.are.same({}, dist.timeline({ p = ffi.cast('struct ms_cuda_event *', 1) }))   -- no entry: never read
    else
      local ok, err = pcall(dist.timing, true)
      assert.is_false(ok)
      assert.matches('needs the NCCL backend', err, 1, true)
    end
  end)
  it('needs a timed cuda.event as its reference', function()
    local ok, err = pcall(dist.timeline, 'now')
    assert.is_false(ok)
    assert.matches('need a timed cuda.event', err, 1, true)
  end)
end)
