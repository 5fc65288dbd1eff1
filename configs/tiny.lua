-- configs/tiny.lua — a byte-level GPT-2 that trains on a laptop CPU in
-- minutes (about 0.8M parameters), checkpointing as it goes.
--
--   bin/train --config configs/tiny.lua
--   bin/train --config configs/tiny.lua --steps 2000 --model.n_layer 6 --out runs/tiny6
--   bin/train --config configs/tiny.lua --out runs/tiny --resume
--   bin/train --nproc-per-node 2 --device cpu --config configs/tiny.lua --fsdp --out runs/tiny2
--       (2 ranks through mpirun, 16 sequences each: 32 per step)
return {
  model = 'models/gpt2.lua',
  preset = 'tiny',
  device = 'cpu',
  steps = 500,
  batch_size = 16,
  seq_len = 128,
  lr = 3e-3,
  warmup = 30,
  weight_decay = 0.1,
  grad_clip = 1.0,
  eval_every = 100,
  eval_iters = 8,
  log_every = 25,
  save_every = 100,
  keep_checkpoints = 3,
  model_config = {},
}
