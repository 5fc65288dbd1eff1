-- moonshard.repl — the logic of bin/repl, testable without a terminal.
--
--   local R = require 'moonshard.repl'
--   local r = R.new{ env = _G, out = io.stdout }
--   r:feed('1 + 2')              --> prints "3", returns 'done'
--   r:feed('function f(x)')      --> 'more' (an incomplete chunk: prompt '>> ')
--   r:feed('return x * 2')       --> 'more'
--   r:feed('end')                --> 'done'
--   R.complete('ms.zer', '', _G) --> { 'ms.zeros', 'ms.zeros_like' }
--   R.incomplete('if x then')    --> true
--
-- A line is first compiled as `return <line>` (an expression: its values are
-- printed, tab-separated) and then as a statement. A chunk whose compile error
-- ends at '<eof>' is incomplete: more lines are read. A trailing `;` silences
-- the printing. Errors print their message and a traceback trimmed of the
-- REPL's own frames; the session goes on. Tensors print through tostring
-- (moonshard.tensor's PyTorch-like format), tables shallowly with a bound.
local R = {}
R.__index = R

local loadstring = loadstring or load

-- --------------------------------------------------------------- chunks

-- true when a compile error says only that the chunk ended too early (an
-- unfinished short string is an error at once: it cannot span lines)
function R.eof_error(err)
  return err:sub(-7) == "'<eof>'" and not err:find('unfinished string', 1, true)
end

-- true when `src` cannot compile only because it ends too early
function R.incomplete(src)
  local f, err = loadstring(src, '=stdin')
  if f then return false end
  return R.eof_error(err)
end

-- Compiles a chunk typed at the prompt. Returns fn, nil (ready); nil,
-- 'incomplete'; nil, message (a syntax error). `quiet`: a trailing ';'.
function R.compile(src)
  local stripped = src:gsub('%s+$', '')
  local quiet = stripped:sub(-1) == ';'
  local expr = quiet and stripped:sub(1, -2) or src
  local f = loadstring('return ' .. expr, '=stdin')
  if f then return f, nil, not quiet end
  local err
  f, err = loadstring(src, '=stdin')
  if f then return f, nil, false end
  if R.eof_error(err) then return nil, 'incomplete' end
  return nil, err
end

-- ------------------------------------------------------------- printing

local function is_tensor(v)
  if type(v) ~= 'cdata' then return false end
  local okT, T = pcall(require, 'moonshard.tensor')
  return okT and T.is_tensor(v)
end

local function is_ident(s) return type(s) == 'string' and s:match('^[%a_][%w_]*$') ~= nil end

local function short(v)
  local tv = type(v)
  if tv == 'string' then return ('%q'):format(v):gsub('\\\n', '\\n') end
  if tv == 'table' then
    local mt = getmetatable(v)
    if mt and mt.__tostring then return tostring(v) end
    return next(v) == nil and '{}' or '{...}'
  end
  if is_tensor(v) then
    local okS, shape = pcall(function() return v.shape end)
    if okS then
      return ('tensor(shape=(%s), dtype=%s, device=%s)'):format(table.concat(shape, ', '), v.dtype, v.device)
    end
  end
  return tostring(v)
end

-- one level of a table: `{1, 2, x = 'a', y = {...}}`, at most `bound` entries
function R.format_table(t, bound)
  bound = bound or 30
  local parts, n = {}, #t
  for i = 1, math.min(n, bound) do parts[#parts + 1] = short(t[i]) end
  local keys = {}
  for k in pairs(t) do
    if not (type(k) == 'number' and k >= 1 and k <= n and k == math.floor(k)) then keys[#keys + 1] = k end
  end
  table.sort(keys, function(a, b)
    if type(a) == type(b) and (type(a) == 'string' or type(a) == 'number') then return a < b end
    return type(a) < type(b)
  end)
  local total = n + #keys
  for _, k in ipairs(keys) do
    if #parts >= bound then break end
    local ks = is_ident(k) and k or ('[' .. short(k) .. ']')
    parts[#parts + 1] = ks .. ' = ' .. short(t[k])
  end
  if total > #parts then parts[#parts + 1] = ('... (%d more)'):format(total - #parts) end
  return '{' .. table.concat(parts, ', ') .. '}'
end

function R.format_value(v)
  if type(v) == 'table' then
    local mt = getmetatable(v)
    if mt and mt.__tostring then return tostring(v) end
    return R.format_table(v)
  end
  return tostring(v)
end

-- ---------------------------------------------------------------- errors

-- The traceback of an error in user code, without the REPL's own frames
-- (everything from the xpcall that ran the chunk down).
function R.traceback(msg, level)
  local tb = debug.traceback(tostring(msg), (level or 1) + 1)
  local out = {}
  for l in tb:gmatch('[^\n]+') do
    if l:find("in function 'xpcall'", 1, true) or l:find('moonshard/repl.lua', 1, true) then break end
    if not l:find('bin/repl:', 1, true) then out[#out + 1] = l end
  end
  if #out == 2 and out[2]:match('^stack traceback:') then out[2] = nil end
  return table.concat(out, '\n')
end

-- ------------------------------------------------------------- a session

-- opts: env (the globals, default _G), out (a file, default io.stdout),
-- err (default out), hook (function run before each chunk, e.g. to arm an
-- interrupt check; returns a function run after it), interpreted (chunks
-- typed at the prompt run with the JIT off for them, so that hook can stop
-- their loops)
function R.new(opts)
  opts = opts or {}
  local r = setmetatable({}, R)
  r.env = opts.env or _G
  r.out = opts.out or io.stdout
  r.err = opts.err or r.out
  r.hook = opts.hook
  r.interpreted = opts.interpreted
  r.buffer = nil
  r.errors = 0
  return r
end

local function pack(...) return { n = select('#', ...), ... } end

function R:write(s) self.out:write(s, '\n'); self.out:flush() end

-- runs fn(...) in the session; prints values when `show`; returns ok
function R:run(fn, show, ...)
  if setfenv then setfenv(fn, self.env) end
  local after = self.hook and self.hook()
  local res = pack(xpcall(fn, function(e) return R.traceback(e, 2) end, ...))
  local nres = res.n
  if after then after() end
  if not res[1] then
    self.errors = self.errors + 1
    self.err:write(tostring(res[2]), '\n')
    self.err:flush()
    return false
  end
  if show and nres > 1 then
    local parts = {}
    for i = 2, nres do
      local okf, s = pcall(R.format_value, res[i])
      parts[#parts + 1] = okf and s or ('<cannot print: ' .. tostring(s) .. '>')
    end
    self:write(table.concat(parts, '\t'))
  end
  return true
end

-- Takes one line. Returns 'more' when the chunk is incomplete (the next
-- prompt is '>> '), else 'done' (after running or reporting the chunk).
function R:feed(line)
  local src = self.buffer and (self.buffer .. '\n' .. line) or line
  if not self.buffer and src:match('^%s*=') then src = src:gsub('^%s*=', '', 1) end   -- `= x` as in lua 5.1
  local fn, err, expr = R.compile(src)
  if err == 'incomplete' then
    self.buffer = src
    return 'more'
  end
  self.buffer = nil
  -- typed code stays in the interpreter, where the interrupt hook can stop it
  -- (JIT-compiled loops never call hooks); functions from files still compile
  if fn and self.interpreted and jit then jit.off(fn, true) end
  if not fn then
    self.errors = self.errors + 1
    self.err:write(err, '\n')
    self.err:flush()
    return 'done'
  end
  self:run(fn, expr)
  return 'done'
end

-- forgets a partly typed chunk (Ctrl-C at the '>> ' prompt)
function R:reset() self.buffer = nil end

function R:prompt() return self.buffer and '>> ' or '> ' end

-- runs a script file with `args` (a list): arg = {[0] = path, ...}, `...`
function R:dofile(path, args)
  args = args or {}
  local fn, err = loadfile(path)
  if not fn then
    self.errors = self.errors + 1
    self.err:write(err, '\n')
    return false
  end
  local a = { [0] = path }
  for i, v in ipairs(args) do a[i] = v end
  self.env.arg = a
  return self:run(fn, false, unpack(args))
end

-- ------------------------------------------------------------ completion

local keywords = {
  'and', 'break', 'do', 'else', 'elseif', 'end', 'false', 'for', 'function', 'goto',
  'if', 'in', 'local', 'nil', 'not', 'or', 'repeat', 'return', 'then', 'true', 'until', 'while',
}

-- the fields a value offers after '.' (method = false) or ':' (method = true)
local function fields(v, method)
  local out, seen = {}, {}
  local function add(k, val)
    if type(k) == 'string' and is_ident(k) and not seen[k] then
      if not method or type(val) == 'function' or val == true then
        seen[k] = true
        out[#out + 1] = k
      end
    end
  end
  if is_tensor(v) then
    local T = require 'moonshard.tensor'
    for k, f in pairs(T.methods) do add(k, f) end
    if not method then for k in pairs(T.props or {}) do add(k, true) end end
    return out
  end
  local depth = 0
  local t = v
  while t ~= nil and depth < 8 do
    depth = depth + 1
    if type(t) == 'table' then
      for k, val in pairs(t) do add(k, val) end
    end
    local mt = getmetatable(t)
    if type(mt) ~= 'table' then break end
    local idx = rawget(mt, '__index')
    if type(idx) ~= 'table' then break end
    t = idx
  end
  return out
end

-- walks `a.b.c` from env; nil when a link is missing or not indexable
local function resolve(path, env)
  local v = env
  for name in path:gmatch('[^%.:]+') do
    if type(v) ~= 'table' and not is_tensor(v) then return nil end
    local okg, nv = pcall(function() return v[name] end)
    if not okg or nv == nil then return nil end
    v = nv
  end
  return v
end

-- true when `line` (the text before the word) ends inside a string literal
function R.in_string(line)
  local q, i, n = nil, 1, #line
  while i <= n do
    local c = line:sub(i, i)
    if q then
      if c == '\\' then i = i + 1
      elseif c == q then q = nil end
    elseif c == '"' or c == "'" then q = c
    elseif c == '-' and line:sub(i, i + 1) == '--' then return false
    end
    i = i + 1
  end
  return q ~= nil
end

-- entries of a directory: names, directories with a trailing '/'
function R.list_dir(dir)
  local p = io.popen("ls -1Ap -- '" .. dir:gsub("'", "'\\''") .. "' 2>/dev/null")
  if not p then return {} end
  local out = {}
  for l in p:lines() do out[#out + 1] = l end
  p:close()
  return out
end

local function complete_path(text)
  local dir, base = text:match('^(.*/)([^/]*)$')
  if not dir then dir, base = '', text end
  local real = dir == '' and '.' or dir
  if real:sub(1, 2) == '~/' then real = (os.getenv('HOME') or '~') .. real:sub(2) end
  local out = {}
  for _, name in ipairs(R.list_dir(real)) do
    if name:sub(1, #base) == base and (base:sub(1, 1) == '.' or name:sub(1, 1) ~= '.') then
      out[#out + 1] = dir .. name
    end
  end
  table.sort(out)
  return out
end

-- Completions of `text` (readline's word) given `before` (the line before
-- it) and the globals `env`: a list of replacements for the whole of `text`.
function R.complete(text, before, env)
  env = env or _G
  before = before or ''
  if R.in_string(before) then return complete_path(text) end
  -- the expression being completed: the trailing name chain of the word
  local head, chain = text:match('^(.-)([%a_][%w_%.:]*)$')
  if not chain then
    head, chain = text:match('^(.-)([%a_][%w_%.:]*[%.:])$')
    if not chain then return {} end
  end
  local out = {}
  local base, sep, partial = chain:match('^(.*)([%.:])([%w_]*)$')
  if base then
    if base == '' or base:find('[%.:]$') or base:find(':', 1, true) then return {} end
    local v = resolve(base, env)
    if v == nil then return {} end
    for _, k in ipairs(fields(v, sep == ':')) do
      if k:sub(1, #partial) == partial then out[#out + 1] = head .. base .. sep .. k end
    end
  else
    local seen = {}
    for _, k in ipairs(fields(env, false)) do
      if k:sub(1, #chain) == chain then seen[k] = true; out[#out + 1] = head .. k end
    end
    for _, k in ipairs(keywords) do
      if k:sub(1, #chain) == chain and not seen[k] then out[#out + 1] = head .. k end
    end
  end
  table.sort(out)
  return out
end

return R
