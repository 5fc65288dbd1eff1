-- Background sharded checkpoints (bin/train --async-checkpoint,
-- docs/checkpoints.md "In the background") under tensor, pipeline and
-- expert parallelism: CPU ranks through mpirun. For --tp 2 (2 ranks),
-- --tp 2 --fsdp FULL_SHARD (4), --pp 2 --tp 2 (4) and --ep 2 (2), a run
-- saving every step synchronously and the same run in the background write
-- the same folders: the same files, the rank files and index.json byte for
-- byte, state.json and manifest.json equal but for the run's own options
-- (--out, --async-checkpoint) and the state file's size and CRC-32; runs
-- resumed from either checkpoint of step 2 have the same losses. Failures
-- (MS_FSDP_CKPT_INJECT, lua/moonshard/fsdp_checkpoint.lua) of the save of
-- step 2 in the background: a file on a full disk, the index, a failure
-- before the file is queued, a rank killed while its file is written; each
-- stops the run naming what failed, and leaves ckpt-1 as the synchronous
-- run wrote it, from which the run resumes on the uninterrupted curve.
local json = require 'dkjson'
local train = require 'moonshard.train'
local S = require 'spec.support'
local q = S.shell_quote
local dir = S.tmpdir()
local bin_train, losses, close_losses = S.bin_train, S.run_losses, S.close_losses

local corpus = S.fixed_corpus(dir, 48000)
local tiny = S.tiny_flags(corpus, 2)
local mixtral = 'models/mixtral.lua --preset tiny --model.num_hidden_layers 2 --model.hidden_size 32 '
  .. '--model.intermediate_size 48 --seq-len 16 --lr 1e-2 --warmup 1 --eval-every 0 --eval-iters 2 --sample-tokens 0 '
  .. '--log-every 2 --data ' .. q(corpus)

-- each layout's flags (given again on resume: --tp, --pp and --ep are not
-- taken from the checkpoint) and the failure its save of step 2 meets
local layouts = {
  { name = 'tp', np = 2, args = 'models/gpt2.lua ' .. tiny, flags = '--batch-size 4 --tp 2', inject = 'disk:1' },
  { name = 'tpfsdp', np = 4, args = 'models/gpt2.lua ' .. tiny, flags = '--batch-size 2 --tp 2 --fsdp FULL_SHARD',
    inject = 'index:0' },
  { name = 'pptp', np = 4, args = 'models/gpt2.lua ' .. tiny, flags = '--batch-size 4 --pp 2 --tp 2', inject = 'kill:3' },
  { name = 'ep', np = 2, args = mixtral, flags = '--batch-size 2 --ep 2', inject = 'disk:0' },
}

local function ls(path)
  local p = io.popen('ls -1 ' .. q(path) .. ' 2>/dev/null')
  local names = {}
  for name in p:lines() do names[#names + 1] = name end
  p:close()
  return names
end
local function read_json(path) return assert(json.decode(assert(S.slurp(path), path), 1, nil), path) end

-- the checkpoint folders a (synchronous) and b (background) hold the same
-- state: every file but state.json and manifest.json byte for byte; those
-- two equal once the run's own options, and the state file's entry in the
-- manifest, are set aside
local function same_checkpoint(a, b)
  local names = ls(a)
  assert.are.same(names, ls(b))
  assert.is_true(train.verify_checkpoint(b))
  local bytes = {}
  for _, name in ipairs(names) do
    if name ~= 'state.json' and name ~= 'manifest.json' then bytes[#bytes + 1] = name end
  end
  assert.is_true(#bytes >= 3, a)   -- (index.json and a file a rank)
  S.same_files(a, b, bytes)
  local sa, sb = read_json(a .. '/state.json'), read_json(b .. '/state.json')
  assert.are.same({ false, true }, { sa.options.async_checkpoint, sb.options.async_checkpoint })
  sa.options.async_checkpoint, sa.options.out, sb.options.async_checkpoint, sb.options.out = nil, nil, nil, nil
  assert.are.same(sa, sb)
  local ma, mb = read_json(a .. '/manifest.json'), read_json(b .. '/manifest.json')
  ma.files['state.json'], mb.files['state.json'] = nil, nil
  assert.are.same(ma, mb)
end

describe('bin/train --async-checkpoint with sharded --tp, --tp --fsdp, --pp --tp and --ep checkpoints (CPU, mpirun)', function()
  teardown(function() os.execute('rm -rf ' .. q(dir)) end)

  for _, c in ipairs(layouts) do
    local common = ('--nproc-per-node %d --device cpu %s %s --steps 4 --save-every 1 --keep-checkpoints 0 --no-save '
      .. '--log-every 1')
      :format(c.np, c.args, c.flags)
    local launch = ('--nproc-per-node %d --device cpu'):format(c.np)
    local sync, async = ('%s/%s-sync'):format(dir, c.name), ('%s/%s-async'):format(dir, c.name)

    it(c.flags .. ' on ' .. c.np .. ' ranks: the background saves are the synchronous ones; a run resumed from '
      .. 'either has the same losses', function()
      local text = S.sync_and_async(common, sync, async)
      for step = 1, 3 do
        assert.is_truthy(text:find(('[rank 0] checkpoint %s/ckpt-%d (written in the background in'):format(async, step),
          1, true), text)
      end
      assert.are.same(losses(sync), losses(async))
      local names = ls(sync)
      assert.are.same(names, ls(async))
      local n = 0
      for _, name in ipairs(names) do
        if name:match('^ckpt%-%d+$') then
          same_checkpoint(sync .. '/' .. name, async .. '/' .. name)
          n = n + 1
        end
      end
      assert.are.equal(4, n)
      -- ckpt-2 of each, alone in a folder, resumed at the same layout
      local resumed = {}
      for _, from in ipairs({ sync, async }) do
        local root = from .. '-r'
        os.execute(('rm -rf %s && mkdir -p %s && cp -r %s/ckpt-2 %s/'):format(q(root), q(root), q(from), q(root)))
        local status, out = bin_train(('%s --resume %s %s'):format(launch, q(root), c.flags))
        assert.are.equal(0, status, out)
        assert.is_truthy(out:find('resumed from ' .. root .. '/ckpt-2 at step 2', 1, true), out)
        resumed[#resumed + 1] = losses(root)
      end
      assert.is_nil(resumed[2][2])
      assert.are.same(resumed[1], resumed[2])
      close_losses(losses(sync), resumed[2], 3, 4, 'resumed from the background checkpoint')
    end)

    it(c.flags .. ': a background save that fails (' .. c.inject .. ') stops the run saying why; ckpt-1 stays as it '
      .. 'was and the run resumes from it', function()
      local stage, r = c.inject:match('^(%w+):(%d+)$')
      if not io.open(sync .. '/ckpt-1/index.json') then
        local status, out = bin_train(('%s --out %s'):format(common, q(sync)))
        assert.are.equal(0, status, out)
      end
      local root = ('%s/%s-failed'):format(dir, c.name)
      local status, text = bin_train(('%s --async-checkpoint --out %s'):format(common, q(root)),
        'MS_FSDP_CKPT_INJECT=' .. c.inject .. ':ckpt-2.tmp')
      assert.are_not.equal(0, status, text)
      assert.is_truthy(text:find('[rank 0] checkpoint ' .. root .. '/ckpt-1 (written in the background in', 1, true), text)
      if stage ~= 'kill' then
        -- the save of step 2 was staged, the training went on, the failure came at a step boundary after it
        assert.is_truthy(text:find('[rank 0] checkpoint ' .. root .. '/ckpt-2: staged in', 1, true), text)
        assert.is_truthy(text:find('[rank 0] step 3/4', 1, true), text)
      end
      local file = ('%s/ckpt-2.tmp.tmp/rank-%05d-of-%05d.safetensors'):format(root, r, c.np)
      if stage == 'disk' then
        assert.is_truthy(text:find(('[rank %s] bin/train: checkpoint: writer: cannot write %s (0 bytes in): No space '
          .. 'left on device'):format(r, file), 1, true), text)
        assert.is_truthy(text:find(('rank(s) %s could not write their files (see their errors)'):format(r), 1, true), text)
      elseif stage == 'index' then
        assert.is_truthy(text:find('[rank 0] bin/train: fsdp_checkpoint: injected failure at index on rank 0', 1, true), text)
        assert.is_truthy(text:find('[rank 1] bin/train: fsdp_checkpoint: save_sharded (index of ' .. root
          .. '/ckpt-2.tmp) failed on another rank (see its error)', 1, true), text)
      else
        assert.are.equal('kill', stage)
        assert.is_truthy(text:find(('bin/train: rank %s failed: killed by signal 9'):format(r), 1, true), text)
        -- (the unfinished save's folder, never read)
        assert.is_truthy(io.open(root .. '/ckpt-2.tmp.tmp'), root)
      end
      for _, name in ipairs(ls(root)) do assert.is_falsy(name:match('^ckpt%-2$'), root) end
      same_checkpoint(sync .. '/ckpt-1', root .. '/ckpt-1')
      status, text = bin_train(('%s --resume %s %s'):format(launch, q(root), c.flags))
      assert.are.equal(0, status, text)
      assert.is_truthy(text:find('resumed from ' .. root .. '/ckpt-1 at step 1', 1, true), text)
      close_losses(losses(sync), losses(root), 1, 4, 'resumed after the failed save')
      -- (the resumed run's save of step 2 replaced what the failed one left)
      assert.is_true(train.verify_checkpoint(root .. '/ckpt-2'))
      assert.is_nil(io.open(root .. '/ckpt-2.tmp.tmp'))
    end)
  end
end)
