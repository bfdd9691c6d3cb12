"""The communicator conformance cases: each verb on one rank, checked against the same
computation done in one process over every rank's inputs.

Every rank builds all ranks' inputs from the same seed, runs the verb on its own, and
compares what it got with the single-process result for its rank. Reduced and combined
values are small integers (times quarters), so sums are exact in any order and in
bf16; pure data movement also uses arbitrary fp32 values. ``None`` means a case passed,
a string says what differs.
"""

from __future__ import annotations

import functools
import os
import time
import zlib
from dataclasses import dataclass
from typing import Callable

import torch

from deepinfer_interfaces import Communicator

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "int64": torch.int64}
_REDUCE = {"sum": lambda s: s.sum(0), "max": lambda s: s.amax(0), "min": lambda s: s.amin(0)}
#: rows of several MB in the large-message cases
LARGE_ELEMENTS = 1 << 21


@dataclass(frozen=True)
class Context:
    """What a case needs to know about the process running it."""

    rank: int
    world: int
    device: torch.device
    scratch: str


@dataclass(frozen=True)
class CommCase:
    op: str
    name: str
    dtype: str
    run: Callable[[Communicator, Context], str | None]


def _gen(*key: object) -> torch.Generator:
    """A generator seeded identically on every rank from a stable key."""
    return torch.Generator().manual_seed(zlib.crc32(repr(key).encode()))


def _ints(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype, bound: int = 4) -> torch.Tensor:
    return torch.randint(-bound, bound + 1, shape, generator=g).to(dtype)


def _per_rank(key: str, world: int, shape: tuple[int, ...], dtype: torch.dtype) -> list[torch.Tensor]:
    g = _gen(key, world)
    return [_ints(g, shape, dtype) for _ in range(world)]


def mismatch(got: object, expected: torch.Tensor, what: str = "output") -> str | None:
    """``None`` when ``got`` equals ``expected`` exactly (dtype, shape, values), else what differs."""
    if not isinstance(got, torch.Tensor):
        return f"{what} is {type(got).__name__}, expected a tensor"
    if got.dtype != expected.dtype:
        return f"{what} has dtype {str(got.dtype).replace('torch.', '')}, expected {str(expected.dtype).replace('torch.', '')}"
    if tuple(got.shape) != tuple(expected.shape):
        return f"{what} has shape {tuple(got.shape)}, expected {tuple(expected.shape)}"
    got = got.detach().cpu()
    bad = got != expected
    if bool(bad.any()):
        diff = (got.double() - expected.double()).abs()[bad].max().item()
        return f"{what}: {int(bad.sum())} of {bad.numel()} values differ (max abs diff {diff:g})"
    return None


# ---- collectives -------------------------------------------------------------------


def _all_reduce(comm: Communicator, ctx: Context, op: str, dtype: str, shape: tuple[int, ...]) -> str | None:
    xs = _per_rank(f"all_reduce/{op}/{dtype}/{shape}", ctx.world, shape, _DTYPES[dtype])
    expected = _REDUCE[op](torch.stack(xs))
    x = xs[ctx.rank].to(ctx.device, copy=True)
    out = comm.all_reduce(x, op)
    return mismatch(out, expected) or mismatch(x, expected, "the input tensor (reduced in place)")


def _all_reduce_strided(comm: Communicator, ctx: Context) -> str | None:
    bases = _per_rank("all_reduce/strided", ctx.world, (6, 8), torch.float32)
    expected = bases[ctx.rank].clone()
    expected[:, 2:5] = torch.stack([b[:, 2:5] for b in bases]).sum(0)
    base = bases[ctx.rank].to(ctx.device, copy=True)
    comm.all_reduce(base[:, 2:5], "sum")
    return mismatch(base, expected, "the tensor holding the reduced column slice")


def _all_gather(comm: Communicator, ctx: Context, dtype: str, shape: tuple[int, ...]) -> str | None:
    xs = _per_rank(f"all_gather/{dtype}/{shape}", ctx.world, shape, _DTYPES[dtype])
    return mismatch(comm.all_gather(xs[ctx.rank].to(ctx.device, copy=True)), torch.cat(xs))


def _reduce_scatter(comm: Communicator, ctx: Context, op: str, dtype: str) -> str | None:
    shape = (2 * ctx.world, 3)
    xs = _per_rank(f"reduce_scatter/{op}/{dtype}", ctx.world, shape, _DTYPES[dtype])
    expected = _REDUCE[op](torch.stack(xs)).chunk(ctx.world)[ctx.rank]
    return mismatch(comm.reduce_scatter(xs[ctx.rank].to(ctx.device, copy=True), op), expected)


def _split_matrix(kind: str, world: int, g: torch.Generator) -> list[list[int]]:
    """``splits[src][dst]``: rows rank ``src`` sends to rank ``dst``."""
    if kind == "even":
        return [[2] * world for _ in range(world)]
    splits = torch.randint(0, 5, (world, world), generator=g)
    if kind == "empty_sends":
        splits[0, :] = 0  # rank 0 sends nothing
        splits[:, world - 1] = 0  # the last rank receives nothing
        splits[1 % world, 0] = 0
    elif kind == "all_empty":
        splits.zero_()
    return splits.tolist()


def _all_to_all(comm: Communicator, ctx: Context, kind: str, dtype: str, width: int = 3, scale: int = 1) -> str | None:
    g = _gen("all_to_all", kind, dtype, ctx.world, scale)
    splits = _split_matrix(kind, ctx.world, g)
    if dtype == "float32":
        xs = [torch.randn(sum(row) * scale, width, generator=g) for row in splits]
    else:
        xs = [_ints(g, (sum(row) * scale, width), _DTYPES[dtype]) for row in splits]
    parts = [x.split([s * scale for s in row]) for x, row in zip(xs, splits)]
    expected = torch.cat([parts[src][ctx.rank] for src in range(ctx.world)])
    x = xs[ctx.rank].to(ctx.device, copy=True)
    if kind == "even":
        out = comm.all_to_all(x)
    else:
        send = [s * scale for s in splits[ctx.rank]]
        recv = [splits[src][ctx.rank] * scale for src in range(ctx.world)]
        out = comm.all_to_all(x, recv, send)
    return mismatch(out, expected)


def _large_all_gather(comm: Communicator, ctx: Context) -> str | None:
    g = _gen("large_all_gather", ctx.world)
    xs = [torch.randn(LARGE_ELEMENTS, generator=g) for _ in range(ctx.world)]
    return mismatch(comm.all_gather(xs[ctx.rank].to(ctx.device, copy=True)), torch.cat(xs))


def _broadcast(comm: Communicator, ctx: Context, dtype: str, strided: bool = False) -> str | None:
    src = ctx.world - 1
    xs = _per_rank(f"broadcast/{dtype}/{strided}", ctx.world, (4, 6), _DTYPES[dtype])
    x = xs[ctx.rank].to(ctx.device, copy=True)
    if not strided:
        out = comm.broadcast(x, src)
        return mismatch(out, xs[src]) or mismatch(x, xs[src], "the input tensor (overwritten in place)")
    expected = xs[ctx.rank].clone()
    expected[:, 1:3] = xs[src][:, 1:3]
    comm.broadcast(x[:, 1:3], src)
    return mismatch(x, expected, "the tensor holding the broadcast column slice")


def _barrier(comm: Communicator, ctx: Context) -> str | None:
    for phase in range(2):
        # late ranks arrive late: without a barrier, early ranks would miss their markers
        time.sleep(0.05 * (ctx.world - 1 - ctx.rank))
        open(os.path.join(ctx.scratch, f"{phase}-{ctx.rank}"), "w").close()
        comm.barrier()
        missing = [r for r in range(ctx.world) if not os.path.exists(os.path.join(ctx.scratch, f"{phase}-{r}"))]
        if missing:
            return f"passed barrier {phase} before rank(s) {missing} reached it"
    return None


# ---- subgroups ---------------------------------------------------------------------


def _check_membership(sub: Communicator, members: list[int], rank: int) -> str | None:
    want_rank = members.index(rank) if rank in members else -1
    if sub.world_size != len(members) or sub.rank != want_rank:
        return f"subgroup {members} has rank {sub.rank} of {sub.world_size}, expected {want_rank} of {len(members)}"
    return None


def _subgroup_even_odd(comm: Communicator, ctx: Context) -> str | None:
    groups = [list(range(0, ctx.world, 2)), list(range(1, ctx.world, 2))]
    subs = [comm.subgroup(m) for m in groups]
    mine = ctx.rank % 2
    xs = _per_rank("subgroup/even_odd", ctx.world, (3, 4), torch.int64)
    expected = torch.stack([xs[r] for r in groups[mine]]).sum(0)
    got = subs[mine].all_reduce(xs[ctx.rank].to(ctx.device, copy=True))
    return _check_membership(subs[mine], groups[mine], ctx.rank) or mismatch(got, expected)


def _subgroup_tail(comm: Communicator, ctx: Context) -> str | None:
    """Ranks 1..N-1: all_gather and a broadcast from the subgroup's last rank (global N-1)."""
    members = list(range(1, ctx.world))
    sub = comm.subgroup(members)
    membership = _check_membership(sub, members, ctx.rank)
    if ctx.rank not in members:
        return membership
    xs = _per_rank("subgroup/tail", ctx.world, (2, 3), torch.float32)
    gathered = sub.all_gather(xs[ctx.rank].to(ctx.device, copy=True))
    y = sub.broadcast(xs[ctx.rank].to(ctx.device, copy=True), len(members) - 1)
    return (
        membership
        or mismatch(gathered, torch.cat(xs[1:]), "all_gather")
        or mismatch(y, xs[ctx.world - 1], "broadcast from the subgroup's last rank")
    )


def _subgroup_nested(comm: Communicator, ctx: Context) -> str | None:
    """A subgroup of the subgroup 1..N-1: its last two ranks (global N-2, N-1; just N-1 for N=2)."""
    tail = list(range(1, ctx.world))
    outer = comm.subgroup(tail)
    if ctx.rank not in tail:
        return None
    inner_local = list(range(max(len(tail) - 2, 0), len(tail)))
    inner_global = [tail[i] for i in inner_local]
    inner = outer.subgroup(inner_local)
    membership = _check_membership(inner, inner_global, ctx.rank)
    if ctx.rank not in inner_global:
        return membership
    xs = _per_rank("subgroup/nested", ctx.world, (3,), torch.int64)
    expected = torch.stack([xs[r] for r in inner_global]).sum(0)
    return membership or mismatch(inner.all_reduce(xs[ctx.rank].to(ctx.device, copy=True)), expected)


# ---- dispatch / combine ------------------------------------------------------------


@dataclass
class _MoEInputs:
    hidden: list[torch.Tensor]
    ids: list[torch.Tensor]
    weights: list[torch.Tensor]
    expert_rank: torch.Tensor
    expert_local: torch.Tensor


def _moe_inputs(scenario: str, world: int, dtype: torch.dtype, k: int = 3, h: int = 8) -> _MoEInputs:
    g = _gen("moe", scenario, world, str(dtype))
    n_experts = 2 * world
    if scenario == "uneven":
        expert_rank = torch.arange(n_experts) // 2
        tokens = [3 + 2 * r for r in range(world)]
    else:  # "skewed": random placement on every rank but the last; rank 0 has no tokens
        expert_rank = torch.randint(0, max(world - 1, 1), (n_experts,), generator=g)
        tokens = [0] + [5 + 3 * r for r in range(1, world)]
    expert_local = torch.zeros(n_experts, dtype=torch.int64)
    for r in range(world):
        where = (expert_rank == r).nonzero().flatten()
        expert_local[where] = torch.arange(len(where))
    hidden, ids, weights = [], [], []
    for t in tokens:
        hidden.append(_ints(g, (t, h), dtype, bound=2))
        choice = torch.stack([torch.randperm(n_experts, generator=g)[:k] for _ in range(t)]) if t else torch.empty(0, k, dtype=torch.int64)
        drop = torch.rand(choice.shape, generator=g) < 0.2
        ids.append(torch.where(drop, torch.full_like(choice, -1), choice))
        w = torch.tensor([0.25, 0.5, 1.0])[torch.randint(0, 3, choice.shape, generator=g)]
        weights.append(torch.where(drop, torch.zeros_like(w), w))
    return _MoEInputs(hidden, ids, weights, expert_rank, expert_local)


def _reference_received(m: _MoEInputs, dest: int) -> list[tuple]:
    """Rows rank ``dest`` must receive: each token once, with only ``dest``'s slots filled."""
    rows = []
    for src in range(len(m.hidden)):
        for t in range(m.ids[src].shape[0]):
            slot_ids, slot_w, keep = [], [], False
            for e, w in zip(m.ids[src][t].tolist(), m.weights[src][t].tolist()):
                here = e >= 0 and int(m.expert_rank[e]) == dest
                keep |= here
                slot_ids.append(int(m.expert_local[e]) if here else -1)
                slot_w.append(w if here else 0.0)
            if keep:
                rows.append((tuple(m.hidden[src][t].tolist()), tuple(slot_ids), tuple(slot_w)))
    return rows


def expert_output(hidden: torch.Tensor, local_ids: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
    """A stand-in for the experts: each row scaled by sum(weight · (local id + 1)) over its slots."""
    scale = torch.where(local_ids >= 0, weights.double() * (local_ids + 1).double(), 0.0).sum(-1, keepdim=True)
    return (hidden.double() * scale).to(hidden.dtype)


def _reference_combined(m: _MoEInputs, src: int) -> torch.Tensor:
    """What ``combine`` returns on ``src``: the expert outputs of every slot, summed per token."""
    ids, w = m.ids[src], m.weights[src]
    local = torch.where(ids >= 0, m.expert_local[ids.clamp(min=0)], -1)
    return expert_output(m.hidden[src], local, w)


def _reference_fixed(m: _MoEInputs, dest: int, capacity: int, k: int = 3) -> list[tuple]:
    """Rows rank ``dest`` must receive in the fixed layout: ``capacity`` per source, in token order,
    only ``dest``'s slots filled, zero rows with ``-1`` ids past a source's tokens."""
    rows = []
    width = m.hidden[0].shape[1]
    for src in range(len(m.hidden)):
        for t in range(capacity):
            if t >= m.ids[src].shape[0]:
                rows.append(((0.0,) * width, (-1,) * k, (0.0,) * k))
                continue
            slot_ids, slot_w = [], []
            for e, w in zip(m.ids[src][t].tolist(), m.weights[src][t].tolist()):
                here = e >= 0 and int(m.expert_rank[e]) == dest
                slot_ids.append(int(m.expert_local[e]) if here else -1)
                slot_w.append(w if here else 0.0)
            rows.append((tuple(m.hidden[src][t].tolist()), tuple(slot_ids), tuple(slot_w)))
    return rows


def _dispatch_combine(comm: Communicator, ctx: Context, scenario: str, dtype: str, results: dict, fixed: bool = False) -> str | None:
    """Run dispatch (and combine); ``results['combine']`` gets combine's verdict. ``fixed``: the
    fixed-capacity layout, with a capacity above every rank's tokens."""
    m = _moe_inputs(scenario, ctx.world, _DTYPES[dtype])
    dev = ctx.device
    capacity = max(x.shape[0] for x in m.hidden) + 1 if fixed else None
    out = comm.dispatch(
        m.hidden[ctx.rank].to(dev), m.ids[ctx.rank].to(dev), m.weights[ctx.rank].to(dev),
        m.expert_rank.to(dev), m.expert_local.to(dev), capacity=capacity,
    )
    problems = []
    for what, got, ref in (("hidden", out.hidden, m.hidden[0]), ("topk_ids", out.topk_ids, m.ids[0]), ("topk_weights", out.topk_weights, m.weights[0])):
        if got.dtype != ref.dtype:
            problems.append(f"received {what} has dtype {got.dtype}, expected {ref.dtype}")
    expected = _reference_fixed(m, ctx.rank, capacity) if fixed else _reference_received(m, ctx.rank)
    n = out.hidden.shape[0]
    if not problems and (out.topk_ids.shape[0] != n or out.topk_weights.shape[0] != n):
        problems.append(f"received {n} hidden rows but {out.topk_ids.shape[0]} id rows and {out.topk_weights.shape[0]} weight rows")
    if not problems:
        got = list(zip(map(tuple, out.hidden.cpu().tolist()), map(tuple, out.topk_ids.cpu().tolist()), map(tuple, out.topk_weights.cpu().tolist())))
        if len(got) != len(expected):
            problems.append(f"received {len(got)} rows, expected {len(expected)}")
        elif (got != expected) if fixed else (sorted(got) != sorted(expected)):
            problems.append("received rows (hidden, local expert ids, weights) differ from the expected ones")
    # combine runs on every rank even when dispatch looked wrong, so no rank is left waiting
    y = expert_output(out.hidden, out.topk_ids, out.topk_weights)
    combined = comm.combine(y, out.handle)
    results["combine"] = mismatch(combined, _reference_combined(m, ctx.rank), "combined hidden")
    return "; ".join(problems) or None


def _combine_verdict(results: dict, comm: Communicator, ctx: Context) -> str | None:
    if "combine" not in results:
        raise RuntimeError("dispatch did not complete, so combine was not run")
    return results.pop("combine")


# ---- the case list ------------------------------------------------------------------


def comm_cases(world: int) -> list[CommCase]:
    """Every communicator case, in the order all ranks run them."""
    p = functools.partial
    cases: list[CommCase] = []
    for op in ("sum", "max", "min"):
        for dtype in ("float32", "bfloat16", "int64") if op != "min" else ("float32",):
            cases.append(CommCase("all_reduce", op, dtype, p(_all_reduce, op=op, dtype=dtype, shape=(5, 7))))
    cases += [
        CommCase("all_reduce", "strided_slice", "float32", _all_reduce_strided),
        CommCase("all_reduce", "empty", "float32", p(_all_reduce, op="sum", dtype="float32", shape=(0, 4))),
        CommCase("all_reduce", "large_8MB", "float32", p(_all_reduce, op="sum", dtype="float32", shape=(LARGE_ELEMENTS,))),
    ]
    for dtype in ("float32", "bfloat16", "int64"):
        cases.append(CommCase("all_gather", "rows", dtype, p(_all_gather, dtype=dtype, shape=(3, 5))))
    cases += [
        CommCase("all_gather", "empty", "float32", p(_all_gather, dtype="float32", shape=(0, 5))),
        CommCase("all_gather", "large_8MB", "float32", _large_all_gather),
    ]
    for op, dtype in (("sum", "float32"), ("sum", "bfloat16"), ("sum", "int64"), ("max", "float32")):
        cases.append(CommCase("reduce_scatter", op, dtype, p(_reduce_scatter, op=op, dtype=dtype)))
    cases.append(CommCase("all_to_all", "even", "float32", p(_all_to_all, kind="even", dtype="float32")))
    for dtype in ("float32", "bfloat16", "int64"):
        cases.append(CommCase("all_to_all", "uneven", dtype, p(_all_to_all, kind="uneven", dtype=dtype)))
    cases += [
        CommCase("all_to_all", "empty_sends", "float32", p(_all_to_all, kind="empty_sends", dtype="float32")),
        CommCase("all_to_all", "all_empty", "float32", p(_all_to_all, kind="all_empty", dtype="float32")),
        CommCase("all_to_all", "large_uneven", "float32", p(_all_to_all, kind="uneven", dtype="float32", width=256, scale=512)),
    ]
    for dtype in ("float32", "bfloat16", "int64"):
        cases.append(CommCase("broadcast", "from_last_rank", dtype, p(_broadcast, dtype=dtype)))
    cases += [
        CommCase("broadcast", "strided_slice", "float32", p(_broadcast, dtype="float32", strided=True)),
        CommCase("barrier", "ordering", "-", _barrier),
        CommCase("subgroup", "even_odd_all_reduce", "int64", _subgroup_even_odd),
        CommCase("subgroup", "tail_gather_broadcast", "float32", _subgroup_tail),
        CommCase("subgroup", "nested_all_reduce", "int64", _subgroup_nested),
    ]
    for scenario in ("uneven", "skewed"):
        for dtype in ("float32", "bfloat16"):
            shared: dict = {}
            cases.append(CommCase("dispatch", scenario, dtype, p(_dispatch_combine, scenario=scenario, dtype=dtype, results=shared)))
            cases.append(CommCase("combine", scenario, dtype, p(_combine_verdict, shared)))
        shared = {}
        cases.append(CommCase("dispatch", f"{scenario}_fixed_capacity", "float32",
                              p(_dispatch_combine, scenario=scenario, dtype="float32", results=shared, fixed=True)))
        cases.append(CommCase("combine", f"{scenario}_fixed_capacity", "float32", p(_combine_verdict, shared)))
    return cases
