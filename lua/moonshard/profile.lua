-- moonshard.profile — the op counter (docs/tensors.md, "Counting the ops"):
-- while on, every op of the core that writes a tensor counts itself, by op
-- name and device: calls, elements and bytes written (core/prof.h). Copies
-- are named by what asked for them (copy_, contiguous, clone, to); views
-- (narrow, transpose, view, ...) write nothing and are not counted. The
-- autograd's backward runs the same ops, so they count too; a call of an op
-- with several outputs (attention: out and lse) counts once, its elements
-- and bytes are all its outputs'.
--
--   local prof = require 'moonshard.profile'   -- (also ms.profile)
--   prof.ops(true)                             -- clears the counts, counts from here
--   ...forward, backward...
--   print(prof.ops_report('one step'))         -- or prof.ops_rows()
--   prof.ops(false)
--
-- MS_OP_COUNT=1 turns it on at load, and bin/train then prints each step's
-- table on stderr (prof.ops_step, beside dist.trace_step). Off, an op pays
-- one test of an int in C. What the core does not see is not counted: a
-- collective's own copies inside NCCL or MPI (dist.trace counts those), and
-- kernels a fused op launches inside itself (flce's chunks: one flce call).
local ffi = require 'ffi'
local T = require 'moonshard.tensor'
local C = T.C

local P = {}

-- prof.ops(on) -> the previous setting; on: the counts cleared first
function P.ops(on)
  local prev = C.ms_prof_enabled() ~= 0
  if on then C.ms_prof_reset() end
  C.ms_prof_enable(on and 1 or 0)
  return prev
end
function P.counting() return C.ms_prof_enabled() ~= 0 end

local name_buf = ffi.new('char[64]')
local dev_box, calls_box = ffi.new('int[1]'), ffi.new('int64_t[1]')
local elems_box, bytes_box = ffi.new('int64_t[1]'), ffi.new('int64_t[1]')

local function device_name(d) return d < 0 and 'cpu' or ('cuda:' .. d) end

-- prof.ops_rows(reset) -> rows in first-call order ({ op, device, calls,
-- elems, bytes }; device 'cpu' or 'cuda:N') and totals { calls, elems,
-- bytes }; reset: the counts cleared after (one step's at a time)
function P.ops_rows(reset)
  local rows, totals = {}, { calls = 0, elems = 0, bytes = 0 }
  for i = 0, C.ms_prof_count() - 1 do
    T.check(C.ms_prof_entry(i, name_buf, 64, dev_box, calls_box, elems_box, bytes_box), 2)
    local r = { op = ffi.string(name_buf), device = device_name(dev_box[0]), calls = tonumber(calls_box[0]),
                elems = tonumber(elems_box[0]), bytes = tonumber(bytes_box[0]) }
    rows[#rows + 1] = r
    totals.calls, totals.elems, totals.bytes = totals.calls + r.calls, totals.elems + r.elems, totals.bytes + r.bytes
  end
  if reset then C.ms_prof_reset() end
  return rows, totals
end

-- prof.ops_report(title, reset) -> the counts as a text table (the most
-- bytes first), the totals last
function P.ops_report(title, reset)
  local rows, totals = P.ops_rows(reset)
  table.sort(rows, function(a, b)
    if a.bytes ~= b.bytes then return a.bytes > b.bytes end
    if a.op ~= b.op then return a.op < b.op end
    return a.device < b.device
  end)
  local dist = require 'moonshard.dist'
  local out = { ('%s (rank %d)'):format(title or 'op count', dist.is_initialized() and dist.rank() or 0),
    ('  %-28s %-7s %7s %14s %14s'):format('op', 'device', 'calls', 'elements', 'bytes') }
  for _, r in ipairs(rows) do
    out[#out + 1] = ('  %-28s %-7s %7d %14d %14d'):format(r.op, r.device, r.calls, r.elems, r.bytes)
  end
  out[#out + 1] = ('  total %-28s %7d %14d %14d'):format('', totals.calls, totals.elems, totals.bytes)
  return table.concat(out, '\n')
end

-- bin/train's step end: with the counter on, step k's table on stderr and
-- the counts cleared
function P.ops_step(k)
  if C.ms_prof_enabled() == 0 then return end
  io.stderr:write(P.ops_report(('op count, step %s'):format(tostring(k)), true), '\n')
end

if os.getenv('MS_OP_COUNT') == '1' then P.ops(true) end

return P
