"""A Communicator over torch.distributed, parametrised by the backend name.

One implementation serves every device: the CPU uses ``gloo``, CUDA ``nccl``,
Ascend ``hccl``. With world size 1 it needs no process group and every verb is
the identity. Collectives work on contiguous buffers: torch.distributed reads a
non-contiguous tensor's storage as if it were contiguous, so in-place verbs
reduce a contiguous copy and write the result back.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist

from .communicator import Communicator

_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def free_local_port() -> int:
    """A TCP port on 127.0.0.1 free right now, for a local group's rendezvous (``tcp://127.0.0.1:PORT``)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _reduce_op(op: str) -> "dist.ReduceOp":
    if op not in _OPS:
        raise ValueError(f"unknown reduce op '{op}' (choose from {', '.join(_OPS)})")
    return _OPS[op]


def _check_splits(name: str, splits: list[int], world: int, rows: int | None = None) -> None:
    if len(splits) != world:
        raise ValueError(f"all_to_all {name} has {len(splits)} entries for world size {world} (give one per rank)")
    if any(s < 0 for s in splits):
        raise ValueError(f"all_to_all {name} {list(splits)} has a negative size")
    if rows is not None and sum(splits) != rows:
        raise ValueError(f"all_to_all {name} {list(splits)} sum to {sum(splits)}, but the tensor has {rows} rows")


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
        timeout_s: float | None = None,
    ) -> None:
        """``timeout_s`` bounds every collective of the group this creates (torch's default otherwise):
        a rank that died or hangs then makes the others raise instead of waiting forever."""
        self.dist_backend = dist_backend
        self.device = device or torch.device("cpu")
        self.group = group
        self._owns_group = False
        self._subgroups: dict[tuple[int, ...], "dist.ProcessGroup"] = {}
        world_size = int(world_size if world_size is not None else os.environ.get("WORLD_SIZE", 1))
        rank = int(rank if rank is not None else os.environ.get("RANK", 0))
        if group is None and world_size > 1:
            if not dist.is_initialized():
                extra = {} if timeout_s is None else {"timeout": datetime.timedelta(seconds=timeout_s)}
                dist.init_process_group(
                    dist_backend, init_method=init_method or "env://", rank=rank, world_size=world_size, **extra
                )
                self._owns_group = True
            elif (dist.get_rank(), dist.get_world_size()) != (rank, world_size):
                raise ValueError(
                    f"torch.distributed is already initialised as rank {dist.get_rank()} of {dist.get_world_size()}, "
                    f"not rank {rank} of {world_size} (pass matching rank/world_size)"
                )
        if group is None and world_size == 1:
            self._rank, self._world = 0, 1
        else:
            self._rank, self._world = dist.get_rank(group), dist.get_world_size(group)
        self._members = list(range(self._world))

    @property
    def rank(self) -> int:
        return self._rank

    @property
    def world_size(self) -> int:
        return self._world

    def _count_device(self) -> torch.device:
        return self.device

    def _distributed(self) -> bool:
        """True when a collective must run; raises on a rank outside this subgroup."""
        if self._rank < 0:
            raise RuntimeError(f"this rank is not a member of the subgroup {self._members} (use the subgroup it belongs to)")
        return self._world > 1

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        red = _reduce_op(op)
        if self._distributed():
            buf = tensor if tensor.is_contiguous() else tensor.contiguous()
            dist.all_reduce(buf, op=red, group=self.group)
            if buf is not tensor:
                tensor.copy_(buf)
        return tensor

    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        if tensor.dim() == 0:
            tensor = tensor.reshape(1)
        if not self._distributed():
            return tensor.clone()
        out = torch.empty((self._world * tensor.shape[0], *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        dist.all_gather_single(out, tensor.contiguous(), group=self.group)
        return out

    def reduce_scatter(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        red = _reduce_op(op)
        if tensor.dim() == 0 or tensor.shape[0] % self._world:
            raise ValueError(
                f"reduce_scatter needs dim 0 of {tuple(tensor.shape)} divisible by world size {self._world} (pad it)"
            )
        if not self._distributed():
            return tensor.clone()
        out = torch.empty((tensor.shape[0] // self._world, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        dist.reduce_scatter_single(out, tensor.contiguous(), op=red, group=self.group)
        return out

    def all_to_all(
        self,
        tensor: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> torch.Tensor:
        """As the contract says; with only ``input_split_sizes`` given, the output splits are exchanged first."""
        world = self._world
        if input_split_sizes is None:
            if tensor.dim() == 0 or tensor.shape[0] % world:
                raise ValueError(
                    f"all_to_all without split sizes needs dim 0 of {tuple(tensor.shape)} divisible by world size {world}"
                )
        else:
            input_split_sizes = [int(s) for s in input_split_sizes]
            _check_splits("input_split_sizes", input_split_sizes, world, tensor.shape[0])
        if output_split_sizes is not None:
            output_split_sizes = [int(s) for s in output_split_sizes]
            _check_splits("output_split_sizes", output_split_sizes, world)
        if not self._distributed():
            if output_split_sizes is not None and sum(output_split_sizes) != tensor.shape[0]:
                raise ValueError(f"all_to_all output_split_sizes {output_split_sizes} do not match {tensor.shape[0]} rows sent to self")
            return tensor.clone()
        if output_split_sizes is None and input_split_sizes is not None:
            output_split_sizes = self.exchange_counts(input_split_sizes)
        rows = tensor.shape[0] if output_split_sizes is None else sum(output_split_sizes)
        out = torch.empty((rows, *tensor.shape[1:]), dtype=tensor.dtype, device=tensor.device)
        dist.all_to_all_single(out, tensor.contiguous(), output_split_sizes, input_split_sizes, group=self.group)
        return out

    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        if not 0 <= src < self._world:
            raise ValueError(f"broadcast src {src} is not a rank of this group of {self._world}")
        if self._distributed():
            global_src = dist.get_global_rank(self.group, src) if self.group is not None else src
            buf = tensor if tensor.is_contiguous() else tensor.contiguous()
            dist.broadcast(buf, global_src, group=self.group)
            if buf is not tensor:
                tensor.copy_(buf)
        return tensor

    def barrier(self) -> None:
        if self._distributed():
            if self.device.type != "cpu" and self.device.index is not None:
                dist.barrier(group=self.group, device_ids=[self.device.index])
            else:
                dist.barrier(group=self.group)

    def subgroup(self, ranks: list[int]) -> "TorchDistributedCommunicator":
        members = sorted({int(r) for r in ranks})
        if not members or members[0] < 0 or members[-1] >= self._world:
            raise ValueError(f"subgroup ranks {list(ranks)} must be a non-empty subset of 0..{self._world - 1}")
        self._distributed()
        sub = type(self).__new__(type(self))
        sub.dist_backend, sub.device, sub._owns_group = self.dist_backend, self.device, False
        sub._members, sub._subgroups = members, {}
        if self._world == 1:
            sub.group, sub._rank, sub._world = None, 0, 1
            return sub
        key = tuple(members)
        if key not in self._subgroups:
            if self.group is None:
                # every process of the job takes part in creating a group of the default group
                self._subgroups[key] = dist.new_group(members, backend=self.dist_backend)
            else:
                # only this group's processes call here, so creation stays local to the members
                global_ranks = [dist.get_global_rank(self.group, r) for r in members]
                self._subgroups[key] = dist.new_group(global_ranks, backend=self.dist_backend, use_local_synchronization=True)
        sub.group = self._subgroups[key]
        if self._rank in members:
            sub._rank, sub._world = members.index(self._rank), len(members)
        else:
            sub._rank, sub._world = -1, len(members)
        return sub

    def close(self) -> None:
        """Tear down the process group this communicator created."""
        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False
