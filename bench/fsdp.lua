-- bench/fsdp.lua — FSDP training throughput on one or more GPUs, shaped as
-- the PyTorch references (../shared/bench/torch_gpt2.py, torch_llama.py):
--
--   luajit bench/fsdp.lua --model gpt2 --no-fsdp            one GPU, plain bf16 autocast
--   luajit bench/fsdp.lua --model gpt2                      fully_shard on a world of one
--   bin/train --nproc-per-node 2 bench/fsdp.lua --model llama
--
-- Options: --model gpt2|llama|mixtral|deepseek, --batch (per GPU; 32 for gpt2, 4 for
-- llama, 8 for mixtral and deepseek),
-- --layers N (fewer blocks than the model's, e.g. under ncu),
-- --seq (1024 / 2048 / 1024), --steps (20), --warmup (5), --strategy (FULL_SHARD),
-- --no-fsdp, --no-skip (do not measure the step with communication skipped),
-- --head-in-root (fully_shard's head_unit = false: Llama's untied head and
-- final norm in the root unit, as before the head unit; docs/fsdp.md "The
-- LM head"), --prefetch-root (the root's all-gather of the next step issued
-- at the end of the optimizer step), --timeline (after the measured steps,
-- one more step with every collective timed on the GPU, ms.dist.timing: per
-- collective when it was issued, ran and waited for, and how long the
-- compute stream stood still for it; rank 0 prints it), --nccl-gather
-- (fully_shard's copy_gather = false: the all-gathers through NCCL's kernels
-- instead of the copy engines; docs/fsdp.md "Copy-engine gathers"),
-- --ac none|full|op|N (activation checkpointing of every block or every N-th,
-- nn.apply_activation_checkpointing; op: every block, its attention outputs
-- and every other linear product kept, docs/nn.md; tokens/s and TFLOP/s count the model's
-- flops only, not the recompute),
-- --float8 (the blocks' linear layers in FP8: moonshard.float8.convert,
-- docs/float8.md; --recipe names the recipe, tensorwise by default;
-- --float8-gather: fully_shard's float8_all_gather, tensorwise or blockwise,
-- docs/fsdp.md; --f8-precompute N: after the measured steps, N more runs of
-- its once-a-step precompute alone, fsdp.float8_precompute, each between two
-- CUDA events: the amaxes, their all-reduce, the scales, the casts and the
-- packing, then the same with the all-reduce skipped, and with tensorwise
-- weights the same with their amaxes and casts a weight at a time,
-- fsdp.f8_many_tensorwise = false, against one launch each),
-- --tp (tensor parallelism instead of FSDP: ms.tp.parallelize over the
-- world, every rank the same batch; tokens/s per GPU is then the step's
-- tokens over the GPUs; docs/tp.md), --sp (with --tp: sequence parallel),
-- --pp (pipeline parallelism instead of FSDP: ms.pp.pipeline over the
-- world, one stage a GPU, every rank the same batch cut into --microbatches
-- M micro-batches (default: --batch, one sequence each), --schedule
-- 1f1b|zbh1|gpipe|zbv|dualpipev (2 chunks a rank in a V)|looped_bfs (with
-- --chunks), --no-overlap: every exchange waited for, --stages 10,6 (or
-- --pp-layers, bin/train's name): the blocks per stage (per virtual stage
-- with chunks) instead of pp.default_cut's (bench/pp_cut.lua prints it),
-- --chunks v: the interleaved 1F1B over v chunks a rank (or looped_bfs's), --no-grad-first: the input's gradient sent
-- after the weight gradients (pp's input_grad_first off); tokens/s per GPU
-- is the step's tokens over the GPUs; --pp-size P: pipelines of P stages,
-- data parallel across them (each its own batch; gradients all-reduced),
-- --pp-fsdp: each stage under fully_shard over its data-parallel ranks
-- instead (--strategy, bf16 parameters, f32 reduce; FSDP x PP);
-- docs/pp.md),
-- --cp N (context parallelism under FSDP: groups of N consecutive ranks
-- split each sequence of --seq tokens, attention a ring over the group,
-- ms.cp; every group its own batch of --batch sequences; tokens/s/GPU is
-- the group's tokens over its N GPUs; docs/cp.md),
-- --ep (the mixtral's or deepseek's experts split over the world: ms.ep.parallelize, each
-- rank its own batch; under fully_shard, --strategy FULL_SHARD or
-- SHARD_GRAD_OP, or plain with --no-fsdp: bf16 autocast, AdamW, the
-- gradients' all-reduce (ms.ep.all_reduce_grads) in the clip phase;
-- docs/moe.md),
-- --jit-profile (rank 0's host in the forward calls of the timed steps,
-- sampled every ms by LuaJIT's profiler, jit.profile: the share of the
-- samples by VM state (N compiled, I interpreted, C in C code, G the
-- garbage collector, J the JIT compiler), by function, and by the chain
-- of four callers),
-- --mem-phases (each phase's peak and what it leaves allocated, in the
-- last step; it resets the peak counter, so the table's peak is then only
-- the last phase's), --keep-activations (ms.autograd.release_activations
-- off: tensors no node frees wait for the Lua collector, which adds ~4 GiB
-- to the Llama's peak; on by default, since the loop keeps only the loss). MS_FSDP_GRAD_SINK=0: no gradient sinks,
-- --loss-budget MiB (the LM loss's logits chunk, 1024 by default),
-- MS_FSDP_STEP_LP=0: the bf16 shard copies refreshed after the step instead
-- of written by it (docs/fsdp.md).
--
-- Models: GPT-2 124M (12 x 768, vocab 50304, tied, no dropout) units by
-- GPT2Block; Llama 1.25B (hidden 2048, 16 layers, 32 heads / 8 kv, MLP 5632,
-- vocab 128256 untied, RoPE theta 5e5) units by LlamaDecoderLayer; the
-- Mixtral of bench/moe_train.sh (8 layers of 2048, 16 heads / 8 kv, 8
-- experts of 5632, 2 a token, vocab 32000, no load-balancing loss; 2.3B
-- parameters, 0.5B active a token) units by its decoder layers; a 1.34B
-- DeepSeek-V3 (bench/torch_deepseek.py's: 8 layers of 2048, the first
-- dense, latent attention of 16 heads with q and kv ranks 512, q/k heads
-- 128 + 64 (DeepSeek-V3's), v heads 128, 16 experts of 1408 in 4 groups, 4 a token, 2
-- shared, vocab 32000) by its decoder layers. bf16
-- parameters for compute, f32 reduce and master weights, AdamW (betas 0.9 /
-- 0.95, weight decay 0.1 on matrices for gpt2 as torch_gpt2.py; lr 3e-4 and
-- torch's default decay 0.01 for llama), grad-norm clip 1.0.
--
-- Prints, on rank 0: ms per step (median of the steps after the warm-up,
-- each step ended by loss:item()), tokens/s per GPU, model TFLOP/s per GPU,
-- peak allocated memory per GPU (over every step, and a line with the
-- timed steps' alone), and the exposed communication: the same
-- steps with every collective skipped (ms.fsdp.set_skip_comm: the
-- numerics are then meaningless, the kernels the same) subtracted from the
-- real step time.
package.path = './lua/?.lua;./lua/?/init.lua;./?.lua;' .. package.path
local ffi = require 'ffi'
local ms = require 'moonshard'

local opts = { model = 'gpt2', batch = 0, seq = 0, steps = 20, warmup = 5, strategy = 'FULL_SHARD', layers = 0,
  ['loss-budget'] = 0, ac = 'none', recipe = 'tensorwise', ['tp-scales'] = 'shard', microbatches = 0,
  schedule = '1f1b', stages = '', ['pp-layers'] = '', chunks = 1, ['pp-size'] = 0, cp = 1, ['f8-precompute'] = 0 }
local flags = { ['no-fsdp'] = false, ['no-skip'] = false, ['head-in-root'] = false, ['prefetch-root'] = false, timeline = false, ['nccl-gather'] = false, ['mem-phases'] = false,
  ['keep-activations'] = false, ['jit-profile'] = false, tp = false, pp = false, sp = false, float8 = false, ['float8-gather'] = false,
  ['no-overlap'] = false, ['no-grad-first'] = false, ['pp-fsdp'] = false, ep = false }
do
  local i = 1
  while i <= #arg do
    local k = arg[i]:match('^%-%-(.+)$')
    if k and flags[k] ~= nil then
      flags[k] = true
      i = i + 1
    elseif k and opts[k] ~= nil then
      opts[k] = tonumber(arg[i + 1]) or arg[i + 1]
      i = i + 2
    else
      error('usage: bench/fsdp.lua [--model gpt2|llama|mixtral|deepseek] [--ep] [--batch N] [--seq T] [--steps N] [--warmup N] '
        .. '[--strategy S] [--layers N] [--no-fsdp] [--no-skip] [--head-in-root] [--prefetch-root] [--timeline] [--nccl-gather] [--mem-phases] [--keep-activations] [--tp [--sp] [--no-overlap]] [--pp [--microbatches M] [--schedule 1f1b|zbh1|gpipe|zbv|dualpipev|looped_bfs] [--no-overlap] [--stages|--pp-layers N,N,..] [--chunks v] [--no-grad-first] [--pp-size P [--pp-fsdp]]] [--cp N] [--ac none|full|op|N] [--float8 [--recipe tensorwise|rowwise|rowwise_with_gw_hp|blockwise] [--float8-gather [--f8-precompute N]] [--tp-scales shard|group]]; got ' .. tostring(arg[i]))
    end
  end
end
if opts.model ~= 'gpt2' and opts.model ~= 'llama' and opts.model ~= 'mixtral' and opts.model ~= 'deepseek' then
  error('bench/fsdp.lua: --model gpt2, llama, mixtral or deepseek')
end
if flags.ep and opts.model ~= 'mixtral' and opts.model ~= 'deepseek' then
  error('bench/fsdp.lua: --ep with --model mixtral or deepseek')
end
if opts.batch == 0 then opts.batch = opts.model == 'gpt2' and 32 or opts.model == 'llama' and 4 or 8 end
if opts.seq == 0 then opts.seq = opts.model == 'llama' and 2048 or 1024 end
assert(ms.cuda.is_available(), 'bench/fsdp.lua needs a CUDA device')
ms.autograd.release_activations = not flags['keep-activations']
-- --loss-budget MiB: the LM loss's chunk of logits (flce.set_lm_loss_budget; 1024 by default)
if opts['loss-budget'] > 0 then require('moonshard.flce').set_lm_loss_budget(math.floor(opts['loss-budget'] * 2 ^ 20)) end

ffi.cdef [[
typedef struct { long tv_sec; long tv_nsec; } ms_fsdpb_timespec;
int ms_fsdpb_clock_gettime(int clk, ms_fsdpb_timespec *t) asm("clock_gettime");
]]
local tsp = ffi.new('ms_fsdpb_timespec')
local function now()
  ffi.C.ms_fsdpb_clock_gettime(1, tsp)
  return tonumber(tsp.tv_sec) + tonumber(tsp.tv_nsec) * 1e-9
end

local use_tp, use_pp, use_ep = flags.tp, flags.pp, flags.ep
local use_fsdp = not flags['no-fsdp'] and not use_tp and not use_pp
assert(not (use_ep and (use_tp or use_pp or opts.cp > 1)), 'bench/fsdp.lua: --ep without --tp, --pp or --cp')
assert(not (use_pp and (use_tp or flags.float8)), 'bench/fsdp.lua: --pp without --tp or --float8')
assert(opts.cp == 1 or use_fsdp, 'bench/fsdp.lua: --cp with FSDP only (not --tp, --pp or --no-fsdp)')
local world, rank = 1, 0
if use_fsdp or use_tp or use_pp or use_ep then
  ms.dist.init { backend = 'nccl' }
  world, rank = ms.dist.world_size(), ms.dist.rank()
end
local function say(...) if rank == 0 then print(...) end; io.stdout:flush() end

-- the model
local M, model, block, decay_all
if opts.model == 'gpt2' then
  M = require 'models.gpt2'
  model = M.new('gpt2-124m', { vocab_size = 50304, n_positions = opts.seq, resid_pdrop = 0, embd_pdrop = 0,
                               attn_pdrop = 0, n_layer = opts.layers > 0 and opts.layers or nil })
  block = M.Block
elseif opts.model == 'deepseek' then
  M = require 'models.deepseek_v3'
  model = M.new({ vocab_size = 32000, hidden_size = 2048, intermediate_size = 5632, moe_intermediate_size = 1408,
                  num_hidden_layers = opts.layers > 0 and opts.layers or 8, num_attention_heads = 16,
                  num_key_value_heads = 16, n_shared_experts = 2, n_routed_experts = 16, routed_scaling_factor = 2.5,
                  kv_lora_rank = 512, q_lora_rank = 512, qk_rope_head_dim = 64, v_head_dim = 128,
                  qk_nope_head_dim = 128, n_group = 4, topk_group = 2, num_experts_per_tok = 4,
                  first_k_dense_replace = 1, max_position_embeddings = opts.seq })
  block = require('models.llama').Layer
elseif opts.model == 'mixtral' then
  M = require 'models.mixtral'
  model = M.new({ vocab_size = 32000, hidden_size = 2048, intermediate_size = 5632,
                  num_hidden_layers = opts.layers > 0 and opts.layers or 8,
                  num_attention_heads = 16, num_key_value_heads = 8, max_position_embeddings = opts.seq,
                  num_local_experts = 8, num_experts_per_tok = 2, output_router_logits = false })
  block = require('models.llama').Layer
else
  M = require 'models.llama'
  model = M.new({ vocab_size = 128256, hidden_size = 2048, intermediate_size = 5632,
                  num_hidden_layers = opts.layers > 0 and opts.layers or 16,
                  num_attention_heads = 32, num_key_value_heads = 8, max_position_embeddings = opts.seq,
                  rope_parameters = { rope_type = 'default', rope_theta = 500000.0 }, tie_word_embeddings = false,
                  rms_norm_eps = 1e-5 })
  block = M.Layer
end
-- (nactive: the parameters a token uses, a MoE layer's experts counted k / E)
local nparams, nactive = 0, 0
for name, p in model:named_parameters() do
  nparams = nparams + p:numel()
  local c = model.config
  nactive = nactive + (name:find('.experts.', 1, true) and p:numel() * c.num_experts_per_tok
    / (c.num_local_experts or c.n_routed_experts) or p:numel())
end
-- --pp: this rank's stage only goes to the GPU
local pipe, pp_mesh, dp = nil, nil, 1
if use_pp then
  if opts.microbatches == 0 then opts.microbatches = opts.batch end
  local P = opts['pp-size'] > 0 and opts['pp-size'] or world
  assert(world % P == 0, 'bench/fsdp.lua: --pp-size must divide the world')
  dp = world / P
  pp_mesh = ms.dist.mesh { replicate = dp, shard = P }
  local layers
  if opts['pp-layers'] ~= '' then opts.stages = opts['pp-layers'] end
  if opts.stages ~= '' then
    layers = {}
    for n in tostring(opts.stages):gmatch('%d+') do layers[#layers + 1] = tonumber(n) end
  end
  pipe = ms.pp.pipeline(model, { group = pp_mesh.shard, microbatches = opts.microbatches,
    schedule = (opts.chunks > 1 and opts.schedule ~= 'looped_bfs') and 'interleaved' or opts.schedule,
    chunks = (opts.schedule == 'zbv' or opts.schedule == 'dualpipev') and 2 or opts.chunks,
    overlap = not flags['no-overlap'], layers = layers, input_grad_first = not flags['no-grad-first'] })
  say(tostring(pipe))
end
-- --ep: each rank keeps its experts (E / world of each layer)
if use_ep then
  ms.ep.parallelize(model, { group = ms.dist.get_world_group() })
  local held = 0
  for _, p in model:named_parameters() do held = held + p:numel() end
  say(('expert parallel over %d GPUs: %.2fB of the %.2fB parameters a rank'):format(world, held / 1e9, nparams / 1e9))
end
model:to('cuda')
model:train()
-- --float8: every Linear of the blocks in FP8 (moonshard.float8, the
-- tensorwise recipe; the LM head stays bf16)
local float8_layers = 0
if flags.float8 then
  float8_layers = #ms.float8.convert(model, { recipe = opts.recipe, tp_scales = opts['tp-scales'] })
end
-- --ac full|N: the blocks' activations checkpointed (every block, every N-th)
local ac_blocks = 0
if opts.ac ~= 'none' then
  local every = (opts.ac == 'full' or opts.ac == 'op') and 1 or tonumber(opts.ac)
  assert(every and every >= 1, 'bench/fsdp.lua: --ac must be none, full, op or N >= 1')
  ac_blocks = #ms.nn.apply_activation_checkpointing(model, { class = block, every = every,
    policy = opts.ac == 'op' and 'op' or nil })
end

local adam = opts.model == 'gpt2' and { lr = 6e-4, betas = { 0.9, 0.95 }, eps = 1e-8, weight_decay = 0.1 }
  or { lr = 3e-4, betas = { 0.9, 0.999 }, eps = 1e-8, weight_decay = 0.01 }
local opt, clip
if use_tp then
  ms.tp.parallelize(model, { sequence_parallel = flags.sp, overlap = not flags['no-overlap'] })
  model = ms.nn.functional.set_precision(model, { compute = 'bf16' })
  opt = ms.optim.AdamW(model, adam)
  clip = function() return ms.tp.clip_grad_norm_(model, 1.0, { tensor = true, defer = opt }) end
elseif use_pp and flags['pp-fsdp'] then
  ms.fsdp.fully_shard(model, { group = pp_mesh.replicate, policy = ms.fsdp.policy.by_class { block },
                               strategy = opts.strategy, mixed_precision = { param = 'bf16', reduce = 'f32' } })
  opt = ms.fsdp.AdamW(model, adam)
  clip = function() return ms.pp.clip_grad_norm_(model, 1.0, { tensor = true, defer = opt }) end
elseif use_pp then
  model = ms.nn.functional.set_precision(model, { compute = 'bf16' })
  opt = ms.optim.AdamW(model, adam)
  clip = function()
    -- (pipelines data parallel: their gradients averaged first)
    if dp > 1 then ms.tp.all_reduce_grads(model, pp_mesh.replicate, 'avg') end
    return ms.pp.clip_grad_norm_(model, 1.0, { tensor = true, defer = opt })
  end
elseif use_fsdp then
  local head_unit = nil                              -- the default: a unit for an untied head
  if flags['head-in-root'] then head_unit = false end
  ms.fsdp.fully_shard(model, { policy = ms.fsdp.policy.by_class { block }, strategy = opts.strategy,
                               mixed_precision = { param = 'bf16', reduce = 'f32' },
                               head_unit = head_unit, prefetch_root = flags['prefetch-root'],
                               copy_gather = not flags['nccl-gather'],
                               float8_all_gather = flags['float8-gather'] or nil })
  opt = ms.fsdp.AdamW(model, adam)
  clip = function() return ms.fsdp.clip_grad_norm(model, 1.0, { defer = opt }) end
elseif use_ep then
  model = ms.nn.functional.set_precision(model, { compute = 'bf16' })
  opt = ms.optim.AdamW(model, adam)
  clip = function()
    ms.ep.all_reduce_grads(model)
    return ms.ep.clip_grad_norm_(model, 1.0, { defer = opt })
  end
else
  model = ms.nn.functional.set_precision(model, { compute = 'bf16' })
  opt = ms.optim.AdamW(model, adam)
  clip = function() return ms.optim.clip_grad_norm(model, 1.0, { tensor = true, defer = opt }) end
end

-- --cp N: the model's attention rings over groups of N consecutive ranks
local cp_ctx, cp_mesh
if opts.cp > 1 then
  assert(world % opts.cp == 0, 'bench/fsdp.lua: --cp must divide the world')
  if opts.cp < world then cp_mesh = ms.dist.mesh { replicate = world / opts.cp, shard = opts.cp } end
  cp_ctx = ms.cp.apply(model, cp_mesh and cp_mesh.shard or nil)
end

-- random tokens, four batches cycled, a different stream per rank
local V = model.config.vocab_size
local data = {}
for k = 1, 4 do
  -- (tensor parallelism: the same tokens on every rank)
  -- (pipelines: each data-parallel group its own)
  -- (context parallelism: one per group, each rank its tokens)
  local r = use_tp and 0 or use_pp and pp_mesh.coord[1] or cp_ctx and (cp_mesh and cp_mesh.coord[1] or 0) or rank
  local d = (ms.rand({ opts.batch, opts.seq + 1 }, { seed = 100 * (r + 1) + k,
    device = 'cuda' })
    * (V - 1)):long()
  data[k] = { d:narrow(2, 1, opts.seq):contiguous(), d:narrow(2, 2, opts.seq):contiguous() }
  if cp_ctx then data[k] = { ms.cp.shard(data[k][1], cp_ctx), ms.cp.shard(data[k][2], cp_ctx) } end
end

-- phases: CUDA events between the step's parts (GPU ms, summed over the
-- steps after the warm-up)
local ph_names = { 'zero_grad', 'forward', 'backward', 'clip', 'optimizer' }
local ph_ev, ph_sum, ph_n = {}, {}, 0
-- the host's time in the forward and the backward calls (unsynced: where a
-- phase's GPU time is no more than its host time, the host sets the pace)
local host_fb = { 0, 0 }
-- --jit-profile: samples of the forward calls (rank 0)
local in_fwd, prof_on = false, flags['jit-profile'] and rank == 0
local prof_vm, prof_leaf, prof_chain, prof_n = {}, {}, {}, 0
local jprof = prof_on and require 'jit.profile' or nil
if prof_on then
  jprof.start('fi1', function(th, samples, vmstate)
    if not in_fwd then return end
    prof_n = prof_n + samples
    prof_vm[vmstate] = (prof_vm[vmstate] or 0) + samples
    local leaf = jprof.dumpstack(th, 'F', 1)
    prof_leaf[leaf] = (prof_leaf[leaf] or 0) + samples
    local chain = jprof.dumpstack(th, 'F < ', 4)
    prof_chain[chain] = (prof_chain[chain] or 0) + samples
  end)
end
local function prof_report()
  if not prof_on then return end
  jprof.stop()
  local function top(t, n, what)
    local list = {}
    for k, v in pairs(t) do list[#list + 1] = { k, v } end
    table.sort(list, function(a, b) return a[2] > b[2] end)
    say(('jit.profile, forward calls, %d samples of 1 ms: by %s'):format(prof_n, what))
    for i = 1, math.min(n, #list) do say(('  %5.1f%%  %s'):format(100 * list[i][2] / math.max(prof_n, 1), list[i][1])) end
  end
  top(prof_vm, 6, 'VM state')
  top(prof_leaf, 25, 'function')
  top(prof_chain, 25, 'chain of callers')
end
for i = 1, #ph_names + 1 do ph_ev[i] = ms.cuda.event { timing = true } end
-- --mem-phases: each phase's peak and what it leaves allocated (GiB), for
-- the last step
local mem = flags['mem-phases'] and {} or nil
local function mark(i)
  if not mem then return end
  local s = ms.cuda.memory_stats()
  mem[i] = ('%s peak %.2f left %.2f'):format(ph_names[i - 1] or 'start', s.peak_allocated / 2 ^ 30, s.allocated / 2 ^ 30)
  ms.cuda.reset_peak_memory_stats()
end
local function step(k, timed)
  local d = data[(k - 1) % 4 + 1]
  if timed then ph_ev[1]:record() end
  mark(1)
  opt:zero_grad()
  if timed then ph_ev[2]:record() end
  mark(2)
  local loss
  local h0 = now()
  in_fwd = timed
  if pipe then
    loss = pipe:step(d[1], d[2])   -- (forward and backward together: the forward phase's time)
  else
    loss = model(d[1], d[2])
  end
  local h1 = now()
  in_fwd = false
  if timed then ph_ev[3]:record() end
  mark(3)
  if not pipe then loss:backward() end
  if timed then
    ph_ev[4]:record()
    host_fb[1], host_fb[2] = host_fb[1] + (h1 - h0), host_fb[2] + (now() - h1)
  end
  mark(4)
  clip()
  if timed then ph_ev[5]:record() end
  mark(5)
  opt:step()
  if timed then ph_ev[6]:record() end
  mark(6)
  local l = loss:item()
  if timed then
    for i = 1, #ph_names do ph_sum[i] = (ph_sum[i] or 0) + ph_ev[i]:elapsed_ms(ph_ev[i + 1]) end
    ph_n = ph_n + 1
  end
  return l
end

local steady0 = 0   -- the peak of the warm-up steps (measure('real'))
local function measure(label)
  local times, loss = {}, nil
  ph_sum, ph_n, host_fb = {}, 0, { 0, 0 }
  local s0
  for k = 1, opts.steps do
    if k == opts.warmup + 1 then
      s0 = ms.cuda.memory_stats()
      steady0 = s0.peak_allocated
      ms.cuda.reset_peak_memory_stats()   -- (the warm-up's peak kept in steady0)
    end
    local t0 = now()
    loss = step(k, k > opts.warmup)
    times[#times + 1] = now() - t0
    if k == 1 or k == opts.steps then say(('%s step %d loss %.4f dt %.1f ms'):format(label, k, loss, times[k] * 1e3)) end
  end
  local s1, parts = ms.cuda.memory_stats(), {}
  for i, nm in ipairs(ph_names) do parts[#parts + 1] = ('%s %.2f'):format(nm, ph_sum[i] / math.max(ph_n, 1)) end
  say(('%s: GPU ms a step: %s; over %d steps: %d cudaMalloc, %d cudaFree, %d host syncs'):format(label,
    table.concat(parts, ', '), ph_n, s1.num_mallocs - s0.num_mallocs, s1.num_frees - s0.num_frees,
    s1.num_host_syncs - s0.num_host_syncs))
  say(('%s: host ms a step in the forward call %.2f, in the backward call %.2f; blocked in host syncs %.2f'):format(
    label, host_fb[1] * 1e3 / math.max(ph_n, 1), host_fb[2] * 1e3 / math.max(ph_n, 1),
    (s1.host_sync_ms - s0.host_sync_ms) / math.max(ph_n, 1)))
  -- a MoE model: the last step's slots an expert got, summed over every
  -- rank's tokens (what each expert's rank computes under --ep), the
  -- busiest expert and the busiest rank's share over the mean
  local moe_layers = ms.nn.moe.layers(model)
  if #moe_layers > 0 then
    local E = moe_layers[1].n_experts
    local flat = {}
    for _, m in ipairs(moe_layers) do
      local c = m:last_stats()   -- (the counts: the scores' mean was released by the backward)
      for e = 1, E do flat[#flat + 1] = c and c[e] or 0 end
    end
    local t = ms.tensor(flat, { dtype = 'f64' })
    if world > 1 then
      t = t:to('cuda')
      ms.dist.all_reduce(t, 'sum')
      t = t:to('cpu')
    end
    local cp = ffi.cast('double *', t:data_ptr())
    local parts = {}
    for li = 1, #moe_layers do
      local sum, top, per = 0, 0, {}
      for e = 1, E do
        local v = cp[(li - 1) * E + e - 1]
        sum, top = sum + v, math.max(top, v)
        local r = math.floor((e - 1) * world / E) + 1
        per[r] = (per[r] or 0) + v
      end
      local busiest = 0
      for r = 1, world do busiest = math.max(busiest, per[r] or 0) end
      parts[#parts + 1] = ('%.2f/%.2f'):format(top / (sum / E), busiest / (sum / world))
    end
    say(('%s: MoE load, the last step, a layer (busiest expert / busiest rank of %d, over the mean): %s'):format(label,
      world, table.concat(parts, ' ')))
  end
  local tail = {}
  for k = opts.warmup + 1, #times do tail[#tail + 1] = times[k] end
  table.sort(tail)
  return tail[math.floor((#tail + 1) / 2)]
end

ms.cuda.reset_peak_memory_stats()
local med = measure('real')
prof_report()
if mem then say('memory by phase, last step: ' .. table.concat(mem, '; ', 2)) end
-- the peak of every step (the warm-up's first steps tune each GEMM shape
-- once) and of the timed steps alone
local steady = ms.cuda.memory_stats().peak_allocated
local peak = math.max(steady0, steady) / 2 ^ 30
say(('peak allocated GiB/GPU: %.2f over all steps, %.2f over the timed steps'):format(peak, steady / 2 ^ 30))
if ac_blocks > 0 then say(('activation checkpointing: %d blocks'):format(ac_blocks)) end
if float8_layers > 0 then say(('float8: %d linear layers (%s%s%s)'):format(float8_layers, opts.recipe, flags['float8-gather'] and ', f8 all-gathers' or '', flags.tp and ', TP scales ' .. opts['tp-scales'] or '')) end

-- --f8-precompute N: float8_all_gather's once-a-step work alone, N times
-- (after 2 untimed), each between two events on the compute stream; with
-- and without its all-reduce (set_skip_comm), and with tensorwise weights
-- their amaxes and casts a weight at a time (fsdp.f8_many_tensorwise =
-- false); median and mean in ms
if opts['f8-precompute'] > 0 then
  assert(flags['float8-gather'] and use_fsdp, 'bench/fsdp.lua: --f8-precompute needs --float8-gather under FSDP')
  local n = math.floor(opts['f8-precompute'])
  local ev0, ev1 = ms.cuda.event { timing = true }, ms.cuda.event { timing = true }
  local tw = 0
  for _, u in ipairs(ms.fsdp.units(model)) do
    for _, k in ipairs(u.f8 and u.f8.ks or {}) do if not u.f8.blk[k] then tw = tw + 1 end end
  end
  for _, v in ipairs({ 'all', 'skip', tw > 0 and 'per-weight' or nil }) do
    local skip = v == 'skip'
    if skip then ms.fsdp.set_skip_comm(model, true) end
    ms.fsdp.f8_many_tensorwise = v ~= 'per-weight'
    local t = {}
    for k = -1, n do
      ms.cuda.synchronize()
      ev0:record()
      ms.fsdp.float8_precompute(model)
      ev1:record()
      ev1:synchronize()
      if k >= 1 then t[#t + 1] = ev0:elapsed_ms(ev1) end
    end
    ms.fsdp.f8_many_tensorwise = true
    if skip then
      ms.fsdp.set_skip_comm(model, false)
      ms.fsdp.float8_precompute(model)   -- (the all-reduced maxima again, for what follows)
    end
    local sum = 0
    for _, x in ipairs(t) do sum = sum + x end
    table.sort(t)
    local units = 0
    for _, u in ipairs(ms.fsdp.units(model)) do if u.f8 then units = units + 1 end end
    local what = ({ all = '', skip = ' without its all-reduce',
      ['per-weight'] = (' with its %d tensorwise weights a launch or two each'):format(tw) })[v]
    say(('f8 precompute%s: median %.3f ms, mean %.3f ms over %d runs (%d float8 units)'):format(
      what, t[math.floor((#t + 1) / 2)], sum / #t, #t, units))
  end
end

-- one step with its collectives timed: what ran when on the communication
-- stream, and where the compute stream waited for it
local function timeline(k)
  local ev0, ev1 = ms.cuda.event { timing = true }, ms.cuda.event { timing = true }
  ms.cuda.synchronize()
  ms.dist.timing(true)
  ev0:record()
  step(k, false)
  ev1:record()
  ev1:synchronize()
  ms.dist.timing(false)
  local tl = ms.dist.timeline(ev0)
  say(('timeline: step of %.2f ms on the GPU, %d collectives (ms after the step start)'):format(ev0:elapsed_ms(ev1), #tl))
  say('| # | collective | issued | start | end | ms | wait | stood still ms |')
  say('|---|---|---|---|---|---|---|---|')
  local busy, still, by = 0, 0, {}
  for i, e in ipairs(tl) do
    local d = e.stop - e.start
    local st = e.wait and math.max(0, e.resumed - e.wait) or 0
    busy, still = busy + d, still + st
    local kind = e.desc:match('^(%S+)') or e.desc
    local b = by[kind] or { n = 0, ms = 0, still = 0 }
    by[kind] = b
    b.n, b.ms, b.still = b.n + 1, b.ms + d, b.still + st
    say(('| %d | %s | %.2f | %.2f | %.2f | %.3f | %s | %s |'):format(i, e.desc, e.issued, e.start, e.stop, d,
      e.wait and ('%.2f'):format(e.wait) or '-', e.wait and ('%.3f'):format(st) or '-'))
  end
  for kind, b in pairs(by) do
    say(('timeline: %s x%d: %.2f ms on the communication stream, compute stood still %.2f ms'):format(kind, b.n, b.ms, b.still))
  end
  say(('timeline: communication stream busy %.2f ms, compute stood still %.2f ms in all'):format(busy, still))
end
if world > 1 and flags.timeline then timeline(opts.steps + 1) end

local skipped
if use_fsdp and world > 1 and not flags['no-skip'] and ms.fsdp.set_skip_comm then
  ms.fsdp.set_skip_comm(model, true)
  skipped = measure('no-comm')
  ms.fsdp.set_skip_comm(model, false)
end
if use_tp and world > 1 and not flags['no-skip'] then
  ms.tp.set_skip_comm(true)
  skipped = measure('no-comm')
  ms.tp.set_skip_comm(false)
end

local cfg = model.config
local L = cfg.n_layer or cfg.num_hidden_layers
local C = cfg.n_embd or cfg.hidden_size
local tok = opts.batch * opts.seq / med / (use_tp and world or use_pp and world / dp or opts.cp)
local flops_tok = 6 * nactive + 6 * L * C * opts.seq
say(('| model | GPUs | mode | B/GPU | T | params | ms/step | tokens/s/GPU | TFLOP/s/GPU | peak GiB/GPU | exposed comm ms |'))
say('|---|---|---|---|---|---|---|---|---|---|---|')
say(('| %s | %d | %s | %d | %d | %.1fM | %.1f | %.0f | %.1f | %.2f | %s |'):format(opts.model, world,
  use_pp and ('pipeline%s, %s, %d micro-batches%s'):format(
    dp > 1 and (' %d x %s %d'):format(world / dp, flags['pp-fsdp'] and opts.strategy or 'data parallel', dp) or '',
    (opts.schedule == 'zbv' or opts.schedule == 'dualpipev') and opts.schedule or opts.chunks > 1 and ('%s x%d'):format(opts.schedule == 'looped_bfs'
      and 'looped_bfs' or 'interleaved', opts.chunks) or opts.schedule, opts.microbatches,
    (flags['no-overlap'] and ', no overlap' or '') .. (flags['no-grad-first'] and ', no grad first' or ''))
    or use_tp and (flags.sp and 'tensor + sequence parallel' or 'tensor parallel') or use_fsdp and (opts.strategy .. (flags['head-in-root'] and ', head in root' or '')
    .. (flags['prefetch-root'] and ', root prefetch' or '') .. (flags['nccl-gather'] and ', NCCL gathers' or '')
    .. (opts.cp > 1 and (', CP %d'):format(opts.cp) or '') .. (use_ep and ', EP' or '')) or use_ep and 'EP, no fsdp'
    or 'no fsdp', opts.batch, opts.seq, nparams / 1e6, med * 1e3, tok, tok * flops_tok / 1e12,
  peak, skipped and ('%.1f'):format((med - skipped) * 1e3) or '-'))
if use_fsdp or use_tp or use_pp or use_ep then ms.dist.destroy() end
