"""Batch-invariant mode on Ascend: the determinism switches torch-npu offers, the reference's fixed-shape
paths instead of fused ops that have no batch-invariant mode, and ``not_supported`` for those in conformance.

The kernel set runs with a stand-in torch_npu (``AscendKernels(torch_npu=...)``) on CPU tensors."""

from __future__ import annotations

import os

import pytest
import torch

from deepinfer_ascend.deterministic import HCCL_DETERMINISTIC, set_deterministic
from deepinfer_ascend.kernels import AscendKernels
from deepinfer_conformance.invariance import run_invariance_suite
from deepinfer_cpu.device import CPUDevice
from deepinfer_interfaces import Kernels, NotSupportedError
from tests.backends.ascend.test_ascend_fallback import A3, StandInTorchNpu


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    return torch.randn(9, 40, generator=g) * 3, torch.randn(9, 40, generator=g) * 3


def test_mode_runs_the_reference_path_instead_of_the_fused_ops():
    tn = StandInTorchNpu(A3)
    kernels = AscendKernels(torch_npu=tn)
    gate, up = _inputs()
    kernels.swiglu(gate, up, 2.0)
    assert tn.calls == ["npu_clipped_swiglu"]
    kernels.set_batch_invariant(True)
    tn.calls.clear()
    reference = Kernels()
    reference.set_batch_invariant(True)
    assert torch.equal(kernels.swiglu(gate, up, 2.0), reference.swiglu(gate, up, 2.0))
    assert torch.equal(kernels.rms_norm(gate, None, 1e-6), reference.rms_norm(gate, None, 1e-6))
    assert tn.calls == [], "no fused op runs in batch-invariant mode"
    kernels.set_batch_invariant(False)
    kernels.rms_norm(gate, None, 1e-6)
    assert tn.calls == ["npu_rms_norm"]


def test_strict_view_refuses_fused_ops_with_the_reason():
    kernels = AscendKernels(torch_npu=StandInTorchNpu(A3))
    kernels.set_batch_invariant(True)
    strict = kernels.for_conformance()
    assert strict.batch_invariant
    gate, up = _inputs()
    with pytest.raises(NotSupportedError, match=r"^swiglu: torch_npu:npu_clipped_swiglu has no batch-invariant mode"):
        strict.swiglu(gate, up, 2.0)


def test_conformance_reports_fused_ops_not_supported_and_the_reference_ops_passing():
    results = run_invariance_suite(AscendKernels(torch_npu=StandInTorchNpu(A3)), CPUDevice(), ["swiglu", "linear"])
    by_op = {op: {r.status for r in results if r.op == op} for op in ("swiglu", "linear")}
    assert by_op == {"swiglu": {"not_supported"}, "linear": {"pass"}}, by_op
    assert all("no batch-invariant mode" in r.message for r in results if r.op == "swiglu")


def test_deterministic_switches_turn_on_and_off(monkeypatch):
    monkeypatch.delenv(HCCL_DETERMINISTIC, raising=False)
    before = torch.are_deterministic_algorithms_enabled()
    try:
        set_deterministic(True)
        assert torch.are_deterministic_algorithms_enabled() and os.environ[HCCL_DETERMINISTIC] == "true"
        set_deterministic(False)
        assert not torch.are_deterministic_algorithms_enabled()
    finally:
        torch.use_deterministic_algorithms(before)
