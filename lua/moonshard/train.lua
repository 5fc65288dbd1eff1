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
--
-- Sharded (docs/train.md, "Sharded training"): with several ranks (bin/train
-- --nproc-per-node N) the loop joins ms.dist, wraps the model with
-- ms.fsdp.fully_shard (--fsdp STRATEGY; NO_SHARD, plain data parallel, when
-- not given), gives each rank its rows of every batch, accumulates
-- micro-batches under no_sync, steps ms.fsdp.AdamW, averages the logged
-- losses over the ranks once per progress line, logs on rank 0 and
-- checkpoints through moonshard.fsdp_checkpoint in the same ckpt-<step>/
-- layout (resumable at another world size). A --tp, --pp or --ep run
-- checkpoints the same way, each rank writing what it holds (its slices
-- as boxes of the whole parameters, its stage's, its experts'), resumable
-- at any other layout (--checkpoint-format full: gathered into a
-- one-process checkpoint).
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
  { 'data', 'string?', nil, 'token shards (a folder of train_*.bin/val_*.bin from bin/tokenize, a glob, a .bin file) or training text (bytes); default: the repository\'s own source and docs' },
  { 'val_fraction', 'number>=0', 0.1, 'share of the data held out for validation (the tail; byte-level data)' },
  { 'val_data', 'string?', nil, 'validation token shards (a glob or a file) when --data is a glob of train shards' },
  { 'steps', 'int>0', 500, 'optimizer steps' },
  { 'batch_size', 'int>0', 16, 'sequences per step' },
  { 'seq_len', 'int>0', 128, 'tokens per sequence' },
  { 'lr', 'number>=0', 3e-3, 'peak learning rate' },
  { 'min_lr', 'number>=0?', nil, 'final learning rate of the decay (cosine, linear, wsd; default lr / 10)' },
  { 'warmup', 'int>=0', 30, 'linear warmup steps' },
  { 'lr_schedule', 'string', 'cosine', 'after the warmup: cosine (to min_lr over the run), linear (to min_lr over the run), wsd (warmup-stable-decay: lr until the last decay_fraction of the steps, then down to min_lr), constant' },
  { 'decay_fraction', 'number', 0.2, 'wsd: the fraction of the steps at the end that decays' },
  { 'decay_shape', 'string', 'linear', 'wsd: the decay\'s shape: linear, cosine or sqrt' },
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
  { 'progress', 'string', 'auto', 'progress display: auto (a line redrawn in place on a terminal, plain lines otherwise), tty or plain' },
  { 'device', 'string', os.getenv('MS_DEVICE') or 'cpu', 'where the model runs: cpu or cuda (MFU and GPU memory on the progress line); default: MS_DEVICE (bin/train --device) or cpu' },
  { 'peak_tflops', 'number>=0', 989, 'the device\'s peak TFLOP/s for MFU (H100 bf16 dense: 989)' },
  { 'tokens_per_step', 'int>=0', 0, 'accumulate micro-batches (batch_size x seq_len tokens each) until this many tokens per optimizer step (0: one micro-batch)' },
  { 'max_bad_steps', 'int>0', 5, 'stop after this many steps in a row with a NaN/inf loss or grad norm (each is skipped)' },
  { 'save_every', 'int>=0', 0, 'steps between checkpoints in out/ckpt-<step>/ (0: only on SIGINT/SIGTERM and --stop-at)' },
  { 'keep_checkpoints', 'int>=0', 3, 'keep the newest K checkpoints (0: all)' },
  { 'resume', 'string?', nil, 'continue from the newest complete checkpoint in out (bare --resume) or in DIR (a run folder or a ckpt-<step> folder), with its options and parallel layout (--tp, --pp, --cp, --ep, --fsdp and what refines them) unless given now (a --config file, then flags); other data-parallel ranks keep its tokens a step (the batch a rank derived); in one process without its --tp, --pp, --cp, --ep (docs/checkpoints.md)' },
  { 'stop_at', 'int>=0', 0, 'stop after this step with a checkpoint, as if interrupted (0: run to --steps)' },
  { 'inject_nan', 'string?', nil, 'test hook: comma-separated steps whose loss is made NaN' },
  { 'fsdp', 'string?', nil, 'shard the model with ms.fsdp.fully_shard: FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or off (a bare --fsdp: FULL_SHARD); default: off in one process, NO_SHARD (plain data parallel) with several ranks' },
  { 'autocast', 'string', 'auto', 'the forward in a bf16 autocast region (bf16: the matmuls and attention in it; the weights, gradients and optimizer state f32: docs/precision.md), or off; auto: bf16 on CUDA without --fsdp (one GPU, and --tp, --pp, --cp, --ep without it; under --fsdp its mixed precision sets the compute dtype), off on the CPU and with --dtype f64' },
  { 'fsdp_policy', 'string', 'auto', 'FSDP units: auto (the model file\'s fsdp_block, else the class of the modules in the largest list of identical children: GPT2Block, LlamaDecoderLayer), a class name, size:N (every module of at least N parameters), or none (one unit)' },
  { 'fsdp_mixed_precision', 'string', 'auto', 'FSDP dtypes PARAM/REDUCE of the gathered parameters and of the gradient reduction (bf16/f32, bf16/bf16, bf16 = bf16/f32), none, or auto: bf16/f32 on CUDA, none on CPU' },
  { 'tp', 'int>0', 1, 'tensor parallelism: TP ranks per group (ms.tp.parallelize: heads, MLPs, experts and the vocabulary split, Megatron-LM\'s layout), the other axis of the world data parallel (plain, or with --fsdp FULL_SHARD / SHARD_GRAD_OP sharded: FSDP x TP); with --ep M (a multiple of N) the MoE layers\' experts whole over groups of M / N TP groups instead, plain or under FSDP (also HYBRID_SHARD), with --cp and inside --pp stages too (docs/moe.md); --fsdp HYBRID_SHARD: the ranks that hold the same slices (with --pp P each stage\'s; --ep or not) sharded in groups of --shard-size of them, replicated across (torchtitan\'s dp_replicate x dp_shard x tp, x pp; docs/tp.md, docs/pp.md; with --ep and no --pp --shard-size counts whole ranks instead); checkpoints sharded, each rank writing its slices (--checkpoint-format), the final weights whole, one process\'s (docs/tp.md)' },
  { 'pp', 'int>0', 1, 'pipeline parallelism: stages per pipeline (ms.pp.pipeline: the blocks cut into consecutive stages, one a rank, micro-batches flowing through them), the other axis of the world data parallel (with --fsdp FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD each stage is sharded over it; HYBRID_SHARD: shard groups of --shard-size of a stage\'s data-parallel ranks, with --tp of those holding the same TP slice, replicated across; a model\'s multi-token-prediction depths on the last stage, with a copy of the embedding); checkpoints sharded (--checkpoint-format), the final weights whole, one process\'s (docs/pp.md)' },
  { 'async_checkpoint', 'bool', false, 'the --save-every checkpoints written by a background thread: a step waits only while the weights and optimizer state are copied to host memory (page-locked on GPUs, kept between saves), and the checkpoint is complete at the first step boundary after every rank has written its files; the next checkpoint, a stop and the end of the run wait for it (docs/checkpoints.md)' },
  { 'cp', 'int>0', 1, 'context parallelism: ranks per group that split each sequence (ms.cp: every rank holds --seq-len / N of each sequence\'s tokens, in load-balanced chunks; attention a ring over the group), the other axis of the world data parallel (plain, or sharded by --fsdp over every rank); with --tp M and/or --pp P the TP groups and pipelines inside (rank = ((d * N + c) * P + p) * M + t); with --ep E the expert groups E consecutive ranks of that order (a stage\'s with --pp; with --tp E / M whole TP groups), each rank routing its chunks\' rows (its sequence-parallel rows under --tp), the experts\' copies over the rest; --seq-len a multiple of 2N; checkpoints as without it (docs/cp.md)' },
  { 'pp_schedule', 'string', '1f1b', 'with --pp: 1f1b (Megatron-LM\'s order: a stage holds at most as many micro-batches\' activations as stages), zbh1 (1F1B with each micro-batch\'s weight gradients run later, the zero-bubble paper\'s ZB-H1: a third of the bubble at the same peak memory; not with --fsdp), zbv (the zero-bubble paper\'s ZB-V: 2 chunks a rank in a V, the embedding and the head on the first rank, the weight gradients run later: near no bubble at 1F1B\'s peak memory; at least 2 x --pp - 1 micro-batches; with --fsdp the weight gradients stay in the backward), dualpipev (DeepSeek\'s DualPipeV, torch\'s ScheduleDualPipeV: ZB-V\'s placement, a forward and another micro-batch\'s backward on the other chunk paired in the steady state, run in turn here, the pair\'s gradient received during its forward; the weight gradients split off in the warm-up and cool-down; one chunk\'s activations more than zbv, 2 x --pp + 1 chunks a rank; at least 2 x --pp micro-batches), gpipe (every forward, then every backward) or looped_bfs (GPipe over --pp-chunks > 1 chunks a rank) (docs/pp.md)' },
  { 'checkpoint_format', 'string?', nil, 'with --tp, --pp or --ep (--ep alone: without --fsdp): sharded (the default: every rank writes what it holds, in parallel, under the whole model\'s names: its TP slices as boxes of the whole parameters, its stage\'s, its experts\', its shard under --fsdp, each piece once; the --fsdp checkpoints\' format, resuming at any --tp, --pp, --ep, data-parallel size or --fsdp and in one process: docs/fsdp-checkpoints.md) or full (the model and its moments gathered, rank 0 writing a one-process checkpoint); --fsdp alone always writes sharded ones' },
  { 'pp_checkpoint', 'string?', nil, 'the older name of --checkpoint-format (which wins when both are given)' },
  { 'pp_chunks', 'int>0', 1, 'with --pp: model chunks a rank holds; more than 1 cuts the blocks into pp x chunks virtual stages and runs the interleaved 1F1B (Megatron-LM\'s virtual pipeline: a bubble that many times smaller; the micro-batches a multiple of --pp), or with --pp-schedule looped_bfs GPipe over the chunks; zbv and dualpipev always run 2 (docs/pp.md)' },
  { 'ep', 'int>0', 1, 'expert parallelism: ranks per group that split every mixture-of-experts layer\'s experts (ms.ep: E / N experts a rank; each rank\'s token rows sent to the ranks that hold their experts and back); every rank trains on its own batch, data parallel over the world; groups of consecutive ranks, each holding a copy of every expert; plain, or with --fsdp FULL_SHARD / SHARD_GRAD_OP the experts sharded over their copies and the rest over every rank, or with HYBRID_SHARD (the expert groups inside the shard groups) each shard group as FULL_SHARD, replicated across; with --cp each rank its chunks of its group\'s sequences; with --pp P each stage\'s experts split over groups of N of its world / P ranks (plain, FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD); with --tp T (N a multiple of T; plain, or with --fsdp FULL_SHARD / SHARD_GRAD_OP each rank\'s slices sharded over the ranks that hold the same ones and the experts over their copies, or with HYBRID_SHARD the same within each shard group of --shard-size ranks (whole expert groups), replicated across; with --pp P inside each stage, plain, FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD (shard groups of --shard-size data-parallel ranks of a stage\'s TP slice, whose TP groups hold whole expert groups: --shard-size x T a multiple of N); with --cp M too, rank = ((d * M + c) * P + p) * T + t, the expert groups N consecutive ranks of a stage\'s (d, c, t), plain, FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD) each group N / T whole tensor-parallel groups, the experts whole, each TP rank routing its own rows (its sequence-parallel rows, or its share of the replicated stream); not with --lora; checkpoints sharded, each rank writing its experts\' pieces (--checkpoint-format full: one process\'s without FSDP), resuming anywhere; the final weights whole (docs/moe.md)' },
  { 'moe_bias_rate', 'number>=0', 0, 'mixture-of-experts balancing without an auxiliary loss (DeepSeek-V3): each MoE layer gets an expert_bias added to the scores that choose the experts, moved by this rate towards balance after every step (the counts summed over the data-parallel ranks); 0: off (docs/moe.md)' },
  { 'pp_layers', 'string?', nil, 'with --pp: the blocks of each virtual stage, comma-separated (2,5,5,4: --pp x chunks counts, 0 allowed, summing to the model\'s blocks) in place of the default cut (one chunk a rank: the stages balanced, the head counted as 0.7 of its weight over a block\'s parameters; several, as --pp-chunks, zbv or dualpipev: the ranks\' work balanced, the head\'s chunk possibly the head alone) (docs/pp.md)' },
  { 'pp_microbatches', 'int>=0', 0, 'with --pp: pipeline micro-batches each batch is split into (0: --batch-size, one sequence each, as torchtitan\'s default)' },
  { 'tp_overlap', 'bool', true, 'with --tp: the split layers\' weight gradients computed while the collective of their input\'s gradient runs (async TP\'s backward; off: each collective then the GEMMs, as before; docs/tp.md)' },
  { 'sequence_parallel', 'bool?', nil, 'with --tp (also with --fsdp and --pp): the residual stream between the split layers held as each rank\'s tokens (norms and dropout on 1/N of them; with --pp the stages exchange those rows; docs/tp.md); default on, except with --pp, where it measured slower (docs/pp.md): --sequence-parallel turns it on there' },
  { 'shard_size', 'int>=0', 0, 'HYBRID_SHARD: ranks per shard group, replicated across the groups (0: the ranks of a node); with --tp T the data-parallel ranks of a TP slice per shard group, with --pp P those of a stage (of a stage\'s TP slice with --tp T too): torchtitan\'s dp_shard, dividing the world / T (/ P) of them, dp_replicate the quotient (0: a node\'s ranks / T (/ P); with --cp their context-parallel ranks counted in; with --pp --tp --ep M the shard group\'s S x T ranks hold whole expert groups); the one exception, --tp --ep without --pp: whole ranks, holding whole expert groups (docs/tp.md, docs/pp.md, docs/moe.md)' },
  { 'init_from', 'string?', nil, 'start from the weights and config of a Hugging Face folder (config.json + model.safetensors, as save_pretrained and --out write) instead of a fresh model: fine-tuning; --preset and --model.* do not apply; sharded runs read only each rank\'s shards' },
  { 'lora', 'int>=0', 0, 'LoRA adapters of this rank (R) on the model\'s projections (nn.apply_lora; 0: none): the rest of the model frozen, the final weights saved merged' },
  { 'lora_alpha', 'number>0?', nil, 'LoRA scale numerator: the update is alpha / r * B A (default: r)' },
  { 'lora_dropout', 'number>=0', 0, 'dropout on the LoRA branch\'s input' },
  { 'lora_targets', 'string', 'attn%.,mlp%.', 'comma-separated Lua patterns: the nn.Linear / nn.Conv1D modules whose names match get adapters' },
  { 'freeze', 'string?', nil, 'comma-separated Lua patterns: the parameters whose names match one are frozen (requires_grad off: no gradient, no optimizer step, also under FSDP); each pattern must match a parameter' },
  { 'float8', 'string', 'off', 'FP8 linear layers (moonshard.float8, torchao\'s float8 training): off, or a recipe: tensorwise (a bare --float8), rowwise, rowwise_with_gw_hp, blockwise (DeepSeek-V3\'s 1x128 / 128x128 blocks; layers with features multiples of 128): every nn.Linear / nn.Conv1D but the LM head computes its three products in FP8 with dynamic scales; CUDA needs an H100-class GPU, the CPU emulates it (docs/float8.md)' },
  { 'float8_all_gather', 'bool', false, 'with --float8 tensorwise or blockwise and --fsdp FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD: the float8 layers\' weights all-gathered as f8 bytes, cast from the shards with scales (blockwise: the 128 x 128 blocks\') all-reduced once a step (fully_shard\'s float8_all_gather, torchao\'s enable_fsdp_float8_all_gather; docs/fsdp.md)' },
  { 'float8_tp_scales', 'string', 'shard', 'with --float8 and --tp: shard (each rank scales its own shards: no collective) or group (the amax of every sharded operand all-reduced over the TP group: the unsplit layer\'s scales, as torchao over DTensors; docs/float8.md)' },
  { 'activation_checkpointing', 'string', 'none', 'activation checkpointing of the model\'s blocks (the class --fsdp-policy auto finds): none, full (every block: its activations recomputed in backward), N (every N-th block), or op (every block, keeping its attention outputs and every other linear layer\'s: torchtitan\'s op-level selective mode, less recompute for more memory)' },
  { 'release_activations', 'bool', true, 'free the activations a training step\'s backward has consumed at once (ms.autograd.release_activations), not when the Lua collector runs; --no-release-activations for model code that keeps activations across backward' },
  { 'cuda_graphs', 'bool', false, 'capture the training step (forward, backward, clipping: one CUDA graph; the AdamW step: another) after --graph-warmup eager steps and replay it every later step with one launch each (torch.compile mode="reduce-overhead", Megatron\'s --enable-cuda-graph): a host-bound step goes several times faster, with the bits of the eager one; --device cuda, one process or several data parallel (--fsdp off / NO_SHARD: the forward and backward captured, the gradient all-reduce after it, as with --no-overlap-grad-reduce, and the clipping eager between the graphs, or with --graph-collectives on recorded in the first graph, NCCL under capture; the AdamW step captured); with --float8 too; not with --tp, --pp, --ep, --cp, a sharding --fsdp, dropout or MoE layers; a step that cannot be captured is reported once and the run goes on eagerly (docs/cuda-graphs.md, "In bin/train")' },
  { 'overlap_grad_reduce', 'bool', true, 'with several processes data parallel (--fsdp off / NO_SHARD, no --tp, --pp, --ep, --cp): each unit\'s gradient all-reduce issued as its backward ends, overlapping the rest of the backward (DDP\'s buckets); --no-overlap-grad-reduce: every micro-batch\'s backward first, then all the all-reduces (Megatron\'s DDP without --overlap-grad-reduce): the same bits, less overlap; --cuda-graphs with several processes always reduces so (docs/train.md)' },
  { 'graph_collectives', 'string', 'off', 'with --cuda-graphs and several processes data parallel: on records the gradient all-reduce and the clipping into the step\'s first graph (NCCL under capture: a step is one replay, the host read of the losses and norm, the optimizer\'s replay); off (the default; on measured no faster on two H200s) keeps them eager between the two graphs; when on and the all-reduce cannot be captured, that is reported once and the run takes off\'s split (the same bits either way; one process: nothing to choose; docs/cuda-graphs.md)' },
  { 'graph_warmup', 'int>0', 3, 'with --cuda-graphs: eager steps before the capture (GEMM plans tuned, gradients and the optimizer state made), counted from the run\'s first step (a resumed run warms up again)' },
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
       option_by_name[key:sub(4)][2]:match('^bool') then
      key, neg = key:sub(4), true
    end
    local opt = option_by_name[key]
    local mfield = key:match('^model%.(.+)$')
    if opt then
      if key == 'resume' and val == nil and (args[i + 1] == nil or args[i + 1]:sub(1, 2) == '--') then
        val = 'latest' -- a bare --resume: the newest checkpoint in --out
      end
      if key == 'fsdp' and val == nil and (args[i + 1] == nil or args[i + 1]:sub(1, 2) == '--') then
        val = 'FULL_SHARD' -- a bare --fsdp
      end
      if key == 'float8' and val == nil and (args[i + 1] == nil or args[i + 1]:sub(1, 2) == '--') then
        val = 'tensorwise' -- a bare --float8
      end
      if opt[2]:match('^bool') and val == nil and (neg or args[i + 1] == nil or args[i + 1]:sub(1, 2) == '--') then
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

train.fsdp_strategies = { FULL_SHARD = true, SHARD_GRAD_OP = true, NO_SHARD = true, HYBRID_SHARD = true }

-- fsdp_mixed_precision -> nil (none) or { param =, reduce = }; auto: bf16 /
-- f32 on a GPU, none on the CPU
local mp_dtypes = { f32 = true, bf16 = true } -- (what the collectives carry, besides f64)
function train.mixed_precision(spec, device)
  spec = spec or 'auto'
  if spec == 'auto' then
    if device and device ~= 'cpu' then return { param = 'bf16', reduce = 'f32' } end
    return nil
  end
  if spec == 'none' or spec == 'off' then return nil end
  local p, r = spec:match('^([%w]+)/([%w]+)$')
  if not p then p, r = spec, 'f32' end
  if not mp_dtypes[p] or not mp_dtypes[r] then
    error(('expected PARAM/REDUCE dtypes (f32 or bf16: bf16/f32), none or auto, got %s'):format(describe(spec)), 0)
  end
  return { param = p, reduce = r }
end

-- the autocast dtype of a run (nil: none): --autocast, where auto is bf16
-- on a GPU without FSDP (under FSDP its mixed precision sets the compute
-- dtype: the gathered parameters'), and off on the CPU and in f64
function train.autocast_dtype(o, device, strategy)
  local a = o.autocast or 'auto'
  if a == 'off' then return nil end
  if a == 'auto' then
    if device == nil or device == 'cpu' or o.dtype == 'f64' or strategy then return nil end
    return 'bf16'
  end
  return a
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
  if o.autocast and o.autocast ~= 'auto' and o.autocast ~= 'off' and o.autocast ~= 'bf16' then
    -- (f16 would need loss scaling, which the loop does not do)
    usage('%s: autocast must be auto, bf16 or off, got %s', where, describe(o.autocast))
  end
  if o.autocast == 'bf16' and o.dtype == 'f64' then
    usage('%s: autocast bf16 needs dtype f32 (got dtype f64: an f64 model computes in f64)', where)
  end
  if o.device and o.device ~= 'cpu' and o.device ~= 'cuda' and not o.device:match('^cuda:%d+$') then
    usage('%s: device must be cpu or cuda, got %s', where, describe(o.device))
  end
  if o.progress and o.progress ~= 'auto' and o.progress ~= 'tty' and o.progress ~= 'plain' then
    usage('%s: progress must be auto, tty or plain, got %s', where, describe(o.progress))
  end
  if o.fsdp ~= nil then
    local v = o.fsdp:upper():gsub('-', '_')
    if v == 'OFF' or v == 'NONE' or v == 'FALSE' or v == 'NO' then v = 'off'
    elseif v == 'TRUE' or v == 'YES' or v == 'ON' then v = 'FULL_SHARD' end
    if v ~= 'off' and not train.fsdp_strategies[v] then
      usage('%s: fsdp must be FULL_SHARD, SHARD_GRAD_OP, NO_SHARD, HYBRID_SHARD or off, got %s', where, describe(o.fsdp))
    end
    o.fsdp = v
  end
  if o.fsdp_mixed_precision ~= nil then
    local ok, err = pcall(train.mixed_precision, o.fsdp_mixed_precision, 'cpu')
    if not ok then usage('%s: fsdp_mixed_precision: %s', where, tostring(err)) end
  end
  if o.lr_schedule ~= nil and not ({ cosine = true, linear = true, wsd = true, constant = true })[o.lr_schedule] then
    usage('%s: lr_schedule must be cosine, linear, wsd or constant, got %s', where, describe(o.lr_schedule))
  end
  if o.decay_fraction ~= nil and not (o.decay_fraction > 0 and o.decay_fraction <= 1) then
    usage('%s: decay_fraction must be in (0, 1], got %s', where, describe(o.decay_fraction))
  end
  if o.decay_shape ~= nil and not ({ linear = true, cosine = true, sqrt = true })[o.decay_shape] then
    usage('%s: decay_shape must be linear, cosine or sqrt, got %s', where, describe(o.decay_shape))
  end
  if o.float8 ~= nil and o.float8 ~= 'off' and not require('moonshard.float8').recipes[o.float8] then
    usage('%s: float8 must be off, tensorwise, rowwise, rowwise_with_gw_hp or blockwise, got %s', where, describe(o.float8))
  end
  for _, k in ipairs({ 'checkpoint_format', 'pp_checkpoint' }) do
    if o[k] ~= nil and o[k] ~= 'sharded' and o[k] ~= 'full' then
      usage('%s: %s must be sharded or full, got %s', where, k, describe(o[k]))
    end
  end
  if o.pp_schedule ~= nil and not ({ ['1f1b'] = true, gpipe = true, zbh1 = true, zbv = true, dualpipev = true,
      looped_bfs = true })[o.pp_schedule] then
    usage('%s: pp_schedule must be 1f1b, zbh1, zbv, dualpipev, gpipe or looped_bfs, got %s', where,
      describe(o.pp_schedule))
  end
  if o.pp_layers ~= nil and (o.pp_layers .. ','):gsub('%d+,', '') ~= '' then
    usage('%s: pp_layers must be blocks per virtual stage, comma-separated counts (2,5,5,4), got %s', where,
      describe(o.pp_layers))
  end
  if o.graph_collectives ~= nil and o.graph_collectives ~= 'on' and o.graph_collectives ~= 'off' then
    usage('%s: graph_collectives must be on or off, got %s', where, describe(o.graph_collectives))
  end
  if o.float8_tp_scales ~= nil and o.float8_tp_scales ~= 'shard' and o.float8_tp_scales ~= 'group' then
    usage('%s: float8_tp_scales must be shard or group, got %s', where, describe(o.float8_tp_scales))
  end
  if o.activation_checkpointing ~= nil then
    local v = tostring(o.activation_checkpointing)
    local n = tonumber(v)
    if not (v == 'none' or v == 'full' or v == 'op' or (n and n >= 1 and n % 1 == 0)) then
      usage('%s: activation_checkpointing must be none, full, op or a whole number N >= 1 (every N-th block), got %s',
        where, describe(o.activation_checkpointing))
    end
  end
  if o.fsdp_policy ~= nil then
    local v = o.fsdp_policy
    local n = v:match('^size:(.*)$')
    if n and not (tonumber(n) and tonumber(n) >= 1) then
      usage('%s: fsdp_policy size:N needs a number N >= 1, got %s', where, describe(v))
    end
  end
  return o
end

-- --cuda-graphs: what it cannot combine with, refused before anything is
-- built (o: resolved options; world: the processes of the run). A capture
-- records one process's kernels with their host numbers frozen: the
-- collectives inside the layers of --tp / --ep / --cp (plain data
-- parallel's all-reduce after the backward is recorded with the step, or
-- run between the graphs with --graph-collectives off, so several
-- processes of it are taken), a pipeline's host-driven schedule, FSDP's storage
-- released and made again each step (the sharding strategies), a random
-- draw (dropout: every replay would draw the same mask) and a host read
-- of the routing counts (MoE) do not fit in it. (The model's own dropout
-- and MoE layers are checked once it is built: train.check_cuda_graphs_model)
function train.check_cuda_graphs(o, world)
  if not o.cuda_graphs then return end
  local function no(fmt, ...)
    usage('--cuda-graphs with ' .. fmt .. ' (run without --cuda-graphs, or --no-cuda-graphs on a resume)', ...)
  end
  local dev = o.device or 'cpu'
  if dev == 'cpu' then
    usage('--cuda-graphs needs --device cuda (got --device cpu: CUDA graphs record GPU kernels; run without '
      .. '--cuda-graphs, or --no-cuda-graphs on a resume)')
  end
  -- (several processes: plain data parallel, the gradient all-reduce
  -- recorded after the backward, or run between the two graphs)
  for _, k in ipairs({ 'tp', 'pp', 'ep', 'cp' }) do
    if (o[k] or 1) > 1 then
      no('--%s %d: its collectives and schedule are host-driven between the kernels', k, o[k])
    end
  end
  if o.fsdp ~= nil and o.fsdp ~= 'off' and o.fsdp ~= 'NO_SHARD' then
    no('--fsdp %s: FSDP frees and gathers its parameters\' storage each step, where a graph needs fixed addresses '
      .. '(several processes data parallel, --fsdp off or NO_SHARD, do capture)', o.fsdp)
  end
  -- (--float8's dynamic scales are device tensors: the amaxes, scales and
  -- casts are kernels of the step, no host read, no history between steps)
  if (o.lora_dropout or 0) > 0 then
    no('--lora-dropout %g: a replay would draw the same dropout mask every step', o.lora_dropout)
  end
  if (o.moe_bias_rate or 0) > 0 then
    no('--moe-bias-rate %g: mixture-of-experts routing reads its counts on the host', o.moe_bias_rate)
  end
end

-- the built model's side of --cuda-graphs: dropout with p > 0 (named by
-- the config field when the model has one, else by the module) and MoE
-- layers are refused
function train.check_cuda_graphs_model(o, model)
  if not o.cuda_graphs then return end
  local cfg = model.config or {}
  local keys = {}
  for k, v in pairs(cfg) do
    if type(k) == 'string' and k:find('drop') and type(v) == 'number' and v > 0 then keys[#keys + 1] = k end
  end
  table.sort(keys)
  if #keys > 0 then
    local given = {}
    for _, k in ipairs(keys) do given[#given + 1] = ('--model.%s %g'):format(k, cfg[k]) end
    usage('--cuda-graphs with dropout (%s): a replay would draw the same mask every step; set %s to 0',
      table.concat(given, ', '), #keys == 1 and 'it' or 'them')
  end
  for name, m in model:named_modules() do
    local p = m:class_name() == 'Dropout' and m.p
    if type(p) == 'number' and p > 0 then
      usage('--cuda-graphs with dropout: the module %s has p = %g (a replay would draw the same mask every step)',
        name ~= '' and name or '(the model)', p)
    end
  end
  local moe = ms.nn.moe and ms.nn.moe.layers(model) or {}
  if #moe > 0 then
    usage('--cuda-graphs with a mixture-of-experts model (%d MoE layers): the routing reads its counts on the host',
      #moe)
  end
end

-- --cuda-graphs' graph A, data parallel (docs/cuda-graphs.md, "In
-- bin/train"): c.capture(with_reduce) -> graph, results | nil, why: the
-- step captured with its gradient all-reduce and clipping (true), or
-- without them (false: they run eagerly between the graphs). With c.coll
-- (--graph-collectives on) the first is tried; c.agree(ok) -> whether every
-- rank's capture succeeded (nil: one process), asked whatever this rank's
-- outcome, so that every rank takes the same path: a graph made here when
-- another rank's failed is given to c.discard(graph). When the graph with
-- the all-reduce is not made, c.warn(message) says so once, naming why,
-- and the step is captured without it. Returns the graph, the results and
-- whether the graph holds the all-reduce, or nil and why the capture
-- without it failed as well (the caller then trains on eagerly).
function train.capture_graph_a(c)
  local g, out, coll = nil, nil, c.coll and true or false
  if coll then
    g, out = c.capture(true)
    local why = not g and out or nil
    if c.agree then
      local all = c.agree(g ~= nil)
      if g and not all then
        c.discard(g)
        g, why = nil, 'another rank\'s capture of it failed'
      end
    end
    if not g then
      coll = false
      c.warn(('--cuda-graphs: the gradient all-reduce could not be captured with the step; capturing the step '
        .. 'without it, the all-reduce and %s eager between the graphs (as --graph-collectives off): %s'):format(
        c.clipping and 'clipping' or 'the norm', tostring(why)))
    end
  end
  if not g then
    g, out = c.capture(false)
    if not g then return nil, out end
  end
  return g, out, coll
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

-- the options of a run config file (--config), checked
local function load_config(path)
  local chunk, err = loadfile(path)
  if not chunk then usage('config: %s', err) end
  local ok, v = pcall(chunk)
  if not ok then usage('config: %s: %s', path, tostring(v)) end
  if type(v) ~= 'table' then usage('config: %s does not return a table of options', path) end
  return train.check_options(v, path)
end

-- train.resolve(model_spec, args | opts) -> M, resolved options
function train.resolve(opts)
  opts = opts or {}
  local given = {}
  for k, v in pairs(opts) do given[k] = v end
  local cfgfile = given.config and load_config(given.config) or {}
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
  local S, kind = ms.optim.schedule, o.lr_schedule or 'cosine'
  local f
  if kind == 'cosine' then
    f = S.cosine{ lr = o.lr, warmup = warmup, total = o.steps, min_lr = min_lr }
  elseif kind == 'linear' then
    f = S.wsd{ lr = o.lr, warmup = warmup, stable = 0, decay = o.steps - warmup, min_lr = min_lr }
  elseif kind == 'wsd' then
    -- the decay: the last decay_fraction of the steps (at least one), after the warmup
    local decay = math.max(1, math.min(o.steps - warmup, math.floor(o.steps * (o.decay_fraction or 0.2) + 0.5)))
    f = S.wsd{ lr = o.lr, warmup = warmup, stable = o.steps - warmup - decay, decay = decay, min_lr = min_lr,
      shape = o.decay_shape or 'linear' }
  else
    f = S.constant{ lr = o.lr, warmup = warmup }
  end
  return function(step) return f(step - 1) end
end

local function sanitize(s)
  return (s:gsub('[%z\1-\8\11-\31\127]', '?'))
end

-- JSON with every object's keys sorted (run.json): checkpoint.encode
function train.encode_sorted(obj) return require('moonshard.checkpoint').encode(obj) end

-- one JSON object per line, "step" first, the other keys sorted; numbers
-- with 17 significant digits, so a loss read back is the loss computed
-- (bitwise comparisons of runs, resume specs)
local function json_number(v)
  if v ~= v or v == math.huge or v == -math.huge then return 'null' end
  if v == math.floor(v) and math.abs(v) < 2 ^ 53 then return ('%d'):format(v) end
  return ('%.17g'):format(v)
end
train.json_number = json_number
local function jsonl_line(f, obj)
  local keys = {}
  for k in pairs(obj) do keys[#keys + 1] = k end
  table.sort(keys, function(a, b)
    if a == 'step' then return b ~= 'step' end
    if b == 'step' then return false end
    return a < b
  end)
  local parts = {}
  for _, k in ipairs(keys) do
    local v = obj[k]
    local enc
    if type(v) == 'number' then enc = json_number(v)
    elseif type(v) == 'table' then enc = json.encode(v)
    else enc = json.encode(v) end
    parts[#parts + 1] = json.quotestring(k) .. ':' .. enc
  end
  f:write('{', table.concat(parts, ','), '}\n')
  f:flush()
end

-- mean loss over a fixed set of validation batches (the same every time)
function train.evaluate(model, loader, iters)
  return train.evaluate_on(model, loader, iters)
end
-- the same, with batches moved by to_device(x, y) -> x, y
function train.evaluate_on(model, loader, iters, to_device, forward)
  local was = model.training
  model:eval()
  local total = 0
  forward = forward or model
  ms.no_grad(function()
    for k = 0, iters - 1 do
      local x, y = loader:batch(k)
      if to_device then x, y = to_device(x, y) end
      total = total + forward(x, y):item()
    end
  end)
  if was then model:train() end
  return total / iters
end

-- ---------------------------------------------------------------- signals
-- SIGINT and SIGTERM stop a run cleanly: the step in flight finishes, a
-- checkpoint is written, the run returns (bin/train exits 0). No work, and
-- no Lua, runs in a signal handler: a LuaJIT callback cannot safely run as a
-- handler (it may interrupt compiled code, or land on one of OpenBLAS's or
-- OpenMP's threads). Instead bin/train blocks both signals before the
-- library starts any thread (every thread inherits the mask, so the kernel
-- keeps the signal pending for the process instead of killing it), and the
-- loop takes a pending one with a zero-timeout sigtimedwait between steps:
-- the "flag" is the kernel's pending set. train.run handles signals only
-- when its caller blocked them, so in a REPL Ctrl-C interrupts as usual.
pcall(ffi.cdef, [[
typedef struct { unsigned long val[16]; } ms_train_sigset;
int ms_train_sigemptyset(ms_train_sigset *s) asm("sigemptyset");
int ms_train_sigaddset(ms_train_sigset *s, int sig) asm("sigaddset");
int ms_train_sigismember(const ms_train_sigset *s, int sig) asm("sigismember");
int ms_train_sigprocmask(int how, const ms_train_sigset *set, ms_train_sigset *old) asm("pthread_sigmask");
int ms_train_sigtimedwait(const ms_train_sigset *set, void *info, const ms_train_timespec *t) asm("sigtimedwait");
int ms_train_isatty(int fd) asm("isatty");
]])
local SIGINT, SIGTERM, SIG_BLOCK, SIG_UNBLOCK = 2, 15, 0, 1
local stop_set = ffi.new('ms_train_sigset')
ffi.C.ms_train_sigemptyset(stop_set)
ffi.C.ms_train_sigaddset(stop_set, SIGINT)
ffi.C.ms_train_sigaddset(stop_set, SIGTERM)
train.signal_names = { [SIGINT] = 'SIGINT', [SIGTERM] = 'SIGTERM' }

-- block (true) or unblock (false) SIGINT/SIGTERM in the calling thread
function train.block_signals(on)
  ffi.C.ms_train_sigprocmask(on == false and SIG_UNBLOCK or SIG_BLOCK, stop_set, nil)
end
-- are SIGINT and SIGTERM blocked in the calling thread?
function train.signals_blocked()
  local cur = ffi.new('ms_train_sigset')
  ffi.C.ms_train_sigprocmask(SIG_BLOCK, nil, cur)
  return ffi.C.ms_train_sigismember(cur, SIGINT) == 1 and ffi.C.ms_train_sigismember(cur, SIGTERM) == 1
end
-- the number of a pending SIGINT/SIGTERM (taken off the pending set), or nil
local zero_ts = ffi.new('ms_train_timespec')
function train.take_signal()
  local sig = ffi.C.ms_train_sigtimedwait(stop_set, nil, zero_ts)
  if sig > 0 then return sig end
  return nil
end

function train.isatty(fd) return ffi.C.ms_train_isatty(fd or 1) == 1 end

-- ------------------------------------------------------------------- run
local ckpt = require 'moonshard.checkpoint'

-- ------------------------------------------------------------------- fsdp
-- The class of a model's blocks, the FSDP units of `--fsdp-policy auto`:
-- the model file's `fsdp_block` (a class or a class name) when it declares
-- one, else found in the model: among the children of every module, grouped
-- by class, the largest group of one class (a list container's children
-- first: nn.ModuleList / Sequential, so `transformer.h`'s GPT2Blocks and
-- `model.layers`' LlamaDecoderLayers win even at one layer; ties go to the
-- group with more parameters). nil when the model has no such children.
local function numel_of(m)
  local n = 0
  for _, p in m:named_parameters() do n = n + p:numel() end
  return n
end
function train.block_class(M, model)
  if M and M.fsdp_block then
    local b = M.fsdp_block
    return type(b) == 'string' and b or (rawget(b, '__name') or b)
  end
  local best
  local function better(c)
    if not best then return true end
    if c.list ~= best.list then return c.list end
    if c.count ~= best.count then return c.count > best.count end
    return c.params > best.params
  end
  for _, m in model:named_modules() do
    local cls = m:class_name()
    local is_list = cls == 'ModuleList' or cls == 'Sequential'
    local groups, order = {}, {}
    for _, cn in ipairs(m._module_names) do
      local c = rawget(m, cn)
      if c ~= nil then
        local k = c:class_name()
        if not groups[k] then groups[k] = { class = k, count = 0, params = 0, list = is_list }; order[#order + 1] = k end
        groups[k].count = groups[k].count + 1
      end
    end
    for _, k in ipairs(order) do
      local g = groups[k]
      -- a group counts when a list holds it or a module has two or more alike
      if (g.list or g.count >= 2) and k ~= 'ModuleList' and k ~= 'Sequential' then
        for _, cn in ipairs(m._module_names) do
          local c = rawget(m, cn)
          if c ~= nil and c:class_name() == k then g.params = g.params + numel_of(c); break end
        end
        if better(g) then best = g end
      end
    end
  end
  return best and best.class or nil
end

-- --fsdp-policy -> a policy for fully_shard and a description for the log
function train.fsdp_policy(M, model, spec)
  local fsdp = ms.fsdp
  spec = spec or 'auto'
  if spec == 'none' then return function() return false end, 'none (one unit)' end
  local n = spec:match('^size:(.*)$')
  if n then return fsdp.policy.by_size(tonumber(n)), ('modules of >= %s parameters'):format(n) end
  local cls = spec
  if spec == 'auto' then
    cls = train.block_class(M, model)
    if not cls then return function() return false end, 'none found (one unit)' end
  else
    local found = false
    for _, m in model:named_modules() do if m:class_name() == cls then found = true; break end end
    if not found then usage('--fsdp-policy: the model has no module of class %s', cls) end
  end
  return fsdp.policy.by_class { cls }, cls
end

-- --data names token shards (read by moonshard.shards through data.open)
-- when it is a folder, a glob or a .bin file; anything else is text
function train.is_shard_data(spec)
  if type(spec) ~= 'string' then return false end
  if spec:match('%.bin$') or spec:find('[%*%?]') then return true end
  local r = os.execute('test -d ' .. data.shell_quote(spec))
  return r == 0 or r == true
end

local function finite(v) return v == v and v ~= math.huge and v ~= -math.huge end

-- (list[g[1]], list[g[2]], ... of one dtype and device, in one copy)
local function stacked_values(list, g)
  local parts = {}
  for j = 1, #g do parts[j] = list[g[j]]:reshape({ 1 }) end
  local s = ms.cat(parts)
  local r = s:totable()
  s:free()
  return r
end

-- The numbers of a step's one-element tensors (its micro-batches' losses,
-- the multi-token prediction's) read together: the tensors of one dtype and
-- device are stacked there and copied to the host at once, one
-- synchronisation instead of one a tensor. The values are item()'s to the
-- bit (cat copies, the host copy widens to f64 exactly). list[1..n] holds
-- tensors, numbers or nothing; the result has numbers at the tensors'
-- places, the numbers as they were.
function train.host_values(list, n)
  local out, groups, order = {}, {}, {}
  for i = 1, n do
    local v = list[i]
    if T.is_tensor(v) then
      local key = v.dtype_id .. ':' .. v.device_id
      local g = groups[key]
      if not g then g = {}; groups[key] = g; order[#order + 1] = g end
      g[#g + 1] = i
    else
      out[i] = v
    end
  end
  for _, g in ipairs(order) do
    if #g == 1 then
      out[g[1]] = list[g[1]]:item()
    else
      local vals = ms.no_grad(stacked_values, list, g)
      for j = 1, #g do out[g[j]] = vals[j] end
    end
  end
  return out
end

local function read_lines(path)
  local f = io.open(path, 'rb')
  if not f then return {} end
  local lines = {}
  for line in f:lines() do lines[#lines + 1] = line end
  f:close()
  return lines
end

-- where a --resume points: the folder holding ckpt-<step>/ folders, and the
-- newest step allowed (a ckpt-<step> folder given itself)
local function resume_root(o)
  local r = o.resume
  if r == 'latest' or r == 'true' then
    if not o.out then usage('--resume needs --out (the run folder) or a folder: --resume DIR') end
    return o.out, nil
  end
  r = r:gsub('/+$', '')
  local parent, step = r:match('^(.*)/ckpt%-(%d+)$')
  if not parent and r:match('^ckpt%-%d+$') then parent, step = '.', r:match('(%d+)$') end
  if parent then return parent, tonumber(step) end
  return r, nil
end

-- the newest complete checkpoint for a --resume, corrupt ones reported and skipped
local function find_resume(o, warn)
  local root, max_step = resume_root(o)
  local skipped = {}
  for _, c in ipairs(ckpt.list(root)) do
    if not max_step or c.step <= max_step then
      local ok, err = train.verify_checkpoint(c.path)
      if ok then return c, root end
      skipped[#skipped + 1] = err
      warn(('checkpoint %s is corrupt: %s; using the previous one'):format(c.path, err))
    end
  end
  if #skipped > 0 then
    usage('--resume: no complete checkpoint in %s (%s)', root, table.concat(skipped, '; '))
  end
  usage('--resume: no checkpoint in %s (ckpt-<step>/ folders)', root)
end

-- ---------------------------------------------------- several ranks
-- One process per rank (bin/train --nproc-per-node N, mpirun, srun): the
-- loop joins ms.dist (MPI on the CPU, NCCL on CUDA), shards the model with
-- ms.fsdp.fully_shard, gives each rank its own rows of every batch, and
-- keeps the ranks in step: rank 0 logs and writes the run's files, the
-- numbers it prints are reduced over the ranks.
local dist = require 'moonshard.dist'

-- collective(t) run on the numbers of list as one f64 tensor on the
-- backend's device; returns the numbers it leaves there
local function numbers_through(list, collective)
  local host = T.tensor(list, { dtype = 'f64' })
  local dev = dist.device()
  local t = dev ~= 'cpu' and host:to(dev) or host
  collective(t)
  local back = t ~= host and t:to('cpu') or t
  local r = back:totable()
  if back ~= t then back:free() end
  if t ~= host then t:free() end
  host:free()
  return r
end
-- every rank's numbers reduced ('sum', 'avg', 'max'): one collective of
-- f64 on the backend's device
local function reduce_numbers(list, op)
  return numbers_through(list, function(t) dist.all_reduce(t, op) end)
end
-- rank 0's numbers on every rank
local function broadcast_numbers(list)
  return numbers_through(list, function(t) dist.broadcast(t, 0) end)
end
train.reduce_numbers, train.broadcast_numbers = reduce_numbers, broadcast_numbers

-- after a step only rank 0 runs (ok: whether it succeeded on this rank), the
-- other ranks raise msg when it failed on rank 0 (collective with several ranks)
local function raise_if_rank0_failed(ok, msg)
  if dist.is_initialized() and dist.world_size() > 1 then
    local flag = reduce_numbers({ ok and 0 or 1 }, 'max')[1]
    if flag > 0 and ok then error(msg, 0) end
  end
end

-- ------------------------------------------------ sharded checkpoints
-- A run whose model is sharded (--fsdp, or several ranks) checkpoints
-- through moonshard.fsdp_checkpoint, in the run's layout: DIR/ckpt-<step>/
-- holds the sharded checkpoint (rank-<r>-of-<W>.safetensors from every
-- rank, index.json), state.json as one process writes it, and
-- manifest.json, written last by rank 0 with every file's bytes and CRC-32
-- and `sharded = true`. It is written into ckpt-<step>.tmp/ and renamed,
-- then the newest --keep-checkpoints are kept, as checkpoint.save does. It
-- loads at any world size and strategy, and into a model without FSDP.
local function fck() return require 'moonshard.fsdp_checkpoint' end

local function read_json_file(path)
  local f = io.open(path, 'rb')
  if not f then return nil end
  local s = f:read('*a')
  f:close()
  local v = json.decode(s, 1, nil)
  return type(v) == 'table' and v or nil
end

-- is dir a sharded checkpoint (written by an FSDP run)?
function train.is_sharded_checkpoint(dir)
  local f = io.open(dir .. '/index.json', 'rb')
  if f then f:close(); return true end
  return false
end

-- verify_checkpoint(dir) -> true | nil, message: checkpoint.verify for
-- either kind (a sharded one needs index.json and state.json)
function train.verify_checkpoint(dir)
  local man = read_json_file(dir .. '/manifest.json')
  if not (man and man.sharded) then return ckpt.verify(dir) end
  if type(man.files) ~= 'table' then return nil, ('%s/manifest.json is not a valid manifest'):format(dir) end
  return ckpt.verify_files(dir, man, { 'index.json', 'state.json' })
end

-- save_sharded_checkpoint(root, step, { model =, optimizer =, state = }, { keep = }) -> path
-- Collective: every rank of a sharded model calls it.
-- With opts.writer (a checkpoint.writer()), the rank's file is staged and
-- written by the writer's thread, and a pending save is returned:
-- p.ready() (this rank's file is written), p.finish() -> path (collective).
function train.save_sharded_checkpoint(root, step, parts, opts)
  opts = opts or {}
  local final = root .. '/' .. ckpt.name(step)
  local tmp = final .. '.tmp'
  local state = parts.state or {}
  state.step = state.step or step
  local state_json = ckpt.encode(state) .. '\n'   -- (as it is now, whenever the save completes)
  local inner = fck().save_sharded(parts.model, tmp, { optimizer = parts.optimizer, step = step, writer = opts.writer })
  local function conclude()
    if opts.writer then inner.finish() end
    local rank = dist.is_initialized() and dist.rank() or 0
    local ok, err = true, nil
    if rank == 0 then
      ok, err = pcall(function()
        local f = assert(io.open(tmp .. '/state.json', 'wb'))
        f:write(state_json)
        f:close()
        local index = fck().read_index(tmp)
        local man = { step = step, format = 1, sharded = true, world_size = index.world_size, files = {} }
        for _, e in ipairs(index.files) do man.files[e.file] = { bytes = e.bytes, crc32 = e.crc32 } end
        ckpt.manifest_add(man, tmp, { 'index.json', 'state.json' })
        ckpt.finish(root, tmp, final, man, opts.keep)
      end)
    end
    raise_if_rank0_failed(ok, ('checkpoint: rank 0 could not write %s (see its error)'):format(final))
    if not ok then error(err, 0) end
    return final
  end
  if not opts.writer then return conclude() end
  local done
  return { ready = inner.ready, finish = function() done = done or conclude(); return done end }
end

-- a checkpoint of a single-process run (model.safetensors) into a sharded
-- model: the plain model, before fully_shard, takes the weights; rank 0
-- rewrites them with the optimizer state as a sharded checkpoint in a
-- temporary folder, which every rank loads after fully_shard. Returns a
-- function(model, opt) that loads it and removes the folder.
local function plain_to_sharded(path, model, plain_optimizer)
  local rank = dist.is_initialized() and dist.rank() or 0
  local tmp = path .. '.sharded'
  local ok, err = true, nil
  if rank == 0 then
    ok, err = pcall(function()
      local opt = plain_optimizer()
      ckpt.load(path, { model = model, optimizer = opt })
      fck().save_sharded(model, tmp, { optimizer = opt })
    end)
  end
  raise_if_rank0_failed(ok, ('resume from %s: rank 0 could not convert it (see its error)'):format(path))
  if not ok then error(('resume from %s: %s'):format(path, tostring(err)), 0) end
  return function(m, opt)
    local info = fck().load_sharded(m, tmp, { optimizer = opt })
    if dist.is_initialized() and dist.world_size() > 1 then dist.barrier() end
    if rank == 0 then ckpt.remove(tmp) end
    return info
  end
end

-- options a resumed run never takes from its checkpoint (what to resume,
-- where to stop, test hooks); every other one it takes unless given now
local not_resumed = { resume = true, stop_at = true, config = true, inject_nan = true }

-- The parallel layout a resumed run takes from its checkpoint, as it ran,
-- unless given now (each axis on its own: --fsdp FULL_SHARD on a resume of a
-- --tp 2 run is FSDP x TP; --tp 1 says the TP is gone). The options that
-- refine an axis come with it only when that axis is the checkpoint's: a
-- --pp 4 given on a --pp 2 run does not take its --pp-layers.
-- In one process (no launcher) a checkpoint resumes without its tp, pp, cp
-- and ep (and what refines them): there is no layout to keep there.
local layout_axes = { 'tp', 'pp', 'cp', 'ep', 'fsdp' }
local layout_refines = { pp_schedule = 'pp', pp_chunks = 'pp', pp_layers = 'pp', pp_microbatches = 'pp',
  sequence_parallel = 'tp', float8_tp_scales = 'tp', shard_size = 'fsdp' }
local layout_order = { 'tp', 'pp', 'cp', 'ep', 'fsdp', 'shard_size', 'pp_schedule', 'pp_chunks', 'pp_microbatches',
  'pp_layers', 'sequence_parallel', 'float8_tp_scales' }

-- the flags of a layout (only what differs from the defaults)
local function layout_flags(opts, keys)
  local parts = {}
  for _, k in ipairs(keys) do
    local v, d = opts[k], option_by_name[k][3]
    if v ~= nil and v ~= d then
      local flag = '--' .. k:gsub('_', '-')
      if v == true then parts[#parts + 1] = flag
      elseif v == false then parts[#parts + 1] = '--no-' .. k:gsub('_', '-')
      else parts[#parts + 1] = flag .. ' ' .. tostring(v) end
    end
  end
  return table.concat(parts, ' ')
end

-- train.resume_layout(saved options, options given now, world size) ->
-- the saved options a resumed run keeps (its layout's among them), the flags
-- of the layout it took from them ('' when none; in one process: of the one
-- it left), and whether it left it. A usage error when the world cannot host
-- the layout taken.
function train.resume_layout(saved, given, world)
  local kept, taken, left = {}, {}, {}
  for k, v in pairs(saved) do
    if option_by_name[k] and not not_resumed[k] or k == 'model_config' then kept[k] = v end
  end
  local function now(k)   -- a layout option as the run will have it
    if given[k] ~= nil then return coerce(option_by_name[k][2], given[k], '--' .. k:gsub('_', '-'), 'options') end
    if kept[k] ~= nil then return kept[k] end
    return option_by_name[k][3]
  end
  for _, k in ipairs(layout_axes) do
    if given[k] == nil and kept[k] ~= nil then
      if world == 1 and k ~= 'fsdp' and kept[k] > 1 then left[k], kept[k] = kept[k], nil
      else taken[k] = true end
    end
  end
  for k, axis in pairs(layout_refines) do
    if given[k] == nil and kept[k] ~= nil then
      if left[axis] or now(axis) ~= saved[axis] then kept[k] = nil else taken[k] = true end
    end
  end
  -- HYBRID_SHARD's --shard-size counts whole ranks under --tp --ep without
  -- --pp and the data-parallel ranks of a TP slice otherwise (the same
  -- with --tp 1): a shard size taken into the other convention is
  -- converted, the shard groups keeping their ranks (S ranks = S x T)
  local notes = {}
  if taken.shard_size and kept.shard_size > 0 and now('fsdp') == 'HYBRID_SHARD' then
    local function whole(tp, pp, ep) return tp > 1 and ep > 1 and pp <= 1 end
    local s_tp, s_pp, s_ep = saved.tp or 1, saved.pp or 1, saved.ep or 1
    local tp, pp, ep = now('tp'), now('pp'), now('ep')
    if whole(s_tp, s_pp, s_ep) ~= whole(tp, pp, ep) then
      local S = kept.shard_size
      local ranks = whole(s_tp, s_pp, s_ep) and S or S * s_tp
      local was = ('--shard-size %d (%s under the checkpoint\'s %s)'):format(S,
        whole(s_tp, s_pp, s_ep) and 'whole ranks' or 'data-parallel ranks of a tensor-parallel slice',
        layout_flags(saved, { 'tp', 'pp', 'ep' }))
      local flags_now = layout_flags({ tp = tp, pp = pp, ep = ep }, { 'tp', 'pp', 'ep' })
      if flags_now == '' then flags_now = '--tp 1' end
      if whole(tp, pp, ep) then
        kept.shard_size = ranks
        notes[#notes + 1] = ('resume: %s counts whole ranks at %s: --shard-size %d, shard groups of %d ranks as '
          .. 'before'):format(was, flags_now, ranks, ranks)
      elseif ranks % tp == 0 then
        kept.shard_size = ranks / tp
        notes[#notes + 1] = ('resume: %s counts the data-parallel ranks of a tensor-parallel slice at %s: '
          .. '--shard-size %d, shard groups of %d ranks as before'):format(was, flags_now, ranks / tp, ranks)
      else
        kept.shard_size, taken.shard_size = nil, nil
        notes[#notes + 1] = ('resume: %s, shard groups of %d ranks, is no whole number of %d-rank tensor-parallel '
          .. 'groups at %s: the default shard size (give --shard-size to choose)'):format(was, ranks, tp, flags_now)
      end
    end
  end
  local function keys_of(set)
    local r = {}
    for _, k in ipairs(layout_order) do if set[k] then r[#r + 1] = k end end
    return r
  end
  local left_keys = keys_of(left)
  if #left_keys > 0 then return kept, layout_flags(left, left_keys), true, notes end
  local flags = layout_flags(kept, keys_of(taken))
  -- the ranks it needs: pipelines of --pp stages, each stage's ranks a
  -- multiple of the TP x CP groups and of the expert groups
  local tp, pp, cp, ep = now('tp'), now('pp'), now('cp'), now('ep')
  local function gcd(x, y) while y ~= 0 do x, y = y, x % y end return x end
  local need = pp * (tp * cp) * ep / gcd(tp * cp, ep)
  local from, ones, others = {}, {}, {}
  for _, k in ipairs({ 'tp', 'pp', 'cp', 'ep' }) do
    if taken[k] and kept[k] > 1 then
      from[#from + 1] = ('--%s %d'):format(k, kept[k])
      ones[#ones + 1] = ('--%s 1'):format(k)
    elseif given[k] ~= nil and now(k) > 1 then
      others[#others + 1] = ('--%s %d'):format(k, now(k))
    end
  end
  if world % need ~= 0 and #from > 0 then
    usage('--resume: the checkpoint\'s layout %s%s needs a multiple of %d ranks and this run has %d; launch it on %d '
      .. '(bin/train --nproc-per-node %d) to go on as it ran, or give the layout to resume it in (e.g. %s: the '
      .. 'checkpoint is resharded)', table.concat(from, ' '),
      #others > 0 and (' with %s given'):format(table.concat(others, ' ')) or '', need, world, need, need,
      table.concat(ones, ' '))
  end
  return kept, flags, false, notes
end

-- train.resume_batch(checkpoint state, options kept (train.resume_layout's),
-- options given now, world size) -> the batch size and tokens per step a
-- resumed run takes and a line saying so, or nothing when it keeps its
-- checkpoint's. A resume whose data-parallel ranks (world / (tp x pp x
-- cp)) are not the checkpoint's keeps the checkpoint's tokens per step
-- (the global batch), as torchtitan keeps global_batch_size: each rank's
-- sequences a step, R = tokens / (seq_len x data-parallel ranks), run as
-- micro-batches of the largest --batch-size up to the checkpoint's that
-- divides R (with --pp-microbatches kept, a multiple of it); unless
-- --batch-size, --seq-len or --tokens-per-step is given. R not whole is a
-- usage error naming the numbers and the options to give.
function train.resume_batch(st, kept, given, world)
  local saved = st.options or {}
  if given.batch_size ~= nil or given.seq_len ~= nil or given.tokens_per_step ~= nil then return end
  local function now(k)
    if given[k] ~= nil then return coerce(option_by_name[k][2], given[k], '--' .. k:gsub('_', '-'), 'options') end
    if kept[k] ~= nil then return kept[k] end
    return option_by_name[k][3]
  end
  local batch, seq, tps_opt = now('batch_size'), now('seq_len'), now('tokens_per_step')
  -- the checkpoint's tokens a step (a one-process checkpoint does not
  -- write them: its batch and accumulation say)
  local tokens = st.tokens_per_step
  if tokens == nil then
    if saved.batch_size == nil or saved.seq_len == nil then return end
    tokens = (saved.tokens_per_step or 0) > 0 and saved.tokens_per_step or saved.batch_size * saved.seq_len
  end
  local split = now('tp') * now('pp') * now('cp')
  if world % split ~= 0 then return end   -- (the layout's own checks say what is wrong)
  local dp = world / split
  -- the tokens a step the kept options give, as the loop counts them
  local micro = batch * seq * dp
  local as_is
  if tps_opt > 0 then as_is = tps_opt % micro == 0 and tps_opt or nil else as_is = micro end
  if as_is == tokens then return end
  local ranks = ('%d data-parallel rank%s'):format(dp, dp == 1 and '' or 's')
  if tokens % (seq * dp) ~= 0 then
    usage('--resume: the checkpoint\'s %d tokens a step (%g sequences of --seq-len %d) do not split over the %s of '
      .. 'this layout (the world of %d over --tp x --pp x --cp = %d); give --batch-size (with --tokens-per-step for '
      .. 'the tokens a step), or a layout whose data-parallel ranks divide %g', tokens, tokens / seq, seq, ranks, world,
      split, tokens / seq)
  end
  local per_rank = tokens / (seq * dp)
  local pm = now('pp') > 1 and now('pp_microbatches') or 0
  local b = math.min(batch, per_rank)
  while b > 0 and (per_rank % b ~= 0 or (pm > 0 and b % pm ~= 0)) do b = b - 1 end
  if b == 0 then
    usage('--resume: the checkpoint\'s %d tokens a step are %d sequences a step on each of the %s of this run, '
      .. 'and no --batch-size up to its %d that divides them is a multiple of --pp-microbatches %d; give '
      .. '--batch-size and --pp-microbatches (or --tokens-per-step)', tokens, per_rank, ranks, batch, pm)
  end
  local n = per_rank / b
  local line = ('resume: --batch-size %d, %d micro-batch%s a step, on %s: derived to keep the checkpoint\'s %d '
    .. 'tokens a step (it ran --batch-size %d; give --batch-size or --tokens-per-step to choose)'):format(b, n,
    n == 1 and '' or 'es', ranks, tokens, batch)
  return b, (n > 1 or tps_opt > 0) and tokens or 0, line
end

-- train.config_changes(config path, the checkpoint's options, the config
-- file's, the command line's) -> the line a resume logs: the options the
-- config file changes against the checkpoint (those the command line does
-- not give in turn), as flags
function train.config_changes(path, saved, cfg, cli)
  local function shown(v) return type(v) == 'string' and v or tostring(v) end
  local parts = {}
  local keys = {}
  for k in pairs(cfg) do if k ~= 'model_config' and cli[k] == nil then keys[#keys + 1] = k end end
  table.sort(keys)
  for _, k in ipairs(keys) do
    local v, was = cfg[k], saved[k]
    if was == nil then was = option_by_name[k][3] end
    if v ~= was and not not_resumed[k] then
      parts[#parts + 1] = ('--%s %s (was %s)'):format(k:gsub('_', '-'), shown(v), was == nil and 'unset' or shown(was))
    end
  end
  local fields, smc, cmc = {}, saved.model_config or {}, cli.model_config or {}
  for f in pairs(cfg.model_config or {}) do if cmc[f] == nil then fields[#fields + 1] = f end end
  table.sort(fields)
  for _, f in ipairs(fields) do
    local v, was = cfg.model_config[f], smc[f]
    if v ~= was then
      parts[#parts + 1] = ('--model.%s %s (was %s)'):format(f, shown(v), was == nil and 'unset' or shown(was))
    end
  end
  if #parts == 0 then return ('resume: --config %s changes no option against the checkpoint'):format(path) end
  return ('resume: --config %s changes against the checkpoint: %s'):format(path, table.concat(parts, ', '))
end

-- train.run(options) -> summary { steps, final_loss, first_loss, val_loss,
-- elapsed_s, tokens_per_s, out, sample, model, interrupted, bad_steps,
-- checkpoint }
-- options as train.options (model: a path, a module name or a model table).
-- With several ranks in the environment (RANK/WORLD_SIZE, mpirun, srun)
-- it joins ms.dist first (unless the caller did) and trains data-parallel.
function train.run(opts)
  opts = opts or {}
  local warn = function(msg) io.stderr:write('bin/train: ', msg, '\n'); io.stderr:flush() end
  local M, o
  local cfg_model, cfg_out, cfg_device
  if opts.resume and opts.model == nil and opts.config ~= nil then
    local cfg = load_config(opts.config)
    cfg_model, cfg_out, cfg_device = cfg.model, cfg.out, cfg.device
  end
  if opts.resume and opts.model == nil and (opts.config == nil or cfg_model == nil) then
    -- `bin/train --resume DIR`: the checkpoint names the model (with a
    -- --config that does not name one too; its --out is where to look)
    o = { resume = coerce('string', opts.resume, '--resume', 'options'), out = opts.out or cfg_out,
      device = opts.device or cfg_device }
  else
    M, o = train.resolve(opts)
  end

  -- several ranks: join the run (MPI on the CPU, NCCL on CUDA)
  local env_world = dist.env().world_size
  local function join()   -- MPI on the CPU, NCCL on a GPU
    local dev = o.device or opts.device or os.getenv('MS_DEVICE') or 'cpu'
    dist.init { backend = dev == 'cpu' and 'mpi' or 'nccl', device = dev ~= 'cpu' and dev or nil }
  end
  if not dist.is_initialized() and (env_world > 1 or o.fsdp == 'HYBRID_SHARD') then join() end
  local rank = dist.is_initialized() and dist.rank() or 0
  local world = dist.is_initialized() and dist.world_size() or 1
  local multi = world > 1

  -- a restarted run (bin/train --max-restarts) goes on from the newest
  -- checkpoint in its folder when there is one, as if --resume were given
  local restart = tonumber(os.getenv('MS_RESTART_COUNT') or '') or 0
  if restart > 0 and not o.resume and o.out and #ckpt.list(o.out) > 0 then
    o.resume = 'latest'
    if rank == 0 then warn(('restart %d: resuming from the newest checkpoint in %s'):format(restart, o.out)) end
  end

  -- resume: the checkpoint's options, then the ones given now
  local resume
  if o.resume then
    local c, root
    if multi then
      -- rank 0 verifies the checkpoints; every rank takes the one it chose
      local okr, a, b = true, nil, nil
      if rank == 0 then okr, a, b = pcall(find_resume, o, warn) end
      local step = broadcast_numbers({ (rank ~= 0 or okr) and (rank == 0 and a.step or 0) or -1 })[1]
      if step < 0 then
        if rank == 0 then error(a, 0) end
        usage('--resume: rank 0 found no checkpoint to resume from (see its message)')
      end
      root = resume_root(o)
      c = { step = step, path = root .. '/' .. ckpt.name(step) }
    else
      c, root = find_resume(o, warn)
    end
    local st = ckpt.load(c.path).state
    -- the options, by increasing precedence: the checkpoint's, the config
    -- file given now (--config), the command line; what the two given
    -- layers name counts as given (a tp = 4 in the config file is a --tp 4)
    local given, cfg = {}, opts.config and load_config(opts.config)
    if cfg then merge(given, cfg) end
    local cli = {}
    for k, v in pairs(opts) do if k ~= 'config' then cli[k] = v end end
    merge(given, cli)
    -- the checkpoint's options, its layout unless given now
    local merged, layout, left, notes = train.resume_layout(st.options or {}, given, world)
    -- another data-parallel width: the global batch stays the checkpoint's
    -- (tokens per step) unless the batch is given now
    local bsz, tps, bline = train.resume_batch(st, merged, given, world)
    if bsz then merged.batch_size, merged.tokens_per_step = bsz, tps; notes[#notes + 1] = bline end
    if cfg then notes[#notes + 1] = train.config_changes(opts.config, st.options or {}, cfg, cli) end
    merge(merged, given)
    -- the run goes on in the folder its checkpoint was found in (it may
    -- have moved since), unless --out (or the config file) says otherwise
    if given.out == nil then merged.out = root end
    merged.resume = nil
    if type(opts.model) == 'table' then merged.model = opts.model end
    M, o = train.resolve(merged)
    o.resume = opts.resume or 'latest'
    o.config = opts.config   -- (in run.json and the options saved; never taken from a checkpoint)
    resume = { path = c.path, state = st, sharded = train.is_sharded_checkpoint(c.path), layout = layout,
      layout_left = left, notes = notes }
  elseif o.out and #ckpt.list(o.out) > 0 then
    -- a fresh run in the folder of an earlier one would truncate its
    -- metrics.jsonl, and its own checkpoints would sit among the earlier
    -- run's (pruned at once when those have later steps; a --resume then
    -- takes the earlier run's)
    usage('--out %s holds checkpoints of an earlier run (%s): --resume to continue it, or another --out',
      o.out, ckpt.name(ckpt.list(o.out)[1].step))
  end

  -- a HYBRID_SHARD checkpoint resumed in one process (`bin/train --resume
  -- DIR`): the strategy came from the checkpoint, after the join above
  if not dist.is_initialized() and o.fsdp == 'HYBRID_SHARD' then join() end
  -- --cuda-graphs: what it cannot combine with (the model's side once it is built)
  train.check_cuda_graphs(o, world)

  -- sharding: --fsdp, or plain data parallel (NO_SHARD) with several ranks
  local strategy = o.fsdp
  -- --tp N: tensor parallel groups of N ranks (mesh.shard), data
  -- parallelism across them (mesh.replicate): plain (gradients all-reduced)
  -- or, with --fsdp FULL_SHARD / SHARD_GRAD_OP, each rank's slices sharded
  -- over its mesh.replicate group (FSDP x TP), or with HYBRID_SHARD over
  -- shard groups of --shard-size of that group's ranks, replicated across
  -- (tp_mesh.hybrid, below); sharded checkpoints (each rank its slices'
  -- boxes), whole-model ones with --checkpoint-format full
  local tp_size, tp_mesh = o.tp, nil
  local data_rank, data_world = rank, world
  if tp_size > 1 then
    if world % tp_size ~= 0 then
      usage('--tp %d: the world of %d rank%s is not a multiple of it (bin/train --nproc-per-node N)', tp_size, world,
        world == 1 and '' or 's')
    end
    -- (HYBRID_SHARD: shard groups of the ranks that hold the same slices,
    -- made below once the groups can be; with --pp each stage's, made with
    -- the pipelines; with --ep M, without --pp: shard groups of whole
    -- expert groups of --shard-size ranks, made with the expert groups)
    if o.lora > 0 then usage('--tp with --lora: not supported (merge the adapters first)') end
    if strategy == nil or strategy == 'off' or strategy == 'NO_SHARD' then strategy = nil end
    tp_mesh = dist.mesh { replicate = world / tp_size, shard = tp_size }
    data_rank, data_world = tp_mesh.coord[1], world / tp_size
  end
  -- --pp N: pipelines of N stages (mesh.shard, consecutive ranks), data
  -- parallelism across them (mesh.replicate, gradients all-reduced);
  -- sharded checkpoints, each rank writing its stage's pieces (whole-model
  -- ones with --checkpoint-format full)
  -- every rank takes part in making every group (a collective each);
  -- ranks_of(i, j) lists group (i, j)'s ranks, this rank keeps its own
  local function mine(n_i, n_j, ranks_of)
    local kept
    for i = 0, n_i - 1 do
      for j = 0, n_j - 1 do
        local g = dist.new_group(ranks_of(i, j))
        if g:is_member() then kept = g else g:free() end
      end
    end
    return kept
  end
  local function along(n, f) local r = {}; for k = 0, n - 1 do r[#r + 1] = f(k) end; return r end
  if tp_mesh and strategy == 'HYBRID_SHARD' and o.pp <= 1 and o.ep <= 1 then
    -- --tp T --fsdp HYBRID_SHARD (2-D HSDP x TP: torchtitan's dp_replicate x
    -- dp_shard x tp): rank r = j * T + t, the ranks that hold slice t (the
    -- same t, tp_mesh.replicate: D = world / T of them; with --cp C their
    -- context-parallel ranks counted in, j = d * C + c) are the slice's
    -- data-parallel axis, cut into shard groups of S consecutive j
    -- (--shard-size S counts them, as with --pp --tp: dp_shard; D / S is
    -- dp_replicate); default the slice's ranks on one node (a node's
    -- ranks / T): shard within a node, replicate across nodes
    local D = world / tp_size
    local S = o.shard_size > 0 and o.shard_size
      or math.max(1, math.min(D, math.floor(dist.local_world_size() / tp_size)))
    if D % S ~= 0 then
      local axis = o.cp > 1 and 'data- and context-parallel' or 'data-parallel'
      usage('--tp %d --fsdp HYBRID_SHARD: --shard-size %d%s does not divide the %d %s rank%s of a tensor-parallel '
        .. 'slice (the world of %d over %d TP ranks; --shard-size counts those ranks: %s)', tp_size, S,
        o.shard_size > 0 and '' or ' (the default: a node\'s ranks / --tp)', D, axis, D == 1 and '' or 's', world,
        tp_size, D == 1 and '1' or ('1, or a divisor of %d'):format(D))
    end
    tp_mesh.hybrid = {
      shard = mine(tp_size, D / S, function(t, g)
        return along(S, function(k) return (g * S + k) * tp_size + t end) end),
      replicate = mine(tp_size, S, function(t, k)
        return along(D / S, function(g) return (g * S + k) * tp_size + t end) end),
    }
  end
  local pp_size, pp_mesh = o.pp, nil
  if pp_size > 1 then
    if world % (pp_size * tp_size) ~= 0 then
      if tp_size > 1 then
        usage('--pp %d with --tp %d: the world of %d rank%s is not a multiple of %d (bin/train --nproc-per-node N)',
          pp_size, tp_size, world, world == 1 and '' or 's', pp_size * tp_size)
      end
      usage('--pp %d: the world of %d rank%s is not a multiple of it (bin/train --nproc-per-node N)', pp_size, world,
        world == 1 and '' or 's')
    end
    -- --fsdp FULL_SHARD / SHARD_GRAD_OP / HYBRID_SHARD: each stage sharded
    -- over the data-parallel ranks that hold it (FSDP x PP); otherwise the
    -- pipelines' gradients are all-reduced
    if strategy == 'off' or strategy == 'NO_SHARD' then strategy = nil end
    if strategy and o.pp_schedule == 'zbh1' and o.pp_chunks == 1 then
      usage('--pp-schedule zbh1 with --fsdp %s: a sharded stage reduces its gradients at the end of each backward, '
        .. 'before the weight gradients zbh1 runs later; use --pp-schedule 1f1b', strategy)
    end
    if tp_size > 1 then
      -- 3-D: TP pairs innermost (consecutive ranks), then the stages, then
      -- data parallelism; rank r = (d * pp + p) * tp + t
      local t, p, d = rank % tp_size, math.floor(rank / tp_size) % pp_size, math.floor(rank / (tp_size * pp_size))
      local dp = world / (tp_size * pp_size)
      local pp_group = mine(dp, tp_size, function(dd, tt)
        return along(pp_size, function(q) return (dd * pp_size + q) * tp_size + tt end) end)
      local dp_group = mine(pp_size, tp_size, function(q, tt)
        return along(dp, function(dd) return (dd * pp_size + q) * tp_size + tt end) end)
      tp_mesh.replicate:free()
      tp_mesh = { shard = tp_mesh.shard, replicate = dp_group, coord = { d, t } }
      pp_mesh = { shard = pp_group, replicate = dp_group, coord = { d, p } }
      data_rank, data_world = d, dp
    else
      pp_mesh = dist.mesh { replicate = world / pp_size, shard = pp_size }
      data_rank, data_world = pp_mesh.coord[1], world / pp_size
    end
    if strategy == 'HYBRID_SHARD' then
      -- each stage's data-parallel ranks as a mesh of their own: shard
      -- groups of --shard-size (default: those on one node), replicated
      -- across the groups; rank (d, stage, t) = (d * pp + stage) * tp + t.
      -- With --tp T the data-parallel axis is a stage's ranks that hold the
      -- same slices (the same t): --shard-size counts those (torchtitan's
      -- dp_shard; dp_replicate = dp / S), each TP rank's copy of its
      -- slices sharded over S of them, replicated over the rest
      local dp, tpn = data_world, math.max(tp_size, 1)
      local S = o.shard_size > 0 and o.shard_size
        or math.max(1, math.min(dp, math.floor(dist.local_world_size() / (pp_size * tpn))))
      if dp % S ~= 0 then
        if tpn > 1 then
          usage('--pp %d --tp %d --fsdp HYBRID_SHARD: --shard-size %d does not divide the %d data-parallel ranks of a '
            .. 'stage\'s tensor-parallel slice (the world of %d over %d stages x %d TP ranks; --shard-size counts '
            .. 'those ranks: 1, or a divisor of %d)', pp_size, tpn, S, dp, world, pp_size, tpn, dp)
        end
        usage('--pp %d --fsdp HYBRID_SHARD: --shard-size %d does not divide the %d data-parallel ranks of a stage', pp_size,
          S, dp)
      end
      local function r_of(dd, q, tt) return (dd * pp_size + q) * tpn + tt end
      local shard = mine(pp_size * tpn, dp / S, function(qt, j)
        return along(S, function(k) return r_of(j * S + k, math.floor(qt / tpn), qt % tpn) end) end)
      local replicate = mine(pp_size * tpn, S, function(qt, k)
        return along(dp / S, function(j) return r_of(j * S + k, math.floor(qt / tpn), qt % tpn) end) end)
      pp_mesh.hybrid = { shard = shard, replicate = replicate }
    end
  end
  -- --cp N: groups of N ranks split each sequence, data parallelism across
  -- them; the gradients are averaged (or sharded, --fsdp) over every rank
  -- (with --tp / --pp: over the ranks of the same TP index and stage), as
  -- each rank's loss is the mean over its tokens. The TP groups are
  -- innermost, then the pipelines, then the context-parallel groups:
  -- rank r = ((d * N + c) * P + p) * M + t (4-D with all three)
  local cp_size, cp_group = o.cp, nil
  if cp_size > 1 then
    -- the stride between a context-parallel group's ranks: the TP groups
    -- and pipelines (consecutive ranks) inside it
    local tpn = math.max(tp_size, 1) * math.max(pp_size, 1)
    if world % (cp_size * tpn) ~= 0 then
      if tpn > 1 then
        local with = (pp_size > 1 and (' --pp %d'):format(pp_size) or '') .. (tp_size > 1 and (' --tp %d'):format(tp_size) or '')
        usage('--cp %d with%s: the world of %d rank%s is not a multiple of %d (bin/train --nproc-per-node N)',
          cp_size, with, world, world == 1 and '' or 's', cp_size * tpn)
      end
      usage('--cp %d: the world of %d rank%s is not a multiple of it (bin/train --nproc-per-node N)', cp_size, world,
        world == 1 and '' or 's')
    end
    if o.seq_len % (2 * cp_size) ~= 0 then
      usage('--cp %d: --seq-len %d is not a multiple of %d (each rank holds two chunks of every sequence)', cp_size,
        o.seq_len, 2 * cp_size)
    end
    if cp_size == world then
      cp_group = dist.get_world_group()
    else
      cp_group = mine(world / (cp_size * tpn), tpn, function(d, t)
        return along(cp_size, function(c) return (d * cp_size + c) * tpn + t end) end)
    end
    data_rank, data_world = math.floor(rank / (cp_size * tpn)), world / (cp_size * tpn)
  end
  -- --ep N: groups of N consecutive ranks split every MoE layer's experts;
  -- every rank trains on its own tokens (data parallel over the world, or
  -- its chunks of its context-parallel group's sequences), the
  -- ranks at the same place in each group hold the same experts (the
  -- replicate group); the gradients reduced by ms.ep (plain) or by FSDP's
  -- units (--fsdp); one-process checkpoints without FSDP, sharded with it
  -- With --pp P: each stage's data-parallel ranks (rank = d * P + stage)
  -- split the stage's experts in groups of N consecutive d, the same place
  -- in each group holding the same experts; ms.ep.parallelize runs on the
  -- stage, after the cut
  local ep_size, ep_group, ep_rep = o.ep, nil, nil
  local ep_hybrid   -- (--tp --ep --fsdp HYBRID_SHARD: fully_shard's mesh and expert_shard)
  if ep_size > 1 then
    if world % ep_size ~= 0 then
      usage('--ep %d: the world of %d rank%s is not a multiple of it (bin/train --nproc-per-node N)', ep_size, world,
        world == 1 and '' or 's')
    end
    if tp_size > 1 then
      -- --tp N --ep M: each expert group of M consecutive ranks holds M / N
      -- whole tensor-parallel groups, whose ranks each route their own rows
      -- (docs/moe.md, "Expert and tensor parallelism"); plain, or with
      -- --fsdp FULL_SHARD / SHARD_GRAD_OP each rank's slices sharded over
      -- the ranks that hold the same ones and the experts over their
      -- copies (HYBRID_SHARD: the shard groups below). With --cp C too
      -- (rank = (j * P + p) * N + t, j = d * C + c) the expert groups are
      -- M consecutive ranks all the same: M / N consecutive j's TP groups,
      -- the ranks of a context-parallel ring or of several data-parallel
      -- ones, each routing its own chunks' rows; the experts' copies are
      -- the ranks at the same place in the other groups, their gradients
      -- summed over them and divided by the C x D TP groups, the rest
      -- averaged over the ranks of the same TP index (tp_mesh.replicate,
      -- which the context-parallel ranks are in), as --tp --cp does
      if ep_size % tp_size ~= 0 then
        usage('--ep %d with --tp %d: --ep must be a multiple of --tp (an expert group holds whole tensor-parallel '
          .. 'groups of consecutive ranks: --ep %d, %d, ...)', ep_size, tp_size, tp_size, 2 * tp_size)
      end
    end
    -- (a stage's ranks: its data-parallel ranks, and with --cp M the
    -- context-parallel ranks of each: world / P in all)
    local stage_world = world / pp_size
    if pp_size > 1 and stage_world % ep_size ~= 0 then
      usage('--ep %d with --pp %d: the %d %s of each stage (the world of %d over %d stages) %s not a multiple of %d',
        ep_size, pp_size, stage_world, stage_world == 1 and 'rank' or 'ranks', world, pp_size,
        stage_world == 1 and 'is' or 'are', ep_size)
    end
    if pp_size > 1 and strategy == 'HYBRID_SHARD' then
      -- each stage's shard groups (S consecutive of its data-parallel
      -- ranks, pp_mesh.hybrid) must hold whole expert groups; the ranks of
      -- a shard group that hold the same experts shard them
      -- (a stage's ranks j = d, or d * M + c with --cp M: stage_world of
      -- them, at rank j * P + q; with --tp T, j = d * T + t at rank
      -- (d * P + q) * T + t, a shard group the S * T consecutive j of its S
      -- data-parallel ranks' TP groups, an expert group N consecutive j:
      -- N / T whole TP groups)
      local S, tpn = pp_mesh.hybrid.shard:size(), tp_size
      local Sj = S * tpn
      if Sj % ep_size ~= 0 then
        if tpn > 1 then
          usage('--ep %d with --pp %d --tp %d --fsdp HYBRID_SHARD: a shard group (--shard-size %d data-parallel '
            .. 'rank%s of a stage\'s TP slice, with %s TP groups %d ranks) must hold whole expert groups of %d ranks: '
            .. '--shard-size a multiple of %d', ep_size, pp_size, tpn, S, S == 1 and '' or 's', S == 1 and 'its' or 'their',
            Sj, ep_size, ep_size / tpn)
        end
        usage('--ep %d with --pp %d --fsdp HYBRID_SHARD: the shard groups of %d ranks (--shard-size) must hold whole '
          .. 'expert groups', ep_size, pp_size, S)
      end
      local function at(q, j) return (math.floor(j / tpn) * pp_size + q) * tpn + j % tpn end
      pp_mesh.expert_shard = mine(pp_size * (stage_world / Sj), ep_size, function(qr, k)
        local q, row = qr % pp_size, math.floor(qr / pp_size)
        return along(Sj / ep_size, function(g) return at(q, row * Sj + g * ep_size + k) end)
      end)
    elseif strategy == 'HYBRID_SHARD' then
      -- (the expert groups inside the shard groups: fully_shard shards an
      -- expert unit over the shard group's ranks that hold those experts)
      local S = o.shard_size > 0 and o.shard_size or dist.local_world_size()
      if S % ep_size ~= 0 or world % S ~= 0 then
        usage('--ep %d%s with --fsdp HYBRID_SHARD: the shard groups of %d ranks (--shard-size; default the ranks of a '
          .. 'node) must hold whole expert groups and divide the world of %d', ep_size,
          tp_size > 1 and (' --tp %d'):format(tp_size) or '', S, world)
      end
      if tp_size > 1 then
        -- --tp N --ep M: each shard group of S consecutive ranks holds S / M
        -- expert groups (of M / N TP groups each); fully_shard's shard
        -- group is its ranks that hold the same slices (S / N, the same TP
        -- index), replicated over the W / S shard groups, and an expert
        -- unit is sharded over its ranks that hold the same experts (S / M)
        ep_hybrid = {
          shard = mine(world / S, tp_size, function(j, t)
            return along(S / tp_size, function(d) return j * S + d * tp_size + t end) end),
          replicate = mine(S, 1, function(kk) return along(world / S, function(j) return j * S + kk end) end),
          expert_shard = mine(world / S, ep_size, function(j, e)
            return along(S / ep_size, function(d) return j * S + d * ep_size + e end) end),
        }
      end
    end
    if o.lora > 0 then usage('--ep with --lora: not supported (merge the adapters first)') end
    -- --fsdp FULL_SHARD / SHARD_GRAD_OP: each layer's experts sharded over
    -- their copies, the rest over every rank; otherwise plain
    if strategy == 'off' or strategy == 'NO_SHARD' then strategy = nil end
    if pp_size > 1 then
      -- (stage q's j-th rank is rank j * P + q: j = d with --cp's
      -- context-parallel ranks counted in, d * M + c; with --tp T its TP
      -- groups inside, j = d * T + t at rank (d * P + q) * T + t, so that
      -- N consecutive j are N / T whole TP groups)
      local n, tpn = stage_world / ep_size, tp_size
      local function at(q, j) return (math.floor(j / tpn) * pp_size + q) * tpn + j % tpn end
      ep_group = mine(pp_size, n, function(q, g)
        return along(ep_size, function(k) return at(q, g * ep_size + k) end) end)
      if n > 1 then
        ep_rep = mine(pp_size, ep_size, function(q, k)
          return along(n, function(g) return at(q, g * ep_size + k) end) end)
      end
    elseif ep_size == world then
      ep_group = dist.get_world_group()
    else
      local n = world / ep_size
      ep_group = mine(n, 1, function(d) return along(ep_size, function(k) return d * ep_size + k end) end)
      ep_rep = mine(ep_size, 1, function(k) return along(n, function(d) return d * ep_size + k end) end)
    end
  end
  if pp_size <= 1 and tp_size <= 1 and not ep_group then
    if strategy == nil or strategy == 'off' then strategy = multi and 'NO_SHARD' or nil end
    if o.fsdp == 'off' and multi and rank == 0 then
      warn('--fsdp off with several ranks: training data-parallel (NO_SHARD)')
    end
  end
  -- plain data parallel's gradient all-reduce after the whole backward
  -- (--no-overlap-grad-reduce; --cuda-graphs, which records the all-reduces
  -- after the backward's kernels, or runs them between its graphs), not as
  -- each unit's backward ends
  local plain_dp = strategy == 'NO_SHARD' and not pp_mesh and not tp_mesh and not ep_group and not cp_group
  if not o.overlap_grad_reduce and multi and not plain_dp then
    usage('--no-overlap-grad-reduce: for plain data parallel (several processes, --fsdp off or NO_SHARD, no --tp, '
      .. '--pp, --ep, --cp), got --fsdp %s%s', tostring(strategy or 'off'),
      (pp_mesh and ', --pp' or '') .. (tp_mesh and ', --tp' or '') .. (ep_group and ', --ep' or '')
      .. (cp_group and ', --cp' or ''))
  end
  local reduce_after = plain_dp and (not o.overlap_grad_reduce or o.cuda_graphs)
  if o.async_checkpoint and o.save_every <= 0 and rank == 0 then
    warn('--async-checkpoint without --save-every N: no checkpoint to write in the background (a stop\'s is '
      .. 'written at once)')
  end

  local tty = o.progress == 'tty' or (o.progress == 'auto' and train.isatty(1))
  local status_shown = false
  local function out_line(s)
    if tty and status_shown then io.stdout:write('\r\27[K') end
    status_shown = false
    io.stdout:write(s, '\n')
    io.stdout:flush()
  end
  -- rank 0 logs (every rank prints its errors, and its closing line)
  local log = (o.quiet or rank ~= 0) and function() end or function(...) out_line(string.format(...)) end
  local function status(s) -- the redrawn line
    if o.quiet or rank ~= 0 then return end
    io.stdout:write('\r', s, '\27[K')
    io.stdout:flush()
    status_shown = true
  end
  if o.threads > 0 then ms.set_num_threads(o.threads) end
  local handle_signals = train.signals_blocked()
  local on_gpu = o.device ~= 'cpu'
  local device = o.device
  if on_gpu and multi and dist.is_initialized() then device = dist.device() end -- cuda:LOCAL_RANK

  -- model
  ms.manual_seed(o.seed)
  -- a config the model refuses (a field of the wrong type, an unknown
  -- preset) is the user's to fix: reported as a usage error
  -- sharded from scratch (or from a sharded checkpoint): the model is built
  -- under nn.deferred_init, so no rank holds the whole of it; fully_shard
  -- writes each rank's shards from the recorded initialisation, the values
  -- an eager build would have had (docs/nn.md, "Deferred initialisation")
  -- (expert parallelism: each rank makes its experts only)
  local deferred = (strategy ~= nil or tp_mesh ~= nil) and not (resume and not resume.sharded) or pp_mesh ~= nil
    or ep_group ~= nil
  local okm, model
  if o.init_from then
    -- fine-tuning: the folder's config and weights (a resumed run builds
    -- the same model from the folder; the checkpoint's weights replace the
    -- folder's)
    if o.model_config and next(o.model_config) then
      usage('--init-from: the model config comes from %s/config.json; drop the --model.* options', o.init_from)
    end
    if type(M.from_pretrained) ~= 'function' then usage('--init-from: the model file has no from_pretrained') end
    okm, model = pcall(M.from_pretrained, o.init_from, { deferred = deferred })
  elseif deferred then
    okm, model = pcall(ms.nn.deferred_init, M.new, o.preset, o.model_config)
  else
    okm, model = pcall(M.new, o.preset, o.model_config)
  end
  if not okm then usage('%s', (tostring(model):gsub('^[^:\n]*%.lua:%d+: ', ''))) end
  -- --moe-bias-rate: the MoE layers' expert_bias buffers (before a resume
  -- reads them)
  if o.moe_bias_rate > 0 and ms.nn.moe.enable_bias(model) == 0 and #ms.nn.moe.layers(model) == 0 then
    usage('--moe-bias-rate: %s has no mixture-of-experts layers (docs/moe.md)', o.model)
  end
  if o.dtype ~= 'f32' then model:to(o.dtype) end
  if on_gpu then model:to(device) end
  model:train()
  train.check_cuda_graphs_model(o, model)
  local cfg = model.config
  local max_pos = model.max_positions and model:max_positions() or math.huge
  if o.seq_len > max_pos then
    usage('--seq-len %d exceeds the model\'s %d positions (raise the model\'s positions with --model.<field>)', o.seq_len, max_pos)
  end
  local sharded = train.is_shard_data(o.data)
  if o.val_data and not sharded then
    usage('--val-data %s: validation shards go with token shards in --data (a folder, a glob or a .bin file); %s is '
      .. 'byte-level text, whose validation split is --val-fraction', o.val_data, o.data or 'the default corpus')
  end
  if not sharded and (cfg.vocab_size or 256) < 256 then
    usage('byte-level data needs a vocabulary of at least 256 tokens; the model has %d', cfg.vocab_size)
  end
  local nparams = 0
  for _, p in pairs(model:parameters()) do nparams = nparams + p:numel() end
  local adamw_opts = { lr = o.lr, betas = { o.beta1, o.beta2 }, eps = o.eps, weight_decay = o.weight_decay }

  -- expert parallelism: each rank keeps its experts (the deferred model
  -- made then, and a one-process checkpoint's weights loaded; its
  -- optimizer state goes in after the optimizer is made). (Under FSDP
  -- from scratch fully_shard makes the shards from the recorded
  -- initialisation; a checkpoint resumed goes in before it)
  local ep_desc
  local function ep_split()
    local okp, perr = pcall(ms.ep.parallelize, model, { group = ep_group, replicate = ep_rep })
    if not okp then usage('--ep %d: %s', ep_size, (tostring(perr):gsub('^[^:\n]*%.lua:%d+: ', ''))) end
    local held = 0
    for _, p in ipairs(model:parameters()) do held = held + p:numel() end
    local layers = ms.nn.moe.layers(model)
    if pp_mesh then
      local sw = world / pp_size
      local copies = sw / ep_size
      held = reduce_numbers({ held }, 'max')[1]
      ep_desc = ('%d-way in each stage\'s %d %sranks (%d cop%s of each expert), %d of %d experts a rank '
        .. 'in %d layers'):format(ep_size, sw, (cp_group or tp_mesh) and '' or 'data-parallel ',
        copies, copies == 1 and 'y' or 'ies', layers[1].n_experts / ep_size, layers[1].n_experts, #layers)
      if tp_mesh then
        -- (the parameters a rank: tensor parallel's line, after its split)
        local ntp = ep_size / tp_size
        ep_desc = ep_desc .. (', each expert whole, each group %d tensor-parallel group%s of %d routing its ranks\' '
          .. 'own rows'):format(ntp, ntp == 1 and '' or 's', tp_size)
      else
        ep_desc = ep_desc .. (', at most %.2fM parameters a rank'):format(held / 1e6)
      end
      if strategy == 'HYBRID_SHARD' then
        -- (with --tp T a shard group's ranks: its S data-parallel ranks' TP
        -- groups, S * T)
        local S, R = pp_mesh.hybrid.shard:size(), pp_mesh.hybrid.replicate:size()
        local Sj = S * tp_size
        local group_of = tp_mesh and ('%d ranks (%d of each TP slice)'):format(Sj, S) or tostring(S)
        if Sj == ep_size then
          ep_desc = ep_desc .. (', each expert whole in each shard group of %s, replicated over %d (HYBRID_SHARD)')
            :format(group_of, R)
        else
          ep_desc = ep_desc .. (', the experts sharded over their %d copies in each shard group of %s, replicated '
            .. 'over %d (HYBRID_SHARD)'):format(Sj / ep_size, group_of, R)
        end
      elseif strategy and copies > 1 then
        ep_desc = ep_desc .. (', the experts sharded over their %d copies (%s)'):format(copies, strategy)
      elseif strategy then
        ep_desc = ep_desc .. (', each rank\'s experts whole, the rest sharded (%s)'):format(strategy)
      end
      return
    end
    if tp_mesh then
      -- (the parameters a rank: tensor parallel's line, after its split)
      local ntp = ep_size / tp_size
      ep_desc = ('%d-way over %d ranks (%d cop%s of each expert), %d of %d experts a rank in %d layers, each expert '
        .. 'whole, each group %d tensor-parallel group%s of %d routing its ranks\' own rows'):format(ep_size, world,
        world / ep_size, world == ep_size and 'y' or 'ies', layers[1].n_experts / ep_size, layers[1].n_experts,
        #layers, ntp, ntp == 1 and '' or 's', tp_size)
      -- (FSDP x TP x EP: the experts' units over their copies, the rest
      -- over the ranks that hold the same slices; HYBRID_SHARD: of each
      -- shard group)
      if ep_hybrid then
        local S = world / ep_hybrid.replicate:size()
        if S == ep_size then
          ep_desc = ep_desc .. (', each expert whole in each shard group of %d, replicated over %d (HYBRID_SHARD)')
            :format(S, world / S)
        else
          ep_desc = ep_desc .. (', the experts sharded over their %d copies in each shard group of %d, replicated '
            .. 'over %d (HYBRID_SHARD)'):format(S / ep_size, S, world / S)
        end
      elseif strategy and world > ep_size then
        ep_desc = ep_desc .. (', the experts sharded over their %d copies (%s)'):format(world / ep_size, strategy)
      elseif strategy then
        ep_desc = ep_desc .. (', each rank\'s experts whole, the rest sharded (%s)'):format(strategy)
      end
      return
    end
    ep_desc = ('%d-way over %d ranks (%d cop%s of each expert), %d of %d experts a rank in %d layers, '
      .. '%.2fM parameters a rank'):format(ep_size, world, world / ep_size, world == ep_size and 'y' or 'ies',
      layers[1].n_experts / ep_size, layers[1].n_experts, #layers, held / 1e6)
    if strategy == 'HYBRID_SHARD' then
      local S = o.shard_size > 0 and o.shard_size or dist.local_world_size()
      ep_desc = ep_desc .. (', the experts sharded over their %d copies in each shard group of %d, replicated over '
        .. '%d (HYBRID_SHARD)'):format(S / ep_size, S, world / S)
    elseif strategy and world > ep_size then
      ep_desc = ep_desc .. (', the experts sharded over their %d copies (%s)'):format(world / ep_size, strategy)
    elseif strategy then
      ep_desc = ep_desc .. (', each rank\'s experts whole, the rest sharded (%s)'):format(strategy)
    end
  end
  -- (with --pp each stage's, after the cut, below)
  if ep_group and not pp_mesh then
    ep_split()
    -- (a sharded checkpoint is read after fully_shard, into the shards;
    -- with --tp after its split, below)
    local whole = resume and not resume.sharded and not tp_mesh
    if (not strategy and not tp_mesh) or whole then ms.nn.materialize(model) end
    if whole then
      local okl, err = pcall(ckpt.load, resume.path, {
        model = { load_state_dict = function(_, sd) ms.ep.load_full_state_dict(model, sd) end } })
      if not okl then error(('resume from %s: %s'):format(resume.path, tostring(err)), 0) end
    end
  end

  -- tensor parallelism: each rank keeps its slices (a deferred model is
  -- materialized a tensor at a time, then the rest of it)
  local tp_desc
  local function tp_split()
    -- (unset: on, except under --pp, where four H200s ran DeepSeek-V3's
    -- bench shape 27% slower with it: docs/pp.md)
    local seq = o.sequence_parallel
    if seq == nil then seq = not pp_mesh end
    local okp, perr = pcall(ms.tp.parallelize, model, { group = tp_mesh.shard, sequence_parallel = seq,
      overlap = o.tp_overlap })
    if not okp then usage('--tp %d: %s', tp_size, (tostring(perr):gsub('^[^:\n]*%.lua:%d+: ', ''))) end
    if not pp_mesh then ms.nn.materialize(model) end   -- (a pipeline makes its stage's only, after the cut)
    local mine = 0
    for _, p in ipairs(model:parameters()) do mine = mine + p:numel() end
    tp_desc = ('%d-way over %d ranks, data parallel %d%s, %ssequence parallel, %.2fM parameters a rank%s%s'):format(
      tp_size, world, data_world, strategy and (' (%s)'):format(strategy) or '', seq and '' or 'no ', mine / 1e6,
      deferred and ', deferred init' or '', o.tp_overlap and '' or ', no backward overlap')
  end
  -- (--pp --tp --ep: each stage's, after the cut and its experts' split,
  -- in the pipeline's block below: ep.parallelize comes first, and
  -- pp.pipeline takes no expert-parallel model)
  if tp_mesh and not (pp_mesh and ep_group) then
    tp_split()
    -- a whole-model checkpoint's weights go into the slices now (before
    -- fully_shard, which takes them); its optimizer state after the optimizer
    -- (a sharded one is read after the optimizer, each rank its boxes)
    if resume and not resume.sharded and not pp_mesh then
      local okl, err = pcall(ckpt.load, resume.path, {
        model = { load_state_dict = function(_, sd)
          -- (--ep too: the experts whole, by their global names)
          if ep_group then ms.ep.load_full_state_dict(model, sd) else ms.tp.load_full_state_dict(model, sd) end
        end } })
      if not okl then error(('resume from %s: %s'):format(resume.path, tostring(err)), 0) end
    end
  end

  -- a single-process checkpoint resumed by a sharded run goes in before fully_shard
  local load_converted
  if resume and strategy and not resume.sharded and not tp_mesh and not pp_mesh and not ep_group then
    load_converted = plain_to_sharded(resume.path, model, function() return ms.optim.AdamW(model, adamw_opts) end)
  end

  -- --lora R: adapters on the matching projections, everything else frozen
  local lora_desc
  if o.lora > 0 then
    local targets = {}
    for pat in o.lora_targets:gmatch('[^,]+') do targets[#targets + 1] = pat end
    local okl, names, skipped = pcall(ms.nn.apply_lora, model, { r = o.lora, alpha = o.lora_alpha,
      dropout = o.lora_dropout, targets = targets })
    if not okl then usage('--lora: %s', (tostring(names):gsub('^[^:\n]*%.lua:%d+: ', ''))) end
    local n = 0
    for name, p in model:named_parameters() do if p.requires_grad then n = n + p:numel() end end
    lora_desc = ('rank %d, alpha %g, %d modules, %.3fM trainable parameters'):format(o.lora, o.lora_alpha or o.lora,
      #names, n / 1e6)
    if #skipped > 0 then
      lora_desc = lora_desc .. (', %d routed experts\' linears left out (the fused experts read their weights)')
        :format(#skipped)
    end
  end

  -- --freeze: requires_grad off for the matching parameters (before
  -- fully_shard, which lays them out last and keeps them out of the steps)
  local freeze_desc
  if o.freeze and o.freeze ~= '' then
    local pats, nt, ne = {}, 0, 0
    for pat in o.freeze:gmatch('[^,]+') do pats[#pats + 1] = { pat = pat, hits = 0 } end
    for name, p in model:named_parameters() do
      local hit = false
      for _, e in ipairs(pats) do
        local okp, m = pcall(string.find, name, e.pat)
        if not okp then usage('--freeze: bad pattern %s: %s', e.pat, tostring(m)) end
        if m then e.hits = e.hits + 1; hit = true end
      end
      if hit and p.requires_grad then p.requires_grad = false; nt = nt + 1; ne = ne + p:numel() end
    end
    for _, e in ipairs(pats) do
      if e.hits == 0 then usage('--freeze: the pattern %s matches no parameter of the model', e.pat) end
    end
    freeze_desc = ('%d tensors, %.2fM parameters'):format(nt, ne / 1e6)
  end

  -- --float8: the linear layers' products in FP8 (after LoRA, whose adapted
  -- layers keep their own forward; before checkpointing and fully_shard,
  -- which work on the converted modules as on any)
  local float8_desc
  if o.float8_tp_scales == 'group' and (o.float8 == 'off' or not tp_mesh) then
    usage('--float8-tp-scales group needs --float8 and --tp (got --float8 %s, --tp %s)', o.float8,
      tp_mesh and 'on' or 'off')
  end
  if o.float8 ~= 'off' then
    local okc, names = pcall(ms.float8.convert, model,
      { recipe = o.float8, tp_scales = tp_mesh and o.float8_tp_scales or nil })
    if not okc then usage('--float8: %s', (tostring(names):gsub('^[^:\n]*%.lua:%d+: ', ''))) end
    local total = 0
    for _, m in model:named_modules() do
      local cls = getmetatable(m)
      if cls == ms.nn.Linear or cls == ms.nn.Conv1D then total = total + 1 end
    end
    float8_desc = ('%s, %d of %d linear layers'):format(o.float8, #names, total)
    if tp_mesh then float8_desc = float8_desc .. ', TP scales ' .. o.float8_tp_scales end
  end

  -- activation checkpointing of the blocks (before fully_shard: the blocks'
  -- unit hooks then run around the checkpointed forward)
  local ac_desc
  if o.activation_checkpointing ~= 'none' then
    local cls = train.block_class(M, model)
    if not cls then usage('--activation-checkpointing: the model has no list of blocks to checkpoint') end
    local op = o.activation_checkpointing == 'op'
    local every = (o.activation_checkpointing == 'full' or op) and 1 or tonumber(o.activation_checkpointing)
    local names = ms.nn.apply_activation_checkpointing(model, { class = cls, every = every, policy = op and 'op' or nil })
    local total = 0
    for _, m in model:named_modules() do if m:class_name() == cls then total = total + 1 end end
    ac_desc = ('%d of %d %s'):format(#names, total, cls)
    if op then ac_desc = ac_desc .. ', attention and every other linear output kept (op-level selective)' end
  end

  -- pipeline parallelism: this rank's stage of the (deferred) model, then
  -- its parameters made (or read from the checkpoint resumed)
  local pp_desc, pipe
  if o.pp_layers and not pp_mesh then usage('--pp-layers %s without --pp N > 1: there is no pipeline to cut', o.pp_layers) end
  if pp_mesh then
    local mbs = o.pp_microbatches > 0 and o.pp_microbatches or o.batch_size
    if o.batch_size % mbs ~= 0 then
      usage('--pp-microbatches %d does not divide --batch-size %d', mbs, o.batch_size)
    end
    -- (--pp-chunks > 1: the interleaved 1F1B, or looped_bfs; zbv, dualpipev: 2 chunks)
    local sched, chunks = o.pp_schedule, o.pp_chunks
    if sched == 'zbv' or sched == 'dualpipev' then
      if chunks > 2 then usage('--pp-schedule %s runs 2 chunks a rank, got --pp-chunks %d', sched, chunks) end
      chunks = 2
    elseif sched == 'looped_bfs' then
      if chunks == 1 then usage('--pp-schedule looped_bfs runs GPipe over chunks: give --pp-chunks > 1 (with one it is gpipe)') end
    elseif chunks > 1 then
      sched = nil
    end
    -- --pp-layers: the cut given, checked against the virtual stages and the model's blocks
    local layers
    if o.pp_layers then
      layers = {}
      for n in o.pp_layers:gmatch('%d+') do layers[#layers + 1] = tonumber(n) end
      local L, sum = type(model.pipeline_parts) == 'function' and #model:pipeline_parts().blocks, 0
      for _, n in ipairs(layers) do sum = sum + n end
      if #layers ~= pp_size * chunks or (L and sum ~= L) then
        usage('--pp-layers %s: %d counts adding up to %d blocks, but --pp %d x %d chunk%s a rank is %d virtual stages '
          .. 'and the model has %d blocks', o.pp_layers, #layers, sum, pp_size, chunks, chunks == 1 and '' or 's',
          pp_size * chunks, L or sum)
      end
    end
    local okp, perr = pcall(ms.pp.pipeline, model, { group = pp_mesh.shard, microbatches = mbs,
      schedule = sched, chunks = chunks, layers = layers })
    if not okp then usage('--pp %d: %s', pp_size, (tostring(perr):gsub('^[^:\n]*%.lua:%d+: ', ''))) end
    pipe = perr
    -- --ep: the stage's experts split over its expert group (the cut made,
    -- so each rank makes only its stage's share of them)
    if ep_group then ep_split() end
    -- (--tp too: the stage split now, its experts whole; the stages
    -- exchange each TP rank's rows under sequence parallelism)
    if ep_group and tp_mesh then
      tp_split()
      pipe.sp = rawget(model, '_tp').sp
    end
    -- (under --fsdp from scratch fully_shard makes the stage's shards from
    -- the recorded initialisation: no rank holds its whole stage)
    if not strategy or resume then ms.nn.materialize(model) end
    local mine = 0
    for _, p in ipairs(model:parameters()) do mine = mine + p:numel() end
    local most = reduce_numbers({ mine }, 'max')[1]
    pp_desc = ('%d stages over %d ranks, blocks {%s}, data parallel %d, %s, %d micro-batches of %d sequences, '
      .. 'at most %.2fM parameters a stage'):format(pp_size, world, table.concat(pipe.layers, ', '), data_world,
      sched == 'zbv' and 'zbv, 2 chunks a rank in a V' or sched == 'dualpipev' and 'dualpipev, 2 chunks a rank in a V'
        or sched == 'looped_bfs' and ('looped bfs, %d chunks a rank'):format(
        chunks) or chunks > 1 and ('interleaved 1f1b, %d chunks a rank'):format(chunks) or sched, mbs,
      o.batch_size / mbs, most / 1e6)
    -- (a sharded checkpoint is read after fully_shard and the optimizer,
    -- each rank reading its stage's pieces by name)
    if resume and not resume.sharded then
      local okl, err = pcall(ckpt.load, resume.path, {
        model = { load_state_dict = function(_, sd) ms.pp.load_full_state_dict(model, sd) end } })
      if not okl then error(('resume from %s: %s'):format(resume.path, tostring(err)), 0) end
    end
  end

  -- FSDP: units by --fsdp-policy, --fsdp-mixed-precision, --shard-size
  local fsdp_desc
  if o.float8_all_gather and (o.float8 ~= 'tensorwise' and o.float8 ~= 'blockwise' or not strategy
      or strategy == 'NO_SHARD') then
    usage('--float8-all-gather needs --float8 tensorwise or blockwise and --fsdp FULL_SHARD, SHARD_GRAD_OP or HYBRID_SHARD '
      .. '(got --float8 %s, --fsdp %s)', o.float8, tostring(strategy or 'off'))
  end
  if strategy then
    local policy, pdesc = train.fsdp_policy(M, model, o.fsdp_policy)
    local mp = train.mixed_precision(o.fsdp_mixed_precision, device)
    local hybrid = pp_mesh and pp_mesh.hybrid or ep_hybrid or tp_mesh and tp_mesh.hybrid
    local group = not hybrid and (pp_mesh or tp_mesh) and (pp_mesh or tp_mesh).replicate or nil
    local okf, ferr = pcall(ms.fsdp.fully_shard, model, { policy = policy, strategy = strategy, mixed_precision = mp,
      shard_size = strategy == 'HYBRID_SHARD' and not hybrid and o.shard_size > 0 and o.shard_size or nil,
      mesh = hybrid or nil, group = group, float8_all_gather = o.float8_all_gather or nil,
      expert_shard = pp_mesh and pp_mesh.expert_shard or ep_hybrid and ep_hybrid.expert_shard or nil })
    if not okf then usage('--fsdp %s: %s', strategy, (tostring(ferr):gsub('^[^:\n]*%.lua:%d+: ', ''))) end
    -- the ranks a unit's parameters are spread over (with --cp, its
    -- context-parallel ranks as well as the data-parallel ones)
    local over = hybrid and hybrid.shard:size() * hybrid.replicate:size() or group and group:size() or world
    -- (HYBRID_SHARD given its mesh: the shard groups and their copies)
    local hdesc = hybrid and (' (shard groups of %d, replicated over %d)'):format(hybrid.shard:size(),
      hybrid.replicate:size()) or ''
    fsdp_desc = ('%s over %d rank%s%s, units %s (%d), %s'):format(strategy, over, over == 1 and '' or 's', hdesc, pdesc,
      #ms.fsdp.units(model), mp and ('params %s, reduce %s'):format(mp.param, mp.reduce) or 'no mixed precision')
    if o.float8_all_gather then fsdp_desc = fsdp_desc .. ', float8 all-gathers' end
    if reduce_after then fsdp_desc = fsdp_desc .. ', gradients all-reduced after the backward' end
    ms.nn.materialize(model)   -- what no unit took (buffers)
    if deferred and not tp_mesh then fsdp_desc = fsdp_desc .. ', deferred init' end
  end

  -- context parallelism: the model's attention rings over the group, its
  -- positions this rank's (after fully_shard: the same modules)
  local cp_desc, cp_ctx
  if cp_group then
    local okc, cerr = pcall(ms.cp.apply, model, cp_group, { need_attention = not pp_mesh })
    if not okc then usage('--cp %d: %s', cp_size, (tostring(cerr):gsub('^[^:\n]*%.lua:%d+: ', ''))) end
    cp_ctx = cerr
    cp_desc = ('%d-way (ring attention, load-balanced chunks of %d tokens), data parallel %d, %d tokens a rank of each '
      .. 'sequence'):format(cp_size, o.seq_len / (2 * cp_size), data_world, o.seq_len / cp_size)
  end

  -- --autocast: the model's forward (the training steps', the validation's,
  -- a pipeline stage's, the sample's) in an autocast region, the weights,
  -- gradients and optimizer state f32 (amp.set_precision)
  local amp_dtype = train.autocast_dtype(o, device, strategy)
  if amp_dtype then ms.nn.functional.set_precision(model, { compute = amp_dtype }) end

  -- data: token shards (a folder from bin/tokenize, a glob, .bin files) or
  -- bytes; rank r reads its rows of every batch
  local corpus, train_loader, val_loader
  if sharded then
    local isdir = os.execute("test -d " .. data.shell_quote(o.data))
    isdir = isdir == 0 or isdir == true
    local okd, d = pcall(data.open, { dir = isdir and o.data or nil, train = not isdir and o.data or nil,
      val = o.val_data, batch_size = o.batch_size, seq_len = o.seq_len, seed = o.seed, rank = data_rank,
      world_size = data_world })
    if not okd then usage('%s', (tostring(d):gsub('^[^:\n]*%.lua:%d+: ', ''))) end
    train_loader, val_loader = d.train, d.val
    corpus = { name = d.name, n = d.n, unit = 'tokens', train = { n = d.n }, val = d.val and { n = d.val.tokens } }
  else
    local okc, c = pcall(data.corpus, { path = o.data, val_fraction = o.val_fraction, min_len = o.seq_len + 1 })
    if not okc then usage('%s', (tostring(c):gsub('^[^:\n]*%.lua:%d+: ', ''))) end
    corpus = c
    corpus.unit = 'bytes'
    train_loader = data.Loader(corpus.train, { batch_size = o.batch_size, seq_len = o.seq_len, seed = o.seed,
      rank = data_rank, world_size = data_world })
    val_loader = corpus.val and data.Loader(corpus.val, { batch_size = o.batch_size, seq_len = o.seq_len, seed = o.seed + 1,
      rank = data_rank, world_size = data_world })
  end
  local function to_device(x, y)
    if on_gpu then
      local dx, dy = x:to(device), y:to(device)
      x:free(); y:free()
      x, y = dx, dy
    end
    if cp_ctx then
      -- (every rank of a context-parallel group read the same rows)
      local sx, sy = ms.cp.shard(x, cp_ctx), ms.cp.shard(y, cp_ctx)
      x:free(); y:free()
      x, y = sx, sy
    end
    return x, y
  end

  -- gradient accumulation: micro-batches of batch_size x seq_len tokens on
  -- each rank; tokens_per_step counts the whole step (every rank's)
  local micro_tokens = o.batch_size * o.seq_len
  local accum = 1
  if o.tokens_per_step > 0 then
    if o.tokens_per_step % (micro_tokens * data_world) ~= 0 then
      if data_world > 1 then
        usage('--tokens-per-step %d is not a multiple of the micro-batches of %d data-parallel ranks (--batch-size %d x --seq-len %d x %d = %d tokens)',
          o.tokens_per_step, data_world, o.batch_size, o.seq_len, data_world, micro_tokens * data_world)
      end
      usage('--tokens-per-step %d is not a multiple of the micro-batch (--batch-size %d x --seq-len %d = %d tokens)',
        o.tokens_per_step, o.batch_size, o.seq_len, micro_tokens)
    end
    accum = o.tokens_per_step / (micro_tokens * data_world)
  end
  local tokens_per_step = micro_tokens * accum * data_world

  local inject = {}
  for n in tostring(o.inject_nan or ''):gmatch('%d+') do inject[tonumber(n)] = true end

  -- output (the default folder's time is rank 0's)
  local name = (M.name or 'model') .. '-' .. tostring(o.preset or 'custom')
  if not o.out then
    local t = os.time()
    if multi then t = broadcast_numbers({ t })[1] end
    o.out = 'runs/' .. name .. '-' .. os.date('%Y%m%d-%H%M%S', t)
  end
  local ok_mk = os.execute('mkdir -p ' .. data.shell_quote(o.out))
  if ok_mk ~= 0 and ok_mk ~= true then usage('cannot create the output folder %s', o.out) end
  -- on a GPU the GEMMs' tuned algorithms are kept with the run
  -- (docs/tensors.md): a resumed run takes the same ones untimed, so it does
  -- not depend on timing noise. MS_GEMM_TUNE_FILE names another file;
  -- MS_GEMM_TUNE=0 turns tuning off.
  if on_gpu and (os.getenv('MS_GEMM_TUNE_FILE') or '') == '' and ms.cuda.gemm_tune() then
    local okt, et = pcall(ms.cuda.gemm_tune_file, o.out .. '/gemm_tune.txt')
    if not okt then warn('GEMM tuning file not kept: ' .. tostring(et)) end
  end

  -- optimizer
  local opt
  if strategy then opt = ms.fsdp.AdamW(model, adamw_opts)
  else opt = ms.optim.AdamW(model, adamw_opts) end
  local lr_at = train.schedule(o)
  local params = not strategy and model:parameters() or nil

  -- resume: weights, optimizer state, RNG, data position, counters
  local start_step, bad_run, bad_total = 1, 0, 0
  if resume then
    local okl, err
    if load_converted then okl, err = pcall(load_converted, model, opt)
    elseif resume.sharded then okl, err = pcall(fck().load_sharded, model, resume.path, { optimizer = opt })
    elseif pp_mesh then
      -- a whole-model checkpoint (its weights went in before): every stage
      -- reads the optimizer's state and keeps its parameters'
      okl, err = pcall(ckpt.load, resume.path, {
        optimizer = { load_state_dict = function(_, sd) ms.pp.load_full_optimizer_state(model, opt, sd) end } })
    elseif tp_mesh then
      -- a whole-model checkpoint (its weights went in before): every rank
      -- reads the optimizer's state and keeps its slices (of its shards;
      -- with --ep its experts')
      okl, err = pcall(ckpt.load, resume.path, {
        optimizer = { load_state_dict = function(_, sd)
          if ep_group then ms.ep.load_full_optimizer_state(model, opt, sd)
          elseif strategy then ms.tp.load_fsdp_optimizer_state(model, opt, sd)
          else ms.tp.load_full_optimizer_state(model, opt, sd) end
        end } })
    elseif ep_group then
      -- a whole-model checkpoint (its weights went in before): every rank
      -- reads the optimizer's state and keeps its parameters' moments (of
      -- its shards under FSDP)
      okl, err = pcall(ckpt.load, resume.path, {
        optimizer = { load_state_dict = function(_, sd) ms.ep.load_full_optimizer_state(model, opt, sd) end } })
    else okl, err = pcall(ckpt.load, resume.path, { model = model, optimizer = opt }) end
    if not okl then error(('resume from %s: %s'):format(resume.path, tostring(err)), 0) end
    local st = resume.state
    start_step = st.step + 1
    T.set_rng_state(st.rng)
    local okd, derr = pcall(train_loader.set_state, train_loader, st.data)
    if not okd then
      usage('resume from %s: the data position does not fit this run (%s)%s', resume.path,
        (tostring(derr):gsub('^[^:\n]*%.lua:%d+: ', '')),
        sharded and st.world_size and st.world_size ~= world
          and ('; token shards resume at the world size that saved them (%d ranks)'):format(st.world_size) or '')
    end
    bad_run, bad_total = st.bad_steps_in_a_row or 0, st.bad_steps or 0
  end

  -- metrics (rank 0): a resumed run keeps the lines up to its checkpoint
  local metrics_path = o.out .. '/metrics.jsonl'
  local mf
  if rank == 0 then
    local kept = {}
    if resume then
      for _, line in ipairs(read_lines(metrics_path)) do
        local s = tonumber(line:match('^{"step":(%d+)'))
        if s and s < start_step then kept[#kept + 1] = line end
      end
    end
    local merr
    mf, merr = io.open(metrics_path, 'w')
    if not mf then usage('cannot write %s: %s', metrics_path, tostring(merr)) end
    for _, line in ipairs(kept) do mf:write(line, '\n') end
    mf:flush()
    local rf = io.open(o.out .. '/run.json', 'w')
    if rf then
      rf:write(train.encode_sorted({ options = o, model_config = cfg, parameters = nparams,
                                     data = corpus.name, data_bytes = corpus.n, world_size = world,
                                     fsdp = strategy }), '\n')
      rf:close()
    end
  end

  log('moonshard train: %s (%s), %.2fM parameters, %s%s', o.model,
    o.init_from and ('from ' .. o.init_from) or tostring(o.preset), nparams / 1e6, o.dtype,
    amp_dtype and (', %s autocast'):format(amp_dtype) or '')
  log('data: %s, %d %s (train %d, val %d)', corpus.name, corpus.n, corpus.unit, corpus.train.n, corpus.val and corpus.val.n or 0)
  if multi then
    log('%d steps x %d tokens (%d %s x %d x %d x %d micro-batches), lr %g, threads %d, out %s',
      o.steps, tokens_per_step, data_world,
      data_world == world and 'ranks' or (data_world == 1 and 'data-parallel group' or 'data-parallel groups'), o.batch_size,
      o.seq_len, accum, o.lr, ms.get_num_threads(), o.out)
  else
    log('%d steps x %d tokens (%d x %d x %d micro-batches), lr %g, threads %d, out %s',
      o.steps, tokens_per_step, o.batch_size, o.seq_len, accum, o.lr, ms.get_num_threads(), o.out)
  end
  if fsdp_desc then log('fsdp: %s', fsdp_desc) end
  if tp_desc then log('tensor parallel: %s', tp_desc) end
  if pp_desc then log('pipeline parallel: %s', pp_desc) end
  if cp_desc then log('context parallel: %s', cp_desc) end
  if ep_desc then log('expert parallel: %s', ep_desc) end
  if float8_desc then log('float8: %s', float8_desc) end
  if ac_desc then log('activation checkpointing: %s', ac_desc) end
  if lora_desc then log('lora: %s', lora_desc) end
  if freeze_desc then log('frozen: %s', freeze_desc) end
  if resume then
    log('resumed from %s at step %d', resume.path, start_step - 1)
    if resume.layout_left then
      log('resume: in one process, without the checkpoint\'s %s (launch it on several ranks, bin/train '
        .. '--nproc-per-node N, to keep it)', resume.layout)
    elseif resume.layout ~= '' then
      log('resume: the checkpoint\'s layout %s (give --tp, --pp, --cp, --ep, --fsdp to change it)', resume.layout)
    end
    for _, line in ipairs(resume.notes) do log('%s', line) end
  end
  if o.cuda_graphs then
    log('cuda graphs: the step captured after %d eager step%s (at step %d), then replayed', o.graph_warmup,
      o.graph_warmup == 1 and '' or 's', start_step + o.graph_warmup)
  end

  -- --async-checkpoint: the background writer (made at the first save) and
  -- the save it is writing: { ready =, finish =, step =, t0 = }
  local writer, ckpt_pending
  local function save_checkpoint(step, async)
    local w = nil
    if async then
      writer = writer or ckpt.writer()
      w = writer
    end
    local saved = {}
    for k, v in pairs(o) do saved[k] = v end
    if type(saved.model) ~= 'string' then saved.model = nil end
    local state = { step = step, scheduler = { step = step, lr = lr_at(math.min(step, o.steps)) },
                    rng = T.rng_state(), data = train_loader:state(), options = saved,
                    bad_steps = bad_total, bad_steps_in_a_row = bad_run }
    -- --tp, --pp, --ep: sharded checkpoints unless --checkpoint-format full
    -- (--ep under FSDP: always sharded)
    local format = o.checkpoint_format or o.pp_checkpoint or 'sharded'
    local parallel = tp_mesh or pp_mesh or ep_group
    if (tp_mesh or pp_mesh or (ep_group and not strategy)) and format == 'full' then
      -- the whole model's and optimizer's state, gathered on every rank
      -- (with --ep on the ranks of rank 0's group, on the host); rank 0
      -- writes a one-process checkpoint (it resumes at any --tp, --pp or
      -- --ep). (--ep under FSDP: sharded checkpoints, below: every rank
      -- writes the pieces it holds, its experts' among them)
      state.world_size, state.tokens_per_step = data_world, tokens_per_step
      state.tp, state.pp = tp_mesh and tp_size or nil, pp_mesh and pp_size or nil
      state.ep = ep_group and ep_size or nil
      local hyper = { lr = lr_at(math.min(step, o.steps)), betas = adamw_opts.betas, eps = adamw_opts.eps,
        weight_decay = adamw_opts.weight_decay }
      local msd, osd
      if pp_mesh then msd, osd = ms.pp.full_checkpoint(model, opt, hyper)   -- (with --tp too: it gathers the slices)
      elseif tp_mesh and not ep_group then msd, osd = ms.tp.full_checkpoint(model, opt, hyper)
      -- (--ep, with --tp too: the ranks of rank 0's expert group; under
      -- FSDP, --tp --ep --fsdp, every rank: the units' gathers span them)
      elseif rank < ep_size or strategy then msd, osd = ms.ep.full_checkpoint(model, opt, hyper, { host = true }) end
      local okw, res = true, nil
      if rank == 0 then
        okw, res = pcall(ckpt.save_async, o.out, step, { model = { state_dict = function() return msd end },
          optimizer = { state_dict = function() return osd end }, state = state },
          { keep = o.keep_checkpoints, writer = w or ckpt.sync_writer(), stage = async })
      end
      msd, osd = nil, nil
      local function conclude()
        local okf, path = okw, res
        if rank == 0 and okw then okf, path = pcall(res.finish, res) end
        local failed = reduce_numbers({ okf and 0 or 1 }, 'max')[1]
        if failed > 0 then
          if rank == 0 then error(path, 0) end
          error('checkpoint: rank 0 could not write it (see its message)', 0)
        end
        return o.out .. '/' .. ckpt.name(step)
      end
      if not async then return conclude() end
      return { ready = function() return rank ~= 0 or not okw or res:ready() end, finish = conclude }
    end
    if not strategy and not parallel then
      if not async then
        return ckpt.save(o.out, step, { model = model, optimizer = opt, state = state }, { keep = o.keep_checkpoints })
      end
      local p = ckpt.save_async(o.out, step, { model = model, optimizer = opt, state = state },
        { keep = o.keep_checkpoints, writer = w })
      return { ready = function() return p:ready() end, finish = function() return p:finish() end }
    end
    -- the shape of the run, so that another world size keeps the global batch
    state.world_size, state.tokens_per_step, state.fsdp = world, tokens_per_step, strategy
    if parallel then
      -- (every rank writes what it holds: its stage's, its slices', its
      -- experts' pieces; the data ranks are the pipelines / TP groups)
      state.world_size = data_world
      state.tp, state.pp = tp_mesh and tp_size or nil, pp_mesh and pp_size or nil
      state.ep = ep_group and ep_size or nil
    end
    return train.save_sharded_checkpoint(o.out, step, { model = model, optimizer = opt, state = state },
      { keep = o.keep_checkpoints, writer = w })
  end
  -- completes the background save (every rank at once: it may be collective)
  local function finish_pending()
    local p = ckpt_pending
    ckpt_pending = nil
    local tw = now()
    last_ckpt = p.finish()
    log('checkpoint %s (written in the background in %.1f s%s)', last_ckpt, now() - p.t0,
      now() - tw > 0.05 and (', the last %.1f s waited for'):format(now() - tw) or '')
  end

  -- the mean validation loss over every rank's batches
  local function validate()
    local v = train.evaluate_on(model, val_loader, o.eval_iters, to_device,
      pipe and function(x, y) return pipe:evaluate(x, y) end or nil)
    if multi then v = reduce_numbers({ v }, 'avg')[1] end
    return v
  end

  local flops_per_token = 6 * nparams
  local t0 = now()
  local t_window, window_loss, window_n, window_steps, eval_s = t0, 0, 0, 0, 0
  local first_loss, last_loss, val_loss, last_ckpt, interrupted
  local steady_t0, steady_step -- timing from the first step on (it warms up)
  local last_step = start_step - 1
  local rate = 0
  -- the metrics of the steps since the last flush; with several ranks each
  -- holds this rank's loss until flush() averages them over the ranks (one
  -- all_reduce per progress line), then the lines are written
  local pending, settled = {}, 0
  local function settle() -- the losses of the pending steps, averaged over the ranks
    if settled == #pending then return end
    if multi then
      -- (each step's loss, then its multi-token-prediction depths' losses)
      local locals = {}
      for i = settled + 1, #pending do
        local p = pending[i]
        locals[#locals + 1] = p.ok and p.loss or 0
        for _, v in ipairs(p.mtp or {}) do locals[#locals + 1] = p.ok and v or 0 end
      end
      local mean = reduce_numbers(locals, 'avg')
      local j = 0
      for i = settled + 1, #pending do
        local p = pending[i]
        j = j + 1
        if p.ok then p.rec.loss = mean[j] end
        for k = 1, #(p.mtp or {}) do
          j = j + 1
          if p.ok then p.rec.mtp_loss[k] = mean[j] end
        end
      end
    end
    for i = settled + 1, #pending do
      local p = pending[i]
      if p.ok then
        local lv = p.rec.loss
        first_loss = first_loss or lv
        last_loss = lv
        window_loss, window_n = window_loss + lv, window_n + 1
      end
    end
    settled = #pending
  end
  local function flush() -- settle, then write the lines
    settle()
    if mf then for _, p in ipairs(pending) do jsonl_line(mf, p.rec) end end
    pending, settled = {}, 0
  end
  local grad_clip = o.grad_clip > 0 and o.grad_clip or nil
  local trace_pins = os.getenv('MS_TRACE_PINS') and require('moonshard.trace_pins') or nil

  -- The step, in the two halves that the eager loop and --cuda-graphs
  -- share. grads_of(step, batch) zeroes the gradients, runs the step's
  -- micro-batches forward and backward (batch(k) -> x, y on the device)
  -- and finds the gradient norm, clipped to --grad-clip; it returns what the
  -- host reads afterwards, { losses = {k -> loss}, mtp = {depth -> {k ->
  -- loss}}, gnorm = }, tensors on one process (nothing read inside it, so
  -- that it can be captured) and numbers where a layout reduced them. Then
  -- the loop reads them, decides (a NaN/inf loss or norm skips the update)
  -- and steps the optimizer: opt:step(), or its captured replay.
  -- grads_of is local_grads (the zeroing and the micro-batches) then
  -- reduced_grads (the layouts' reductions, the norm and clipping): with
  -- several processes --cuda-graphs captures both (the all-reduces after
  -- the backward: reduce_after), or with --graph-collectives off the first
  -- alone, running the second eagerly.
  local function local_grads(step, batch)
    opt:zero_grad()
    local losses, mtp = {}, nil
    local function keep(t)   -- (a value read after backward, which may release t)
      return ms.no_grad(function() return t:clone() end)
    end
    for k = 1, accum do
      local x, y = batch(k)
      local function micro()
        -- (the loop keeps only the loss's value: every activation can go
        -- at backward; the setting restored even when the step raises)
        local prev = ms.autograd.release_activations
        ms.autograd.release_activations = o.release_activations
        local ok, err = pcall(function()
          if pipe then
            -- every micro-batch of the pipeline, forward and backward (docs/pp.md)
            local loss = pipe:step(x, y, { scale = 1 / accum, sync = k == accum,
              loss_hook = inject[step] and function(l) return l * (0 / 0) end or nil })
            losses[k] = loss:item()
            loss:free()
            -- (multi-token prediction: each depth's loss of the batch, the
            -- last stage's, on every stage)
            local ml = pipe:mtp_losses()
            for d = 1, #ml do
              mtp = mtp or {}
              mtp[d] = mtp[d] or {}
              mtp[d][k] = ml[d]
            end
            return
          end
          local loss
          loss = model(x, y)
          if inject[step] then loss = loss * (0 / 0) end
          -- (backward frees what it consumed under --release-activations
          -- but the tensor it starts from: with several micro-batches that
          -- is the scaled loss, so the value read later is a copy)
          losses[k] = accum > 1 and keep(loss) or loss
          -- (DeepSeek-V3's multi-token prediction: each depth's loss too)
          local ml = type(model.mtp_losses) == 'function' and model:mtp_losses() or {}
          for d = 1, #ml do
            mtp = mtp or {}
            mtp[d] = mtp[d] or {}
            mtp[d][k] = keep(ml[d])
          end
          if accum > 1 then loss = loss * (1 / accum) end -- the mean over all micro-batches (exact for a power of two)
          loss:backward()
        end)
        ms.autograd.release_activations = prev
        if not ok then error(err, 0) end
      end
      -- FSDP: the gradients of all but the last micro-batch stay unsharded
      -- (no communication); the last backward reduces their sum, or, with
      -- reduce_after, reduced_grads does once the backward is over
      if strategy and (k < accum or reduce_after) then model:no_sync(micro) else micro() end
    end
    return { losses = losses, mtp = mtp }
  end
  local function reduced_grads(out, keep_norm)
    local gnorm
    if pp_mesh then
      -- the pipelines' gradients averaged, then clipped over the stages
      -- (under FSDP the stages' reductions averaged them; with --ep the
      -- experts' summed over their copies, ms.ep)
      if not strategy and ep_group then ms.ep.all_reduce_grads(model, pp_mesh.replicate)
      elseif not strategy then ms.tp.all_reduce_grads(model, pp_mesh.replicate, 'avg') end
      gnorm = ms.pp.clip_grad_norm_(model, grad_clip, { defer = grad_clip and opt or nil })
    elseif tp_mesh and ep_group then
      -- the experts' gradients summed over their copies and divided by the
      -- data-parallel ranks, the others averaged over them (ms.ep); the norm
      -- counts each expert and each slice once
      -- (under FSDP the units reduced them: the experts' over their copies)
      if not strategy then ms.ep.all_reduce_grads(model, tp_mesh.replicate) end
      gnorm = ms.ep.clip_grad_norm_(model, grad_clip, { defer = grad_clip and opt or nil })
    elseif tp_mesh then
      -- (under FSDP the gradients were reduced over mesh.replicate already)
      if not strategy then ms.tp.all_reduce_grads(model, tp_mesh.replicate, 'avg') end
      gnorm = ms.tp.clip_grad_norm_(model, grad_clip, { defer = grad_clip and opt or nil })
    elseif ep_group and not strategy then
      -- the mean over every rank's loss: the experts' gradients summed over
      -- their copies, the others' averaged (ms.ep)
      ms.ep.all_reduce_grads(model)
      gnorm = ms.ep.clip_grad_norm_(model, grad_clip, { defer = grad_clip and opt or nil })
    elseif strategy then
      -- (reduce_after: every unit's all-reduce now, its backwards done)
      if reduce_after then ms.fsdp.reduce_grads(model) end
      -- (keep_norm: a device tensor, read after the step: in a capture)
      gnorm = ms.fsdp.clip_grad_norm(model, grad_clip or math.huge)
      if not keep_norm then gnorm = gnorm:item() end
    else
      -- (the norm stays on the device: read after the step, or after its replay)
      gnorm = ms.optim.clip_grad_norm(params, grad_clip, { tensor = true })
    end
    out.gnorm = gnorm
    return out
  end
  local function grads_of(step, batch, keep_norm) return reduced_grads(local_grads(step, batch), keep_norm) end
  local function value(v) return type(v) == 'number' and v or v:item() end

  -- --cuda-graphs (docs/cuda-graphs.md, "In bin/train"). Every step's
  -- micro-batches are copied into static device tensors (through
  -- page-locked buffers, on the compute stream), which the step reads,
  -- eager or replayed. After --graph-warmup eager steps, grads_of is
  -- captured once (graph A: zeroing, every micro-batch's forward and
  -- backward, the clipped norm; its outputs the losses and the norm) and,
  -- at the first step whose update goes ahead, opt:step() (graph B: AdamW,
  -- whose replay hook writes the step's constants from the lr the schedule
  -- set). Between A and B the host reads the losses and the norm, as the
  -- eager loop does, so a NaN/inf still skips the update. A step unlike the
  -- captured one (an --inject-nan step, a batch of another shape) runs
  -- eagerly in between. A capture refused by an op is reported once and
  -- the run goes on eagerly.
  -- Data parallel (several processes, NO_SHARD units; reduce_after): every
  -- backward under no_sync into the units' unsharded gradient buffers, then
  -- reduced_grads. With --graph-collectives on (G.coll) graph A is all of
  -- grads_of: the all-reduces are recorded into it (NCCL under capture: the
  -- communication stream forked from the captured one and joined back by
  -- each wait), the norm stays a device tensor; the gradient shards it
  -- makes in its memory are written by each replay, unseen by Lua, so the
  -- loop keeps them (fsdp.grad_shards) and hands them back after each
  -- replay (fsdp.set_grad_shards). When that capture fails on any rank
  -- (every rank asks the others: all take the same path) it is reported
  -- once and graph A is captured again as local_grads alone (off's split):
  -- after its replay the loop hands the unsharded buffers back to the
  -- units (fsdp.set_grad_buffers) and runs reduced_grads eagerly. Graph B
  -- is fsdp.AdamW's step; it reads each unit's gradient shard where the
  -- capture found it (the buffer itself with an f32 reduction; a reduction
  -- that makes new memory is copied there first).
  local graphs
  if o.cuda_graphs then
    local cuda = ms.cuda
    local G = { at = start_step + o.graph_warmup, replays = 0, dp = strategy ~= nil,
      coll = strategy ~= nil and o.graph_collectives == 'on' }
    graphs = G
    -- this step's micro-batches -> fits (the static tensors' shapes: copied
    -- into them), the host batches
    local function fetch()
      local hb = {}
      for k = 1, accum do hb[k] = { train_loader:next() } end
      if not G.static then
        G.static = {}
        for k = 1, accum do
          local x, y = hb[k][1], hb[k][2]
          G.static[k] = { x = x:to(device), y = y:to(device), hx = cuda.pinned_empty(x.shape, x.dtype),
            hy = cuda.pinned_empty(y.shape, y.dtype) }
        end
      end
      for k = 1, accum do
        local s, x, y = G.static[k], hb[k][1], hb[k][2]
        if x.dtype ~= s.x.dtype or y.dtype ~= s.y.dtype or T.shape_str(x.shape) ~= T.shape_str(s.x.shape)
           or T.shape_str(y.shape) ~= T.shape_str(s.y.shape) then
          return false, hb
        end
      end
      -- (the page-locked buffers are free again: the last step's copies
      -- ran before its losses were read)
      for k = 1, accum do
        local s, x, y = G.static[k], hb[k][1], hb[k][2]
        s.hx:copy_(x); s.hy:copy_(y)
        cuda.copy_async_(s.x, s.hx); cuda.copy_async_(s.y, s.hy)
        x:free(); y:free()
      end
      return true, hb
    end
    local function static_batch(k) return G.static[k].x, G.static[k].y end
    local function reason(err) return (tostring(err):gsub('^[^:\n]*%.lua:%d+: ', '')) end
    -- G.capture(step, with_reduce) -> graph A and grads_of's results (of
    -- local_grads alone for a data-parallel step without with_reduce), or
    -- nil and why the capture failed (then discarded: the forward it put on
    -- the tape cleared, the gradients and reductions it left dropped)
    function G.capture(step, with_reduce)
      local out
      local ok, g = pcall(cuda.graph, function()
        local done, err = pcall(function()
          if G.dp and not with_reduce then out = local_grads(step, static_batch)
          else out = grads_of(step, static_batch, true) end
        end)
        -- (every collective's stream joined back before the capture ends;
        -- an error after some all-reduces were recorded: theirs joined
        -- before the capture is discarded)
        if not done then
          if with_reduce then dist.join_captured() end
          error(err, 0)
        end
        if with_reduce then dist.check_joined('--cuda-graphs') end
        local list = {}   -- (the graph keeps what it returns; dp split: no norm yet)
        if out.gnorm ~= nil then list[1] = out.gnorm end
        for k = 1, accum do list[#list + 1] = out.losses[k] end
        for _, l in ipairs(out.mtp or {}) do for k = 1, accum do list[#list + 1] = l[k] end end
        return unpack(list)
      end, { warmup = 0 })
      if ok then return g, out end
      ms.autograd.clear_tape()
      if G.dp then opt:zero_grad() end
      return nil, reason(g)
    end
    -- grads(step) -> grads_of's results, whether they came from a replay
    function G.grads(step)
      local fits, hb = fetch()
      if not fits then
        if not G.told_shape then
          G.told_shape = true
          warn(('--cuda-graphs: step %d\'s batch (%s) is not the captured shape (%s): run eagerly'):format(step,
            T.shape_str(hb[1][1].shape), T.shape_str(G.static[1].x.shape)))
        end
        return grads_of(step, function(k) return to_device(hb[k][1], hb[k][2]) end), false
      end
      if G.off or step < G.at or inject[step] then return grads_of(step, static_batch), false end
      if not G.a then
        local g, out, coll = train.capture_graph_a({
          coll = G.coll,
          capture = function(with_reduce) return G.capture(step, with_reduce) end,
          -- (every rank's answer: the least, on the device, read once)
          agree = multi and function(ok)
            local flag = T.full({ 1 }, ok and 1 or 0, { dtype = 'f32', device = device })
            dist.all_reduce(flag, 'min')
            local all = flag:item() == 1
            flag:free()
            return all
          end or nil,
          discard = function(a) a:free(); opt:zero_grad() end,
          warn = warn, clipping = grad_clip ~= nil,
        })
        if not g then
          G.off = true
          warn(('--cuda-graphs: the step could not be captured, training on eagerly: %s'):format(out))
          return grads_of(step, static_batch), false
        end
        G.coll = coll
        G.a, G.out = g, out
        -- each parameter's gradient in the graph's memory: an eager step in
        -- between (an --inject-nan one) makes its own, a replay writes these
        -- (dp: the units' gradient shards, or with the all-reduce outside
        -- the graph their unsharded gradient buffers)
        if G.coll then G.shards = ms.fsdp.grad_shards(model)
        elseif G.dp then G.gbuf = ms.fsdp.grad_buffers(model)
        else
          G.grad = {}
          for i, p in ipairs(params) do G.grad[i] = p.grad or false end
        end
        local what = grad_clip and 'clipping' or 'the norm'
        log('cuda graphs: step %d captured (%d micro-batch%s: forward, backward%s), replayed from now on', step,
          accum, accum == 1 and '' or 'es', G.coll and (', the gradient all-reduce, ' .. what)
            or G.dp and ('; the gradient all-reduce and %s eager after it'):format(what)
            or (grad_clip and ', clipping' or ', the gradient norm'))
      end
      if G.coll then
        -- (the Lua side of the captured zeroing, then the shards the
        -- replay wrote given back to the units; the replay watched as a
        -- collective of the world: a peer that hangs aborts the group)
        opt:zero_grad()
        G.a:replay()
        if multi then dist.watch('the replay of the step\'s graph (its gradient all-reduces)') end
        ms.fsdp.set_grad_shards(model, G.shards)
        G.replays = G.replays + 1
        return G.out, true
      end
      if G.dp then
        -- (the Lua side of the captured zeroing: the last step's gradient
        -- shards let go; the replay's buffers then given to the units)
        opt:zero_grad()
        G.a:replay()
        ms.fsdp.set_grad_buffers(model, G.gbuf)
        G.replays = G.replays + 1
        return reduced_grads({ losses = G.out.losses, mtp = G.out.mtp }), true
      end
      G.a:replay()
      for i, p in ipairs(params) do p.grad = G.grad[i] or nil end
      G.replays = G.replays + 1
      return G.out, true
    end
    -- dp: each unit's gradient shard where graph B reads it (G.home, the
    -- tensors the capture found): one in other memory (a bf16 reduction's
    -- f32 result, an eager step's) copied there and made an alias of it
    local function home_grads()
      for i, u in ipairs(ms.fsdp.units(model)) do
        local h, g = G.home[i], u.fp.shard.grad
        if h and g ~= nil and not (g.storage == h.storage and g.offset == h.offset) then
          T.raw_copy_(h, g)
          g:free()
          u.fp.shard.grad = h:alias()
          u.fp.grad_shard = u.fp.shard.grad
        elseif h and g == nil then
          error(('--cuda-graphs: unit %s has no gradient at a replayed step (it had one when the optimizer step '
            .. 'was captured)'):format(u.label), 0)
        end
      end
    end
    -- the update after a replayed step: opt:step() captured at the first
    -- one (the capture takes no step: its replay does), then replayed
    function G.update()
      if not G.b and not G.b_off then
        local counts = {}
        for _, st in pairs(opt.state) do counts[st] = st.step end
        if G.dp then
          G.home = {}
          for i, u in ipairs(ms.fsdp.units(model)) do
            local gs = u.fp.shard.grad
            G.home[i] = gs ~= nil and gs:alias() or false
          end
        end
        local ok, g = pcall(cuda.graph, function() opt:step() end, { warmup = 0 })
        if ok then G.b = g
        else
          for st, n in pairs(counts) do st.step = n end   -- (a refusal midway leaves no count moved)
          G.b_off = true
          warn(('--cuda-graphs: the optimizer step could not be captured, stepping it eagerly: %s'):format(reason(g)))
        end
      end
      if G.b then
        if G.dp then home_grads() end
        G.b:replay()
      else opt:step() end
    end
    function G.free()
      if G.a then G.a:free() end
      if G.b then G.b:free() end
      for _, list in ipairs({ G.gbuf or {}, G.home or {}, G.shards or {} }) do
        for _, t in ipairs(list) do if t then t:free() end end
      end
      G.a, G.b, G.off, G.gbuf, G.home, G.shards = nil, nil, true, nil, nil, nil
    end
  end

  for step = start_step, o.steps do
    local lr = lr_at(step)
    set_lr(opt, lr)
    local out, replayed
    if graphs then out, replayed = graphs.grads(step)
    else out = grads_of(step, function() return to_device(train_loader:next()) end) end
    -- (every loss of the step read at once, train.host_values; summed here
    -- in the micro-batches' order, as each was read apart before)
    local mtp_l = out.mtp or {}
    local all = {}
    for k = 1, accum do all[k] = out.losses[k] end
    for d, l in ipairs(mtp_l) do for k = 1, accum do all[d * accum + k] = l[k] end end
    local vals = train.host_values(all, (#mtp_l + 1) * accum)
    local lsum, mtp_sum = 0, nil
    for k = 1, accum do lsum = lsum + vals[k] end
    for d, l in ipairs(mtp_l) do
      mtp_sum = mtp_sum or {}
      mtp_sum[d] = 0
      for k = 1, accum do if l[k] ~= nil then mtp_sum[d] = mtp_sum[d] + vals[d * accum + k] end end
    end
    local lv = lsum / accum
    local gnorm = value(out.gnorm)
    local rec = { step = step, lr = lr, elapsed_s = now() - t0 }
    if replayed then rec.replayed = true end
    -- several ranks decide on the gradient norm, the same on every rank (a
    -- NaN loss on one rank makes it NaN)
    local good = finite(gnorm) and (multi or finite(lv))
    if good then
      if replayed then graphs.update() else opt:step() end
      -- (the routers' biases move towards balance, the counts summed over
      -- the ranks whose tokens differ: every rank but a pipeline's other stages)
      if o.moe_bias_rate > 0 then
        ms.nn.moe.update_bias(model, o.moe_bias_rate, pp_mesh and pp_mesh.replicate or (multi and dist.world_group or nil))
      end
      bad_run = 0
      rec.loss, rec.grad_norm = lv, gnorm
    else
      -- no update: the gradients are dropped, the step (its data, its lr) is spent
      opt:zero_grad()
      if o.moe_bias_rate > 0 then ms.nn.moe.reset_counts(model) end
      bad_run, bad_total = bad_run + 1, bad_total + 1
      rec.skipped = true
      rec.bad_loss, rec.bad_grad_norm = tostring(lv), tostring(gnorm)
      log('step %d: loss %s, grad norm %s: skipped (%d in a row, %d in all)', step, tostring(lv), tostring(gnorm), bad_run, bad_total)
      if bad_run >= o.max_bad_steps then
        rec.bad_steps = bad_total
        pending[#pending + 1] = { rec = rec, ok = false }
        flush()
        if mf then mf:close() end
        error(('train: %d steps in a row with a NaN/inf loss or gradient norm (steps %d-%d, %d in all): stopping '
          .. '(--max-bad-steps %d); try a lower --lr or --grad-clip, or resume from the last checkpoint'):format(
          bad_run, step - bad_run + 1, step, bad_total, o.max_bad_steps), 0)
      end
    end
    if bad_total > 0 then rec.bad_steps = bad_total end
    dist.trace_step(step)   -- (MS_DIST_COUNT=1: the step's collectives on stderr, docs/dist.md)
    ms.profile.ops_step(step)   -- (MS_OP_COUNT=1: the step's ops on stderr, docs/tensors.md)
    -- LuaJIT specialises a trace on a closure it calls while the closure's
    -- prototype has made fewer than three, and the trace keeps it, with the
    -- tensors its upvalues hold, for as long as it lives (with tensor.lua's
    -- 16 MiB code area: the run). So the traces of the first steps, which
    -- can hold the setup's closures and the first steps' own, are flushed
    -- once after the third: the traces recorded again specialise on the
    -- prototypes of the closures made each step. (docs/tensors.md,
    -- "Compiled traces keep what they were specialised on"; MS_TRACE_PINS
    -- measures what the traces keep.)
    if step == start_step + 2 then jit.flush() end
    if trace_pins then trace_pins.step(step, rank) end   -- (MS_TRACE_PINS: moonshard.trace_pins)
    local mtp
    if mtp_sum then
      mtp = {}
      for d = 1, #mtp_sum do mtp[d] = mtp_sum[d] / accum end
      if good then rec.mtp_loss = { unpack(mtp) } end
    end
    pending[#pending + 1] = { rec = rec, ok = good, loss = lv, mtp = mtp }
    window_steps = window_steps + 1
    local t = now()
    if not steady_t0 then steady_t0, steady_step = t, step end
    if val_loader and (step == o.steps or (o.eval_every > 0 and step % o.eval_every == 0)) then
      local te = now()
      val_loss = validate()
      rec.val_loss = val_loss
      eval_s = eval_s + (now() - te)
    end
    local log_now = step % o.log_every == 0 or step == o.steps or step == start_step
    if log_now or not multi then settle() end
    if log_now or (tty and not multi) then
      -- throughput of the training steps alone (validation time left out)
      local dt = now() - t_window - eval_s
      rate = window_steps * tokens_per_step / math.max(dt, 1e-9)
      if log_now then rec.tokens_per_s = rate end
      local per_step = step > steady_step and (t - steady_t0) / (step - steady_step) or dt / window_steps
      local extra = ''
      if on_gpu then
        local mfu = rate * flops_per_token / (o.peak_tflops * 1e12 * world)
        local cuda = require 'moonshard.cuda'
        local mem = cuda.memory_allocated()
        rec.mfu, rec.gpu_mem_bytes = mfu, mem
        extra = (' | MFU %.1f%% | mem %.2f GiB'):format(100 * mfu, mem / 2 ^ 30)
      end
      local line = ('step %' .. #tostring(o.steps) .. 'd/%d | loss %s | lr %.2e | %s tok/s%s | %s elapsed | ETA %s%s'):format(
        step, o.steps, window_n > 0 and ('%.4f'):format(window_loss / window_n) or 'skipped', lr, fmt_rate(rate), extra,
        fmt_duration(t - t0), fmt_duration(per_step * (o.steps - step)),
        rec.val_loss and (' | val %.4f'):format(rec.val_loss) or '')
      if tty then
        status(line)
        if rec.val_loss and not o.quiet and rank == 0 then out_line(line) end -- validations stay on screen
      elseif log_now then
        log('%s', line)
      end
      if log_now then t_window, window_loss, window_n, window_steps, eval_s = now(), 0, 0, 0, 0 end
    end
    if log_now or not multi then flush() end
    last_step = step
    local sig = handle_signals and train.take_signal()
    -- several ranks stop together: the first signal any rank holds
    if multi and handle_signals then
      local s = reduce_numbers({ sig or 0 }, 'max')[1]
      sig = s > 0 and s or nil
    end
    -- (a signal during the last step: the run ends as it would anyway)
    if sig and step < o.steps then interrupted = train.signal_names[sig] or ('signal ' .. sig) end
    if o.stop_at > 0 and step >= o.stop_at and step < o.steps then interrupted = interrupted or ('--stop-at ' .. o.stop_at) end
    -- --async-checkpoint: the save in the background completes at the first
    -- step boundary where every rank has written its files
    if ckpt_pending then
      local ready = ckpt_pending.ready()
      if multi then ready = reduce_numbers({ ready and 1 or 0 }, 'min')[1] == 1 end
      if ready then finish_pending() end
    end
    if interrupted or (o.save_every > 0 and step % o.save_every == 0 and step < o.steps) then
      flush()
      if ckpt_pending then finish_pending() end   -- (one save in the background at a time)
      if o.async_checkpoint and not interrupted then
        local ts = now()
        ckpt_pending = save_checkpoint(step, true)
        ckpt_pending.t0 = ts
        log('checkpoint %s/%s: staged in %.2f s, writing in the background', o.out, ckpt.name(step), now() - ts)
      else
        last_ckpt = save_checkpoint(step)
        if not interrupted then log('checkpoint %s', last_ckpt) end
      end
    end
    if interrupted then break end
  end
  -- (the graphs' memory back to the cache: the gradients they wrote become
  -- ordinary tensors)
  if graphs then
    if graphs.a then log('cuda graphs: %d steps replayed', graphs.replays) end
    graphs.free()
  end
  if ckpt_pending then finish_pending() end
  if writer then writer:close() end
  flush()
  local elapsed = now() - t0
  if mf then mf:close() end
  if tty and status_shown then io.stdout:write('\n'); status_shown = false end
  local steps_run = last_step - start_step + 1

  if interrupted then
    log('stopped by %s after step %d/%d: checkpoint %s (continue with --resume)', interrupted, last_step, o.steps, last_ckpt)
    return {
      steps = last_step, first_loss = first_loss, final_loss = last_loss, val_loss = val_loss, elapsed_s = elapsed,
      tokens_per_s = steps_run * tokens_per_step / math.max(elapsed, 1e-9), out = o.out, model = model, options = o,
      interrupted = interrupted, checkpoint = last_ckpt, bad_steps = bad_total, rank = rank, world_size = world,
    }
  end

  -- a pipeline's whole model (its stages gathered), for the saved weights and the sample
  local pp_sd = pp_mesh and (o.save or (o.sample_tokens > 0 and not sharded)) and ms.pp.full_state_dict(model) or nil
  -- (LoRA: the adapters folded into their weights, the plain model's tensors)
  if pp_sd and ms.nn.has_lora(model) then pp_sd = ms.nn.lora_merged(model, pp_sd) end
  if o.save then
    if pp_mesh then
      if rank == 0 then
        local hf = require 'models.hf'
        hf.save_pretrained({ family = model.family, config = model.config, state_dict = function() return pp_sd end },
          o.out)
      end
    elseif tp_mesh or (ep_group and not strategy) then
      local msd
      if tp_mesh and not ep_group then msd = ms.tp.full_checkpoint(model)
      -- (--ep, with --tp too: the ranks of rank 0's group gather the experts, every rank under
      -- --tp --ep --fsdp; --ep --fsdp alone: the branch below streams them, a unit at a time)
      elseif rank < ep_size or strategy then msd = ms.ep.full_state_dict(model, { host = true }) end
      if rank == 0 then
        local hf = require 'models.hf'
        hf.save_pretrained({ family = model.family, config = model.config, state_dict = function() return msd end }, o.out)
      end
    elseif strategy then
      -- config.json from rank 0, the weights gathered (fsdp_checkpoint.save_full, rank 0 writes)
      if rank == 0 then
        local hf = require 'models.hf'
        hf.save_pretrained({ family = model.family, config = model.config, state_dict = function() return {} end }, o.out)
      end
      fck().save_full(model, o.out .. '/model.safetensors')
      -- (the checkpoints' layout where the model's differs: Llama 4's fused experts)
      if rank == 0 and model.family and model.family.export_state_dict then
        require('models.hf').export_file(model.family, o.out .. '/model.safetensors', model.config)
      end
    else
      model:save_pretrained(o.out)
    end
  end
  if o.save_every > 0 and last_step >= start_step then last_ckpt = save_checkpoint(last_step) end

  local sample
  if o.sample_tokens > 0 and not sharded then -- (a sample of byte-level models only: shards carry no tokenizer)
    local prompt = data.encode(o.sample_prompt)
    if #prompt == 0 then prompt = { 10 } end
    -- a sharded model: every rank samples the same tokens (its forwards gather the units)
    if strategy and not pp_mesh then ms.fsdp.unshard(model) end
    -- (context parallelism off: every rank samples the whole sequence)
    if cp_ctx then ms.cp.remove(model) end
    local gen = model
    if pp_mesh then
      -- the pipeline's stages put together again in a whole model (every rank samples the same tokens)
      gen = M.build(model.config)
      gen:load_state_dict(pp_sd)
      gen:to(device)
      gen:eval()
    end
    local ids = gen:generate({ prompt }, o.sample_tokens, {
      temperature = o.temperature, top_k = o.top_k > 0 and o.top_k or nil, seed = o.seed })
    if strategy and not pp_mesh then ms.fsdp.reshard(model) end
    local row = ids:totable()[1]
    local new = {}
    for i = #prompt + 1, #row do new[#new + 1] = row[i] < 256 and row[i] or 63 end
    sample = o.sample_prompt .. data.decode(new)
    log('---- sample (%d tokens, temperature %g) ----\n%s\n----', o.sample_tokens, o.temperature, sanitize(sample))
  end
  local done = ('done: %d steps in %s (%s tok/s), loss %s -> %s%s%s; metrics %s/metrics.jsonl'):format(
    steps_run, fmt_duration(elapsed), fmt_rate(steps_run * tokens_per_step / math.max(elapsed, 1e-9)),
    first_loss and ('%.4f'):format(first_loss) or '-', last_loss and ('%.4f'):format(last_loss) or '-',
    val_loss and (', val %.4f'):format(val_loss) or '', bad_total > 0 and (', %d bad steps skipped'):format(bad_total) or '',
    o.out)
  if rank == 0 then log('%s', done)
  elseif not o.quiet then out_line(('%s (rank %d of %d)'):format(done, rank, world)) end -- every rank says it finished
  return {
    steps = o.steps, first_loss = first_loss, final_loss = last_loss, val_loss = val_loss,
    elapsed_s = elapsed, tokens_per_s = steps_run * tokens_per_step / math.max(elapsed, 1e-9),
    out = o.out, sample = sample, model = model, options = o, bad_steps = bad_total, checkpoint = last_ckpt,
    rank = rank, world_size = world,
  }
end

-- ------------------------------------------------------------------ main
train.help = [[
usage: bin/train FILE [options]
       bin/train --config CONFIG [options]       (configs/tiny.lua, configs/gpt2-124m.lua, configs/llama-1b.lua)
       bin/train --resume RUN_DIR [options]      (continue from its newest complete checkpoint)

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

-- train.main_args(args) -> exit status: `bin/train --config FILE [options]`
-- (the options name the config; the config names the model)
function train.main_args(args)
  local ok, status = xpcall(function()
    for _, a in ipairs(args) do
      if a == '--help' or a == '-h' then print(train.usage_text()); return 0 end
    end
    train.run(train.parse_args(args))
    return 0
  end, function(e)
    if train.is_usage_error(e) then return e end
    return { msg = tostring(e), tb = debug.traceback(tostring(e), 2) }
  end)
  if ok then return status end
  if train.is_usage_error(status) then
    io.stderr:write('bin/train: ', status.msg, '\n')
    return 2
  end
  io.stderr:write('bin/train: ', status.msg, '\n')
  if os.getenv('MS_TRACEBACK') then io.stderr:write(status.tb, '\n')
  else io.stderr:write('(MS_TRACEBACK=1 prints the traceback)\n') end
  return 1
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
    -- bin/train blocked SIGINT/SIGTERM for the built-in loop (see signals);
    -- a training script gets the default behaviour back
    local blocked = train.signals_blocked()
    if blocked then train.block_signals(false) end
    local rets = { chunk(unpack(args)) }
    local v = rets[1]
    local kind = train.kind_of(v)
    if blocked and (kind == 'model' or kind == 'config') then train.block_signals(true) end
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
      for _, a in ipairs(args) do
        if a == '--help' or a == '-h' then   -- the options, and its model's presets when it names one
          local okm, M = pcall(train.load_model, v.model)
          print(train.usage_text(okm and M or nil)); return 0
        end
      end
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
