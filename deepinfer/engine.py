"""The engine: requests in, tokens out, one scheduler step at a time.

Each ``step`` asks the scheduler which tokens to compute, runs them through the
model runner, samples the requests whose chunk reached their last token, and
applies stop conditions. Bad requests fail alone: their output carries the
error and the rest of the batch goes on.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Mapping

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer, find_stop
from .errors import ConfigError, DeepInferError
from .kv_cache_manager import KVCacheManager
from .loader import load_tokenizer, read_generation_config
from .model.config import CSA, ModelConfig
from .model_runner import ModelRunner
from .outputs import CompletionOutput, RequestOutput
from .registry import select_backend
from .request import Request, RequestStatus
from .sampler import Sampler, to_logprobs
from .sampling_params import InvalidRequestError, SamplingParams
from .scheduler import Scheduler
from .stats import EngineStats
from .structured_output import GrammarCompilerCache, allocate_bitmask
from .worker import DeviceWorker, GrammarGate, StepPlan, StepResult

log = logging.getLogger("deepinfer")

BUNDLED_MODEL = Path(__file__).parent / "models" / "tiny-v4"


def resolve_model_dir(model: str | None) -> Path:
    """The model directory to load: the given one, or the bundled model."""
    if model is not None:
        return Path(model)
    if not (BUNDLED_MODEL / "config.json").is_file():
        raise ConfigError(f"no model given and the bundled model is missing at {BUNDLED_MODEL}; pass --model DIR")
    return BUNDLED_MODEL


def replay_length(config: ModelConfig, mode: str) -> int:
    """Tokens recomputed before a prefix hit to rebuild the state that is not cached.

    The sliding-window K=V ring and the compressors' partial windows depend on
    every earlier token, so they are not content-addressed. ``bounded`` replays
    the last W tokens (W = the sliding window), their attention seeing only the
    cached compressed context: fixed cost, approximate. ``exact`` replays the
    window's receptive field through all layers (W per layer, plus the
    overlapping compressor's two windows), after which the rebuilt state equals
    a full prefill's.
    """
    w = config.sliding_window
    if mode == "bounded":
        return w
    csa = config.compress_ratio(CSA) if CSA in config.layer_types else 0
    return config.num_hidden_layers * w + 2 * csa


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.backend = select_backend(config.backend, config.kernels, config.interpret)
        model_dir = resolve_model_dir(config.model)
        self.runner = ModelRunner(self.backend, model_dir, config)
        self.tokenizer = load_tokenizer(model_dir)
        mc = self.runner.config
        self.vocab_size = mc.vocab_size
        self.max_model_len = self.runner.max_model_len
        gen = read_generation_config(model_dir)
        eos = gen.get("eos_token_id", mc.eos_token_id)
        self.eos_token_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        plan = self.runner.plan
        self.kv = KVCacheManager(plan.num_blocks, plan.block_size, plan.num_slots, config.enable_prefix_caching)
        self.replay_tokens = replay_length(mc, config.swa_replay)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.runner.max_step_tokens, self._replay_start
        )
        self.sampler = Sampler(self.backend.kernels, self.backend.device, config.seed)
        self.requests: dict[str, Request] = {}
        self._ids = itertools.count()
        self.stats = EngineStats()
        self._grammar_cache: GrammarCompilerCache | None = None
        self.worker = DeviceWorker(self.runner, self.sampler, threaded=config.overlap_scheduling)
        self._inflight: deque[tuple[StepPlan, Future]] = deque()
        #: request id -> index among the last planned step's samples (placeholder sources)
        self._prev_sample_index: dict[str, int] = {}

    def _grammars(self) -> GrammarCompilerCache:
        """The grammar compiler, built on the first constrained request (xgrammar loads slowly)."""
        if self._grammar_cache is None:
            eos = next(iter(sorted(self.eos_token_ids)), None)
            self._grammar_cache = GrammarCompilerCache(self.tokenizer, self.vocab_size, eos)
        return self._grammar_cache

    def _replay_start(self, hit: int) -> int | None:
        """Where a request with ``hit`` cached tokens starts computing; None: the hit is too short
        to save anything over a full prefill, so the request is prefilled from scratch."""
        start = hit - self.replay_tokens
        return start if start > 0 else None

    # ----- requests -----

    def _validate(self, prompt_ids: list[int]) -> None:
        if not prompt_ids:
            raise InvalidRequestError("the prompt is empty; give at least one token")
        bad = [t for t in prompt_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequestError(f"prompt token id {bad[0]} is outside the vocabulary [0, {self.vocab_size}); fix the token ids")
        if len(prompt_ids) >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {len(prompt_ids)} tokens but max_model_len is {self.max_model_len}; "
                "shorten the prompt or raise max_model_len"
            )

    def add_request(
        self, prompt: str | list[int], params: SamplingParams | Mapping[str, Any] | None = None, request_id: str | None = None
    ) -> Request:
        """Queue one request; an invalid one is returned already finished with its error."""
        request_id = request_id or str(next(self._ids))
        text = prompt if isinstance(prompt, str) else None
        req = Request(request_id, text, [], SamplingParams())
        self.requests[request_id] = req
        try:
            if params is None:
                params = SamplingParams()
            elif not isinstance(params, SamplingParams):
                params = SamplingParams(**dict(params))
            req.params = params
            ids = self.tokenizer.encode(prompt).ids if isinstance(prompt, str) else [int(t) for t in prompt]
            req.prompt_token_ids = ids
            self._validate(ids)
            if params.structured_outputs is not None:
                req.state["grammar"] = self._grammars().request_grammar(params.structured_outputs)
        except DeepInferError as exc:
            req.status = RequestStatus.FINISHED
            req.finish_reason = "abort"
            req.state["error"] = str(exc)
            return req
        req.eos_token_id = next(iter(self.eos_token_ids), None)
        req.state["detok"] = IncrementalDetokenizer(self.tokenizer, req.prompt_token_ids, params.skip_special_tokens)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(req.prompt_token_ids)
        req.max_total_tokens = min(len(req.prompt_token_ids) + params.max_tokens, self.max_model_len)
        self.scheduler.add(req)
        return req

    def abort(self, request_id: str) -> None:
        """Stop a request wherever it is; its output so far is kept with finish reason ``abort``."""
        req = self.requests.get(request_id)
        if req is not None and not req.finished:
            self.scheduler.finish(req, "abort")
            req.metrics.finished_time = time.monotonic()

    def release(self, request_ids: list[str]) -> None:
        """Forget finished requests once their outputs have been taken."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and req.finished:
                del self.requests[rid]

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._inflight)

    # ----- stepping -----

    def _plan(self) -> tuple[StepPlan | None, list[Request]]:
        """Schedule the next step and describe it for the device; also return preempted requests."""
        out = self.scheduler.schedule()
        self.stats.preemptions += len(out.preempted)
        if not out.chunks:
            return None, list(out.preempted)
        now = time.monotonic()
        prev_index = self._prev_sample_index
        tokens, placeholders, offsets, slots, tables, floors, frozen = [], [], [], [], {}, {}, {}
        sample_rows, sample_reqs, prompt_rows = [], [], []
        flat = row = 0
        for c in out.chunks:
            req = c.request
            toks = req.token_slice(c.start, c.num_tokens)
            for j, t in enumerate(toks):
                if t < 0:
                    placeholders.append((flat + j, prev_index[req.request_id]))
            wants_prompt = req.params.prompt_logprobs is not None and c.start < req.num_prompt_tokens
            offs = list(range(c.num_tokens)) if wants_prompt else ([c.num_tokens - 1] if c.samples else [])
            if wants_prompt:
                n = min(c.num_tokens, req.num_prompt_tokens - 1 - c.start)
                if n > 0:
                    prompt_rows.append((req, c.start, row, n))
            if c.samples:
                sample_rows.append(row + len(offs) - 1)
                sample_reqs.append(req)
            slot = self.kv.slots[req.request_id]
            tokens.append(toks)
            offsets.append(offs)
            slots.append(slot)
            tables[slot] = list(self.kv.tables[req.request_id])
            floors[slot] = req.state_floor
            frozen[slot] = req.num_cached_tokens
            flat += c.num_tokens
            row += len(offs)
            if req.metrics.first_scheduled_time is None:
                req.metrics.first_scheduled_time = now
                self.stats.prompt_tokens += req.num_prompt_tokens
            if c.start == req.state_floor and req.num_cached_tokens:
                # first chunk after a prefix hit
                self.stats.cached_tokens += req.num_cached_tokens
                self.stats.replayed_tokens += req.num_cached_tokens - req.state_floor
            decode = c.samples and c.num_tokens == 1 and c.start + 1 >= req.num_known_tokens
            if not decode:
                self.stats.prefill_tokens += c.num_tokens
            req.num_computed_tokens += c.num_tokens
            if c.samples:
                req.num_pending += 1
        self._prev_sample_index = {r.request_id: i for i, r in enumerate(sample_reqs)}
        ks = [r.params.logprobs for r in sample_reqs if r.params.logprobs is not None]
        plan = StepPlan(
            out.chunks, tokens, placeholders, offsets, slots, tables, floors, frozen, sample_rows, sample_reqs,
            max(ks) if ks else None, prompt_rows,
        )
        constrained = [i for i, r in enumerate(sample_reqs) if "grammar" in r.state]
        if constrained:
            plan.grammar = GrammarGate(allocate_bitmask(len(constrained), self.vocab_size), constrained)
        self.stats.steps += 1
        self.stats.computed_tokens += out.num_tokens
        return plan, list(out.preempted)

    @staticmethod
    def _fill_grammar(plan: StepPlan) -> None:
        """Write the constrained requests' masks; their grammars have seen every earlier token."""
        gate = plan.grammar
        if gate is None or gate.ready.is_set():
            return
        for j, i in enumerate(gate.rows):
            plan.sample_reqs[i].state["grammar"].fill_bitmask(gate.bitmask, j)
        gate.ready.set()

    def step(self) -> list[Request]:
        """Advance by one step; return the requests that produced tokens, finished or were preempted.

        With overlap scheduling the next step is scheduled and handed to the
        device before this step's tokens are read back, so a stop condition is
        seen one step late; the extra token it cost is discarded.
        """
        t0 = time.perf_counter()
        plan, changed = self._plan()
        self.stats.schedule_seconds += time.perf_counter() - t0
        if plan is not None:
            if not self._inflight:
                self._fill_grammar(plan)  # nothing pending: the masks can be written now
            self._inflight.append((plan, self.worker.submit(plan)))
        elif not self._inflight and self.scheduler.waiting and not self.scheduler.running:
            req = self.scheduler.waiting[0]
            self._fail(req, f"the request needs {self.kv.blocks_for(req.num_tokens)} cache blocks but the cache has {self.kv.pool.num_blocks}; raise kv_cache_memory")
            changed.append(req)
        keep = 1 if (self.config.overlap_scheduling and plan is not None) else 0
        while len(self._inflight) > keep:
            done_plan, fut = self._inflight.popleft()
            t1 = time.perf_counter()
            result = fut.result()
            self.stats.idle_wait_seconds += time.perf_counter() - t1
            self.stats.forward_seconds += result.forward_seconds
            changed.extend(self._apply(done_plan, result))
        for pending_plan, _ in self._inflight:
            self._fill_grammar(pending_plan)  # the device waits for these before sampling
        self.stats.wall_seconds += time.perf_counter() - t0
        return changed

    def _apply(self, plan: StepPlan, result: StepResult) -> list[Request]:
        """Take a finished step's tokens into the requests: log-probabilities, stop conditions, cache commits."""
        changed: list[Request] = []
        for req, start, rows in result.prompt_logprobs:
            for j, r in enumerate(rows):
                target = req.prompt_token_ids[start + 1 + j]
                req.prompt_logprobs[start + 1 + j] = to_logprobs([self._trim(r, req.params.prompt_logprobs, target)], self._decode_one)[0]
        for i, (req, tok) in enumerate(zip(plan.sample_reqs, result.token_list)):
            req.num_pending -= 1
            if req.finished:
                continue  # stopped a step ago: this token was computed ahead and is dropped
            if result.logprob_rows is not None and req.params.logprobs is not None:
                keep = self._trim(result.logprob_rows[i], req.params.logprobs, tok)
                req.logprobs.extend(to_logprobs([keep], self._decode_one))
            self._append(req, tok)
            changed.append(req)
        for c in plan.chunks:
            if not c.request.finished:
                self.kv.commit(c.request)
        self.stats.generated_tokens += len(changed)
        return changed

    def stats_line(self) -> str:
        return self.stats.line()

    @staticmethod
    def _trim(row: dict[int, tuple[float, int]], k: int, chosen: int) -> dict[int, tuple[float, int]]:
        return {t: v for t, v in row.items() if v[1] <= k or t == chosen}

    def _decode_one(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    def _append(self, req: Request, token: int) -> None:
        now = time.monotonic()
        p = req.params
        req.output_token_ids.append(token)
        m = req.metrics
        m.num_generated_tokens += 1
        if m.first_token_time is None:
            m.first_token_time = now
        reason: tuple[str, str | int | None] | None = None
        grammar = req.state.get("grammar")
        if grammar is not None and not grammar.accept(token):
            self._fail(req, f"token {token} was sampled outside the output grammar (a kernel ignored the bitmask)")
            return
        if grammar is not None and grammar.is_terminated:
            reason = ("stop", None)
        elif not p.ignore_eos and token in self.eos_token_ids:
            reason = ("stop", None)
        elif token in p.stop_token_ids:
            reason = ("stop", token)
        else:
            delta = req.state["detok"].push(token)
            req.output_text += delta
            hit = find_stop(req.output_text, len(delta), p.stop) if p.stop and delta else None
            if hit is not None:
                req.output_text = req.output_text[: hit[0]]
                reason = ("stop", hit[1])
        if reason is None and len(req.output_token_ids) >= p.max_tokens:
            reason = ("length", None)
        if reason is None and req.num_tokens >= self.max_model_len:
            reason = ("length", None)
        if reason is not None:
            self.scheduler.finish(req, *reason)
            m.finished_time = now

    def _fail(self, req: Request, message: str) -> None:
        self.scheduler.finish(req, "abort")
        req.state["error"] = message
        req.metrics.finished_time = time.monotonic()

    # ----- outputs -----

    def output(self, req: Request) -> RequestOutput:
        """A snapshot of ``req``'s output so far."""
        completion = CompletionOutput(
            index=0,
            text=req.output_text,
            token_ids=list(req.output_token_ids),
            logprobs=list(req.logprobs) if req.params.logprobs is not None else None,
            finish_reason=req.finish_reason,
            stop_reason=req.stop_reason,
        )
        prompt_lps = None
        if req.params.prompt_logprobs is not None and req.prompt_logprobs:
            prompt_lps = list(req.prompt_logprobs)
        return RequestOutput(
            request_id=req.request_id,
            prompt=req.prompt,
            prompt_token_ids=list(req.prompt_token_ids),
            prompt_logprobs=prompt_lps,
            outputs=[completion],
            finished=req.finished,
            metrics=req.metrics,
            error=req.state.get("error"),
            num_cached_tokens=req.num_cached_tokens,
        )
