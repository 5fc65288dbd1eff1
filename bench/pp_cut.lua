-- bench/pp_cut.lua — the pipeline's cut of the blocks, old (pp.balanced:
-- the virtual stages balanced) against new (pp.default_cut: the ranks'
-- work balanced with several chunks a rank), in pp_order's simulation of
-- each schedule: F = B = W, a virtual stage's proportional to its blocks
-- plus the head's work on the last (pp.head_weight x the head's elements
-- over a block's parameters), exchanges free. No GPU: it prints the cuts
-- (bench/fsdp.lua --stages takes them), the ranks' work, the simulated
-- step in F units of a mean stage, the bubble, and the most activations
-- each rank holds at once, in blocks x micro-batches.
--
--   luajit bench/pp_cut.lua [--stages 4] [--microbatches 8] [--search]
--                           [--blocks 16 --hidden 2048 --kv 512 --mlp 5632 --vocab 128256]
--
-- The defaults are the 1.25B Llama of bench/fsdp.lua --model llama;
-- --search also simulates every cut of the two-chunk schedules (each
-- virtual stage a block, the head's alone allowed) and prints the fastest.
package.path = './lua/?.lua;./lua/?/init.lua;./?.lua;' .. package.path
local pp = require('moonshard').pp
local O = pp.order

local o = { stages = 4, microbatches = 8, blocks = 16, hidden = 2048, kv = 512, mlp = 5632, vocab = 128256 }
local search = false
local i = 1
while i <= #arg do
  local k = arg[i]:match('^%-%-(.+)$')
  if k == 'search' then search = true
  elseif k and o[k] and tonumber(arg[i + 1]) then o[k] = tonumber(arg[i + 1]); i = i + 1
  else error('usage: luajit bench/pp_cut.lua [--stages S] [--microbatches M] [--search] [--blocks L] [--hidden H] '
    .. '[--kv K] [--mlp I] [--vocab V]; got ' .. tostring(arg[i]), 0) end
  i = i + 1
end

local S, M, L, H = o.stages, o.microbatches, o.blocks, o.hidden
-- a Llama block: q and o H x H, k and v H x kv, the MLP's three H x mlp, two norms
local block = 2 * H * H + 2 * H * o.kv + 3 * H * o.mlp + 2 * H
local head = pp.head_weight * o.vocab * H / block
print(('%d blocks of %.1fM parameters, a head of %.1fM: %.2f blocks of work (pp.head_weight %.1f); %d stages, %d '
  .. 'micro-batches'):format(L, block / 1e6, o.vocab * H / 1e6, head, pp.head_weight, S, M))

local function rank_work(cut, layout)
  local w = {}
  for r = 1, S do w[r] = 0 end
  for k = 1, #cut do
    local r = O.rank_of(layout, S, k - 1) + 1
    w[r] = w[r] + cut[k] + (k == #cut and head or 0)
  end
  for r = 1, S do w[r] = ('%.2f'):format(w[r]) end
  return table.concat(w, ' ')
end

local function row(name, v, what, cut)
  local r = O.simulate(name, S, M, { chunks = v, cost = O.stage_costs(cut, S, head), act = cut })
  local peak = {}
  for s = 1, S do peak[s] = ('%d'):format(r.held[s]) end
  print(('| %s | %s | %s | %s | %.2f | %.3f | %s |'):format(name .. (v > 1 and not O.vshaped(name) and (', ' .. v .. ' chunks') or ''),
    what, table.concat(cut, ','), rank_work(cut, O.layout(name)), r.makespan, r.bubble, table.concat(peak, ' ')))
  return r.makespan
end

print('\n| schedule | cut | blocks a virtual stage | ranks\' work (blocks) | step (F units) | bubble | most '
  .. 'activations a rank holds (blocks x micro-batches) |')
print('| --- | --- | --- | --- | --- | --- | --- |')
for _, sc in ipairs({ { '1f1b', 1 }, { 'zbh1', 1 }, { 'zbv', 2 }, { 'dualpipev', 2 }, { 'interleaved', 2 } }) do
  local name, v = sc[1], sc[2]
  local lo, mult = O.microbatch_rule(name, S)
  if M >= lo and M % mult == 0 then
    local old, new = pp.balanced(L, S * v, head), pp.default_cut(L, S, v, name, M, head)
    row(name, v, 'old', old)
    if table.concat(old, ',') ~= table.concat(new, ',') then row(name, v, 'new', new) end
    if search and v > 1 then
      local best, best_t, c = nil, math.huge, {}
      local V = S * v
      local function walk(k, left)
        if k == V then
          c[V] = left
          local t = O.simulate(name, S, M, { chunks = v, cost = O.stage_costs(c, S, head) }).makespan
          if t < best_t then best, best_t = { unpack(c) }, t end
          return
        end
        for n = 1, left - (V - k - 1) - (head >= 1 and 0 or 1) do c[k] = n; walk(k + 1, left - n) end
      end
      walk(1, L)
      row(name, v, 'fastest', best)
    end
  else
    print(('| %s | %d micro-batches cannot run on %d stages |'):format(name, M, S))
  end
end
