"""Structured output through the engine: constrained sampling, mixed batches, per-request errors."""

import json
import re

import jsonschema
import pytest
import torch

from deepinfer.llm import LLM
from deepinfer.sampling_params import SamplingParams, StructuredOutputsParams
from tests.helpers.checkpoints import BOS_ID, make_tiny_checkpoint
from tests.helpers.plugins import run_cli

SCHEMAS = [
    {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"], "additionalProperties": False},
    {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"], "additionalProperties": False},
    {"type": "object", "properties": {"c": {"enum": ["red", "green", "blue"]}}, "required": ["c"], "additionalProperties": False},
    {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 9}, "minItems": 1, "maxItems": 3},
    {"type": "object", "properties": {"n": {"type": "integer", "minimum": 10, "maximum": 20}}, "required": ["n"], "additionalProperties": False},
    {"type": "object", "properties": {"x": {"anyOf": [{"type": "integer"}, {"type": "boolean"}]}}, "required": ["x"], "additionalProperties": False},
    {"type": "object", "properties": {"p": {"type": "object", "properties": {"q": {"type": "boolean"}}, "required": ["q"], "additionalProperties": False}}, "required": ["p"], "additionalProperties": False},
    {"type": "object", "properties": {"s": {"type": "string", "maxLength": 3}}, "required": ["s"], "additionalProperties": False},
    {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "boolean"}}, "required": ["a"], "additionalProperties": False},
    {"type": "array", "items": {"enum": [1, 2, 3]}, "minItems": 2, "maxItems": 2},
    {"type": "object", "properties": {"v": {"type": "number", "minimum": -1, "maximum": 1}}, "required": ["v"], "additionalProperties": False},
    {"type": "boolean"},
    {"type": "integer", "minimum": -5, "maximum": 5},
    {"enum": ["yes", "no"]},
    {"type": "object", "properties": {"l": {"type": "array", "items": {"type": "boolean"}, "maxItems": 2}}, "required": ["l"], "additionalProperties": False},
    {"type": "object", "properties": {"k": {"const": "fixed"}}, "required": ["k"], "additionalProperties": False},
    {"type": "array", "items": {"type": "object", "properties": {"i": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["i"], "additionalProperties": False}, "maxItems": 2},
    {"type": "object", "properties": {"e": {"enum": [1, "one", True]}}, "required": ["e"], "additionalProperties": False},
    {"type": "null"},
    {"type": "object", "properties": {"t": {"type": "string", "enum": ["ab", "cd"]}, "u": {"type": "integer", "minimum": 0, "maximum": 2}}, "required": ["t", "u"], "additionalProperties": False},
    {"anyOf": [{"type": "integer", "minimum": 0, "maximum": 3}, {"enum": ["none"]}]},
]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ck"), "sliding_hca")


@pytest.fixture(scope="module")
def llm(ckpt):
    return LLM(model=str(ckpt), backend="cpu", kv_cache_memory=64 << 20, max_model_len=256)


PROMPT = [BOS_ID] + list(b"answer: ")


def test_sampled_outputs_validate_against_their_schemas(llm):
    params = [
        SamplingParams(temperature=1.0, max_tokens=60, seed=seed, structured_outputs=StructuredOutputsParams(json=schema))
        for schema in SCHEMAS
        for seed in (0, 1)
    ]
    outs = llm.generate([PROMPT] * len(params), params)
    finished = 0
    for sp, o in zip(params, outs):
        c = o.outputs[0]
        assert o.error is None
        if c.finish_reason == "stop":
            finished += 1
            jsonschema.validate(json.loads(c.text), json.loads(json.dumps(sp.structured_outputs.json)))
        else:
            assert c.finish_reason == "length"  # cut short by max_tokens: a prefix of a valid value
    assert finished >= len(params) * 0.75


def test_regex_and_choice(llm):
    outs = llm.generate(
        [PROMPT] * 3,
        [
            SamplingParams(temperature=1.0, max_tokens=20, seed=3, structured_outputs=StructuredOutputsParams(regex=r"[a-c]{2,4}-\d")),
            SamplingParams(temperature=1.0, max_tokens=20, seed=4, structured_outputs=StructuredOutputsParams(choice=["alpha", "beta"])),
            SamplingParams(temperature=0.0, max_tokens=20, structured_outputs=StructuredOutputsParams(json_object=True)),
        ],
    )
    assert re.fullmatch(r"[a-c]{2,4}-\d", outs[0].outputs[0].text)
    assert outs[1].outputs[0].text in ("alpha", "beta")
    if outs[2].outputs[0].finish_reason == "stop":
        assert isinstance(json.loads(outs[2].outputs[0].text), dict)


@pytest.mark.parametrize("overlap", [False, True])
def test_unconstrained_requests_unchanged_in_mixed_batch(ckpt, overlap):
    llm = LLM(model=str(ckpt), backend="cpu", kv_cache_memory=64 << 20, max_model_len=256, overlap_scheduling=overlap)
    g = torch.Generator().manual_seed(1)
    prompts = [[BOS_ID] + torch.randint(0, 256, (5 + 3 * i,), generator=g).tolist() for i in range(6)]
    greedy = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True)
    alone = [o.outputs[0].token_ids for o in llm.generate(prompts, greedy)]
    constrained = SamplingParams(temperature=0.7, seed=5, max_tokens=30, structured_outputs=StructuredOutputsParams(json=SCHEMAS[0]))
    mixed = llm.generate(prompts + [PROMPT] * 3, [greedy] * len(prompts) + [constrained] * 3)
    assert [o.outputs[0].token_ids for o in mixed[: len(prompts)]] == alone
    for o in mixed[len(prompts):]:
        if o.outputs[0].finish_reason == "stop":
            jsonschema.validate(json.loads(o.outputs[0].text), SCHEMAS[0])


def test_invalid_schema_fails_that_request_only(llm):
    outs = llm.generate(
        [PROMPT, PROMPT, PROMPT],
        [
            SamplingParams(temperature=0, max_tokens=5),
            SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(json='{"type": "object", "properties": ')),
            SamplingParams(max_tokens=5, structured_outputs=StructuredOutputsParams(regex="(ab")),
        ],
    )
    assert outs[0].error is None and len(outs[0].outputs[0].token_ids) > 0
    assert "JSON schema" in outs[1].error and len(outs[1].error.splitlines()) == 1
    assert "regex" in outs[2].error


def test_cli_json_schema(ckpt, tmp_path):
    f = tmp_path / "s.json"
    f.write_text(json.dumps(SCHEMAS[2]))
    proc = run_cli(["generate", "--model", str(ckpt), "--prompt", "answer: ", "--json-schema", str(f), "--max-tokens", "40",
                    "--kv-cache-memory", "64000000", "--max-model-len", "256"])
    assert proc.returncode == 0, proc.stderr
    value = json.loads(proc.stdout.strip())
    jsonschema.validate(value, SCHEMAS[2])
