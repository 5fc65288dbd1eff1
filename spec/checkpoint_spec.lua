-- Checkpoints and resume (moonshard.checkpoint, moonshard.train): a run
-- stopped and resumed is bitwise the run that never stopped; a corrupt or
-- truncated checkpoint is named and the previous one used; only the last K
-- are kept; SIGINT leaves a complete checkpoint and exit status 0; NaN steps
-- are skipped and counted; gradient accumulation equals one big batch;
-- configs and overrides; bin/plot draws a PNG.
local ffi = require 'ffi'
local T = require 'moonshard.tensor'
local S = require 'moonshard.safetensors'
local json = require 'dkjson'
local train = require 'moonshard.train'
local ckpt = require 'moonshard.checkpoint'
pcall(ffi.cdef, 'int memcmp(const void *a, const void *b, size_t n);')

local root = T.root
local S_ = require 'spec.support'
local q, tmpdir = S_.shell_quote, S_.tmpdir
local function rm(d) os.execute('rm -rf ' .. q(d)) end
local slurp = S_.slurp
local function spit(path, s)
  local f = assert(io.open(path, 'wb'))
  f:write(s)
  f:close()
end
local function exists(path) local f = io.open(path, 'rb'); if f then f:close() end; return f ~= nil end
local function read_jsonl(path)
  local rows = {}
  for line in assert(io.open(path, 'rb')):lines() do rows[#rows + 1] = assert(json.decode(line, 1, nil)) end
  return rows
end
-- the "loss" field of each line, as written (17 significant digits)
local function loss_fields(path)
  local out = {}
  for line in assert(io.open(path, 'rb')):lines() do
    out[#out + 1] = line:match('^{"step":(%d+)') .. ' ' .. tostring(line:match('"loss":([^,}]*)'))
  end
  return out
end
local function bin_train(args)
  local p = io.popen(('cd %s && bin/train %s 2>&1; echo "__status=$?"'):format(q(root), args))
  local out = p:read('*a')
  p:close()
  return tonumber(out:match('__status=(%d+)%s*$')), out:gsub('__status=%d+%s*$', '')
end
local function dirs(path)
  local p = io.popen('ls -1 ' .. q(path))
  local out = {}
  for l in p:lines() do out[#out + 1] = l end
  p:close()
  table.sort(out)
  return out
end

-- the text every run trains on: fixed bytes, not the repository's own
-- files (their default), which an edit made while the specs run would
-- change between the two runs a test compares
local corpus_dir = tmpdir()
local corpus = S_.fixed_corpus(corpus_dir, 48000)
-- a tiny GPT-2 with dropout on, so the RNG matters to every step
local function opts(t)
  local o = { model = 'models.gpt2', preset = 'tiny', steps = 40, seq_len = 16, batch_size = 4, lr = 1e-2, warmup = 3,
              data = corpus,
              model_config = { n_layer = 1, n_embd = 32, n_head = 2, resid_pdrop = 0.1, embd_pdrop = 0.1, attn_pdrop = 0.1 },
              eval_every = 10, eval_iters = 1, sample_tokens = 0, quiet = true, seed = 7 }
  for k, v in pairs(t or {}) do o[k] = v end
  return o
end
local small_flags = '--preset tiny --model.n_layer 1 --model.n_embd 32 --model.n_head 2 --seq-len 16 --batch-size 4 '
  .. '--sample-tokens 0 --eval-iters 1 --data ' .. q(corpus)

describe('checkpoint', function()
  -- the models, optimizers and loaded tensors of these runs go now, not in
  -- a later spec that counts live storages (spec/flce_spec.lua)
  after_each(function() for _ = 1, 4 do collectgarbage() end end)

  it('computes the CRC-32 of zlib and PNG (zlib and the LuaJIT fallback agree)', function()
    assert.are.equal(0xCBF43926, ckpt.crc32_string('123456789'))
    assert.are.equal(0xCBF43926, ckpt.crc32_string('6789', ckpt.crc32_string('12345')))
    assert.are.equal(0xCBF43926, ckpt.crc32_lua(0, '123456789'))
    assert.are.equal(ckpt.crc32_string(('moonshard'):rep(1000)), ckpt.crc32_lua(0, ('moonshard'):rep(1000)))
    local dir = tmpdir()
    spit(dir .. '/f', ('moonshard'):rep(1000))
    local saved = ckpt.chunk_bytes
    ckpt.chunk_bytes = 77 -- many chunks
    local crc, n = ckpt.crc32_file(dir .. '/f')
    ckpt.chunk_bytes = saved
    assert.are.equal(9000, n)
    assert.are.equal(ckpt.crc32_string(('moonshard'):rep(1000)), crc)
    rm(dir)
  end)

  it('resumes bitwise: 40 steps straight = 20 steps, stop, 20 more (losses and parameters)', function()
    local a, b = tmpdir(), tmpdir()
    train.run(opts{ out = a })
    local s1 = train.run(opts{ out = b, stop_at = 20 })
    assert.are.equal('--stop-at 20', s1.interrupted)
    assert.are.equal(b .. '/ckpt-20', s1.checkpoint)
    assert.is_true(ckpt.verify(s1.checkpoint))
    assert.are.equal(20, #read_jsonl(b .. '/metrics.jsonl'))
    assert.is_nil(io.open(b .. '/model.safetensors')) -- no final weights: the run is not done
    T.manual_seed(12345) -- the resumed run must not depend on the RNG it finds
    local s2 = train.run{ out = b, resume = 'latest', model = 'models.gpt2' }
    assert.are.equal(40, s2.steps)
    local la, lb = loss_fields(a .. '/metrics.jsonl'), loss_fields(b .. '/metrics.jsonl')
    assert.are.equal(40, #la)
    assert.are.same(la, lb)
    -- validation losses too (the val loader is a pure function of the step)
    local ra, rb = read_jsonl(a .. '/metrics.jsonl'), read_jsonl(b .. '/metrics.jsonl')
    for _, s in ipairs({ 10, 20, 30, 40 }) do assert.are.equal(ra[s].val_loss, rb[s].val_loss) end
    -- the final parameters, tensor by tensor, byte for byte
    local ta, tb = S.load(a .. '/model.safetensors'), S.load(b .. '/model.safetensors')
    local n = 0
    for name, t in pairs(ta) do
      local u = assert(tb[name], name)
      local bytes = t:numel() * 4
      assert.are.equal(0, ffi.C.memcmp(t:data_ptr(), u:data_ptr(), bytes), name)
      n = n + 1
    end
    assert.is_true(n > 5)
    -- and the losses do depend on the dropout RNG: another seed differs
    local c = tmpdir()
    train.run(opts{ out = c, steps = 3, seed = 8 })
    assert.are_not.equal(la[2], loss_fields(c .. '/metrics.jsonl')[2])
    rm(a); rm(b); rm(c)
  end)

  it('resumes bitwise on token shards too (the shard loader\'s position is in the checkpoint)', function()
    local shards = require 'moonshard.shards'
    local d, a, b = tmpdir(), tmpdir(), tmpdir()
    local text = slurp(root .. '/lua/moonshard/train.lua')
    local tr, va = {}, {}
    for i = 1, 20000 do tr[i] = text:byte(i) end
    for i = 20001, 24000 do va[#va + 1] = text:byte(i) end
    shards.write(d .. '/train_000000.bin', tr)
    shards.write(d .. '/val_000000.bin', va)
    train.run(opts{ out = a, steps = 16, data = d })
    train.run(opts{ out = b, steps = 16, data = d, stop_at = 7 })
    local st = json.decode(slurp(b .. '/ckpt-7/state.json'))
    assert.are.equal(7, st.data.step)
    assert.are.equal(0, st.data.epoch)
    train.run{ resume = b }
    assert.are.same(loss_fields(a .. '/metrics.jsonl'), loss_fields(b .. '/metrics.jsonl'))
    assert.are.equal(slurp(a .. '/model.safetensors'), slurp(b .. '/model.safetensors'))
    rm(d); rm(a); rm(b)
  end)

  it('detects a flipped byte, a truncated file and a missing manifest, names the file, uses the previous one', function()
    local dir = tmpdir()
    train.run(opts{ out = dir, steps = 15, save_every = 5, keep_checkpoints = 0, eval_every = 0 })
    assert.are.same({ 'ckpt-10', 'ckpt-15', 'ckpt-5' }, (function()
      local d = {}
      for _, x in ipairs(dirs(dir)) do if x:match('^ckpt') then d[#d + 1] = x end end
      return d
    end)())
    -- flip one byte in the middle of ckpt-15's weights
    local p15 = dir .. '/ckpt-15/model.safetensors'
    local s = slurp(p15)
    local k = math.floor(#s / 2)
    spit(p15, s:sub(1, k - 1) .. string.char((s:byte(k) + 1) % 256) .. s:sub(k + 1))
    local ok, err = ckpt.verify(dir .. '/ckpt-15')
    assert.is_nil(ok)
    assert.is_truthy(err:find('ckpt-15/model.safetensors: checksum mismatch', 1, true), err)
    local warned = {}
    local c = ckpt.latest(dir, function(m) warned[#warned + 1] = m end)
    assert.are.equal(10, c.step)
    assert.is_truthy(warned[1]:find('model.safetensors', 1, true), warned[1])
    -- bin/train --resume says so and continues from ckpt-10
    local status, text = bin_train(('--resume %s --steps 16 --quiet'):format(q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('ckpt-15/model.safetensors: checksum mismatch', 1, true), text)
    local rows = read_jsonl(dir .. '/metrics.jsonl')
    assert.are.equal(16, #rows)
    for i, r in ipairs(rows) do assert.are.equal(i, r.step) end
    -- the resumed run wrote a good ckpt-15 and ckpt-16; drop them, then
    -- truncate ckpt-10's optimizer state: ckpt-5 next
    assert.is_true(ckpt.verify(dir .. '/ckpt-15'))
    rm(dir .. '/ckpt-15'); rm(dir .. '/ckpt-16')
    local p10 = dir .. '/ckpt-10/optimizer.safetensors'
    s = slurp(p10)
    spit(p10, s:sub(1, #s - 100))
    warned = {}
    c = ckpt.latest(dir, function(m) warned[#warned + 1] = m end)
    assert.are.equal(5, c.step)
    assert.is_truthy(warned[1]:find('ckpt-10/optimizer.safetensors has ' .. (#s - 100) .. ' bytes', 1, true), warned[1])
    -- no manifest (a copy cut short): nothing left
    os.remove(dir .. '/ckpt-5/manifest.json')
    c = ckpt.latest(dir)
    assert.is_nil(c)
    status, text = bin_train(('models/gpt2.lua --out %s --resume --quiet'):format(q(dir)))
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('ckpt-5/manifest.json is missing', 1, true), text)
    assert.is_truthy(text:find('no complete checkpoint', 1, true), text)
    rm(dir)
  end)

  it('keeps the last K checkpoints and leaves no temporary folder', function()
    local dir = tmpdir()
    train.run(opts{ out = dir, steps = 12, save_every = 2, keep_checkpoints = 2, eval_every = 0 })
    local found = {}
    for _, x in ipairs(dirs(dir)) do if x:match('^ckpt') then found[#found + 1] = x end end
    assert.are.same({ 'ckpt-10', 'ckpt-12' }, found)
    for _, x in ipairs(found) do
      assert.is_true(ckpt.verify(dir .. '/' .. x))
      local man = json.decode(slurp(dir .. '/' .. x .. '/manifest.json'))
      for _, f in ipairs({ 'model.safetensors', 'optimizer.safetensors', 'optimizer.json', 'state.json' }) do
        assert.is_number(man.files[f].crc32, f)
      end
    end
    local st = json.decode(slurp(dir .. '/ckpt-12/state.json'))
    assert.are.equal(12, st.step)
    assert.are.equal(12, st.scheduler.step)
    assert.are.equal(12, st.data.step)
    assert.is_number(st.rng.offset)
    assert.are.equal(12, st.options.steps)
    rm(dir)
  end)

  it('a fresh run refuses an --out that holds an earlier run\'s checkpoints (its metrics and checkpoints kept)', function()
    -- (it truncated metrics.jsonl and wrote its ckpt-2 beside ckpt-4..8,
    -- whose pruning removed it at once: a --resume took the earlier run)
    local dir = tmpdir()
    local status, text = bin_train(('models/gpt2.lua --steps 8 --save-every 2 --quiet --out %s '):format(q(dir)) .. small_flags)
    assert.are.equal(0, status, text)
    local before = slurp(dir .. '/metrics.jsonl')
    status, text = bin_train(('models/gpt2.lua --steps 2 --save-every 2 --quiet --out %s '):format(q(dir)) .. small_flags)
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('--out ' .. dir .. ' holds checkpoints of an earlier run (ckpt-8): --resume', 1, true), text)
    assert.is_falsy(text:find('traceback', 1, true), text)
    assert.are.equal(before, slurp(dir .. '/metrics.jsonl'))
    assert.are.same({ 'ckpt-4', 'ckpt-6', 'ckpt-8', 'config.json', 'metrics.jsonl', 'model.safetensors', 'run.json' },
      dirs(dir))
    -- a --resume of it goes on
    status, text = bin_train(('--resume %s --steps 10 --quiet'):format(q(dir)))
    assert.are.equal(0, status, text)
    assert.are.equal(10, #read_jsonl(dir .. '/metrics.jsonl'))
    rm(dir)
  end)

  it('the writer thread writes queued files with their CRC-32, reports a failed one by name and goes on', function()
    local dir = tmpdir()
    local w = ckpt.writer()
    local a = T.randn({ 1000 }, { dtype = 'f32' })
    local b = T.randn({ 3, 5 }, { dtype = 'f64' })
    local empty = T.empty({ 0 }, { dtype = 'f32' })
    local ptrs = ffi.new('const void *[3]', { a:data_ptr(), empty:data_ptr(), b:data_ptr() })
    local bytes = ffi.new('int64_t[3]', { 4000, 0, 120 })
    local j1 = T.C.ms_writer_submit(w.p, dir .. '/one', 'head', 4, 3, ptrs, bytes)
    local j2 = T.C.ms_writer_submit(w.p, '/dev/full', 'x', 1, 1, ptrs, bytes)   -- ENOSPC on write
    local j3 = T.C.ms_writer_submit(w.p, dir .. '/no/such/folder/f', nil, 0, 1, ptrs, bytes)
    local j4 = T.C.ms_writer_submit(w.p, dir .. '/two', nil, 0, 1, ptrs + 2, bytes + 2)
    assert.are.same({ 0, 1, 2, 3 }, { tonumber(j1), tonumber(j2), tonumber(j3), tonumber(j4) })
    local ok, err = pcall(w.wait, w)
    assert.is_false(ok)
    assert.matches('cannot write /dev/full (0 bytes in): No space left on device (and 1 more file failed)', err, 1, true)
    assert.is_true(w:idle())
    -- the files queued after the failures were written, with the CRC-32 of their bytes
    local one = slurp(dir .. '/one')
    assert.are.equal(4 + 4000 + 120, #one)
    assert.are.equal('head', one:sub(1, 4))
    assert.are.equal(ffi.string(a:data_ptr(), 4000) .. ffi.string(b:data_ptr(), 120), one:sub(5))
    local n, crc = w:result(j1)
    assert.are.equal(#one, n)
    assert.are.equal(ckpt.crc32_string(one), crc)
    n, crc = w:result(j4)
    assert.are.equal(120, n)
    assert.are.equal(ckpt.crc32_file(dir .. '/two'), crc)
    local okr, rerr = pcall(w.result, w, j3)
    assert.is_false(okr)
    assert.matches('checkpoint: writer: cannot create ' .. dir .. '/no/such/folder/f: No such file or directory', rerr, 1,
      true)
    assert.is_false((pcall(w.result, w, 99)))
    -- the failures were reported once: the next wait is clean
    w:wait()
    -- bad arguments are refused at once
    assert.are.equal(-1, tonumber(T.C.ms_writer_submit(w.p, dir .. '/bad', nil, 0, 1, ptrs, ffi.new('int64_t[1]', { -5 }))))
    assert.matches('piece 1 has %-5 bytes', ffi.string(T.C.ms_last_error()))
    w:close()
    w:close()
    rm(dir)
  end)

  it('the writer streams pieces given later, frees what is written, and a cancelled file fails by name', function()
    local dir = tmpdir()
    local w = ckpt.writer()
    local C = T.C
    local a, b = T.randn({ 300 }), T.randn({ 500 })
    local ptrs = ffi.new('const void *[2]', { nil, nil })
    local bytes = ffi.new('int64_t[2]', { 1200, 2000 })
    local job = C.ms_writer_submit(w.p, dir .. '/s', 'hd', 2, 2, ptrs, bytes)
    assert.are.equal(0, tonumber(C.ms_writer_idle(w.p)))        -- waiting for piece 0
    assert.are.equal(0, C.ms_writer_provide(w.p, job, 0, a:data_ptr()))
    assert.are.equal(1, C.ms_writer_wait_written(w.p, job, 1))  -- piece 0 out, piece 1 not given yet
    assert.are.equal(-1, C.ms_writer_provide(w.p, job, 0, b:data_ptr()))   -- (given already)
    assert.are.equal(0, C.ms_writer_provide(w.p, job, 1, b:data_ptr()))
    w:wait()
    assert.are.equal('hd' .. ffi.string(a:data_ptr(), 1200) .. ffi.string(b:data_ptr(), 2000), slurp(dir .. '/s'))
    -- cancelled while it waits for a piece: the wait names the file and the reason
    local j2 = C.ms_writer_submit(w.p, dir .. '/c', nil, 0, 2, ptrs, bytes)
    C.ms_writer_provide(w.p, j2, 0, a:data_ptr())
    assert.are.equal(0, C.ms_writer_cancel(w.p, j2, 'the copy failed'))
    assert.are.equal(-1, C.ms_writer_wait_written(w.p, j2, 2))
    local ok, err = pcall(w.wait, w)
    assert.is_false(ok)
    assert.matches('writer: ' .. dir .. '/c: the copy failed', err, 1, true)
    -- safetensors through the writer without staging: views and their copies
    -- streamed a few at a time give S.save's bytes
    local tensors = {}
    for k = 1, 6 do tensors['v' .. k] = T.randn({ 40, 30 }):t() end   -- (non-contiguous: copied)
    tensors.plain = T.randn({ 7 })
    local saved = S.stream_bytes
    S.stream_bytes = 5000   -- two copies of 4800 bytes held at most
    local j3 = w:safetensors(dir .. '/v.safetensors', tensors, { note = 'x' }, false)
    S.stream_bytes = saved
    w:wait()
    S.save(dir .. '/ref.safetensors', tensors, { note = 'x' })
    assert.are.equal(slurp(dir .. '/ref.safetensors'), slurp(dir .. '/v.safetensors'))
    assert.are.equal(#slurp(dir .. '/v.safetensors'), (w:result(j3)))
    -- a copy that fails part way: the file fails, named, and nothing waits forever
    local orig = T.methods.clone
    local calls = 0
    T.methods.clone = function(...) calls = calls + 1; if calls == 3 then error('simulated copy failure') end; return orig(...) end
    local okf, ferr = pcall(w.safetensors, w, dir .. '/f.safetensors', tensors, nil, false)
    T.methods.clone = orig
    assert.is_false(okf)
    assert.matches('simulated copy failure', ferr, 1, true)
    assert.matches(dir .. '/f.safetensors', ferr, 1, true)
    -- the writer goes on
    w:safetensors(dir .. '/g.safetensors', tensors, nil, false)
    w:wait()
    assert.are.equal(slurp(dir .. '/ref.safetensors'):sub(-4800), slurp(dir .. '/g.safetensors'):sub(-4800))
    -- closed with a file still waiting for a piece: that file fails, nothing hangs
    C.ms_writer_submit(w.p, dir .. '/never', nil, 0, 2, ptrs, bytes)
    w:close()
    w:close()
    rm(dir)
  end)

  it('save_async stages the tensors: the checkpoint holds the values of the call, the training goes on', function()
    local dir = tmpdir()
    local gpt2 = require 'models.gpt2'
    T.manual_seed(3)
    local model = gpt2.new('tiny', { n_layer = 1, n_embd = 32, n_head = 2 })
    local opt = require('moonshard.optim').AdamW(model, { lr = 1e-2 })
    local x = T.tensor({ { 1, 2, 3, 4 } }, { dtype = 'i64' })
    model(x, x):backward()
    opt:step()
    local before = {}
    for name, t in pairs(model:state_dict()) do before[name] = t:clone() end
    local w = ckpt.writer()
    local p = ckpt.save_async(dir, 5, { model = model, optimizer = opt, state = { note = 'async' } },
      { keep = 2, writer = w })
    -- at once: another step changes every parameter and moment
    opt:zero_grad()
    model(x, x):backward()
    opt:step()
    -- and a second save before the first is finished: its staging waits for
    -- the files still written from the same buffers
    local after = {}
    for name, t in pairs(model:state_dict()) do after[name] = t:clone() end
    local p7 = ckpt.save_async(dir, 7, { model = model }, { writer = w })
    require('moonshard').no_grad(function() for _, t in pairs(model:state_dict()) do t:mul_(0) end end)
    assert.are.equal(dir .. '/ckpt-7', p7:finish())
    local saved7 = S.load(dir .. '/ckpt-7/model.safetensors')
    for name, t in pairs(after) do
      assert.are.equal(0, ffi.C.memcmp(t:data_ptr(), saved7[name]:data_ptr(), t:numel() * 4), name)
    end
    model:load_state_dict(after)
    assert.are.equal(dir .. '/ckpt-5', p:finish())
    assert.are.equal(dir .. '/ckpt-5', p:finish())   -- (a second finish returns the path)
    assert.is_true(ckpt.verify(dir .. '/ckpt-5'))
    local saved = S.load(dir .. '/ckpt-5/model.safetensors')
    local n = 0
    for name, t in pairs(before) do
      assert.are.equal(0, ffi.C.memcmp(t:data_ptr(), saved[name]:data_ptr(), t:numel() * 4), name)
      assert.is_true((model:state_dict()[name] - t):abs():max():item() > 0, name)
      n = n + 1
    end
    assert.is_true(n > 5)
    -- the same bytes as a synchronous save of the same values
    model:load_state_dict(before)
    local sync = tmpdir()
    local p2 = ckpt.save_async(dir, 6, { model = model }, { writer = w })   -- the staging buffers reused
    ckpt.save(sync, 6, { model = model })
    p2:finish()
    assert.are.equal(slurp(sync .. '/ckpt-6/model.safetensors'), slurp(dir .. '/ckpt-6/model.safetensors'))
    assert.are.equal(slurp(sync .. '/ckpt-6/manifest.json'), slurp(dir .. '/ckpt-6/manifest.json'))
    w:close()
    rm(dir); rm(sync)
  end)

  it('a background save that fails names the file, removes its folder and keeps the older checkpoints', function()
    local dir = tmpdir()
    local model = require('models.gpt2').new('tiny', { n_layer = 1, n_embd = 32, n_head = 2 })
    ckpt.save(dir, 1, { model = model })
    local w = ckpt.writer()
    -- the model file of step 2 lands on /dev/full: its write fails (ENOSPC) in the writer's thread
    local trap = { state_dict = function()
      os.execute(('ln -s /dev/full %s'):format(q(dir .. '/ckpt-2.tmp/model.safetensors')))
      return model:state_dict()
    end }
    local p = ckpt.save_async(dir, 2, { model = trap }, { keep = 1, writer = w })
    local ok, err = pcall(p.finish, p)
    assert.is_false(ok)
    assert.matches('checkpoint: writer: cannot write ' .. dir .. '/ckpt-2.tmp/model.safetensors', err, 1, true)
    assert.matches('No space left on device', err, 1, true)
    assert.are.same({ 'ckpt-1' }, dirs(dir))
    assert.is_true(ckpt.verify(dir .. '/ckpt-1'))
    -- the writer works on
    ckpt.save_async(dir, 3, { model = model }, { keep = 1, writer = w }):finish()
    assert.are.same({ 'ckpt-3' }, dirs(dir))
    -- a tensor that cannot be saved is refused before anything is queued
    local okb, berr = pcall(ckpt.save_async, dir, 4, { model = { state_dict = function() return { x = 5 } end } },
      { writer = w })
    assert.is_false(okb)
    assert.matches('value for "x" is a number, expected a tensor', berr, 1, true)
    assert.are.same({ 'ckpt-3' }, dirs(dir))
    w:close()
    rm(dir)
  end)

  it('--async-checkpoint writes the checkpoints of the synchronous run and resumes bitwise from them', function()
    local a, b = tmpdir(), tmpdir()
    train.run(opts{ out = a, steps = 12, save_every = 4, keep_checkpoints = 0, eval_every = 0 })
    local r = train.run(opts{ out = b, steps = 12, save_every = 4, keep_checkpoints = 0, eval_every = 0,
      async_checkpoint = true })
    assert.are.equal(b .. '/ckpt-12', r.checkpoint)
    assert.are.same({ 'ckpt-12', 'ckpt-4', 'ckpt-8' }, (function()
      local out = {}
      for _, x in ipairs(dirs(b)) do if x:match('^ckpt') then out[#out + 1] = x end end
      return out
    end)())
    for _, c in ipairs({ 'ckpt-4', 'ckpt-8', 'ckpt-12' }) do
      assert.is_true(ckpt.verify(b .. '/' .. c))
      for _, f in ipairs({ 'model.safetensors', 'optimizer.safetensors', 'optimizer.json' }) do
        assert.are.equal(slurp(a .. '/' .. c .. '/' .. f), slurp(b .. '/' .. c .. '/' .. f), c .. '/' .. f)
      end
    end
    -- resumed from the background-written ckpt-8: the same last losses
    os.execute('rm -rf ' .. q(b .. '/ckpt-12'))
    train.run{ out = b, resume = b .. '/ckpt-8', model = 'models.gpt2' }
    assert.are.same(loss_fields(a .. '/metrics.jsonl'), loss_fields(b .. '/metrics.jsonl'))
    rm(a); rm(b)
  end)

  it('bin/train stops on SIGINT after the step in flight: a complete checkpoint, exit status 0', function()
    local dir = tmpdir()
    local cmd = ('cd %s && ( bin/train models/gpt2.lua %s --steps 100000 --log-every 1 --out %s > %s 2>&1 & '
      .. 'echo $! > %s; wait $!; echo $? > %s ) > /dev/null 2>&1 &'):format(
      q(root), small_flags, q(dir .. '/run'), q(dir .. '/log'), q(dir .. '/pid'), q(dir .. '/status'))
    os.execute(cmd)
    local function wait_for(pred, what)
      for _ = 1, 600 do
        if pred() then return true end
        os.execute('sleep 0.05')
      end
      error('timed out waiting for ' .. what .. '; log: ' .. tostring(slurp(dir .. '/log')))
    end
    wait_for(function() return (slurp(dir .. '/log') or ''):find('step%s+%d+/100000') end, 'the first progress line')
    local pid = tonumber(slurp(dir .. '/pid'))
    assert.is_number(pid)
    os.execute('kill -INT ' .. pid)
    wait_for(function() return (slurp(dir .. '/status') or ''):match('%d') end, 'the exit status')
    local log = slurp(dir .. '/log')
    assert.are.equal(0, tonumber(slurp(dir .. '/status')), log)
    assert.is_truthy(log:find('stopped by SIGINT after step', 1, true), log)
    local c = ckpt.latest(dir .. '/run')
    assert.is_table(c, log)
    assert.is_true(ckpt.verify(c.path))
    local rows = read_jsonl(dir .. '/run/metrics.jsonl')
    assert.are.equal(c.step, rows[#rows].step)
    rm(dir)
  end)

  it('skips NaN steps without an update, counts them, stops after --max-bad-steps in a row', function()
    local a, b = tmpdir(), tmpdir()
    train.run(opts{ out = a, steps = 6, stop_at = 3 })
    local s = train.run(opts{ out = b, steps = 6, stop_at = 4, inject_nan = '4' })
    assert.are.equal(1, s.bad_steps)
    -- step 4 changed nothing: the weights after it are those after step 3
    assert.are.equal(slurp(a .. '/ckpt-3/model.safetensors'), slurp(b .. '/ckpt-4/model.safetensors'))
    local rows = read_jsonl(b .. '/metrics.jsonl')
    assert.is_true(rows[4].skipped)
    assert.is_nil(rows[4].loss)
    assert.are.equal('nan', rows[4].bad_loss:gsub('^%-', ''))
    assert.are.equal(1, rows[4].bad_steps)
    -- a run of them stops with a clear message
    local c = tmpdir()
    local ok, err = pcall(train.run, opts{ out = c, steps = 10, inject_nan = '2,3,5,6,7', max_bad_steps = 3 })
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find('3 steps in a row with a NaN/inf loss or gradient norm (steps 5-7, 5 in all)', 1, true), tostring(err))
    assert.is_truthy(tostring(err):find('--max-bad-steps 3', 1, true), tostring(err))
    -- and bin/train exits 1 with it
    local status, text = bin_train(('models/gpt2.lua %s --steps 5 --inject-nan 1,2 --max-bad-steps 2 --out %s'):format(small_flags, q(c)))
    assert.are.equal(1, status, text)
    assert.is_truthy(text:find('step 1: loss nan', 1, true) or text:find('step 1: loss -nan', 1, true), text)
    assert.is_truthy(text:find('2 steps in a row', 1, true), text)
    rm(a); rm(b); rm(c)
  end)

  it('accumulates 4 micro-batches to the gradient of one big batch (f64)', function()
    local a, b = tmpdir(), tmpdir()
    local base = { steps = 3, dtype = 'f64', eval_every = 0, save = true, warmup = 1,
                   model_config = { n_layer = 1, n_embd = 32, n_head = 2 } }
    local function with(t) local o = opts(base); for k, v in pairs(t) do o[k] = v end; return o end
    train.run(with{ out = a, batch_size = 8 })
    local s = train.run(with{ out = b, batch_size = 2, tokens_per_step = 8 * 16 })
    assert.are.equal(3, s.steps)
    local ra, rb = read_jsonl(a .. '/metrics.jsonl'), read_jsonl(b .. '/metrics.jsonl')
    for i = 1, 3 do
      assert.is_true(math.abs(ra[i].loss - rb[i].loss) < 1e-9, ('step %d: %.17g vs %.17g'):format(i, ra[i].loss, rb[i].loss))
      assert.is_true(math.abs(ra[i].grad_norm - rb[i].grad_norm) < 1e-9 * ra[i].grad_norm,
        ('step %d grad norm: %.17g vs %.17g'):format(i, ra[i].grad_norm, rb[i].grad_norm))
    end
    local ta, tb = S.load(a .. '/model.safetensors'), S.load(b .. '/model.safetensors')
    for name, t in pairs(ta) do
      local x, y = t:totable(), tb[name]:totable()
      local function walk(u, v)
        if type(u) == 'table' then for i = 1, #u do walk(u[i], v[i]) end
        else assert.is_true(math.abs(u - v) < 1e-6, ('%s: %.17g vs %.17g'):format(name, u, v)) end
      end
      walk(x, y)
    end
    local ok, err = pcall(train.run, with{ out = b, batch_size = 3, tokens_per_step = 100 })
    assert.is_false(ok)
    assert.is_truthy(tostring(err):find('not a multiple of the micro-batch', 1, true), tostring(err))
    rm(a); rm(b)
  end)
end)

describe('run configs', function()
  it('bin/train --config FILE takes --key value and --model.FIELD overrides', function()
    local dir = tmpdir()
    local status, text = bin_train(('--config configs/tiny.lua --steps 3 --seq-len 16 --batch-size 2 '
      .. '--model.n_layer 1 --model.n_embd 32 --model.n_head 2 --sample-tokens 0 --no-save --out %s'):format(q(dir)))
    assert.are.equal(0, status, text)
    local run = json.decode(slurp(dir .. '/run.json'))
    assert.are.equal(3, run.options.steps)
    assert.are.equal(100, run.options.save_every) -- from the config
    assert.are.equal('models/gpt2.lua', run.options.model)
    assert.are.equal(1, run.model_config.n_layer)
    assert.are.equal(32, run.model_config.n_embd)
    assert.are.equal(3, #read_jsonl(dir .. '/metrics.jsonl'))
    -- not a terminal: plain lines, no carriage returns
    assert.is_truthy(text:find('step 1/3 | loss', 1, true), text)
    assert.is_falsy(text:find('\r', 1, true))
    -- a bad key in the config or the flags is named
    status, text = bin_train('--config configs/tiny.lua --stepz 3')
    assert.are.equal(2, status, text)
    assert.is_truthy(text:find('unknown option --stepz', 1, true), text)
    rm(dir)
  end)

  it('--progress tty redraws one line in place', function()
    local dir = tmpdir()
    local status, text = bin_train(('models/gpt2.lua %s --steps 4 --progress tty --eval-every 0 --no-save --out %s'):format(small_flags, q(dir)))
    assert.are.equal(0, status, text)
    assert.is_truthy(text:find('\rstep 2/4 | loss', 1, true), text)
    assert.is_truthy(text:find('\27[K', 1, true), text)
    rm(dir)
  end)

  it('the presets load and pass the option checks', function()
    for _, f in ipairs({ 'tiny', 'gpt2-124m', 'llama-1b' }) do
      local M, o = train.resolve{ config = root .. '/configs/' .. f .. '.lua' }
      assert.is_table(M, f)
      assert.is_number(o.steps, f)
      if o.tokens_per_step > 0 then assert.are.equal(0, o.tokens_per_step % (o.batch_size * o.seq_len), f) end
    end
  end)
end)

describe('bin/plot', function()
  it('writes a PNG of loss and throughput from metrics.jsonl', function()
    local have = os.execute('command -v gnuplot > /dev/null 2>&1')
    assert.is_true(have == 0 or have == true, 'gnuplot is not installed: `make deps` installs gnuplot-nox')
    local dir = tmpdir()
    local rows = {}
    for s = 1, 20 do
      rows[#rows + 1] = ('{"step":%d,"loss":%g,"lr":0.001%s%s}'):format(s, 5 - s / 10,
        s % 5 == 0 and (',"val_loss":%g'):format(5.1 - s / 10) or '', s % 4 == 0 and ',"tokens_per_s":1000' or '')
    end
    rows[#rows + 1] = '{"step":21,"skipped":true,"bad_loss":"nan"}'
    spit(dir .. '/metrics.jsonl', table.concat(rows, '\n') .. '\n')
    local p = io.popen(('%s/bin/plot %s 2>&1; echo "__status=$?"'):format(q(root), q(dir)))
    local out = p:read('*a')
    p:close()
    assert.is_truthy(out:find('__status=0', 1, true), out)
    local png = slurp(dir .. '/metrics.png')
    assert.is_truthy(png and #png > 1000, out)
    assert.are.equal('\137PNG', png:sub(1, 4))
    -- a folder without metrics is a usage error
    p = io.popen(('%s/bin/plot %s 2>&1; echo "__status=$?"'):format(q(root), q(dir .. '/nope')))
    out = p:read('*a')
    p:close()
    assert.is_truthy(out:find('cannot read', 1, true) and out:find('__status=2', 1, true), out)
    rm(dir)
  end)
end)

-- (the corpus every run above trained on)
teardown(function() rm(corpus_dir) end)
