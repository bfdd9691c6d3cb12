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


def test_peak_memory_of_32k_and_128k_prefills_differ_by_at_most_10_percent(runs):
    short, long = runs[32768]["peak_rss_mib"], runs[131072]["peak_rss_mib"]
    assert abs(long - short) <= 0.1 * short, (short, long)
    # and the prefill's own growth over the loaded engine stays small at 4x the context
    growth = {n: r["peak_rss_mib"] - r["rss_before_mib"] for n, r in runs.items()}
    assert growth[131072] <= growth[32768] + 0.1 * runs[32768]["peak_rss_mib"], growth


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
