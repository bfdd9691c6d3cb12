"""One rank's model, cache, sampler and decode graphs on the selected backend's device.

The runner turns a ``Step`` (one record per scheduled sequence) into the
device batch in one place: it installs the records' block tables, computes
every index on the host, copies them in one transfer, runs the forward
(replaying a captured graph for decode steps it fits) and samples. Tokens the
host has not seen yet are filled on the device from the previous step's
samples, which the runner keeps. It touches the hardware only through the
backend's ``Device`` and ``Kernels``; all per-rank state lives on the instance.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import time
from concurrent.futures import Future
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .config import EngineConfig
from .decode_graphs import DecodeGraph, DecodeGraphs, default_capture_sizes
from .deterministic import enable_batch_invariance
from .encoder_cache import EncoderCache
from .errors import ConfigError
from .expert_parallel.lockstep import StepDispatch, StepKind
from .expert_parallel.sharding import ExpertParallel
from .kv_store import KVStore, KVStoreOps
from .kv_transfer.sequence_state import SequenceState, plan_sequence, read_sequence, write_sequence
from .models.common.batch import Batch
from .models.common.cache import ModelCache
from .models.common.cache_spec import CacheGeometry, block_size_for
from .models.common.inputs import ForwardInputs, StepLayout, StepShape, fill_step_inputs
from .registry import SelectedBackend
from .models.common.dspark import DSparkConfig, DSparkDraft, DSparkRing
from .sampler import Sampler, top_logprobs
from .spec_decode import DSparkProposer, StepCostProfile, verify_drafts
from .spec_decode.inflight import StepOutcomes, verified_counts
from .stats import EngineStats
from .step import SampledToken, ScheduledSequence, Step, StepResult
from .models.registry import load_model
from .profile_cache import OnlineBound, ProfileCache, model_fingerprint
from .version import package_version

log = logging.getLogger("deepinfer")

#: runs timed per point of the start-up cost profiles (the fastest counts)
PROFILE_RUNS = 4
#: start-up cost profiles by everything that shapes them, in this process and across processes: an engine built
#: again on the same model, backend, dtype and slots (as servers, tests and benchmarks are) reuses the first one's prior
_PROFILES = ProfileCache()

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16, "float64": torch.float64}


@dataclass
class CachePlan:
    """How the KV budget was split, reported at start-up."""

    block_size: int
    num_blocks: int
    num_slots: int
    bytes_per_block: int
    bytes_per_slot: int
    #: bytes the pools and the draft's context rings take (at most the configured budget)
    budget: int
    #: longest sequence one slot holds
    max_model_len: int
    #: bytes of the DSpark draft's context ring per slot (0: no speculation)
    draft_bytes_per_slot: int = 0
    #: the ``kv_cache_dtype`` asked for, and how rows are stored (``CacheFormats.describe()``)
    kv_cache_dtype: str = "model"
    kv_cache: str = ""
    #: compressed-state bytes one more token of context costs (``CacheGeometry.bytes_per_token``)
    bytes_per_token: float = 0.0

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.block_size

    @property
    def tokens_per_sequence(self) -> int:
        """The longest context one sequence can reach: ``max_model_len``, or the blocks' tokens when fewer."""
        return min(self.max_model_len, self.token_capacity)

    @property
    def full_length_sequences(self) -> int:
        """How many sequences at ``tokens_per_sequence`` the blocks hold at once."""
        return min(self.num_slots, self.token_capacity // max(self.tokens_per_sequence, 1))

    def describe(self) -> str:
        mib = 1 << 20
        draft = f" (the draft's context rings {self.num_slots * self.draft_bytes_per_slot / mib:.1f} MiB of it)" if self.draft_bytes_per_slot else ""
        return (
            f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens ({self.token_capacity} tokens of compressed state) "
            f"+ {self.num_slots} sequence slots, {self.budget / mib:.1f} MiB{draft}; up to {self.tokens_per_sequence} tokens per "
            f"sequence (max_model_len {self.max_model_len}), {self.full_length_sequences} at that length at once; "
            f"kv_cache_dtype {self.kv_cache_dtype}: {self.kv_cache}; {self.bytes_per_token:,.1f} B of compressed state per token"
        )


def plan_cache(
    geometry: CacheGeometry, budget: int, slots: int, max_model_len: int, dtype: torch.dtype, draft_per_slot: int = 0,
    kv_cache_dtype: str = "model",
) -> CachePlan:
    """Split ``budget`` bytes into ``slots`` sequence slots and as many token blocks as they can use
    (``draft_per_slot``: what each slot's DSpark context ring takes besides the pools; ``kv_cache_dtype``: what was
    asked for, reported beside the formats it resolved to)."""
    per_block = geometry.bytes_per_block(dtype)
    per_slot = geometry.bytes_per_slot(dtype) + draft_per_slot
    need_blocks = geometry.blocks_for(max_model_len)
    remaining = budget - slots * per_slot
    # more blocks than every slot at max_model_len can use would only hold cold prefixes
    ceiling = slots * need_blocks
    num_blocks = min(remaining // per_block, ceiling) if per_block else ceiling
    if remaining < 0 or num_blocks < need_blocks:
        need = slots * per_slot + need_blocks * per_block
        raise ConfigError(
            f"kv_cache_memory of {budget} bytes cannot hold one sequence of max_model_len {max_model_len}: "
            f"{slots} sequence slots take {slots * per_slot} bytes and {need_blocks} blocks take {need_blocks * per_block} "
            f"(at least {need} bytes needed); raise kv_cache_memory or lower max_model_len / max_num_seqs"
        )
    used = geometry.pool_bytes(slots, int(num_blocks), dtype) + slots * draft_per_slot
    return CachePlan(geometry.block_size, int(num_blocks), slots, per_block, per_slot - draft_per_slot, used, max_model_len, draft_per_slot,
                     kv_cache_dtype, geometry.formats.describe(), geometry.bytes_per_token(dtype))


class ModelRunner:
    def __init__(
        self,
        selected: SelectedBackend,
        model_dir: str | Path,
        cfg: EngineConfig,
        stats: EngineStats | None = None,
        sharding: ExpertParallel | None = None,
    ) -> None:
        """``sharding``: this rank's expert parallelism (the model then holds only its experts and every
        step, even an empty one, joins the other ranks' dispatch and combine)."""
        self.sharding = sharding
        self.selected = selected
        self.model_dir = Path(model_dir).resolve()
        self.quantization = cfg.quantization
        self.device = selected.device
        self.kernels = selected.kernels
        if cfg.deterministic:
            enable_batch_invariance(selected)
        self.torch_device = self.device.torch_device
        self.dtype = self._dtype(cfg.dtype)
        self.stats = stats if stats is not None else EngineStats()
        self.device.manual_seed(cfg.seed)
        started = time.perf_counter()
        self.model = load_model(
            model_dir, self.kernels, dtype=self.dtype, device=self.torch_device, quantization=cfg.quantization, sharding=sharding
        )
        log.info(f"weights: loaded onto {self.torch_device} in {time.perf_counter() - started:.1f} s ({cfg.quantization} quantization)")
        placed = self.model.place_tables(self.device, cfg.engram_tables)
        if placed is not None:
            log.info(placed)
        if sharding is not None:
            sharding.moe_layers = [layer.ffn for layer in self.model.layers]
        self.config = self.model.config
        self.max_model_len = cfg.max_model_len or min(self.config.max_position_embeddings, 32768)
        if self.max_model_len > self.config.max_position_embeddings:
            raise ConfigError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings {self.config.max_position_embeddings}; lower it"
            )
        self.max_step_tokens = min(cfg.max_num_batched_tokens, cfg.max_prefill_chunk)
        self.max_batched_tokens = cfg.max_num_batched_tokens
        self._profile: StepCostProfile | None = None
        self._draft_profile: StepCostProfile | None = None
        #: the profiles checked against the steps and draft passes the engine runs (set once each is known)
        self._step_bound: OnlineBound | None = None
        self._draft_bound: OnlineBound | None = None
        self.geometry = CacheGeometry.build(
            self.config, block_size_for(self.config, cfg.block_size), self.max_step_tokens, self.max_model_len, cfg.kv_cache_dtype
        )
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
        else:
            free, _ = self.device.memory_info()
            budget = int(free * cfg.kv_cache_memory_fraction)
        draft = self._draft(cfg, model_dir)
        if draft is not None:  # the draft's context ring reads a window of the prompt's last hidden states
            self.geometry = self.geometry.with_prefill_margin(self.config.sliding_window)
        # the tail-only prefill moves tokens between layers on one rank; expert parallelism routes every row
        self.prefill_fast_path = cfg.prefill_fast_path and sharding is None
        # the draft copied the stored mtp.* tensors into its own parameters (or speculation is off): drop them
        self.model.extra_tensors = {k: v for k, v in self.model.extra_tensors.items() if not k.startswith("mtp.")}
        ring = DSparkRing.bytes_per_slot(draft) if draft is not None else 0
        self.plan = plan_cache(self.geometry, budget, cfg.max_num_seqs, self.max_model_len, self.dtype, ring, cfg.kv_cache_dtype)
        self.cache = ModelCache(
            self.geometry, self.plan.num_slots, self.plan.num_blocks, self.geometry.blocks_for(self.max_model_len),
            self.dtype, self.torch_device,
        )
        log.info(self.plan.describe())
        #: the KV store over this cache (the engine opens it): the writer the blocks steps save go to
        self.store: KVStore | None = None
        self.sampler = Sampler(self.kernels, self.device, cfg.seed)
        self.proposer = DSparkProposer(draft, self.plan.num_slots) if draft is not None else None
        #: per layer the draft reads (none without speculation), what each forward keeps of its hidden states
        self.hidden_layers: tuple[int, ...] = self.proposer.target_layers if self.proposer is not None else ()
        self._staging_tensor: torch.Tensor | None = None
        #: recorded after each step's host-to-device copy: host buffers are rewritten only once it has passed
        self._copied = self.device.new_event()
        #: the previous step's sampled tokens on the device, and each request's index among them
        self._last_tokens: torch.Tensor | None = None
        self._last_index: dict[str, int] = {}
        #: what the previous step left each sampled request: chained records are resolved from it
        self._outcomes = StepOutcomes()
        #: the last forward's hidden states at ``hidden_layers``
        self._hidden: dict[int, torch.Tensor] = {}
        #: the span rows of the images prompts in flight still need, by digest
        self.images = EncoderCache()
        self.graphs: DecodeGraphs | None = None
        if self._graph_mode(cfg):
            sizes = cfg.graph_capture_sizes or default_capture_sizes(cfg.max_num_seqs)
            self.graphs = DecodeGraphs(
                self.model, self.cache, self.device, sizes, self.max_model_len,
                self.sharding.use_capacity if self.sharding is not None else None, self.hidden_layers,
                self.proposer.gamma if self.proposer is not None else 0,
            )
            if self.sharding is not None:
                self.sharding.use_graphs(self.graphs.sizes, self.graphs.drafts)
            report = self.graphs.capture(_progress_line if sys.stderr.isatty() and log.isEnabledFor(logging.INFO) else None)
            self.stats.graphs_captured = report.graphs
            self.stats.graph_capture_seconds = report.seconds
            self.stats.graph_capture_bytes = report.bytes
            log.info(
                f"captured {report.graphs} decode graphs ({len(self.graphs.sizes)} batch sizes up to {self.graphs.sizes[-1]} x "
                f"{len(self.graphs.buckets)} context buckets up to {self.graphs.buckets[-1]}) in {report.seconds:.1f} s, "
                f"{report.bytes / (1 << 20):.1f} MiB"
            )

    def _dtype(self, name: str) -> torch.dtype:
        if name == "auto":
            # exact fp32 on the host; bf16 where the accelerator has fast bf16 matmuls
            return torch.float32 if self.device.type == "cpu" else torch.bfloat16
        dtype = _DTYPES[name]
        if dtype not in self.device.capabilities().dtypes:
            raise ConfigError(f"dtype {name} is not supported by device {self.device.type}; choose another --dtype")
        return dtype

    @torch.inference_mode()
    def step_cost_profile(self) -> StepCostProfile:
        """Seconds a forward takes at token counts from 1 to the most a speculative step brings
        (every sequence slot verifying every draft), over padding only: the adaptive policy's profile.
        Measured once per runner, on this rank in lockstep with the others under expert parallelism."""
        if self._profile is not None:
            return self._profile
        gamma = self.proposer.gamma if self.proposer is not None else 0
        top = max(1, min(self.max_batched_tokens, self.plan.num_slots * (gamma + 1)))
        counts = sorted({*(1 << i for i in range(top.bit_length()) if 1 << i <= top), top})
        key = self._profile_key("step", counts)
        cached = _PROFILES.get(key) if key is not None else None
        if cached is not None:
            self._profile = cached
            self._step_bound = OnlineBound("step-cost profile", cached, key, _PROFILES)
            return cached
        empty = Batch((), (), (), ())
        times: list[float] = []
        counters = dataclasses.replace(self.sharding.counters) if self.sharding is not None else None
        for tokens in counts:
            context = min(self.max_model_len, 1024)  # a typical context: attention reads padding entries up to it
            layout = StepLayout(StepShape.padded(tokens, min(tokens, self.plan.num_slots), tokens, context, self.geometry), self.geometry)
            host = self.device.host_buffer(layout.numel, torch.int64)
            fill_step_inputs(host.numpy(), layout, empty, self.cache)
            inputs = layout.forward_inputs(host.to(self.torch_device, copy=True))
            if self.sharding is not None:
                self.sharding.use_capacity(tokens)
            best = float("inf")
            for _ in range(PROFILE_RUNS):  # the first run warms up; the fastest is the device's cost
                self.device.synchronize()
                t0 = time.perf_counter()
                self.model.forward(inputs, self.cache, self.hidden_layers)
                self.device.synchronize()
                best = min(best, time.perf_counter() - t0)
            times.append(max(best, 1e-9))
        if self.sharding is not None:
            self.sharding.counters = counters  # the profile's dispatches are not serving traffic
        self._profile = StepCostProfile.monotone(counts, times)
        self._step_bound = OnlineBound("step-cost profile", self._profile, key, _PROFILES)
        if key is not None:
            _PROFILES.put(key, self._profile)
        log.info("step-cost profile: " + ", ".join(f"{t} tokens {1e3 * s:.2f} ms" for t, s in zip(counts, self._profile.seconds)))
        return self._profile

    @torch.inference_mode()
    def draft_cost_profile(self) -> StepCostProfile:
        """Seconds a draft pass takes for 1 up to every sequence slot drafting (anchors over empty context
        rings): the prior of the adaptive policy's draft cost. Measured once per runner."""
        if self._draft_profile is not None:
            return self._draft_profile
        draft, ring = self.proposer.draft, self.proposer.ring
        top = self.plan.num_slots
        counts = sorted({*(1 << i for i in range(top.bit_length()) if 1 << i <= top), top})
        key = self._profile_key("draft", counts)
        cached = _PROFILES.get(key) if key is not None else None
        if cached is not None:
            self._draft_profile = cached
            self._draft_bound = OnlineBound("draft-cost profile", cached, key, _PROFILES)
            return cached
        times: list[float] = []
        for n in counts:
            ids = torch.zeros(n, dtype=torch.int64, device=self.torch_device)
            pos = torch.full((n,), min(self.max_model_len, 1024) - draft.config.dspark_block_size, dtype=torch.int64, device=self.torch_device)
            rows = ring.rows(list(range(n)), pos)
            best = float("inf")
            for _ in range(PROFILE_RUNS):  # the first run warms up; the fastest is the device's cost
                self.device.synchronize()
                t0 = time.perf_counter()
                draft.draft(ids, pos, ring.kv, rows).tokens.tolist()
                best = min(best, time.perf_counter() - t0)
            times.append(max(best, 1e-9))
        self._draft_profile = StepCostProfile.monotone(counts, times)
        self._draft_bound = OnlineBound("draft-cost profile", self._draft_profile, key, _PROFILES)
        if key is not None:
            _PROFILES.put(key, self._draft_profile)
        log.info("draft-cost profile: " + ", ".join(f"{n} requests {1e3 * s:.2f} ms" for n, s in zip(counts, self._draft_profile.seconds)))
        return self._draft_profile

    def observe_step(self, tokens: int, seconds: float, drafters: int = 0, draft_seconds: float = 0.0) -> None:
        """A step the engine ran (``tokens`` computed eagerly in ``seconds``; 0: a graph replay, not compared;
        without its draft pass: ``drafters`` requests in ``draft_seconds``): the start-up profiles are checked
        against it, and lowered where they were timed too slow."""
        if self._step_bound is not None and (fixed := self._step_bound.observe(tokens, seconds)) is not None:
            self._profile = fixed
        if drafters and self._draft_bound is not None and (fixed := self._draft_bound.observe(drafters, draft_seconds)) is not None:
            self._draft_profile = fixed

    def _profile_key(self, kind: str, counts: list[int]) -> tuple | None:
        """What a start-up profile of ``kind`` at ``counts`` depends on; None under expert parallelism (every
        rank measures in lockstep, each in its own process)."""
        if self.sharding is not None:
            return None
        s = self.selected
        return (kind, tuple(counts), model_fingerprint(self.model_dir), s.name, s.kernels_name, s.kernels.batch_invariant, s.interpret,
                str(self.dtype), self.device.describe(), self.plan.num_slots, self.max_model_len, self.quantization, torch.get_num_threads(),
                package_version(), torch.__version__)

    def graph_shape(self, num_seqs: int, verify: bool) -> int | None:
        """The token count of the graph a decode (``verify``: verify) step of ``num_seqs`` sequences replays,
        or None when it runs eager."""
        return self.graphs.padded_tokens(num_seqs, verify) if self.graphs is not None else None

    def _draft(self, cfg: EngineConfig, model_dir: str | Path) -> DSparkDraft | None:
        """The DSpark draft when speculation is on: asked for (``dspark``), or the checkpoint has one (``auto``)."""
        if cfg.speculative_method is None:
            return None
        from .loader import read_config
        from .models.common.dspark import NO_DRAFT

        raw = read_config(model_dir)  # the whole file: a V4.1 draft's fields sit in its text_config
        if DSparkConfig.from_hf(raw, self.config) is None:
            if cfg.speculative_method == "dspark":
                raise ConfigError(
                    f"speculative_method 'dspark' needs a checkpoint with DSpark draft stages, but {NO_DRAFT}; "
                    "run with --speculative none"
                )
            return None
        return DSparkDraft.from_target(self.model, raw)

    def _graph_mode(self, cfg: EngineConfig) -> bool:
        caps = self.device.capabilities()
        if not caps.graph_capture:
            if cfg.enforce_eager is False:
                log.warning(f"device {self.device.type} has no graph capture; running eager")
            return False
        wanted = not cfg.enforce_eager if cfg.enforce_eager is not None else caps.graph_by_default
        blocker = self.model.graph_blocker()
        if wanted and blocker is not None:
            log.warning(f"decode graphs are off: {blocker}; running eager")
            return False
        return wanted

    # ----- one step -----

    @torch.inference_mode()
    def execute(self, step: Step) -> StepResult:
        """Run ``step`` and sample its sequences; steps must come in submission order."""
        t0 = time.perf_counter()
        self.apply_kv_store(step.kv_store)
        for install in step.installs:
            self.install_sequence(install.slot, install.block_ids, install.state)
        step = self._outcomes.resolve(step)
        for rid in step.finished_request_ids:
            self.images.forget(rid)
            if self.proposer is not None:
                self.proposer.forget(rid)
        for s in step.sequences:
            self.cache.set_sequence(s.slot, s.block_table, s.state_floor, s.shared_prefix_tokens)
            if self.proposer is not None and s.num_tokens and s.start == s.state_floor:
                self.proposer.clear(s.slot)  # its first chunk: no context from the slot's previous sequence
        batch, rows, placeholders = self._batch(step)
        images = self._image_inputs([s for s in step.sequences if s.num_tokens])
        # a step splicing image rows runs eager (a captured graph's inputs hold token ids alone)
        decode = images is None and all(s.is_decode for s in step.sequences if s.num_tokens)
        verify = images is None and all(s.decodes for s in step.sequences if s.num_tokens)
        agreed = (self.sharding.begin_step(batch.num_seqs, batch.num_tokens, StepKind.of(decode, verify))
                  if self.sharding is not None else None)
        graph = self._graph_for(decode, verify, batch, agreed)
        logits = self._forward(batch, placeholders, graph, images) if batch.num_seqs else None
        if self.sharding is not None:
            if not batch.num_seqs:
                self._join(agreed)
            self.sharding.end_step()
        for s in step.sequences:
            if s.fork is not None:
                self.cache.fork(s.fork.source_slot, s.slot, list(s.fork.block_copies))
        hidden = dict(self._hidden)
        prompt_lps = {}
        for s in step.sequences:
            if s.prompt_logprobs is not None:
                first = rows[s.request_id][0]
                targets = torch.tensor(s.prompt_logprobs.targets, dtype=torch.int64, device=self.torch_device)
                scored = top_logprobs(logits[first : first + len(targets)], s.prompt_logprobs.k, targets)
                prompt_lps[s.request_id] = (s.start + 1, scored)
        tokens, last = self._sample(step, logits, rows)
        drafts, draft_seconds = {}, 0.0
        if self.proposer is not None:
            self.proposer.observe_step(step, hidden, tokens)
            t1 = time.perf_counter()
            drafts = self.proposer.draft_step(step, tokens, last, self.sampler, self.config.max_position_embeddings)
            draft_seconds = time.perf_counter() - t1 if drafts else 0.0
        self._outcomes.record(step, tokens, drafts)
        return StepResult(tokens, prompt_lps, time.perf_counter() - t0, graph is not None,
                          graph.size * graph.tokens_per_seq if graph is not None else 0, drafts, draft_seconds, verified_counts(step))

    @torch.inference_mode()
    def read_sequence(self, slot: int, blocks: list[int], num_tokens: int) -> SequenceState:
        """The state of positions ``[0, num_tokens)`` of the sequence in ``slot`` (device thread)."""
        if self.proposer is not None:
            self.proposer.flush()
        return read_sequence(self.cache, self.proposer.ring if self.proposer is not None else None, slot, blocks, num_tokens)

    def plan_sequence(self, slot: int, blocks: list[int], num_tokens: int) -> SequenceState:
        """Where the state of positions ``[0, num_tokens)`` of ``slot`` lives in the pools, once the steps that
        wrote it are done (device thread): what another process reads straight from ``transfer_pools``."""
        if self.proposer is not None:
            self.proposer.flush()
        self.device.synchronize()
        return plan_sequence(self.cache, self.proposer.ring if self.proposer is not None else None, slot, blocks, num_tokens)

    def transfer_pools(self) -> list[torch.Tensor]:
        """Every tensor a sequence's state is read from: the cache pools and the draft's context rings."""
        ring = self.proposer.ring if self.proposer is not None else None
        return self.cache.pools() + ([ring.ctx, ring.kv] if ring is not None else [])

    @torch.inference_mode()
    def apply_kv_store(self, ops: KVStoreOps) -> None:
        """A step's store work, before its forward (device thread): the blocks committed since the previous
        step copied to the host and handed to the store's writer, then the stored blocks installed."""
        if ops.saves and self.store is not None:
            self.store.write([s.write for s in ops.saves], self._copy_blocks([s.block_id for s in ops.saves]))
        if ops.loads:
            self.cache.write_blocks([load.block_id for load in ops.loads], [load.data for load in ops.loads])

    def _copy_blocks(self, block_ids: list[int]) -> Future[list[list[torch.Tensor]]]:
        """Host copies of the blocks, as the store's writer takes them: a failed copy is its to drop, not the step's."""
        copies: Future[list[list[torch.Tensor]]] = Future()
        try:
            copies.set_result(self.cache.read_blocks(block_ids))
        except Exception as exc:
            copies.set_exception(exc)
        return copies

    @torch.inference_mode()
    def install_sequence(self, slot: int, blocks: list[int], state: SequenceState) -> None:
        """Install another engine's sequence state into ``slot`` and ``blocks`` (device thread, before its step)."""
        if self.proposer is not None:
            self.proposer.flush()
        write_sequence(self.cache, self.proposer.ring if self.proposer is not None else None, slot, blocks, state)

    @torch.inference_mode()
    def execute_idle(self) -> None:
        """A step with nothing to compute on this rank: under expert parallelism it still serves the
        other ranks' tokens routed to its experts, in every layer."""
        if self.sharding is not None:
            t0 = time.perf_counter()
            self._join(self.sharding.begin_step(0, 0, StepKind.DECODE))
            self.sharding.end_step()
            self.stats.forward_seconds += time.perf_counter() - t0

    def _join(self, agreed: StepDispatch) -> None:
        """This rank's part in a step's collectives when it brings no tokens: the agreed graph (decode or
        verify) replayed over padding only when there is one, else an eager pass over no rows."""
        graph = self.graphs.get(*agreed.graph, 0) if self.graphs is not None and agreed.graph is not None else None
        if graph is None:
            self.model.join_step()
            return
        self._copied.synchronize()
        graph.load(Batch((), (), (), ()), self.cache)
        self._copied.record()
        self.stats.graph_replays += 1
        self._replay(graph)

    def _replay(self, graph: DecodeGraph) -> tuple[torch.Tensor, torch.Tensor]:
        graph.replays += 1
        sizes = self.stats.graph_replays_by_size
        sizes[graph.key] = sizes.get(graph.key, 0) + 1
        return graph.replay()

    def _batch(self, step: Step) -> tuple[Batch, dict[str, list[int]], np.ndarray]:
        """The step's sequences that bring tokens as one batch; each one's logits rows; and for every
        token, its index among the previous step's samples when the host does not know it yet (else -1)."""
        compute = [s for s in step.sequences if s.num_tokens]
        rows: dict[str, list[int]] = {}
        logits_indices: list[int] = []
        placeholders: list[int] = []
        flat = 0
        for s in compute:
            rows[s.request_id] = list(range(len(logits_indices), len(logits_indices) + len(s.logit_offsets)))
            logits_indices.extend(flat + j for j in s.logit_offsets)
            placeholders.extend(self._last_index[s.request_id] if t < 0 else -1 for t in s.all_token_ids)
            flat += s.num_tokens
        batch = Batch(
            tuple(tuple(s.all_token_ids) for s in compute), tuple(s.slot for s in compute),
            tuple(s.start for s in compute), tuple(logits_indices), tuple(tuple(s.history_ids) for s in compute),
            tuple(s.prefill_end for s in compute) if self.prefill_fast_path else (),
        )
        return batch, rows, np.asarray(placeholders, dtype=np.int64)

    def _sample(
        self, step: Step, logits: torch.Tensor | None, rows: dict[str, list[int]]
    ) -> tuple[dict[str, list[SampledToken]], torch.Tensor | None]:
        """Each sampling sequence's new tokens with their log-probabilities: one drawn from its last logits
        row (a fork's from its source's), or its drafts verified. Also every sampling sequence's last new
        token, in record order, on the device (the next step's placeholders and the draft's anchors)."""
        sampled = step.sampled
        self._last_index = {s.request_id: i for i, s in enumerate(sampled)}
        if not sampled:
            self._last_tokens = None
            return {}, None
        plain = [i for i, s in enumerate(sampled) if not s.draft_token_ids]
        verify = [i for i, s in enumerate(sampled) if s.draft_token_ids]
        last = torch.empty(len(sampled), dtype=torch.int64, device=logits.device)
        out: dict[str, list[SampledToken]] = {}
        if plain:
            seqs = [sampled[i] for i in plain]
            tokens = self._draw(step, plain, seqs, logits, rows)
            last[torch.tensor(plain, device=last.device)] = tokens
            self._add_tokens(out, seqs, logits, [[rows[s.fork.source_id if s.fork else s.request_id][-1]] for s in seqs],
                             [[t] for t in tokens.tolist()])
        if verify:
            seqs = [sampled[i] for i in verify]
            accepted, tokens, picked_rows = self._verify(step, verify, seqs, logits, rows)
            last[torch.tensor(verify, device=last.device)] = tokens.gather(1, accepted[:, None])[:, 0]
            # one read-back: a row's emitted tokens are its entries >= 0 (the rest are -1)
            emitted = [[t for t in row if t >= 0] for row in tokens.tolist()]
            self._add_tokens(out, seqs, logits, [r[: len(e)] for r, e in zip(picked_rows, emitted)], emitted)
        self._last_tokens = last
        return out, last

    def _draw(
        self, step: Step, indices: list[int], seqs: list[ScheduledSequence], logits: torch.Tensor, rows: dict[str, list[int]]
    ) -> torch.Tensor:
        """One token per sequence (``indices``: their places among the step's sampled ones) from its last
        logits row, under the step's grammar masks."""
        picked = logits[torch.tensor([rows[s.fork.source_id if s.fork else s.request_id][-1] for s in seqs], device=logits.device)]
        bitmask = None
        masks = self._masks(step, {(index, 0): i for i, index in enumerate(indices)})
        if masks is not None:
            bitmask = (masks[0].to(picked.device), masks[1])
        return self.sampler.sample(picked, [s.sample for s in seqs], [s.start + len(s.token_ids) for s in seqs], bitmask)

    def _masks(self, step: Step, picked: dict[tuple[int, int], int]) -> tuple[torch.Tensor, list[int]] | None:
        """The grammar masks for ``picked`` ((sampled index, drafts before) -> row), once the host filled them."""
        if step.grammar is None:
            return None
        step.grammar.ready.wait()
        return step.grammar.rows_for(picked)

    def _verify(
        self, step: Step, indices: list[int], seqs: list[ScheduledSequence], logits: torch.Tensor, rows: dict[str, list[int]]
    ) -> tuple[torch.Tensor, torch.Tensor, list[list[int]]]:
        """Verify each sequence's drafts against the target's logits at their positions, under its grammar's
        mask at each: ``(accepted [N], tokens [N, K + 1], each sequence's logits rows)``."""
        k = max(len(s.draft_token_ids) for s in seqs)
        seq_rows = [rows[s.request_id] for s in seqs]  # the anchor's row, then one per draft
        index = torch.tensor([[r[min(j, len(r) - 1)] for j in range(k + 1)] for r in seq_rows], device=logits.device)
        picked = logits[index.reshape(-1)]
        masks = self._masks(step, {(index_i, j): n_i * (k + 1) + j for n_i, (index_i, s) in enumerate(zip(indices, seqs))
                                   for j in range(len(s.draft_token_ids) + 1)})
        if masks is not None:
            at = torch.tensor(masks[1], dtype=torch.int64, device=logits.device)
            picked[at] = self.kernels.apply_token_bitmask(picked[at], masks[0].to(logits.device))
        accepted, tokens = verify_drafts(self.kernels, self.sampler, self.proposer, seqs, picked.view(len(seqs), k + 1, -1))
        return accepted, tokens, seq_rows

    def _add_tokens(
        self, out: dict[str, list[SampledToken]], seqs: list[ScheduledSequence], logits: torch.Tensor,
        token_rows: list[list[int]], tokens: list[list[int]],
    ) -> None:
        """``out[request] = its new tokens`` (``tokens[i][j]``, read back, from logits row ``token_rows[i][j]``),
        each with the top log-probabilities its request asks for."""
        ks = [s.sample.logprobs for s in seqs if s.sample.logprobs is not None]
        flat = [t for ts in tokens for t in ts]
        lps = None
        if ks:
            dev = logits.device
            rows = torch.tensor([r for rs in token_rows for r in rs], device=dev)
            lps = top_logprobs(logits[rows], max(ks), torch.tensor(flat, dtype=torch.int64, device=dev))
        at = 0
        for s, ts in zip(seqs, tokens):
            new = []
            for j, tok in enumerate(ts):
                row = None
                if lps is not None and s.sample.logprobs is not None:
                    row = {t: v for t, v in lps[at + j].items() if v[1] <= s.sample.logprobs or t == tok}
                new.append(SampledToken(tok, row))
            out[s.request_id] = new
            at += len(ts)

    def _graph_for(self, decode: bool, verify: bool, batch: Batch, agreed: StepDispatch | None) -> DecodeGraph | None:
        """The graph this step replays: the smallest size holding the batch (a verify graph when sequences
        bring drafts); under expert parallelism exactly the agreed one (its dispatch layout: a decode batch
        replays the verify graph when another rank verifies), else none (eager with the agreed capacity)."""
        if self.graphs is None or not batch.num_seqs:
            return None
        if agreed is not None:
            return self.graphs.get(*agreed.graph, batch.max_context_len) if agreed.graph is not None else None
        if decode:
            return self.graphs.find(batch.num_seqs, batch.max_context_len)
        if verify:
            return self.graphs.find(batch.num_seqs, batch.max_context_len, batch.num_tokens)
        return None

    def _image_inputs(self, compute: list[ScheduledSequence]) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The step's image positions as batch rows ``[R]`` and the rows of their spans ``[R, D]`` (None: the step
        reaches into no image). Images not held yet are encoded first, all in one ``encode_images`` call; a
        request keeps holding an image until its chunk passes the span."""
        spans = [span for s in compute for span in s.images]
        if not spans:
            return None
        t0 = time.perf_counter()
        encoded = self.images.ensure(spans, self.model.encode_images)
        if encoded:
            self.stats.images_encoded += encoded
            self.stats.image_encoder_calls += 1
            self.stats.image_encode_seconds += time.perf_counter() - t0
        rows: list[np.ndarray] = []
        embeds: list[torch.Tensor] = []
        passed: list[tuple[str, bytes, bool]] = []
        flat = 0
        for s in compute:
            end = s.start + len(s.token_ids)
            for span in s.images:
                lo, hi = max(span.offset, s.start), min(span.end, end)
                rows.append(np.arange(flat + lo - s.start, flat + hi - s.start, dtype=np.int64))
                embeds.append(self.images.rows(span.digest)[lo - span.offset : hi - span.offset])
                passed.append((s.request_id, span.digest, end >= span.end))
            flat += s.num_tokens
        for request_id, digest, done in passed:  # after every slice is taken: a retired image may be dropped
            if done:
                self.images.release(request_id, digest)
            else:
                self.images.hold(request_id, digest)
        index = torch.from_numpy(np.concatenate(rows)).to(self.torch_device)
        return index, torch.cat(embeds).to(self.torch_device)

    def _forward(
        self, batch: Batch, placeholders: np.ndarray, graph: DecodeGraph | None,
        images: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """fp32 logits of the batch's logits rows: the step's indices in one copy, then a replay or an eager forward
        (``images``: the image rows to splice into its embeddings, eager only)."""
        self.cache.begin_forward(batch)
        self._copied.synchronize()
        if graph is not None:
            graph.load(batch, self.cache, placeholders)
            self._copied.record()
            self._fill_placeholders(graph.inputs, placeholders)
            logits, hidden = self._replay(graph)
            self._hidden = {layer: hidden[:, i] for i, layer in enumerate(self.hidden_layers)}
            return logits[: len(batch.logits_indices)].float()
        layout = StepLayout(StepShape.exact(batch, self.geometry), self.geometry)
        host_tensor = self._host_staging(layout.numel)
        fill_step_inputs(host_tensor.numpy(), layout, batch, self.cache, placeholders)
        inputs = layout.forward_inputs(host_tensor.to(self.torch_device, non_blocking=True))
        self._copied.record()
        self._fill_placeholders(inputs, placeholders)
        if images is not None:
            inputs.image_rows, inputs.image_embeds = images
        logits = self.model.forward(inputs, self.cache, self.hidden_layers).float()
        self._hidden = self.model.hidden_states
        return logits

    def _fill_placeholders(self, inputs: ForwardInputs, placeholders: np.ndarray) -> None:
        """Tokens sampled by the previous step, written into the input ids on the device."""
        if not (placeholders >= 0).any():
            return
        src = inputs.placeholder_src
        filled = torch.where(src >= 0, self._last_tokens[src.clamp(min=0)], inputs.input_ids)
        inputs.input_ids.copy_(filled)

    def _host_staging(self, numel: int) -> torch.Tensor:
        """A reused host buffer of at least ``numel`` int64, grown by doubling."""
        have = 0 if self._staging_tensor is None else self._staging_tensor.numel()
        if have < numel:
            self._staging_tensor = self.device.host_buffer(max(numel, 2 * have), torch.int64)
        return self._staging_tensor[:numel]


def _progress_line(done: int, total: int) -> None:
    sys.stderr.write(f"\rcapturing decode graphs: {done}/{total}")
    if done == total:
        sys.stderr.write("\n")
    sys.stderr.flush()
