-- bin/repl: the logic (lua/moonshard/repl.lua) tested directly, the pipe and
-- -e modes through a process, and the interactive REPL through a
-- pseudo-terminal: tmux on a private socket, the screen polled with a bounded
-- wait, the server killed after each test.
local ffi = require 'ffi'
local T = require 'moonshard.tensor'
local R = require 'moonshard.repl'

local root = T.root or '.'
if root:sub(1, 1) ~= '/' then
  local p = io.popen('cd ' .. "'" .. root:gsub("'", "'\\''") .. "'" .. ' && pwd')
  root = p:read('*l') or root
  p:close()
end

pcall(ffi.cdef, [[
int ms_repl_spec_poll(void *, unsigned long, int) asm("poll");
int ms_repl_spec_getpid(void) asm("getpid");
]])
local function sleep_ms(ms) ffi.C.ms_repl_spec_poll(nil, 0, ms) end
local function now()
  local p = io.popen('date +%s.%N')
  local s = tonumber(p:read('*l'))
  p:close()
  return s
end
local q = require('spec.support').shell_quote

local function run(cmd)
  local p = assert(io.popen('cd ' .. q(root) .. ' && ' .. cmd .. ' 2>&1; echo "__exit $?"'))
  local out = p:read('*a')
  p:close()
  local code = tonumber(out:match('__exit (%d+)%s*$'))
  return (out:gsub('__exit %d+%s*$', '')), code
end

-- a buffer that collects what the REPL writes
local function sink()
  local s = { text = '' }
  function s:write(...) for _, v in ipairs({ ... }) do self.text = self.text .. tostring(v) end end
  function s:flush() end
  return s
end

describe('repl chunks', function()
  it('knows an incomplete chunk from a finished or a wrong one', function()
    assert.is_true(R.incomplete('function f(x)'))
    assert.is_true(R.incomplete('function f(x)\n  return x * 2'))
    assert.is_true(R.incomplete('if x then'))
    assert.is_true(R.incomplete('t = {1, 2,'))
    assert.is_true(R.incomplete('s = [[long'))
    assert.is_true(R.incomplete('f('))
    assert.is_false(R.incomplete('function f(x) return x end'))
    assert.is_false(R.incomplete('1 +* 2'))
    assert.is_false(R.incomplete('x = "unfinished'))
    assert.is_false(R.incomplete('end'))
  end)

  it('compiles an expression to print, a statement not, and `;` silences', function()
    local f, err, show = R.compile('1 + 2')
    assert.is_nil(err); assert.is_true(show); assert.equal(3, f())
    f, err, show = R.compile('x_repl_spec = 1')
    assert.is_nil(err); assert.is_false(show)
    f, err, show = R.compile('1 + 2;')
    assert.is_nil(err); assert.is_false(show); assert.equal(3, f())
    f, err = R.compile('for i = 1, 2 do')
    assert.is_nil(f); assert.equal('incomplete', err)
    f, err = R.compile('1 +* 2')
    assert.is_nil(f); assert.matches('unexpected symbol', err)
  end)

  it('feeds lines: values printed tab-separated, multi-line chunks, errors that do not end the session', function()
    local out = sink()
    local env = setmetatable({}, { __index = _G })
    local r = R.new{ env = env, out = out }
    assert.equal('done', r:feed('1 + 2'))
    assert.equal('3\n', out.text)
    out.text = ''
    r:feed('"s", nil, 4')
    assert.equal('s\tnil\t4\n', out.text)
    out.text = ''
    assert.equal('more', r:feed('function f(x)'))
    assert.equal('>> ', r:prompt())
    assert.equal('more', r:feed('  return x * 2'))
    assert.equal('done', r:feed('end'))
    assert.equal('> ', r:prompt())
    assert.equal('', out.text)
    r:feed('f(21)')
    assert.equal('42\n', out.text)
    out.text = ''
    r:feed('y = f(1);')
    r:feed('f(2);')
    assert.equal('', out.text)
    assert.equal(2, env.y)
    r:feed('local function g() error("boom") end g()')
    assert.matches('stdin:1: boom', out.text, 1, true)
    assert.matches('stack traceback:', out.text, 1, true)
    assert.not_matches("xpcall", out.text, 1, true)
    assert.not_matches('moonshard/repl.lua', out.text, 1, true)
    assert.equal(1, r.errors)
    out.text = ''
    r:feed('= 6 * 7')
    assert.equal('42\n', out.text)
  end)

  it('prints tensors like PyTorch and tables shallowly, with a bound', function()
    local out = sink()
    local r = R.new{ out = out, env = setmetatable({ ms = require 'moonshard' }, { __index = _G }) }
    r:feed('ms.tensor({{1, 2}, {3, 4}})')
    assert.equal('tensor([[1., 2.],\n        [3., 4.]])\n', out.text)
    assert.equal('{1, 2, a = 3, b = {...}, c = "x"}', R.format_table({ 1, 2, a = 3, b = { 1 }, c = 'x' }))
    local big = {}
    for i = 1, 100 do big[i] = i end
    local s = R.format_table(big, 5)
    assert.equal('{1, 2, 3, 4, 5, ... (95 more)}', s)
    out.text = ''
    r:feed('ms.zeros({2}):view(3)')
    assert.matches('view: shape (3) is invalid for a tensor of shape (2)', out.text, 1, true)
  end)
end)

local function includes(list, x)
  for _, v in ipairs(list) do if v == x then return true end end
  return false
end

describe('repl completion', function()
  local ms = require 'moonshard'
  local env = setmetatable({ ms = ms, t = ms.ones({ 2 }), cfg = { model = { n_layer = 2, n_head = 4 } },
    obj = setmetatable({ own = 1 }, { __index = { method_a = function() end, field_b = 2 } }) }, { __index = _G })

  it('completes globals, keywords and fields walked through a.b.c', function()
    local m = R.complete('ms.zer', '', env)
    assert.truthy(includes(m, 'ms.zeros')); assert.truthy(includes(m, 'ms.zeros_like'))
    for _, c in ipairs(m) do assert.equal('ms.zer', c:sub(1, 6)) end
    assert.same({ 'cfg.model.n_head', 'cfg.model.n_layer' }, R.complete('cfg.model.n_', '', env))
    assert.truthy(includes(R.complete('cf', '', env), 'cfg'))
    assert.truthy(includes(R.complete('functi', '', env), 'function'))
    assert.truthy(includes(R.complete('s:up', '', setmetatable({ s = 'x' }, { __index = _G })), 's:upper'))
    assert.truthy(includes(R.complete('ms.nn', 'x = ', env), 'ms.nn'))
    -- the word may carry text before the name (readline breaks on fewer characters)
    assert.truthy(includes(R.complete('-ms.zer', '', env), '-ms.zeros'))
    assert.same({}, R.complete('nothere.x', '', env))
  end)

  it('completes tensor methods through the metatype, and table methods through __index', function()
    assert.truthy(includes(R.complete('t:resh', '', env), 't:reshape'))
    assert.truthy(includes(R.complete('t:', '', env), 't:matmul'))
    assert.falsy(includes(R.complete('t:', '', env), 't:shape'))   -- a property, not a method
    assert.truthy(includes(R.complete('t.sha', '', env), 't.shape'))
    assert.same({ 'obj:method_a' }, R.complete('obj:m', '', env))
    assert.same({ 'obj.field_b' }, R.complete('obj.f', '', env))
    assert.same({ 'obj.own' }, R.complete('obj.o', '', env))
  end)

  it('completes file paths inside string literals', function()
    assert.is_true(R.in_string('dofile("'))
    assert.is_true(R.in_string("x = 'a\\'b"))
    assert.is_false(R.in_string('x = "a" .. '))
    local m = R.complete(root .. '/spec/repl_sp', 'dofile("', env)
    assert.same({ root .. '/spec/repl_spec.lua' }, m)
    m = R.complete(root .. '/no_such_prefix_zq', "require('", env)
    assert.same({}, m)
    m = R.complete(root .. '/bi', "f('", env)
    assert.same({ root .. '/bin/' }, m)
  end)
end)

describe('repl readline binding', function()
  it('binds libreadline.so.8 and keeps . and : inside a word', function()
    local rl = require 'moonshard.readline'
    assert(rl.available, 'libreadline.so.8 not loaded (Debian libreadline8, in the Makefile DEBS): ' .. tostring(rl.error))
    assert.is_nil(rl.word_break:find('.', 1, true))
    assert.is_nil(rl.word_break:find(':', 1, true))
    assert.is_nil(rl.word_break:find('/', 1, true))
    assert.truthy(rl.word_break:find('(', 1, true))
  end)
end)

describe('bin/repl without a terminal', function()
  it('reads piped lines, prints values, survives errors and exits 1 after one', function()
    local out, code = run([[printf '1+2\nfunction f(x)\nreturn x*2\nend\nf(21)\nms.zeros({2}):view(3)\nms.ones({2});\n"after"\n' | luajit bin/repl]])
    assert.equal(1, code)
    assert.matches('^3\n42\n', out)
    assert.matches('view: shape (3) is invalid', out, 1, true)
    assert.matches('\nafter\n$', out)
    assert.not_matches('tensor%(', out)
  end)

  it('exits 0 when every chunk ran; -e evaluates code like a typed line', function()
    local out, code = run([[printf 'x = 2\nx * 3\n' | luajit bin/repl]])
    assert.equal(0, code); assert.equal('6\n', out)
    out, code = run([[luajit bin/repl -e 'ms.ones({2})' < /dev/null]])
    assert.equal(0, code); assert.equal('tensor([1., 1.])\n', out)
    out, code = run([[luajit bin/repl -e 'error("bad")' < /dev/null]])
    assert.equal(1, code); assert.matches('bad', out)
  end)

  it('runs a script with arg and ..., then reads more lines with its globals', function()
    local path = os.tmpname()
    local f = assert(io.open(path, 'w'))
    f:write('print(arg[0] ~= nil, arg[1], select("#", ...), ...)\nfrom_script = 40\n')
    f:close()
    local out, code = run([[printf 'from_script + 2\n' | luajit bin/repl ]] .. q(path) .. ' a b')
    os.remove(path)
    assert.equal(0, code)
    assert.equal('true\ta\t2\ta\tb\n42\n', out)
  end)
end)

-- ------------------------------------------------------------ through a pty
local tmux_bin
do
  local p = io.popen('command -v tmux 2>/dev/null')
  tmux_bin = p:read('*l')
  p:close()
end

describe('bin/repl in a terminal (tmux)', function()
  -- a private server per test (a socket name is not reused while a killed
  -- server may still be going away)
  local base = ('ms_repl_spec_%d_%d'):format(ffi.C.ms_repl_spec_getpid(), os.time() % 100000)
  local n, sock, hist = 0, nil, nil
  local function tmux(args)
    local p = io.popen(q(tmux_bin) .. ' -L ' .. sock .. ' ' .. args .. ' 2>&1')
    local s = p:read('*a')
    p:close()
    return s
  end
  local function screen() return tmux('capture-pane -p -t repl') end
  -- waits (at most `limit` s) until pred(screen) holds; fails with the screen
  local function wait(pred, what, limit)
    local t0, s = now(), ''
    repeat
      s = screen()
      if pred(s) then return s end
      sleep_ms(50)
    until now() - t0 > (limit or 30)
    error(('timed out waiting for %s; the screen:\n%s'):format(what, s), 2)
  end
  local function has(text) return function(s) return s:find(text, 1, true) ~= nil end end
  -- the last non-blank line of the screen is the prompt `p` (with nothing typed)
  local function prompt_is(p)
    return function(s)
      local last
      for l in s:gmatch('[^\n]*') do if l:find('%S') then last = l end end
      return last == p
    end
  end
  local function type_text(text)
    -- literal keys; a ';' is sent as hex (tmux reads a trailing ';' as a separator)
    for piece, semi in text:gmatch('([^;]*)(;?)') do
      if piece ~= '' then tmux('send-keys -t repl -l ' .. q(piece)) end
      if semi ~= '' then tmux('send-keys -t repl -H 3b') end
    end
  end
  local function key(k) tmux('send-keys -t repl ' .. k) end
  local function line(text) type_text(text); key('Enter') end

  before_each(function()
    assert(tmux_bin, 'tmux not found: the REPL spec needs it (make deps installs it: DEBS has tmux)')
    n = n + 1
    sock = base .. '_' .. n
    hist = os.tmpname()
    os.remove(hist)
    -- bounded: a REPL left behind by an interrupted spec run ends by itself
    local cmd = ('cd %s && MS_REPL_HISTORY=%s timeout --foreground 300 luajit bin/repl; echo "__exited $?"; sleep 30'):format(q(root), q(hist))
    local ok, err = pcall(function()
      local out = tmux('-f /dev/null new-session -d -s repl -x 120 -y 40 ' .. q(cmd))
      assert(out == '', 'tmux new-session: ' .. out)
      wait(prompt_is('>'), 'the first prompt')
    end)
    if not ok then tmux('kill-server'); error(err, 0) end
  end)

  after_each(function()
    tmux('kill-server')
    if hist then os.remove(hist) end
  end)

  it('prints an expression and a tensor', function()
    line('1+2')
    wait(has('> 1+2\n3\n'), '3')
    line('ms.tensor({{1,2},{3,4}})')
    wait(has('tensor([[1., 2.],\n        [3., 4.]])\n'), 'the tensor')
    wait(prompt_is('>'), 'the prompt')
  end)

  it('reports a bad call and the prompt comes back', function()
    line('ms.zeros({2}):view(3)')
    wait(has('view: shape (3) is invalid for a tensor of shape (2)'), 'the error message')
    wait(prompt_is('>'), 'the prompt after the error')
    line('10*10')
    wait(has('\n100\n'), 'the session going on')
  end)

  it('takes a multi-line function on a >> prompt', function()
    line('function f(x)')
    wait(prompt_is('>>'), 'the continuation prompt')
    line('return x*2')
    wait(has('>> return x*2'), 'the second line')
    line('end')
    wait(prompt_is('>'), 'the end of the chunk')
    line('f(21)')
    wait(has('> f(21)\n42\n'), '42')
  end)

  it('completes with Tab: ms fields, tensor methods, paths in strings', function()
    type_text('ms.zer')
    key('Tab')
    wait(has('> ms.zeros'), 'ms.zer completed')
    key('C-u')
    line('t = ms.ones({2})')
    wait(prompt_is('>'), 'the assignment')
    type_text('t:resh')
    key('Tab')
    wait(has('> t:reshape'), 't:resh completed')
    line('({2})')
    wait(has('> t:reshape({2})\ntensor([1., 1.])'), 'the completed call run')
    type_text('x = io.open("spec/repl_sp')
    key('Tab')
    wait(has('> x = io.open("spec/repl_spec.lua'), 'the path completed')
  end)

  it('completes after hundreds of keys (the key loop stays off the JIT: no "bad callback")', function()
    for _ = 1, 40 do type_text(('x = 1 + 2 + 3 + 4 + 5 '):rep(2)); key('C-u') end
    type_text('xx')
    wait(has('> xx'), 'the keys read')
    key('C-u')
    for i = 1, 3 do
      type_text('ms.zer')
      key('Tab')
      type_text(('({%d})'):format(i))
      key('Enter')
    end
    wait(has('> ms.zeros({3})\ntensor([0., 0., 0.])'), 'three completed calls')
  end)

  it('silences a value with ;', function()
    line('ms.ones({3});')
    line('7')
    local s = wait(has('> 7\n7\n'), '7')
    assert.matches('> ms.ones%(%{3%}%);\n> 7', s)
    assert.not_matches('tensor%(', s)
  end)

  it('clears the line on Ctrl-C and the process lives on', function()
    type_text('abc')
    wait(has('> abc'), 'the typed text')
    key('C-c')
    wait(prompt_is('>'), 'a fresh prompt')
    line('function g()')
    wait(prompt_is('>>'), 'the continuation prompt')
    key('C-c')
    wait(prompt_is('>'), 'the chunk dropped')
    line('5*5')
    wait(has('\n25\n'), 'the session going on')
  end)

  it('interrupts a running loop on Ctrl-C with an error, and goes on', function()
    line([[io.write('loop', 'ing\n') while true do end]])
    wait(has('\nlooping\n'), 'the loop running')
    key('C-c')
    wait(has('stdin:1: interrupted'), 'the interrupt error')
    wait(prompt_is('>'), 'the prompt after the interrupt')
    line('6*7')
    wait(has('\n42\n'), 'the session going on')
  end)

  it('exits on Ctrl-D and persists the history', function()
    line('1+2')
    wait(has('\n3\n'), '3')
    line('hist_marker = 1')
    wait(prompt_is('>'), 'the prompt')
    key('C-d')
    wait(has('__exited 0'), 'a clean exit')
    local f = assert(io.open(hist, 'r'), 'no history file written')
    local text = f:read('*a')
    f:close()
    assert.matches('1+2\n', text, 1, true)
    assert.matches('hist_marker = 1\n', text, 1, true)
  end)
end)
