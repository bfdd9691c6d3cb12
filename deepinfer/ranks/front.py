"""The engine as ``LLM`` sees it when the experts are spread over ranks.

``ExpertParallelEngine`` is an ``EngineClient``, as ``Engine`` is. It gives
each request to the rank with the fewest outstanding tokens, and turns the
ranks' reports into request snapshots. Spawned ranks are watched: when one dies or the group stops
answering, every rank is stopped and ``RankFailure`` names the rank and what
happened.
"""

from __future__ import annotations

import itertools
import signal
import time
from dataclasses import dataclass
from typing import Any, Mapping

from ..config import EngineConfig
from ..engine import resolve_model_dir
from ..errors import ConfigError, RankFailure
from ..expert_parallel.placement import ExpertPlacement
from ..kv_store import store_line
from ..kv_transfer.sequence_state import PrefilledRequest
from ..loader import load_tokenizer, read_config
from ..models.common.config import ModelConfig
from ..output_deltas import OutputDelta, SentSoFar, delta_of_output
from ..outputs import RequestOutput
from ..registry import select_backend
from ..sampling_params import InvalidRequestError, SamplingParams
from ..stats import EngineLoad, spec_line
from .launch import SpawnedGroup, spawn_ranks
from .merged_metrics import ep_line, merge_metrics
from .protocol import Abort, AddRequest, Command, FlushCache, Metrics, PackedState, RankReport, Shutdown, Tick
from .rank_server import RankServer
from ..models.registry import parse_config

#: signals that stop a process from outside (a kill, not a crash)
_KILL_SIGNALS = (signal.SIGKILL, signal.SIGTERM, signal.SIGINT)
#: seconds the front waits for spawned ranks to load the model and meet
START_TIMEOUT_S = 600.0


@dataclass
class RemoteRequest:
    """The front's view of a request running on a rank: its latest snapshot."""

    request_id: str
    rank: int
    latest: RequestOutput | None = None
    all_finished: bool = False
    #: prefill role: its rank exports its state when it finishes
    hold_kv: bool = False


def check_ep(config: EngineConfig, model_config: ModelConfig, devices: int | None) -> None:
    """Refuse an EP degree the model or the machine cannot take, with the numbers."""
    ep = config.expert_parallel_size
    if devices is not None and ep > devices:
        raise ConfigError(f"--ep {ep} needs {ep} devices but {devices} are visible; lower --ep or make more devices visible")
    try:
        ExpertPlacement.identity(model_config.n_routed_experts, ep, config.num_redundant_experts)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class ExpertParallelEngine:
    """The front of an expert-parallel group (an ``EngineClient``): spawned ranks (``server`` None) or, under
    torchrun, rank 0 itself."""

    def __init__(self, config: EngineConfig, server: RankServer | None = None) -> None:
        self.config = config
        model_dir = resolve_model_dir(config.model)
        self.model_config = parse_config(read_config(model_dir))
        self.tokenizer = load_tokenizer(model_dir)
        self.world = config.expert_parallel_size if server is None else server.world
        self.requests: dict[str, RemoteRequest] = {}
        self._ids = itertools.count()
        self._outstanding = [0] * self.world
        self._loads = [EngineLoad() for _ in range(self.world)]
        #: the longest context every rank serves (known from the ranks' first reports)
        self.max_model_len = self.model_config.max_position_embeddings
        self._queued: list[Command] = []
        #: prefill role: states the ranks exported, until ``release_prefilled``
        self._exported: dict[str, PackedState] = {}
        self._metrics: list[dict[str, Any]] | None = None
        self._server = server
        self._group: SpawnedGroup | None = None
        self._closed = False
        self._failed: str | None = None
        if server is None:
            device = select_backend(config.backend, config.kernels, config.interpret).device
            check_ep(config, self.model_config, None if device.type == "cpu" else device.device_count())
            self._group = spawn_ranks(config, self.world, START_TIMEOUT_S)
            _, reports = self._receive(START_TIMEOUT_S, starting=True)
            self._take(reports)

    @property
    def backend_name(self) -> str:
        """The backend the configuration names (the ranks resolve it)."""
        return self.config.backend

    @property
    def rank_pids(self) -> list[int]:
        """Process ids of the spawned ranks (empty under torchrun)."""
        return [p.pid for p in self._group.processes] if self._group is not None else []

    @property
    def log_dir(self):
        """Where the spawned ranks' own output goes (None under torchrun)."""
        return self._group.log_dir if self._group is not None else None

    # ----- requests -----

    def add_request(
        self, prompt: str | list[int] | Mapping[str, Any], params: SamplingParams | Mapping[str, Any] | None = None,
        request_id: str | None = None,
        *, hold_kv: bool = False, prefilled: PrefilledRequest | None = None,
    ) -> RemoteRequest:
        """Queue a prompt on the rank with the fewest outstanding tokens (``hold_kv`` and ``prefilled`` as for
        ``Engine.add_request``: the rank keeps or installs the prompt's state)."""
        rid = request_id or str(next(self._ids))
        rank = min(range(self.world), key=lambda r: (self._outstanding[r], r))
        self._outstanding[rank] += self._cost(prompt, params, prefilled is not None)
        req = self.requests[rid] = RemoteRequest(rid, rank, hold_kv=hold_kv)
        self._queue(AddRequest(rank, rid, prompt, params, hold_kv, PackedState.pack(prefilled) if prefilled is not None else None))
        return req

    def export_prefilled(self, request_id: str) -> PrefilledRequest:
        """The state of a finished ``hold_kv`` request, as its rank exported it with its last report."""
        packed = self._exported.get(request_id)
        if packed is None:
            raise InvalidRequestError(f"request {request_id!r} holds no cache to export (unknown, running, or already released)")
        return packed.unpack()

    def release_prefilled(self, request_id: str) -> None:
        """Forget an exported state (its rank freed the cache when it exported it)."""
        self._exported.pop(request_id, None)

    def _queue(self, command: Command) -> None:
        """Hand spawned ranks a command at once (rank 0 takes it at its next tick); under torchrun it waits for ours."""
        self._check()
        self._queued.append(command)
        if self._group is not None:
            commands, self._queued = self._queued, []
            self._group.send(commands)

    def _cost(self, prompt: str | list[int] | Mapping[str, Any], params: SamplingParams | Mapping[str, Any] | None,
              prefilled: bool = False) -> int:
        """Tokens the request will cost its rank: its prompt (none when prefilled elsewhere; its images' spans
        not counted) and its outputs."""
        if isinstance(prompt, Mapping):
            prompt = prompt.get("prompt", prompt.get("prompt_token_ids"))
        n_prompt = len(self.tokenizer.encode(prompt).ids) if isinstance(prompt, str) else len(prompt) if isinstance(prompt, (list, tuple)) else 0
        n_prompt = 0 if prefilled else n_prompt
        if isinstance(params, SamplingParams):
            return n_prompt + params.max_tokens * params.n
        p = dict(params or {})
        return n_prompt + int(p.get("max_tokens", SamplingParams().max_tokens)) * int(p.get("n", 1))

    def _check(self) -> None:
        if self._failed is not None:
            raise RankFailure(self._failed)
        if self._closed:
            raise RankFailure("the expert-parallel engine was closed; create a new LLM")

    def abort(self, request_id: str) -> None:
        req = self.requests.get(request_id)
        if req is not None and not req.all_finished and not self._closed:
            self._queue(Abort(req.rank, request_id))

    def release(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            req = self.requests.get(rid)
            if req is not None and req.all_finished:
                del self.requests[rid]

    def output(self, req: RemoteRequest, prompt_ids: bool = True) -> RequestOutput:
        """The latest snapshot its rank reported (with the prompt's ids whatever ``prompt_ids``)."""
        if req.latest is None:
            return RequestOutput(req.request_id, None, [], None, [], False)  # not yet reported by its rank
        return req.latest

    def delta(self, req: RemoteRequest, sent: SentSoFar) -> OutputDelta:
        """What its rank's latest snapshot adds to ``sent`` (the ranks report snapshots)."""
        return delta_of_output(self.output(req), sent)

    @property
    def has_unfinished(self) -> bool:
        return any(not r.all_finished for r in self.requests.values())

    # ----- stepping -----

    def step(self) -> list[RemoteRequest]:
        """Wait for the ranks' next news; return the requests it changed (none, at once, when nothing is running
        or queued: idle rank processes send no news)."""
        if self._server is None and not self._queued and not self.has_unfinished:
            return []
        while True:
            _, reports = self._exchange()
            changed = self._take(reports)
            if changed or not self.has_unfinished:
                return changed

    def _exchange(self) -> tuple[str, list[RankReport]]:
        self._check()
        commands, self._queued = self._queued, []
        if self._server is not None:
            try:
                return "reports", self._server.tick(Tick(commands))
            except RankFailure as exc:  # a rank across machines was lost (torchrun): this rank stops, the others alike
                self._failed, self._closed = str(exc), True
                self._server.engine.close()
                raise
        if commands:
            self._group.send(commands)
        return self._receive(self.config.ep_timeout_s * 2)

    def _take(self, reports: list[RankReport]) -> list[RemoteRequest]:
        changed: dict[str, RemoteRequest] = {}
        for report in reports:
            self._outstanding[report.rank] = report.outstanding_tokens
            self._loads[report.rank] = report.load
            self._exported.update(report.exported)
            if report.max_model_len:
                self.max_model_len = min(self.max_model_len, report.max_model_len)
            for out in report.outputs:
                req = self.requests.get(out.request_id)
                if req is None:
                    continue
                req.latest = out
                req.all_finished = out.request_id in report.finished
                changed[out.request_id] = req
            if report.metrics is not None:
                self._metrics = self._metrics or [None] * self.world  # type: ignore[list-item]
                self._metrics[report.rank] = report.metrics
        return list(changed.values())

    def _receive(self, timeout_s: float, starting: bool = False) -> tuple[str, list[RankReport]]:
        """The next message from rank 0, watching every rank meanwhile."""
        group = self._group
        deadline = time.monotonic() + timeout_s
        rank0_error = None
        while True:
            try:
                if rank0_error is None and group.conn.poll(0.2):
                    kind, payload = group.conn.recv()
                    if kind != "error":
                        return kind, payload
                    rank0_error = payload
            except (EOFError, OSError):
                time.sleep(0.2)
            problem = self._failure(starting, [(0, rank0_error)] if rank0_error else [])
            if problem is None and time.monotonic() > deadline:
                problem = f"the ranks sent nothing for {timeout_s:.0f} s (a rank hangs); stopped every rank"
            if problem is not None:
                self._abandon()
                self._failed = problem
                raise RankFailure(problem)

    def _failure(self, starting: bool, errors: list[tuple[int, str]]) -> str | None:
        """One line on the first rank that failed, or None while every rank is alive and well."""
        group = self._group
        errors = errors + group.failures()
        dead = [(r, p.poll()) for r, p in enumerate(group.processes) if p.poll() is not None]
        if not errors and not dead:
            return None
        time.sleep(0.5)  # let the other ranks' reports of the same failure arrive
        errors += group.failures()
        dead = [(r, p.poll()) for r, p in enumerate(group.processes) if p.poll() is not None]
        stop = "stopped every rank (restart the engine)"
        killed = [(r, -code) for r, code in dead if code is not None and -code in _KILL_SIGNALS]
        if killed:
            r, sig = killed[0]
            return f"rank {r} of {self.world} was killed by signal {sig}; {stop}"

        def echo(line: str) -> bool:  # another rank's failure seen from here: a lost peer or a timed-out collective
            return any(w in line.lower() for w in ("timed out", "timeout", "connection", "peer"))

        own = sorted((r, line) for r, line in errors if not echo(line))
        if own:
            r, line = own[0]
            return f"rank {r} of {self.world} {'failed while starting' if starting else 'failed'}: {line}; {stop}"
        silent = [r for r in range(self.world) if r not in {e[0] for e in errors} | {d[0] for d in dead}]
        if silent:
            return (
                f"rank {silent[0]} of {self.world} stopped answering (the others waited {self.config.ep_timeout_s:.0f} s "
                f"for it in a collective); {stop}"
            )
        r, code = dead[0] if dead else (errors[0][0], None)
        if code is not None and code < 0:
            return f"rank {r} of {self.world} crashed with signal {-code}; {stop}"
        return f"rank {r} of {self.world} exited with status {code}: {errors[0][1] if errors else 'no error reported'}; {stop}"

    def _abandon(self) -> None:
        self._closed = True
        for p in self._group.processes:
            if p.poll() is None:
                p.kill()
        self._group.stop(timeout_s=5.0)

    # ----- load, health, metrics and shutdown -----

    def load(self) -> EngineLoad:
        """Every rank's requests and cache occupancy, summed, as of the last tick."""
        return sum(self._loads, EngineLoad())

    def health(self) -> str | None:
        """None while every rank is alive; else the one-line failure (every rank is then stopped)."""
        if self._failed is not None or self._group is None or self._closed:
            return self._failed
        problem = self._failure(False, [])
        if problem is not None:
            self._abandon()
            self._failed = problem
        return problem

    def reset_prefix_cache(self) -> None:
        """Every rank forgets the cached prefixes nobody uses (at the next tick)."""
        self._queue(FlushCache())

    def get_metrics(self) -> dict[str, Any]:
        """Every rank's counters, merged (one tick; the balance figures are refreshed across ranks)."""
        self._metrics = None
        self._queue(Metrics())
        while self._metrics is None or any(m is None for m in self._metrics):
            self._take(self._exchange()[1])
        return merge_metrics(self._metrics)

    def stats_line(self) -> str:
        m = self.get_metrics()
        return (
            f"steps {m['steps']}, computed tokens {m['computed_tokens']} (prefill {m['prefill_tokens']}), generated "
            f"{m['generated_tokens']} ({m.get('generated_tokens_per_second', 0.0):.1f} tok/s), preemptions {m['preemptions']}"
            + spec_line(m) + ep_line(m) + store_line(m)
        )

    def close(self) -> None:
        """Stop every rank."""
        if self._closed:
            return
        self._closed = True
        if self._server is not None:
            self._server.tick(Tick([Shutdown()]))
            self._server.close()
            return
        try:
            self._group.send([Shutdown()])
        except (OSError, ValueError):
            pass
        self._group.stop()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass
