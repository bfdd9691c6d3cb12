"""Manifold-constrained hyper-connections (mHC): mixing ``n`` residual streams.

V4 collapses a site's streams with that site's own ``pre`` (``mhc_pre``) and
the final streams with head weights of their own (``mhc_head``). V4.1 computes
the same mixes from one projection, but a site's ``pre`` is consumed by the
next site: the attention input collapses with the previous site's ``pre`` (the
first layer's with a one-hot ``pre`` on stream 0), the FFN input with the
attention site's, and the final hidden state with the last FFN site's (there is
no head). So ``mhc_pre`` is the two halves V4.1 calls apart: ``mhc_mix`` (the
weights) then ``mhc_collapse`` (the weighted sum of the streams).
"""

from __future__ import annotations

import torch

from .base import acc_dtype, op
from .invariant import elementwise, matmul_rows


def _mix_logits(x: torch.Tensor, fn: torch.Tensor, norm_eps: float, acc: torch.dtype, invariant: bool) -> torch.Tensor:
    """Unweighted RMS norm of the flattened streams, then the linear map ``fn`` (row-tiled when ``invariant``)."""
    flat = x.flatten(1).to(acc)
    flat = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + norm_eps)
    return matmul_rows(flat, fn.to(acc).t(), invariant)


class MHCOps:
    @op(rows=("x",))
    def mhc_mix(
        self,
        x: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        norm_eps: float,
        hc_eps: float,
        sinkhorn_iters: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The three mixes of one hyper-connection site, from one projection of its streams.

        ``x`` is ``[T, n, D]`` (``n`` residual streams per token), ``fn``
        ``[(2+n)·n, n·D]``, ``base`` ``[(2+n)·n]``, ``scale`` ``[3]``. With
        ``u = rmsnorm(flatten(x), eps=norm_eps) @ fnᵀ`` split into
        ``(u_pre [n], u_post [n], u_comb [n·n])`` and ``base`` likewise::

            pre  = sigmoid(u_pre · scale[0] + base_pre) + hc_eps
            post = 2 · sigmoid(u_post · scale[1] + base_post)
            comb = softmax_k(u_comb · scale[2] + base_comb) + hc_eps     (as [n, n] = [j, k])

        then Sinkhorn normalisation of ``comb``: divide each column (sum over
        ``j``) by its sum ``+ hc_eps``, then ``sinkhorn_iters − 1`` times divide
        rows (sum over ``k``) then columns likewise. ``comb[j, k]`` is the share
        of input stream ``j`` in output stream ``k`` (see ``mhc_post``).

        Returns ``pre`` ``[T, n]``, ``post`` ``[T, n]`` and ``comb`` ``[T, n, n]``,
        in fp32 (fp64 for fp64 x).
        """
        acc = acc_dtype(x)
        n = x.shape[1]
        u = _mix_logits(x, fn, norm_eps, acc, self.batch_invariant)
        u_pre, u_post, u_comb = u.split([n, n, n * n], dim=-1)
        b = base.to(acc)
        b_pre, b_post, b_comb = b.split([n, n, n * n])
        s = scale.to(acc)
        pre = elementwise(torch.sigmoid, self.batch_invariant, u_pre * s[0] + b_pre) + hc_eps
        post = 2 * elementwise(torch.sigmoid, self.batch_invariant, u_post * s[1] + b_post)
        comb = torch.softmax(u_comb.view(-1, n, n) * s[2] + b_comb.view(n, n), dim=-1) + hc_eps
        # Sinkhorn on a [j, k, T] copy: both sums then run over a leading dim of contiguous token vectors
        # (eps as a 0-dim tensor of the same dtype: the same value as the float, without wrapping it each time)
        c = comb.permute(1, 2, 0).contiguous()
        eps = torch.full((), hc_eps, dtype=acc, device=x.device)
        c = c / (c.sum(dim=0, keepdim=True) + eps)
        for _ in range(sinkhorn_iters - 1):
            c = c / (c.sum(dim=1, keepdim=True) + eps)
            c = c / (c.sum(dim=0, keepdim=True) + eps)
        return pre, post, c.permute(2, 0, 1).contiguous()

    @op(rows=("x", "pre"))
    def mhc_collapse(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The block input a hyper-connection feeds: the streams summed with the weights ``pre``.

        ``x`` ``[T, n, D]``, ``pre`` ``[T, n]`` (from ``mhc_mix``; in V4.1 the
        previous site's)::

            out[t] = Σ_j pre[t, j] · x[t, j]

        Computed in fp32 (fp64 for fp64 x), returned ``[T, D]`` in ``x.dtype``.
        """
        acc = acc_dtype(x)
        return (pre.to(acc)[..., None] * x.to(acc)).sum(dim=1).to(x.dtype)

    @op(rows=("x",))
    def mhc_pre(
        self,
        x: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        norm_eps: float,
        hc_eps: float,
        sinkhorn_iters: int,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Weights of one hyper-connection and the block input they collapse (V4).

        ``mhc_mix`` of ``x``, then ``mhc_collapse`` of ``x`` with that same
        site's ``pre``. Returns ``collapsed`` ``[T, D]`` in ``x.dtype``, and
        ``post`` ``[T, n]`` and ``comb`` ``[T, n, n]`` in fp32 (fp64 for fp64 x).
        """
        pre, post, comb = self.mhc_mix(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
        return self.mhc_collapse(x, pre), post, comb

    @op(rows=("y", "x", "post", "comb"))
    def mhc_post(self, y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """Expand a block's output back into ``n`` streams and add the mixed residual.

        ``y`` ``[T, D]`` is the block output, ``x`` ``[T, n, D]`` the streams that
        entered the block, ``post`` ``[T, n]`` and ``comb`` ``[T, n, n]`` from
        ``mhc_mix`` (or ``mhc_pre``)::

            out[t, k] = post[t, k] · y[t] + Σ_j comb[t, j, k] · x[t, j]

        Computed in fp32 (fp64 for fp64 x), returned in ``x.dtype``.
        """
        acc = acc_dtype(x)
        mixed = torch.einsum("tjk,tjd->tkd", comb.to(acc), x.to(acc))
        return (post.to(acc)[..., None] * y.to(acc)[:, None, :] + mixed).to(x.dtype)

    @op(rows=("x",))
    def mhc_head(
        self,
        x: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        norm_eps: float,
        hc_eps: float,
    ) -> torch.Tensor:
        """The final collapse of ``n`` streams into one hidden state (V4; V4.1 has no head).

        ``x`` ``[T, n, D]``, ``fn`` ``[n, n·D]``, ``base`` ``[n]``, ``scale`` ``[1]``::

            pre = sigmoid((rmsnorm(flatten(x), eps=norm_eps) @ fnᵀ) · scale + base) + hc_eps
            out = Σ_j pre_j · x_j

        Computed in fp32 (fp64 for fp64 x), returned ``[T, D]`` in ``x.dtype``.
        """
        acc = acc_dtype(x)
        u = _mix_logits(x, fn, norm_eps, acc, self.batch_invariant)
        pre = elementwise(torch.sigmoid, self.batch_invariant, u * scale.to(acc) + base.to(acc)) + hc_eps
        return self.mhc_collapse(x, pre)
