-- The flat-parameter layout (core/fsdp/flat.h through moonshard.fsdp), in
-- one process: hand-worked layouts (alignment padding, right padding to the
-- group size, a parameter straddling two shards, trailing ranks holding only
-- padding), then random lists of sizes for world sizes 1..5 checked against
-- an independent Lua computation that walks the flat buffer element by
-- element; then FlatParam's flatten / views / local shard on random tensors.
local ms = require 'moonshard'
local fsdp = ms.fsdp

-- the reference: an owner map of the flat buffer, element by element
local function ref_layout(numels, elem, world, align_bytes)
  local a = align_bytes / elem
  local offsets, pos = {}, 0
  for i, n in ipairs(numels) do
    while pos % a ~= 0 do pos = pos + 1 end
    offsets[i] = pos
    pos = pos + n
  end
  local used = pos
  local total = used
  while total % world ~= 0 do total = total + 1 end
  return { offsets = offsets, used = used, total = total, shard = total / world }
end

-- rank r's slice of parameter i by scanning the shard's elements
local function ref_slice(numels, ref, r, i)
  local first, count, at = nil, 0, nil
  for k = 0, ref.shard - 1 do
    local e = r * ref.shard + k
    local j = e - ref.offsets[i]
    if j >= 0 and j < numels[i] then
      if not first then first, at = j, k end
      count = count + 1
    end
  end
  if count == 0 then return { param_start = 0, numel = 0, shard_offset = 0 } end
  return { param_start = first, numel = count, shard_offset = at }
end

local function check_against_ref(numels, elem, world)
  local l = fsdp.layout(numels, { group_size = world, elem_size = elem })
  local ref = ref_layout(numels, elem, world, 16)
  assert.are.same(ref.offsets, l.offsets)
  assert.are.same(numels, l.numels)
  assert.are.equal(ref.used, l.used)
  assert.are.equal(ref.total, l.total)
  assert.are.equal(ref.shard, l.shard_numel)
  -- every element of every parameter is held by exactly one rank
  local held = {}
  for i = 1, #numels do held[i] = 0 end
  for r = 0, world - 1 do
    for i = 1, #numels do
      local s = l:slice(r, i)
      assert.are.same(ref_slice(numels, ref, r, i), s)
      held[i] = held[i] + s.numel
    end
  end
  assert.are.same(numels, held)
  return l
end

describe('flat layout', function()
  it('aligns each parameter to 16 bytes and pads to the group size (f32)', function()
    local l = fsdp.layout({ 10, 3, 7 }, { group_size = 4, elem_size = 4 })
    assert.are.same({ 0, 12, 16 }, l.offsets)
    assert.are.equal(23, l.used)
    assert.are.equal(24, l.total)
    assert.are.equal(6, l.shard_numel)
    assert.are.equal(4, l.align)
  end)

  it('aligns to 8 elements for bf16 and 2 for f64', function()
    assert.are.same({ 0, 8, 16 }, fsdp.layout({ 5, 1, 1 }, { elem_size = 2 }).offsets)
    assert.are.same({ 0, 4, 6 }, fsdp.layout({ 3, 1, 1 }, { elem_size = 8 }).offsets)
  end)

  it('splits a parameter that straddles two shards', function()
    -- 10 f32 elements on 4 ranks of 6 (total 24): rank 0 holds 0..5, rank 1 6..9
    local l = fsdp.layout({ 10, 3, 7 }, { group_size = 4 })
    assert.are.same({ param_start = 0, numel = 6, shard_offset = 0 }, l:slice(0, 1))
    assert.are.same({ param_start = 6, numel = 4, shard_offset = 0 }, l:slice(1, 1))
    -- parameter 3 (offset 16, 7 elements) straddles ranks 2 and 3
    assert.are.same({ param_start = 0, numel = 2, shard_offset = 4 }, l:slice(2, 3))
    assert.are.same({ param_start = 2, numel = 5, shard_offset = 0 }, l:slice(3, 3))
    assert.are.same({ param_start = 0, numel = 3, shard_offset = 0 }, l:slice(2, 2))
    assert.are.same({ param_start = 0, numel = 0, shard_offset = 0 }, l:slice(0, 3))
  end)

  it('leaves trailing ranks only padding when there is little to shard', function()
    -- 2 elements on 5 ranks: total 5, one element each, ranks 2..4 pad only
    local l = fsdp.layout({ 1, 1 }, { group_size = 5 })
    assert.are.same({ 0, 4 }, l.offsets)
    assert.are.equal(5, l.used)
    assert.are.equal(5, l.total)
    assert.are.same({ param_start = 0, numel = 1, shard_offset = 0 }, l:slice(0, 1))
    for r = 1, 3 do
      for i = 1, 2 do assert.are.equal(0, l:slice(r, i).numel) end
    end
    assert.are.same({ param_start = 0, numel = 1, shard_offset = 0 }, l:slice(4, 2))
    local l2 = fsdp.layout({ 3 }, { group_size = 5 })
    assert.are.equal(5, l2.total)
    for r = 3, 4 do assert.are.equal(0, l2:slice(r, 1).numel) end
  end)

  it('gives one rank everything and keeps zero-element parameters out of shards', function()
    local l = check_against_ref({ 7, 0, 5 }, 4, 1)
    assert.are.same({ 0, 8, 8 }, l.offsets)
    assert.are.equal(13, l.total)
    assert.are.equal(0, l:slice(0, 2).numel)
  end)

  it('matches an element-by-element computation on random sizes, world sizes 1..5', function()
    math.randomseed(7)
    local cases = 0
    for world = 1, 5 do
      for _, elem in ipairs({ 4, 2, 8 }) do
        for _ = 1, 6 do
          local numels = {}
          for i = 1, math.random(1, 7) do
            numels[i] = math.random(1, 4) == 1 and math.random(1, 3) or math.random(1, 90)
          end
          check_against_ref(numels, elem, world)
          cases = cases + 1
        end
      end
    end
    assert.are.equal(90, cases)
  end)

  it('rejects bad sizes with messages naming them', function()
    local function err(f) local ok, e = pcall(f); assert.is_false(ok); return tostring(e) end
    assert.matches('parameter 2 has numel %-3', err(function() fsdp.layout({ 1, -3 }) end))
    assert.matches('group size 0', err(function() fsdp.layout({ 1 }, { group_size = 0 }) end))
    assert.matches('alignment 16 bytes .* element size 3 bytes',
      err(function() fsdp.layout({ 1 }, { elem_size = 3 }) end))
    assert.matches('alignment 6 bytes', err(function() fsdp.layout({ 1 }, { align = 6 }) end))
    local l = fsdp.layout({ 4, 4 }, { group_size = 2 })
    assert.matches('rank 2 out of range for a group of 2', err(function() l:slice(2, 1) end))
    assert.matches('parameter 2 out of range %(2 parameters%)', err(function() l:slice(0, 3) end))
    assert.matches('overflows', err(function() fsdp.layout({ 2 ^ 61, 2 ^ 61 }) end))
  end)
end)

describe('FlatParam (one process)', function()
  local function params(seed)
    return {
      ms.randn({ 3, 5 }, { seed = seed }), ms.randn({ 7 }, { seed = seed + 1 }),
      ms.randn({ 2, 1, 3 }, { seed = seed + 2 }), ms.randn({ 1 }, { seed = seed + 3 }),
    }
  end

  it('flattens into a zero-padded buffer and gives every parameter back as a view', function()
    local ps = params(11)
    local fp = fsdp.FlatParam.new(ps, { world_size = 3, rank = 0 })
    local flat = fp:flatten(ps)
    assert.are.equal(fp.total, flat:numel())
    local vs = fp:views(flat)
    for i, p in ipairs(ps) do
      assert.are.same(p.shape, vs[i].shape)
      assert.are.same(p:totable(), vs[i]:totable())
    end
    -- padding is zero, and views write through to the flat buffer
    local l, owned = fp.layout, {}
    for i = 1, #ps do for k = 0, l.numels[i] - 1 do owned[l.offsets[i] + k] = true end end
    local ft = flat:totable()
    for e = 0, l.total - 1 do if not owned[e] then assert.are.equal(0, ft[e + 1]) end end
    vs[2]:copy_(5)
    assert.are.equal(5, flat:get(l.offsets[2] + 1))
  end)

  it('keeps each rank\'s shard: the slices of its parameters at their shard offsets', function()
    local ps = params(21)
    for world = 1, 5 do
      for r = 0, world - 1 do
        local fp = fsdp.FlatParam.new(ps, { world_size = world, rank = r })
        assert.are.equal(fp.shard_numel, fp.shard:numel())
        local sh = fp.shard:totable()
        for i, s in ipairs(fp:slices()) do
          local pt = ps[i]:reshape(ps[i]:numel()):totable()
          for k = 0, s.numel - 1 do
            assert.are.equal(pt[s.param_start + k + 1], sh[s.shard_offset + k + 1])
          end
        end
      end
    end
  end)

  it('unshards and reduce-scatters on one rank without collectives', function()
    local ps = params(31)
    local fp = fsdp.FlatParam.new(ps, { world_size = 1, rank = 0 })
    local vs = fp:unshard()
    for i, p in ipairs(ps) do assert.are.same(p:totable(), vs[i]:totable()) end
    assert.is_true(fp:is_unsharded())
    fp:reshard()
    assert.is_false(fp:is_unsharded())
    local g, gv = fp:grad_buffer()
    for i, v in ipairs(gv) do v:copy_(ps[i]) end
    local gs = fp:reduce_scatter(g, 'sum')
    assert.are.equal('f32', gs.dtype)
    assert.are.same(fp.shard:totable(), gs:totable())
  end)

  it('keeps an f32 master shard and gathers its bf16 copy', function()
    local ps = params(41)
    local fp = fsdp.FlatParam.new(ps, { world_size = 1, rank = 0, dtype = 'bf16' })
    assert.are.equal('f32', fp.shard.dtype)
    assert.are.equal('bf16', fp.dtype)
    assert.are.equal(8, fp.layout.align)   -- 16 bytes of bf16
    local flat32 = fp:flatten(ps, 'f32')
    assert.are.same(flat32:totable(), fp.shard:totable())
    local vs = fp:unshard()
    for i, p in ipairs(ps) do
      assert.are.equal('bf16', vs[i].dtype)
      assert.are.same(p:bf16():totable(), vs[i]:totable())
    end
    local f64 = fsdp.FlatParam.new({ ms.randn({ 3 }, { dtype = 'f64' }) }, { world_size = 1, rank = 0 })
    assert.are.equal('f64', f64.shard.dtype)
  end)

  it('names the parameter that is not a tensor or has the wrong size', function()
    local ok, e = pcall(fsdp.FlatParam.new, { ms.randn({ 2 }), 3 })
    assert.is_false(ok); assert.matches('parameter 2 is a number', e)
    local fp = fsdp.FlatParam.new({ ms.randn({ 2 }), ms.randn({ 3 }) }, { world_size = 2, rank = 1 })
    ok, e = pcall(fp.flatten, fp, { ms.randn({ 2 }), ms.randn({ 4 }) })
    assert.is_false(ok); assert.matches('parameter 2 has 4 elements, the layout 3', e)
    ok, e = pcall(fsdp.FlatParam.new, { ms.randn({ 2 }) }, { world_size = 2, rank = 2 })
    assert.is_false(ok); assert.matches('rank 2 out of range for a group of 2', e)
  end)
end)
