"""The engine: requests in, tokens out, one scheduler step at a time.

Each ``step`` asks the scheduler for the next step's records, hands them to the
device (the runner samples the sequences whose chunk reached their last token),
and applies the returned tokens: log-probabilities, stop conditions, cache
commits. Bad requests fail alone: their output carries the error and the rest
of the batch goes on.
"""

from __future__ import annotations

import itertools
import logging
import time
from collections import deque
from concurrent.futures import Future
from pathlib import Path
from typing import Any, Callable, Mapping

import torch

from deepinfer_interfaces.errors import first_line

from .config import EngineConfig
from .detokenizer import IncrementalDetokenizer, find_stop
from .errors import ConfigError, DeepInferError
from .expert_parallel.sharding import ExpertParallel
from .kv_cache_manager import KVCacheManager
from .kv_transfer import PrefilledRequest
from .kv_transfer.sequence_state import SequenceState, storage_mismatch
from .kv_store import KVStore, PartShape, StoreStats, open_store, store_line
from .image_input import ImageLimits
from .loader import load_tokenizer, read_config, read_generation_config
from .models.common.config import ModelConfig
from .model_runner import ModelRunner
from .multimodal import ImageSpan
from .output_deltas import OutputDelta, SentSoFar
from .outputs import CompletionOutput, RequestOutput
from .prompts import PromptReader
from .registry import SelectedBackend, select_backend
from .request import Request, RequestStatus, token_array
from .request_limits import RequestLimits
from .sampler import to_logprobs
from .sampling_params import InvalidRequestError, SamplingParams
from .scheduler import Scheduler
from .spec_decode.inflight import DraftLedger, rejected_drafts
from .spec_decode.speculation import Speculation, step_kind
from .stats import EngineLoad, EngineStats
from .step import ScheduledSequence, Step, StepResult
from .step_executor import StepExecutor
from .structured_output import StructuredOutputManager

log = logging.getLogger("deepinfer")

BUNDLED_MODEL = Path(__file__).parent / "bundled" / "tiny-v4"


def resolve_model_dir(model: str | None) -> Path:
    """The model directory to load: the given one, or the bundled model."""
    if model is not None:
        return Path(model)
    if not (BUNDLED_MODEL / "config.json").is_file():
        raise ConfigError(f"no model given and the bundled model is missing at {BUNDLED_MODEL}; pass --model DIR")
    return BUNDLED_MODEL


def check_prompt_ids(prompt_ids: list[int], vocab_size: int, max_model_len: int, param: str | None = None) -> None:
    """Refuse an empty prompt, token ids outside the vocabulary, or a prompt the context cannot hold (``param``:
    the request field a server names)."""
    if not prompt_ids:
        raise InvalidRequestError("the prompt is empty; give at least one token", param)
    bad = None
    if min(prompt_ids) < 0 or max(prompt_ids) >= vocab_size:  # two C-speed passes; the offender is looked for only then
        bad = next(t for t in prompt_ids if not 0 <= t < vocab_size)
    if bad is not None:
        raise InvalidRequestError(f"prompt token id {bad} is outside the vocabulary [0, {vocab_size}); fix the token ids", param)
    if len(prompt_ids) >= max_model_len:
        raise InvalidRequestError(
            f"the prompt has {len(prompt_ids)} tokens but max_model_len is {max_model_len}; "
            "shorten the prompt or raise max_model_len", param,
        )


class Engine:
    """The engine of one process (an ``EngineClient``), or of one rank of an expert-parallel group."""

    def __init__(self, config: EngineConfig, backend: SelectedBackend | None = None, sharding: ExpertParallel | None = None) -> None:
        """``sharding``: this engine is one rank of an expert-parallel group (its requests are its share;
        every ``step`` runs exactly one forward, empty when it has nothing, in lockstep with the others)."""
        self.config = config
        self.stats = EngineStats()
        self.backend = backend or select_backend(config.backend, config.kernels, config.interpret)
        model_dir = resolve_model_dir(config.model)
        self.sharding = sharding
        self.runner = ModelRunner(self.backend, model_dir, config, self.stats, sharding)
        self.tokenizer = load_tokenizer(model_dir)
        mc = self.runner.config
        self.prompts = PromptReader(self.tokenizer, mc.model_type, read_config(model_dir), ImageLimits.from_config(config))
        self.vocab_size = mc.vocab_size
        self.max_model_len = self.runner.max_model_len
        gen = read_generation_config(model_dir)
        eos = gen.get("eos_token_id", mc.eos_token_id)
        self.eos_token_ids = set(eos if isinstance(eos, list) else [] if eos is None else [eos])
        self.structured = StructuredOutputManager(self.tokenizer, self.vocab_size, next(iter(sorted(self.eos_token_ids)), None))
        plan = self.runner.plan
        self.store = self._open_store(model_dir) if config.kv_store and config.enable_prefix_caching else None
        self.runner.store = self.store
        if config.kv_store and not config.enable_prefix_caching:
            log.warning("kv_store %s is not used: it serves the prefix cache, which is off; set enable_prefix_caching=True", config.kv_store)
        self.kv = KVCacheManager(plan.num_blocks, plan.block_size, plan.num_slots, config.enable_prefix_caching, store=self.store)
        self.replay_tokens = mc.replay_length(config.swa_replay)
        proposer = self.runner.proposer
        self.speculation: Speculation | None = None
        if proposer is not None:
            # the draft's context is per-request state too: after a prefix hit it is rebuilt from the replayed
            # tokens (V4-Flash replays its 128-token window, as long as the draft's context window)
            self.speculation = Speculation(
                config, proposer.gamma, self.runner.step_cost_profile, self.stats, self.runner.draft_cost_profile, self.runner.graph_shape,
            )
        overlap = config.overlap_scheduling
        self.overlap = self.backend.device.capabilities().asynchronous if overlap is None else overlap
        self.overlap = self.overlap and sharding is None  # lockstep: one forward per step, in order
        #: every speculating request's drafts in flight
        self.drafts = DraftLedger(self.speculation, chain=self.overlap, structured=self.structured)
        self.scheduler = Scheduler(
            self.kv, config.max_num_seqs, config.max_num_batched_tokens, self.runner.max_step_tokens, self._replay_start, self.stats,
            self.drafts, history_tokens=max(0, self.runner.geometry.history_window - 1),
        )
        self.limits = RequestLimits.from_config(config)
        #: user request id -> its first completion (which lists every completion in ``siblings``)
        self.requests: dict[str, Request] = {}
        #: every completion the device may still return tokens for, by its own id
        self._live: dict[str, Request] = {}
        self._ids = itertools.count()
        self.executor = StepExecutor(self.runner, threaded=self.overlap)
        self._inflight: deque[tuple[Step, Future]] = deque()

    def _open_store(self, model_dir: Path) -> KVStore | None:
        """The KV store the config names, fingerprinted by everything that shapes a block's contents."""
        from deepinfer_interfaces import INTERFACE_VERSION

        cache = self.runner.cache
        parts = [PartShape(p.name, p.rows, p.width, p.pool.dtype, p.format) for p in cache.block_parts()]
        b = self.backend
        settings = dict(backend=b.name, kernels=b.kernels_name, interpret=b.interpret, quantization=self.config.quantization,
                        interface=INTERFACE_VERSION)
        if self.config.deterministic:  # batch-invariant kernels round differently: their blocks are their own
            settings["batch_invariant"] = True
        return open_store(self.config, model_dir, settings, cache.dtype, cache.formats.as_dict(), parts, cache.block_size)

    def close(self) -> None:
        """Finish the steps in flight and the store's writes."""
        self.executor.close()
        if self.store is not None:
            self.store.close()

    def _replay_start(self, hit: int) -> int | None:
        """Where a request with ``hit`` cached tokens starts computing; None: the hit is too short
        to save anything over a full prefill, so the request is prefilled from scratch."""
        start = hit - self.replay_tokens
        return start if start > 0 else None

    @property
    def model_config(self) -> ModelConfig:
        return self.runner.config

    @property
    def backend_name(self) -> str:
        return self.backend.name

    def get_metrics(self) -> dict[str, Any]:
        """The engine's counters (what ``--stats`` prints); under expert parallelism also the EP figures
        (a collective: every rank asks in the same step)."""
        out = self.stats.as_dict()
        out.update(self.speculation.live_figures() if self.speculation is not None else {})
        out.update((self.store.stats if self.store is not None else StoreStats()).as_dict())
        if self.sharding is not None:
            out["expert_parallel"] = self.sharding.metrics()
        return out

    def load(self) -> EngineLoad:
        """Requests running and waiting, and the cache they occupy (a server's load report and gauges)."""
        pool = self.kv.pool
        sched = self.scheduler
        return EngineLoad(
            num_running=len(sched.running), num_waiting=sched.num_waiting,
            num_tokens=sum(r.num_computed_tokens for r in sched.running), num_blocks=pool.num_blocks,
            num_used_blocks=pool.num_blocks - pool.num_free,
        )

    def health(self) -> str | None:
        """None while the engine can step; one engine in one process has no part that can die alone."""
        return None

    def reset_prefix_cache(self) -> int:
        """Forget every cached prefix no request is using (the KV store on disk is kept); blocks dropped."""
        return self.kv.pool.forget_unused()

    # ----- requests -----

    def _validate(self, prompt_ids: list[int]) -> None:
        check_prompt_ids(prompt_ids, self.vocab_size, self.max_model_len)

    def _check_images(self, images: tuple[ImageSpan, ...]) -> None:
        """Refuse images the model cannot encode (its family reads them, but no vision tower was built)."""
        if images and (why := self.runner.model.image_blocker()) is not None:
            raise InvalidRequestError(why)

    def add_request(
        self, prompt: str | list[int] | Mapping[str, Any], params: SamplingParams | Mapping[str, Any] | None = None,
        request_id: str | None = None, *, hold_kv: bool = False, prefilled: PrefilledRequest | None = None,
    ) -> Request:
        """Queue one prompt (``params.n`` completions of it); an invalid one is returned already finished with its error.

        ``prompt``: text, token ids, or vLLM's ``{"prompt": ..., "multi_modal_data": {"image": ...}}`` (``prompts``:
        each image placeholder is expanded into its image's span, kept in ``Request.images``).

        ``hold_kv``: keep its cache when it finishes, for ``export_prefilled`` (a prefill engine of a disaggregated
        pair). ``prefilled``: its prompt was computed by another engine; that state is installed and the tokens
        it sampled are taken as this request's first (a decode engine: no prompt token is computed here)."""
        request_id = request_id or str(next(self._ids))
        text = prompt if isinstance(prompt, str) else None
        req = Request(request_id, text, [], SamplingParams())
        self.requests[request_id] = req
        try:
            read = self.prompts.read(prompt)
            text = req.prompt = read.text
            if params is None:
                params = SamplingParams()
            elif not isinstance(params, SamplingParams):
                params = SamplingParams(**dict(params))
            req.params = params
            self.limits.check_params(params)
            if self.store is not None:
                try:
                    self.store.policy.class_for(params.cache_class)
                except ValueError as exc:
                    raise InvalidRequestError(str(exc)) from None
            self._validate(read.token_ids)
            req.prompt_token_ids = ids = token_array(read.token_ids)
            req.images = read.images
            self._check_images(read.images)
            if (hold_kv or prefilled is not None) and params.n != 1:
                raise InvalidRequestError("a disaggregated request has one completion; use n=1", "n")
            if prefilled is not None and prefilled.state.num_tokens != len(ids):
                raise InvalidRequestError(
                    f"the prefilled state holds {prefilled.state.num_tokens} positions but the prompt has {len(ids)} tokens; "
                    "send the prompt the prefill server computed"
                )
            if prefilled is not None and (why := storage_mismatch(self.runner.cache, prefilled.state)) is not None:
                raise InvalidRequestError(why)
            children = [req] + [
                Request(f"{request_id}#{i}", text, ids, params, index=i, fork_source=req, images=read.images) for i in range(1, params.n)
            ]
            for child in children:
                child.siblings = children
                if params.structured_outputs is not None or params.thinking_budget is not None:
                    self.structured.add(child.request_id, params.structured_outputs, thinking_budget=params.thinking_budget,
                                        prompt_ids=read.token_ids)
                child.eos_token_id = next(iter(self.eos_token_ids), None)
                child.detokenizer = IncrementalDetokenizer(self.tokenizer, ids, params.skip_special_tokens)
                child.max_total_tokens = min(len(ids) + params.max_tokens, self.max_model_len)
        except DeepInferError as exc:
            return self._refuse(req, str(exc))
        except Exception as exc:  # noqa: BLE001 - a fault while admitting one request is that request's alone
            log.exception("admitting request %s failed", request_id)
            return self._refuse(req, f"internal error while admitting the request: {first_line(exc)}", internal=True)
        for child in children:
            self._live[child.request_id] = child
            self.drafts.start(child)
        if params.prompt_logprobs is not None:
            req.prompt_logprobs = [None] * len(ids)
        req.hold_kv = hold_kv
        if prefilled is not None:
            try:
                rows = prefilled.output_logprobs if params.logprobs is not None else None
                for i, token in enumerate(prefilled.output_token_ids):
                    if not req.finished:
                        if rows is not None and i < len(rows):  # the prefill side's, so positions line up with tokens
                            req.logprobs.extend(to_logprobs([rows[i]], self._decode_one))
                        self._append(req, token)
            except Exception as exc:  # noqa: BLE001 - as in ``_apply``: the request fails alone
                log.exception("taking the prefilled tokens of request %s failed", request_id)
                self._fail(req, f"internal error while processing the request's output: {first_line(exc)}", internal=True)
            if req.finished:
                return req
            req.imported = prefilled.state
        for child in children:
            self.scheduler.add(child)
        return req

    def _refuse(self, req: Request, message: str, internal: bool = False) -> Request:
        """``req`` finished on arrival with ``message`` (``internal``: the engine's fault, not the request's)."""
        for child in req.siblings:
            self.structured.release(child.request_id)
        req.siblings = [req]
        req.status = RequestStatus.FINISHED
        req.finish_reason = "abort"
        req.error, req.internal_error = message, internal
        return req

    def export_prefilled(self, request_id: str) -> PrefilledRequest:
        """The state and sampled tokens of a finished request added with ``hold_kv`` (copied off the device
        after the steps that wrote it); its cache stays held until ``release_prefilled``."""
        return self._prefilled(request_id, self.runner.read_sequence)

    def plan_prefilled(self, request_id: str) -> PrefilledRequest:
        """As ``export_prefilled``, but nothing is copied: each state tensor is a ``RowRead`` of the pools
        (``transfer_pools``), for a connector that reads them in place; valid until ``release_prefilled``."""
        return self._prefilled(request_id, self.runner.plan_sequence)

    def transfer_pools(self) -> list[torch.Tensor]:
        """The tensors ``plan_prefilled`` reads point into (a connector registers them once)."""
        return self.runner.transfer_pools()

    def _prefilled(self, request_id: str, read: Callable[[int, list[int], int], SequenceState]) -> PrefilledRequest:
        req = self.requests.get(request_id)
        held = self.kv.held.get(request_id)
        if req is None or held is None:
            raise InvalidRequestError(f"request {request_id!r} holds no cache to export (unknown, running, or already released)")
        slot, table = held
        state = self.executor.call(read, slot, table, len(req.prompt_token_ids)).result()
        logprobs = [{t: (lp.logprob, lp.rank) for t, lp in row.items()} for row in req.logprobs] if req.params.logprobs is not None else None
        return PrefilledRequest(state, req.output_token_ids.tolist(), logprobs)

    def release_prefilled(self, request_id: str) -> None:
        """Free the cache a ``hold_kv`` request kept (its blocks stay in the prefix cache)."""
        self.kv.release_held(request_id)

    def abort(self, request_id: str) -> None:
        """Stop every completion of a request wherever it is; output so far is kept with finish reason ``abort``."""
        req = self.requests.get(request_id)
        if req is None:
            return
        for child in req.siblings:
            if not child.finished:
                self.scheduler.finish(child, "abort")
                child.metrics.finished_time = time.monotonic()

    def release(self, request_ids: list[str]) -> None:
        """Forget finished requests once their outputs have been taken."""
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and req.all_finished:
                del self.requests[rid]
                for child in req.siblings:
                    if not child.num_pending:
                        self._forget(child)

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_work or bool(self._inflight)

    # ----- stepping -----

    def _next_step(self) -> tuple[Step | None, list[Request]]:
        """Schedule the next step; also return the requests it preempted."""
        out = self.scheduler.schedule()
        if not out.sequences:
            return None, list(out.preempted)
        step = Step(out.sequences, finished_request_ids=out.finished_request_ids, kv_store=self.kv.take_store_ops(),
                    installs=out.installs)
        step.grammar = self.structured.gate(step.sampled)
        return step, list(out.preempted)

    def _draft_tokens(self, s: ScheduledSequence) -> list[int]:
        """The drafts ``s`` verifies (the ledger's answer: its own, or a chained record's from its step in flight)."""
        return self.drafts.verifies(s, self._live[s.request_id])

    def _forget(self, req: Request) -> None:
        """Drop a completion the device will return nothing more for, and its matcher."""
        self._live.pop(req.request_id, None)
        self.structured.release(req.request_id)

    def step(self) -> list[Request]:
        """Advance by one step; return the requests (first completions) that gained tokens, finished or were preempted.

        With overlap scheduling the next step is scheduled and handed to the
        device before this step's tokens are read back, so a stop condition is
        seen one step late; the extra token it cost is discarded.
        """
        t0 = time.perf_counter()
        step, changed = self._next_step()
        self.stats.schedule_seconds += time.perf_counter() - t0
        if step is not None:
            if not self._inflight:
                self.structured.fill(step, self._draft_tokens)  # nothing pending: the masks can be written now
            self._inflight.append((step, self.executor.submit(step)))
        else:
            # nothing runs and the first waiting request still does not fit: it never will, unless states held for
            # a decode server (a prefill engine's) free their slots and blocks, when they are read or expire
            if not self._inflight and self.scheduler.waiting and not self.scheduler.running and not self.kv.held:
                req = self.scheduler.waiting[0]
                self._fail(req, f"the request needs {self.kv.blocks_for(req.num_tokens)} cache blocks but the cache has {self.kv.pool.num_blocks}; raise kv_cache_memory")
                changed.append(req)
            if self.sharding is not None:
                self.runner.execute_idle()  # the other ranks' tokens still reach this rank's experts
        keep = 1 if (self.overlap and step is not None) else 0
        applied: list[tuple[Step, StepResult]] = []
        while len(self._inflight) > keep:
            done, fut = self._inflight.popleft()
            t1 = time.perf_counter()
            result = fut.result()  # a failed install fails the engine, never a silent wrong state
            self.stats.idle_wait_seconds += time.perf_counter() - t1
            self.stats.forward_seconds += result.forward_seconds
            self.stats.graph_replays += int(result.graph)
            self.stats.draft_seconds += result.draft_seconds
            self.drafts.pass_made(list(result.drafts.values()))
            changed.extend(self._apply(done, result))
            applied.append((done, result))
            # the runner's own time for an eager step bounds its start-up profiles, which time eager forwards (a
            # step's wall can hide a forward that ran between two calls; a graph replay is another cost)
            self.runner.observe_step(0 if result.graph else done.num_tokens, result.forward_seconds - result.draft_seconds,
                                     len(result.drafts), result.draft_seconds)
            for pending, _ in self._inflight:
                self.structured.fill(pending, self._draft_tokens)  # the device waits for these before sampling
        if not self.has_unfinished:
            self._flush_store_ops()
        wall = time.perf_counter() - t0
        self.stats.wall_seconds += wall
        if self.speculation is not None and len(applied) == 1:  # one step's whole cycle, as the policy prices it
            done, result = applied[0]
            self.speculation.record_step(step_kind(done), result.graph, result.graph_tokens or done.num_tokens,
                                         wall - result.draft_seconds, len(result.drafts), result.draft_seconds)
        return list({id(r): r for r in (c.siblings[0] for c in changed)}.values())

    def _flush_store_ops(self) -> None:
        """The store work no next step will carry (nothing is left to run): applied by the runner now, so
        every committed block is with the store's writer when ``step`` returns."""
        ops = self.kv.take_store_ops()
        if not ops.empty:
            self.executor.call(self.runner.apply_kv_store, ops).result()

    def _apply(self, step: Step, result: StepResult) -> list[Request]:
        """Take a finished step's tokens into the requests: log-probabilities, stop conditions, cache commits.
        A fault while taking one request's tokens (detokenizing, its grammar, its stop strings) fails that
        request alone; the others go on."""
        changed: list[Request] = []
        for s in step.sequences:
            req = self._live.get(s.request_id)
            if req is None:
                continue
            try:
                if self._apply_one(s, req, result):
                    changed.append(req)
            except Exception as exc:  # noqa: BLE001 - this request's fault, not the engine's
                log.exception("processing the output of request %s failed", s.request_id)
                if not req.finished:
                    self._fail(req, f"internal error while processing the request's output: {first_line(exc)}", internal=True)
                changed.append(req)
            if s.sample is not None and req.finished and not req.num_pending and req.siblings[0].request_id not in self.requests:
                self._forget(req)
            if not req.finished:
                self.kv.commit(req)
        return changed

    def _apply_one(self, s: ScheduledSequence, req: Request, result: StepResult) -> bool:
        """One sequence's part of a finished step; whether it gained tokens or finished."""
        scored = result.prompt_logprobs.get(s.request_id)
        if scored is not None and not req.finished:
            first, rows = scored
            req.prompt_logprobs[first : first + len(rows)] = to_logprobs(rows, self._decode_one)
        if s.sample is None:
            return False
        req.num_pending -= 1
        new = result.tokens[s.request_id]
        if s.draft_token_ids:
            self.scheduler.settle(req, rejected_drafts(s, new))
        if req.finished:  # it stopped a step ago: this token was computed ahead and is dropped
            return False
        self.drafts.verified(req, s, new, result.verified.get(s.request_id, 0))
        for tok in new:
            if tok.logprobs is not None:
                req.logprobs.extend(to_logprobs([tok.logprobs], self._decode_one))
            self._append(req, tok.token_id)
            self.stats.generated_tokens += 1
            if req.finished:  # a stop inside the accepted drafts: what follows is dropped
                break
        if req.status is RequestStatus.RUNNING:
            self.drafts.drafted(req, result.drafts.get(s.request_id))
        return True

    def stats_line(self) -> str:
        live = self.speculation.live_figures() if self.speculation is not None else None
        return self.stats.line(live) + (store_line(self.store.stats.as_dict()) if self.store is not None else "")

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
        if not self.structured.accept(req.request_id, token):
            self._fail(req, f"token {token} was sampled outside the output grammar (a kernel ignored the bitmask)")
            return
        if self.structured.is_complete(req.request_id):
            reason = ("stop", None)
        elif not p.ignore_eos and token in self.eos_token_ids:
            reason = ("stop", None)
        elif token in p.stop_token_ids:
            reason = ("stop", token)
        else:
            delta = req.detokenizer.push(token)
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

    def _fail(self, req: Request, message: str, internal: bool = False) -> None:
        self.scheduler.finish(req, "abort")
        req.error, req.internal_error = message, internal
        req.metrics.finished_time = time.monotonic()

    # ----- outputs -----

    def output(self, req: Request, prompt_ids: bool = True) -> RequestOutput:
        """A snapshot of the output so far of ``req``'s prompt: one completion per sibling. ``prompt_ids``
        False leaves its ``prompt_token_ids`` empty, sparing a copy of the whole prompt (a streaming server
        sends them once, with the request's last output)."""
        completions = [
            CompletionOutput(
                index=r.index,
                text=r.output_text,
                token_ids=r.output_token_ids.tolist(),
                logprobs=list(r.logprobs) if r.params.logprobs is not None else None,
                finish_reason=r.finish_reason,
                stop_reason=r.stop_reason,
            )
            for r in req.siblings
        ]
        first = req.siblings[0]
        errors = [r.error for r in req.siblings if r.error]
        return RequestOutput(
            request_id=first.request_id,
            prompt=first.prompt,
            prompt_token_ids=first.prompt_token_ids.tolist() if prompt_ids else [],
            prompt_logprobs=self._prompt_logprobs(first),
            outputs=completions,
            finished=req.all_finished,
            metrics=first.metrics,
            error=errors[0] if errors else None,
            num_cached_tokens=first.num_cached_tokens,
            internal_error=any(r.internal_error for r in req.siblings),
        )

    def delta(self, req: Request, sent: SentSoFar) -> OutputDelta:
        """What ``req``'s prompt gained since ``sent`` (advanced past it), cut straight from its completions: the
        new token ids, text and log-probabilities only, the prompt's ids and timings with the finishing delta."""
        first = req.siblings[0]
        completions = [
            sent.cut(k, r.index, r.output_text, r.output_token_ids, r.logprobs if r.params.logprobs is not None else None,
                     r.finish_reason, r.stop_reason)
            for k, r in enumerate(req.siblings)
        ]
        error = next((r.error for r in req.siblings if r.error), None)
        delta = OutputDelta(first.request_id, completions, req.all_finished, error, first.num_cached_tokens,
                            server_error=any(r.internal_error for r in req.siblings))
        if delta.finished:
            delta.add_finish(first.prompt_token_ids.tolist(), self._prompt_logprobs(first), first.metrics)
        return delta

    @staticmethod
    def _prompt_logprobs(first: Request) -> list | None:
        return list(first.prompt_logprobs) if first.params.prompt_logprobs is not None and first.prompt_logprobs else None
