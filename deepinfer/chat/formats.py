"""Which chat format a model uses, and turning a conversation into prompt token ids with it.

A checkpoint's own ``chat_template`` wins (as in vLLM and transformers); a
DeepSeek-V4 checkpoint without one, whose tokenizer has the V4 chat tokens, gets
the DeepSeek-V4 encoder; any other model has no chat format and ``chat`` says so.

The text is tokenized without adding special tokens (the format writes the BOS
itself), and special-token strings in it become their single ids — including
any that appear inside message content, which is neither escaped nor split,
exactly as vLLM, SGLang and transformers tokenize a rendered chat prompt.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping, Protocol, Sequence

from tokenizers import Tokenizer

from ..errors import ChatFormatError
from ..models.registry import chat_encoder
from . import deepseek_v4, jinja_template
from .messages import Message, is_single_conversation, parse_conversation


@dataclass(frozen=True)
class ChatPrompt:
    """A formatted conversation: the prompt text, its token ids and its images in order (one placeholder each)."""

    text: str
    token_ids: list[int]
    images: tuple[Any, ...] = ()

    def engine_prompt(self) -> list[int] | dict[str, Any]:
        """What the engine takes: the token ids, with the images as vLLM's ``multi_modal_data`` when there are any."""
        if not self.images:
            return self.token_ids
        return {"prompt_token_ids": self.token_ids, "multi_modal_data": {"image": list(self.images)}}


class ChatFormat(Protocol):
    """Turns a checked conversation into prompt text."""

    name: str

    def render(
        self,
        conversation: list[Message],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        kwargs: Mapping[str, Any],
    ) -> str: ...


class DeepseekV4Format:
    """The DeepSeek-V4 encoder; ``kwargs``: ``thinking`` / ``enable_thinking``, ``drop_thinking``, ``reasoning_effort``,
    and ``thinking_budget``, which the engine enforces (``SamplingParams.thinking_budget``) and the prompt does not show."""

    name = "deepseek_v4"
    _KWARGS = ("thinking", "enable_thinking", "drop_thinking", "reasoning_effort", "thinking_budget")

    def render(
        self,
        conversation: list[Message],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        kwargs: Mapping[str, Any],
    ) -> str:
        unknown = sorted(set(kwargs) - set(self._KWARGS))
        if unknown:
            raise ChatFormatError(
                f"chat_template_kwargs {', '.join(map(repr, unknown))} not understood by the DeepSeek-V4 chat format; "
                f"it takes {', '.join(self._KWARGS)}"
            )
        thinking = bool(kwargs.get("thinking") or kwargs.get("enable_thinking"))
        thinking = deepseek_v4.check_options(thinking, kwargs.get("reasoning_effort"), tools)
        return deepseek_v4.encode(
            conversation,
            thinking=thinking,
            drop_thinking=bool(kwargs.get("drop_thinking", True)),
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
        )


class JinjaFormat:
    """A Jinja chat template (the checkpoint's, or one passed as ``chat_template=``)."""

    name = "chat_template"

    def __init__(self, template: str | dict[str, str], special: Mapping[str, str]) -> None:
        self.template = template
        self.special = dict(special)

    def render(
        self,
        conversation: list[Message],
        *,
        add_generation_prompt: bool,
        continue_final_message: bool,
        tools: Sequence[Mapping[str, Any]] | None,
        kwargs: Mapping[str, Any],
    ) -> str:
        source = jinja_template.pick_template(self.template, bool(tools))
        return jinja_template.render(
            source, conversation, special=self.special, tools=[dict(t) for t in tools] if tools else None,
            add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message, kwargs=kwargs,
        )


def has_v4_chat_tokens(tokenizer: Tokenizer) -> bool:
    """Whether every DeepSeek-V4 chat token is a single token of ``tokenizer``."""
    return all(tokenizer.token_to_id(t) is not None for t in deepseek_v4.CHAT_TOKENS)


def chat_format_for(model_dir: str | Path, tokenizer: Tokenizer, model_type: str | None, chat_template: str | None = None) -> ChatFormat:
    """The chat format of the model in ``model_dir``: ``chat_template`` if given, the checkpoint's
    template, else DeepSeek-V4's encoder; a ChatFormatError when the model has none."""
    model_dir = Path(model_dir)
    config = jinja_template.read_tokenizer_config(model_dir)
    template = chat_template or jinja_template.find_template(model_dir, config)
    if template:
        return JinjaFormat(template, jinja_template.special_tokens(config))
    if chat_encoder(model_type) == DeepseekV4Format.name and has_v4_chat_tokens(tokenizer):
        return DeepseekV4Format()
    missing = [t for t in deepseek_v4.CHAT_TOKENS if tokenizer.token_to_id(t) is None]
    why = f"its tokenizer lacks the DeepSeek-V4 chat tokens {', '.join(missing)}" if missing else f"it is a {model_type!r} model"
    raise ChatFormatError(
        f"this model has no chat format: {str(model_dir)!r} has no chat_template and {why}; "
        "use generate with a formatted prompt, or give a Jinja template (chat_template= / --chat-template FILE)"
    )


def encode_prompt(tokenizer: Tokenizer, text: str) -> list[int]:
    """Token ids of formatted chat text: no special tokens added, special-token strings as their ids."""
    return tokenizer.encode(text, add_special_tokens=False).ids


def format_chat(
    fmt: ChatFormat,
    tokenizer: Tokenizer,
    messages: Any,
    *,
    tools: Sequence[Mapping[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    kwargs: Mapping[str, Any] | None = None,
    image_placeholder: str | None = None,
) -> list[ChatPrompt]:
    """Format one conversation (a list of message dicts) or a list of them; one ChatPrompt each.
    ``image_placeholder``: the text an image part becomes (None: the model reads no images)."""
    if add_generation_prompt and continue_final_message:
        raise ChatFormatError("continue_final_message=True continues the last assistant message; set add_generation_prompt=False with it")
    conversations = [messages] if is_single_conversation(messages) else messages
    if isinstance(conversations, (str, bytes, Mapping)) or not isinstance(conversations, Sequence) or not conversations:
        raise ChatFormatError("messages must be a conversation (a non-empty list of message dicts) or a list of conversations")
    prompts = []
    for k, conv in enumerate(conversations):
        try:
            parsed = parse_conversation(conv, image_placeholder)
            if continue_final_message and parsed[-1].role != "assistant":
                raise ChatFormatError("continue_final_message=True needs the conversation to end with an assistant message")
            text = fmt.render(
                parsed, add_generation_prompt=add_generation_prompt, continue_final_message=continue_final_message,
                tools=tools, kwargs=dict(kwargs or {}),
            )
        except ChatFormatError as exc:
            if len(conversations) == 1:
                raise
            raise ChatFormatError(f"conversation {k}: {exc}") from None
        prompts.append(ChatPrompt(text, encode_prompt(tokenizer, text), tuple(i for m in parsed for i in m.images)))
    return prompts
