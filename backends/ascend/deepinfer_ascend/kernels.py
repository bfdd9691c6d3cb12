"""The Ascend kernel set: torch_npu fused ops and Triton-Ascend kernels, the reference elsewhere.

Where each op runs is decided at call time (see :meth:`AscendKernels.paths`):

- an op mapped to a torch_npu fused op runs it when torch_npu imports and the
  tensors are on an NPU, unless the fused op does not take the inputs (a
  dtype, a shape limit, the SoC: ``fp8_linear`` and ``moe_experts_quantized``
  need the FP8/MX matmuls of Ascend 950 and ``sparse_attention`` the sinks of
  its ``npu_sparse_flash_attention``, so A2/A3 run their reference);
- an op with a Triton-Ascend kernel runs it on NPU tensors (Triton-Ascend
  installed) or on CPU tensors under Triton's interpreter (``--interpret``);
  on Ascend 950, ``indexer_scores``, ``mhc_pre``, ``mhc_mix``, ``mhc_post`` and
  ``entry_attention`` (and ``indexer_topk`` on 950, A3 and A2) run the SoC's own
  fused op first where it takes the inputs, the Triton-Ascend kernel otherwise
  (and after the fused op raised);
- otherwise, and for every op named in ``DEEPINFER_ASCEND_DISABLE``, the
  reference runs (plain torch, on whatever device the tensors are on).

A fused op that raises (a RuntimeError from an op the SoC or the CANN release
does not have, a TypeError from a changed signature) never fails a generation:
the op's reference result is returned, one warning line on the
``deepinfer.ascend`` logger names the op and the error, and that op runs the
reference from then on.

Batch-invariant mode (``set_batch_invariant(True)``) turns on the determinism
switches torch-npu offers (``deterministic.py``) and sends every op this set
runs itself to the reference's batch-invariant path: none of its fused ops has
a batch-invariant mode. A strict set raises ``NotSupportedError`` for those ops
instead, naming the fused op or kernel, so conformance reports them
``not_supported`` rather than measuring the reference.

``strict`` changes only the "otherwise": a strict kernel set raises
``NotSupportedError("needs torch_npu: …")`` (or "needs Triton-Ascend") instead
of quietly running the reference, so conformance reports those ops
``not_supported`` rather than measuring the reference under the Ascend name.
The conformance runner asks for the strict view through :meth:`for_conformance`;
the engine uses the default, non-strict set, so a model runs end to end on any
device. Empty batches return their (empty) result without launching anything.
torch_npu and Triton are imported only when an op needs them.

Packed cache pools (``PackedPool``, the KV cache as FP8/FP4 records) never
reach a torch_npu op: ``npu_sparse_flash_attention`` and
``npu_lightning_indexer`` read plain fp16/bf16 rows. ``kv_pack``, ``kv_unpack``
and the packed ``cache_write`` are Triton-Ascend kernels
(``triton_ascend_kv_quant``, byte for byte the reference's records); the ops
that read a pool (``sparse_attention``, ``entry_attention``, ``indexer_scores``,
``indexer_topk``) read packed records in their Triton-Ascend kernels:
``sparse_attention`` decodes the rows each token lists into a plain block
(``take_rows``, any number of regions) and attends over it as over a plain pool
(``npu_sparse_flash_attention`` where it takes it); the others decode each row
of a one-format pool as they load it. ``entry_attention`` over a pool of several
record formats (V4.1's FP4 entries and FP8 window in one numbering), and any
pool decoding to another dtype, runs the reference, which decodes only the rows
it gathers; a strict set reports it ``NotSupportedError`` instead.
"""

from __future__ import annotations

import logging
from types import ModuleType
from typing import Any, Callable, ClassVar, TypeVar

import torch

from deepinfer_interfaces import Kernels, NotSupportedError, PackedPool, QuantizedWeight
from deepinfer_interfaces.kv_format import KVFormat

from .deterministic import no_batch_invariance_reason, set_deterministic
from .launch import KERNEL_DTYPES, is_disabled, on_npu, packed_pool_reason, triton_can_run
from .npu import load_torch_npu

R = TypeVar("R")

log = logging.getLogger("deepinfer.ascend")

TRITON = "triton-ascend"

#: the most bytes of decoded rows ``sparse_attention`` over a packed pool gathers at once (a chunk of tokens' listed
#: rows, ``T × K × D`` in the pool dtype); a longer step walks its tokens in chunks
GATHER_BYTES = 256 << 20

#: the reference itself, for ops whose reference is composed of other ops (``mhc_pre`` is ``mhc_mix`` then
#: ``mhc_collapse``, ``mhc_head`` ends in ``mhc_collapse``): through ``super()`` it would call this set's overrides
#: of the parts, so a disabled or failed op would still run fused ops or kernels
_REFERENCE = Kernels()
#: the same in batch-invariant mode
_INVARIANT_REFERENCE = Kernels()
_INVARIANT_REFERENCE.set_batch_invariant(True)


class AscendKernels(Kernels):
    name = "ascend"
    interface_version = "1.7.0"  # the contract this kernel set was written for

    #: op -> where it runs on Ascend: ``torch_npu:<fused op>``, ``triton-ascend``, or a Triton-Ascend kernel that
    #: Ascend 950 replaces by its own fused op where the op takes the inputs: ``triton-ascend (950: torch_npu:<op>)``
    _PATHS: ClassVar[dict[str, str]] = {
        "rms_norm": "torch_npu:npu_rms_norm",
        "rope": "torch_npu:npu_rotary_mul",
        "moe_route": "torch_npu:npu_moe_gating_top_k",
        "hash_route": "torch_npu:npu_moe_gating_top_k",
        "swiglu": "torch_npu:npu_clipped_swiglu",
        "moe_experts": "torch_npu:npu_grouped_matmul",
        "fp8_linear": "torch_npu:npu_quant_matmul",
        "moe_experts_quantized": "torch_npu:npu_grouped_matmul",
        "sparse_attention": "torch_npu:npu_sparse_flash_attention",
        "compress_kv": TRITON,
        "indexer_scores": f"{TRITON} (950: torch_npu:npu_lightning_indexer)",
        "mhc_pre": f"{TRITON} (950: torch_npu:npu_mhc_pre+npu_mhc_sinkhorn)",
        "mhc_mix": f"{TRITON} (950: torch_npu:npu_mhc_pre+npu_mhc_sinkhorn)",
        "mhc_collapse": TRITON,
        "mhc_post": f"{TRITON} (950: torch_npu:npu_mhc_post)",
        "mhc_head": TRITON,
        "candidate_blocks": TRITON,
        "engram_inject": TRITON,
        "indexer_topk": f"{TRITON} (950/A3/A2: torch_npu:npu_lightning_indexer)",
        "entry_attention": f"{TRITON} (950: torch_npu:npu_sparse_flash_attention)",
        "cache_write": f"{TRITON} (packed pools)",
        "kv_pack": TRITON,
        "kv_unpack": TRITON,
        "vit_attention": "torch_npu:npu_fusion_attention",
    }

    def __init__(self, strict: bool = False, torch_npu: Any = None) -> None:
        """``torch_npu``: where the fused ops come from. None (the default) imports the real torch_npu on
        first use and runs its ops on NPU tensors only; an object given here (a stand-in in tests, a wrapped
        build) is used as it is, on tensors of any device."""
        self.strict = strict
        self._torch_npu = torch_npu
        #: op -> the one-line error that sent it to the reference for good
        self.failed: dict[str, str] = {}

    @classmethod
    def paths(cls) -> dict[str, str]:
        """Every op this set runs itself, and how: ``torch_npu:<op name>`` or ``triton-ascend``."""
        return dict(cls._PATHS)

    def for_conformance(self) -> "AscendKernels":
        """The strict view conformance checks: ops that cannot run here are not_supported, not the reference."""
        view = type(self)(strict=True, torch_npu=self._torch_npu)
        view.batch_invariant = self.batch_invariant
        return view

    def set_batch_invariant(self, enabled: bool) -> None:
        """Batch-invariant mode (see ``Kernels``): on the NPU, torch's deterministic algorithms and
        ``HCCL_DETERMINISTIC`` (``deterministic.py``); every op this set runs itself takes the reference's
        batch-invariant path (a strict set raises ``NotSupportedError`` for it)."""
        super().set_batch_invariant(enabled)
        if self._torch_npu is None and load_torch_npu()[0] is not None:
            set_deterministic(enabled)

    def _reference(self) -> Kernels:
        """The reference kernel set in this set's mode (``_REFERENCE``)."""
        return _INVARIANT_REFERENCE if self.batch_invariant else _REFERENCE

    def _not_batch_invariant(self, op: str, reference: Callable[[], R]) -> R:
        """``op`` in batch-invariant mode: the reference's path, or ``NotSupportedError`` from a strict set."""
        if self.strict and not is_disabled(op):
            raise NotSupportedError(no_batch_invariance_reason(op, self._PATHS.get(op, TRITON)))
        return reference()

    # -- routing -------------------------------------------------------------

    def _npu_module(self) -> tuple[Any, str | None]:
        """The module the fused ops come from: the one given to the constructor, else the real torch_npu."""
        if self._torch_npu is not None:
            return self._torch_npu, None
        return load_torch_npu()

    def _fused(self, op: str, tensors: tuple[torch.Tensor, ...], fused: Callable[[ModuleType], R], reference: Callable[[], R]) -> R:
        """Run ``fused(torch_npu)`` when it can run here, else the reference (or raise when strict).

        An error from the fused op other than ``NotSupportedError`` (which is about these inputs only)
        sends ``op`` to the reference for good, with one warning line; a strict set raises it instead,
        so conformance reports it.
        """
        if is_disabled(op) or (op in self.failed and not self.strict):
            return reference()
        if self.batch_invariant:
            return self._not_batch_invariant(op, reference)
        module, reason = self._npu_module()
        if module is None or (self._torch_npu is None and not on_npu(*tensors)):
            if not self.strict:
                return reference()
            where = reason if module is None else f"the tensors are on {tensors[0].device.type}, not an NPU"
            raise NotSupportedError(f"needs torch_npu: {self._PATHS[op]} ({where})")
        try:
            return fused(module)
        except NotSupportedError:
            if self.strict:
                raise
            return reference()
        except Exception as exc:
            if self.strict:
                raise
            self._give_up(op, exc)
            return reference()

    def _give_up(self, op: str, exc: Exception) -> None:
        """Record that ``op``'s fused path raised and say so in one warning line."""
        lines = str(exc).strip().splitlines()
        self.failed[op] = f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
        log.warning("ascend: %s (%s) raised %s; %s runs its fallback (%s) from now on",
                    op, self._PATHS[op], self.failed[op], op, "the Triton-Ascend kernel" if TRITON in self._PATHS[op] else "the reference")

    def _triton(self, op: str, tensors: tuple[torch.Tensor, ...], kernel: Callable[[], R], reference: Callable[[], R]) -> R:
        """Run the Triton-Ascend ``kernel`` when it can run here, else the reference (or raise when strict)."""
        if is_disabled(op) or any(t.dtype not in KERNEL_DTYPES for t in tensors if t.is_floating_point()):
            return reference()
        if self.batch_invariant:
            return self._not_batch_invariant(op, reference)
        if triton_can_run(*tensors):
            try:
                return kernel()
            except NotSupportedError:  # e.g. tiles that cannot fit the unified buffer at these shapes
                if self.strict:
                    raise
                return reference()
        if not self.strict:
            return reference()
        device = tensors[0].device.type
        if device == "npu":
            raise NotSupportedError(f"needs Triton-Ascend: {op} is a Triton-Ascend kernel (pip install triton-ascend matched to CANN)")
        _, reason = load_torch_npu()
        raise NotSupportedError(
            f"needs torch_npu or the Triton interpreter: {op} is a Triton-Ascend kernel "
            f"({reason or 'the tensors are on ' + device}; CPU tensors run it under --interpret)"
        )

    def _packed(
        self, op: str, pool: PackedPool, tensors: tuple[torch.Tensor, ...], kernel: Callable[[], R] | None,
        reference: Callable[[], R], one_format: bool = True,
    ) -> R:
        """``op`` over a packed pool: its Triton-Ascend ``kernel`` where it reads the pool (as ``_triton``
        decides; ``one_format``: a kernel that reads pools of one record format), else the reference, which
        decodes only the rows it gathers; a strict set raises ``NotSupportedError`` instead of running the reference."""
        reason = "no Triton-Ascend kernel of it reads packed records" if kernel is None else packed_pool_reason(pool, one_format)
        if self.batch_invariant:
            return self._not_batch_invariant(op, reference)
        if reason is None:
            return self._triton(op, (*tensors, *pool.tensors()), kernel, reference)
        if self.strict and not is_disabled(op):
            raise NotSupportedError(f"{op} over this packed pool runs the reference on Ascend: {reason}")
        return reference()

    def _fused_module(self, tensors: tuple[torch.Tensor, ...]) -> Any | None:
        """The module a fused op would run from for ``tensors`` (as ``_fused`` decides), None where none can run.

        For the ops whose fused op comes before a Triton-Ascend kernel: inputs the fused op does not take go to
        the kernel before ``_fused`` is asked, so a strict set does not report them not_supported."""
        module, _ = self._npu_module()
        if module is None or (self._torch_npu is None and not on_npu(*tensors)):
            return None
        return module

    # -- torch_npu fused ops -------------------------------------------------

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
        """``npu_rms_norm`` (see ``npu_ops.rms_norm``)."""
        if x.numel() == 0:
            return torch.empty_like(x)
        from . import npu_ops

        return self._fused("rms_norm", (x,), lambda tn: npu_ops.rms_norm(tn, x, weight, eps), lambda: super(AscendKernels, self).rms_norm(x, weight, eps))

    def rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
        """``npu_rotary_mul`` in interleave mode on the rope slice (see ``npu_ops.rope``)."""
        if cos.shape[-1] == 0 or x.shape[0] == 0:
            return x.clone()
        from . import npu_ops

        return self._fused("rope", (x,), lambda tn: npu_ops.rope(tn, x, cos, sin, inverse), lambda: super(AscendKernels, self).rope(x, cos, sin, inverse))

    def moe_route(
        self,
        logits: torch.Tensor,
        bias: torch.Tensor | None,
        top_k: int,
        routed_scaling: float,
        scoring: str = "sqrtsoftplus",
        renormalize: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``npu_moe_gating_top_k`` for sigmoid scoring; V4's sqrtsoftplus (and softmax) run the reference."""
        reference = lambda: super(AscendKernels, self).moe_route(logits, bias, top_k, routed_scaling, scoring, renormalize)  # noqa: E731
        if scoring != "sigmoid" or logits.shape[0] == 0:
            return reference()
        from . import npu_ops

        return self._fused("moe_route", (logits,), lambda tn: npu_ops.moe_route_sigmoid(tn, logits, bias, top_k, routed_scaling, renormalize), reference)

    def hash_route(
        self,
        logits: torch.Tensor,
        token_ids: torch.Tensor,
        tid2eid: torch.Tensor,
        routed_scaling: float,
        scoring: str = "sqrtsoftplus",
        renormalize: bool = True,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The hash mode of ``npu_moe_gating_top_k``, V4's sqrtsoftplus included (see ``npu_v4_ops.hash_route``)."""
        reference = lambda: super(AscendKernels, self).hash_route(  # noqa: E731
            logits, token_ids, tid2eid, routed_scaling, scoring, renormalize
        )
        if logits.shape[0] == 0:
            return reference()
        from . import npu_v4_ops

        return self._fused(
            "hash_route", (logits, token_ids),
            lambda tn: npu_v4_ops.hash_route(tn, logits, token_ids, tid2eid, routed_scaling, scoring, renormalize), reference,
        )

    def sparse_attention(
        self, q: torch.Tensor, kv: torch.Tensor, indices: torch.Tensor, sinks: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """``npu_sparse_flash_attention`` with sinks on Ascend 950 (see ``npu_v4_ops.sparse_attention``). A packed
        pool (any regions): the rows each token lists decoded by a Triton-Ascend kernel
        (``triton_ascend_kv_quant.take_rows``) into a plain ``[T·K, D]`` block, at most ``GATHER_BYTES`` a chunk of
        tokens, which this op then attends over as a plain pool (the fused op where it takes it)."""
        reference = lambda: super(AscendKernels, self).sparse_attention(q, kv, indices, sinks, scale)  # noqa: E731
        if q.shape[0] == 0 or indices.shape[1] == 0 or kv.shape[0] == 0:
            return reference()
        if isinstance(kv, PackedPool):
            gathered = lambda: self._gathered_attention(q, kv, indices, sinks, scale)  # noqa: E731
            return self._packed("sparse_attention", kv, (q, indices), gathered, reference, one_format=False)
        from . import npu_v4_ops

        return self._fused("sparse_attention", (q, kv), lambda tn: npu_v4_ops.sparse_attention(tn, q, kv, indices, sinks, scale), reference)

    def _gathered_attention(self, q: torch.Tensor, kv: PackedPool, indices: torch.Tensor, sinks: torch.Tensor, scale: float) -> torch.Tensor:
        """``sparse_attention`` over a packed pool as over plain rows: per chunk of tokens, the listed rows decoded
        (``-1`` stays ``-1``), then this op's plain path."""
        from .triton_ascend_kv_quant import take_rows

        t, k = indices.shape
        row_bytes = k * kv.dim * torch.empty((), dtype=kv.dtype).element_size()
        chunk = max(1, min(t, GATHER_BYTES // row_bytes))
        outs = []
        for t0 in range(0, t, chunk):
            idx = indices[t0 : t0 + chunk]
            local = torch.arange(idx.numel(), device=idx.device).view(idx.shape)
            rows = take_rows(kv, idx).view(-1, kv.dim)
            outs.append(self.sparse_attention(q[t0 : t0 + chunk], rows, torch.where(idx >= 0, local, -1), sinks, scale))
        return torch.cat(outs) if len(outs) > 1 else outs[0]

    def vit_attention(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """``npu_fusion_attention`` over the packed images in its TND layout, each image one sequence, no mask (see
        ``npu_ops.vit_attention``)."""
        reference = lambda: super(AscendKernels, self).vit_attention(q, k, v, cu_seqlens, scale)  # noqa: E731
        if q.shape[0] == 0:
            return reference()
        from . import npu_ops

        return self._fused("vit_attention", (q, k, v), lambda tn: npu_ops.vit_attention(tn, q, k, v, cu_seqlens, scale), reference)

    def swiglu(self, gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> torch.Tensor:
        """``npu_clipped_swiglu`` on A2/A3 (``npu_swiglu`` without a limit or on Ascend 950; see ``npu_ops.swiglu_packed``)."""
        reference = lambda: super(AscendKernels, self).swiglu(gate, up, limit)  # noqa: E731
        if gate.numel() == 0:
            return reference()
        from . import npu_ops

        return self._fused("swiglu", (gate, up), lambda tn: npu_ops.swiglu(tn, gate, up, limit), reference)

    def moe_experts(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        w13: torch.Tensor,
        w2: torch.Tensor,
        limit: float | None,
    ) -> torch.Tensor:
        """``npu_grouped_matmul`` twice around the clamped SwiGLU, rows grouped by ``npu_moe_init_routing_v2`` on A2/A3
        (see ``npu_ops.moe_experts``)."""
        reference = lambda: super(AscendKernels, self).moe_experts(x, topk_ids, topk_weights, w13, w2, limit)  # noqa: E731
        if x.shape[0] == 0:
            return reference()
        from . import npu_ops

        return self._fused("moe_experts", (x, w13, w2), lambda tn: npu_ops.moe_experts(tn, x, topk_ids, topk_weights, w13, w2, limit), reference)

    def fp8_linear(self, x: torch.Tensor, weight: QuantizedWeight) -> torch.Tensor:
        """``npu_quant_matmul`` in MX or G-B mode on Ascend 950, x quantized on the fly (see ``npu_quant_ops.fp8_linear``)."""
        reference = lambda: super(AscendKernels, self).fp8_linear(x, weight)  # noqa: E731
        if x.shape[0] == 0 or weight.shape[0] == 0:
            return reference()
        from . import npu_quant_ops

        return self._fused("fp8_linear", (x, weight.codes, weight.scales), lambda tn: npu_quant_ops.fp8_linear(tn, x, weight), reference)

    def moe_experts_quantized(
        self,
        x: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        w13: QuantizedWeight,
        w2: QuantizedWeight,
        limit: float | None,
    ) -> torch.Tensor:
        """Block-scaled ``npu_grouped_matmul`` twice around the clamped SwiGLU on Ascend 950
        (see ``npu_quant_ops.moe_experts_quantized``)."""
        reference = lambda: super(AscendKernels, self).moe_experts_quantized(x, topk_ids, topk_weights, w13, w2, limit)  # noqa: E731
        if x.shape[0] == 0 or topk_ids.shape[1] == 0:
            return reference()
        from . import npu_quant_ops

        return self._fused(
            "moe_experts_quantized", (x, w13.codes, w13.scales, w2.codes, w2.scales),
            lambda tn: npu_quant_ops.moe_experts_quantized(tn, x, topk_ids, topk_weights, w13, w2, limit), reference,
        )

    # -- Triton-Ascend kernels -----------------------------------------------

    def compress_kv(
        self,
        kv: torch.Tensor,
        gate: torch.Tensor,
        position_bias: torch.Tensor,
        indices: torch.Tensor,
        prev_indices: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Gated softmax pooling over each window (see ``triton_ascend_compressor``); its state buffers are plain
        tensors (a packed one runs the reference)."""
        reference = lambda: super(AscendKernels, self).compress_kv(kv, gate, position_bias, indices, prev_indices)  # noqa: E731
        if indices.shape[0] == 0 or indices.shape[1] == 0 or kv.shape[0] == 0:
            return reference()
        for pool in (kv, gate):
            if isinstance(pool, PackedPool):
                return self._packed("compress_kv", pool, (position_bias,), None, reference)

        def kernel() -> torch.Tensor:
            from .triton_ascend_compressor import compress_kv

            return compress_kv(kv, gate, position_bias, indices, prev_indices)

        return self._triton("compress_kv", (kv, gate, position_bias), kernel, reference)

    def indexer_scores(
        self, q: torch.Tensor, weights: torch.Tensor, keys: torch.Tensor, indices: torch.Tensor, scale: float
    ) -> torch.Tensor:
        """Relu-weighted multi-head scores over gathered keys: ``npu_lightning_indexer`` on Ascend 950 where it
        takes them (see ``npu_v4_ops.indexer_scores``), else the Triton-Ascend kernel (``triton_ascend_indexer``)."""
        reference = lambda: super(AscendKernels, self).indexer_scores(q, weights, keys, indices, scale)  # noqa: E731
        if q.shape[0] == 0 or indices.shape[1] == 0:
            return reference()

        def kernel() -> torch.Tensor:
            from .triton_ascend_indexer import indexer_scores

            return indexer_scores(q, weights, keys, indices, scale)

        if isinstance(keys, PackedPool):  # the kernel decodes the keys it gathers; the fused op takes plain rows
            return self._packed("indexer_scores", keys, (q, weights), kernel, reference)

        triton = lambda: self._triton("indexer_scores", (q, weights, keys), kernel, reference)  # noqa: E731
        from . import npu_v4_ops

        tn = self._fused_module((q, keys))
        if tn is None or npu_v4_ops.indexer_scores_fits(tn, q, weights, keys, indices) is not None:
            return triton()
        return self._fused("indexer_scores", (q, keys), lambda tn: npu_v4_ops.indexer_scores(tn, q, weights, keys, indices, scale), triton)

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
        """Gates, Sinkhorn and collapse per token: ``npu_mhc_pre`` + ``npu_mhc_sinkhorn`` on Ascend 950 where they
        take the inputs (see ``npu_v4_ops.mhc_pre``), else the Triton-Ascend kernel (``triton_ascend_mhc``)."""
        reference = lambda: self._reference().mhc_pre(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)  # noqa: E731
        if x.shape[0] == 0:
            return reference()

        def kernel() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            from .triton_ascend_mhc import mhc_pre

            return mhc_pre(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)

        triton = lambda: self._triton("mhc_pre", (x, fn), kernel, reference)  # noqa: E731
        from . import npu_v4_ops

        tn = self._fused_module((x, fn))
        if tn is None or npu_v4_ops.mhc_pre_fits(tn, x, fn, base, scale, sinkhorn_iters) is not None:
            return triton()
        return self._fused(
            "mhc_pre", (x, fn), lambda tn: npu_v4_ops.mhc_pre(tn, x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters), triton
        )

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
        """``mhc_pre`` without the collapse (V4.1): ``npu_mhc_pre`` (``out_flag=1``, its ``h_pre``) + ``npu_mhc_sinkhorn``
        on Ascend 950 where they take the inputs (see ``npu_v4_ops.mhc_mix``), else ``mhc_pre``'s Triton-Ascend
        kernel storing ``pre`` (``triton_ascend_mhc``)."""
        reference = lambda: super(AscendKernels, self).mhc_mix(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)  # noqa: E731
        if x.shape[0] == 0:
            return reference()

        def kernel() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
            from .triton_ascend_mhc import mhc_mix

            return mhc_mix(x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters)

        triton = lambda: self._triton("mhc_mix", (x, fn), kernel, reference)  # noqa: E731
        from . import npu_v4_ops

        tn = self._fused_module((x, fn))
        if tn is None or npu_v4_ops.mhc_pre_fits(tn, x, fn, base, scale, sinkhorn_iters) is not None:
            return triton()
        return self._fused(
            "mhc_mix", (x, fn), lambda tn: npu_v4_ops.mhc_mix(tn, x, fn, base, scale, norm_eps, hc_eps, sinkhorn_iters), triton
        )

    def mhc_collapse(self, x: torch.Tensor, pre: torch.Tensor) -> torch.Tensor:
        """``Σ_j pre_j · x_j`` per token: the Triton-Ascend kernel per (token, channel-block) tile (``triton_ascend_mhc``);
        no torch_npu op collapses with given weights (``npu_mhc_pre`` computes its own)."""
        reference = lambda: super(AscendKernels, self).mhc_collapse(x, pre)  # noqa: E731
        if x.shape[0] == 0:
            return reference()

        def kernel() -> torch.Tensor:
            from .triton_ascend_mhc import mhc_collapse

            return mhc_collapse(x, pre)

        return self._triton("mhc_collapse", (x, pre), kernel, reference)

    def mhc_post(self, y: torch.Tensor, x: torch.Tensor, post: torch.Tensor, comb: torch.Tensor) -> torch.Tensor:
        """``post · y + combᵀ x`` per token: ``npu_mhc_post`` on Ascend 950 where it takes the inputs (see
        ``npu_v4_ops.mhc_post``), else the Triton-Ascend kernel per channel block (``triton_ascend_mhc``)."""
        reference = lambda: super(AscendKernels, self).mhc_post(y, x, post, comb)  # noqa: E731
        if x.shape[0] == 0:
            return reference()

        def kernel() -> torch.Tensor:
            from .triton_ascend_mhc import mhc_post

            return mhc_post(y, x, post, comb)

        triton = lambda: self._triton("mhc_post", (y, x, post, comb), kernel, reference)  # noqa: E731
        from . import npu_v4_ops

        tn = self._fused_module((y, x))
        if tn is None or npu_v4_ops.mhc_post_fits(tn, y, x, post, comb) is not None:
            return triton()
        return self._fused("mhc_post", (y, x), lambda tn: npu_v4_ops.mhc_post(tn, y, x, post, comb), triton)

    def mhc_head(
        self,
        x: torch.Tensor,
        fn: torch.Tensor,
        base: torch.Tensor,
        scale: torch.Tensor,
        norm_eps: float,
        hc_eps: float,
    ) -> torch.Tensor:
        """The final collapse, the pre-gate half of ``mhc_pre``'s kernel (see ``triton_ascend_mhc``)."""
        reference = lambda: self._reference().mhc_head(x, fn, base, scale, norm_eps, hc_eps)  # noqa: E731
        if x.shape[0] == 0:
            return reference()

        def kernel() -> torch.Tensor:
            from .triton_ascend_mhc import mhc_head

            return mhc_head(x, fn, base, scale, norm_eps, hc_eps)

        return self._triton("mhc_head", (x, fn), kernel, reference)

    def candidate_blocks(self, scores: torch.Tensor, visible: torch.Tensor, topk_blocks: int, block_size: int) -> torch.Tensor:
        """V4.1's candidate blocks: block maxima, then selection by rank (bisection over order-preserving int32 keys,
        no sort, no host sync), as two Triton-Ascend kernels (``triton_ascend_indexer``)."""
        reference = lambda: super(AscendKernels, self).candidate_blocks(scores, visible, topk_blocks, block_size)  # noqa: E731
        if topk_blocks < 1 or block_size < 1 or scores.shape[0] == 0 or scores.shape[1] == 0:
            return reference()  # the reference's ValueError, or its empty mask

        def kernel() -> torch.Tensor:
            from .triton_ascend_indexer import candidate_blocks

            return candidate_blocks(scores, visible, topk_blocks, block_size)

        return self._triton("candidate_blocks", (scores, visible), kernel, reference)

    def engram_inject(
        self, streams: torch.Tensor, key: torch.Tensor, value: torch.Tensor, weight: torch.Tensor, eps: float
    ) -> torch.Tensor:
        """The gated Engram value added to each stream, two passes over each (token, stream) row in channel blocks
        (``triton_ascend_engram``): it fits the unified buffer at any width, V4.1's 5120 included."""
        reference = lambda: super(AscendKernels, self).engram_inject(streams, key, value, weight, eps)  # noqa: E731
        if streams.shape[0] == 0:
            return reference()

        def kernel() -> torch.Tensor:
            from .triton_ascend_engram import engram_inject

            return engram_inject(streams, key, value, weight, eps)

        return self._triton("engram_inject", (streams, key, value, weight), kernel, reference)

    def indexer_topk(
        self,
        q: torch.Tensor,
        weights: torch.Tensor,
        keys: torch.Tensor,
        table: torch.Tensor,
        token_seq: torch.Tensor,
        visible: torch.Tensor,
        scale: float,
        k: int,
    ) -> torch.Tensor:
        """The top-``k`` entries over per-sequence tables: ``npu_lightning_indexer`` (per-token batches over gathered
        rows) where it takes them (see ``npu_v4_ops.indexer_topk``), else the Triton-Ascend kernels scoring entry
        blocks into a bounded scratch and selecting by rank (``triton_ascend_long_context``)."""
        reference = lambda: super(AscendKernels, self).indexer_topk(q, weights, keys, table, token_seq, visible, scale, k)  # noqa: E731
        if q.shape[0] == 0 or k <= 0 or table.shape[1] == 0 or keys.shape[0] == 0:
            return reference()

        def kernel() -> torch.Tensor:
            from .triton_ascend_long_context import indexer_topk

            return indexer_topk(q, weights, keys, table, token_seq, visible, scale, k)

        if isinstance(keys, PackedPool):  # the kernel decodes the keys it gathers; the fused op takes plain rows
            return self._packed("indexer_topk", keys, (q, weights), kernel, reference)

        triton = lambda: self._triton("indexer_topk", (q, weights, keys), kernel, reference)  # noqa: E731
        from . import npu_v4_ops

        tn = self._fused_module((q, keys))
        if tn is None or npu_v4_ops.indexer_topk_fits(tn, q, weights, keys, table, k) is not None:
            return triton()
        return self._fused(
            "indexer_topk", (q, keys),
            lambda tn: npu_v4_ops.indexer_topk(tn, q, weights, keys, table, token_seq, visible, scale, k), triton,
        )

    def entry_attention(
        self,
        q: torch.Tensor,
        kv: torch.Tensor,
        indices: torch.Tensor,
        table: torch.Tensor,
        token_seq: torch.Tensor,
        visible: torch.Tensor,
        sinks: torch.Tensor,
        scale: float,
    ) -> torch.Tensor:
        """Sink attention over listed rows and table entries: ``npu_sparse_flash_attention`` on Ascend 950 where it
        takes them (see ``npu_v4_ops.entry_attention``), else the Triton-Ascend kernel's running softmax per
        (token, head) (``triton_ascend_long_context``)."""
        reference = lambda: super(AscendKernels, self).entry_attention(q, kv, indices, table, token_seq, visible, sinks, scale)  # noqa: E731
        if q.shape[0] == 0 or kv.shape[0] == 0:
            return reference()

        def kernel() -> torch.Tensor:
            from .triton_ascend_long_context import entry_attention

            return entry_attention(q, kv, indices, table, token_seq, visible, sinks, scale)

        if isinstance(kv, PackedPool):  # the kernel decodes the rows it reads; the fused op takes plain rows
            return self._packed("entry_attention", kv, (q,), kernel, reference)

        triton = lambda: self._triton("entry_attention", (q, kv), kernel, reference)  # noqa: E731
        from . import npu_v4_ops

        tn = self._fused_module((q, kv))
        if tn is None or npu_v4_ops.entry_attention_fits(tn, q, kv, indices, table, sinks) is not None:
            return triton()
        return self._fused(
            "entry_attention", (q, kv),
            lambda tn: npu_v4_ops.entry_attention(tn, q, kv, indices, table, token_seq, visible, sinks, scale), triton,
        )

    # -- packed cache records --------------------------------------------------

    def cache_write(self, pool: torch.Tensor | PackedPool, slots: torch.Tensor, values: torch.Tensor) -> None:
        """A plain pool: the reference's scatter (plain torch, on whatever device the pool is). A ``PackedPool``:
        each region's rows packed straight into their slots by ``kv_pack``'s Triton-Ascend kernel
        (``triton_ascend_kv_quant.pack_into``), no records in between."""
        if not isinstance(pool, PackedPool):
            return super().cache_write(pool, slots, values)
        reference = lambda: self._reference().cache_write(pool, slots, values)  # noqa: E731
        if slots.numel() == 0 or pool.shape[0] == 0:
            return reference()

        def kernel() -> None:
            from .triton_ascend_kv_quant import pack_into

            for region in pool.regions:
                pack_into(region.data, slots, region.start, values, region.format)

        return self._triton("cache_write", (values, slots, *pool.tensors()), kernel, reference)

    def kv_pack(self, values: torch.Tensor, fmt: KVFormat) -> torch.Tensor:
        """Rows to packed records, byte for byte the reference's (``triton_ascend_kv_quant``); no torch_npu
        quantize op computes DeepSeek's scales and codes exactly (see that module)."""
        reference = lambda: super(AscendKernels, self).kv_pack(values, fmt)  # noqa: E731
        if values.shape[0] == 0:
            return reference()

        def kernel() -> torch.Tensor:
            from .triton_ascend_kv_quant import kv_pack

            return kv_pack(values, fmt)

        return self._triton("kv_pack", (values,), kernel, reference)

    def kv_unpack(self, records: torch.Tensor, fmt: KVFormat, dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """Packed records to rows in ``dtype`` (``triton_ascend_kv_quant``); other dtypes than fp32/fp16/bf16 run
        the reference."""
        reference = lambda: super(AscendKernels, self).kv_unpack(records, fmt, dtype)  # noqa: E731
        if records.numel() == 0 or dtype not in KERNEL_DTYPES:
            return reference()

        def kernel() -> torch.Tensor:
            from .triton_ascend_kv_quant import kv_unpack

            return kv_unpack(records, fmt, dtype)

        return self._triton("kv_unpack", (records,), kernel, reference)
