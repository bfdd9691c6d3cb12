"""A Communicator over torch.distributed, parametrised by the backend name.

One implementation serves every device: the CPU uses ``gloo``, CUDA ``nccl``,
Ascend ``hccl``. With world size 1 it needs no process group and every verb is
the identity.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from .communicator import Communicator

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


class TorchDistributedCommunicator(Communicator):
    """Collectives through torch.distributed with the given backend (gloo/nccl/hccl)."""

    def __init__(
        self,
        dist_backend: str = "gloo",
        rank: int | None = None,
        world_size: int | None = None,
        init_method: str | None = None,
        device: torch.device | None = None,
        group: "dist.ProcessGroup | None" = None,
    ) -> None:
        self.dist_backend = dist_backend
        self.device = device or torch.device("cpu")
        self.group = group
        world_size = int(world_size if world_size is not None else os.environ.get("WORLD_SIZE", 1))
        rank = int(rank if rank is not None else os.environ.get("RANK", 0))
        if world_size > 1 and group is None and not dist.is_initialized():
            dist.init_process_group(
                dist_backend, init_method=init_method or "env://", rank=rank, world_size=world_size
            )
        self._rank = dist.get_rank(group) if (world_size > 1 or group is not None) else 0
        self._world = dist.get_world_size(group) if (world_size > 1 or group is not None) else 1

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def _count_device(self) -> torch.device:
        return self.device

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if self._world > 1:
            dist.all_reduce(tensor, op=_OPS[op], group=self.group)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if self._world == 1:
            return tensor.clone()
        parts = [torch.empty_like(tensor) for _ in range(self._world)]
        dist.all_gather(parts, tensor.contiguous(), group=self.group)
        return torch.cat(parts)

    def reduce_scatter(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        if tensor.shape[0] % self._world:
            raise ValueError(f"reduce_scatter needs dim 0 ({tensor.shape[0]}) divisible by world size {self._world}")
        if self._world == 1:
            return tensor.clone()
        if self.dist_backend == "gloo":
            # gloo has no reduce_scatter: reduce everything, keep our chunk
            full = tensor.clone()
            dist.all_reduce(full, op=_OPS[op], group=self.group)
            return full.chunk(self._world)[self._rank].clone()
        out = torch.empty((tensor.shape[0] // self._world, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        dist.reduce_scatter_tensor(out, tensor.contiguous(), op=_OPS[op], group=self.group)
        return out

    def all_to_all(
        self,
        tensor: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> torch.Tensor:
        if self._world == 1:
            return tensor.clone()
        if output_split_sizes is None:
            rows = tensor.shape[0]
        else:
            rows = sum(output_split_sizes)
        out = torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        dist.all_to_all_single(
            out, tensor.contiguous(), output_split_sizes, input_split_sizes, group=self.group
        )
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if self._world > 1:
            global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
            dist.broadcast(tensor, global_src, group=self.group)
        return tensor

    def barrier(self) -> None:
        if self._world > 1:
            dist.barrier(group=self.group)

    def subgroup(self, ranks: list[int]) -> "TorchDistributedCommunicator":
        if self._world == 1:
            return self
        group = dist.new_group(ranks, backend=self.dist_backend)
        sub = TorchDistributedCommunicator.__new__(TorchDistributedCommunicator)
        sub.dist_backend, sub.device, sub.group = self.dist_backend, self.device, group
        member = dist.get_rank() in ranks
        sub._rank = dist.get_rank(group) if member else -1
        sub._world = len(ranks)
        return sub

    def close(self) -> None:
        """Tear down the process group this communicator created."""
        if self._world > 1 and self.group is None and dist.is_initialized():
            dist.destroy_process_group()
