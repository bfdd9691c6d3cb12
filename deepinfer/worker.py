"""The device side of a step: forward, sampling and log-probabilities, on a worker thread.

With overlap scheduling the engine hands a ``StepPlan`` to the worker and
schedules the next step while this one runs. Tokens the next step needs but the
host has not seen yet are placeholders in its plan; the worker fills them from
the previous step's sampled tokens on the device, so no host round trip sits
between two forwards. Plans run strictly in submission order.
"""

from __future__ import annotations

import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .model_runner import ModelRunner
from .request import Request
from .sampler import Sampler, top_logprobs
from .scheduler import ScheduledChunk


@dataclass
class GrammarGate:
    """Bitmask rows the host fills once the previous step's tokens are known."""

    bitmask: torch.Tensor
    #: indices into the plan's sampled requests that are constrained
    rows: list[int]
    ready: threading.Event = field(default_factory=threading.Event)


@dataclass
class StepPlan:
    chunks: list[ScheduledChunk]
    #: per chunk, the tokens to compute (-1: a placeholder for the previous step's sample)
    tokens: list[list[int]]
    #: (flat position in this step, index among the previous step's samples)
    placeholders: list[tuple[int, int]]
    #: per chunk, offsets whose logits are needed
    offsets: list[list[int]]
    slots: list[int]
    tables: dict[int, list[int]]
    #: per slot: first position of window state the sequence computes itself (after a prefix hit)
    floors: dict[int, int]
    #: per slot: leading tokens whose compressed entries are shared from the prefix cache
    frozen: dict[int, int]
    sample_rows: list[int]
    sample_reqs: list[Request]
    #: largest ``logprobs`` asked for among sampled requests (None: nobody asked)
    logprobs_k: int | None
    #: (request, chunk start, first logits row, rows) for prompt log-probabilities
    prompt_rows: list[tuple[Request, int, int, int]]
    grammar: GrammarGate | None = None


@dataclass
class StepResult:
    tokens: torch.Tensor
    token_list: list[int]
    logprob_rows: list[dict[int, tuple[float, int]]] | None
    prompt_logprobs: list[tuple[Request, int, list[dict[int, tuple[float, int]]]]]
    forward_seconds: float


class DeviceWorker:
    """Runs plans in order, on its own thread when ``threaded``."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, threaded: bool) -> None:
        self.runner = runner
        self.sampler = sampler
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-device") if threaded else None
        self._last: Future | None = None

    def submit(self, plan: StepPlan) -> Future:
        prev = self._last
        if self._pool is None:
            fut: Future = Future()
            try:
                fut.set_result(self._run(plan, prev))
            except BaseException as exc:  # surfaced by .result() like the threaded path
                fut.set_exception(exc)
        else:
            fut = self._pool.submit(self._run, plan, prev)
        self._last = fut
        return fut

    def _run(self, plan: StepPlan, prev: Future | None) -> StepResult:
        t0 = time.perf_counter()
        fix = None
        if plan.placeholders:
            prev_tokens = prev.result().tokens
            dev = prev_tokens.device
            pos = torch.tensor([p for p, _ in plan.placeholders], dtype=torch.int64, device=dev)
            idx = torch.tensor([i for _, i in plan.placeholders], dtype=torch.int64, device=dev)
            fix = (pos, prev_tokens[idx])
        self.runner.cache.set_sequences(plan.tables, plan.floors, plan.frozen)
        logits = self.runner.execute(plan.tokens, [c.start for c in plan.chunks], plan.offsets, plan.slots, fix)
        prompt_lps = []
        for req, start, row0, n in plan.prompt_rows:
            targets = torch.tensor(req.prompt_token_ids[start + 1 : start + 1 + n], device=logits.device)
            prompt_lps.append((req, start, top_logprobs(logits[row0 : row0 + n], req.params.prompt_logprobs, targets)))
        rows = logits[plan.sample_rows]
        bitmask = None
        if plan.grammar is not None:
            plan.grammar.ready.wait()
            bitmask = (plan.grammar.bitmask.to(rows.device), plan.grammar.rows)
        tokens = self.sampler.sample(rows, plan.sample_reqs, bitmask)
        lps = top_logprobs(rows, plan.logprobs_k, tokens) if plan.logprobs_k is not None and len(plan.sample_reqs) else None
        token_list = tokens.tolist()
        return StepResult(tokens, token_list, lps, prompt_lps, time.perf_counter() - t0)

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
