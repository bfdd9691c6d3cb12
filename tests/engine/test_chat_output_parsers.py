"""Chat output parsing (``deepinfer.serve.chat_parsing``): reasoning, content and tool calls, whole and streamed.

Every case is checked against its expected fields and, under many
fragmentations of its text (whole, one character at a time, random cuts with
fixed seeds, cuts inside every marker), for the streaming invariants: the
streamed reasoning, content and argument pieces concatenate to the
non-streaming fields, each call's first delta carries its id and name, and the
streamed result equals ``parse_chat_output`` on the whole text.
"""

from __future__ import annotations

import json
import random
import re

import pytest

from deepinfer.chat import deepseek_v4, parse_conversation
from deepinfer.chat.deepseek_v4 import DSML, END_THINK, EOS, THINK
from deepinfer.serve.chat_parsing import TOOL_PARSERS, ChatDelta, ChatOutputParser, ParsedChat, parse_chat_output

THINKING = "<｜begin▁of▁sentence｜><｜User｜>Weather?<｜Assistant｜><think>"
PLAIN = "<｜begin▁of▁sentence｜><｜User｜>Weather?<｜Assistant｜></think>"
OPEN, CLOSE = f"<{DSML}tool_calls>", f"</{DSML}tool_calls>"


def invoke(name: str, *params: tuple[str, str, str]) -> str:
    """A DSML invoke; params are (name, "true"/"false", raw value)."""
    body = "\n".join(f'<{DSML}parameter name="{k}" string="{s}">{v}</{DSML}parameter>' for k, s, v in params)
    return f'<{DSML}invoke name="{name}">\n{body}\n</{DSML}invoke>'


def block(*invokes: str) -> str:
    return f"\n\n{OPEN}\n" + "\n".join(invokes) + f"\n{CLOSE}"


WEATHER = invoke("get_weather", ("city", "true", "Paris"), ("days", "false", "3"))
WEATHER_ARGS = {"city": "Paris", "days": 3}
MALFORMED = f"Let me check.\n\n{OPEN}\n<{DSML}invoke nam=\"x\">\n{CLOSE}"
UNFINISHED = f"Let me check.\n\n{OPEN}\n<{DSML}invoke name=\"get_weather\""
HERMES_TWO = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>\n<tool_call>\n{"name": "g", "arguments": {"b": "ü"}}\n</tool_call>'

# id: (prompt, text, parser options, expected reasoning, content, [(name, arguments as a dict)])
CASES = {
    "thinking_from_prompt": (THINKING, "The user wants weather.</think>It is sunny.", {}, "The user wants weather.", "It is sunny.", []),
    "prompt_think_then_whitespace": (THINKING + "\n", "a</think>b", {}, "a", "b", []),
    "output_opens_think": (PLAIN[: -len(END_THINK)], "\n <think>hmm</think>\n\nAnswer", {}, "hmm", "\n\nAnswer", []),
    "no_end_think": (THINKING, "still thinking <｜DSML｜tool_calls> </thin", {}, "still thinking <｜DSML｜tool_calls> </thin", "", []),
    "not_thinking": (PLAIN, "Plain answer with </think> and <think> inside.", {}, None, "Plain answer with </think> and <think> inside.", []),
    "reasoning_off": (THINKING, "<think>a</think>b", {"reasoning": False}, None, "<think>a</think>b", []),
    "one_call": (THINKING, "Need weather.</think>Sure." + block(WEATHER), {}, "Need weather.", "Sure.", [("get_weather", WEATHER_ARGS)]),
    "call_without_content": (PLAIN, block(WEATHER), {}, None, None, [("get_weather", WEATHER_ARGS)]),
    "multiple_calls": (
        PLAIN,
        "Two." + block(WEATHER, invoke("get_time", ("tz", "true", "Europe/Paris")), invoke("ping")),
        {},
        None,
        "Two.",
        [("get_weather", WEATHER_ARGS), ("get_time", {"tz": "Europe/Paris"}), ("ping", {})],
    ),
    "non_string_params": (
        PLAIN,
        block(invoke("f", ("n", "false", "1.5"), ("ok", "false", "true"), ("none", "false", "null"), ("xs", "false", '[1, {"a": "b"}]'),
                     ("bad", "false", "not json"), ("num_text", "true", "42"))),
        {},
        None,
        None,
        [("f", {"n": 1.5, "ok": True, "none": None, "xs": [1, {"a": "b"}], "bad": "not json", "num_text": "42"})],
    ),
    "unicode": (
        THINKING,
        "思考中…</think>Héllo 🌍 ｜ <" + block(invoke("翻訳", ("text", "true", "日本語\n\"quoted\" ｜DSML｜"))),
        {},
        "思考中…",
        "Héllo 🌍 ｜ <",
        [("翻訳", {"text": '日本語\n"quoted" ｜DSML｜'})],
    ),
    "tight_whitespace": (PLAIN, f"x{OPEN}{WEATHER.replace(chr(10), '')}{CLOSE}", {}, None, "x", [("get_weather", WEATHER_ARGS)]),
    "content_after_block": (PLAIN, "a" + block(WEATHER) + "\n\nb", {}, None, "ab", [("get_weather", WEATHER_ARGS)]),
    "tool_parsing_off": (PLAIN, "Sure." + block(WEATHER), {"tool_parser": None}, None, "Sure." + block(WEATHER), []),
    "tools_in_reasoning": (THINKING, "maybe" + block(WEATHER) + "</think>no", {}, "maybe" + block(WEATHER), "no", []),
    "malformed_block": (PLAIN, MALFORMED, {}, None, MALFORMED, []),
    "malformed_then_more": (PLAIN, MALFORMED + "\nafter", {}, None, MALFORMED + "\nafter", []),
    "unfinished_block": (PLAIN, UNFINISHED, {}, None, UNFINISHED, []),
    "partial_marker_at_end": (PLAIN, "Sure.\n\n<｜DSML｜tool", {}, None, "Sure.\n\n<｜DSML｜tool", []),
    # a call whose invoke tag was streamed stays a call; the unparsed rest goes to content
    "garbage_after_invoke": (
        PLAIN,
        f"{OPEN}\n{WEATHER}\n<{DSML}invoke name=\"g\">\n<{DSML}parameter name=\"a\" string=\"true\">1</{DSML}parameter>\nJUNK",
        {},
        None,
        "\nJUNK",
        [("get_weather", WEATHER_ARGS), ("g", {"a": "1"})],
    ),
    "hermes": (PLAIN, "Calling.\n" + HERMES_TWO + "\n", {"tool_parser": "hermes"}, None, "Calling.", [("f", {"a": 1}), ("g", {"b": "ü"})]),
    "hermes_malformed": (PLAIN, "x\n<tool_call>{oops}</tool_call> y", {"tool_parser": "hermes"}, None, "x\n<tool_call>{oops}</tool_call> y", []),
    "hermes_string_arguments": (PLAIN, '<tool_call>{"name": "f", "arguments": "{\\"a\\": [1]}"}</tool_call>', {"tool_parser": "hermes"}, None, None, [("f", {"a": [1]})]),
    "hermes_list_arguments": (PLAIN, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', {"tool_parser": "hermes"}, None, '<tool_call>{"name": "f", "arguments": [1]}</tool_call>', []),
    "hermes_unfinished": (PLAIN, '<tool_call>{"name": "f"', {"tool_parser": "hermes"}, None, '<tool_call>{"name": "f"', []),
    "dsml_text_under_hermes": (PLAIN, "a" + block(WEATHER), {"tool_parser": "hermes"}, None, "a" + block(WEATHER), []),
}

MARKERS = (THINK, END_THINK, OPEN, CLOSE, f"<{DSML}invoke", f"</{DSML}invoke>", f"<{DSML}parameter", f"</{DSML}parameter>", "<tool_call>", "</tool_call>")


def _cut(text: str, points: set[int]) -> list[str]:
    bounds = [0, *sorted(p for p in points if 0 < p < len(text)), len(text)]
    return [text[a:b] for a, b in zip(bounds, bounds[1:])]


def _marker_spans(text: str) -> list[tuple[int, int]]:
    return [(m.start(), m.end()) for marker in MARKERS for m in re.finditer(re.escape(marker), text)]


FRAGMENTATIONS = {
    "whole": lambda t: [t],
    "chars": lambda t: list(t),
    **{f"random{seed}": (lambda t, seed=seed: _cut(t, set(random.Random(seed).sample(range(len(t) + 1), min(len(t), 1 + len(t) // 4))))) for seed in range(3)},
    "marker_middles": lambda t: _cut(t, {(a + b) // 2 for a, b in _marker_spans(t)}),
    "inside_markers": lambda t: _cut(t, {p for a, b in _marker_spans(t) for p in range(a + 1, b)}),
}


def stream(prompt: str, pieces: list[str], **options) -> tuple[list[ChatDelta], ParsedChat]:
    parser = ChatOutputParser(prompt, **options)
    deltas = [parser.feed(p) for p in pieces]
    deltas.append(parser.finish())
    return deltas, parser.result()


def shape(parsed: ParsedChat) -> tuple:
    """The fields without the random call ids, arguments parsed (their exact text is checked separately)."""
    return parsed.reasoning, parsed.content, [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls]


def check_streaming(deltas: list[ChatDelta], result: ParsedChat) -> None:
    assert "".join(d.reasoning for d in deltas) == (result.reasoning or "")
    assert "".join(d.content for d in deltas) == (result.content or "")
    streamed: dict[int, list] = {}
    for d in deltas:
        for call in d.tool_calls:
            if call.index not in streamed:
                assert call.id is not None and call.name is not None, "a call's first delta carries its id and name"
                streamed[call.index] = [call.id, call.name, call.arguments]
            else:
                assert call.id is None and call.name is None
                streamed[call.index][2] += call.arguments
    assert sorted(streamed) == list(range(len(result.tool_calls)))
    assert [tuple(streamed[i]) for i in sorted(streamed)] == [(c.id, c.name, c.arguments) for c in result.tool_calls]


@pytest.mark.parametrize("fragmentation", FRAGMENTATIONS)
@pytest.mark.parametrize("case", CASES)
def test_stream_matches_whole(case: str, fragmentation: str) -> None:
    prompt, text, options, reasoning, content, calls = CASES[case]
    pieces = FRAGMENTATIONS[fragmentation](text)
    assert "".join(pieces) == text
    deltas, result = stream(prompt, pieces, **options)
    check_streaming(deltas, result)
    assert shape(result) == (reasoning, content, calls)
    assert shape(result) == shape(parse_chat_output(prompt, text, **options))
    for call, (_, args) in zip(result.tool_calls, calls):
        assert call.arguments == json.dumps(args, ensure_ascii=False)  # default separators, parameters in order


def test_argument_fragments_and_header() -> None:
    parser = ChatOutputParser(PLAIN)
    assert parser.feed("Sure.\n\n<｜DSML").content == "Sure."
    head = parser.feed(f"｜tool_calls>\n{WEATHER.split(chr(10))[0]}\n")
    assert [(c.index, c.name, c.arguments) for c in head.tool_calls] == [(0, "get_weather", "")]
    assert head.tool_calls[0].id and head.content == ""
    rest = [parser.feed(line + "\n").tool_calls for line in WEATHER.split("\n")[1:]]
    assert [[c.arguments for c in r] for r in rest] == [['{"city": "Paris"'], [', "days": 3'], ["}"]]
    assert parser.feed(CLOSE).empty() and parser.finish().empty()


def test_call_ids_are_unique_and_openai_shaped() -> None:
    text = block(*[invoke(f"f{i}") for i in range(20)])
    ids = [c.id for c in parse_chat_output(PLAIN, text).tool_calls]
    assert len(set(ids)) == 20 and all(re.fullmatch(r"call_[0-9a-f]{24}", i) for i in ids)


def test_unknown_tool_parser() -> None:
    with pytest.raises(ValueError, match="deepseek_v4, hermes"):
        ChatOutputParser(PLAIN, tool_parser="mistral")
    assert TOOL_PARSERS == ("deepseek_v4", "hermes")


def test_feed_after_finish_is_an_error() -> None:
    parser = ChatOutputParser(PLAIN)
    parser.finish()
    with pytest.raises(RuntimeError):
        parser.feed("x")


ROUND_TRIP_ARGS = [
    {"city": "Paris", "days": 3},
    {"query": "naïve café ✓ ｜", "limit": 2.5, "exact": False, "tags": ["a", "b"], "filter": {"lang": "fr", "n": None}, "code": 'print("hi")\n'},
    {},
]


@pytest.mark.parametrize("thinking", [True, False])
def test_round_trip_with_the_deepseek_v4_encoder(thinking: bool) -> None:
    calls = [{"id": f"call_{i}", "type": "function", "function": {"name": f"tool_{i}", "arguments": json.dumps(a)}} for i, a in enumerate(ROUND_TRIP_ARGS)]
    conversation = parse_conversation([
        {"role": "user", "content": "Do things."},
        {"role": "assistant", "content": "On it.", "reasoning_content": "Three tools.", "tool_calls": calls},
    ])
    prompt = deepseek_v4.encode(conversation[:1], thinking=thinking)
    full = deepseek_v4.encode(conversation, thinking=thinking, add_generation_prompt=False)
    assert full.startswith(prompt) and full.endswith(EOS)
    output = full[len(prompt) : -len(EOS)]
    assert output == deepseek_v4._assistant(conversation[1], keep_reasoning=thinking, eos=False)
    for pieces in ([output], list(output)):
        deltas, result = stream(prompt, pieces)
        check_streaming(deltas, result)
        assert result.reasoning == ("Three tools." if thinking else None)
        assert result.content == "On it."
        assert [(c.name, c.arguments) for c in result.tool_calls] == [(f"tool_{i}", json.dumps(a, ensure_ascii=False)) for i, a in enumerate(ROUND_TRIP_ARGS)]
