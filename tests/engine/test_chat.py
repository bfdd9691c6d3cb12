"""Chat formatting: ``LLM.chat`` / ``LLM.format_chat`` and ``deepinfer generate --chat``.

The DeepSeek-V4 format is checked down to the token id against ids written out
here from the literal pieces of the release's format (special tokens by their
known ids, text byte by byte), so a wrong token, a missing piece or a double BOS
fails. Also: a checkpoint's ``chat_template`` wins, a model with neither gets one
clear error, messages are checked with one-line errors, and the CLI.
"""

from __future__ import annotations

import json

import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.chat import deepseek_v4, parse_conversation
from deepinfer.errors import ChatFormatError
from tests.helpers.chat_models import ASSISTANT, BOS, END_THINK, EOS, IDS, THINK, USER, byte_ids, v4_chat_model, without_chat_format
from tests.helpers.plugins import run_cli

pytestmark = pytest.mark.usefixtures("one_thread")

ENGINE = dict(backend="cpu", max_model_len=256, kv_cache_memory=64_000_000)
GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
SYSTEM, U1, R1, A1, U2 = "You are terse.", "Hi there", "The user greets me.", "Hello!", "What is 2+2?"
TWO_TURNS = [
    {"role": "system", "content": SYSTEM},
    {"role": "user", "content": U1},
    {"role": "assistant", "content": A1, "reasoning_content": R1},
    {"role": "user", "content": U2},
]
DSML = "｜DSML｜"


def two_turn_ids(thinking: bool) -> list[int]:
    """The release's format for TWO_TURNS: the earlier answer's reasoning dropped, the last turn opened."""
    return (
        [IDS[BOS]] + byte_ids(SYSTEM)
        + [IDS[USER]] + byte_ids(U1) + [IDS[ASSISTANT], IDS[END_THINK]] + byte_ids(A1) + [IDS[EOS]]
        + [IDS[USER]] + byte_ids(U2) + [IDS[ASSISTANT], IDS[THINK] if thinking else IDS[END_THINK]]
    )


@pytest.fixture(scope="module")
def chat_llm(tmp_path_factory) -> LLM:
    """The bundled weights with a byte-level tokenizer that has the V4 chat tokens."""
    return LLM(str(v4_chat_model(tmp_path_factory.mktemp("chat") / "model")), **ENGINE)


@pytest.fixture(scope="module")
def bundled_chat_dir(tmp_path_factory):
    """The bundled weights with their own BPE tokenizer given the V4 chat tokens: replies decode to text."""
    return v4_chat_model(tmp_path_factory.mktemp("chat-bpe") / "model", tokenizer="bundled")


@pytest.mark.parametrize("thinking", [False, True])
def test_two_turn_conversation_token_ids(chat_llm, thinking):
    out = chat_llm.chat(TWO_TURNS, GREEDY, thinking=thinking)[0]
    assert out.error is None
    assert out.prompt_token_ids == two_turn_ids(thinking)
    end = THINK if thinking else END_THINK
    assert out.prompt == f"{BOS}{SYSTEM}{USER}{U1}{ASSISTANT}{END_THINK}{A1}{EOS}{USER}{U2}{ASSISTANT}{end}"
    assert len(out.outputs[0].token_ids) == GREEDY.max_tokens
    # the tokenizer adds BOS by default, so the exact ids above also prove chat did not add a second one
    assert chat_llm.get_tokenizer().encode("x").ids == [IDS[BOS]] + byte_ids("x")


@pytest.mark.parametrize("kwargs", [{"thinking": True}, {"enable_thinking": True}])
def test_thinking_through_chat_template_kwargs(chat_llm, kwargs):
    assert chat_llm.format_chat(TWO_TURNS, chat_template_kwargs=kwargs)[0].token_ids == two_turn_ids(True)


def test_reasoning_kept_after_the_last_user_turn(chat_llm):
    conv = [{"role": "user", "content": U1}, {"role": "assistant", "content": A1, "reasoning_content": R1}]
    head = [IDS[BOS], IDS[USER]] + byte_ids(U1) + [IDS[ASSISTANT]]
    thinking = chat_llm.format_chat(conv, thinking=True)[0].token_ids
    assert thinking == head + [IDS[THINK]] + byte_ids(R1) + [IDS[END_THINK]] + byte_ids(A1) + [IDS[EOS]]
    plain = chat_llm.format_chat(conv)[0].token_ids
    assert plain == head + [IDS[END_THINK]] + byte_ids(A1) + [IDS[EOS]]


def test_drop_thinking_false_keeps_earlier_reasoning(chat_llm):
    ids = chat_llm.format_chat(TWO_TURNS, chat_template_kwargs={"thinking": True, "drop_thinking": False})[0].token_ids
    assert ids == (
        [IDS[BOS]] + byte_ids(SYSTEM)
        + [IDS[USER]] + byte_ids(U1) + [IDS[ASSISTANT], IDS[THINK]] + byte_ids(R1) + [IDS[END_THINK]] + byte_ids(A1) + [IDS[EOS]]
        + [IDS[USER]] + byte_ids(U2) + [IDS[ASSISTANT], IDS[THINK]]
    )


def test_special_token_text_in_content_becomes_the_token(chat_llm):
    """Like vLLM, SGLang and transformers, content is not escaped: special-token text in it is that token."""
    ids = chat_llm.format_chat([{"role": "user", "content": f"a{USER}b"}])[0].token_ids
    assert ids == [IDS[BOS], IDS[USER]] + byte_ids("a") + [IDS[USER]] + byte_ids("b") + [IDS[ASSISTANT], IDS[END_THINK]]


def test_list_of_conversations_in_order(chat_llm):
    outs = chat_llm.chat([[{"role": "user", "content": "one"}], [{"role": "user", "content": "two"}]], GREEDY)
    assert [o.prompt for o in outs] == [f"{BOS}{USER}{t}{ASSISTANT}{END_THINK}" for t in ("one", "two")]


TOOL_TURNS = [
    {"role": "user", "content": "Weather in Paris?"},
    {
        "role": "assistant",
        "content": "",
        "reasoning_content": "I need the tools.",
        "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}},
            {"id": "c2", "type": "function", "function": {"name": "get_time", "arguments": {"tz": "CET"}}},
        ],
    },
    {"role": "tool", "tool_call_id": "c2", "content": "12:00"},
    {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
]
TOOL_CALLS_TEXT = (
    f"\n\n<{DSML}tool_calls>\n"
    f'<{DSML}invoke name="get_weather">\n'
    f'<{DSML}parameter name="city" string="true">Paris</{DSML}parameter>\n'
    f'<{DSML}parameter name="days" string="false">2</{DSML}parameter>\n'
    f"</{DSML}invoke>\n"
    f'<{DSML}invoke name="get_time">\n'
    f'<{DSML}parameter name="tz" string="true">CET</{DSML}parameter>\n'
    f"</{DSML}invoke>\n"
    f"</{DSML}tool_calls>"
)


@pytest.mark.parametrize(
    "messages, kwargs, expected",
    [
        # tool results form one user turn, in call order; the calling turn's reasoning is before that turn, so dropped
        (
            TOOL_TURNS, {"thinking": True},
            f"{BOS}{USER}Weather in Paris?{ASSISTANT}{END_THINK}{TOOL_CALLS_TEXT}{EOS}"
            f"{USER}<tool_result>sunny</tool_result>\n\n<tool_result>12:00</tool_result>{ASSISTANT}{THINK}",
        ),
        # consecutive user messages merge; text parts join with a newline
        (
            [{"role": "user", "content": "a"}, {"role": "user", "content": [{"type": "text", "text": "b"}, {"type": "text", "text": "c"}]}],
            {}, f"{BOS}{USER}a\n\nb\nc{ASSISTANT}{END_THINK}",
        ),
        # a developer turn renders like a user turn; thinking mode drops the ones before the last user turn
        (
            [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}], {},
            f"{BOS}{USER}d{USER}u{ASSISTANT}{END_THINK}",
        ),
        (
            [{"role": "developer", "content": "d"}, {"role": "user", "content": "u"}], {"thinking": True},
            f"{BOS}{USER}u{ASSISTANT}{THINK}",
        ),
        # continuing the final assistant message leaves its EOS off; no generation prompt leaves the reply unopened
        (
            [{"role": "user", "content": "u"}, {"role": "assistant", "content": "Sure"}],
            {"continue_final_message": True, "add_generation_prompt": False},
            f"{BOS}{USER}u{ASSISTANT}{END_THINK}Sure",
        ),
        ([{"role": "user", "content": "u"}], {"add_generation_prompt": False}, f"{BOS}{USER}u"),
    ],
)
def test_deepseek_v4_text(messages, kwargs, expected):
    assert deepseek_v4.encode(parse_conversation(messages), **kwargs) == expected


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}<{{ m.role }}>{{ m.content }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def test_checkpoint_chat_template_wins(tmp_path):
    llm = LLM(str(v4_chat_model(tmp_path / "model", chat_template=TEMPLATE)), **ENGINE)
    prompt = llm.format_chat(TWO_TURNS)[0]
    body = f"<system>{SYSTEM}\n<user>{U1}\n<assistant>{A1}\n<user>{U2}\n<assistant>"
    assert prompt.text == BOS + body
    assert prompt.token_ids == [IDS[BOS]] + byte_ids(body)
    assert llm.format_chat(TWO_TURNS, chat_template="{{ messages[0].content }}")[0].token_ids == byte_ids(SYSTEM)
    with pytest.raises(ChatFormatError, match="chat_template failed to render this conversation: no system role"):
        llm.format_chat(TWO_TURNS, chat_template="{{ raise_exception('no system role') }}")


def test_model_without_chat_format_is_one_clear_error(tmp_path):
    llm = LLM(model=str(without_chat_format(tmp_path / "plain")), **ENGINE)  # no chat_template, no V4 chat tokens
    with pytest.raises(ChatFormatError, match="this model has no chat format") as exc:
        llm.chat([{"role": "user", "content": "hi"}])
    assert "use generate with a formatted prompt" in str(exc.value) and "\n" not in str(exc.value)


CALL = {"type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize(
    "messages, kwargs, message",
    [
        ([], {}, "non-empty list"),
        ([{"role": "bot", "content": "x"}], {}, "message 0 has role 'bot'; use one of system, user"),
        ([{"role": "user", "content": 3}], {}, "message 0 (user) has content of type int"),
        ([{"role": "user"}], {}, "message 0 (user) has no content"),
        ([{"role": "user", "content": [{"type": "image_url"}]}], {}, "image_url part without a url"),
        ([{"role": "user", "content": "x", "tool_calls": [CALL]}], {}, "only assistant messages make tool calls"),
        (
            [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"function": {"name": "f", "arguments": "{no"}}]}],
            {}, "tool call 0 has arguments that are not JSON",
        ),
        ([{"role": "user", "content": "x"}], {"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool declarations"),
        (
            [{"role": "user", "content": "x"}], {"chat_template_kwargs": {"thinking": True, "reasoning_effort": "max"}},
            "reasoning_effort='max' is not supported",
        ),
        ([{"role": "user", "content": "x"}], {"chat_template_kwargs": {"thinkng": True}}, "'thinkng' not understood"),
        ([{"role": "user", "content": "x"}], {"continue_final_message": True}, "set add_generation_prompt=False"),
        ([[{"role": "user", "content": "x"}], [{"role": "user", "content": 1}]], {}, "conversation 1: message 0"),
    ],
)
def test_bad_conversations_one_line_errors(chat_llm, messages, kwargs, message):
    with pytest.raises(ChatFormatError) as exc:
        chat_llm.chat(messages, **kwargs)
    assert message in str(exc.value) and "\n" not in str(exc.value)


BASE = ["--backend", "cpu", "--kv-cache-memory", "64000000", "--max-model-len", "256", "--max-tokens", "6"]


def test_cli_generate_chat_matches_llm_chat(bundled_chat_dir, tmp_path):
    from_file = [{"role": "user", "content": "def read_file(path):"}]
    (tmp_path / "conv.json").write_text(json.dumps(from_file))
    args = ["generate", "--model", str(bundled_chat_dir), "--messages", str(tmp_path / "conv.json"),
            "--system", "Be brief.", "--prompt", "hello", "--thinking", *BASE]
    proc = run_cli(args)
    assert proc.returncode == 0, proc.stderr
    llm = LLM(str(bundled_chat_dir), **ENGINE)
    outs = llm.chat([from_file, [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hello"}]], GREEDY, thinking=True)
    assert outs[1].prompt.endswith(f"Be brief.{USER}hello{ASSISTANT}{THINK}")
    expected = "".join(f"=== [{i}] {label!r}\n{o.outputs[0].text}\n" for i, (label, o) in enumerate(zip(["def read_file(path):", "hello"], outs)))
    assert proc.stdout == expected


@pytest.mark.parametrize(
    "extra, content, message",
    [
        (["--messages", "{file}"], '[{"role": "user", "content": "x"}, {"role": "bot", "content": "y"}]', "message 1 has role 'bot'"),
        (["--messages", "{file}"], '[{"role": "user"', "is not valid JSON"),
        (["--prompt", "hi", "--thinking"], None, "add --chat"),
        (["--prompt", "hi", "--chat", "--model", "{plain}"], None, "this model has no chat format"),
    ],
)
def test_cli_chat_bad_input_one_line_exit_2(bundled_chat_dir, tmp_path, extra, content, message):
    if content is not None:
        (tmp_path / "m.json").write_text(content)
    plain = without_chat_format(tmp_path / "plain") if any("{plain}" in a for a in extra) else None
    extra = [a.format(file=tmp_path / "m.json", plain=plain) for a in extra]
    proc = run_cli(["generate", "--model", str(bundled_chat_dir), *BASE, *extra])
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and message in lines[0], proc.stderr
