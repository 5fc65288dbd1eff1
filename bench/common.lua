-- bench/common.lua — what the GPU benchmarks share: their command line,
-- the timing (CUDA events, median of the runs, L2 flushed before each) and
-- the comparison with a reference.
--
--   local B = require 'bench.common'
--   local opts = B.parse_args({ iters = 20, warmup = 3 },
--     'usage: luajit bench/x.lua [--iters N] [--warmup N]')
--   local timed = B.timer(opts)        -- after checking for a CUDA device
--   local ms_ = timed(function() ... end)
local ms = require 'moonshard'
local F = ms.raw

local B = {}

-- `--name value` pairs of argv (default: the script's arg) over a copy of
-- defaults; an unknown name raises `usage`. Numbers are converted.
function B.parse_args(defaults, usage, argv)
  argv = argv or arg
  local opts = {}
  for k, v in pairs(defaults) do opts[k] = v end
  local i = 1
  while i <= #argv do
    local k = argv[i]:match('^%-%-(.+)$')
    if not k or opts[k] == nil then error(usage) end
    opts[k] = tonumber(argv[i + 1]) or argv[i + 1]
    i = i + 2
  end
  return opts
end

-- the tiny models of the host-cost benchmarks (bench/host_cost.lua,
-- bench/trace_pins.lua): { name, model file, config }, a 16-layer Llama of
-- hidden 64 and a 4-layer DeepSeek-V3 (MLA, 8 routed experts and a shared
-- one, the first layer dense) at tiny widths
local hf = require 'models.hf'
B.tiny_models = {
  { 'llama', 'models/llama.lua', { vocab_size = 256, hidden_size = 64, intermediate_size = 128,
    num_hidden_layers = 16, num_attention_heads = 4, num_key_value_heads = 2, max_position_embeddings = 64,
    bos_token_id = hf.null, eos_token_id = hf.null } },
  { 'deepseek', 'models/deepseek_v3.lua', { vocab_size = 256, hidden_size = 48, intermediate_size = 96,
    moe_intermediate_size = 24, num_hidden_layers = 4, num_attention_heads = 12, n_shared_experts = 1,
    n_routed_experts = 8, routed_scaling_factor = 1.5, kv_lora_rank = 16, q_lora_rank = 20, qk_rope_head_dim = 4,
    v_head_dim = 6, qk_nope_head_dim = 4, n_group = 4, topk_group = 2, num_experts_per_tok = 2,
    first_k_dense_replace = 1, max_position_embeddings = 64, bos_token_id = hf.null, eos_token_id = hf.null } },
}

function B.median(t)
  table.sort(t)
  return t[math.floor((#t + 1) / 2)]
end

-- now() -> seconds on the monotonic clock (wall time, not CPU time): the
-- training loop's clock
B.now = require('moonshard.train').now

-- timer(opts) -> timed(fn): the median ms of opts.iters runs of fn() after
-- opts.warmup, each timed by CUDA events after an L2 flush (a 256 MiB fill
-- of a buffer allocated here); a GC step after each run frees its results
function B.timer(opts)
  local flush_buf = ms.empty({ 64 * 2 ^ 20 }, { device = 'cuda' })
  local function flush_l2() F.fill_(flush_buf, 0) end
  return function(fn)
    for _ = 1, opts.warmup do fn() end
    ms.cuda.synchronize()
    local e0, e1 = ms.cuda.event({ timing = true }), ms.cuda.event({ timing = true })
    local ts = {}
    for k = 1, opts.iters do
      flush_l2()
      e0:record()
      fn()
      e1:record()
      e1:synchronize()
      ts[k] = e0:elapsed_ms(e1)
      collectgarbage('step')
    end
    return B.median(ts)
  end
end

-- ‖got − want‖ / ‖want‖, computed on the CPU in f64
function B.relerr(got, want)
  local g, w = got:to('cpu'):to('f64'), want:to('cpu'):to('f64')
  local d = F.sub(g, w)
  return math.sqrt(F.sum(F.mul(d, d)):item() / F.sum(F.mul(w, w)):item())
end

-- a model of B.tiny_models (its file `path`, config `cfg`) in training
-- mode from seed 1, AdamW at lr 1e-4 over it, and one batch of 1 x T
-- random token ids and targets -> model, opt, ids, targets
function B.tiny_setup(path, cfg, T)
  local ms = require 'moonshard'
  local M = dofile(path)
  ms.manual_seed(1)
  local model = M.new(cfg)
  model:train()
  local opt = ms.optim.AdamW(model, { lr = 1e-4 })
  local V = cfg.vocab_size
  local ids = (ms.rand({ 1, T }, { seed = 1 }) * (V - 1)):long()
  local tg = (ms.rand({ 1, T }, { seed = 2 }) * (V - 1)):long()
  return model, opt, ids, tg
end

return B
