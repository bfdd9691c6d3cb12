"""The KV store under the prefix cache: blocks shared across engines and processes, retention classes, faults."""

import json
import logging
import os
import struct
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from deepinfer.block_pool import chain_hashes
from deepinfer.cli import main as cli_main
from deepinfer.errors import ConfigError
from deepinfer.kv_store.block_file import BadBlockFile, PartShape, decode, encode
from deepinfer.kv_store.layout import block_path
from deepinfer.kv_store.policy import parse_duration, parse_size
from deepinfer.llm import LLM
from deepinfer.sampling_params import InvalidRequestError, SamplingParams
from deepinfer_interfaces.kv_format import KVFormat, pack_rows
from tests.helpers.checkpoints import BOS_ID, byte_tokens, make_tiny_checkpoint
from tests.helpers.subprocesses import ROOT, run_python

GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
ENGINE = dict(kv_cache_memory=64 << 20, max_model_len=1024, max_num_batched_tokens=256, max_prefill_chunk=256)


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ck"), "mixed")


def _prompts(prefix_len=200, users=3, seed=0):
    system = [BOS_ID] + byte_tokens(prefix_len, seed)
    return [system + byte_tokens(5 + 3 * i, 100 + seed + i) for i in range(users)]


def _llm(ckpt, store=None, **kw):
    return LLM(model=str(ckpt), backend="cpu", kv_store=None if store is None else str(store), **{**ENGINE, **kw})


def _serve(llm, prompts, params=GREEDY):
    """Each prompt alone, in order: a later one may hit what an earlier one committed."""
    return [llm.generate([p], params)[0].outputs[0].token_ids for p in prompts]


def _serve_into(llm, prompts, params=GREEDY):
    _serve(llm, prompts, params)
    return llm


def _done(llm):
    """Every write handed to the store is on disk."""
    llm.engine.store.flush()
    return llm.get_metrics()


def _files(store, suffix=".kvb"):
    return sorted(p for p in Path(store).rglob(f"*{suffix}"))


def _shared_paths(llm, prompts, cache_class="default"):
    """The stored files of the blocks every prompt shares, in chain order."""
    block = llm.engine.kv.block_size
    shared = os.path.commonprefix(prompts)
    hashes = chain_hashes(shared[: len(shared) // block * block], block, llm.engine.kv.salt)
    return [block_path(llm.engine.store.root, cache_class, llm.engine.store.fingerprint, h) for h in hashes]


@pytest.fixture(scope="module")
def reference(ckpt):
    """Outputs with no prefix caching, and with in-memory hits under bounded replay."""
    prompts = _prompts()
    plain = _serve(_llm(ckpt, enable_prefix_caching=False), prompts)
    bounded = _serve(_llm(ckpt, swa_replay="bounded"), prompts)
    return prompts, plain, bounded


@pytest.mark.parametrize("replay", ["exact", "bounded"])
def test_fresh_engine_hits_the_store_like_memory(ckpt, reference, tmp_path, replay):
    prompts, plain, bounded = reference
    first = _llm(ckpt, tmp_path, swa_replay=replay)
    assert _serve(first, prompts[:1]) == (plain if replay == "exact" else bounded)[:1]
    written = _done(first)
    assert written["kv_store_misses"] == 1 and written["kv_store_hits"] == 0 and written["kv_store_blocks_written"] > 0
    assert written["kv_store_bytes_written"] == sum(p.stat().st_size for p in _files(tmp_path))

    second = _llm(ckpt, tmp_path, swa_replay=replay)  # nothing in its memory: the prefix comes from the store
    out = _serve(second, prompts[1:])
    assert out == (plain if replay == "exact" else bounded)[1:]
    m = _done(second)
    block = second.engine.kv.block_size
    per_hit = len(prompts[0][:201]) // block * block
    window = second.engine.replay_tokens if replay == "exact" else second.engine.runner.config.sliding_window
    assert m["kv_store_hits"] == 1 and m["kv_store_hit_tokens"] == per_hit  # the second prompt then hits in memory
    assert m["cached_tokens"] == 2 * per_hit and m["replayed_tokens"] == 2 * window
    assert m["kv_store_bytes_read"] == sum(p.stat().st_size for p in _shared_paths(second, prompts))


def test_processes_share_one_store_under_concurrent_writers(ckpt, reference, tmp_path):
    prompts, plain, _ = reference
    store = tmp_path / "store"

    def spec(name, ps):
        path = tmp_path / f"{name}.json"
        path.write_text(json.dumps({"model": str(ckpt), "store": str(store), "prompts": ps, "engine": {**ENGINE, "swa_replay": "exact"}}))
        return ["-m", "tests.helpers.kv_store_worker", str(path)]

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    writers = [subprocess.Popen([sys.executable, *spec(f"w{i}", prompts[:1])], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
               for i in range(2)]
    try:
        results = [w.communicate(timeout=180) for w in writers]
    finally:
        for w in writers:
            w.kill()
    for w, (out, err) in zip(writers, results):
        assert w.returncode == 0, err[-2000:]
        assert json.loads(out.splitlines()[-1])["tokens"] == plain[:1]
    assert not _files(store, ".tmp")  # renamed into place whole, or not at all

    run = run_python(spec("reader", prompts[1:]))
    assert run.returncode == 0, run.stderr[-2000:]
    reader = json.loads(run.stdout.splitlines()[-1])
    assert reader["tokens"] == plain[1:]
    m = reader["metrics"]
    assert m["kv_store_hits"] == 1 and m["kv_store_bad_files"] == 0 and m["cached_tokens"] > 0


@pytest.mark.parametrize("damage", ["flip", "truncate", "foreign", "other_block"])
def test_bad_files_are_ignored_and_recomputed(ckpt, reference, tmp_path, damage):
    prompts, plain, _ = reference
    first = _llm(ckpt, tmp_path, swa_replay="exact")
    _serve(first, prompts[:1])
    _done(first)
    paths = _shared_paths(first, prompts)
    bad = paths[3]
    data = bad.read_bytes()
    if damage == "flip":
        at = len(data) - 20  # in the payload
        data = data[:at] + bytes([data[at] ^ 1]) + data[at + 1 :]
    elif damage == "truncate":
        data = data[: len(data) // 2]
    elif damage == "foreign":  # a well-formed file from an engine with other weights or settings
        store = first.engine.store
        tensors = decode(data, store.fingerprint, int(bad.stem, 16), store.parts)
        data = encode("0" * 32, int(bad.stem, 16), store.parts, tensors)
    else:
        data = paths[4].read_bytes()
    bad.write_bytes(data)

    second = _llm(ckpt, tmp_path, swa_replay="exact")
    assert _serve(second, prompts[1:]) == plain[1:]
    m = _done(second)
    assert m["kv_store_bad_files"] == 1 and m["kv_store_hit_blocks"] == 3  # the run of good blocks before it
    store = second.engine.store
    decode(bad.read_bytes(), store.fingerprint, int(bad.stem, 16), store.parts)  # recomputed and stored anew


GREEDY_LP = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=2)


def _serve_lp(llm, prompts):
    """Each prompt alone, in order: its tokens and every position's top log-probabilities."""
    outs = [llm.generate([p], GREEDY_LP)[0].outputs[0] for p in prompts]
    return [(o.token_ids, [{t: lp.logprob for t, lp in pos.items()} for pos in o.logprobs]) for o in outs]


def test_packed_blocks_round_trip_through_the_store(ckpt, tmp_path):
    """kv_cache_dtype fp8: blocks are stored as the records the cache holds, and a fresh engine that loads them
    continues exactly as the engine that wrote them did from its memory."""
    prompts = _prompts()
    first = _llm(ckpt, tmp_path, kv_cache_dtype="fp8", swa_replay="exact")
    assert first.engine.runner.cache.formats.name == "fp8"
    wrote = _serve_lp(first, prompts)  # the second and third prompts hit the first one's blocks in memory
    m = _done(first)
    assert m["kv_store_blocks_written"] > 0 and first.get_metrics()["cached_tokens"] > 0
    header = json.loads(_header(_files(tmp_path)[0]))
    assert {p[3] for p in header["parts"]} == {"uint8"} and {p[4]["name"] for p in header["parts"]} == {"v4.kv.fp8", "v4.index.fp4"}

    second = _llm(ckpt, tmp_path, kv_cache_dtype="fp8", swa_replay="exact")
    assert _serve_lp(second, prompts[1:]) == wrote[1:]
    m = _done(second)
    assert m["kv_store_hits"] >= 1 and m["kv_store_bad_files"] == 0 and m["kv_store_hit_blocks"] >= 200 // 16
    assert second.get_metrics()["computed_tokens"] < sum(len(p) for p in prompts[1:])  # the prefix came from the store


@pytest.mark.parametrize("part", ["kv", "index"])
def test_a_corrupted_scale_is_a_refused_file(ckpt, tmp_path, part):
    """A stored fp8 block whose record holds a NaN scale (ue8m0 0xFF) under a valid checksum is refused naming
    its part, counted, deleted and recomputed; the run of good blocks before it still loads."""
    prompts = _prompts()
    expected = _serve(_llm(ckpt, kv_cache_dtype="fp8", swa_replay="exact"), prompts)  # no store
    first = _llm(ckpt, tmp_path, kv_cache_dtype="fp8", swa_replay="exact")
    assert _serve(first, prompts[:1]) == expected[:1]
    _done(first)
    store = first.engine.store
    bad = _shared_paths(first, prompts)[3]
    tensors = decode(bad.read_bytes(), store.fingerprint, int(bad.stem, 16), store.parts)
    k, shape = next((k, p) for k, p in enumerate(store.parts) if p.name == f"layers.1.{part}")
    tensors[k][1, shape.format.scale_offset] = 0xFF
    bad.write_bytes(encode(store.fingerprint, int(bad.stem, 16), store.parts, tensors))
    with pytest.raises(BadBlockFile, match=rf"scale out of range .* in part layers\.1\.{part}, record 1"):
        decode(bad.read_bytes(), store.fingerprint, int(bad.stem, 16), store.parts)

    second = _llm(ckpt, tmp_path, kv_cache_dtype="fp8", swa_replay="exact")
    assert _serve(second, prompts[1:]) == expected[1:]
    m = _done(second)
    assert m["kv_store_bad_files"] == 1 and m["kv_store_hit_blocks"] == 3
    decode(bad.read_bytes(), store.fingerprint, int(bad.stem, 16), store.parts)  # recomputed and stored anew


def test_fp8_store_files_are_smaller_by_the_geometry_ratio(ckpt, tmp_path):
    """Each file's payload is the geometry's bytes per block, so fp8 files shrink by its ratio to the model dtype's."""
    prompts = _prompts()[:1]
    payload, files = {}, {}
    for kv in ("model", "fp8"):
        llm = _llm(ckpt, tmp_path / kv, kv_cache_dtype=kv)
        _serve(llm, prompts)
        m = _done(llm)
        runner = llm.engine.runner
        per_block = runner.geometry.bytes_per_block(runner.dtype)
        sizes = {p.name: (p.stat().st_size, _payload_bytes(p)) for p in _files(tmp_path / kv)}
        assert len(sizes) == m["kv_store_blocks_written"] >= 200 // 16 and {b for _, b in sizes.values()} == {per_block}
        assert llm.engine.store.block_bytes == per_block
        payload[kv], files[kv] = per_block, sizes
    assert files["model"].keys() == files["fp8"].keys()  # the same blocks (hashes) either way
    ratio = payload["model"] / payload["fp8"]
    assert payload["model"] == 448 and payload["fp8"] == 172 and ratio > 2.5  # 4 + 4 + 1 rows of 16 / 8 / 16 channels
    for name, (size, _) in files["fp8"].items():
        model_size = files["model"][name][0]
        header_growth = (size - payload["fp8"]) - (model_size - payload["model"])
        assert 0 < header_growth < 400  # the fp8 header names each part's record format
        assert size < model_size / ratio + (size - payload["fp8"])


def _header(path: Path) -> bytes:
    data = path.read_bytes()
    (n,) = struct.unpack_from("<I", data, 8)
    return data[12 : 12 + n]


def _payload_bytes(path: Path) -> int:
    """A block file's rows: all but the magic, header length, header and digest."""
    return path.stat().st_size - 12 - len(_header(path)) - 16


def test_engines_that_must_not_share_state_do_not(ckpt, reference, tmp_path):
    prompts, _, _ = reference
    store = tmp_path / "store"
    _done(_serve_into(_llm(ckpt, store), prompts[:1]))
    other_weights = make_tiny_checkpoint(tmp_path / "other", "mixed", seed=1)
    for llm in (_llm(other_weights, store), _llm(ckpt, store, dtype="bfloat16"), _llm(ckpt, store, kv_cache_dtype="fp8")):
        _serve(llm, prompts[1:2])
        m = _done(llm)
        assert m["kv_store_hits"] == 0 and m["kv_store_misses"] == 1 and m["kv_store_bad_files"] == 0
    assert len({p.parent.parent.name for p in _files(store)}) == 4  # one fingerprint per engine kind


def test_retention_classes_expire_apart(ckpt, tmp_path, capsys):
    retention = {"chat": "7d", "agent": "3d"}
    llm = _llm(ckpt, tmp_path, kv_store_retention=retention)
    chat, agent = _prompts(seed=1)[0], _prompts(seed=2)[0]
    _serve(llm, [chat], SamplingParams(temperature=0, max_tokens=2, cache_class="chat"))
    _serve(llm, [agent], SamplingParams(temperature=0, max_tokens=2, cache_class="agent"))
    _done(llm)
    counts = {c: len(_files(tmp_path / c)) for c in retention}
    assert counts["chat"] > 0 and counts["agent"] > 0
    old = time.time() - 4 * 86400  # unused for four days: past the agent class's three
    for p in _files(tmp_path):
        os.utime(p, (old, old))

    assert cli_main(["kv-store", "prune", str(tmp_path), "--json"]) == 0  # the rules the engine wrote beside the blocks
    report = {c["cache_class"]: c for c in json.loads(capsys.readouterr().out)["classes"]}
    assert report["agent"]["expired_files"] == counts["agent"] and report["agent"]["kept_files"] == 0
    assert report["chat"]["expired_files"] == 0 and report["chat"]["kept_files"] == counts["chat"]
    assert not _files(tmp_path / "agent") and len(_files(tmp_path / "chat")) == counts["chat"]

    assert cli_main(["kv-store", "stats", str(tmp_path), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["classes"]["chat"]["files"] == counts["chat"] and stats["classes"]["agent"]["files"] == 0
    assert stats["classes"]["agent"]["ttl_seconds"] == 3 * 86400 and stats["default_class"] == "chat"


def test_capacity_evicts_least_recently_used(ckpt, tmp_path, capsys):
    first = _llm(ckpt, tmp_path, swa_replay="exact")
    a, b = _prompts(seed=3), _prompts(seed=4)
    _serve(first, [a[0], b[0]])
    _done(first)
    old = time.time() - 3600
    for p in _files(tmp_path):
        os.utime(p, (old, old))
    second = _llm(ckpt, tmp_path, swa_replay="exact")
    _serve(second, [a[1]])  # reading a's blocks is a use: they are the recent ones now
    _done(second)
    used = _shared_paths(second, a[:2])
    keep = sum(p.stat().st_size for p in _files(tmp_path) if p.stat().st_mtime > old + 60)
    assert cli_main(["kv-store", "prune", str(tmp_path), "--retention", '{"default": "7d"}', "--capacity", str(keep), "--json"]) == 0
    result = json.loads(capsys.readouterr().out)["classes"][0]
    assert result["evicted_files"] > 0 and result["kept_bytes"] <= keep
    assert all(p.exists() for p in used)
    assert not any(p.exists() for p in _shared_paths(second, b[:2]))


def test_engine_keeps_a_class_near_its_capacity(ckpt, tmp_path):
    llm = _llm(ckpt, tmp_path, kv_store_capacity="6KiB")
    _serve(llm, [p[0] for p in (_prompts(seed=s) for s in range(5, 9))], SamplingParams(temperature=0, max_tokens=1))
    m = _done(llm)
    on_disk = sum(p.stat().st_size for p in _files(tmp_path))
    assert m["kv_store_bytes_written"] > 6 * 1024 and m["kv_store_pruned_bytes"] > 0
    assert on_disk == m["kv_store_bytes_written"] - m["kv_store_pruned_bytes"] and on_disk <= 6 * 1024 * 1.1 + 2048


def test_store_that_cannot_be_created_warns_once(ckpt, reference, tmp_path, caplog):
    prompts, plain, _ = reference
    (tmp_path / "file").write_text("")
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        llm = _llm(ckpt, tmp_path / "file" / "store", swa_replay="exact")
        assert _serve(llm, prompts) == plain
    assert llm.engine.store is None
    warnings = [r.getMessage() for r in caplog.records if "kv_store" in r.getMessage()]
    assert len(warnings) == 1 and "running without the store" in warnings[0]
    assert llm.get_metrics()["kv_store_hits"] == 0


def test_unwritable_store_still_serves_its_blocks(ckpt, reference, tmp_path, caplog):
    prompts, plain, _ = reference
    _done(_serve_into(_llm(ckpt, tmp_path, swa_replay="exact"), prompts[:1]))
    before = _files(tmp_path)
    (tmp_path / "retention.json").unlink()
    (tmp_path / "retention.json").mkdir()  # the policy cannot be written: the store is read-only to this engine
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        llm = _llm(ckpt, tmp_path, swa_replay="exact")
        assert _serve(llm, prompts[1:]) == plain[1:]
    m = _done(llm)
    assert m["kv_store_hits"] == 1 and m["kv_store_blocks_written"] == 0 and _files(tmp_path) == before
    assert len([r for r in caplog.records if "reading stored blocks only" in r.getMessage()]) == 1


def test_full_disk_degrades_to_no_store_with_one_warning(ckpt, reference, tmp_path):
    prompts, plain, _ = reference
    spec = tmp_path / "spec.json"
    spec.write_text(json.dumps({"model": str(ckpt), "store": str(tmp_path / "store"), "prompts": prompts,
                                "engine": {**ENGINE, "swa_replay": "exact"}, "fsize_limit": 64}))
    run = run_python(["-m", "tests.helpers.kv_store_worker", str(spec)])
    assert run.returncode == 0, run.stderr[-2000:]
    out = json.loads(run.stdout.splitlines()[-1])
    assert out["tokens"] == plain
    assert len(out["warnings"]) == 1 and "writing failed" in out["warnings"][0]
    m = out["metrics"]
    assert m["kv_store_blocks_written"] == 0 and m["kv_store_blocks_dropped"] > 0
    assert not _files(tmp_path / "store") and not _files(tmp_path / "store", ".tmp")


def test_bad_settings_and_classes_are_refused_clearly(ckpt, tmp_path):
    with pytest.raises(ConfigError, match="'soon' is not a duration"):
        _llm(ckpt, tmp_path, kv_store_retention={"chat": "soon"})
    with pytest.raises(ConfigError, match="kv_store_capacity names class 'agent'"):
        _llm(ckpt, tmp_path, kv_store_capacity={"agent": "1GB"})
    with pytest.raises(ConfigError, match="kv_store_default_class 'agent' is not a kv_store_retention class"):
        _llm(ckpt, tmp_path, kv_store_default_class="agent")
    with pytest.raises(InvalidRequestError, match="cache class 'a b' is not a valid name"):
        SamplingParams(cache_class="a b")
    llm = _llm(ckpt, tmp_path, kv_store_retention={"chat": "7d"})
    prompts = _prompts(prefix_len=40)
    outs = llm.generate(prompts[:2], [GREEDY, SamplingParams(temperature=0, max_tokens=2, cache_class="agent")])
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) == 6
    assert "cache_class 'agent' is not a retention class of the KV store (known: chat)" in outs[1].error


def test_cli_errors_name_the_fix(tmp_path, capsys):
    assert cli_main(["kv-store", "stats", str(tmp_path / "none")]) == 2
    assert "does not exist" in capsys.readouterr().err
    assert cli_main(["kv-store", "prune", str(tmp_path)]) == 2
    assert "no readable retention.json" in capsys.readouterr().err
    assert cli_main(["kv-store", "prune", str(tmp_path), "--retention", "7d"]) == 2
    assert "--retention '7d' is not JSON" in capsys.readouterr().err


def test_durations_and_sizes():
    assert parse_duration("7d") == 7 * 86400 and parse_duration("36h") == 36 * 3600 and parse_duration(45) == 45.0
    assert parse_duration("2w") == 14 * 86400 and parse_duration("1.5m") == 90
    assert parse_size("80GB") == 80 << 30 and parse_size("512MiB") == 512 << 20 and parse_size(100) == 100
    for bad in ("0d", "soon", "-1h"):
        with pytest.raises(ValueError):
            parse_duration(bad)
    for bad in ("0", "lots", "5XB"):
        with pytest.raises(ValueError):
            parse_size(bad)


def test_block_file_checks():
    parts = [PartShape("a", 2, 3, torch.float32), PartShape("b", 1, 4, torch.float32)]
    tensors = [torch.randn(2, 3), torch.randn(1, 4)]
    data = encode("f" * 32, 7, parts, tensors)
    back = decode(data, "f" * 32, 7, parts)
    assert all(torch.equal(x, y) for x, y in zip(back, tensors))
    cases = {
        "checksum mismatch": (data[:-1] + bytes([data[-1] ^ 1]), "f" * 32, 7, parts),
        "not a block file": (b"junk", "f" * 32, 7, parts),
        "fingerprint mismatch": (data, "e" * 32, 7, parts),
        "another block": (data, "f" * 32, 8, parts),
        "layout differs": (data, "f" * 32, 7, [PartShape("a", 2, 3, torch.float32), PartShape("b", 2, 2, torch.float32)]),
        "part a is stored as 2 rows of 3 float32, this cache holds 2 rows of 3 bfloat16":
            (data, "f" * 32, 7, [PartShape("a", 2, 3, torch.bfloat16), parts[1]]),
    }
    for reason, (raw, fp, h, ps) in cases.items():
        with pytest.raises(BadBlockFile, match=reason):
            decode(raw, fp, h, ps)


#: one record format per scale kind: 16 FP8 codes with ue8m0 scales, 8 FP4 codes with e4m3 or fp32 scales
SCALE_FORMATS = {
    "ue8m0": KVFormat("t.fp8", 16, "e4m3", 8, "ue8m0"),
    "e4m3": KVFormat("t.fp4", 8, "e2m1", 4, "e4m3"),
    "fp32": KVFormat("t.fp4f", 8, "e2m1", 4, "fp32"),
}
#: scale bytes that are not scales, by scale kind: NaN, infinite, zero or negative
BAD_SCALES = {
    "ue8m0": [b"\xff"],
    "e4m3": [b"\x7f", b"\x00", b"\xb8"],  # NaN, zero, -1.0
    "fp32": [struct.pack("<f", v) for v in (float("nan"), float("inf"), 0.0, -1.0)],
}


@pytest.mark.parametrize("scale", sorted(SCALE_FORMATS))
def test_a_packed_part_with_a_bad_scale_is_refused_naming_the_part(scale):
    fmt = SCALE_FORMATS[scale]
    parts = [PartShape("layers.1.kv", 3, fmt.record_bytes, torch.uint8, fmt)]
    records = pack_rows(torch.randn(3, fmt.dim), fmt)
    assert torch.equal(decode(encode("f" * 32, 7, parts, [records]), "f" * 32, 7, parts)[0], records)
    for bad in BAD_SCALES[scale]:
        damaged = records.clone()
        damaged[2, fmt.scale_offset : fmt.scale_offset + len(bad)] = torch.tensor(list(bad), dtype=torch.uint8)
        data = encode("f" * 32, 7, parts, [damaged])  # a valid checksum over a bad scale
        with pytest.raises(BadBlockFile, match=r"scale out of range .* in part layers\.1\.kv, record 2"):
            decode(data, "f" * 32, 7, parts)
    plain = [PartShape("layers.1.kv", 3, fmt.dim, torch.float32)]  # the same block of a model-dtype cache
    stored_as = rf"part layers\.1\.kv is stored as 3 {fmt.name} records of {fmt.record_bytes} uint8"
    with pytest.raises(BadBlockFile, match=rf"its layout differs .* {stored_as}, this cache holds 3 rows of {fmt.dim} float32"):
        decode(encode("f" * 32, 7, parts, [records]), "f" * 32, 7, plain)


def test_block_hashes_are_the_same_in_every_process():
    tokens = list(range(300))
    script = "from deepinfer.block_pool import chain_hashes; print(chain_hashes(list(range(300)), 64, 'salt'))"
    runs = {run_python(["-c", script], env={"PYTHONHASHSEED": seed}).stdout.strip() for seed in ("1", "2")}
    assert runs == {str(chain_hashes(tokens, 64, "salt"))}


def test_store_without_prefix_caching_says_it_is_unused(ckpt, tmp_path, caplog):
    with caplog.at_level(logging.WARNING, logger="deepinfer"):
        llm = _llm(ckpt, tmp_path, enable_prefix_caching=False)
    assert llm.engine.store is None and not any(tmp_path.iterdir())
    assert any("set enable_prefix_caching=True" in r.getMessage() for r in caplog.records)


def test_retention_from_the_environment():
    from deepinfer.config import load_config

    config = load_config({}, env={"DEEPINFER_KV_STORE": "/tmp/kv", "DEEPINFER_KV_STORE_RETENTION": '{"chat": "7d", "agent": "3d"}'})
    assert config.kv_store == "/tmp/kv" and config.kv_store_retention == {"chat": "7d", "agent": "3d"}
    with pytest.raises(ConfigError, match="is not a JSON object"):
        load_config({}, env={"DEEPINFER_KV_STORE_RETENTION": '{"chat": 7d}'})


def test_expert_parallel_ranks_write_what_one_device_reads(ckpt, reference, tmp_path):
    prompts, plain, _ = reference
    ep = _llm(ckpt, tmp_path, swa_replay="exact", expert_parallel_size=2)
    try:
        assert _serve(ep, prompts[:1]) == plain[:1]
    finally:
        ep.close()  # each rank finishes its store writes
    single = _llm(ckpt, tmp_path, swa_replay="exact")
    assert _serve(single, prompts[1:]) == plain[1:]
    m = _done(single)
    assert m["kv_store_hits"] == 1 and m["kv_store_bad_files"] == 0
