"""Every ``EngineConfig`` field as a command-line flag, for ``generate`` and ``serve`` alike.

A flag is the field's name in kebab case (two are shortened: ``--ep``,
``--speculative``); its type, choices and help come from the field. A flag left
out is no value at all, so the config file, the environment or the default
decides, as for ``LLM(...)`` keywords.
"""

from __future__ import annotations

import argparse
import json
import typing
from typing import Any

from .config import EngineConfig

#: fields whose flag is not their kebab-case name
_SHORT = {"expert_parallel_size": "--ep", "speculative_method": "--speculative"}
#: fields a command sets from a flag of its own meaning (``--model`` is positional-like everywhere)
_OWN = ("model",)


def _flag(name: str) -> str:
    return _SHORT.get(name, "--" + name.replace("_", "-"))


def _int_list(text: str) -> list[int]:
    try:
        return [int(v) for v in (json.loads(text) if text.strip().startswith("[") else text.split(",")) if str(v).strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a list of integers; give 1,2,4 or [1, 2, 4]") from None


def _json_or_text(text: str) -> Any:
    if text.strip().startswith("{"):
        try:
            return json.loads(text)
        except json.JSONDecodeError as exc:
            raise argparse.ArgumentTypeError(f"{text!r} is not a JSON object ({exc.msg})") from None
    return text


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    """One flag per ``EngineConfig`` field (``--model`` excepted: each command documents its own)."""
    group = parser.add_argument_group("engine", "every EngineConfig field; a flag left out defers to the config file, DEEPINFER_<FIELD>, then the default")
    for name, field in EngineConfig.model_fields.items():
        if name in _OWN:
            continue
        kwargs: dict[str, Any] = {"default": None, "dest": name, "help": field.description}
        ann = field.annotation
        args = [a for a in typing.get_args(ann) if a is not type(None)]
        origin = typing.get_origin(ann)
        literal = next((a for a in args if typing.get_origin(a) is typing.Literal), ann if origin is typing.Literal else None)
        if ann is bool or (args and set(args) == {bool}):
            kwargs["action"] = argparse.BooleanOptionalAction
        elif literal is not None:
            kwargs["choices"] = list(typing.get_args(literal)) + (["none"] if type(None) in typing.get_args(ann) else [])
        elif "list[int]" in str(ann):
            kwargs.update(type=_int_list, metavar="N,N,...")
        elif "dict" in str(ann):
            kwargs.update(type=_json_or_text, metavar="JSON")
        elif int in (args or [ann]) and float not in (args or [ann]):
            kwargs["type"] = int
        elif float in (args or [ann]):
            kwargs["type"] = float
        group.add_argument(_flag(name), **kwargs)


def engine_overrides(args: argparse.Namespace) -> dict[str, Any]:
    """The engine fields given on the command line (a flag left out is absent)."""
    return {name: getattr(args, name) for name in EngineConfig.model_fields if name not in _OWN and getattr(args, name, None) is not None}
