"""``POST /v1/completions``: one engine request per prompt, choices ``prompt * n + completion``."""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi.responses import JSONResponse, StreamingResponse
from starlette.requests import Request as HTTPRequest

from ..sampling_params import InvalidRequestError
from .errors import error_for, guarded
from .bootstrap import post_when_done, room_of
from .deltas import CompletionCursor, completion_logprobs, decoder, usage
from .params import constraint_field, sampling_params, served_max_tokens
from .protocol import CompletionRequest
from .state import ServerState
from .streaming import DONE, admit, check_output, final_outputs, merged, release, sse

#: OpenAI's default for the completions API
DEFAULT_MAX_TOKENS = 16


def tokenized_prompts(state: ServerState, prompt: Any) -> list[tuple[str | None, list[int]]]:
    """Each prompt's text (None for token ids) and token ids, checked."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif prompt and all(isinstance(t, int) for t in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise InvalidRequestError("prompt is empty; give a string, a list of strings, or token ids", "prompt")
    out = []
    for item in items:
        ids = state.tokenizer.encode(item).ids if isinstance(item, str) else list(item)
        state.check_prompt(ids)
        out.append((item if isinstance(item, str) else None, ids))
    return out


def _prompt_logprobs(body: CompletionRequest) -> int | None:
    """Top log-probabilities the engine scores each prompt token with: for ``prompt_logprobs``, and for
    ``echo`` with ``logprobs`` (the echoed prompt's entries)."""
    wanted = [k for k in (body.prompt_logprobs, body.logprobs if body.echo else None) if k is not None]
    return max(wanted) if wanted else None


def _prompt_logprobs_field(k: int, ids: list[int], positions: list | None) -> list[dict[str, dict[str, Any]] | None]:
    """vLLM's ``prompt_logprobs`` of a choice: per prompt position None (the first) or token id -> its
    ``logprob``, ``rank`` and ``decoded_token``, the top ``k`` and the prompt's own token."""
    out: list[dict[str, dict[str, Any]] | None] = []
    for i, row in enumerate(positions or [None] * len(ids)):
        if row is None:
            out.append(None)
            continue
        out.append({str(t): {"logprob": lp.logprob, "rank": lp.rank, "decoded_token": lp.decoded_token}
                    for t, lp in row.items() if lp.rank <= k or t == ids[i]})
    return out


async def create_completion(body: CompletionRequest, state: ServerState, http: HTTPRequest):
    received = time.monotonic()
    model = state.model_name(body.model)
    if body.suffix:
        raise InvalidRequestError("suffix is not supported (the model has no fill-in-the-middle format)", "suffix")
    prompts = tokenized_prompts(state, body.prompt)
    hold_kv, transfer = await state.transfer(body, len(prompts))
    engine = state.engine
    base = f"cmpl-{uuid.uuid4().hex}"
    params = []
    for _, ids in prompts:
        requested = body.max_tokens if body.max_tokens is not None else min(DEFAULT_MAX_TOKENS, state.max_model_len - len(ids))
        requested = 1 if hold_kv else requested  # a prefill server samples the first token; the decode server the rest
        params.append(sampling_params(
            body, state.limits, max_tokens=served_max_tokens(requested, len(ids), state.max_model_len), logprobs=body.logprobs,
            prompt_logprobs=_prompt_logprobs(body),
        ))
    streams = []
    try:
        for i, ((_, ids), p) in enumerate(zip(prompts, params)):
            streams.append(engine.submit(f"{base}-{i}", ids, p, len(ids), hold_kv=hold_kv, kv_transfer_params=transfer,
                                         received=received))
    except Exception:
        release(engine, streams, state.metrics)  # the queue filled up part-way: the earlier prompts go too
        raise
    room = room_of(body)
    if hold_kv and room is not None and state.rooms is not None:
        post_when_done(state.rooms, room, streams[0])
    await admit(engine, streams, state.metrics, constraint_field(body))
    created = int(time.time())
    if body.stream:
        return StreamingResponse(guarded(_stream(body, state, http, base, model, created, prompts, streams)), media_type="text/event-stream")
    outs = await final_outputs(engine, streams, http, state.metrics)
    built = time.monotonic()
    choices = []
    completion_tokens = 0
    for i, ((text, ids), out) in enumerate(zip(prompts, outs)):
        prompt_text = text if text is not None else state.tokenizer.decode(ids, skip_special_tokens=False)
        for c in out.outputs:
            completion_tokens += len(c.token_ids)
            choices.append({
                "index": i * body.n + c.index,
                "text": (prompt_text if body.echo else "") + c.text,
                "logprobs": _logprobs(body, state, ids, prompt_text, out.prompt_logprobs, c.token_ids, c.logprobs),
                "finish_reason": c.finish_reason,
                "stop_reason": c.stop_reason,
            })
            if body.prompt_logprobs is not None:
                choices[-1]["prompt_logprobs"] = _prompt_logprobs_field(body.prompt_logprobs, ids, out.prompt_logprobs)
    prompt_tokens = sum(len(ids) for _, ids in prompts)
    response = {
        "id": base, "object": "text_completion", "created": created, "model": model, "choices": choices,
        "usage": usage(prompt_tokens, completion_tokens),
    }
    if hold_kv:
        response["kv_transfer_params"] = outs[0].extra.get("kv_transfer_params")
    reply = JSONResponse(response)
    state.metrics.observe_postprocess(time.monotonic() - built)
    return reply



def _logprobs(body: CompletionRequest, state: ServerState, prompt_ids, prompt_text, prompt_lps, token_ids, lps) -> dict | None:
    if body.logprobs is None or lps is None:
        return None
    decode = decoder(state.tokenizer)
    out = completion_logprobs(token_ids, lps, body.logprobs, decode, len(prompt_text) if body.echo else 0)
    if body.echo:
        head = completion_logprobs(prompt_ids, list(prompt_lps or [None] * len(prompt_ids)), body.logprobs, decode, 0)
        out = {k: head[k] + out[k] for k in out}
    return out



async def _stream(body, state: ServerState, http, base, model, created, prompts, streams) -> AsyncIterator[bytes]:
    cursors: list[list[CompletionCursor]] = [[] for _ in streams]  # one per completion, from the first snapshot
    stop = body.stop if isinstance(body.stop, list) else [body.stop] if body.stop else []
    completion_tokens = 0
    include_usage = body.stream_options is not None and body.stream_options.include_usage
    head = {"id": base, "object": "text_completion", "created": created, "model": model}
    try:
        if body.echo:
            for i, (text, ids) in enumerate(prompts):
                prompt_text = text if text is not None else state.tokenizer.decode(ids, skip_special_tokens=False)
                for j in range(body.n):
                    yield sse({**head, "choices": [{"index": i * body.n + j, "text": prompt_text, "logprobs": None, "finish_reason": None}]})
        async for i, out in merged(streams):
            began = time.monotonic()
            try:
                out = check_output(streams[i], out)
            except Exception as exc:  # noqa: BLE001 - the status line is sent: the failure goes in the stream
                yield sse(error_for(exc)[1])
                continue
            if not cursors[i]:
                cursors[i] = [CompletionCursor(stop) for _ in out.outputs]
            choices = []
            for c, cursor in zip(out.outputs, cursors[i]):
                delta = cursor.advance(c)
                if delta is None:
                    continue
                completion_tokens += len(delta.token_ids)
                lp = None
                if body.logprobs is not None and delta.logprobs is not None:
                    lp = completion_logprobs(delta.token_ids, delta.logprobs, body.logprobs, decoder(state.tokenizer), 0)
                choices.append({"index": i * body.n + c.index, "text": delta.text, "logprobs": lp, "finish_reason": delta.finish_reason,
                                "stop_reason": c.stop_reason if delta.finish_reason else None})
            streams[i].timing.postprocess += time.monotonic() - began
            if choices:
                yield sse({**head, "choices": choices})
        if include_usage:
            yield sse({**head, "choices": [], "usage": usage(sum(len(ids) for _, ids in prompts), completion_tokens)})
        yield DONE
    finally:
        release(state.engine, streams, state.metrics)

