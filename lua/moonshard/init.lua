-- moonshard — the Lua face of the engine.
--
--   local ms = require 'moonshard'
--   local x = ms.randn({4, 8}, {seed = 1})
--   local w = ms.randn({8, 2})
--   print(ms.matmul(x, w):sum())
--
-- Layers (each a module of its own, all reachable from here):
--   moonshard.tensor       the Tensor metatype, constructors, views, printing
--   moonshard.ops          tensor operations (raw, no autograd)
--   moonshard.safetensors  load/save .safetensors files
--   moonshard.dist         collectives between ranks (NCCL on GPU, MPI on CPU)
local T = require 'moonshard.tensor'

local ms = {}
ms.C, ms.ffi = T.C, T.ffi
ms.Tensor = T

-- constructors
for _, k in ipairs({ 'tensor', 'empty', 'zeros', 'ones', 'full', 'arange', 'rand', 'randn',
  'zeros_like', 'ones_like', 'empty_like', 'manual_seed', 'rng_state', 'set_rng_state',
  'is_tensor', 'uniform_', 'normal_' }) do
  ms[k] = T[k]
end

-- raw ops: functional forms, also installed as tensor methods by moonshard.ops
local okops, F = pcall(require, 'moonshard.ops')
if okops then
  ms.raw = F
  for k, f in pairs(F) do ms[k] = f end
elseif not tostring(F):find("module 'moonshard.ops' not found", 1, true) then
  error(F, 0)
end

-- autograd: recording versions of the differentiable ops replace the raw ones
-- (ms.raw keeps the raw layer), plus grad mode, checkpointing, nn and optim
if okops then
  local A = require 'moonshard.autograd'
  ms.autograd = A
  for k, f in pairs(A.ops) do ms[k] = f end
  ms.no_grad, ms.enable_grad, ms.is_grad_enabled = A.no_grad, A.enable_grad, A.is_grad_enabled
  ms.set_grad_enabled, ms.checkpoint = A.set_grad_enabled, A.checkpoint
  ms.nn = require 'moonshard.nn'
  ms.optim = require 'moonshard.optim'
  ms.float8 = require 'moonshard.float8'   -- FP8 linear layers (docs/float8.md)
end

local okst, st = pcall(require, 'moonshard.safetensors')
if okst then
  ms.load_safetensors, ms.save_safetensors = st.load, st.save
elseif not tostring(st):find("module 'moonshard.safetensors' not found", 1, true) then
  error(st, 0)
end

ms.cuda = require 'moonshard.cuda'
ms.dist = require 'moonshard.dist'   -- collectives, groups, the rendezvous store (docs/dist.md)
ms.profile = require 'moonshard.profile'   -- the op counter (docs/tensors.md)
local okfs, fs = pcall(require, 'moonshard.fsdp')   -- flat parameters (docs/fsdp.md)
if okfs then ms.fsdp = fs elseif not tostring(fs):find("module 'moonshard.fsdp' not found", 1, true) then error(fs, 0) end

local oktp, tpm = pcall(require, 'moonshard.tp')   -- tensor parallelism (docs/tp.md)
if oktp then ms.tp = tpm elseif not tostring(tpm):find("module 'moonshard.tp' not found", 1, true) then error(tpm, 0) end
ms.pp = require 'moonshard.pp'   -- pipeline parallelism (docs/pp.md)
ms.cp = require 'moonshard.cp'   -- context parallelism (docs/cp.md)
ms.ep = require 'moonshard.ep'   -- expert parallelism in training (docs/moe.md)

function ms.set_num_threads(n) T.C.ms_set_num_threads(n) end
function ms.get_num_threads() return T.C.ms_get_num_threads() end
function ms.live_storages() return tonumber(T.C.ms_live_storages()) end
function ms.live_bytes(device) return tonumber(T.C.ms_live_bytes(device or -1)) end

return ms
