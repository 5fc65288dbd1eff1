-- The fused kernels (kernels/norm.cu, adamw.cu, rope.cu) against their CPU
-- references on random data, ‖gpu − cpu‖ / ‖cpu‖ within the dtype bounds
-- (f32 ≤ 1e-5, bf16 ≤ 1e-2); determinism of the reductions; the autograd
-- nodes and the autocast region on the GPU. Run with `make test-gpu`.
local ms = require 'moonshard'
local T = require 'moonshard.tensor'
local F = ms.raw
local nnf = ms.nn.functional

local function relerr(got, want)
  local g, w = got:to('cpu'):to('f64'), want:to('cpu'):to('f64')
  local d = F.sub(g, w)
  local num = F.sum(F.mul(d, d)):item()
  local den = F.sum(F.mul(w, w)):item()
  if den == 0 then return math.sqrt(num) end
  return math.sqrt(num / den)
end
local function same_bits(a, b)
  return table.concat(a:to('cpu'):to('f64'):view(-1):totable(), ',') ==
      table.concat(b:to('cpu'):to('f64'):view(-1):totable(), ',')
end

local bound = { f32 = 1e-5, bf16 = 1e-2, f16 = 2e-3, f64 = 1e-12 }
local seed = 3000
local function randn(shape, dtype)
  seed = seed + 1
  return ms.randn(shape, { seed = seed }):to(dtype or 'f32')
end
local function cu(t) return t and t:to('cuda') or nil end

describe('fused kernels #gpu', function()
  setup(function() assert.is_true(ms.cuda.is_available(), 'no CUDA device') end)

  describe('layer_norm and rms_norm', function()
    -- rows x C: GPT-2 width, an odd width (scalar path), Llama widths
    -- (block-wide backward), and one wider than the shared-memory partials;
    -- widths up to 1024 run the warp-per-row backward: more rows than the
    -- grid's warps (each warp's dw/db sums over several rows), 2, 4 and 8
    -- chunks a lane, a last chunk cut short (1000)
    local shapes = { { 64, 768 }, { 33, 37 }, { 16, 4096 }, { 9, 8192 }, { 3, 30000 }, { 4100, 256 },
      { 2500, 1000 }, { 700, 512 } }
    for _, dt in ipairs({ 'f32', 'bf16' }) do
      for _, sh in ipairs(shapes) do
        it(('layer_norm forward/backward %s (%d, %d)'):format(dt, sh[1], sh[2]), function()
          local x, g = randn(sh, dt), randn(sh, dt)
          local w, b = randn({ sh[2] }, dt), randn({ sh[2] }, dt)
          local y, mean, rstd = F.native_layer_norm(x, w, b, 1e-5)
          local yg, meang, rstdg = F.native_layer_norm(cu(x), cu(w), cu(b), 1e-5)
          assert.are.equal('cuda:0', yg.device)
          assert.is_true(relerr(yg, y) <= bound[dt], 'y ' .. relerr(yg, y))
          assert.is_true(relerr(meang, mean) <= 1e-5)
          assert.is_true(relerr(rstdg, rstd) <= 1e-5)
          local dx, dw, db = F.native_layer_norm_backward(g, x, mean, rstd, w)
          local dxg, dwg, dbg = F.native_layer_norm_backward(cu(g), cu(x), meang, rstdg, cu(w))
          assert.is_true(relerr(dxg, dx) <= bound[dt], 'dx ' .. relerr(dxg, dx))
          assert.is_true(relerr(dwg, dw) <= bound[dt], 'dw ' .. relerr(dwg, dw))
          assert.is_true(relerr(dbg, db) <= bound[dt], 'db ' .. relerr(dbg, db))
          -- deterministic: the same bits again
          local dx2, dw2, db2 = F.native_layer_norm_backward(cu(g), cu(x), meang, rstdg, cu(w))
          assert.is_true(same_bits(dxg, dx2) and same_bits(dwg, dw2) and same_bits(dbg, db2))
        end)
        it(('rms_norm forward/backward %s (%d, %d)'):format(dt, sh[1], sh[2]), function()
          local x, g, w = randn(sh, dt), randn(sh, dt), randn({ sh[2] }, dt)
          local y, rstd = F.native_rms_norm(x, w, 1e-6)
          local yg, rstdg = F.native_rms_norm(cu(x), cu(w), 1e-6)
          assert.is_true(relerr(yg, y) <= bound[dt], 'y ' .. relerr(yg, y))
          assert.is_true(relerr(rstdg, rstd) <= 1e-5)
          local dx, dw = F.native_rms_norm_backward(g, x, rstd, w)
          local dxg, dwg = F.native_rms_norm_backward(cu(g), cu(x), rstdg, cu(w))
          assert.is_true(relerr(dxg, dx) <= bound[dt], 'dx ' .. relerr(dxg, dx))
          assert.is_true(relerr(dwg, dw) <= bound[dt], 'dw ' .. relerr(dwg, dw))
          local _, dw2 = F.native_rms_norm_backward(cu(g), cu(x), rstdg, cu(w))
          assert.is_true(same_bits(dwg, dw2))
        end)
      end
    end

    it('mixed dtypes: f32 residual in, bf16 out (autocast), bf16 gradient in', function()
      local x, w, b = randn({ 40, 768 }), randn({ 768 }), randn({ 768 })
      local y = F.native_layer_norm(x, w, b, 1e-5, 'bf16')
      local yg, meang, rstdg = F.native_layer_norm(cu(x), cu(w), cu(b), 1e-5, 'bf16')
      assert.are.equal('bf16', yg.dtype)
      assert.is_true(relerr(yg, y) <= 1e-2)
      local g = randn({ 40, 768 }, 'bf16')
      local _, mean, rstd = F.native_layer_norm(x, w, b)
      local dx = F.native_layer_norm_backward(g, x, mean, rstd, w)
      local dxg = F.native_layer_norm_backward(cu(g), cu(x), meang, rstdg, cu(w))
      assert.are.equal('f32', dxg.dtype)
      assert.is_true(relerr(dxg, dx) <= 1e-5, 'dx ' .. relerr(dxg, dx))
      local yr = F.native_rms_norm(cu(x), cu(w):to('bf16'), 1e-6, 'bf16')
      assert.is_true(relerr(yr, F.native_rms_norm(x, w:to('bf16'), 1e-6, 'bf16')) <= 1e-2)
    end)

    it('f64 on the GPU, and no weight or bias', function()
      local x, g = randn({ 7, 50 }, 'f64'), randn({ 7, 50 }, 'f64')
      local y, mean, rstd = F.native_layer_norm(x)
      local yg, meang, rstdg = F.native_layer_norm(cu(x))
      assert.is_true(relerr(yg, y) <= 1e-12)
      local dx, dw, db = F.native_layer_norm_backward(g, x, mean, rstd)
      local dxg, dwg, dbg = F.native_layer_norm_backward(cu(g), cu(x), meang, rstdg)
      assert.is_true(relerr(dxg, dx) <= 1e-12 and relerr(dwg, dw) <= 1e-12 and relerr(dbg, db) <= 1e-12)
    end)

    it('nn.functional nodes and modules: forward and backward match the CPU', function()
      for _, dt in ipairs({ 'f32', 'bf16' }) do
        local x = randn({ 2, 9, 64 }, dt)
        local ln, rms = ms.nn.LayerNorm(64), ms.nn.RMSNorm(64)
        ms.no_grad(function()
          F.add_(ln.weight, randn({ 64 })); F.add_(ln.bias, randn({ 64 })); F.add_(rms.weight, randn({ 64 }))
        end)
        ln:to(dt); rms:to(dt)
        local xc = x:requires_grad_()
        local yc = rms(ln(xc))
        yc:to('f32'):sum():backward()
        local ln2, rms2 = ms.nn.LayerNorm(64), ms.nn.RMSNorm(64)
        ln2:load_state_dict(ln:state_dict()); rms2:load_state_dict(rms:state_dict())
        ln2:to(dt):to('cuda'); rms2:to(dt):to('cuda')
        local xg = x:detach():to('cuda'):requires_grad_()
        local yg = rms2(ln2(xg))
        yg:to('f32'):sum():backward()
        assert.is_true(relerr(yg, yc) <= bound[dt])
        assert.is_true(relerr(xg.grad, xc.grad) <= bound[dt])
        assert.is_true(relerr(ln2.weight.grad, ln.weight.grad) <= bound[dt])
        assert.is_true(relerr(ln2.bias.grad, ln.bias.grad) <= bound[dt])
        assert.is_true(relerr(rms2.weight.grad, rms.weight.grad) <= bound[dt])
      end
    end)

    it('a CPU weight with a GPU input is a Lua error naming both devices', function()
      local ok, err = pcall(F.native_layer_norm, cu(randn({ 4, 8 })), randn({ 8 }))
      assert.is_false(ok)
      assert.matches('cpu', err)
      assert.matches('cuda:0', err)
    end)
  end)

  describe('adamw_ and sum_squares', function()
    for _, c in ipairs({ { 'f32', 'f32' }, { 'f32', 'bf16' }, { 'bf16', 'bf16' }, { 'f64', 'f64' } }) do
      it(('adamw_ %s parameters, %s gradients: 3 steps equal the CPU reference'):format(c[1], c[2]), function()
        local n = { 1000, 77, 65536 + 5, 3 }
        local ps, gs, ms_, vs = {}, {}, {}, {}
        local sdt = c[1] == 'f64' and 'f64' or 'f32'
        for i, k in ipairs(n) do
          ps[i] = randn({ k }, c[1])
          ms_[i], vs[i] = ms.zeros({ k }, { dtype = sdt }), ms.zeros({ k }, { dtype = sdt })
        end
        local gp, gm, gv = {}, {}, {}
        for i = 1, #n do gp[i], gm[i], gv[i] = cu(ps[i]), cu(ms_[i]), cu(vs[i]) end
        for step = 1, 3 do
          for i, k in ipairs(n) do gs[i] = randn({ k }, c[2]) end
          local gg = {}
          for i = 1, #n do gg[i] = cu(gs[i]) end
          F.adamw_(ps, gs, ms_, vs, 1e-2, 0.9, 0.95, 1e-8, 0.1, step)
          F.adamw_(gp, gg, gm, gv, 1e-2, 0.9, 0.95, 1e-8, 0.1, step)
        end
        local b = c[1] == 'bf16' and 1e-2 or (c[1] == 'f64' and 1e-12 or 1e-5)
        for i = 1, #n do
          assert.is_true(relerr(gp[i], ps[i]) <= b, 'p ' .. i .. ' ' .. relerr(gp[i], ps[i]))
          assert.is_true(relerr(gm[i], ms_[i]) <= math.max(b, 1e-6), 'm ' .. i)
          assert.is_true(relerr(gv[i], vs[i]) <= math.max(b, 1e-6), 'v ' .. i)
        end
      end)
    end

    it('adamw_ with a grad_scale (clip_grad_norm defer): the same bits as scaling first, and the CPU reference', function()
      for _, gd in ipairs({ 'f32', 'bf16' }) do
        local n = { 1000, 65536 + 5 }
        local p1, p2, pc, m1, m2, mc, v1, v2, vc = {}, {}, {}, {}, {}, {}, {}, {}, {}
        for i, k in ipairs(n) do
          pc[i] = randn({ k }, 'f32'); p1[i] = cu(pc[i]); p2[i] = cu(pc[i])
          mc[i], vc[i] = ms.zeros({ k }), ms.zeros({ k })
          m1[i], m2[i], v1[i], v2[i] = cu(mc[i]), cu(mc[i]), cu(vc[i]), cu(vc[i])
        end
        for step = 1, 3 do
          local sc = ms.tensor({ 0.25 + 0.2 * step }, { dtype = 'f64' })
          local g1, g2, gc = {}, {}, {}
          for i, k in ipairs(n) do
            gc[i] = randn({ k }, gd); g1[i] = cu(gc[i]); g2[i] = cu(gc[i])
            F.mul_(g2[i], cu(sc):to(gd))
          end
          F.adamw_(p1, g1, m1, v1, 1e-2, 0.9, 0.95, 1e-8, 0.1, step, nil, cu(sc))
          F.adamw_(p2, g2, m2, v2, 1e-2, 0.9, 0.95, 1e-8, 0.1, step)
          F.adamw_(pc, gc, mc, vc, 1e-2, 0.9, 0.95, 1e-8, 0.1, step, nil, sc)
        end
        for i = 1, #n do
          assert.are.equal(0, relerr(p1[i], p2[i]:cpu()), gd .. ' p ' .. i .. ': scaling first gives other bits')
          assert.is_true(relerr(p1[i], pc[i]) <= 1e-5, gd .. ' p ' .. i .. ' ' .. relerr(p1[i], pc[i]))
          assert.is_true(relerr(m1[i], mc[i]) <= 1e-5, gd .. ' m ' .. i)
        end
      end
    end)

    it('adamw_ with f32 masters of bf16 parameters (some without): 3 steps equal the CPU reference', function()
      local n = { 1000, 77, 65536 + 5, 3 }
      local ps, ws, ms_, vs, gp, gw, gm, gv = {}, {}, {}, {}, {}, {}, {}, {}
      for i, k in ipairs(n) do
        local f = randn({ k })
        ps[i] = f:to('bf16')
        ws[i] = i ~= 2 and f or false            -- parameter 2 runs without a master
        ms_[i], vs[i] = ms.zeros({ k }), ms.zeros({ k })
        gp[i], gw[i], gm[i], gv[i] = cu(ps[i]), ws[i] and cu(ws[i]) or false, cu(ms_[i]), cu(vs[i])
      end
      for step = 1, 3 do
        local gs, gg = {}, {}
        for i, k in ipairs(n) do gs[i] = randn({ k }, 'bf16'); gg[i] = cu(gs[i]) end
        F.adamw_(ps, gs, ms_, vs, 1e-2, 0.9, 0.95, 1e-8, 0.1, step, ws)
        F.adamw_(gp, gg, gm, gv, 1e-2, 0.9, 0.95, 1e-8, 0.1, step, gw)
      end
      for i = 1, #n do
        if ws[i] then
          assert.is_true(relerr(gw[i], ws[i]) <= 1e-5, 'master ' .. i .. ' ' .. relerr(gw[i], ws[i]))
          assert.are.equal(0, relerr(gp[i], gw[i]:to('bf16')), 'p is the rounded master ' .. i)
        end
        assert.is_true(relerr(gp[i], ps[i]) <= 1e-2, 'p ' .. i)
      end
    end)

    it('adamw_ in pairs of elements (aligned) and one at a time (misaligned views): the same bits', function()
      -- the same values through views at element 0 (every array aligned:
      -- the paired form) and at element 1 (f32 arrays 4 bytes off: one at
      -- a time); odd lengths across chunks, with and without f32 masters
      local cases = { { 'bf16', 'f32', true }, { 'f32', 'f32', false }, { 'f32', 'bf16', false },
        { 'bf16', 'bf16', false }, { 'bf16', 'bf16', true } }
      for _, c in ipairs(cases) do
        local pd, gd, master = c[1], c[2], c[3]
        local n = { 65536 * 2 + 5, 77, 4 }
        local function views(off)
          local out = { p = {}, g = {}, m = {}, v = {}, w = {} }
          for i, k in ipairs(n) do
            local f = randn({ k + 1 }):cuda()
            out.w[i] = master and f:narrow(1, 1 + off, k) or false
            out.p[i] = f:to(pd):narrow(1, 1 + off, k)
            out.m[i] = ms.zeros({ k + 1 }, { device = 'cuda' }):narrow(1, 1 + off, k)
            out.v[i] = ms.zeros({ k + 1 }, { device = 'cuda' }):narrow(1, 1 + off, k)
          end
          return out
        end
        local a, b = views(0), views(1)
        for i = 1, #n do   -- b holds a's values
          b.p[i]:copy_(a.p[i])
          if master then b.w[i]:copy_(a.w[i]) end
        end
        for step = 1, 3 do
          for i, k in ipairs(n) do
            local gg = randn({ k + 1 }, gd):cuda()
            a.g[i], b.g[i] = gg:narrow(1, 1, k), gg:clone():narrow(1, 2, k)
            b.g[i]:copy_(a.g[i])
          end
          local sc = cu(ms.tensor({ 0.7 }, { dtype = 'f64' }))
          F.adamw_(a.p, a.g, a.m, a.v, 1e-2, 0.9, 0.95, 1e-8, 0.1, step, master and a.w or nil, sc)
          F.adamw_(b.p, b.g, b.m, b.v, 1e-2, 0.9, 0.95, 1e-8, 0.1, step, master and b.w or nil, sc)
        end
        for i = 1, #n do
          local what = ('%s p, %s g%s, tensor %d'):format(pd, gd, master and ', master' or '', i)
          assert.are.equal(0, (a.p[i]:float() - b.p[i]:float()):abs():max():item(), what .. ': p')
          assert.are.equal(0, (a.m[i] - b.m[i]):abs():max():item(), what .. ': m')
          assert.are.equal(0, (a.v[i] - b.v[i]):abs():max():item(), what .. ': v')
          if master then assert.are.equal(0, (a.w[i] - b.w[i]):abs():max():item(), what .. ': master') end
          assert.is_true(a.m[i]:abs():max():item() > 0, what .. ': nothing stepped')
        end
      end
    end)

    it('adamw_ over 130 tensors of mixed dtypes (several launches)', function()
      local ps, gs, ms_, vs, gp, gg, gm, gv = {}, {}, {}, {}, {}, {}, {}, {}
      for i = 1, 130 do
        local k = 10 + (i * 37) % 300
        ps[i] = randn({ k }, i % 3 == 0 and 'bf16' or 'f32')
        gs[i] = randn({ k }, i % 2 == 0 and 'bf16' or 'f32')
        ms_[i], vs[i] = ms.zeros({ k }), ms.zeros({ k })
        gp[i], gg[i], gm[i], gv[i] = cu(ps[i]), cu(gs[i]), cu(ms_[i]), cu(vs[i])
      end
      F.adamw_(ps, gs, ms_, vs, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1)
      F.adamw_(gp, gg, gm, gv, 1e-3, 0.9, 0.999, 1e-8, 0.01, 1)
      for i = 1, 130 do
        assert.is_true(relerr(gp[i], ps[i]) <= (ps[i].dtype == 'bf16' and 1e-2 or 1e-5), 'tensor ' .. i)
      end
    end)

    it('sum_squares over many tensors of mixed dtypes, deterministic', function()
      local ts, tg = {}, {}
      for i = 1, 100 do
        ts[i] = randn({ 1 + (i * 911) % 40000 }, ({ 'f32', 'bf16', 'f64' })[i % 3 + 1])
        tg[i] = cu(ts[i])
      end
      local want = F.sum_squares(ts)
      local got = F.sum_squares(tg)
      assert.are.equal('cuda:0', got.device)
      assert.are.equal('f64', got.dtype)
      assert.is_true(relerr(got, want) <= 1e-12, relerr(got, want))
      assert.are.equal(got:item(), F.sum_squares(tg):item())
    end)

    it('the optimizer steps GPU parameters like CPU ones', function()
      local function model()
        ms.manual_seed(5)
        return ms.nn.Sequential(ms.nn.Linear(16, 32), ms.nn.GELU(), ms.nn.LayerNorm(32), ms.nn.Linear(32, 4))
      end
      local mc, mg = model(), model():to('cuda')
      local oc = ms.optim.AdamW(mc, { lr = 1e-2, weight_decay = 0.1 })
      local og = ms.optim.AdamW(mg, { lr = 1e-2, weight_decay = 0.1 })
      local x, y = randn({ 8, 16 }), randn({ 8, 4 })
      for _ = 1, 5 do
        for _, pair in ipairs({ { mc, oc, x, y }, { mg, og, cu(x), cu(y) } }) do
          local m, o = pair[1], pair[2]
          o:zero_grad()
          local d = m(pair[3]) - pair[4]
          ;(d * d):mean():backward()
          o:step()
        end
      end
      local pc, pg = mc:parameters(), mg:parameters()
      for i = 1, #pc do assert.is_true(relerr(pg[i], pc[i]) <= 1e-4, 'param ' .. i .. ' ' .. relerr(pg[i], pc[i])) end
    end)
  end)

  describe('rope', function()
    for _, dt in ipairs({ 'f32', 'bf16' }) do
      it('forward and backward on a transposed (B, H, T, D) view ' .. dt, function()
        local q = randn({ 2, 33, 4, 64 }, dt)               -- (B, T, H, D)
        local g = randn({ 2, 4, 33, 64 }, dt)
        local cos, sin = nnf.rope_cache(33, 64, 10000, 'f32')
        local want = F.rope(q:transpose(2, 3), cos, sin)
        local got = F.rope(cu(q):transpose(2, 3), cu(cos), cu(sin))
        assert.are.same({ 2, 4, 33, 64 }, got.shape)
        assert.is_true(relerr(got, want) <= bound[dt], relerr(got, want))
        local gb = F.rope_backward(cu(g), cu(cos), cu(sin))
        assert.is_true(relerr(gb, F.rope_backward(g, cos, sin)) <= bound[dt])
        -- bf16 cos/sin are read as f32
        local got2 = F.rope(cu(q):transpose(2, 3), cu(cos):to(dt), cu(sin):to(dt))
        assert.is_true(relerr(got2, F.rope(q:transpose(2, 3), cos:to(dt), sin:to(dt))) <= bound[dt])
      end)
    end
    it('apply_rotary backward on the GPU equals the CPU', function()
      local x = randn({ 1, 2, 17, 32 }):requires_grad_()
      local xg = cu(x:detach()):requires_grad_()
      local cos, sin = nnf.rope_cache(17, 32, 10000, 'f32')
      local w = randn({ 1, 2, 17, 32 })
      ;(nnf.apply_rotary(x, cos, sin) * w):sum():backward()
      ;(nnf.apply_rotary(xg, cu(cos), cu(sin)) * cu(w)):sum():backward()
      assert.is_true(relerr(xg.grad, x.grad) <= 1e-5)
    end)
  end)

  describe('autocast on the GPU', function()
    local fixtures = T.root .. '/../shared/fixtures'
    for _, name in ipairs({ 'gpt2-tiny', 'llama-tiny' }) do
      it(name .. ': f32 master weights, bf16 compute: loss within 1e-2, f32 grads within 3e-2', function()
        local M = require(name:match('^gpt2') and 'models.gpt2' or 'models.llama')
        local dir = fixtures .. '/' .. name
        local model = nnf.set_precision(M.from_pretrained(dir):to('cuda'), { compute = 'bf16' })
        model:eval()
        local exp = ms.load_safetensors(dir .. '/expected.safetensors')
        local loss = model(cu(exp.input_ids), cu(exp.targets))
        local el = math.abs(loss:item() - exp.loss:item()) / exp.loss:item()
        assert.is_true(el <= 1e-2, 'loss ' .. el)
        loss:backward()
        for pname, p in model:named_parameters() do
          assert.are.equal('f32', p.grad.dtype, pname)
          local e = relerr(p.grad, exp['grad.' .. pname])
          assert.is_true(e <= 3e-2, pname .. ' ' .. e)
        end
      end)
    end
  end)
end)

describe('the residual add fused into LayerNorm on cuda #gpu', function()
  -- (f32 residual, bf16 branch and output: GPT-2 under autocast; all f32)
  for _, c in ipairs({ { 'f32', 'bf16', 'bf16' }, { 'f32', 'f32', 'f32' }, { 'bf16', 'bf16', 'bf16' } }) do
    it(('x %s + h %s -> y %s, forward and backward with the residual gradient'):format(c[1], c[2], c[3]), function()
      local x, h = randn({ 37, 768 }, c[1]), randn({ 37, 768 }, c[2])
      local w, b = randn({ 768 }), randn({ 768 })
      local r1, y1, m1, s1 = F.native_add_layer_norm(x, h, w, b, 1e-5, c[3])
      local r2, y2, m2, s2 = F.native_add_layer_norm(cu(x), cu(h), cu(w), cu(b), 1e-5, c[3])
      assert.are.equal(r1.dtype, r2.dtype)
      assert.is_true(relerr(r2, r1) <= bound[c[1]], 'res ' .. relerr(r2, r1))
      assert.is_true(relerr(y2, y1) <= bound[c[3]], 'y ' .. relerr(y2, y1))
      assert.is_true(relerr(s2, s1) <= 1e-5, 'rstd ' .. relerr(s2, s1))
      local g, gres = randn({ 37, 768 }, c[3]), randn({ 37, 768 }, r1.dtype)
      local dx1, dw1, db1 = F.native_layer_norm_backward_add(g, r1, m1, s1, w, gres)
      local dx2, dw2, db2 = F.native_layer_norm_backward_add(cu(g), r2, m2, s2, cu(w), cu(gres))
      local bd = bound[r1.dtype] * (r1.dtype == 'f32' and 10 or 1)
      assert.is_true(relerr(dx2, dx1) <= bd, 'dx ' .. relerr(dx2, dx1))
      assert.is_true(relerr(dw2, dw1) <= 1e-4, 'dw ' .. relerr(dw2, dw1))
      assert.is_true(relerr(db2, db1) <= 1e-4, 'db ' .. relerr(db2, db1))
      -- dx a second time in g's dtype from the same pass: exactly dx rounded
      local dx3, _, _, dxl = F.native_layer_norm_backward_add(cu(g), r2, m2, s2, cu(w), cu(gres), { dxl = true })
      assert.are.equal(c[3], dxl.dtype)
      assert.are.equal(0, relerr(dxl, dx3:to(c[3])))
      assert.is_true(relerr(dxl:to('cpu'), dx1:to(c[3])) <= bound[c[3]] * 10, 'dxl ' .. relerr(dxl:to('cpu'), dx1:to(c[3])))
    end)
  end
end)

describe('the residual add fused into RMSNorm on cuda #gpu', function()
  for _, c in ipairs({ { 'f32', 'bf16', 'bf16' }, { 'f32', 'f32', 'f32' } }) do
    it(('x %s + h %s -> y %s, forward and backward with the residual gradient'):format(c[1], c[2], c[3]), function()
      local x, h, w = randn({ 29, 2048 }, c[1]), randn({ 29, 2048 }, c[2]), randn({ 2048 })
      local r1, y1, s1 = F.native_add_rms_norm(x, h, w, 1e-6, c[3])
      local r2, y2, s2 = F.native_add_rms_norm(cu(x), cu(h), cu(w), 1e-6, c[3])
      assert.is_true(relerr(r2, r1) <= bound[c[1]], 'res ' .. relerr(r2, r1))
      assert.is_true(relerr(y2, y1) <= bound[c[3]], 'y ' .. relerr(y2, y1))
      assert.is_true(relerr(s2, s1) <= 1e-5, 'rstd ' .. relerr(s2, s1))
      local g, gres = randn({ 29, 2048 }, c[3]), randn({ 29, 2048 }, r1.dtype)
      local dx1, dw1 = F.native_rms_norm_backward_add(g, r1, s1, w, gres)
      local dx2, dw2 = F.native_rms_norm_backward_add(cu(g), r2, s2, cu(w), cu(gres))
      assert.is_true(relerr(dx2, dx1) <= bound[r1.dtype] * 10, 'dx ' .. relerr(dx2, dx1))
      assert.is_true(relerr(dw2, dw1) <= 1e-4, 'dw ' .. relerr(dw2, dw1))
      local dx3, _, dxl = F.native_rms_norm_backward_add(cu(g), r2, s2, cu(w), cu(gres), { dxl = true })
      assert.are.equal(c[3], dxl.dtype)
      assert.are.equal(0, relerr(dxl, dx3:to(c[3])))
    end)
  end
end)

describe('the column sums of dxl (a bias gradient) from the norm backward on cuda #gpu', function()
  -- rows x C, x's and g's dtypes: 768 and 256 wide run the warp-per-row
  -- kernel (the sums fused into its pass; more rows than the grid's warps),
  -- 2048 the block kernel and 37 the scalar one (a separate reduction of dxl)
  local cases = { { 4096, 768, 'f32', 'bf16' }, { 4096, 768, 'f32', 'f32' }, { 4100, 256, 'bf16', 'bf16' },
    { 512, 2048, 'f32', 'f32' }, { 512, 2048, 'f32', 'bf16' }, { 33, 37, 'f32', 'bf16' } }
  -- got (C) against the f64 column sums of d (N, C): rel·|sum| plus a floor
  -- of 1e-5 of the column's absolute sum, column by column
  local function near_sums(got, d, rel)
    local d64 = d:to('cpu'):to('f64')
    local want = F.sum(d64, 1):totable()
    local mag = F.sum(F.abs(d64), 1):totable()
    local g = got:to('cpu'):to('f64'):totable()
    assert.are.equal(#want, #g)
    for c = 1, #want do
      local tol = rel * math.abs(want[c]) + 1e-5 * mag[c]
      if math.abs(g[c] - want[c]) > tol then
        return false, ('column %d: %.9g vs %.9g (tolerance %.3g)'):format(c, g[c], want[c], tol)
      end
    end
    return true
  end
  for _, c in ipairs(cases) do
    local N, Cw, xdt, gdt = c[1], c[2], c[3], c[4]
    it(('%dx%d, x %s, g %s: the sums of dxl as stored, deterministic, as the CPU reference'):format(N, Cw, xdt, gdt),
      function()
        local x, h = randn({ N, Cw }, xdt), randn({ N, Cw }, xdt)
        local w, b = randn({ Cw }), randn({ Cw })
        local res, _, m, s = F.native_add_layer_norm(cu(x), cu(h), cu(w), cu(b), 1e-5)
        local g, gres = randn({ N, Cw }, gdt), randn({ N, Cw }, res.dtype)
        local dx, dw, db, dxl, dls = F.native_layer_norm_backward_add(cu(g), res, m, s, cu(w), cu(gres),
          { dxl = true, dxl_sum = true })
        assert.are.equal(gdt, dls.dtype)
        assert.are.same({ Cw }, dls.shape)
        local ok, msg = near_sums(dls, dxl, gdt == 'f32' and 1e-5 or 1e-2)
        assert.is_true(ok, msg)
        -- the other outputs as without the sums, and the same bits again
        local dx2, dw2, db2, dxl2 = F.native_layer_norm_backward_add(cu(g), res, m, s, cu(w), cu(gres), { dxl = true })
        assert.is_true(same_bits(dx, dx2) and same_bits(dxl, dxl2), 'dx, dxl')
        assert.is_true(same_bits(dw, dw2) and same_bits(db, db2), 'dw, db')
        local _, _, _, _, dls2 = F.native_layer_norm_backward_add(cu(g), res, m, s, cu(w), cu(gres),
          { dxl = true, dxl_sum = true })
        assert.is_true(same_bits(dls, dls2), 'not deterministic')
        -- the CPU reference from the same inputs (its dxl rounds alike up
        -- to the last bit of a few elements)
        local cr, cm, cs = res:to('cpu'), m:to('cpu'), s:to('cpu')
        local _, _, _, _, cdls = F.native_layer_norm_backward_add(g, cr, cm, cs, w, gres, { dxl = true, dxl_sum = true })
        local e = relerr(dls, cdls)
        assert.is_true(e <= (gdt == 'f32' and 1e-4 or 1e-2), 'vs cpu ' .. e)
        -- without a residual gradient: the plain backward, then the sums
        -- by the generic reduction of dxl
        local _, _, _, ndxl, ndls = F.native_layer_norm_backward_add(cu(g), res, m, s, cu(w), nil,
          { dxl = true, dxl_sum = true })
        ok, msg = near_sums(ndls, ndxl, gdt == 'f32' and 1e-5 or 1e-2)
        assert.is_true(ok, 'without gres ' .. tostring(msg))
        -- RMSNorm: the same sums
        local rr, _, rs = F.native_add_rms_norm(cu(x), cu(h), cu(w), 1e-6)
        local _, _, rdxl, rdls = F.native_rms_norm_backward_add(cu(g), rr, rs, cu(w), cu(gres),
          { dxl = true, dxl_sum = true })
        ok, msg = near_sums(rdls, rdxl, gdt == 'f32' and 1e-5 or 1e-2)
        assert.is_true(ok, 'rms ' .. tostring(msg))
      end)
  end
end)
