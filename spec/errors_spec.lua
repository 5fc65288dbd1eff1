-- Every error path of the tensor layer raises a readable Lua error that names
-- the op and the shapes (or dtypes, devices) involved, and the process goes
-- on: no crash, no leaked storage, later calls work.
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local S = require 'spec.support'

-- runs f, expects an error whose message contains every string in `parts`
local function fails(f, parts)
  local ok, err = pcall(f)
  assert.is_false(ok, 'expected an error containing: ' .. table.concat(parts, ' | '))
  assert.is_string(err)
  for _, p in ipairs(parts) do
    assert.matches(p, err, 1, true)
  end
  return err
end

describe('errors', function()
  local x
  before_each(function() x = ms.tensor({ { 1, 2, 3 }, { 4, 5, 6 } }) end)

  describe('views', function()
    it('view to a shape with another element count', function()
      fails(function() return x:view(4, 2) end, { 'view', '(4,2)', '(2,3)', '6 elements' })
      fails(function() return x:reshape(5) end, { 'reshape', '(5)', '(2,3)' })
      fails(function() return x:view(7) end, { 'view', '(7)' })
    end)

    it('view with two -1 or a negative size', function()
      fails(function() return x:view(-1, -1) end, { 'view', 'only one dim may be -1', '(-1,-1)' })
      fails(function() return x:view(-2, 3) end, { 'view', 'invalid size', '(-2,3)' })
      fails(function() return x:view(4, -1) end, { 'view', '(4,-1)', '(2,3)' })
    end)

    it('view of a transposed tensor that needs a copy points to reshape', function()
      fails(function() return x:t():view(6) end, { 'view', '(3,2)', '(6)', 'reshape' })
    end)

    it('non-integer shape entries', function()
      fails(function() return x:view('a') end, { 'view', 'integers', 'a' })
      fails(function() return x:view(2.5, 2) end, { 'view', 'integers', '2.5' })
    end)

    it('narrow out of range (messages use the Lua 1-based numbers)', function()
      fails(function() return x:narrow(1, 2, 2) end, { 'narrow', 'start 2 length 2', 'dim 1 of size 2', '(2,3)' })
      fails(function() return x:narrow(2, 0, 1) end, { 'narrow', 'start 0', '(2,3)' })
      fails(function() return x:narrow(2, 1, 4) end, { 'narrow', 'length 4', 'dim 2 of size 3' })
      fails(function() return x:narrow(1, 1, -1) end, { 'narrow', 'length -1' })
      fails(function() return x:narrow(3, 1, 1) end, { 'narrow', 'dim 3 out of range', '2 dims' })
      -- a negative start as given (it named -2 here, the start it counted from)
      fails(function() return x:narrow(2, -5, 1) end, { 'narrow', 'start -5 length 1', 'dim 2 of size 3' })
    end)

    it('select out of range', function()
      fails(function() return x:select(1, 3) end, { 'select', 'index 3', 'dim 1 of size 2' })
      fails(function() return x:select(1, 0) end, { 'select', 'index 0' })
      fails(function() return x:select(2, -4) end, { 'select', 'index -4 out of range for dim 2 of size 3' })
      -- (it named index 0, the -3 converted, through get too)
      fails(function() return x:get(-3, 1) end, { 'select', 'index -3 out of range for dim 1 of size 2' })
    end)

    it('dims out of range or not integers name the op', function()
      fails(function() return x:transpose(1, 3) end, { 'transpose', 'dim 3 out of range', '2 dims', 'use 1..2' })
      fails(function() return x:transpose(0, 1) end, { 'transpose', 'dim 0 out of range' })
      fails(function() return x:transpose(1.5, 1) end, { 'transpose', 'dim must be an integer', '1.5' })
      fails(function() return x:squeeze(3) end, { 'squeeze', 'dim 3' })
      fails(function() return x:unsqueeze(4) end, { 'unsqueeze', 'dim 4', 'use 1..3' })
      fails(function() return x:size(-3) end, { 'size', 'dim -3' })
      fails(function() return x:flatten(3) end, { 'flatten', 'dim 3' })
    end)

    it('permute with the wrong number of dims or a repeated dim', function()
      fails(function() return x:permute(1) end, { 'permute', '1 dims given', '(2,3)' })
      fails(function() return x:permute(1, 1) end, { 'permute', 'dim 1 repeated in (1,1)' })
      -- the dims as given, not the core's 0-based count (it said 'dim 0 repeated', then 'dim 1' for these)
      fails(function() return x:permute(2, -1) end, { 'permute', 'dim -1 repeated in (2,-1)' })
      fails(function() return x:permute(1, 3) end, { 'permute', 'dim 3 out of range' })
    end)

    it('expand to an incompatible shape', function()
      fails(function() return x:expand(4, 3) end, { 'expand', '(2,3)', '(4,3)' })
      fails(function() return x:expand(3) end, { 'expand', '(2,3)', '(3)' })
      fails(function() return x:expand(-1, 2, 3) end, { 'expand', '-1 not allowed' })
    end)

    it('more than 8 dims', function()
      fails(function() return ms.zeros({ 1, 1, 1, 1, 1, 1, 1, 1 }):unsqueeze(1) end, { 'unsqueeze', '8 dims' })
      fails(function() return ms.zeros({ 1, 1, 1, 1, 1, 1, 1, 1, 1 }) end, { 'empty', '9 dims', 'at most 8' })
      fails(function() return x:view(1, 1, 1, 1, 1, 1, 1, 2, 3) end, { 'view', 'at most 8' })
    end)

    it('t() of a tensor that is not 2-D', function()
      fails(function() return ms.zeros({ 2, 3, 4 }):t() end, { 't:', '2-D', '3 dims' })
    end)
  end)

  describe('constructors', function()
    it('negative, fractional or absurd sizes', function()
      fails(function() return ms.zeros({ 2, -1 }) end, { 'empty', 'negative size', '(2,-1)' })
      fails(function() return ms.zeros({ 2.5 }) end, { 'empty', 'integers', '2.5' })
      fails(function() return ms.empty({ 2 ^ 62, 16 }) end, { 'empty', 'too large' })
    end)

    it('unknown dtype names', function()
      fails(function() return ms.zeros({ 2 }, { dtype = 'f128' }) end, { 'unknown dtype f128', 'bf16' })
      fails(function() return ms.tensor({ 1 }, { dtype = 'int8' }) end, { 'unknown dtype int8' })
      fails(function() return x:to('int8') end, { 'to', 'unknown dtype or device int8' })
      fails(function() return x:to({ dtype = 'q4' }) end, { 'unknown dtype q4' })
    end)

    it('unknown device names', function()
      fails(function() return ms.zeros({ 2 }, { device = 'gpu' }) end, { 'unknown device gpu', 'cuda:N' })
      fails(function() return ms.zeros({ 2 }, { device = 'cuda:x' }) end, { 'unknown device cuda:x' })
      fails(function() return x:to({ device = 'tpu' }) end, { 'unknown device tpu' })
    end)

    it('a cuda device requested where there is none', function()
      local ok, t = pcall(ms.zeros, { 2 }, { device = 'cuda:0' })
      if ok then  -- a GPU host: the tensor is real
        assert.are.equal('cuda:0', t.device)
        return
      end
      assert.matches('cuda:0', t, 1, true)
      fails(function() return x:to('cuda') end, { 'cuda' })
      fails(function() return ms.tensor({ 1 }, { device = 'cuda:3' }) end, { 'cuda:3' })
    end)

    it('ragged tables and wrong element types', function()
      fails(function() return ms.tensor({ { 1 }, { 2, 3 } }) end, { 'tensor', 'ragged', 'data[2]', '2 elements', '1 were expected' })
      fails(function() return ms.tensor({ { 1, 2 }, 3 }) end, { 'tensor', 'ragged' })
      fails(function() return ms.tensor({ 1, 'a' }) end, { 'tensor', 'data[2] is a string' })
      fails(function() return ms.tensor(nil) end, { 'tensor', 'got nil' })
    end)

    it('arange with a zero step', function()
      fails(function() return ms.arange(0, 5, 0) end, { 'arange', 'step must not be 0' })
    end)
  end)

  describe('element access and copies', function()
    it('item on a tensor of more than one element', function()
      fails(function() return x:item() end, { 'item', '(2,3)', '6 elements' })
      fails(function() return ms.zeros({ 0 }):item() end, { 'item', '0 elements' })
    end)

    it('get / set with the wrong number of indices or out of range', function()
      fails(function() return x:get(1) end, { 'get', '1 indices', '2 dims' })
      fails(function() return x:get(3, 1) end, { 'index 3', 'size 2' })
      fails(function() return x:set(1, 4, 1) end, { 'index 4', 'size 3' })
      fails(function() return x:set(1, 1) end, { 'set', '1 indices', '2 dims' })
    end)

    it('copy_ from a shape that does not broadcast', function()
      fails(function() return ms.zeros({ 2, 2 }):copy_(ms.zeros({ 3 })) end,
        { 'copy_', 'f32 (3) cpu', 'f32 (2,2) cpu', 'broadcast' })
      fails(function() return ms.zeros({ 2 }, { dtype = 'f64' }):copy_(ms.zeros({ 2, 2 }, { dtype = 'i32' })) end,
        { 'copy_', 'i32 (2,2)', 'f64 (2)' })
    end)

    it('an in-place op into an expanded view (elements sharing memory) is refused, as in PyTorch', function()
      -- (add_ gave 2 in every element of a zeros(1,3):expand(2,3) + 1: each element added once per row)
      local base = ms.zeros({ 1, 3 })
      local e = base:expand(2, 3)
      fails(function() return e:add_(1) end, { 'add_', 'destination f32 (2,3) cpu has overlapping elements' })
      fails(function() return e:mul_(ms.ones({ 2, 3 })) end, { 'mul_', 'overlapping elements' })
      assert.are.same({ { 0, 0, 0 } }, base:totable())
      -- an expanded input is fine, and so is the in-place op on the base itself
      local a = ms.zeros({ 2, 3 })
      a:add_(ms.ones({ 1, 3 }):expand(2, 3))
      assert.are.same({ { 1, 1, 1 }, { 1, 1, 1 } }, a:totable())
      base:add_(1)
      assert.are.same({ { 1, 1, 1 }, { 1, 1, 1 } }, e:totable())
    end)

    it('copy_ from something that is not a number or tensor', function()
      fails(function() return ms.zeros({ 2 }):copy_('x') end, { 'fill', 'string' })
    end)

    it('setting a field that does not exist', function()
      fails(function() x.shape = { 3, 2 } end, { 'cannot set field shape' })
    end)

    it('using a freed tensor', function()
      local y = ms.tensor({ 1, 2 })
      y:free()
      fails(function() return y:view(2) end, { 'view', 'freed' })
      fails(function() return y:narrow(1, 1, 1) end, { 'narrow', 'freed' })
      fails(function() return y:transpose(1, 1) end, { 'transpose', 'freed' })
      fails(function() return y:item() end, { 'item', 'freed' })
      fails(function() return y:contiguous() end, { 'freed' })
      fails(function() return ms.zeros({ 2 }):copy_(y) end, { 'copy_', 'freed' })
      fails(function() return y + 1 end, { 'freed' })
      fails(function() return y - y end, { 'freed' })
    end)

    it('a nil tensor handed to the C layer', function()
      fails(function() return T.op(T.C.ms_tensor_view, nil, 0, nil) end, { 'view', 'nil' })
    end)
  end)

  describe('the process survives', function()
    it('hundreds of failing calls leak no storage and leave the library usable', function()
      local settled = function() return S.settled(ms.live_storages) end   -- (earlier specs' garbage)
      local s0 = settled()
      local bad = {
        function() return x:view(4, 2) end,
        function() return x:narrow(1, 2, 5) end,
        function() return x:t():view(6) end,
        function() return x:expand(5, 5) end,
        function() return ms.zeros({ 2 }, { dtype = 'nope' }) end,
        function() return ms.zeros({ 2 }, { device = 'cuda:7' }) end,
        function() return ms.tensor({ { 1 }, { 1, 2 } }) end,
        function() return ms.zeros({ 2, 2 }):copy_(ms.zeros({ 3 })) end,
        function() return x:reshape(7) end,
        function() return x:item() end,
      }
      local n = 0
      for _ = 1, 30 do
        for _, f in ipairs(bad) do
          local ok = pcall(f)
          if not ok then n = n + 1 end
        end
      end
      assert.are.equal(30 * #bad, n)
      assert.are.equal(s0, settled())
      -- and ordinary work still gives right answers
      local y = ms.tensor({ { 1, 2 }, { 3, 4 } }):t():contiguous()
      assert.are.same({ { 1, 3 }, { 2, 4 } }, y:totable())
      assert.are.equal(4, x:t():reshape(6):get(2))
    end)

    it('the C error message is per call: a success after a failure reports no stale error', function()
      pcall(function() return x:view(4, 2) end)
      local v = x:view(3, 2)
      assert.are.same({ 3, 2 }, v.shape)
      local err = fails(function() return x:view(5) end, { '(5)' })
      assert.is_nil(err:find('(4,2)', 1, true))
    end)
  end)
end)
