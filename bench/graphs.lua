-- bench/graphs.lua — a host-bound training step eager and replayed by a
-- CUDA graph (ms.cuda.graph, docs/cuda-graphs.md):
--
--   luajit bench/graphs.lua                        16 layers, hidden 256, 1 x 128 tokens
--   luajit bench/graphs.lua --layers 4 --seq 512   another shape
--
-- Options: --layers (16), --hidden (256), --seq (128), --batch (1), --vocab
-- (4096), --steps (50, timed), --warmup (3, cuda.graph's warm-up),
-- --precision (both: f32 and bf16 autocast rows; or f32, bf16).
--
-- The step is a Llama forward (loss), backward and AdamW step with static
-- token buffers. Eager: each kernel is launched from Lua (tens of
-- microseconds of host work a node), so a small step waits on the host;
-- replayed: one cudaGraphLaunch (and the AdamW constants' kernel). Time:
-- CUDA events around `steps` back-to-back steps (ms a step; the GPU's
-- clock, host gaps included) and the host's wall clock for the same loop.
-- Also printed: whether the replays' losses equal the eager steps' from
-- the same start, bit for bit (they should).
package.path = './lua/?.lua;./lua/?/init.lua;./?.lua;' .. package.path
local ms = require 'moonshard'
local B = require 'bench.common'
local llama = require 'models.llama'

local opts = B.parse_args({ layers = 16, hidden = 256, seq = 128, batch = 1, vocab = 4096, steps = 50, warmup = 3,
  precision = 'both' },
  'usage: luajit bench/graphs.lua [--layers N] [--hidden N] [--seq T] [--batch B] [--vocab V] [--steps N] '
  .. '[--warmup N] [--precision both|f32|bf16]')
if not ms.cuda.is_available() then error('bench/graphs.lua: no CUDA device') end

local function make(precision)
  ms.manual_seed(1)
  local m = llama.new('tiny', { num_hidden_layers = opts.layers, hidden_size = opts.hidden,
    intermediate_size = math.floor(opts.hidden * 2.75), num_attention_heads = math.max(1, opts.hidden / 64),
    num_key_value_heads = math.max(1, opts.hidden / 128), vocab_size = opts.vocab,
    max_position_embeddings = opts.seq }):to('cuda')
  if precision == 'bf16' then m = ms.nn.functional.set_precision(m, { compute = 'bf16' }) end
  return m, ms.optim.AdamW(m, { lr = 1e-3 })
end

local function tokens(seed)
  local rows, st = {}, seed
  for b = 1, opts.batch do
    rows[b] = {}
    for t = 1, opts.seq do
      st = (st * 1103515245 + 12345) % 2147483648
      rows[b][t] = st % opts.vocab
    end
  end
  return ms.tensor(rows, { dtype = 'i64' }):to('cuda')
end

local function step(m, o, x, y)
  o:zero_grad({ set_to_none = false })
  local loss = m(x, y)
  loss:backward()
  o:step()
  return loss
end

-- ms a step by events and by the host's clock, over opts.steps runs of fn
local function timed(fn)
  ms.cuda.synchronize()
  local e0, e1 = ms.cuda.event({ timing = true }), ms.cuda.event({ timing = true })
  local t0 = B.now()
  e0:record()
  for _ = 1, opts.steps do fn() end
  e1:record()
  e1:synchronize()
  local wall = (B.now() - t0) * 1e3 / opts.steps
  return e0:elapsed_ms(e1) / opts.steps, wall
end

local function row(precision)
  local x, y = tokens(11), tokens(12)
  -- eager
  local ma, oa = make(precision)
  for _ = 1, opts.warmup do step(ma, oa, x, y) end
  local first_eager = step(ma, oa, x, y):item()
  local ev_e, wall_e = timed(function() step(ma, oa, x, y) end)
  -- replayed, from the same start
  local mb, ob = make(precision)
  local ok, g = pcall(ms.cuda.graph, function() return step(mb, ob, x, y) end, { warmup = opts.warmup })
  if not ok then
    return ('%-6s %10.3f %10.3f   capture failed: %s'):format(precision, ev_e, wall_e, tostring(g))
  end
  local first_graph = g:replay():item()
  local stats0 = ms.cuda.memory_stats()
  local ev_g, wall_g = timed(function() g:replay() end)
  local stats1 = ms.cuda.memory_stats()
  g:free()
  return ('%-6s %10.3f %10.3f %10.3f %10.3f %8.2fx %8s %8d %8d'):format(precision, ev_e, wall_e, ev_g, wall_g,
    ev_e / ev_g, first_eager == first_graph and 'yes' or ('%.3g'):format(first_graph - first_eager),
    stats1.num_mallocs - stats0.num_mallocs, stats1.num_host_syncs - stats0.num_host_syncs)
end

print(('Llama %d layers, hidden %d, %d x %d tokens, vocab %d; %d steps timed; %s'):format(opts.layers, opts.hidden,
  opts.batch, opts.seq, opts.vocab, opts.steps, ms.cuda.get_device_name()))
print(('%-6s %10s %10s %10s %10s %9s %8s %8s %8s'):format('', 'eager ms', 'eager wall', 'graph ms', 'graph wall',
  'speedup', 'same', 'mallocs', 'syncs'))
local precisions = opts.precision == 'both' and { 'f32', 'bf16' } or { opts.precision }
for _, p in ipairs(precisions) do print(row(p)) end
print('(ms: CUDA events a step; wall: host clock a step; same: the first replay\'s loss equals the eager step\'s '
  .. 'from the same start; mallocs, syncs: during the timed replays)')
