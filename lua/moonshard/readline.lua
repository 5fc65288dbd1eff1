-- moonshard.readline — GNU readline through LuaJIT's FFI, for bin/repl.
--
--   local rl = require 'moonshard.readline'
--   if rl.available and rl.isatty(0) then
--     rl.init{ name = 'moonshard', history = '~/.moonshard_history',
--              complete = function(text, line, start) return { ... } end }
--     local line, why = rl.read('> ')   -- nil, 'eof' on Ctrl-D; '', 'interrupt' on Ctrl-C
--     rl.add_history(line)
--     rl.close()                        -- writes the history file
--   end
--
-- libreadline.so.8 (Debian's libreadline8) is used through the callback
-- interface, the way CPython's readline module does it: we poll stdin
-- ourselves and feed readline one character at a time. SIGINT is blocked and
-- read through a signalfd, so Ctrl-C is an ordinary event in this loop (it
-- clears the line) instead of a signal that would kill the process or call a
-- Lua function at an unsafe moment. `rl.block_sigint()` must run before any
-- library starts threads (OpenBLAS starts its pool when it loads), since a
-- thread that does not block SIGINT would receive it and die of it.
-- `rl.interrupt_pending()` tells whether Ctrl-C was pressed since the last
-- look (bin/repl checks it from a count hook while user code runs).
--
-- The completion callbacks are ffi.cast pointers kept alive in this module;
-- readline calls them synchronously from rl_callback_read_char, which is
-- safe as long as the caller is not JIT-compiled (M.read is kept off the JIT). All C names are declared with asm aliases so they cannot clash with
-- declarations made by other modules.
local ffi = require 'ffi'

local M = { available = false }

ffi.cdef [[
typedef char *ms_rl_compentry_func_t(const char *, int);
typedef char **ms_rl_completion_func_t(const char *, int, int);
typedef void ms_rl_vcpfunc_t(char *);
typedef struct { unsigned long val[16]; } ms_rl_sigset_t;
typedef struct { int fd; short events; short revents; } ms_rl_pollfd;
int ms_rl_isatty(int) asm("isatty");
int ms_rl_poll(ms_rl_pollfd *, unsigned long, int) asm("poll");
long ms_rl_read(int, void *, size_t) asm("read");
int ms_rl_close(int) asm("close");
void ms_rl_free(void *) asm("free");
char *ms_rl_strdup(const char *) asm("strdup");
int ms_rl_sigemptyset(ms_rl_sigset_t *) asm("sigemptyset");
int ms_rl_sigaddset(ms_rl_sigset_t *, int) asm("sigaddset");
int ms_rl_sigprocmask(int, const ms_rl_sigset_t *, ms_rl_sigset_t *) asm("sigprocmask");
int ms_rl_signalfd(int, const ms_rl_sigset_t *, int) asm("signalfd");
]]
local C = ffi.C

local ok, L = pcall(ffi.load, 'readline.so.8')
if not ok then ok, L = pcall(ffi.load, 'libreadline.so.8') end
if not ok then ok, L = pcall(ffi.load, 'readline') end
if ok then
  ok = pcall(ffi.cdef, [[
  void add_history(const char *);
  int read_history(const char *);
  int write_history(const char *);
  int history_truncate_file(const char *, int);
  void using_history(void);
  void stifle_history(int);
  char **rl_completion_matches(const char *, ms_rl_compentry_func_t *);
  void rl_callback_handler_install(const char *, ms_rl_vcpfunc_t *);
  void rl_callback_read_char(void);
  void rl_callback_handler_remove(void);
  void rl_callback_sigcleanup(void);
  void rl_free_line_state(void);
  void rl_replace_line(const char *, int);
  int rl_crlf(void);
  void rl_redisplay(void);
  extern ms_rl_completion_func_t *rl_attempted_completion_function;
  extern const char *rl_basic_word_break_characters;
  extern const char *rl_readline_name;
  extern int rl_attempted_completion_over;
  extern int rl_completion_append_character;
  extern int rl_catch_signals;
  extern int rl_catch_sigwinch;
  extern char *rl_line_buffer;
  extern int rl_point;
  extern int rl_end;
  ]])
  M.available = ok
  M.lib = L
end
if not ok then M.error = tostring(L) end

function M.isatty(fd) return C.ms_rl_isatty(fd or 0) == 1 end

-- ------------------------------------------------------------------ SIGINT
local SIGINT, SIG_BLOCK, SFD_NONBLOCK, SFD_CLOEXEC = 2, 0, 0x800, 0x80000
local sigfd = -1

-- Blocks SIGINT in this thread (and every thread started after) and opens a
-- signalfd for it. Returns true on success.
function M.block_sigint()
  if sigfd >= 0 then return true end
  local set = ffi.new('ms_rl_sigset_t')
  C.ms_rl_sigemptyset(set)
  C.ms_rl_sigaddset(set, SIGINT)
  if C.ms_rl_sigprocmask(SIG_BLOCK, set, nil) ~= 0 then return false end
  sigfd = C.ms_rl_signalfd(-1, set, SFD_NONBLOCK + SFD_CLOEXEC)
  return sigfd >= 0
end

-- Runs fn(...) with SIGINT unblocked (after dropping a pending one): for
-- os.execute, whose system() ignores SIGINT in this process while the child
-- runs and gives the child the default action, so Ctrl-C stops the child.
function M.with_sigint(fn, ...)
  if sigfd < 0 then return fn(...) end
  M.interrupt_pending()
  local set = ffi.new('ms_rl_sigset_t')
  C.ms_rl_sigemptyset(set)
  C.ms_rl_sigaddset(set, SIGINT)
  C.ms_rl_sigprocmask(1, set, nil)               -- SIG_UNBLOCK
  local res = { pcall(fn, ...) }
  C.ms_rl_sigprocmask(SIG_BLOCK, set, nil)
  if not res[1] then error(res[2], 0) end
  return unpack(res, 2, table.maxn(res))
end

local siginfo = ffi.new('uint8_t[128]')
local pfd1 = ffi.new('ms_rl_pollfd[1]')

-- true when Ctrl-C was pressed since the last call (consumes it)
function M.interrupt_pending()
  if sigfd < 0 then return false end
  local got = false
  while C.ms_rl_read(sigfd, siginfo, 128) == 128 do got = true end
  return got
end

-- ---------------------------------------------------------------- history
local history_path
local function expand(path)
  if path:sub(1, 2) == '~/' then return (os.getenv('HOME') or '.') .. path:sub(2) end
  return path
end

function M.add_history(line)
  if not M.available or not line or not line:find('%S') then return end
  if line == M.last_history then return end
  M.last_history = line
  L.add_history(line)
end

-- ------------------------------------------------------------- completion
local completer                     -- function(text, line_before_text, start) -> list
local matches, match_i = {}, 0
local generator = ffi.cast('ms_rl_compentry_func_t *', function(_, state)
  if state == 0 then match_i = 0 end
  match_i = match_i + 1
  local m = matches[match_i]
  if m == nil then return nil end
  return C.ms_rl_strdup(m)
end)
local function attempted_fn(text, start, finish)
  L.rl_attempted_completion_over = 1       -- never fall back to readline's filenames
  L.rl_completion_append_character = 0
  local line = ffi.string(L.rl_line_buffer, finish)
  local t = ffi.string(text)
  local okc, res = pcall(completer, t, line:sub(1, start), start)
  matches = okc and type(res) == 'table' and res or {}
  if #matches == 0 then return nil end
  return L.rl_completion_matches(text, generator)
end
-- it calls C that calls back (the generator): never JIT-compiled (see M.read)
if jit then jit.off(attempted_fn) end
local attempted = ffi.cast('ms_rl_completion_func_t *', attempted_fn)
M._callbacks = { generator, attempted }   -- kept alive with the module

-- Characters that end a word for completion. '.', ':' are absent so `t:me`
-- and `a.b.c` are one word; '/', '-', '~' are absent so paths in strings are.
M.word_break = ' \t\n"\'`@$><=;|&{(,)[]+*%^#'
local word_break_c = ffi.new('char[?]', #M.word_break + 1, M.word_break)

-- opts: name, history (path), history_size, complete (function)
function M.init(opts)
  assert(M.available, 'moonshard.readline: ' .. tostring(M.error))
  opts = opts or {}
  completer = opts.complete or function() return {} end
  M.name_c = ffi.new('char[?]', #(opts.name or 'moonshard') + 1, opts.name or 'moonshard')
  L.rl_readline_name = M.name_c
  L.rl_catch_signals = 0             -- SIGINT is ours (a signalfd), see above
  L.rl_basic_word_break_characters = word_break_c
  L.rl_attempted_completion_function = attempted
  L.using_history()
  history_path = opts.history and expand(opts.history)
  M.history_size = opts.history_size or 1000
  if history_path then L.read_history(history_path) end
end

-- one line handler for every read: readline hands the line over here
local got_line, got_done
local handler = ffi.cast('ms_rl_vcpfunc_t *', function(p)
  got_done = true
  if p == nil then got_line = nil
  else got_line = ffi.string(p); C.ms_rl_free(p) end
  L.rl_callback_handler_remove()
end)
M._callbacks[3] = handler

-- Reads one line with `prompt`. Returns the line; nil, 'eof' at Ctrl-D on
-- an empty line; '', 'interrupt' when Ctrl-C was pressed.
function M.read(prompt)
  M.interrupt_pending()                       -- a stale Ctrl-C is not for this prompt
  got_line, got_done = nil, false
  L.rl_callback_handler_install(prompt, handler)
  local fds = ffi.new('ms_rl_pollfd[2]')
  fds[0].fd, fds[0].events = 0, 1             -- POLLIN
  fds[1].fd, fds[1].events = sigfd, 1
  local n = sigfd >= 0 and 2 or 1
  while not got_done do
    fds[0].revents, fds[1].revents = 0, 0
    local r = C.ms_rl_poll(fds, n, -1)
    if r > 0 then
      if n == 2 and fds[1].revents ~= 0 and M.interrupt_pending() then
        L.rl_point = L.rl_end                 -- '^C' after the line, as a shell shows it
        L.rl_redisplay()
        io.stdout:write('^C')
        io.stdout:flush()
        L.rl_free_line_state()
        L.rl_callback_sigcleanup()
        L.rl_replace_line('', 0)
        L.rl_callback_handler_remove()       -- restores the terminal
        io.stdout:write('\n')
        io.stdout:flush()
        return '', 'interrupt'
      end
      if fds[0].revents ~= 0 then L.rl_callback_read_char() end
    elseif r < 0 and ffi.errno() ~= 4 then    -- not EINTR: stdin is gone
      L.rl_callback_handler_remove()
      return nil, 'eof'
    end
  end
  if got_line == nil then io.stdout:write('\n'); io.stdout:flush(); return nil, 'eof' end
  return got_line
end

-- rl_callback_read_char calls back into Lua (the line handler, completion):
-- LuaJIT forbids that from a C call made by JIT-compiled code ("bad
-- callback", a panic), and the key loop above gets hot after a few dozen
-- keys. So the functions that make such calls stay in the interpreter.
if jit then jit.off(M.read, true) end

-- writes the history file (keeping the last history_size lines)
function M.save_history()
  if not (M.available and history_path) then return end
  L.write_history(history_path)
  L.history_truncate_file(history_path, M.history_size)
end

function M.close()
  M.save_history()
end

return M
