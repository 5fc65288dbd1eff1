-- tools/heapwalk.lua — what holds an object: a breadth-first walk of the
-- Lua heap from the registry, _G and the caller's stack (tables, closures'
-- upvalues, function environments, coroutines' stacks, userdata: the walk
-- of moonshard.trace_pins), giving
-- the shortest path to every object a predicate picks. For a tensor that
-- outlives what the program should hold:
--
--   local HW = dofile('tools/heapwalk.lua')
--   local old = HW.tensors_from({ model, opt }, ms.is_tensor)  -- a weak set
--   ...                                        -- later, when they should be gone
--   local paths, n = HW.paths(function(x) return old[x] end, { [old] = true })
--   for _, p in ipairs(paths) do print(p) end  -- e.g. "_G / cache / 3 / grad"
--
-- A tensor that nothing here reaches but the collector keeps may be a
-- constant of a compiled trace: jit.flush() releases it (docs/tensors.md).
local M = {}
-- paths(want, skip, maxn) -> up to maxn (10) path strings, and how many
-- objects want(x) picked; skip: a set of objects not to walk into
function M.paths(want, skip, maxn)
  local parent, label = {}, {}
  local seen = setmetatable({}, { __mode = 'k' })
  local found = {}
  local seeds = { { debug.getregistry(), 'REGISTRY' }, { _G, '_G' } }
  for level = 2, 60 do
    local info = debug.getinfo(level, 'Sl')
    if not info then break end
    for i = 1, 200 do
      local n, v = debug.getlocal(level, i)
      if not n then break end
      seeds[#seeds + 1] = { v, ('stack%d(%s:%d).%s'):format(level, info.short_src, info.currentline or 0, n) }
    end
  end
  -- (moonshard.trace_pins' walk: the same edges as its pins())
  require('moonshard.trace_pins').walk(seeds, seen, skip, function(x, lab, _, par)
    parent[x], label[x] = par, par == nil and lab or lab:sub(1, 40)   -- (a key's, cut short)
    if want(x) then found[#found + 1] = x end
  end)
  local out = {}
  for i = 1, math.min(#found, maxn or 10) do
    local x, parts = found[i], {}
    while x ~= nil do
      local lab = label[x]
      local d = type(x) == 'function' and (function() local inf = debug.getinfo(x, 'S'); return ('fn@%s:%d'):format(inf.short_src, inf.linedefined) end)() or nil
      table.insert(parts, 1, d and (lab .. '{' .. d .. '}') or lab)
      x = parent[x]
    end
    out[#out + 1] = table.concat(parts, ' / ')
  end
  return out, #found
end

-- tensors_from(roots, is_tensor) -> a weak-keyed set of every tensor the
-- roots reach (through tables and upvalues)
function M.tensors_from(roots, is_tensor)
  local set = setmetatable({}, { __mode = 'k' })
  local seen = {}
  local stack = {}
  for _, r in ipairs(roots) do stack[#stack + 1] = r end
  while #stack > 0 do
    local x = table.remove(stack)
    local tx = type(x)
    if (tx == 'table' or tx == 'function' or tx == 'cdata') and not seen[x] then
      seen[x] = true
      if tx == 'cdata' then
        if is_tensor(x) then set[x] = true end
      elseif tx == 'table' then
        local mt = getmetatable(x)
        if mt then stack[#stack + 1] = mt end
        for k, v in next, x do stack[#stack + 1] = k; stack[#stack + 1] = v end
      else
        for i = 1, 255 do
          local n, v = debug.getupvalue(x, i)
          if not n then break end
          stack[#stack + 1] = v
        end
      end
    end
  end
  return set
end
return M
