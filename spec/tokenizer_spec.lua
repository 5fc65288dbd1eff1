-- moonshard.tokenizer: byte-level ids, byte-level BPE from a hand-made
-- tokenizer.json (merges applied by rank, both merge forms, added tokens,
-- ignore_merges, add_prefix_space, an NFC normalizer), the pre-tokenizer
-- patterns of GPT-2 and Llama 3 on hand-split text, round trips, and clear
-- refusals.
local tok = require 'moonshard.tokenizer'
local json = require 'dkjson'

-- the 256 byte symbols at ids 0..255, then the merges' results
local function tiny(opts)
  opts = opts or {}
  local vocab = {}
  for b = 0, 255 do vocab[tok.byte_to_char[b]] = b end
  local extra = { 'he', 'll', 'hell', 'hello', 'Ġw', 'or', 'Ġwor' }
  for k, s in ipairs(extra) do vocab[s] = 255 + k end -- 256 .. 262
  local merges = { 'h e', 'l l', 'he ll', 'hell o', 'Ġ w', 'o r', 'Ġw or' }
  if opts.pairs then
    for k, mg in ipairs(merges) do merges[k] = { mg:match('^(%S+) (%S+)$') } end
  end
  if opts.world then vocab['Ġworld'] = 264 end
  local t = {
    version = '1.0',
    added_tokens = { { id = 263, content = '<|endoftext|>', special = true } },
    normalizer = json.null,
    pre_tokenizer = opts.pre or { type = 'ByteLevel', add_prefix_space = opts.prefix or false, use_regex = true },
    decoder = { type = 'ByteLevel' },
    model = { type = 'BPE', vocab = vocab, merges = merges, ignore_merges = opts.ignore_merges or nil },
  }
  return json.encode(t)
end

local function random_bytes(n, seed)
  math.randomseed(seed)
  local t = {}
  for i = 1, n do t[i] = string.char(math.random(0, 255)) end
  return table.concat(t)
end

describe('byte-level tokenizer', function()
  local b = tok.bytes()
  it('has ids equal to the bytes and a vocabulary of 256', function()
    assert.are.equal(256, b.vocab_size)
    assert.are.same({ 104, 105, 0, 255 }, b:encode('hi\0\255'))
  end)
  it('round-trips random bytes', function()
    local s = random_bytes(4096, 7)
    assert.are.equal(s, b:decode(b:encode(s)))
  end)
end)

describe('BPE from tokenizer.json', function()
  local bpe = tok.from_json(tiny(), 'tiny.json')

  it('applies the merges by rank (hand-worked ids)', function()
    -- "hello": h e l l o -> he l l o (rank 0) -> he ll o (1) -> hell o (2) -> hello (3)
    -- " world": Ġ w o r l d -> Ġw o r l d (4) -> Ġw or l d (5) -> Ġwor l d (6)
    assert.are.same({ 259, 262, 108, 100 }, bpe:encode('hello world'))
    -- "helloh": hello h; "hell": he l l -> he ll -> hell; "hel": he l
    assert.are.same({ 259, 104 }, bpe:encode('helloh'))
    assert.are.same({ 258 }, bpe:encode('hell'))
    assert.are.same({ 256, 108 }, bpe:encode('hel'))
    assert.are.equal(263 + 1, bpe.vocab_size)
  end)

  it('reads merges as ["a", "b"] pairs the same as "a b" strings', function()
    local p = tok.from_json(tiny({ pairs = true }))
    local s = 'hello world, hello there: worlds of ore'
    assert.are.same(bpe:encode(s), p:encode(s))
  end)

  it('maps unmerged bytes through the byte-to-unicode table', function()
    -- a space alone is Ġ (byte 32, id 32); a newline is Ċ (byte 10)
    assert.are.same({ 32, 10 }, bpe:encode(' \n'))
    assert.are.equal('Ġ', tok.byte_to_char[32])
    assert.are.equal('Ċ', tok.byte_to_char[10])
  end)

  it('splits at added tokens and gives them their ids', function()
    assert.are.same({ 104, 105, 263, 259 }, bpe:encode('hi<|endoftext|>hello'))
    assert.are.same({ 263, 263 }, bpe:encode('<|endoftext|><|endoftext|>'))
    assert.are.equal(263, bpe:token_id('<|endoftext|>'))
    -- allowed_special = false: the text is plain text
    local plain = bpe:encode('<|endoftext|>', { allowed_special = false })
    assert.is_true(#plain > 1)
    assert.are.equal('hi<|endoftext|>hello', bpe:decode(bpe:encode('hi<|endoftext|>hello')))
    assert.are.equal('hihello', bpe:decode(bpe:encode('hi<|endoftext|>hello'), { skip_special = true }))
  end)

  it('decode(encode(s)) == s for text and for random bytes', function()
    for _, s in ipairs({ 'hello world', "It's 12345 apples,  and I'LL   go.\n\n  \tDon't\r\n",
                         'café naïve — “quoted” 日本語 x² 🙂', random_bytes(2000, 3) }) do
      assert.are.equal(s, bpe:decode(bpe:encode(s)))
    end
  end)

  it('add_prefix_space puts a space before the text', function()
    local p = tok.from_json(tiny({ prefix = true }))
    assert.are.same({ 32, 259 }, p:encode('hello'))
    assert.are.same({ 262, 108, 100 }, p:encode('world'))
  end)

  it('ignore_merges takes a whole piece found in the vocabulary', function()
    local a = tok.from_json(tiny({ world = true }))
    local b = tok.from_json(tiny({ world = true, ignore_merges = true }))
    assert.are.same({ 262, 108, 100 }, a:encode(' world'))
    assert.are.same({ 264 }, b:encode(' world'))
  end)

  it('runs a Split pre-tokenizer (Llama 3 style) before a regex-free ByteLevel', function()
    local pre = { type = 'Sequence', pretokenizers = {
      { type = 'Split', pattern = { Regex = tok.LLAMA3_PATTERN }, behavior = 'Isolated', invert = false },
      { type = 'ByteLevel', add_prefix_space = false, trim_offsets = true, use_regex = false } } }
    local l = tok.from_json(tiny({ pre = pre }))
    assert.are.same({ 259, 262, 108, 100 }, l:encode('hello world'))
    -- digits go in threes: "12345" -> "123" "45" (bytes, no merges)
    assert.are.same({ 49, 50, 51, 52, 53 }, l:encode('12345'))
    local s = "I'LL  go\r\n\r\n 1234567 x"
    assert.are.equal(s, l:decode(l:encode(s)))
  end)

  it('an NFC normalizer (Qwen\'s) composes the text before the BPE (through ICU), between added tokens; others '
    .. 'refused', function()
    local plain = tok.from_json(tiny())
    for _, norm in ipairs({ { type = 'NFC' }, { type = 'Sequence', normalizers = { { type = 'NFC' } } } }) do
      local t = json.decode(tiny())
      t.normalizer = norm
      local n = tok.from_table(t, 'nfc.json')
      local composed, decomposed = '\195\169', 'e\204\129'   -- U+00E9; e then U+0301
      assert.are.same(plain:encode(composed), n:encode(decomposed))
      assert.are_not.same(plain:encode(decomposed), n:encode(decomposed))
      assert.are.same(plain:encode('\195\133'), n:encode('\226\132\171'))   -- the Angstrom sign is U+00C5
      assert.are.same(plain:encode('hello world'), n:encode('hello world'))
      -- added tokens are matched before, the text around them composed
      local ids = n:encode(decomposed .. '<|endoftext|>' .. decomposed)
      local want = plain:encode(composed)
      local expect = {}
      for _, id in ipairs(want) do expect[#expect + 1] = id end
      expect[#expect + 1] = 263
      for _, id in ipairs(want) do expect[#expect + 1] = id end
      assert.are.same(expect, ids)
      assert.has_error(function() n:encode('a\255b') end, 'tokenizer: NFC: the text is not valid UTF-8 (ICU error 10)')
    end
    local t = json.decode(tiny())
    t.normalizer = { type = 'NFKC' }
    assert.has_error(function() tok.from_table(t, 'nfkc.json') end,
      'tokenizer: nfkc.json: normalizer NFKC is not supported (none or NFC)')
  end)

  it('refuses what it does not implement, naming it', function()
    local t = json.decode(tiny())
    t.model.type = 'WordPiece'
    assert.has_error(function() tok.from_table(t, 'wp.json') end,
      'tokenizer: wp.json: model type WordPiece is not supported (only BPE)')
    t = json.decode(tiny())
    t.pre_tokenizer = { type = 'Whitespace' }
    assert.has_error(function() tok.from_table(t, 'ws.json') end,
      'tokenizer: pre_tokenizer type Whitespace is not supported (ByteLevel, Split, Sequence)')
    t = json.decode(tiny())
    t.pre_tokenizer = json.null
    assert.has_error(function() tok.from_table(t, 'nb.json') end)
    assert.has_error(function() tok.from_json('{not json', 'bad.json') end)
    assert.has_error(function() tok.load('/nonexistent/tokenizer.json') end)
  end)
end)

describe('pre-tokenizer patterns', function()
  local function pieces(pattern, s)
    local out = {}
    for _, p in ipairs(tok.regex(pattern):split(s)) do out[#out + 1] = p[1] end
    return out
  end
  it("split text as GPT-2's pattern does", function()
    assert.are.same({ 'Hello', ' world', '!', ' It', "'s", ' 123', ' apples', ',', ' ', ' and', '\n\n ', ' go' },
      pieces(tok.GPT2_PATTERN, "Hello world! It's 123 apples,  and\n\n  go"))
    assert.are.same({ ' café', ' ²', '  ', ' “', 'x', '”' }, pieces(tok.GPT2_PATTERN, ' café ²   “x”'))
  end)
  it("split text as Llama 3's pattern does", function()
    assert.are.same({ 'I', "'LL", ' ', '123', '45', ' go', '.\n\n', '  ', ' x' },
      pieces(tok.LLAMA3_PATTERN, "I'LL 12345 go.\n\n   x"))
  end)
  it('the compiled engine agrees with the reference matcher on random text', function()
    local alphabet = { 'a', 'Z', ' ', '  ', '\n', '\r\n', '\t', '1', '23', "'", "'s", "'LL", '.', ',', '!',
                       'é', '²', '—', '“', '日本', '🙂', '\194\160' }
    math.randomseed(11)
    local patterns = { tok.GPT2_PATTERN, tok.LLAMA3_PATTERN, 'a+?Z|(?:a|1)+Z?|\\s{2,3}(?=\\S)|.',
                       '(?:ab|a)*?b|[^a-c\\d]{1,2}' }
    for _, pat in ipairs(patterns) do
      local re = tok.regex(pat)
      for _ = 1, 40 do
        local parts = {}
        for k = 1, math.random(0, 30) do parts[k] = alphabet[math.random(#alphabet)] end
        local cps = tok.utf8_decode(table.concat(parts))
        assert.are.same(re:find_all_reference(cps), re:find_all(cps))
      end
    end
  end)
  it('supports classes, counted and lazy repeats, lookahead and anchors', function()
    assert.are.same({ 'ab', 'ab', 'a' }, pieces('a[b-c]?', 'ababa'))
    assert.are.same({ '12', '34', '5' }, pieces('\\d{1,2}', '12345'))
    assert.are.same({ 'a', 'aa' }, pieces('^a', 'aaa')) -- the unmatched rest is a piece too
    assert.are.same({ 'xz', 'x', 'y' }, pieces('[xy](?!z)', 'xzxy'))
    assert.are.same({ 'aB', 'Ab' }, pieces('(?i:ab)', 'aBAb'))
    assert.are.same({ 'a', 'a' }, pieces('a+?', 'aa'))
    assert.has_error(function() tok.regex('\\p{Greek}') end)
    assert.has_error(function() tok.regex('(?:a*)*') end)
    assert.has_error(function() tok.regex('(ab') end)
  end)
end)
