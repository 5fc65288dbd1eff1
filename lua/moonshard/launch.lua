-- moonshard.launch — bin/train's multi-process launcher (like torchrun).
--
--   bin/train --nproc-per-node 2 --device cuda models/gpt2.lua --steps 100
--   bin/train --nproc-per-node 4 --device cpu my_script.lua
--   bin/train --nnodes 2 --node-rank 0 --master-addr 10.0.0.1 --master-port 29500 \
--             --nproc-per-node 8 train_llama.lua          (MS_DIST_TOKEN set on both nodes)
--
-- It starts the ranks, each running `bin/train FILE ARGS` as a single
-- process would, with the environment ms.dist reads: RANK, WORLD_SIZE,
-- LOCAL_RANK, LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR, MASTER_PORT,
-- MS_DIST_TOKEN (a fresh random secret per run on one node), MS_DEVICE, and
-- NCCL_NVLS_ENABLE=0 (NVLink multicast stays off). How the ranks start:
--   --device cuda (and --spawn direct): the launcher forks them itself; rank
--       i of a node uses GPU LOCAL_RANK=i (dist.init picks cuda:LOCAL_RANK);
--   --device cpu (--spawn mpirun): through one `mpirun` (the MPI backend
--       needs MPI's own wire-up); each rank still gets RANK, ... copied from
--       OMPI_COMM_WORLD_* and the same MASTER_ADDR/PORT/token, so a rank
--       that never reaches dist.init is named by the others' time-out.
-- Every output line is prefixed with "[rank N] " (stderr stays stderr);
-- with --log-dir DIR each rank's output goes, unprefixed, to DIR/rankN.log
-- and only rank 0's lines reach the console. SIGINT and SIGTERM are
-- forwarded to every rank; ranks still alive 10 s later are killed (a second
-- SIGINT kills at once). When a rank exits non-zero the others are stopped
-- (SIGTERM, then SIGKILL after 5 s) and the launcher exits non-zero, naming
-- the rank and its status.
--
-- This module loads only the FFI and libc: the launcher process never loads
-- the engine, so forking it is safe.
local ffi = require 'ffi'
local bit = require 'bit'

local launch = {}

ffi.cdef [[
typedef struct { unsigned long val[16]; } ms_launch_sigset;
typedef struct { long tv_sec; long tv_nsec; } ms_launch_timespec;
typedef struct { int fd; short events; short revents; } ms_launch_pollfd;
int ms_launch_fork(void) asm("fork");
int ms_launch_execve(const char *path, char *const argv[], char *const envp[]) asm("execve");
int ms_launch_execvpe(const char *file, char *const argv[], char *const envp[]) asm("execvpe");
void ms_launch__exit(int status) asm("_exit");
int ms_launch_pipe2(int fds[2], int flags) asm("pipe2");
int ms_launch_dup2(int a, int b) asm("dup2");
int ms_launch_close(int fd) asm("close");
int ms_launch_open(const char *path, int flags, int mode) asm("open");
long ms_launch_read(int fd, void *buf, size_t n) asm("read");
long ms_launch_write(int fd, const void *buf, size_t n) asm("write");
int ms_launch_setpgid(int pid, int pgid) asm("setpgid");
int ms_launch_kill(int pid, int sig) asm("kill");
int ms_launch_waitpid(int pid, int *status, int options) asm("waitpid");
int ms_launch_poll(ms_launch_pollfd *fds, unsigned long n, int timeout) asm("poll");
int ms_launch_sigemptyset(ms_launch_sigset *s) asm("sigemptyset");
int ms_launch_sigaddset(ms_launch_sigset *s, int sig) asm("sigaddset");
int ms_launch_sigprocmask(int how, const ms_launch_sigset *set, ms_launch_sigset *old) asm("sigprocmask");
int ms_launch_sigtimedwait(const ms_launch_sigset *set, void *info, const ms_launch_timespec *t) asm("sigtimedwait");
int ms_launch_prctl(int option, unsigned long a2, unsigned long a3, unsigned long a4, unsigned long a5) asm("prctl");
int ms_launch_getpid(void) asm("getpid");
int ms_launch_getppid(void) asm("getppid");
int ms_launch_clock_gettime(int clk, ms_launch_timespec *t) asm("clock_gettime");
char *ms_launch_strerror(int e) asm("strerror");
long ms_launch_sysconf(int name) asm("sysconf");
char *ms_launch_mkdtemp(char *tmpl) asm("mkdtemp");
int ms_launch_mkfifo(const char *path, unsigned int mode) asm("mkfifo");
void *ms_launch_signal(int sig, void *handler) asm("signal");
extern char **environ;
]]
local C = ffi.C

local SIGINT, SIGKILL, SIGTERM = 2, 9, 15
local SIG_BLOCK, SIG_SETMASK = 0, 2
local WNOHANG = 1
local O_RDONLY, O_WRONLY, O_CREAT, O_TRUNC, O_APPEND, O_CLOEXEC, O_NONBLOCK = 0, 1, 64, 512, 1024, 524288, 2048
local POLLIN, POLLHUP = 1, 16
local PR_SET_PDEATHSIG = 1
local signames = { [1] = 'SIGHUP', [2] = 'SIGINT', [3] = 'SIGQUIT', [4] = 'SIGILL', [6] = 'SIGABRT',
  [7] = 'SIGBUS', [8] = 'SIGFPE', [9] = 'SIGKILL', [11] = 'SIGSEGV', [13] = 'SIGPIPE', [15] = 'SIGTERM' }

local function now()
  local t = ffi.new('ms_launch_timespec')
  C.ms_launch_clock_gettime(1, t)
  return tonumber(t.tv_sec) + tonumber(t.tv_nsec) * 1e-9
end
launch.now = now

local function errstr() return ffi.string(C.ms_launch_strerror(ffi.errno())) end

-- ---------------------------------------------------------------- options

launch.usage = [[
multi-process options (before FILE; any of them starts the launcher):
  --nproc-per-node N   ranks on this node (default 1)
  --nnodes M           nodes (default 1); with --node-rank R (0-based)
  --master-addr A      address of node 0, whose launcher serves the rendezvous
                       store (default 127.0.0.1 on one node)
  --master-port P      its TCP port (default: a free port on one node, 29500 on several)
  --device cpu|cuda    cuda: one GPU per rank (LOCAL_RANK), NCCL; cpu: MPI
                       (default: cuda when /dev/nvidia0 exists)
  --spawn direct|mpirun  how ranks start (default: direct for cuda, mpirun for cpu)
  --log-dir DIR        each rank's output in DIR/rankN.log; the console shows rank 0
  --max-restarts K     when a rank fails, stop the others and start them all again,
                       at most K times, on every node (MS_RESTART_COUNT tells the ranks)
  (several nodes share a secret: export MS_DIST_TOKEN=... on each node)]]

local flags = {
  ['--nproc-per-node'] = 'nproc', ['--nproc_per_node'] = 'nproc', ['--nnodes'] = 'nnodes',
  ['--node-rank'] = 'node_rank', ['--node_rank'] = 'node_rank', ['--master-addr'] = 'master_addr',
  ['--master_addr'] = 'master_addr', ['--master-port'] = 'master_port', ['--master_port'] = 'master_port',
  ['--device'] = 'device', ['--spawn'] = 'spawn', ['--log-dir'] = 'log_dir', ['--log_dir'] = 'log_dir',
  ['--max-restarts'] = 'max_restarts', ['--max_restarts'] = 'max_restarts',
}
launch.flags = flags

local UsageError = { __tostring = function(e) return e.msg end }
local function usage(fmt, ...) error(setmetatable({ msg = fmt:format(...) }, UsageError), 0) end

-- Takes the launcher's options out of argv (the leading options, before
-- FILE; other leading options such as --threads stay). Returns the options
-- table, or nil when none was given.
function launch.parse(argv)
  local o, found, names = {}, false, {}
  local i = 1
  while argv[i] and argv[i]:sub(1, 1) == '-' do
    local a = argv[i]
    local name, inline = a:match('^(%-%-[%w_%-]+)=(.*)$')
    name = name or a
    local key = flags[name]
    if key then
      local v = inline
      local n = 1
      if not v then v = argv[i + 1]; n = 2 end
      if v == nil then usage('bin/train: %s needs a value', name) end
      o[key] = v
      names[key] = name
      found = true
      for _ = 1, n do table.remove(argv, i) end
    else
      -- another launcher option (bin/train's own); skip it and its value
      if a == '--threads' then i = i + 2 else i = i + 1 end
    end
  end
  if not found then return nil end
  local function int(key, min)
    if o[key] == nil then return end
    local v = tonumber(o[key])
    if not v or v ~= math.floor(v) or v < min then
      usage('bin/train: %s expects an integer >= %d, got %s', names[key], min, tostring(o[key]))
    end
    o[key] = v
  end
  int('nproc', 1); int('nnodes', 1); int('node_rank', 0); int('master_port', 1); int('max_restarts', 0)
  if o.master_port and o.master_port > 65535 then usage('bin/train: --master-port %d is not a TCP port', o.master_port) end
  o.nnodes = o.nnodes or 1
  o.node_rank = o.node_rank or 0
  if o.node_rank >= o.nnodes then usage('bin/train: --node-rank %d with --nnodes %d', o.node_rank, o.nnodes) end
  if o.nnodes > 1 and not o.master_addr then usage('bin/train: --nnodes %d needs --master-addr (node 0\'s address)', o.nnodes) end
  if o.device and o.device ~= 'cpu' and o.device ~= 'cuda' then usage('bin/train: --device is cpu or cuda, got %s', o.device) end
  if o.spawn and o.spawn ~= 'direct' and o.spawn ~= 'mpirun' then usage('bin/train: --spawn is direct or mpirun, got %s', o.spawn) end
  return o
end

-- --------------------------------------------------------------- helpers

local function file_exists(p)
  local f = io.open(p, 'rb')
  if f then f:close() return true end
  return false
end

local function random_token()
  local f = io.open('/dev/urandom', 'rb')
  local bytes = f and f:read(16)
  if f then f:close() end
  if not bytes or #bytes < 16 then error('bin/train: cannot read /dev/urandom for the run\'s token') end
  return (bytes:gsub('.', function(c) return ('%02x'):format(c:byte()) end))
end

-- The run's rendezvous store, served by the launcher for the whole run
-- (torchrun's agent store): the port is bound before any rank starts, so
-- nothing can take it between its choice and the ranks' rendezvous (with a
-- port chosen first and bound by rank 0, another process could, and rank 0
-- failed with "Address already in use"). Rank 0 only connects
-- (MS_AGENT_STORE=1). Port 0: a free one. Returns the server and its port.
local function serve_store(addr, port, token)
  local okd, dist = pcall(require, 'moonshard.dist')
  if not okd then
    error('bin/train: the launcher serves the ranks\' rendezvous store with moonshard\'s library, '
      .. 'which did not load: ' .. tostring(dist), 0)
  end
  local ok, server = pcall(dist.store_server, { host = addr, port = port, token = token })
  if not ok then
    error(('bin/train: cannot serve the rendezvous store on %s:%s (--master-addr, --master-port): %s')
      :format(addr, port == 0 and 'a free port' or tostring(port), tostring(server)), 0)
  end
  return server, server:port()
end

local function cpu_count()
  local n = tonumber(C.ms_launch_sysconf(84))   -- _SC_NPROCESSORS_ONLN
  return (n and n > 0) and n or 1
end

-- the current environment as a table, without the names in `drop`
local function environment(drop)
  local env, order = {}, {}
  local i = 0
  while C.environ[i] ~= nil do
    local kv = ffi.string(C.environ[i])
    local k, v = kv:match('^([^=]*)=(.*)$')
    if k and not (drop and drop[k]) and env[k] == nil then env[k] = v; order[#order + 1] = k end
    i = i + 1
  end
  return env
end

local function env_array(env)
  local keys = {}
  for k in pairs(env) do keys[#keys + 1] = k end
  table.sort(keys)
  local arr = ffi.new('char*[?]', #keys + 1)
  local keep = {}
  for i, k in ipairs(keys) do
    local s = ffi.new('char[?]', #k + #env[k] + 2, k .. '=' .. env[k])
    keep[i] = s
    arr[i - 1] = s
  end
  arr[#keys] = nil
  return arr, keep
end

local function argv_array(list)
  local arr = ffi.new('char*[?]', #list + 1)
  local keep = {}
  for i, s in ipairs(list) do
    keep[i] = ffi.new('char[?]', #s + 1, s)
    arr[i - 1] = keep[i]
  end
  arr[#list] = nil
  return arr, keep
end

local function sigset(...)
  local s = ffi.new('ms_launch_sigset')
  C.ms_launch_sigemptyset(s)
  for _, sig in ipairs({ ... }) do C.ms_launch_sigaddset(s, sig) end
  return s
end

-- fork + exec with stdout/stderr into pipes; the child leads its own
-- process group (so a kill reaches its children too) and dies with us
local function spawn(cmd, env, stdin_path)
  local out, err = ffi.new('int[2]'), ffi.new('int[2]')
  if C.ms_launch_pipe2(out, O_CLOEXEC) ~= 0 or C.ms_launch_pipe2(err, O_CLOEXEC) ~= 0 then
    error('bin/train: pipe failed: ' .. errstr())
  end
  local argv, k1 = argv_array(cmd)
  local envp, k2 = env_array(env)
  local parent = C.ms_launch_getpid()
  local empty = sigset()
  local pid = C.ms_launch_fork()
  if pid < 0 then error('bin/train: fork failed: ' .. errstr()) end
  if pid == 0 then
    -- the child: only async-signal-safe calls until exec
    C.ms_launch_setpgid(0, 0)
    C.ms_launch_prctl(PR_SET_PDEATHSIG, SIGTERM, 0, 0, 0)
    if C.ms_launch_getppid() ~= parent then C.ms_launch__exit(1) end
    local fd = C.ms_launch_open(stdin_path or '/dev/null', O_RDONLY, 0)
    if fd > 0 then
      C.ms_launch_dup2(fd, 0)
      C.ms_launch_close(fd)
    end
    C.ms_launch_dup2(out[1], 1)
    C.ms_launch_dup2(err[1], 2)
    C.ms_launch_sigprocmask(SIG_SETMASK, empty, nil)
    C.ms_launch_execvpe(cmd[1], argv, envp)
    local msg = 'bin/train: cannot run ' .. cmd[1] .. ': ' .. errstr() .. '\n'
    C.ms_launch_write(2, msg, #msg)
    C.ms_launch__exit(127)
  end
  C.ms_launch_setpgid(pid, pid)   -- also here: no race with an early kill
  C.ms_launch_close(out[1])
  C.ms_launch_close(err[1])
  local _ = k1, k2
  return pid, out[0], err[0]
end

local function describe_status(st)
  local sig = bit.band(st, 0x7f)
  if sig == 0 then
    local code = bit.band(bit.rshift(st, 8), 0xff)
    return ('exit status %d'):format(code), code
  end
  return ('killed by signal %d (%s)'):format(sig, signames[sig] or '?'), 128 + sig
end
-- sh reports a child killed by signal n as 128 + n
local function describe_code(code)
  if code > 128 and code < 160 then
    local sig = code - 128
    return ('killed by signal %d (%s), exit status %d'):format(sig, signames[sig] or '?', code)
  end
  return ('exit status %d'):format(code)
end

-- ---------------------------------------------------------------- output

-- a line sink per (rank, stream): prefixes and routes complete lines
local function make_router(o, nlocal, rank0, attempt)
  local logs = {}
  if o.log_dir then
    os.execute(("mkdir -p '%s'"):format(o.log_dir:gsub("'", "'\\''")))
    for i = 0, nlocal - 1 do
      local path = ('%s/rank%d.log'):format(o.log_dir, rank0 + i)
      -- a restarted run (--max-restarts) appends: the failed attempt's lines stay
      local f = io.open(path, (attempt or 0) > 0 and 'a' or 'w')
      if f and (attempt or 0) > 0 then f:write(('--- bin/train: restart %d\n'):format(attempt)) end
      if not f then usage('bin/train: cannot write %s', path) end
      f:setvbuf('line')
      logs[rank0 + i] = f
    end
  end
  local partial = {}
  local router = {}
  function router.line(rank, stream, text)
    if logs[rank] then logs[rank]:write(text, '\n') end
    if not o.log_dir or rank == 0 then
      local dst = stream == 2 and io.stderr or io.stdout
      dst:write(('[rank %d] '):format(rank), text, '\n')
    end
  end
  function router.data(rank, stream, chunk)
    local key = rank * 4 + stream
    local buf = (partial[key] or '') .. chunk
    local start = 1
    while true do
      local nl = buf:find('\n', start, true)
      if not nl then break end
      router.line(rank, stream, buf:sub(start, nl - 1))
      start = nl + 1
    end
    partial[key] = buf:sub(start)
  end
  function router.flush()
    for key, rest in pairs(partial) do
      if rest ~= '' then router.line(math.floor(key / 4), key % 4, rest) end
      partial[key] = ''
    end
    for _, f in pairs(logs) do f:close() end
  end
  return router
end

-- ------------------------------------------------------------------ main

local function message(fmt, ...)
  io.stderr:write('bin/train: ', fmt:format(...), '\n')
  io.stderr:flush()
end

-- The supervising loop. `procs` are { pid, out, err }; on_data(proc,
-- stream, chunk) gets their output; on_exit(proc, status) may record a
-- failure in `state.fail` ({ rank, code, msg }), as may on_data (mpirun's
-- exit markers). Once a failure is known the other processes are stopped:
-- direct ranks get SIGTERM, then SIGKILL after 5 s; mpirun, which stops its
-- job itself, is given 8 s before the same. SIGINT/SIGTERM sent to the
-- launcher go to every process, SIGKILL follows 10 s later (at once on a
-- second signal). Returns when every process has exited.
local function supervise(procs, on_data, on_exit, state, mpirun)
  local blocked = sigset(SIGINT, SIGTERM)
  local zero = ffi.new('ms_launch_timespec')
  local buf = ffi.new('char[65536]')
  local alive = 0
  for _, p in ipairs(procs) do
    if p.pid then alive = alive + 1 else p.exited = true end
  end
  local term_at, kill_at = nil, nil
  local stopping = false
  local function signal_all(sig)
    for _, p in ipairs(procs) do
      if p.pid and not p.exited then C.ms_launch_kill(-p.pid, sig) end
    end
    -- process groups started by mpirun: signalled directly too
    for _, g in ipairs(state.groups and state.groups() or {}) do C.ms_launch_kill(-g, sig) end
  end
  local function read_some(p, s)
    local fd = s == 1 and p.out or p.err
    local got = tonumber(C.ms_launch_read(fd, buf, 65536))
    if got and got > 0 then
      on_data(p, s, ffi.string(buf, got))
      return true
    end
    C.ms_launch_close(fd)
    if s == 1 then p.out = -1 else p.err = -1 end
    return false
  end
  while true do
    local pfds = ffi.new('ms_launch_pollfd[?]', 2 * #procs + 1)
    local map, n = {}, 0
    for _, p in ipairs(procs) do
      for s = 1, 2 do
        local fd = s == 1 and p.out or p.err
        if fd >= 0 then
          pfds[n].fd, pfds[n].events = fd, POLLIN
          map[n] = { p, s }
          n = n + 1
        end
      end
    end
    if alive == 0 and n == 0 then break end
    C.ms_launch_poll(n > 0 and pfds or nil, n, 100)
    for i = 0, n - 1 do
      if bit.band(pfds[i].revents, POLLIN + POLLHUP + 8) ~= 0 then read_some(map[i][1], map[i][2]) end
    end
    if state.tick then state.tick() end
    if state.peer then state.peer() end
    for _, p in ipairs(procs) do
      if not p.exited then
        local st = ffi.new('int[1]')
        if C.ms_launch_waitpid(p.pid, st, WNOHANG) == p.pid then
          p.exited = true
          alive = alive - 1
          on_exit(p, st[0])
        end
      end
    end
    -- a process that exited may leave a grandchild holding its pipes: once
    -- every process is gone, stop waiting for their output after 2 s
    if alive == 0 then
      state.drain_until = state.drain_until or (math.max(now(), kill_at or 0, term_at or 0) + 2)
      if now() > state.drain_until then
        for _, p in ipairs(procs) do
          if p.out >= 0 then C.ms_launch_close(p.out); p.out = -1 end
          if p.err >= 0 then C.ms_launch_close(p.err); p.err = -1 end
        end
      end
    end
    if state.fail and not stopping and not state.interrupted then
      stopping = true
      if mpirun then
        -- mpirun stops its job itself; the launcher stops the ranks' groups
        -- too, and mpirun if it is still there after 8 s
        for _, g in ipairs(state.groups and state.groups() or {}) do C.ms_launch_kill(-g, SIGTERM) end
        term_at = now() + 8
        kill_at = now() + 5
      else
        signal_all(SIGTERM)
        kill_at = now() + 5
      end
    end
    local sig = C.ms_launch_sigtimedwait(blocked, nil, zero)
    while sig > 0 do
      if state.interrupted then
        message('second %s: killing every rank', signames[sig] or sig)
        signal_all(SIGKILL)
      else
        state.interrupted = sig
        stopping = true
        message('%s: stopping every rank (killed if still running in 10 s)', signames[sig] or sig)
        signal_all(sig)
        term_at, kill_at = nil, now() + 10
      end
      sig = C.ms_launch_sigtimedwait(blocked, nil, zero)
    end
    local t = now()
    if term_at and t > term_at then
      signal_all(SIGTERM)
      term_at, kill_at = nil, t + 2
    end
    if kill_at and t > kill_at then
      signal_all(SIGKILL)
      kill_at = nil
    end
  end
end

-- Node 0's ranks are done, and the store goes with its launcher: the other
-- nodes' ranks may still be at their last barrier or get. Wait until every
-- rank has closed its connection (they close at exit), or `secs` (as
-- torchrun's agents meet at an exit barrier); SIGINT or SIGTERM end the wait.
local function linger(server, secs)
  local open = server:stats().open
  if open == 0 then return end
  message('waiting for the other nodes\' ranks to leave the rendezvous store (%d connected)', open)
  local set, tick, t0 = sigset(SIGINT, SIGTERM), ffi.new('ms_launch_timespec', 0, 50 * 1000 * 1000), now()
  while open > 0 and now() - t0 < secs do
    if C.ms_launch_sigtimedwait(set, nil, tick) > 0 then return end
    open = server:stats().open
  end
  if open > 0 then message('%d ranks still connected after %d s; the store stops', open, secs) end
end

-- After an attempt on this node (--max-restarts with several nodes): a
-- failure is told to the other nodes (an interrupt as 'abort': nobody
-- restarts); ranks that ended well wait for every node to end well, or for
-- one to fail (then this node restarts too). Returns true to stop
-- restarting, and the code 1 as the attempt's when a peer failed after this
-- node's ranks had ended well.
local function node_outcome(coord, o, attempt, ok, code, interrupted)
  local key = 'fail/' .. attempt
  if not ok or interrupted then coord:set(key, 'abort'); return true end
  if code ~= 0 then
    if not coord:get(key, 0.001) then coord:set(key, tostring(o.node_rank)) end
    return coord:get(key, 0.001) == 'abort'
  end
  local n, t0, limit = coord:add('done/' .. attempt, 1), now(), o.store_timeout or 300
  while n < o.nnodes do
    local v = coord:get(key, 0.2)
    if v then
      message('node %s failed; this node\'s ranks ended well, but every node starts again', v)
      return v == 'abort', 1
    end
    if now() - t0 > limit then
      message('%d of %d nodes ended well after %d s of waiting; this node is done', n, o.nnodes, limit)
      return true
    end
    n = coord:add('done/' .. attempt, 0)
  end
  return false
end

-- runs the job; returns the launcher's exit code
function launch.run(o, rank_cmd)
  local device = o.device or (file_exists('/dev/nvidia0') and 'cuda' or 'cpu')
  local spawn_mode = o.spawn or (device == 'cuda' and 'direct' or 'mpirun')
  if spawn_mode == 'mpirun' and o.nnodes > 1 then
    usage('bin/train: several nodes with --spawn mpirun (CPU): start the ranks with mpirun and a hostfile '
      .. 'yourself (mpirun -np N --hostfile H luajit bin/train FILE; see docs/dist.md), or use --spawn direct')
  end
  local token = os.getenv('MS_DIST_TOKEN')
  if not token or token == '' then
    if o.nnodes > 1 then
      usage('bin/train: several nodes share the run\'s secret: export MS_DIST_TOKEN=<the same random string> on '
        .. 'every node (e.g. head -c 16 /dev/urandom | od -An -tx1 | tr -d " \\n")')
    end
    token = random_token()
  end
  local addr = o.master_addr or '127.0.0.1'
  local port = o.master_port or (o.nnodes > 1 and 29500 or 0)
  -- the first node serves the store; the others' ranks connect to it
  local server
  if o.node_rank == 0 then server, port = serve_store(addr, port, token) end
  -- --max-restarts: a failed run starts again, every rank, with
  -- MS_RESTART_COUNT (and torchrun's TORCHELASTIC_RESTART_COUNT) one more;
  -- dist.init names its store keys after it, so nothing of the failed
  -- attempt answers the new one. With several nodes the launchers
  -- restart together, through the store:
  -- a node whose ranks fail says so under fail/<attempt>; the others stop
  -- theirs (or, done already, wait for every node's outcome) and all meet
  -- at start/<attempt + 1>
  local coord
  if (o.max_restarts or 0) > 0 and o.nnodes > 1 then
    local ok, c = pcall(function()
      local dist = require 'moonshard.dist'
      local st, err = dist.store_connect { host = addr, port = port, token = token, rank = o.node_rank,
        timeout = o.store_timeout or 300 }
      if not st then error(err, 0) end
      return st:set_prefix('launch/')
    end)
    if not ok then
      if server then server:stop() end
      error('bin/train: the launchers of a run with --max-restarts meet at the store: ' .. tostring(c), 0)
    end
    coord = c
  end
  local ok, code, interrupted
  for attempt = 0, o.max_restarts or 0 do
    if coord then
      local met, err = coord:barrier('start/' .. attempt, o.node_rank, o.nnodes, o.store_timeout or 300)
      if not met then ok, code = true, 1; message('%s', err); break end
    end
    ok, code, interrupted = pcall(launch.run_ranks, o, rank_cmd, addr, port, token, attempt, coord)
    local abort = not ok or interrupted
    if coord then
      local stop, peer_code = node_outcome(coord, o, attempt, ok, code, interrupted)
      abort = abort or stop
      code = peer_code or code
    end
    if abort or code == 0 or attempt == (o.max_restarts or 0) then break end
    message('restarting every rank (restart %d of %d)', attempt + 1, o.max_restarts)
  end
  if coord then coord:close() end
  if server and ok and code == 0 and o.nnodes > 1 then linger(server, o.store_linger or 60) end
  if server then server:stop() end
  if not ok then error(code, 0) end
  return code
end

-- runs the ranks of this node against the store at addr:port
function launch.run_ranks(o, rank_cmd, addr, port, token, attempt, coord)
  local nproc = o.nproc or 1
  local world = nproc * o.nnodes
  local rank0 = o.node_rank * nproc
  local device = o.device or (file_exists('/dev/nvidia0') and 'cuda' or 'cpu')
  local spawn_mode = o.spawn or (device == 'cuda' and 'direct' or 'mpirun')

  -- the ranks' common environment
  local drop = { RANK = true, LOCAL_RANK = true, WORLD_SIZE = true, LOCAL_WORLD_SIZE = true, GROUP_RANK = true }
  local env = environment(drop)
  env.MASTER_ADDR, env.MASTER_PORT, env.MS_DIST_TOKEN = addr, tostring(port), token
  env.MS_AGENT_STORE = '1'   -- the first node's launcher serves the store: rank 0 only connects
  env.MS_RESTART_COUNT, env.TORCHELASTIC_RESTART_COUNT = tostring(attempt or 0), tostring(attempt or 0)
  env.MS_DEVICE = device
  env.NCCL_NVLS_ENABLE = '0'
  env.OMP_WAIT_POLICY = env.OMP_WAIT_POLICY or 'PASSIVE'
  if not env.OMP_NUM_THREADS and not env.MS_NUM_THREADS then
    env.OMP_NUM_THREADS = tostring(math.max(1, math.floor(cpu_count() / nproc)))
  end

  -- SIGINT/SIGTERM are taken from the queue by the loop (never by a
  -- handler). A shell starts background jobs with SIGINT ignored, and an
  -- ignored signal is never queued: back to the default first (the ranks
  -- inherit that too)
  C.ms_launch_signal(SIGINT, nil)
  C.ms_launch_signal(SIGTERM, nil)
  local blocked = sigset(SIGINT, SIGTERM)
  C.ms_launch_sigprocmask(SIG_BLOCK, blocked, nil)

  local router = make_router(o, nproc, rank0, attempt)
  local t0 = now()
  local procs = {}
  local state = {}
  if coord then
    -- another node's failure (--max-restarts): stop this node's ranks too
    local key, next_at = 'fail/' .. (attempt or 0), 0
    state.peer = function()
      if state.fail or state.interrupted or now() < next_at then return end
      next_at = now() + 0.5
      local v = coord:get(key, 0.001)
      if v then
        state.fail = { code = 1, what = ('node %s failed'):format(v) }
        message('node %s failed; stopping this node\'s ranks', v)
      end
    end
  end
  if spawn_mode == 'direct' then
    for i = 0, nproc - 1 do
      local e = {}
      for k, v in pairs(env) do e[k] = v end
      e.RANK, e.LOCAL_RANK = tostring(rank0 + i), tostring(i)
      e.WORLD_SIZE, e.LOCAL_WORLD_SIZE, e.GROUP_RANK = tostring(world), tostring(nproc), tostring(o.node_rank)
      local pid, out, err = spawn(rank_cmd, e)
      procs[#procs + 1] = { pid = pid, out = out, err = err, rank = rank0 + i }
    end
    supervise(procs, function(p, s, chunk) router.data(p.rank, s, chunk) end, function(p, st)
      local what, code = describe_status(st)
      if code ~= 0 and not state.fail and not state.interrupted then
        state.fail = { rank = p.rank, code = code, what = what }
        message('rank %d (pid %d) failed: %s; stopping the other ranks', p.rank, p.pid, what)
      end
    end, state, false)
  else
    -- Open MPI settings for one host (as tools/mpi_env.sh)
    local defaults = {
      OMPI_MCA_btl = 'self,vader', OMPI_MCA_btl_vader_single_copy_mechanism = 'none',
      OMPI_MCA_plm_rsh_agent = 'false', OMPI_MCA_rmaps_base_oversubscribe = '1',
      OMPI_MCA_hwloc_base_binding_policy = 'none', OMPI_ALLOW_RUN_AS_ROOT = '1',
      OMPI_ALLOW_RUN_AS_ROOT_CONFIRM = '1',
    }
    for k, v in pairs(defaults) do if env[k] == nil then env[k] = v end end
    env.WORLD_SIZE = nil
    -- each rank's stdout and stderr come to the launcher through FIFOs of
    -- its own (as a direct rank's pipes: exact lines, no mpirun tags), and
    -- its exit status through a file; the wrapper also sets the torchrun
    -- variables from Open MPI's
    local dir = ffi.new('char[64]', '/tmp/ms-launch-XXXXXX')
    if C.ms_launch_mkdtemp(dir) == nil then error('bin/train: mkdtemp failed: ' .. errstr()) end
    dir = ffi.string(dir)
    state.cleanup = dir
    for r = rank0, rank0 + nproc - 1 do
      local p = { rank = r }
      for s, ext in ipairs({ 'out', 'err' }) do
        local path = ('%s/%d.%s'):format(dir, r, ext)
        if C.ms_launch_mkfifo(path, tonumber('600', 8)) ~= 0 then error('bin/train: mkfifo failed: ' .. errstr()) end
        local fd = C.ms_launch_open(path, O_RDONLY + O_NONBLOCK + O_CLOEXEC, 0)
        if fd < 0 then error('bin/train: cannot open ' .. path .. ': ' .. errstr()) end
        if s == 1 then p.out = fd else p.err = fd end
      end
      procs[#procs + 1] = p
    end
    env.MS_LAUNCH_DIR = dir
    local wrapper = 'export RANK=$OMPI_COMM_WORLD_RANK WORLD_SIZE=$OMPI_COMM_WORLD_SIZE '
      .. 'LOCAL_RANK=$OMPI_COMM_WORLD_LOCAL_RANK LOCAL_WORLD_SIZE=$OMPI_COMM_WORLD_LOCAL_SIZE GROUP_RANK=0; '
      .. 'd=$MS_LAUNCH_DIR; echo $$ >"$d/$RANK.pid"; exec >"$d/$RANK.out" 2>"$d/$RANK.err"; "$@"; s=$?; echo $s >"$d/$RANK.tmp"; '
      .. 'mv "$d/$RANK.tmp" "$d/$RANK.status"; exit $s'
    local cmd = { 'mpirun', '-np', tostring(nproc), '--oversubscribe', '--bind-to', 'none',
      'sh', '-c', wrapper, 'ms-rank' }
    for _, a in ipairs(rank_cmd) do cmd[#cmd + 1] = a end
    local pid, out, err = spawn(cmd, env)
    local mpirun = { pid = pid, out = out, err = err }
    table.insert(procs, 1, mpirun)
    local mpi_lines, partial = {}, { '', '' }
    local reported, groups = {}, {}
    state.groups = function()
      local list = {}
      for r = rank0, rank0 + nproc - 1 do
        if not groups[r] then
          local f = io.open(('%s/%d.pid'):format(dir, r), 'r')
          groups[r] = f and tonumber(f:read('*l'))
          if f then f:close() end
        end
        if groups[r] then list[#list + 1] = groups[r] end
      end
      return list
    end
    state.tick = function()
      for r = rank0, rank0 + nproc - 1 do
        if not reported[r] then
          local f = io.open(('%s/%d.status'):format(dir, r), 'r')
          local code = f and tonumber(f:read('*l'))
          if f then f:close() end
          if code then
            reported[r] = true
            if code ~= 0 and not state.fail and not state.interrupted then
              state.fail = { rank = r, code = code, what = describe_code(code) }
              message('rank %d failed: %s; stopping the other ranks', r, state.fail.what)
            end
          end
        end
      end
    end
    supervise(procs, function(p, s, chunk)
      if p.rank then return router.data(p.rank, s, chunk) end
      local buf = partial[s] .. chunk
      local start = 1
      while true do
        local nl = buf:find('\n', start, true)
        if not nl then break end
        mpi_lines[#mpi_lines + 1] = buf:sub(start, nl - 1)
        start = nl + 1
      end
      partial[s] = buf:sub(start)
    end, function(p, st)
      state.tick()
      local what, code = describe_status(st)
      if code ~= 0 and not state.fail and not state.interrupted then
        state.fail = { code = code, what = 'mpirun ' .. what }
      end
    end, state, true)
    for s = 1, 2 do if partial[s] ~= '' then mpi_lines[#mpi_lines + 1] = partial[s] end end
    os.execute(("rm -rf '%s'"):format(dir))
    -- mpirun's own lines, when no rank's status explains the failure
    if state.fail and not state.fail.rank then
      for _, l in ipairs(mpi_lines) do io.stderr:write('[mpirun] ', l, '\n') end
    end
  end
  router.flush()
  local secs = now() - t0
  if state.interrupted then
    message('stopped by %s after %.1f s', signames[state.interrupted] or state.interrupted, secs)
    return 128 + state.interrupted, true
  end
  local f = state.fail
  if f then
    if f.rank then
      message('rank %d failed (%s); the run stopped after %.1f s', f.rank, f.what, secs)
    else
      message('%s after %.1f s', f.what, secs)
    end
    local code = f.code or 1
    if code <= 0 or code > 125 then code = 1 end
    return code
  end
  return 0
end

-- bin/train's entry: when argv holds launcher options, run the ranks and
-- return the exit code; otherwise nil (bin/train runs the file itself).
-- `self_path` is bin/train's path; `interp` the LuaJIT that runs it.
function launch.main(argv, self_path, interp)
  local ok, o = pcall(launch.parse, argv)
  if not ok then
    if getmetatable(o) == UsageError then io.stderr:write(tostring(o), '\n'); return 2 end
    error(o, 0)
  end
  if not o then return nil end
  for _, a in ipairs(argv) do
    if a == '--help' or a == '-h' then return nil end   -- bin/train prints the help
    if a:sub(1, 1) ~= '-' then break end
  end
  if not o.nproc and o.nnodes == 1 then
    -- one process, as without the launcher: only the device is passed on
    if o.device then
      pcall(ffi.cdef, 'int ms_launch_setenv(const char *, const char *, int) asm("setenv");')
      C.ms_launch_setenv('MS_DEVICE', o.device, 1)
    end
    return nil
  end
  if not argv[1] then
    io.stderr:write('usage: bin/train [--nproc-per-node N] [...] FILE [args]   (bin/train --help)\n')
    return 2
  end
  local cmd = { interp or 'luajit', self_path }
  for _, a in ipairs(argv) do cmd[#cmd + 1] = a end
  local ok2, code = pcall(launch.run, o, cmd)
  if not ok2 then
    if getmetatable(code) == UsageError then io.stderr:write(tostring(code), '\n'); return 2 end
    io.stderr:write(tostring(code), '\n')
    return 1
  end
  return code
end

return launch
