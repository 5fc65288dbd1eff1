-- safetensors read/write: round trips on random data, views, metadata, the
-- shared fixtures, and every kind of malformed file.
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local st = require 'moonshard.safetensors'
local json = require 'dkjson'
local ffi = require 'ffi'

local fixtures = T.root .. '/../shared/fixtures'

local tmpdir = os.tmpname()
os.remove(tmpdir)
assert(os.execute('mkdir -p ' .. tmpdir) == 0)
local function tmp(name) return tmpdir .. '/' .. name end

local function read_all(path)
  local f = assert(io.open(path, 'rb'))
  local s = f:read('*a')
  f:close()
  return s
end
local function write_all(path, s)
  local f = assert(io.open(path, 'wb'))
  f:write(s)
  f:close()
end
local function exists(path)
  local f = io.open(path, 'rb')
  if f then f:close() end
  return f ~= nil
end
local function u64le(n)
  local b = {}
  for i = 1, 8 do b[i] = string.char(n % 256); n = math.floor(n / 256) end
  return table.concat(b)
end
-- the header of a file, parsed independently of the module
local function raw_header(path)
  local s = read_all(path)
  local n = 0
  for i = 8, 1, -1 do n = n * 256 + s:byte(i) end
  return json.decode(s:sub(9, 8 + n)), n, s
end
local function flat(t)
  local out = {}
  local function walk(v)
    if type(v) == 'table' then for i = 1, #v do walk(v[i]) end else out[#out + 1] = v end
  end
  walk(t)
  return out
end
local function count(tbl)
  local n = 0
  for _ in pairs(tbl) do n = n + 1 end
  return n
end

-- random nested table of shape, values from gen(), never zero for numbers
local function rand_table(shape, gen, d)
  d = d or 1
  local r = {}
  for i = 1, shape[d] do
    if d == #shape then r[i] = gen() else r[i] = rand_table(shape, gen, d + 1) end
  end
  return r
end
local function nonzero_float()
  local v = (0.25 + math.random()) * 2 ^ math.random(-6, 6)
  return math.random() < 0.5 and -v or v
end
local gens = {
  f64 = nonzero_float, f32 = nonzero_float, bf16 = nonzero_float, f16 = nonzero_float,
  i64 = function()
    local v = math.random(1, 2 ^ 30) * 1024 + math.random(1, 1023)  -- beyond 32 bits
    return math.random() < 0.5 and -v or v
  end,
  i32 = function() local v = math.random(1, 2 ^ 31 - 1); return math.random() < 0.5 and -v or v end,
  u8 = function() return math.random(1, 255) end,
  bool = function() return math.random() < 0.5 end,
}

describe('safetensors', function()
  math.randomseed(1234)

  teardown(function() os.execute('rm -rf ' .. tmpdir) end)

  describe('round trip', function()
    for _, dtype in ipairs({ 'f64', 'f32', 'bf16', 'f16', 'i64', 'i32', 'u8', 'bool' }) do
      it('keeps every value of a random ' .. dtype .. ' tensor bit-exact', function()
        local data = rand_table({ 3, 5, 7 }, gens[dtype])
        local t = ms.tensor(data, { dtype = dtype })
        local path = tmp('rt_' .. dtype .. '.safetensors')
        st.save(path, { x = t })
        local got = st.load(path)
        assert.are.equal(1, count(got))
        local x = got.x
        assert.are.same({ 3, 5, 7 }, x.shape)
        assert.are.equal(dtype, x.dtype)
        assert.are.same(t:totable(), x:totable())
        -- independent: the data bytes in the file equal the tensor's bytes
        local hdr, n, s = raw_header(path)
        local nbytes = t:numel() * t:element_size()
        assert.are.same({ 0, nbytes }, { hdr.x.data_offsets[1], hdr.x.data_offsets[2] })
        assert.are.equal(8 + n + nbytes, #s)
        assert.are.equal(ffi.string(t:data_ptr(), nbytes), s:sub(9 + n))
        -- and the values differ from zero (the test data is not trivial)
        local nz = 0
        for _, v in ipairs(flat(x:totable())) do if v ~= 0 and v ~= false then nz = nz + 1 end end
        assert.is_true(nz > 0.4 * t:numel())
      end)
    end

    it('decodes known f32/i64 bytes written by hand', function()
      local vals = { 1.5, -2.25, 3.0e-3, 65504 }
      local fbuf = ffi.new('float[4]', vals)
      local ibuf = ffi.new('int64_t[2]', { -100, 2 ^ 40 + 7 })
      local header = '{"a":{"dtype":"F32","shape":[2,2],"data_offsets":[0,16]},' ..
          '"b":{"dtype":"I64","shape":[2],"data_offsets":[16,32]}}'
      local path = tmp('hand.safetensors')
      write_all(path, u64le(#header) .. header .. ffi.string(fbuf, 16) .. ffi.string(ibuf, 16))
      local got = st.load(path)
      assert.are.same({ { 1.5, -2.25 }, { fbuf[2], 65504 } }, got.a:totable())
      assert.are.same({ -100, 2 ^ 40 + 7 }, got.b:totable())
    end)

    it('writes tensors sorted by name, back to back, header padded with spaces to 8 bytes', function()
      local tensors = {
        zeta = ms.tensor(rand_table({ 3 }, nonzero_float), { dtype = 'f16' }),
        alpha = ms.tensor(rand_table({ 2, 3 }, nonzero_float)),
        mid = ms.tensor(rand_table({ 5 }, gens.i64), { dtype = 'i64' }),
        b = ms.tensor(rand_table({ 1 }, gens.bool), { dtype = 'bool' }),
      }
      local path = tmp('order.safetensors')
      st.save(path, tensors, { format = 'pt' })
      local hdr, n, s = raw_header(path)
      assert.are.equal(0, n % 8)
      local text = s:sub(9, 8 + n)
      local json_end = #text:match('^(.-})%s*$')
      assert.are.equal(text:sub(json_end + 1), (' '):rep(n - json_end))
      local names = { 'alpha', 'b', 'mid', 'zeta' }
      local pos = 0
      for _, name in ipairs(names) do
        local e = hdr[name]
        assert.are.equal(pos, e.data_offsets[1])
        local t = tensors[name]
        pos = pos + t:numel() * t:element_size()
        assert.are.equal(pos, e.data_offsets[2])
        assert.are.same(t.shape, { unpack(e.shape) })
      end
      local a, b2, m, z = text:find('"alpha"'), text:find('"b"'), text:find('"mid"'), text:find('"zeta"')
      assert.is_true(a < b2 and b2 < m and m < z)
      assert.are.equal(8 + n + pos, #s)
      assert.are.equal('F16', hdr.zeta.dtype)
      assert.are.equal('BOOL', hdr.b.dtype)
      assert.are.equal('I64', hdr.mid.dtype)
    end)

    it('saves views as their values: transposed, narrowed with an offset, expanded, selected', function()
      local base = ms.tensor(rand_table({ 4, 6 }, nonzero_float))
      local views = {
        tr = base:transpose(1, 2),             -- (6,4), strides (1,6)
        nar = base:narrow(1, 2, 2),            -- contiguous rows 2..3, storage offset 6
        col = base:narrow(2, 3, 2),            -- (4,2), not contiguous
        exp = base:narrow(1, 3, 1):expand(3, 6), -- stride 0
        sel = base:select(2, 5),               -- column 5: (4,), stride 6
      }
      assert.is_false(views.tr:is_contiguous())
      assert.are.equal(6, views.nar:storage_offset())
      local path = tmp('views.safetensors')
      st.save(path, views)
      local got = st.load(path)
      local b = base:totable()
      -- expected values computed from the base's Lua table
      local tr, nar, col, exp, sel = {}, {}, {}, {}, {}
      for j = 1, 6 do tr[j] = {}; for i = 1, 4 do tr[j][i] = b[i][j] end end
      for i = 2, 3 do nar[#nar + 1] = b[i] end
      for i = 1, 4 do col[i] = { b[i][3], b[i][4] } end
      for k = 1, 3 do exp[k] = b[3] end
      for i = 1, 4 do sel[i] = b[i][5] end
      assert.are.same(tr, got.tr:totable())
      assert.are.same(nar, got.nar:totable())
      assert.are.same(col, got.col:totable())
      assert.are.same(exp, got.exp:totable())
      assert.are.same(sel, got.sel:totable())
      -- saving left the views and the base alone
      assert.are.same(b, base:totable())
      assert.are.same(tr, views.tr:totable())
    end)

    it('round-trips scalars (shape []) and empty tensors', function()
      local s = ms.tensor(3.25, { dtype = 'f64' })
      local e = ms.tensor({}, { dtype = 'f32' })
      local path = tmp('scalar.safetensors')
      st.save(path, { s = s, e = e })
      local got = st.load(path)
      assert.are.same({}, got.s.shape)
      assert.are.equal(3.25, got.s:item())
      assert.are.same({ 0 }, got.e.shape)
      assert.are.equal(0, got.e:numel())
    end)

    it('round-trips metadata strings, including quotes, backslashes, newlines and UTF-8', function()
      local meta = { format = 'pt', note = 'a "quoted" \\ back\nslash', ['clé'] = 'valeur é ✓', empty = '' }
      local path = tmp('meta.safetensors')
      st.save(path, { w = ms.tensor({ 1.5, -2 }) }, meta)
      local got, m = st.load(path)
      assert.are.same(meta, m)
      assert.are.same({ 1.5, -2 }, got.w:totable())
      -- and an independent JSON parser agrees
      assert.are.same(meta, (raw_header(path)).__metadata__)
    end)

    it('returns an empty metadata table when the file has none, and writes no __metadata__ for none', function()
      local path = tmp('nometa.safetensors')
      st.save(path, { w = ms.tensor({ 1, 2 }) })
      local _, m = st.load(path)
      assert.are.same({}, m)
      assert.is_nil((raw_header(path)).__metadata__)
    end)

    it('saves and loads an empty table of tensors', function()
      local path = tmp('none.safetensors')
      st.save(path, {}, { k = 'v' })
      local got, m = st.load(path)
      assert.are.same({}, got)
      assert.are.same({ k = 'v' }, m)
    end)

    it('is reachable as ms.save_safetensors / ms.load_safetensors', function()
      local path = tmp('ms.safetensors')
      local x = ms.tensor({ { 1.25, -3 }, { 7, 0.5 } }, { dtype = 'bf16' })
      ms.save_safetensors(path, { x = x })
      assert.are.same(x:totable(), ms.load_safetensors(path).x:totable())
    end)
  end)

  describe('load options', function()
    local path = tmp('opts.safetensors')
    local a = ms.tensor(rand_table({ 2, 3 }, nonzero_float))
    local b = ms.tensor(rand_table({ 4 }, gens.i32), { dtype = 'i32' })
    local c = ms.tensor(rand_table({ 3 }, nonzero_float), { dtype = 'f64' })

    it('opts.names loads only the named tensors (list or set)', function()
      st.save(path, { a = a, b = b, c = c })
      local got = st.load(path, { names = { 'b', 'c' } })
      assert.are.equal(2, count(got))
      assert.are.same(b:totable(), got.b:totable())
      assert.are.same(c:totable(), got.c:totable())
      got = st.load(path, { names = { a = true } })
      assert.are.same({ 'a' }, (function() local r = {} for k in pairs(got) do r[#r + 1] = k end return r end)())
      assert.are.same(a:totable(), got.a:totable())
    end)

    it('opts.names with a missing name is an error naming it and the file', function()
      st.save(path, { a = a, b = b, c = c })
      local ok, err = pcall(st.load, path, { names = { 'a', 'nope' } })
      assert.is_false(ok)
      assert.matches(path, err, 1, true)
      assert.matches('nope', err, 1, true)
    end)

    it('opts.device = "cpu" keeps tensors on the CPU; an unknown device is an error', function()
      st.save(path, { a = a, b = b, c = c })
      local got = st.load(path, { device = 'cpu' })
      assert.are.equal('cpu', got.a.device)
      assert.are.same(a:totable(), got.a:totable())
      local ok, err = pcall(st.load, path, { device = 'tpu' })
      assert.is_false(ok)
      assert.matches('unknown device tpu', err, 1, true)
    end)

    it('opts.device = "cuda:0" moves the tensors there, or fails cleanly in a CPU build', function()
      st.save(path, { a = a })
      local ok, got = pcall(st.load, path, { device = 'cuda:0' })
      if ok then
        assert.are.equal('cuda:0', got.a.device)
        assert.are.same(a:totable(), got.a:totable())
      else
        assert.matches('cuda:0', got, 1, true)
      end
    end)

    it('header() reads names, dtypes and shapes without data', function()
      st.save(path, { a = a, b = b, c = c })
      local h = st.header(path)
      assert.are.equal('f32', h.a.dtype)
      assert.are.same({ 2, 3 }, { h.a.shape[1], h.a.shape[2] })
      assert.are.equal('i32', h.b.dtype)
      assert.are.same({ 24, 40 }, h.b.data_offsets)
    end)
  end)

  describe('stream', function()
    it('writes the entries in their order as they come (each freed once written); the file loads as save\'s would',
      function()
      local keep = st.stream_bytes
      st.stream_bytes = 0
      local list = {
        { 'z.weight', { 7, 5 }, 'f32' }, { 'a.bias', { 5 }, 'f64' }, { 'm.emb', { 3, 4, 2 }, 'bf16' }, { 'e', { 0 }, 'f32' },
        { 'k.ids', { 6 }, 'i64' },
      }
      local entries, src = {}, {}
      for i, e in ipairs(list) do
        entries[i] = { name = e[1], shape = e[2], dtype = e[3] }
        local n = 1
        for _, d in ipairs(e[2]) do n = n * d end
        local vals = {}
        for k = 1, n do vals[k] = (k * 7 + i) % 23 - 11 end
        src[e[1]] = n > 0 and ms.tensor(vals, { dtype = 'f64' }):to(e[3]):reshape(e[2]) or ms.zeros(e[2], { dtype = e[3] })
      end
      local path = tmp('stream.safetensors')
      local s = st.stream(path, entries, { format = 'pt' })
      for _, e in ipairs(entries) do s:put(src[e.name]:clone():reshape({ src[e.name]:numel() }):contiguous()) end
      assert.are.equal(path, s:finish())
      st.stream_bytes = keep
      local got, meta = st.load(path)
      assert.are.equal('pt', meta.format)
      for name, t in pairs(src) do
        assert.are.equal(t.dtype, got[name].dtype, name)
        assert.are.same(t.shape, got[name].shape, name)
        if t:numel() > 0 then assert.are.same(t:totable(), got[name]:totable(), name) end
      end
      -- in the entries' order: the offsets rise along the list
      local h = st.header(path)
      for i = 2, #entries do
        assert.is_true(h[entries[i].name].data_offsets[1] >= h[entries[i - 1].name].data_offsets[2], entries[i].name)
      end
      assert.is_nil(io.open(path .. '.tmp', 'rb'))
    end)

    it('a wrong tensor or too few cancel the file, naming the entry; a file already there is kept', function()
      local path = tmp('stream_bad.safetensors')
      st.save(path, { x = ms.tensor({ 1, 2 }) })
      local before = read_all(path)
      local entries = { { name = 'a', shape = { 2, 2 }, dtype = 'f32' }, { name = 'b', shape = { 3 }, dtype = 'f32' } }
      local s = st.stream(path, entries)
      local ok, err = pcall(s.put, s, ms.zeros({ 4 }, { dtype = 'f64' }))
      assert.is_false(ok)
      assert.matches('stream_bad.safetensors: a wants a contiguous host tensor of f32, 4 elements; got cpu f64, 4 elements',
        tostring(err), 1, true)
      assert.are.equal(before, read_all(path))
      assert.is_nil(io.open(path .. '.tmp', 'rb'))
      s = st.stream(path, entries)
      s:put(ms.zeros({ 4 }))
      ok, err = pcall(s.finish, s)
      assert.is_false(ok)
      assert.matches('finished with 1 of 2 tensors given', tostring(err), 1, true)
      assert.are.equal(before, read_all(path))
      ok, err = pcall(st.stream, path, { { name = 'a', shape = { 1 }, dtype = 'f32' }, { name = 'a', shape = { 1 },
        dtype = 'f32' } })
      assert.is_false(ok)
      assert.matches('entry 2 has a bad or repeated name a', tostring(err), 1, true)
    end)
  end)

  describe('save errors', function()
    it('rejects non-string metadata values and leaves an existing file untouched', function()
      local path = tmp('keep.safetensors')
      local x = ms.tensor({ 1.5, 2.5, 3.5 })
      st.save(path, { x = x }, { v = '1' })
      local before = read_all(path)
      for _, bad in ipairs({ { v = 1 }, { v = true }, { [1] = 'x' }, 'str' }) do
        local ok, err = pcall(st.save, path, { x = ms.tensor({ 9, 9 }) }, bad)
        assert.is_false(ok)
        assert.matches('metadata', err, 1, true)
        assert.matches(path, err, 1, true)
      end
      assert.are.equal(before, read_all(path))
      assert.is_false(exists(path .. '.tmp'))
    end)

    it('save(path, m:state_dict()): the names list passed on as metadata is named, with the call that works', function()
      local path = tmp('sd.safetensors')
      local m = ms.nn.Linear(2, 3)
      local ok, err = pcall(st.save, path, m:state_dict())
      assert.is_false(ok)
      assert.matches("a list of the tensors' names: state_dict()'s second result? save(path, (m:state_dict()))", err, 1,
        true)
      st.save(path, (m:state_dict()))
      assert.are.same(m.weight:totable(), st.load(path).weight:totable())
    end)

    it('rejects non-tensor values, non-string names, freed tensors and __metadata__ as a name', function()
      local path = tmp('bad.safetensors')
      local freed = ms.tensor({ 1, 2 })
      freed:free()
      local cases = {
        { { x = 3 }, 'value for "x" is a number' },
        { { [1] = ms.tensor({ 1 }) }, 'names must be strings' },
        { { f = freed }, '"f" was freed' },
        { { __metadata__ = ms.tensor({ 1 }) }, 'reserved' },
      }
      for _, c in ipairs(cases) do
        local ok, err = pcall(st.save, path, c[1])
        assert.is_false(ok)
        assert.matches(c[2], err, 1, true)
      end
      assert.is_false(exists(path))
      assert.is_false(exists(path .. '.tmp'))
    end)

    it('a failure while writing removes the .tmp file and keeps the old file', function()
      local path = tmp('midwrite.safetensors')
      st.save(path, { x = ms.tensor({ 4, 5 }) })
      local before = read_all(path)
      local orig = T.methods.clone
      T.methods.clone = function() error('simulated failure') end
      local base = ms.tensor({ { 1, 2 }, { 3, 4 } })
      local ok, err = pcall(st.save, path, { a = ms.tensor({ 1 }), b = base:t() })
      T.methods.clone = orig
      assert.is_false(ok)
      assert.matches('simulated failure', err, 1, true)
      assert.matches(path, err, 1, true)
      assert.are.equal(before, read_all(path))
      assert.is_false(exists(path .. '.tmp'))
    end)

    it('a path in a missing directory is an error naming it', function()
      local path = tmp('no/such/dir/x.safetensors')
      local ok, err = pcall(st.save, path, { x = ms.tensor({ 1 }) })
      assert.is_false(ok)
      assert.matches(path, err, 1, true)
    end)

    it('a rename that fails (target is a directory) cleans up the .tmp file', function()
      local path = tmp('adir')
      os.execute('mkdir -p ' .. path)
      local ok, err = pcall(st.save, path, { x = ms.tensor({ 1 }) })
      assert.is_false(ok)
      assert.matches('rename', err, 1, true)
      assert.is_false(exists(path .. '.tmp'))
    end)
  end)

  describe('malformed files', function()
    -- writes a file from a header string (padded to 8) and n data bytes
    local function make(name, header, data, hlen)
      local path = tmp(name)
      write_all(path, u64le(hlen or #header) .. header .. (data or ''))
      return path
    end
    local function fails_with(path, what)
      local ok, err = pcall(st.load, path)
      assert.is_false(ok, 'expected an error for ' .. path)
      assert.is_string(err)
      assert.matches(path, err, 1, true)
      assert.matches(what, err, 1, true)
      return err
    end
    local good = '{"x":{"dtype":"F32","shape":[2,3],"data_offsets":[0,24]}}'
    local data24 = ffi.string(ffi.new('float[6]', { 1, 2, 3, 4, 5, 6 }), 24)

    it('a well-formed hand-made file loads (the baseline of the cases below)', function()
      local got = st.load(make('ok.st', good, data24))
      assert.are.same({ { 1, 2, 3 }, { 4, 5, 6 } }, got.x:totable())
    end)

    it('a missing file', function()
      fails_with(tmp('does-not-exist.safetensors'), 'cannot open')
    end)

    it('a file shorter than 8 bytes', function()
      local path = tmp('four.st')
      write_all(path, 'abcd')
      fails_with(path, 'too short')
      write_all(path, '')
      fails_with(path, 'too short')
    end)

    it('a header length of 0, of 2^40, or past the end of the file', function()
      fails_with(make('len0.st', good, data24, 0), 'header length 0 is invalid')
      fails_with(make('lenhuge.st', good, data24, 2 ^ 40), 'is invalid')
      fails_with(make('lenpast.st', good, '', #good + 100), 'runs past the end')
    end)

    it('a file truncated inside the data', function()
      local path = make('trunc.st', good, data24:sub(1, 10))
      fails_with(path, 'outside')
      -- a truncated copy of a real fixture
      local s = read_all(fixtures .. '/flce/mean.safetensors')
      local p2 = tmp('mean-truncated.safetensors')
      write_all(p2, s:sub(1, #s - 100))
      fails_with(p2, 'truncated')
      write_all(p2, s:sub(1, 200))
      fails_with(p2, 'runs past the end')
    end)

    it('a header that is not JSON, not an object, or has trailing garbage', function()
      fails_with(make('badjson.st', '{"x":{"dtype":"F32","shape":[2,3', data24), 'not valid JSON')
      fails_with(make('badjson2.st', '{"x":{"dtype":"F32",,}}', data24), 'safetensors')
      fails_with(make('badjson3.st', '{"x" 1}', ''), 'safetensors')
      fails_with(make('notobj.st', '[1,2,3]', ''), 'does not start with')
      fails_with(make('strobj.st', '{"x": "F32"}', ''), 'entry "x" is a JSON string')
      fails_with(make('trailing.st', good .. ' junk', data24), 'trailing')
      fails_with(make('binary.st', '\0\1\2\3\4\5\6\7', ''), 'does not start with')
    end)

    it('entries missing dtype, shape or data_offsets', function()
      fails_with(make('nodtype.st', '{"x":{"shape":[2,3],"data_offsets":[0,24]}}', data24), 'has no dtype')
      fails_with(make('noshape.st', '{"x":{"dtype":"F32","data_offsets":[0,24]}}', data24), 'has no shape')
      fails_with(make('nooffs.st', '{"x":{"dtype":"F32","shape":[2,3]}}', data24), 'has no data_offsets')
    end)

    it('an unknown or unsupported dtype', function()
      local err = fails_with(make('dtype.st', '{"x":{"dtype":"F8_E4M3FNUZ","shape":[2,3],"data_offsets":[0,6]}}',
        data24), 'unsupported dtype F8_E4M3FNUZ')
      assert.matches('"x"', err, 1, true)
      fails_with(make('dtype2.st', '{"x":{"dtype":"Q4","shape":[2],"data_offsets":[0,1]}}', data24), 'unsupported dtype Q4')
      fails_with(make('dtype3.st', '{"x":{"dtype":7,"shape":[2],"data_offsets":[0,1]}}', data24), 'unsupported dtype 7')
    end)

    it('bad shapes', function()
      fails_with(make('shape1.st', '{"x":{"dtype":"F32","shape":[2,-3],"data_offsets":[0,24]}}', data24),
        'shape entry 2')
      fails_with(make('shape2.st', '{"x":{"dtype":"F32","shape":[2.5],"data_offsets":[0,24]}}', data24),
        'shape entry 1')
      fails_with(make('shape3.st', '{"x":{"dtype":"F32","shape":{"a":1},"data_offsets":[0,24]}}', data24),
        'shape must be an array')
      fails_with(make('shape4.st', '{"x":{"dtype":"F32","shape":[1,1,1,1,1,1,1,1,6],"data_offsets":[0,24]}}',
        data24), 'at most 8')
    end)

    it('offsets out of range, reversed, malformed, or inconsistent with the shape', function()
      fails_with(make('off1.st', '{"x":{"dtype":"F32","shape":[2,3],"data_offsets":[0,2400]}}', data24), 'outside')
      fails_with(make('off2.st', '{"x":{"dtype":"F32","shape":[2,3],"data_offsets":[24,0]}}', data24),
        'end before they begin')
      fails_with(make('off3.st', '{"x":{"dtype":"F32","shape":[2,3],"data_offsets":[0]}}', data24),
        'two non-negative integers')
      fails_with(make('off4.st', '{"x":{"dtype":"F32","shape":[2,3],"data_offsets":[-8,16]}}', data24),
        'two non-negative integers')
      local err = fails_with(make('off5.st', '{"x":{"dtype":"F32","shape":[2,3],"data_offsets":[0,20]}}', data24),
        'hold 20 bytes')
      assert.matches('(2,3)', err, 1, true)
      assert.matches('needs 24', err, 1, true)
      fails_with(make('off6.st', '{"x":{"dtype":"F64","shape":[2,3],"data_offsets":[0,24]}}', data24), 'needs 48')
    end)

    it('overlapping tensors', function()
      local h = '{"x":{"dtype":"F32","shape":[4],"data_offsets":[0,16]},' ..
          '"y":{"dtype":"F32","shape":[3],"data_offsets":[12,24]}}'
      local err = fails_with(make('overlap.st', h, data24), 'overlap')
      assert.matches('"x"', err, 1, true)
      assert.matches('"y"', err, 1, true)
      -- an empty tensor between them does not hide the overlap
      h = '{"x":{"dtype":"F32","shape":[5],"data_offsets":[0,20]},' ..
          '"e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]},' ..
          '"y":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}}'
      fails_with(make('overlap2.st', h, data24), 'overlap')
      -- identical offsets
      h = '{"x":{"dtype":"F32","shape":[6],"data_offsets":[0,24]},' ..
          '"y":{"dtype":"I32","shape":[6],"data_offsets":[0,24]}}'
      fails_with(make('overlap3.st', h, data24), 'overlap')
    end)

    it('metadata that is not an object of strings', function()
      fails_with(make('meta1.st', '{"__metadata__":{"a":1}}', ''), '__metadata__ value for "a"')
      fails_with(make('meta2.st', '{"__metadata__":[1]}', ''), '__metadata__ is a JSON array')
    end)

    it('the process survives a run of random corruptions of a real file', function()
      local s = read_all(fixtures .. '/gpt2-tiny/model.safetensors')
      local n = 0
      for i = 8, 1, -1 do n = n * 256 + s:byte(i) end
      local path = tmp('fuzz.safetensors')
      local failures = 0
      for k = 1, 60 do
        local bytes = { s:byte(1, 8 + n) }
        for _ = 1, 3 do
          local pos = math.random(1, 8 + n)
          bytes[pos] = math.random(0, 255)
        end
        local hdr = {}
        for i = 1, #bytes, 4096 do hdr[#hdr + 1] = string.char(unpack(bytes, i, math.min(i + 4095, #bytes))) end
        write_all(path, table.concat(hdr) .. s:sub(9 + n))
        local ok, err = pcall(st.load, path)
        if not ok then
          failures = failures + 1
          assert.matches('safetensors: ' .. path, err, 1, true)
        end
      end
      assert.is_true(failures > 0)
    end)
  end)

  describe('the shared fixtures', function()
    local files = {}
    local p = io.popen('cd ' .. fixtures .. ' && ls */*.safetensors 2>/dev/null')
    for line in p:lines() do files[#files + 1] = line end
    p:close()

    it('are present (13 files)', function()
      assert.are.equal(13, #files)
    end)

    for _, f in ipairs(files) do
      it('load: ' .. f .. ' (every tensor, values equal to the raw file bytes)', function()
        local path = fixtures .. '/' .. f
        local got = st.load(path)
        local hdr, n, s = raw_header(path)
        local names = 0
        for name, e in pairs(hdr) do
          if name ~= '__metadata__' then
            names = names + 1
            local t = got[name]
            assert.is_not_nil(t, name)
            assert.are.same({ unpack(e.shape) }, t.shape)
            assert.are.equal(st.dtype_codes[t.dtype], e.dtype)
            local nbytes = e.data_offsets[2] - e.data_offsets[1]
            assert.are.equal(nbytes, t:numel() * t:element_size())
            assert.are.equal(s:sub(9 + n + e.data_offsets[1], 8 + n + e.data_offsets[2]),
              ffi.string(t:data_ptr(), nbytes))
          end
        end
        assert.are.equal(names, count(got))
      end)
    end

    it('gpt2-tiny has the documented names and shapes', function()
      local w, meta = st.load(fixtures .. '/gpt2-tiny/model.safetensors')
      assert.are.equal('pt', meta.format)
      assert.are.same({ 256, 64 }, w['transformer.wte.weight'].shape)
      assert.are.same({ 64, 64 }, w['transformer.wpe.weight'].shape)
      assert.is_nil(w['lm_head.weight'])  -- tied, stored once
      for l = 0, 1 do
        local h = 'transformer.h.' .. l .. '.'
        assert.are.same({ 64, 192 }, w[h .. 'attn.c_attn.weight'].shape)  -- Conv1D (in, out)
        assert.are.same({ 192 }, w[h .. 'attn.c_attn.bias'].shape)
        assert.are.same({ 64, 256 }, w[h .. 'mlp.c_fc.weight'].shape)
        assert.are.same({ 256, 64 }, w[h .. 'mlp.c_proj.weight'].shape)
        assert.are.same({ 64 }, w[h .. 'ln_1.weight'].shape)
      end
      assert.are.same({ 64 }, w['transformer.ln_f.weight'].shape)
      for _, t in pairs(w) do assert.are.equal('f32', t.dtype) end
      -- the first two entries of wte, decoded by hand from the raw bytes
      local hdr, n, s = raw_header(fixtures .. '/gpt2-tiny/model.safetensors')
      local o = hdr['transformer.wte.weight'].data_offsets[1]
      local f = ffi.new('float[2]')
      ffi.copy(f, s:sub(9 + n + o, 16 + n + o), 8)
      assert.are.equal(f[0], w['transformer.wte.weight']:get(1, 1))
      assert.are.equal(f[1], w['transformer.wte.weight']:get(1, 2))
      -- norm weights are perturbed away from 1 (the fixture README's promise)
      assert.are_not.equal(1, w['transformer.ln_f.weight']:get(1))
    end)

    it('gpt2-tiny expected: tokens, targets shifted by one, logits, loss, a grad per parameter', function()
      local w = st.load(fixtures .. '/gpt2-tiny/model.safetensors')
      local e = st.load(fixtures .. '/gpt2-tiny/expected.safetensors')
      assert.are.same({ 2, 32 }, e.input_ids.shape)
      assert.are.equal('i64', e.input_ids.dtype)
      assert.are.same({ 2, 32 }, e.targets.shape)
      assert.are.same({ 2, 32, 256 }, e.logits.shape)
      assert.are.same({ 1 }, e.loss.shape)
      local ids, tg = e.input_ids:totable(), e.targets:totable()
      local ignored, checked = 0, 0
      for b = 1, 2 do
        for t = 1, 32 do
          assert.is_true(ids[b][t] >= 0 and ids[b][t] < 256)
          if tg[b][t] == -100 then ignored = ignored + 1
          else
            assert.is_true(tg[b][t] >= 0 and tg[b][t] < 256)
            if t < 32 then assert.are.equal(ids[b][t + 1], tg[b][t]); checked = checked + 1 end
          end
        end
      end
      assert.is_true(ignored >= 1 and ignored <= 20)
      assert.is_true(checked >= 40)
      local loss = e.loss:item()
      assert.is_true(loss > 4 and loss < 7)  -- about log(256) = 5.5 for a tiny random model
      for name, t in pairs(w) do
        local g = e['grad.' .. name]
        assert.is_not_nil(g, 'grad.' .. name)
        assert.are.same(t.shape, g.shape)
      end
    end)

    it('llama-tiny has the documented names and shapes (GQA, SwiGLU, untied head)', function()
      local w = st.load(fixtures .. '/llama-tiny/model.safetensors')
      assert.are.same({ 256, 64 }, w['model.embed_tokens.weight'].shape)
      assert.are.same({ 256, 64 }, w['lm_head.weight'].shape)
      assert.are.same({ 64 }, w['model.norm.weight'].shape)
      for l = 0, 1 do
        local h = 'model.layers.' .. l .. '.'
        assert.are.same({ 64, 64 }, w[h .. 'self_attn.q_proj.weight'].shape)
        assert.are.same({ 32, 64 }, w[h .. 'self_attn.k_proj.weight'].shape)
        assert.are.same({ 32, 64 }, w[h .. 'self_attn.v_proj.weight'].shape)
        assert.are.same({ 64, 64 }, w[h .. 'self_attn.o_proj.weight'].shape)
        assert.are.same({ 176, 64 }, w[h .. 'mlp.gate_proj.weight'].shape)
        assert.are.same({ 176, 64 }, w[h .. 'mlp.up_proj.weight'].shape)
        assert.are.same({ 64, 176 }, w[h .. 'mlp.down_proj.weight'].shape)
      end
      local e = st.load(fixtures .. '/llama-tiny/expected.safetensors')
      assert.are.same({ 2, 32, 256 }, e.logits.shape)
      for name, t in pairs(w) do assert.are.same(t.shape, e['grad.' .. name].shape) end
    end)

    it('flce cases hold x (64,32), W (500,32), targets (64) and their options\' tensors', function()
      local cases = json.decode(read_all(fixtures .. '/flce/cases.json'))
      local n = 0
      for case, o in pairs(cases) do
        n = n + 1
        local t = st.load(fixtures .. '/flce/' .. case .. '.safetensors')
        assert.are.same({ 64, 32 }, t.x.shape)
        assert.are.same({ 500, 32 }, t.W.shape)
        assert.are.same({ 64 }, t.targets.shape)
        assert.are.equal('i64', t.targets.dtype)
        assert.are.same({ 64, 32 }, t.grad_x.shape)
        assert.are.same({ 500, 32 }, t.grad_W.shape)
        assert.are.equal(o.bias == true, t.bias ~= nil, case)
        if o.bias then assert.are.same({ 500 }, t.bias.shape) end
        assert.are.equal(o.ce_weight ~= nil, t.ce_weight ~= nil, case)
        local ignored = 0
        for _, v in ipairs(t.targets:totable()) do
          if v == -100 then ignored = ignored + 1 else assert.is_true(v >= 0 and v < 500) end
        end
        assert.is_true(ignored >= 2 and ignored <= 25, case .. ' ignored ' .. ignored)
        if o.reduction == 'none' then assert.are.same({ 64 }, t.loss.shape) else assert.are.same({ 1 }, t.loss.shape) end
      end
      assert.are.equal(9, n)
    end)
  end)
end)
