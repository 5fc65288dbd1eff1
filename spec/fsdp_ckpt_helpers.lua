-- Shared by spec/dist_fsdp_ckpt_spec.lua and spec/fsdp_ckpt_reshard_spec.lua
-- (not a spec itself): gpt2-tiny from the shared fixtures, built plain or
-- sharded in the ways the checkpoint specs compare, a few AdamW steps,
-- and exact / relative comparisons of tensors.
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local dist = require 'moonshard.dist'

local H = {}
H.fixture = T.root .. '/../shared/fixtures/gpt2-tiny'
local f = io.open(H.fixture .. '/model.safetensors', 'rb')
H.have_fixture = f ~= nil
if f then f:close() end
H.under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

-- eps 1e-6 and no weight decay, as spec/dist_fsdp_shard_spec.lua (why: there)
H.OPTS = { lr = 1e-3, eps = 1e-6, weight_decay = 0 }

local exp
function H.batch()
  exp = exp or ms.load_safetensors(H.fixture .. '/expected.safetensors')
  return exp.input_ids, exp.targets
end

function H.gpt2() return require 'models.gpt2' end

-- a gpt2-tiny with the fixture's weights; overrides change the config
-- (the weights are then HF's initialisation, seeded)
function H.load_model(overrides)
  local gpt2 = H.gpt2()
  if not overrides then return gpt2.from_pretrained(H.fixture, { dtype = 'f32' }) end
  local hf = require 'models.hf'
  local raw = assert(hf.read_json(H.fixture .. '/config.json'))
  local cfg = hf.config(gpt2, nil, raw, { from_json = true }, overrides)
  ms.manual_seed(1)
  return gpt2.build(cfg):init_weights()
end

-- kind: 'full' (FULL_SHARD, units by gpt2.Block), 'noshard' (NO_SHARD, by
-- Block), 'root' (FULL_SHARD, one unit: the root), 'plain' (no FSDP, the
-- ordinary AdamW with its decay / no-decay groups). -> model, optimizer
-- With the later fsdp (H.more_strategies): 'grad_op' (SHARD_GRAD_OP),
-- 'hybrid' (HYBRID_SHARD, shards of 2 ranks where the world size is even,
-- else of 1), 'bf16' (FULL_SHARD, mixed_precision param = bf16).
H.more_strategies = ms.fsdp.after_step ~= nil
function H.build(kind, overrides)
  local model = H.load_model(overrides)
  local fsdp = ms.fsdp
  if kind == 'plain' then return model, ms.optim.AdamW(model, H.OPTS) end
  local o = { policy = fsdp.policy.by_class { H.gpt2().Block }, strategy = 'FULL_SHARD' }
  if kind == 'root' then o.policy = function() return false end end
  if kind == 'noshard' then o.strategy = 'NO_SHARD' end
  if kind == 'grad_op' then o.strategy = 'SHARD_GRAD_OP' end
  if kind == 'hybrid' then o.strategy, o.shard_size = 'HYBRID_SHARD', dist.world_size() % 2 == 0 and 2 or 1 end
  if kind == 'bf16' then o.mixed_precision = { param = 'bf16' } end
  fsdp.fully_shard(model, o)
  return model, fsdp.AdamW(model, H.OPTS)
end

-- SGD with momentum over gpt2-tiny: kind 'full' (FULL_SHARD by Block) or
-- 'plain'. -> model, optimizer
H.SGD_OPTS = { lr = 1e-2, momentum = 0.9, weight_decay = 0.01 }
function H.build_sgd(kind)
  local model = H.load_model()
  if kind == 'plain' then return model, ms.optim.SGD(model, H.SGD_OPTS) end
  ms.fsdp.fully_shard(model, { policy = ms.fsdp.policy.by_class { H.gpt2().Block } })
  return model, ms.fsdp.SGD(model, H.SGD_OPTS)
end

-- llama-tiny (untied head): kind 'head' (FULL_SHARD by decoder layer, the
-- LM head a unit of its own), 'head_in_root' (the same, head_unit = false),
-- 'noshard' (NO_SHARD by layer: the head unit too), 'plain' (no FSDP).
-- -> model, optimizer
H.llama_fixture = T.root .. '/../shared/fixtures/llama-tiny'
function H.build_llama(kind)
  local model = require('models.llama').from_pretrained(H.llama_fixture, { dtype = 'f32' })
  local fsdp = ms.fsdp
  if kind == 'plain' then return model, ms.optim.AdamW(model, H.OPTS) end
  local o = { policy = fsdp.policy.by_class { 'LlamaDecoderLayer' }, strategy = 'FULL_SHARD' }
  if kind == 'head_in_root' then o.head_unit = false end
  if kind == 'noshard' then o.strategy = 'NO_SHARD' end
  fsdp.fully_shard(model, o)
  return model, fsdp.AdamW(model, H.OPTS)
end

-- n AdamW steps on the fixture batch; the losses
function H.train(model, opt, n)
  local x, y = H.batch()
  local losses = {}
  for s = 1, n do
    local loss = model(x, y)
    losses[s] = loss:item()
    loss:backward()
    opt:step()
    -- gradients accumulate over backwards until dropped (fsdp too, since
    -- it has fsdp.zero_grad; before, each backward overwrote shard.grad)
    if not rawget(model, '_fsdp') or ms.fsdp.zero_grad then opt:zero_grad() end
  end
  return losses
end

-- the logits of the fixture batch (no grad), a fresh tensor
function H.logits(model)
  local x = H.batch()
  local l
  ms.no_grad(function() l = model(x):clone() end)
  return l
end

function H.max_abs(a, b)
  if a:numel() == 0 then return 0 end
  return (a:to('f64') - b:to('f64')):abs():max():item()
end

-- max |a - b| / max |b|
function H.max_rel(a, b)
  local s = b:to('f64'):abs():max():item()
  return H.max_abs(a, b) / math.max(s, 1e-30)
end

function H.rel(a, b) return math.abs(a - b) / math.max(math.abs(b), 1e-30) end

-- a folder every rank of this mpirun agrees on (rank 0 makes it)
function H.shared_tmpdir()
  local n = 200
  local t = T.zeros({ n }, { dtype = 'f64' })
  if dist.rank() == 0 then
    local p = os.tmpname()
    os.remove(p)
    p = p .. '-fsdp-ckpt'
    assert(#p < n)
    os.execute("mkdir -p '" .. p .. "'")
    local v = {}
    for i = 1, n do v[i] = i <= #p and p:byte(i) or 0 end
    t:copy_(T.tensor(v, { dtype = 'f64' }))
  end
  dist.broadcast(t, 0)
  local chars = {}
  for _, c in ipairs(t:totable()) do if c > 0 then chars[#chars + 1] = string.char(c) end end
  return table.concat(chars)
end

-- runs fn on rank 0 only, then a barrier (file surgery for the error specs)
function H.on_rank0(fn)
  if dist.rank() == 0 then fn() end
  dist.barrier()
end

function H.sh(cmd)
  local r = os.execute(cmd)
  assert(r == 0 or r == true, 'command failed: ' .. cmd)
end

-- what pcall(fn) raised, as a string (and fails when fn did not raise)
function H.error_of(fn)
  local ok, err = pcall(fn)
  assert(not ok, 'expected an error')
  return tostring(err)
end

return H
