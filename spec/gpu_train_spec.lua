-- bin/train on a GPU: the run folder keeps the GEMM tuning file, and a
-- resumed run takes its choices from it (nothing appended: no plan timed
-- again) and goes on. Run on a GPU host: `make test-gpu`.
local ms = require 'moonshard'
local T = require 'moonshard.tensor'

local root = T.root
local S_ = require 'spec.support'
local q, tmpdir = S_.shell_quote, S_.tmpdir
local function bin_train(args, env)
  local p = io.popen(('cd %s && %s bin/train %s 2>&1; echo "__status=$?"'):format(q(root), env or '', args))
  local out = p:read('*a')
  p:close()
  return tonumber(out:match('__status=(%d+)%s*$')), out
end
local function lines(path)
  local f = io.open(path)
  if not f then return nil end
  local n = 0
  for l in f:lines() do
    assert(l:match('^ms%-gemm%-tune 1 %d+ %S+'), path .. ': ' .. l)
    n = n + 1
  end
  f:close()
  return n
end

local small = '--preset tiny --model.n_layer 2 --model.n_embd 128 --model.n_head 4 --seq-len 64 --batch-size 8'

describe('bin/train on cuda #gpu', function()
  setup(function() assert.is_true(ms.cuda.is_available(), 'no CUDA device') end)

  it('keeps gemm_tune.txt in the run folder and takes the choices from it on resume', function()
    local out = tmpdir()
    local st, text = bin_train(('models/gpt2.lua %s --device cuda --steps 4 --save-every 4 --log-every 2 '
      .. '--sample-tokens 0 --out %s'):format(small, q(out)), 'MS_GEMM_TUNE_FILE= MS_GEMM_TUNE=1')
    assert.are.equal(0, st, text)
    local n = lines(out .. '/gemm_tune.txt')
    assert.is_truthy(n, 'no gemm_tune.txt in ' .. out)
    assert.is_true(n >= 1, 'no plan recorded')
    st, text = bin_train(('--resume %s --steps 6 --sample-tokens 0'):format(q(out)), 'MS_GEMM_TUNE_FILE= MS_GEMM_TUNE=1')
    assert.are.equal(0, st, text)
    assert.is_truthy(text:find('done:', 1, true), text)
    assert.are.equal(n, lines(out .. '/gemm_tune.txt'), 'plans timed again on resume')
    -- tuning off: no file
    local out2 = tmpdir()
    st, text = bin_train(('models/gpt2.lua %s --device cuda --steps 2 --sample-tokens 0 --out %s'):format(small, q(out2)),
      'MS_GEMM_TUNE=0')
    assert.are.equal(0, st, text)
    assert.is_nil(lines(out2 .. '/gemm_tune.txt'))
    os.execute('rm -rf ' .. q(out) .. ' ' .. q(out2))
  end)
end)
