"""Packing cache rows into quantized records and reading them back (``kv_format.py`` defines the math)."""

from __future__ import annotations

import torch

from ..kv_format import KVFormat, pack_rows, unpack_rows
from .base import acc_dtype, op
from .invariant import matmul_rows

_HADAMARD: dict[tuple[int, torch.dtype, torch.device], torch.Tensor] = {}


def hadamard_matrix(d: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """The ``d × d`` Sylvester Walsh–Hadamard matrix scaled by ``d^-1/2`` (orthonormal; ``d`` a power of two)."""
    if d < 1 or d & (d - 1):
        raise ValueError(f"a Walsh–Hadamard transform needs a power-of-two width, got {d}")
    key = (d, dtype, torch.device(device))
    h = _HADAMARD.get(key)
    if h is None:
        h = torch.ones(1, 1, dtype=torch.float64)
        while h.shape[0] < d:
            h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
        h = _HADAMARD[key] = (h * d**-0.5).to(dtype=dtype, device=device)
    return h


class KVQuantOps:
    @op(rows=("values",))
    def kv_pack(self, values: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
        """``[n, fmt.record_bytes]`` uint8 records of ``values`` ``[n, fmt.dim]``.

        Per block of ``fmt.block`` leading channels one scale (the block's
        ``max|x|``, floored at ``fmt.amax_floor``, over the code's largest value:
        rounded up to a power of two for ``ue8m0``, to the nearest e4m3 for
        ``e4m3``), and each channel's code rounded to the nearest value, ties
        to even, saturated; the trailing ``fmt.rope`` channels as bf16. Bytes
        are exact: a backend's records equal these bit for bit, except inside
        a block whose scale is NaN (a block holding NaN or ±inf), where any
        codes and any NaN encoding of the scale decode alike, and a NaN rotary
        channel, which may be any bf16 NaN.
        """
        return pack_rows(values, fmt)

    @op(rows=("records",))
    def kv_unpack(self, records: torch.Tensor, fmt: KVFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """``[n, fmt.dim]`` rows of ``records`` ``[n, fmt.record_bytes]`` in ``dtype``: each code's value
        times its block's scale (exact in fp32), the rope channels as stored."""
        return unpack_rows(records, fmt, dtype)

    @op(rows=("x",))
    def hadamard(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` ``[..., d]`` times the orthonormal Walsh–Hadamard matrix ``H_d / √d`` along its last dim
        (``d`` a power of two; ``H_{2n} = [[H_n, H_n], [H_n, −H_n]]``, so output channel ``j`` is
        ``Σ_i (−1)^popcount(i & j) · x_i / √d``). Computed in fp32 (fp64 for fp64), returned in ``x.dtype``."""
        acc = acc_dtype(x)
        if x.numel() == 0:
            return x.clone()
        return matmul_rows(x.to(acc), hadamard_matrix(x.shape[-1], acc, x.device), self.batch_invariant).to(x.dtype)
