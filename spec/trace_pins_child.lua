-- The in-process cases of spec/trace_pins_spec.lua, each run in a fresh
-- luajit (`luajit spec/trace_pins_child.lua probe|nn` from the repository's
-- root): what the JIT compiles and specialises on depends on the
-- process's history, so these need one of their own. Errors on a failed
-- check (exit status 1, the message on stderr); prints
-- "trace_pins_child CASE: passed" otherwise.
package.path = './lua/?.lua;./lua/?/init.lua;./?.lua;' .. package.path
local ms = require 'moonshard'
local TP = require 'moonshard.trace_pins'

local function check(cond, msg) if not cond then error(msg, 2) end end
local function count(weak)
  local n = 0
  for _ in pairs(weak) do n = n + 1 end
  return n
end

local cases = {}

-- the probe finds a tensor only a trace keeps (a closure's upvalue, the
-- closure a trace was specialised on), names the closure's definition
-- site, and a flush gives it back
function cases.probe()
  check(jit.status(), 'the JIT is off')
  -- a closure over a fresh random tensor, which goes into weak
  local function closure_over_tensor(weak)
    local t = ms.rand({ 1000 }, { seed = 7 })
    weak[t] = true
    return function(i) return i + t.ndim end
  end
  -- calls f in a loop long enough to be compiled (a trace specialised on f)
  local function hot_calls(f)
    local s = 0
    for i = 1, 2000 do s = s + f(i) end
    return s
  end
  jit.flush()
  local weak = setmetatable({}, { __mode = 'k' })
  local got = hot_calls(closure_over_tensor(weak))
  check(got == 2000 * 2001 / 2 + 2000, ('hot_calls gave %s'):format(got))
  local before = TP.live()
  check(count(weak) == 1, 'the trace did not keep its closure\'s tensor')
  local sites, n, bytes = TP.pins()
  check(n >= 1 and bytes >= 4000, ('%d tensors, %d bytes'):format(n, bytes))
  local found
  for site, e in pairs(sites) do
    if site:find('spec/trace_pins_child.lua:', 1, true) then found = e end
  end
  check(found, 'no site in this file among the pins')
  check(found.bytes >= 4000, ('the site holds %d bytes'):format(found.bytes))
  local pinned = TP.pinned_bytes()
  check(pinned >= 4000, ('a flush gave back %d bytes'):format(pinned))
  check(count(weak) == 0, 'the tensor outlived the flush')
  local after = TP.live()
  check(after <= before - 4000, ('live bytes %d before the flush, %d after'):format(before, after))
end

-- nn.Module's iterators leave no model behind in traces
function cases.nn()
  local nn = ms.nn
  local weak = setmetatable({}, { __mode = 'k' })
  local function walk_once()
    local layers = {}
    for i = 1, 40 do layers[i] = nn.Linear(3, 3) end
    local m = nn.Sequential(unpack(layers))
    m:register_buffer('scale', ms.rand({ 256 }, { seed = 1 }))
    for _, p in m:named_parameters() do weak[p] = true end
    for _, p in m:named_buffers() do weak[p] = true end
    local n = 0
    for _, p in m:named_parameters() do n = n + p:numel() end
    for _, p in ipairs(m:parameters()) do n = n + p:numel() end
    for _, b in m:named_buffers() do n = n + b:numel() end
    for _, c in m:named_modules() do n = n + (c.weight and 1 or 0) end
    for c in m:modules() do n = n + (c.weight and 1 or 0) end
    for _, c in m:named_children() do n = n + (c.bias and 1 or 0) end
    for c in m:children() do n = n + (c.bias and 1 or 0) end
    return n
  end
  local n = walk_once()
  check(n == 2 * 40 * 12 + 256 + 4 * 40, ('walk_once gave %d'):format(n))
  TP.live()
  local left = count(weak)
  local text = left > 0 and TP.pins_report() or ''
  jit.flush()
  TP.live()
  check(left == 0, ('%d of the model\'s tensors outlived it: %s'):format(left, text))
end

local case = arg[1]
if not cases[case] then
  io.stderr:write('usage: luajit spec/trace_pins_child.lua probe|nn\n')
  os.exit(2)
end
local ok, err = pcall(cases[case])
if not ok then
  io.stderr:write(('trace_pins_child %s: %s\n'):format(case, tostring(err)))
  os.exit(1)
end
print(('trace_pins_child %s: passed'):format(case))
