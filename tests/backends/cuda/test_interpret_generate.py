"""``deepinfer generate --backend cpu --kernels cuda|ascend --interpret`` gives the reference's greedy text."""

import pytest

from tests.helpers.checkpoints import make_tiny_checkpoint
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
