"""One MoE layer's logical → physical expert map under expert parallelism: the single source of truth.

``P = num_logical + num_redundant`` physical slots are laid out rank-major:
rank ``r`` holds slots ``[r·P/N, (r+1)·P/N)``. Each slot holds one logical
expert; a logical expert held by several slots has replicas, and a token's
slot is chosen among them by ``to_physical`` from data every rank agrees on,
with static shapes and no host sync (it runs inside captured graphs).
``physical_rank`` / ``physical_local`` are the tables the Communicator's
``dispatch`` takes as ``expert_rank`` / ``expert_local``.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

#: Fibonacci hashing: 2^32 / golden ratio; ``frac(key / φ)`` spreads any arithmetic run of keys evenly
_HASH_MUL = 0x9E3779B1
_HASH_MASK = 0xFFFFFFFF


@dataclass(frozen=True, eq=False)
class ExpertPlacement:
    num_logical: int
    world_size: int
    #: ``[P]`` int64: the logical expert in each physical slot
    physical_to_logical: torch.Tensor
    #: derived tables (see ``__post_init__``)
    replicas: torch.Tensor = field(init=False, repr=False, compare=False)
    logical_to_physical: torch.Tensor = field(init=False, repr=False, compare=False)
    physical_rank: torch.Tensor = field(init=False, repr=False, compare=False)
    physical_local: torch.Tensor = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        p2l = self.physical_to_logical
        if not isinstance(p2l, torch.Tensor) or p2l.dim() != 1 or p2l.is_floating_point() or p2l.is_complex():
            raise ValueError("physical_to_logical must be a 1-D integer tensor (the logical expert of each physical slot)")
        if self.num_logical < 1 or self.world_size < 1:
            raise ValueError(f"a placement needs at least one expert and one rank; got {self.num_logical} and {self.world_size}")
        p2l = p2l.to(torch.int64)
        object.__setattr__(self, "physical_to_logical", p2l)
        physical = p2l.numel()
        if physical % self.world_size:
            raise ValueError(
                f"--ep {self.world_size} does not divide n_routed_experts + num_redundant_experts = "
                f"{self.num_logical} + {physical - self.num_logical}; choose an EP degree that divides {physical} "
                "(or change num_redundant_experts)"
            )
        if physical == 0 or p2l.min() < 0 or p2l.max() >= self.num_logical:
            raise ValueError(f"a physical slot names an expert outside [0, {self.num_logical})")
        replicas = torch.bincount(p2l.cpu(), minlength=self.num_logical).to(p2l.device)
        if int(replicas.min()) < 1:
            missing = int((replicas == 0).nonzero()[0])
            raise ValueError(f"logical expert {missing} has no physical slot; every expert needs at least one")
        # l2p[e, j]: the j-th slot (ascending) holding expert e, -1 past its replicas; as wide as any
        # placement of these slots can need, so every placement's tables have one shape
        order = torch.sort(p2l * physical + torch.arange(physical, device=p2l.device)).indices
        starts = torch.cumsum(replicas, 0) - replicas
        width = physical - self.num_logical + 1
        l2p = torch.full((self.num_logical, width), -1, dtype=torch.int64, device=p2l.device)
        rank_in = torch.arange(physical, device=p2l.device) - starts[p2l[order]]
        l2p[p2l[order], rank_in] = order
        per = physical // self.world_size
        slots = torch.arange(physical, device=p2l.device)
        object.__setattr__(self, "replicas", replicas)
        object.__setattr__(self, "logical_to_physical", l2p)
        object.__setattr__(self, "physical_rank", slots // per)
        object.__setattr__(self, "physical_local", slots % per)

    @classmethod
    def identity(cls, num_logical: int, world_size: int, num_redundant: int = 0) -> "ExpertPlacement":
        """Expert ``e`` in slot ``e``; redundant slots hold replicas of experts 0, 1, ... in turn."""
        physical = num_logical + num_redundant
        return cls(num_logical, world_size, torch.arange(physical, dtype=torch.int64) % num_logical)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ExpertPlacement):
            return NotImplemented
        return (
            (self.num_logical, self.world_size) == (other.num_logical, other.world_size)
            and self.physical_to_logical.shape == other.physical_to_logical.shape
            and torch.equal(self.physical_to_logical.cpu(), other.physical_to_logical.cpu())
        )

    def __hash__(self) -> int:
        return hash((self.num_logical, self.world_size, tuple(self.physical_to_logical.tolist())))

    @property
    def num_physical(self) -> int:
        return self.physical_to_logical.numel()

    @property
    def slots_per_rank(self) -> int:
        return self.num_physical // self.world_size

    def to(self, device: torch.device | str) -> "ExpertPlacement":
        """The same placement with tables of its own on ``device``."""
        return ExpertPlacement(self.num_logical, self.world_size, self.physical_to_logical.to(device, copy=True))

    def assign_(self, other: "ExpertPlacement") -> None:
        """Overwrite these tables with ``other``'s, in place: a captured graph that reads them keeps
        reading the same memory and routes by ``other`` from its next replay."""
        if (other.num_logical, other.world_size, other.num_physical) != (self.num_logical, self.world_size, self.num_physical):
            raise ValueError(
                f"cannot assign a placement of {other.num_logical} experts in {other.num_physical} slots over "
                f"{other.world_size} ranks to one of {self.num_logical} in {self.num_physical} over {self.world_size}"
            )
        for name in ("physical_to_logical", "replicas", "logical_to_physical"):
            getattr(self, name).copy_(getattr(other, name))

    def local_logical(self, rank: int) -> torch.Tensor:
        """The logical expert of each of ``rank``'s slots, in slot order: what the rank loads."""
        per = self.slots_per_rank
        return self.physical_to_logical[rank * per : (rank + 1) * per]

    def to_physical(self, topk_ids: torch.Tensor, token_index: torch.Tensor) -> torch.Tensor:
        """``[T, K]`` logical ids (-1 kept) as physical slots.

        ``token_index`` ``[T]`` is an integer per token that every rank agrees on (a position, a global
        token counter); the spreading over replicas rests on it. The replica is
        ``floor(frac((token_index · K + slot) / φ) · replicas)`` (Fibonacci hashing): the same index always
        reaches the same replica, and consecutive or strided indices spread evenly whatever ``K`` and the
        replica count are. Gathers and integer arithmetic only: static shapes, no host sync.
        """
        k = topk_ids.shape[-1]
        safe = topk_ids.clamp(min=0)
        key = token_index.to(torch.int64)[:, None] * k + torch.arange(k, device=topk_ids.device)
        fraction = (key * _HASH_MUL) & _HASH_MASK  # frac(key / φ), in units of 2^-32
        pick = (fraction * self.replicas[safe]) >> 32  # floor(frac · replicas): in [0, replicas)
        physical = self.logical_to_physical[safe, pick]
        return torch.where(topk_ids >= 0, physical, -1)

    def moved_from(self, old: "ExpertPlacement", rank: int) -> list[tuple[int, int, int]]:
        """``(local slot, logical expert, source rank)`` for each of ``rank``'s slots whose expert changes from
        ``old``; the source holds that expert under ``old`` (``rank`` itself when it does, else the lowest rank).
        Every expert has a replica under ``old``, so a source always exists."""
        if (old.num_logical, old.world_size, old.num_physical) != (self.num_logical, self.world_size, self.num_physical):
            raise ValueError(
                f"cannot move from a placement of {old.num_logical} experts in {old.num_physical} slots over "
                f"{old.world_size} ranks to one of {self.num_logical} in {self.num_physical} over {self.world_size}"
            )
        new_local, old_local = self.local_logical(rank).tolist(), old.local_logical(rank).tolist()
        out = []
        for slot, (want, had) in enumerate(zip(new_local, old_local)):
            if want != had:
                # slots are rank-major, so an expert's first slot is on the lowest rank holding it
                src = rank if want in old_local else int(old.physical_rank[old.logical_to_physical[want, 0]])
                out.append((slot, int(want), src))
        return out

    def expected_balancedness(self, logical_load: torch.Tensor) -> float:
        """The balancedness this placement would give ``logical_load`` ``[L]``, each expert's tokens split
        evenly over its replicas."""
        share = logical_load.double().cpu() / self.replicas.double().cpu()
        return self.balancedness(share[self.physical_to_logical.cpu()])

    def balancedness(self, load: torch.Tensor) -> float:
        """Mean over max of the tokens each rank's slots received (``load`` ``[P]`` per slot); 1.0 with no tokens."""
        if load.shape != (self.num_physical,):
            raise ValueError(f"balancedness needs one count per physical slot [{self.num_physical}]; got {tuple(load.shape)}")
        per_rank = torch.zeros(self.world_size, dtype=torch.float64)
        per_rank.index_add_(0, self.physical_rank.cpu(), load.double().cpu())
        top = float(per_rank.max())
        return float(per_rank.mean()) / top if top > 0 else 1.0
