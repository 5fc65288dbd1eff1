-- The rendezvous store (core/dist/store.c): what real ranks get from it,
-- and what it does with peers that are not ranks — a wrong token, no HELLO,
-- a truncated message, an oversized or zero length prefix, a malformed
-- request, random bytes — each rejected while the store keeps serving the
-- real ranks, its contents untouched. Everything listens on 127.0.0.1.
local ffi = require 'ffi'
local bit = require 'bit'
local dist = require 'moonshard.dist'

ffi.cdef [[
typedef struct ms_spec_sockaddr_in {
  uint16_t sin_family; uint16_t sin_port; uint32_t sin_addr; uint8_t zero[8];
} ms_spec_sockaddr_in;
typedef struct ms_spec_pollfd { int fd; short events; short revents; } ms_spec_pollfd;
int ms_spec_socket(int domain, int type, int protocol) asm("socket");
int ms_spec_connect(int fd, const void *addr, uint32_t len) asm("connect");
long ms_spec_send(int fd, const void *buf, size_t n, int flags) asm("send");
long ms_spec_recv(int fd, void *buf, size_t n, int flags) asm("recv");
int ms_spec_close(int fd) asm("close");
int ms_spec_poll(ms_spec_pollfd *fds, unsigned long n, int timeout) asm("poll");
]]

local TOKEN = 'spec-token-0123456789abcdef'

local function sleep_ms(ms) ffi.C.ms_spec_poll(nil, 0, ms) end

-- a raw TCP connection to 127.0.0.1:port
local function raw_connect(port)
  local fd = ffi.C.ms_spec_socket(2, 1, 0)   -- AF_INET, SOCK_STREAM
  assert(fd >= 0, 'socket failed')
  local a = ffi.new('ms_spec_sockaddr_in')
  a.sin_family = 2
  a.sin_port = bit.bor(bit.rshift(port, 8), bit.lshift(bit.band(port, 0xff), 8))
  a.sin_addr = 0x0100007f   -- 127.0.0.1, network order on a little-endian host
  assert(ffi.C.ms_spec_connect(fd, a, ffi.sizeof(a)) == 0, 'connect failed')
  return fd
end

local function raw_send(fd, s)
  local sent = 0
  while sent < #s do
    local n = tonumber(ffi.C.ms_spec_send(fd, ffi.cast('const char *', s) + sent, #s - sent, 0x4000)) -- MSG_NOSIGNAL
    if n <= 0 then return false end
    sent = sent + n
  end
  return true
end

-- reads until the server closes the connection (or timeout): what it said
local function raw_drain(fd, timeout_ms)
  local buf, out = ffi.new('char[4096]'), {}
  local pfd = ffi.new('ms_spec_pollfd[1]')
  local waited = 0
  while waited < timeout_ms do
    pfd[0].fd, pfd[0].events = fd, 1
    if ffi.C.ms_spec_poll(pfd, 1, 50) > 0 then
      local n = tonumber(ffi.C.ms_spec_recv(fd, buf, 4096, 0))
      if n <= 0 then return table.concat(out), true end
      out[#out + 1] = ffi.string(buf, n)
    else
      waited = waited + 50
    end
  end
  return table.concat(out), false
end

local function u32(n)
  return string.char(n % 256, math.floor(n / 256) % 256, math.floor(n / 65536) % 256, math.floor(n / 16777216) % 256)
end
local function str(s) return u32(#s) .. s end
local function frame(body) return u32(#body) .. body end
local function hello(token) return frame(string.char(1) .. u32(1) .. u32(0) .. str(token)) end

-- waits until f() is true (the server thread works on its own time)
local function eventually(f, what)
  for _ = 1, 200 do
    if f() then return end
    sleep_ms(10)
  end
  error('never happened: ' .. what, 2)
end

-- another process acting as a rank: runs `code` with `store` connected
local function run_bg(port, code)
  local path = os.tmpname()
  local f = assert(io.open(path, 'w'))
  f:write(([[
    local dist = require 'moonshard.dist'
    local store = assert(dist.store_connect{ port = %d, token = %q, rank = 9, timeout = 10 })
    %s
  ]]):format(port, TOKEN, code))
  f:close()
  local p = assert(io.popen('luajit ' .. path .. ' 2>&1; echo "exit $?"'))
  return { p = p, path = path }
end
local function finish_bg(h)
  local out = h.p:read('*a')
  h.p:close()
  os.remove(h.path)
  return out
end

describe('rendezvous store', function()
  local server, port, store

  setup(function()
    server = dist.store_server { host = '127.0.0.1', port = 0, token = TOKEN }
    port = server:port()
    store = assert(dist.store_connect { port = port, token = TOKEN, rank = 0, timeout = 10 })
  end)
  teardown(function()
    store:close()
    server:stop()
  end)

  it('listens on the loopback address it was given, not on every interface', function()
    local hexport = ('%04X'):format(port)
    local found = false
    for line in io.lines('/proc/net/tcp') do
      local addr, p, st = line:match('^%s*%d+: (%x+):(%x+) %x+:%x+ (%x+)')
      if p == hexport and st == '0A' then
        assert.are.equal('0100007F', addr)
        found = true
      end
    end
    assert.is_true(found, 'no listening socket on port ' .. port)
  end)

  it('sets, gets, adds and waits', function()
    store:set('a', 'hello')
    assert.are.equal('hello', store:get('a', 1))
    store:set('a', string.rep('x', 10000))   -- a value larger than the first read buffer
    assert.are.equal(string.rep('x', 10000), store:get('a', 1))
    assert.are.equal(3, store:add('n', 3))
    assert.are.equal(1, store:add('n', -2))
    assert.is_true(store:wait({ 'a', 'n' }, 1))
    assert.is_true(store:ping())
  end)

  it('makes a get wait for a key another rank sets later', function()
    local h = run_bg(port, [[ os.execute('sleep 0.3'); store:set('late', 'here') ]])
    assert.are.equal('here', store:get('late', 10))
    assert.matches('exit 0', finish_bg(h))
  end)

  it('times out a get and a wait naming the missing keys', function()
    local v, err = store:get('never', 0.2)
    assert.is_nil(v)
    assert.matches("key 'never' did not appear within 0.2 s", err, 1, true)
    local ok, err2 = store:wait({ 'a', 'nope1', 'nope2' }, 0.2)
    assert.is_nil(ok)
    assert.matches("2 keys: 'nope1', 'nope2'", err2, 1, true)
  end)

  it('meets at a barrier with other processes; a time-out names the ranks that never arrived', function()
    local h1 = run_bg(port, [[ assert(store:barrier('b', 1, 3, 10)) ]])
    local h2 = run_bg(port, [[ os.execute('sleep 0.2'); assert(store:barrier('b', 2, 3, 10)) ]])
    assert.is_true(store:barrier('b', 0, 3, 10))
    assert.matches('exit 0', finish_bg(h1))
    assert.matches('exit 0', finish_bg(h2))
    local ok, err = store:barrier('lonely', 0, 5, 0.3)
    assert.is_nil(ok)
    assert.matches("rendezvous 'lonely' timed out after 0.3 s: ranks 1-4 of 5 never arrived", err, 1, true)
  end)

  it('rejects a client with a wrong token, and keeps serving', function()
    local before = server:stats().rejected_auth
    local s, err = dist.store_connect { port = port, token = 'not-the-token', rank = 1, timeout = 5 }
    assert.is_nil(s)
    assert.matches('authentication failed', err, 1, true)
    assert.are.equal(before + 1, server:stats().rejected_auth)
    assert.are.equal(string.rep('x', 10000), store:get('a', 1))
    assert.is_true(store:ping())
  end)

  it('rejects a peer whose first message is not HELLO', function()
    local before = server:stats().rejected_auth
    local fd = raw_connect(port)
    raw_send(fd, frame(string.char(2) .. str('a') .. str('overwritten')))   -- SET without HELLO
    local reply, closed = raw_drain(fd, 2000)
    ffi.C.ms_spec_close(fd)
    assert.is_true(closed)
    assert.matches('authentication required', reply, 1, true)
    assert.are.equal(before + 1, server:stats().rejected_auth)
    assert.are.equal(string.rep('x', 10000), store:get('a', 1))
  end)

  it('rejects an oversized or zero length prefix without reading further', function()
    for _, n in ipairs({ 0xffffffff, 2 ^ 20 + 1, 0 }) do
      local before = server:stats().rejected_oversize
      local fd = raw_connect(port)
      raw_send(fd, hello(TOKEN) .. u32(n) .. 'abc')
      local reply, closed = raw_drain(fd, 2000)
      ffi.C.ms_spec_close(fd)
      assert.is_true(closed, 'the server kept a connection that announced ' .. n .. ' bytes')
      assert.matches(('message of %d bytes refused'):format(n), reply, 1, true)
      assert.are.equal(before + 1, server:stats().rejected_oversize)
    end
    assert.is_true(store:ping())
  end)

  it('drops a truncated message, and the store is unchanged', function()
    local keys = server:stats().keys
    local before = server:stats().truncated
    local fd = raw_connect(port)
    local body = string.char(2) .. str('trunc') .. str(string.rep('v', 100))
    raw_send(fd, hello(TOKEN) .. u32(#body) .. body:sub(1, 40))
    sleep_ms(20)
    ffi.C.ms_spec_close(fd)
    eventually(function() return server:stats().truncated == before + 1 end, 'truncated counted')
    local v = store:get('trunc', 0.05)
    assert.is_nil(v)
    assert.are.equal(keys, server:stats().keys)
  end)

  it('rejects malformed requests from an authenticated peer without touching the table', function()
    local keys = server:stats().keys
    local bad = {
      string.char(2) .. u32(1000) .. 'k',                       -- key length past the frame
      string.char(2) .. str('k') .. str('v') .. 'junk',         -- trailing bytes
      string.char(2) .. str('') .. str('v'),                    -- empty key
      string.char(2) .. str(string.rep('k', 513)) .. str('v'),  -- key too long
      string.char(99),                                          -- unknown op
      string.char(5) .. u32(10) .. u32(0),                      -- WAIT for no keys
      string.char(1) .. u32(1) .. u32(0) .. str(TOKEN),         -- HELLO twice
    }
    for i, b in ipairs(bad) do
      local before = server:stats().rejected_malformed
      local fd = raw_connect(port)
      raw_send(fd, hello(TOKEN) .. frame(b))
      local reply, closed = raw_drain(fd, 2000)
      ffi.C.ms_spec_close(fd)
      assert.is_true(closed, 'malformed request ' .. i .. ' left the connection open')
      assert.matches('malformed request', reply, 1, true)
      assert.are.equal(before + 1, server:stats().rejected_malformed, 'request ' .. i)
    end
    assert.are.equal(keys, server:stats().keys)
    assert.is_nil((store:get('k', 0.05)))
  end)

  it('survives a fuzz loop of random bytes, before and after authentication', function()
    math.randomseed(12345)
    local keys = server:stats().keys
    local function rnd(n)
      local t = {}
      for i = 1, n do t[i] = string.char(math.random(0, 255)) end
      return table.concat(t)
    end
    for i = 1, 150 do
      local fd = raw_connect(port)
      local kind = i % 3
      local msg
      if kind == 0 then
        msg = rnd(math.random(1, 64))                                  -- noise
      elseif kind == 1 then
        local body = rnd(math.random(1, 48))
        msg = u32(#body) .. body                                       -- a frame of noise
      else
        local body = string.char(math.random(1, 7)) .. rnd(math.random(0, 40))
        msg = hello(TOKEN) .. u32(#body) .. body                       -- noise after HELLO
      end
      raw_send(fd, msg)
      raw_drain(fd, 30)
      ffi.C.ms_spec_close(fd)
      if i % 25 == 0 then assert.is_true(store:ping()) end
    end
    -- real ranks are still served, the contents intact
    assert.is_true(store:ping())
    assert.are.equal(string.rep('x', 10000), store:get('a', 1))
    store:set('after-fuzz', 'ok')
    assert.are.equal('ok', store:get('after-fuzz', 1))
    assert.are.equal(keys + 1, server:stats().keys)
    local st = server:stats()
    assert.is_true(st.rejected_auth + st.rejected_malformed + st.rejected_oversize + st.truncated > 50)
  end)

  it('refuses values and keys over the limits on the client side too', function()
    local ok, err = pcall(store.set, store, 'big', string.rep('z', 2 ^ 20))
    assert.is_false(ok)
    assert.matches('too large', err, 1, true)
    ok, err = pcall(store.set, store, string.rep('k', 600), 'v')
    assert.is_false(ok)
    assert.matches('keys are 1 to 512 bytes', err, 1, true)
    assert.is_true(store:ping())
  end)

  it('puts a client\'s prefix before every key it names: set, get, add, wait and barrier', function()
    local open = server:stats().open
    local other = assert(dist.store_connect { port = port, token = TOKEN, rank = 0, timeout = 10 })
    assert.are.equal(open + 1, server:stats().open)   -- the connections open now
    other:set_prefix('e2/')
    store:set('pk', 'plain')
    other:set('pk', 'prefixed')
    assert.are.equal('plain', store:get('pk', 1))
    assert.are.equal('prefixed', other:get('pk', 1))
    assert.are.equal('prefixed', store:get('e2/pk', 1))   -- the name on the wire
    assert.are.equal(5, other:add('pn', 5))
    assert.are.equal(5, store:add('e2/pn', 0))
    assert.is_nil(store:get('pn', 0.1))
    local ok, err = other:wait({ 'pk', 'only_plain' }, 0.1)
    assert.is_nil(ok)
    assert.matches("1 key: 'only_plain'", err, 1, true)   -- the names as the caller gave them
    assert.is_true(other:barrier('pb', 0, 1, 5))
    assert.are.equal(1, store:add('e2/ms/bgen/pb/0', 0))
    -- the prefix counts against the key limit; '' removes it
    ok, err = pcall(other.set, other, string.rep('k', 510), 'v')
    assert.is_false(ok)
    assert.matches('keys are 1 to 509 bytes, got 510', err, 1, true)
    ok, err = pcall(other.set_prefix, other, string.rep('p', 24))
    assert.is_false(ok)
    assert.matches('a key prefix is at most 23 bytes, got 24', err, 1, true)
    other:set_prefix('')
    assert.are.equal('plain', other:get('pk', 1))
    other:close()
    local t0 = os.clock()
    while server:stats().open ~= open and os.clock() - t0 < 5 do other = nil end
    assert.are.equal(open, server:stats().open)
  end)

  it('tells a rank that cannot reach the store which rank it was waiting for', function()
    local s, err = dist.store_connect { port = 1, token = TOKEN, rank = 3, timeout = 0.2 }
    assert.is_nil(s)
    assert.matches("what serves it (rank 0, or bin/train's launcher) is not there", err, 1, true)
  end)
end)
