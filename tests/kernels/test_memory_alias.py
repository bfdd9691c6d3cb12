"""``alias_memory`` wraps memory it did not allocate as a torch tensor (here host memory, DLPack's kDLCPU) and
keeps its owner alive exactly as long as the alias; ``Device.map_host`` is None unless a device says otherwise."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch

from deepinfer_cpu.device import CPUDevice
from deepinfer_interfaces import Device
from deepinfer_interfaces.memory_alias import alias_memory


class _Owner:
    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


def test_the_alias_reads_and_writes_the_memory_it_wraps():
    src = torch.arange(24, dtype=torch.float32)
    alias = alias_memory(src.data_ptr(), (4, 6), torch.float32, "cpu", 0, src)
    assert alias.shape == (4, 6) and alias.dtype == torch.float32 and alias.device.type == "cpu"
    assert alias.data_ptr() == src.data_ptr() and torch.equal(alias.flatten(), src)
    src[7] = -3.0
    alias[3, 5] = 99.0
    assert alias[1, 1] == -3.0 and src[23] == 99.0


@pytest.mark.parametrize("dtype", [torch.float8_e4m3fn, torch.uint8, torch.bfloat16, torch.int64])
def test_any_dtype_is_viewed_from_the_bytes(dtype):
    src = torch.arange(64, dtype=torch.uint8)
    n = 64 // dtype.itemsize
    alias = alias_memory(src.data_ptr(), (2, n // 2), dtype, "cpu", 0, src)
    assert alias.dtype == dtype and torch.equal(alias.view(torch.uint8).flatten(), src)


def test_the_owner_lives_until_the_alias_and_its_views_are_freed():
    owner = _Owner(torch.arange(12, dtype=torch.int32))
    freed = []
    weakref.finalize(owner, freed.append, True)
    alias = alias_memory(owner.tensor.data_ptr(), (3, 4), torch.int32, "cpu", 0, owner)
    del owner
    gc.collect()
    assert not freed and alias.sum() == 66  # only the alias holds the memory now, and it is intact
    row = alias[2]
    del alias
    gc.collect()
    assert not freed and row.tolist() == [8, 9, 10, 11]
    del row
    gc.collect()
    assert freed == [True]


def test_empty_shapes_and_unknown_devices():
    assert alias_memory(0, (0, 8), torch.float32, "cpu", 0, None).shape == (0, 8)
    with pytest.raises(ValueError, match="alias_memory knows devices"):
        alias_memory(0, (1,), torch.float32, "npu", 0, None)


def test_map_host_is_the_tensor_on_the_cpu_and_none_by_default():
    table = torch.randn(5, 4)
    assert CPUDevice().map_host(table) is table

    class Plain(CPUDevice):
        map_host = Device.map_host

    assert Plain().map_host(table) is None
