-- moonshard.safetensors — read and write .safetensors files.
--
--   local st = require 'moonshard.safetensors'
--   local tensors, metadata = st.load('model.safetensors')
--   print(tensors['transformer.wte.weight'].shape[1], metadata.format)
--   st.save('out.safetensors', { w = w, b = b }, { format = 'pt' })
--
-- The format (https://huggingface.co/docs/safetensors): 8 bytes of header
-- length N (little-endian u64), N bytes of JSON header, then the data bytes.
-- The header maps each tensor name to {dtype, shape, data_offsets = [begin,
-- end)} (offsets relative to the start of the data), plus an optional
-- "__metadata__" object of string -> string. The header is padded with spaces
-- to a multiple of 8 bytes.
--
-- load() validates the whole header before it reads any data (bounded header
-- size, JSON that parses, every entry complete, offsets inside the file and
-- consistent with shape × dtype size, no two tensors overlapping): a malformed
-- file raises a Lua error "safetensors: <path>: <what is wrong>", never a
-- crash. Tensor data is read by C (ms_file_read_into) straight into a fresh
-- tensor: a big file never becomes a Lua string.
--
-- save() writes tensors sorted by name, back to back, from contiguous CPU
-- copies where needed, into `path .. '.tmp'`, then renames it over `path`: a
-- failed save leaves an existing file untouched.
local ffi = require 'ffi'
local json = require 'dkjson'
local T = require 'moonshard.tensor'
local C = T.C

local S = {}

-- dkjson's LPeg parser is stricter and faster; its plain-Lua one is the fallback
local okl, jsonlpeg = pcall(json.use_lpeg)
local json_decode = okl and jsonlpeg.decode or json.decode

-- safetensors dtype codes <-> moonshard dtype names
local from_code = {
  F64 = 'f64', F32 = 'f32', BF16 = 'bf16', F16 = 'f16',
  I64 = 'i64', I32 = 'i32', U8 = 'u8', BOOL = 'bool', F8_E4M3 = 'f8e4m3', F8_E5M2 = 'f8e5m2',
}
local to_code = {}
for code, name in pairs(from_code) do to_code[name] = code end
S.dtype_codes = to_code
local dtype_size = { f64 = 8, f32 = 4, bf16 = 2, f16 = 2, i64 = 8, i32 = 4, u8 = 1, bool = 1, f8e4m3 = 1, f8e5m2 = 1 }

-- a header longer than this is refused (real headers are a few hundred KB)
S.max_header_bytes = 100 * 2 ^ 20
-- save() writes data in pieces of this many bytes (bounds the Lua strings)
S.write_chunk_bytes = 16 * 2 ^ 20

local function fail(path, fmt, ...)
  error(('safetensors: %s: ' .. fmt):format(path, ...), 3)
end

local function is_int(v) return type(v) == 'number' and v == math.floor(v) and v >= 0 and v < 2 ^ 53 end

local function jsontype(v)
  if type(v) ~= 'table' then return type(v) end
  local m = getmetatable(v)
  return m and m.__jsontype or 'table'
end

-- Reads and validates the header. Returns entries (list of {name, dtype,
-- shape, begin, finish} sorted by begin), the metadata table and the absolute
-- offset of the data section.
local function read_header(path)
  if type(path) ~= 'string' then
    error(('safetensors: expected a file path, got %s'):format(type(path)), 3)
  end
  local f, err = io.open(path, 'rb')
  if not f then fail(path, 'cannot open: %s', err) end
  local size = f:seek('end')
  f:seek('set', 0)
  if not size or size < 8 then
    f:close()
    fail(path, 'file is %d bytes, too short for the 8-byte header length (truncated?)', size or 0)
  end
  local b = f:read(8)
  local n = 0
  for i = 8, 1, -1 do n = n * 256 + b:byte(i) end
  if n < 2 or n > S.max_header_bytes then
    f:close()
    fail(path, 'header length %.0f is invalid (must be 2..%d bytes; not a safetensors file?)', n, S.max_header_bytes)
  end
  if 8 + n > size then
    f:close()
    fail(path, 'header length %.0f runs past the end of the %d-byte file (truncated?)', n, size)
  end
  local text = f:read(n)
  f:close()
  if not text or #text ~= n then fail(path, 'could not read the %.0f-byte header', n) end
  if text:sub(1, 1) ~= '{' then fail(path, 'header does not start with "{" (not a safetensors file?)') end
  local ok, hdr, pos, jerr = pcall(json_decode, text, 1, nil)
  if not ok then fail(path, 'header is not valid JSON: %s', tostring(hdr)) end
  if hdr == nil then fail(path, 'header is not valid JSON: %s', tostring(jerr)) end
  if jsontype(hdr) ~= 'object' then fail(path, 'header is a JSON %s, expected an object', jsontype(hdr)) end
  if text:find('[^ \t\r\n]', pos) then
    fail(path, 'header has trailing bytes after the JSON object at byte %d', pos)
  end

  local data_start, data_size = 8 + n, size - 8 - n
  local metadata = {}
  local entries = {}
  for name, e in pairs(hdr) do
    if name == '__metadata__' then
      if jsontype(e) ~= 'object' then fail(path, '__metadata__ is a JSON %s, expected an object', jsontype(e)) end
      for k, v in pairs(e) do
        if type(v) ~= 'string' then
          fail(path, '__metadata__ value for %q is a %s, expected a string', k, jsontype(v))
        end
        metadata[k] = v
      end
    else
      if jsontype(e) ~= 'object' then fail(path, 'entry %q is a JSON %s, expected an object', name, jsontype(e)) end
      local code, shape, offs = e.dtype, e.shape, e.data_offsets
      if code == nil then fail(path, 'tensor %q has no dtype', name) end
      if shape == nil then fail(path, 'tensor %q has no shape', name) end
      if offs == nil then fail(path, 'tensor %q has no data_offsets', name) end
      local dtype = from_code[code]
      if not dtype then
        fail(path, 'tensor %q has unsupported dtype %s (supported: F64, F32, BF16, F16, I64, I32, U8, BOOL, F8_E4M3, F8_E5M2)',
          name, tostring(code))
      end
      if jsontype(shape) ~= 'array' or #shape > 8 then
        fail(path, 'tensor %q: shape must be an array of at most 8 sizes', name)
      end
      local numel = 1
      for i = 1, #shape do
        if not is_int(shape[i]) then
          fail(path, 'tensor %q: shape entry %d is %s, expected a non-negative integer', name, i, tostring(shape[i]))
        end
        numel = numel * shape[i]
      end
      if jsontype(offs) ~= 'array' or #offs ~= 2 or not is_int(offs[1]) or not is_int(offs[2]) then
        fail(path, 'tensor %q: data_offsets must be two non-negative integers', name)
      end
      local b0, b1 = offs[1], offs[2]
      if b1 < b0 then fail(path, 'tensor %q: data_offsets [%.0f, %.0f] end before they begin', name, b0, b1) end
      if b1 > data_size then
        fail(path, 'tensor %q: data_offsets [%.0f, %.0f] lie outside the %.0f data bytes of the file (truncated?)',
          name, b0, b1, data_size)
      end
      local want = numel * dtype_size[dtype]
      if b1 - b0 ~= want then
        fail(path, 'tensor %q: data_offsets [%.0f, %.0f] hold %.0f bytes, but shape (%s) of %s needs %.0f',
          name, b0, b1, b1 - b0, table.concat(shape, ','), code, want)
      end
      entries[#entries + 1] = { name = name, dtype = dtype, shape = shape, begin = b0, finish = b1 }
    end
  end
  table.sort(entries, function(a, c)
    if a.begin ~= c.begin then return a.begin < c.begin end
    return a.name < c.name
  end)
  local last -- the non-empty entry reaching furthest so far
  for _, q in ipairs(entries) do
    if q.finish > q.begin then
      if last and q.begin < last.finish then
        fail(path, 'tensors %q [%.0f, %.0f] and %q [%.0f, %.0f] overlap', last.name, last.begin, last.finish,
          q.name, q.begin, q.finish)
      end
      if not last or q.finish > last.finish then last = q end
    end
  end
  return entries, metadata, data_start
end

-- load_deferred(path) -> { name = tensor }, metadata: every tensor of the
-- file as a deferred tensor (nn.deferred_init) that holds no data and reads
-- its bytes only when replayed: copied into a deferred model's parameters
-- (load_state_dict), they give fsdp.fully_shard each rank's part of the
-- file, and nn.materialize the whole of it
function S.load_deferred(path)
  if not ffi.abi('le') then error('safetensors: only little-endian hosts are supported', 2) end
  local entries, metadata, data_start = read_header(path)
  local out = {}
  for _, e in ipairs(entries) do
    out[e.name] = T.deferred_file(path, data_start + e.begin, e.dtype, e.shape)
  end
  return out, metadata
end

-- load(path [, opts]) -> { name = tensor }, metadata
--   opts.names   list (or set) of names to load; a missing one is an error
--   opts.device  device to move the tensors to ('cpu', 'cuda', 'cuda:N')
function S.load(path, opts)
  opts = opts or {}
  if not ffi.abi('le') then error('safetensors: only little-endian hosts are supported', 2) end
  local entries, metadata, data_start = read_header(path)
  local want
  if opts.names ~= nil then
    if type(opts.names) ~= 'table' then error('safetensors: opts.names must be a table of names', 2) end
    want = {}
    for k, v in pairs(opts.names) do
      if type(k) == 'number' then want[v] = true elseif v then want[k] = true end
    end
    local have = {}
    for _, e in ipairs(entries) do have[e.name] = true end
    local missing = {}
    for name in pairs(want) do if not have[name] then missing[#missing + 1] = tostring(name) end end
    table.sort(missing)
    if #missing > 0 then fail(path, 'no tensor named %s in the file', table.concat(missing, ', ')) end
  end
  local device = opts.device and T.device_id(opts.device, 2) or -1
  local out = {}
  for _, e in ipairs(entries) do
    if not want or want[e.name] then
      local t = T.empty(e.shape, { dtype = e.dtype })
      if C.ms_file_read_into(path, data_start + e.begin, e.finish - e.begin, t) ~= 0 then
        error(('safetensors: %s: tensor %q: %s'):format(path, e.name, ffi.string(C.ms_last_error())), 2)
      end
      if device >= 0 then
        local d = t:to({ device = device })
        t:free()
        t = d
      end
      out[e.name] = t
    end
  end
  return out, metadata
end

-- header(path) -> { name = {dtype=, shape=, data_offsets=} }, metadata:
-- what load() would read, without reading any data.
function S.header(path)
  local entries, metadata = read_header(path)
  local r = {}
  for _, e in ipairs(entries) do
    r[e.name] = { dtype = e.dtype, shape = e.shape, data_offsets = { e.begin, e.finish } }
  end
  return r, metadata
end

local function u64le(n)
  local b = {}
  for i = 1, 8 do
    b[i] = string.char(n % 256)
    n = math.floor(n / 256)
  end
  return table.concat(b)
end

-- the file's first bytes (the 8-byte length and the padded JSON header)
-- for entries { name =, shape =, dtype = } laid out in their order, the
-- metadata's keys in meta_keys' order
local function head_of(entries, metadata, meta_keys)
  local q = json.quotestring
  local parts, offset = {}, 0
  if #meta_keys > 0 then
    local kv = {}
    for i, k in ipairs(meta_keys) do kv[i] = q(k) .. ':' .. q(metadata[k]) end
    parts[#parts + 1] = '"__metadata__":{' .. table.concat(kv, ',') .. '}'
  end
  for _, e in ipairs(entries) do
    local numel = 1
    local dims = {}
    for i, d in ipairs(e.shape) do dims[i] = ('%d'):format(d); numel = numel * d end
    local nbytes = numel * dtype_size[e.dtype]
    parts[#parts + 1] = ('%s:{"dtype":"%s","shape":[%s],"data_offsets":[%.0f,%.0f]}'):format(
      q(e.name), to_code[e.dtype], table.concat(dims, ','), offset, offset + nbytes)
    offset = offset + nbytes
  end
  local header = '{' .. table.concat(parts, ',') .. '}'
  header = header .. (' '):rep((8 - #header % 8) % 8)
  return u64le(#header) .. header
end

-- plan(path, tbl, metadata, what) -> names (sorted), head: the checks
-- save() makes before touching the disk, and the file's first bytes (the
-- 8-byte length and the padded JSON header)
local function plan(path, tbl, metadata, what)
  if type(path) ~= 'string' then error(('safetensors: %s: expected a file path, got %s'):format(what, type(path)), 3) end
  if type(tbl) ~= 'table' then
    error(('safetensors: %s %s: expected a table of name -> tensor, got %s'):format(what, path, type(tbl)), 3)
  end
  local names = {}
  for name, t in pairs(tbl) do
    if type(name) ~= 'string' then
      error(('safetensors: %s %s: tensor names must be strings, got %s %s'):format(what, path, type(name), tostring(name)), 3)
    end
    if name == '__metadata__' then error(('safetensors: %s %s: "__metadata__" is reserved'):format(what, path), 3) end
    if not T.is_tensor(t) then
      error(('safetensors: %s %s: value for %q is a %s, expected a tensor'):format(what, path, name, type(t)), 3)
    end
    if t.storage == nil then error(('safetensors: %s %s: tensor %q was freed'):format(what, path, name), 3) end
    if C.ms_tensor_check_live(t, 'save') ~= 0 then   -- no data (deferred, released): before anything is written
      error(('safetensors: %s %s: tensor %q: %s'):format(what, path, name, ffi.string(C.ms_last_error())), 3)
    end
    names[#names + 1] = name
  end
  table.sort(names)
  local meta_keys = {}
  if metadata ~= nil then
    if type(metadata) ~= 'table' then
      error(('safetensors: %s %s: metadata must be a table of string -> string, got %s'):format(what, path,
        type(metadata)), 3)
    end
    for k, v in pairs(metadata) do
      if type(k) ~= 'string' or type(v) ~= 'string' then
        -- save(path, m:state_dict()) passes state_dict's second result (its
        -- names, a list) on as the metadata
        local names_list = type(k) == 'number' and type(v) == 'string' and tbl[v] ~= nil
        error(('safetensors: %s %s: metadata must map strings to strings, got %s %s -> %s %s%s'):format(
          what, path, type(k), tostring(k), type(v), tostring(v), names_list and
            ' (a list of the tensors\' names: state_dict()\'s second result? save(path, (m:state_dict())) '
            .. 'passes the table alone)' or ''), 3)
      end
      meta_keys[#meta_keys + 1] = k
    end
    table.sort(meta_keys)
  end

  local entries = {}
  for i, name in ipairs(names) do entries[i] = { name = name, shape = tbl[name].shape, dtype = tbl[name].dtype } end
  return names, head_of(entries, metadata, meta_keys)
end

-- save(path, { name = tensor }, metadata)
--   metadata: nil or a table of string -> string
function S.save(path, tbl, metadata)
  local names, head = plan(path, tbl, metadata, 'save')

  -- data, into path.tmp, then rename
  local tmp = path .. '.tmp'
  local f, err = io.open(tmp, 'wb')
  if not f then error(('safetensors: save %s: cannot open %s for writing: %s'):format(path, tmp, tostring(err)), 2) end
  local function write(s)
    local ok, werr = f:write(s)
    if not ok then error(('cannot write %s: %s'):format(tmp, tostring(werr)), 0) end
  end
  local ok, perr = pcall(function()
    write(head)
    local chunk = S.write_chunk_bytes
    for _, name in ipairs(names) do
      local t = tbl[name]
      -- a contiguous CPU copy when t is a view or lives on a GPU
      local h, copied = t, false
      if not h:is_contiguous() then h, copied = h:clone(), true end
      if h.device_id >= 0 then
        local c = h:to({ device = 'cpu' })
        if copied then h:free() end
        h, copied = c, true
      end
      local nbytes = h:numel() * dtype_size[h.dtype]
      local p = ffi.cast('const char *', C.ms_tensor_data(h))
      for off = 0, nbytes - 1, chunk do
        write(ffi.string(p + off, math.min(chunk, nbytes - off)))
      end
      if copied then h:free() end
    end
    local cok, cerr = f:close()
    f = nil
    if not cok then error(('cannot close %s: %s'):format(tmp, tostring(cerr)), 0) end
    local rok, rerr = os.rename(tmp, path)
    if not rok then error(('cannot rename %s to %s: %s'):format(tmp, path, tostring(rerr)), 0) end
  end)
  if not ok then
    if f then f:close() end
    os.remove(tmp)
    error(('safetensors: save %s: %s'):format(path, tostring(perr)), 2)
  end
  return true
end

-- the contiguous host copy of t in stage (a table of reusable host
-- tensors, keyed by `key`): made, or reused when its dtype and shape match;
-- page-locked when t is on a GPU (fast copies: ms.cuda.pinned_empty)
local function staged(writer, stage, key, t)
  local e = stage[key]
  -- a file still being written from this buffer (an earlier save not
  -- finished) is waited for first; its outcome is the writer's next wait's
  if e and e.job then
    C.ms_writer_wait_written(writer, e.job, 2 ^ 30)
    e.job = nil
  end
  local pinned = t.device_id >= 0
  local same = e and e.t.dtype == t.dtype and e.pinned == pinned and e.t:numel() == t:numel()
  if e and not same then
    e.t:free()
    stage[key] = nil
    e = nil
  end
  if not e then
    local h = pinned and require('moonshard.cuda').pinned_empty({ t:numel() }, t.dtype)
      or T.empty({ t:numel() }, { dtype = t.dtype })
    e = { t = h, pinned = pinned }
    stage[key] = e
  end
  e.t:view(t.shape):copy_(t)
  return e.t
end

-- write_async(writer, path, { name = tensor }, metadata, stage) -> job, held
--   queues the file on writer (a ms_writer *: core/io/writer.h); job is its
--   number there. With stage (a table the caller keeps between calls),
--   every tensor is first copied into a host tensor of it: the caller may
--   change its tensors at once. Without, contiguous CPU tensors are written
--   from their own memory and must stay unchanged until the job is done;
--   the others (views, GPU tensors) are copied one at a time while the
--   writer's thread writes the ones before, at most S.stream_bytes of
--   copies held at once beyond the one being made. `held` lists the host
--   tensors the job still reads: keep them until it is done, then free the
--   ones in held.owned.
S.stream_bytes = 256 * 2 ^ 20
-- hands host copy h to the writer as piece i of its job and keeps it in
-- q ({ list =, bytes = }); the oldest copies are freed once written while
-- more than S.stream_bytes are held beyond the newest. False when a write
-- failed (the writer's next wait reports it; q keeps what is unwritten).
local function provide(q, writer, job, i, h, nbytes)
  q.list[#q.list + 1] = { i = i, h = h, bytes = nbytes }
  q.bytes = q.bytes + nbytes
  T.check(C.ms_writer_provide(writer, job, i - 1, C.ms_tensor_data(h)), 3)
  while #q.list > 1 and q.bytes - q.list[#q.list].bytes > S.stream_bytes do
    local first = q.list[1]
    if C.ms_writer_wait_written(writer, job, first.i) < 0 then return false end
    table.remove(q.list, 1)
    first.h:free()
    q.bytes = q.bytes - first.bytes
  end
  return true
end
function S.write_async(writer, path, tbl, metadata, stage)
  local names, head = plan(path, tbl, metadata, 'write')
  local n = #names
  local ptrs, bytes = ffi.new('const void *[?]', math.max(n, 1)), ffi.new('int64_t[?]', math.max(n, 1))
  local held, later, keys = {}, {}, {}
  local base = path:match('([^/]*)$')
  for i, name in ipairs(names) do
    local t = tbl[name]
    bytes[i - 1] = t:numel() * dtype_size[t.dtype]
    if stage then
      local key = base .. '\0' .. name
      local h = staged(writer, stage, key, t)
      held[#held + 1] = h
      keys[#keys + 1] = key   -- (the entry is this job's until it is written)
      ptrs[i - 1] = C.ms_tensor_data(h)
    elseif t.device_id < 0 and t:is_contiguous() then
      held[#held + 1] = t
      ptrs[i - 1] = C.ms_tensor_data(t)
    else
      ptrs[i - 1] = nil   -- (provided once copied, below)
      if bytes[i - 1] > 0 then later[#later + 1] = i else ptrs[i - 1] = C.ms_tensor_data(t) end
    end
  end
  local job = C.ms_writer_submit(writer, path, head, #head, n, ptrs, bytes)
  if job < 0 then error(('safetensors: write %s: %s'):format(path, ffi.string(C.ms_last_error())), 2) end
  if stage then
    for _, key in ipairs(keys) do stage[key].job = job end
    return job, held
  end
  if #later == 0 then return job, held end
  -- the copies, streamed: each provided as soon as it is made; the oldest
  -- freed once written while more than S.stream_bytes are held
  local q = { list = {}, bytes = 0 }
  local ok, err = pcall(function()
    for _, i in ipairs(later) do
      local t = tbl[names[i]]
      local h, copied = t, false
      if not h:is_contiguous() then h, copied = h:clone(), true end
      if h.device_id >= 0 then
        local c = h:to({ device = 'cpu' })
        if copied then h:free() end
        h = c
      end
      -- (a failed write: the writer's wait reports it)
      if not provide(q, writer, job, i, h, tonumber(bytes[i - 1])) then return end
    end
  end)
  if not ok then
    -- the thread must not wait for a piece that will never come, nor read a
    -- copy after it is freed: the job fails, and is waited for
    C.ms_writer_cancel(writer, job, tostring(err))
    C.ms_writer_wait(writer)
    for _, f in ipairs(q.list) do f.h:free() end
    error(('safetensors: write %s: %s'):format(path, tostring(err)), 2)
  end
  held.owned = {}
  for _, f in ipairs(q.list) do
    held[#held + 1] = f.h
    held.owned[#held.owned + 1] = f.h
  end
  return job, held
end

-- stream(path, entries, metadata) -> a file written as its tensors come:
-- entries { name =, shape =, dtype = } in file order (the header is
-- written first, so every shape is known up front); st:put(h) gives the
-- next entry's data, h a contiguous host tensor of its dtype and element
-- count, which the stream then owns (freed once written: at most
-- S.stream_bytes of them held beyond the newest); st:finish() -> path
-- (waits for the writer's thread, then renames path.tmp into place);
-- st:cancel(why) drops the file. What a sharded model's full save writes
-- one unit at a time (fsdp_checkpoint.save_full), holding one unit's
-- tensors instead of the model's.
local Stream = {}
Stream.__index = Stream
function S.stream(path, entries, metadata)
  if type(path) ~= 'string' then error(('safetensors: stream: expected a file path, got %s'):format(type(path)), 2) end
  local seen, meta_keys = {}, {}
  for i, e in ipairs(entries) do
    if type(e.name) ~= 'string' or e.name == '__metadata__' or seen[e.name] then
      error(('safetensors: stream %s: entry %d has a bad or repeated name %s'):format(path, i, tostring(e.name)), 2)
    end
    if not dtype_size[e.dtype] or not to_code[e.dtype] then
      error(('safetensors: stream %s: %s has dtype %s, which safetensors files do not hold'):format(path, e.name,
        tostring(e.dtype)), 2)
    end
    seen[e.name] = true
  end
  for k in pairs(metadata or {}) do meta_keys[#meta_keys + 1] = k end
  table.sort(meta_keys)
  local head = head_of(entries, metadata, meta_keys)
  local n = #entries
  local ptrs, bytes = ffi.new('const void *[?]', math.max(n, 1)), ffi.new('int64_t[?]', math.max(n, 1))
  local numels = {}
  for i, e in ipairs(entries) do
    local numel = 1
    for _, d in ipairs(e.shape) do numel = numel * d end
    numels[i] = numel
    bytes[i - 1] = numel * dtype_size[e.dtype]
    ptrs[i - 1] = nil
  end
  local box = ffi.new('ms_writer *[1]')
  T.check(C.ms_writer_new(box), 2)
  local w = ffi.gc(box[0], C.ms_writer_free)
  local tmp = path .. '.tmp'
  local job = C.ms_writer_submit(w, tmp, head, #head, n, ptrs, bytes)
  if job < 0 then error(('safetensors: stream %s: %s'):format(path, ffi.string(C.ms_last_error())), 2) end
  return setmetatable({ path = path, tmp = tmp, entries = entries, numels = numels, bytes = bytes, w = w, job = job,
    next = 1, held = { list = {}, bytes = 0 } }, Stream)
end

function Stream:put(h)
  local i = self.next
  local e = self.entries[i]
  if e == nil then error(('safetensors: stream %s: more tensors than its %d entries'):format(self.path, #self.entries), 2) end
  if not T.is_tensor(h) or h.device_id >= 0 or not h:is_contiguous() or h.dtype ~= e.dtype or h:numel() ~= self.numels[i] then
    local why = ('safetensors: stream %s: %s wants a contiguous host tensor of %s, %d elements; got %s'):format(
      self.path, e.name, e.dtype, self.numels[i], T.is_tensor(h) and ('%s %s, %d elements'):format(h.device, h.dtype,
      h:numel()) or type(h))
    self:cancel(why)
    error(why, 2)
  end
  self.next = i + 1
  if not provide(self.held, self.w, self.job, i, h, tonumber(self.bytes[i - 1])) then
    local why = ffi.string(C.ms_last_error())
    self:cancel(why)
    error(('safetensors: stream %s: %s'):format(self.path, why), 2)
  end
end

local function close_stream(st)
  for _, f in ipairs(st.held.list) do f.h:free() end
  st.held = { list = {}, bytes = 0 }
  C.ms_writer_free(ffi.gc(st.w, nil))
  st.w = nil
end

function Stream:finish()
  if self.w == nil then error(('safetensors: stream %s: already finished or cancelled'):format(self.path), 2) end
  if self.next <= #self.entries then
    local why = ('%d of %d tensors given'):format(self.next - 1, #self.entries)
    self:cancel(why)
    error(('safetensors: stream %s: finished with %s'):format(self.path, why), 2)
  end
  local rc = C.ms_writer_wait(self.w)
  local why = rc ~= 0 and ffi.string(C.ms_last_error()) or nil
  close_stream(self)
  if why then
    os.remove(self.tmp)
    error(('safetensors: stream %s: %s'):format(self.path, why), 2)
  end
  local ok, err = os.rename(self.tmp, self.path)
  if not ok then error(('safetensors: stream %s: cannot rename %s: %s'):format(self.path, self.tmp, tostring(err)), 2) end
  return self.path
end

function Stream:cancel(why)
  if self.w == nil then return end
  C.ms_writer_cancel(self.w, self.job, tostring(why or 'cancelled'))
  C.ms_writer_wait(self.w)
  close_stream(self)
  os.remove(self.tmp)
end

return S
