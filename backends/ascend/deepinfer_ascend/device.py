"""Ascend NPUs through torch_npu (``torch.npu``), with features gated by SoC generation.

Every call goes through the ``torch_npu.npu`` module that :mod:`.npu` loaded,
never through ``torch.npu`` directly, so nothing here depends on torch_npu's
autoload hook having registered ``torch.npu``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from types import ModuleType
from typing import Any, Callable, TypeVar

import torch

from deepinfer_interfaces import Device, DeviceCapabilities, NotSupportedError, record_stream_graph

from .npu import availability, npu_device_count, npu_namespace

T = TypeVar("T")


def soc_generation(soc_name: str) -> str:
    """The SoC generation from the device name torch_npu reports.

    ``"950"`` for Ascend 950 (``Ascend950PR_9599``, ``Ascend950DT_…``; early CANN
    names it ``Ascend910_95…``), ``"a3"`` for Atlas A3 (``Ascend910_93…``),
    ``"a2"`` for Atlas A2 (``Ascend910B…``), ``"other"`` otherwise (310P, 910A).
    """
    name = soc_name.lower().replace(" ", "")
    if "950" in name or "910_95" in name:
        return "950"
    if "910_93" in name or "910c" in name:
        return "a3"
    if "910b" in name:
        return "a2"
    return "other"


#: ``[start, end)`` of each generation in torch_npu's ``c10_npu::SocVersion`` enum
#: (torch_npu/csrc/core/npu/NpuVariables.h: Ascend910B1 = 220 .. Ascend910B4_1, Ascend910_9391 = 250 ..
#: Ascend910_9363, Ascend950 = 260), the number ``torch_npu.npu.get_soc_version()`` returns; torch_npu's
#: own SoC checks use the same bounds (``>= 260`` Ascend 950, ``>= 250`` A3, ``220 <= v < 240`` A2)
SOC_VERSION_GENERATIONS: tuple[tuple[int, int, str], ...] = ((260, 1 << 31, "950"), (250, 260, "a3"), (220, 240, "a2"))


def generation_from_soc_version(version: int) -> str | None:
    """The SoC generation of a ``c10_npu::SocVersion`` number; None for ``UnsupportedSocVersion`` (-1)."""
    if version < 0:
        return None
    for start, end, gen in SOC_VERSION_GENERATIONS:
        if start <= version < end:
            return gen
    return "other"  # 910A family (100-104), 310P (200-205), 310B (240-243)


@dataclass(frozen=True)
class SocInfo:
    """An NPU's SoC generation and what torch_npu reported it from (for reasons and logs)."""

    generation: str
    source: str


def detect_soc(npu: Any, index: int = 0) -> SocInfo:
    """The SoC of NPU ``index`` from the ``torch_npu.npu`` module ``npu``.

    ``get_soc_version()`` first: torch_npu's parsed SoC enum does not depend on
    how a CANN release spells the marketing name. The device name is the
    fallback, for a torch_npu without ``get_soc_version``, one that fails, or
    one that answers ``UnsupportedSocVersion``.
    """
    get_version = getattr(npu, "get_soc_version", None)
    if get_version is not None:
        try:
            version = int(get_version())
        except Exception:
            version = -1
        gen = generation_from_soc_version(version)
        if gen is not None:
            return SocInfo(gen, f"SocVersion {version}")
    name = str(npu.get_device_name(index))
    return SocInfo(soc_generation(name), name)


_SOC_CACHE: dict[tuple[Any, int], SocInfo] = {}


def cached_soc(npu: Any, index: int = 0) -> SocInfo:
    """:func:`detect_soc`, once per ``torch_npu.npu`` module and device (ops ask on every call).

    The key holds the module itself, not its id, so a stand-in freed later cannot alias a new one;
    an unhashable stand-in is asked every time.
    """
    key = (npu, index)
    try:
        hash(key)
    except TypeError:
        return detect_soc(npu, index)
    if key not in _SOC_CACHE:
        _SOC_CACHE[key] = detect_soc(npu, index)
    return _SOC_CACHE[key]


def features_for_generation(gen: str) -> dict[str, bool]:
    """FP8, HiF8 and MXFP4 matmuls exist on Ascend 950 only; bf16 from A2 on."""
    is_950 = gen == "950"
    return {"fp8": is_950, "hif8": is_950, "mxfp4": is_950, "bf16": gen in ("950", "a3", "a2")}


def _npu() -> ModuleType:
    npu = npu_namespace()
    if npu is None:
        _, reason = availability()
        raise NotSupportedError(f"needs torch_npu: {reason}")
    return npu


class AscendDevice(Device):
    type = "npu"
    dist_backend = "hccl"

    @classmethod
    def is_available(cls) -> tuple[bool, str | None]:
        return availability()

    def device_count(self) -> int:
        return npu_device_count()

    def set_device(self, index: int) -> None:
        self.index = index
        _npu().set_device(index)

    def generation(self) -> str:
        """``"950"``, ``"a3"``, ``"a2"`` or ``"other"`` for the selected NPU (see :func:`detect_soc`)."""
        return detect_soc(_npu(), self.index).generation

    def capabilities(self) -> DeviceCapabilities:
        npu = _npu()
        soc = npu.get_device_name(self.index)
        gen = detect_soc(npu, self.index).generation
        feats = features_for_generation(gen)
        dtypes = [torch.float32, torch.float16]
        if feats["bf16"]:
            dtypes.append(torch.bfloat16)
        if feats["fp8"]:
            dtypes.append(torch.float8_e4m3fn)
        return DeviceCapabilities(
            name=soc, dtypes=tuple(dtypes), fp8=feats["fp8"], fp4=feats["mxfp4"], graph_capture=True, graph_by_default=True, asynchronous=True,
            extra={"generation": gen, "hif8": feats["hif8"], "vector_cores": vector_core_count(self.index)},
        )

    def synchronize(self) -> None:
        _npu().synchronize(self.index)

    def memory_info(self) -> tuple[int, int]:
        free, total = _npu().mem_get_info(self.index)
        return int(free), int(total)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        _npu().manual_seed_all(seed)

    def new_stream(self) -> Any:
        return _npu().Stream(device=self.torch_device)

    def new_event(self) -> Any:
        return _npu().Event()

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager:
        return _npu().stream(stream)

    def new_graph_pool(self) -> Any:
        return _npu().graph_pool_handle()

    def capture_graph(self, fn: Callable[[], T], pool: Any = None) -> Callable[[], T]:
        """An NPU graph (``torch_npu.npu.NPUGraph``) of ``fn``, warmed up on a side stream, captured into ``pool``."""
        npu = _npu()
        return record_stream_graph(npu, npu.NPUGraph, fn, pool)


#: vector cores assumed when neither Triton-Ascend nor torch_npu reports a count (an A2/A3 die has 40-48)
DEFAULT_VECTOR_CORES = 40


def vector_core_count(index: int = 0) -> int:
    """Vector cores of NPU ``index``: Triton-Ascend's driver properties, else torch_npu's, else a default.

    Triton-Ascend kernels launch a 1-D grid of exactly this many programs.
    """
    try:
        import triton

        props = triton.runtime.driver.active.utils.get_device_properties(index)
        count = int(props.get("num_vectorcore", -1))
        if count > 0:
            return count
    except Exception:
        pass
    npu = npu_namespace()
    if npu is not None:
        try:
            props = npu.get_device_properties(index)
            for attr in ("vector_core_num", "num_vectorcore", "multi_processor_count"):
                count = int(getattr(props, attr, -1) or -1)
                if count > 0:
                    return count
        except Exception:
            pass
    return DEFAULT_VECTOR_CORES
