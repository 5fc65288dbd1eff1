-- models/hf.lua — the plumbing the model files share: Hugging Face style
-- configs (defaults, presets, validation), from_pretrained / save_pretrained,
-- input checks and sampling. The architectures themselves live in
-- models/gpt2.lua and models/llama.lua; this file knows nothing about them.
--
--   local hf = require 'models.hf'
--   local cfg = hf.config(gpt2, 'tiny', { n_layer = 2 })   -- defaults < preset < overrides
--   local model = hf.from_pretrained(gpt2, 'path/to/dir')
--   hf.save_pretrained(model, 'out/dir')
--
-- A model file describes its config as a list of fields,
--   { name, type, default, help }
-- where type is one of 'int>0', 'int>=0', 'number>0', 'number>=0', 'prob'
-- (0 <= p < 1), 'bool', 'string', 'table', 'ids' (a token id or a list of
-- them, as HF's eos_token_id), or a list of allowed values; a
-- trailing '?' (or a list with optional = true) lets the field be nil (JSON null).
local json = require 'dkjson'
local ms = require 'moonshard'
local T = require 'moonshard.tensor'

local hf = {}
hf.null = json.null

-- ---------------------------------------------------------------- configs
local function deepcopy(v)
  if type(v) ~= 'table' or v == json.null then return v end
  local r = {}
  for k, x in pairs(v) do r[k] = deepcopy(x) end
  return r
end
hf.deepcopy = deepcopy

-- defaults table of a field list
function hf.defaults(fields)
  local d = {}
  for _, f in ipairs(fields) do d[f[1]] = deepcopy(f[3]) end
  return d
end

local function describe(v)
  if type(v) == 'string' then return ("'%s' (a string)"):format(v) end
  if type(v) == 'number' then return ('%s (a number)'):format(tostring(v)) end
  return ('%s (a %s)'):format(tostring(v), type(v))
end

local type_words = {
  ['int>0'] = 'a positive integer', ['int>=0'] = 'a non-negative integer',
  ['number>0'] = 'a positive number', ['number>=0'] = 'a non-negative number',
  prob = 'a number in [0, 1)', bool = 'a boolean', string = 'a string', table = 'a table (JSON object)',
  ids = 'a token id or a list of token ids',
}

local function is_int(v) return type(v) == 'number' and v == math.floor(v) and v > -2 ^ 53 and v < 2 ^ 53 end

-- returns nil when v fits ty, else the phrase for what was expected
local function mismatch(ty, v)
  if type(ty) == 'table' then
    for _, s in ipairs(ty) do if v == s then return nil end end
    local q = {}
    for i, s in ipairs(ty) do q[i] = type(s) == 'string' and ("'" .. s .. "'") or tostring(s) end
    return 'one of ' .. table.concat(q, ', ')
  end
  local ok
  if ty == 'int>0' then ok = is_int(v) and v > 0
  elseif ty == 'int>=0' then ok = is_int(v) and v >= 0
  elseif ty == 'number>0' then ok = type(v) == 'number' and v > 0 and v < math.huge
  elseif ty == 'number>=0' then ok = type(v) == 'number' and v >= 0 and v < math.huge
  elseif ty == 'prob' then ok = type(v) == 'number' and v >= 0 and v < 1
  elseif ty == 'bool' then ok = type(v) == 'boolean'
  elseif ty == 'string' then ok = type(v) == 'string'
  elseif ty == 'table' then ok = type(v) == 'table'
  elseif ty == 'ids' then
    ok = (is_int(v) and v >= 0) or type(v) == 'table'
    if type(v) == 'table' then
      for k, x in pairs(v) do
        if type(k) ~= 'number' or not is_int(x) or x < 0 then ok = false end
      end
    end
  else error('hf: unknown field type ' .. tostring(ty)) end
  if ok then return nil end
  return type_words[ty]
end

local function edit_distance(a, b)
  local prev = {}
  for j = 0, #b do prev[j] = j end
  for i = 1, #a do
    local cur = { [0] = i }
    for j = 1, #b do
      local cost = a:byte(i) == b:byte(j) and 0 or 1
      cur[j] = math.min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + cost)
    end
    prev = cur
  end
  return prev[#b]
end

-- Checks every declared field of cfg (raising "<name> config: <field> must
-- be ..., got ..."). With opts.typos, an undeclared field whose name is within
-- two edits of a declared one is an error too (a likely misspelling); other
-- undeclared fields (bos_token_id, architectures, ...) are kept as they are.
function hf.validate(fields, cfg, name, opts)
  if type(cfg) ~= 'table' then
    error(('%s config: expected a table, got %s'):format(name, describe(cfg)), 3)
  end
  local known = {}
  for _, f in ipairs(fields) do
    local fname, ty = f[1], f[2]
    known[fname] = true
    local v = cfg[fname]
    local optional = false
    if type(ty) == 'string' and ty:sub(-1) == '?' then ty, optional = ty:sub(1, -2), true end
    if type(ty) == 'table' and ty.optional then optional = true end
    if v == nil or v == json.null then
      if not optional then error(('%s config: %s is missing (%s expected)'):format(name, fname, type_words[ty] or 'a value'), 3) end
      cfg[fname] = nil
    else
      local want = mismatch(ty, v)
      if want then
        error(('%s config: %s must be %s, got %s'):format(name, fname, want, describe(v)), 3)
      end
    end
  end
  if opts and opts.typos then
    for k in pairs(cfg) do
      if type(k) ~= 'string' then
        error(('%s config: field names must be strings, got %s'):format(name, describe(k)), 3)
      end
      if not known[k] then
        for kn in pairs(known) do
          if #k >= 4 and edit_distance(k, kn) <= 2 then
            error(('%s config: unknown field %s (did you mean %s?)'):format(name, k, kn), 3)
          end
        end
      end
    end
  end
  return cfg
end

-- hf.config(M, preset, overrides): M.config defaults, then the preset (a
-- name in M.presets or a table), then overrides; then M.normalize (if any)
-- and validation against M.fields. Returns a fresh table.
function hf.config(M, preset, overrides, opts, more)
  local cfg = deepcopy(M.config)
  if preset ~= nil then
    local p = preset
    if type(preset) == 'string' then
      p = M.presets[preset]
      if not p then
        local names = {}
        for k in pairs(M.presets) do names[#names + 1] = k end
        table.sort(names)
        error(('%s: unknown preset %s (presets: %s)'):format(M.name, preset, table.concat(names, ', ')), 2)
      end
    elseif type(preset) ~= 'table' then
      error(('%s: preset must be a name or a table, got %s'):format(M.name, describe(preset)), 2)
    end
    for k, v in pairs(p) do cfg[k] = deepcopy(v) end
  end
  if overrides ~= nil then
    if type(overrides) ~= 'table' then
      error(('%s config: expected a table, got %s'):format(M.name, describe(overrides)), 2)
    end
    for k, v in pairs(overrides) do cfg[k] = deepcopy(v) end
  end
  if more ~= nil then
    if type(more) ~= 'table' then
      error(('%s config: overrides must be a table, got %s'):format(M.name, describe(more)), 2)
    end
    for k, v in pairs(more) do cfg[k] = deepcopy(v) end
  end
  if M.normalize then M.normalize(cfg) end
  hf.validate(M.fields, cfg, M.name, { typos = not (opts and opts.from_json) })
  if M.check then M.check(cfg) end
  return cfg
end

-- --------------------------------------------------------------- json io
function hf.read_json(path)
  local f, err = io.open(path, 'rb')
  if not f then return nil, ('cannot open %s: %s'):format(path, tostring(err)) end
  local s = f:read('*a')
  f:close()
  local obj, _, jerr = json.decode(s, 1, nil)
  if type(obj) ~= 'table' then
    return nil, ('%s is not a JSON object%s'):format(path, jerr and (': ' .. jerr) or '')
  end
  return obj
end

-- JSON as transformers writes config.json: sorted keys, two-space indent,
-- "key": value. Numbers print in their shortest round-trip form; fields
-- that are floats in Python (float_keys) keep a decimal point (10000.0), so
-- Python reads them back as floats.
hf.float_keys = {
  rope_theta = true, rms_norm_eps = true, layer_norm_epsilon = true, initializer_range = true,
  resid_pdrop = true, embd_pdrop = true, attn_pdrop = true, attention_dropout = true,
  summary_first_dropout = true, routed_scaling_factor = true, factor = true, beta_fast = true, beta_slow = true,
  mscale = true, mscale_all_dim = true, low_freq_factor = true, high_freq_factor = true,
  router_aux_loss_coef = true, router_jitter_noise = true, attn_scale = true, aux_loss_alpha = true,
}
local function json_number(v, float)
  if v ~= v or v == math.huge or v == -math.huge then
    error('hf: cannot write ' .. tostring(v) .. ' to JSON', 4)
  end
  local s
  if v == math.floor(v) and math.abs(v) < 1e15 then
    s = ('%d'):format(v)
  else
    for prec = 15, 17 do
      s = ('%.' .. prec .. 'g'):format(v)
      if tonumber(s) == v then break end
    end
  end
  if float and not s:find('[%.eEn]') then s = s .. '.0' end
  return s
end

function hf.encode_json(v, indent, key)
  indent = indent or ''
  if v == nil or v == json.null then return 'null' end
  local t = type(v)
  if t == 'boolean' then return tostring(v) end
  if t == 'number' then return json_number(v, hf.float_keys[key]) end
  if t == 'string' then return json.encode(v) end
  if t ~= 'table' then error('hf: cannot write a ' .. t .. ' to JSON', 3) end
  local inner = indent .. '  '
  if #v > 0 or next(v) == nil then
    if next(v) == nil then return '{}' end
    local items = {}
    for i = 1, #v do items[i] = inner .. hf.encode_json(v[i], inner, key) end
    return '[\n' .. table.concat(items, ',\n') .. '\n' .. indent .. ']'
  end
  local keys = {}
  for k in pairs(v) do keys[#keys + 1] = tostring(k) end
  table.sort(keys)
  local items = {}
  for i, k in ipairs(keys) do
    items[i] = inner .. json.encode(k) .. ': ' .. hf.encode_json(v[k], inner, k)
  end
  return '{\n' .. table.concat(items, ',\n') .. '\n' .. indent .. '}'
end

-- writes obj as JSON to path (through a temporary file and a rename)
function hf.write_json(path, obj)
  local s = hf.encode_json(obj)
  local tmp = path .. '.tmp'
  local f, err = io.open(tmp, 'wb')
  if not f then error(('cannot write %s: %s'):format(tmp, tostring(err)), 2) end
  f:write(s, '\n')
  f:close()
  local ok, rerr = os.rename(tmp, path)
  if not ok then error(('cannot rename %s to %s: %s'):format(tmp, path, tostring(rerr)), 2) end
end

local function shell_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
function hf.mkdir_p(dir)
  local ok = os.execute('mkdir -p ' .. shell_quote(dir))
  if ok ~= 0 and ok ~= true then error(('cannot create folder %s'):format(dir), 2) end
end

-- -------------------------------------------------------- pretrained io
-- hf.read_checkpoint(dir, opts) -> { name = tensor }, what: the tensors of
-- a transformers checkpoint folder, dir/model.safetensors or, when there is
-- none, the shards dir/model.safetensors.index.json names (its weight_map:
-- tensor name -> file, as save_pretrained writes a large model: model-00001-
-- of-00004.safetensors ...), every tensor of every shard. A tensor the
-- index places in a shard that lacks it, one in two shards, or a shard
-- name with a path in it is an error naming the files. `what` names what
-- was read (for messages). opts.deferred: deferred tensors (records of the
-- files' bytes, read when materialised or sharded), not data.
function hf.read_checkpoint(dir, opts)
  opts = opts or {}
  local st = require 'moonshard.safetensors'
  local load = opts.deferred and st.load_deferred or st.load
  local function exists(path)
    local fh = io.open(path, 'rb')
    if fh then fh:close() end
    return fh ~= nil
  end
  local single, index = dir .. '/model.safetensors', dir .. '/model.safetensors.index.json'
  if exists(single) then return (load(single)), single end
  if not exists(index) then
    error(('%s: neither model.safetensors nor model.safetensors.index.json (a sharded checkpoint) found'):format(dir), 0)
  end
  local j, err = hf.read_json(index)
  if not j then error(err, 0) end
  local wm = j.weight_map
  if type(wm) ~= 'table' or next(wm) == nil then
    error(('%s: no weight_map (tensor name -> shard file) in it'):format(index), 0)
  end
  local files, seen = {}, {}
  for name, f in pairs(wm) do
    if type(f) ~= 'string' or f == '' or f:find('/', 1, true) or f:find('\\', 1, true) or f == '..' then
      error(('%s: weight_map[%s] = %s is not a file name in the folder'):format(index, tostring(name), tostring(f)), 0)
    end
    if not seen[f] then seen[f] = true; files[#files + 1] = f end
  end
  table.sort(files)
  local sd, from = {}, {}
  for _, f in ipairs(files) do
    local path = dir .. '/' .. f
    if not exists(path) then error(('%s: shard %s, named by %s, not found'):format(dir, f, index), 0) end
    for name, t in pairs(load(path)) do
      if from[name] then
        error(('%s: tensor %s is in two shards, %s and %s'):format(dir, name, from[name], f), 0)
      end
      sd[name], from[name] = t, f
    end
  end
  for name, f in pairs(wm) do
    if from[name] ~= f then
      error(('%s: %s places %s in %s, which does not hold it'):format(dir, index, name, f), 0)
    end
  end
  return sd, ('%s (%d shards)'):format(index, #files)
end

-- hf.from_pretrained(M, dir, opts): dir/config.json -> M.new(config), then
-- the weights (dir/model.safetensors, or the shards of a sharded checkpoint:
-- hf.read_checkpoint) loaded strictly (missing, unexpected and mis-shaped
-- keys all reported). M.fix_state_dict(sd, config), when present, maps
-- names of older checkpoints onto the current ones first.
-- opts.dtype converts the model after loading.
function hf.from_pretrained(M, dir, opts)
  opts = opts or {}
  if type(dir) ~= 'string' then error(('%s.from_pretrained: expected a folder path, got %s'):format(M.name, describe(dir)), 3) end
  -- (opts.config: the config table itself, read by the caller from the
  -- folder's config.json: Llama 4's text_config inside a multimodal one)
  local raw, err
  if opts.config ~= nil then raw = deepcopy(opts.config) else raw, err = hf.read_json(dir .. '/config.json') end
  if not raw then error(('%s.from_pretrained: %s'):format(M.name, err), 3) end
  if raw.model_type and M.model_type and raw.model_type ~= M.model_type then
    error(('%s.from_pretrained: %s/config.json has model_type %s, expected %s'):format(
      M.name, dir, tostring(raw.model_type), M.model_type), 3)
  end
  local cfg = hf.config(M, nil, raw, { from_json = true })
  -- opts.deferred: the model built under nn.deferred_init with the file's
  -- tensors as records (read when materialized, or by fully_shard: each
  -- rank reads only its shards' bytes)
  local model = opts.deferred and ms.nn.deferred_init(M.build, cfg) or M.build(cfg)
  local okr, sd, path = pcall(hf.read_checkpoint, dir, { deferred = opts.deferred })
  if not okr then error(('%s.from_pretrained: %s'):format(M.name, tostring(sd)), 3) end
  if M.fix_state_dict then sd = M.fix_state_dict(sd, cfg) end
  -- (M.prepare(model, sd): what the file has beyond the config's model, a
  -- Mixtral's routing biases say)
  if M.prepare then M.prepare(model, sd) end
  local ok, lerr = pcall(model.load_state_dict, model, sd, { strict = true })
  if not ok then error(('%s.from_pretrained: %s: %s'):format(M.name, path, tostring(lerr)), 3) end
  if opts.dtype then model:to(opts.dtype) end
  return model
end

-- Writes dir/config.json and dir/model.safetensors (f32 unless opts.dtype,
-- names as in HF checkpoints, tied weights once, metadata format = pt) so
-- that transformers' from_pretrained reads them back.
function hf.save_pretrained(model, dir, opts)
  opts = opts or {}
  local M = model.family
  hf.mkdir_p(dir)
  local cfg = deepcopy(model.config)
  if M.export_config then cfg = M.export_config(cfg) end
  local dtype = opts.dtype or 'f32'
  -- transformers 5 reads `dtype` (and warns about the older `torch_dtype`)
  cfg.torch_dtype = nil
  cfg.dtype = ({ f32 = 'float32', bf16 = 'bfloat16', f16 = 'float16', f64 = 'float64' })[dtype]
  hf.write_json(dir .. '/config.json', cfg)
  local out = {}
  local sd, made = model:state_dict(), {}
  -- LoRA adapters merged into their weights: a plain model's folder
  if ms.nn.is_module(model) and ms.nn.has_lora(model) then sd, made = ms.nn.lora_merged(model, sd) end
  -- (M.export_state_dict(sd, config): the model's names and layouts to the
  -- checkpoints', where they differ: Llama 4's fused experts)
  if M.export_state_dict then sd = M.export_state_dict(sd, model.config) end
  for name, t in pairs(sd) do
    out[name] = t:to({ dtype = dtype, device = 'cpu', copy = true }):contiguous()
  end
  for _, t in ipairs(made) do t:free() end
  ms.save_safetensors(dir .. '/model.safetensors', out, { format = 'pt' })
  return dir
end

-- hf.export_file(M, path, config): a safetensors file in the model's own
-- names and layouts (fsdp_checkpoint.save_full's, streamed from the
-- ranks) rewritten in the checkpoints' (M.export_state_dict: Llama 4's
-- fused experts), one tensor at a time: the file read deferred, each
-- tensor of the new one made when the stream takes it, the new file
-- renamed over the old. Nothing to do without M.export_state_dict, or when
-- it returns the table it was given (DeepSeek-V3 without MTP layers).
function hf.export_file(M, path, config)
  if not M.export_state_dict then return path end
  local st = require 'moonshard.safetensors'
  local src = st.load_deferred(path)
  local sd = M.export_state_dict(src, config)
  if sd == src then return path end   -- (the same names and layouts: the file as it is)
  local names = {}
  for name in pairs(sd) do names[#names + 1] = name end
  table.sort(names)
  local entries = {}
  for i, name in ipairs(names) do entries[i] = { name = name, shape = sd[name].shape, dtype = sd[name].dtype } end
  local out = st.stream(path, entries, { format = 'pt' })
  for _, name in ipairs(names) do
    local t = sd[name]
    local h = T.empty(t.shape, { dtype = t.dtype })
    if T.is_deferred(t) then T.replay(t, h) else h:copy_(t) end
    out:put(h)
  end
  return out:finish()
end

-- ----------------------------------------------------------------- inputs
-- Checks a (B, T) integer tensor of token ids (a Lua list or a nested list is
-- converted) against the vocabulary and the longest sequence. Returns the
-- ids tensor, B and T.
function hf.check_ids(ids, name, what, vocab, max_len, level)
  level = (level or 2) + 1
  if type(ids) == 'table' then
    if type(ids[1]) ~= 'table' then ids = { ids } end
    ids = ms.tensor(ids, { dtype = 'i64' })
  end
  if not T.is_tensor(ids) then
    error(('%s: %s must be a (B, T) integer tensor, got %s'):format(name, what, describe(ids)), level)
  end
  if ids.ndim ~= 2 or (ids.dtype ~= 'i64' and ids.dtype ~= 'i32') then
    error(('%s: %s must be a (B, T) tensor of i64 or i32 token ids, got shape (%s) %s'):format(
      name, what, table.concat(ids.shape, ', '), ids.dtype), level)
  end
  local B, Tn = ids.shape[1], ids.shape[2]
  if B == 0 or Tn == 0 then error(('%s: %s is empty (shape (%d, %d))'):format(name, what, B, Tn), level) end
  if max_len and Tn > max_len then
    error(('%s: sequence length %d exceeds the model\'s %d positions'):format(name, Tn, max_len), level)
  end
  -- on the GPU the embedding kernel checks every id (a device flag raised at
  -- the next sync point): reading max/min here would sync every forward
  if vocab and ids.device_id < 0 then
    local th, tl = ms.max(ids), ms.min(ids)
    local hi, lo = th:item(), tl:item()
    th:free(); tl:free()
    if hi >= vocab or lo < 0 then
      local bad = hi >= vocab and hi or lo
      error(('%s: %s holds token id %d, outside the vocabulary [0, %d)'):format(name, what, bad, vocab), level)
    end
  end
  return ids, B, Tn
end

-- targets: (B, T) integers, each in [0, vocab) or ignore_index (-100)
function hf.check_targets(targets, B, Tn, name, vocab, level)
  level = (level or 2) + 1
  targets = hf.check_ids(targets, name, 'targets', nil, nil, level)
  if targets.shape[1] ~= B or targets.shape[2] ~= Tn then
    error(('%s: targets have shape (%s), expected (%d, %d) like input_ids'):format(
      name, table.concat(targets.shape, ', '), B, Tn), level)
  end
  return targets
end

-- ---------------------------------------------------------------- sampling
-- hf.generate(model, ids, n, { temperature = 1, top_k = nil, seed = 0 })
-- appends n sampled tokens to ids ((B, T) tensor or a Lua list) and returns
-- the (B, T + n) i64 tensor. temperature 0 is greedy. The context is cropped
-- to the model's positions. Sampling draws from ms.rand with an explicit
-- seed, so it leaves the global generator alone and repeats for a seed.
function hf.generate(model, ids, n, opts)
  opts = opts or {}
  local name = model.family.name .. ':generate'
  local cfg = model.config
  local max_len = model:max_positions()
  local vocab = cfg.vocab_size
  ids = hf.check_ids(ids, name, 'ids', vocab, nil, 2)
  if type(n) ~= 'number' or n < 0 or n ~= math.floor(n) then
    error(('%s: n must be a non-negative integer, got %s'):format(name, describe(n)), 2)
  end
  local temperature = opts.temperature or 1
  local top_k = opts.top_k
  if type(temperature) ~= 'number' or temperature < 0 then
    error(('%s: temperature must be a number >= 0, got %s'):format(name, describe(temperature)), 2)
  end
  if top_k ~= nil and (not is_int(top_k) or top_k < 1) then
    error(('%s: top_k must be a positive integer, got %s'):format(name, describe(top_k)), 2)
  end
  local seed = opts.seed or 0
  local was_training = model.training
  model:eval()
  local rows = ids:to('i64'):totable()
  local B = #rows
  local device = 'cpu'  -- the model's: the context goes where its weights are
  for _, p in model:named_parameters() do device = p.device; break end
  local ok, err = pcall(ms.no_grad, function()
    for step = 1, n do
      local Tn = #rows[1]
      local start = math.max(1, Tn - max_len + 1)
      local ctx = {}
      for b = 1, B do
        local r = {}
        for t = start, Tn do r[#r + 1] = rows[b][t] end
        ctx[b] = r
      end
      local x = ms.tensor(ctx, { dtype = 'i64', device = device })
      local logits = model:last_logits(x) -- (B, V)
      local lt = logits:to('f64'):totable()
      local u = ms.rand({ B }, { seed = seed, offset = (step - 1) * B * 4, dtype = 'f64' }):totable()
      for b = 1, B do
        rows[b][#rows[b] + 1] = hf.sample(lt[b], temperature, top_k, u[b])
      end
    end
  end)
  if was_training then model:train() end
  if not ok then error(err, 0) end
  return ms.tensor(rows, { dtype = 'i64' })
end

-- one token id (0-based) from a list of logits, given a uniform u in [0, 1)
function hf.sample(logits, temperature, top_k, u)
  local V = #logits
  if temperature == 0 then
    local best, bi = -math.huge, 1
    for i = 1, V do if logits[i] > best then best, bi = logits[i], i end end
    return bi - 1
  end
  local cut = -math.huge
  if top_k and top_k < V then
    local sorted = {}
    for i = 1, V do sorted[i] = logits[i] end
    table.sort(sorted, function(a, b) return a > b end)
    cut = sorted[top_k]
  end
  local m = -math.huge
  for i = 1, V do if logits[i] > m then m = logits[i] end end
  local p, total = {}, 0
  for i = 1, V do
    local l = logits[i]
    local e = l >= cut and math.exp((l - m) / temperature) or 0
    p[i] = e
    total = total + e
  end
  local r = u * total
  local acc = 0
  for i = 1, V do
    acc = acc + p[i]
    if r < acc then return i - 1 end
  end
  for i = V, 1, -1 do if p[i] > 0 then return i - 1 end end
  return V - 1
end

return hf
