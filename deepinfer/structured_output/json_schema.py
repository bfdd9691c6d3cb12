"""JSON schemas checked for what the grammar compiler enforces, before it compiles them.

xgrammar 0.2.9 silently ignores some constraining keywords (its output would then
break the schema), so those are refused with a line naming the keyword and where
it is. One gap is repaired instead of refused: a string with only
``minLength``/``maxLength`` compiles to a rule that lets raw control characters
into the string (invalid JSON), so the length becomes the equivalent ``pattern``
``^.{min,max}$``, which xgrammar compiles with JSON string escaping rules.
That escaping covers character classes, ranges and ``.`` but not characters a
pattern names one by one: a pattern naming ``"``, a backslash or a control
character would put it into the string raw, so such patterns are refused.
"""

from __future__ import annotations

import json
from typing import Any

from ..sampling_params import InvalidRequestError

#: keywords whose value maps names to subschemas
_SCHEMA_MAPS = ("properties", "patternProperties", "$defs", "definitions")
#: keywords whose value is one subschema (``items`` may also be a list, the old tuple form)
_SCHEMA_ONE = (
    "items",
    "additionalProperties",
    "unevaluatedProperties",
    "additionalItems",
    "unevaluatedItems",
    "propertyNames",
)
#: keywords whose value is a list of subschemas
_SCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
#: constraining keywords the compiler ignores
_IGNORED = (
    "not",
    "if",
    "then",
    "else",
    "dependentRequired",
    "dependentSchemas",
    "dependencies",
    "contains",
    "minContains",
    "maxContains",
    "$dynamicRef",
    "$recursiveRef",
)
_BOUNDS = ("minimum", "maximum", "exclusiveMinimum", "exclusiveMaximum")


def _fail(problem: str) -> InvalidRequestError:
    return InvalidRequestError(f"invalid JSON schema: {problem}")


def _where(path: str) -> str:
    return path or "/"


def _types_of(node: dict) -> set[str]:
    t = node.get("type")
    if isinstance(t, str):
        return {t}
    if isinstance(t, list):
        return {x for x in t if isinstance(x, str)}
    return set()


#: escapes naming one control character
_CONTROL_ESCAPES = set("tnrfv0")
_HEX_ESCAPES = {"x": 2, "u": 4}


def names_unescapable(pattern: str) -> bool:
    """Whether the regex names ``"``, a backslash or a control character outside ranges and negated classes."""
    i, n = 0, len(pattern)
    in_class = negated = False
    class_start = -1
    while i < n:
        start, ch = i, pattern[i]
        if ch == "\\" and i + 1 < n:
            nxt = pattern[i + 1]
            width = 2 + _HEX_ESCAPES.get(nxt, 0)
            if nxt in _HEX_ESCAPES:
                try:
                    code = int(pattern[i + 2 : i + width], 16)
                except ValueError:
                    code = None
                bad = code is not None and (code < 0x20 or code in (0x22, 0x5C))
            else:
                bad = nxt in '\\"' or nxt in _CONTROL_ESCAPES or nxt == "c"
            i += width
        elif in_class and ch == "]" and start != class_start:
            in_class = False
            i += 1
            continue
        elif not in_class and ch == "[":
            in_class, negated = True, pattern[i + 1 : i + 2] == "^"
            i += 2 if negated else 1
            class_start = i
            continue
        else:
            bad = ch == '"' or ord(ch) < 0x20
            i += 1
        if not bad:
            continue
        range_start = pattern[i : i + 1] == "-" and pattern[i + 1 : i + 2] not in ("", "]")
        range_end = start > class_start and pattern[start - 1] == "-"
        if not (in_class and (negated or range_start or range_end)):
            return True
    return False


def _check_node(node: dict, path: str) -> None:
    at = _where(path)
    for key in _IGNORED:
        if key in node:
            raise _fail(f"keyword '{key}' at {at} is not supported by the structured-output compiler; remove it")
    if node.get("uniqueItems") is True:
        raise _fail(f"keyword 'uniqueItems' at {at} is not supported by the structured-output compiler; remove it")
    all_of = node.get("allOf")
    if isinstance(all_of, list) and len(all_of) > 1:
        raise _fail(f"'allOf' with {len(all_of)} schemas at {at} is not supported; merge them into one schema")
    if "multipleOf" in node:
        step = node["multipleOf"]
        integral = isinstance(step, int) or (isinstance(step, float) and step.is_integer())
        if "number" in _types_of(node) or not integral:
            raise _fail(f"'multipleOf' at {at} is supported only for integers; remove it")
        if any(b in node for b in _BOUNDS):
            raise _fail(f"'multipleOf' together with a minimum or maximum at {at} is not supported; keep one of them")
    ref = node.get("$ref")
    if isinstance(ref, str) and not (ref == "#" or ref.startswith("#/")):
        raise _fail(f"reference {ref!r} at {at} is not supported; use a local reference such as '#/$defs/name'")
    patterns = [("pattern", node.get("pattern"))]
    if isinstance(node.get("patternProperties"), dict):
        patterns += [("patternProperties", p) for p in node["patternProperties"]]
    for key, pattern in patterns:
        if isinstance(pattern, str) and names_unescapable(pattern):
            raise _fail(
                f"the {key} {pattern!r} at {at} names a quote, backslash or control character, which the compiler "
                "cannot escape inside JSON strings; match it with a character range or leave it out"
            )
    if ("minLength" in node or "maxLength" in node) and ("pattern" in node or "format" in node):
        other = "pattern" if "pattern" in node else "format"
        raise _fail(
            f"'minLength'/'maxLength' together with '{other}' at {at} is not supported; put the length into the pattern"
        )


def _length_as_pattern(node: dict, path: str) -> dict:
    lo, hi = node.get("minLength", 0), node.get("maxLength")
    for name, v in (("minLength", lo), ("maxLength", hi)):
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < 0):
            raise _fail(f"'{name}' at {_where(path)} must be a non-negative integer, got {v!r}")
    if hi is not None and hi < lo:
        raise _fail(f"'maxLength' {hi} is below 'minLength' {lo} at {_where(path)}")
    out = {k: v for k, v in node.items() if k not in ("minLength", "maxLength")}
    out["pattern"] = f"^.{{{lo},{'' if hi is None else hi}}}$"
    return out


def _walk(node: Any, path: str) -> Any:
    if isinstance(node, bool):
        return node
    if not isinstance(node, dict):
        raise _fail(f"the schema at {_where(path)} must be an object or a boolean, got {type(node).__name__}")
    _check_node(node, path)
    out: dict = {}
    for key, value in node.items():
        sub = f"{path}/{key}"
        if key in _SCHEMA_MAPS and isinstance(value, dict):
            out[key] = {name: _walk(v, f"{sub}/{name}") for name, v in value.items()}
        elif key in _SCHEMA_ONE and isinstance(value, (dict, bool)):
            out[key] = _walk(value, sub)
        elif key in _SCHEMA_LISTS + ("items",) and isinstance(value, list):
            out[key] = [_walk(v, f"{sub}/{i}") for i, v in enumerate(value)]
        else:
            out[key] = value
    if ("minLength" in out or "maxLength" in out) and _types_of(out) <= {"string", "null"}:
        out = _length_as_pattern(out, path)
    return out


def prepare_json_schema(schema: dict | str | bool) -> str:
    """The schema as compact JSON text for the compiler, or ``InvalidRequestError`` naming what is wrong."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as exc:
            raise _fail(f"not valid JSON ({exc})") from None
    if schema is False:
        raise _fail("the schema 'false' accepts no value")
    prepared = _walk(schema, "")
    try:
        return json.dumps(prepared, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
    except (TypeError, ValueError) as exc:
        raise _fail(f"it cannot be written as JSON ({exc})") from None
