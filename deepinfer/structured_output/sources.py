"""Compiler input for each kind of constraint, with the cases the compiler would get silently wrong refused."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

from ..sampling_params import InvalidRequestError, StructuredOutputsParams
from .json_schema import prepare_json_schema

#: what each kind of constraint is called in error messages
KIND_NAMES = {
    "json": "JSON schema",
    "json_object": "JSON object",
    "regex": "regex",
    "grammar": "grammar",
    "choice": "choice",
    "structural_tag": "structural tag",
}

_EBNF_ESCAPES = {'"': '\\"', "\\": "\\\\", "\n": "\\n", "\t": "\\t", "\r": "\\r"}


def ebnf_literal(text: str) -> str:
    """``text`` as a double-quoted EBNF string literal; control characters as ``\\xNN``."""
    out = []
    for ch in text:
        if ch in _EBNF_ESCAPES:
            out.append(_EBNF_ESCAPES[ch])
        elif ord(ch) < 0x20 or ord(ch) == 0x7F:
            out.append(f"\\x{ord(ch):02x}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def choice_ebnf(choices: list[str]) -> str:
    """An EBNF grammar whose only sentences are the given strings."""
    for i, c in enumerate(choices):
        if not isinstance(c, str):
            raise InvalidRequestError(f"invalid choice {i}: expected a string, got {type(c).__name__}")
        if "\x00" in c:
            raise InvalidRequestError(f"invalid choice {i} {c!r}: it contains a NUL character; remove it")
    options = list(dict.fromkeys(choices))
    return "root ::= " + " | ".join(ebnf_literal(c) for c in options)


def check_regex(regex: str) -> None:
    """Refuse what the regex compiler would ignore rather than enforce: Unicode property classes and NUL."""
    if "\x00" in regex:
        raise InvalidRequestError("invalid regex: it contains a NUL character; write it as \\x00")
    i = 0
    while i < len(regex):
        if regex[i] == "\\" and i + 1 < len(regex):
            if regex[i + 1] in "pP":
                raise InvalidRequestError(
                    f"invalid regex: the Unicode property class '\\{regex[i + 1]}' at position {i} is not supported; "
                    "use an explicit character class"
                )
            i += 2
        else:
            i += 1


def is_ebnf(grammar: str) -> bool:
    """EBNF (GBNF) rules use ``::=``; anything else is read as a Lark grammar."""
    return re.search(r"::=", grammar) is not None


def compiler_message(exc: BaseException) -> str:
    """The compiler's complaint as one line, without its log prefix and internal check text."""
    lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
    line = lines[0] if lines else type(exc).__name__
    line = re.sub(r"^\[[^\]]*\]\s*\S+:\d+:\s*", "", line)
    line = re.sub(r"^Check failed: \(.*?\) is false:\s*", "", line)
    return line.rstrip(".")


@dataclass(frozen=True)
class GrammarSource:
    """What the compiler is given: the kind of constraint (a key of ``KIND_NAMES``) and its text.

    Equal sources compile to the same automaton, so a source is the compile cache's key.
    """

    kind: str
    text: str

    @property
    def kind_name(self) -> str:
        """The kind as error messages call it."""
        return KIND_NAMES[self.kind]


def grammar_source(params: StructuredOutputsParams) -> GrammarSource:
    """The compiler input for ``params``; ``InvalidRequestError`` for what the compiler would get wrong.

    A JSON schema given as a dict or as JSON text yields the same source (key
    order is kept: it sets the order of the output's properties).
    """
    if params.json is not None:
        return GrammarSource("json", prepare_json_schema(params.json))
    if params.json_object:
        return GrammarSource("json_object", "")
    if params.regex is not None:
        check_regex(params.regex)
        return GrammarSource("regex", params.regex)
    if params.grammar is not None:
        return GrammarSource("grammar", params.grammar)
    if params.structural_tag is not None:
        tag = params.structural_tag
        return GrammarSource("structural_tag", tag if isinstance(tag, str) else json.dumps(tag, ensure_ascii=False))
    return GrammarSource("choice", choice_ebnf(list(params.choice or [])))
