-- configs/gpt2-124m.lua — GPT-2 small (124M parameters, the shapes of
-- openai-community/gpt2) on one GPU: 0.5M tokens per optimizer step by
-- gradient accumulation (16 x 1024 tokens per micro-batch, 32 micro-batches),
-- as in llm.c's GPT-2 reproduction. Byte-level data unless --data says otherwise.
--
--   bin/train --config configs/gpt2-124m.lua --data corpus.txt --out runs/gpt2-124m
--   bin/train --config configs/gpt2-124m.lua --out runs/gpt2-124m --resume
--   bin/train --nproc-per-node 8 --device cuda --config configs/gpt2-124m.lua --fsdp FULL_SHARD
--       (8 GPUs, the same 0.5M tokens per step: 4 micro-batches of 16 x 1024 per GPU;
--        bf16 parameters and f32 reductions by default on CUDA: docs/train.md, "Sharded training")
return {
  model = 'models/gpt2.lua',
  preset = 'gpt2-124m',
  device = 'cuda',
  dtype = 'f32',
  steps = 19073,
  batch_size = 16,
  seq_len = 1024,
  tokens_per_step = 524288,
  lr = 6e-4,
  min_lr = 6e-5,
  warmup = 715,
  weight_decay = 0.1,
  beta1 = 0.9,
  beta2 = 0.95,
  grad_clip = 1.0,
  eval_every = 250,
  eval_iters = 20,
  log_every = 10,
  save_every = 1000,
  keep_checkpoints = 3,
  sample_tokens = 128,
  peak_tflops = 989,
  model_config = {},
}
