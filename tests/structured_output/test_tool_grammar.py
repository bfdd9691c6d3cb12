"""Forced tool calls' grammar and the thinking gate, on the bundled tokenizer with real xgrammar (no model).

Random walks through the masked vocabulary (every allowed token equally likely)
end in replies that the server's parsers read as calls whose arguments validate
against their tool's schema; the chat formats' own renderings of calls are
accepted; ``tool_choice`` errors name the field.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import jsonschema
import pytest
from tokenizers import Tokenizer

from deepinfer.chat.deepseek_v4 import _invoke
from deepinfer.chat.messages import ToolCall
from deepinfer.chat.tool_grammar import parse_tool_choice, tool_call_constraint
from deepinfer.sampling_params import InvalidRequestError
from deepinfer.serve.chat_parsing import parse_chat_output
from deepinfer.structured_output import GrammarCompilerCache, allocate_bitmask
from deepinfer.structured_output.thinking import ThinkingGate, thinking_markers
from deepinfer_interfaces.kernels import unpack_bitmask
from deepinfer.engine import BUNDLED_MODEL

WEATHER = {"type": "object", "properties": {
    "city": {"type": "string", "maxLength": 6},
    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
    "window": {"type": "object", "properties": {"days": {"type": "integer", "minimum": 1, "maximum": 7}}, "required": ["days"]},
}, "required": ["city", "unit", "window"]}
LOOKUP = {"type": "object", "properties": {"ids": {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "maxItems": 2},
                                            "exact": {"type": "boolean"}}, "required": ["ids"]}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": WEATHER}},
         {"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}}]
SCHEMAS = {"get_weather": WEATHER, "lookup": LOOKUP}
EOS = 1


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_file(str(Path(BUNDLED_MODEL) / "tokenizer.json"))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompilerCache:
    return GrammarCompilerCache(tokenizer, tokenizer.get_vocab_size(), EOS)


def _walk(matcher, rng: random.Random, cap: int = 2000) -> list[int]:
    """Tokens drawn uniformly from what ``matcher`` allows, until it takes the end token (or ``cap``)."""
    out: list[int] = []
    mask = allocate_bitmask(1, 4096)
    while len(out) < cap and not matcher.is_terminated:
        matcher.fill_bitmask(mask, 0)
        allowed = unpack_bitmask(mask, 4096)[0].nonzero().flatten().tolist()
        token = EOS if EOS in allowed and rng.random() < 0.5 else rng.choice(allowed)
        assert matcher.accept(token)
        out.append(token)
    return out


@pytest.mark.parametrize("fmt", ["hermes", "deepseek_v4"])
@pytest.mark.parametrize("choice,parallel", [("required", False), ("required", True),
                                             ({"type": "function", "function": {"name": "lookup"}}, True)])
def test_random_replies_are_valid_calls(compiler, tokenizer, fmt, choice, parallel):
    constraint = tool_call_constraint(fmt, TOOLS, choice, parallel)
    rng = random.Random(7)
    counts = set()
    for _ in range(6):
        tokens = _walk(compiler.request_grammar(constraint), rng)
        assert tokens[-1] == EOS
        parsed = parse_chat_output("", tokenizer.decode(tokens[:-1]), tool_parser=fmt)
        assert parsed.content is None and parsed.tool_calls
        counts.add(len(parsed.tool_calls))
        for call in parsed.tool_calls:
            assert isinstance(choice, str) or call.name == "lookup"
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert counts == {1} if not parallel else max(counts) > 1  # parallel: some reply makes several calls


def test_rendered_calls_are_accepted(compiler, tokenizer):
    """The chat formats' own writing of calls is a sentence of the grammar; a second call only when parallel."""
    call = ToolCall("get_weather", {"city": "Oslo", "unit": "celsius", "window": {"days": 3}})
    hermes = '<tool_call>{"name": "get_weather", "arguments": ' + json.dumps(call.arguments) + "}</tool_call>"
    dsml = f"<｜DSML｜tool_calls>\n{_invoke(call)}\n</｜DSML｜tool_calls>"
    dsml_two = f"<｜DSML｜tool_calls>\n{_invoke(call)}\n{_invoke(call)}\n</｜DSML｜tool_calls>"

    def accepts(fmt: str, text: str, choice="required", parallel=True) -> bool:
        grammar = compiler.request_grammar(tool_call_constraint(fmt, TOOLS, choice, parallel))
        ok = all(grammar.accept(t) for t in tokenizer.encode(text, add_special_tokens=False).ids)
        return ok and grammar.accept(EOS)

    assert accepts("hermes", hermes) and accepts("hermes", hermes + "\n" + hermes)
    assert not accepts("hermes", hermes + "\n" + hermes, parallel=False)
    assert not accepts("hermes", hermes, {"type": "function", "function": {"name": "lookup"}})
    assert not accepts("hermes", hermes.replace("celsius", "kelvin"))
    assert accepts("deepseek_v4", dsml) and accepts("deepseek_v4", dsml_two)
    assert not accepts("deepseek_v4", dsml_two, parallel=False)


@pytest.mark.parametrize("choice,tools,problem", [
    ({"type": "function", "function": {"name": "nope"}}, TOOLS, "names the function 'nope'"),
    ({"type": "function", "function": {}}, TOOLS, "names no function"),
    ({"type": "tool"}, TOOLS, "is not one of"),
    ("sometimes", TOOLS, "is not one of"),
    ("required", None, "declares no tools"),
])
def test_bad_tool_choice_names_the_field(choice, tools, problem):
    with pytest.raises(InvalidRequestError, match=problem) as info:
        parse_tool_choice(choice, tools)
    assert info.value.param == "tool_choice"
    assert tool_call_constraint("hermes", TOOLS, "auto") is None and tool_call_constraint("hermes", TOOLS, "none") is None


def test_thinking_gate_forces_the_end_and_rolls_back(compiler, tokenizer):
    markers = thinking_markers(tokenizer)
    prompt = tokenizer.encode("User: hi\nAssistant: <think>", add_special_tokens=False).ids
    end = list(markers.encode("</think>"))
    inner = compiler.request_grammar(tool_call_constraint("hermes", TOOLS, "required", False))
    gate = ThinkingGate(markers, prompt, 3, inner)
    words = tokenizer.encode(" so we go on", add_special_tokens=False).ids
    assert gate.in_reasoning and all(gate.accept(t) for t in words[:3])
    assert not gate.accept(words[3])  # the budget is spent: only the closing tokens
    assert gate.validate_draft(end + words) == len(end)  # a draft past the forced end is cut there
    for t in end:
        mask = allocate_bitmask(1, 4096)
        gate.fill_bitmask(mask, 0)
        assert unpack_bitmask(mask, 4096)[0].nonzero().flatten().tolist() == [t]
        assert gate.accept(t)
    assert not gate.in_reasoning and not gate.accept(words[0])  # the answer is the tool call's grammar
    gate.rollback(len(end) + 1)
    assert gate.in_reasoning and gate.num_tokens == 2 and gate.accept(words[2])
    free = ThinkingGate(markers, prompt, None, None)  # no budget: the model closes its reasoning itself
    assert all(free.accept(t) for t in words + end) and not free.in_reasoning
    opened = ThinkingGate(markers, tokenizer.encode("Assistant: ", add_special_tokens=False).ids, 0, None)
    assert not opened.in_reasoning and all(opened.accept(t) for t in markers.encode(" <think>"))
    assert opened.in_reasoning and not opened.accept(words[0])  # a budget of 0 closes at once
