-- moonshard.optim.schedule — learning-rate schedules: each returns fn(step) -> lr
-- for 0-based steps (step 0 is the first optimizer step).
--
--   cosine{lr =, warmup = 0, total =, min_lr = 0}
--     step < warmup:   lr * (step + 1) / warmup         (linear warmup)
--     step < total:    min_lr + (lr - min_lr) * (1 + cos(pi * r)) / 2,
--                      r = (step - warmup) / (total - warmup)
--     after:           min_lr
--   wsd{lr =, warmup = 0, stable =, decay =, min_lr = 0, shape = 'linear'}
--     warm-up as above, then lr for `stable` steps, then from lr to min_lr
--     over `decay` steps: 'linear', 'cosine' or 'sqrt' (lr - (lr-min_lr)*sqrt(r)),
--     then min_lr
--   constant{lr =, warmup = 0}
local S = {}

local function need(name, o, k)
  local v = o[k]
  if type(v) ~= 'number' then
    error(('schedule.%s: %s must be a number, got %s'):format(name, k, tostring(v)), 3)
  end
  return v
end

function S.cosine(o)
  local lr, total = need('cosine', o, 'lr'), need('cosine', o, 'total')
  local warmup, min_lr = o.warmup or 0, o.min_lr or 0
  if total <= warmup then error('schedule.cosine: total must exceed warmup', 2) end
  return function(step)
    if step < warmup then return lr * (step + 1) / warmup end
    if step >= total then return min_lr end
    local r = (step - warmup) / (total - warmup)
    return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * r))
  end
end

function S.wsd(o)
  local lr = need('wsd', o, 'lr')
  local stable, decay = need('wsd', o, 'stable'), need('wsd', o, 'decay')
  local warmup, min_lr, shape = o.warmup or 0, o.min_lr or 0, o.shape or 'linear'
  if shape ~= 'linear' and shape ~= 'cosine' and shape ~= 'sqrt' then
    error(("schedule.wsd: shape must be 'linear', 'cosine' or 'sqrt', got %s"):format(tostring(shape)), 2)
  end
  return function(step)
    if step < warmup then return lr * (step + 1) / warmup end
    local s = step - warmup
    if s < stable then return lr end
    s = s - stable
    if s >= decay then return min_lr end
    local r = s / decay
    if shape == 'linear' then return lr + (min_lr - lr) * r end
    if shape == 'cosine' then return min_lr + (lr - min_lr) * 0.5 * (1 + math.cos(math.pi * r)) end
    return lr - (lr - min_lr) * math.sqrt(r)
  end
end

function S.constant(o)
  local lr = need('constant', o, 'lr')
  local warmup = o.warmup or 0
  return function(step)
    if step < warmup then return lr * (step + 1) / warmup end
    return lr
  end
end

return S
