-- bench/train_graphs.lua — tokens/s of `bin/train --device cuda` with and
-- without --cuda-graphs (docs/cuda-graphs.md, "In bin/train"):
--
--   luajit bench/train_graphs.lua                      the small and the medium Llama, bf16 autocast
--   luajit bench/train_graphs.lua --only small --steps 100 --autocast off
--   luajit bench/train_graphs.lua --nproc 2            data parallel on 2 GPUs
--
-- Options: --steps (60), --graph-warmup (3), --accum (1: micro-batches a
-- step), --autocast (bf16 or off), --only (small, medium or both),
-- --nproc (1: processes, one a GPU, data parallel: bin/train
-- --nproc-per-node N; the shapes are each rank's, so N times the tokens a
-- step), --float8 (off, or a recipe: tensorwise, rowwise, ...).
--
-- With --nproc N > 1 each row gets two more runs: eager with
-- --no-overlap-grad-reduce (every all-reduce after the backward, as the
-- graphed step runs them): `after tok/s` splits what the graphs gain from
-- what the reduction's lost overlap costs; and --cuda-graphs
-- --graph-collectives off (the all-reduce and clipping eager between the
-- two graphs, the default): `split tok/s` against `graph tok/s` (run with
-- --graph-collectives on: the all-reduce inside the first graph) is what recording NCCL into the graph
-- gains. Under data parallel --autocast
-- does not apply: FSDP's mixed precision (bf16 parameters, f32 reduction)
-- sets the compute dtype.
--
-- Each row is two bin/train processes on the same data and seed: the
-- built-in loop as it is, then with --cuda-graphs. small: a host-bound
-- Llama (16 layers of hidden 256, 1 x 128 tokens: thousands of small
-- kernels, each costing more to launch than to run); medium: a Llama of 8
-- layers of hidden 1024, 8 x 512 tokens, where the GPU's work dominates.
-- The rate is the steady one, from the metrics' elapsed times between the
-- step after the capture and the last step (the warm-up, the capture and
-- GEMM tuning left out; the loop's per-step loss and norm reads included,
-- as a run has them), in tokens/s and ms a step. `same`: whether the two
-- runs logged the same losses, bit for bit (both read the GEMM plans a
-- short run tuned into one file first).
package.path = './lua/?.lua;./lua/?/init.lua;./?.lua;' .. package.path
local ms = require 'moonshard'
local json = require 'dkjson'
local B = require 'bench.common'

local opts = B.parse_args({ steps = 60, ['graph-warmup'] = 3, accum = 1, autocast = 'bf16', only = 'both', nproc = 1,
  float8 = 'off' },
  'usage: luajit bench/train_graphs.lua [--steps N] [--graph-warmup N] [--accum N] [--autocast bf16|off] '
  .. '[--only small|medium|both] [--nproc N] [--float8 off|tensorwise|rowwise|...]')
if not ms.cuda.is_available() then error('bench/train_graphs.lua: no CUDA device') end
local nproc = opts.nproc
if type(nproc) ~= 'number' or nproc < 1 or nproc ~= math.floor(nproc) then
  error('bench/train_graphs.lua: --nproc must be a whole number >= 1, got ' .. tostring(nproc))
end
if nproc > ms.cuda.device_count() then
  error(('bench/train_graphs.lua: --nproc %d needs %d GPUs, %d here'):format(nproc, nproc, ms.cuda.device_count()))
end
local warm = opts['graph-warmup']
if opts.steps < warm + 10 then error('bench/train_graphs.lua: --steps must leave at least 10 replayed steps') end

local shapes = {
  { name = 'small', batch = 1, seq = 128, flags = '--model.num_hidden_layers 16 --model.hidden_size 256 '
    .. '--model.intermediate_size 704 --model.num_attention_heads 4 --model.num_key_value_heads 2 '
    .. '--model.max_position_embeddings 128' },
  { name = 'medium', batch = 8, seq = 512, flags = '--model.num_hidden_layers 8 --model.hidden_size 1024 '
    .. '--model.intermediate_size 2816 --model.num_attention_heads 16 --model.num_key_value_heads 8 '
    .. '--model.max_position_embeddings 512' },
}

local function q(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end
local tmp = io.popen('mktemp -d'):read('*l')

-- one bin/train run -> step -> metrics row, the output. The GEMM plans:
-- tuned once per shape by a short run into one file, which both timed runs
-- read (each would otherwise time its own, and may pick others: other bits)
-- (graphs: true, false, 'after': eager with --no-overlap-grad-reduce, or
-- 'split': --cuda-graphs --graph-collectives off)
local function run(shape, graphs, out, steps)
  steps = steps or opts.steps
  local cmd = ('MS_GEMM_TUNE=1 MS_GEMM_TUNE_FILE=%s luajit bin/train %s models/llama.lua --preset tiny %s '
    .. '--device cuda --batch-size %d --seq-len %d '
    .. '--tokens-per-step %d --steps %d --warmup 5 --eval-every 0 --eval-iters 1 --sample-tokens 0 --no-save '
    .. '--log-every 1000000 --autocast %s --float8 %s %s --out %s 2>&1'):format(
    q(tmp .. '/' .. shape.name .. '-gemm.txt'), nproc > 1 and ('--nproc-per-node %d'):format(nproc) or '',
    shape.flags, shape.batch, shape.seq,
    shape.batch * shape.seq * opts.accum * nproc, steps, nproc > 1 and 'auto' or opts.autocast, opts.float8,
    graphs == 'after' and '--no-overlap-grad-reduce'
      or graphs and ('--cuda-graphs --graph-warmup %d%s'):format(warm,
        graphs == 'split' and ' --graph-collectives off' or nproc > 1 and ' --graph-collectives on' or '') or '',
    q(out))
  local p = io.popen(cmd)
  local text = p:read('*a')
  local ok = p:close()
  local rows = {}
  local f = io.open(out .. '/metrics.jsonl')
  if f then
    for line in f:lines() do
      local r = json.decode(line, 1, nil)
      if type(r) == 'table' then rows[r.step] = r end
    end
    f:close()
  end
  if not rows[steps] then error(('bench/train_graphs.lua: the run failed:\n%s\n%s'):format(cmd, text)) end
  return rows, text, ok
end

-- tokens/s and ms a step from step s0 to the last
local function rate(rows, shape)
  local s0, s1 = warm + 2, opts.steps
  local dt = rows[s1].elapsed_s - rows[s0].elapsed_s
  local tokens = (s1 - s0) * shape.batch * shape.seq * opts.accum * nproc
  return tokens / dt, dt * 1e3 / (s1 - s0)
end

print(('bin/train models/llama.lua --device cuda, %d steps (steady rate from step %d), %d micro-batch%s a step, '
  .. '%s, float8 %s; %s'):format(opts.steps, warm + 2, opts.accum, opts.accum == 1 and '' or 'es',
  nproc > 1 and ('%d processes data parallel (NO_SHARD, bf16/f32)'):format(nproc) or 'autocast ' .. opts.autocast,
  opts.float8, ms.cuda.get_device_name()))
print(('%-7s %9s %12s %10s %12s %10s %8s %6s %9s%s'):format('model', 'tokens', 'eager tok/s', 'eager ms', 'graph tok/s',
  'graph ms', 'speedup', 'same', 'replayed', nproc > 1 and (' %12s %12s'):format('after tok/s', 'split tok/s') or ''))
for _, shape in ipairs(shapes) do
  if opts.only == 'both' or opts.only == shape.name then
    run(shape, false, tmp .. '/' .. shape.name .. '-tune', 2)
    local ea = run(shape, false, tmp .. '/' .. shape.name .. '-eager')
    local ga, text = run(shape, true, tmp .. '/' .. shape.name .. '-graphs')
    local aa = nproc > 1 and run(shape, 'after', tmp .. '/' .. shape.name .. '-after') or nil
    local sa = nproc > 1 and run(shape, 'split', tmp .. '/' .. shape.name .. '-split') or nil
    local er, ems = rate(ea, shape)
    local gr, gms = rate(ga, shape)
    local same, replayed = true, 0
    for s = 1, opts.steps do
      if ea[s].loss ~= ga[s].loss or ea[s].grad_norm ~= ga[s].grad_norm then same = false end
      if aa and (aa[s].loss ~= ea[s].loss or aa[s].grad_norm ~= ea[s].grad_norm) then same = false end
      if sa and (sa[s].loss ~= ea[s].loss or sa[s].grad_norm ~= ea[s].grad_norm) then same = false end
      if ga[s].replayed then replayed = replayed + 1 end
    end
    local refused = text:match('%-%-cuda%-graphs: ([^\n]*)')
    print(('%-7s %9d %12.0f %10.3f %12.0f %10.3f %7.2fx %6s %9d%s%s'):format(shape.name, shape.batch * shape.seq *
      opts.accum * nproc, er, ems, gr, gms, gr / er, same and 'yes' or 'NO', replayed,
      aa and (' %12.0f %12.0f'):format((rate(aa, shape)), (rate(sa, shape))) or '',
      refused and ('   (' .. refused .. ')') or ''))
  end
end
os.execute('rm -rf ' .. q(tmp))
print('(tok/s, ms: a step of the loop, host reads of the loss and norm included; same: the losses and gradient norms '
  .. 'of the runs equal bit for bit; replayed: steps run by the graphs' .. (nproc > 1 and '; after: eager with '
  .. '--no-overlap-grad-reduce; graph: with --graph-collectives on; split: --cuda-graphs --graph-collectives off, the all-reduce eager between the '
  .. 'graphs' or '') .. ')')
