-- models/mixtral.lua: Llama's decoder with MoE layers (docs/moe.md). The
-- loss with output_router_logits is the cross-entropy plus the coefficient
-- times the load-balancing loss; float64 finite differences through the
-- whole model; save_pretrained / from_pretrained round trip with
-- transformers' names; AdamW steps lower the loss; bin/train trains it on
-- one process and on two (FSDP over the decoder layers, two pipeline
-- stages, context-parallel pairs), checkpointed, and with float8 outside
-- the experts; bad configs and layouts name what is wrong.
local ms = require 'moonshard'
local A = ms.autograd
local mixtral = require 'models.mixtral'
local S = require 'spec.support'
local q = S.shell_quote
local null = require('models.hf').null

local function small(over)
  local cfg = { vocab_size = 40, hidden_size = 8, intermediate_size = 12, num_hidden_layers = 2,
    num_attention_heads = 2, num_key_value_heads = 1, max_position_embeddings = 16, num_local_experts = 4,
    num_experts_per_tok = 2, output_router_logits = true, router_aux_loss_coef = 0.3, bos_token_id = null,
    eos_token_id = null }
  for k, v in pairs(over or {}) do cfg[k] = v end
  return cfg
end

local batch = S.token_batch

describe('models.mixtral', function()
  before_each(function() A.clear_tape() end)

  it('with output_router_logits the loss is the cross-entropy plus coef x the load-balancing loss', function()
    ms.manual_seed(3)
    local m = mixtral.new(small()):to('f64')
    local x, y = batch(2, 6, 40, 7)
    local l = m(x, y):item()
    local aux = ms.nn.moe.aux_loss(ms.nn.moe.layers(m)):item()
    m.config.output_router_logits = false
    local ce = m(x, y):item()
    -- (top-2 of 4 experts, evenly routed: 4 x sum_e 0.5 x 0.25 = 2)
    assert.is_true(aux > 1 and aux < 3, 'load-balancing loss ' .. aux)
    assert.is_true(math.abs(l - (ce + 0.3 * aux)) <= 1e-12, ('%.17g against %.17g + 0.3 x %.17g'):format(l, ce, aux))
    -- the logits without targets are the cross-entropy's
    local logits = m(x)
    assert.are.same({ 2, 6, 40 }, logits.shape)
  end)

  it('float64 finite differences through the whole model (a router, an expert, the embedding)', function()
    ms.manual_seed(4)
    local m = mixtral.new(small()):to('f64')
    -- (weights of std 0.4: gradients well above the differences' rounding)
    for name, p in m:named_parameters() do if not name:match('norm') then ms.normal_(p, 0, 0.4) end end
    local x, y = batch(2, 5, 40, 11)
    local L = m.model.layers
    local checked = { L[1].block_sparse_moe.gate.weight, L[2].block_sparse_moe.experts[3].w2.weight,
      L[1].self_attn.q_proj.weight }
    local worst = A.gradcheck(function() return m(x, y) end, checked)
    assert.is_true(worst < 1e-6, 'relative error ' .. worst)
  end)

  it('save_pretrained / from_pretrained: transformers\' names and config, the same loss', function()
    ms.manual_seed(5)
    local m = mixtral.new(small())
    local dir = S.tmpdir()
    m:save_pretrained(dir)
    local sd = ms.load_safetensors(dir .. '/model.safetensors')
    for _, name in ipairs({ 'model.layers.0.block_sparse_moe.gate.weight',
      'model.layers.1.block_sparse_moe.experts.3.w1.weight', 'model.layers.1.block_sparse_moe.experts.3.w2.weight',
      'model.layers.1.block_sparse_moe.experts.3.w3.weight', 'lm_head.weight' }) do
      assert.is_not_nil(sd[name], name)
    end
    assert.are.same({ 4, 8 }, sd['model.layers.0.block_sparse_moe.gate.weight'].shape)
    assert.are.same({ 8, 12 }, sd['model.layers.1.block_sparse_moe.experts.3.w2.weight'].shape)
    local cfg = require('models.hf').read_json(dir .. '/config.json')
    assert.are.equal('mixtral', cfg.model_type)
    assert.are.same({ 'MixtralForCausalLM' }, cfg.architectures)
    assert.are.equal(4, cfg.num_local_experts)
    assert.are.equal(2, cfg.num_experts_per_tok)
    local m2 = mixtral.from_pretrained(dir)
    local x, y = batch(2, 6, 40, 13)
    assert.are.equal(m(x, y):item(), m2(x, y):item())
    os.execute('rm -rf ' .. q(dir))
  end)

  it('AdamW steps on one batch lower the loss', function()
    ms.manual_seed(6)
    local m = mixtral.new(small({ hidden_size = 16, intermediate_size = 24, router_aux_loss_coef = 0.02 }))
    local x, y = batch(4, 12, 40, 17)
    local losses = S.adamw_losses(m, x, y, 30, 1e-2)
    assert.is_true(losses[30] < 0.5 * losses[1], ('%g -> %g'):format(losses[1], losses[30]))
  end)

  it('refuses configs it cannot run, naming the field', function()
    assert.has_error(function() mixtral.new(small({ sliding_window = 4096 })) end,
      'mixtral config: sliding_window 4096 is not supported (full causal attention only; set it to null)')
    assert.has_error(function() mixtral.new(small({ router_jitter_noise = 0.01 })) end,
      'mixtral config: router_jitter_noise 0.01 is not supported (0 only)')
    assert.has_error(function() mixtral.new(small({ num_experts_per_tok = 5 })) end,
      'mixtral config: num_experts_per_tok 5 is more than num_local_experts 4')
  end)

  it('tells a pipeline about its load-balancing loss (the stages carry its statistics: docs/pp.md)', function()
    local m = mixtral.new(small())
    assert.are.same({ coef = m.config.router_aux_loss_coef, experts = 4 }, m:pipeline_parts().aux)
    assert.is_nil(mixtral.new(small({ output_router_logits = false })):pipeline_parts().aux)
  end)

  describe('bin/train', function()
    local dir = S.tmpdir()
    teardown(function() os.execute('rm -rf ' .. q(dir)) end)
    local corpus = S.fixed_corpus(dir, 20000)
    local flags = '--preset tiny --model.num_hidden_layers 2 --model.hidden_size 32 --model.intermediate_size 48 '
      .. '--seq-len 16 --lr 1e-2 --warmup 1 --eval-every 0 --eval-iters 2 --sample-tokens 0 --log-every 2 --data '
      .. q(corpus)

    it('trains the tiny Mixtral (load-balancing loss on) on one process and under --fsdp on two; without the '
      .. 'load-balancing loss, --fsdp FULL_SHARD on two follows the one-process curve', function()
      local status, text = S.bin_train(('models/mixtral.lua %s --batch-size 4 --steps 6 --out %s/one'):format(flags,
        q(dir)))
      assert.are.equal(0, status, text)
      local one = S.run_losses(dir .. '/one')
      assert.is_true(one[6] < one[1], ('%g -> %g'):format(one[1], one[6]))
      local m = mixtral.from_pretrained(dir .. '/one')
      assert.are.equal(2, #ms.nn.moe.layers(m))
      status, text = S.bin_train(('--nproc-per-node 2 --device cpu models/mixtral.lua %s --batch-size 2 --steps 6 '
        .. '--fsdp FULL_SHARD --out %s/fsdp_aux'):format(flags, q(dir)))
      assert.are.equal(0, status, text)
      local two = S.run_losses(dir .. '/fsdp_aux')
      assert.is_true(two[6] < two[1], ('%g -> %g'):format(two[1], two[6]))
      -- (each rank's load-balancing loss is over its own tokens, a product
      -- of their means: not the one-process value; the cross-entropy is)
      local plain = flags .. ' --model.output_router_logits false'
      status, text = S.bin_train(('models/mixtral.lua %s --batch-size 4 --steps 6 --out %s/one_plain'):format(plain,
        q(dir)))
      assert.are.equal(0, status, text)
      status, text = S.bin_train(('--nproc-per-node 2 --device cpu models/mixtral.lua %s --batch-size 2 --steps 6 '
        .. '--fsdp FULL_SHARD --out %s/fsdp_plain'):format(plain, q(dir)))
      assert.is_truthy(text:find('units LlamaDecoderLayer (', 1, true), text)
      assert.are.equal(0, status, text)
      S.close_losses(S.run_losses(dir .. '/one_plain'), S.run_losses(dir .. '/fsdp_plain'), 1, 6, 'mixtral --fsdp')
      -- two pipeline stages, one layer each
      status, text = S.bin_train(('--nproc-per-node 2 --device cpu models/mixtral.lua %s --batch-size 4 --steps 6 '
        .. '--pp 2 --out %s/pp_plain'):format(plain, q(dir)))
      assert.are.equal(0, status, text)
      S.close_losses(S.run_losses(dir .. '/one_plain'), S.run_losses(dir .. '/pp_plain'), 1, 6, 'mixtral --pp 2')
      -- with the load-balancing loss and one micro-batch (the loss a
      -- product of the batch's means, as one process's)
      status, text = S.bin_train(('--nproc-per-node 2 --device cpu models/mixtral.lua %s --batch-size 4 --steps 6 '
        .. '--pp 2 --pp-microbatches 1 --out %s/pp_aux'):format(flags, q(dir)))
      assert.are.equal(0, status, text)
      S.close_losses(one, S.run_losses(dir .. '/pp_aux'), 1, 6, 'mixtral --pp 2 with the load-balancing loss')
      -- context parallel pairs (routing is per token), and the layers checkpointed (the recompute routes alike)
      status, text = S.bin_train(('--nproc-per-node 2 --device cpu models/mixtral.lua %s --batch-size 4 --steps 6 '
        .. '--cp 2 --out %s/cp_plain'):format(plain, q(dir)))
      assert.are.equal(0, status, text)
      S.close_losses(S.run_losses(dir .. '/one_plain'), S.run_losses(dir .. '/cp_plain'), 1, 6, 'mixtral --cp 2')
      status, text = S.bin_train(('models/mixtral.lua %s --batch-size 4 --steps 6 --activation-checkpointing full '
        .. '--out %s/ac_plain'):format(plain, q(dir)))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('activation checkpointing: 2 of 2 LlamaDecoderLayer', 1, true), text)
      S.close_losses(S.run_losses(dir .. '/one_plain'), S.run_losses(dir .. '/ac_plain'), 1, 6, 'mixtral, checkpointed')
      -- balancing by the routers' biases: two FSDP ranks (the counts summed) follow one process, a stop
      -- and resume follow the run that never stopped, and the saved folder holds the biases
      local biased = plain .. ' --moe-bias-rate 0.01'
      status, text = S.bin_train(('models/mixtral.lua %s --batch-size 4 --steps 6 --out %s/one_bias'):format(biased,
        q(dir)))
      assert.are.equal(0, status, text)
      local ob = S.run_losses(dir .. '/one_bias')
      assert.are_not.equal(S.run_losses(dir .. '/one_plain')[6], ob[6], 'the biases change the routing')
      status, text = S.bin_train(('--nproc-per-node 2 --device cpu models/mixtral.lua %s --batch-size 2 --steps 6 '
        .. '--fsdp FULL_SHARD --out %s/fsdp_bias'):format(biased, q(dir)))
      assert.are.equal(0, status, text)
      S.close_losses(ob, S.run_losses(dir .. '/fsdp_bias'), 1, 6, 'mixtral --moe-bias-rate --fsdp')
      status, text = S.bin_train(('models/mixtral.lua %s --batch-size 4 --steps 6 --save-every 3 --stop-at 3 '
        .. '--out %s/stop_bias'):format(biased, q(dir)))
      assert.are.equal(0, status, text)
      status, text = S.bin_train(('--resume %s/stop_bias --out %s/stop_bias'):format(q(dir), q(dir)))
      assert.are.equal(0, status, text)
      S.close_losses(ob, S.run_losses(dir .. '/stop_bias'), 1, 6, 'mixtral --moe-bias-rate, resumed', 0)
      local mb = mixtral.from_pretrained(dir .. '/one_bias')
      local b = mb.model.layers[1].block_sparse_moe.expert_bias
      assert.is_true(b:abs():sum():item() > 0)
      status, text = S.bin_train(('models/llama.lua --preset tiny --model.num_hidden_layers 1 --steps 1 --data %s '
        .. '--moe-bias-rate 0.01 --out %s/nomoe'):format(q(corpus), q(dir)))
      assert.are.equal(2, status, text)
      assert.is_truthy(text:find('--moe-bias-rate: models/llama.lua has no mixture-of-experts layers', 1, true), text)
      -- float8: the attention's linears; the routed experts and the routers stay in the compute dtype
      status, text = S.bin_train(('models/mixtral.lua %s --batch-size 4 --steps 2 --float8 --out %s/f8'):format(plain,
        q(dir)))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('float8: tensorwise, 8 of 35 linear layers', 1, true), text)
    end)
  end)
end)
