"""DeepSeek V4.1's Engram: the prime layout against the release, the hash, the compressed vocabulary, memory-mapped
tables, the gated injection and the module, each against an independent computation."""

import math
import mmap
import os

import numpy as np
import pytest
import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models

from deepinfer.engine import BUNDLED_MODEL
from deepinfer.errors import CheckpointError, ConfigError
from deepinfer.loader.safetensors_reader import read_catalog
from deepinfer.loader.tokenizer import load_tokenizer
from deepinfer.models.deepseek_v41.config import DeepseekV41Config
from deepinfer.models.deepseek_v41.engram import Engram, EngramHasher, EngramLayout, EngramTable, compressed_vocabulary, is_prime, next_prime
from deepinfer.models.common.linear import PLAIN
from deepinfer_conformance.ops import run_spec
from deepinfer_cpu.device import CPUDevice
from deepinfer_interfaces import Kernels
from deepinfer_interfaces.specs import SPECS
from tests.helpers.published import V41_ENGRAM_NUM_EMBEDDINGS, V41_ENGRAM_ROW_BYTES, V41_FLASH

K = Kernels()
MASK64 = (1 << 64) - 1


def _text_config(**overrides):
    raw = {**V41_FLASH, "text_config": {**V41_FLASH["text_config"], **overrides}}
    return DeepseekV41Config.from_hf(raw).text_config


def _trial_division_prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, math.isqrt(n) + 1))


# ---- layout ------------------------------------------------------------------------------------------


def test_release_layout_reproduces_engram_num_embeddings():
    layout = EngramLayout.from_config(_text_config())
    assert [l.layer_id for l in layout.layers] == [1, 14]
    assert tuple(l.rows for l in layout.layers) == V41_ENGRAM_NUM_EMBEDDINGS
    assert layout.columns == 24
    for layer in layout.layers:
        flat = [p for row in layer.primes for p in row]
        assert len(layer.primes) == 3 and all(len(row) == 8 for row in layer.primes)
        assert list(layer.offsets) == [sum(flat[:c]) for c in range(24)]
        assert layer.rows == sum(flat)
    # the release's table bytes: 264 per row (256 e4m3 codes + 8 UE8M0 scales)
    assert V41_ENGRAM_ROW_BYTES == 256 + 256 // 32


def test_primes_are_the_consecutive_primes_from_the_vocab_size():
    layout = EngramLayout.from_config(_text_config())
    flat = [p for layer in layout.layers for row in layer.primes for p in row]
    assert all(_trial_division_prime(p) for p in flat)
    assert flat == sorted(set(flat))  # distinct, ascending across heads, sizes and layers
    # nothing prime is skipped: from 16,000,000 the sequence holds every prime up to its last
    expected = [n for n in range(16_000_000, flat[-1] + 1) if _trial_division_prime(n)]
    assert flat == expected


def test_is_prime_against_trial_division_and_known_cases():
    assert [n for n in range(3000) if is_prime(n)] == [n for n in range(3000) if _trial_division_prime(n)]
    assert is_prime(2**61 - 1) and is_prime(2**31 - 1)
    # Carmichael numbers and strong pseudoprimes to several small bases are composite
    for n in (561, 1105, 3_215_031_751, 3_825_123_056_546_413_051, 4_294_967_291 * 4_294_967_279):
        assert not is_prime(n)
    with pytest.raises(ValueError, match="exact below"):
        is_prime((2**61 - 1) * (2**31 - 1))
    assert next_prime(16_000_000 - 1) == 16_000_057 and next_prime(16_000_057) == 16_000_079


def test_layout_disagreeing_with_config_is_refused():
    with pytest.raises(ConfigError, match=r"engram_num_embeddings\[1\] is 384016681 for Engram layer 14.*384016682 rows"):
        EngramLayout.from_config(_text_config(engram_num_embeddings=[384_006_168, 384_016_681]))
    with pytest.raises(ConfigError, match=r"engram_num_embeddings\[0\] is 384006168 for Engram layer 1"):
        EngramLayout.from_config(_text_config(engram_n_heads=7))


def test_multipliers_are_odd_bounded_deterministic_per_layer():
    a = EngramLayout.from_config(_text_config())
    b = EngramLayout.from_config(_text_config())
    bound = ((2**63 - 1) // 99092) // 2
    for layer in a.layers:
        assert len(layer.multipliers) == 4
        assert all(m % 2 == 1 and 0 < m < 2 * bound for m in layer.multipliers)
        # numpy's generator seeded 10007 * layer id, drawn below the bound, doubled plus one
        draws = np.random.default_rng(10007 * layer.layer_id).integers(0, bound, size=4, dtype=np.int64)
        assert list(layer.multipliers) == [int(v) * 2 + 1 for v in draws]
    assert a == b
    assert a.layers[0].multipliers != a.layers[1].multipliers
    assert a.layers[0].primes != a.layers[1].primes


# ---- hashing -----------------------------------------------------------------------------------------


def _hash_by_hand(windows, mult, primes, offsets):
    """Python integers, 64-bit wrap and floored mod written out."""
    def signed(v):
        v &= MASK64
        return v - (1 << 64) if v >> 63 else v

    out = []
    for row in windows:
        prods = [signed(t * m) for t, m in zip(row, mult)]
        rolling, cols = prods[0], []
        for i in range(1, len(row)):
            rolling = signed(rolling ^ prods[i])
            cols += [rolling % p for p in primes[i - 1]]
        out.append([c + o for c, o in zip(cols, offsets)])
    return out


def test_hash_of_a_small_case_by_hand():
    windows = [[3, 1, 0], [4, 3, 1], [0, 0, 0]]
    mult, primes = [5, 7, 9], [[7, 11], [13, 17]]
    offsets = [0, 7, 18, 31]
    # token 1: 15 ^ 7 = 8 -> 8 % 7, 8 % 11; 8 ^ 0 = 8 -> 8 % 13, 8 % 17
    got = K.engram_hash(torch.tensor(windows), torch.tensor(mult), torch.tensor(primes), torch.tensor(offsets))
    assert got[0].tolist() == [1, 7 + 8, 18 + 8, 31 + 8]
    assert got.tolist() == _hash_by_hand(windows, mult, primes, offsets)


def test_hash_wraps_and_floors_like_int64():
    g = torch.Generator().manual_seed(3)
    windows = torch.randint(0, 1 << 20, (20, 4), generator=g)
    mult = torch.randint(0, 2**62, (4,), generator=g) * 2 + 1  # products overflow int64
    primes = torch.tensor([[10007, 10009], [10037, 10039], [10061, 10067]])
    offsets = torch.arange(6) * 20000
    got = K.engram_hash(windows, mult, primes, offsets)
    assert got.tolist() == _hash_by_hand(windows.tolist(), mult.tolist(), primes.tolist(), offsets.tolist())
    assert bool(((got - offsets) >= 0).all())


def test_hasher_gives_each_layer_ids_inside_its_columns():
    layout = EngramLayout.from_config(_text_config())
    windows = torch.from_numpy(np.random.default_rng(0).integers(0, 99092, (40, 4)))
    ids = EngramHasher(layout)(K, windows)
    assert set(ids) == {1, 14}
    for layer in layout.layers:
        got = ids[layer.layer_id]
        assert got.shape == (40, 24) and got.dtype == torch.int64
        flat = [p for row in layer.primes for p in row]
        expect = _hash_by_hand(windows.tolist(), layer.multipliers, layer.primes, layer.offsets)
        assert got.tolist() == expect
        assert all(o <= v < o + p for r in expect for v, o, p in zip(r, layer.offsets, flat))
        assert int(got.max()) < layer.rows
    # the first token sees only itself: its 2-, 3- and 4-gram differ only in the pad look-backs
    assert not torch.equal(ids[1][0], ids[1][1])


# ---- compressed vocabulary ---------------------------------------------------------------------------


def test_compressed_vocabulary_of_the_bundled_tokenizer():
    tok = load_tokenizer(BUNDLED_MODEL)
    lookup, size = compressed_vocabulary(tok)
    n = tok.get_vocab_size(with_added_tokens=True)
    assert lookup.dtype == np.int64 and lookup.shape == (n,)
    the = [tok.token_to_id(t) for t in ("The", "the", "ĠThe", "Ġthe")]
    assert None not in the and len({int(lookup[i]) for i in the}) == 1
    assert lookup[tok.token_to_id("!")] != lookup[the[0]]
    # ids are handed out in order of first appearance, with no gaps
    assert lookup[0] == 0 and size == int(lookup.max()) + 1
    assert all(lookup[t] <= lookup[:t].max() + 1 for t in range(1, n))
    assert size < n
    # a partial UTF-8 byte decodes to U+FFFD; it keys by its raw token, so two such tokens stay apart
    partial = [i for i in range(n) if "\ufffd" in tok.decode([i], skip_special_tokens=False)]
    assert len(partial) > 1 and len({int(lookup[i]) for i in partial}) == len(partial)
    with pytest.raises(ConfigError, match=rf"compress to {size} distinct.*engram_compressed_vocab_size is 99092"):
        compressed_vocabulary(tok, expected_size=99092)
    assert compressed_vocabulary(tok, expected_size=size)[1] == size


def test_compressed_vocabulary_normalisation_rules():
    words = ["Café", "cafe", "CAFE", "  ", " ", "\n\t", "x", "\u0301", "\u0300", "ﬁ", "fi", " X "]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="x"))
    lookup, size = compressed_vocabulary(tok)
    ids = dict(zip(words, lookup.tolist()))
    assert ids["Café"] == ids["cafe"] == ids["CAFE"] == 0  # accents stripped, lowercased
    assert ids["  "] == ids[" "] == ids["\n\t"] == 1  # a whitespace run is one space, and one space stays
    assert ids["x"] == ids[" X "] == 2  # stripped
    assert ids["\u0301"] != ids["\u0300"]  # normalise to nothing: keyed by their own text
    assert ids["ﬁ"] == ids["fi"]  # NFKC
    assert size == 6


# ---- tables ------------------------------------------------------------------------------------------


def _e4m3_by_bits(byte: int) -> float:
    sign = -1.0 if byte & 0x80 else 1.0
    exp, man = (byte >> 3) & 0xF, byte & 7
    if exp == 0xF and man == 7:
        return math.nan
    return sign * (man / 8 * 2.0**-6 if exp == 0 else (1 + man / 8) * 2.0 ** (exp - 7))


def _random_table(rows: int, head_dim: int = 256, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    codes = torch.randint(0, 256, (rows, head_dim), generator=g, dtype=torch.uint8)
    codes[(codes & 0x7F) == 0x7F] = 0x38  # no NaN codes
    scales = torch.randint(110, 140, (rows, head_dim // 32), generator=g, dtype=torch.uint8)
    return codes, scales


def test_lookup_decodes_e4m3_and_ue8m0_by_the_bits():
    codes, scales = _random_table(16, 64)
    ids = torch.tensor([[3, 15, 3], [0, 7, 9]])
    got = K.engram_lookup(codes.view(torch.float8_e4m3fn), scales, ids, torch.float32)
    assert got.shape == (2, 3, 64)
    for t in range(2):
        for c in range(3):
            r = int(ids[t, c])
            expect = [_e4m3_by_bits(int(codes[r, j])) * 2.0 ** (int(scales[r, j // 32]) - 127) for j in range(64)]
            assert got[t, c].tolist() == expect
    raw = K.engram_lookup(codes, scales.view(torch.float8_e8m0fnu), ids, torch.bfloat16)
    assert raw.dtype == torch.bfloat16 and torch.equal(raw.float(), got)  # exact in bf16
    with pytest.raises(ValueError, match="needs 2 scales per row"):
        K.engram_lookup(codes, scales[:, :1], ids, torch.float32)
    assert K.engram_lookup(codes, scales, torch.empty(0, 24, dtype=torch.int64), torch.bfloat16).shape == (0, 24, 64)


def _write_table(path, codes, scales, layer=1, filler=0):
    tensors = {f"layers.{layer}.engram.embed.weight": codes.view(torch.float8_e4m3fn), f"layers.{layer}.engram.embed.scale": scales}
    if filler:
        tensors["layers.0.attn.wq_a.weight"] = torch.zeros(filler, dtype=torch.uint8)
    save_file(tensors, str(path))


def test_mapped_table_reads_back_rows_equal_to_a_full_dequantized_read(tmp_path):
    codes, scales = _random_table(1000)
    path = tmp_path / "model-00001.safetensors"
    _write_table(path, codes, scales, filler=5000)
    table = EngramTable.from_catalog(read_catalog([path], None), 1)
    assert table.mapped and (table.rows, table.head_dim) == (1000, 256)
    assert table.codes.dtype == torch.float8_e4m3fn and table.scales.dtype == torch.uint8
    full = K.engram_lookup(codes, scales, torch.arange(1000)[:, None], torch.float32)[:, 0]
    ids = torch.tensor([[0, 999, 500], [17, 17, 3]])
    got = table.lookup(K, ids, torch.float32)
    assert torch.equal(got, full[ids])
    assert torch.equal(table.lookup(K, ids, torch.bfloat16), full[ids].to(torch.bfloat16))
    with pytest.raises(CheckpointError, match="no Engram table for layer 14"):
        EngramTable.from_catalog(read_catalog([path], None), 14)


def test_mapped_table_pages_in_only_the_rows_read(tmp_path):
    rows = 8192  # 2 MiB of codes: 512 pages
    codes, scales = _random_table(rows, seed=1)
    path = tmp_path / "table.safetensors"
    _write_table(path, codes, scales)
    table = EngramTable.open(path, "layers.1.engram.embed.weight", "layers.1.engram.embed.scale")
    # the table's tensors are views of the file's mapping, not copies
    region = table.regions[0]
    assert region.address <= table.codes.data_ptr() < region.address + len(region.mapping)
    if table.resident_bytes() is None:
        pytest.skip("mincore is not available here")
    fd = os.open(path, os.O_RDONLY)
    os.fsync(fd)  # written pages are clean, so they can be evicted
    os.close(fd)
    table.drop_cache()
    before = table.resident_bytes()
    if before > 16 * mmap.PAGESIZE:
        pytest.skip(f"this filesystem keeps the file in the page cache ({before} bytes after eviction)")
    ids = torch.tensor([[5, 4000, 8000, 123, 6001]])
    got = table.lookup(K, ids, torch.float32)
    touched = table.resident_bytes() - before
    # each row is at most two pages of codes and two of scales; the table is far larger
    assert 0 < touched <= 5 * 4 * mmap.PAGESIZE < table.nbytes() // 20
    full = K.engram_lookup(codes, scales, ids, torch.float32)
    assert torch.equal(got, full)
    table.drop_cache()  # pages mapped by the lookup are released too
    assert table.resident_bytes() <= before


def test_unquantized_table_and_corrupt_files(tmp_path):
    plain = torch.randn(50, 32).to(torch.bfloat16)
    path = tmp_path / "plain.safetensors"
    save_file({"layers.1.engram.embed.weight": plain}, str(path))
    table = EngramTable.from_catalog(read_catalog([path], None), 1)
    assert table.scales is None
    ids = torch.tensor([[49, 0]])
    assert torch.equal(table.lookup(K, ids, torch.float32), plain.float()[ids])
    bad = tmp_path / "truncated.safetensors"
    bad.write_bytes(path.read_bytes()[:-100])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        EngramTable.open(bad, "layers.1.engram.embed.weight")
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\xff" * 64)
    with pytest.raises(CheckpointError, match="no valid safetensors header"):
        EngramTable.open(junk, "x")


# ---- injection ---------------------------------------------------------------------------------------


def _inject_by_hand(streams, key, value, weight, eps):
    t, n, d = streams.shape
    out = torch.empty(t, n, d, dtype=torch.float64)
    for i in range(t):
        for k in range(n):
            h, q = streams[i, k].double().tolist(), key[i, k].double().tolist()
            w = weight[k].double().tolist()
            rstd = 1 / math.sqrt(sum(x * x for x in h) / d + eps) / math.sqrt(sum(x * x for x in q) / d + eps)
            dot = sum(a * b * c for a, b, c in zip(h, w, q)) * rstd / math.sqrt(d)
            sign = (dot > 0) - (dot < 0)
            gate = 1 / (1 + math.exp(-sign * math.sqrt(max(abs(dot), 1e-6))))
            out[i, k] = torch.tensor(h, dtype=torch.float64) + gate * value[i].double()
    return out


def test_inject_against_the_formula():
    g = torch.Generator().manual_seed(4)
    s, k, v, w = torch.randn(3, 2, 8, generator=g), torch.randn(3, 2, 8, generator=g), torch.randn(3, 8, generator=g), torch.randn(2, 8, generator=g)
    got = K.engram_inject(s.double(), k.double(), v.double(), w.double(), 1e-6)
    assert torch.allclose(got, _inject_by_hand(s, k, v, w, 1e-6), atol=1e-12)
    assert K.engram_inject(s.bfloat16(), k, v, w, 1e-6).dtype == torch.bfloat16


def test_inject_zero_value_is_identity_and_gates_by_hand():
    streams = torch.tensor([[[3.0, 4.0]]])  # rms 5/sqrt(2)
    key = torch.tensor([[[1.0, 1.0]]])  # rms 1
    value = torch.tensor([[10.0, -20.0]])
    weight = torch.tensor([[2.0, 0.5]])
    assert torch.equal(K.engram_inject(streams, key, torch.zeros(1, 2), weight, 0.0), streams)
    dot = (3 * 2 + 4 * 0.5) / (5 / math.sqrt(2)) / math.sqrt(2)  # = 1.6
    gate = 1 / (1 + math.exp(-math.sqrt(dot)))
    got = K.engram_inject(streams, key, value, weight, 0.0)
    assert torch.allclose(got, torch.tensor([[[3 + 10 * gate, 4 - 20 * gate]]]), atol=1e-5)
    # a negative dot gates below one half; a zero dot (sign 0) gives exactly one half
    neg = K.engram_inject(streams, key, value, -weight, 0.0)
    assert torch.allclose(neg, torch.tensor([[[3 + 10 * (1 - gate), 4 - 20 * (1 - gate)]]]), atol=1e-5)
    half = K.engram_inject(streams, key, value, torch.zeros(1, 2), 0.0)
    assert torch.equal(half, torch.tensor([[[8.0, -6.0]]]))


# ---- the module --------------------------------------------------------------------------------------


def _small_config():
    return _text_config(hidden_size=16, hc_mult=2, engram_head_dim=64, engram_n_heads=2, engram_max_ngram_size=3,
                        engram_vocab_size=50, engram_layer_ids=[1, 14], engram_num_embeddings=[1, 1])


def test_engram_module_against_a_plain_computation():
    cfg = _small_config()
    rows = 40
    cfg = cfg.model_copy(update={"engram_num_embeddings": [rows, rows]})
    g = torch.Generator().manual_seed(5)
    codes, scales = _random_table(rows, 64, seed=2)
    table = EngramTable(codes.view(torch.float8_e4m3fn), scales)
    mod = Engram(cfg, 14, torch.float32, "cpu", table=table, wkv_storage=PLAIN)
    assert set(mod.named_parameters()) == {"wkv.weight", "q_weight", "k_weight"}
    params = mod.named_parameters()
    for name, p in params.items():
        p.copy_(torch.randn(p.shape, generator=g) * 0.1)
    assert params["wkv.weight"].shape == (3 * 16, 4 * 64)
    streams = torch.randn(3, 2, 16, generator=g)
    ids = torch.randint(0, rows, (3, 4), generator=g)
    got = mod(K, streams, ids)
    dense = K.engram_lookup(codes, scales, ids, torch.float64).reshape(3, -1)
    kv = dense @ params["wkv.weight"].double().t()
    key, value = kv[:, :32].reshape(3, 2, 16), kv[:, 32:]
    expect = _inject_by_hand(streams, key, value, params["q_weight"] * params["k_weight"], cfg.rms_norm_eps)
    assert torch.allclose(got.double(), expect, atol=1e-5)
    assert mod(K, streams[:0], ids[:0]).shape == (0, 2, 16)


def test_engram_module_owns_its_table_when_none_is_given_and_checks_a_given_one():
    cfg = _small_config().model_copy(update={"engram_num_embeddings": [12, 30]})
    own = Engram(cfg, 1, torch.bfloat16, "cpu")
    names = own.named_parameters()
    assert names["embed.weight"].shape == (12, 64) and names["embed.weight"].dtype == torch.float8_e4m3fn
    assert names["embed.scale"].shape == (12, 2) and names["embed.scale"].dtype == torch.uint8
    plain = Engram(cfg, 14, torch.bfloat16, "cpu", table_storage=PLAIN).named_parameters()
    assert plain["embed.weight"].shape == (30, 64) and "embed.scale" not in plain
    with pytest.raises(CheckpointError, match=r"table is \[12, 64\], but config.json gives \[30, 64\]"):
        Engram(cfg, 14, torch.bfloat16, "cpu", table=own.table)
    with pytest.raises(ConfigError, match="layer 3 is not one of"):
        Engram(cfg, 3, torch.bfloat16, "cpu")


# ---- the op specs fail a wrong kernel --------------------------------------------------------------


class _OrHash(Kernels):
    def engram_hash(self, tokens, multipliers, primes, offsets):
        p = tokens * multipliers
        return super().engram_hash(torch.cat([p[:, :1], p[:, 1:] | p[:, :1]], 1), torch.ones_like(multipliers), primes, offsets)


class _ScaleOffByOne(Kernels):
    def engram_lookup(self, codes, scales, ids, dtype):
        return super().engram_lookup(codes, scales, ids, dtype) * (2 if scales is not None else 1)


class _SignOfZeroIsOne(Kernels):
    def engram_inject(self, streams, key, value, weight, eps):
        return super().engram_inject(streams, key, value, weight + 1e-30, eps)


@pytest.mark.parametrize(("op", "mutant"), [("engram_hash", _OrHash), ("engram_lookup", _ScaleOffByOne), ("engram_inject", _SignOfZeroIsOne)])
def test_specs_pass_the_reference_and_fail_a_wrong_kernel(op, mutant):
    assert all(r.status == "pass" for r in run_spec(SPECS[op], K, CPUDevice()))
    failed = {r.case for r in run_spec(SPECS[op], mutant(), CPUDevice()) if r.status == "fail"}
    assert failed and "empty_batch" not in failed
    if op == "engram_inject":
        assert failed == {"zero_weight_half_gate"}
