-- Expert parallelism inside pipeline stages (bin/train --pp P --ep N,
-- docs/moe.md and docs/pp.md): CPU ranks through mpirun, a tiny Mixtral (4
-- experts, 2 a token, one MoE layer a stage, without the load-balancing
-- loss). Each stage's data-parallel ranks split its experts in groups of
-- N. Checked against one process over the same global batches: the loss
-- curve and the gradient norm (within 1e-5 relative) at --pp 2 --ep 2 on 4
-- ranks (one copy of each expert) and on 8 (two copies), plain, under
-- --fsdp FULL_SHARD and SHARD_GRAD_OP, HYBRID_SHARD (8 ranks, shard
-- groups of 2 and 4), with --cp 2 (8 ranks; plain, FULL_SHARD and
-- HYBRID_SHARD with shard groups of 2 and 4), and with
-- --moe-bias-rate; the final
-- weights are the whole model (the routers' biases each from the stage
-- that moved them); the checkpoints are one process's (every
-- expert, its moments) and resume at --pp 2 --ep 2 and in one process
-- with the losses of the run that never stopped, and a one-process
-- checkpoint resumes at --pp 2 --ep 2; DeepSeek-V3's multi-token
-- prediction under --pp 2 (with --ep 2, and FSDP) follows one process in
-- f64, each depth's loss too, and resumes; the routers' load-balancing
-- loss under --pp (2 micro-batches, interleaved, with --ep 2 and FSDP)
-- follows one process's accumulation in f64; bad layouts exit 2 with a
-- message.
local S = require 'spec.support'
local json = require 'dkjson'
local q = S.shell_quote
local dir = S.tmpdir()
local bin_train, losses, close_losses = S.bin_train, S.run_losses, S.close_losses

local corpus = S.fixed_corpus(dir, 20000)
local flags = '--preset tiny --model.num_hidden_layers 2 --model.hidden_size 32 --model.intermediate_size 48 '
  .. '--model.output_router_logits false --seq-len 16 --lr 1e-2 --warmup 1 --eval-every 0 --eval-iters 2 '
  .. '--sample-tokens 0 --log-every 2 --data ' .. q(corpus)

local norms = S.run_grad_norms   -- (step -> grad_norm)

describe('bin/train --pp 2 --ep 2 (expert parallelism in pipeline stages, CPU through mpirun)', function()
  teardown(function() os.execute('rm -rf ' .. q(dir)) end)

  -- the one-process run: 4 steps of 4 sequences, checkpoints every 2
  local refs = {}
  local function reference(extra, name)
    if refs[name] then return refs[name] end
    local status, text = bin_train(('models/mixtral.lua %s%s --batch-size 4 --steps 4 --save-every 2 --out %s/%s'):format(
      flags, extra, q(dir), name))
    assert.are.equal(0, status, text)
    refs[name] = losses(dir .. '/' .. name)
    return refs[name]
  end
  local function max_diff(a, b) return (a:to('f64') - b:to('f64')):abs():max():item() end

  it('follows the one-process curve and gradient norm on 4 ranks (one copy of each expert) and 8 (two), plain and '
    .. 'under --fsdp FULL_SHARD and SHARD_GRAD_OP; the final weights are the whole model', function()
    local one = reference('', 'one')
    local one_norm = norms(dir .. '/one')
    local mixtral = require 'models.mixtral'
    local ref = mixtral.from_pretrained(dir .. '/one'):state_dict()
    for _, c in ipairs({ { 4, 'off', 'each stage\'s 2 data-parallel ranks (1 copy of each expert), 2 of 4 experts a rank' },
      { 4, 'FULL_SHARD', 'each rank\'s experts whole, the rest sharded (FULL_SHARD)' },
      { 4, 'SHARD_GRAD_OP', 'each rank\'s experts whole, the rest sharded (SHARD_GRAD_OP)' },
      { 8, 'off', 'each stage\'s 4 data-parallel ranks (2 copies of each expert)' },
      { 8, 'FULL_SHARD', 'the experts sharded over their 2 copies (FULL_SHARD)' },
      { 8, 'HYBRID_SHARD --shard-size 2', 'each expert whole in each shard group of 2, replicated over 2 (HYBRID_SHARD)' },
      { 8, 'HYBRID_SHARD --shard-size 4', 'the experts sharded over their 2 copies in each shard group of 4, replicated '
        .. 'over 1 (HYBRID_SHARD)' } }) do
      local np, strategy = c[1], c[2]
      local out = ('%s/pe%d_%s'):format(dir, np, strategy:gsub('[^%w]', ''))
      local status, text = bin_train(('--nproc-per-node %d --device cpu models/mixtral.lua %s --batch-size %d --steps 4 '
        .. '--pp 2 --ep 2 --fsdp %s --out %s'):format(np, flags, 8 / np, strategy, q(out)))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('[rank 0] expert parallel: 2-way in ', 1, true), text)
      assert.is_truthy(text:find(c[3], 1, true), text)
      local what = ('--pp 2 --ep 2 --fsdp %s on %d ranks'):format(strategy, np)
      close_losses(one, losses(out), 1, 4, what)
      close_losses(one_norm, norms(out), 1, 4, what .. ' (gradient norm)')
      local m = mixtral.from_pretrained(out)
      local n = 0
      for name, t in pairs(m:state_dict()) do
        n = n + 1
        -- (lr 1e-2: f32 sums in another order move the weights of experts
        -- few tokens chose by up to ~1e-4; AdamW divides by small moments)
        assert.is_true(max_diff(t, ref[name]) <= 5e-4, ('%s (%s): %g from the one-process weights'):format(name,
          what, max_diff(t, ref[name])))
      end
      assert.is_truthy(m:state_dict()['model.layers.1.block_sparse_moe.experts.3.w2.weight'])
      assert.is_truthy(m:state_dict()['model.layers.0.block_sparse_moe.experts.0.w1.weight'])
    end
  end)

  it('with --cp 2 too (8 ranks: each stage\'s 4 ranks, 2 data-parallel x 2 context-parallel, split the experts in '
    .. 'pairs), plain, under --fsdp FULL_SHARD and HYBRID_SHARD (shard groups of 2 and 4), follows the one-process '
    .. 'curve and gradient norm', function()
    local one = reference('', 'one')
    local one_norm = norms(dir .. '/one')
    for _, strategy in ipairs({ 'off', 'FULL_SHARD', 'HYBRID_SHARD --shard-size 2', 'HYBRID_SHARD --shard-size 4' }) do
      local out = ('%s/pec_%s'):format(dir, strategy:gsub('[^%w]', ''))
      local status, text = bin_train(('--nproc-per-node 8 --device cpu models/mixtral.lua %s --batch-size 2 --steps 4 '
        .. '--pp 2 --ep 2 --cp 2 --fsdp %s --out %s'):format(flags, strategy, q(out)))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('expert parallel: 2-way in each stage\'s 4 ranks (2 copies of each expert)', 1, true),
        text)
      -- (HYBRID_SHARD: shard groups of a stage's data x context-parallel ranks)
      local S = strategy:match('shard%-size (%d+)')
      if S then
        assert.is_truthy(text:find(('in each shard group of %s, replicated over %d (HYBRID_SHARD)'):format(S, 4 / S), 1,
          true), text)
      end
      local what = ('--pp 2 --ep 2 --cp 2 --fsdp %s'):format(strategy)
      close_losses(one, losses(out), 1, 4, what)
      close_losses(one_norm, norms(out), 1, 4, what .. ' (gradient norm)')
    end
  end)

  it('with --moe-bias-rate follows the one-process curve (each stage\'s counts summed over its data-parallel ranks)',
    function()
    local one = reference(' --moe-bias-rate 1e-2', 'one_bias')
    local out = dir .. '/pe_bias'
    local status, text = bin_train(('--nproc-per-node 4 --device cpu models/mixtral.lua %s --moe-bias-rate 1e-2 '
      .. '--batch-size 2 --steps 4 --pp 2 --ep 2 --out %s'):format(flags, q(out)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(out), 1, 4, '--pp 2 --ep 2 --moe-bias-rate')
    -- the biases moved (not zero) and are the one-process run's
    local st = require 'moonshard.safetensors'
    local a = st.load(out .. '/model.safetensors')
    local b = st.load(dir .. '/one_bias/model.safetensors')
    local moved = 0
    for name, t in pairs(b) do
      if name:find('expert_bias', 1, true) then
        moved = moved + t:abs():sum():item()
        assert.is_true(max_diff(a[name], t) <= 1e-6, name)
      end
    end
    assert.is_true(moved > 0, 'no expert_bias moved')
    -- stopped after 2 steps, resumed as it ran: the biases of both stages'
    -- layers come back from the checkpoint
    local so = dir .. '/pe_bias_s'
    status, text = bin_train(('--nproc-per-node 4 --device cpu models/mixtral.lua %s --moe-bias-rate 1e-2 '
      .. '--batch-size 2 --steps 4 --pp 2 --ep 2 --save-every 1 --stop-at 2 --out %s'):format(flags, q(so)))
    assert.are.equal(0, status, text)
    status, text = bin_train(('--nproc-per-node 4 --device cpu --resume %s --pp 2 --ep 2'):format(q(so)))
    assert.are.equal(0, status, text)
    close_losses(one, losses(so), 1, 4, '--pp 2 --ep 2 --moe-bias-rate, stopped and resumed')
  end)

  it('with --checkpoint-format full a checkpoint is one process\'s (every expert and its moments): it resumes at --pp 2 '
    .. '--ep 2 (plain and under FSDP) and in one process with the same losses, and a one-process checkpoint resumes at '
    .. '--pp 2 --ep 2', function()
    local one = reference('', 'one')
    local st = require 'moonshard.safetensors'
    for _, strategy in ipairs({ 'off', 'FULL_SHARD', 'HYBRID_SHARD' }) do
      local common = ('--nproc-per-node 4 --device cpu models/mixtral.lua %s --batch-size 2 --steps 4 --pp 2 --ep 2 '
        .. '--fsdp %s'):format(flags, strategy)
      local out = ('%s/ps_%s'):format(dir, strategy)
      local status, text = bin_train(('%s --checkpoint-format full --save-every 1 --stop-at 2 --out %s'):format(common,
        q(out)))
      assert.are.equal(0, status, text)
      for _, f in ipairs({ 'model', 'optimizer' }) do
        local got = st.load(('%s/ckpt-2/%s.safetensors'):format(out, f))
        local want = st.load(('%s/one/ckpt-2/%s.safetensors'):format(dir, f))
        local n = 0
        for name, t in pairs(want) do
          n = n + 1
          assert.is_truthy(got[name], ('%s: %s missing (--fsdp %s)'):format(f, name, strategy))
          -- (the weights as the final ones above; the moments within 1e-4)
          local bound = f == 'model' and 5e-4 or 1e-4 * math.max(1, t:abs():max():item())
          assert.is_true(max_diff(got[name], t) <= bound, ('%s: %s is %g from the one-process run\'s'):format(f, name,
            max_diff(got[name], t)))
        end
        for name in pairs(got) do assert.is_truthy(want[name], ('%s: not the model\'s: %s'):format(f, name)) end
        assert.is_true(n > 0)
      end
      os.execute(('cp -r %s %s1'):format(q(out), q(out)))
      status, text = bin_train(('--nproc-per-node 4 --device cpu --resume %s --pp 2 --ep 2 --fsdp %s'):format(q(out),
        strategy))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('resumed from', 1, true), text)
      close_losses(one, losses(out), 1, 4, ('--pp 2 --ep 2 --fsdp %s resumed as it ran'):format(strategy))
      -- (one process: without the sharding the run had)
      status, text = bin_train(('--resume %s1 --fsdp off'):format(q(out)))
      assert.are.equal(0, status, text)
      close_losses(one, losses(out .. '1'), 1, 4, ('--pp 2 --ep 2 --fsdp %s resumed in one process'):format(strategy))
      local r = ('%s/one_r_%s'):format(dir, strategy)
      os.execute(('mkdir -p %s && cp -r %s/one/ckpt-2 %s/'):format(q(r), q(dir), q(r)))
      status, text = bin_train(('--nproc-per-node 4 --device cpu --resume %s --pp 2 --ep 2 --fsdp %s --batch-size 2')
        :format(q(r), strategy))
      assert.are.equal(0, status, text)
      close_losses(one, losses(r), 3, 4, ('a one-process checkpoint resumed at --pp 2 --ep 2 --fsdp %s'):format(strategy))
    end
  end)

  it('a checkpoint is sharded by default (each rank its stage\'s pieces, its experts\'; every expert once): it resumes at '
    .. '--pp 2 --ep 2, at --ep 2 and at --pp 2 on 2 ranks, and in one process with the same losses', function()
    local one = reference('', 'one')
    local out = dir .. '/pes'
    local status, text = bin_train(('--nproc-per-node 4 --device cpu models/mixtral.lua %s --batch-size 2 --steps 4 '
      .. '--pp 2 --ep 2 --save-every 1 --stop-at 2 --out %s'):format(flags, q(out)))
    assert.are.equal(0, status, text)
    local ck = require 'moonshard.fsdp_checkpoint'
    local index = ck.read_index(out .. '/ckpt-2')
    assert.are.equal(4, #index.files)
    -- every parameter of the whole model once, each expert from the rank that holds it
    local whole = {}
    for name in require('models.mixtral').from_pretrained(dir .. '/one'):named_parameters() do whole[name] = true end
    local n = 0
    for _, e in ipairs(index.params) do
      assert.is_true(whole[e.name], e.name)
      n = n + 1
      local c = 0
      for _, pc in ipairs(index.pieces[e.name]) do c = c + pc.numel end
      assert.are.equal(e.numel, c, e.name)
    end
    local nw = 0
    for _ in pairs(whole) do nw = nw + 1 end
    assert.are.equal(nw, n)
    -- (the global batch of 4 sequences at every layout)
    local layouts = { { '', '--nproc-per-node 4 --device cpu', '--pp 2 --ep 2' },
                      { 'e', '--nproc-per-node 2 --device cpu', '--pp 1 --ep 2 --batch-size 2' },
                      { 'p', '--nproc-per-node 2 --device cpu', '--pp 2 --ep 1 --batch-size 4' },
                      { '1', '', '--batch-size 4' } }
    for _, c in ipairs(layouts) do
      if c[1] ~= '' then os.execute(('rm -rf %s%s && cp -r %s %s%s'):format(q(out), c[1], q(out), q(out), c[1])) end
    end
    for _, c in ipairs(layouts) do
      status, text = bin_train(('%s --resume %s%s %s'):format(c[2], q(out), c[1], c[3]))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('resumed from', 1, true), text)
      close_losses(one, losses(out .. c[1]), 1, 4, 'a sharded --pp 2 --ep 2 checkpoint resumed with ' .. c[3])
    end
  end)

  it('DeepSeek-V3 with multi-token prediction (the depths on the last stage, a copy of the embedding there), the '
    .. 'sequence-wise balance loss and --moe-bias-rate: --pp 2, --pp 2 --ep 2 and --pp 2 --ep 2 --fsdp FULL_SHARD '
    .. 'follow the one-process curve and each depth\'s loss (f64); stopped, --pp 2 resumes on it', function()
    local df = '--preset tiny --model.mtp_loss_weight 0.3 --model.aux_loss_alpha 0.05 --moe-bias-rate 1e-2 '
      .. '--dtype f64 --seq-len 16 --lr 1e-2 --warmup 1 --eval-every 0 --eval-iters 2 --sample-tokens 0 '
      .. '--log-every 1 --steps 4 --data ' .. q(corpus)
    local function mtp_of(out)
      local r = {}
      for line in io.lines(out .. '/metrics.jsonl') do
        local obj = assert(json.decode(line, 1, nil), line)
        if obj.loss then r[obj.step] = obj.mtp_loss end
      end
      return r
    end
    local status, text = bin_train(('models/deepseek_v3.lua %s --batch-size 4 --out %s/d1'):format(df, q(dir)))
    assert.are.equal(0, status, text)
    local one, mone, none = losses(dir .. '/d1'), mtp_of(dir .. '/d1'), norms(dir .. '/d1')
    local function follows(out, what, from)
      close_losses(one, losses(out), from or 1, 4, what, 1e-10)
      close_losses(none, norms(out), from or 1, 4, what .. ' (gradient norm)', 1e-10)
      local m = mtp_of(out)
      for step = from or 1, 4 do
        assert.are.equal(1, #m[step], what)
        close_losses({ mone[step][1] }, { m[step][1] }, 1, 1, ('%s: step %d\'s depth loss'):format(what, step), 1e-10)
      end
    end
    for _, c in ipairs({ { 2, '' }, { 4, '--ep 2' }, { 4, '--ep 2 --fsdp FULL_SHARD' } }) do
      local out = ('%s/d%d%s'):format(dir, c[1], c[2]:gsub('[^%w]', ''))
      status, text = bin_train(('--nproc-per-node %d --device cpu models/deepseek_v3.lua %s --batch-size %d --pp 2 %s '
        .. '--out %s'):format(c[1], df, 8 / c[1], c[2], q(out)))
      assert.are.equal(0, status, text)
      follows(out, '--pp 2 ' .. c[2])
    end
    local so = dir .. '/ds'
    status, text = bin_train(('--nproc-per-node 2 --device cpu models/deepseek_v3.lua %s --batch-size 4 --pp 2 '
      .. '--save-every 1 --stop-at 2 --out %s'):format(df, q(so)))
    assert.are.equal(0, status, text)
    status, text = bin_train(('--nproc-per-node 2 --device cpu --resume %s --pp 2'):format(q(so)))
    assert.are.equal(0, status, text)
    follows(so, '--pp 2 stopped and resumed', 1)
  end)

  it('the routers\' load-balancing loss (output_router_logits) under --pp follows one process\'s gradient '
    .. 'accumulation over the same micro-batches (f64): --pp 2 with 2 micro-batches, interleaved, and --pp 2 x data '
    .. 'parallel 2 with --ep 2 and FSDP', function()
    local lf = '--preset tiny --model.num_hidden_layers 4 --model.hidden_size 32 --model.intermediate_size 48 '
      .. '--model.output_router_logits true --model.router_aux_loss_coef 0.5 --dtype f64 --seq-len 16 --lr 1e-2 '
      .. '--warmup 1 --eval-every 0 --eval-iters 2 --sample-tokens 0 --log-every 1 --steps 4 --data ' .. q(corpus)
    -- (each micro-batch's loss is its own product of means: one process
    -- accumulates micro-batches of 2 sequences)
    local status, text = bin_train(('models/mixtral.lua %s --batch-size 2 --tokens-per-step 64 --out %s/lb1'):format(lf,
      q(dir)))
    assert.are.equal(0, status, text)
    local one, none = losses(dir .. '/lb1'), norms(dir .. '/lb1')
    -- (without the term the curve is another: the spec can tell)
    status, text = bin_train(('models/mixtral.lua %s --model.router_aux_loss_coef 0 --batch-size 2 --tokens-per-step 64 '
      .. '--out %s/lb0'):format(lf, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_true(math.abs(losses(dir .. '/lb0')[1] - one[1]) > 1e-4)
    for _, c in ipairs({ { 2, '--batch-size 4 --pp-microbatches 2' }, { 2, '--batch-size 4 --pp-microbatches 2 '
      .. '--pp-chunks 2' }, { 4, '--batch-size 2 --pp-microbatches 1 --ep 2' }, { 4, '--batch-size 2 '
      .. '--pp-microbatches 1 --ep 2 --fsdp SHARD_GRAD_OP' }, { 4, '--batch-size 2 --pp-microbatches 1 --fsdp '
      .. 'FULL_SHARD' } }) do
      local out = ('%s/lb%d%s'):format(dir, c[1], c[2]:gsub('[^%w]', ''))
      status, text = bin_train(('--nproc-per-node %d --device cpu models/mixtral.lua %s --pp 2 %s --out %s'):format(
        c[1], lf, c[2], q(out)))
      assert.are.equal(0, status, text)
      close_losses(one, losses(out), 1, 4, '--pp 2 ' .. c[2], 1e-10)
      close_losses(none, norms(out), 1, 4, '--pp 2 ' .. c[2] .. ' (gradient norm)', 1e-10)
    end
  end)

  it('bad layouts exit 2 and say why', function()
    local function fails(args, msg)
      local status, text = bin_train(args .. (' --steps 1 --out %s/bad'):format(q(dir)))
      assert.are.equal(2, status, text)
      assert.is_truthy(text:find(msg, 1, true), text)
    end
    local m = '--device cpu models/mixtral.lua ' .. flags
    fails(('--nproc-per-node 2 %s --pp 2 --ep 2'):format(m), '--ep 2 with --pp 2: the 1 rank of each '
      .. 'stage (the world of 2 over 2 stages) is not a multiple of 2')
    fails(('--nproc-per-node 6 %s --pp 2 --ep 2'):format(m), '--ep 2 with --pp 2: the 3 ranks of each '
      .. 'stage (the world of 6 over 2 stages) are not a multiple of 2')
    fails(('--nproc-per-node 6 %s --pp 2 --ep 3'):format(m), '--ep 3: ep.parallelize: 4 experts do not split over 3 '
      .. 'ranks')
    fails(('--nproc-per-node 3 %s --pp 2 --ep 3'):format(m), '--pp 2: the world of 3 ranks is not a multiple of it')
    fails(('--nproc-per-node 8 %s --pp 2 --ep 4 --fsdp HYBRID_SHARD --shard-size 2'):format(m),
      '--ep 4 with --pp 2 --fsdp HYBRID_SHARD: the shard groups of 2 ranks (--shard-size) must hold whole expert groups')
  end)
end)
