"""A torch tensor over memory torch did not allocate, through a DLPack capsule built by hand.

A device that reads host memory in place (pinned or registered memory under
unified addressing) gives a pointer that is valid on the device; torch has no
public call that wraps such a pointer as a device tensor, but it takes any
DLPack tensor. ``alias_memory`` builds one around ``pointer`` (a flat byte
tensor, viewed as ``dtype`` and ``shape`` afterwards, so every torch dtype works,
FP8 and E8M0 included) and keeps ``owner`` (whatever holds the memory) alive
until torch frees the alias.
"""

from __future__ import annotations

import ctypes
import math
from typing import Any

import torch

#: DLPack device types (``DLDeviceType``) by torch device type
DLPACK_DEVICE_TYPES = {"cpu": 1, "cuda": 2}
_DL_UINT = 1
_CAPSULE_NAME = b"dltensor"


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


class _DLManagedTensor(ctypes.Structure):
    pass


_DELETER = ctypes.CFUNCTYPE(None, ctypes.POINTER(_DLManagedTensor))
_DLManagedTensor._fields_ = [("dl_tensor", _DLTensor), ("manager_ctx", ctypes.c_void_p), ("deleter", _DELETER)]

#: what each live alias keeps alive (its struct, shape array and owner), by the struct's address
_LIVE: dict[int, tuple[Any, ...]] = {}


@_DELETER
def _release(managed) -> None:
    """Torch's call when the alias's storage is freed: drop what the alias kept alive."""
    _LIVE.pop(ctypes.addressof(managed.contents), None)


_new_capsule = ctypes.pythonapi.PyCapsule_New
_new_capsule.restype = ctypes.py_object
_new_capsule.argtypes = (ctypes.c_void_p, ctypes.c_char_p, ctypes.c_void_p)


def alias_memory(
    pointer: int, shape: tuple[int, ...], dtype: torch.dtype, device_type: str, device_id: int, owner: Any
) -> torch.Tensor:
    """A contiguous ``shape`` tensor of ``dtype`` on ``device_type:device_id`` whose data is the memory at
    ``pointer`` (valid on that device); ``owner`` stays referenced until the alias and its views are freed.

    Nothing is copied or checked: the caller vouches that ``pointer`` addresses ``prod(shape)`` elements
    the device can read."""
    if device_type not in DLPACK_DEVICE_TYPES:
        raise ValueError(f"alias_memory knows devices {sorted(DLPACK_DEVICE_TYPES)}, not {device_type!r}")
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, device=torch.device(device_type, device_id))
    managed = _DLManagedTensor()
    dims = (ctypes.c_int64 * 1)(nbytes)
    managed.dl_tensor = _DLTensor(
        ctypes.c_void_p(pointer), _DLDevice(DLPACK_DEVICE_TYPES[device_type], device_id), 1, _DLDataType(_DL_UINT, 8, 1),
        dims, None, 0,
    )
    managed.manager_ctx = None
    managed.deleter = _release
    _LIVE[ctypes.addressof(managed)] = (managed, dims, owner)
    capsule = _new_capsule(ctypes.addressof(managed), _CAPSULE_NAME, None)
    flat = torch.utils.dlpack.from_dlpack(capsule)
    return flat.view(dtype).view(shape)
