-- moonshard.optim.sgd — SGD with momentum, as torch.optim.SGD:
--
--   d = g + weight_decay * p
--   buf = d (first step), else momentum * buf + (1 - dampening) * d
--   d = nesterov and d + momentum * buf or buf        (when momentum ~= 0)
--   p = p - lr * d
--
-- ms.optim.SGD(params, {lr =, momentum = 0, weight_decay = 0, dampening = 0,
-- nesterov = false}). This file returns a builder: require('moonshard.optim').SGD
-- is the class.
local F = require 'moonshard.ops'
local A = require 'moonshard.autograd'

local free = A.free

return function(optim)
  local SGD = setmetatable({}, { __index = optim.Optimizer })
  SGD.__index = SGD
  SGD.__tostring = optim.Optimizer.__tostring

  local defaults = { lr = 1e-3, momentum = 0, weight_decay = 0, dampening = 0, nesterov = false }

  local function new(params, opts)
    opts = opts or {}
    local d = {}
    for k, v in pairs(defaults) do d[k] = v end
    for k, v in pairs(opts) do d[k] = v end
    if type(d.lr) ~= 'number' or d.lr < 0 then error(('SGD: lr must be a number >= 0, got %s'):format(tostring(d.lr)), 2) end
    if d.nesterov and (d.momentum <= 0 or d.dampening ~= 0) then
      error('SGD: nesterov needs momentum > 0 and dampening = 0', 2)
    end
    return optim.new_optimizer(SGD, 'SGD', params, d, false)
  end
  setmetatable(SGD, { __index = optim.Optimizer, __call = function(_, ...) return new(...) end })

  function SGD:step()
    A.no_grad(function()
      for _, group in ipairs(self.param_groups) do
        local lr, mom, wd, damp = group.lr, group.momentum or 0, group.weight_decay or 0, group.dampening or 0
        for _, p in ipairs(group.params) do
          local g = p.grad
          if g ~= nil then
            local sdt = optim.state_dtype(p)
            local pw = p
            if p.dtype ~= sdt then pw = p:to(sdt) end
            local d = g:to(sdt, { copy = true })
            if wd ~= 0 then
              local t = F.mul(pw, wd)
              F.add_(d, t)
              free(t)
            end
            if mom ~= 0 then
              local st = self.state[tonumber(p.id)]
              if st == nil then
                optim.refuse_new_state('SGD', p)
                st = { momentum_buffer = d:clone() }
                self.state[tonumber(p.id)] = st
              else
                local buf = st.momentum_buffer
                F.mul_(buf, mom)
                local t = F.mul(d, 1 - damp)
                F.add_(buf, t)
                free(t)
              end
              local buf = st.momentum_buffer
              if group.nesterov then
                local t = F.mul(buf, mom)
                F.add_(d, t)
                free(t)
              else
                d:copy_(buf)
              end
            end
            F.mul_(d, lr)
            F.sub_(pw, d)
            A.bump_version(p)   -- written in place (autograd's saved-tensor check)
            free(d)
            if pw ~= p then
              p:copy_(pw)
              free(pw)
            end
          end
        end
      end
    end)
  end

  return SGD
end
