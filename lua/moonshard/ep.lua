-- moonshard.ep — expert parallelism for training: what the loop around
-- nn.moe.expert_parallel needs (docs/moe.md, "Expert parallelism").
--
--   ms.dist.init{}
--   local model = mixtral.new('tiny')                 -- the same seed on every rank
--   local mesh = ms.dist.mesh{ replicate = 2, shard = 4 } -- 8 ranks: experts over 4, 2 copies of each
--   ms.ep.parallelize(model, { group = mesh.shard, replicate = mesh.replicate })
--   local loss = model(x, y)                          -- each rank its own batch
--   loss:backward()
--   ms.ep.all_reduce_grads(model)                     -- the data-parallel mean of every gradient
--   ms.ep.clip_grad_norm_(model, 1.0)
--   local msd, osd = ms.ep.full_checkpoint(model, opt, hyper)  -- a one-process checkpoint's parts
--
-- Every rank trains on its own tokens. The experts of each MoE layer are
-- split over `group` (E / P a rank); `replicate` joins the ranks that hold
-- the same experts (none when the group is every data-parallel rank). Each
-- rank's loss is the mean over its tokens, and the run's loss the mean
-- over the W = P x |replicate| ranks, so:
--   - a gradient outside the experts is this rank's tokens': averaged over
--     all W ranks;
--   - a local expert's gradient is already the sum over its group's
--     ranks' losses (their tokens came to it): summed over `replicate`,
--     then divided by W.
-- The whole model's state (the experts gathered from the group) makes a
-- one-process checkpoint, which resumes at any expert-parallel size or in
-- one process, and a one-process checkpoint resumes here: each rank keeps
-- its experts' tensors and moments. Under fsdp.fully_shard each layer's
-- experts are a unit sharded over `replicate` (fsdp.lua), the units reduce
-- the gradients, and fsdp_checkpoint's sharded and streamed full saves
-- write every expert (ep.remote_names, ep.gather_experts).
--
-- With tensor parallelism (docs/moe.md, "Expert and tensor parallelism"):
-- ep.parallelize over groups made of whole TP groups, then
-- tp.parallelize; each TP rank routes its own rows, the experts whole.
-- Each TP group's loss is the mean over its tokens, so all_reduce_grads
-- takes the data-parallel group (the ranks holding the same slices) and
-- divides the experts' sums by its size; clip_grad_norm_ adds the slices'
-- squares over the TP group; the whole-model state gathers the slices
-- (tp.full_state_dict) and loads cut to them. Under fsdp.fully_shard over
-- the ranks that hold the same slices (FSDP x TP x EP) the units reduce
-- the gradients (the experts' over their copies), clip_grad_norm_ counts
-- each element of the shards once (a replicated parameter's squares over
-- the TP group's size), and the whole-model state is the units' gathered
-- (tp.fsdp_full_tensors), then the experts'.
local T = require 'moonshard.tensor'
local A = require 'moonshard.autograd'
local F = require 'moonshard.ops'
local dist = require 'moonshard.dist'

local ep = {}

local shape_str = T.shape_str

local function info_of(model, fname)
  local info = type(model) == 'table' and rawget(model, '_ep_train')
  if not info then
    error(('ep.%s: the model is not expert-parallel (ep.parallelize)'):format(fname), 3)
  end
  return info
end

local function check_group(g, what)
  if type(g) ~= 'table' or type(g.is_member) ~= 'function' or not g:is_member() then
    error(('ep.parallelize: %s %s is not a process group this rank belongs to'):format(what, tostring(g)), 3)
  end
end

-- ep.parallelize(model, { group =, replicate = }) -> model: each MoE
-- layer's experts split over `group` (default the world; nn.moe.expert_parallel),
-- `replicate` the ranks that hold the same experts (nil: none)
function ep.parallelize(model, opts)
  opts = opts or {}
  local nn = require 'moonshard.nn'
  if not nn.is_module(model) then error('ep.parallelize: model must be a module', 2) end
  if rawget(model, '_ep_train') then error('ep.parallelize: the model is already expert-parallel', 2) end
  if rawget(model, '_tp') then
    error('ep.parallelize: the model is tensor-parallel already (its experts split by features); split the experts '
      .. 'first: ep.parallelize, then tp.parallelize', 2)
  end
  local group = opts.group or dist.world_group
  if group == nil then error('ep.parallelize: dist is not initialised (ms.dist.init) and no group given', 2) end
  check_group(group, 'group')
  local rep = opts.replicate
  if rep ~= nil then
    check_group(rep, 'replicate')
    -- (a collective over it) the ranks of `replicate` must hold the same
    -- experts: the same place in their groups, and groups of one size
    local mine = T.tensor({ group:rank(), group:size() }, { dtype = 'f64' })
    local dev = mine:to(dist.device())
    local all = T.empty({ 2 * rep:size() }, { dtype = 'f64', device = dev.device })
    dist.all_gather_into(all, dev, { group = rep })
    local v = all:to('cpu'):totable()
    for k = 0, rep:size() - 1 do
      if v[2 * k + 1] ~= group:rank() or v[2 * k + 2] ~= group:size() then
        error(('ep.parallelize: replicate rank %d is rank %d of a group of %d, this rank (replicate rank %d) rank %d '
          .. 'of %d: a replicate group joins the ranks that hold the same experts'):format(k, v[2 * k + 1],
          v[2 * k + 2], rep:rank(), group:rank(), group:size()), 2)
      end
    end
  end
  local ok, err = pcall(nn.moe.expert_parallel, model, group)
  if not ok then error((tostring(err):gsub('^moe%.expert_parallel', 'ep.parallelize')), 2) end
  local by = {}
  for _, m in ipairs(err) do by[m] = true end
  -- (a pipeline's stage, pp.pipeline before this: the layers of the other
  -- stages hold no parameters and are left out)
  local layers = {}
  for name, m in model:named_modules() do
    if by[m] and #m.experts:parameters() > 0 then
      local e = rawget(m, '_ep')
      layers[#layers + 1] = { module = m, prefix = name == '' and '' or name .. '.', E = m.n_experts,
        El = e.local_experts }
    end
  end
  rawset(model, '_ep_train', { group = group, replicate = rep, size = group:size(), rank = group:rank(),
    layers = layers })
  return model
end

-- the local experts' parameters of layer L: a list of { j =, rest =,
-- tensor = } (local expert j = 1..El in turn, each expert's parameters in
-- order; rest: the name inside the expert)
local function local_experts(L)
  local list = {}
  for j = 1, L.El do
    local x = L.module.experts[j]
    for n, p in x:named_parameters() do list[#list + 1] = { rest = n, tensor = p, j = j } end
  end
  return list
end

-- the model's name of expert e's (0-based, global) parameter `rest` in layer L
local function expert_name(L, e, rest) return ('%sexperts.%d.%s'):format(L.prefix, e, rest) end

-- ep.local_names(model) -> name -> true for the parameters of this rank's
-- experts (under their whole-model names)
function ep.local_names(model)
  local info = info_of(model, 'local_names')
  local out = {}
  for _, L in ipairs(info.layers) do
    for _, it in ipairs(local_experts(L)) do out[expert_name(L, info.rank * L.El + it.j - 1, it.rest)] = true end
  end
  return out
end

-- ep.remote_names(model) -> name -> true for the parameters of the
-- experts the group's other ranks hold (the whole model's names this rank
-- lacks: a checkpoint of the whole model holds them)
function ep.remote_names(model)
  local info = info_of(model, 'remote_names')
  local out = {}
  for _, L in ipairs(info.layers) do
    local rests = {}
    for _, it in ipairs(local_experts(L)) do if it.j == 1 then rests[#rests + 1] = it.rest end end
    for e = 0, L.E - 1 do
      if math.floor(e / L.El) ~= info.rank then
        for _, rest in ipairs(rests) do out[expert_name(L, e, rest)] = true end
      end
    end
  end
  return out
end

-- the tensor-parallel group's size of a model also split by tp.parallelize (1: none)
local function tp_size(model)
  local t = rawget(model, '_tp')
  return t and t.size or 1
end

-- tensor id -> true for every local expert's parameter
local function expert_ids(info)
  local ids = {}
  for _, L in ipairs(info.layers) do
    for _, p in ipairs(L.module.experts:parameters()) do ids[tonumber(p.id)] = true end
  end
  return ids
end

-- ep.all_reduce_grads(model, group = world): the gradients of the mean
-- over every data-parallel rank's loss (`group`, P x |replicate| ranks):
-- the experts' summed over `replicate` and divided by the group's size,
-- the others averaged over it
function ep.all_reduce_grads(model, group)
  local info = info_of(model, 'all_reduce_grads')
  if rawget(model, '_fsdp') then
    error('ep.all_reduce_grads: the model is under fully_shard, whose units reduce the gradients', 2)
  end
  -- (tensor-parallel too, tp.parallelize: `group` the ranks that hold the
  -- same slices, each group of N its own tokens; the experts' divided by
  -- its size as well)
  local N = tp_size(model)
  if N > 1 and group == nil then
    error('ep.all_reduce_grads: the model is tensor-parallel too: give the data-parallel group (the ranks that '
      .. 'hold the same slices: the tensor-parallel mesh\'s replicate axis)', 2)
  end
  group = group or dist.world_group
  local W = group:size()
  local R = info.replicate and info.replicate:size() or 1
  if W * N ~= info.size * R then
    if N > 1 then
      error(('ep.all_reduce_grads: a data-parallel group of %d ranks x %d-way tensor parallel, but the experts split '
        .. 'over %d ranks with %d copies (%d)'):format(W, N, info.size, R, info.size * R), 2)
    end
    error(('ep.all_reduce_grads: a data-parallel group of %d ranks, but the experts split over %d ranks with %d '
      .. 'copies (%d)'):format(W, info.size, R, info.size * R), 2)
  end
  local ex = expert_ids(info)
  local experts, rest = {}, {}
  for _, p in ipairs(model:parameters()) do
    local g = p.grad
    if g ~= nil then
      if ex[tonumber(p.id)] then experts[#experts + 1] = g else rest[#rest + 1] = g end
    end
  end
  -- (in buckets: dist.all_reduce_coalesced)
  if R > 1 then dist.all_reduce_coalesced(experts, 'sum', { group = info.replicate }) end
  for _, g in ipairs(experts) do F.mul_(g, 1 / W) end
  if W > 1 then dist.all_reduce_coalesced(rest, 'avg', { group = group }) end
end

-- ep.clip_grad_norm_(model, max_norm, opts) -> the whole model's gradient
-- norm (after all_reduce_grads: the same on every rank): the local
-- experts' sums of squares added over the group (each expert once), the
-- rest's once; clipped as ms.optim.clip_grad_norm (opts.defer, opts.tensor)
function ep.clip_grad_norm_(model, max_norm, opts)
  local info = info_of(model, 'clip_grad_norm_')
  if max_norm ~= nil and (type(max_norm) ~= 'number' or max_norm <= 0) then
    error(('ep.clip_grad_norm_: max_norm must be a positive number, got %s'):format(tostring(max_norm)), 2)
  end
  if max_norm == math.huge then max_norm = nil end
  -- (FSDP x TP x EP: tp.clip_grad_norm_ counts the expert units' shards
  -- with the TP slices', each element held by one rank of the world)
  if rawget(model, '_fsdp') and rawget(model, '_tp') then
    local v = require('moonshard.tp').clip_grad_norm_(model, max_norm, opts)
    return v
  end
  if rawget(model, '_fsdp') then
    -- (under fully_shard every element of every shard is held by one rank:
    -- the experts' over their copies, the rest over every rank)
    local t = require('moonshard.fsdp').clip_grad_norm(model, max_norm or math.huge,
      { defer = opts and opts.defer })
    if opts and opts.tensor then return t end
    local v = t:item()
    t:free()
    return v
  end
  local optim = require 'moonshard.optim'
  local ex = expert_ids(info)
  -- (tensor-parallel too: the slices' sums over the tensor-parallel group)
  local tpi = rawget(model, '_tp')
  local tpm = tpi and require 'moonshard.tp'
  local split, sliced, rep, all = {}, {}, {}, {}
  local dev
  for name, p in model:named_parameters() do
    local g = p.grad
    if g ~= nil then
      dev = dev or g.device
      if g.device ~= dev then error(('ep.clip_grad_norm_: gradients on %s and %s'):format(dev, g.device), 2) end
      all[#all + 1] = g
      if ex[tonumber(p.id)] then split[#split + 1] = g
      elseif tpi and tpm.placement(model, name) then sliced[#sliced + 1] = g
      else rep[#rep + 1] = g end
    end
  end
  dev = dev or dist.device()
  -- (every rank calls the all-reduces, with or without gradients)
  local s = optim.sum_squares(split, dev)
  dist.all_reduce(s, 'sum', { group = info.group })
  if tpi then
    local t = optim.sum_squares(sliced, dev)
    if tpi.size > 1 then dist.all_reduce(t, 'sum', { group = tpi.group }) end
    F.add_(s, t)
    t:free()
  end
  local r = optim.sum_squares(rep, dev)
  F.add_(s, r)
  r:free()
  local total = F.sqrt(s)
  s:free()
  return optim.clip_with_norm(all, total, max_norm, opts, 'ep.clip_grad_norm_')
end

-- the tensors get(item) of layer L's local experts (items from
-- local_experts), gathered over the group: name -> tensor for every expert
-- of the layer (on the host when `host`); get may return nil (a moment not
-- made yet): zeros of the parameter's shape go in its place
local function gather_layer(info, L, items, get, dtype, host, out)
  local P = info.size
  local list, made = {}, {}
  for k, it in ipairs(items) do
    local t = get(it)
    if t == nil then
      t = T.zeros(it.tensor.shape, { dtype = dtype, device = it.tensor.device })
      made[#made + 1] = t
    end
    list[k] = t
  end
  local flat = F.cast_flat(list, dtype)
  for _, t in ipairs(made) do t:free() end
  local n = flat:numel()
  local whole = T.empty({ P * n }, { dtype = dtype, device = flat.device })
  dist.all_gather_into(whole, flat, { group = info.group })
  flat:free()
  for p = 0, P - 1 do
    local off = p * n
    for k, it in ipairs(items) do
      local numel = it.tensor:numel()
      local name = expert_name(L, p * L.El + it.j - 1, it.rest)
      local v = whole:narrow(1, off + 1, numel):view(it.tensor.shape)
      local own
      if host and whole.device ~= 'cpu' then own = v:to('cpu') else own = v:clone() end
      v:free()
      out[name] = own
      off = off + numel
    end
  end
  whole:free()
end

-- ep.layer_of(model, module) -> { names = (every expert's parameter names
-- of MoE layer `module`, in the whole model's order), shapes = (name ->
-- shape) }, or nil when `module` is not one of the model's split layers
function ep.layer_of(model, module)
  local info = info_of(model, 'layer_of')
  for _, L in ipairs(info.layers) do
    if L.module == module then
      local items = local_experts(L)
      local names, shapes = {}, {}
      for e = 0, L.E - 1 do
        for _, it in ipairs(items) do
          if it.j == 1 then
            local n = expert_name(L, e, it.rest)
            names[#names + 1] = n
            shapes[n] = it.tensor.shape
          end
        end
      end
      return { names = names, shapes = shapes, layer = L }
    end
  end
  return nil
end

-- ep.gather_experts(model, module, get, dtype, host) -> name -> tensor of
-- every expert of MoE layer `module`: get(name) gives this rank's local
-- expert tensor of that (global) name, whole; all-gathered over the group
-- (a collective over it), on the host when `host`
function ep.gather_experts(model, module, get, dtype, host)
  local info = info_of(model, 'gather_experts')
  local lay = ep.layer_of(model, module)
  if not lay then error('ep.gather_experts: the module is not one of the model\'s expert-parallel layers', 2) end
  local L = lay.layer
  local out = {}
  gather_layer(info, L, local_experts(L), function(it) return get(expert_name(L, info.rank * L.El + it.j - 1,
    it.rest)) end, dtype, host, out)
  return out
end

-- ep.full_state_dict(model, opts) -> name -> whole tensor: the model's
-- state with every expert of every layer gathered from the group (a
-- collective over it; every rank of the group gets it). opts.host: the
-- gathered tensors on the host (the device holds one layer's at a time).
function ep.full_state_dict(model, opts)
  return (ep.full_checkpoint(model, nil, nil, opts))
end

-- this rank's global name of local expert item `it` of layer L
local function local_name(info, L, it)
  return expert_name(L, info.rank * L.El + it.j - 1, it.rest)
end

-- the model's own state: name -> tensor (the experts' whole), and with an
-- optimizer name -> { exp_avg =, exp_avg_sq =, step = } of the parameters
-- that have state. Under fully_shard the units are all-gathered
-- (fsdp_checkpoint.gather: a collective over every rank); `owned`: names
-- whose tensors are copies made here
local function own_state(model, info, opt)
  local tensors, state, owned = {}, {}, {}
  if rawget(model, '_fsdp') and rawget(model, '_tp') then
    -- (FSDP x TP x EP: the units all-gathered, then the slices over the TP
    -- group; the experts whole: as gathered. Buffers: the model's own)
    local msd, st = require('moonshard.tp').fsdp_full_tensors(model, opt)
    local params = {}
    for name in model:named_parameters() do params[name] = true end
    for name, t in pairs(msd) do tensors[name] = t; if params[name] then owned[name] = true end end
    return tensors, st or {}, owned
  end
  if rawget(model, '_fsdp') then
    local params, st = require('moonshard.fsdp_checkpoint').gather(model, { optimizer = opt })
    for _, e in ipairs(params) do tensors[e.name] = e.tensor; owned[e.name] = true end
    -- buffers (not in the flat parameters): the model's own
    for name, t in pairs(model:state_dict()) do if tensors[name] == nil then tensors[name] = t end end
    return tensors, st or {}, owned
  end
  local tpi = rawget(model, '_tp')
  if tpi then
    -- tensor-parallel too: the slices gathered over its group (the experts
    -- are whole: as they are), and their moments
    local tpm = require 'moonshard.tp'
    for name, t in pairs(tpm.full_state_dict(model)) do
      tensors[name] = t
      if tpm.placement(model, name) then owned[name] = true end
    end
    if opt then
      local m, v, steps = {}, {}, {}
      for name, p in model:named_parameters() do
        local s = opt.state[tonumber(p.id)]
        if s and s.exp_avg then m[name], v[name], steps[name] = s.exp_avg, s.exp_avg_sq, s.step end
      end
      m, v = tpm.gather_named(model, m), tpm.gather_named(model, v)
      for name, st in pairs(steps) do state[name] = { exp_avg = m[name], exp_avg_sq = v[name], step = st } end
    end
    return tensors, state, owned
  end
  for name, t in pairs(model:state_dict()) do tensors[name] = t end
  if opt then
    for name, p in model:named_parameters() do
      local s = opt.state[tonumber(p.id)]
      if s and s.exp_avg then state[name] = { exp_avg = s.exp_avg, exp_avg_sq = s.exp_avg_sq, step = s.step } end
    end
  end
  return tensors, state, owned
end

-- the names of the whole (unsplit) model's parameters in the groups
-- build_groups(model, {}, true) would make of it: each layer's run of
-- local experts' names replaced by every expert's, in order
local function full_groups(model, info)
  local optim = require 'moonshard.optim'
  local groups = optim.build_groups(model, {}, true)
  local layer_of = {}
  for _, L in ipairs(info.layers) do
    for _, it in ipairs(local_experts(L)) do layer_of[tonumber(it.tensor.id)] = L end
  end
  local out = {}
  for gi, g in ipairs(groups) do
    local names, done = {}, {}
    for k, p in ipairs(g.params) do
      local L = layer_of[tonumber(p.id)]
      if L == nil then
        names[#names + 1] = g.names[k]
      elseif not done[L] then
        done[L] = true
        -- (an expert's parameters all fall in one group: its 2-D weights)
        local rests = {}
        for _, it in ipairs(local_experts(L)) do if it.j == 1 then rests[#rests + 1] = it.rest end end
        for e = 0, L.E - 1 do
          for _, rest in ipairs(rests) do names[#names + 1] = expert_name(L, e, rest) end
        end
      end
    end
    out[gi] = { names = names, weight_decay = g.weight_decay }
  end
  return out
end
-- ep.full_groups(model) -> those groups: { names =, weight_decay = } each
function ep.full_groups(model) return full_groups(model, info_of(model, 'full_groups')) end

-- ep.full_checkpoint(model, opt, hyper, opts) -> model state dict,
-- optimizer state dict: a one-process checkpoint's two parts (what
-- ms.optim.AdamW over the unsplit model would save), the experts and their
-- AdamW moments gathered from the group (a collective over it); `hyper`
-- = { lr, betas, eps, weight_decay }; opts.host as full_state_dict
function ep.full_checkpoint(model, opt, hyper, opts)
  local info = info_of(model, 'full_checkpoint')
  local msd, by_name = ep.full_tensors(model, opt, opts)
  if not opt then return msd, nil end
  return msd, require('moonshard.optim').one_process_state(full_groups(model, info), by_name, hyper or {})
end

-- ep.full_tensors(model, opt, opts) -> name -> tensor (the model's state,
-- every expert of every layer gathered from the group), and with `opt`
-- name -> { exp_avg =, exp_avg_sq =, step = } of the parameters with
-- state, the experts' gathered too (a collective over the group; what
-- full_checkpoint writes, and pp's whole-model checkpoint of a stage that
-- is expert-parallel reads); opts.host as full_state_dict
function ep.full_tensors(model, opt, opts)
  local info = info_of(model, 'full_tensors')
  local host = opts and opts.host
  local optim = require 'moonshard.optim'
  local tensors, state, owned = own_state(model, info, opt)
  -- the local experts' names: gathered below, the rest as they are
  local mine = {}
  for _, L in ipairs(info.layers) do
    for _, it in ipairs(local_experts(L)) do mine[local_name(info, L, it)] = true end
  end
  local msd, by_name = {}, {}
  for name, t in pairs(tensors) do if not mine[name] then msd[name] = t end end
  for name, e in pairs(state) do if not mine[name] then by_name[name] = e end end
  for _, L in ipairs(info.layers) do
    local items = local_experts(L)
    gather_layer(info, L, items, function(it) return tensors[local_name(info, L, it)] end,
      tensors[local_name(info, L, items[1])].dtype, host, msd)
  end
  for name in pairs(mine) do if owned[name] then tensors[name]:free() end end
  if not opt then return msd, nil end
  for _, L in ipairs(info.layers) do
    local items = local_experts(L)
    local m, v = {}, {}
    local function field(f) return function(it) local e = state[local_name(info, L, it)]; return e and e[f] end end
    local sdt = optim.state_dtype(items[1].tensor)
    gather_layer(info, L, items, field('exp_avg'), sdt, host, m)
    gather_layer(info, L, items, field('exp_avg_sq'), sdt, host, v)
    -- the steps (a plain AdamW counts each parameter's; 0: no state yet,
    -- the zeros gathered in its place dropped)
    local steps = {}
    for _, it in ipairs(items) do
      local e = state[local_name(info, L, it)]
      steps[#steps + 1] = e and e.step or 0
    end
    local s = T.tensor(steps, { dtype = 'f64' })
    local sd = s:to(dist.device())
    local all = T.empty({ info.size * #items }, { dtype = 'f64', device = sd.device })
    dist.all_gather_into(all, sd, { group = info.group })
    local st = all:to('cpu'):totable()
    s:free(); if sd ~= s then sd:free() end
    all:free()
    for p = 0, info.size - 1 do
      for k, it in ipairs(items) do
        local name = expert_name(L, p * L.El + it.j - 1, it.rest)
        if st[p * #items + k] == 0 then
          m[name]:free(); v[name]:free()
        else
          by_name[name] = { exp_avg = m[name], exp_avg_sq = v[name], step = st[p * #items + k] }
        end
      end
    end
    -- (fully_shard's gathered moments: copies)
    if rawget(model, '_fsdp') then
      for _, it in ipairs(items) do
        local e = state[local_name(info, L, it)]
        if e then e.exp_avg:free(); e.exp_avg_sq:free() end
      end
    end
  end
  return msd, by_name
end

-- ep.load_full_state_dict(model, sd): a whole model's state dict (a
-- one-process checkpoint's, read on every rank) into this rank's model:
-- every tensor it holds, its experts among them, copied from sd
function ep.load_full_state_dict(model, sd)
  local info = info_of(model, 'load_full_state_dict')
  if rawget(model, '_fsdp') then
    error('ep.load_full_state_dict: the model is under fully_shard; load the weights before fully_shard', 2)
  end
  -- (tensor-parallel too: each rank's slices cut from the whole tensors,
  -- the experts copied whole)
  if rawget(model, '_tp') then
    local ok, err = pcall(require('moonshard.tp').load_full_state_dict, model, sd)
    if not ok then error((tostring(err):gsub('^[^:\n]*%.lua:%d+: ', ''):gsub('^tp%.', 'ep.')), 2) end
  end
  A.no_grad(function()
    if rawget(model, '_tp') then return end
    for name, dst in pairs(model:state_dict()) do
      local src = sd[name]
      if src == nil then error(('ep.load_full_state_dict: %s is missing'):format(name), 3) end
      if src:numel() ~= dst:numel() then
        error(('ep.load_full_state_dict: %s is %s in the file, the model\'s is %s'):format(name, shape_str(src.shape),
          shape_str(dst.shape)), 3)
      end
      if dst:numel() > 0 then T.raw_copy_(dst, src:view(dst.shape)) end
    end
  end)
  -- (the file's experts must be as many as the model's: a lost expert name is caught above,
  -- one too many here)
  for _, L in ipairs(info.layers) do
    local it = local_experts(L)[1]
    local extra = expert_name(L, L.E, it.rest)
    if sd[extra] ~= nil then
      error(('ep.load_full_state_dict: the file holds %s, the model has %d experts there'):format(extra, L.E), 3)
    end
  end
  return model
end

-- ep.load_full_optimizer_state(model, opt, sd): a one-process optimizer
-- state dict (ms.optim.AdamW over the unsplit model; its groups name
-- their parameters) into `opt` (ms.optim.AdamW over this rank's model):
-- every parameter it holds gets the moments and step saved under its name
function ep.load_full_optimizer_state(model, opt, sd)
  info_of(model, 'load_full_optimizer_state')
  local meta = sd.meta or {}
  local name_of = {}
  for gi, g in ipairs(meta.groups or {}) do
    if type(g.names) ~= 'table' then
      error(('ep.load_full_optimizer_state: group %d of the saved state does not name its parameters'):format(gi), 2)
    end
    for k, i in ipairs(g.params) do name_of[i] = g.names[k] end
  end
  -- the saved tensors by parameter index ('<i>.<field>')
  local fields = {}
  for tn, t in pairs(sd.tensors or {}) do
    local idx, f = tn:match('^(%d+)%.(.+)$')
    if idx then
      idx = tonumber(idx)
      fields[idx] = fields[idx] or {}
      fields[idx][f] = t
    end
  end
  local saved = {}
  for _, e in ipairs(meta.state or {}) do
    local name = name_of[e.index]
    if name == nil then error(('ep.load_full_optimizer_state: state for parameter %s, which no group names'):format(
      tostring(e.index)), 2) end
    saved[name] = e
  end
  if rawget(model, '_fsdp') then
    -- fsdp.AdamW: each piece of a unit's shard gets the moments of the
    -- elements it holds (the local experts' found by their global names)
    local by_name = {}
    for name, e in pairs(saved) do
      local f = fields[e.index] or {}
      if f.exp_avg and f.exp_avg_sq then by_name[name] = { exp_avg = f.exp_avg, exp_avg_sq = f.exp_avg_sq, step = e.step } end
    end
    local fck = require 'moonshard.fsdp_checkpoint'
    local optim = require 'moonshard.optim'
    -- (tensor-parallel too: a split parameter's moments cut to its slice)
    local piece = rawget(model, '_tp') and function(name, t) return require('moonshard.tp').local_piece(model, name, t) end
      or nil
    fck.load_moments(model, opt, by_name, fck.tag_groups(optim.build_groups(model, {}, true), meta.groups), piece)
    return opt
  end
  if #(meta.groups or {}) ~= #opt.param_groups then
    error(('ep.load_full_optimizer_state: %d parameter groups in the state, %d in the optimizer'):format(
      #(meta.groups or {}), #opt.param_groups), 2)
  end
  local tensors, lmeta, i = {}, { type = meta.type, groups = {}, state = {} }, 0
  local tpm = rawget(model, '_tp') and require('moonshard.tp') or nil
  local cut = {}
  for gi, g in ipairs(opt.param_groups) do
    if not g.names then error('ep.load_full_optimizer_state: the optimizer\'s groups do not name their parameters '
      .. '(make it from the model)', 2) end
    local mg = { params = {}, names = g.names }
    for k, v in pairs(meta.groups[gi]) do if k ~= 'params' and k ~= 'names' then mg[k] = v end end
    for k, name in ipairs(g.names) do
      i = i + 1
      mg.params[k] = i
      local e = saved[name]
      if e then
        local entry = { index = i }
        for f, v in pairs(e) do if f ~= 'index' then entry[f] = v end end
        lmeta.state[#lmeta.state + 1] = entry
        for f, t in pairs(fields[e.index] or {}) do
          -- (tensor-parallel too: a split parameter's moments cut to its slice)
          if tpm and t.ndim == g.params[k].ndim then
            local piece, made = tpm.local_piece(model, name, t)
            if made then cut[#cut + 1] = piece end
            t = piece
          end
          tensors[i .. '.' .. f] = t
        end
      end
    end
    lmeta.groups[gi] = mg
  end
  opt:load_state_dict({ tensors = tensors, meta = lmeta })
  for _, t in ipairs(cut) do t:free() end
  return opt
end

return ep
