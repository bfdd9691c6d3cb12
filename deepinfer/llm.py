"""The offline Python API, shaped like vLLM's ``LLM``."""

from __future__ import annotations

from typing import Any, Iterator, Mapping, Sequence

from tokenizers import Tokenizer

from .chat import ChatFormat, ChatPrompt, Conversation, chat_format_for, format_chat
from .chat.messages import is_single_conversation
from .chat.tool_grammar import tool_call_constraint, tool_call_format
from .config import load_config
from .engine import resolve_model_dir
from .engine_client import EngineClient
from .loader import read_config
from .outputs import RequestOutput
from .prompts import image_placeholder
from .ranks.engines import make_engine
from .request_limits import RequestLimits, check_at_most
from .sampling_params import InvalidRequestError, SamplingParams, StructuredOutputsParams

#: text, token ids, or vLLM's {"prompt": text} / {"prompt_token_ids": ids}, either with
#: "multi_modal_data": {"image": an image or a list} (PIL images, bytes, data URIs, file paths)
Prompt = str | list[int] | Mapping[str, Any]
Params = SamplingParams | Mapping[str, Any]


class LLM:
    """An engine instance: ``LLM(model=DIR, backend="cpu", **any EngineConfig field)``.

    Settings not given as keywords come from ``DEEPINFER_<FIELD>`` environment
    variables, then the config file (``config=PATH`` or ``DEEPINFER_CONFIG``).
    """

    def __init__(self, model: str | None = None, *, config: str | None = None, **kwargs: Any) -> None:
        self.config = load_config({"model": model, **kwargs}, config, explicit=True)
        self.engine: EngineClient = make_engine(self.config)
        self._default_chat_format: ChatFormat | None = None
        self._image_placeholder: str | None = None

    def close(self) -> None:
        """Stop the engine's rank processes (expert parallelism); the engine is unusable afterwards."""
        self.engine.close()

    def get_tokenizer(self) -> Tokenizer:
        return self.engine.tokenizer

    def get_metrics(self) -> dict[str, Any]:
        """The engine's counters: steps, tokens computed, prefix hits, preemptions, step times, graph replays, ..."""
        return self.engine.get_metrics()

    def _submit(self, prompts: Prompt | Sequence[Prompt], params: Params | Sequence[Params] | None) -> list[str]:
        if isinstance(prompts, (str, Mapping)) or (isinstance(prompts, list) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]  # type: ignore[list-item]
        prompts = list(prompts)
        if params is None or isinstance(params, (SamplingParams, Mapping)):
            per = [params] * len(prompts)
        else:
            per = list(params)
            if len(per) != len(prompts):
                raise ValueError(f"got {len(prompts)} prompts but {len(per)} sampling params; give one, or one per prompt")
        return [self.engine.add_request(p, sp).request_id for p, sp in zip(prompts, per)]

    def generate_stream(
        self, prompts: Prompt | Sequence[Prompt], sampling_params: Params | Sequence[Params] | None = None
    ) -> Iterator[RequestOutput]:
        """Yield a ``RequestOutput`` snapshot each time a request gains tokens or finishes.

        Requests that fail validation are yielded first, finished, with ``error`` set.
        """
        ids = self._submit(prompts, sampling_params)
        reqs = [self.engine.requests[i] for i in ids]
        for req in reqs:
            if req.all_finished:
                yield self.engine.output(req)
        pending = {r.request_id for r in reqs if not r.all_finished}
        try:
            while pending:
                for req in self.engine.step():
                    if req.request_id in pending:
                        yield self.engine.output(req)
                        if req.all_finished:
                            pending.discard(req.request_id)
        finally:
            for rid in pending:  # the caller stopped iterating: abort what is left
                self.engine.abort(rid)
            self.engine.release(ids)

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: Params | Sequence[Params] | None = None,
        use_tqdm: bool = False,
    ) -> list[RequestOutput]:
        """Complete every prompt (text, token ids, or vLLM's ``{"prompt": ..., "multi_modal_data": {"image": ...}}``
        with one image placeholder token where each image goes); outputs come back in prompt order.

        A request with bad input (empty or too long prompt, token ids outside the
        vocabulary, a bad image, an invalid sampling value given as a mapping) does not raise:
        its ``RequestOutput.error`` holds the one-line reason and every other
        request completes. ``SamplingParams(...)`` itself raises on invalid values.
        """
        ids = self._submit(prompts, sampling_params)
        bar = _Progress(len(ids)) if use_tqdm else None
        done = sum(self.engine.requests[i].all_finished for i in ids)
        while any(not self.engine.requests[i].all_finished for i in ids):
            for req in self.engine.step():
                if req.all_finished and bar is not None:
                    done += 1
                    bar.update(done)
        if bar is not None:
            bar.close()
        outputs = [self.engine.output(self.engine.requests[i]) for i in ids]
        self.engine.release(ids)
        return outputs

    def chat(
        self,
        messages: Conversation | Sequence[Conversation],
        sampling_params: Params | Sequence[Params] | None = None,
        use_tqdm: bool = False,
        *,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        thinking: bool = False,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
        tool_choice: str | Mapping[str, Any] | None = None,
        parallel_tool_calls: bool = True,
    ) -> list[RequestOutput]:
        """Reply to one conversation, or to each of a list of them, like vLLM's ``LLM.chat``.

        ``messages`` are dicts with ``role`` (system, user, assistant, tool,
        developer) and ``content``; assistant turns may carry ``reasoning_content``
        and ``tool_calls``. Each conversation is formatted with the model's chat
        format (see ``format_chat``) and generated like a ``generate`` prompt;
        ``RequestOutput.prompt`` is the formatted text. ``thinking=True`` (or
        ``chat_template_kwargs={"thinking": True}``) opens the reply in thinking
        mode. Content parts may carry images (``{"type": "image_url", "image_url":
        {"url": data URI or file path}}``, or ``image_pil``): each becomes the
        model's image placeholder and the images go with the prompt; a bad image
        fails its own conversation's output. A malformed conversation, or a model
        with no chat format, raises ``ChatFormatError`` (one line).

        ``tool_choice`` ``"required"`` or ``{"type": "function", "function": {"name": ...}}`` makes each
        reply tool calls (one, or several with ``parallel_tool_calls``) in the chat format's syntax, with
        arguments matching their tool's schema, as the server does; ``"auto"`` / ``"none"`` constrain nothing.
        A bad ``tool_choice`` raises ``InvalidRequestError``.
        """
        prompts = self.format_chat(
            messages, chat_template=chat_template, chat_template_kwargs=chat_template_kwargs, thinking=thinking,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message, tools=tools,
        )
        forced = tool_call_constraint(tool_call_format(self._chat_format(chat_template)), tools, tool_choice, parallel_tool_calls)
        if forced is not None:
            sampling_params = _with_constraint(sampling_params, forced)
        outputs = self.generate([p.engine_prompt() for p in prompts], sampling_params, use_tqdm)
        for out, prompt in zip(outputs, prompts):
            out.prompt = prompt.text
        return outputs

    def format_chat(
        self,
        messages: Conversation | Sequence[Conversation],
        *,
        chat_template: str | None = None,
        chat_template_kwargs: Mapping[str, Any] | None = None,
        thinking: bool = False,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        tools: Sequence[Mapping[str, Any]] | None = None,
    ) -> list[ChatPrompt]:
        """The prompt text and token ids ``chat`` would generate from, one per conversation.

        The format is ``chat_template`` if given, else the checkpoint's Jinja
        chat template, else the DeepSeek-V4 encoder when the tokenizer has the V4
        chat tokens. The text is encoded without adding special tokens (the
        format writes the BOS); special-token text inside content is not escaped.
        """
        limits = RequestLimits.from_config(self.config)
        check_at_most("tools", len(tools or ()), limits.max_tools, what="tools")
        for conversation in [messages] if is_single_conversation(messages) else messages:
            if isinstance(conversation, Sequence) and not isinstance(conversation, (str, bytes)):
                check_at_most("messages", len(conversation), limits.max_messages, what="messages")
        kwargs = dict(chat_template_kwargs or {})
        if thinking:
            kwargs["thinking"] = True
        return format_chat(
            self._chat_format(chat_template), self.engine.tokenizer, messages, tools=tools,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message, kwargs=kwargs,
            image_placeholder=self._placeholder(),
        )

    def _placeholder(self) -> str | None:
        """The model's image placeholder text (None: it reads no images), read once."""
        if self._image_placeholder is None:
            raw = read_config(resolve_model_dir(self.config.model))
            self._image_placeholder = image_placeholder(raw, self.engine.tokenizer) or ""
        return self._image_placeholder or None

    def _chat_format(self, chat_template: str | None) -> ChatFormat:
        if chat_template is None and self._default_chat_format is not None:
            return self._default_chat_format
        fmt = chat_format_for(
            resolve_model_dir(self.config.model), self.engine.tokenizer, self.engine.model_config.model_type, chat_template
        )
        if chat_template is None:
            self._default_chat_format = fmt
        return fmt


def _with_constraint(params: Params | Sequence[Params] | None, constraint: StructuredOutputsParams) -> Params | list[Params]:
    """``params`` (one, or one per prompt) constrained by a forced tool call's grammar."""
    if params is not None and not isinstance(params, (SamplingParams, Mapping)):
        return [_with_constraint(p, constraint) for p in params]  # type: ignore[misc]
    given = params.structured_outputs if isinstance(params, SamplingParams) else (params or {}).get("structured_outputs")
    if given is not None:
        raise InvalidRequestError(
            "tool_choice forces a tool call, which cannot be combined with structured_outputs; drop one of them", "tool_choice"
        )
    if isinstance(params, SamplingParams):
        return params.model_copy(update={"structured_outputs": constraint})
    return {**(params or {}), "structured_outputs": constraint}


class _Progress:
    """A one-line progress bar on stderr."""

    def __init__(self, total: int) -> None:
        import sys

        self.total = total
        self.out = sys.stderr

    def update(self, done: int) -> None:
        width = 30
        filled = int(width * done / max(self.total, 1))
        self.out.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {done}/{self.total} requests")
        self.out.flush()

    def close(self) -> None:
        self.out.write("\n")
