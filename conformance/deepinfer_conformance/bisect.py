"""``deepinfer conformance --bisect``: which of a kernel set's own ops make end to end diverge.

The kernel set runs the failing e2e cases with chosen ops swapped for the
reference's (``with_reference``: a subclass made per subset whose chosen
methods are the reference's; the user's class is not touched). First the set
as it is (it must fail), then each of its own ops swapped alone: an op whose
swap makes e2e pass is a culprit. When no single swap fixes it, the ops
interact: the set of swapped ops is halved while one half still fixes it,
then ops are dropped one at a time while it still does, which leaves a
minimal set whose own implementations cause the divergence together. The
reference's runs are made once and shared by every attempt.

Exit status: 0 when e2e passes (nothing to bisect), 1 when it fails (with
the culprits, or the note that no swap of the set's ops fixes it).
"""

from __future__ import annotations

import fnmatch
import types
from dataclasses import dataclass, replace
from typing import Callable, Iterable, Sequence

from deepinfer_interfaces import Device, Kernels

from .e2e import E2ERun
from .results import FAILING, CaseResult


def with_reference(kernels: Kernels, ops: Iterable[str]) -> Kernels:
    """A copy of ``kernels`` whose ``ops`` run the reference implementation and every other op its own."""
    chosen = sorted(set(ops))
    unknown = [o for o in chosen if o not in Kernels.ops()]
    if unknown:
        raise ValueError(f"not an op of the Kernels contract: {unknown[0]}")
    cls = type(kernels)
    body = {op: getattr(Kernels, op) for op in chosen}
    swapped = types.new_class(f"{cls.__name__}WithReference", (cls,), exec_body=lambda ns: ns.update(body))
    copy = object.__new__(swapped)
    copy.__dict__.update(vars(kernels))
    return copy


@dataclass
class Attempt:
    """One e2e run of the kernel set with ``swapped`` ops on the reference."""

    swapped: tuple[str, ...]
    results: list[CaseResult]

    @property
    def failing(self) -> list[CaseResult]:
        return [r for r in self.results if r.status in FAILING]

    @property
    def passes(self) -> bool:
        return not self.failing

    def figure(self) -> str:
        """The e2e evidence in a few words: failing cases and the worst error as a multiple of its case's tolerance."""
        ratios = [r.max_abs_err / r.atol for r in self.results if r.max_abs_err is not None and r.atol]
        worst = f", worst error {max(ratios):.2g}x its tolerance" if ratios else ""
        return f"{len(self.failing)} of {len(self.results)} e2e cases failing{worst}"


@dataclass
class Bisection:
    """What bisection found: the first attempt (every op the set's own), each attempt after, and the culprits."""

    own_ops: list[str]
    baseline: Attempt
    attempts: list[Attempt]
    culprits: list[str]
    together: bool = False


def bisect_ops(check: Callable[[Sequence[str]], list[CaseResult]], own_ops: Sequence[str],
               log: Callable[[str], None] = lambda line: None) -> Bisection:
    """Find the ops whose own implementation makes ``check`` (e2e with those ops on the reference) fail.

    ``check(swapped)`` runs e2e with ``swapped`` on the reference.
    """
    attempts: list[Attempt] = []

    def attempt(swapped: Sequence[str]) -> Attempt:
        a = Attempt(tuple(sorted(swapped)), check(list(swapped)))
        attempts.append(a)
        return a

    baseline = attempt([])
    found = Bisection(list(own_ops), baseline, attempts, [])
    if baseline.passes or not own_ops:
        return found
    for op in own_ops:
        a = attempt([op])
        log(f"  swap {op:<24} {'e2e passes' if a.passes else 'e2e still fails'} ({a.figure()})")
        if a.passes:
            found.culprits.append(op)
    if found.culprits or len(own_ops) == 1:
        return found
    log("  no single swap fixes it: bisecting for ops that act together")
    suspects = list(own_ops)
    if not attempt(suspects).passes:
        log(f"  swap all {len(suspects)} own ops: e2e still fails ({attempts[-1].figure()})")
        return found
    while len(suspects) > 1:
        half = len(suspects) // 2
        for part in (suspects[:half], suspects[half:]):
            if attempt(part).passes:
                log(f"  swap {', '.join(part)}: e2e passes")
                suspects = part
                break
        else:
            break
    for op in list(suspects):
        rest = [o for o in suspects if o != op]
        if rest and attempt(rest).passes:
            suspects = rest
    found.culprits, found.together = suspects, True
    return found


def run_bisect(run: E2ERun, kernels: Kernels, device: Device, kernels_name: str, op_globs: Sequence[str] | None,
               out: Callable[[str], None] = print) -> int:
    """Bisect ``kernels``' own ops over ``run``'s e2e cases, print the culprits; the exit status (see the module)."""
    own = [op for op in type(kernels).overrides() if not op_globs or any(fnmatch.fnmatch(op, g) for g in op_globs)]
    out(f"bisect: kernel set {kernels_name}; own ops: {', '.join(own) if own else 'none (reference everywhere)'}")
    first = run.check(kernels, device)
    failing_ops = tuple(dict.fromkeys(r.op for r in first if r.status in FAILING))
    if not failing_ops:
        out(f"bisect: e2e passes ({len(first)} cases): nothing to bisect")
        return 0
    counts = {op: sum(r.op == op and r.status in FAILING for r in first) for op in failing_ops}
    out(f"bisect: e2e fails: {', '.join(f'{op} ({n} of its cases)' for op, n in counts.items())}")
    # later attempts rerun only the cases that failed, on the same reference runs
    narrowed = _only(run, failing_ops)
    tried = {(): [r for r in first if r.op in failing_ops]}

    def check(swapped: Sequence[str]) -> list[CaseResult]:
        key = tuple(sorted(swapped))
        if key not in tried:
            tried[key] = narrowed.check(with_reference(kernels, key), device)
        return tried[key]

    found = bisect_ops(check, own, log=out)
    before = found.baseline.figure()
    for op in found.culprits:
        swapped = tuple(sorted(found.culprits)) if found.together else (op,)
        after = next(a for a in found.attempts if a.swapped == swapped).figure()
        others = [o for o in found.culprits if o != op]
        with_ = f" (together with {', '.join(others)})" if others else ""
        out(f"culprit: {op}{with_}: with {' + '.join(swapped)} on the reference, {before} -> {after}")
    if found.culprits:
        return 1
    if own:
        out(f"bisect: no swap of this set's own ops to the reference makes e2e pass ({before}); "
            "the divergence is outside them: the device, the dtype or the model")
    else:
        out(f"bisect: the kernel set has no ops of its own ({before}); the divergence is in the device or the dtype")
    return 1


def _only(run: E2ERun, ops: tuple[str, ...]) -> E2ERun:
    """``run`` restricted to ``ops``, sharing its reference runs."""
    return replace(run, cases=tuple(c for c in run.cases if c in ops), _references=run._references, _ids=run._ids)
