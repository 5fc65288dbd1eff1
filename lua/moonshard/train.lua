-- moonshard.train — the built-in training loop, used by `bin/train
-- models/<model>.lua` and reusable from scripts.
--
--   local train = require 'moonshard.train'
--   local summary = train.run{ model = 'models/gpt2.lua', preset = 'tiny', steps = 200 }
--   print(summary.final_loss, summary.out)
--
-- A run is described by one flat table of options (train.options lists
-- them, with types and defaults); model config fields ride along in
-- `model_config` (`--model.n_layer 2`, or `--n-layer 2` when the name is a
-- field of the model's config). Layers, lowest first: train.options
-- defaults, the model file's `train_defaults`, a run config file (--config),
-- then flags: each later layer overrides the earlier ones.
--
-- The loop: byte-level batches from moonshard.data, model(x, y) -> loss,
-- backward, clip, AdamW with linear warmup + cosine decay, a progress line
-- every log_every steps, validation every eval_every steps, one JSON line per
-- step in <out>/metrics.jsonl, the resolved run in <out>/run.json, the final
-- weights in <out>/ (config.json + model.safetensors, as save_pretrained
-- writes them) and a sample from the model at the end.
local ffi = require 'ffi'
local json = require 'dkjson'
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local data = require 'moonshard.data'

local train = {}

-- ---------------------------------------------------------------- options
-- { name, type, default, help }; type: 'int', 'int>0', 'int>=0', 'number',
-- 'number>=0', 'string', 'bool'; a trailing '?' allows nil.
train.options = {
  { 'model', 'string?', nil, 'model file (models/gpt2.lua) or module name (models.gpt2)' },
  { 'preset', 'string?', 'tiny', 'model preset (see the model file\'s presets)' },
  { 'config', 'string?', nil, 'a Lua file returning a table of these options' },
  { 'data', 'string?', nil, 'training text (bytes); default: the repository\'s own source and docs' },
  { 'val_fraction', 'number>=0', 0.1, 'share of the data held out for validation (the tail)' },
  { 'steps', 'int>0', 500, 'optimizer steps' },
  { 'batch_size', 'int>0', 16, 'sequences per step' },
  { 'seq_len', 'int>0', 128, 'tokens per sequence' },
  { 'lr', 'number>=0', 3e-3, 'peak learning rate' },
  { 'min_lr', 'number>=0?', nil, 'final learning rate of the cosine decay (default lr / 10)' },
  { 'warmup', 'int>=0', 30, 'linear warmup steps' },
  { 'weight_decay', 'number>=0', 0.1, 'AdamW decoupled weight decay (not on norms, biases, embeddings)' },
  { 'beta1', 'number>=0', 0.9, 'AdamW beta1' },
  { 'beta2', 'number>=0', 0.99, 'AdamW beta2' },
  { 'eps', 'number>=0', 1e-8, 'AdamW epsilon' },
  { 'grad_clip', 'number>=0', 1.0, 'clip the global gradient norm to this (0: off)' },
  { 'seed', 'int>=0', 1337, 'seed of the initialisation, the batches and the sample' },
  { 'dtype', 'string', 'f32', 'parameter and compute dtype: f32 or f64' },
  { 'threads', 'int>=0', 0, 'CPU threads (0: the library default)' },
  { 'out', 'string?', nil, 'output folder (default runs/<model>-<preset>-<time>)' },
  { 'log_every', 'int>0', 25, 'steps between progress lines' },
  { 'eval_every', 'int>=0', 100, 'steps between validations (0: only at the end)' },
  { 'eval_iters', 'int>0', 8, 'validation batches' },
  { 'save', 'bool', true, 'write the final weights (config.json + model.safetensors) to out' },
  { 'sample_tokens', 'int>=0', 256, 'tokens to sample at the end (0: no sample)' },
  { 'sample_prompt', 'string', '\n', 'prompt of the final sample' },
  { 'temperature', 'number>=0', 0.8, 'sampling temperature (0: greedy)' },
  { 'top_k', 'int>=0', 0, 'sample from the k most likely tokens (0: all)' },
  { 'quiet', 'bool', false, 'no progress lines' },
}
local option_by_name = {}
for _, o in ipairs(train.options) do option_by_name[o[1]] = o end
train.option_by_name = option_by_name

function train.defaults()
  local d = {}
  for _, o in ipairs(train.options) do d[o[1]] = o[3] end
  return d
end

-- Errors in what the user asked for (flags, options, files) are tables
-- {usage = true, msg = ...}; bin/train prints them without a traceback.
local UsageError = {}
UsageError.__index = UsageError
UsageError.__tostring = function(e) return e.msg end
train.UsageError = UsageError
local function usage(fmt, ...)
  error(setmetatable({ usage = true, msg = fmt:format(...) }, UsageError), 0)
end
train.usage = usage
function train.is_usage_error(e) return getmetatable(e) == UsageError end

local function describe(v)
  if type(v) == 'string' then return "'" .. v .. "'" end
  return tostring(v)
end

-- checks and converts one option value (strings from the command line are
-- parsed into the option's type); `where` names its origin in errors
local function coerce(ty, v, name, where)
  local optional = ty:sub(-1) == '?'
  if optional then ty = ty:sub(1, -2) end
  if v == nil then
    if optional then return nil end
    usage('%s: %s needs a value', where, name)
  end
  local base = ty:match('^(%a+)')
  if base == 'int' or base == 'number' then
    local n = type(v) == 'number' and v or (type(v) == 'string' and tonumber(v))
    if not n or n ~= n then usage('%s: %s expects a number, got %s', where, name, describe(v)) end
    if base == 'int' and n ~= math.floor(n) then usage('%s: %s expects an integer, got %s', where, name, describe(v)) end
    if ty:find('>=0', 1, true) and n < 0 then usage('%s: %s must be >= 0, got %s', where, name, describe(v)) end
    if ty:find('>0', 1, true) and not ty:find('>=0', 1, true) and n <= 0 then
      usage('%s: %s must be > 0, got %s', where, name, describe(v))
    end
    return n
  elseif base == 'bool' then
    if type(v) == 'boolean' then return v end
    if v == 'true' or v == '1' or v == 'yes' then return true end
    if v == 'false' or v == '0' or v == 'no' then return false end
    usage('%s: %s expects true or false, got %s', where, name, describe(v))
  elseif base == 'string' then
    if type(v) ~= 'string' then usage('%s: %s expects a string, got %s', where, name, describe(v)) end
    return v
  end
  error('train: unknown option type ' .. ty)
end
train.coerce = coerce

-- a command-line value for a model config field, typed by the model's field list
local function model_value(M, field, v, flag)
  for _, f in ipairs(M.fields or {}) do
    if f[1] == field then
      local ty = f[2]
      if type(ty) == 'table' then
        if v == 'true' then return true elseif v == 'false' then return false end
        local n = tonumber(v)
        for _, allowed in ipairs(ty) do
          if allowed == v or allowed == n then return allowed end
        end
        return v -- the model's validation names what is allowed
      end
      ty = ty:gsub('%?$', '')
      if ty:match('^int') or ty:match('^number') or ty == 'prob' or (ty == 'ids' and tonumber(v)) then
        local n = tonumber(v)
        if not n then usage('%s expects a number, got %s', flag, describe(v)) end
        return n
      elseif ty == 'bool' then return coerce('bool', v, flag, 'flag')
      elseif ty == 'table' then
        local obj = json.decode(v, 1, nil)
        if type(obj) ~= 'table' then usage('%s expects a JSON object, got %s', flag, describe(v)) end
        return obj
      end
      return v
    end
  end
  return nil
end

function train.has_field(M, field)
  for _, f in ipairs(M.fields or {}) do if f[1] == field then return true end end
  return false
end

-- ----------------------------------------------------------- model files
-- A model file returns a table with `new` and `config` or `presets`; a
-- training script returns nothing or a function; a run config returns a
-- table of options (with `model`).
function train.kind_of(v)
  if type(v) == 'table' and type(v.new) == 'function' and (v.config ~= nil or v.presets ~= nil) then return 'model' end
  if type(v) == 'function' or v == nil then return 'script' end
  if type(v) == 'table' then return 'config' end
  return 'unknown'
end

-- path of a file, or a module name (models.gpt2 / models/gpt2) -> the value it returns
function train.load_model(spec)
  if type(spec) == 'table' then return spec end
  if type(spec) ~= 'string' then usage('model: expected a file or module name, got %s', describe(spec)) end
  local name = spec:gsub('%.lua$', ''):gsub('^%./', '')
  local path = spec
  local f = io.open(path, 'rb')
  if not f and not spec:match('%.lua$') then
    local alt = T.root .. '/' .. name:gsub('%.', '/') .. '.lua'
    f = io.open(alt, 'rb')
    if f then path = alt end
  end
  if not f then usage('model: cannot find %s', spec) end
  f:close()
  -- a file of this repository is loaded through require, so that every
  -- require 'models.gpt2' in the process shares one table
  local abs = path
  if abs:sub(1, 1) ~= '/' then abs = (os.getenv('PWD') or '.') .. '/' .. abs end
  local rel = abs:match('^' .. T.root:gsub('%p', '%%%0') .. '/(.*)%.lua$')
  local M
  if rel and not rel:find('%.') then
    M = require(rel:gsub('/', '.'))
  else
    local chunk, err = loadfile(path)
    if not chunk then usage('model: %s', err) end
    M = chunk()
  end
  if train.kind_of(M) ~= 'model' then
    usage('model: %s does not return a model table (with new and config/presets)', spec)
  end
  return M
end

-- ------------------------------------------------------------ arguments
-- train.parse_args(list of strings, M) -> options table (only what was given)
-- `--key value`, `--key=value`, `--no-key` (booleans); dashes and
-- underscores are the same; `--model.field value` or `--field value` for a
-- field of the model config (when M is known).
function train.parse_args(args, M)
  local opts, model_config = {}, {}
  local i = 1
  while i <= #args do
    local a = args[i]
    if type(a) ~= 'string' or a:sub(1, 2) ~= '--' then
      usage('unexpected argument %s (options are --name value)', describe(a))
    end
    local key, val = a:sub(3), nil
    local eq = key:find('=', 1, true)
    if eq then key, val = key:sub(1, eq - 1), key:sub(eq + 1) end
    key = key:gsub('-', '_')
    local neg = false
    if not option_by_name[key] and key:match('^no_') and option_by_name[key:sub(4)] and
       option_by_name[key:sub(4)][2] == 'bool' then
      key, neg = key:sub(4), true
    end
    local opt = option_by_name[key]
    local mfield = key:match('^model%.(.+)$')
    if opt then
      if opt[2] == 'bool' and val == nil and (neg or args[i + 1] == nil or args[i + 1]:sub(1, 2) == '--') then
        val = not neg
      elseif val == nil then
        i = i + 1
        val = args[i]
        if val == nil then usage('--%s needs a value', key:gsub('_', '-')) end
      end
      opts[key] = coerce(opt[2], val, '--' .. key:gsub('_', '-'), 'flag')
    elseif mfield or (M and train.has_field(M, key)) then
      local field = mfield or key
      if val == nil then
        i = i + 1
        val = args[i]
        if val == nil then usage('%s needs a value', a) end
      end
      if M then
        local v = model_value(M, field, val, a)
        if v == nil then usage('%s: %s has no config field %s', a, M.name or 'the model', field) end
        model_config[field] = v
      else
        model_config[field] = tonumber(val) or val
      end
    else
      local names = {}
      for _, o in ipairs(train.options) do names[#names + 1] = '--' .. o[1]:gsub('_', '-') end
      usage('unknown option %s (options: %s; model config fields as --model.<field>)', a, table.concat(names, ' '))
    end
    i = i + 1
  end
  if next(model_config) then opts.model_config = model_config end
  return opts
end

-- checks a whole options table (from a script, a config file or flags)
function train.check_options(o, where)
  where = where or 'train'
  for k, v in pairs(o) do
    local opt = option_by_name[k]
    if opt then
      o[k] = coerce(opt[2], v, k, where)
    elseif k ~= 'model_config' then
      usage('%s: unknown option %s', where, tostring(k))
    end
  end
  if o.model_config ~= nil and type(o.model_config) ~= 'table' then
    usage('%s: model_config must be a table, got %s', where, describe(o.model_config))
  end
  if o.dtype and o.dtype ~= 'f32' and o.dtype ~= 'f64' then
    usage('%s: dtype must be f32 or f64 on CPU, got %s', where, describe(o.dtype))
  end
  return o
end

local function merge(dst, src)
  for k, v in pairs(src) do
    if k == 'model_config' then
      dst.model_config = dst.model_config or {}
      for mk, mv in pairs(v) do dst.model_config[mk] = mv end
    else
      dst[k] = v
    end
  end
  return dst
end

-- train.resolve(model_spec, args | opts) -> M, resolved options
function train.resolve(opts)
  opts = opts or {}
  local given = {}
  for k, v in pairs(opts) do given[k] = v end
  local cfgfile = {}
  if given.config then
    local chunk, err = loadfile(given.config)
    if not chunk then usage('config: %s', err) end
    local ok, v = pcall(chunk)
    if not ok then usage('config: %s: %s', given.config, tostring(v)) end
    if type(v) ~= 'table' then usage('config: %s does not return a table of options', given.config) end
    cfgfile = train.check_options(v, given.config)
  end
  local spec = given.model or cfgfile.model
  if spec == nil then usage('no model given (e.g. bin/train models/gpt2.lua)') end
  local M = train.load_model(spec)
  local o = train.defaults()
  if M.train_defaults then merge(o, train.check_options(M.train_defaults, 'train_defaults')) end
  merge(o, cfgfile)
  merge(o, train.check_options(given, 'options'))
  o.model = type(spec) == 'string' and spec or (M.name or 'model')
  return M, o
end

-- ------------------------------------------------------------------ clock
local now
do
  local ok = pcall(ffi.cdef, [[
    typedef struct { long tv_sec; long tv_nsec; } ms_train_timespec;
    int clock_gettime(int clk_id, ms_train_timespec *tp);
  ]])
  if ok then
    local ts = ffi.new('ms_train_timespec')
    now = function()
      ffi.C.clock_gettime(1, ts) -- CLOCK_MONOTONIC
      return tonumber(ts.tv_sec) + tonumber(ts.tv_nsec) * 1e-9
    end
  else
    now = os.time
  end
end
train.now = now

local function fmt_duration(s)
  s = math.max(0, math.floor(s + 0.5))
  if s >= 3600 then return ('%d:%02d:%02d'):format(math.floor(s / 3600), math.floor(s / 60) % 60, s % 60) end
  return ('%d:%02d'):format(math.floor(s / 60), s % 60)
end
train.fmt_duration = fmt_duration

local function fmt_rate(r)
  if r >= 1e6 then return ('%.2fM'):format(r / 1e6) end
  if r >= 1e3 then return ('%.1fk'):format(r / 1e3) end
  return ('%.0f'):format(r)
end

-- ---------------------------------------------------------------- helpers
local function set_lr(opt, lr)
  if opt.set_lr then return opt:set_lr(lr) end
  if opt.param_groups then
    for _, g in ipairs(opt.param_groups) do g.lr = lr end
  end
  if opt.defaults and type(opt.defaults) == 'table' then opt.defaults.lr = lr end
  if opt.lr ~= nil then opt.lr = lr end
end
train.set_lr = set_lr

-- the lr schedule of 1-based step k: linear warmup, then cosine from lr to
-- min_lr (ms.optim.schedule.cosine, which counts steps from 0). A warmup as
-- long as the run is cut to a tenth of it.
function train.schedule(o)
  local min_lr = o.min_lr or o.lr / 10
  local warmup = o.warmup
  if warmup >= o.steps then warmup = math.floor(o.steps / 10) end
  local f = ms.optim.schedule.cosine{ lr = o.lr, warmup = warmup, total = o.steps, min_lr = min_lr }
  return function(step) return f(step - 1) end
end

local function sanitize(s)
  return (s:gsub('[%z\1-\8\11-\31\127]', '?'))
end

-- JSON with every object's keys sorted (run.json)
function train.encode_sorted(obj)
  local keys, seen = {}, {}
  local function collect(t)
    for k, v in pairs(t) do
      if type(k) == 'string' and not seen[k] then seen[k] = true; keys[#keys + 1] = k end
      if type(v) == 'table' then collect(v) end
    end
  end
  collect(obj)
  table.sort(keys)
  return json.encode(obj, { indent = true, keyorder = keys })
end

local function jsonl_line(f, obj)
  local keys = {}
  for k in pairs(obj) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b)
    if a == 'step' then return b ~= 'step' end
    if b == 'step' then return false end
    return a < b
  end)
  f:write(json.encode(obj, { keyorder = keys }), '\n')
  f:flush()
end

-- mean loss over a fixed set of validation batches (the same every time)
function train.evaluate(model, loader, iters)
  local was = model.training
  model:eval()
  local total = 0
  ms.no_grad(function()
    for k = 0, iters - 1 do
      local x, y = loader:batch(k)
      total = total + model(x, y):item()
    end
  end)
  if was then model:train() end
  return total / iters
end

-- ------------------------------------------------------------------- run
-- train.run(options) -> summary { steps, final_loss, first_loss, val_loss,
-- elapsed_s, tokens_per_s, out, sample, model }
-- options as train.options (model: a path, a module name or a model table).
function train.run(opts)
  local M, o = train.resolve(opts)
  local log = o.quiet and function() end or function(...) io.stdout:write(string.format(...), '\n'); io.stdout:flush() end
  if o.threads > 0 then ms.set_num_threads(o.threads) end

  -- model
  ms.manual_seed(o.seed)
  -- a config the model refuses (a field of the wrong type, an unknown
  -- preset) is the user's to fix: reported as a usage error
  local okm, model = pcall(M.new, o.preset, o.model_config)
  if not okm then usage('%s', (tostring(model):gsub('^[^:\n]*%.lua:%d+: ', ''))) end
  if o.dtype ~= 'f32' then model:to(o.dtype) end
  model:train()
  local cfg = model.config
  local max_pos = model.max_positions and model:max_positions() or math.huge
  if o.seq_len > max_pos then
    usage('--seq-len %d exceeds the model\'s %d positions (raise the model\'s positions with --model.<field>)', o.seq_len, max_pos)
  end
  if (cfg.vocab_size or 256) < 256 then
    usage('byte-level data needs a vocabulary of at least 256 tokens; the model has %d', cfg.vocab_size)
  end
  local nparams = 0
  for _, p in pairs(model:parameters()) do nparams = nparams + p:numel() end

  -- data
  local okc, corpus = pcall(data.corpus, { path = o.data, val_fraction = o.val_fraction, min_len = o.seq_len + 1 })
  if not okc then usage('%s', (tostring(corpus):gsub('^[^:\n]*%.lua:%d+: ', ''))) end
  local train_loader = data.Loader(corpus.train, { batch_size = o.batch_size, seq_len = o.seq_len, seed = o.seed })
  local val_loader = corpus.val and data.Loader(corpus.val, { batch_size = o.batch_size, seq_len = o.seq_len, seed = o.seed + 1 })

  -- output
  local name = (M.name or 'model') .. '-' .. tostring(o.preset or 'custom')
  o.out = o.out or ('runs/' .. name .. '-' .. os.date('%Y%m%d-%H%M%S'))
  local ok_mk = os.execute('mkdir -p ' .. data.shell_quote(o.out))
  if ok_mk ~= 0 and ok_mk ~= true then usage('cannot create the output folder %s', o.out) end
  local mf, merr = io.open(o.out .. '/metrics.jsonl', 'w')
  if not mf then usage('cannot write %s/metrics.jsonl: %s', o.out, tostring(merr)) end
  do
    local rf = io.open(o.out .. '/run.json', 'w')
    if rf then
      rf:write(train.encode_sorted({ options = o, model_config = cfg, parameters = nparams,
                                     data = corpus.name, data_bytes = corpus.n }), '\n')
      rf:close()
    end
  end

  -- optimizer
  local opt = ms.optim.AdamW(model, { lr = o.lr, betas = { o.beta1, o.beta2 }, eps = o.eps, weight_decay = o.weight_decay })
  local lr_at = train.schedule(o)
  local params = model:parameters()

  log('moonshard train: %s (%s), %.2fM parameters, %s', o.model, tostring(o.preset), nparams / 1e6, o.dtype)
  log('data: %s, %d bytes (train %d, val %d)', corpus.name, corpus.n, corpus.train.n, corpus.val and corpus.val.n or 0)
  log('%d steps x %d sequences x %d tokens, lr %g, threads %d, out %s',
    o.steps, o.batch_size, o.seq_len, o.lr, ms.get_num_threads(), o.out)

  local tokens_per_step = o.batch_size * o.seq_len
  local t0 = now()
  local t_window, window_loss, window_n, eval_s = t0, 0, 0, 0
  local first_loss, last_loss, val_loss
  local steady_t0, steady_step -- timing from step 2 on (step 1 warms up)
  for step = 1, o.steps do
    local lr = lr_at(step)
    set_lr(opt, lr)
    local x, y = train_loader:next()
    local loss = model(x, y)
    opt:zero_grad()
    loss:backward()
    local gnorm
    if o.grad_clip > 0 then gnorm = ms.optim.clip_grad_norm(params, o.grad_clip) end
    opt:step()
    local lv = loss:item()
    if lv ~= lv or lv == math.huge or lv == -math.huge then
      error(('train: the loss is %s at step %d (try a lower --lr)'):format(tostring(lv), step), 0)
    end
    first_loss = first_loss or lv
    last_loss = lv
    window_loss, window_n = window_loss + lv, window_n + 1
    local t = now()
    if step == 1 then steady_t0, steady_step = t, 1 end
    local rec = { step = step, loss = lv, lr = lr, grad_norm = gnorm, elapsed_s = t - t0 }
    if val_loader and (step == o.steps or (o.eval_every > 0 and step % o.eval_every == 0)) then
      local te = now()
      val_loss = train.evaluate(model, val_loader, o.eval_iters)
      rec.val_loss = val_loss
      eval_s = eval_s + (now() - te)
    end
    local log_now = step % o.log_every == 0 or step == o.steps or step == 1
    if log_now then
      -- throughput of the training steps alone (validation time left out)
      local dt = now() - t_window - eval_s
      local rate = window_n * tokens_per_step / math.max(dt, 1e-9)
      rec.tokens_per_s = rate
      local per_step = step > steady_step and (t - steady_t0) / (step - steady_step) or dt
      log('step %' .. #tostring(o.steps) .. 'd/%d | loss %.4f | lr %.2e | %s tok/s | %s elapsed | ETA %s%s',
        step, o.steps, window_loss / window_n, lr, fmt_rate(rate),
        fmt_duration(t - t0), fmt_duration(per_step * (o.steps - step)),
        rec.val_loss and (' | val %.4f'):format(rec.val_loss) or '')
      t_window, window_loss, window_n, eval_s = now(), 0, 0, 0
    end
    jsonl_line(mf, rec)
  end
  local elapsed = now() - t0
  mf:close()

  if o.save then model:save_pretrained(o.out) end

  local sample
  if o.sample_tokens > 0 then
    local prompt = data.encode(o.sample_prompt)
    if #prompt == 0 then prompt = { 10 } end
    local ids = model:generate({ prompt }, o.sample_tokens, {
      temperature = o.temperature, top_k = o.top_k > 0 and o.top_k or nil, seed = o.seed })
    local row = ids:totable()[1]
    local new = {}
    for i = #prompt + 1, #row do new[#new + 1] = row[i] < 256 and row[i] or 63 end
    sample = o.sample_prompt .. data.decode(new)
    log('---- sample (%d tokens, temperature %g) ----\n%s\n----', o.sample_tokens, o.temperature, sanitize(sample))
  end
  log('done: %d steps in %s (%s tok/s), loss %.4f -> %.4f%s; metrics %s/metrics.jsonl',
    o.steps, fmt_duration(elapsed), fmt_rate(o.steps * tokens_per_step / elapsed), first_loss, last_loss,
    val_loss and (', val %.4f'):format(val_loss) or '', o.out)
  return {
    steps = o.steps, first_loss = first_loss, final_loss = last_loss, val_loss = val_loss,
    elapsed_s = elapsed, tokens_per_s = o.steps * tokens_per_step / elapsed,
    out = o.out, sample = sample, model = model, options = o,
  }
end

-- ------------------------------------------------------------------ main
train.help = [[
usage: bin/train FILE [options]

FILE is a model file (models/gpt2.lua, models/llama.lua: trained by the
built-in loop with the options below), a run config (a Lua file returning a
table of these options with `model`), or a training script (run as it is,
with its arguments in `arg` and `...`).

options (--name value, --name=value; --no-NAME for false):
]]

function train.usage_text(M)
  local lines = { train.help }
  for _, o in ipairs(train.options) do
    local d = o[3]
    if d == '\n' then d = '"\\n"' end
    lines[#lines + 1] = ('  --%-16s %s%s'):format(o[1]:gsub('_', '-'), o[4], d ~= nil and (' [' .. tostring(d) .. ']') or '')
  end
  lines[#lines + 1] = '  --model.FIELD VALUE  a field of the model config (also --FIELD when unambiguous), e.g. --model.n_layer 2'
  if M and M.presets then
    local names = {}
    for k in pairs(M.presets) do names[#names + 1] = k end
    table.sort(names)
    lines[#lines + 1] = ('\n%s presets: %s'):format(M.name or 'model', table.concat(names, ', '))
  end
  if M and M.fields then
    lines[#lines + 1] = ('%s config fields:'):format(M.name or 'model')
    for _, f in ipairs(M.fields) do
      lines[#lines + 1] = ('  %-26s %s'):format(f[1], f[4] or '')
    end
  end
  return table.concat(lines, '\n')
end

-- train.main_file(path, args) -> exit status. Runs a model file through the
-- built-in loop, a run config likewise, or a training script as it is.
function train.main_file(path, args)
  args = args or {}
  local tb
  local function fail(e)
    if train.is_usage_error(e) then
      io.stderr:write('bin/train: ', e.msg, '\n')
      return 2
    end
    io.stderr:write('bin/train: ', tostring(e), '\n')
    if tb and os.getenv('MS_TRACEBACK') then io.stderr:write(tb, '\n')
    elseif tb then io.stderr:write('(MS_TRACEBACK=1 prints the traceback)\n') end
    return 1
  end
  local ok, status = xpcall(function()
    local f = io.open(path, 'rb')
    if not f then usage('cannot open %s', path) end
    f:close()
    local chunk, err = loadfile(path)
    if not chunk then usage('%s', err) end
    local script_arg = { [0] = path }
    for i, a in ipairs(args) do script_arg[i] = a end
    local env_arg = _G.arg
    _G.arg = script_arg
    local rets = { chunk(unpack(args)) }
    local v = rets[1]
    local kind = train.kind_of(v)
    if kind == 'model' then
      _G.arg = env_arg
      local M = train.load_model(path)
      for _, a in ipairs(args) do
        if a == '--help' or a == '-h' then print(train.usage_text(M)); return 0 end
      end
      local o = train.parse_args(args, M)
      o.model = path
      train.run(o)
      return 0
    elseif kind == 'config' then
      _G.arg = env_arg
      local o = train.parse_args(args)
      o.config = path
      train.run(o)
      return 0
    elseif type(v) == 'function' then
      local r = v(unpack(args))
      return type(r) == 'number' and r or 0
    end
    return type(rets[2]) == 'number' and rets[2] or 0
  end, function(e)
    if not train.is_usage_error(e) then tb = debug.traceback(tostring(e), 2) end
    return e
  end)
  if ok then return status end
  return fail(status)
end

return train
