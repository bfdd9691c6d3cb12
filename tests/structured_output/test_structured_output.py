"""Structured output with a real byte-level BPE tokenizer and real xgrammar: every finished output obeys its constraint.

Outputs are random walks through the masked distribution: each step fills the
bitmask, masks zero logits with the reference ``apply_token_bitmask`` and draws
with the reference ``sample`` at temperature 1 and seeded exponential noise (so
every allowed token is equally likely), until the grammar accepts EOS or a cap.
"""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from deepinfer.structured_output.json_schema import names_unescapable
from deepinfer.structured_output.vocab import BYTE_FALLBACK, BYTE_LEVEL, byte_level_alphabet, detect_layout
from deepinfer.sampling_params import InvalidRequestError, StructuredOutputsParams
from deepinfer.structured_output import GrammarCompilerCache, RequestGrammar, allocate_bitmask, fill_batch_bitmask
from deepinfer_interfaces.kernels import Kernels, unpack_bitmask
from training.tokenizer import train_tokenizer

KERNELS = Kernels()
SPECIALS = ["<eos>", "<pad>", "<|user|>"]
CAP = 300

_KEYS = ["name", "age", "id", "user", "active", "tags", "items", "score", "color", "k", "v", "kind", "value", "date"]
_WORDS = ["alice", "bob", "red", "green", "blue", "true", "false", "null", "hello", "world", "yes", "no", "maybe"]


def _corpus(n: int = 2000) -> list[str]:
    rng = random.Random(0)

    def value(depth: int):
        r = rng.random()
        if r < 0.2:
            return rng.randint(-1000, 100000)
        if r < 0.35:
            return round(rng.uniform(-100, 100), rng.randint(0, 4))
        if r < 0.5:
            return rng.choice([True, False, None])
        if r < 0.75 or depth > 2:
            return rng.choice(_WORDS) + (str(rng.randint(0, 99)) if rng.random() < 0.3 else "")
        if r < 0.88:
            return [value(depth + 1) for _ in range(rng.randint(0, 4))]
        return {rng.choice(_KEYS): value(depth + 1) for _ in range(rng.randint(0, 3))}

    return [json.dumps({rng.choice(_KEYS): value(0) for _ in range(rng.randint(1, 4))}) for _ in range(n)]


def _tiny_tokenizer(specials: list[str]) -> Tokenizer:
    return train_tokenizer(["ab cd ef"] * 5, 30000, specials)


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return train_tokenizer(_corpus(), 800, SPECIALS)


@pytest.fixture(scope="module")
def vocab_size(tokenizer: Tokenizer) -> int:
    """The model's vocabulary: the tokenizer's padded up past the next multiple of 64, as embeddings often are."""
    return (tokenizer.get_vocab_size() // 64 + 2) * 64


@pytest.fixture(scope="module")
def cache(tokenizer: Tokenizer, vocab_size: int) -> GrammarCompilerCache:
    return GrammarCompilerCache(tokenizer, vocab_size, tokenizer.token_to_id("<eos>"))


def _allowed(bitmask: torch.Tensor, row: int, vocab_size: int) -> set[int]:
    return set(unpack_bitmask(bitmask[row : row + 1], vocab_size)[0].nonzero().flatten().tolist())


def _walk(cache: GrammarCompilerCache, tok: Tokenizer, params, seeds: list[int], cap: int = CAP):
    """Random walks for ``seeds`` as one batch (plus an unconstrained row); returns (text, finished) per seed."""
    vocab, eos = cache.vocab_size, cache.eos_token_id
    never = {tok.token_to_id(s) for s in SPECIALS[1:]} | set(range(tok.get_vocab_size(), vocab))
    grammars: list[RequestGrammar | None] = [cache.request_grammar(params) for _ in seeds] + [None]
    gens = [torch.Generator().manual_seed(s) for s in seeds]
    ids: list[list[int]] = [[] for _ in seeds]
    finished = [False] * len(seeds)
    bitmask = allocate_bitmask(len(grammars), vocab)
    for _ in range(cap):
        live = [g if g is not None and not g.is_terminated else None for g in grammars]
        rows = fill_batch_bitmask(live, bitmask)
        if not rows:
            break
        assert rows == [i for i, g in enumerate(live) if g is not None]
        assert bool((bitmask[-1] == -1).all()), "the unconstrained row was written"
        for r in rows:
            allowed = _allowed(bitmask, r, vocab)
            assert allowed and not allowed & never, "a special or padded token was allowed"
        logits = KERNELS.apply_token_bitmask(torch.zeros(len(rows), vocab), bitmask[rows])
        noise = torch.stack([torch.empty(vocab).exponential_(generator=gens[r]) for r in rows])
        n = len(rows)
        picked = KERNELS.sample(
            logits, torch.ones(n), torch.zeros(n, dtype=torch.int64), torch.ones(n), torch.zeros(n), noise
        )
        for r, t in zip(rows, picked.tolist()):
            assert grammars[r].accept(t), f"sampled token {t} outside the mask was refused"
            if t == eos:
                assert grammars[r].is_terminated
                finished[r] = True
            else:
                assert not grammars[r].is_terminated
                ids[r].append(t)
    return [(tok.decode(i, skip_special_tokens=True), f) for i, f in zip(ids, finished)]


SCHEMAS = [
    {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 8},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
        },
        "required": ["name", "age"],
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "integer"}, "active": {"type": "boolean"}},
                "required": ["id", "active"],
            }
        },
        "required": ["user"],
    },
    {"type": "array", "items": {"type": "integer", "minimum": -5, "maximum": 5}, "minItems": 1, "maxItems": 4},
    {"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 3},
    {"type": "string", "enum": ["red", "green", "blue"]},
    {"enum": [1, "two", True, None, {"x": [1, 2]}]},
    {"type": "number", "minimum": -2.5, "maximum": 10},
    {"type": "integer", "minimum": 100, "maximum": 1999},
    {"type": "integer", "exclusiveMinimum": -3, "exclusiveMaximum": 3},
    {"type": "integer", "multipleOf": 3},
    {"type": "boolean"},
    {"type": ["integer", "null"]},
    {
        "type": "object",
        "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}, "c": {"type": "null"}},
        "required": ["b"],
    },
    {"anyOf": [{"type": "integer"}, {"type": "string", "maxLength": 4}]},
    {"oneOf": [{"type": "boolean"}, {"type": "null"}]},
    {"type": "string", "maxLength": 5},
    {"type": "string", "minLength": 2, "maxLength": 3},
    {"type": ["string", "null"], "maxLength": 3},
    {"const": {"kind": "fixed", "value": 7}},
    {
        "type": "array",
        "items": {
            "type": "object",
            "properties": {"k": {"enum": ["x", "y"]}, "v": {"type": "number", "minimum": 0, "maximum": 1}},
            "required": ["k", "v"],
        },
        "maxItems": 3,
    },
    {"type": "array", "prefixItems": [{"type": "integer"}, {"type": "boolean"}], "items": False},
    {
        "type": "object",
        "properties": {
            "color": {"$ref": "#/$defs/color"},
            "tags": {"type": "array", "items": {"$ref": "#/$defs/color"}, "maxItems": 2},
        },
        "required": ["color", "tags"],
        "$defs": {"color": {"enum": ["red", "green"]}},
    },
    {"type": "string", "pattern": "^[a-z]{2,4}-[0-9]{1,3}$"},
    {"type": "string", "pattern": '^[^"]{1,4}$'},
    {
        "type": "object",
        "patternProperties": {"^[a-c]$": {"type": "integer", "minimum": 0, "maximum": 9}},
        "maxProperties": 2,
    },
    {"type": "string", "format": "uuid"},
    {"type": "string", "format": "ipv6"},
    {
        "type": "object",
        "properties": {"x": {"type": "integer"}, "y": {"type": "integer"}, "k": {"type": "boolean"}},
        "minProperties": 1,
        "maxProperties": 2,
    },
    {
        "type": "array",
        "items": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "maxItems": 2},
        "maxItems": 2,
    },
    {"type": "number"},
]


@pytest.mark.parametrize("index", range(len(SCHEMAS)))
def test_json_schema_outputs_validate(cache, tokenizer, index):
    schema = SCHEMAS[index]
    results = _walk(cache, tokenizer, StructuredOutputsParams(json=schema), seeds=[11, 22, 33, 44])
    done = [text for text, finished in results if finished]
    assert done, f"no walk finished within {CAP} tokens"
    for text in done:
        value = json.loads(text)
        jsonschema.validate(value, schema, format_checker=jsonschema.FormatChecker())


def test_schema_as_json_text_matches_dict(cache, tokenizer):
    schema = SCHEMAS[0]
    text = json.dumps(schema, indent=2)
    assert cache.compile(StructuredOutputsParams(json=text)) is cache.compile(StructuredOutputsParams(json=schema))
    for out, finished in _walk(cache, tokenizer, StructuredOutputsParams(json=text), seeds=[5]):
        if finished:
            jsonschema.validate(json.loads(out), schema)


def test_json_object_outputs_are_objects(cache, tokenizer):
    results = _walk(cache, tokenizer, StructuredOutputsParams(json_object=True), seeds=list(range(8)))
    done = [text for text, finished in results if finished]
    assert done
    for text in done:
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize(
    "regex",
    [r"[a-z]{2,5}-\d{2,3}", r"(foo|bar)+baz", r"-?\d{1,4}(\.\d{1,2})?", r"(yes|no|maybe)( sir)?", r'"[^"]{0,6}"'],
)
def test_regex_outputs_fullmatch(cache, tokenizer, regex):
    results = _walk(cache, tokenizer, StructuredOutputsParams(regex=regex), seeds=[1, 2, 3])
    done = [text for text, finished in results if finished]
    assert done
    for text in done:
        assert re.fullmatch(regex, text), text


def test_choice_outputs_are_choices(cache, tokenizer):
    choices = ["yes", "no", "yes sir", 'say "hi"', "back\\slash", "tab\tand\nnewline", "ünïcödé €", ""]
    results = _walk(cache, tokenizer, StructuredOutputsParams(choice=choices), seeds=list(range(24)))
    texts = [text for text, finished in results]
    assert all(finished for _, finished in results)
    assert set(texts) <= set(choices)
    assert len(set(texts)) >= 4


def test_ebnf_and_lark_grammars(cache, tokenizer):
    ebnf = 'root ::= "(" num ("+" num)* ")"\nnum ::= [0-9] | [1-9] [0-9]'
    lark = 'start: "[" WORD ("," WORD)* "]"\nWORD: /[a-c]{1,3}/'
    for grammar, pattern in ((ebnf, r"\((\d|[1-9]\d)(\+(\d|[1-9]\d))*\)"), (lark, r"\[[a-c]{1,3}(,[a-c]{1,3})*\]")):
        results = _walk(cache, tokenizer, StructuredOutputsParams(grammar=grammar), seeds=[1, 2, 3])
        done = [text for text, finished in results if finished]
        assert done
        for text in done:
            assert re.fullmatch(pattern, text), text


def _some_valid_tokens(cache: GrammarCompilerCache, g: RequestGrammar, n: int, seed: int) -> list[int]:
    """``n`` tokens the grammar accepts in a row from its current state (left unchanged)."""
    gen = torch.Generator().manual_seed(seed)
    bm = allocate_bitmask(1, cache.vocab_size)
    out = []
    for _ in range(n):
        g.fill_bitmask(bm, 0)
        allowed = sorted(_allowed(bm, 0, cache.vocab_size) - set(cache.stop_token_ids))
        t = allowed[int(torch.randint(len(allowed), (1,), generator=gen))]
        assert g.accept(t)
        out.append(t)
    g.rollback(n)
    return out


def test_rollback_restores_the_mask(cache):
    g = cache.request_grammar(StructuredOutputsParams(json=SCHEMAS[1]))
    vocab = cache.vocab_size
    prefix = _some_valid_tokens(cache, g, 3, seed=0)
    for t in prefix:
        assert g.accept(t)
    before = allocate_bitmask(1, vocab)
    g.fill_bitmask(before, 0)
    for k in (1, 4, 7):
        more = _some_valid_tokens(cache, g, k, seed=k)
        for t in more:
            assert g.accept(t)
        assert g.num_tokens == 3 + k
        after = allocate_bitmask(1, vocab)
        g.rollback(k)
        g.fill_bitmask(after, 0)
        assert torch.equal(after, before)
        assert g.num_tokens == 3
    with pytest.raises(ValueError, match="cannot roll back 4 tokens: the grammar has accepted 3"):
        g.rollback(4)
    g.reset()
    fresh = allocate_bitmask(1, vocab)
    cache.request_grammar(StructuredOutputsParams(json=SCHEMAS[1])).fill_bitmask(fresh, 0)
    g.fill_bitmask(before, 0)
    assert torch.equal(before, fresh) and g.num_tokens == 0


def test_rollback_past_the_stop_token(cache, tokenizer):
    eos = cache.eos_token_id
    g = cache.request_grammar(StructuredOutputsParams(choice=["yes", "no"]))
    for t in tokenizer.encode("yes").ids:
        assert g.accept(t)
    bm = allocate_bitmask(1, cache.vocab_size)
    g.fill_bitmask(bm, 0)
    assert _allowed(bm, 0, cache.vocab_size) == {eos}
    assert g.accept(eos) and g.is_terminated
    assert not g.accept(eos)
    g.fill_bitmask(bm, 0)
    assert _allowed(bm, 0, cache.vocab_size) == {eos}
    g.rollback(1)
    assert not g.is_terminated


def test_validate_draft_counts_and_keeps_state(cache, tokenizer):
    g = cache.request_grammar(StructuredOutputsParams(regex=r"[a-z]{3}-[0-9]{3}"))
    vocab = cache.vocab_size
    good = tokenizer.encode("abc-123").ids
    bad = tokenizer.encode("X").ids[0]
    eos = cache.eos_token_id
    start = allocate_bitmask(1, vocab)
    g.fill_bitmask(start, 0)
    assert g.validate_draft(good) == len(good)
    assert g.validate_draft(good + [eos]) == len(good) + 1
    assert g.validate_draft(good + [eos, good[0]]) == len(good) + 1
    assert g.validate_draft(good[:1] + [bad] + good[1:]) == 1
    assert g.validate_draft([bad]) == 0
    assert g.validate_draft([]) == 0
    now = allocate_bitmask(1, vocab)
    g.fill_bitmask(now, 0)
    assert torch.equal(now, start) and g.num_tokens == 0 and not g.is_terminated
    assert g.accept(good[0])
    assert g.validate_draft(good[1:] + [eos]) == len(good)
    assert g.num_tokens == 1


def test_fill_batch_bitmask_leaves_unconstrained_rows(cache):
    g1 = cache.request_grammar(StructuredOutputsParams(choice=["a", "b"]))
    g2 = cache.request_grammar(StructuredOutputsParams(regex=r"\d+"))
    bm = allocate_bitmask(5, cache.vocab_size)
    assert bm.dtype == torch.int32 and bm.shape == (5, (cache.vocab_size + 31) // 32)
    assert fill_batch_bitmask([None, g1, None, g2], bm) == [1, 3]
    assert bool((bm[[0, 2, 4]] == -1).all())
    assert not bool((bm[[1, 3]] == -1).all())
    with pytest.raises(ValueError, match="3 requests but the bitmask has 2 rows"):
        fill_batch_bitmask([None, g1, g2], allocate_bitmask(2, cache.vocab_size))


def test_compile_cache_returns_the_same_object(cache):
    a = cache.compile(StructuredOutputsParams(json={"type": "integer"}))
    assert cache.compile(StructuredOutputsParams(json={"type": "integer"})) is a
    assert cache.compile(StructuredOutputsParams(json='{ "type" : "integer" }')) is a
    assert cache.compile(StructuredOutputsParams(json={"type": "boolean"})) is not a
    assert cache.compile(StructuredOutputsParams(regex="ab|c")) is cache.compile(StructuredOutputsParams(regex="ab|c"))
    assert cache.compile(StructuredOutputsParams(choice=["x", "y"])) is cache.compile(
        StructuredOutputsParams(choice=["x", "y"])
    )
    assert cache.compile(StructuredOutputsParams(json_object=True)) is cache.compile(
        StructuredOutputsParams(json_object=True)
    )


def test_compile_cache_is_bounded(tokenizer, vocab_size):
    small = GrammarCompilerCache(tokenizer, vocab_size, tokenizer.token_to_id("<eos>"), max_entries=2)
    first = small.compile(StructuredOutputsParams(regex="a"))
    small.compile(StructuredOutputsParams(regex="b"))
    assert small.compile(StructuredOutputsParams(regex="a")) is first
    small.compile(StructuredOutputsParams(regex="c"))
    assert len(small) == 2
    assert small.compile(StructuredOutputsParams(regex="a")) is first
    assert small.compile(StructuredOutputsParams(regex="b")) is not None and len(small) == 2


@pytest.mark.parametrize(
    ("params", "message"),
    [
        (dict(json={"type": "strin"}), 'invalid JSON schema: Unsupported type "strin"'),
        (dict(json="{bad"), "invalid JSON schema: not valid JSON (Expecting property name"),
        (dict(json="[1, 2]"), "invalid JSON schema: the schema at / must be an object or a boolean, got list"),
        (dict(json=False), "invalid JSON schema: the schema 'false' accepts no value"),
        (
            dict(json={"type": "object", "properties": {"a": {"not": {"type": "string"}}}}),
            "invalid JSON schema: keyword 'not' at /properties/a is not supported by the structured-output compiler",
        ),
        (dict(json={"if": {"type": "integer"}, "then": {"minimum": 1}}), "keyword 'if' at / is not supported"),
        (dict(json={"type": "array", "uniqueItems": True}), "keyword 'uniqueItems' at / is not supported"),
        (dict(json={"type": "array", "contains": {"const": 1}}), "keyword 'contains' at / is not supported"),
        (dict(json={"dependentRequired": {"a": ["b"]}}), "keyword 'dependentRequired' at / is not supported"),
        (dict(json={"allOf": [{"type": "integer"}, {"minimum": 1}]}), "'allOf' with 2 schemas at / is not supported"),
        (dict(json={"type": "number", "multipleOf": 0.5}), "'multipleOf' at / is supported only for integers"),
        (
            dict(json={"type": "integer", "multipleOf": 3, "minimum": 1}),
            "'multipleOf' together with a minimum or maximum at / is not supported",
        ),
        (
            dict(json={"type": "string", "pattern": "^a+$", "maxLength": 3}),
            "'minLength'/'maxLength' together with 'pattern' at / is not supported",
        ),
        (dict(json={"$ref": "https://x.org/s.json"}), "reference 'https://x.org/s.json' at / is not supported"),
        (
            dict(json={"type": "object", "properties": {"q": {"type": "string", "pattern": '^a"b$'}}}),
            "the pattern '^a\"b$' at /properties/q names a quote, backslash or control character",
        ),
        (
            dict(json={"type": "object", "patternProperties": {"^a\\tb$": {}}}),
            "the patternProperties '^a\\\\tb$' at / names a quote",
        ),
        (dict(json={"enum": {1, 2}}), "invalid JSON schema: it cannot be written as JSON (Object of type set"),
        (dict(json={"type": "string", "maxLength": -1}), "'maxLength' at / must be a non-negative integer, got -1"),
        (dict(json={"type": "integer", "minimum": 5, "maximum": 1}), "invalid JSON schema: Invalid range"),
        (dict(regex="a(b"), "invalid regex: Regex parsing error at position 4: The parenthesis is not closed"),
        (dict(regex=r"(?<=a)b"), "invalid regex: Regex parsing error at position 3: Lookbehind is not supported yet"),
        (dict(regex=r"\p{L}+"), "invalid regex: the Unicode property class '\\p' at position 0 is not supported"),
        (dict(grammar='root ::= "a" |'), "invalid grammar: EBNF parser error at line 1"),
        (dict(grammar="root ::= foo"), 'invalid grammar: EBNF parser error at line 1, column 10: Rule "foo" is not'),
        (dict(grammar="start: nothing"), "invalid grammar: Lark error at line 1, column 8: unknown name 'nothing'"),
        (dict(choice=["ok", "nul\x00"]), "invalid choice 1 'nul\\x00': it contains a NUL character"),
    ],
)
def test_invalid_constraints_raise_one_line(cache, params, message):
    with pytest.raises(InvalidRequestError) as info:
        cache.compile(StructuredOutputsParams(**params))
    text = str(info.value)
    assert text.startswith(message) or message in text, text
    assert "\n" not in text and "/project/" not in text and "Check failed" not in text


@pytest.mark.parametrize(
    ("pattern", "refused"),
    [
        ('^a"b$', True),
        (r"^a\\d$", True),
        (r"^x\ty$", True),
        ("^x\ny$", True),
        (r"^[\\]{1,2}$", True),
        (r"^\x22$", True),
        (r"^\u0009$", True),
        (r'^[^"\\]{0,3}$', False),
        (r"^[\x00-\x7f]+$", False),
        (r"^[!-#]+$", False),
        (r"^a\.b\d+\s?$", False),
        (r"^[a-z]{2,4}-[0-9]{1,3}$", False),
    ],
)
def test_patterns_naming_unescapable_characters_are_refused(pattern, refused):
    assert names_unescapable(pattern) is refused


def test_tokenizer_vocabulary_for_the_compiler(cache, tokenizer, vocab_size):
    import xgrammar as xgr

    info = cache.tokenizer_info
    assert info.vocab_type == xgr.VocabType.BYTE_LEVEL and info.vocab_size == vocab_size
    assert info.stop_token_ids == [tokenizer.token_to_id("<eos>")]
    special = set(info.special_token_ids)
    assert {tokenizer.token_to_id("<pad>"), tokenizer.token_to_id("<|user|>")} <= special
    assert set(range(tokenizer.get_vocab_size(), vocab_size)) <= special
    decoded = info.decoded_vocab
    for text in ('{"name": 12}', " hello world\n", "ünï €"):
        assert b"".join(decoded[t] for t in tokenizer.encode(text).ids) == text.encode()
    alphabet = byte_level_alphabet()
    assert len(set(alphabet)) == 256 and set(alphabet) == set(pre_tokenizers.ByteLevel.alphabet())


def test_vocabulary_layout_matches_xgrammar_detection(tokenizer):
    import xgrammar as xgr

    def xgr_detect(tok: Tokenizer):
        meta = xgr.TokenizerInfo._detect_metadata_from_hf(tok.to_str())
        return meta["vocab_type"].name.lower(), meta["add_prefix_space"]

    layout = detect_layout(json.loads(tokenizer.to_str()))
    assert (layout.vocab_type, layout.add_prefix_space) == (BYTE_LEVEL, False) == xgr_detect(tokenizer)

    sp = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    sp.pre_tokenizer = pre_tokenizers.Metaspace(replacement="▁", prepend_scheme="always")
    sp.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()])
    trainer = trainers.BpeTrainer(vocab_size=60, special_tokens=["<unk>"], show_progress=False)
    sp.train_from_iterator(["hello world"] * 20, trainer)
    layout = detect_layout(json.loads(sp.to_str()))
    assert (layout.vocab_type, layout.add_prefix_space) == (BYTE_FALLBACK, True) == xgr_detect(sp)


def test_added_non_special_tokens_match_their_text(vocab_size):
    tok = _tiny_tokenizer(["<eos>"])
    tok.add_tokens(["<think> now"])
    added = tok.token_to_id("<think> now")
    cache = GrammarCompilerCache(tok, vocab_size, tok.token_to_id("<eos>"))
    assert cache.tokenizer_info.decoded_vocab[added] == b"<think> now"
    g = cache.request_grammar(StructuredOutputsParams(regex="<think> now!"))
    assert g.accept(added)


def test_bad_construction(tokenizer):
    with pytest.raises(ValueError, match="eos_token_id 5000 is outside the vocabulary of 1000 tokens"):
        GrammarCompilerCache(tokenizer, 1000, 5000)


def test_end_token_found_by_name_without_eos_id():
    tok = _tiny_tokenizer(["<｜begin▁of▁sentence｜>", "<｜end▁of▁sentence｜>"])
    cache = GrammarCompilerCache(tok, 320, None)
    end, begin = tok.token_to_id("<｜end▁of▁sentence｜>"), tok.token_to_id("<｜begin▁of▁sentence｜>")
    assert cache.stop_token_ids == [end]
    assert begin in cache.tokenizer_info.special_token_ids
    g = cache.request_grammar(StructuredOutputsParams(regex="ab"))
    assert g.accept(tok.token_to_id("ab")) and g.accept(end) and g.is_terminated

    with pytest.raises(ValueError, match="no recognisable end-of-sequence token; pass eos_token_id"):
        GrammarCompilerCache(_tiny_tokenizer(["<stop_here>"]), 320, None)
