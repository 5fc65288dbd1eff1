-- bench/pp_schedules.lua — the pipeline schedules' step in pp_order's
-- simulation (no GPU): makespan in F units of a whole stage, the bubble
-- (the share of S makespans not spent computing: exposed communication
-- counts as lost) and the most stage-activations a rank holds, for
-- 1f1b, zbh1, zbv and dualpipev (run in turn, as ms.pp runs its pairs, and
-- as DeepSeek runs them: a pair's F, B and W one unit, each's
-- communication under the other's compute), uniform stages, exchanges
-- between stages free. Two cost models:
--   dense: F = B = W (a stage's forward, input-gradient and weight-gradient passes);
--   moe:   the same compute, plus an expert all-to-all inside each F and
--          each B (comm_f = comm_b = --comm x F; DeepSeek-V3 reports
--          cross-node expert parallelism near 1:1 compute to
--          communication), exposed unless a pair hides it; W has none.
--
--   luajit bench/pp_schedules.lua [--stages 4] [--microbatches 8,16] [--comm 1]
package.path = './lua/?.lua;./lua/?/init.lua;./?.lua;' .. package.path
local O = require 'moonshard.pp_order'

local o = { stages = 4, microbatches = '8,16', comm = 1 }
local i = 1
while i <= #arg do
  local k = arg[i]:match('^%-%-(.+)$')
  if k and o[k] and arg[i + 1] and (k == 'microbatches' and arg[i + 1]:match('^[%d,]+$') or tonumber(arg[i + 1])) then
    o[k] = k == 'microbatches' and arg[i + 1] or tonumber(arg[i + 1])
    i = i + 1
  else
    error('usage: luajit bench/pp_schedules.lua [--stages S] [--microbatches M1,M2,..] [--comm C]; got '
      .. tostring(arg[i]), 0)
  end
  i = i + 1
end
local S = o.stages
local models = {
  { 'dense (F = B = W)', {} },
  { ('moe (F = B = W, all-to-all %g x F in each F and B)'):format(o.comm), { comm_f = o.comm, comm_b = o.comm } },
}
local runs = {
  { '1f1b', '1f1b' }, { 'zbh1', 'zbh1' }, { 'zbv', 'zbv' },
  { 'dualpipev', 'dualpipev, pairs in turn (ms.pp)' },
  { 'dualpipev', 'dualpipev, pairs overlapped (DeepSeek)', overlap = true },
}
for M in o.microbatches:gmatch('%d+') do
  M = tonumber(M)
  for _, cm in ipairs(models) do
    print(('\n%d stages, %d micro-batches, %s\n'):format(S, M, cm[1]))
    print('| schedule | step (F units) | bubble | most activations a rank holds (stages x micro-batches) |')
    print('| --- | --- | --- | --- |')
    for _, r in ipairs(runs) do
      local lo = O.microbatch_rule(r[1], S)
      if M < lo then
        print(('| %s | needs %d micro-batches |  |  |'):format(r[2], lo))
      else
        local opts = { overlap = r.overlap }
        for k, v in pairs(cm[2]) do opts[k] = v end
        local res = O.simulate(r[1], S, M, opts)
        local peak = {}
        for s = 1, S do peak[s] = ('%g'):format(res.peak[s]) end
        print(('| %s | %.1f | %.3f | %s |'):format(r[2], res.makespan, res.bubble, table.concat(peak, ' ')))
      end
    end
  end
end
