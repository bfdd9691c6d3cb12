"""End-to-end parity: the reference passes on a tiny model, and the verdict rules hold on constructed distributions."""

import pytest
import torch

from deepinfer_conformance.e2e import PROMPTS, compare_prompt, judge, resolve_dtype, run_e2e
from deepinfer_conformance.tolerances import E2ETolerance
from deepinfer_cpu.device import CPUDevice
from deepinfer_interfaces import Kernels
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.plugins import run_cli

TOL = E2ETolerance(logprob=0.1, kl=1e-3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "mixed")


def test_reference_kernels_pass_with_identical_distributions(tiny):
    results = run_e2e(Kernels(), CPUDevice(), tiny, max_new_tokens=6)
    assert [r.case for r in results] == [pid for pid, _ in PROMPTS]
    for r in results:
        assert (r.suite, r.op, r.dtype, r.status) == ("e2e", "greedy", "float32", "pass"), r
        assert r.max_abs_err == 0.0 and r.frac_out_of_tol == 0.0
        assert "no greedy divergence in 6 steps" in r.message and "mean KL 0.00e+00" in r.message
        assert "min top-5 overlap 5/5" in r.message


def _logprobs(rows):
    return torch.log_softmax(torch.tensor(rows, dtype=torch.float32), dim=-1)


def test_divergence_at_a_near_tie_is_a_warning():
    ref = _logprobs([[2.0, 1.0, 0.0, -1.0], [1.0, 0.98, 0.0, -1.0], [0.0, 3.0, 0.0, 0.0]])
    got = _logprobs([[2.0, 1.0, 0.0, -1.0], [0.98, 1.0, 0.0, -1.0], [0.0, 3.0, 0.0, 0.0]])
    parity = compare_prompt(ref, got, [0, 0, 1], top_k=2)
    assert parity.divergence == 1 and parity.divergence_gap == pytest.approx(0.02, abs=1e-5)
    status, message = judge(parity, TOL, top_k=2)
    assert status == "warn"
    assert "first greedy divergence at step 1 of 3 (reference logprob gap 0.02, within tolerance 0.1)" in message


def test_divergence_past_the_tolerance_fails_even_with_a_small_kl():
    ref = _logprobs([[1.0, 0.7, 0.0]])
    got = _logprobs([[0.7, 1.0, 0.0]])
    status, message = judge(compare_prompt(ref, got, [0]), E2ETolerance(logprob=0.1, kl=1.0))
    assert status == "fail" and "beyond tolerance 0.1" in message


def test_kl_bands_without_divergence():
    ref = _logprobs([[3.0, 0.0, 0.0, 0.0]] * 4)
    slightly = _logprobs([[3.0, 0.05, 0.0, 0.0]] * 4)
    far = _logprobs([[3.0, 1.5, 0.0, 0.0]] * 4)
    kl_small = float(compare_prompt(ref, slightly, [0] * 4).kl.mean())
    assert judge(compare_prompt(ref, slightly, [0] * 4), E2ETolerance(1e-3, kl_small * 2))[0] == "pass"
    assert judge(compare_prompt(ref, slightly, [0] * 4), E2ETolerance(1e-3, kl_small / 2))[0] == "warn"
    status, message = judge(compare_prompt(ref, far, [0] * 4), E2ETolerance(1e-3, kl_small))
    assert status == "fail" and "no greedy divergence in 4 steps" in message


def test_non_finite_backend_logits_fail():
    ref = _logprobs([[1.0, 0.0]])
    got = torch.tensor([[float("nan"), float("nan")]])
    status, message = judge(compare_prompt(ref, got, [0]), TOL)
    assert status == "fail" and "not finite" in message


def test_top_k_overlap_counts_shared_candidates():
    ref = _logprobs([[5.0, 4.0, 3.0, 0.0, -1.0]])
    got = _logprobs([[5.0, 0.0, 3.0, 4.0, -1.0]])
    assert compare_prompt(ref, got, [0], top_k=3).min_overlap == 2


def test_dtype_choice_follows_the_engine_default_and_checks_support():
    from deepinfer.errors import ConfigError

    assert resolve_dtype(None, CPUDevice()) == torch.float32
    assert resolve_dtype("bfloat16", CPUDevice()) == torch.bfloat16
    with pytest.raises(ConfigError, match="unknown --dtype 'int8'"):
        resolve_dtype("int8", CPUDevice())


def test_cli_names_model_when_the_directory_is_not_a_model(tmp_path):
    proc = run_cli(["conformance", "--backend", "cpu", "--suite", "e2e", "--model", str(tmp_path / "missing")])
    assert proc.returncode == 2
    assert "--model" in proc.stderr and "no config.json" in proc.stderr and "Traceback" not in proc.stderr
