-- moonshard.shards — token shards in llm.c's format: write them, map them,
-- and a loader that gives every rank its own part of each batch.
--
--   local shards = require 'moonshard.shards'
--   shards.write('data/train_000000.bin', ids)      -- ids: a Lua list of 0-based token ids
--   local s = shards.open('data/train_000000.bin')   -- mmap'd, validated; s.n, s.version, s:get(i)
--   local loader = shards.Loader{ files = 'data/train_*.bin',  -- a folder, a glob, a file or a list
--     batch_size = 8, seq_len = 1024, rank = 0, world_size = 1, seed = 1, device = 'cpu' }
--   local x, y = loader:next()        -- (B, T) i64 each; y is x shifted by one token
--   local st = loader:state()         -- plain numbers: step, epoch, shard, sample, seed, ...
--   loader:set_state(st)              -- the next batch is the one that would have come
--
-- Format (core/io/shards.h): 256 little-endian int32 (magic 20240520,
-- version 1 = uint16 tokens or 2 = uint32 tokens, token count), then the
-- tokens. The C core maps the file read-only and validates it: a tiny
-- file, a bad magic number, a bad version or a truncated shard is a Lua
-- error naming the file and the numbers.
--
-- Batches (as llm.c's DataLoader): a "sample" is world_size * B * T + 1
-- consecutive tokens of one shard, starting at a multiple of
-- world_size * B * T; rank r takes its B * T + 1 tokens at r * B * T. So
-- in a step the ranks' batches are disjoint and together are the batch one
-- rank would read with world_size times the batch size. A shard of n tokens
-- holds floor((n - 1) / (world_size * B * T)) samples (the tail is unused).
-- Every epoch visits each sample once: the shards in a seeded permutation
-- of the epoch, each shard's samples in a seeded permutation of (epoch,
-- shard) (shuffle = false: both in order). Batch k is a pure function of
-- (seed, k), so the whole position is the step; state() also names the
-- epoch, shard and sample, and set_state checks they agree with the files.
local ffi = require 'ffi'
local bit = require 'bit'
local T = require 'moonshard.tensor'
local C = T.C

local shards = {}
shards.MAGIC = 20240520
shards.HEADER_BYTES = 1024

-- ------------------------------------------------------------------ files
local Shard = {}
Shard.__index = Shard

local function release(h) C.ms_shard_free(h) end

-- shards.open(path) -> shard { path, n, version, token_bytes } (mmap'd; :free() to unmap now)
function shards.open(path)
  local box = ffi.new('ms_shard*[1]')
  if C.ms_shard_open(box, tostring(path)) ~= 0 then error(ffi.string(C.ms_last_error()), 2) end
  local h = ffi.gc(box[0], release)
  local s = setmetatable({ h = h, path = path, n = tonumber(C.ms_shard_ntokens(h)),
    version = C.ms_shard_version(h), token_bytes = C.ms_shard_token_bytes(h) }, Shard)
  s.ptr = ffi.cast(s.version == 1 and 'const uint16_t*' or 'const uint32_t*', C.ms_shard_tokens(h))
  return s
end

function Shard:live(op)
  if self.h == nil then error(('shard %s: %s after free()'):format(self.path, op), 3) end
  return self.h
end
-- token i (0-based)
function Shard:get(i)
  self:live('get')
  if i < 0 or i >= self.n then error(('shard %s: token %d outside [0, %d)'):format(self.path, i, self.n), 2) end
  return tonumber(self.ptr[i])
end
-- tokens [start, start + n) into an int64_t* (0-based)
function Shard:read(start, n, dst)
  T.check(C.ms_shard_read_i64(self:live('read'), start, n, dst), 2)
end
-- tokens [start, start + n) as a Lua list (all by default)
function Shard:tokens(start, n)
  self:live('tokens')
  start, n = start or 0, n or (self.n - (start or 0))
  local buf = ffi.new('int64_t[?]', math.max(n, 1))
  self:read(start, n, buf)
  local out = {}
  for i = 1, n do out[i] = tonumber(buf[i - 1]) end
  return out
end
function Shard:free()
  if self.h ~= nil then
    C.ms_shard_free(ffi.gc(self.h, nil))
    self.h, self.ptr = nil, nil
  end
end

function shards.live() return tonumber(C.ms_shard_live()) end

-- shards.write(path, ids [, { n =, version = }]) -> version written
-- ids: a Lua list (1-based) or an integer cdata array (0-based, give n).
-- version: 1 (uint16) unless an id exceeds 65,535 (then 2); written to
-- path .. '.tmp' then renamed, so a reader never sees half a shard.
function shards.write(path, ids, opts)
  opts = opts or {}
  local n = opts.n or #ids
  local base = type(ids) == 'table' and 1 or 0
  local version = opts.version
  if not version then
    version = 1
    for i = 0, n - 1 do
      if ids[i + base] > 65535 then version = 2; break end
    end
  end
  if version ~= 1 and version ~= 2 then error(('shards.write: version must be 1 or 2, got %s'):format(tostring(version)), 2) end
  if n > 2147483647 then error(('shards.write: %d tokens do not fit one shard (the header holds an int32)'):format(n), 2) end
  local header = ffi.new('int32_t[256]')
  header[0], header[1], header[2] = shards.MAGIC, version, n
  local buf = ffi.new(version == 1 and 'uint16_t[?]' or 'uint32_t[?]', math.max(n, 1))
  local limit = version == 1 and 65535 or 4294967295
  for i = 0, n - 1 do
    local v = ids[i + base]
    if v < 0 or v > limit then
      error(('shards.write: %s: token %d is %s, outside [0, %d] for version %d'):format(path, i, tostring(v), limit, version), 2)
    end
    buf[i] = v
  end
  local tmp = path .. '.tmp'
  local f, err = io.open(tmp, 'wb')
  if not f then error(('shards.write: cannot write %s: %s'):format(tmp, tostring(err)), 2) end
  local ok, werr = f:write(ffi.string(header, 1024), ffi.string(buf, n * (version == 1 and 2 or 4)))
  f:close()
  if not ok then os.remove(tmp); error(('shards.write: %s: %s'):format(tmp, tostring(werr)), 2) end
  local okr, rerr = os.rename(tmp, path)
  if not okr then error(('shards.write: cannot rename %s to %s: %s'):format(tmp, path, tostring(rerr)), 2) end
  return version
end

-- --------------------------------------------------------------- listing
local function shell_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
local function is_dir(path)
  local ok, _, code = os.rename(path, path)
  if not ok and code ~= 13 then return false end -- 13: permission denied (exists)
  local f = io.open(path .. '/.')
  if f then f:close(); return true end
  return false
end
local function ls(dir)
  local p = io.popen('ls -1A ' .. shell_quote(dir) .. ' 2>/dev/null')
  local names = {}
  for line in p:lines() do names[#names + 1] = line end
  p:close()
  return names
end
local function glob_to_pattern(g)
  return '^' .. g:gsub('[%^%$%(%)%%%.%[%]%+%-]', '%%%0'):gsub('%*', '.*'):gsub('%?', '.') .. '$'
end

-- shards.list(spec) -> sorted list of paths. spec: a folder (its *.bin
-- files), a glob (wildcards * and ? in the last component), a file, or a
-- list of these. An empty result is an error naming the spec.
function shards.list(spec)
  local out = {}
  local specs = type(spec) == 'table' and spec or { spec }
  for _, sp in ipairs(specs) do
    sp = tostring(sp)
    local found = {}
    if sp:find('[%*%?]') then
      local dir, pat = sp:match('^(.*)/([^/]*)$')
      if not dir then dir, pat = '.', sp end
      if dir:find('[%*%?]') then error(('shards: %s: wildcards only in the file name'):format(sp), 2) end
      local lp = glob_to_pattern(pat)
      for _, name in ipairs(ls(dir == '' and '/' or dir)) do
        if name:match(lp) then found[#found + 1] = (dir == '.' and sp:sub(1, 2) ~= './') and name or (dir .. '/' .. name) end
      end
    elseif is_dir(sp) then
      for _, name in ipairs(ls(sp)) do
        if name:match('%.bin$') then found[#found + 1] = sp:gsub('/$', '') .. '/' .. name end
      end
    else
      local f = io.open(sp, 'rb')
      if not f then error(('shards: no such file or folder: %s'):format(sp), 2) end
      f:close()
      found[1] = sp
    end
    if #found == 0 then error(('shards: no shards match %s'):format(sp), 2) end
    table.sort(found)
    for _, f in ipairs(found) do out[#out + 1] = f end
  end
  return out
end

-- -------------------------------------------------------------- generator
-- splitmix64: counter-based, so a permutation is a pure function of its key
local u64 = ffi.typeof('uint64_t')
local function mix(z)
  z = z + 0x9E3779B97F4A7C15ULL
  z = bit.bxor(z, bit.rshift(z, 30)) * 0xBF58476D1CE4E5B9ULL
  z = bit.bxor(z, bit.rshift(z, 27)) * 0x94D049BB133111EBULL
  return bit.bxor(z, bit.rshift(z, 31))
end
local function key(seed, a, b) return mix(mix(mix(u64(seed)) + u64(a)) + u64(b)) end

-- a permutation of 0..n-1 (int32 array) for a key; identity when key is nil
function shards.permutation(n, k)
  local p = ffi.new('int32_t[?]', math.max(n, 1))
  for i = 0, n - 1 do p[i] = i end
  if k then
    for i = n - 1, 1, -1 do
      local z = mix(k + u64(i))
      local j = tonumber(z % u64(i + 1)) -- modulo bias < (i+1) / 2^64
      p[i], p[j] = p[j], p[i]
    end
  end
  return p
end

-- ----------------------------------------------------------------- loader
local Loader = {}
Loader.__index = Loader
shards.Loader_mt = Loader

local SHARD_ORDER = 0xFFFFFFFF -- the key's tag for the shard order

-- shards.Loader{ files =, batch_size = 8, seq_len = 64, rank = 0, world_size = 1,
--                seed = 0, shuffle = true, device = 'cpu', step = 0, name = }
function shards.Loader(opts)
  opts = opts or {}
  local B, Tn = opts.batch_size or 8, opts.seq_len or 64
  local rank, W = opts.rank or 0, opts.world_size or 1
  if W < 1 or rank < 0 or rank >= W then
    error(('shards.Loader: rank %s must be in [0, world_size = %s)'):format(tostring(rank), tostring(W)), 2)
  end
  if B < 1 or Tn < 1 then error(('shards.Loader: batch_size %d and seq_len %d must be positive'):format(B, Tn), 2) end
  local ok, files = pcall(shards.list, opts.files)
  if not ok then error(files, 2) end
  local self = setmetatable({ B = B, T = Tn, rank = rank, world_size = W, seed = opts.seed or 0,
    shuffle = opts.shuffle ~= false, device = opts.device, step = opts.step or 0,
    files = files, shards = {}, samples = {}, total = 0, tokens = 0, version = 1 }, Loader)
  local span = W * B * Tn
  self.span = span
  local active = {}
  for i, path in ipairs(files) do
    local ok2, s = pcall(shards.open, path)
    if not ok2 then self:free(); error(s, 2) end
    self.shards[i] = s
    local ns = s.n > 0 and math.floor((s.n - 1) / span) or 0
    self.samples[i] = ns
    self.total = self.total + ns
    self.tokens = self.tokens + s.n
    if s.version > self.version then self.version = s.version end
    if ns > 0 then active[#active + 1] = i end
  end
  self.active = active -- files with at least one sample (1-based indices)
  -- the files as given: a glob or folder, or a list (data.open's val shards)
  local given = type(opts.files) == 'table' and table.concat(opts.files, ', ') or tostring(opts.files)
  if self.total == 0 then
    local biggest = 0
    for _, s in ipairs(self.shards) do biggest = math.max(biggest, s.n) end
    self:free()
    error(('shards.Loader: no shard of %s holds a batch: the largest has %d tokens, a batch of world_size %d x B %d x T %d needs %d + 1')
      :format(given, biggest, W, B, Tn, span), 2)
  end
  self.name = opts.name or (#files == 1 and files[1] or ('%s (%d shards)'):format(given, #files))
  return self
end

-- the files of an epoch in visiting order (positions into self.active)
function Loader:order(epoch)
  local c = self._order
  if not (c and c.epoch == epoch) then
    c = { epoch = epoch, perm = shards.permutation(#self.active, self.shuffle and key(self.seed, epoch, SHARD_ORDER) or nil) }
    self._order = c
  end
  return c.perm
end
function Loader:sample_order(epoch, file)
  local c = self._samples
  if not (c and c.epoch == epoch and c.file == file) then
    c = { epoch = epoch, file = file,
          perm = shards.permutation(self.samples[file], self.shuffle and key(self.seed, epoch, file) or nil) }
    self._samples = c
  end
  return c.perm
end

-- where batch k comes from: epoch, shard (0-based position in the epoch's
-- order), file (1-based index into loader.files), sample (0-based position
-- in that shard's order), start (the rank's first token in the shard)
function Loader:locate(k)
  local epoch = math.floor(k / self.total)
  local r = k - epoch * self.total
  local order = self:order(epoch)
  for pos = 0, #self.active - 1 do
    local file = self.active[order[pos] + 1]
    local ns = self.samples[file]
    if r < ns then
      local idx = self:sample_order(epoch, file)[r]
      return { epoch = epoch, shard = pos, file = file, sample = r,
               start = idx * self.span + self.rank * self.B * self.T }
    end
    r = r - ns
  end
  error('shards.Loader: internal error locating batch ' .. tostring(k))
end

-- the k-th batch (0-based) of this rank's stream, without moving the loader
function Loader:batch(k)
  if not self.shards[1] then error('shards.Loader: used after free()', 2) end
  local at = self:locate(k)
  local s = self.shards[at.file]
  local B, Tn = self.B, self.T
  local x = T.empty({ B, Tn }, { dtype = 'i64' })
  local y = T.empty({ B, Tn }, { dtype = 'i64' })
  s:read(at.start, B * Tn, ffi.cast('int64_t*', x:data_ptr()))
  s:read(at.start + 1, B * Tn, ffi.cast('int64_t*', y:data_ptr()))
  if self.device and T.device_id(self.device) >= 0 then
    x, y = x:to(self.device), y:to(self.device)
  end
  return x, y
end

function Loader:next()
  local x, y = self:batch(self.step)
  self.step = self.step + 1
  return x, y
end

-- the position of the next batch: plain numbers, for a checkpoint
function Loader:state()
  local at = self:locate(self.step)
  return { step = self.step, epoch = at.epoch, shard = at.shard, sample = at.sample, seed = self.seed,
           batch_size = self.B, seq_len = self.T, world_size = self.world_size, samples = self.total }
end

-- restores a state(): the next batch is the one that would have come. The
-- batch shape and world size must match; epoch/shard/sample must agree with
-- the step on these files (else the shards changed since the state was taken).
function Loader:set_state(s)
  if type(s) ~= 'table' then error('shards.Loader:set_state: expected a table from state()', 2) end
  for _, f in ipairs({ { 'batch_size', self.B }, { 'seq_len', self.T }, { 'world_size', self.world_size } }) do
    if s[f[1]] and s[f[1]] ~= f[2] then
      error(('shards.Loader:set_state: the state has %s %d, this loader %d'):format(f[1], s[f[1]], f[2]), 2)
    end
  end
  local seed = s.seed or self.seed
  local step = s.step
  if seed ~= self.seed then self.seed, self._order, self._samples = seed, nil, nil end
  if not step then
    if not (s.epoch and s.shard and s.sample) then error('shards.Loader:set_state: the state has no step (nor epoch, shard, sample)', 2) end
    step = s.epoch * self.total
    local order = self:order(s.epoch)
    for pos = 0, s.shard - 1 do step = step + self.samples[self.active[order[pos] + 1]] end
    step = step + s.sample
  end
  if s.epoch and s.shard and s.sample then
    local at = self:locate(step)
    if at.epoch ~= s.epoch or at.shard ~= s.shard or at.sample ~= s.sample then
      error(('shards.Loader:set_state: step %d is epoch %d shard %d sample %d on %s, but the state says epoch %d shard %d sample %d (the shards changed?)')
        :format(step, at.epoch, at.shard, at.sample, self.name, s.epoch, s.shard, s.sample), 2)
    end
  end
  self.step = step
end

-- unmaps the shards now (the GC would, later); safe twice
function Loader:free()
  for i, s in ipairs(self.shards) do s:free(); self.shards[i] = nil end
end

return shards
