-- configs/llama-1b.lua — a ~1.2B-parameter Llama (the shapes of Llama 3.2
-- 1B: models/llama.lua's '1b' preset) on one GPU with 1M tokens per optimizer
-- step (8 x 2048 tokens per micro-batch, 64 micro-batches).
--
--   bin/train --config configs/llama-1b.lua --data corpus.txt --out runs/llama-1b
--   bin/train --config configs/llama-1b.lua --out runs/llama-1b --resume
--   bin/train --nproc-per-node 8 --device cuda --config configs/llama-1b.lua --fsdp FULL_SHARD
--       (8 GPUs, LlamaDecoderLayer units, 8 micro-batches per GPU for the same 1M tokens per step)
return {
  model = 'models/llama.lua',
  preset = '1b',
  device = 'cuda',
  dtype = 'f32',
  steps = 20000,
  batch_size = 8,
  seq_len = 2048,
  tokens_per_step = 1048576,
  lr = 3e-4,
  min_lr = 3e-5,
  warmup = 2000,
  weight_decay = 0.1,
  beta1 = 0.9,
  beta2 = 0.95,
  eps = 1e-8,
  grad_clip = 1.0,
  eval_every = 500,
  eval_iters = 20,
  log_every = 10,
  save_every = 500,
  -- the checkpoints (15 GB: f32 weights and AdamW moments) written by a
  -- background thread: a save costs the run ~0.3 s instead of ~16 s, for
  -- 15 GB of page-locked host memory (docs/checkpoints.md)
  async_checkpoint = true,
  keep_checkpoints = 2,
  sample_tokens = 128,
  peak_tflops = 989,
  model_config = {},
}
