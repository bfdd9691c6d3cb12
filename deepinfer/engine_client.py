"""What the callers of an engine use of it, whichever engine ``make_engine`` built.

``Engine`` (one process) and ``ExpertParallelEngine`` (the front of a group of
ranks) both provide every member here, with the same signatures; ``LLM``, the
CLI and the server's engine process use nothing else. Each engine hands out
its own request records; callers read them only through ``RequestHandle``
and give them back to the same engine's ``output``.
"""

from __future__ import annotations

from typing import Any, Mapping, Protocol, TypeVar

from tokenizers import Tokenizer

from .config import EngineConfig
from .kv_transfer.sequence_state import PrefilledRequest
from .models.common.config import ModelConfig
from .output_deltas import OutputDelta, SentSoFar
from .outputs import RequestOutput
from .sampling_params import SamplingParams
from .stats import EngineLoad


class RequestHandle(Protocol):
    """A request as an engine's caller sees it."""

    @property
    def request_id(self) -> str: ...

    @property
    def all_finished(self) -> bool:
        """Every completion of the prompt finished."""
        ...

    @property
    def hold_kv(self) -> bool:
        """Prefill role: its cache is kept for ``export_prefilled`` when it finishes."""
        ...


Handle = TypeVar("Handle", bound=RequestHandle)


class EngineClient(Protocol[Handle]):
    """An engine as its callers drive it: requests in, snapshots out, one step at a time."""

    @property
    def config(self) -> EngineConfig: ...

    @property
    def tokenizer(self) -> Tokenizer: ...

    @property
    def model_config(self) -> ModelConfig: ...

    @property
    def max_model_len(self) -> int:
        """The longest context (prompt and output) a request may reach."""
        ...

    @property
    def backend_name(self) -> str:
        """The backend the engine runs on, as the server reports it."""
        ...

    @property
    def requests(self) -> Mapping[str, Handle]:
        """The requests added and not yet released, by id."""
        ...

    @property
    def has_unfinished(self) -> bool: ...

    def add_request(
        self, prompt: str | list[int] | Mapping[str, Any], params: SamplingParams | Mapping[str, Any] | None = None,
        request_id: str | None = None,
        *, hold_kv: bool = False, prefilled: PrefilledRequest | None = None,
    ) -> Handle:
        """Queue one prompt; an invalid one comes back already finished with its error."""
        ...

    def step(self) -> list[Handle]:
        """Advance; the requests that gained tokens, finished or were preempted."""
        ...

    def output(self, req: Handle, prompt_ids: bool = True) -> RequestOutput:
        """A snapshot of the output so far of ``req``'s prompt (``prompt_ids`` False: it may leave the
        prompt's ids out)."""
        ...

    def delta(self, req: Handle, sent: SentSoFar) -> OutputDelta:
        """What ``req``'s prompt gained since ``sent`` (which it advances): new tokens, text, log-probabilities,
        the finish; the work is proportional to what is new."""
        ...

    def abort(self, request_id: str) -> None: ...

    def release(self, request_ids: list[str]) -> None:
        """Forget finished requests once their outputs have been taken."""
        ...

    def export_prefilled(self, request_id: str) -> PrefilledRequest:
        """The state of a finished ``hold_kv`` request."""
        ...

    def release_prefilled(self, request_id: str) -> None: ...

    def load(self) -> EngineLoad: ...

    def health(self) -> str | None:
        """None while the engine can step; else the one-line failure."""
        ...

    def reset_prefix_cache(self) -> int | None:
        """Forget the cached prefixes nobody uses (the blocks dropped, when the engine knows at once)."""
        ...

    def get_metrics(self) -> dict[str, Any]: ...

    def stats_line(self) -> str: ...

    def close(self) -> None: ...
