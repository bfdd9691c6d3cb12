"""Engine completions against a dense oracle's logits, for the tests of the KV cache as the models were trained.

``Completion`` is what one greedy request gave: the log-probability of every
prompt token (when asked) and of every generated token. ``agreement`` scores it
against an oracle's logits over the same tokens: the mean and largest absolute
log-probability difference, and whether the oracle's greedy choice at every
generated position is the token the engine generated.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from deepinfer.llm import LLM
from deepinfer.models.common.cache_spec import CacheGeometry, block_size_for
from deepinfer.models.registry import load_config
from deepinfer.outputs import RequestOutput
from deepinfer.sampling_params import SamplingParams

#: mean absolute log-probability difference a float64 engine may have from the oracle (measured: 1e-7 to 3e-7,
#: the sampler's fp32 log-probabilities; up to ~4e-5 where a value pooled in the fp32 compressor state lands
#: within that state's noise of a bf16 / FP8 boundary)
MEAN_ATOL = 1e-3
#: in fp32 a value within ~1e-6 (relative) of a rounding boundary rounds either way, and several such elements
#: in a hundred-token prompt are typical (V4's bf16 rotary channels most of all): on these tiny random models
#: that moves the mean log-probability by up to ~1e-2, so an fp32 engine is held only to being this many times
#: closer to the rounded oracle than to the unrounded one (measured over 12 prompts of 96 tokens each: at
#: least 17 for V4, 100 for V4.1; float64 runs carry the exact comparison)
FP32_SEPARATION = 5


@dataclass
class Completion:
    """One greedy request's prompt and output, with its log-probabilities."""

    prompt: list[int]
    tokens: list[int]
    #: ``[len(prompt)]``: entry ``i`` the log-probability of prompt token ``i`` after the ones before (None at 0,
    #: and for a request that did not ask)
    prompt_logprobs: list[float | None]
    logprobs: list[float]
    cached_tokens: int

    @classmethod
    def of(cls, out: RequestOutput) -> "Completion":
        def value(row) -> float | None:
            return None if row is None else next(iter(row.values())).logprob

        prompt = list(out.prompt_token_ids)
        rows = out.prompt_logprobs or [None] * len(prompt)
        gen = out.outputs[0]
        return cls(prompt, list(gen.token_ids), [value(r) for r in rows], [value(r) for r in gen.logprobs], out.num_cached_tokens)

    @property
    def ids(self) -> list[int]:
        """Prompt and generated tokens: what the oracle runs over."""
        return self.prompt + self.tokens


def greedy(max_tokens: int, prompt_logprobs: bool) -> SamplingParams:
    """Greedy sampling returning each generated token's log-probability (and each prompt token's)."""
    return SamplingParams(temperature=0, max_tokens=max_tokens, logprobs=0, prompt_logprobs=0 if prompt_logprobs else None,
                          ignore_eos=True)


def one_by_one(llm: LLM, requests: list[tuple[list[int], SamplingParams]]) -> list[Completion]:
    """Each request alone, in order (a later one may hit the prefix an earlier one committed)."""
    return [Completion.of(llm.generate([prompt], params)[0]) for prompt, params in requests]


def together(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[Completion]:
    """All prompts in one call (scheduled side by side)."""
    return [Completion.of(out) for out in llm.generate(prompts, params)]


@dataclass
class Agreement:
    """How a completion compares with an oracle's logits."""

    mean: float
    max: float
    #: log-probabilities compared
    count: int
    #: the oracle's argmax at each generated position
    oracle_tokens: list[int]
    engine_tokens: list[int]

    @property
    def same_tokens(self) -> bool:
        return self.oracle_tokens == self.engine_tokens

    def __str__(self) -> str:
        return (f"mean |Δlogprob| {self.mean:.2e}, max {self.max:.2e} over {self.count}; tokens engine {self.engine_tokens} "
                f"oracle {self.oracle_tokens}")


def agreement(done: Completion, logits: torch.Tensor, start: int = 0) -> Agreement:
    """Compare ``done`` with oracle ``logits`` ``[T - start, vocab]`` of its tokens from position ``start`` on
    (the prompt log-probabilities the oracle's rows cover, and every generated one)."""
    lp = torch.log_softmax(logits.double(), dim=-1)
    ids, n = done.ids, len(done.prompt)
    got, want = [], []
    for i in range(max(start, 0) + 1, n):
        if done.prompt_logprobs[i] is not None:
            got.append(done.prompt_logprobs[i])
            want.append(float(lp[i - 1 - start, ids[i]]))
    for k, token in enumerate(done.tokens):
        got.append(done.logprobs[k])
        want.append(float(lp[n - 1 + k - start, token]))
    diff = (torch.tensor(got, dtype=torch.float64) - torch.tensor(want, dtype=torch.float64)).abs()
    oracle_tokens = lp[n - 1 - start : n - 1 - start + len(done.tokens)].argmax(-1).tolist()
    return Agreement(float(diff.mean()), float(diff.max()), len(got), oracle_tokens, done.tokens)


def prompt_logprob_gap(a: Completion, b: Completion) -> float:
    """Mean absolute difference of two completions' prompt log-probabilities (same prompt)."""
    assert a.prompt == b.prompt
    pairs = [(x, y) for x, y in zip(a.prompt_logprobs, b.prompt_logprobs) if x is not None and y is not None]
    return sum(abs(x - y) for x, y in pairs) / len(pairs)


def greedy_bigrams(done: list[Completion], limit: int) -> dict[int, int]:
    """Up to ``limit`` pairs ``a -> b`` that every completion follows (each ``a`` followed by one ``b`` only,
    the prompt's last token included): what a planted draft proposes to agree with those continuations."""
    follows: dict[int, set[int]] = {}
    for d in done:
        seq = [d.prompt[-1], *d.tokens]
        for a, b in zip(seq, seq[1:]):
            follows.setdefault(a, set()).add(b)
    return dict(list({a: next(iter(bs)) for a, bs in follows.items() if len(bs) == 1}.items())[:limit])


def kv_budget(model: str | Path, kv_cache_dtype: str, dtype: torch.dtype, step: int, max_len: int, slots: int, blocks: int) -> int:
    """KV cache bytes of ``slots`` sequence slots and ``blocks`` token blocks (a ``dtype`` model, steps of ``step`` tokens)."""
    config = load_config(Path(model))
    g = CacheGeometry.build(config, block_size_for(config, 16), step, max_len, kv_cache_dtype)
    return slots * g.bytes_per_slot(dtype) + blocks * g.bytes_per_block(dtype)


def check_speculation(ckpt: Path, done: list[Completion], markov_rank: int, tmp_path: Path, engine: dict, tokens: int) -> None:
    """Drafts planted from the greedy continuations ``done`` get some accepted and the rest rejected (rolling
    back rounded rows, closed compress windows and published indexer keys) without changing a token."""
    from .dspark_planting import plant_bigrams

    planted = shutil.copytree(ckpt, tmp_path / "planted")
    plant_bigrams(planted, greedy_bigrams(done, markov_rank))
    llm = LLM(model=str(planted), kv_cache_dtype="auto", swa_replay="exact",
              **dict(engine, speculative_method="dspark", speculative_policy="all"))
    spec = one_by_one(llm, [(d.prompt, greedy(tokens, False)) for d in done])
    assert [s.tokens for s in spec] == [d.tokens for d in done]
    stats = llm.get_metrics()
    assert 0 < stats["spec_accepted_tokens"] < stats["spec_verified_tokens"]


def check_float32(ckpt: Path, engine: dict, prompt: list[int], tokens: int, oracle: Callable[..., torch.Tensor]) -> None:
    """The engine as it runs on the host: ``kv_cache_dtype="model"`` is the unrounded math (today's numerics),
    ``auto`` the rounded one, up to fp32's boundary noise (``FP32_SEPARATION``), and the two measurably apart.
    ``oracle(ids, rounding=...)``: the dense reference's logits."""
    engine = dict(engine, dtype="float32")
    (plain,) = one_by_one(LLM(model=str(ckpt), kv_cache_dtype="model", **engine), [(prompt, greedy(tokens, True))])
    agree = agreement(plain, oracle(plain.ids, rounding=False))
    assert agree.mean <= MEAN_ATOL and agree.same_tokens, str(agree)
    llm = LLM(model=str(ckpt), kv_cache_dtype="auto", **engine)
    assert llm.engine.runner.cache.formats.window is not None
    (rounded,) = one_by_one(llm, [(prompt, greedy(tokens, True))])
    near = agreement(rounded, oracle(rounded.ids, rounding=True)).mean
    far = agreement(rounded, oracle(rounded.ids, rounding=False)).mean
    assert FP32_SEPARATION * near < far, f"fp32 auto: {near:.2e} from the rounded oracle, {far:.2e} from the unrounded"
    assert prompt_logprob_gap(plain, rounded) > 1e-4


def check_preemption(ckpt: Path, engine: dict, prompts: list[list[int]], tokens: int, oracle: Callable[[list[int]], torch.Tensor]) -> None:
    """A KV budget of ten blocks for eight sequences forces preemption by recompute; every request still gives
    the rounded oracle's log-probabilities and greedy tokens (``oracle(ids)``: its logits)."""
    engine = dict(engine, max_num_seqs=8, max_model_len=128, max_num_batched_tokens=32, max_prefill_chunk=32)
    engine["kv_cache_memory"] = kv_budget(ckpt, "auto", torch.float64, step=32, max_len=128, slots=8, blocks=10)
    llm = LLM(model=str(ckpt), kv_cache_dtype="auto", enable_prefix_caching=False, **engine)
    done = together(llm, prompts, greedy(tokens, False))
    assert llm.get_metrics()["preemptions"] > 0
    for d in done:
        agree = agreement(d, oracle(d.ids))
        assert agree.mean <= MEAN_ATOL and agree.same_tokens, str(agree)
