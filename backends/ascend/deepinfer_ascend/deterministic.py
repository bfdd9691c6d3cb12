"""What torch-npu offers for reproducible results, and what it does not.

torch-npu honours ``torch.use_deterministic_algorithms``: the aclnn ops that
have a deterministic variant (``aclnnIndexAdd``, ``aclnnMatmul``/``Gemm``,
scatter-adds, …) take it, so a torch op gives the same bits run after run. HCCL
reads ``HCCL_DETERMINISTIC`` when a communicator is created: reductions
(all-reduce, reduce-scatter) then sum in a fixed order. Neither makes a result
independent of the batch: a fused op still picks its tiling from the shapes it
is given, and none of the fused ops this backend calls documents a
batch-invariant mode. Batch-invariant mode on Ascend therefore turns both
switches on and runs the reference's fixed-shape paths (``Kernels`` in
batch-invariant mode) instead of the fused ops and Triton-Ascend kernels.
"""

from __future__ import annotations

import os

import torch

#: the environment variable HCCL reads at communicator creation for ordered reductions
HCCL_DETERMINISTIC = "HCCL_DETERMINISTIC"


def set_deterministic(enabled: bool) -> None:
    """torch's deterministic algorithms on or off (torch-npu's aclnn ops follow it), and ``HCCL_DETERMINISTIC``
    for HCCL communicators created from now on (a value the user set is left alone)."""
    torch.use_deterministic_algorithms(enabled)
    if enabled:
        os.environ.setdefault(HCCL_DETERMINISTIC, "true")


def no_batch_invariance_reason(op: str, path: str) -> str:
    """The one-line reason ``op`` (run through ``path``, e.g. ``torch_npu:npu_grouped_matmul``) is not batch-invariant."""
    if path.startswith("torch_npu:"):
        how = f"{path} has no batch-invariant mode (its tiling follows the batch; deterministic computing only fixes run-to-run order)"
    else:
        how = f"its {path} kernel chooses tiles and splits from the batch"
    return f"{op}: {how}; in batch-invariant mode the engine runs the reference for it"
