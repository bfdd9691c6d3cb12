"""HCCL collectives through torch.distributed, with the fused MC2 MoE dispatch/combine where it fits.

Every collective is the shared ``TorchDistributedCommunicator`` (with
``dist_backend="hccl"`` on NPUs; whatever backend the device names otherwise,
e.g. gloo under ``--interpret``). ``dispatch``/``combine`` use torch_npu's
``npu_moe_distribute_dispatch``/``_combine`` when ``DEEPINFER_ASCEND_FUSED_DISPATCH=1``
and every rank's call fits the ops (see ``fused_dispatch``), else the base
all-to-all path, which follows the Communicator contract exactly.
"""

from __future__ import annotations

import logging

import torch
import torch.distributed as dist

from deepinfer_interfaces import DispatchHandle, DispatchResult
from deepinfer_interfaces.distributed import TorchDistributedCommunicator

from . import fused_dispatch
from .npu import load_torch_npu

log = logging.getLogger("deepinfer.ascend")


class AscendCommunicator(TorchDistributedCommunicator):
    """torch.distributed over HCCL; fused MC2 MoE dispatch/combine on A2/A3 when requested."""

    def __init__(self, dist_backend: str = "hccl", **kwargs) -> None:
        super().__init__(dist_backend, **kwargs)
        self._moe_group = None

    def _fused_module(self):
        if not fused_dispatch.fused_requested() or self.dist_backend != "hccl" or self.world_size < 2:
            return None
        module, _ = load_torch_npu()
        if module is None or not all(hasattr(module, n) for n in ("npu_moe_distribute_dispatch", "npu_moe_distribute_combine")):
            return None
        return module

    def _generation(self) -> str:
        """The SoC generation of this rank's NPU (``get_soc_version()``, the device name as the fallback)."""
        from .device import cached_soc
        from .npu import npu_namespace

        return cached_soc(npu_namespace(), self.device.index or 0).generation

    def _window_problem(self, module, window_mb: int) -> str | None:
        """Why this rank cannot give the fused ops' group its communication window (None: it can): the
        window is reserved twice (send and receive) in device memory the first time the group is made."""
        if getattr(self, "_moe_group", None) is not None:
            return None
        refused = getattr(self, "_window_refused", None)
        if refused is None:
            free, _ = module.npu.mem_get_info()
            refused = ""
            if free < 2 * window_mb * fused_dispatch.MB:
                refused = (f"the fused MoE dispatch needs 2 x {window_mb} MB of HCCL window but {free // fused_dispatch.MB} MB "
                           f"are free: MoE runs the all-to-all path (lower {fused_dispatch.MAX_TOKENS_ENV} to fit)")
                log.warning(f"ascend: {refused}")
            self._window_refused = refused
        return refused or None

    def _moe_group_name(self, module, window_mb: int) -> str:
        """The HCCL name of a group reserved for the fused ops (they allow no other ops in their domain), made
        with a ``window_mb`` communication window in its own ``hccl_config`` (it takes precedence over
        ``HCCL_BUFFSIZE``, whose 200 MB default is far too small)."""
        if getattr(self, "_moe_group", None) is None:  # subgroups are built without __init__
            options = module._C._distributed_c10d.ProcessGroupHCCL.Options()
            options.hccl_config = {"hccl_buffer_size": window_mb}
            log.info(f"fused MoE dispatch: HCCL window {window_mb} MB per rank")
            if self.group is None:
                self._moe_group = dist.new_group(list(range(self.world_size)), backend="hccl", pg_options=options)
            else:
                members = [dist.get_global_rank(self.group, r) for r in range(self.world_size)]
                self._moe_group = dist.new_group(members, backend="hccl", use_local_synchronization=True, pg_options=options)
        backend = self._moe_group._get_backend(torch.device("npu"))
        return backend.get_hccl_comm_name(dist.get_rank())

    def dispatch(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        expert_rank: torch.Tensor,
        expert_local: torch.Tensor,
        capacity: int | None = None,
    ) -> DispatchResult:
        module = self._fused_module()
        if module is None or capacity is not None:  # the fixed layout is the base class's
            return super().dispatch(hidden, topk_ids, topk_weights, expert_rank, expert_local, capacity)
        gen = self._generation()
        problem = fused_dispatch.local_problem(gen, self.world_size, hidden, topk_ids, expert_rank, expert_local)
        window_mb = 0
        if problem is None:
            window_mb = fused_dispatch.hccl_buffer_mb(
                gen, fused_dispatch.planned_tokens(gen), self.world_size, int(expert_rank.shape[0]), int(topk_ids.shape[1]),
                int(hidden.shape[1]),
            )
            problem = self._window_problem(module, window_mb)
        # every rank must take the same path: agree on eligibility and the largest batch in one all-reduce
        vote = torch.tensor([0 if problem else 1, -int(topk_ids.shape[0])], dtype=torch.int64, device=self.device)
        self.all_reduce(vote, op="min")
        if int(vote[0]) == 0:
            return super().dispatch(hidden, topk_ids, topk_weights, expert_rank, expert_local)
        global_bs = -int(vote[1]) * self.world_size
        recv_hidden, ids, weights, handle = fused_dispatch.dispatch(
            module, hidden, topk_ids, topk_weights, int(expert_rank.shape[0]), self._moe_group_name(module, window_mb),
            self.rank, self.world_size, global_bs, gen,
        )
        return DispatchResult(recv_hidden, ids, weights, handle)

    def combine(self, hidden: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        if isinstance(handle, fused_dispatch.FusedDispatchHandle):
            module, _ = load_torch_npu()
            return fused_dispatch.combine(module, hidden, handle)
        return super().combine(hidden, handle)
