"""Engram n-gram memory (DeepSeek V4.1): hash a token's n-grams, look up table rows, gate them into the streams."""

from __future__ import annotations

import torch

from ..quant import QuantizedWeight
from .base import acc_dtype, op
from .invariant import elementwise

#: channels of a table row one UE8M0 scale covers
ENGRAM_SCALE_BLOCK = 32


class EngramOps:
    @op(rows=("tokens",))
    def engram_hash(
        self,
        tokens: torch.Tensor,
        multipliers: torch.Tensor,
        primes: torch.Tensor,
        offsets: torch.Tensor,
    ) -> torch.Tensor:
        """Row ids of each token's 2- to N-gram in one Engram layer's table.

        ``tokens`` ``[T, N]`` int64 is each token's window of compressed ids,
        already padded: ``tokens[t, s]`` is the token ``s`` positions back
        (``s = 0`` the token itself), the pad id where the look-back leaves the
        sequence. ``multipliers`` ``[N]`` int64 (one per look-back), ``primes``
        ``[N−1, H]`` int64 (one per n-gram size ``n = 2..N`` and head),
        ``offsets`` ``[(N−1)·H]`` int64 (where each column's rows start in the
        table). In int64 arithmetic that wraps modulo 2^64::

            products[s] = tokens[:, s] · multipliers[s]
            rolling     = products[0]
            for i in 1..N−1:
                rolling = rolling XOR products[i]          (bitwise)
                column (i−1)·H + h = (rolling mod primes[i−1, h]) + offsets[(i−1)·H + h]

        ``mod`` is floored (the result lies in ``[0, prime)`` even for a
        negative ``rolling``). Column block ``i−1`` is the ``(i+1)``-gram, head
        ``h`` within it. Returns ``[T, (N−1)·H]`` int64 on ``tokens.device``.
        """
        t, n = tokens.shape
        heads = primes.shape[1]
        if t == 0 or n < 2:
            return torch.empty(t, (n - 1) * heads, dtype=torch.int64, device=tokens.device)
        products = tokens.to(torch.int64) * multipliers.to(torch.int64)  # [T, N], wraps like the spec says
        primes = primes.to(torch.int64)
        rolling = products[:, 0]
        columns = []
        for i in range(1, n):
            rolling = torch.bitwise_xor(rolling, products[:, i])
            columns.append(torch.remainder(rolling[:, None], primes[i - 1]))
        # one concatenation, not writes into slices of an empty buffer: inductor's CPU code for the latter
        # divides in lanes outside the slice and raises ZeroDivisionError inside a compiled decode graph
        return torch.cat(columns, dim=1) + offsets.to(torch.int64)

    @op(rows=("ids",))
    def engram_lookup(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor | None,
        ids: torch.Tensor,
        dtype: torch.dtype,
    ) -> torch.Tensor:
        """The table rows ``ids`` names, dequantized: ``[T, C, head_dim]`` in ``dtype`` on ``ids.device``.

        ``ids`` ``[T, C]`` int64 are row ids (``engram_hash``'s output), every
        one in ``[0, rows)``. The table is either

        - FP8: ``codes`` ``[rows, head_dim]`` e4m3 (``float8_e4m3fn``, or its
          raw bytes as ``uint8``) and ``scales`` ``[rows, head_dim / 32]``, one
          UE8M0 exponent byte per 32 consecutive channels (``uint8`` or
          ``float8_e8m0fnu``; the scale is ``2^(byte − 127)``)::

              out[t, c, j] = e4m3(codes[ids[t, c], j]) · 2^(scales[ids[t, c], j // 32] − 127)

          computed in fp32, then rounded to ``dtype``; or
        - unquantized: ``codes`` ``[rows, head_dim]`` in a float dtype and
          ``scales`` None: ``out[t, c] = codes[ids[t, c]]`` converted to ``dtype``.

        ``codes`` and ``scales`` may live on another device than ``ids`` (a
        memory-mapped table on the host): the rows are gathered where the
        table lives and only the gathered rows move to ``ids.device``; the table
        is never read whole.
        """
        t, c = ids.shape
        head_dim = codes.shape[-1]
        if scales is not None and scales.shape[-1] * ENGRAM_SCALE_BLOCK != head_dim:
            raise ValueError(
                f"an FP8 Engram table of {head_dim} channels needs {head_dim // ENGRAM_SCALE_BLOCK} scales per row "
                f"(one per {ENGRAM_SCALE_BLOCK}); got {scales.shape[-1]}"
            )
        if t * c == 0:
            return torch.empty(t, c, head_dim, dtype=dtype, device=ids.device)
        flat = ids.reshape(-1).to(codes.device)
        rows = codes.index_select(0, flat).to(ids.device)
        if scales is None:
            return rows.to(dtype).view(t, c, head_dim)
        exps = scales.index_select(0, flat.to(scales.device)).to(ids.device)
        if exps.dtype != torch.uint8:
            exps = exps.view(torch.uint8)
        weight = QuantizedWeight(rows, exps, (1, ENGRAM_SCALE_BLOCK), "e4m3")
        return weight.dequantize(dtype).view(t, c, head_dim)

    @op(rows=("streams", "key", "value"))
    def engram_inject(
        self,
        streams: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
    ) -> torch.Tensor:
        """Gate an Engram value into each residual stream.

        ``streams`` ``[T, n, D]`` (the ``n`` hyper-connection streams), ``key``
        ``[T, n, D]`` (one key per stream), ``value`` ``[T, D]``, ``weight``
        ``[n, D]`` (the product ``q_weight · k_weight``). Per token ``t`` and
        stream ``k``, with ``h = streams[t, k]``, ``q = key[t, k]``::

            rstd = rsqrt(mean_D(h²) + eps) · rsqrt(mean_D(q²) + eps)
            dot  = Σ_D(h · weight[k] · q) · rstd · D^−½
            gate = sigmoid(sign(dot) · sqrt(max(|dot|, 1e−6)))
            out[t, k] = h + gate · value[t]

        ``sign(0) = 0``, so a zero ``dot`` gives gate ``sigmoid(0) = ½``.
        Computed in fp32 (fp64 for fp64 streams), returned ``[T, n, D]`` in
        ``streams.dtype``.
        """
        acc = acc_dtype(streams)
        d = streams.shape[-1]
        if streams.shape[0] == 0:
            return streams.clone()
        h, q = streams.to(acc), key.to(acc)
        rstd = torch.rsqrt(h.pow(2).mean(-1) + eps) * torch.rsqrt(q.pow(2).mean(-1) + eps)  # [T, n]
        dot = (h * weight.to(acc) * q).sum(-1) * rstd * d**-0.5
        gate = elementwise(torch.sigmoid, self.batch_invariant, torch.sign(dot) * torch.sqrt(dot.abs().clamp(min=1e-6)))
        return (h + gate[..., None] * value.to(acc)[:, None, :]).to(streams.dtype)
