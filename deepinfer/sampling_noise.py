"""Counter-based randomness: a seeded token's noise is a pure function of (seed, completion, position).

A seeded request's exponential-race noise at the position a token will occupy is computed, not drawn
from a generator's stream: hashing (its key, the position, the vocabulary index) with the SplitMix64
finalizer in 64-bit integer arithmetic, the same bits on every device. So which other requests share
the batch, whether and how much was drafted, preemption, forks or the step a token is sampled in never
change which noise a token uses: the draft proposes with it, verification compares with the target's
sample under it, and plain sampling draws with it.
"""

from __future__ import annotations

import torch

#: SplitMix64's constants, as the signed 64-bit integers torch holds
_GOLDEN = -7046029254386353131  # 0x9E3779B97F4A7C15
_MUL1 = -4658895280553007687  # 0xBF58476D1CE4E5B9
_MUL2 = -7723592293110705685  # 0x94D049BB133111EB
_U64 = (1 << 64) - 1
#: the bits of a hash a uniform takes (exact in float32)
_UNIFORM_BITS = 24


def _signed(x: int) -> int:
    """An unsigned 64-bit integer as torch's int64 holds it."""
    x &= _U64
    return x - (1 << 64) if x >= 1 << 63 else x


def _mix_int(x: int) -> int:
    """SplitMix64's finalizer on a Python integer (unsigned 64-bit)."""
    x &= _U64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _U64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _U64
    return x ^ (x >> 31)


def noise_key(seed: int) -> int:
    """The noise key of a completion seeded with ``seed`` (any 64-bit integer; completion ``i`` of a request
    seeded ``s`` has seed ``s + i``)."""
    return _signed(_mix_int(_mix_int(seed) + 0x9E3779B97F4A7C15))


def _shift(x: torch.Tensor, k: int) -> torch.Tensor:
    """Logical right shift of int64 ``x`` by ``k`` (torch's ``>>`` keeps the sign)."""
    return (x >> k) & ((1 << (64 - k)) - 1)


def _mix(x: torch.Tensor) -> torch.Tensor:
    """SplitMix64's finalizer, elementwise on int64 (multiplication wraps, as unsigned arithmetic would)."""
    x = (x ^ _shift(x, 30)) * _MUL1
    x = (x ^ _shift(x, 27)) * _MUL2
    return x ^ _shift(x, 31)


def position_exponentials(keys: torch.Tensor, positions: torch.Tensor, vocab: int) -> torch.Tensor:
    """Exp(1) noise ``[B, vocab]`` (float32): row ``i`` is completion ``keys[i]``'s at ``positions[i]``.

    ``keys``, ``positions``: int64 ``[B]`` on the device the noise is made on."""
    row = _mix(keys ^ _mix(positions * _GOLDEN + 1))
    column = torch.arange(vocab, dtype=torch.int64, device=keys.device) * _GOLDEN
    bits = _shift(_mix(row[:, None] + column[None, :]), 64 - _UNIFORM_BITS)
    uniform = (bits.to(torch.float32) + 0.5) * (2.0 ** -_UNIFORM_BITS)
    return -torch.log(uniform)
