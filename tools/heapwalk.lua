-- tools/heapwalk.lua — what holds an object: a breadth-first walk of the
-- Lua heap from the registry, _G and the caller's stack (tables, closures'
-- upvalues, function environments, coroutines' stacks, userdata), giving
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
  local q, head = {}, 1
  local found = {}
  local function push(x, par, lab)
    local tx = type(x)
    if tx ~= 'table' and tx ~= 'function' and tx ~= 'thread' and tx ~= 'userdata' and tx ~= 'cdata' then return end
    if seen[x] or (skip and skip[x]) then return end
    seen[x] = true
    parent[x], label[x] = par, lab
    if want(x) then found[#found + 1] = x end
    if tx ~= 'cdata' then q[#q + 1] = x end
  end
  push(debug.getregistry(), nil, 'REGISTRY')
  push(_G, nil, '_G')
  for level = 2, 60 do
    local info = debug.getinfo(level, 'Sl')
    if not info then break end
    for i = 1, 200 do
      local n, v = debug.getlocal(level, i)
      if not n then break end
      push(v, nil, ('stack%d(%s:%d).%s'):format(level, info.short_src, info.currentline or 0, n))
    end
  end
  while head <= #q do
    local x = q[head]; head = head + 1
    local tx = type(x)
    if tx == 'table' then
      local mt = getmetatable(x)
      if mt then push(mt, x, '<mt>') end
      local mode = mt and rawget(mt, '__mode') or ''
      for k, v in next, x do
        if not mode:find('k') then push(k, x, '<key>') end
        if not mode:find('v') then push(v, x, tostring(k):sub(1, 40)) end
      end
    elseif tx == 'function' then
      for i = 1, 255 do
        local n, v = debug.getupvalue(x, i)
        if not n then break end
        push(v, x, '^' .. n)
      end
      local env = getfenv(x)
      if env then push(env, x, '<env>') end
    elseif tx == 'thread' then
      for level = 0, 60 do
        local ok, info = pcall(debug.getinfo, x, level, 'Sl')
        if not ok or not info then break end
        for i = 1, 200 do
          local n, v = debug.getlocal(x, level, i)
          if not n then break end
          push(v, x, ('co%d.%s'):format(level, n))
        end
      end
    elseif tx == 'userdata' then
      local mt = getmetatable(x)
      if mt then push(mt, x, '<mt>') end
      local env = debug.getfenv(x)
      if env then push(env, x, '<env>') end
    end
  end
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
