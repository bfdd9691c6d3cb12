"""``POST /v1/completions/render`` and ``POST /v1/chat/completions/render``: the token ids a request's prompt
becomes, without running it.

vLLM's router asks a replica for them before it routes a request (its ``cache_aware`` policy matches prefixes),
and falls back to ``/tokenize`` when a replica has no render endpoint. The bodies are the completion endpoints';
the prompt goes through the same code as there (the completions' prompt handling, the chat format's rendering)
and the same checks (model, length, vocabulary), so a render refused here is a completion refused there. The
answers have the shape of vLLM's: a list with one object per prompt for completions, one object for chat, each
with ``token_ids`` (what a router reads), ``model`` and ``request_id``, fields of vLLM's ``GenerateRequest``.
Sampling fields are not checked here: the completion call does that.
"""

from __future__ import annotations

import uuid
from typing import Any

from . import completions, conversation
from .protocol import ChatCompletionRequest, CompletionRequest
from .state import ServerState


def _rendered(request_id: str, model: str, token_ids: list[int]) -> dict[str, Any]:
    """One rendered prompt, in the fields of vLLM's ``GenerateRequest``."""
    return {"request_id": request_id, "model": model, "token_ids": token_ids}


def render_completion(body: CompletionRequest, state: ServerState) -> list[dict[str, Any]]:
    """Each prompt's token ids, tokenized and checked as ``/v1/completions`` does."""
    model = state.model_name(body.model)
    base = f"cmpl-{uuid.uuid4().hex}"
    return [_rendered(f"{base}-{i}", model, ids) for i, (_, ids) in enumerate(completions.tokenized_prompts(state, body.prompt))]


def render_chat(body: ChatCompletionRequest, state: ServerState) -> dict[str, Any]:
    """The conversation's token ids in the model's chat format, rendered and checked as ``/v1/chat/completions`` does."""
    model = state.model_name(body.model)
    ids = conversation.render(body, state).token_ids
    state.check_prompt(ids, "messages")
    return _rendered(f"chatcmpl-{uuid.uuid4().hex}", model, ids)
