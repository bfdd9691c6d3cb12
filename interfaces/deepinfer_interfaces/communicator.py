"""The Communicator contract: collectives between ranks, and the two MoE verbs.

Collectives follow torch.distributed semantics. ``dispatch`` and ``combine`` are
written here once on top of ``all_to_all`` (uneven splits), so a backend gets
them for free and overrides them only when it has a faster path (DeepEP-style).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

import torch


@dataclass
class DispatchHandle:
    """What ``combine`` needs to send results back to where tokens came from."""

    #: for each sent row, the source token index (sent rows are ordered by destination rank)
    send_token_index: torch.Tensor
    send_splits: list[int]
    recv_splits: list[int]
    num_tokens: int
    #: rows per (source, destination) pair of a fixed-capacity dispatch; None for the variable-split layout
    capacity: int | None = None


@dataclass
class DispatchResult:
    """Tokens received by this rank for its local experts."""

    #: ``[R, H]`` hidden states of the received tokens (one row per token and rank)
    hidden: torch.Tensor
    #: ``[R, K]`` local expert index for each of the token's top-k slots, -1 where that
    #: slot's expert lives on another rank
    topk_ids: torch.Tensor
    #: ``[R, K]`` routing weights matching ``topk_ids`` (0 where ``topk_ids`` is -1)
    topk_weights: torch.Tensor
    handle: DispatchHandle


class Communicator(ABC):
    """Collectives over a group of ranks, one rank per device."""

    @property
    @abstractmethod
    def rank(self) -> int:
        """This process's rank in the group."""

    @property
    @abstractmethod
    def world_size(self) -> int:
        """Number of ranks in the group."""

    @abstractmethod
    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce ``tensor`` across ranks in place (``sum``, ``max``, ``min``); returns it."""

    @abstractmethod
    def all_gather(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate every rank's ``tensor`` along dim 0, in rank order."""

    @abstractmethod
    def reduce_scatter(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """Reduce across ranks, then give rank ``r`` the ``r``-th equal chunk along dim 0."""

    @abstractmethod
    def all_to_all(
        self,
        tensor: torch.Tensor,
        output_split_sizes: list[int] | None = None,
        input_split_sizes: list[int] | None = None,
    ) -> torch.Tensor:
        """Send the ``i``-th dim-0 slice of ``tensor`` to rank ``i``; splits may be uneven or 0."""

    @abstractmethod
    def broadcast(self, tensor: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Overwrite ``tensor`` on every rank with rank ``src``'s; returns it."""

    @abstractmethod
    def barrier(self) -> None:
        """Wait until every rank reaches this point."""

    @abstractmethod
    def subgroup(self, ranks: list[int]) -> "Communicator":
        """A communicator over ``ranks`` of this group (every rank of this group must call it).

        Ranks in the new group follow ascending order of ``ranks``. A rank not in
        ``ranks`` gets a communicator with rank -1 whose collectives raise.
        """

    def close(self) -> None:
        """Release what this communicator holds (a process group it created); default: nothing."""

    def exchange_counts(self, counts: list[int]) -> list[int]:
        """Send ``counts[i]`` to rank ``i``; return what each rank sent to us."""
        if len(counts) != self.world_size:
            raise ValueError(f"exchange_counts got {len(counts)} counts for world size {self.world_size} (give one per rank)")
        if self.world_size == 1:
            return list(counts)
        t = torch.tensor(counts, dtype=torch.int64, device=self._count_device())
        out = self.all_to_all(t, [1] * self.world_size, [1] * self.world_size)
        return [int(v) for v in out.cpu().tolist()]

    def _count_device(self) -> torch.device:
        """Device that small control tensors live on for this communicator."""
        return torch.device("cpu")

    def dispatch(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        expert_rank: torch.Tensor,
        expert_local: torch.Tensor,
        capacity: int | None = None,
    ) -> DispatchResult:
        """Send each token to every rank holding one of its chosen experts, once per rank.

        ``hidden`` is ``[T, H]``; ``topk_ids`` ``[T, K]`` global expert ids (-1: no
        expert); ``expert_rank[e]`` / ``expert_local[e]`` place expert ``e``. The
        receiving rank sees each token once with the slots of its own experts; its
        rows are grouped by source rank in rank order, each group in token order.
        Dtypes of ``hidden``, ``topk_ids`` and ``topk_weights`` are kept.

        With ``capacity`` (the same on every rank, at least every rank's ``T``)
        the layout is fixed instead, as DeepEP's low-latency mode has it: every
        rank receives exactly ``capacity`` rows from each rank, row ``t`` of a
        source's group being its token ``t`` with only the receiver's slots
        filled (all ``-1`` when none is, or past that source's ``T``). Nothing
        depends on the data, so no host sync happens and the call can be
        captured in a graph; experts skip the all ``-1`` rows.
        """
        if topk_ids.dim() != 2 or topk_weights.shape != topk_ids.shape or hidden.shape[0] != topk_ids.shape[0]:
            raise ValueError(
                f"dispatch needs hidden [T, H], topk_ids and topk_weights [T, K]; got {tuple(hidden.shape)}, "
                f"{tuple(topk_ids.shape)} and {tuple(topk_weights.shape)}"
            )
        if capacity is not None:
            return self._dispatch_fixed(hidden, topk_ids, topk_weights, expert_rank, expert_local, capacity)
        num_tokens = topk_ids.shape[0]
        world = self.world_size
        expert_rank = expert_rank.to(topk_ids.device)
        expert_local = expert_local.to(topk_ids.device)
        valid = topk_ids >= 0
        safe_ids = topk_ids.clamp(min=0)
        slot_rank = torch.where(valid, expert_rank[safe_ids], torch.full_like(topk_ids, -1))
        # dest[t, r] is True when token t has an expert on rank r
        dest = torch.zeros(num_tokens, world, dtype=torch.bool, device=topk_ids.device)
        rows, cols = valid.nonzero(as_tuple=True)
        dest[rows, slot_rank[rows, cols]] = True
        dest_rank, token_index = dest.t().nonzero(as_tuple=True)  # ordered by rank, then token
        send_splits = torch.bincount(dest_rank, minlength=world).tolist()
        # per sent row: local ids of the slots that live on the destination rank
        sel_rank = slot_rank[token_index]
        mine = sel_rank == dest_rank[:, None]
        send_ids = torch.where(mine, expert_local[safe_ids[token_index]], -1).to(topk_ids.dtype)
        sel_w = topk_weights[token_index]
        send_w = torch.where(mine, sel_w, torch.zeros_like(sel_w))
        recv_splits = self.exchange_counts(send_splits)
        token_index = token_index.to(hidden.device)
        recv_hidden = self.all_to_all(hidden[token_index], recv_splits, send_splits)
        recv_ids = self.all_to_all(send_ids, recv_splits, send_splits)
        recv_w = self.all_to_all(send_w, recv_splits, send_splits)
        handle = DispatchHandle(token_index, send_splits, recv_splits, num_tokens)
        return DispatchResult(recv_hidden, recv_ids, recv_w, handle)

    def _dispatch_fixed(
        self,
        hidden: torch.Tensor,
        topk_ids: torch.Tensor,
        topk_weights: torch.Tensor,
        expert_rank: torch.Tensor,
        expert_local: torch.Tensor,
        capacity: int,
    ) -> DispatchResult:
        """``dispatch`` in the fixed layout: ``[world, capacity]`` rows out, the same in, equal splits."""
        num_tokens, k = topk_ids.shape
        if num_tokens > capacity:
            raise ValueError(f"dispatch got {num_tokens} tokens for a fixed capacity of {capacity}; pass a capacity of at least every rank's tokens")
        world, dev = self.world_size, topk_ids.device
        pad = capacity - num_tokens
        ids = torch.nn.functional.pad(topk_ids, (0, 0, 0, pad), value=-1)
        weights = torch.nn.functional.pad(topk_weights, (0, 0, 0, pad))
        rows = torch.nn.functional.pad(hidden, (0, 0, 0, pad))
        valid = ids >= 0
        safe = ids.clamp(min=0)
        slot_rank = torch.where(valid, expert_rank.to(dev)[safe], -1)
        mine = slot_rank[None] == torch.arange(world, device=dev)[:, None, None]  # [world, capacity, K]
        send_ids = torch.where(mine, expert_local.to(dev)[safe][None], -1).to(topk_ids.dtype)
        send_w = torch.where(mine, weights[None], torch.zeros((), dtype=weights.dtype, device=dev))
        splits = [capacity] * world
        recv_hidden = self.all_to_all(rows[None].expand(world, -1, -1).reshape(world * capacity, -1), splits, splits)
        recv_ids = self.all_to_all(send_ids.reshape(world * capacity, k), splits, splits)
        recv_w = self.all_to_all(send_w.reshape(world * capacity, k), splits, splits)
        index = torch.arange(capacity, device=hidden.device).repeat(world)
        handle = DispatchHandle(index, splits, splits, num_tokens, capacity)
        return DispatchResult(recv_hidden, recv_ids, recv_w, handle)

    def combine(self, hidden: torch.Tensor, handle: DispatchHandle) -> torch.Tensor:
        """Return each received row's result to its source rank and sum per token.

        ``hidden`` is ``[R, H]`` in the order ``dispatch`` delivered; the result is
        ``[T, H]`` on the source rank in ``hidden``'s dtype, the sum (accumulated in
        at least fp32) over every rank that processed the token; 0 for a token no
        rank processed.
        """
        if hidden.shape[0] != sum(handle.recv_splits):
            raise ValueError(f"combine got {hidden.shape[0]} rows, but dispatch delivered {sum(handle.recv_splits)}")
        back = self.all_to_all(hidden, handle.send_splits, handle.recv_splits)
        acc = torch.promote_types(hidden.dtype, torch.float32)
        if handle.capacity is not None:  # fixed layout: one row per token from each rank, summed in rank order
            out = back.view(self.world_size, handle.capacity, *hidden.shape[1:]).to(acc).sum(0)
            return out[: handle.num_tokens].to(hidden.dtype)
        out = torch.zeros((handle.num_tokens, *hidden.shape[1:]), dtype=acc, device=hidden.device)
        out.index_add_(0, handle.send_token_index.to(hidden.device), back.to(acc))
        return out.to(hidden.dtype)
