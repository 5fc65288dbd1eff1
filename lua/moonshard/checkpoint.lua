-- moonshard.checkpoint — training checkpoints: written atomically, checked
-- by checksums, the last K kept, the newest complete one found on resume.
--
--   local ckpt = require 'moonshard.checkpoint'
--   local dir = ckpt.save('runs/x', 200, {
--     model = model,              -- model:state_dict() -> model.safetensors
--     optimizer = opt,            -- opt:state_dict() -> optimizer.safetensors + optimizer.json
--     state = { step = 200, rng = ms.rng_state(), data = loader:state(), options = o },
--   }, { keep = 3 })              -- -> 'runs/x/ckpt-200'
--   local found, skipped = ckpt.latest('runs/x')       -- newest that verifies
--   local c = ckpt.load(found.path, { model = model, optimizer = opt })  -- c.state
--
-- Layout of one checkpoint, runs/x/ckpt-<step>/:
--   model.safetensors      every tensor of model:state_dict()
--   optimizer.safetensors  the optimizer's state tensors ('<i>.exp_avg', ...)
--   optimizer.json         the optimizer's meta (groups, hyper-parameters, steps)
--   state.json             step, scheduler step, RNG state, data position, run options
--   manifest.json          written last: { step, files = { name = { bytes, crc32 } } }
-- Everything goes into ckpt-<step>.tmp/ first; the folder is renamed to
-- ckpt-<step>/ only once manifest.json is closed, so a folder without the
-- .tmp suffix is complete unless its bytes changed afterwards, and
-- ckpt.verify catches that: a missing manifest, a missing or unreadable
-- file, a size or CRC-32 mismatch, each reported with the file's name.
--
-- The safetensors files are written by a background thread (ckpt.writer,
-- core/io/writer.c) that computes their CRC-32 as the bytes go out;
-- ckpt.save waits for it, ckpt.save_async returns once the tensors are
-- copied to host memory (the training goes on while the files are
-- written) and its p:finish() completes the checkpoint.
--
-- Checksums are zlib's crc32 (verify reads 4 MiB chunks, several GB/s);
-- where libz cannot be loaded, a table-driven CRC-32 in LuaJIT gives the
-- same value.
local ffi = require 'ffi'
local bit = require 'bit'
local json = require 'dkjson'
local S = require 'moonshard.safetensors'
local T = require 'moonshard.tensor'
local C = T.C

local ckpt = {}

-- ------------------------------------------------------------------ CRC-32
local zlib
do
  pcall(ffi.cdef, 'unsigned long crc32(unsigned long crc, const unsigned char *buf, unsigned int len);')
  local ok, lib = pcall(ffi.load, 'z')
  if not ok then ok, lib = pcall(ffi.load, 'libz.so.1') end
  if ok then zlib = lib end
end

local crc_table
local function crc32_lua(crc, s)
  if not crc_table then
    crc_table = ffi.new('uint32_t[256]')
    for i = 0, 255 do
      local c = i
      for _ = 1, 8 do
        if bit.band(c, 1) ~= 0 then c = bit.bxor(0xEDB88320, bit.rshift(c, 1)) else c = bit.rshift(c, 1) end
      end
      crc_table[i] = c
    end
  end
  local c = bit.bnot(crc)
  local p = ffi.cast('const uint8_t *', s)
  for i = 0, #s - 1 do
    c = bit.bxor(crc_table[bit.band(bit.bxor(c, p[i]), 0xff)], bit.rshift(c, 8))
  end
  return tonumber(ffi.cast('uint32_t', bit.bnot(c)))
end

ckpt.crc32_lua = crc32_lua -- the fallback, for the spec

-- CRC-32 (the zlib/PNG polynomial) of a string, continuing from crc
function ckpt.crc32_string(s, crc)
  crc = crc or 0
  if zlib then return tonumber(zlib.crc32(crc, s, #s)) end
  return crc32_lua(crc, s)
end

ckpt.chunk_bytes = 4 * 1024 * 1024

-- crc32_file(path) -> crc (number), bytes | nil, err
function ckpt.crc32_file(path)
  local f, err = io.open(path, 'rb')
  if not f then return nil, err end
  local crc, n = 0, 0
  while true do
    local s = f:read(ckpt.chunk_bytes)
    if not s then break end
    crc = ckpt.crc32_string(s, crc)
    n = n + #s
  end
  f:close()
  return crc, n
end

-- ------------------------------------------------------------------ files
local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

local function write_file(path, s)
  local f, err = io.open(path, 'wb')
  if not f then error(('checkpoint: cannot write %s: %s'):format(path, tostring(err)), 0) end
  local ok, werr = f:write(s)
  if not ok then f:close(); error(('checkpoint: cannot write %s: %s'):format(path, tostring(werr)), 0) end
  local cok, cerr = f:close()
  if not cok then error(('checkpoint: cannot close %s: %s'):format(path, tostring(cerr)), 0) end
end

local function read_file(path)
  local f, err = io.open(path, 'rb')
  if not f then return nil, err end
  local s = f:read('*a')
  f:close()
  return s
end

local function sh(cmd)
  local r = os.execute(cmd)
  return r == 0 or r == true
end

-- JSON with sorted keys (stable files, stable checksums); compact: on one
-- line (a safetensors header's metadata)
local function encode(obj, compact)
  local keys, seen = {}, {}
  local function collect(t)
    for k, v in pairs(t) do
      if type(k) == 'string' and not seen[k] then seen[k] = true; keys[#keys + 1] = k end
      if type(v) == 'table' then collect(v) end
    end
  end
  collect(obj)
  table.sort(keys)
  return json.encode(obj, { indent = not compact, keyorder = keys })
end
ckpt.encode = encode

function ckpt.name(step) return ('ckpt-%d'):format(step) end

-- the complete-looking checkpoint folders under root (no .tmp), newest first:
-- { {step =, path =}, ... }
function ckpt.list(root)
  local out = {}
  local p = io.popen('ls -1 ' .. q(root) .. ' 2>/dev/null')
  if p then
    for name in p:lines() do
      local step = name:match('^ckpt%-(%d+)$')
      if step then out[#out + 1] = { step = tonumber(step), path = root .. '/' .. name } end
    end
    p:close()
  end
  table.sort(out, function(a, b) return a.step > b.step end)
  return out
end

-- rm -rf path
local function remove(path) return sh('rm -rf ' .. q(path)) end
ckpt.remove = remove

-- man.files[name] = { bytes =, crc32 = } of each file `name` of dir
function ckpt.manifest_add(man, dir, names)
  for _, name in ipairs(names) do
    local crc, n = ckpt.crc32_file(dir .. '/' .. name)
    if not crc then error(('checkpoint: cannot read back %s/%s: %s'):format(dir, name, tostring(n)), 0) end
    man.files[name] = { bytes = n, crc32 = crc }
  end
end

-- the last step of a save, with every other file of tmp written: the
-- manifest man, then tmp renamed to final and the newest `keep` kept
function ckpt.finish(root, tmp, final, man, keep)
  write_file(tmp .. '/manifest.json', encode(man) .. '\n')
  sh('sync -f ' .. q(tmp) .. ' 2>/dev/null')
  remove(final)
  local ok, err = os.rename(tmp, final)
  if not ok then error(('checkpoint: cannot rename %s to %s: %s'):format(tmp, final, tostring(err)), 0) end
  ckpt.prune(root, keep)
end

-- verify_files(dir, man, required) -> true | nil, message: every file the
-- manifest man lists has its bytes and CRC-32, and it lists the `required`
function ckpt.verify_files(dir, man, required)
  local names = {}
  for name in pairs(man.files) do names[#names + 1] = name end
  table.sort(names)
  for _, name in ipairs(names) do
    local e = man.files[name]
    local path = dir .. '/' .. name
    local crc, n = ckpt.crc32_file(path)
    if not crc then return nil, ('%s is missing or unreadable (%s)'):format(path, tostring(n)) end
    if n ~= e.bytes then
      return nil, ('%s has %d bytes, the manifest says %d (truncated?)'):format(path, n, e.bytes)
    end
    if crc ~= e.crc32 then
      return nil, ('%s: checksum mismatch (crc32 %08x, the manifest says %08x)'):format(path, crc, e.crc32)
    end
  end
  for _, need in ipairs(required) do
    if not man.files[need] then return nil, ('%s/manifest.json does not list %s'):format(dir, need) end
  end
  return true
end

-- verify(dir) -> true | nil, message naming the file at fault
function ckpt.verify(dir)
  local ms, err = read_file(dir .. '/manifest.json')
  if not ms then return nil, ('%s/manifest.json is missing or unreadable (%s)'):format(dir, tostring(err)) end
  local man = json.decode(ms, 1, nil)
  if type(man) ~= 'table' or type(man.files) ~= 'table' then
    return nil, ('%s/manifest.json is not a valid manifest'):format(dir)
  end
  return ckpt.verify_files(dir, man, { 'model.safetensors', 'state.json' })
end

-- latest(root [, warn]) -> {step =, path =} | nil, and the list of
-- {path =, err =} skipped on the way (each also passed to warn(msg))
function ckpt.latest(root, warn)
  local skipped = {}
  for _, c in ipairs(ckpt.list(root)) do
    local ok, err = ckpt.verify(c.path)
    if ok then return c, skipped end
    skipped[#skipped + 1] = { path = c.path, err = err }
    if warn then warn(('checkpoint %s is corrupt: %s; trying the previous one'):format(c.path, err)) end
  end
  return nil, skipped
end

-- keep only the newest `keep` checkpoints under root (0: keep all); returns the removed paths
function ckpt.prune(root, keep)
  local removed = {}
  if not keep or keep <= 0 then return removed end
  for i, c in ipairs(ckpt.list(root)) do
    if i > keep then
      remove(c.path)
      removed[#removed + 1] = c.path
    end
  end
  return removed
end

-- ----------------------------------------------------------------- writer
-- ckpt.writer() -> a background thread that writes checkpoint files
-- (core/io/writer.h): a file's bytes and CRC-32 in one pass, fsync'd.
--   local w = ckpt.writer()
--   local job = w:safetensors(path, tensors, metadata, true)  -- staged: the tensors may change at once
--   w:idle()  w:wait()  w:result(job) -> bytes, crc32  w:close()
-- Staging copies every tensor into host memory the writer keeps between
-- saves (page-locked for GPU tensors), torchtitan's "async with pinned
-- memory"; without it the tensors are written from their own memory and
-- must not change until the wait.
local Writer = {}
Writer.__index = Writer

function ckpt.writer()
  local box = ffi.new('ms_writer *[1]')
  T.check(C.ms_writer_new(box), 2)
  return setmetatable({ p = ffi.gc(box[0], C.ms_writer_free), held = {}, stage = {} }, Writer)
end

function Writer:safetensors(path, tensors, metadata, stage)
  local job, held = S.write_async(self.p, path, tensors, metadata, stage and self.stage or nil)
  self.held[#self.held + 1] = held
  return job
end

function Writer:idle() return C.ms_writer_idle(self.p) == 1 end

-- waits for every queued file; raises naming the first that failed
function Writer:wait()
  local rc = C.ms_writer_wait(self.p)
  local err = rc ~= 0 and ffi.string(C.ms_last_error()) or nil
  for _, h in ipairs(self.held) do
    for _, t in ipairs(h.owned or {}) do t:free() end
  end
  self.held = {}
  if err then error('checkpoint: ' .. err, 0) end
end

-- a written file's bytes and CRC-32; raises naming the file when it failed
function Writer:result(job)
  local n, crc = ffi.new('int64_t[1]'), ffi.new('uint32_t[1]')
  if C.ms_writer_result(self.p, job, n, crc) ~= 0 then error('checkpoint: ' .. ffi.string(C.ms_last_error()), 2) end
  return tonumber(n[0]), tonumber(crc[0])
end

-- lets the thread finish its queue (a file still waiting for a piece
-- fails), stops it, frees the copies and the staging memory; unreported
-- failures are dropped
function Writer:close()
  if not self.p then return end
  C.ms_writer_free(ffi.gc(self.p, nil))
  self.p = nil
  for _, h in ipairs(self.held) do
    for _, t in ipairs(h.owned or {}) do t:free() end
  end
  self.held = {}
  for _, e in pairs(self.stage) do e.t:free() end
  self.stage = {}
end

-- the writer of the synchronous saves (made at the first)
local sync_writer
function ckpt.sync_writer()
  sync_writer = sync_writer or ckpt.writer()
  return sync_writer
end

-- a save whose files are queued: p:ready(), p:finish() -> path
local Pending = {}
Pending.__index = Pending

-- true once every file is on disk (finish then only renames)
function Pending:ready() return self.writer:idle() end

-- waits for the files, writes the manifest, renames <ckpt>.tmp and prunes;
-- on a failed file the .tmp folder is removed and the older checkpoints
-- stay as they were
function Pending:finish()
  if self.path then return self.path end
  -- (a failure the wait reports may be another save's, on the same writer:
  -- each save judges its own files)
  pcall(self.writer.wait, self.writer)
  local man = { step = self.step, format = 1, files = {} }
  for name, job in pairs(self.jobs) do
    local ok, n, crc = pcall(self.writer.result, self.writer, job)
    if not ok then
      remove(self.tmp)
      error(n, 0)
    end
    man.files[name] = { bytes = n, crc32 = crc }
  end
  for name, sum in pairs(self.small) do man.files[name] = sum end
  ckpt.finish(self.root, self.tmp, self.final, man, self.keep)
  self.path = self.final
  return self.final
end

-- save_async(root, step, { model =, optimizer =, state = }, { keep = K, writer = w, stage = true }) -> a pending save
--   The tensors are staged (copied into the writer's host memory) before it
--   returns, so training may go on; the files are written by the writer's
--   thread; p:finish() completes the checkpoint. stage = false writes from
--   the tensors' own memory (they must not change until p:finish()).
function ckpt.save_async(root, step, parts, opts)
  opts = opts or {}
  local w = opts.writer or error('checkpoint.save_async: opts.writer (a checkpoint.writer()) is needed', 2)
  local final = root .. '/' .. ckpt.name(step)
  local tmp = final .. '.tmp'
  local p = setmetatable({ writer = w, root = root, tmp = tmp, final = final, step = step, keep = opts.keep,
    jobs = {}, small = {} }, Pending)
  remove(tmp)
  if not sh('mkdir -p ' .. q(tmp)) then error(('checkpoint: cannot create %s'):format(tmp), 0) end
  local stage = opts.stage ~= false
  local function small(name, s)
    write_file(tmp .. '/' .. name, s)
    p.small[name] = { bytes = #s, crc32 = ckpt.crc32_string(s) }
  end
  local ok, err = pcall(function()
    if parts.model then
      p.jobs['model.safetensors'] = w:safetensors(tmp .. '/model.safetensors', (parts.model:state_dict()), nil, stage)
    end
    if parts.optimizer then
      local sd = parts.optimizer:state_dict()
      p.jobs['optimizer.safetensors'] = w:safetensors(tmp .. '/optimizer.safetensors', sd.tensors, nil, stage)
      small('optimizer.json', encode(sd.meta) .. '\n')
    end
    local state = parts.state or {}
    state.step = state.step or step
    small('state.json', encode(state) .. '\n')
  end)
  if not ok then
    pcall(w.wait, w)   -- (what was queued is written before the folder goes)
    remove(tmp)
    error(err, 0)
  end
  return p
end

-- save(root, step, { model =, optimizer =, state = }, { keep = K }) -> path:
-- the same files, written before it returns
function ckpt.save(root, step, parts, opts)
  opts = opts or {}
  return ckpt.save_async(root, step, parts, { keep = opts.keep, writer = ckpt.sync_writer(), stage = false }):finish()
end

-- load(dir, { model =, optimizer = }) -> { state =, path = }: copies the
-- weights into model and the state into optimizer (when given). Call
-- verify first; a file that fails to parse is still an error naming it.
function ckpt.load(dir, into)
  into = into or {}
  local function jread(name)
    local s, err = read_file(dir .. '/' .. name)
    if not s then error(('checkpoint: cannot read %s/%s: %s'):format(dir, name, tostring(err)), 0) end
    local v = json.decode(s, 1, nil)
    if type(v) ~= 'table' then error(('checkpoint: %s/%s is not valid JSON'):format(dir, name), 0) end
    return v
  end
  local state = jread('state.json')
  if into.model then
    local sd = S.load(dir .. '/model.safetensors')
    into.model:load_state_dict(sd)
    for _, t in pairs(sd) do t:free() end
  end
  if into.optimizer then
    local tensors = S.load(dir .. '/optimizer.safetensors')
    into.optimizer:load_state_dict({ tensors = tensors, meta = jread('optimizer.json') })
    for _, t in pairs(tensors) do t:free() end
  end
  return { state = state, path = dir }
end

return ckpt
