"""A request as the engine tracks it between arrival and its last token."""

from __future__ import annotations

import enum
import time
from array import array
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from typing import TYPE_CHECKING

from .outputs import PositionLogprobs, RequestMetrics
from .sampling_params import SamplingParams
from .step import PLACEHOLDER, SampleSpec

if TYPE_CHECKING:
    from .detokenizer import IncrementalDetokenizer
    from .kv_transfer.sequence_state import SequenceState
    from .multimodal import ImageSpan
    from .spec_decode.spec_state import SpecState


def token_array(ids: Iterable[int] = ()) -> array:
    """Token ids as 32-bit C integers: 4 bytes a token, where a list costs a pointer and often a Python int
    (8 to 36 bytes), so a long context's ids stay small next to its cache."""
    return array("i", ids)


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Request:
    """One sequence: a prompt and one completion of it.

    With parallel sampling (``SamplingParams.n > 1``) a prompt has ``n``
    requests, ``index`` 0 … n − 1, listed in each one's ``siblings``; request 0
    prefills the prompt and the others start as copies of its state
    (``fork_source``) when its prefill completes.
    """

    request_id: str
    prompt: str | None
    #: the prompt's ids (``token_array``; a list given here is converted)
    prompt_token_ids: array
    params: SamplingParams
    #: which of the prompt's ``n`` completions this is
    index: int = 0
    eos_token_id: int | None = None
    #: the ids sampled so far (``token_array``)
    output_token_ids: array = field(default_factory=token_array)
    #: tokens (prompt then output) whose state is in the cache, or being computed; advanced by the scheduler only
    num_computed_tokens: int = 0
    #: tokens sampled on the device that the host has not seen yet (overlap scheduling)
    num_pending: int = 0
    #: prompt + output tokens after which the request stops (max_tokens or max_model_len)
    max_total_tokens: int = 1 << 62
    #: prompt tokens found in the prefix cache when last scheduled (their entries are shared)
    num_cached_tokens: int = 0
    #: first position whose sliding-window state this request computed itself (replay start)
    state_floor: int = 0
    status: RequestStatus = RequestStatus.WAITING
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(arrival_time=time.monotonic()))
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    output_text: str = ""
    #: the one-line reason this request failed (None: it did not)
    error: str | None = None
    #: the failure is the engine's (a fault while serving it), not the request's (invalid input)
    internal_error: bool = False
    detokenizer: IncrementalDetokenizer | None = None
    #: the sibling whose prompt state this one copies instead of prefilling (None: it prefills itself)
    fork_source: Request | None = None
    #: every completion of this prompt, in index order (this request alone when n == 1)
    siblings: list[Request] = field(default_factory=list)
    #: its drafts in flight, owned by the engine's ``DraftLedger`` (None: it does not speculate)
    spec: SpecState | None = None
    #: keep its cache (slot and blocks) when it finishes, for another engine to take (disaggregated prefill)
    hold_kv: bool = False
    #: its prompt's state computed by another engine, installed when it is first scheduled (disaggregated decode)
    imported: SequenceState | None = None
    #: its prompt's images, in prompt order: where each span sits and its preprocessed pixels (shared by its siblings)
    images: tuple[ImageSpan, ...] = ()

    def __post_init__(self) -> None:
        if not isinstance(self.prompt_token_ids, array):
            self.prompt_token_ids = token_array(self.prompt_token_ids)
        if not isinstance(self.output_token_ids, array):
            self.output_token_ids = token_array(self.output_token_ids)
        if not self.siblings:
            self.siblings = [self]

    @property
    def seed(self) -> int | None:
        """This completion's generator seed: the request's seed plus its index, as an unsigned 64-bit
        integer (None: unseeded)."""
        return None if self.params.seed is None else (self.params.seed + self.index) % 2**64

    @property
    def num_tokens(self) -> int:
        """Known tokens plus those sampled but not yet seen by the host."""
        return len(self.prompt_token_ids) + len(self.output_token_ids) + self.num_pending

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    def known_tokens(self, start: int, end: int) -> array:
        """The known tokens (prompt, then output) at positions ``[start, end)``, no further than the host
        knows: a copy of that range alone, never of the whole context."""
        p = len(self.prompt_token_ids)
        if end <= p:
            return self.prompt_token_ids[start:end]
        if start >= p:
            return self.output_token_ids[start - p : end - p]
        return self.prompt_token_ids[start:] + self.output_token_ids[: end - p]

    def images_in(self, start: int, end: int) -> tuple[ImageSpan, ...]:
        """The prompt's image spans reaching into positions ``[start, end)``."""
        return tuple(span for span in self.images if span.overlaps(start, end)) if self.images else ()

    def token_slice(self, start: int, n: int) -> list[int]:
        """Tokens ``[start, start + n)``, with ``PLACEHOLDER`` for positions still pending on the device."""
        known = self.known_tokens(start, start + n).tolist()
        return known + [PLACEHOLDER] * (n - len(known))

    @cached_property
    def sample_spec(self) -> SampleSpec:
        """How each of this request's tokens is drawn."""
        p = self.params
        return SampleSpec(p.temperature, p.top_k, p.top_p, p.min_p, self.seed, p.logprobs)

    @property
    def at_limit(self) -> bool:
        """Whether it has (or will have, once pending tokens land) every token it may produce."""
        return self.num_tokens >= self.max_total_tokens

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def finished(self) -> bool:
        return self.status is RequestStatus.FINISHED

    @property
    def all_finished(self) -> bool:
        """Whether every completion of this prompt has finished."""
        return all(r.finished for r in self.siblings)
