-- moonshard.trace_pins — what LuaJIT's compiled traces keep alive. A trace
-- is specialised on the values it read through constant paths (a closure it
-- called, a closure's upvalue that never changes, a table it indexed from
-- such an upvalue): they become its GC constants, and a trace marks its
-- constants for as long as it lives. With a machine-code area that holds a
-- whole step (tensor.lua's maxmcode) the traces live across steps, so a
-- closure made in step k and recorded into a trace, with the tensors its
-- upvalues hold, outlives step k (docs/tensors.md, "Compiled traces keep
-- what they were specialised on").
--
--   local TP = require 'moonshard.trace_pins'
--   print((TP.pins_report()))  -- the tensors only traces keep, by site
--   print(TP.report(TP.scan())) -- the closures traces hold, by site
--   TP.pinned_bytes()          -- live bytes a jit.flush() gives back (flushes!)
--
-- pins() -> sites, n, bytes: the tensors reached from the traces' GC
-- constants (through closures' upvalues and tables) and not from the
-- registry, the globals or the caller's stack; sites[site] = { tensors,
-- bytes, path } by the constant that reaches them (site "closure
-- file:line", "table in trace N" or "cdata in trace N"; path: the first
-- tensor's, with its shape). scan() -> { traces, closures = { [file:line]
-- = { n, traces } }, tensors (the tensors that are constants themselves),
-- tables }: a site with n > 1 is a closure made again and again that the
-- traces hold several of. bin/train calls step() at each step's end when
-- MS_TRACE_PINS is set (below).
local jutil = require 'jit.util'
local M = {}

-- (none of this module is compiled: its own traces would hold its walks'
-- tables, every tensor among their keys, and count themselves)
jit.off(true, true)

local ok_ms, T = pcall(require, 'moonshard.tensor')
local is_tensor = ok_ms and T.is_tensor or function() return false end
local C = ok_ms and T.C or nil

-- bytes of t's storage (what freeing its last handle would give back); only
-- for a tensor some Lua object holds (a trace's own cdata constant may be a
-- handle C has freed since: not read)
local function tensor_bytes(t)
  local st = t.storage
  if st == nil then return 0 end
  return tonumber(st.nbytes)
end

-- the live bytes (CPU and CUDA) after two full collections (finalizers, then
-- what they released)
function M.live()
  collectgarbage(); collectgarbage()
  if not C then return 0 end
  return tonumber(C.ms_live_bytes(-1)) + tonumber(C.ms_live_bytes(0))
end

-- the live bytes a jit.flush() gives back (traces dropped: the next calls
-- record them again) -> pinned, before, after
function M.pinned_bytes()
  local before = M.live()
  jit.flush()
  local after = M.live()
  return before - after, before, after
end

-- each live trace's GC constants: fn(k, trace) for every one
-- where a Lua function was defined: "file:line", the file as loaded
local function where(f)
  local fi = jutil.funcinfo(f)
  if not fi.source then return nil end
  local file = fi.source:gsub('^@', ''):gsub('^.*/(lua/)', '%1'):gsub('^.*/(models/)', '%1'):gsub('^%./', '')
  return ('%s:%d'):format(file, fi.linedefined)
end
M.where = where

local function each_constant(fn)
  local n = 0
  for tr = 1, 65535 do
    local info = jutil.traceinfo(tr)
    if info then
      n = n + 1
      for idx = -info.nk, -1 do   -- (nk: how many constants, at -nk .. -1)
        local k, t = jutil.tracek(tr, idx)
        if t ~= nil and (type(k) == 'function' or type(k) == 'table' or type(k) == 'cdata') then fn(k, tr) end
      end
    elseif tr > 8192 then
      break
    end
  end
  return n
end

function M.scan()
  local r = { closures = {}, tensors = {}, tables = 0 }
  local seen_fn, seen_tab = {}, {}
  r.traces = each_constant(function(k, tr)
    local tk = type(k)
    if tk == 'function' then
      local loc = where(k)
      if loc then   -- a Lua closure (built-ins have no source)
        local e = r.closures[loc]
        if not e then e = { n = 0, traces = {} }; r.closures[loc] = e end
        if not seen_fn[k] then seen_fn[k] = true; e.n = e.n + 1 end
        e.traces[tr] = true
      end
    elseif tk == 'cdata' then
      if is_tensor(k) then r.tensors[k] = true end
    elseif tk == 'table' and not seen_tab[k] then
      seen_tab[k] = true
      r.tables = r.tables + 1
    end
  end)
  return r
end

-- walk(seeds, seen, skip, visit): a breadth-first walk of the Lua heap
-- from seeds (a list of { object, label }) through tables (keys, values and
-- metatables, weak parts left out), closures' upvalues and environments,
-- coroutines' stacks, userdata's metatables and environments; objects in
-- seen (marked as they are reached) or skip are not entered; visit(x,
-- label, from, parent) for each object reached first, from: the seed's
-- label, parent: the object it was reached through (nil for a seed). Also
-- tools/heapwalk.lua's walk.
local function walk(seeds, seen, skip, visit)
  local q, from, head = {}, {}, 1
  local x
  local function push(y, lab, src)
    local ty = type(y)
    if ty ~= 'table' and ty ~= 'function' and ty ~= 'thread' and ty ~= 'userdata' and ty ~= 'cdata' then return end
    if seen[y] or (skip and skip[y]) then return end
    seen[y] = true
    if visit then visit(y, lab, src, x) end
    if ty ~= 'cdata' then q[#q + 1] = y; from[#q] = src end
  end
  for _, s in ipairs(seeds) do push(s[1], s[2], s[2]) end
  while head <= #q do
    local src
    x, src = q[head], from[head]
    head = head + 1
    local tx = type(x)
    if tx == 'table' then
      local mt = getmetatable(x)
      if type(mt) == 'table' then push(mt, '<mt>', src) end
      local mode = type(mt) == 'table' and rawget(mt, '__mode') or ''
      if type(mode) ~= 'string' then mode = '' end
      local wk, wv = mode:find('k') ~= nil, mode:find('v') ~= nil
      for k, v in next, x do
        if not wk then push(k, '<key>', src) end
        if not wv then push(v, tostring(k), src) end
      end
    elseif tx == 'function' then
      for i = 1, 255 do
        local n, v = debug.getupvalue(x, i)
        if not n then break end
        push(v, '^' .. n, src)
      end
      local env = getfenv(x)
      if env then push(env, '<env>', src) end
    elseif tx == 'thread' then
      for level = 0, 200 do
        local ok, info = pcall(debug.getinfo, x, level, 'S')
        if not ok or not info then break end
        for i = 1, 250 do
          local n, v = debug.getlocal(x, level, i)
          if not n then break end
          push(v, n, src)
        end
      end
    elseif tx == 'userdata' then
      local mt = getmetatable(x)
      if type(mt) == 'table' then push(mt, '<mt>', src) end
      local env = debug.getfenv(x)
      if env then push(env, '<env>', src) end
    end
  end
end
M.walk = walk

-- the tensors only the traces keep alive: those reached from the traces'
-- GC constants (through closures' upvalues and tables) and not from the
-- registry, the globals or the caller's stack. -> { [site] = { tensors =
-- n, bytes = b } }, the tensors' count and bytes in all; site: where the
-- constant that reaches them was defined ("closure file:line", "table in
-- trace N", "tensor in trace N"; bytes of a tensor that is itself a
-- constant are not read, see tensor_bytes)
function M.pins()
  local seen = {}
  local roots = { { debug.getregistry(), 'registry' }, { _G, '_G' } }
  for level = 2, 200 do
    local info = debug.getinfo(level, 'S')
    if not info then break end
    for i = 1, 250 do
      local n, v = debug.getlocal(level, i)
      if not n then break end
      roots[#roots + 1] = { v, n }
    end
  end
  walk(roots, seen)
  local seeds, named = {}, {}
  each_constant(function(k, tr)
    if seen[k] or named[k] then return end
    local tk = type(k)
    local site
    if tk == 'function' then
      site = 'closure ' .. (where(k) or 'builtin')
    elseif tk == 'table' then
      site = 'table in trace ' .. tr
    else
      site = 'cdata in trace ' .. tr
    end
    named[k] = true
    seeds[#seeds + 1] = { k, site }
  end)
  local sites, n, bytes = {}, 0, 0
  local parent, label = {}, {}
  walk(seeds, seen, nil, function(x, lab, src, par)
    parent[x], label[x] = par, lab
    if type(x) == 'cdata' and is_tensor(x) then
      local e = sites[src]
      if not e then
        -- the first tensor's path from the constant, for the report
        local parts, y = {}, x
        while y ~= nil do
          local l = label[y]
          if type(y) == 'function' then l = l .. '{' .. (where(y) or 'builtin') .. '}' end
          table.insert(parts, 1, l)
          y = parent[y]
        end
        local what = ''
        if not named[x] and x.storage ~= nil then
          local dims = {}
          for i = 0, x.ndim - 1 do dims[#dims + 1] = tostring(tonumber(x.sizes[i])) end
          what = (' (%s, %s)'):format(table.concat(dims, 'x'), T.dtype_names[x.dtype_id] or tostring(x.dtype_id))
        end
        e = { tensors = 0, bytes = 0, path = table.concat(parts, ' / ') .. what }
        sites[src] = e
      end
      local b = named[x] and 0 or tensor_bytes(x)
      e.tensors, e.bytes = e.tensors + 1, e.bytes + b
      n, bytes = n + 1, bytes + b
    end
  end)
  return sites, n, bytes
end

-- pins() as text, the most bytes first
function M.pins_report()
  local sites, n, bytes = M.pins()
  local rows = {}
  for site, e in pairs(sites) do rows[#rows + 1] = { site, e.tensors, e.bytes } end
  table.sort(rows, function(a, b) return a[3] > b[3] or (a[3] == b[3] and a[1] < b[1]) end)
  local out = { ('%d tensors, %d bytes, kept alive by trace constants alone:'):format(n, bytes) }
  for _, row in ipairs(rows) do
    out[#out + 1] = ('  %5d tensors %10d bytes  %s'):format(row[2], row[3], row[1])
    out[#out + 1] = '        e.g. ' .. sites[row[1]].path
  end
  return table.concat(out, '\n'), n, bytes
end

-- the scan as text: the closures' definition sites with more than `min`
-- (default 1) objects held, most first, then the tensors
function M.report(r, min)
  min = min or 1
  local rows = {}
  for loc, e in pairs(r.closures) do
    if e.n > min then
      local nt = 0
      for _ in pairs(e.traces) do nt = nt + 1 end
      rows[#rows + 1] = { loc, e.n, nt }
    end
  end
  table.sort(rows, function(a, b) return a[2] > b[2] or (a[2] == b[2] and a[1] < b[1]) end)
  local out = { ('%d traces, %d constant tables; closures held more than %d times by definition site:'):format(
    r.traces, r.tables, min) }
  for _, row in ipairs(rows) do out[#out + 1] = ('  %5d closures in %4d traces  %s'):format(row[2], row[3], row[1]) end
  local nt = 0
  for _ in pairs(r.tensors) do nt = nt + 1 end
  out[#out + 1] = ('%d tensors are trace constants themselves'):format(nt)
  return table.concat(out, '\n')
end

-- bin/train's probe at each step's end, MS_TRACE_PINS set: two full
-- collections, then on stderr the live bytes and what the traces hold
-- ("[rank r] trace pins, step k: live B bytes; T traces hold N tensors, S
-- bytes"). MS_TRACE_PINS=flush flushes the traces first (the baseline:
-- nothing survives a step in a trace); MS_TRACE_PINS=sites adds the
-- closure definition sites the traces hold more than one object of.
local mode = os.getenv('MS_TRACE_PINS')
function M.step(step, rank)
  if mode == 'flush' then jit.flush() end
  local live = M.live()
  local text, n, bytes = M.pins_report()
  io.stderr:write(('[rank %d] trace pins, step %d: live %d bytes; traces alone keep %d tensors, %d bytes\n'):format(
    rank or 0, step, live, n, bytes))
  if mode == 'sites' then io.stderr:write(text, '\n', M.report(M.scan()), '\n') end
end

return M
