"""A checkpoint's Jinja ``chat_template``, found and rendered the way transformers does.

transformers keeps the template in ``chat_template.jinja`` (what it writes now)
or under ``chat_template`` in ``tokenizer_config.json`` (a string, or a list of
named templates). It renders in a sandbox with ``trim_blocks`` and
``lstrip_blocks``, the loop-control extension, a ``tojson`` filter that keeps
non-ASCII text, ``raise_exception`` and ``strftime_now``; the template sees
``messages``, ``tools``, ``documents``, ``add_generation_prompt``, the special
tokens (``bos_token``, ``eos_token``, ...) and every ``chat_template_kwargs`` entry.
"""

from __future__ import annotations

import json
from datetime import datetime
from functools import lru_cache
from pathlib import Path
from typing import Any, Mapping

from ..errors import ChatFormatError
from .messages import Message

#: tokenizer_config.json keys transformers passes to the template as strings
_SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
#: marks the end of the final message when continuing it, so the render can be cut there
_CONTINUE_TAG = "CONTINUE_FINAL_MESSAGE_TAG "


def read_tokenizer_config(model_dir: Path) -> dict[str, Any]:
    """``tokenizer_config.json`` as a dict ({} when absent or not a JSON object)."""
    path = model_dir / "tokenizer_config.json"
    if not path.is_file():
        return {}
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise ChatFormatError(f"cannot read {str(path)!r} for its chat_template: {exc}") from None
    return data if isinstance(data, dict) else {}


def find_template(model_dir: Path, tokenizer_config: Mapping[str, Any]) -> str | dict[str, str] | None:
    """The checkpoint's chat template: one string, named templates (name -> source), or None."""
    path = model_dir / "chat_template.jinja"
    if path.is_file():
        return path.read_text(encoding="utf-8")
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        return {t["name"]: t["template"] for t in template if isinstance(t, Mapping) and "name" in t and "template" in t}
    return template if isinstance(template, str) and template else None


def special_tokens(tokenizer_config: Mapping[str, Any]) -> dict[str, str]:
    """``bos_token`` etc. as strings (tokenizer_config.json may hold them as AddedToken dicts)."""
    out = {}
    for key in _SPECIAL_TOKEN_KEYS:
        value = tokenizer_config.get(key)
        if isinstance(value, Mapping):
            value = value.get("content")
        if isinstance(value, str):
            out[key] = value
    return out


def pick_template(template: str | dict[str, str], has_tools: bool) -> str:
    """A named template set's ``tool_use`` template when tools are given, else its ``default``."""
    if isinstance(template, str):
        return template
    if has_tools and "tool_use" in template:
        return template["tool_use"]
    if "default" not in template:
        raise ChatFormatError(f"the chat_template list has no 'default' template (it has {', '.join(sorted(template))})")
    return template["default"]


def render(
    template: str,
    conversation: list[Message],
    *,
    special: Mapping[str, str],
    tools: list[dict[str, Any]] | None = None,
    add_generation_prompt: bool = True,
    continue_final_message: bool = False,
    kwargs: Mapping[str, Any] | None = None,
) -> str:
    """The template's text for ``conversation``."""
    messages = [dict(m.source) for m in conversation]
    if continue_final_message:
        messages[-1]["content"] += _CONTINUE_TAG
    try:
        text = _compile(template).render(
            messages=messages, tools=tools, documents=None, add_generation_prompt=add_generation_prompt,
            **{**special, **dict(kwargs or {})},
        )
    except Exception as exc:  # jinja2's TemplateError, or whatever the template's own expressions raise
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ChatFormatError(f"the model's chat_template failed to render this conversation: {first}") from None
    if continue_final_message:
        cut = text.rfind(_CONTINUE_TAG.strip())
        if cut < 0:
            raise ChatFormatError("continue_final_message is set but the chat_template does not render the final message's content")
        text = text[:cut] if text.startswith(_CONTINUE_TAG, cut) else text[:cut].rstrip()
    return text


@lru_cache(maxsize=8)
def _compile(template: str):
    try:
        import jinja2
        from jinja2.ext import loopcontrols
        from jinja2.sandbox import ImmutableSandboxedEnvironment
    except ImportError:
        raise ChatFormatError("this model's chat_template needs jinja2; install it with `pip install jinja2`") from None

    def raise_exception(message: str) -> None:
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x: Any, ensure_ascii: bool = False, indent: int | None = None, separators: Any = None, sort_keys: bool = False) -> str:
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    try:
        return env.from_string(template)
    except jinja2.exceptions.TemplateSyntaxError as exc:
        raise ChatFormatError(f"the model's chat_template is not valid Jinja (line {exc.lineno}: {exc.message})") from None
