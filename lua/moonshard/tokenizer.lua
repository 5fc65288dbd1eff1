-- moonshard.tokenizer — byte-level tokens, and byte-level BPE from a Hugging
-- Face tokenizer.json (GPT-2, Llama 3 and their kin). No downloads: you give
-- the file.
--
--   local tok = require 'moonshard.tokenizer'
--   local bytes = tok.bytes()                      -- ids are the bytes, vocab 256
--   local bpe = tok.load('tokenizer.json')         -- or tok.from_json(text) / tok.from_table(t)
--   local ids = bpe:encode('Hello world')          -- { 15496, 995 } (0-based ids, a Lua list)
--   print(bpe:decode(ids), bpe.vocab_size)
--   bpe:token_id('<|endoftext|>')                  -- an added token's id (or nil)
--
-- What a tokenizer.json may hold (anything else is a clear error, never a
-- silent difference):
--   model:          type "BPE" with vocab, merges ("a b" strings or ["a", "b"]
--                   pairs, rank = position), ignore_merges, unk_token
--   added_tokens:   matched in the text first (longest at the leftmost
--                   position), each its own id; lstrip/rstrip/single_word are
--                   not applied
--   normalizer:     null (or an empty Sequence), or NFC (Qwen's: Unicode
--                   canonical composition through ICU, libicuuc, applied to
--                   the text between added tokens; ASCII text is left as is)
--   pre_tokenizer:  ByteLevel (add_prefix_space, use_regex: GPT-2's pattern),
--                   Split (a Regex or a String pattern; behaviour Isolated,
--                   Removed, MergedWithPrevious or MergedWithNext), Sequence
--   decoder:        ByteLevel (bytes back from GPT-2's byte-to-unicode table)
-- The post_processor (BOS/EOS templates) is not applied: encode gives the
-- text's tokens only; bin/tokenize puts a document separator itself.
--
-- Split patterns are run by a small backtracking regex engine over code
-- points (tok.regex): alternation, (?:...), (?i:...), (?!...), (?=...),
-- classes [...] with ranges and negation, \s \S \d \D \w \W \r \n \t,
-- \p{L} \p{N} \P{..} (also \pL \pN), quantifiers ? * + {m,n} (greedy, lazy
-- "?" and possessive "+"), ^ $. It matches as Oniguruma does (leftmost,
-- first alternative that leads to a match). Unicode categories are tables
-- of ranges: ASCII and Latin-1 exactly; beyond them white space and the
-- decimal digits, fractions and circled numbers of the common scripts are
-- exact, the punctuation, symbol, emoji and combining-mark blocks are
-- "neither letter nor number", and every other code point counts as a
-- letter (so a combining mark inside an Indic word is taken as a letter,
-- where Unicode says \p{M}: the one known difference from the reference).
local bit = require 'bit'

local tok = {}

-- ------------------------------------------------------------------ UTF-8
-- code points of s, and the byte offset where each starts (pos[#cps+1] = #s+1);
-- an invalid byte is taken as the code point of its value (0x80-0xFF)
local function utf8_decode(s)
  local cps, pos = {}, {}
  local i, n, k = 1, #s, 0
  while i <= n do
    local c = s:byte(i)
    local cp, len = c, 1
    if c >= 0xF0 and c < 0xF8 and i + 3 <= n then
      local c2, c3, c4 = s:byte(i + 1, i + 3)
      if bit.band(c2, 0xC0) == 0x80 and bit.band(c3, 0xC0) == 0x80 and bit.band(c4, 0xC0) == 0x80 then
        cp, len = (c - 0xF0) * 0x40000 + (c2 - 0x80) * 0x1000 + (c3 - 0x80) * 0x40 + (c4 - 0x80), 4
      end
    elseif c >= 0xE0 and c < 0xF0 and i + 2 <= n then
      local c2, c3 = s:byte(i + 1, i + 2)
      if bit.band(c2, 0xC0) == 0x80 and bit.band(c3, 0xC0) == 0x80 then
        cp, len = (c - 0xE0) * 0x1000 + (c2 - 0x80) * 0x40 + (c3 - 0x80), 3
      end
    elseif c >= 0xC0 and c < 0xE0 and i + 1 <= n then
      local c2 = s:byte(i + 1)
      if bit.band(c2, 0xC0) == 0x80 then cp, len = (c - 0xC0) * 0x40 + (c2 - 0x80), 2 end
    end
    k = k + 1
    cps[k], pos[k] = cp, i
    i = i + len
  end
  pos[k + 1] = n + 1
  return cps, pos
end
tok.utf8_decode = utf8_decode

local function utf8_char(cp)
  if cp < 0x80 then return string.char(cp) end
  if cp < 0x800 then return string.char(0xC0 + bit.rshift(cp, 6), 0x80 + bit.band(cp, 0x3F)) end
  if cp < 0x10000 then
    return string.char(0xE0 + bit.rshift(cp, 12), 0x80 + bit.band(bit.rshift(cp, 6), 0x3F), 0x80 + bit.band(cp, 0x3F))
  end
  return string.char(0xF0 + bit.rshift(cp, 18), 0x80 + bit.band(bit.rshift(cp, 12), 0x3F),
    0x80 + bit.band(bit.rshift(cp, 6), 0x3F), 0x80 + bit.band(cp, 0x3F))
end
tok.utf8_char = utf8_char

-- ------------------------------------------------------ Unicode categories
local function in_ranges(r, cp)
  local lo, hi = 1, #r / 2
  while lo <= hi do
    local mid = math.floor((lo + hi) / 2)
    local a, b = r[2 * mid - 1], r[2 * mid]
    if cp < a then hi = mid - 1 elseif cp > b then lo = mid + 1 else return true end
  end
  return false
end
local space_r = { 0x09, 0x0D, 0x20, 0x20, 0x85, 0x85, 0xA0, 0xA0, 0x1680, 0x1680, 0x2000, 0x200A,
  0x2028, 0x2029, 0x202F, 0x202F, 0x205F, 0x205F, 0x3000, 0x3000 }
local number_r = { 0x30, 0x39, 0xB2, 0xB3, 0xB9, 0xB9, 0xBC, 0xBE, 0x660, 0x669, 0x6F0, 0x6F9, 0x7C0, 0x7C9,
  0x966, 0x96F, 0x9E6, 0x9EF, 0xA66, 0xA6F, 0xAE6, 0xAEF, 0xB66, 0xB6F, 0xBE6, 0xBF2, 0xC66, 0xC6F,
  0xCE6, 0xCEF, 0xD66, 0xD78, 0xE50, 0xE59, 0xED0, 0xED9, 0xF20, 0xF33, 0x1040, 0x1049, 0x16EE, 0x16F0,
  0x17E0, 0x17E9, 0x1810, 0x1819, 0x2070, 0x2070, 0x2074, 0x2079, 0x2080, 0x2089, 0x2150, 0x2182,
  0x2185, 0x2189, 0x2460, 0x249B, 0x24EA, 0x24FF, 0x2776, 0x2793, 0x3007, 0x3007, 0x3021, 0x3029,
  0x3038, 0x303A, 0x3192, 0x3195, 0x3220, 0x3229, 0x3248, 0x324F, 0x3251, 0x325F, 0x3280, 0x3289,
  0x32B1, 0x32BF, 0xFF10, 0xFF19, 0x1D7CE, 0x1D7FF, 0x1F100, 0x1F10C }
-- neither letter nor number (ASCII handled apart): controls, punctuation,
-- symbols, combining marks, private use, emoji
local other_r = { 0x80, 0xA9, 0xAB, 0xB4, 0xB6, 0xB8, 0xBB, 0xBF, 0xD7, 0xD7, 0xF7, 0xF7,
  0x2C2, 0x2C5, 0x2D2, 0x2DF, 0x2E5, 0x2EB, 0x2ED, 0x2ED, 0x2EF, 0x36F, 0x375, 0x375, 0x37E, 0x37E,
  0x384, 0x385, 0x387, 0x387, 0x3F6, 0x3F6, 0x482, 0x489, 0x55A, 0x55F, 0x589, 0x58A, 0x591, 0x5C7,
  0x5F3, 0x5F4, 0x600, 0x61F, 0x64B, 0x65F, 0x66A, 0x66D, 0x670, 0x670, 0x6D4, 0x6D4, 0x6D6, 0x6ED,
  0x2000, 0x206F, 0x20A0, 0x20FF, 0x2100, 0x2101, 0x2103, 0x2106, 0x2108, 0x2109, 0x2114, 0x2114,
  0x2116, 0x2118, 0x211E, 0x2123, 0x2125, 0x2125, 0x2127, 0x2127, 0x2129, 0x2129, 0x212E, 0x212E,
  0x213A, 0x213B, 0x2140, 0x2144, 0x214A, 0x214D, 0x214F, 0x214F, 0x218A, 0x245F, 0x249C, 0x24E9,
  0x2500, 0x2775, 0x2794, 0x2BFF, 0x2CE5, 0x2CEA, 0x2CF9, 0x2CFF, 0x2E00, 0x2E7F, 0x2FF0, 0x3006,
  0x3008, 0x3020, 0x302A, 0x3030, 0x3036, 0x3037, 0x303D, 0x303F, 0x3099, 0x309C, 0x30A0, 0x30A0,
  0x30FB, 0x30FB, 0x3200, 0x321F, 0x322A, 0x3247, 0x3250, 0x3250, 0x3260, 0x327F, 0x328A, 0x32B0,
  0x32C0, 0x33FF, 0x4DC0, 0x4DFF, 0xA490, 0xA4C6, 0xD800, 0xF8FF, 0xFB29, 0xFB29, 0xFD3E, 0xFD3F,
  0xFE00, 0xFE6F, 0xFEFF, 0xFEFF, 0xFF01, 0xFF0F, 0xFF1A, 0xFF20, 0xFF3B, 0xFF40, 0xFF5B, 0xFF65,
  0xFFE0, 0xFFFF, 0x1D000, 0x1D24F, 0x1F000, 0x1F0FF, 0x1F10D, 0x1FAFF, 0xE0000, 0xE0FFF,
  0xF0000, 0x10FFFF }

local function is_space(cp) return in_ranges(space_r, cp) end
local function is_number(cp)
  if cp < 0x80 then return cp >= 0x30 and cp <= 0x39 end
  return in_ranges(number_r, cp)
end
local function is_letter(cp)
  if cp < 0x80 then return (cp >= 0x41 and cp <= 0x5A) or (cp >= 0x61 and cp <= 0x7A) end
  return not in_ranges(other_r, cp) and not in_ranges(space_r, cp) and not in_ranges(number_r, cp)
end
local function is_digit(cp) return cp >= 0x30 and cp <= 0x39 end
local function is_word(cp) return is_letter(cp) or is_number(cp) or cp == 0x5F end
tok.is_space, tok.is_number, tok.is_letter = is_space, is_number, is_letter

local function lower(cp) -- ASCII and Latin-1 (what (?i:'s|'t...) needs)
  if (cp >= 0x41 and cp <= 0x5A) or (cp >= 0xC0 and cp <= 0xDE and cp ~= 0xD7) then return cp + 32 end
  return cp
end
local function upper(cp)
  if (cp >= 0x61 and cp <= 0x7A) or (cp >= 0xE0 and cp <= 0xFE and cp ~= 0xF7) then return cp - 32 end
  return cp
end

-- ------------------------------------------------------------------ regex
-- tok.regex(pattern) -> re with re:find_all(cps) -> list of { first, last }
-- (code-point indices, inclusive); see the module comment for the syntax.
local Regex = {}
Regex.__index = Regex

local function compile(pattern)
  local p = utf8_decode(pattern)
  local i, n = 1, #p
  local function fail(msg) error(('tokenizer: regex %q at %d: %s'):format(pattern, i, msg), 0) end
  local function peek(k) return p[i + (k or 0)] end
  local function ch(c) return c and utf8_char(c) or '' end

  local function prop_class(neg)
    -- after "\p" or "\P": {Name} or a one-letter name
    local name
    if peek() == 0x7B then -- {
      local j = i + 1
      local buf = {}
      while p[j] and p[j] ~= 0x7D do buf[#buf + 1] = ch(p[j]); j = j + 1 end
      if not p[j] then fail('unclosed \\p{') end
      name = table.concat(buf)
      i = j + 1
    else
      name = ch(peek()); i = i + 1
    end
    local f
    if name == 'L' or name == 'Letter' then f = is_letter
    elseif name == 'N' or name == 'Number' then f = is_number
    else fail('unsupported Unicode property \\p{' .. name .. '} (supported: L, N)') end
    if neg then return function(c) return not f(c) end end
    return f
  end

  -- an escape after "\": returns a predicate
  local function escape()
    local c = peek()
    if not c then fail('trailing backslash') end
    i = i + 1
    local e = ch(c)
    if e == 's' then return is_space end
    if e == 'S' then return function(x) return not is_space(x) end end
    if e == 'd' then return is_digit end
    if e == 'D' then return function(x) return not is_digit(x) end end
    if e == 'w' then return is_word end
    if e == 'W' then return function(x) return not is_word(x) end end
    if e == 'p' then return prop_class(false) end
    if e == 'P' then return prop_class(true) end
    local lit = ({ n = 10, r = 13, t = 9, f = 12, v = 11, ['0'] = 0 })[e]
    if not lit then
      if (c >= 0x41 and c <= 0x5A) or (c >= 0x61 and c <= 0x7A) then fail('unsupported escape \\' .. e) end
      lit = c
    end
    return nil, lit
  end

  local function class(icase)
    -- after "["
    local neg = false
    if peek() == 0x5E then neg = true; i = i + 1 end
    local preds, ranges = {}, {}
    local first = true
    while true do
      local c = peek()
      if not c then fail('unclosed [') end
      if c == 0x5D and not first then i = i + 1; break end
      first = false
      local lo
      if c == 0x5C then
        i = i + 1
        local f, lit = escape()
        if f then preds[#preds + 1] = f else lo = lit end
      elseif c == 0x5B and peek(1) == 0x3A then
        fail('POSIX classes [:name:] are not supported')
      else
        lo = c; i = i + 1
      end
      if lo then
        local hi = lo
        if peek() == 0x2D and peek(1) and peek(1) ~= 0x5D then
          i = i + 1
          local c2 = peek()
          if c2 == 0x5C then
            i = i + 1
            local f, lit = escape()
            if f then fail('a class escape cannot end a range') end
            hi = lit
          else hi = c2; i = i + 1 end
        end
        ranges[#ranges + 1] = { lo, hi }
      end
    end
    local function member(x)
      for _, r in ipairs(ranges) do if x >= r[1] and x <= r[2] then return true end end
      for _, f in ipairs(preds) do if f(x) then return true end end
      return false
    end
    local f = member
    if icase then f = function(x) return member(x) or member(lower(x)) or member(upper(x)) end end
    if neg then return function(x) return not f(x) end end
    return f
  end

  local parse_alt

  local function atom(icase)
    local c = peek()
    if c == 0x28 then -- (
      i = i + 1
      local node
      if peek() == 0x3F then -- ?
        local k = ch(peek(1))
        if k == ':' then i = i + 2; node = parse_alt(icase)
        elseif k == '!' or k == '=' then i = i + 2; node = { t = 'look', neg = k == '!', node = parse_alt(icase) }
        elseif k == 'i' and ch(peek(2)) == ':' then i = i + 3; node = parse_alt(true)
        elseif k == 'i' and ch(peek(2)) == ')' then i = i + 3; return { t = 'seq', items = {} }, 'icase'
        else fail('unsupported group (?' .. k) end
      else
        node = parse_alt(icase) -- a capture group: captures are not kept
      end
      if peek() ~= 0x29 then fail('missing )') end
      i = i + 1
      return node
    elseif c == 0x5B then i = i + 1; return { t = 'set', f = class(icase) }
    elseif c == 0x2E then i = i + 1; return { t = 'set', f = function(x) return x ~= 10 end }
    elseif c == 0x5E then i = i + 1; return { t = 'bol' }
    elseif c == 0x24 then i = i + 1; return { t = 'eol' }
    elseif c == 0x5C then
      i = i + 1
      local f, lit = escape()
      if f then return { t = 'set', f = f } end
      c = lit
    else
      i = i + 1
    end
    if icase and (lower(c) ~= c or upper(c) ~= c) then
      local lc = lower(c)
      return { t = 'set', f = function(x) return lower(x) == lc end }
    end
    return { t = 'set', f = function(x) return x == c end }
  end

  local function number()
    local v
    while peek() and peek() >= 0x30 and peek() <= 0x39 do v = (v or 0) * 10 + peek() - 0x30; i = i + 1 end
    return v
  end

  local function parse_seq(icase)
    local items = {}
    while true do
      local c = peek()
      if not c or c == 0x7C or c == 0x29 then break end
      local node, flag = atom(icase)
      if flag == 'icase' then icase = true end
      local q = peek()
      local min, max
      if q == 0x3F then min, max = 0, 1; i = i + 1
      elseif q == 0x2A then min, max = 0, math.huge; i = i + 1
      elseif q == 0x2B then min, max = 1, math.huge; i = i + 1
      elseif q == 0x7B and peek(1) and peek(1) >= 0x30 and peek(1) <= 0x39 then
        i = i + 1
        min = number()
        max = min
        if peek() == 0x2C then i = i + 1; max = number() or math.huge end
        if peek() ~= 0x7D then fail('bad {m,n}') end
        i = i + 1
      end
      if min then
        if node.t == 'look' or node.t == 'bol' or node.t == 'eol' then fail('quantifier after an assertion') end
        local lazy, poss = false, false
        if peek() == 0x3F then lazy = true; i = i + 1 elseif peek() == 0x2B then poss = true; i = i + 1 end
        node = { t = 'rep', node = node, min = min, max = max, lazy = lazy, poss = poss }
      end
      items[#items + 1] = node
    end
    if #items == 1 then return items[1] end
    return { t = 'seq', items = items }
  end

  function parse_alt(icase)
    local alts = { parse_seq(icase) }
    while peek() == 0x7C do
      i = i + 1
      alts[#alts + 1] = parse_seq(icase)
    end
    if #alts == 1 then return alts[1] end
    return { t = 'alt', alts = alts }
  end

  local root = parse_alt(false)
  if i <= n then fail('unbalanced )') end
  return root
end

-- m(node, cps, n, i, k): match node at i, then the continuation k(j); returns
-- the end of the whole match or nil
local m
local function match_seq(items, j, cps, n, i, k)
  if j > #items then return k(i) end
  return m(items[j], cps, n, i, function(i2) return match_seq(items, j + 1, cps, n, i2, k) end)
end
function m(node, cps, n, i, k)
  local t = node.t
  if t == 'set' then
    if i <= n and node.f(cps[i]) then return k(i + 1) end
    return nil
  elseif t == 'seq' then
    return match_seq(node.items, 1, cps, n, i, k)
  elseif t == 'alt' then
    for _, a in ipairs(node.alts) do
      local r = m(a, cps, n, i, k)
      if r then return r end
    end
    return nil
  elseif t == 'rep' then
    local sub, min, max = node.node, node.min, node.max
    if sub.t == 'set' then -- one code point at a time: no recursion
      local f, c = sub.f, 0
      while c < max and i + c <= n and f(cps[i + c]) do c = c + 1 end
      if c < min then return nil end
      if node.poss then return k(i + c) end
      if node.lazy then
        for j = min, c do local r = k(i + j); if r then return r end end
      else
        for j = c, min, -1 do local r = k(i + j); if r then return r end end
      end
      return nil
    end
    if node.poss then -- match greedily once, without giving back
      local pos, count = i, 0
      while count < max do
        local e = m(sub, cps, n, pos, function(j) return j end)
        if not e or e == pos then break end
        pos, count = e, count + 1
      end
      if count < min then return nil end
      return k(pos)
    end
    local function try(count, pos)
      if node.lazy and count >= min then
        local r = k(pos)
        if r then return r end
      end
      if count < max then
        local r = m(sub, cps, n, pos, function(j)
          if j == pos then return nil end
          return try(count + 1, j)
        end)
        if r then return r end
      end
      if not node.lazy and count >= min then return k(pos) end
      return nil
    end
    return try(0, i)
  elseif t == 'look' then
    local r = m(node.node, cps, n, i, function(j) return j end)
    if node.neg then
      if r then return nil end
    elseif not r then return nil end
    return k(i)
  elseif t == 'bol' then
    if i == 1 then return k(i) end
    return nil
  elseif t == 'eol' then
    if i == n + 1 then return k(i) end
    return nil
  end
  error('tokenizer: regex node ' .. tostring(t))
end

local function ident(j) return j end

-- The engine that runs: the tree compiled to a backtracking VM (no closures
-- per step, so LuaJIT compiles its loop; the continuation matcher above is
-- the reference it is checked against). Instructions, in parallel arrays:
--   PRED f            the code point at i satisfies f: i + 1
--   SPLIT x y         try x, and y on failure
--   JMP x
--   MATCH             success: the end is i
--   REPSET f min max mode   a run of f (mode 0 greedy, 1 lazy, 2 possessive),
--                     backtracking one code point at a time
--   LOOK sub neg      sub matches at i (neg: does not); i unchanged
--   ATOMIC sub        sub's first match, never given back (possessive groups)
--   BOL, EOL
local PRED, SPLIT, JMP, MATCH, REPSET, LOOK, ATOMIC, BOL, EOL = 1, 2, 3, 4, 5, 6, 7, 8, 9

local function nullable(node)
  local t = node.t
  if t == 'set' then return false end
  if t == 'seq' then
    for _, x in ipairs(node.items) do if not nullable(x) then return false end end
    return true
  end
  if t == 'alt' then
    for _, x in ipairs(node.alts) do if nullable(x) then return true end end
    return false
  end
  if t == 'rep' then return node.min == 0 or nullable(node.node) end
  return true
end

local function new_prog() return { op = {}, a = {}, b = {}, c = {}, d = {}, n = 0 } end
local function emit(P, op, a, b, c, d)
  local k = P.n + 1
  P.n = k
  P.op[k], P.a[k], P.b[k], P.c[k], P.d[k] = op, a, b, c, d
  return k
end

local gen
local function sub_prog(node)
  local P = new_prog()
  gen(P, node)
  emit(P, MATCH)
  return P
end
function gen(P, node)
  local t = node.t
  if t == 'set' then emit(P, PRED, node.f)
  elseif t == 'seq' then for _, x in ipairs(node.items) do gen(P, x) end
  elseif t == 'alt' then
    local jumps = {}
    for k, x in ipairs(node.alts) do
      if k < #node.alts then
        local sp = emit(P, SPLIT, P.n + 2, nil)
        gen(P, x)
        jumps[#jumps + 1] = emit(P, JMP, nil)
        P.b[sp] = P.n + 1
      else
        gen(P, x)
      end
    end
    for _, j in ipairs(jumps) do P.a[j] = P.n + 1 end
  elseif t == 'rep' then
    local sub, min, max = node.node, node.min, node.max
    if sub.t == 'set' then
      emit(P, REPSET, sub.f, min, max, node.poss and 2 or node.lazy and 1 or 0)
      return
    end
    if node.poss then
      emit(P, ATOMIC, sub_prog({ t = 'rep', node = sub, min = min, max = max }))
      return
    end
    if max == math.huge and nullable(sub) then
      error('tokenizer: regex: a repeated group that can match the empty string is not supported', 0)
    end
    for _ = 1, min do gen(P, sub) end
    if max == math.huge then
      local loop = emit(P, SPLIT, nil, nil)
      gen(P, sub)
      emit(P, JMP, loop)
      local out = P.n + 1
      if node.lazy then P.a[loop], P.b[loop] = out, loop + 1 else P.a[loop], P.b[loop] = loop + 1, out end
    else
      local splits = {}
      for _ = min + 1, max do
        splits[#splits + 1] = emit(P, SPLIT, nil, nil)
        gen(P, sub)
      end
      local out = P.n + 1
      for _, sp in ipairs(splits) do
        if node.lazy then P.a[sp], P.b[sp] = out, sp + 1 else P.a[sp], P.b[sp] = sp + 1, out end
      end
    end
  elseif t == 'look' then emit(P, LOOK, sub_prog(node.node), node.neg)
  elseif t == 'bol' then emit(P, BOL)
  elseif t == 'eol' then emit(P, EOL)
  else error('tokenizer: regex node ' .. tostring(t)) end
end

-- backtrack stacks, one per nesting depth (lookaheads, atomic groups)
local stacks, depth = {}, 0
local CPS, N -- the code points being matched

-- the end of P's first match at i (exclusive), or nil
local function run(P, i)
  depth = depth + 1
  local st = stacks[depth]
  if not st then st = { k = {}, pc = {}, i = {}, x = {} }; stacks[depth] = st end
  local sk, spc, si, sx = st.k, st.pc, st.i, st.x
  local top = 0
  local op, A, Bv, Cv, Dv = P.op, P.a, P.b, P.c, P.d
  local cps, n = CPS, N
  local pc = 1
  while true do
    local o = op[pc]
    local ok = true
    if o == PRED then
      if i <= n and A[pc](cps[i]) then i = i + 1; pc = pc + 1 else ok = false end
    elseif o == REPSET then
      local f, min, max, mode = A[pc], Bv[pc], Cv[pc], Dv[pc]
      local c = 0
      while c < max and i + c <= n and f(cps[i + c]) do c = c + 1 end
      if c < min then ok = false
      else
        if mode == 0 then
          if c > min then top = top + 1; sk[top], spc[top], si[top], sx[top] = 2, pc + 1, i + c - 1, i + min end
          i = i + c
        elseif mode == 1 then
          if c > min then top = top + 1; sk[top], spc[top], si[top], sx[top] = 3, pc + 1, i + min + 1, i + c end
          i = i + min
        else
          i = i + c
        end
        pc = pc + 1
      end
    elseif o == SPLIT then
      top = top + 1
      sk[top], spc[top], si[top] = 1, Bv[pc], i
      pc = A[pc]
    elseif o == JMP then pc = A[pc]
    elseif o == MATCH then
      depth = depth - 1
      return i
    elseif o == LOOK then
      local r = run(A[pc], i)
      if (r ~= nil) ~= (Bv[pc] and true or false) then pc = pc + 1 else ok = false end
    elseif o == ATOMIC then
      local r = run(A[pc], i)
      if r then i = r; pc = pc + 1 else ok = false end
    elseif o == BOL then
      if i == 1 then pc = pc + 1 else ok = false end
    elseif o == EOL then
      if i == n + 1 then pc = pc + 1 else ok = false end
    end
    if not ok then -- backtrack
      if top == 0 then depth = depth - 1; return nil end
      local kind = sk[top]
      pc, i = spc[top], si[top]
      if kind == 1 then top = top - 1
      elseif kind == 2 then
        if i - 1 >= sx[top] then si[top] = i - 1 else top = top - 1 end
      else
        if i + 1 <= sx[top] then si[top] = i + 1 else top = top - 1 end
      end
    end
  end
end

function tok.regex(pattern)
  local root = compile(pattern)
  return setmetatable({ pattern = pattern, root = root, prog = sub_prog(root) }, Regex)
end

-- every non-empty match, leftmost first: { {first, last}, ... }
function Regex:find_all(cps)
  local n, out, i = #cps, {}, 1
  local prog = self.prog
  CPS, N, depth = cps, n, 0
  while i <= n do
    local e = run(prog, i)
    if e and e > i then
      out[#out + 1] = { i, e - 1 }
      i = e
    else
      i = i + 1
    end
  end
  CPS = nil
  return out
end

-- the same with the continuation matcher (the reference, for the specs)
function Regex:find_all_reference(cps)
  local n, out, i = #cps, {}, 1
  local root = self.root
  while i <= n do
    local e = m(root, cps, n, i, ident)
    if e and e > i then
      out[#out + 1] = { i, e - 1 }
      i = e
    else
      i = i + 1
    end
  end
  return out
end

-- the pieces of s: matches and the text between them, each tagged
function Regex:split(s)
  local cps, pos = utf8_decode(s)
  local pieces, last = {}, 1
  for _, r in ipairs(self:find_all(cps)) do
    if r[1] > last then pieces[#pieces + 1] = { s:sub(pos[last], pos[r[1]] - 1), false } end
    pieces[#pieces + 1] = { s:sub(pos[r[1]], pos[r[2] + 1] - 1), true }
    last = r[2] + 1
  end
  if last <= #cps then pieces[#pieces + 1] = { s:sub(pos[last], #s), false } end
  return pieces
end

-- GPT-2's pattern (ByteLevel with use_regex), as the tokenizers library has it
tok.GPT2_PATTERN = [['s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+]]
-- Llama 3's (a Split in its tokenizer.json; tiktoken's cl100k pattern)
tok.LLAMA3_PATTERN = [[(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+]]

-- ------------------------------------------------------- byte <-> unicode
-- GPT-2's bytes_to_unicode: printable bytes map to themselves, the others to
-- 256 + k, so every byte is a visible character of the vocabulary
local byte_to_char, char_to_byte = {}, {}
do
  local k = 0
  for b = 0, 255 do
    local cp
    if (b >= 33 and b <= 126) or (b >= 161 and b <= 172) or (b >= 174 and b <= 255) then cp = b
    else cp = 256 + k; k = k + 1 end
    byte_to_char[b] = utf8_char(cp)
    char_to_byte[utf8_char(cp)] = b
  end
end
tok.byte_to_char, tok.char_to_byte = byte_to_char, char_to_byte

local function bytes_to_chars(s)
  local out = {}
  for i = 1, #s do out[i] = byte_to_char[s:byte(i)] end
  return out -- one symbol (a UTF-8 string) per byte
end

-- --------------------------------------------------------------- tokenizers
local Tok = {}
Tok.__index = Tok
tok.Tokenizer = Tok

-- byte-level: id = byte
function tok.bytes()
  return setmetatable({ kind = 'bytes', name = 'bytes', vocab_size = 256, added = {}, added_list = {} }, Tok)
end

local function fail(fmt, ...) error('tokenizer: ' .. fmt:format(...), 0) end

-- pre-tokenizer steps: each maps a list of pieces (strings) to a new list
local function pre_step(spec, steps, state)
  local ty = spec.type
  if ty == 'Sequence' then
    for _, s in ipairs(spec.pretokenizers or {}) do pre_step(s, steps, state) end
  elseif ty == 'ByteLevel' then
    state.byte_level = true
    local re = (spec.use_regex ~= false) and tok.regex(tok.GPT2_PATTERN) or nil
    local prefix = spec.add_prefix_space
    steps[#steps + 1] = function(pieces, first_segment)
      local out = {}
      for idx, s in ipairs(pieces) do
        if prefix and idx == 1 and first_segment and s:sub(1, 1) ~= ' ' then s = ' ' .. s end
        if re then
          for _, pc in ipairs(re:split(s)) do out[#out + 1] = pc[1] end
        else
          out[#out + 1] = s
        end
      end
      return out
    end
  elseif ty == 'Split' then
    if spec.invert then fail('Split with invert = true is not supported') end
    local pat = spec.pattern or {}
    local re
    if pat.Regex then re = tok.regex(pat.Regex)
    elseif pat.String then
      re = tok.regex((pat.String:gsub('[%^%$%(%)%%%.%[%]%*%+%-%?%{%}|\\]', '\\%0')))
    else fail('Split without a Regex or String pattern') end
    local behavior = spec.behavior or 'Isolated'
    steps[#steps + 1] = function(pieces)
      local out = {}
      for _, s in ipairs(pieces) do
        local parts = re:split(s)
        if behavior == 'Isolated' then
          for _, pc in ipairs(parts) do out[#out + 1] = pc[1] end
        elseif behavior == 'Removed' then
          for _, pc in ipairs(parts) do if not pc[2] then out[#out + 1] = pc[1] end end
        elseif behavior == 'MergedWithPrevious' then
          local cur
          for _, pc in ipairs(parts) do
            if pc[2] and cur then out[#out] = cur .. pc[1]; cur = nil
            else out[#out + 1] = pc[1]; cur = out[#out] end
          end
        elseif behavior == 'MergedWithNext' then
          local pend
          for _, pc in ipairs(parts) do
            if pc[2] then
              if pend then out[#out + 1] = pend end
              pend = pc[1]
            else
              out[#out + 1] = (pend or '') .. pc[1]; pend = nil
            end
          end
          if pend then out[#out + 1] = pend end
        else
          fail('Split behaviour %s is not supported (Isolated, Removed, MergedWithPrevious, MergedWithNext)', tostring(behavior))
        end
      end
      return out
    end
  else
    fail('pre_tokenizer type %s is not supported (ByteLevel, Split, Sequence)', tostring(ty))
  end
end

-- tok.from_table(decoded tokenizer.json [, name])
function tok.from_table(t, name)
  name = name or 'tokenizer.json'
  local model = t.model
  if type(model) ~= 'table' then fail('%s: no model', name) end
  if model.type ~= nil and model.type ~= 'BPE' then
    fail('%s: model type %s is not supported (only BPE)', name, tostring(model.type))
  end
  if type(model.vocab) ~= 'table' then fail('%s: model.vocab is missing', name) end
  if (model.continuing_subword_prefix or '') ~= '' or (model.end_of_word_suffix or '') ~= '' then
    fail('%s: continuing_subword_prefix / end_of_word_suffix are not supported (byte-level BPE has none)', name)
  end
  if model.byte_fallback then fail('%s: byte_fallback BPE (SentencePiece style) is not supported; only byte-level BPE', name) end
  local norm = t.normalizer
  local nfc = false
  if type(norm) == 'table' and norm.type == 'Sequence' and #(norm.normalizers or {}) == 1 then
    norm = norm.normalizers[1]
  end
  if type(norm) == 'table' and norm.type == 'NFC' then
    nfc = true
  elseif type(norm) == 'table' and not (norm.type == 'Sequence' and #(norm.normalizers or {}) == 0) then
    fail('%s: normalizer %s is not supported (none or NFC)', name, tostring(norm.type))
  end
  local self = setmetatable({ kind = 'bpe', name = name, nfc = nfc }, Tok)
  local vocab, id_to_token, maxid = {}, {}, -1
  for s, id in pairs(model.vocab) do
    vocab[s] = id
    id_to_token[id] = s
    if id > maxid then maxid = id end
  end
  local ranks = {}
  for r, mg in ipairs(model.merges or {}) do
    local a, b
    if type(mg) == 'string' then a, b = mg:match('^(.-) (.*)$')
    elseif type(mg) == 'table' then a, b = mg[1], mg[2] end
    if not a or not b then fail('%s: merge %d is malformed: %s', name, r, tostring(mg)) end
    ranks[a .. ' ' .. b] = ranks[a .. ' ' .. b] or (r - 1)
  end
  -- a pair key must not be ambiguous: symbols never hold a space in byte-level BPE
  self.vocab, self.id_to_token, self.ranks = vocab, id_to_token, ranks
  self.ignore_merges = model.ignore_merges and true or false
  self.unk_id = model.unk_token and vocab[model.unk_token] or nil
  -- added tokens
  self.added, self.added_list, self.added_ids = {}, {}, {}
  for _, a in ipairs(t.added_tokens or {}) do
    if type(a.content) ~= 'string' or type(a.id) ~= 'number' or a.content == '' then
      fail('%s: malformed added token %s', name, tostring(a.content))
    end
    self.added[a.content] = a.id
    self.added_ids[a.id] = a.content
    self.added_list[#self.added_list + 1] = { content = a.content, id = a.id, special = a.special }
    if a.id > maxid then maxid = a.id end
  end
  self.vocab_size = maxid + 1
  -- pre-tokenizer
  local steps, state = {}, {}
  if type(t.pre_tokenizer) == 'table' then pre_step(t.pre_tokenizer, steps, state) end
  if not state.byte_level then
    fail('%s: only byte-level BPE is supported (the pre_tokenizer has no ByteLevel step)', name)
  end
  self.steps = steps
  self.cache = {}
  return self
end

function tok.from_json(text, name)
  local json = require 'dkjson'
  local t, _, err = json.decode(text, 1, nil)
  if not t then fail('%s: not valid JSON: %s', name or 'tokenizer.json', tostring(err)) end
  return tok.from_table(t, name)
end

function tok.load(path)
  local f, err = io.open(path, 'rb')
  if not f then fail('cannot read %s: %s', path, tostring(err)) end
  local s = f:read('*a')
  f:close()
  return tok.from_json(s, path)
end

-- the id of a token string (an added token's content, or a vocabulary entry)
function Tok:token_id(s)
  if self.kind == 'bytes' then return #s == 1 and s:byte() or nil end
  return self.added[s] or self.vocab[s]
end

-- BPE of one piece (already mapped to byte-level characters)
function Tok:bpe(piece, out)
  local cached = self.cache[piece]
  if not cached then
    local vocab, ranks = self.vocab, self.ranks
    if self.ignore_merges and vocab[piece] then
      cached = { vocab[piece] }
    else
      local cps, pos = utf8_decode(piece)
      local syms = {}
      for i = 1, #cps do syms[i] = piece:sub(pos[i], pos[i + 1] - 1) end
      while #syms > 1 do
        local best, best_rank = nil, math.huge
        for i = 1, #syms - 1 do
          local r = ranks[syms[i] .. ' ' .. syms[i + 1]]
          if r and r < best_rank then best, best_rank = i, r end
        end
        if not best then break end
        local a, b = syms[best], syms[best + 1]
        local merged, j, ns = a .. b, 1, {}
        while j <= #syms do
          if j < #syms and syms[j] == a and syms[j + 1] == b then
            ns[#ns + 1] = merged; j = j + 2
          else
            ns[#ns + 1] = syms[j]; j = j + 1
          end
        end
        syms = ns
      end
      cached = {}
      for i, s in ipairs(syms) do
        local id = vocab[s] or self.unk_id
        if not id then fail('%s: symbol %q is not in the vocabulary (and there is no unk_token)', self.name, s) end
        cached[i] = id
      end
    end
    self.cache[piece] = cached
  end
  for _, id in ipairs(cached) do out[#out + 1] = id end
end

-- ------------------------------------------------------------ NFC (ICU)
-- libicuuc through the FFI (Debian's libicu-dev), loaded on first use; its
-- symbols carry the library's version (unorm2_normalize_72), found by trying
local icu
local function icu_lib()
  if icu then return icu end
  local ffi = require 'ffi'
  -- ICU keeps the NFC instance in a static of its own, freed only by
  -- u_cleanup. The library is opened once more with RTLD_NODELETE (0x1000 on
  -- Linux) so that it stays mapped after lua_close collects ffi.load's
  -- handle: the instance stays reachable from the library's data, not a leak.
  pcall(ffi.cdef, 'void *dlopen(const char *file, int mode);')
  local lib
  for _, nm in ipairs({ 'libicuuc.so', 'icuuc' }) do
    local ok, l = pcall(ffi.load, nm)
    if ok then
      lib = l
      pcall(function() ffi.C.dlopen(nm, 0x2 + 0x1000) end) -- RTLD_NOW | RTLD_NODELETE
      break
    end
  end
  if not lib then fail('the NFC normalizer needs ICU (libicuuc: the Debian package libicu-dev), which did not load') end
  pcall(ffi.cdef, 'typedef struct ms_icu_norm2 ms_icu_norm2;')
  local sfx = { '' }
  for v = 99, 50, -1 do sfx[#sfx + 1] = '_' .. v end
  for _, x in ipairs(sfx) do
    local tag = x == '' and 'u' or x:sub(2)
    local names = { nfc = 'ms_icu_nfc_' .. tag, norm = 'ms_icu_normalize_' .. tag, from8 = 'ms_icu_from8_' .. tag,
      to8 = 'ms_icu_to8_' .. tag }
    pcall(ffi.cdef, ([[
      const ms_icu_norm2 *%s(int *err) asm("unorm2_getNFCInstance%s");
      int32_t %s(const ms_icu_norm2 *n, const uint16_t *src, int32_t len, uint16_t *dst, int32_t cap, int *err)
        asm("unorm2_normalize%s");
      uint16_t *%s(uint16_t *dst, int32_t cap, int32_t *plen, const char *src, int32_t len, int *err)
        asm("u_strFromUTF8%s");
      char *%s(char *dst, int32_t cap, int32_t *plen, const uint16_t *src, int32_t len, int *err)
        asm("u_strToUTF8%s");
    ]]):format(names.nfc, x, names.norm, x, names.from8, x, names.to8, x))
    local ok = pcall(function() return lib[names.nfc] and lib[names.norm] and lib[names.from8] and lib[names.to8] end)
    if ok then
      local err = ffi.new('int[1]')
      local inst = lib[names.nfc](err)
      if err[0] > 0 or inst == nil then fail('ICU: unorm2_getNFCInstance failed (error %d)', err[0]) end
      icu = { ffi = ffi, lib = lib, inst = inst, norm = lib[names.norm], from8 = lib[names.from8], to8 = lib[names.to8] }
      return icu
    end
  end
  fail('the NFC normalizer: libicuuc loaded but has no unorm2_normalize of a known version')
end

-- tok.nfc(s) -> s in Unicode normalisation form C (canonical composition);
-- ASCII text is returned as it is. Invalid UTF-8 is an error.
function tok.nfc(s)
  if not s:find('[\128-\255]') then return s end
  local I = icu_lib()
  local ffi = I.ffi
  local err, len = ffi.new('int[1]'), ffi.new('int32_t[1]')
  local n = #s
  local u = ffi.new('uint16_t[?]', n + 1)
  I.from8(u, n + 1, len, s, n, err)
  if err[0] > 0 then fail('NFC: the text is not valid UTF-8 (ICU error %d)', err[0]) end
  local cap = 3 * len[0] + 16
  local v = ffi.new('uint16_t[?]', cap)
  local m = I.norm(I.inst, u, len[0], v, cap, err)
  if err[0] > 0 then fail('NFC: unorm2_normalize failed (ICU error %d)', err[0]) end
  local bcap = 3 * m + 16
  local out = ffi.new('char[?]', bcap)
  I.to8(out, bcap, len, v, m, err)
  if err[0] > 0 then fail('NFC: u_strToUTF8 failed (ICU error %d)', err[0]) end
  return ffi.string(out, len[0])
end

-- text without added tokens -> ids appended to out
function Tok:encode_ordinary(s, out, first_segment)
  if s == '' then return out end
  if self.nfc then s = tok.nfc(s) end
  local pieces = { s }
  for _, step in ipairs(self.steps) do pieces = step(pieces, first_segment) end
  for _, pc in ipairs(pieces) do
    if pc ~= '' then self:bpe(table.concat(bytes_to_chars(pc)), out) end
  end
  return out
end

-- tok:encode(s [, { allowed_special = true }]) -> list of ids (0-based)
-- added tokens found in s are their own ids unless allowed_special == false
function Tok:encode(s, opts)
  local out = {}
  if self.kind == 'bytes' then
    for i = 1, #s do out[i] = s:byte(i) end
    return out
  end
  local use_added = not (opts and opts.allowed_special == false) and #self.added_list > 0
  if not use_added then return self:encode_ordinary(s, out, true) end
  -- next occurrence of each added token at or after pos (cached)
  local nextpos = {}
  local pos, first = 1, true
  while pos <= #s do
    local best, best_len, best_id = nil, 0, nil
    for k, a in ipairs(self.added_list) do
      local p = nextpos[k]
      if p == nil or (p ~= false and p < pos) then
        p = s:find(a.content, pos, true) or false
        nextpos[k] = p
      end
      if p and (not best or p < best or (p == best and #a.content > best_len)) then
        best, best_len, best_id = p, #a.content, a.id
      end
    end
    if not best then break end
    if best > pos then self:encode_ordinary(s:sub(pos, best - 1), out, first) end
    out[#out + 1] = best_id
    pos, first = best + best_len, false
  end
  if pos <= #s then self:encode_ordinary(s:sub(pos), out, first) end
  return out
end

-- ids (a Lua list, 0-based ids) -> text; { skip_special = true } drops added tokens
function Tok:decode(ids, opts)
  local n = ids.n or #ids
  if self.kind == 'bytes' then
    local out = {}
    for i = 1, n do
      local id = ids[i]
      if id < 0 or id > 255 then fail('byte-level id %s is out of range [0, 255]', tostring(id)) end
      out[i] = string.char(id)
    end
    return table.concat(out)
  end
  local skip = opts and opts.skip_special
  local out, run = {}, {}
  local function flush()
    if #run == 0 then return end
    local s = table.concat(run)
    local cps, pos = utf8_decode(s)
    local bytes = {}
    for i = 1, #cps do
      local c = s:sub(pos[i], pos[i + 1] - 1)
      local b = char_to_byte[c]
      bytes[i] = b and string.char(b) or c
    end
    out[#out + 1] = table.concat(bytes)
    run = {}
  end
  for i = 1, n do
    local id = ids[i]
    local a = self.added_ids[id]
    if a then
      flush()
      if not skip then out[#out + 1] = a end
    else
      local s = self.id_to_token[id]
      if not s then fail('%s: id %s is not in the vocabulary', self.name, tostring(id)) end
      run[#run + 1] = s
    end
  end
  flush()
  return table.concat(out)
end

return tok
