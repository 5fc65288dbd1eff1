-- tools/nccl_smoke.lua — the smallest NCCL life cycle, step by step on
-- stderr, to find where a rank dies (run each rank by hand, rank 0 under a
-- debugger):
--   MASTER_ADDR=127.0.0.1 MASTER_PORT=29533 WORLD_SIZE=2 LOCAL_WORLD_SIZE=2 \
--   MS_DIST_TOKEN=t RANK=r LOCAL_RANK=r luajit tools/nccl_smoke.lua [no-destroy] [no-group]
package.path = './lua/?.lua;./lua/?/init.lua;./?.lua;' .. package.path
local ms = require 'moonshard'
local dist = ms.dist
local flags = {}
for _, a in ipairs(arg) do flags[a] = true end
local function say(s) io.stderr:write(('[rank %s] %s\n'):format(os.getenv('RANK') or '?', s)); io.stderr:flush() end
say('init')
dist.init { backend = 'nccl' }
local t = ms.ones({ 1000 }, { device = 'cuda' })
dist.all_reduce(t, 'sum')
say('all_reduce ' .. t:sum():item())
if not flags['no-group'] then
  local g = dist.new_group({ 0, 1 })
  say('new_group')
  dist.all_reduce(t, 'sum', { group = g })
  say('group all_reduce ' .. t:sum():item())
  g:free()
  say('group freed')
end
dist.barrier()
say('barrier')
if not flags['no-destroy'] then
  dist.destroy()
  say('destroyed')
end
say('exit')
