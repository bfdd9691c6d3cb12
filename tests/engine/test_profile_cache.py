"""Start-up cost profiles kept across processes: what one engine measured, the next reads back by its key."""

from __future__ import annotations

import os
import subprocess
import sys

from deepinfer.profile_cache import CACHE_DIR_ENV, CHECK_EVERY, OnlineBound, ProfileCache, cache_dir, model_fingerprint
from deepinfer.spec_decode import StepCostProfile

PROFILE = StepCostProfile((1, 2, 8), (0.010, 0.011, 0.020))
KEY = ("step", (1, 2, 8), "model", "cpu", 64)


def test_a_profile_kept_by_one_cache_is_read_by_another(tmp_path):
    ProfileCache(tmp_path).put(KEY, PROFILE)
    assert ProfileCache(tmp_path).get(KEY) == PROFILE
    assert ProfileCache(tmp_path).get(("draft", *KEY[1:])) is None  # another key: measured anew
    assert [p.suffix for p in tmp_path.iterdir()] == [".json"]  # no temporary file left


def test_an_unreadable_or_unwritable_cache_is_passed_over(tmp_path):
    cache = ProfileCache(tmp_path)
    cache.put(KEY, PROFILE)
    next(tmp_path.iterdir()).write_text("{not json")
    assert ProfileCache(tmp_path).get(KEY) is None
    blocked = tmp_path / "file"
    blocked.write_text("")
    ProfileCache(blocked / "profiles").put(KEY, PROFILE)  # a path under a file: nothing raised
    assert ProfileCache(blocked / "profiles").get(KEY) is None


def test_the_directory_comes_from_the_environment(tmp_path, monkeypatch):
    monkeypatch.setenv(CACHE_DIR_ENV, str(tmp_path))
    assert cache_dir() == tmp_path / "profiles"


def test_a_changed_checkpoint_is_another_model(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    before = model_fingerprint(tmp_path)
    (tmp_path / "model.safetensors").write_bytes(b"x")
    assert model_fingerprint(tmp_path) != before


def test_a_second_engine_process_reads_the_first_ones_profiles(tmp_path):
    """Two processes build the bundled model's engine; only the first times its forwards."""
    code = ("import logging, sys; logging.basicConfig(stream=sys.stdout, level=logging.INFO, format='%(message)s'); "
            "from deepinfer import LLM; LLM(backend='cpu', max_num_seqs=4, max_model_len=256).engine.speculation")
    env = {**os.environ, CACHE_DIR_ENV: str(tmp_path), "OMP_NUM_THREADS": "1"}
    runs = [subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300) for _ in range(2)]
    assert all(r.returncode == 0 for r in runs), runs[0].stderr[-2000:]
    assert "step-cost profile" in runs[0].stdout and "draft-cost profile" in runs[0].stdout
    assert "profile" not in runs[1].stdout, runs[1].stdout
    assert len(list((tmp_path / "profiles").iterdir())) == 2


def test_a_profile_timed_on_a_busy_machine_is_lowered_to_the_steps_observed(tmp_path):
    """Observed steps bound the profile at their size and below; where it is well above, it is lowered, kept in
    the cache for the next start, and never raised by a slower step (that is load now, not the device's cost)."""
    slow = StepCostProfile((1, 8, 64), (0.300, 0.320, 0.400))  # timed while others ran
    cache = ProfileCache(tmp_path)
    cache.put(KEY, slow)
    bound = OnlineBound("step-cost profile", slow, KEY, cache)
    fixed = [bound.observe(8, 0.040) for _ in range(CHECK_EVERY - 1)]
    assert fixed == [None] * (CHECK_EVERY - 1)  # checked every CHECK_EVERY observations
    fixed = bound.observe(64, 0.090)
    assert fixed is not None and fixed.seconds == (0.040, 0.040, 0.090)
    assert ProfileCache(tmp_path).get(KEY) == fixed  # the next process starts from the corrected prior
    for _ in range(CHECK_EVERY):
        assert bound.observe(64, 5.0) is None  # slower steps: nothing raised
    assert bound.profile == fixed and bound.corrections == 1


def test_a_profile_that_agrees_with_the_steps_is_kept(tmp_path):
    quiet = StepCostProfile((1, 8, 64), (0.030, 0.036, 0.080))
    bound = OnlineBound("step-cost profile", quiet, KEY, ProfileCache(tmp_path))
    for i in range(4 * CHECK_EVERY):
        assert bound.observe(1 + i % 64, 0.9 * quiet.cost(1 + i % 64) + 0.002) is None  # within DISAGREE of it
    assert bound.corrections == 0 and not list(tmp_path.iterdir())
