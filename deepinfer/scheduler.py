"""Continuous batching: which tokens of which requests run in the next step.

Each step has a token budget (``max_num_batched_tokens``) shared by decodes and
prefill chunks, so long prompts are split (chunked prefill) and mixed with the
decodes of running requests. Running requests go first, in arrival order; then
waiting ones, first come first served, while there is budget, a free sequence
slot and cache room. When the cache runs out, the newest running request is
preempted: its cache is freed and it will be recomputed from scratch later.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .kv_cache_manager import KVCacheManager
from .request import Request, RequestStatus


@dataclass
class ScheduledChunk:
    request: Request
    #: first token (index into prompt + output) computed in this step
    start: int
    num_tokens: int
    #: whether this chunk reaches the request's last known token, so a new token is sampled
    samples: bool = False

    def __post_init__(self) -> None:
        self.samples = self.start + self.num_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    chunks: list[ScheduledChunk] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(c.num_tokens for c in self.chunks)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_chunk: int | None = None,
        replay_start: Callable[[int], int | None] = lambda hit: hit,
    ) -> None:
        """``replay_start(hit)`` gives the position from which a request whose first ``hit``
        tokens are cached recomputes (to rebuild state that is not cached), or None when
        the hit is not worth adopting."""
        self.kv = kv
        self.replay_start = replay_start
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        #: most tokens of one sequence in one step
        self.max_chunk = max_chunk or max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions = 0

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput()
        budget = self.max_num_batched_tokens
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            if req.at_limit or req.num_computed_tokens >= req.num_tokens:
                i += 1  # finishes once its pending tokens land; nothing to compute
                continue
            n = min(req.num_tokens - req.num_computed_tokens, budget, self.max_chunk)
            while not self.kv.allocate(req, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                out.chunks.append(ScheduledChunk(req, req.num_computed_tokens, n))
                budget -= n
                i += 1
                continue
            break
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            if not self.kv.has_free_slot:
                break
            hit = self.kv.prefix_hit(req)
            cached = len(hit) * self.kv.block_size
            start = self.replay_start(cached) if hit else 0
            if start is None:
                hit, cached, start = [], 0, 0
            n = min(req.num_tokens - start, budget, self.max_chunk)
            if not self.kv.allocate(req, start + n, hit):
                break
            self.waiting.popleft()
            req.status = RequestStatus.RUNNING
            req.num_computed_tokens = start
            req.num_cached_tokens = cached
            req.state_floor = start
            self.running.append(req)
            out.chunks.append(ScheduledChunk(req, start, n))
            budget -= n
        return out

    def finish(self, req: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """End ``req`` wherever it is, freeing its cache."""
        if req.finished:
            return
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        self.kv.free(req)
