"""The Ascend kernel set when a fused op raises, clipped SwiGLU gated by SoC generation, and SoC detection.

The kernel set is built with a stand-in torch_npu through its own constructor
seam (``AscendKernels(torch_npu=...)``), so the real routing, glue and fallback
code run on CPU tensors; nothing patches torch_npu or the backend.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from deepinfer_ascend.device import detect_soc, generation_from_soc_version
from deepinfer_ascend.kernels import AscendKernels
from deepinfer_interfaces import Kernels

ROOT = Path(__file__).resolve().parents[3]


class StandInNpuNamespace:
    """``torch_npu.npu`` as far as SoC detection reads it."""

    def __init__(self, soc_version: int | None, name: str = "Ascend910_9391", fails: bool = False) -> None:
        self.soc_version, self.name, self.fails = soc_version, name, fails
        if soc_version is None:
            self.get_soc_version = None  # a torch_npu without it: getattr finds None

    def get_soc_version(self) -> int:
        if self.fails:
            raise RuntimeError("drvGetPlatformInfo failed")
        return self.soc_version

    def get_device_name(self, index: int = 0) -> str:
        return self.name


class StandInTorchNpu:
    """The fused ops the SwiGLU and RMSNorm paths call, as their op reference documents them, on a given SoC.

    ``raises`` maps an op name to the error it raises, as torch_npu does for an op its SoC or CANN lacks.
    """

    def __init__(self, soc_version: int, raises: dict[str, Exception] | None = None) -> None:
        self.npu = StandInNpuNamespace(soc_version)
        self.raises = raises or {}
        self.calls: list[str] = []

    def _enter(self, op: str) -> None:
        self.calls.append(op)
        if op in self.raises:
            raise self.raises[op]

    def npu_clipped_swiglu(self, x, *, group_index=None, dim=-1, alpha=1.702, limit=7.0, bias=1.0, interleaved=True):
        self._enter("npu_clipped_swiglu")
        a, b = (x[..., ::2], x[..., 1::2]) if interleaved else x.chunk(2, dim=-1)
        a, b = a.clamp(max=limit), b.clamp(min=-limit, max=limit)
        return a * torch.sigmoid(alpha * a) * (b + bias)

    def npu_swiglu(self, x, dim=-1):
        self._enter("npu_swiglu")
        a, b = x.chunk(2, dim=dim)
        return torch.nn.functional.silu(a) * b

    def npu_rms_norm(self, x, gamma, epsilon=1e-6):
        self._enter("npu_rms_norm")
        xf = x.float()
        rstd = torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + epsilon)
        return (xf * rstd * gamma.float()).to(x.dtype), rstd


A2, A3, ASCEND_950 = 222, 250, 260
CANN_ERROR = RuntimeError("npu_clipped_swiglu: EZ9999: Inner Error!\nEZ9999: kernel ClippedSwiglu has no binary for this SoC\n"
                          "[ERROR] 2026-01-01 (PID:1, Device:0, RankID:-1) ERR01100 OPS call acl api failed")


def _inputs() -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(7)
    return torch.randn(5, 12, generator=g) * 4, torch.randn(5, 12, generator=g) * 4


def _ascend_warnings(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "deepinfer.ascend" and r.levelno == logging.WARNING]


# ---- a fused op that raises -----------------------------------------------------------------


def test_a_fused_op_error_falls_back_to_the_reference_with_one_warning_line(caplog):
    tn = StandInTorchNpu(A3, raises={"npu_clipped_swiglu": CANN_ERROR})
    kernels = AscendKernels(torch_npu=tn)
    gate, up = _inputs()
    want = Kernels().swiglu(gate, up, 2.0)
    with caplog.at_level(logging.WARNING, logger="deepinfer.ascend"):
        first = kernels.swiglu(gate, up, 2.0)
        again = kernels.swiglu(gate, up, 2.0)
    assert torch.equal(first, want) and torch.equal(again, want)
    lines = _ascend_warnings(caplog)
    assert len(lines) == 1 and "\n" not in lines[0], lines
    assert "swiglu" in lines[0] and "torch_npu:npu_clipped_swiglu" in lines[0] and "RuntimeError" in lines[0]
    assert "EZ9999: Inner Error!" in lines[0] and "runs its fallback (the reference) from now on" in lines[0]
    assert tn.calls == ["npu_clipped_swiglu"], "after the first error the fused op is not tried again"
    assert set(kernels.failed) == {"swiglu"}


def test_a_changed_signature_falls_back_too_while_other_ops_keep_their_fused_path(caplog):
    tn = StandInTorchNpu(A2, raises={"npu_rms_norm": TypeError("npu_rms_norm() got an unexpected keyword argument 'epsilon'")})
    kernels = AscendKernels(torch_npu=tn)
    x, w = torch.randn(4, 16), torch.randn(16)
    gate, up = _inputs()
    with caplog.at_level(logging.WARNING, logger="deepinfer.ascend"):
        assert torch.equal(kernels.rms_norm(x, w, 1e-6), Kernels().rms_norm(x, w, 1e-6))
        torch.testing.assert_close(kernels.swiglu(gate, up, 2.0), Kernels().swiglu(gate, up, 2.0))
    lines = _ascend_warnings(caplog)
    assert len(lines) == 1 and "rms_norm (torch_npu:npu_rms_norm) raised TypeError" in lines[0]
    assert tn.calls == ["npu_rms_norm", "npu_clipped_swiglu"]


def test_the_strict_conformance_view_reports_the_error_instead():
    tn = StandInTorchNpu(A3, raises={"npu_clipped_swiglu": CANN_ERROR})
    gate, up = _inputs()
    with pytest.raises(RuntimeError, match="EZ9999"):
        AscendKernels(torch_npu=tn).for_conformance().swiglu(gate, up, 2.0)


# ---- npu_clipped_swiglu only where torch_npu documents it ------------------------------------


@pytest.mark.parametrize(("soc_version", "fused"), [(A2, ["npu_clipped_swiglu"]), (A3, ["npu_clipped_swiglu"]),
                                                     (ASCEND_950, ["npu_swiglu"])])
def test_clipped_swiglu_runs_on_a2_and_a3_and_ascend_950_clamps_in_torch(caplog, soc_version, fused):
    tn = StandInTorchNpu(soc_version, raises={"npu_clipped_swiglu": CANN_ERROR} if soc_version == ASCEND_950 else None)
    kernels = AscendKernels(torch_npu=tn)
    gate, up = _inputs()
    with caplog.at_level(logging.WARNING, logger="deepinfer.ascend"):
        got = kernels.swiglu(gate, up, 2.0)
    torch.testing.assert_close(got, Kernels().swiglu(gate, up, 2.0))
    assert tn.calls == fused and _ascend_warnings(caplog) == [] and kernels.failed == {}


# ---- SoC detection ----------------------------------------------------------------------------


@pytest.mark.parametrize(("version", "gen"), [(220, "a2"), (225, "a2"), (250, "a3"), (256, "a3"), (260, "950"), (261, "950"),
                                              (102, "other"), (202, "other"), (241, "other"), (-1, None)])
def test_soc_version_numbers_map_to_generations(version, gen):
    assert generation_from_soc_version(version) == gen


def test_detection_prefers_get_soc_version_and_falls_back_to_the_name():
    assert detect_soc(StandInNpuNamespace(ASCEND_950, name="Ascend910B3")).generation == "950"
    assert detect_soc(StandInNpuNamespace(ASCEND_950)).source == "SocVersion 260"
    for fallback in (StandInNpuNamespace(None, "Ascend910B3"), StandInNpuNamespace(A3, "Ascend910B3", fails=True),
                     StandInNpuNamespace(-1, "Ascend910B3")):
        soc = detect_soc(fallback)
        assert (soc.generation, soc.source) == ("a2", "Ascend910B3")


def test_the_device_reads_the_generation_from_get_soc_version(tmp_path):
    """A fake torch_npu package in a subprocess (it must never reach this process): the version wins over the name."""
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text(textwrap.dedent(
        """
        import types
        npu = types.ModuleType("torch_npu.npu")
        npu.device_count = lambda: 1
        npu.get_device_name = lambda index=0: "Ascend910_9391"
        npu.get_soc_version = lambda: 260
        """
    ))
    script = textwrap.dedent(
        """
        import json
        from deepinfer_ascend.device import AscendDevice
        dev = AscendDevice()
        caps = dev.capabilities()
        print(json.dumps({"gen": dev.generation(), "caps_gen": caps.extra["generation"], "fp8": caps.fp8, "name": caps.name}))
        """
    )
    env = {k: v for k, v in os.environ.items() if k not in ("ASCEND_RT_VISIBLE_DEVICES", "TRITON_INTERPRET")}
    env["PYTHONPATH"] = os.pathsep.join([str(tmp_path), str(ROOT), env.get("PYTHONPATH", "")])
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got == {"gen": "950", "caps_gen": "950", "fp8": True, "name": "Ascend910_9391"}
