"""Moving one MoE layer's expert weights between ranks when its placement changes.

Every slot whose expert changes gets that expert's weights from a rank
holding it under the old placement (the slot's own rank when it can, a local
copy), each weight tensor through one ``all_to_all``. Every rank calls this
for the same layer in the same step.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from deepinfer_interfaces import Communicator

from .placement import ExpertPlacement


def move_experts(comm: Communicator, tensors: Iterable[torch.Tensor], old: ExpertPlacement, new: ExpertPlacement) -> int:
    """Rewrite this rank's slots of ``tensors`` (one row block per slot) from ``old`` to ``new``; the slots that changed here."""
    rank, world = comm.rank, comm.world_size
    moves = {r: new.moved_from(old, r) for r in range(world)}
    held = [int(e) for e in old.local_logical(rank).tolist()]
    send_slots: list[int] = []
    send_splits = [0] * world
    for dest in range(world):
        if dest == rank:
            continue
        for _, logical, src in moves[dest]:
            if src == rank:
                send_slots.append(held.index(logical))
                send_splits[dest] += 1
    mine = moves[rank]
    recv_slots: list[int] = []
    recv_splits = [0] * world
    for src in range(world):
        if src == rank:
            continue
        for slot, _, from_rank in mine:
            if from_rank == src:
                recv_slots.append(slot)
                recv_splits[src] += 1
    local = [(slot, held.index(logical)) for slot, logical, src in mine if src == rank]
    for tensor in tensors:
        data = tensor.view(torch.uint8) if tensor.element_size() == 1 and tensor.dtype != torch.uint8 else tensor
        rows = data.reshape(data.shape[0], -1)
        outgoing = rows[send_slots].contiguous() if send_slots else rows[:0].contiguous()
        copies = rows[[src for _, src in local]].clone() if local else None
        incoming = comm.all_to_all(outgoing, recv_splits, send_splits)
        if recv_slots:
            rows[recv_slots] = incoming
        if copies is not None:
            rows[[slot for slot, _ in local]] = copies
    return len(mine)
