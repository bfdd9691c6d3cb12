"""TorchDistributedCommunicator over real gloo processes on 127.0.0.1, against the
same computation done in one process.

Each world size (2 and 4) is started once; every rank runs all checks in order and
reports a verdict per check, which the tests then assert. Integer-valued data keeps
reductions exact in any order, so results are compared exactly.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import re
import socket
import time
from typing import Callable

import pytest
import torch
import torch.distributed as dist

from deepinfer_interfaces import Communicator
from deepinfer_interfaces.distributed import TorchDistributedCommunicator

WORLD_TIMEOUT_S = 60.0
K = 3
H = 6


def _gen(*key: object) -> torch.Generator:
    return torch.Generator().manual_seed(sum(ord(c) * (i + 1) for i, c in enumerate(repr(key))))


def _ints(g: torch.Generator, shape: tuple[int, ...], dtype: torch.dtype = torch.float32, bound: int = 4) -> torch.Tensor:
    return torch.randint(-bound, bound + 1, shape, generator=g).to(dtype)


def _differs(got: torch.Tensor, want: torch.Tensor, what: str) -> str | None:
    if got.dtype != want.dtype or tuple(got.shape) != tuple(want.shape):
        return f"{what}: got {got.dtype} {tuple(got.shape)}, want {want.dtype} {tuple(want.shape)}"
    if not torch.equal(got, want):
        return f"{what}: values differ"
    return None


def _raises(fn: Callable[[], object], exc: type[BaseException], pattern: str) -> str | None:
    try:
        fn()
    except exc as e:
        return None if re.search(pattern, str(e)) else f"{exc.__name__} said {e!s}, expected /{pattern}/"
    return f"expected {exc.__name__} /{pattern}/"


def _first(*problems: str | None) -> str | None:
    return next((p for p in problems if p), None)


# ---- one single-process reference per verb ------------------------------------------


def ref_all_to_all(xs: list[torch.Tensor], splits: list[list[int]], dest: int) -> torch.Tensor:
    """Rows ``dest`` receives: rank ``src``'s ``dest``-th slice, in source order."""
    return torch.cat([x.split(row)[dest] for x, row in zip(xs, splits)])


def ref_dispatch(hidden, ids, weights, expert_rank, expert_local, dest):
    """Rows, local ids and weights ``dest`` receives, grouped by source rank, in token order."""
    rows, rid, rw = [], [], []
    for src in range(len(hidden)):
        for t in range(ids[src].shape[0]):
            here = [(k, int(e)) for k, e in enumerate(ids[src][t].tolist()) if e >= 0 and int(expert_rank[e]) == dest]
            if not here:
                continue
            slot_ids, slot_w = [-1] * K, [0.0] * K
            for k, e in here:
                slot_ids[k], slot_w[k] = int(expert_local[e]), float(weights[src][t, k])
            rows.append(hidden[src][t])
            rid.append(slot_ids)
            rw.append(slot_w)
    h = torch.stack(rows) if rows else hidden[0].new_zeros(0, hidden[0].shape[1])
    return h, torch.tensor(rid, dtype=ids[0].dtype).view(-1, K), torch.tensor(rw, dtype=weights[0].dtype).view(-1, K)


def _moe(world: int, scenario: str, dtype: torch.dtype = torch.float32, ids_dtype: torch.dtype = torch.int64):
    """Per-rank tokens, expert choices and weights, and an expert placement.

    ``uneven``: experts spread evenly over the ranks, rank r has 2+3r tokens. ``skewed``: random
    placement that leaves the last rank without experts (it receives nothing),
    and rank 0 has no tokens.
    """
    g = _gen("moe", world, scenario, str(dtype))
    n_experts = max(2 * world, K + 1)
    if scenario == "uneven":
        expert_rank = torch.arange(n_experts) * world // n_experts
        tokens = [2 + 3 * r for r in range(world)]
    else:
        expert_rank = torch.randint(0, world - 1, (n_experts,), generator=g)
        tokens = [0] + [4 + 2 * r for r in range(1, world)]
    expert_local = torch.zeros(n_experts, dtype=torch.int64)
    for r in range(world):
        where = (expert_rank == r).nonzero().flatten()
        expert_local[where] = torch.arange(len(where))
    hidden, ids, weights = [], [], []
    for t in tokens:
        hidden.append(_ints(g, (t, H), dtype, bound=2) if dtype != torch.float64 else torch.randn(t, H, generator=g, dtype=dtype))
        choice = torch.stack([torch.randperm(n_experts, generator=g)[:K] for _ in range(t)]) if t else torch.zeros(0, K, dtype=torch.int64)
        drop = torch.rand(choice.shape, generator=g) < 0.25
        ids.append(torch.where(drop, -1, choice).to(ids_dtype))
        w = torch.tensor([0.25, 0.5, 1.0])[torch.randint(0, 3, choice.shape, generator=g)]
        weights.append(torch.where(drop, 0.0, w))
    return hidden, ids, weights, expert_rank, expert_local


# ---- checks: each runs on every rank and returns None or what went wrong ---------------


def check_all_reduce(comm: Communicator, rank: int, world: int, scratch: str) -> str | None:
    problems = []
    for op, fn in (("sum", lambda s: s.sum(0)), ("max", lambda s: s.amax(0)), ("min", lambda s: s.amin(0))):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            g = _gen("ar", op, str(dtype), world)
            xs = [_ints(g, (4, 5), dtype) for _ in range(world)]
            x = xs[rank].clone()
            out = comm.all_reduce(x, op)
            problems.append(_differs(out, fn(torch.stack(xs)), f"all_reduce {op} {dtype}"))
            problems.append(None if out is x else f"all_reduce {op} did not return its input tensor")
    g = _gen("ar-strided", world)
    bases = [_ints(g, (5, 6)) for _ in range(world)]
    base = bases[rank].clone()
    comm.all_reduce(base.t()[1:4])  # rows 1..3 of the transpose: a strided column block
    want = bases[rank].clone()
    want.t()[1:4] = torch.stack([b.t()[1:4] for b in bases]).sum(0)
    problems.append(_differs(base, want, "all_reduce on a strided view"))
    problems.append(_differs(comm.all_reduce(torch.zeros(0, 3)), torch.zeros(0, 3), "all_reduce empty"))
    problems.append(_raises(lambda: comm.all_reduce(torch.ones(2), "prod"), ValueError, "unknown reduce op 'prod'"))
    return _first(*problems)


def check_all_gather(comm: Communicator, rank: int, world: int, scratch: str) -> str | None:
    problems = []
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        g = _gen("ag", str(dtype), world)
        xs = [_ints(g, (3, 2), dtype) for _ in range(world)]
        problems.append(_differs(comm.all_gather(xs[rank]), torch.cat(xs), f"all_gather {dtype}"))
    problems.append(_differs(comm.all_gather(torch.tensor(float(rank))), torch.arange(world, dtype=torch.float32), "all_gather scalar"))
    problems.append(_differs(comm.all_gather(torch.zeros(0, 4)), torch.zeros(0, 4), "all_gather empty"))
    return _first(*problems)


def check_reduce_scatter(comm: Communicator, rank: int, world: int, scratch: str) -> str | None:
    problems = []
    for op, fn in (("sum", lambda s: s.sum(0)), ("max", lambda s: s.amax(0))):
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            g = _gen("rs", op, str(dtype), world)
            xs = [_ints(g, (2 * world, 3), dtype) for _ in range(world)]
            want = fn(torch.stack(xs)).chunk(world)[rank]
            problems.append(_differs(comm.reduce_scatter(xs[rank], op), want, f"reduce_scatter {op} {dtype}"))
    problems.append(_raises(lambda: comm.reduce_scatter(torch.ones(world + 1, 2)), ValueError, "divisible by world size"))
    return _first(*problems)


def check_all_to_all(comm: Communicator, rank: int, world: int, scratch: str) -> str | None:
    problems = []
    g = _gen("a2a", world)
    for kind in ("uneven", "zero_sends", "all_empty"):
        splits = torch.randint(0, 4, (world, world), generator=g)
        if kind == "zero_sends":
            splits[0] = 0  # rank 0 sends nothing
            splits[:, -1] = 0  # the last rank receives nothing
        elif kind == "all_empty":
            splits.zero_()
        splits = splits.tolist()
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            xs = [_ints(g, (sum(row), 3), dtype) for row in splits]
            out = comm.all_to_all(xs[rank], [splits[s][rank] for s in range(world)], splits[rank])
            problems.append(_differs(out, ref_all_to_all(xs, splits, rank), f"all_to_all {kind} {dtype}"))
    # even split without sizes; input sizes only (output sizes exchanged)
    xs = [torch.randn(2 * world, 3, generator=g) for _ in range(world)]
    even = [[2] * world] * world
    problems.append(_differs(comm.all_to_all(xs[rank]), ref_all_to_all(xs, even, rank), "all_to_all even"))
    splits = torch.randint(0, 3, (world, world), generator=g).tolist()
    xs = [torch.randn(sum(row), 2, generator=g) for row in splits]
    out = comm.all_to_all(xs[rank], None, splits[rank])
    problems.append(_differs(out, ref_all_to_all(xs, splits, rank), "all_to_all with input sizes only"))
    # several MB, arbitrary float bits
    splits = [[(s * 7 + d * 3) % 5 * 4096 for d in range(world)] for s in range(world)]
    xs = [torch.randn(sum(row), 64, generator=g) for row in splits]
    out = comm.all_to_all(xs[rank], [splits[s][rank] for s in range(world)], splits[rank])
    problems.append(_differs(out, ref_all_to_all(xs, splits, rank), "all_to_all large"))
    problems.append(_raises(lambda: comm.all_to_all(torch.ones(3, 2), None, [1] * (world + 1)), ValueError, "entries for world size"))
    problems.append(_raises(lambda: comm.all_to_all(torch.ones(3, 2), None, [4] + [0] * (world - 1)), ValueError, "sum to 4, but the tensor has 3 rows"))
    return _first(*problems)


def check_broadcast(comm: Communicator, rank: int, world: int, scratch: str) -> str | None:
    problems = []
    src = world - 1
    for dtype in (torch.float32, torch.bfloat16, torch.int64):
        g = _gen("bc", str(dtype), world)
        xs = [_ints(g, (3, 4), dtype) for _ in range(world)]
        x = xs[rank].clone()
        problems.append(_differs(comm.broadcast(x, src), xs[src], f"broadcast {dtype}"))
        problems.append(_differs(x, xs[src], f"broadcast {dtype} in place"))
    base = torch.full((4, 4), float(rank))
    comm.broadcast(base[:, 1], src)
    want = torch.full((4, 4), float(rank))
    want[:, 1] = float(src)
    problems.append(_differs(base, want, "broadcast into a strided column"))
    problems.append(_raises(lambda: comm.broadcast(torch.ones(1), world), ValueError, "not a rank of this group"))
    return _first(*problems)


def check_barrier(comm: Communicator, rank: int, world: int, scratch: str) -> str | None:
    for phase in range(3):
        time.sleep(0.03 * (world - 1 - rank))
        open(os.path.join(scratch, f"barrier{phase}-{rank}"), "w").close()
        comm.barrier()
        missing = [r for r in range(world) if not os.path.exists(os.path.join(scratch, f"barrier{phase}-{r}"))]
        if missing:
            return f"left barrier {phase} before ranks {missing} arrived"
    return None


def check_subgroup(comm: Communicator, rank: int, world: int, scratch: str) -> str | None:
    problems = []
    evens, odds = list(range(0, world, 2)), list(range(1, world, 2))
    subs = {tuple(evens): comm.subgroup(evens), tuple(odds): comm.subgroup(odds)}
    mine = evens if rank % 2 == 0 else odds
    other = odds if rank % 2 == 0 else evens
    sub = subs[tuple(mine)]
    problems.append(None if (sub.rank, sub.world_size) == (mine.index(rank), len(mine)) else f"subgroup rank {sub.rank}/{sub.world_size}")
    g = _gen("sub", world)
    xs = [_ints(g, (2, 3), torch.int64) for _ in range(world)]
    problems.append(_differs(sub.all_reduce(xs[rank].clone()), torch.stack([xs[r] for r in mine]).sum(0), "subgroup all_reduce"))
    problems.append(_differs(sub.all_gather(xs[rank]), torch.cat([xs[r] for r in mine]), "subgroup all_gather"))
    root = len(mine) - 1
    problems.append(_differs(sub.broadcast(xs[rank].clone(), root), xs[mine[root]], "subgroup broadcast from its last rank"))
    outsider = subs[tuple(other)]
    problems.append(None if outsider.rank == -1 else f"non-member has rank {outsider.rank}")
    problems.append(_raises(lambda: outsider.all_reduce(torch.ones(1)), RuntimeError, "not a member of the subgroup"))
    problems.append(_raises(lambda: comm.subgroup([world]), ValueError, "non-empty subset"))
    # a subgroup of a subgroup: ranks 1..N-1, then that group's last two (global N-2, N-1)
    tail = list(range(1, world))
    outer = comm.subgroup(tail)
    if rank in tail:
        inner_local = list(range(max(len(tail) - 2, 0), len(tail)))
        inner_global = [tail[i] for i in inner_local]
        inner = outer.subgroup(inner_local)
        if rank in inner_global:
            problems.append(_differs(inner.all_reduce(xs[rank].clone()), torch.stack([xs[r] for r in inner_global]).sum(0), "nested all_reduce"))
        else:
            problems.append(None if inner.rank == -1 else "nested non-member has a rank")
    return _first(*problems)


def check_dispatch_combine(comm: Communicator, rank: int, world: int, scratch: str) -> str | None:
    problems = []
    for scenario in ("uneven", "skewed"):
        for dtype, ids_dtype in ((torch.float32, torch.int64), (torch.bfloat16, torch.int32), (torch.float64, torch.int64)):
            hidden, ids, weights, expert_rank, expert_local = _moe(world, scenario, dtype, ids_dtype)
            tag = f"{scenario} {dtype} {ids_dtype}"
            res = comm.dispatch(hidden[rank], ids[rank], weights[rank], expert_rank, expert_local)
            want_h, want_ids, want_w = ref_dispatch(hidden, ids, weights, expert_rank, expert_local, rank)
            problems += [
                _differs(res.hidden, want_h, f"dispatch hidden {tag}"),
                _differs(res.topk_ids, want_ids, f"dispatch ids {tag}"),
                _differs(res.topk_weights, want_w, f"dispatch weights {tag}"),
            ]
            if scenario == "skewed" and rank == world - 1 and res.hidden.shape[0] != 0:
                problems.append("the rank without experts received tokens")
            # identity experts: every destination returns the token unchanged
            n_dest = [torch.zeros(ids[r].shape[0], dtype=torch.int64) for r in range(world)]
            for r in range(world):
                for t in range(ids[r].shape[0]):
                    n_dest[r][t] = len({int(expert_rank[e]) for e in ids[r][t].tolist() if e >= 0})
            back = comm.combine(res.hidden, res.handle)
            want = torch.zeros_like(hidden[rank])
            for _ in range(world):  # sequential sums of identical rows are exact in any order
                want = torch.where((n_dest[rank] > _)[:, None], want + hidden[rank], want)
            problems.append(_differs(back, want, f"combine round trip {tag}"))
            # a weighted MoE: expert e scales by (e + 1); the single-process result sums w * (e + 1) * x
            if dtype != torch.float64:
                global_of = {(int(expert_rank[e]), int(expert_local[e])): e for e in range(len(expert_rank))}
                gid = torch.tensor([[global_of[(rank, int(i))] if i >= 0 else -1 for i in row] for row in res.topk_ids.tolist()]).view(-1, K)
                scale = torch.where(gid >= 0, res.topk_weights * (gid + 1).float(), 0.0).sum(-1, keepdim=True)
                y = (res.hidden.float() * scale).to(dtype)
                w_all = torch.where(ids[rank] >= 0, weights[rank] * (ids[rank].long() + 1).float(), 0.0).sum(-1, keepdim=True)
                problems.append(_differs(comm.combine(y, res.handle), (hidden[rank].float() * w_all).to(dtype), f"combine weighted {tag}"))
    return _first(*problems)


def check_init_mismatch(comm: Communicator, rank: int, world: int, scratch: str) -> str | None:
    return _raises(
        lambda: TorchDistributedCommunicator("gloo", rank=(rank + 1) % world, world_size=world),
        ValueError, "already initialised as rank",
    )


CHECKS: dict[str, Callable[[Communicator, int, int, str], str | None]] = {
    "all_reduce": check_all_reduce,
    "all_gather": check_all_gather,
    "reduce_scatter": check_reduce_scatter,
    "all_to_all": check_all_to_all,
    "broadcast": check_broadcast,
    "barrier": check_barrier,
    "subgroup": check_subgroup,
    "dispatch_combine": check_dispatch_combine,
    "init_mismatch": check_init_mismatch,
}


def _rank_main(rank: int, world: int, port: int, scratch: str, out: "mp.Queue") -> None:
    torch.set_num_threads(1)
    comm = TorchDistributedCommunicator("gloo", rank, world, f"tcp://127.0.0.1:{port}")
    for name, check in CHECKS.items():
        try:
            out.put((rank, name, check(comm, rank, world, scratch)))
        except Exception as exc:
            out.put((rank, name, f"raised {type(exc).__name__}: {exc}"))
    comm.close()
    out.put((rank, "closed", None if not dist.is_initialized() else "process group still initialised after close()"))


@pytest.fixture(scope="module", params=[2, 4], ids=lambda w: f"world{w}")
def world_verdicts(request, tmp_path_factory) -> tuple[int, dict[str, dict[int, str | None]]]:
    """Start one gloo world, run every check on every rank, collect the verdicts."""
    world = request.param
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    scratch = str(tmp_path_factory.mktemp(f"world{world}"))
    procs = [ctx.Process(target=_rank_main, args=(r, world, port, scratch, out), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    verdicts: dict[str, dict[int, str | None]] = {name: {} for name in [*CHECKS, "closed"]}
    deadline = time.monotonic() + WORLD_TIMEOUT_S
    expected = len(verdicts) * world
    got = 0
    while got < expected and time.monotonic() < deadline:
        try:
            rank, name, verdict = out.get(timeout=1.0)
        except queue.Empty:
            if not any(p.is_alive() for p in procs) and out.empty():
                break
            continue
        verdicts[name][rank] = verdict
        got += 1
    for p in procs:
        p.join(5)
        if p.is_alive():
            p.kill()
            p.join()
    return world, verdicts


@pytest.mark.parametrize("check", [*CHECKS, "closed"])
def test_verb_across_processes(world_verdicts, check):
    world, verdicts = world_verdicts
    by_rank = verdicts[check]
    missing = [r for r in range(world) if r not in by_rank]
    assert not missing, f"ranks {missing} did not report '{check}' (crashed or hung)"
    failures = {r: v for r, v in by_rank.items() if v is not None}
    assert not failures, failures


def test_world_size_one_needs_no_process_group():
    comm = TorchDistributedCommunicator("gloo", rank=0, world_size=1)
    assert not dist.is_initialized()
    assert (comm.rank, comm.world_size) == (0, 1)
    x = torch.arange(6.0).view(3, 2)
    assert comm.all_reduce(x, "max") is x and torch.equal(x, torch.arange(6.0).view(3, 2))
    assert torch.equal(comm.all_gather(x), x)
    assert torch.equal(comm.reduce_scatter(x), x)
    assert torch.equal(comm.all_to_all(x, [3], [3]), x)
    assert torch.equal(comm.broadcast(x, 0), x)
    comm.barrier()
    assert comm.exchange_counts([5]) == [5]
    sub = comm.subgroup([0])
    assert (sub.rank, sub.world_size) == (0, 1) and torch.equal(sub.all_gather(x), x)
    with pytest.raises(ValueError, match="all_to_all input_split_sizes \\[2\\] sum to 2, but the tensor has 3 rows"):
        comm.all_to_all(x, [2], [2])
    with pytest.raises(ValueError, match="broadcast src 1"):
        comm.broadcast(x, 1)
    # dispatch/combine: every token is local; combine sums the returned rows per token
    hidden, ids, weights, expert_rank, expert_local = _moe(1, "uneven", torch.bfloat16, torch.int32)
    res = comm.dispatch(hidden[0], ids[0], weights[0], expert_rank, expert_local)
    want_h, want_ids, want_w = ref_dispatch(hidden, ids, weights, expert_rank, expert_local, 0)
    assert torch.equal(res.hidden, want_h) and torch.equal(res.topk_ids, want_ids) and torch.equal(res.topk_weights, want_w)
    sent = (ids[0] >= 0).any(-1)
    assert torch.equal(comm.combine(res.hidden, res.handle), torch.where(sent[:, None], hidden[0], 0))
    comm.close()
    assert not dist.is_initialized()


def test_dispatch_rejects_mismatched_shapes():
    comm = TorchDistributedCommunicator("gloo", rank=0, world_size=1)
    with pytest.raises(ValueError, match="dispatch needs hidden \\[T, H\\], topk_ids and topk_weights \\[T, K\\]"):
        comm.dispatch(torch.zeros(3, 4), torch.zeros(2, 2, dtype=torch.int64), torch.zeros(2, 2), torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64))
