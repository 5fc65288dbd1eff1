-- The op counter (ms.profile, core/prof.h; docs/tensors.md "Counting the
-- ops") on small graphs whose ops are known: every op of the core that
-- writes a tensor counts a call, its elements and bytes, by op name and
-- device; views count nothing; off, nothing is counted. And the collective
-- trace's time column (dist.trace(true, { times = true }), MS_DIST_COUNT=2)
-- under mpirun (#mpi): present and >= 0 with it, absent without.
local ms = require 'moonshard'
local prof = require 'moonshard.profile'
local nnf = require 'moonshard.nn.functional'

-- the rows of one op (on the CPU), or zeros
local function row(rows, op)
  for _, r in ipairs(rows) do
    if r.op == op and r.device == 'cpu' then return r end
  end
  return { calls = 0, elems = 0, bytes = 0 }
end

describe('the op counter', function()
  after_each(function() prof.ops(false) end)

  it('counts a linear layer\'s forward and backward: three matmuls, of the output, grad_x and grad_W', function()
    local B, I, O = 5, 7, 3
    ms.manual_seed(1)
    local x = ms.randn({ B, I }):requires_grad_()
    local w = ms.randn({ O, I }):requires_grad_()
    prof.ops(true)
    local y = nnf.linear(x, w)
    y:sum():backward()
    local rows = prof.ops_rows()
    prof.ops(false)
    local mm = row(rows, 'matmul')
    assert.are.equal(3, mm.calls)
    assert.are.equal(B * O + B * I + O * I, mm.elems)
    assert.are.equal((B * O + B * I + O * I) * 4, mm.bytes)
    -- (and the gradients they made are the ones expected)
    assert.is_true((x.grad - ms.ones({ B, O }):matmul(w)):abs():max():item() < 1e-5)
  end)

  it('counts nothing while off, and counts afresh when turned on again', function()
    local a, b = ms.randn({ 4, 6 }), ms.randn({ 6, 2 })
    prof.ops(true)
    local _ = a:matmul(b)
    prof.ops(false)
    local _ = a:matmul(b)
    assert.are.equal(1, row(prof.ops_rows(), 'matmul').calls)
    prof.ops(true)
    assert.are.same({}, (prof.ops_rows()))
    local _ = a:matmul(b)
    local _ = a:matmul(b)
    assert.are.equal(2, row(prof.ops_rows(true), 'matmul').calls)
    assert.are.same({}, (prof.ops_rows()), 'ops_rows(true) clears')
  end)

  it('names a copy by what asked for it; a view writes nothing', function()
    local a = ms.randn({ 6, 10 }, { dtype = 'f64' })
    prof.ops(true)
    local v = a:narrow(2, 3, 4):transpose(1, 2)   -- (views)
    local c = v:contiguous()
    local d = ms.empty({ 4, 6 }, { dtype = 'f32' })
    d:copy_(v)
    local e = a:clone()
    local f = a:to('f32')
    local rows = prof.ops_rows()
    prof.ops(false)
    assert.are.same({ calls = 1, elems = 24, bytes = 24 * 8 },
      { calls = row(rows, 'contiguous').calls, elems = row(rows, 'contiguous').elems, bytes = row(rows, 'contiguous').bytes })
    assert.are.same({ 1, 24, 24 * 4 }, { row(rows, 'copy_').calls, row(rows, 'copy_').elems, row(rows, 'copy_').bytes })
    assert.are.same({ 1, 60, 60 * 8 }, { row(rows, 'clone').calls, row(rows, 'clone').elems, row(rows, 'clone').bytes })
    assert.are.same({ 1, 60, 60 * 4 }, { row(rows, 'to').calls, row(rows, 'to').elems, row(rows, 'to').bytes })
    local n = 0
    for _, r in ipairs(rows) do n = n + r.calls end
    assert.are.equal(4, n, 'nothing else: the views are not counted')
    -- (a contiguous tensor's contiguous() is itself: no copy)
    prof.ops(true)
    local _ = c:contiguous()
    assert.are.same({}, (prof.ops_rows()))
    for _, t in ipairs({ c, d, e, f }) do t:free() end
  end)

  it('counts an op of several outputs once, with every output\'s elements (rms_norm: out and rstd)', function()
    local N, Cn = 6, 5
    local x, w = ms.randn({ N, Cn }), ms.randn({ Cn })
    prof.ops(true)
    local y = nnf.rms_norm(x, w, 1e-6)
    local r = row(prof.ops_rows(), 'rms_norm')
    prof.ops(false)
    assert.are.equal(1, r.calls)
    assert.are.equal(N * Cn + N, r.elems)
    assert.is_true(y:abs():sum():item() > 0)
  end)

  it('prints a table with a header, one line an op and the totals', function()
    prof.ops(true)
    local _ = ms.randn({ 3, 3 }) + 1
    local text = prof.ops_report('a test', true)
    prof.ops(false)
    assert.truthy(text:find('a test (rank 0)', 1, true))
    assert.truthy(text:find('\n  op ', 1, true))
    assert.truthy(text:find('\n  add ', 1, true))
    assert.truthy(text:find('\n  total ', 1, true))
    assert.are.same({}, (prof.ops_rows()), 'the report with reset clears')
  end)
end)

describe('the collective trace\'s times #mpi', function()
  if os.getenv('OMPI_COMM_WORLD_SIZE') == nil then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  local dist = ms.dist
  setup(function() dist.init { backend = 'mpi', timeout = 120 } end)
  teardown(function() dist.destroy() end)

  local function step()
    local t = ms.randn({ 1001 })
    dist.all_reduce(t, 'sum')
    local out = ms.empty({ 1001 * dist.world_size() })
    dist.all_gather_into(out, t)
    dist.all_reduce(t, 'max', { async = true }):wait()
  end

  it('with times: every row and total has ms >= 0, and the table an ms column', function()
    dist.trace(true, { times = true })
    step()
    local rows, totals = dist.trace_rows()
    local text = dist.trace_report('timed')
    dist.trace(false)
    assert.is_true(#rows >= 2)
    for _, r in ipairs(rows) do
      assert.are.equal('number', type(r.ms), r.kind)
      assert.is_true(r.ms >= 0, r.kind)
    end
    assert.is_true(totals.all.ms >= 0)
    assert.truthy(text:find(' ms ', 1, true))
    assert.truthy(text:find('ms; peak live', 1, true))
  end)

  it('without: no ms in the rows or the table', function()
    dist.trace(true)
    step()
    local rows, totals = dist.trace_rows()
    local text = dist.trace_report('untimed')
    dist.trace(false)
    assert.is_true(#rows >= 2)
    for _, r in ipairs(rows) do assert.is_nil(r.ms, r.kind) end
    assert.is_nil(totals.all.ms)
    assert.falsy(text:find(' ms ', 1, true))
  end)
end)
