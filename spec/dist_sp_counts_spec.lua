-- Sequence parallelism's communication, counted (#mpi; docs/tp.md,
-- "What sequence parallelism costs"): ms.dist's trace (dist.trace) over one
-- step of a model split by ms.tp.parallelize, against the formula of
-- Megatron-LM's layout. Per split block and micro-batch of S bytes of
-- stream (mb·T·C), on the TP group:
--   with sequence parallelism  forward an all-gather and a reduce-scatter
--     for the attention (the latent attention gathers its latents, mb·T·
--     (q_lora + kv_lora + dr)) and for the MLP / MoE, backward the mirror;
--     the first stage's embedding a reduce-scatter of its partial sums
--     (its gradient rows gathered in backward: Megatron-LM's), the head's
--     gather on the last (its backward a reduce-scatter of the loss's
--     partial grad_x); the parts of the norms'
--     (and the latents') gradients summed once a step (a pipeline: not a
--     micro-batch); the stages exchange each rank's own S / N;
--   without  forward two all-reduces a block (and the embedding's),
--     backward one a split layer's input (the latent attention's three
--     latents); the stages exchange S.
-- The MoE's routing weights add one all-reduce of mb·T·k a layer in
-- backward either way. The vocabulary-parallel loss's own collectives
-- (core/flce.c, noted by flce.lua) are: grad_x's all-reduce (S; not
-- under sequence parallelism) and D's (16 bytes) a micro-batch, and the
-- rows' statistics a chunk (not counted here: the chunks are the C core's
-- choice). Then the
-- same under fully_shard (FSDP x TP): the whole model on each rank, the
-- parts summed once a unit a step (two micro-batches, the first under
-- no_sync). Host reads (item, totable) are the same with and without.
local ms = require 'moonshard'
local FS = require 'spec.fsdp_support'
local SU = require 'spec.support'
local dist = require 'moonshard.dist'
local hf = require 'models.hf'

local under_mpi = os.getenv('OMPI_COMM_WORLD_SIZE') ~= nil

describe('sequence parallelism\'s collectives, counted #mpi', function()
  if not under_mpi then
    it('runs under mpirun (tools/run_mpi_specs.sh)', function() pending('not started by mpirun') end)
    return
  end
  setup(function() dist.init { backend = 'mpi', timeout = 120 } end)
  teardown(function() dist.destroy() end)

  local W = tonumber(os.getenv('OMPI_COMM_WORLD_SIZE'))
  local nn = ms.nn

  local cases = {
    { 'llama', require 'models.llama', { vocab_size = 257, hidden_size = 48, intermediate_size = 96,
      num_hidden_layers = 4, num_attention_heads = 24, num_key_value_heads = 12, max_position_embeddings = 32 } },
    { 'deepseek_v3', require 'models.deepseek_v3', { vocab_size = 257, hidden_size = 48, intermediate_size = 96,
      moe_intermediate_size = 24, num_hidden_layers = 4, num_attention_heads = 12, n_shared_experts = 1,
      n_routed_experts = 4, routed_scaling_factor = 1.5, kv_lora_rank = 16, q_lora_rank = 20, qk_rope_head_dim = 4,
      v_head_dim = 6, qk_nope_head_dim = 4, n_group = 2, topk_group = 1, num_experts_per_tok = 2,
      first_k_dense_replace = 1, max_position_embeddings = 32, bos_token_id = hf.null, eos_token_id = hf.null } },
  }
  local function build(case)
    ms.manual_seed(7)
    return case[2].new(case[3]):to('f64')
  end
  local ES = 8   -- (f64)

  -- the trace's rows on `group` (a dist group) -> { [kind .. ' ' .. phase] = { calls =, bytes = } },
  -- and the host reads' count
  local tally, add, same = SU.tally, SU.tally_add, SU.same_tally

  -- what one micro-batch of `tok` tokens costs the TP group in the blocks
  -- `blocks` (first / last: the embedding / the head run here), added to t
  local function blocks_formula(t, blocks, tok, C, sp, first, last, M)
    local S = tok * C * ES
    for _, b in ipairs(blocks) do
      local attn, mlp = b.self_attn, b.mlp
      local mla = getmetatable(attn) == nn.MLAttention
      local moe = getmetatable(mlp) == nn.MoE
      if sp then
        local ain = mla and tok * (attn.q_lora_rank + attn.kv_lora_rank + attn.qk_rope_head_dim) * ES or S
        add(t, 'all_gather fwd', M, ain)
        add(t, 'all_gather fwd', M, S)
        add(t, 'reduce_scatter fwd', 2 * M, S)
        add(t, 'all_gather bwd', 2 * M, S)
        add(t, 'reduce_scatter bwd', M, ain)
        add(t, 'reduce_scatter bwd', M, S)
      else
        add(t, 'all_reduce fwd', 2 * M, S)
        if mla then
          for _, w in ipairs({ attn.q_lora_rank, attn.kv_lora_rank, attn.qk_rope_head_dim }) do
            add(t, 'all_reduce bwd', M, tok * w * ES)
          end
        else
          add(t, 'all_reduce bwd', M, S)
        end
        add(t, 'all_reduce bwd', M, S)
      end
      if moe then add(t, 'all_reduce bwd', M, tok * mlp.top_k * ES) end   -- (the routing weights)
    end
    if first then
      if sp then
        -- (the vocabulary-parallel embedding's partial sums reduce-scattered
        -- to this rank's rows, sp.embed; its backward the rows' gradients
        -- gathered)
        add(t, 'reduce_scatter fwd', M, S)
        add(t, 'all_gather bwd', M, S)
      else
        add(t, 'all_reduce fwd', M, S)               -- (the embedding's sum)
      end
    end
    if last then
      -- (the vocabulary-parallel loss: D and the weights' sum; grad_x
      -- all-reduced by the loss, or under sequence parallelism left partial
      -- and reduce-scattered by the backward of the head's gather)
      add(t, 'all_reduce (flce: D, sum w) fwd', M, 16)
      if sp then
        add(t, 'all_gather fwd', M, S)
        add(t, 'reduce_scatter bwd', M, S)
      else
        add(t, 'all_reduce (flce: grad_x) fwd', M, S)
      end
    end
  end

  -- the bytes of the parameters whose gradients are sequence-parallel parts
  local function partial_bytes(m)
    local info = rawget(m, '_tp')
    local n = 0
    for _, p in ipairs(m:parameters()) do
      if info.sp_partial[tonumber(p.id)] then n = n + p:numel() * ES end
    end
    return n
  end

  it('--pp 2 --tp 2 (4 ranks), Llama and DeepSeek-V3, with and without sequence parallelism: every collective and '
    .. 'point-to-point call of a step as the formula says', function()
    if W ~= 4 then return end
    local mesh = dist.mesh { replicate = 2, shard = 2 }   -- shard: the TP pairs; replicate: the pipelines
    local M, B, Tn = 4, 4, 8
    for _, case in ipairs(cases) do
      local reads, ops = {}, {}
      for _, sp in ipairs({ true, false }) do
        local what = ('%s, %s sequence parallelism'):format(case[1], sp and 'with' or 'without')
        local m = build(case)
        ms.tp.parallelize(m, { group = mesh.shard, sequence_parallel = sp })
        local pipe = ms.pp.pipeline(m, { group = mesh.replicate, microbatches = M, layers = { 2, 2 } })
        local C = m.config.hidden_size
        local x, y = FS.lcg_batch(5, B, Tn)
        pipe:step(x, y):free()   -- (a first step: whatever is made once)
        for _, p in ipairs(m:parameters()) do p.grad = nil end
        dist.trace(true)
        ms.profile.ops(true)
        local ok, err = pcall(function() pipe:step(x, y):free() end)
        ops[sp] = {}
        for _, o in ipairs((ms.profile.ops_rows())) do ops[sp][o.op] = o.calls end
        ms.profile.ops(false)
        local rows = dist.trace_rows()
        dist.trace(false)
        assert(ok, err)
        local got, nreads = tally(rows, mesh.shard)
        reads[sp] = nreads
        local want = {}
        local r = pipe.ranges[1]
        local blocks = {}
        for j = r[1], r[2] do blocks[#blocks + 1] = pipe.parts.blocks[j] end
        local tok = B / M * Tn
        blocks_formula(want, blocks, tok, C, sp, pipe.first, pipe.last, M)
        if sp then add(want, 'all_reduce fwd', 1, partial_bytes(m)) end   -- (once a step)
        same(want, got, what)
        -- the stages exchange S (S / 2 with sequence parallelism) each way a micro-batch
        local A = tok * C * ES / (sp and 2 or 1)
        local sent, recvd = 0, 0
        for _, row in ipairs(rows) do
          if row.kind:find('^p2p') then
            if row.kind:find('send') then sent = sent + row.calls * row.bytes else recvd = recvd + row.calls * row.bytes end
          end
        end
        assert.are.equal(M * A, sent, what .. ': bytes sent to the neighbour stage')
        assert.are.equal(M * A, recvd, what .. ': bytes received')
        pipe:free()
      end
      -- (sequence parallelism reads nothing more to the host)
      assert.are.equal(reads[false], reads[true], case[1] .. ': host reads')
      -- nor fills or adds more tensors (ms.profile): once a zero gradient
      -- filled and added a norm's parameter a micro-batch (tp's partial-
      -- gradient hooks), and the latent attention's three narrowed
      -- latents three zero-filled buffers and two adds (docs/perf-notes.md,
      -- "Sequence parallelism under --pp, op by op")
      for _, op in ipairs({ 'fill_', 'add' }) do
        assert.is_true((ops[true][op] or 0) <= (ops[false][op] or 0), ('%s: %s calls a step: %d with sequence '
          .. 'parallelism, %d without'):format(case[1], op, ops[true][op] or 0, ops[false][op] or 0))
      end
    end
    mesh.shard:free()
    mesh.replicate:free()
  end)

  it('FSDP x TP 2 (2 and 4 ranks), Llama and DeepSeek-V3, with and without sequence parallelism: the TP group\'s '
    .. 'collectives of a step of two micro-batches as the formula says', function()
    if W % 2 ~= 0 then return end
    local mesh = dist.mesh { replicate = W / 2, shard = 2 }
    local r = mesh.coord[1]
    local M, B, Tn = 2, 2, 8   -- (two micro-batches of B sequences a data-parallel rank)
    for _, case in ipairs(cases) do
      local reads = {}
      for _, sp in ipairs({ true, false }) do
        local what = ('%s, FSDP %d x TP 2, %s sequence parallelism'):format(case[1], W / 2, sp and 'with' or 'without')
        local m = build(case)
        ms.tp.parallelize(m, { group = mesh.shard, sequence_parallel = sp })
        ms.fsdp.fully_shard(m, { policy = ms.fsdp.policy.by_class { 'LlamaDecoderLayer' }, group = mesh.replicate })
        local C = m.config.hidden_size
        local x, y = FS.lcg_batch(9, M * B * (W / 2), Tn)
        local function step()
          for mb = 0, M - 1 do
            local a = (r * M + mb) * B + 1
            local xl, yl = x:narrow(1, a, B):contiguous(), y:narrow(1, a, B):contiguous()
            local function run()
              local l = m(xl, yl) * (1 / M)
              l:backward()
              l:free()
            end
            if mb < M - 1 then ms.fsdp.no_sync(m, run) else run() end
          end
        end
        step()
        dist.trace(true)
        local ok, err = pcall(step)
        local rows = dist.trace_rows()
        dist.trace(false)
        assert(ok, err)
        local got, nreads = tally(rows, mesh.shard)
        reads[sp] = nreads
        local want = {}
        blocks_formula(want, m:pipeline_parts().blocks, B * Tn, C, sp, true, true, M)
        if sp then
          -- each unit sums its parts once a step, before its own reduction
          for _, u in ipairs(ms.fsdp.units(m)) do
            if u.sp_ks then
              local n = 0
              for _, k in ipairs(u.sp_ks) do n = n + u.fp.layout.numels[k] end
              add(want, 'all_reduce bwd', 1, n * ES)
            end
          end
        end
        same(want, got, what)
      end
      assert.are.equal(reads[false], reads[true], case[1] .. ': host reads')
    end
    mesh.shard:free()
    mesh.replicate:free()
  end)
end)
