-- moonshard.jsd — fused linear Jensen-Shannon divergence: the distillation
-- loss between a student's and a teacher's next-token distributions, from
-- their hidden states and LM heads, without the (BT, V) logits in memory
-- (Liger Kernel's fused linear JSD; TRL's generalized JSD, as GKD uses it).
--
--   local nnf = require 'moonshard.nn.functional'
--   local loss = nnf.fused_linear_jsd(xs, Ws, xt, Wt, {
--     beta = 0.5,            -- in [0, 1]: 0 forward KL(teacher‖student), 1 reverse KL(student‖teacher)
--     temperature = 1,       -- both heads' logits divided by it
--     labels = y,            -- (BT) ids, optional: tokens whose label is ignore_index count for nothing
--     ignore_index = -100,
--     reduction = 'mean',    -- 'mean' (over the counted tokens; 0 when none) or 'sum'
--     chunk_size = nil,      -- rows a chunk (default: from memory_budget)
--     memory_budget = nil,   -- bytes for a chunk's (rows, V) buffers: two of logits, and one of their gradient unless
--                            --   it is written over the student's logits (same dtype) (default 1 GiB)
--   })
--
-- xs (BT, Hs) or (..., Hs) with Ws (V, Hs): the student, the only side that
-- gets gradients; xt (BT, Ht) or (..., Ht) with Wt (V, Ht): the teacher,
-- constants (no gradient flows into them, whatever they require). With
-- log-probabilities ls = log_softmax(xs·Wsᵀ / τ), lt = log_softmax(xt·Wtᵀ / τ),
-- q = exp(ls), p = exp(lt), each token's divergence is
--   β = 0:      KL(p‖q) = Σ p (lt − ls)
--   β = 1:      KL(q‖p) = Σ q (ls − lt)
--   otherwise:  β KL(p‖m) + (1 − β) KL(q‖m), m = β p + (1 − β) q
-- (TRL's generalized_jsd_loss and Liger's: the general form's limits at 0
-- and 1 are 0, hence the two named cases). Its gradient in the student's
-- logits s = xs·Wsᵀ / τ: q − p at β = 0; else q ⊙ (h − Σ q h) with
-- h = ls − lt (β = 1) or (1 − β)(ls − log m), as ∂/∂q_j of the general form
-- is (1 − β) log(q_j / m_j).
--
-- The algorithm is the fused linear cross-entropy's (docs/flce.md): rows in
-- chunks; a chunk's two logit GEMMs (1/τ in the GEMM's alpha) into buffers
-- of the inputs' dtype on CUDA for bf16/f16 inputs, else f32 (f64 for an
-- f64 student), one fused row pass (core/flce.h ms_jsd_rows: core/jsd.c on the
-- CPU in f64, kernels/jsd.cu on CUDA in f32) for each row's divergence and
-- the gradient of its logits in the student's dtype, then the chunk's rows
-- of grad_xs and its share of grad_Ws (accumulated in f32, cast to Ws's
-- dtype at the end) by GEMMs; nothing of (BT, V) outlives its chunk. All gradients exist when the forward returns; the backward scales
-- them by the incoming gradient on the device (nothing at 1, no host sync),
-- and the count of labelled tokens stays on the device too. Under an
-- autocast region the four tensors are cast (recorded) to its dtype first.
local ffi = require 'ffi'
local T = require 'moonshard.tensor'
local A = require 'moonshard.autograd'
local F = require 'moonshard.ops'
local amp = require 'moonshard.amp'

local C = T.C
local R = A.raw_views
local free = A.free
local needs = A.needs_grad
local is_tensor = T.is_tensor

local M = {}
local NAME = 'fused_linear_jsd'

local raise = require('moonshard.ops').raise   -- (errors at the user's line)

local function dims(t) return '(' .. table.concat(t.shape, ', ') .. ')' end

local function need_tensor(t, what)
  if not is_tensor(t) then raise(('%s: %s must be a tensor, got %s'):format(NAME, what, type(t))) end
end

-- x (..., H) as rows (N, H): a view (freed by the caller when not x)
local function rows_of(x)
  if x.ndim == 2 then return x end
  return R.reshape(x, { -1, x.shape[x.ndim] })
end

-- the rows a chunk for V classes: the two (rows, V) logit buffers of elt
-- bytes and the gradient's of gelt (0: written over the student's logits)
-- in `bytes`
function M.chunk_rows(N, V, elt, gelt, bytes)
  local r = math.floor(bytes / (V * (2 * elt + gelt)))
  return math.max(1, math.min(N, r))
end

local function bwd(node, g)
  local s = node.saved
  local out = {}
  for k, t in pairs({ s.gx, s.gw }) do
    if C.ms_flce_scale_(t, g) ~= 0 then error(ffi.string(C.ms_last_error()), 0) end
    -- a new handle on the same storage (node.own releases the saved one)
    out[k] = (k == 1 and s.xshape) and R.view(t, s.xshape) or R.alias(t)
  end
  return out[1], out[2]
end

function M.fused_linear_jsd(xs, Ws, xt, Wt, opts)
  need_tensor(xs, 'xs (the student\'s hidden states)')
  need_tensor(Ws, 'Ws (the student\'s head)')
  need_tensor(xt, 'xt (the teacher\'s hidden states)')
  need_tensor(Wt, 'Wt (the teacher\'s head)')
  opts = opts or {}
  local beta = opts.beta == nil and 0.5 or opts.beta
  if type(beta) ~= 'number' or beta ~= beta or beta < 0 or beta > 1 then
    raise(('%s: beta must be a number in [0, 1], got %s'):format(NAME, tostring(beta)))
  end
  local temp = opts.temperature == nil and 1 or opts.temperature
  if type(temp) ~= 'number' or not (temp > 0) or temp == math.huge then
    raise(('%s: temperature must be a positive number, got %s'):format(NAME, tostring(temp)))
  end
  local red = opts.reduction or 'mean'
  if red ~= 'mean' and red ~= 'sum' then
    raise(('%s: reduction must be \'mean\' or \'sum\', got %s'):format(NAME, tostring(red)))
  end
  local ignore = opts.ignore_index == nil and -100 or opts.ignore_index
  xs, Ws, xt, Wt = amp.cast(xs, Ws, xt, Wt)
  if Ws.ndim ~= 2 or Wt.ndim ~= 2 or xs.ndim < 1 or xt.ndim < 1 then
    raise(('%s: expected xs (..., Hs), Ws (V, Hs), xt (..., Ht), Wt (V, Ht), got %s, %s, %s, %s'):format(NAME,
      dims(xs), dims(Ws), dims(xt), dims(Wt)))
  end
  local V, Hs, Ht = Ws.shape[1], Ws.shape[2], Wt.shape[2]
  local N = xs:numel() / math.max(xs.shape[xs.ndim], 1)
  if xs.shape[xs.ndim] ~= Hs or xt.shape[xt.ndim] ~= Ht or Wt.shape[1] ~= V or xt:numel() / Ht ~= N then
    raise(('%s: shapes do not fit: xs %s with Ws %s (V, Hs), xt %s with Wt %s (V, Ht): the same V and rows'):format(
      NAME, dims(xs), dims(Ws), dims(xt), dims(Wt)))
  end
  local dev = xs.device_id
  for _, t in ipairs({ Ws, xt, Wt }) do
    if t.device_id ~= dev then
      raise(('%s: xs is on %s, Ws / xt / Wt on %s, %s, %s'):format(NAME, xs.device, Ws.device, xt.device, Wt.device))
    end
  end
  if Ws.dtype_id ~= xs.dtype_id or Wt.dtype_id ~= xt.dtype_id then
    raise(('%s: dtypes xs %s, Ws %s, xt %s, Wt %s: each side\'s hidden states and head must share one'):format(NAME,
      xs.dtype, Ws.dtype, xt.dtype, Wt.dtype))
  end
  local labels = opts.labels
  if labels ~= nil then
    need_tensor(labels, 'opts.labels')
    if labels:numel() ~= N or (labels.dtype ~= 'i64' and labels.dtype ~= 'i32') or labels.device_id ~= dev then
      raise(('%s: labels must be %d integer ids on %s, got %s %s on %s'):format(NAME, N, xs.device, labels.dtype,
        dims(labels), labels.device))
    end
  end
  -- the row math's dtype: f64 for f64 students (gradchecks), else f32
  local cd = xs.dtype == 'f64' and 'f64' or 'f32'
  -- the logits' dtype: on CUDA the 16-bit inputs' own (what x @ W.T gives
  -- in PyTorch, as Liger's chunks hold them: half the bytes of f32 for the
  -- row pass to read, twice the rows a chunk), else the row math's
  local ld = cd
  if dev >= 0 and xs.dtype == xt.dtype and (xs.dtype == 'bf16' or xs.dtype == 'f16') then ld = xs.dtype end
  local gdt = xs.dtype      -- the logits' gradient, in the dtype its GEMMs read
  local in_place = ld == gdt   -- the gradient written over the student's logits
  local xs2, xt2 = rows_of(xs), rows_of(xt)
  local lab1 = labels and (labels.ndim == 1 and labels or R.reshape(labels, { -1 })) or nil
  local rows = opts.chunk_size or M.chunk_rows(N, V, C.ms_dtype_size(T.dtype_id(ld)),
    in_place and 0 or C.ms_dtype_size(xs.dtype_id), opts.memory_budget or 2 ^ 30)
  if type(rows) ~= 'number' or rows < 1 or rows % 1 ~= 0 then
    raise(('%s: chunk_size must be a positive integer, got %s'):format(NAME, tostring(rows)))
  end
  local want_x, want_w = A.is_grad_enabled() and needs(xs), A.is_grad_enabled() and needs(Ws)
  local gx = want_x and T.empty({ N, Hs }, { dtype = xs.dtype, device = dev }) or nil
  -- grad_Ws accumulated over the chunks in f32 (f64 for an f64 student)
  local gw = want_w and T.zeros({ V, Hs }, { dtype = cd, device = dev }) or nil
  local total = T.zeros({}, { dtype = cd, device = dev })
  for r0 = 0, N - 1, rows do
    local n = math.min(rows, N - r0)
    local xs_c, xt_c = R.narrow(xs2, 1, r0 + 1, n), R.narrow(xt2, 1, r0 + 1, n)
    local S = T.empty({ n, V }, { dtype = ld, device = dev })
    local Tl = T.empty({ n, V }, { dtype = ld, device = dev })
    F.gemm_(S, xs_c, Ws, false, true, 1 / temp, 0)
    F.gemm_(Tl, xt_c, Wt, false, true, 1 / temp, 0)
    local lossr = T.empty({ n }, { dtype = cd, device = dev })
    local G = nil
    if gx or gw then G = in_place and S or T.empty({ n, V }, { dtype = gdt, device = dev }) end
    local lab_c = lab1 and R.narrow(lab1, 1, r0 + 1, n) or nil
    -- the row pass (core/jsd.c, kernels/jsd.cu): each row's divergence and
    -- its gradient in the logits, times 1/τ (the chain through xs·Wsᵀ / τ)
    local rc = C.ms_jsd_rows(G, lossr, S, Tl, lab_c, ignore, beta, 1 / temp)
    if G ~= S then free(S) end
    free(Tl)
    if lab_c then free(lab_c) end
    if rc ~= 0 then
      free(G); free(lossr); free(xs_c); free(xt_c)
      raise(ffi.string(C.ms_last_error()))
    end
    local ls_sum = F.sum(lossr)
    F.add_(total, ls_sum)
    free(ls_sum); free(lossr)
    if gx then
      local gx_c = R.narrow(gx, 1, r0 + 1, n)
      F.gemm_(gx_c, G, Ws, false, false, 1, 0)
      free(gx_c)
    end
    if gw then F.gemm_(gw, G, xs_c, true, false, 1, 1) end
    free(G); free(xs_c); free(xt_c)
  end
  -- 'mean': over the labelled tokens (their count on the device; 0 when none)
  if red == 'mean' then
    local cnt
    if lab1 then
      local vb = F.ne(lab1, ignore)
      local c = F.sum(vb.dtype == cd and vb or vb:to(cd))
      free(vb)
      cnt = F.maximum(c, 1)
      free(c)
    else
      cnt = T.full({}, math.max(N, 1), { dtype = cd, device = dev })
    end
    F.div_(total, cnt)
    if gx then
      local c = cnt.dtype_id == gx.dtype_id and cnt or cnt:to(gx.dtype)
      F.div_(gx, c)
      if c ~= cnt then free(c) end
    end
    if gw then F.div_(gw, cnt) end
    free(cnt)
  end
  if gw and gw.dtype_id ~= Ws.dtype_id then
    local c = gw:to(Ws.dtype)
    free(gw)
    gw = c
  end
  if lab1 and lab1 ~= labels then free(lab1) end
  local loss = total
  if gx or gw then
    local xshape = xs.ndim ~= 2 and xs.shape or nil
    local own = {}
    if gx then own[#own + 1] = gx end
    if gw then own[#own + 1] = gw end
    A.record_list(NAME, loss, bwd, { gx = gx, gw = gw, xshape = xshape }, own, { xs, Ws })
  end
  if xs2 ~= xs then free(xs2) end
  if xt2 ~= xt then free(xt2) end
  return loss
end

return M
