-- spec/support.lua — small helpers shared by several specs (not a spec
-- itself: busted runs only *_spec.lua).
--
--   local S = require 'spec.support'
--   local t = S.make({ 2, 3 }, { 1, 2, 3, 4, 5, 6 })   -- a (2, 3) f64 tensor
--   assert.are.same({ 1, 2, 3, 4, 5, 6 }, S.vals(t))
--
-- Tensors in and out of plain Lua lists (make, vals, values), comparisons
-- (relerr, finite), errors (errmsg), the expected results of a collective
-- (collective_val, reduce_expect), JSON fixture files (json_cases), and
-- temporary directories and shell quoting for specs that run commands
-- (tmpdir, shell_quote), bin/train runs, their text and their loss curves
-- (fixed_corpus, bin_train, run_losses, close_losses), and the layout
-- specs' runs against one process (references, follows, resumes_at,
-- hybrid_stop, one_process_ckpt_at, pp_stop_and_resume, pp_fsdp_follows),
-- a refused layout (exits_2).
local ffi = require 'ffi'
local json = require 'dkjson'
local luassert = require 'luassert'   -- busted's assert (a spec's global)
local T = require 'moonshard.tensor'
local C = T.C

local S = {}

-- s as one shell word ('...', a ' inside written '\'')
function S.shell_quote(s) return "'" .. tostring(s):gsub("'", "'\\''") .. "'" end

-- a new empty directory (mktemp -d)
function S.tmpdir()
  local p = io.popen('mktemp -d')
  local d = p:read('*l')
  p:close()
  return d
end

-- dir/corpus.txt: `nbytes` of English-like text drawn from a fixed word
-- list by a fixed generator -> its path. The same bytes on every run and
-- every checkout (a corpus made of the repository's own files changed with
-- each edit of the docs, and with it the numbers the specs compare)
local corpus_words = {}
for w in ([[the a of to and in is it that for on with as by this be are from at or an
  model training step loss rank ranks gradient gradients shard shards weight weights layer
  layers tensor tensors batch batches token tokens sequence checkpoint optimizer learning
  rate warmup decay data loader vocabulary embedding attention head heads block blocks
  norm mixed precision parameter parameters memory device devices kernel kernels forward
  backward sum mean scale scales value values each every one two four first last next
  run runs keeps takes makes reads writes gives holds moves saves loads splits gathers
  reduces casts computes trains resumes stops starts waits frees returns calls]]):gmatch('%S+') do
  corpus_words[#corpus_words + 1] = w
end
function S.fixed_corpus(dir, nbytes)
  local state = 20261127
  local function nxt(n)   -- (Park-Miller: 1..n)
    state = (state * 16807) % 2147483647
    return state % n + 1
  end
  local parts, size, line = {}, 0, 0
  while size < nbytes do
    local len = 4 + nxt(12)
    local words = {}
    for i = 1, len do words[i] = corpus_words[nxt(#corpus_words)] end
    words[1] = words[1]:sub(1, 1):upper() .. words[1]:sub(2)
    local sentence = table.concat(words, ' ') .. (nxt(5) == 1 and '; ' or '. ')
    line = line + #sentence
    if line > 72 then sentence = sentence .. '\n'; line = 0 end
    parts[#parts + 1] = sentence
    size = size + #sentence
  end
  local path = dir .. '/corpus.txt'
  local f = assert(io.open(path, 'wb'))
  f:write(table.concat(parts))
  f:close()
  return path
end

-- bin/train with the argument string `args` (and `env`, a prefix of
-- VAR=value words), from the repository's root -> exit status, output
function S.bin_train(args, env)
  local p = io.popen(('cd %s && %s luajit bin/train %s 2>&1; echo "__status=$?"'):format(S.shell_quote(T.root),
    env or '', args))
  local out = p:read('*a')
  p:close()
  local status = tonumber(out:match('__status=(%d+)%s*$'))
  return status, (out:gsub('__status=%d+%s*$', ''))
end

-- the losses of `steps` AdamW steps (lr) of model m on the batch (x, y)
function S.adamw_losses(m, x, y, steps, lr)
  local opt = require('moonshard').optim.AdamW(m, { lr = lr })
  local losses = {}
  for k = 1, steps do
    opt:zero_grad()
    local loss = m(x, y)
    loss:backward()
    opt:step()
    losses[k] = loss:item()
  end
  return losses
end

-- step -> obj[key] of a run folder's metrics.jsonl (the steps that have it)
local function run_field(out, key)
  local r = {}
  for line in io.lines(out .. '/metrics.jsonl') do
    local obj = assert(json.decode(line, 1, nil), line)
    if obj[key] then r[obj.step] = obj[key] end
  end
  return r
end
-- step -> loss (skipped steps have none), step -> grad_norm
function S.run_losses(out) return run_field(out, 'loss') end
function S.run_grad_norms(out) return run_field(out, 'grad_norm') end

-- every field of out/metrics.jsonl but the timings: step -> { field -> value }
-- (the file writes %.17g: a decoded number is the bits the run had)
function S.run_metrics(out)
  local rows = {}
  for line in io.lines(out .. '/metrics.jsonl') do
    local obj = assert(json.decode(line, 1, nil), line)
    obj.elapsed_s, obj.tokens_per_s = nil, nil
    rows[obj.step] = obj
  end
  return rows
end

-- asserts that run b's metrics are run a's, bit for bit, at steps 1..steps:
-- the loss, gradient norm and learning rate at each, and every other field
function S.same_metrics(a, b, steps, what)
  local ra, rb = S.run_metrics(a), S.run_metrics(b)
  for step = 1, steps do
    luassert.is_table(ra[step], what .. ': straight step ' .. step)
    luassert.is_table(rb[step], what .. ': resumed step ' .. step)
    for _, k in ipairs({ 'loss', 'grad_norm', 'lr' }) do
      luassert.is_number(ra[step][k], ('%s: step %d has no %s'):format(what, step, k))
      luassert.is_true(ra[step][k] == rb[step][k], ('%s: step %d %s: resumed %.17g, straight %.17g'):format(what, step,
        k, rb[step][k] or 0 / 0, ra[step][k]))
    end
    for k, v in pairs(rb[step]) do luassert.are.same(ra[step][k], v, ('%s: step %d %s'):format(what, step, k)) end
    for k in pairs(ra[step]) do luassert.is_not_nil(rb[step][k], ('%s: step %d lacks %s'):format(what, step, k)) end
  end
end

-- A split run's final weights (safetensors at `path`) against one
-- process's (`ref_path`), within f32 rounding as AdamW carries it: a step
-- moves a weight ~lr = 1e-2 whatever its gradient's size, so sums in
-- another order move the elements whose gradients are small (the experts
-- few tokens chose) by 1e-5 and more: at most one element in fifty beyond
-- 2e-5, none beyond 5e-4, the same names on both sides (the --tp --ep
-- specs)
function S.close_weights(path, ref_path, what)
  local st = require('moonshard.safetensors')
  local got, ref = st.load(path), st.load(ref_path)
  local n = 0
  for name, t in pairs(ref) do
    n = n + 1
    luassert.is_truthy(got[name], what .. ': ' .. name .. ' missing')
    local d = (got[name]:to('f64') - t:to('f64')):abs()
    local far, most = d:gt(2e-5):sum():item(), d:max():item()
    luassert.is_true(far <= math.max(1, d:numel() / 50) and most <= 5e-4,
      ('%s: %s: %d of %d elements beyond 2e-5, the most %g'):format(what, name, far, d:numel(), most))
  end
  for name in pairs(got) do luassert.is_truthy(ref[name], what .. ': not the model\'s: ' .. name) end
  luassert.is_true(n > 10)
end

-- A model file's bin/train check (the MoE ones', and the dense Qwens'): `flags` (its tiny preset, shrunk)
-- trains 6 steps on one process with the load-balancing loss and its loss
-- falls; without it, each of `layouts` (bin/train flags) on two CPU ranks
-- follows 4 steps of one process. Runs in a fresh folder, removed after.
-- no_aux: the flags that turn the load-balancing loss off (default
-- --model.output_router_logits false; '' for a model without one)
function S.moe_train_runs(model_file, flags, layouts, no_aux)
  local q = S.shell_quote
  local dir = S.tmpdir()
  flags = flags .. ' --data ' .. q(S.fixed_corpus(dir, 20000))
  local status, text = S.bin_train(('%s %s --batch-size 4 --steps 6 --out %s/one'):format(model_file, flags, q(dir)))
  luassert.are.equal(0, status, text)
  local one = S.run_losses(dir .. '/one')
  luassert.is_true(one[6] < one[1], ('%g -> %g'):format(one[1], one[6]))
  local plain = flags .. (no_aux or ' --model.output_router_logits false')
  status, text = S.bin_train(('%s %s --batch-size 4 --steps 4 --out %s/p1'):format(model_file, plain, q(dir)))
  luassert.are.equal(0, status, text)
  for _, how in ipairs(layouts) do
    local out = dir .. '/p2' .. how:gsub('[^%w]', '')
    status, text = S.bin_train(('--nproc-per-node 2 --device cpu %s %s --batch-size 2 --steps 4 %s --out %s'):format(
      model_file, plain, how, q(out)))
    luassert.are.equal(0, status, text)
    S.close_losses(S.run_losses(dir .. '/p1'), S.run_losses(out), 1, 4, model_file .. ' ' .. how)
  end
  os.execute('rm -rf ' .. q(dir))
end

-- bin/train of model_file with `flags` (its data included) for `steps`
-- steps of --batch-size 4 on one process, then on two CPU ranks with
-- `how` (a parallelism that keeps the global batch: --tp 2, --cp 2): the
-- two runs' losses within 1e-5, in a fresh folder (removed after). Returns
-- the two-rank run's output.
function S.two_ranks_follow(model_file, flags, how, steps)
  local q = S.shell_quote
  local dir = S.tmpdir()
  local f = flags .. ' --data ' .. q(S.fixed_corpus(dir, 20000))
  local status, text = S.bin_train(('%s %s --batch-size 4 --steps %d --out %s/one'):format(model_file, f, steps,
    q(dir)))
  luassert.are.equal(0, status, text)
  status, text = S.bin_train(('--nproc-per-node 2 --device cpu %s %s --batch-size 4 --steps %d %s --out %s/two')
    :format(model_file, f, steps, how, q(dir)))
  luassert.are.equal(0, status, text)
  S.close_losses(S.run_losses(dir .. '/one'), S.run_losses(dir .. '/two'), 1, steps, model_file .. ' ' .. how)
  os.execute('rm -rf ' .. q(dir))
  return text
end

-- bin/train on 2 CPU ranks with `how` (e.g. '--tp 2') under --autocast
-- bf16, 4 steps of batch 4, into the folder out: the run says so, and its
-- losses are within bf16 rounding (1e-2) of the one-process bf16 curve
-- `one`, which is not the f32 curve `one32` bit for bit (autocast ran)
function S.autocast_follows(model_file, flags, how, out, one, one32)
  local status, text = S.bin_train(('--nproc-per-node 2 --device cpu %s %s --batch-size 4 --steps 4 %s '
    .. '--autocast bf16 --out %s'):format(model_file, flags, how, S.shell_quote(out)))
  luassert.are.equal(0, status, text)
  luassert.is_truthy(text:find('parameters, f32, bf16 autocast', 1, true), text)
  S.close_losses(one, S.run_losses(out), 1, 4, how .. ' --autocast bf16', 1e-2)
  local same = true
  for k = 1, 4 do same = same and one[k] == one32[k] end
  luassert.is_false(same, 'the bf16 run gave the f32 losses bit for bit: autocast did not run')
end

-- asserts got[s] within `bound` (relative; 1e-5) of ref[s] for s = from..to
function S.close_losses(ref, got, from, to, what, bound)
  bound = bound or 1e-5
  for s = from, to do
    luassert.is_number(ref[s], ('%s: reference step %d'):format(what, s))
    luassert.is_number(got[s], ('%s: no loss at step %d'):format(what, s))
    local rel = math.abs(got[s] - ref[s]) / math.abs(ref[s])
    luassert.is_true(rel <= bound, ('%s: step %d loss %.17g, reference %.17g (relative %.2e)'):format(what, s, got[s],
      ref[s], rel))
  end
end

-- a tensor of `shape` holding the row-major values `vals`, in dtype (f64)
-- the fused linear cross-entropy of (x, W, t) times g (nil: 1), then its
-- backward, with W's gradient into a fresh sink of `sink` (a tensor shaped
-- like W, NaN-filled: overwritten, never read) or, with sink nil, into
-- W.grad. Checks the sink's token (marked by the forward, written by the
-- backward, W.grad left nil) and returns grad_W and x.grad
function S.flce_sink_run(x, W, t, opts, sink, g)
  local A = require 'moonshard.autograd'
  local ms = require 'moonshard'
  local s
  if sink then
    s = { t = sink:fill_(0 / 0), written = {}, i = 1 }
    A.set_grad_sink(W, s)
  end
  local loss = ms.nn.functional.fused_linear_cross_entropy(x, W, t, opts)
  if s then luassert.are.equal('table', type(s.written[1])) end
  if g then loss = loss * g end
  loss:backward()
  if not s then return W.grad, x.grad end
  luassert.is_nil(W.grad)
  luassert.is_true(s.written[1])
  return s.t, x.grad
end

-- writes a model file at `path`: GPT-2 whose rank `rank` exits with `status`
-- at its `at`-th forward in a launcher's first attempt (MS_RESTART_COUNT 0),
-- for the --max-restarts specs
function S.write_dying_model(path, rank, at, status)
  local f = assert(io.open(path, 'w'))
  f:write(([[
    local gpt2 = require 'models.gpt2'
    local M = {}
    for k, v in pairs(gpt2) do M[k] = v end
    function M.new(...)
      local m = gpt2.new(...)
      if os.getenv('MS_RESTART_COUNT') == '0' and os.getenv('RANK') == '%d' then
        local calls, forward = 0, m.forward
        m.forward = function(self, ...)
          calls = calls + 1
          if calls == %d then io.stderr:write('rank %d dies at forward %d\n'); os.exit(%d) end
          return forward(self, ...)
        end
      end
      return m
    end
    return M
  ]]):format(rank, at, rank, at, status))
  f:close()
  return path
end

function S.make(shape, vals, dtype)
  local t = T.empty(shape, { dtype = 'f64' })
  local p = ffi.cast('double*', C.ms_tensor_data(t))
  for i = 1, #vals do p[i - 1] = vals[i] end
  if (dtype or 'f64') == 'f64' then return t end
  return t:to(dtype)
end

-- the row-major values of a CPU tensor (any layout, any dtype) as Lua numbers
function S.vals(t)
  local h = T.empty(t.shape, { dtype = 'f64' })
  T.check(C.ms_tensor_copy_(h, t))
  local p = ffi.cast('double*', C.ms_tensor_data(h))
  local r = {}
  for i = 1, t:numel() do r[i] = p[i - 1] end
  return r
end

function S.numel_of(shape)
  local n = 1
  for _, s in ipairs(shape) do n = n * s end
  return n
end

-- host copy of a tensor on any device as a flat Lua list of doubles
function S.values(t)
  local h = t:to({ dtype = 'f64', device = 'cpu', copy = true }):contiguous()
  local p = ffi.cast('double*', h:data_ptr())
  local out = {}
  for i = 0, h:numel() - 1 do out[i + 1] = p[i] end
  return out
end

-- ‖got − want‖ / ‖want‖ over the elements (shapes must hold as many);
-- ‖got‖ when want is all zeros
function S.relerr(got, want)
  assert(got ~= nil, 'no tensor to compare')
  local g, w = S.values(got), S.values(want)
  luassert.are.equal(#w, #g)
  local num, den = 0, 0
  for i = 1, #w do
    num, den = num + (g[i] - w[i]) ^ 2, den + w[i] ^ 2
  end
  if den == 0 then return math.sqrt(num) end
  return math.sqrt(num / den)
end

-- no NaN, no ±inf
function S.finite(t)
  for _, v in ipairs(S.values(t)) do if v ~= v or v == math.huge or v == -math.huge then return false end end
  return true
end

-- rank r's i-th value (i 0-based) in the collective specs: small integers
-- and halves, exact in every dtype, and sums of four of them too
function S.collective_val(r, i, dtype)
  local v = ((r * 7 + i * 3) % 23) - 11
  if dtype ~= 'i64' and (i % 2 == 1) then v = v + 0.5 end
  return v
end

-- rank r's gradient-like list for the all_reduce_coalesced specs: tensor k
-- of specs[k] = { shape, dtype } holds integers (exact sums in every
-- dtype), on `device` (default the CPU)
function S.coalesced_list(r, specs, device)
  local ms = require 'moonshard'
  local list = {}
  for k, sp in ipairs(specs) do
    local n = S.numel_of(sp[1])
    local vals = {}
    for i = 1, n do vals[i] = ((r + 1) * (7 * k + 3 * i + 1)) % 61 - 30 end
    local t = (n > 0 and ms.tensor(vals, { dtype = 'f64' }) or ms.zeros({ 0 }, { dtype = 'f64' })):to(sp[2])
      :reshape(sp[1])
    list[k] = device and t:to(device) or t
  end
  return list
end

-- what the reduction `op` ('sum', 'avg', 'max', 'min') of the ranks' values
-- gives; i64 'avg' truncates as C does (and NCCL)
function S.reduce_expect(op, vals, dtype)
  local acc = vals[1]
  for k = 2, #vals do
    local v = vals[k]
    if op == 'sum' or op == 'avg' then acc = acc + v
    elseif op == 'max' then acc = math.max(acc, v)
    else acc = math.min(acc, v) end
  end
  if op == 'avg' then
    if dtype == 'i64' then
      local q = acc / #vals
      acc = q >= 0 and math.floor(q) or math.ceil(q)
    else
      acc = acc / #vals
    end
  end
  return acc
end

-- what is allocated once nothing holds garbage: LuaJIT's compiled traces
-- keep the values they were specialised on (a closure's upvalues, tensors
-- among them) alive as constants until they are flushed or replaced, so a
-- tensor no Lua code reaches can outlive every collection and go a few
-- steps later (dist_cp_multi_spec's "memory flat" failed 2 runs in 4 that
-- way). Flushed, then two full collections (finalizers, then what they
-- released). Synchronizes the current CUDA device when there is one.
function S.settle()
  jit.flush()
  collectgarbage(); collectgarbage()
  local ok, ms = pcall(require, 'moonshard')
  if ok and ms.cuda and ms.cuda.is_available and ms.cuda.is_available() then ms.cuda.synchronize() end
end

-- count() once the collector has nothing more to free: a handle's
-- finalizer can free a storage another handle shared, and it drops the
-- handle's metadata (its gradient, its graph node), whose tensors become
-- garbage only in the next cycle. So a chain of handles over shared
-- storages (views) can run several cycles without changing count() and
-- then free a storage (garbage of earlier specs). Settled means 4 full
-- cycles in a row in which neither count() nor the Lua heap changed (at
-- most 200 cycles).
function S.settled(count)
  jit.flush()   -- (traces keep their constants alive: S.settle)
  local prev, prev_heap, quiet = -1, -1, 0
  for _ = 1, 200 do
    collectgarbage('collect')
    local now = count()
    local heap = collectgarbage('count')
    if now == prev and heap == prev_heap then quiet = quiet + 1 else quiet = 0 end
    if quiet >= 4 then return now end
    prev, prev_heap = now, heap
  end
  return prev
end

-- the message of the error fn() raises (an assertion fails when it raises none)
function S.errmsg(fn)
  local ok, e = pcall(fn)
  luassert.is_false(ok, 'expected an error')
  return tostring(e)
end

-- the layout specs' models (train_tp/pp/cp_spec): bin/train flags of a tiny
-- GPT-2 and a tiny Llama of `layers` blocks reading `corpus`
function S.tiny_flags(corpus, layers)
  local common = ' --seq-len 16 --lr 1e-2 --warmup 1 --eval-every 0 --eval-iters 2 --sample-tokens 0 --log-every 2 '
    .. '--data ' .. S.shell_quote(corpus)
  return ('--preset tiny --model.n_layer %d --model.n_embd 32 --model.n_head 2'):format(layers) .. common,
    ('--preset tiny --model.num_hidden_layers %d --model.hidden_size 32 --model.intermediate_size 64'):format(layers)
      .. common
end

-- the --tp --ep layout specs' models (train_ep_tp, train_ep_tp_pp,
-- train_pp_tp_hsdp): bin/train arguments of a tiny Mixtral (`mixtral_extra`
-- flags added, where given) and a tiny DeepSeek-V3 (--moe-bias-rate), 2
-- layers each, reading `corpus` and logging every `log_every` steps
function S.tiny_moe_flags(corpus, log_every, mixtral_extra)
  local common = (' --seq-len 16 --lr 1e-2 --warmup 1 --eval-every 0 --eval-iters 2 --sample-tokens 0 --log-every %d '
    .. '--data %s'):format(log_every, S.shell_quote(corpus))
  return 'models/mixtral.lua --preset tiny --model.num_hidden_layers 2 --model.hidden_size 32 '
      .. '--model.intermediate_size 48' .. (mixtral_extra or '') .. common,
    'models/deepseek_v3.lua --preset tiny --model.num_hidden_layers 2 --model.hidden_size 32 '
      .. '--model.intermediate_size 64 --model.moe_intermediate_size 16 --model.kv_lora_rank 16 --model.q_lora_rank 24 '
      .. '--model.qk_rope_head_dim 8 --model.v_head_dim 8 --model.qk_nope_head_dim 8 --model.aux_loss_alpha 0.01 '
      .. '--moe-bias-rate 1e-2' .. common
end

-- reference(model, args, name) -> the losses of one process over 4 steps
-- of 4 sequences (checkpoints every 2) in dir/name, run once per name;
-- and the table of those run so far (name -> losses)
function S.references(dir)
  local refs = {}
  return function(model, args, name)
    if refs[name] then return refs[name] end
    local status, text = S.bin_train(('%s %s --batch-size 4 --steps 4 --save-every 2 --out %s/%s'):format(model, args,
      S.shell_quote(dir), name))
    luassert.are.equal(0, status, text)
    refs[name] = S.run_losses(dir .. '/' .. name)
    return refs[name]
  end, refs
end

-- the hybrid-sharding specs' (train_tp_hsdp, train_pp_tp_hsdp) check of a
-- run, from reference (S.references(dir)): follows(np, args, ref, name,
-- what, lines) runs `np` CPU ranks of bin/train (`args` the model and
-- layout, 4 steps) into dir/name against the one-process run ref = { model
-- and args, its name }: its log holds each of `lines`, its loss curve and
-- gradient norms within close_losses' bound, its final weights close_weights'
function S.follows(dir, reference)
  local q = S.shell_quote
  return function(np, args, ref, name, what, lines)
    local one = reference(ref[1], '', ref[2])
    local status, text = S.bin_train(('--nproc-per-node %d --device cpu %s --steps 4 --out %s/%s'):format(np, args,
      q(dir), name))
    luassert.are.equal(0, status, text)
    for _, l in ipairs(lines or {}) do luassert.is_truthy(text:find(l, 1, true), what .. ': ' .. l .. '\n' .. text) end
    S.close_losses(one, S.run_losses(dir .. '/' .. name), 1, 4, what)
    S.close_losses(S.run_grad_norms(dir .. '/' .. ref[2]), S.run_grad_norms(dir .. '/' .. name), 1, 4,
      what .. ' (gradient norm)')
    S.close_weights(dir .. '/' .. name .. '/model.safetensors', dir .. '/' .. ref[2] .. '/model.safetensors', what)
  end
end

-- the checkpoint dir `out`/ckpt-2 resumed in a copy of `out` for each of
-- `layouts` ({ launch, flags, what }: '--nproc-per-node N --device cpu ' or
-- '', the layout's flags, its name; the copy out .. #what): each exits 0
-- (`said` where given: its log holds 'resumed from') with the losses `one`
-- at steps 1-4; `what` the messages' prefix
function S.resumes_at(one, out, layouts, what, said)
  local q = S.shell_quote
  for _, c in ipairs(layouts) do
    local copy = out .. #c[3]
    os.execute(('rm -rf %s && cp -r %s %s'):format(q(copy), q(out), q(copy)))
    local status, text = S.bin_train(('%s--resume %s/ckpt-2 --out %s%s'):format(c[1], q(copy), q(copy), c[2]))
    luassert.are.equal(0, status, text)
    if said then luassert.is_truthy(text:find('resumed from', 1, true), text) end
    S.close_losses(one, S.run_losses(copy), 1, 4, what .. c[3])
  end
end

-- the hybrid-sharding specs' stopped run: `np` CPU ranks of bin/train
-- (`args` the model and the HYBRID_SHARD layout), 4 steps of --batch-size
-- 1, a checkpoint each step, stopped at step 2 in `out`; its ckpt-2 index
-- says world `np` and HYBRID_SHARD -> rank -> the pieces that rank wrote
function S.hybrid_stop(np, args, out)
  local status, text = S.bin_train(('--nproc-per-node %d --device cpu %s --batch-size 1 --steps 4 --save-every 1 '
    .. '--stop-at 2 --out %s'):format(np, args, S.shell_quote(out)))
  luassert.are.equal(0, status, text)
  local index = require('moonshard.fsdp_checkpoint').read_index(out .. '/ckpt-2')
  luassert.are.equal(np, index.world_size)
  luassert.are.equal('HYBRID_SHARD', index.strategy)
  local n = {}
  for _, list in pairs(index.pieces) do
    for _, pc in ipairs(list) do n[pc.rank] = (n[pc.rank] or 0) + 1 end
  end
  return n
end

-- the one-process run dir/name's ckpt-2 (copied into dir/one_r) resumed on
-- `np` CPU ranks with `layout` (and --batch-size 1): its log holds `line`
-- and steps 3-4 are on the curve `one` of that run (what: the message)
function S.one_process_ckpt_at(dir, name, np, layout, line, one, what)
  local q = S.shell_quote
  local r = dir .. '/one_r'
  os.execute(('mkdir -p %s && cp -r %s/%s/ckpt-2 %s/'):format(q(r), q(dir), name, q(r)))
  local status, text = S.bin_train(('--nproc-per-node %d --device cpu --resume %s %s --batch-size 1'):format(np, q(r),
    layout))
  luassert.are.equal(0, status, text)
  luassert.is_truthy(text:find(line, 1, true), text)
  S.close_losses(one, S.run_losses(r), 3, 4, what)
end

-- `np` CPU ranks of bin/train with `args` (the model and a layout it
-- refuses) for 1 step into `out`: exit status 2, the log holding `msg`
function S.exits_2(np, args, out, msg)
  local status, text = S.bin_train(('--nproc-per-node %d --device cpu %s --steps 1 --out %s'):format(np, args,
    S.shell_quote(out)))
  luassert.are.equal(2, status, text)
  luassert.is_truthy(text:find(msg, 1, true), text)
end

-- the two-chunk schedules' bin/train specs (train_pp_zbv,
-- train_pp_dualpipev): `model` (its file and flags) at --pp 2
-- --pp-schedule `schedule` on 2 CPU ranks, 4 steps of 4 sequences, stopped
-- at step 2 (a checkpoint every 2) in `out`; inspect(out), where given,
-- checks the stopped run; then out resumes at --pp 2 `schedule` and a copy
-- (out .. 'a') in one process, each on the curve `one` of the run that
-- never stopped
function S.pp_stop_and_resume(model, schedule, out, one, inspect)
  local q = S.shell_quote
  local status, text = S.bin_train(('--nproc-per-node 2 --device cpu %s --batch-size 4 --steps 4 --pp 2 '
    .. '--pp-schedule %s --save-every 2 --stop-at 2 --out %s'):format(model, schedule, q(out)))
  luassert.are.equal(0, status, text)
  if inspect then inspect(out) end
  os.execute(('cp -r %s %sa'):format(q(out), q(out)))
  status, text = S.bin_train(('--nproc-per-node 2 --device cpu --resume %s --pp 2 --pp-schedule %s'):format(q(out),
    schedule))
  luassert.are.equal(0, status, text)
  S.close_losses(one, S.run_losses(out), 1, 4, ('a %s checkpoint resumed at --pp 2 %s'):format(schedule, schedule))
  status, text = S.bin_train(('--resume %sa --batch-size 4'):format(q(out)))
  luassert.are.equal(0, status, text)
  S.close_losses(one, S.run_losses(out .. 'a'), 1, 4, ('a %s checkpoint resumed in one process'):format(schedule))
end

-- the two-chunk schedules' bin/train specs: the tiny Llama (`flags`) at
-- --pp 2 --pp-schedule `schedule` --fsdp FULL_SHARD on 4 CPU ranks (2
-- pipelines of 4 rows) in dir/name follows one process over their 8 rows
-- (run in dir/l8): its log names the layout and holds each of `lines`
function S.pp_fsdp_follows(dir, flags, schedule, name, lines)
  local q = S.shell_quote
  local status, text = S.bin_train(('models/llama.lua %s --batch-size 8 --steps 4 --out %s/l8'):format(flags, q(dir)))
  luassert.are.equal(0, status, text)
  local one = S.run_losses(dir .. '/l8')
  local out = dir .. '/' .. name
  status, text = S.bin_train(('--nproc-per-node 4 --device cpu models/llama.lua %s --batch-size 4 --steps 4 --pp 2 '
    .. '--pp-schedule %s --fsdp FULL_SHARD --out %s'):format(flags, schedule, q(out)))
  luassert.are.equal(0, status, text)
  luassert.is_truthy(text:find('2 stages over 4 ranks, blocks {1, 1, 1, 1}, data parallel 2, ' .. schedule, 1, true),
    text)
  for _, l in ipairs(lines or {}) do luassert.is_truthy(text:find(l, 1, true), text) end
  S.close_losses(one, S.run_losses(out), 1, 4, '--pp 2 ' .. schedule .. ' --fsdp FULL_SHARD')
end

-- a (B, T) batch of token ids in [0, V) and targets of the same shape,
-- i64, from the LCG x -> (1103515245 x + 12345) mod 2^31 started at seed
function S.token_batch(B, Tn, V, seed)
  local x, y, st = {}, {}, seed
  for b = 1, B do
    x[b], y[b] = {}, {}
    for t = 1, Tn do
      st = (st * 1103515245 + 12345) % 2147483648
      x[b][t] = st % V
      y[b][t] = math.floor(st / 7) % V
    end
  end
  return T.tensor(x, { dtype = 'i64' }), T.tensor(y, { dtype = 'i64' })
end

-- A step's collectives counted (spec/dist_sp_counts_spec.lua,
-- spec/dist_tp_sp_ends_spec.lua): S.tally(rows, group) -> { [kind .. ' '
-- .. phase] = { calls =, bytes = } } of a trace's rows on `group` (the
-- fused loss's row statistics left out), and the host reads' count;
-- S.tally_add(t, k, calls, bytes) adds calls of bytes each to t[k] (calls
-- may be negative: an entry that comes to nothing goes); S.same_tally(want,
-- got, what) asserts the two tables equal, naming the first kind that is not
function S.tally(rows, group)
  local key = table.concat(group:ranks(), ',')
  local t, reads = {}, 0
  for _, r in ipairs(rows) do
    if r.kind:find('^host read') then reads = reads + r.calls
    elseif r.ranks == key and not r.kind:find('row stats', 1, true) then
      S.tally_add(t, r.kind .. ' ' .. r.phase, r.calls, r.bytes)
    end
  end
  return t, reads
end
function S.tally_add(t, k, calls, bytes)
  if calls == 0 then return end
  local e = t[k] or { calls = 0, bytes = 0 }
  t[k] = e
  e.calls, e.bytes = e.calls + calls, e.bytes + calls * bytes
  if e.calls == 0 and e.bytes == 0 then t[k] = nil end
end
function S.same_tally(want, got, what)
  for k, e in pairs(want) do
    local g = got[k] or { calls = 0, bytes = 0 }
    luassert.are.same(e, g, ('%s: %s: want %d calls, %d bytes in all; got %d, %d'):format(what, k, e.calls, e.bytes,
      g.calls, g.bytes))
  end
  for k, g in pairs(got) do
    luassert.is_not_nil(want[k], ('%s: %s: %d calls (%d bytes) not wanted'):format(what, k, g.calls, g.bytes))
  end
end

-- the bytes of the file at path, or nil when it cannot be read
function S.slurp(path)
  local f = io.open(path, 'rb')
  if not f then return nil end
  local x = f:read('*a')
  f:close()
  return x
end

-- asserts that the files `names` under folders a and b hold the same bytes
-- (a checkpoint written two ways)
function S.same_files(a, b, names)
  for _, name in ipairs(names) do
    local x, y = S.slurp(a .. '/' .. name), S.slurp(b .. '/' .. name)
    luassert.is_string(x, a .. '/' .. name .. ' is missing')
    luassert.is_string(y, b .. '/' .. name .. ' is missing')
    if x ~= y then
      local k = 1
      while k <= #x and x:byte(k) == y:byte(k) do k = k + 1 end
      -- (named by the first byte that differs, not by dumping both files)
      luassert.is_true(false, ('%s/%s (%d bytes) differs from %s/%s (%d bytes) from byte %d on'):format(b, name, #y, a,
        name, #x, k))
    end
  end
end

-- asserts that two safetensors files hold the same tensors, byte for byte
-- (their headers' JSON may list the fields in another order)
function S.same_tensors(pa, pb)
  local St = require 'moonshard.safetensors'
  local ffi = require 'ffi'
  local a, b = St.load(pa), St.load(pb)
  local n = 0
  for name, t in pairs(a) do
    local u = b[name]
    luassert.is_not_nil(u, pb .. ' lacks ' .. name)
    luassert.are.same(t.shape, u.shape, name)
    local bytes = t:numel() * ({ f64 = 8, f32 = 4, bf16 = 2, f16 = 2, i64 = 8 })[t.dtype]
    luassert.is_true(ffi.string(t:data_ptr(), bytes) == ffi.string(u:data_ptr(), bytes),
      ('%s: %s differs from %s\'s'):format(pb, name, pa))
    n = n + 1
  end
  for name in pairs(b) do luassert.is_not_nil(a[name], pa .. ' lacks ' .. name) end
  return n
end

-- bin/train `args` twice: with --out a, then with --async-checkpoint --out
-- b (env as bin_train's); both must succeed. Returns the second's output.
function S.sync_and_async(args, a, b, env)
  local status, text = S.bin_train(('%s --out %s'):format(args, S.shell_quote(a)), env)
  luassert.are.equal(0, status, text)
  status, text = S.bin_train(('%s --async-checkpoint --out %s'):format(args, S.shell_quote(b)), env)
  luassert.are.equal(0, status, text)
  return text
end

-- the JSON object of fixture cases in `path` ({} when the file is missing)
-- and its names, sorted
function S.json_cases(path)
  local f = io.open(path, 'rb')
  local cases = f and json.decode(f:read('*a')) or {}
  if f then f:close() end
  local names = {}
  for name in pairs(cases) do names[#names + 1] = name end
  table.sort(names)
  return cases, names
end

-- a golden run against a Hugging Face fixture folder (config.json,
-- model.safetensors, expected.safetensors with input_ids, targets, logits,
-- loss and grad.<name>; spec/fixtures/README.md): M.from_pretrained(dir) in
-- dtype, logits, loss and every parameter's gradient within `bound`
-- relative, and a gradient expected for every parameter (S.hf_compare).
function S.hf_golden(M, dir, dtype, bound, opts)
  local m = M.from_pretrained(dir)
  if dtype ~= 'f32' then m:to(dtype) end
  return S.hf_compare(m, dir, bound, opts)
end
-- the same comparison for a model already built. opts.map(grads, config):
-- the expected gradients under the model's names (as fix_state_dict maps
-- the weights: Llama 4's fused experts). A gradient zero in exact
-- arithmetic is rounding noise in the file (its norm under 1e-12): ours
-- must be as small (1e-12 in f64, 1e-8 otherwise). Returns { logits =,
-- grad = } (the worst relative errors) and the logits.
function S.hf_compare(m, dir, bound, opts)
  local ms = require 'moonshard'
  m:eval()
  local exp = ms.load_safetensors(dir .. '/expected.safetensors')
  local logits = ms.no_grad(function() return m(exp.input_ids) end)
  local worst = { logits = S.relerr(logits, exp.logits), grad = 0 }
  luassert.is_true(worst.logits < bound, ('logits: relative error %.3g >= %g'):format(worst.logits, bound))
  m:zero_grad()
  local loss = m(exp.input_ids, exp.targets)
  local el = math.abs(loss:item() - exp.loss:item()) / math.abs(exp.loss:item())
  luassert.is_true(el < bound, ('loss %.9g vs %.9g (relative %.3g)'):format(loss:item(), exp.loss:item(), el))
  loss:backward()
  local grads, n, want = {}, 0, 0
  for k, g in pairs(exp) do
    local name = k:match('^grad%.(.*)$')
    if name then grads[name] = g end
  end
  if opts and opts.map then grads = opts.map(grads, m.config) end
  for _ in pairs(grads) do want = want + 1 end
  local function norm(t) local d = t:to('f64') return (d * d):sum():sqrt():item() end
  for name, p in m:named_parameters() do
    local g = grads[name]
    luassert.is_not_nil(g, 'no expected gradient for ' .. name)
    luassert.is_not_nil(p.grad, 'no gradient for ' .. name)
    if norm(g) < 1e-12 then
      local got = norm(p.grad)
      luassert.is_true(got < (p.dtype == 'f64' and 1e-12 or 1e-8), ('grad.%s: %.3g, zero expected'):format(name, got))
    else
      local eg = S.relerr(p.grad, g)
      luassert.is_true(eg < bound, ('grad.%s: relative error %.3g >= %g'):format(name, eg, bound))
      worst.grad = math.max(worst.grad, eg)
    end
    n = n + 1
  end
  luassert.are.equal(want, n)
  return worst, logits
end

return S
