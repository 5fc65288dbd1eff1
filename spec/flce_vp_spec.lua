-- The vocabulary-parallel fused linear cross-entropy on CPU ranks: runs
-- spec/flce_vp_ranks.lua under mpirun with 1, 2, 3 and 4 ranks (one busted
-- per rank, Open MPI settings of tools/mpi_env.sh) and passes when every
-- rank passed all of it. The ranks run in their own mpirun, not in
-- tools/run_mpi_specs.sh's shared one, because MPI starts once per process
-- and that file's own dist.init/destroy would collide with another file's.
-- Tagged noasan: mpirun and its daemons are not built for the preloaded ASan.
local T = require 'moonshard.tensor'

local function sh(cmd)
  local ok, how, code = os.execute(cmd)
  if type(ok) == 'number' then return ok == 0 end -- Lua 5.1 / LuaJIT without 5.2 compat
  return ok == true and how == 'exit' and code == 0
end

local have_mpirun = sh('command -v mpirun >/dev/null 2>&1')

local function slurp(path)
  local f = io.open(path, 'rb')
  if not f then return '(no log)' end
  local s = f:read('*a')
  f:close()
  return s
end

describe('vocabulary-parallel fused_linear_cross_entropy on CPU ranks (mpirun) #noasan', function()
  for np = 1, 4 do
    it(('matches the unsharded result on every one of %d rank%s'):format(np, np == 1 and '' or 's'), function()
      if not have_mpirun then
        pending('mpirun not found (apt-get install openmpi-bin)')
        return
      end
      local busted = os.getenv('BUSTED_LUA') or '/usr/bin/busted'
      local logdir = os.tmpname()
      os.remove(logdir)
      assert(sh(("mkdir -p '%s'"):format(logdir)))
      local cmd = ("cd '%s' && . tools/mpi_env.sh && timeout -k 5 %d mpirun -np %d $MS_MPIRUN_FLAGS "
        .. [[sh -c 'exec luajit "$0" --lpath="./lua/?.lua;./lua/?/init.lua;./?.lua" -o utfTerminal ]]
        .. [[--no-auto-insulate spec/flce_vp_ranks.lua >"%s/rank$OMPI_COMM_WORLD_RANK.log" 2>&1' '%s' ]]
        .. [[>"%s/mpirun.log" 2>&1]]):format(T.root, tonumber(os.getenv('MS_MPI_SPEC_TIMEOUT')) or 300, np,
          logdir, busted, logdir)
      local ran = sh(cmd)
      local report, all_ok = {}, ran
      for r = 0, np - 1 do
        local log = slurp(('%s/rank%d.log'):format(logdir, r))
        local plain = log:gsub('\27%[[%d;]*m', '')
        local ok, fail, err = plain:match('(%d+) successes? / (%d+) failures? / (%d+) errors?')
        if not ok or tonumber(ok) == 0 or tonumber(fail) > 0 or tonumber(err) > 0 then
          all_ok = false
          report[#report + 1] = ('----- rank %d of %d\n%s'):format(r, np, plain)
        end
      end
      if not all_ok then report[#report + 1] = '----- mpirun\n' .. slurp(logdir .. '/mpirun.log') end
      sh(("rm -rf '%s'"):format(logdir))
      assert(all_ok, table.concat(report, '\n'))
    end)
  end
end)
