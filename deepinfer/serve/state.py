"""What every endpoint of one server shares: its engine, names, chat format and metrics."""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any

from tokenizers import Tokenizer

from ..chat import ChatFormat
from ..engine import check_prompt_ids
from ..image_input import ImageLimits
from ..models.common.images import ImageReader
from ..request_limits import RequestLimits
from ..sampling_params import InvalidRequestError
from .async_engine import AsyncEngine
from .metrics import ServerMetrics
from .bootstrap import Rooms, RoomUnavailable, fetch_room_params
from .protocol import SamplingFields

log = logging.getLogger("deepinfer")


class ModelNotFound(InvalidRequestError):
    """A request named a model this server does not serve (404)."""


@dataclass
class ServerState:
    engine: AsyncEngine
    tokenizer: Tokenizer
    #: the names clients may use in ``model``; the first is the one responses carry
    model_names: list[str]
    max_model_len: int
    vocab_size: int
    metrics: ServerMetrics
    #: the chat format, or the one-line reason there is none (chat requests get a 400 with it)
    chat_format: ChatFormat | None
    chat_format_error: str | None
    #: whether thinking is split into ``reasoning_content``; which tool-call format is parsed
    reasoning_parser: bool
    tool_call_parser: str | None
    #: facts ``/server_info`` reports (engine configuration, backend, ...)
    info: dict = field(default_factory=dict)
    started: float = field(default_factory=time.time)
    #: the server stops taking requests (SIGTERM: draining)
    draining: bool = False
    #: ``both`` (colocated), ``prefill`` or ``decode`` (disaggregated serving)
    disaggregation_mode: str = "both"
    #: a prefill server's bootstrap rooms (SGLang's router)
    rooms: Rooms | None = None
    #: decode role: a request whose prefill server cannot be reached computes its prompt here instead of failing
    recompute_failed_transfers: bool = False
    #: the text a chat image part becomes (None: the model reads no images, and a request with images is refused)
    image_placeholder: str | None = None
    #: what a request's images may be (the engine's image fields)
    image_limits: ImageLimits = field(default_factory=ImageLimits)
    #: how long each decoded image's span is in a prompt (None: the model reads no images)
    image_reader: ImageReader | None = None
    #: what one request may ask for (the engine's own bounds, checked here first so a refusal names its field)
    limits: RequestLimits = field(default_factory=RequestLimits)

    async def transfer(self, body: SamplingFields, n_prompts: int) -> tuple[bool, dict[str, Any] | None]:
        """This server's part of a disaggregated request: (hold and publish its state: a prefill server,
        the prefill server's parameters to fetch it with: a decode server). A decode request carries them
        (vLLM's router) or names the bootstrap room where the prefill server posts them (SGLang's)."""
        mode = self.disaggregation_mode
        if mode == "both":
            return False, None
        if n_prompts != 1 or body.n != 1:
            raise InvalidRequestError(f"a {mode} server takes one prompt with n=1 per request", "n" if body.n != 1 else "prompt")
        if mode == "prefill":
            return True, None
        if body.kv_transfer_params is not None and "location" in body.kv_transfer_params:
            return False, body.kv_transfer_params
        try:
            return False, await fetch_room_params(body)
        except RoomUnavailable as exc:
            if not self.recompute_failed_transfers:
                raise
            log.warning("%s; computing the prompt here (--kv-load-failure-policy recompute)", exc)
            return False, None

    def model_name(self, requested: str | None) -> str:
        """The name a response carries; an unknown requested name is a 404."""
        if requested is None or requested in self.model_names:
            return self.model_names[0] if requested is None else requested
        raise ModelNotFound(
            f"the model '{requested}' does not exist on this server; it serves {', '.join(map(repr, self.model_names))}", "model"
        )

    def check_prompt(self, token_ids: list[int], param: str = "prompt", image_tokens: int = 0) -> None:
        """Refuse what the engine would (before the request reaches it), naming the field; ``image_tokens``:
        the positions the prompt's images add when their placeholders expand into spans."""
        check_prompt_ids(token_ids, self.vocab_size, self.max_model_len, param)
        total = len(token_ids) + image_tokens
        if image_tokens and total >= self.max_model_len:
            raise InvalidRequestError(
                f"the prompt has {total} tokens with its images' spans but max_model_len is {self.max_model_len}; "
                "send fewer or smaller images, shorten the prompt, or raise max_model_len", param,
            )
