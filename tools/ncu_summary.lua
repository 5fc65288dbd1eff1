-- tools/ncu_summary.lua — GPU time per kernel from an Nsight Compute CSV, the
-- biggest first, so a training step's profile reads as a table:
--
--   ncu --csv --metrics gpu__time_duration.sum luajit bench/profile_step.lua \
--       --batch 8 --steps 1 --hooks 0 --layers 2 > ncu.csv
--   luajit tools/ncu_summary.lua ncu.csv [steps=3] [rows=40]
--
-- `steps` divides the totals (profile_step runs 2 warm-up steps before the
-- measured ones: --steps 1 gives 3 steps in the file). ncu serialises the
-- kernels, locks the clocks and flushes the caches between them, so small
-- memory-bound kernels look slower than in a real step: read the table for
-- proportions and counts, and bench/profile_step.lua for wall time.
local path, steps, nrows = arg[1], tonumber(arg[2]) or 3, tonumber(arg[3]) or 40
if not path then
  io.stderr:write('usage: luajit tools/ncu_summary.lua ncu.csv [steps] [rows]\n')
  os.exit(2)
end

-- one CSV line of quoted fields ("a","b,c","d") -> list
local function fields(line)
  local out, i, n = {}, 1, #line
  while i <= n do
    if line:sub(i, i) == '"' then
      local j, buf = i + 1, {}
      while j <= n do
        local c = line:sub(j, j)
        if c == '"' then
          if line:sub(j + 1, j + 1) == '"' then buf[#buf + 1] = '"'; j = j + 2
          else break end
        else buf[#buf + 1] = c; j = j + 1 end
      end
      out[#out + 1] = table.concat(buf)
      i = j + 2   -- past the quote and the comma
    else
      local j = line:find(',', i, true) or n + 1
      out[#out + 1] = line:sub(i, j - 1)
      i = j + 1
    end
  end
  return out
end

local f = assert(io.open(path, 'r'))
local header, col = nil, {}
local total, by, count = 0, {}, {}
local scale = { ns = 1e-3, nsecond = 1e-3, us = 1, usecond = 1, ms = 1e3, msecond = 1e3 }
for line in f:lines() do
  if line:sub(1, 1) == '"' then
    local r = fields(line)
    if not header then
      header = r
      for k, name in ipairs(r) do col[name] = k end
      assert(col['Kernel Name'] and col['Metric Value'] and col['Metric Unit'],
        path .. ': no Kernel Name / Metric Value / Metric Unit columns (ncu --csv --metrics gpu__time_duration.sum)')
    else
      local us = tonumber((r[col['Metric Value']]:gsub(',', ''))) * (scale[r[col['Metric Unit']]] or 1)
      local name = r[col['Kernel Name']]:sub(1, 90)
      by[name] = (by[name] or 0) + us
      count[name] = (count[name] or 0) + 1
      total = total + us
    end
  end
end
f:close()
assert(header, path .. ': no CSV rows (did ncu run?)')
local names = {}
for k in pairs(by) do names[#names + 1] = k end
table.sort(names, function(a, b) return by[a] > by[b] end)
print(('total %.1f us per step over %d steps'):format(total / steps, steps))
print('| us/step | % | calls/step | kernel |')
print('|---|---|---|---|')
for i = 1, math.min(nrows, #names) do
  local k = names[i]
  print(('| %.1f | %.1f | %.1f | %s |'):format(by[k] / steps, 100 * by[k] / total, count[k] / steps, k))
end
