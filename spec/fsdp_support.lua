-- spec/fsdp_support.lua — what the fsdp runtime specs share: the tiny
-- fixture models, token rows from a fixed generator, and the relative
-- differences they compare with.
local T = require 'moonshard.tensor'

local S = {}

S.fixtures = T.root .. '/../shared/fixtures'

-- is the fixture model `name` (gpt2-tiny, llama-tiny) there?
function S.have_fixture(name)
  local f = io.open(S.fixtures .. '/' .. (name or 'gpt2-tiny') .. '/model.safetensors', 'rb')
  if f then f:close() end
  return f ~= nil
end

-- the fixture model `name` in f32 (gpt2-tiny by default)
function S.load_model(name)
  name = name or 'gpt2-tiny'
  local M = require(name:match('^llama') and 'models.llama' or 'models.gpt2')
  return M.from_pretrained(S.fixtures .. '/' .. name, { dtype = 'f32' })
end

-- model m split for `--tp 2 --ep M` over W ranks (the dist_ep_tp specs):
-- TP groups of 2 consecutive ranks, the expert groups of M consecutive
-- ranks (M = 2: the TP group, with its W / 2 copies; else the world)
-- -> m, the mesh { replicate = W / 2, shard = 2 }
function S.split_ep_tp(m, W, M, sp)
  local ms, dist = require 'moonshard', require 'moonshard.dist'
  local mesh = dist.mesh { replicate = W / 2, shard = 2 }
  if M == 2 then
    ms.ep.parallelize(m, { group = mesh.shard, replicate = W > 2 and mesh.replicate or nil })
  else
    ms.ep.parallelize(m, { group = dist.world_group })
  end
  ms.tp.parallelize(m, { group = mesh.shard, sequence_parallel = sp })
  return m, mesh
end

-- n rows of `seq` token ids in [0, 256) and their next-token targets, from
-- the LCG x -> (1103515245 x + 12345) mod 2^31 started at `seed` (Lua tables)
function S.lcg_rows(seed, n, seq)
  local ids, tg = {}, {}
  for i = 1, n do
    ids[i], tg[i] = {}, {}
    for j = 1, seq + 1 do
      seed = (seed * 1103515245 + 12345) % 2147483648
      local v = math.floor(seed / 65536) % 256
      if j <= seq then ids[i][j] = v end
      if j > 1 then tg[i][j - 1] = v end
    end
  end
  return ids, tg
end

-- the same rows as i64 tensors
function S.lcg_batch(seed, n, seq)
  local ids, tg = S.lcg_rows(seed, n, seq)
  return T.tensor(ids, { dtype = 'i64' }), T.tensor(tg, { dtype = 'i64' })
end

-- ||a − b|| / ||b|| of tensors, in f64 (DESIGN.md's measure for dtype bounds)
function S.norm_rel(a, b)
  local a64, b64 = a:to('f64'), b:to('f64')
  return math.sqrt((a64 - b64):square():sum():item()) / math.max(math.sqrt(b64:square():sum():item()), 1e-30)
end

-- the losses of `steps` steps of model m on (x, y) under bf16 autocast,
-- optimizer opt stepping each
function S.autocast_losses(m, opt, x, y, steps)
  local r = {}
  for k = 1, steps do
    local l = require('moonshard').nn.functional.autocast('bf16', m, x, y)
    l:backward(); r[k] = l:item(); opt:step(); opt:zero_grad()
  end
  return r
end

-- |a − b| / |b| of numbers
function S.rel(a, b) return math.abs(a - b) / math.max(math.abs(b), 1e-30) end

-- max |a − b| / max |b| of tensors
function S.max_rel(a, b)
  local d = (a:to('f64') - b:to('f64')):abs():max():item()
  local s = b:to('f64'):abs():max():item()
  return d / math.max(s, 1e-30)
end

-- name -> the whole gradient (flat), from fully_shard's units' gradient
-- shards (a collective over each unit's group)
function S.whole_grads(m)
  local fsdp, dist = require 'moonshard.fsdp', require 'moonshard.dist'
  local r = {}
  for _, u in ipairs(fsdp.units(m)) do
    local fp = u.fp
    local g = fp.shard.grad
    assert(g ~= nil, u.label .. ' has no gradient shard')
    local flat = T.empty({ fp.total }, { dtype = g.dtype, device = g.device })
    if fp.world_size == 1 then flat:copy_(g) else dist.all_gather_into(flat, g, { group = fp.group }) end
    for i = 1, fp.nparams do
      r[u.param_names[i]] = flat:narrow(1, fp.layout.offsets[i] + 1, fp.layout.numels[i]):clone()
    end
    flat:free()
  end
  return r
end

return S
