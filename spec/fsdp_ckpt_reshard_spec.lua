-- FSDP checkpoints across world sizes (#mpi, but not a dist_* spec: one
-- mpirun has one world size, so tools/run_fsdp_ckpt_specs.sh runs this
-- file in phases over a folder they share, MS_FSDP_CKPT_DIR):
--   MS_FSDP_CKPT_PHASE=save  (4 ranks) gpt2-tiny sharded by gpt2.Block, 2
--     AdamW steps, a sharded and a full save, and the reference: the
--     gathered parameters and moments, the logits, then one more step (the
--     run that never reloads): its loss and parameters
--   MS_FSDP_CKPT_PHASE=load  (2, 3, then 1 rank) the checkpoint loads into
--     FULL_SHARD, NO_SHARD and a plain model (no FSDP): parameters and
--     moments bit-identical, logits bit-identical, the next step's loss
--     bit-identical and its parameters within 1e-6 (of the largest
--     magnitude) of the run that never saved; the full file loads with
--     load_full as well. Measured: every check is bit-identical at 2 and 1
--     ranks; at 3 ranks the parameters after the next step differ by up to
--     3.6e-8 (wte), the gradient average over 3 ranks rounding differently
--     from the one over 4.
-- The same for llama-tiny (untied head), saved at 4 ranks with its LM head
-- a unit of its own, loaded into the head unit, the head in the root
-- (head_unit = false: another layout of the same names), NO_SHARD and a
-- plain model. And SGD with momentum: its buffers saved at 4 ranks, loaded
-- into FULL_SHARD and a plain model, the next two steps' losses.
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local dist = require 'moonshard.dist'
local S = require 'moonshard.safetensors'
local ck = require 'moonshard.fsdp_checkpoint'
local H = require 'spec.fsdp_ckpt_helpers'

local D = os.getenv('MS_FSDP_CKPT_DIR')
local phase = os.getenv('MS_FSDP_CKPT_PHASE')

describe('fsdp checkpoints across world sizes #mpi', function()
  if not H.under_mpi or not D or (phase ~= 'save' and phase ~= 'load') then
    it('runs under tools/run_fsdp_ckpt_specs.sh', function() pending('no MS_FSDP_CKPT_DIR / MS_FSDP_CKPT_PHASE') end)
    return
  end
  if not H.have_fixture then
    it('needs the gpt2-tiny fixture', function() pending('no ' .. H.fixture) end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 120 } end)
  teardown(function() dist.destroy() end)

  -- what is saved: gpt2-tiny under D/sharded, full.safetensors,
  -- reference.safetensors; llama-tiny under D/llama-*
  local FAMS = {
    { prefix = '', build = function(kind) return H.build(kind == 'head' and 'full' or kind) end, name = 'gpt2-tiny' },
    { prefix = 'llama-', build = H.build_llama, name = 'llama-tiny' },
  }

  if phase == 'save' then
    for _, fam in ipairs(FAMS) do
      it(fam.name .. ': trains 2 steps, saves sharded and full checkpoints and the reference, then takes one more step', function()
        local model, opt = fam.build('head')
        local units = ms.fsdp.units(model)
        -- llama-tiny's head is a unit of its own, gpt2-tiny's (tied) is not
        assert.are.equal(fam.prefix == 'llama-', units[#units].head)
        H.train(model, opt, 2)
        local W = dist.world_size()
        local P = D .. '/' .. fam.prefix
        ck.save_sharded(model, P .. 'sharded', { optimizer = opt, extra = { saved_at = W } })
        ck.save_full(model, P .. 'full.safetensors')
        local params, state = ck.gather(model, { optimizer = opt })
        local ref = { logits = H.logits(model) }
        for _, e in ipairs(params) do
          ref['param.' .. e.name] = e.tensor
          ref['exp_avg.' .. e.name] = state[e.name].exp_avg
          ref['exp_avg_sq.' .. e.name] = state[e.name].exp_avg_sq
        end
        local loss3 = H.train(model, opt, 1)[1]
        ref.loss3 = T.tensor({ loss3 }, { dtype = 'f64' })
        for _, e in ipairs(ck.gather(model)) do ref['after.' .. e.name] = e.tensor end
        if dist.rank() == 0 then S.save(P .. 'reference.safetensors', ref) end
        dist.barrier()
        assert.are.equal(W, ck.read_index(P .. 'sharded').world_size)
      end)
    end
    it('SGD with momentum: trains 2 steps, saves its momentum buffers, then takes 2 more', function()
      local model, opt = H.build_sgd('full')
      H.train(model, opt, 2)
      ck.save_sharded(model, D .. '/sgd-sharded', { optimizer = opt, step = 2 })
      local after = H.train(model, opt, 2)
      if dist.rank() == 0 then
        S.save(D .. '/sgd-reference.safetensors', { losses = T.tensor(after, { dtype = 'f64' }) })
      end
      dist.barrier()
    end)
    return
  end

  local refs = {}
  local function reference(prefix)
    prefix = prefix or ''
    refs[prefix] = refs[prefix] or ms.load_safetensors(D .. '/' .. prefix .. 'reference.safetensors')
    return refs[prefix]
  end

  local function check_loaded(model, opt, what, prefix)
    local r = reference(prefix)
    local params, state = ck.gather(model, { optimizer = opt })
    for _, e in ipairs(params) do
      assert.are.equal(0, H.max_abs(e.tensor, r['param.' .. e.name]), what .. ': ' .. e.name)
      if opt then
        assert.are.equal(2, state[e.name].step)
        assert.are.equal(0, H.max_abs(state[e.name].exp_avg, r['exp_avg.' .. e.name]), what .. ': exp_avg of ' .. e.name)
        assert.are.equal(0, H.max_abs(state[e.name].exp_avg_sq, r['exp_avg_sq.' .. e.name]), what .. ': exp_avg_sq of ' .. e.name)
      end
    end
    local d = H.max_rel(H.logits(model), r.logits)
    assert.is_true(d == 0, ('%s: logits differ by %.3g'):format(what, d))
  end

  local function check_next_step(model, opt, what, prefix)
    local r = reference(prefix)
    local loss3 = H.train(model, opt, 1)[1]
    local want = r.loss3:item()
    assert.is_true(loss3 == want, ('%s: next loss %.9g, the run that never saved %.9g'):format(what, loss3, want))
    for _, e in ipairs(ck.gather(model)) do
      local d = H.max_rel(e.tensor, r['after.' .. e.name])
      assert.is_true(d <= 1e-6, ('%s: %s differs by %.3g after the next step'):format(what, e.name, d))
    end
  end

  local cases = { { 'full', 'FULL_SHARD by Block' }, { 'noshard', 'NO_SHARD by Block' }, { 'root', 'FULL_SHARD, one unit' },
                  { 'plain', 'a plain model and optimizer (no FSDP)' } }
  if H.more_strategies then
    cases[#cases + 1] = { 'grad_op', 'SHARD_GRAD_OP by Block' }
    cases[#cases + 1] = { 'hybrid', 'HYBRID_SHARD by Block' }
  end
  for _, c in ipairs(cases) do
    it(('the sharded checkpoint of 4 ranks loads into %s here: identical parameters, moments, logits; the next step matches'):format(c[2]),
      function()
        local model, opt = H.build(c[1])
        local info = ck.load_sharded(model, D .. '/sharded', { optimizer = opt })
        assert.are.equal(info.world_size, info.extra.saved_at)
        assert.are.equal(2, info.step)
        check_loaded(model, opt, c[1] .. ' at ' .. dist.world_size())
        check_next_step(model, opt, c[1] .. ' at ' .. dist.world_size())
      end)
  end

  local llama_cases = { { 'head', 'FULL_SHARD by layer, the LM head a unit' },
    { 'head_in_root', 'FULL_SHARD by layer, the LM head in the root' }, { 'noshard', 'NO_SHARD by layer' },
    { 'plain', 'a plain model and optimizer (no FSDP)' } }
  for _, c in ipairs(llama_cases) do
    it(('llama-tiny: the sharded checkpoint of 4 ranks (head unit) loads into %s here; the next step matches'):format(c[2]),
      function()
        local model, opt = H.build_llama(c[1])
        local info = ck.load_sharded(model, D .. '/llama-sharded', { optimizer = opt })
        assert.are.equal(info.world_size, info.extra.saved_at)
        check_loaded(model, opt, 'llama ' .. c[1] .. ' at ' .. dist.world_size(), 'llama-')
        check_next_step(model, opt, 'llama ' .. c[1] .. ' at ' .. dist.world_size(), 'llama-')
      end)
  end

  -- (the second step's gradient is averaged over this world, which rounds
  -- differently at 3 ranks: 1e-6)
  for _, kind in ipairs({ 'full', 'plain' }) do
    it(('SGD with momentum: the checkpoint of 4 ranks loads into %s here; the next two steps match'):format(kind),
      function()
        local want = ms.load_safetensors(D .. '/sgd-reference.safetensors').losses:totable()
        local model, opt = H.build_sgd(kind)
        ck.load_sharded(model, D .. '/sgd-sharded', { optimizer = opt })
        local got = H.train(model, opt, 2)
        assert.are.equal(want[1], got[1], kind .. ' at ' .. dist.world_size())
        assert.is_true(H.rel(got[2], want[2]) <= 1e-6, ('%s at %d: %.9g against %.9g'):format(kind, dist.world_size(),
          got[2], want[2]))
      end)
  end

  it('the full file of 4 ranks loads with load_full into FULL_SHARD here and into a plain model', function()
    for _, kind in ipairs({ 'full', 'plain' }) do
      local model = H.build(kind)
      ck.load_full(model, D .. '/full.safetensors')
      check_loaded(model, nil, 'load_full ' .. kind .. ' at ' .. dist.world_size())
    end
  end)
end)
