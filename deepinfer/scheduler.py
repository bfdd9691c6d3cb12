"""Continuous batching: which tokens of which requests run in the next step, as one record per sequence.

Each step has a token budget (``max_num_batched_tokens``) shared by decodes and
prefill chunks, so long prompts are split (chunked prefill) and mixed with the
decodes of running requests. Running requests go first, in arrival order; then
waiting ones, first come first served, while there is budget, a free sequence
slot and cache room. When the cache runs out, the newest running request is
preempted: its cache is freed and it will be recomputed from scratch later.

The scheduler is the only place that advances ``num_computed_tokens``: a
request's tokens count as computed once they are scheduled. It also counts
what it schedules into the engine's ``EngineStats``.

Speculative decoding: a running request whose draft follows the token it feeds
next brings that token and the drafts the policy admits (from their survival
probabilities, over the whole batch); they count as computed until the step
returns, when ``settle`` keeps the anchor and the accepted drafts and drops the
rest (with the blocks only they needed). Once a step's records are made, the
policy also picks which of its sampling requests draft after it (``propose``):
all, some or none, as the next step's expected goodput with the draft pass
priced in says; a request that does not draft decodes plainly next step and
drafts again once the policy picks it. With overlap scheduling (``chain``) a
request whose step is still in flight is scheduled again at once: its record is
*chained* to that step (its token and drafts are the ones that step samples and
drafts, its positions assume every draft in flight is accepted, and the runner
moves them back by the rejected ones), and how many drafts it verifies is
admitted from its previous draft's survival, one step old.

Parallel sampling: the extra completions of a prompt wait here until their
first sibling's prefill is scheduled to finish; in that same step they start
as copies of its state (its full blocks shared, a partly filled last block
copied) and draw their first tokens from its last logits row. Without a free
slot or block for the copy they fall back to prefilling like any request.
"""

from __future__ import annotations

import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from .kv_cache_manager import KVCacheManager
from .kv_transfer.sequence_state import SequenceInstall
from .request import Request, RequestStatus
from .spec_decode.inflight import DraftLedger
from .spec_decode.speculation import StepOutlook
from .stats import EngineStats
from .step import ForkSpec, PromptLogprobSpec, ScheduledSequence



@dataclass
class SchedulerOutput:
    sequences: list[ScheduledSequence] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)
    #: requests finished since the previous output
    finished_request_ids: list[str] = field(default_factory=list)
    #: imported sequences to install before this step
    installs: list[SequenceInstall] = field(default_factory=list)

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.sequences)


class Scheduler:
    def __init__(
        self,
        kv: KVCacheManager,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_chunk: int | None = None,
        replay_start: Callable[[int], int | None] = lambda hit: hit,
        stats: EngineStats | None = None,
        drafts: DraftLedger | None = None,
        history_tokens: int = 0,
    ) -> None:
        """``replay_start(hit)`` gives the position from which a request whose first ``hit``
        tokens are cached recomputes (to rebuild state that is not cached), or None when
        the hit is not worth adopting. ``drafts``: the speculating requests' drafts in flight and the
        admission policy (how many of each ready request's drafts a step verifies, which requests draft
        after it, whether a request chains to its step in flight); None: nobody speculates.
        ``history_tokens``: how many tokens before a replay start a first chunk brings as history (the
        model's n-gram look-back)."""
        self.kv = kv
        self.history_tokens = history_tokens
        self.replay_start = replay_start
        self.drafts = drafts if drafts is not None else DraftLedger()
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        #: most tokens of one sequence in one step
        self.max_chunk = max_chunk or max_num_batched_tokens
        self.stats = stats if stats is not None else EngineStats()
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        #: source request id -> its siblings waiting to start as copies of it
        self._forks: dict[str, list[Request]] = {}
        #: siblings started as copies in the step being scheduled (they join ``running`` once it is)
        self._forked: list[Request] = []
        self._finished_ids: list[str] = []

    def add(self, req: Request) -> None:
        if req.fork_source is not None:
            self._forks.setdefault(req.fork_source.request_id, []).append(req)
        else:
            self.waiting.append(req)

    @property
    def num_waiting(self) -> int:
        """Requests not yet started: queued, and completions waiting to start as copies of their prompt's first."""
        return len(self.waiting) + sum(len(f) for f in self._forks.values())

    @property
    def has_work(self) -> bool:
        return bool(self.waiting or self.running or self._forks)

    def _preempt(self, req: Request) -> None:
        self.kv.free(req)
        req.num_computed_tokens = 0
        self.drafts.preempted(req)
        req.status = RequestStatus.WAITING
        req.metrics.num_preemptions += 1
        self.stats.preemptions += 1
        self.waiting.appendleft(req)

    def schedule(self) -> SchedulerOutput:
        out = SchedulerOutput(finished_request_ids=self._finished_ids)
        self._finished_ids = []
        budget = self.max_num_batched_tokens
        drafts = self._admitted(budget)
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            chained = self.drafts.chains(req)
            if req.at_limit or (chained and req.num_computed_tokens >= req.max_total_tokens) or (
                not chained and req.num_computed_tokens >= req.num_tokens
            ):
                i += 1  # finishes once its pending tokens land (or may: it waits for them); nothing to compute
                continue
            n = 1 if chained else min(req.num_tokens - req.num_computed_tokens, budget, self.max_chunk)
            draft = drafts.get(req.request_id, [])[: max(0, min(budget, self.max_chunk) - n)]
            if draft and not self.kv.allocate(req, req.num_computed_tokens + n + len(draft)):
                draft = []  # no room to verify: decode plainly before preempting anyone
            while not self.kv.allocate(req, req.num_computed_tokens + n):
                victim = self.running.pop()
                self._preempt(victim)
                out.preempted.append(victim)
                if victim is req:
                    break
            else:
                self._emit(out, req, req.num_computed_tokens, n, draft, chained)
                budget -= n + len(draft)
                i += 1
                continue
            break
        while self.waiting and budget > 0 and len(self.running) + len(self._forked) < self.max_num_seqs and not out.preempted:
            req = self.waiting[0]
            if not self.kv.has_free_slot:
                break
            if req.imported is not None:
                if not self._start_imported(out, req):
                    break
                budget -= 1
                continue
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
            if cached:
                self.stats.cached_tokens += cached
                self.stats.replayed_tokens += cached - start
            self._emit(out, req, start, n)
            budget -= n
        self.running.extend(self._forked)
        self._forked = []
        self._choose_drafters(out)
        if out.sequences:
            self.stats.steps += 1
            self.stats.computed_tokens += out.num_tokens
        return out

    def _start_imported(self, out: SchedulerOutput, req: Request) -> bool:
        """Start a request whose prompt another engine computed: its state is installed before this step,
        which feeds its first output token (no prompt token is computed here). False: no room yet."""
        n = req.imported.num_tokens
        if not self.kv.allocate(req, n + 1):
            return False
        self.waiting.popleft()
        req.status = RequestStatus.RUNNING
        req.num_computed_tokens = n
        req.state_floor = 0
        self.running.append(req)
        out.installs.append(SequenceInstall(self.kv.slots[req.request_id], list(self.kv.tables[req.request_id]), req.imported))
        req.imported = None  # preempted later, it is recomputed from its tokens like any other
        self._emit(out, req, n, req.num_tokens - n)
        return True

    def _decodes(self, req: Request) -> bool:
        """Whether ``req``'s next record feeds one token and samples (a decode, maybe verifying drafts)."""
        return not req.at_limit and (self.drafts.chains(req) or req.num_computed_tokens == req.num_tokens - 1)

    def _admitted(self, budget: int) -> dict[str, list[int]]:
        """The drafts each ready running request verifies this step."""
        ready = self.drafts.ready(self.running)
        if not ready:
            return {}
        decoding = sum(1 for r in self.running if self._decodes(r))
        chunks = sum(min(r.num_tokens - r.num_computed_tokens, self.max_chunk) for r in self.running
                     if not self.drafts.chains(r) and r.num_tokens - r.num_computed_tokens > 1)
        outlook = StepOutlook(decoding, decoding + min(chunks, max(0, budget - decoding)))
        return self.drafts.admit(ready, max(0, budget - outlook.base_tokens), outlook)

    def _choose_drafters(self, out: SchedulerOutput) -> None:
        """Let the policy pick the step's sampling records that draft after it, for the next step, which this
        one predicts: each sampling request decodes, each unfinished prompt goes on."""
        decoding = sum(1 for s in out.sequences if s.sample is not None)
        chunks = sum(s.num_tokens for s in out.sequences if s.sample is None and s.num_tokens)
        outlook = StepOutlook(decoding, decoding + chunks)
        self.drafts.choose(out.sequences, self.running, outlook, max(0, self.max_num_batched_tokens - outlook.base_tokens))

    def settle(self, req: Request, rejected: int) -> None:
        """After verification: ``req``'s ``rejected`` drafts stop counting as computed (a record chained
        after them assumed them accepted: the runner moved its positions back by as many), and the
        blocks only they needed are dropped. A request preempted since keeps its fresh start."""
        if req.status is not RequestStatus.RUNNING:
            return
        req.num_computed_tokens -= rejected
        self.kv.truncate(req, max(req.num_tokens, req.num_computed_tokens))

    def _emit(
        self, out: SchedulerOutput, req: Request, start: int, n: int, draft: list[int] | None = None, chained: bool = False
    ) -> None:
        """Record one chunk of ``req`` (with the drafts it verifies) and count it as computed."""
        draft = draft or []
        if req.metrics.first_scheduled_time is None:
            req.metrics.first_scheduled_time = time.monotonic()
            self.stats.prompt_tokens += req.num_prompt_tokens
        samples = chained or start + n == req.num_tokens
        if not (samples and n == 1 and start >= req.num_prompt_tokens):  # anything but feeding back one output token
            self.stats.prefill_tokens += n
        offsets: list[int] = []
        prompt_lp = None
        if req.params.prompt_logprobs is not None and req.index == 0 and start < req.num_prompt_tokens:
            rows = min(n, req.num_prompt_tokens - 1 - start)
            if rows > 0:
                offsets = list(range(rows))
                targets = tuple(req.prompt_token_ids[start + 1 : start + 1 + rows])
                prompt_lp = PromptLogprobSpec(req.params.prompt_logprobs, targets)
        if samples and (not offsets or offsets[-1] != n - 1):
            offsets.append(n - 1)
        offsets.extend(range(n, n + len(draft)))  # each draft's row: the target's distribution after it
        out.sequences.append(ScheduledSequence(
            request_id=req.request_id,
            slot=self.kv.slots[req.request_id],
            start=start,
            token_ids=req.token_slice(start, n),
            block_table=list(self.kv.tables[req.request_id]),
            state_floor=req.state_floor,
            shared_prefix_tokens=req.num_cached_tokens,
            history_ids=self._history(req, start),
            prefill_end=req.num_tokens if prompt_lp is None and not draft and not req.num_pending and not chained else 0,
            logit_offsets=offsets,
            sample=req.sample_spec if samples else None,
            prompt_logprobs=prompt_lp,
            draft_token_ids=draft,
            speculate=req.spec is not None,
            chained=chained,
            images=req.images_in(start, start + n),
        ))
        if chained:
            self.stats.spec_chained_records += 1
        req.num_computed_tokens = start + n + len(draft)
        if samples:
            req.num_pending += 1
            if req.request_id in self._forks and not req.output_token_ids:
                self._fork_siblings(out, req)

    def _history(self, req: Request, start: int) -> list[int]:
        """The tokens before ``start`` a sequence's first chunk after a prefix hit brings as history."""
        if not self.history_tokens or start == 0 or start != req.state_floor:
            return []
        first = max(0, start - self.history_tokens)
        return req.token_slice(first, start - first)

    def _fork_siblings(self, out: SchedulerOutput, source: Request) -> None:
        """Start the siblings waiting on ``source`` as copies of its state at the end of its prompt."""
        length = source.num_prompt_tokens
        for child in self._forks.pop(source.request_id):
            child.fork_source = None
            if child.finished:
                continue
            room = len(self.running) + len(self._forked) < self.max_num_seqs
            copies = self.kv.fork(source, child, length) if room else None
            if copies is None:
                self.waiting.append(child)  # no room to copy: it prefills on its own
                continue
            child.status = RequestStatus.RUNNING
            child.metrics.first_scheduled_time = time.monotonic()
            child.num_computed_tokens = length
            child.num_cached_tokens = self.kv.shared_tokens(child)
            child.state_floor = source.state_floor
            child.num_pending += 1
            self._forked.append(child)
            self.stats.forked_sequences += 1
            out.sequences.append(ScheduledSequence(
                request_id=child.request_id,
                slot=self.kv.slots[child.request_id],
                start=length,
                token_ids=[],
                block_table=list(self.kv.tables[child.request_id]),
                state_floor=child.state_floor,
                shared_prefix_tokens=child.num_cached_tokens,
                sample=child.sample_spec,
                fork=ForkSpec(source.request_id, self.kv.slots[source.request_id], tuple(copies)),
                speculate=child.spec is not None,
            ))

    def finish(self, req: Request, reason: str, stop_reason: str | int | None = None) -> None:
        """End ``req`` wherever it is, freeing its cache."""
        if req.finished:
            return
        if req.status is RequestStatus.RUNNING:
            self.kv.commit(req)  # its last full blocks serve later prefixes too
        req.status = RequestStatus.FINISHED
        req.finish_reason = reason
        req.stop_reason = stop_reason
        if req in self.running:
            self.running.remove(req)
        elif req in self.waiting:
            self.waiting.remove(req)
        elif req.fork_source is not None:
            waiting = self._forks.get(req.fork_source.request_id, [])
            if req in waiting:
                waiting.remove(req)
            if not waiting:
                self._forks.pop(req.fork_source.request_id, None)
        if req.hold_kv:
            self.kv.hold(req)
        else:
            self.kv.free(req)
        self._finished_ids.append(req.request_id)
        for child in self._forks.pop(req.request_id, []):  # it never reached the end of its prompt
            child.fork_source = None
            self.waiting.append(child)
