"""A checkpoint's tensors under the release's names, in float64, for the dense oracles.

Reads every ``*.safetensors`` file of the directory (the draft's shards too),
lazily. A ``name.weight`` stored as codes with a ``name.scale`` companion is
decoded the way DeepSeek's release defines it, independently of the engine:
FP8 e4m3 codes times one scale per ``weight_block_size`` tile (``F8_E8M0``
exponents, or float32), FP4 e2m1 codes packed two per byte (the first value in
the low nibble) times one ``F8_E8M0`` scale per 32 columns.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from .oracle_math import DTYPE
#: e2m1 magnitudes by the low three bits of a nibble (bit 3 is the sign)
E2M1 = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0)
FP4_BLOCK = 32


def _expand(scales: torch.Tensor, rows: int, cols: int) -> torch.Tensor:
    """A scale grid ``[ceil(rows/bn), ceil(cols/bk)]`` as one scale per element ``[rows, cols]``."""
    bn, bk = -(-rows // scales.shape[0]), -(-cols // scales.shape[1])
    return scales.repeat_interleave(bn, 0)[:rows].repeat_interleave(bk, 1)[:, :cols]


def dequantize(codes: torch.Tensor, scales: torch.Tensor, block: tuple[int, int]) -> torch.Tensor:
    """float64 values of one stored weight: FP8 codes (``float8_e4m3fn``) with ``block`` tiles of scales, or
    FP4 pairs (``int8`` / ``uint8``) with one scale per 32 columns."""
    s = scales.to(DTYPE)
    if codes.dtype == torch.float8_e4m3fn:
        rows, cols = codes.shape
        grid = (-(-rows // block[0]), -(-cols // block[1]))
        if tuple(s.shape) != grid:
            raise ValueError(f"a {tuple(codes.shape)} FP8 weight with {tuple(s.shape)} scales is not in {block} tiles")
        return codes.to(DTYPE) * _expand(s, rows, cols)
    raw = codes.view(torch.uint8)
    table = torch.tensor(E2M1, dtype=DTYPE)
    nibbles = torch.stack([raw & 0xF, raw >> 4], dim=-1).flatten(-2).long()
    values = table[nibbles & 7] * torch.where(nibbles & 8 > 0, -1.0, 1.0).to(DTYPE)
    rows, cols = values.shape
    if tuple(s.shape) != (rows, cols // FP4_BLOCK):
        raise ValueError(f"a {rows}x{cols} FP4 weight with {tuple(s.shape)} scales is not in 1x{FP4_BLOCK} tiles")
    return values * s.repeat_interleave(FP4_BLOCK, 1)


class CheckpointTensors:
    """Tensors by release name: ``raw(name)`` as stored, ``self(name)`` in float64 (decoded where quantized);
    ``overrides`` replace stored tensors by name."""

    def __init__(self, directory: Path) -> None:
        from safetensors import safe_open

        directory = Path(directory)
        raw = json.loads((directory / "config.json").read_text())
        quant = raw.get("quantization_config") or {}
        self.block = tuple(quant.get("weight_block_size", (128, 128)))
        self._files = [safe_open(str(f), framework="pt") for f in sorted(directory.glob("*.safetensors"))]
        self._where = {name: f for f in self._files for name in f.keys()}
        self._cache: dict[str, torch.Tensor] = {}
        self.overrides: dict[str, torch.Tensor] = {}

    def __contains__(self, name: str) -> bool:
        return name in self.overrides or name in self._where

    def raw(self, name: str) -> torch.Tensor:
        if name in self.overrides:
            return self.overrides[name]
        if name not in self._where:
            raise KeyError(f"the checkpoint holds no tensor {name!r}")
        return self._where[name].get_tensor(name)

    def __call__(self, name: str) -> torch.Tensor:
        if name not in self._cache:
            t = self.raw(name)
            scale = name[: -len("weight")] + "scale" if name.endswith(".weight") else None
            if scale is not None and scale in self and t.dtype in (torch.float8_e4m3fn, torch.int8, torch.uint8):
                self._cache[name] = dequantize(t, self.raw(scale), self.block)
            else:
                self._cache[name] = t.to(DTYPE)
        return self._cache[name]
