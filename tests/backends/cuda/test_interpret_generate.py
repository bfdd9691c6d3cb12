"""``deepinfer generate --backend cpu --kernels cuda|ascend --interpret`` gives the reference's greedy text, and the
CUDA kernels do with a packed FP8/FP4 cache too (``--kv-cache-dtype fp8``: records written, decoded in the attention
and indexer kernels)."""

import pytest

from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.interpret_sweep import full_sweep
from tests.helpers.plugins import run_cli


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ck"), "mixed")


def _generate(ckpt, *extra):
    proc = run_cli(
        ["generate", "--model", str(ckpt), "--prompt", "kernels under the interpreter", "--max-tokens", "8",
         "--temperature", "0", "--kv-cache-memory", "32000000", "--max-model-len", "64", "--backend", "cpu", *extra],
        timeout=600,
    )
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.fixture(scope="module")
def reference(ckpt):
    """The reference kernels' text, once for both kernel sets."""
    text = _generate(ckpt, "--kernels", "reference")
    assert len(text.strip()) > 0
    return text


@pytest.mark.slow
@pytest.mark.parametrize("kernels", ["cuda", "ascend"])
def test_interpreted_kernel_set_matches_reference(ckpt, reference, kernels):
    assert _generate(ckpt, "--kernels", kernels, "--interpret") == reference


@pytest.mark.slow
@pytest.mark.skipif(
    not full_sweep(),
    reason="~30 s under the interpreter; tests/backends/cuda/test_cuda_packed_kv.py checks each packed op, "
    "DEEPINFER_FULL_INTERPRET_SWEEP=1 runs the whole model too",
)
def test_interpreted_cuda_kernels_match_reference_on_a_packed_cache(ckpt):
    packed = _generate(ckpt, "--kernels", "reference", "--kv-cache-dtype", "fp8")
    assert packed.strip()
    assert _generate(ckpt, "--kernels", "cuda", "--interpret", "--kv-cache-dtype", "fp8") == packed
