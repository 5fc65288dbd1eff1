-- Point-to-point sends and receives over MPI on CPU tensors (dist.batch_p2p,
-- dist.send, dist.recv), run by every rank under mpirun with 1-4 ranks
-- (tools/run_mpi_specs.sh). Each rank fills what it sends from a formula of
-- its own rank, so the receiver checks what arrived against values it
-- computes alone.
local ms = require 'moonshard'
local dist = require 'moonshard.dist'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

-- rank r's i-th value (0-based) of message k: small integers, exact in every dtype
local function val(r, i, k) return ((r * 7 + i * 3 + k * 5) % 23) - 11 end
local function filled(r, n, dtype, k)
  local v = {}
  for i = 0, n - 1 do v[i + 1] = val(r, i, k) end
  return ms.tensor(v, { dtype = dtype })
end
local function check_from(t, r, k, what)
  local got = t:to('f64'):totable()
  for i = 1, #got do
    if got[i] ~= val(r, i - 1, k) then
      error(('%s: element %d is %s, expected %s (from rank %d)'):format(what, i, got[i], val(r, i - 1, k), r), 2)
    end
  end
end

describe('dist point-to-point over MPI #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end

  local R, W
  setup(function()
    dist.init { backend = 'mpi', timeout = 60 }
    R, W = dist.rank(), dist.world_size()
  end)
  teardown(function() dist.destroy() end)

  it('passes a ring of messages, a send and a receive in one batch, for every dtype', function()
    if W < 2 then return end
    local nxt, prev = (R + 1) % W, (R - 1 + W) % W
    for k, dtype in ipairs({ 'f32', 'bf16', 'f64', 'i64' }) do
      for _, n in ipairs({ 1, 7, 1001 }) do
        local out = filled(R, n, dtype, k)
        local inb = ms.empty({ n }, { dtype = dtype })
        dist.batch_p2p({ { 'send', out, nxt }, { 'recv', inb, prev } })
        check_from(inb, prev, k, ('%s x %d from rank %d'):format(dtype, n, prev))
      end
    end
  end)

  it('exchanges both ways between neighbours (a pipeline\'s forward and backward at once)', function()
    if W < 2 then return end
    -- every rank sends to both neighbours and receives from both, in one batch;
    -- with 2 ranks both neighbours are the same rank: two messages each way,
    -- matched in the order they were posted
    local nxt, prev = (R + 1) % W, (R - 1 + W) % W
    local a, b = filled(R, 33, 'f32', 1), filled(R, 33, 'f32', 2)
    local from_prev, from_next = ms.empty({ 33 }), ms.empty({ 33 })
    local w = dist.batch_p2p({ { 'send', a, nxt }, { 'send', b, prev }, { 'recv', from_prev, prev },
      { 'recv', from_next, nxt } }, { async = true })
    w:wait()
    w:free()
    check_from(from_prev, prev, 1, 'forward message')
    check_from(from_next, nxt, 2, 'backward message')
  end)

  it('dist.send and dist.recv between rank 0 and the last rank, several messages in order', function()
    if W < 2 then return end
    local last = W - 1
    if R == 0 then
      for k = 1, 3 do dist.send(filled(0, 5 + k, 'f32', k), last) end
    elseif R == last then
      for k = 1, 3 do
        local t = ms.empty({ 5 + k })
        dist.recv(t, 0)
        check_from(t, 0, k, 'message ' .. k)
      end
    end
    dist.barrier()
  end)

  it('on a sub-group, with world ranks as peers', function()
    if W < 3 then return end
    local g = dist.new_group({ 1, 2 })
    if g:is_member() then
      local other = R == 1 and 2 or 1
      local t = ms.empty({ 4 }, { dtype = 'f64' })
      g:batch_p2p({ { 'send', filled(R, 4, 'f64', 9), other }, { 'recv', t, other } })
      check_from(t, other, 9, 'sub-group message')
      assert.has_error(function() g:batch_p2p({ { 'send', t, 0 } }) end,
        'p2p: operation 1 (send) names rank 0, not a rank of the group group [1,2] (peers are world ranks)')
    end
    g:free()
    dist.barrier()
  end)

  it('refuses bad batches with messages that name the operation', function()
    local t = ms.empty({ 3 })
    assert.has_error(function() dist.send(t, R) end,
      ('p2p: operation 1 (send) names this rank (%d) as its peer'):format(R))
    assert.has_error(function() dist.batch_p2p({ { 'recv', t, W } }) end,
      ('p2p: operation 1 (receive) names rank %d, not a rank of the group world (peers are world ranks)'):format(W))
    assert.has_error(function() dist.batch_p2p({ { 'put', t, 0 } }) end,
      'batch_p2p: operation 1 is put, not "send" or "recv"')
    assert.has_error(function() dist.batch_p2p({ { 'send', 3, 0 } }) end,
      'batch_p2p: operation 1 (send) needs a tensor, got number')
    assert.has_error(function() dist.batch_p2p({}) end, 'batch_p2p: expects a list of {"send"|"recv", tensor, peer}')
    assert.has_error(function() dist.send(ms.empty({ 2, 3 }):t(), (R + 1) % math.max(W, 2)) end,
      'p2p: the tensor of operation 1 (send) (f32 (3,2) cpu) is not contiguous (call :contiguous() first)')
    if W >= 2 then
      local both = ms.empty({ 4 })
      local peer = (R + 1) % W
      assert.has_error(function() dist.batch_p2p({ { 'send', both, peer }, { 'recv', both:narrow(1, 1, 2), peer } }) end,
        'p2p: operations 1 and 2 share a storage and one of them receives into it')
    end
  end)

  it('names a message longer than its receive (the group is unusable after it)', function()
    if W < 2 then return end
    local g = dist.new_group({ 0, 1 })
    if g:is_member() then
      if R == 0 then
        g:batch_p2p({ { 'send', filled(0, 8, 'f32', 1), 1 } })
      else
        local ok, err = pcall(function() g:batch_p2p({ { 'recv', ms.empty({ 4 }), 0 } }) end)
        assert.is_false(ok)
        assert.matches('a message did not fit its receive', tostring(err), 1, true)
        assert.is_true(g:is_broken())
      end
    end
    g:free()
    dist.barrier()
  end)
end)
