"""The CUDA kernel set: Triton kernels where a fused kernel pays, the reference elsewhere.

Triton is imported only when a kernel runs (the ``triton_*`` modules are
imported inside the methods), so listing plugins never imports it. Empty
batches return without launching anything (the model ops hand them to the
reference, which computes nothing for them). Dtypes the kernels do not handle
(anything outside ``launch.KERNEL_DTYPES``, for the DeepSeek-V4 model ops
outside ``launch.MODEL_DTYPES`` or with operands of mixed dtypes) run the
reference, and so do quantized weights the kernels cannot read (see
``_readable``). ``topk_select`` stays the reference: it is one torch sort.
``engram_lookup`` runs its kernel only when the table lives on the ids'
device: in GPU memory, or pinned host memory the GPU reads in place
(``CUDADevice.map_host``, inside captured graphs too); a memory-mapped host
table is gathered on the host by the reference.

Cache pools may be ``PackedPool``s (``deepinfer_interfaces``): ``cache_write``
quantizes rows into records and scatters them in one kernel per region, and
``sparse_attention``, ``entry_attention``, ``indexer_scores`` and
``indexer_topk`` decode the records of the rows they read in registers (pools
of one or two non-empty regions decoding to the query's dtype; others run the
reference, which decodes the gathered rows). ``kv_pack``, ``kv_unpack`` and
``hadamard`` have their own kernels. ``vit_attention`` (the vision tower's) finds each
token's image on the device from ``cu_seqlens``.
"""

from __future__ import annotations

import torch

from deepinfer_interfaces import KVFormat, Kernels, PackedPool, QuantizedWeight
from deepinfer_interfaces.kernels.engram import ENGRAM_SCALE_BLOCK
from deepinfer_interfaces.kernels.moe import SCORING_FUNCS

from .launch import KERNEL_DTYPES, MODEL_DTYPES, check_device, interpreting
from .pool_operand import readable_pool


def _model_dtypes(*tensors: "torch.Tensor | PackedPool") -> bool:
    """True when every tensor (a packed pool: the dtype its rows decode to) has one dtype the model kernels handle."""
    return tensors[0].dtype in MODEL_DTYPES and all(t.dtype == tensors[0].dtype for t in tensors)


def _storage(pool: "torch.Tensor | PackedPool") -> list[torch.Tensor]:
    """The tensors a pool is stored in (for device checks)."""
    return pool.tensors() if isinstance(pool, PackedPool) else [pool]


def _readable(weight: QuantizedWeight, dims: int) -> bool:
    """True when the kernels decode ``weight``'s codes and scales as stored (a ``dims``-dimensional weight)."""
    codes = (torch.uint8, torch.float8_e4m3fn) if weight.fmt == "e4m3" else (torch.uint8,)
    *lead, n, k = weight.shape
    bn, bk = weight.block
    return (
        weight.codes.dim() == dims
        and weight.codes.dtype in codes
        and weight.scales.dtype in (torch.uint8, torch.float32)
        and bn >= 1
        and bk >= 1
        and tuple(weight.scales.shape) == (*lead, -(-n // bn), -(-k // bk))
    )


def _table_beside(ids: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor | None) -> bool:
    """True when an Engram table lives on ``ids``' device and Triton runs there (the GPU, or the CPU under the
    interpreter); a memory-mapped host table with ids on the GPU is gathered on the host by the reference."""
    here = "cpu" if interpreting() else "cuda"
    return ids.device.type == here and codes.device == ids.device and (scales is None or scales.device == ids.device)


def _readable_table(codes: torch.Tensor, scales: torch.Tensor | None) -> bool:
    """True for the Engram tables the lookup kernel decodes: e4m3 codes with UE8M0 bytes, or a model-dtype table."""
    if scales is None:
        return codes.dtype in MODEL_DTYPES
    return codes.dtype in (torch.uint8, torch.float8_e4m3fn) and scales.dtype in (torch.uint8, torch.float8_e8m0fnu)


class CUDAKernels(Kernels):
    """The Triton kernel set. In batch-invariant mode (``set_batch_invariant``) no launch splits a reduction to
    fill the device, the GEMM-like kernels use one tile height whatever the batch, and the dense ``linear`` runs
    a fixed-tile Triton GEMM instead of cuBLAS (whose algorithm choice follows the batch size)."""

    name = "cuda"
    interface_version = "1.7.0"  # the contract this kernel set was written for

    def linear(self, x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
        """Dense linear: torch's GEMM by default; in batch-invariant mode a fixed-tile Triton GEMM (see ``Kernels.linear``)."""
        if not self.batch_invariant or x.numel() == 0 or not _model_dtypes(x, weight) or x.dtype != weight.dtype:
            return super().linear(x, weight)
        check_device("linear", x, weight)
        from .triton_linear import invariant_linear

        return invariant_linear(x, weight)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """RMSNorm, one Triton program per row (see ``Kernels.rms_norm``)."""
        if x.dtype not in KERNEL_DTYPES:
            return super().rms_norm(x, weight, eps)
        if x.numel() == 0:
            return torch.empty_like(x)
        check_device("rms_norm", x, *([] if weight is None else [weight]))
        from .triton_norm import rms_norm

        return rms_norm(x, weight, eps)

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """Partial interleaved RoPE, forward or inverse, in one pass (see ``Kernels.rope``)."""
        if x.dtype not in KERNEL_DTYPES:
            return super().rope(x, cos, sin, inverse)
        if cos.shape[-1] == 0 or x.numel() == 0:
            return x.clone()
        check_device("rope", x, cos, sin)
        from .triton_rope import rope

        return rope(x, cos, sin, inverse)

    def sample(
        self,
        logits: torch.Tensor,
        temperature: torch.Tensor,
        top_k: torch.Tensor,
        top_p: torch.Tensor,
        min_p: torch.Tensor,
        noise: torch.Tensor,
    ) -> torch.Tensor:
        """Temperature, top-k, top-p and min-p by the exponential race (see ``Kernels.sample``)."""
        if logits.shape[0] == 0:
            return torch.empty(0, dtype=torch.int64, device=logits.device)
        check_device("sample", logits, noise)
        from .triton_sampling import sample

        return sample(logits, temperature, top_k, top_p, min_p, noise)

    def apply_token_bitmask(self, logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
        """Masks disallowed tokens to ``-inf`` in place (see ``Kernels.apply_token_bitmask``)."""
        if logits.numel() == 0:
            return logits
        check_device("apply_token_bitmask", logits)
        from .triton_bitmask import apply_token_bitmask

        return apply_token_bitmask(logits, bitmask)

    def cache_write(self, pool: "torch.Tensor | PackedPool", slots: torch.Tensor, values: torch.Tensor) -> None:
        """Scatters value rows into pool rows, ``-1`` slots skipped, without a host sync; into a packed pool's
        regions as records quantized in the same kernel (see ``Kernels.cache_write``)."""
        if slots.numel() == 0:
            return
        if isinstance(pool, PackedPool):
            if pool.shape[0] == 0 or values.dtype not in MODEL_DTYPES or any(t.stride(-1) != 1 for t in pool.tensors()):
                return super().cache_write(pool, slots, values)
            check_device("cache_write", *pool.tensors(), slots, values)
            from .triton_records import cache_write_packed

            return cache_write_packed(pool, slots, values)
        if not pool.is_contiguous():
            return super().cache_write(pool, slots, values)
        check_device("cache_write", pool, slots, values)
        from .triton_cache import cache_write

        cache_write(pool, slots, values)

    def kv_pack(self, values: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
        """Block scales, codes and bf16 rope channels of each row in one kernel, records equal to the reference's
        byte for byte (see ``Kernels.kv_pack``)."""
        if values.dim() != 2 or values.shape[0] == 0 or values.dtype not in MODEL_DTYPES:
            return super().kv_pack(values, fmt)
        check_device("kv_pack", values)
        from .triton_records import kv_pack

        return kv_pack(values, fmt)

    def kv_unpack(self, records: torch.Tensor, fmt: KVFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Each record's codes times its block scales, and its rope channels, in one kernel (see ``Kernels.kv_unpack``)."""
        if records.numel() == 0 or records.dtype != torch.uint8 or dtype not in MODEL_DTYPES:
            return super().kv_unpack(records, fmt, dtype)
        check_device("kv_unpack", records)
        from .triton_records import kv_unpack

        return kv_unpack(records, fmt, dtype)

    def hadamard(self, x: torch.Tensor) -> torch.Tensor:
        """Rows times the ``±1`` Sylvester matrix built in registers, then ``d^-1/2``, in one kernel (see ``Kernels.hadamard``)."""
        d = x.shape[-1] if x.dim() else 0
        if x.numel() == 0 or x.dtype not in MODEL_DTYPES or d < 1 or d & (d - 1):
            return super().hadamard(x)
        from .triton_hadamard import MAX_WIDTH, hadamard

        if d > MAX_WIDTH:
            return super().hadamard(x)
        check_device("hadamard", x)
        return hadamard(x)

    def sparse_attention(
        self, q: torch.Tensor, kv: "torch.Tensor | PackedPool", indices: torch.Tensor, sinks: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Online-softmax attention over gathered rows (a packed pool's decoded in registers) with sinks, split over
        the rows at decode (see ``Kernels.sparse_attention``)."""
        if q.shape[0] == 0 or indices.shape[-1] == 0 or not _model_dtypes(q, kv) or not readable_pool(kv):
            return super().sparse_attention(q, kv, indices, sinks, scale)
        check_device("sparse_attention", q, *_storage(kv), indices, sinks)
        from .triton_attention import sparse_attention

        return sparse_attention(q, kv, indices, sinks, scale, invariant=self.batch_invariant)

    def indexer_scores(
        self, q: torch.Tensor, weights: torch.Tensor, keys: "torch.Tensor | PackedPool", indices: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Head-summed ReLU scores of gathered keys (packed ones decoded in registers) in one pass (see ``Kernels.indexer_scores``)."""
        if indices.shape[0] == 0 or indices.shape[-1] == 0 or not _model_dtypes(q, keys) or not readable_pool(keys):
            return super().indexer_scores(q, weights, keys, indices, scale)
        check_device("indexer_scores", q, weights, *_storage(keys), indices)
        from .triton_indexer import indexer_scores

        return indexer_scores(q, weights, keys, indices, scale)

    def indexer_topk(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: "torch.Tensor | PackedPool",
        table: torch.Tensor,
        token_seq: torch.Tensor,
        visible: torch.Tensor,
        scale: float,
        k: int,
    ) -> torch.Tensor:
        """Indexer scores (packed keys decoded in registers) and a running top-k in registers over each token's
        entries (see ``Kernels.indexer_topk``)."""
        n = table.shape[-1]
        if q.shape[0] == 0 or n == 0 or k < 1 or not _model_dtypes(q, keys) or not readable_pool(keys):
            return super().indexer_topk(q, weights, keys, table, token_seq, visible, scale, k)
        check_device("indexer_topk", q, weights, *_storage(keys), table, token_seq, visible)
        from .triton_long_context import MAX_TOPK, indexer_topk, topk_width

        if topk_width(k, n) > MAX_TOPK:  # wider than the registers hold: the reference, tiled too
            return super().indexer_topk(q, weights, keys, table, token_seq, visible, scale, k)
        return indexer_topk(q, weights, keys, table, token_seq, visible, scale, k, invariant=self.batch_invariant)

    def entry_attention(
        self,
        q: torch.Tensor,
        kv: "torch.Tensor | PackedPool",
        indices: torch.Tensor,
        table: torch.Tensor,
        token_seq: torch.Tensor,
        visible: torch.Tensor,
        sinks: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Online-softmax attention with sinks over listed rows, then visible entries (a packed pool's rows decoded in
        registers; see ``Kernels.entry_attention``)."""
        if q.shape[0] == 0 or table.shape[-1] == 0 or not _model_dtypes(q, kv) or not readable_pool(kv):
            return super().entry_attention(q, kv, indices, table, token_seq, visible, sinks, scale)
        check_device("entry_attention", q, *_storage(kv), indices, table, token_seq, visible, sinks)
        from .triton_long_context import entry_attention

        return entry_attention(q, kv, indices, table, token_seq, visible, sinks, scale, invariant=self.batch_invariant)

    def candidate_blocks(self, scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block_size: int) -> torch.Tensor:
        """Block maxima, then the top blocks by bisection on their keys, without a host sync (see ``Kernels.candidate_blocks``)."""
        if scores.numel() == 0 or scores.dtype not in MODEL_DTYPES or topk_blocks < 1 or block_size < 1:
            return super().candidate_blocks(scores, visible, topk_blocks, block_size)
        check_device("candidate_blocks", scores, visible)
        from .triton_candidates import candidate_blocks

        return candidate_blocks(scores, visible, topk_blocks, block_size)

    def compress_kv(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        position_bias: torch.Tensor,
        indices: torch.Tensor,
        prev_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Gated softmax pooling of each window, per channel, online (see ``Kernels.compress_kv``)."""
        if indices.shape[0] == 0 or not _model_dtypes(kv, gate):
            return super().compress_kv(kv, gate, position_bias, indices, prev_indices)
        check_device("compress_kv", kv, gate, position_bias, indices, *([] if prev_indices is None else [prev_indices]))
        from .triton_compressor import compress_kv

        return compress_kv(kv, gate, position_bias, indices, prev_indices)

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
        """Fused norm + mixing matmul, then sigmoid / Sinkhorn / collapse (see ``Kernels.mhc_pre``)."""
        if x.shape[0] == 0 or x.dtype not in MODEL_DTYPES:
            return super().mhc_pre(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
        check_device("mhc_pre", x, fn, base, scale)
        from .triton_mhc import mhc_pre

        return mhc_pre(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, invariant=self.batch_invariant)

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
        """``mhc_pre``'s two kernels with the collapse left out, ``pre`` stored instead (see ``Kernels.mhc_mix``)."""
        if x.shape[0] == 0 or x.dtype not in MODEL_DTYPES:
            return super().mhc_mix(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)
        check_device("mhc_mix", x, fn, base, scale)
        from .triton_mhc import mhc_mix

        return mhc_mix(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters, invariant=self.batch_invariant)

    def mhc_collapse(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """The weighted sum of the streams, ``mhc_pre``'s collapse with ``pre`` given (see ``Kernels.mhc_collapse``)."""
        if x.shape[0] == 0 or x.dtype not in MODEL_DTYPES or pre.dtype not in MODEL_DTYPES:
            return super().mhc_collapse(x, pre)
        check_device("mhc_collapse", x, pre)
        from .triton_mhc import mhc_collapse

        return mhc_collapse(x, pre)

    def mhc_post(self, y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """Stream expansion and residual mixing in one pass (see ``Kernels.mhc_post``)."""
        if x.shape[0] == 0 or x.dtype not in MODEL_DTYPES:
            return super().mhc_post(y, x, post, comb)
        check_device("mhc_post", y, x, post, comb)
        from .triton_mhc import mhc_post

        return mhc_post(y, x, post, comb)

    def mhc_head(
        self, x: torch.Tensor, fn: torch.Tensor, base: torch.Tensor, scale: torch.Tensor, norm_eps: float, hc_eps: float
    ) -> torch.Tensor:
        """The final stream collapse, as ``mhc_pre`` without post and Sinkhorn (see ``Kernels.mhc_head``)."""
        if x.shape[0] == 0 or x.dtype not in MODEL_DTYPES:
            return super().mhc_head(x, fn, base, scale, norm_eps, hc_eps)
        check_device("mhc_head", x, fn, base, scale)
        from .triton_mhc import mhc_head

        return mhc_head(x, fn, base, scale, norm_eps, hc_eps, invariant=self.batch_invariant)

    def vit_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Flash attention over the packed images, each token's image found from ``cu_seqlens`` on the device, no
        host read (see ``Kernels.vit_attention`` and ``triton_vit``)."""
        if q.shape[0] == 0 or not _model_dtypes(q, k, v):
            return super().vit_attention(q, k, v, cu_seqlens, scale)
        check_device("vit_attention", q, k, v, cu_seqlens)
        from .triton_vit import vit_attention

        return vit_attention(q, k, v, cu_seqlens, scale)

    def engram_hash(
        self, tokens: torch.Tensor, multipliers: torch.Tensor, primes: torch.Tensor, offsets: torch.Tensor
    ) -> torch.Tensor:
        """Wrapping int64 products, running XOR and floored per-head modulo in one kernel (see ``Kernels.engram_hash``)."""
        if tokens.dim() != 2 or tokens.shape[0] == 0 or tokens.shape[1] < 2 or tokens.dtype not in (torch.int64, torch.int32):
            return super().engram_hash(tokens, multipliers, primes, offsets)
        check_device("engram_hash", tokens, multipliers, primes, offsets)
        from .triton_engram import engram_hash

        return engram_hash(tokens, multipliers, primes, offsets)

    def engram_lookup(
        self, codes: torch.Tensor, scales: torch.Tensor | None, ids: torch.Tensor, dtype: torch.dtype
    ) -> torch.Tensor:
        """Gather and dequantize table rows in one kernel when the table is on the ids' device; the reference's
        host gather otherwise (see ``Kernels.engram_lookup``)."""
        if (
            ids.dim() != 2
            or ids.numel() == 0
            or codes.dim() != 2
            or dtype not in MODEL_DTYPES
            or ids.dtype != torch.int64
            or not _readable_table(codes, scales)
            or (scales is not None and (scales.dim() != 2 or scales.shape[-1] * ENGRAM_SCALE_BLOCK != codes.shape[-1]))
            or not _table_beside(ids, codes, scales)
        ):
            return super().engram_lookup(codes, scales, ids, dtype)
        from .triton_engram import engram_lookup

        return engram_lookup(codes, scales, ids, dtype)

    def engram_inject(
        self, streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """RMS statistics, the signed-sqrt sigmoid gate and the residual add, one program per (token, stream)
        (see ``Kernels.engram_inject``)."""
        if streams.dim() != 3 or streams.shape[0] == 0 or any(x.dtype not in MODEL_DTYPES for x in (streams, key, value, weight)):
            return super().engram_inject(streams, key, value, weight, eps)
        check_device("engram_inject", streams, key, value, weight)
        from .triton_engram import engram_inject

        return engram_inject(streams, key, value, weight, eps)

    def moe_route(
        self,
        logits: torch.Tensor,
        bias: torch.Tensor | None,
        top_k: int,
        routed_scaling: float,
        scoring: str = "sqrtsoftplus",
        renormalize: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Scoring, biased top-k, renormalisation and scaling in one kernel (see ``Kernels.moe_route``)."""
        if (
            logits.shape[0] == 0
            or not 0 < top_k <= logits.shape[-1]
            or logits.dtype not in MODEL_DTYPES
            or scoring not in SCORING_FUNCS
        ):
            return super().moe_route(logits, bias, top_k, routed_scaling, scoring, renormalize)
        check_device("moe_route", logits, *([] if bias is None else [bias]))
        from .triton_moe import route

        return route(logits, bias, top_k, routed_scaling, scoring, renormalize)

    def hash_route(
        self,
        logits: torch.Tensor,
        token_ids: torch.Tensor,
        tid2eid: torch.Tensor,
        routed_scaling: float,
        scoring: str = "sqrtsoftplus",
        renormalize: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Table lookup of the experts and their router weights in one kernel (see ``Kernels.hash_route``)."""
        if logits.shape[0] == 0 or tid2eid.shape[-1] == 0 or logits.dtype not in MODEL_DTYPES or scoring not in SCORING_FUNCS:
            return super().hash_route(logits, token_ids, tid2eid, routed_scaling, scoring, renormalize)
        check_device("hash_route", logits, token_ids, tid2eid)
        from .triton_moe import route

        return route(logits, None, 0, routed_scaling, scoring, renormalize, token_ids, tid2eid)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
        """Clamped SwiGLU, elementwise in fp32 (see ``Kernels.swiglu``)."""
        if gate.numel() == 0 or not _model_dtypes(gate, up):
            return super().swiglu(gate, up, limit)
        check_device("swiglu", gate, up)
        from .triton_moe import swiglu

        return swiglu(gate, up, limit)

    def moe_experts(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        limit: float | None,
    ) -> torch.Tensor:
        """Grouped clamped-SwiGLU expert matmuls over expert-sorted pairs (see ``Kernels.moe_experts``)."""
        if x.shape[0] == 0 or topk_ids.shape[-1] == 0 or w13.shape[0] == 0 or not _model_dtypes(x, w13, w2):
            return super().moe_experts(x, topk_ids, topk_weights, w13, w2, limit)
        check_device("moe_experts", x, topk_ids, topk_weights, w13, w2)
        from .triton_experts import moe_experts

        return moe_experts(x, topk_ids, topk_weights, w13, w2, limit, invariant=self.batch_invariant)

    def fp8_linear(self, x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
        """Block-scaled GEMM: FP8 tensor cores over per-token e4m3 activations where the GPU has them,
        weight tiles decoded in the kernel otherwise (see ``Kernels.fp8_linear``)."""
        if x.dim() != 2 or x.dtype not in MODEL_DTYPES or not _readable(weight, 2):
            return super().fp8_linear(x, weight)
        n = weight.shape[0]
        if x.shape[0] == 0 or n == 0:
            return x.new_zeros(x.shape[0], n)
        check_device("fp8_linear", x, weight.codes, weight.scales)
        from .triton_fp8 import fp8_linear

        return fp8_linear(x, weight, invariant=self.batch_invariant)

    def moe_experts_quantized(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        w13: QuantizedWeight,
        w2: QuantizedWeight,
        limit: float | None,
    ) -> torch.Tensor:
        """The grouped expert kernels with FP8 / FP4 codes decoded inside both matmuls (see ``Kernels.moe_experts_quantized``)."""
        if (
            x.shape[0] == 0
            or topk_ids.shape[-1] == 0
            or w13.shape[0] == 0
            or x.dtype not in MODEL_DTYPES
            or not (_readable(w13, 3) and _readable(w2, 3))
        ):
            return super().moe_experts_quantized(x, topk_ids, topk_weights, w13, w2, limit)
        check_device("moe_experts_quantized", x, topk_ids, topk_weights, w13.codes, w13.scales, w2.codes, w2.scales)
        from .triton_experts import moe_experts

        return moe_experts(x, topk_ids, topk_weights, w13, w2, limit, invariant=self.batch_invariant)
