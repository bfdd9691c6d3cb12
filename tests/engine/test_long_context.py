"""Long contexts on a tiny random config with a million-token position range (YaRN) and V4-Flash's
compress ratios (4 and 128): a 128K-token prefill through the engine, its prefix hit with exact
replay, its last position against the untiled ops, and a peak memory that does not grow with the
context. Each prefill runs in its own process (``tests/helpers/long_prefill.py``), so its peak RSS
is its own."""

from __future__ import annotations

import json

import pytest

from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.subprocesses import run_python

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("long"), "long_context")


def _prefill(ckpt, tmp_path, tokens: int, parity: int = 0) -> dict:
    out = tmp_path / f"prefill-{tokens}.json"
    args = ["-m", "tests.helpers.long_prefill", str(ckpt), str(tokens), str(out)] + (["--parity", str(parity)] if parity else [])
    proc = run_python(args, timeout=1500, env={"OMP_NUM_THREADS": "2"})  # the parent only waits
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.fixture(scope="module")
def runs(ckpt, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("runs")
    return {n: _prefill(ckpt, tmp, n, parity=256 if n == 131072 else 0) for n in (32768, 131072)}


def test_config_reaches_a_million_positions(ckpt):
    config = json.loads((ckpt / "config.json").read_text())
    assert config["max_position_embeddings"] >= 1 << 20
    assert config["rope_parameters"]["compress"]["rope_type"] == "yarn"  # the compressed layers' rope, as V4 scales it


def test_128k_prefill_last_position_equals_the_untiled_ops(runs):
    run = runs[131072]
    assert run["parity_max_abs"] <= 1e-4 * max(1.0, run["parity_logits_scale"]), run


def test_128k_prefix_hit_with_exact_replay_continues_the_first_run(runs):
    """The prompt plus its first token, from the prefix cache: the token and log-probability the first
    run produced second (exact replay recomputes the window from the cached compressed state)."""
    run = runs[131072]
    assert run["hit_cached_tokens"] >= 131072 - 128
    assert run["hit_token"] == run["generated"][1]
    assert abs(run["hit_logprob"] - run["second_logprob"]) <= 1e-4


#: bytes a prefill's peak may grow by per context token, outside the KV pools (fixed by the budget)
BYTES_PER_TOKEN = 128
#: the resident high-water mark's noise between two runs (allocator and page timing), allowed on top
RSS_NOISE_MIB = 4


def test_prefill_peak_grows_at_most_128_bytes_per_context_token(runs):
    """The prefill's peak over the loaded engine, from 32K to 128K tokens: what it adds per extra context
    token (98,304 of them: 128 bytes each is 12 MiB) beyond a few MiB of noise. The pools are sized by the
    budget, not the context; anything else that scales with it (host token lists, per-step tables, tiles
    sized by the entries) shows up here."""
    growth = {n: r["peak_rss_mib"] - r["rss_before_mib"] for n, r in runs.items()}
    extra = (growth[131072] - growth[32768]) * (1 << 20)
    tokens = 131072 - 32768
    assert extra <= BYTES_PER_TOKEN * tokens + RSS_NOISE_MIB * (1 << 20), (
        f"{extra / tokens:.0f} bytes per context token (growth {growth[32768]:.1f} MiB at 32K, {growth[131072]:.1f} at 128K)"
    )
    short, long = runs[32768]["peak_rss_mib"], runs[131072]["peak_rss_mib"]
    assert abs(long - short) <= 0.1 * short, (short, long)


def test_planner_reports_tokens_per_sequence(runs):
    assert "up to 132096 tokens per sequence (max_model_len 132096)" in runs[131072]["plan"]


def test_planner_accepts_the_models_whole_position_range(ckpt):
    from deepinfer import LLM

    llm = LLM(model=str(ckpt), backend="cpu", max_model_len=1 << 20, kv_cache_memory=128 << 20, max_num_seqs=1)
    plan = llm.engine.runner.plan
    assert plan.tokens_per_sequence == 1 << 20 and plan.full_length_sequences == 1
    assert "up to 1048576 tokens per sequence" in plan.describe()
    with pytest.raises(Exception, match="exceeds the model's max_position_embeddings 1048576"):
        LLM(model=str(ckpt), backend="cpu", max_model_len=(1 << 20) + 1, kv_cache_memory=128 << 20)
