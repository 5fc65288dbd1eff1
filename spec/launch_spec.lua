-- bin/train's launcher (lua/moonshard/launch.lua): ranks get the
-- environment, their output is prefixed, a failing rank stops the run within
-- 10 s and is named, a rank missing at the rendezvous is named by the others,
-- and SIGINT stops every rank. CPU only: through mpirun (the default for
-- --device cpu) and with --spawn direct (how CUDA ranks start).
local T = require 'moonshard.tensor'
local launch = require 'moonshard.launch'

local root = T.root
local dir = os.tmpname()
os.remove(dir)
os.execute("mkdir -p '" .. dir .. "'")

local function write(name, text)
  local f = assert(io.open(dir .. '/' .. name, 'w'))
  f:write(text)
  f:close()
  return dir .. '/' .. name
end

local function slurp(path)
  local f = io.open(path, 'r')
  if not f then return nil end
  local s = f:read('*a')
  f:close()
  return s
end

-- runs bin/train with `args`; returns output (stdout+stderr), exit code, seconds
local function train(args)
  local t0 = launch.now()
  local p = assert(io.popen(("cd '%s' && luajit bin/train %s 2>&1; echo \"__exit $?\""):format(root, args)))
  local out = p:read('*a')
  p:close()
  local code = tonumber(out:match('__exit (%d+)%s*$'))
  return out:gsub('__exit %d+%s*$', ''), code, launch.now() - t0
end

local function alive(pid) return os.execute(('kill -0 %d 2>/dev/null'):format(pid)) == 0 end

local function wait_until(f, secs)
  local t0 = launch.now()
  while launch.now() - t0 < secs do
    if f() then return true end
    os.execute('sleep 0.05')
  end
  return f()
end

-- a script that writes its pid, then sleeps (the rank to be stopped)
local function pid_script(tag)
  return write(tag .. '.lua', ([[
    local pid = io.open('/proc/self/stat'):read('*l'):match('^(%%d+)')
    local f = io.open('%s/%s.pid.' .. os.getenv('RANK'), 'w'); f:write(pid, '\n'); f:close()
    %s
  ]]):format(dir, tag, "os.execute('sleep 60')"))
end

local function pids(tag, n)
  local list = {}
  for r = 0, n - 1 do
    local s = slurp(('%s/%s.pid.%d'):format(dir, tag, r))
    list[#list + 1] = s and tonumber(s:match('%d+'))
  end
  return list
end

describe('bin/train launcher', function()
  teardown(function() os.execute("rm -rf '" .. dir .. "'") end)

  it('starts N ranks through mpirun with the environment ms.dist reads; output is prefixed by rank', function()
    local s = write('ok.lua', [[
      local ms = require 'moonshard'
      local dist = require 'moonshard.dist'
      dist.init{ timeout = 30 }
      local t = ms.full({ 5 }, dist.rank() + 1, { dtype = 'bf16' })
      dist.all_reduce(t, 'sum')
      print(('env %s %s %s %s %s %s %s'):format(os.getenv('RANK'), os.getenv('WORLD_SIZE'), os.getenv('LOCAL_RANK'),
        os.getenv('LOCAL_WORLD_SIZE'), os.getenv('MASTER_ADDR'), os.getenv('MS_DEVICE'), os.getenv('NCCL_NVLS_ENABLE')))
      print('token', #os.getenv('MS_DIST_TOKEN'), 'sum', t:float():totable()[5])
      io.stderr:write('to stderr\n')
      dist.destroy()
    ]])
    local out, code = train('--nproc-per-node 3 --device cpu ' .. s)
    assert.are.equal(0, code, out)
    for r = 0, 2 do
      assert.matches(('[rank %d] env %d 3 %d 3 127.0.0.1 cpu 0'):format(r, r, r), out, 1, true)
      assert.matches(('[rank %d] token\t32\tsum\t6'):format(r), out, 1, true)
      assert.matches(('[rank %d] to stderr'):format(r), out, 1, true)
    end
  end)

  for _, spawn in ipairs({ 'mpirun', 'direct' }) do
    it(('stops the run within 10 s when a rank fails, and names it (--spawn %s)'):format(spawn), function()
      local tag = 'fail_' .. spawn
      local s = write(tag .. '.lua', ([[
        local pid = io.open('/proc/self/stat'):read('*l'):match('^(%%d+)')
        local f = io.open('%s/%s.pid.' .. os.getenv('RANK'), 'w'); f:write(pid, '\n'); f:close()
        if os.getenv('RANK') == '1' then os.execute('sleep 0.5'); os.exit(3) end
        os.execute('sleep 60')
      ]]):format(dir, tag))
      local out, code, secs = train(('--nproc-per-node 3 --device cpu --spawn %s %s'):format(spawn, s))
      assert.are_not.equal(0, code)
      assert.is_true(secs < 10, ('took %.1f s'):format(secs))
      assert.matches('rank 1 failed (exit status 3)', out, 1, true)
      for r, pid in ipairs(pids(tag, 3)) do
        assert.is_true(wait_until(function() return not alive(pid) end, 2), 'rank ' .. (r - 1) .. ' still runs')
      end
    end)
  end

  it('stops the run within 10 s when a rank fails after dist.init (no MPI_Finalize waits for the others)', function()
    local tag = 'late'
    local s = write(tag .. '.lua', ([[
      local dist = require 'moonshard.dist'
      dist.init{ timeout = 30 }
      local pid = io.open('/proc/self/stat'):read('*l'):match('^(%%d+)')
      local f = io.open('%s/%s.pid.' .. dist.rank(), 'w'); f:write(pid, '\n'); f:close()
      dist.barrier()
      if dist.rank() == 2 then error('rank two gives up') end
      os.execute('sleep 60')
    ]]):format(dir, tag))
    local out, code, secs = train('--nproc-per-node 3 --device cpu ' .. s)
    assert.are_not.equal(0, code)
    assert.is_true(secs < 10, ('took %.1f s'):format(secs))
    assert.matches('rank two gives up', out, 1, true)
    assert.matches('rank 2 failed (exit status 1)', out, 1, true)
    for r, pid in ipairs(pids(tag, 3)) do
      assert.is_true(wait_until(function() return not alive(pid) end, 2), 'rank ' .. (r - 1) .. ' still runs')
    end
  end)

  for _, spawn in ipairs({ 'mpirun', 'direct' }) do
    it(('names the ranks that never reach the rendezvous (--spawn %s)'):format(spawn), function()
      local s = write('hang.lua', [[
        local dist = require 'moonshard.dist'
        if os.getenv('RANK') == '2' then os.execute('sleep 60') end
        dist.init{ backend = 'mpi', timeout = 2 }
      ]])
      local out, code, secs = train(('--nproc-per-node 3 --device cpu --spawn %s %s'):format(spawn, s))
      assert.are_not.equal(0, code)
      assert.is_true(secs < 10, ('took %.1f s'):format(secs))
      -- the first rank to fail stops the other, which may not have printed yet
      local lines = 0
      for r, line in out:gmatch('%[rank (%d)%]([^\n]*dist%.init[^\n]*)') do
        lines = lines + 1
        assert.matches(("dist.init (rank %s of 3): rendezvous 'init' timed out after 2 s: rank 2 of 3 never arrived")
          :format(r), line, 1, true)
      end
      assert.is_true(lines >= 1, out)
      assert.matches('bin/train: rank [01] failed %(exit status 1%)', out)
    end)
  end

  for _, spawn in ipairs({ 'mpirun', 'direct' }) do
    it(('stops every rank on SIGINT (--spawn %s)'):format(spawn), function()
      local tag = 'int_' .. spawn
      local s = pid_script(tag)
      local lpid, status = dir .. '/' .. tag .. '.launcher', dir .. '/' .. tag .. '.status'
      os.execute(("cd '%s' && (luajit bin/train --nproc-per-node 3 --device cpu --spawn %s %s >'%s.out' 2>&1 & "
        .. "echo $! >'%s'; wait $!; echo $? >'%s') >/dev/null 2>&1 &"):format(root, spawn, s, lpid, lpid, status))
      assert.is_true(wait_until(function()
        local p = pids(tag, 3)
        return p[1] and p[2] and p[3]
      end, 10), 'the ranks did not start')
      local launcher = tonumber(slurp(lpid))
      local t0 = launch.now()
      os.execute(('kill -INT %d'):format(launcher))
      assert.is_true(wait_until(function() return slurp(status) ~= nil and slurp(status) ~= '' end, 12),
        'the launcher did not exit')
      assert.is_true(launch.now() - t0 < 10.5)
      assert.are.equal(130, tonumber(slurp(status)))
      for r, pid in ipairs(pids(tag, 3)) do
        assert.is_true(wait_until(function() return not alive(pid) end, 2), 'rank ' .. (r - 1) .. ' still runs')
      end
      assert.matches('stopped by SIGINT', slurp(lpid .. '.out'), 1, true)
    end)
  end

  for _, spawn in ipairs({ 'mpirun', 'direct' }) do
    it(('serves the rendezvous store itself, its port bound before any rank starts (--spawn %s)'):format(spawn), function()
      -- each rank first tries to take MASTER_PORT as another program would
      -- (bound by the launcher, it must be refused), then meets the others
      -- at the launcher's store
      local s = write('agent_' .. spawn .. '.lua', [[
        local ffi = require 'ffi'
        local bit = require 'bit'
        local dist = require 'moonshard.dist'
        ffi.cdef[=[
          typedef struct { uint16_t family; uint16_t port; uint32_t addr; uint8_t zero[8]; } spec_sin;
          int spec_socket(int, int, int) asm("socket");
          int spec_bind(int, const void *, uint32_t) asm("bind");
          int spec_close(int) asm("close");
        ]=]
        local port, rank = tonumber(os.getenv('MASTER_PORT')), tonumber(os.getenv('RANK'))
        local fd = ffi.C.spec_socket(2, 1, 0)
        local a = ffi.new('spec_sin')
        a.family, a.addr = 2, 0x0100007f
        a.port = bit.bor(bit.rshift(port, 8), bit.lshift(bit.band(port, 0xff), 8))
        local rc = ffi.C.spec_bind(fd, a, ffi.sizeof(a))
        local err = ffi.errno()
        ffi.C.spec_close(fd)
        print('intruder', rc, err, os.getenv('MS_AGENT_STORE'))
        local st = assert(dist.store_connect { port = port, rank = rank })
        st:set('hello/' .. rank, 'from ' .. rank)
        assert(st:barrier('agent', rank, 3, 20))
        print('peer', assert(st:get('hello/' .. ((rank + 1) % 3), 5)))
      ]])
      local out, code = train(('--nproc-per-node 3 --device cpu --spawn %s %s'):format(spawn, s))
      assert.are.equal(0, code, out)
      for r = 0, 2 do
        assert.matches(('[rank %d] intruder\t-1\t98\t1'):format(r), out, 1, true)   -- EADDRINUSE
        assert.matches(('[rank %d] peer\tfrom %d'):format(r, (r + 1) % 3), out, 1, true)
      end
    end)
  end

  it('initialises dist again in the same ranks against the one store, with each init\'s own keys', function()
    -- in the second init rank 1 asks for 'k' before rank 0 sets it again: it
    -- must wait for the second value, not read the first init's
    local s = write('reinit.lua', [[
      local ms = require 'moonshard'
      local dist = require 'moonshard.dist'
      for round = 1, 2 do
        dist.init { timeout = 30 }
        local st = dist.store()
        if dist.rank() == 0 then
          if round == 2 then os.execute('sleep 0.5') end
          st:set('k', 'round ' .. round)
        end
        local v = assert(st:get('k', 10))
        local t = ms.full({ 3 }, dist.rank() + round)
        dist.all_reduce(t, 'sum')
        print(('init %d: %s, sum %g'):format(round, v, t:totable()[3]))
        dist.destroy()
      end
    ]])
    local out, code = train('--nproc-per-node 2 --device cpu ' .. s)
    assert.are.equal(0, code, out)
    for r = 0, 1 do
      assert.matches(('[rank %d] init 1: round 1, sum 3'):format(r), out, 1, true)
      assert.matches(('[rank %d] init 2: round 2, sum 5'):format(r), out, 1, true)
    end
  end)

  it('runs two nodes against the store of node 0\'s launcher, which waits for the last rank to leave', function()
    -- a port for --master-port: node 0's launcher binds it (node 1's ranks
    -- retry their connection until it is there)
    local dist = require 'moonshard.dist'
    local probe = dist.store_server { host = '127.0.0.1', port = 0, token = 'probe' }
    local port = probe:port()
    probe:stop()
    local s = write('nodes.lua', [[
      local dist = require 'moonshard.dist'
      local rank, world = tonumber(os.getenv('RANK')), tonumber(os.getenv('WORLD_SIZE'))
      local st = assert(dist.store_connect { port = tonumber(os.getenv('MASTER_PORT')), rank = rank, timeout = 20 })
      st:set('node/' .. rank, os.getenv('GROUP_RANK'))
      assert(st:barrier('nodes', rank, world, 20))
      -- node 0's ranks are gone by now: its launcher keeps the store for us
      if os.getenv('GROUP_RANK') == '1' then os.execute('sleep 1') end
      local seen = {}
      for r = 0, world - 1 do seen[#seen + 1] = assert(st:get('node/' .. r, 5)) end
      print('nodes', table.concat(seen, ' '), os.getenv('MS_AGENT_STORE'))
    ]])
    local cmd = "cd '%s' && MS_DIST_TOKEN=two-nodes luajit bin/train --nnodes 2 --node-rank %d --master-addr 127.0.0.1 "
      .. "--master-port %d --nproc-per-node 2 --device cpu --spawn direct %s >'%s/node%d.out' 2>&1; echo $? >'%s/node%d.rc'"
    os.execute(('(%s) &'):format(cmd:format(root, 1, port, s, dir, 1, dir, 1)))   -- node 1 first: it waits
    os.execute('sleep 0.3')
    os.execute(cmd:format(root, 0, port, s, dir, 0, dir, 0))
    assert.is_true(wait_until(function() return (slurp(dir .. '/node1.rc') or '') ~= '' end, 20), 'node 1 did not end')
    for node = 0, 1 do
      local out = slurp(('%s/node%d.out'):format(dir, node))
      assert.are.equal('0', slurp(('%s/node%d.rc'):format(dir, node)):match('%d+'), out)
      for r = 2 * node, 2 * node + 1 do
        assert.matches(('[rank %d] nodes\t0 0 1 1\t1'):format(r), out, 1, true)
      end
    end
    -- (2 to 4 connected: node 0's own ranks may not have been seen to leave yet)
    assert.matches("waiting for the other nodes' ranks to leave the rendezvous store %([234] connected%)",
      slurp(dir .. '/node0.out'))
  end)

  it('--max-restarts starts every rank again after a failure; dist.init meets the new attempt\'s ranks only', function()
    -- rank 1 fails in attempts 0 and 1 after a collective; attempt 2 ends well
    local s = write('restart.lua', [[
      local ms = require 'moonshard'
      local dist = require 'moonshard.dist'
      dist.init { timeout = 30 }
      local t = ms.full({ 2 }, dist.rank() + 1)
      dist.all_reduce(t, 'sum')
      -- a key every attempt sets: rank 1 asks before rank 0 sets it, and
      -- must get this attempt's value, not an earlier one's
      local st = dist.store()
      if dist.rank() == 0 then os.execute('sleep 0.3'); st:set('k', os.getenv('MS_RESTART_COUNT')) end
      print(('attempt %s %s sum %g k %s'):format(os.getenv('MS_RESTART_COUNT'), os.getenv('TORCHELASTIC_RESTART_COUNT'),
        t:totable()[1], assert(st:get('k', 10))))
      io.stdout:flush()
      if os.getenv('MS_RESTART_COUNT') ~= '2' and dist.rank() == 1 then os.exit(3) end
      dist.destroy()
    ]])
    local out, code = train('--nproc-per-node 2 --device cpu --max-restarts 3 ' .. s)
    assert.are.equal(0, code, out)
    for a = 0, 2 do assert.matches(('[rank 1] attempt %d %d sum 3 k %d'):format(a, a, a), out, 1, true) end
    assert.matches('[rank 0] attempt 2 2 sum 3 k 2', out, 1, true)
    assert.matches('bin/train: restarting every rank (restart 1 of 3)', out, 1, true)
    assert.matches('bin/train: restarting every rank (restart 2 of 3)', out, 1, true)
    assert.is_nil(out:find('restart 3 of 3', 1, true))
    -- restarts used up: the last failure's status
    local s2 = write('always.lua', [[
      print('attempt ' .. os.getenv('MS_RESTART_COUNT'))
      io.stdout:flush()
      -- (rank 0 fails after rank 1 has printed: the launcher stops rank 1
      -- at once when rank 0 fails, and rank 1's log must hold each attempt)
      if os.getenv('RANK') == '0' then os.execute('sleep 1'); os.exit(4) end
    ]])
    local logs = dir .. '/restart_logs'
    out, code = train(('--nproc-per-node 2 --device cpu --spawn direct --max-restarts 1 --log-dir %s %s'):format(logs, s2))
    assert.are.equal(4, code, out)
    -- each rank's log keeps every attempt
    assert.are.equal('attempt 0\n--- bin/train: restart 1\nattempt 1\n', slurp(logs .. '/rank1.log'))
    assert.matches('restarting every rank (restart 1 of 1)', out, 1, true)
    local _, fails = out:gsub('rank 0 failed %(exit status 4%); the run stopped', '')
    assert.are.equal(2, fails, out)
  end)

  it('--max-restarts with two nodes: the launchers stop and start again together', function()
    local dist = require 'moonshard.dist'
    -- two launchers on this host, one rank each; returns both outputs and exit codes
    local function two_nodes(tag, script)
      local probe = dist.store_server { host = '127.0.0.1', port = 0, token = 'probe' }
      local port = probe:port()
      probe:stop()
      local cmd = "cd '%s' && MS_DIST_TOKEN=restarts luajit bin/train --nnodes 2 --node-rank %d --master-addr 127.0.0.1 "
        .. "--master-port %d --nproc-per-node 1 --device cpu --spawn direct --max-restarts 1 %s >'%s/%s%d.out' 2>&1; "
        .. "echo $? >'%s/%s%d.rc'"
      os.execute(('(%s) &'):format(cmd:format(root, 1, port, script, dir, tag, 1, dir, tag, 1)))
      os.execute(cmd:format(root, 0, port, script, dir, tag, 0, dir, tag, 0))
      assert.is_true(wait_until(function() return (slurp(('%s/%s1.rc'):format(dir, tag)) or '') ~= '' end, 30))
      local r = {}
      for n = 0, 1 do
        r[n] = { out = slurp(('%s/%s%d.out'):format(dir, tag, n)),
                 code = tonumber(slurp(('%s/%s%d.rc'):format(dir, tag, n)):match('%d+')) }
      end
      return r
    end
    -- node 1's rank fails while node 0's still runs: node 0 stops its rank
    local s = write('nodes_fail.lua', [[
      print('attempt ' .. os.getenv('MS_RESTART_COUNT'))
      io.stdout:flush()
      if os.getenv('MS_RESTART_COUNT') == '0' then
        if os.getenv('RANK') == '1' then os.execute('sleep 0.5'); os.exit(3) end
        os.execute('sleep 30')
      end
    ]])
    local t0 = launch.now()
    local r = two_nodes('nf', s)
    assert.is_true(launch.now() - t0 < 20, 'took too long')
    for n = 0, 1 do
      assert.are.equal(0, r[n].code, r[n].out)
      assert.matches('restarting every rank (restart 1 of 1)', r[n].out, 1, true)
      assert.matches(('[rank %d] attempt 1'):format(n), r[n].out, 1, true)
    end
    assert.matches("node 1 failed; stopping this node's ranks", r[0].out, 1, true)
    -- node 0's rank ends well first, then node 1's fails: node 0 starts again too
    s = write('nodes_late.lua', [[
      print('attempt ' .. os.getenv('MS_RESTART_COUNT'))
      io.stdout:flush()
      if os.getenv('MS_RESTART_COUNT') == '0' and os.getenv('RANK') == '1' then os.execute('sleep 1'); os.exit(3) end
    ]])
    r = two_nodes('nl', s)
    for n = 0, 1 do
      assert.are.equal(0, r[n].code, r[n].out)
      assert.matches(('[rank %d] attempt 1'):format(n), r[n].out, 1, true)
    end
    assert.matches("node 1 failed; this node's ranks ended well, but every node starts again", r[0].out, 1, true)
    -- restarts used up: both launchers fail
    s = write('nodes_always.lua', [[ if os.getenv('RANK') == '1' then os.exit(5) end os.execute('sleep 30') ]])
    r = two_nodes('na', s)
    assert.are.equal(5, r[1].code, r[1].out)
    assert.are.equal(1, r[0].code, r[0].out)
    assert.matches('node 1 failed', r[0].out, 1, true)
  end)

  it('says which address it cannot serve the store on', function()
    local s = write('noop2.lua', 'print(1)')
    local out, code = train('--nproc-per-node 2 --device cpu --master-addr 192.0.2.1 ' .. s)
    assert.are.equal(1, code, out)
    assert.matches('bin/train: cannot serve the rendezvous store on 192.0.2.1:a free port', out, 1, true)
  end)

  it('writes per-rank logs with --log-dir and shows only rank 0 on the console', function()
    local s = write('logs.lua', [[ print('line of rank ' .. os.getenv('RANK')) ]])
    local logs = dir .. '/logs'
    local out, code = train(('--nproc-per-node 2 --device cpu --spawn direct --log-dir %s %s'):format(logs, s))
    assert.are.equal(0, code, out)
    assert.matches('[rank 0] line of rank 0', out, 1, true)
    assert.is_nil(out:find('line of rank 1', 1, true))
    assert.are.equal('line of rank 0\n', slurp(logs .. '/rank0.log'))
    assert.are.equal('line of rank 1\n', slurp(logs .. '/rank1.log'))
  end)

  it('gives direct ranks RANK, LOCAL_RANK, GROUP_RANK and the node\'s offset', function()
    local s = write('env.lua', [[ print(os.getenv('RANK'), os.getenv('LOCAL_RANK'), os.getenv('WORLD_SIZE'), os.getenv('GROUP_RANK')) ]])
    -- several nodes need the shared secret
    local out, code = train(('--nnodes 2 --node-rank 1 --master-addr 127.0.0.1 --nproc-per-node 2 --device cpu '
      .. '--spawn direct %s'):format(s))
    assert.are.equal(2, code, out)
    assert.matches('MS_DIST_TOKEN', out, 1, true)
    local p = assert(io.popen(("cd '%s' && MS_DIST_TOKEN=abc luajit bin/train --nnodes 2 --node-rank 1 "
      .. "--master-addr 127.0.0.1 --nproc-per-node 2 --device cpu --spawn direct %s 2>&1"):format(root, s)))
    out = p:read('*a')
    p:close()
    assert.matches('[rank 2] 2\t0\t4\t1', out, 1, true)
    assert.matches('[rank 3] 3\t1\t4\t1', out, 1, true)
  end)

  it('refuses bad launcher options with exit status 2', function()
    local s = write('noop.lua', 'print(1)')
    local out, code = train('--nproc-per-node 0 ' .. s)
    assert.are.equal(2, code)
    assert.matches('--nproc-per-node expects an integer >= 1', out, 1, true)
    out, code = train('--nnodes 2 --nproc-per-node 1 ' .. s)
    assert.are.equal(2, code)
    assert.matches('needs --master-addr', out, 1, true)
    out, code = train('--nproc-per-node 2 --device tpu ' .. s)
    assert.are.equal(2, code)
    assert.matches('--device is cpu or cuda', out, 1, true)
  end)

  it('trains a model file with the built-in loop in every rank', function()
    local out, code = train(('--nproc-per-node 2 --device cpu models/gpt2.lua --steps 2 --log-every 1 --eval-iters 1 '
      .. '--sample-tokens 0 --save false --out %s/run'):format(dir))
    assert.are.equal(0, code, out)
    assert.matches('[rank 0] done: 2 steps', out, 1, true)
    assert.matches('[rank 1] done: 2 steps', out, 1, true)
  end)

  it('runs one process as before without --nproc-per-node', function()
    local s = write('single.lua', [[ print('single', os.getenv('RANK'), ...) ]])
    local out, code = train(s .. ' a b')
    assert.are.equal(0, code, out)
    assert.matches('^single\tnil\ta\tb', out)
  end)
end)
