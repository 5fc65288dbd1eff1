-- moonshard.shards and bin/tokenize: shards written by bin/tokenize read
-- back exactly (bytes, and a BPE tokenizer's ids), uint16 and uint32
-- shards, several shards and ranks (disjoint batches that together are one
-- rank's bigger batch), a deterministic order per seed that covers every
-- sample once an epoch, state()/set_state() giving the very next batches,
-- and every malformed shard a clear error naming the file.
local T = require 'moonshard.tensor'
local ffi = require 'ffi'
local json = require 'dkjson'
local shards = require 'moonshard.shards'
local tok = require 'moonshard.tokenizer'
local data = require 'moonshard.data'

local root = T.root
local S_ = require 'spec.support'
local q, tmpdir = S_.shell_quote, S_.tmpdir
local function write_all(path, s)
  local f = assert(io.open(path, 'wb'))
  f:write(s)
  f:close()
end
local function read_all(path)
  local f = assert(io.open(path, 'rb'))
  local s = f:read('*a')
  f:close()
  return s
end
local function run(cmd)
  local p = io.popen(cmd .. ' 2>&1; echo "__rc $?"')
  local out = p:read('*a')
  p:close()
  local rc = tonumber(out:match('__rc (%d+)%s*$'))
  return rc, out:gsub('__rc %d+%s*$', '')
end
local function tokenize(args) return run(q(root .. '/bin/tokenize') .. ' ' .. args) end

-- every token of the shards of a glob, in order
local function all_tokens(glob)
  local out = {}
  for _, path in ipairs(shards.list(glob)) do
    local s = shards.open(path)
    for _, v in ipairs(s:tokens()) do out[#out + 1] = v end
    s:free()
  end
  return out
end
local function as_list(t) -- a (B, T) i64 tensor -> Lua list, row-major
  local n = t:numel()
  local p = ffi.cast('int64_t*', t:data_ptr())
  local out = {}
  for i = 1, n do out[i] = tonumber(p[i - 1]) end
  return out
end

local dir = tmpdir()
local texts = {
  'The quick brown fox jumps over the lazy dog.\n',
  ("hello world, hello there. It's 12345 o'clock!\n"):rep(40),
  'café naïve — “quoted” 日本語 x² 🙂\n' .. ('line %d\n'):rep(1):format(1),
}
for k, s in ipairs(texts) do write_all(('%s/doc%d.txt'):format(dir, k), s) end
local docs = ('%s/doc1.txt %s/doc2.txt %s/doc3.txt'):format(q(dir), q(dir), q(dir))

-- the tiny byte-level BPE of the tokenizer spec, plus a document separator
local function tiny_json(extra_id)
  local vocab = {}
  for b = 0, 255 do vocab[tok.byte_to_char[b]] = b end
  for k, s in ipairs({ 'he', 'll', 'hell', 'hello', 'Ġw', 'or', 'Ġwor' }) do vocab[s] = 255 + k end
  local added = { { id = 263, content = '<|endoftext|>', special = true } }
  if extra_id then added[2] = { id = extra_id, content = '<|big|>', special = true } end
  return json.encode({
    added_tokens = added,
    pre_tokenizer = { type = 'ByteLevel', add_prefix_space = false, use_regex = true },
    decoder = { type = 'ByteLevel' },
    model = { type = 'BPE', vocab = vocab, merges = { 'h e', 'l l', 'he ll', 'hell o', 'Ġ w', 'o r', 'Ġw or' } },
  })
end

describe('bin/tokenize', function()
  it('writes byte-level shards that read back as the files\' bytes', function()
    local out = dir .. '/bytes'
    local rc, msg = tokenize(('--out %s --shard-size 500 --val-fraction 0.2 %s'):format(q(out), docs))
    assert.are.equal(0, rc, msg)
    assert.truthy(msg:find('train_000000.bin', 1, true), msg)
    local all = texts[1] .. texts[2] .. texts[3]
    local n_val = math.floor(#all * 0.2)
    local train, val = all_tokens(out .. '/train_*.bin'), all_tokens(out .. '/val_*.bin')
    assert.are.equal(#all - n_val, #train)
    assert.are.equal(n_val, #val)
    assert.are.same(tok.bytes():encode(all), (function() for _, v in ipairs(val) do train[#train + 1] = v end return train end)())
    assert.are.equal(math.ceil((#all - n_val) / 500), #shards.list(out .. '/train_*.bin'))
    local s = shards.open(out .. '/train_000000.bin')
    assert.are.equal(1, s.version)
    assert.are.equal(500, s.n)
    assert.are.equal(1024 + 2 * 500, #read_all(out .. '/train_000000.bin'))
    s:free()
  end)

  it('writes a BPE tokenizer\'s ids, each document after <|endoftext|>', function()
    local tj = dir .. '/tiny.json'
    write_all(tj, tiny_json())
    local out = dir .. '/bpe'
    local rc, msg = tokenize(('--tokenizer %s --out %s --val-fraction 0 %s'):format(q(tj), q(out), docs))
    assert.are.equal(0, rc, msg)
    local bpe = tok.load(tj)
    local want = {}
    for _, s in ipairs(texts) do
      want[#want + 1] = 263
      for _, id in ipairs(bpe:encode(s)) do want[#want + 1] = id end
    end
    local got = all_tokens(out .. '/train_*.bin')
    assert.are.same(want, got)
    assert.are.equal(texts[1], bpe:decode({ unpack(got, 2, 1 + #bpe:encode(texts[1])) }))
    assert.are.equal(1, shards.open(out .. '/train_000000.bin').version)
    assert.has_error(function() shards.list(out .. '/val_*.bin') end)
    -- a second run into the same folder, with smaller shards then larger:
    -- no shard of the earlier run is left to join the glob
    assert.are.equal(0, (tokenize(('--tokenizer %s --out %s --shard-size 100 %s'):format(q(tj), q(out), docs))))
    assert.is_true(#shards.list(out .. '/train_*.bin') > 3)
    local rc2, msg2 = tokenize(('--tokenizer %s --out %s --val-fraction 0 %s'):format(q(tj), q(out), docs))
    assert.are.equal(0, rc2, msg2)
    assert.truthy(msg2:find('removed', 1, true), msg2)
    assert.are.same(want, all_tokens(out .. '/train_*.bin'))
    assert.has_error(function() shards.list(out .. '/val_*.bin') end)
  end)

  it('writes uint32 shards when the vocabulary exceeds 65,536 ids', function()
    local tj = dir .. '/big.json'
    write_all(tj, tiny_json(70000))
    write_all(dir .. '/big.txt', 'hello <|big|> world<|big|>')
    local out = dir .. '/big'
    local rc, msg = tokenize(('--tokenizer %s --out %s --val-fraction 0 --doc-sep none %s'):format(q(tj), q(out), q(dir .. '/big.txt')))
    assert.are.equal(0, rc, msg)
    assert.truthy(msg:find('uint32', 1, true), msg)
    local s = shards.open(out .. '/train_000000.bin')
    assert.are.equal(2, s.version)
    assert.are.same({ 259, 32, 70000, 262, 108, 100, 70000 }, s:tokens())
    assert.are.equal(1024 + 4 * 7, #read_all(out .. '/train_000000.bin'))
  end)

  it('reports usage errors and unreadable files with a non-zero exit', function()
    local rc, msg = tokenize('')
    assert.are.equal(2, rc)
    assert.truthy(msg:find('no input files', 1, true), msg)
    rc, msg = tokenize('--val-fraction 2 x')
    assert.are.equal(2, rc)
    rc, msg = tokenize(('--out %s %s'):format(q(dir .. '/none'), q(dir .. '/missing.txt')))
    assert.are.equal(1, rc)
    assert.truthy(msg:find('missing.txt', 1, true), msg)
    -- empty input (byte-level: no tokens) is an error that leaves an earlier
    -- run's shards in the folder (it removed them and wrote none, exit 0)
    local out = dir .. '/empty_run'
    assert.are.equal(0, (tokenize(('--out %s %s'):format(q(out), docs))))
    local before = #shards.list(out .. '/train_*.bin')
    write_all(dir .. '/empty.txt', '')
    rc, msg = tokenize(('--out %s %s'):format(q(out), q(dir .. '/empty.txt')))
    assert.are.equal(1, rc, msg)
    assert.truthy(msg:find(dir .. '/empty.txt: no tokens (0 bytes); nothing written', 1, true), msg)
    assert.are.equal(before, #shards.list(out .. '/train_*.bin'))
    assert.are.equal(1, #shards.list(out .. '/val_*.bin'))
  end)
end)

-- shards whose tokens are unique: shard i token j = i * 100000 + j
local sdir = dir .. '/u'
assert(os.execute('mkdir -p ' .. q(sdir)) == 0)
local sizes = { 1000, 2500, 700, 1601 }
for i, n in ipairs(sizes) do
  local ids = {}
  for j = 0, n - 1 do ids[j + 1] = i * 100000 + j end
  shards.write(('%s/shard_%02d.bin'):format(sdir, i), ids)
end

describe('shards', function()
  it('write and open: uint16 and uint32 tokens, exactly', function()
    local p16, p32 = dir .. '/s16.bin', dir .. '/s32.bin'
    assert.are.equal(1, shards.write(p16, { 0, 1, 65535, 7 }))
    assert.are.equal(2, shards.write(p32, { 0, 65536, 4294967295, 7 }))
    local a, b = shards.open(p16), shards.open(p32)
    assert.are.same({ 1, 4, 2 }, { a.version, a.n, a.token_bytes })
    assert.are.same({ 2, 4, 4 }, { b.version, b.n, b.token_bytes })
    assert.are.same({ 0, 1, 65535, 7 }, a:tokens())
    assert.are.same({ 0, 65536, 4294967295, 7 }, b:tokens())
    assert.are.same({ 65536, 4294967295 }, b:tokens(1, 2))
    assert.has_error(function() a:tokens(3, 2) end)
    assert.has_error(function() shards.write(dir .. '/x.bin', { 70000 }, { version = 1 }) end)
  end)

  it('unmaps on free(), once', function()
    local before = shards.live()
    local s = shards.open(dir .. '/s16.bin')
    assert.are.equal(before + 1, shards.live())
    s:free(); s:free()
    assert.are.equal(before, shards.live())
    assert.has_error(function() s:get(0) end)
  end)

  it('lists a folder, a glob, a file and a list, sorted', function()
    local want = {}
    for i = 1, 4 do want[i] = ('%s/shard_%02d.bin'):format(sdir, i) end
    assert.are.same(want, shards.list(sdir))
    assert.are.same(want, shards.list(sdir .. '/shard_*.bin'))
    assert.are.same({ want[2] }, shards.list(want[2]))
    assert.are.same({ want[3], want[1] }, shards.list({ want[3], want[1] }))
    assert.has_error(function() shards.list(sdir .. '/nothing_*.bin') end, 'shards: no shards match ' .. sdir .. '/nothing_*.bin')
  end)

  describe('a malformed shard is an error naming the file', function()
    local function expect(path, ...)
      local ok, err = pcall(shards.open, path)
      assert.is_false(ok)
      err = tostring(err)
      assert.truthy(err:find(path, 1, true), err)
      for _, s in ipairs({ ... }) do assert.truthy(err:find(s, 1, true), err) end
      -- and through a loader
      local ok2, err2 = pcall(shards.Loader, { files = path, batch_size = 1, seq_len = 1 })
      assert.is_false(ok2)
      assert.truthy(tostring(err2):find(path, 1, true), tostring(err2))
    end
    local good = read_all(sdir .. '/shard_01.bin')
    local function int32(v) return string.char(v % 256, math.floor(v / 256) % 256, math.floor(v / 65536) % 256, math.floor(v / 16777216) % 256) end
    it('truncated', function()
      local p = dir .. '/truncated.bin'
      write_all(p, good:sub(1, #good - 3))
      expect(p, 'truncated', '1000 tokens', '5024 bytes', '5021 bytes') -- uint32 tokens
    end)
    it('bad magic number', function()
      local p = dir .. '/magic.bin'
      write_all(p, int32(12345) .. good:sub(5))
      expect(p, 'bad magic number 12345', '20240520')
    end)
    it('bad version', function()
      local p = dir .. '/version.bin'
      write_all(p, good:sub(1, 4) .. int32(3) .. good:sub(9))
      expect(p, 'bad version 3')
    end)
    it('too small for a header', function()
      local p = dir .. '/tiny.bin'
      write_all(p, 'abc')
      expect(p, '3 bytes', 'too small')
    end)
    it('missing', function()
      expect(dir .. '/absent.bin')
    end)
  end)
end)

describe('shards.Loader', function()
  local B, Tn = 2, 16
  local function loader(o)
    o.files = o.files or sdir
    o.batch_size, o.seq_len = o.batch_size or B, o.seq_len or Tn
    return shards.Loader(o)
  end

  it('gives (B, T) i64 inputs and the targets one token on', function()
    local l = loader({ seed = 1 })
    local x, y = l:next()
    assert.are.same({ B, Tn }, { x.shape[1], x.shape[2] })
    assert.are.equal('i64', x.dtype)
    local xs, ys = as_list(x), as_list(y)
    for i = 1, #xs do assert.are.equal(xs[i] + 1, ys[i]) end -- consecutive unique tokens
    -- samples per shard: floor((n - 1) / (B * T))
    local total = 0
    for _, n in ipairs(sizes) do total = total + math.floor((n - 1) / (B * Tn)) end
    assert.are.equal(total, l.total)
  end)

  it('visits every sample once an epoch, in an order fixed by the seed', function()
    local l = loader({ seed = 5 })
    local seen, firsts = {}, {}
    for k = 0, l.total - 1 do
      local x = l:batch(k)
      local v = as_list(x)[1]
      assert.is_nil(seen[v])
      seen[v] = true
      firsts[#firsts + 1] = v
      local shard, off = math.floor(v / 100000), v % 100000
      assert.are.equal(0, off % (B * Tn))
      assert.is_true(off + B * Tn + 1 <= sizes[shard])
    end
    local again, other = loader({ seed = 5 }), loader({ seed = 6 })
    local same, diff = true, false
    for k = 0, l.total - 1 do
      if as_list(again:batch(k))[1] ~= firsts[k + 1] then same = false end
      if as_list(other:batch(k))[1] ~= firsts[k + 1] then diff = true end
    end
    assert.is_true(same)
    assert.is_true(diff)
    -- the next epoch is another permutation of the same samples
    local e2 = {}
    for k = l.total, 2 * l.total - 1 do e2[as_list(l:batch(k))[1]] = true end
    assert.are.same(seen, e2)
    -- shuffle = false: shards in order, samples in order
    local plain = loader({ shuffle = false })
    assert.are.equal(100000, as_list(plain:batch(0))[1])
    assert.are.equal(100000 + B * Tn, as_list(plain:batch(1))[1])
  end)

  it('gives ranks disjoint parts that together are one rank\'s batch of W x B', function()
    local W = 3
    local one = loader({ seed = 9, batch_size = W * B })
    local ranks = {}
    for r = 0, W - 1 do ranks[r] = loader({ seed = 9, rank = r, world_size = W }) end
    assert.are.equal(one.total, ranks[0].total)
    for _ = 1, one.total + 3 do -- across an epoch boundary
      local x1, y1 = one:next()
      local xs, ys = as_list(x1), as_list(y1)
      local seen = {}
      for r = 0, W - 1 do
        local x, y = ranks[r]:next()
        local a, b = as_list(x), as_list(y)
        for i = 1, #a do
          assert.are.equal(xs[r * B * Tn + i], a[i])
          assert.are.equal(ys[r * B * Tn + i], b[i])
          assert.is_nil(seen[a[i]])
          seen[a[i]] = true
        end
      end
    end
    assert.has_error(function() loader({ rank = 3, world_size = 3 }) end)
  end)

  it('state() / set_state() resumes with the very next batches', function()
    local a = loader({ seed = 3 })
    for _ = 1, a.total - 2 do a:next() end -- near the end of epoch 0
    local st = a:state()
    for _, v in pairs(st) do assert.are.equal('number', type(v)) end
    assert.are.same({ a.total - 2, 0, 3 }, { st.step, st.epoch, st.seed })
    local want = {}
    for k = 1, 5 do want[k] = { as_list((a:next())) } end
    local b = loader({ seed = 3 })
    b:set_state(json.decode(json.encode(st))) -- as a checkpoint would keep it
    for k = 1, 5 do assert.are.same(want[k][1], as_list((b:next()))) end
    -- from epoch, shard and sample alone
    local c = loader({ seed = 3 })
    c:set_state({ epoch = st.epoch, shard = st.shard, sample = st.sample, seed = st.seed })
    assert.are.same(want[1][1], as_list((c:next())))
    -- a state of another shape, or of other files, is refused
    assert.has_error(function() loader({ batch_size = 4 }):set_state(st) end,
      'shards.Loader:set_state: the state has batch_size 2, this loader 4')
    local moved = { step = st.step, epoch = st.epoch, shard = st.shard, sample = st.sample + 1, seed = 3 }
    assert.has_error(function() loader({ seed = 3 }):set_state(moved) end)
  end)

  it('puts the batches on the requested GPU #gpu', function()
    local cpu, gpu = loader({ seed = 4 }), loader({ seed = 4, device = 'cuda' })
    for _ = 1, 3 do
      local x, y = cpu:next()
      local gx, gy = gpu:next()
      assert.are.equal('cuda:0', gx.device)
      assert.are.equal('i64', gx.dtype)
      assert.are.same(as_list(x), as_list(gx:to('cpu')))
      assert.are.same(as_list(y), as_list(gy:to('cpu')))
    end
  end)

  it('refuses shards too small for one batch, with the numbers', function()
    assert.has_error(function() loader({ batch_size = 64, seq_len = 64 }) end,
      ('shards.Loader: no shard of %s holds a batch: the largest has 2500 tokens, a batch of world_size 1 x B 64 x T 64 needs 4096 + 1'):format(sdir))
    -- a list of files (data.open's val shards: bin/train --data DIR) is
    -- named by its files (it was 'no shard of table: 0x...')
    local a, b = sdir .. '/shard_01.bin', sdir .. '/shard_03.bin'
    assert.has_error(function() shards.Loader({ files = { a, b }, batch_size = 64, seq_len = 64 }) end,
      ('shards.Loader: no shard of %s, %s holds a batch: the largest has 1000 tokens, a batch of world_size 1 x B 64 x '
        .. 'T 64 needs 4096 + 1'):format(a, b))
    local l = shards.Loader({ files = { a, b }, batch_size = 2, seq_len = 8 })
    assert.are.equal(('%s, %s (2 shards)'):format(a, b), l.name)
    l:free()
  end)

  it('data.open gives train and val loaders from a bin/tokenize folder', function()
    local d = data.open({ dir = dir .. '/bytes', batch_size = 2, seq_len = 8, seed = 1 })
    assert.truthy(d.train and d.val)
    local x, y = d.train:next()
    local xs, ys = as_list(x), as_list(y)
    assert.are.equal(16, #xs)
    assert.are.same({ xs[2], xs[3] }, { ys[1], ys[2] })
    local v1 = as_list((d.val:batch(0)))
    assert.are.same(v1, as_list((d.val:batch(0))))
    assert.are.equal(d.train.step, d.train:state().step)
    assert.has_error(function() data.open({}) end)
  end)
end)
