"""``deepinfer generate``: streaming output, several prompts, and one-line errors with status 2."""

import pytest

from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.plugins import run_cli


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ck"), "sliding_hca")


BASE = ["--kv-cache-memory", "64000000", "--max-model-len", "128"]


def test_single_prompt_streams_text_and_stats(ckpt):
    proc = run_cli(["generate", "--model", str(ckpt), "--prompt", "hello", "--max-tokens", "8", "--stats", *BASE])
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.endswith("\n") and len(proc.stdout) > 1
    assert "generated 8" in proc.stderr or "generated" in proc.stderr


def test_many_prompts_from_file(ckpt, tmp_path):
    f = tmp_path / "p.txt"
    f.write_text("one\ntwo\n\nthree\n")
    proc = run_cli(["generate", "--model", str(ckpt), "--prompts-file", str(f), "--max-tokens", "4", *BASE])
    assert proc.returncode == 0, proc.stderr
    assert [l for l in proc.stdout.splitlines() if l.startswith("=== [")] == ["=== [0] 'one'", "=== [1] 'two'", "=== [2] 'three'"]


@pytest.mark.parametrize(
    "extra, message",
    [
        (["--temperature", "-1"], "invalid sampling parameter 'temperature'"),
        (["--top-p", "0"], "invalid sampling parameter 'top_p'"),
        (["--max-tokens", "0"], "invalid sampling parameter 'max_tokens'"),
        (["--backend", "nope"], "unknown backend 'nope'"),
        (["--backend", "cuda"], "backend 'cuda' is unavailable"),
        (["--kv-cache-memory", "10"], "kv_cache_memory of 10 bytes cannot hold one sequence"),
    ],
)
def test_bad_input_one_line_exit_2(ckpt, extra, message):
    proc = run_cli(["generate", "--model", str(ckpt), "--prompt", "hi", *BASE, *extra])
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0]


def test_prompt_too_long_one_line(ckpt):
    proc = run_cli(["generate", "--model", str(ckpt), "--prompt", "x" * 300, *BASE])
    assert proc.returncode == 2
    assert "max_model_len is 128" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1


def test_malformed_checkpoint(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    proc = run_cli(["generate", "--model", str(tmp_path), "--prompt", "hi"])
    assert proc.returncode == 2 and "model_type" in proc.stderr and len(proc.stderr.strip().splitlines()) == 1
