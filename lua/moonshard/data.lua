-- moonshard.data — a byte-level corpus and a random-window batch loader.
--
--   local data = require 'moonshard.data'
--   local corpus = data.corpus{ path = nil, val_fraction = 0.1 }  -- nil: the repo's own text
--   local loader = data.Loader(corpus.train, { batch_size = 16, seq_len = 128, seed = 1 })
--   local x, y = loader:next()     -- (B, T) i64 each; y is x shifted by one byte
--
-- Tokens are bytes (vocab 256): nothing to download, nothing to train. The
-- default corpus is the repository's own source and docs (*.lua, *.c, *.h,
-- *.md, sorted by path, so every clone builds the same one from the same
-- tree). The last `val_fraction` of the bytes is the validation split.
--
-- A loader draws windows at offsets from a counter-based generator keyed by
-- (seed, step): batch k is a pure function of the seed and k, so a loader's
-- whole position is `loader.step` (state()/set_state() for checkpoints).
--
-- Data parallel: with { rank = r, world_size = W }, batch k of rank r is
-- rows r*B .. r*B+B-1 of the global batch k of W*B rows, the one a single
-- loader with batch_size W*B draws: row i of the stream is a pure function
-- of (seed, i), and global batch k holds rows k*W*B .. (k+1)*W*B-1. So the
-- ranks' batches are disjoint and together are one process's big batch.
-- state() also carries `rows` (the global rows consumed), so a position
-- taken at one world size or batch size resumes at another.
local ffi = require 'ffi'
local T = require 'moonshard.tensor'

local data = {}

-- ---------------------------------------------------------------- corpora
-- A Bytes is a read-only byte buffer: { n = length, ptr = uint8_t*, name = }.
local function bytes_from_string(s, name)
  local n = #s
  local buf = ffi.new('uint8_t[?]', math.max(n, 1))
  ffi.copy(buf, s, n)
  return { n = n, ptr = buf, name = name }
end
data.bytes_from_string = bytes_from_string

local function read_file(path)
  local f, err = io.open(path, 'rb')
  if not f then return nil, err end
  local s = f:read('*a')
  f:close()
  return s
end

local function shell_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
data.shell_quote = shell_quote

-- The files of the default corpus under `root`, sorted by path (bytewise).
-- Hidden folders, build outputs and run folders are left out.
data.corpus_exts = { 'lua', 'c', 'h', 'md' }
function data.source_files(root)
  root = root or T.root
  local names = {}
  for _, e in ipairs(data.corpus_exts) do names[#names + 1] = "-name '*." .. e .. "'" end
  local cmd = ('cd %s && find . -mindepth 1 -type d \\( -name ".*" -o -name "build*" -o -name runs \\) -prune -o -type f \\( %s \\) -print 2>/dev/null')
    :format(shell_quote(root), table.concat(names, ' -o '))
  local p = io.popen(cmd)
  local files = {}
  if p then
    for line in p:lines() do
      if line ~= '.' then files[#files + 1] = line:gsub('^%./', '') end
    end
    p:close()
  end
  table.sort(files)
  return files
end

-- The default corpus text: every source file in order, each ending in a newline.
function data.source_text(root)
  root = root or T.root
  local parts = {}
  for _, rel in ipairs(data.source_files(root)) do
    local s = read_file(root .. '/' .. rel)
    if s and #s > 0 then
      parts[#parts + 1] = s
      if s:sub(-1) ~= '\n' then parts[#parts + 1] = '\n' end
    end
  end
  return table.concat(parts)
end

-- data.corpus{ path = FILE | nil, text = STRING | nil, val_fraction = 0.1, min_len = }
-- -> { train = Bytes, val = Bytes, name = , n = }
-- min_len: each split must hold at least this many bytes (seq_len + 1).
function data.corpus(opts)
  opts = opts or {}
  local text, name
  if opts.text then
    text, name = opts.text, opts.name or '<text>'
  elseif opts.path then
    local s, err = read_file(opts.path)
    if not s then error(('data: cannot read %s: %s'):format(opts.path, tostring(err)), 2) end
    text, name = s, opts.path
  else
    text, name = data.source_text(opts.root), 'repository sources (*.lua, *.c, *.h, *.md)'
  end
  local vf = opts.val_fraction or 0.1
  if type(vf) ~= 'number' or vf < 0 or vf >= 1 then
    error(('data: val_fraction must be a number in [0, 1), got %s'):format(tostring(vf)), 2)
  end
  local n = #text
  local n_val = math.floor(n * vf)
  local min_len = opts.min_len or 2
  if n - n_val < min_len or (vf > 0 and n_val < min_len) then
    error(('data: %s has %d bytes; with val_fraction %g each split needs at least %d (seq_len + 1)')
      :format(name, n, vf, min_len), 2)
  end
  return {
    name = name,
    n = n,
    train = bytes_from_string(text:sub(1, n - n_val), name .. ' [train]'),
    val = n_val > 0 and bytes_from_string(text:sub(n - n_val + 1), name .. ' [val]') or nil,
  }
end

-- bytes <-> text
function data.encode(s)
  local ids = {}
  for i = 1, #s do ids[i] = s:byte(i) end
  return ids
end
function data.decode(ids)
  local out = {}
  for i = 1, #ids do out[i] = string.char(ids[i]) end
  return table.concat(out)
end

-- -------------------------------------------------------------- generator
-- splitmix64 of (seed, counter): a uniform double in [0, 1). Stateless, so a
-- loader's position is just its step counter.
local u64 = ffi.typeof('uint64_t')
local function mix(z)
  z = (z + 0x9E3779B97F4A7C15ULL)
  z = bit.bxor(z, bit.rshift(z, 30)) * 0xBF58476D1CE4E5B9ULL
  z = bit.bxor(z, bit.rshift(z, 27)) * 0x94D049BB133111EBULL
  return bit.bxor(z, bit.rshift(z, 31))
end
function data.uniform(seed, counter)
  local z = mix(mix(u64(seed)) + u64(counter))
  return tonumber(bit.rshift(z, 11)) / 9007199254740992 -- 2^53
end

-- ----------------------------------------------------------------- loader
local Loader = {}
Loader.__index = Loader
data.Loader_mt = Loader

-- data.Loader(bytes, { batch_size =, seq_len =, seed =, step = 0, rank = 0, world_size = 1 })
function data.Loader(bytes, opts)
  opts = opts or {}
  local B, Tn = opts.batch_size or 8, opts.seq_len or 64
  local rank, W = opts.rank or 0, opts.world_size or 1
  if not bytes then error('data.Loader: no bytes (an empty split?)', 2) end
  if bytes.n < Tn + 1 then
    error(('data.Loader: %s has %d bytes, fewer than seq_len + 1 = %d'):format(bytes.name or 'data', bytes.n, Tn + 1), 2)
  end
  if type(W) ~= 'number' or W < 1 or type(rank) ~= 'number' or rank < 0 or rank >= W then
    error(('data.Loader: rank %s must be in [0, world_size = %s)'):format(tostring(rank), tostring(W)), 2)
  end
  return setmetatable({ bytes = bytes, B = B, T = Tn, seed = opts.seed or 0, step = opts.step or 0,
    rank = rank, world_size = W }, Loader)
end

-- the k-th batch (0-based) of this loader's stream (this rank's rows of
-- global batch k), without moving it
function Loader:batch(k)
  local B, Tn, bytes = self.B, self.T, self.bytes
  local first = (k * self.world_size + self.rank) * B -- the stream's row index of this batch's row 0
  local x = T.empty({ B, Tn }, { dtype = 'i64' })
  local y = T.empty({ B, Tn }, { dtype = 'i64' })
  local px = ffi.cast('int64_t*', x:data_ptr())
  local py = ffi.cast('int64_t*', y:data_ptr())
  local src = bytes.ptr
  local span = bytes.n - Tn -- offsets 0 .. span-1
  for b = 0, B - 1 do
    local off = math.floor(data.uniform(self.seed, first + b) * span)
    local row = b * Tn
    for t = 0, Tn - 1 do
      px[row + t] = src[off + t]
      py[row + t] = src[off + t + 1]
    end
  end
  return x, y
end

function Loader:next()
  local x, y = self:batch(self.step)
  self.step = self.step + 1
  return x, y
end

-- the position: step (batches of this loader), seed, and rows (the global
-- rows consumed: step x world_size x batch_size), which set_state prefers,
-- so a state resumes at another world size or batch size when the global
-- rows fall on a batch boundary there
function Loader:state()
  return { step = self.step, seed = self.seed, rows = self.step * self.world_size * self.B }
end
function Loader:set_state(s)
  local step = s.step
  if s.rows then
    local per = self.world_size * self.B
    if s.rows % per ~= 0 then
      error(('data.Loader:set_state: %d rows consumed is not a whole number of batches of %d ranks x %d rows'):format(
        s.rows, self.world_size, self.B), 2)
    end
    step = s.rows / per
  end
  self.step, self.seed = step, s.seed or self.seed
end

-- ----------------------------------------------------------------- shards
-- data.open{ train = 'dir|glob|file', val = ..., dir = DIR, batch_size =, seq_len =,
--            seed = 0, rank = 0, world_size = 1, device = }
-- -> { train = loader, val = loader | nil, name = , n = train tokens }
-- Token shards (llm.c's format, bin/tokenize) through moonshard.shards:
-- dir = DIR means train = DIR/train_*.bin and val = DIR/val_*.bin (when
-- any). The loaders have the interface of data.Loader (next, batch(k),
-- state, set_state); the train loader shuffles with `seed`, the val loader
-- reads in order (batch k is the same every evaluation).
function data.open(opts)
  local shards = require 'moonshard.shards'
  local train_spec, val_spec = opts.train, opts.val
  if opts.dir then
    train_spec = train_spec or (opts.dir .. '/train_*.bin')
    if val_spec == nil then
      local ok, list = pcall(shards.list, opts.dir .. '/val_*.bin')
      val_spec = ok and list or nil
    end
  end
  if not train_spec then error('data.open: no train shards (give train = or dir =)', 2) end
  local function loader(spec, seed, shuffle, name)
    local ok, l = pcall(shards.Loader, { files = spec, batch_size = opts.batch_size, seq_len = opts.seq_len,
      seed = seed, shuffle = shuffle, rank = opts.rank, world_size = opts.world_size, device = opts.device, name = name })
    if not ok then error(l, 3) end
    return l
  end
  local seed = opts.seed or 0
  local tr = loader(train_spec, seed, opts.shuffle ~= false)
  local va = val_spec and loader(val_spec, seed + 1, false) or nil
  return { train = tr, val = va, name = tr.name, n = tr.tokens }
end

return data
