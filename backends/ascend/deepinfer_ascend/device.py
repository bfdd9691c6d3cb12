"""Ascend NPUs through torch_npu (``torch.npu``), with features gated by SoC generation."""

from __future__ import annotations

import contextlib
from typing import Any

import torch

from deepinfer_interfaces import Device, DeviceCapabilities

from .npu import load_torch_npu, npu_device_count


def soc_generation(soc_name: str) -> str:
    """``"950"`` for Ascend 950, ``"a3"``/``"a2"`` for Atlas 800 A3/A2 (910_93xx/910B), else ``"other"``."""
    name = soc_name.lower().replace(" ", "")
    if "950" in name:
        return "950"
    if "910_93" in name or "910c" in name:
        return "a3"
    if "910b" in name:
        return "a2"
    return "other"


def features_for_generation(gen: str) -> dict[str, bool]:
    """FP8, HiF8 and MXFP4 matmuls exist on Ascend 950 only."""
    is_950 = gen == "950"
    return {"fp8": is_950, "hif8": is_950, "mxfp4": is_950}


class AscendDevice(Device):
    type = "npu"
    dist_backend = "hccl"

    @classmethod
    def is_available(cls) -> tuple[bool, str | None]:
        module, reason = load_torch_npu()
        if module is None:
            return False, reason
        if npu_device_count() == 0:
            return False, "torch_npu imported but no NPU is visible (check the driver and ASCEND_RT_VISIBLE_DEVICES)"
        return True, None

    def device_count(self) -> int:
        return npu_device_count()

    def set_device(self, index: int) -> None:
        self.index = index
        torch.npu.set_device(index)

    def capabilities(self) -> DeviceCapabilities:
        soc = torch.npu.get_device_name(self.index)
        gen = soc_generation(soc)
        feats = features_for_generation(gen)
        dtypes = [torch.float32, torch.float16, torch.bfloat16]
        if feats["fp8"]:
            dtypes.append(torch.float8_e4m3fn)
        return DeviceCapabilities(
            name=soc, dtypes=tuple(dtypes), fp8=feats["fp8"], fp4=feats["mxfp4"], graph_capture=True,
            extra={"generation": gen, "hif8": feats["hif8"]},
        )

    def synchronize(self) -> None:
        torch.npu.synchronize(self.index)

    def memory_info(self) -> tuple[int, int]:
        return torch.npu.mem_get_info(self.index)

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)
        torch.npu.manual_seed_all(seed)

    def new_stream(self) -> Any:
        return torch.npu.Stream(device=self.index)

    def new_event(self) -> Any:
        return torch.npu.Event()

    def stream_context(self, stream: Any) -> contextlib.AbstractContextManager:
        return torch.npu.stream(stream)
