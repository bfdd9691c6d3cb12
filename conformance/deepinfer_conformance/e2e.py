"""End-to-end parity: the whole model on the backend against the reference, in several cases.

The reference (reference ``Kernels`` on the CPU in fp32) decodes from a few
fixed prompts, keeping each step's next-token log-probabilities (in fp64, so
the KL of two close distributions is not lost in the rounding of its own
sum). The backend (its device and kernels, in its dtype) then runs the same
steps fed the reference's tokens (teacher forcing: prefill, then one token per
step), so its distribution at every step is compared on the same context, and
its greedy choice at step ``i`` is what it would have generated alone up to its
first divergence.

The cases (``CASES``; ``op`` of each result):

- ``greedy``: every prompt in one batch, greedy, in the run's dtype.
- ``greedy-graph`` (with graph mode): the same steps replayed from graphs the
  device captured, judged against the backend's own eager run.
- ``single``: one request decoding alone (a batch of one at every step).
- ``sample``: the backend's ``sample`` kernel against the reference's on the
  same logits (the reference's) and the same seeded Exp(1) noise, per sampling
  setting (temperature, top-k, top-p, min-p, and all of them mixed in one
  batch with greedy rows; ``one_row``: the mixed settings one row per call,
  as a request decoding alone samples): the same noise must give the same
  tokens, each call a result of its batch's shape, and ``sampling_probs`` the
  same distributions.
- ``constrained``: greedy decoding through ``apply_token_bitmask``: every step
  a seeded grammar-like bitmask (a quarter of the vocabulary open, or a single
  forced token) in xgrammar's layout; the backend must mask exactly those
  tokens and then agree with the reference like ``greedy``.
- ``clamp``: ``greedy`` on a copy of the model whose ``swiglu_limit`` is set
  low enough that about one SwiGLU input in ten reaches the clamp (the
  message says how many did in the reference run).
- ``greedy-bf16``: ``greedy`` with the backend in bf16 under the bf16
  tolerances, where the run's dtype is fp32 and the device lists bf16.

Per prompt: the first step whose greedy token differs, the mean and largest
KL(reference ‖ backend), and the smallest overlap of the two top-k token sets.
A divergence is accepted as a warning only when the reference itself saw a near
tie there: its log-probability of the backend's token is within the dtype's
``logprob`` tolerance of its own choice (the spirit of vLLM's logprob-closeness
check). Each case runs its prompts as one batch, so a run costs one prefill
and one step per generated token on each side; the reference's runs are made
once per ``E2ERun`` and shared by every kernel set it checks (``bisect``).
"""

from __future__ import annotations

import json
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from deepinfer_interfaces import Device, Kernels, NotSupportedError
from deepinfer_interfaces.kernels import unpack_bitmask
from deepinfer_interfaces.specs import WARN_FACTOR

from .ops import dtype_name
from .results import CaseResult
from .tolerances import E2ETolerance, e2e_tolerance
from deepinfer.models.registry import load_model

#: ``(id, text)``: short prompts of different kinds (prose, counting, code, dialogue)
PROMPTS: tuple[tuple[str, str], ...] = (
    ("prose", "The quick brown fox jumps over the lazy dog. Then the fox"),
    ("count", "1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12,"),
    ("code", "def add(a, b):\n    return a + b\n\ndef sub(a, b):\n"),
    ("dialogue", "Q: What is the capital of France?\nA: Paris.\nQ: And of Italy?\nA:"),
)
#: greedy steps per prompt
MAX_NEW_TOKENS = 12
#: size of the top-k sets whose overlap is reported
TOP_K = 5

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_dtype(name: str | None, device: Device) -> torch.dtype:
    """The dtype the backend runs the model in: ``name``, or for ``auto``/None the
    engine's default (fp32 on the host, bf16 on an accelerator)."""
    from deepinfer.errors import ConfigError

    if name in (None, "auto"):
        return torch.float32 if device.type == "cpu" else torch.bfloat16
    if name not in _DTYPES:
        raise ConfigError(f"unknown --dtype '{name}' (choose from auto, {', '.join(_DTYPES)})")
    dtype = _DTYPES[name]
    if dtype not in device.capabilities().dtypes:
        raise ConfigError(f"dtype {name} is not supported by device {device.type}; choose another --dtype")
    return dtype


def resolve_model(model: str | Path | None) -> Path:
    """The model directory: the given one, or the bundled model (a clear error naming --model if missing)."""
    from deepinfer.engine import resolve_model_dir
    from deepinfer.errors import ConfigError

    path = resolve_model_dir(None if model is None else str(model))
    if not (path / "config.json").is_file():
        raise ConfigError(f"--model {path} is not a model directory (no config.json); pass --model DIR of an HF-layout DeepSeek-V4 checkpoint")
    return path


def encode_prompts(model_dir: Path, prompts: Sequence[tuple[str, str]]) -> list[list[int]]:
    """Token ids of each prompt with the model's own tokenizer."""
    from deepinfer.errors import ConfigError
    from deepinfer.loader import load_tokenizer

    tok = load_tokenizer(model_dir)
    ids = [tok.encode(text).ids for _, text in prompts]
    empty = [pid for (pid, _), i in zip(prompts, ids) if not i]
    if empty:
        raise ConfigError(f"prompt '{empty[0]}' encodes to no tokens with the tokenizer of {model_dir}")
    return ids


def _load(model_dir: Path, kernels: Kernels, dtype: torch.dtype, device: torch.device):

    return load_model(model_dir, kernels, dtype=dtype, device=device)


def step_logprobs(
    model,
    prompts: list[list[int]],
    steps: int,
    forced: list[list[int]] | None = None,
    device: Device | None = None,
    bitmasks: Sequence[torch.Tensor] | None = None,
) -> tuple[torch.Tensor, list[list[int]]]:
    """Greedy (or, with ``forced``, teacher-forced) generation of all prompts as one batch.

    Returns ``[P, steps, V]`` fp64 CPU log-probabilities of each step's next
    token, and the tokens fed after each step (the argmax, or ``forced``). With
    ``bitmasks`` (one CPU int32 ``[P, words]`` per step), each step's logits go
    through the model's ``apply_token_bitmask`` first, as the engine's sampler
    does for a grammar. With ``device``, every decode step replays a graph that
    ``device`` captured before the prefill, as the engine does; else every step
    runs eager.
    """
    from deepinfer.decode_graphs import DecodeGraphs
    from deepinfer.models.common.batch import Batch
    from deepinfer.models.common.cache import ContiguousCache

    n = len(prompts)
    longest = max(len(p) for p in prompts)
    cache = ContiguousCache(model.config, n, longest + steps + 1, dtype=model.dtype, device=model.device)
    slots = [cache.allocate() for _ in range(n)]
    graphs = None
    if device is not None:
        graphs = DecodeGraphs(model, cache, device, [n], cache.max_len)
        graphs.capture()
    logits = model(Batch.build(prompts, slots, [0] * n), cache)
    out = torch.empty(n, steps, model.config.vocab_size, dtype=torch.float64)
    tokens: list[list[int]] = [[] for _ in range(n)]
    for i in range(steps):
        if bitmasks is not None:
            logits = model.kernels.apply_token_bitmask(logits.clone(), bitmasks[i].to(logits.device))
        # fp64 from the logits as computed: the KL of close distributions survives its own sum
        lp = torch.log_softmax(logits.cpu().double(), dim=-1)
        out[:, i] = lp
        fed = lp.argmax(-1).tolist() if forced is None else [f[i] for f in forced]
        for seq, t in zip(tokens, fed):
            seq.append(int(t))
        if i + 1 < steps:
            batch = Batch.build([[t] for t in fed], slots, [len(p) + i for p in prompts])
            if graphs is None:
                logits = model(batch, cache)
            else:
                cache.begin_forward(batch)
                graph = graphs.find(n, batch.max_context_len)
                graph.load(batch, cache)
                logits = graph.replay()[0][:n].clone()
    return out, tokens


def graphs_by_default(device: Device) -> bool:
    """Whether the engine captures decode graphs on ``device`` unless told otherwise."""
    caps = device.capabilities()
    return caps.graph_capture and caps.graph_by_default


@dataclass
class PromptParity:
    """How one prompt's backend run compares with the reference."""

    steps: int
    divergence: int | None
    divergence_gap: float | None
    kl: torch.Tensor
    min_overlap: int
    max_abs_logprob_err: float
    finite: bool


def compare_prompt(ref: torch.Tensor, got: torch.Tensor, ref_tokens: list[int], top_k: int = TOP_K) -> PromptParity:
    """Compare ``[steps, V]`` log-probabilities of one prompt (reference, backend)."""
    finite = bool(torch.isfinite(got).all())
    chosen = got.argmax(-1)
    expected = torch.tensor(ref_tokens)
    diverged = (chosen != expected).nonzero().flatten()
    divergence = int(diverged[0]) if diverged.numel() else None
    gap = None
    if divergence is not None:
        row = ref[divergence]
        gap = float(row[expected[divergence]] - row[chosen[divergence]])
    p = ref.exp()
    kl = (p * (ref - got)).sum(-1).clamp(min=0.0) if finite else torch.full((ref.shape[0],), float("inf"))
    k = min(top_k, ref.shape[-1])
    ref_top, got_top = ref.topk(k, dim=-1).indices, got.topk(k, dim=-1).indices
    overlap = min(len(set(a.tolist()) & set(b.tolist())) for a, b in zip(ref_top, got_top))
    err = (got.gather(-1, ref_top) - ref.gather(-1, ref_top)).abs()
    return PromptParity(ref.shape[0], divergence, gap, kl, overlap, float(torch.nan_to_num(err, nan=float("inf")).max()), finite)


def judge(parity: PromptParity, tol: E2ETolerance, top_k: int = TOP_K) -> tuple[str, str]:
    """Status and message of one prompt under ``tol``."""
    mean_kl = float(parity.kl.mean())
    parts = []
    status = "pass"
    if not parity.finite:
        status = "fail"
        parts.append("the backend's logits are not finite")
    if parity.divergence is None:
        parts.append(f"no greedy divergence in {parity.steps} steps")
    else:
        near_tie = parity.divergence_gap is not None and parity.divergence_gap <= tol.logprob
        verdict = "within" if near_tie else "beyond"
        parts.append(
            f"first greedy divergence at step {parity.divergence} of {parity.steps} "
            f"(reference logprob gap {parity.divergence_gap:.3g}, {verdict} tolerance {tol.logprob:g})"
        )
        status = "warn" if near_tie and status == "pass" else "fail"
    parts.append(f"mean KL {mean_kl:.2e} (tolerance {tol.kl:g}), max KL {float(parity.kl.max()):.2e}")
    parts.append(f"min top-{top_k} overlap {parity.min_overlap}/{top_k}")
    if mean_kl > WARN_FACTOR * tol.kl:
        status = "fail"
    elif mean_kl > tol.kl and status == "pass":
        status = "warn"
    return status, "; ".join(parts)




#: every e2e case (``op`` of its results), in the order they run; ``greedy-graph`` only with graph mode
CASES: tuple[str, ...] = ("greedy", "greedy-graph", "single", "sample", "constrained", "clamp", "greedy-bf16")
#: index in the prompts of the one that decodes alone (``single``)
SINGLE_PROMPT = 0


@dataclass(frozen=True)
class SampleSetting:
    """One row's sampling parameters (temperature 0: greedy)."""

    temperature: float
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0


#: ``sample`` case id -> the settings its rows take in turn
SAMPLE_CASES: dict[str, tuple[SampleSetting, ...]] = {
    "temperature": (SampleSetting(0.7),),
    "top_k": (SampleSetting(1.0, top_k=8),),
    "top_p": (SampleSetting(1.0, top_p=0.9),),
    "min_p": (SampleSetting(1.0, min_p=0.1),),
    "mixed": (
        SampleSetting(0.0), SampleSetting(0.7), SampleSetting(1.0, top_k=8), SampleSetting(1.0, top_p=0.9),
        SampleSetting(1.3, top_k=20, top_p=0.95, min_p=0.05),
    ),
}
#: noise draws per row of logits, and the seed of the generator that draws them
SAMPLE_DRAWS = 8
SAMPLE_SEED = 0
#: race scores (probability / noise) within this relative distance are a tie rounding may break either way
SAMPLE_TIE_RTOL = 1e-4
#: largest total-variation distance between the two ``sampling_probs`` of a row: warn above, fail above WARN_FACTOR×
SAMPLE_TV = 1e-4
#: fraction of the vocabulary a ``constrained`` step leaves open; every this many (prompt, step) force one token
CONSTRAINT_OPEN = 0.25
CONSTRAINT_FORCED_EVERY = 4
CONSTRAINT_SEED = 0
#: ``clamp``: the SwiGLU limit is this quantile of the reference's SwiGLU inputs (gate, |up|) at prefill
CLAMP_QUANTILE = 0.9
#: a masked log-probability after the masks were found equal (exp() of it is 0, and it never ranks)
_MASKED = -1e30


def case_ids(prompts: Sequence[tuple[str, str]] = PROMPTS) -> list[tuple[str, str]]:
    """``(op, case)`` of every result the e2e suite can report, for the pytest entry's test ids."""
    pids = [pid for pid, _ in prompts]
    per_op = {
        "greedy": pids, "greedy-graph": pids, "single": [pids[SINGLE_PROMPT]], "sample": [*SAMPLE_CASES, "one_row"],
        "constrained": pids, "clamp": pids, "greedy-bf16": pids,
    }
    return [(op, case) for op in CASES for case in per_op[op]]


@dataclass
class Decode:
    """One decode: per-step fp64 log-probabilities ``[P, steps, V]`` and the tokens fed after each step."""

    logprobs: torch.Tensor
    tokens: list[list[int]]


@dataclass
class E2ERun:
    """What every kernel set checked on one model is compared with; the reference's runs are made once, on first use."""

    model_dir: Path
    dtype: torch.dtype
    prompts: tuple[tuple[str, str], ...] = PROMPTS
    max_new_tokens: int = MAX_NEW_TOKENS
    graphs: bool = False
    cases: tuple[str, ...] = CASES
    _references: dict[str, Any] = field(default_factory=dict, repr=False)
    _ids: list[list[int]] | None = field(default=None, repr=False)

    @property
    def ids(self) -> list[list[int]]:
        if self._ids is None:
            self._ids = encode_prompts(self.model_dir, self.prompts)
        return self._ids

    @property
    def prompt_ids(self) -> list[str]:
        return [pid for pid, _ in self.prompts]

    def reference(self, key: str, compute: Callable[[], Any]) -> Any:
        """The reference run ``key``, computed on first use."""
        if key not in self._references:
            self._references[key] = compute()
        return self._references[key]

    def check(self, kernels: Kernels, device: Device) -> list[CaseResult]:
        """Every selected case on ``kernels`` and ``device``."""
        results: list[CaseResult] = []
        if "greedy" in self.cases or ("greedy-graph" in self.cases and self.graphs):
            results += _greedy(self, kernels, device)
        for op, case in (("single", _single), ("sample", _sample), ("constrained", _constrained), ("clamp", _clamp), ("greedy-bf16", _bf16)):
            if op in self.cases:
                results += case(self, kernels, device)
        return [r for r in results if r.op in self.cases]


def make_run(
    device: Device,
    model: str | Path | None = None,
    dtype: torch.dtype | None = None,
    prompts: Sequence[tuple[str, str]] = PROMPTS,
    max_new_tokens: int = MAX_NEW_TOKENS,
    graphs: bool | None = None,
    cases: Sequence[str] | None = None,
) -> E2ERun:
    """The e2e run for ``device``: ``model`` (None: the bundled one), ``dtype`` (None: the engine's default),
    ``graphs`` (None: where the engine captures graphs by default), ``cases`` (None: all of ``CASES``)."""
    from deepinfer.errors import ConfigError

    chosen = tuple(CASES if cases is None else cases)
    unknown = [c for c in chosen if c not in CASES]
    if unknown:
        raise ConfigError(f"unknown e2e case '{unknown[0]}' (choose from {', '.join(CASES)})")
    return E2ERun(
        model_dir=resolve_model(model), dtype=dtype or resolve_dtype(None, device), prompts=tuple(prompts),
        max_new_tokens=max_new_tokens, graphs=graphs_by_default(device) if graphs is None else graphs, cases=chosen,
    )


def run_e2e(
    kernels: Kernels,
    device: Device,
    model: str | Path | None = None,
    dtype: torch.dtype | None = None,
    prompts: Sequence[tuple[str, str]] = PROMPTS,
    max_new_tokens: int = MAX_NEW_TOKENS,
    graphs: bool | None = None,
    cases: Sequence[str] | None = None,
) -> list[CaseResult]:
    """One ``CaseResult(suite="e2e")`` per case and prompt (or sampling setting); see the module docstring.

    ``model`` is an HF-layout directory (None: the bundled model); ``dtype`` the
    backend's (None: the engine's default for ``device``); ``graphs`` None: on
    where the engine captures graphs by default; ``cases`` None: every case.
    """
    return make_run(device, model, dtype, prompts, max_new_tokens, graphs, cases).check(kernels, device)


# -- the cases ---------------------------------------------------------------------------------------


def _reference_decode(model_dir: Path, ids: list[list[int]], steps: int, kernels: Kernels | None = None,
                      bitmasks: Sequence[torch.Tensor] | None = None) -> Decode:
    model = _load(model_dir, kernels or Kernels(), torch.float32, torch.device("cpu"))
    return Decode(*step_logprobs(model, ids, steps, bitmasks=bitmasks))


def _forced(model, ids: list[list[int]], ref: Decode, device: Device, graph_device: Device | None = None,
            bitmasks: Sequence[torch.Tensor] | None = None) -> torch.Tensor:
    """The backend's log-probabilities fed the reference's tokens."""
    lp, _ = step_logprobs(model, ids, len(ref.tokens[0]), forced=ref.tokens, device=graph_device, bitmasks=bitmasks)
    device.synchronize()
    return lp


def _greedy_reference(run: E2ERun) -> Decode:
    return run.reference("greedy", lambda: _reference_decode(run.model_dir, run.ids, run.max_new_tokens))


def _greedy(run: E2ERun, kernels: Kernels, device: Device) -> list[CaseResult]:
    ref = _greedy_reference(run)
    base = _base("greedy", run.dtype)
    graph_base = dict(base, op="greedy-graph")
    model, problem = _attempt(lambda: _load(run.model_dir, kernels, run.dtype, device.torch_device))
    got = None
    if problem is None:
        got, problem = _attempt(lambda: _forced(model, run.ids, ref, device))
    if problem is not None:
        out = _same(run.prompt_ids, base, problem)
        return out + (_same(run.prompt_ids, graph_base, problem) if run.graphs else [])
    results = _judged(run.prompt_ids, ref, got, e2e_tolerance(run.dtype), base)
    if run.graphs:
        graph_lp, problem = _attempt(lambda: _forced(model, run.ids, ref, device, graph_device=device))
        if problem is not None:
            return results + _same(run.prompt_ids, graph_base, problem)
        eager = Decode(got, [row.argmax(-1).tolist() for row in got])
        results += _judged(run.prompt_ids, eager, graph_lp, e2e_tolerance(run.dtype), graph_base)
    return results


def _decode_case(run: E2ERun, kernels: Kernels, device: Device, op: str, ids: list[list[int]], case_ids: list[str],
                 ref: Decode, dtype: torch.dtype, model_dir: Path | None = None) -> list[CaseResult]:
    """Teacher-forced ``ids`` on the backend in ``dtype``, judged against ``ref`` per prompt."""
    base = _base(op, dtype)
    model, problem = _attempt(lambda: _load(model_dir or run.model_dir, kernels, dtype, device.torch_device))
    got = None
    if problem is None:
        got, problem = _attempt(lambda: _forced(model, ids, ref, device))
    if problem is not None:
        return _same(case_ids, base, problem)
    return _judged(case_ids, ref, got, e2e_tolerance(dtype), base)


def _single(run: E2ERun, kernels: Kernels, device: Device) -> list[CaseResult]:
    ids = [run.ids[SINGLE_PROMPT]]
    ref = run.reference("single", lambda: _reference_decode(run.model_dir, ids, run.max_new_tokens))
    return _decode_case(run, kernels, device, "single", ids, [run.prompt_ids[SINGLE_PROMPT]], ref, run.dtype)


def _bf16(run: E2ERun, kernels: Kernels, device: Device) -> list[CaseResult]:
    if run.dtype != torch.float32:
        return []  # the run's own dtype is already the reduced one
    if torch.bfloat16 not in device.capabilities().dtypes:
        return _same(run.prompt_ids, _base("greedy-bf16", torch.bfloat16), ("not_supported", f"device {device.type} lists no bfloat16"))
    ref = _greedy_reference(run)
    return _decode_case(run, kernels, device, "greedy-bf16", run.ids, run.prompt_ids, ref, torch.bfloat16)


# constrained decoding


def pack_bitmask(allowed: torch.Tensor) -> torch.Tensor:
    """``[B, 32·W]`` bool to ``[B, W]`` int32 words in xgrammar's layout (token ``32·i + j`` is bit ``j`` of word ``i``)."""
    bits = allowed.reshape(allowed.shape[0], -1, 32).to(torch.int64) << torch.arange(32, dtype=torch.int64)
    words = bits.sum(-1)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def constraint_masks(prompts: int, steps: int, vocab: int, seed: int = CONSTRAINT_SEED) -> list[torch.Tensor]:
    """One CPU int32 ``[prompts, ceil(vocab / 32)]`` bitmask per step, as a grammar would write them.

    A quarter of the vocabulary open at random, except that every
    ``CONSTRAINT_FORCED_EVERY``-th (prompt, step) allows one token only, the
    top bit of a word (the int32 sign bit), as a grammar's literal does.
    """
    gen = torch.Generator().manual_seed(seed)
    words = -(-vocab // 32)
    out = []
    for step in range(steps):
        allowed = torch.rand(prompts, words * 32, generator=gen) < CONSTRAINT_OPEN
        for p in range(prompts):
            if (p + step) % CONSTRAINT_FORCED_EVERY == 0:
                word = int(torch.randint(words, (1,), generator=gen))
                allowed[p] = False
                allowed[p, min(32 * word + 31, vocab - 1)] = True
        allowed[:, vocab:] = False
        out.append(pack_bitmask(allowed))
    return out


@dataclass
class ConstrainedReference:
    bitmasks: list[torch.Tensor]
    decode: Decode


def _constrained_reference(run: E2ERun) -> ConstrainedReference:
    model = _load(run.model_dir, Kernels(), torch.float32, torch.device("cpu"))
    masks = constraint_masks(len(run.ids), run.max_new_tokens, model.config.vocab_size)
    return ConstrainedReference(masks, Decode(*step_logprobs(model, run.ids, run.max_new_tokens, bitmasks=masks)))


def _constrained(run: E2ERun, kernels: Kernels, device: Device) -> list[CaseResult]:
    ref = run.reference("constrained", lambda: _constrained_reference(run))
    base = _base("constrained", run.dtype)
    model, problem = _attempt(lambda: _load(run.model_dir, kernels, run.dtype, device.torch_device))
    got = None
    if problem is None:
        got, problem = _attempt(lambda: _forced(model, run.ids, ref.decode, device, bitmasks=ref.bitmasks))
    if problem is not None:
        return _same(run.prompt_ids, base, problem)
    vocab = got.shape[-1]
    allowed = torch.stack([unpack_bitmask(m, vocab) for m in ref.bitmasks], dim=1)  # [P, steps, V]
    tol = e2e_tolerance(run.dtype)
    results = []
    for i, pid in enumerate(run.prompt_ids):
        wrong = torch.isneginf(got[i]) != ~allowed[i]
        if bool(wrong.any()):
            step, token = (int(v) for v in wrong.nonzero()[0])
            state = "masked" if bool(allowed[i, step, token]) else "left open"
            message = (f"bitmask: {int(wrong.sum())} token(s) over {int(wrong.any(-1).sum())} step(s) masked differently "
                       f"from the bitmask (first: step {step}, token {token} = bit {token % 32} of word {token // 32}, {state})")
            results.append(CaseResult(case=pid, status="fail", message=message, frac_out_of_tol=float(wrong.float().mean()), **base))
            continue
        ref_lp = torch.where(allowed[i], ref.decode.logprobs[i], _MASKED)
        got_lp = torch.where(allowed[i], got[i], _MASKED)
        results += _judged([pid], Decode(ref_lp[None], [ref.decode.tokens[i]]), got_lp[None], tol, base)
    return results


# the SwiGLU clamp


class ClampProbe(Kernels):
    """The reference kernels, counting the SwiGLU inputs that reach the clamp (and keeping their scale)."""

    name = "reference-clamp-probe"

    def __init__(self) -> None:
        self.reached = 0
        self.seen = 0
        self.magnitudes: list[torch.Tensor] = []

    def observe(self, gate: torch.Tensor, up: torch.Tensor, limit: float | None) -> None:
        """Count the elements the clamp changes: ``gate > limit`` and ``|up| > limit``."""
        g, u = gate.detach().float().flatten(), up.detach().float().abs().flatten()
        self.magnitudes.append(torch.cat([g, u]))
        self.seen += g.numel() + u.numel()
        if limit is not None:
            self.reached += int((g > limit).sum()) + int((u > limit).sum())

    def limit_for(self, quantile: float) -> float:
        """The limit that ``quantile`` of the observed inputs stay under, to two significant digits."""
        values = torch.cat(self.magnitudes) if self.magnitudes else torch.zeros(1)
        values = values[:: max(1, values.numel() // (1 << 20))]
        return float(f"{float(torch.quantile(values, quantile)):.2g}")

    def swiglu(self, gate, up, limit):
        self.observe(gate, up, limit)
        return super().swiglu(gate, up, limit)

    def moe_experts(self, x, topk_ids, topk_weights, w13, w2, limit):
        half = w13.shape[1] // 2
        for e in topk_ids[(topk_ids >= 0) & (topk_ids < w13.shape[0])].unique().tolist():
            rows = (topk_ids == e).any(-1)
            h = x[rows].float() @ w13[e].float().T
            self.observe(h[:, :half], h[:, half:], limit)
        return super().moe_experts(x, topk_ids, topk_weights, w13, w2, limit)


def clamp_checkpoint(model_dir: Path, limit: float, into: Path) -> Path:
    """A view of ``model_dir`` in ``into`` (its files linked) whose config sets ``swiglu_limit`` to ``limit``."""
    for entry in model_dir.iterdir():
        if entry.name != "config.json":
            (into / entry.name).symlink_to(entry.resolve())
    config = json.loads((model_dir / "config.json").read_text())
    config["swiglu_limit"] = limit
    if isinstance(config.get("text_config"), dict):
        config["text_config"]["swiglu_limit"] = limit
    (into / "config.json").write_text(json.dumps(config, indent=1))
    return into


@dataclass
class ClampReference:
    checkpoint: Path
    limit: float
    decode: Decode
    reached: int
    seen: int
    _dir: tempfile.TemporaryDirectory = field(repr=False)


def _clamp_reference(run: E2ERun) -> ClampReference:
    scale = ClampProbe()
    step_logprobs(_load(run.model_dir, scale, torch.float32, torch.device("cpu")), run.ids, 1)
    own = json.loads((run.model_dir / "config.json").read_text()).get("swiglu_limit")
    limit = scale.limit_for(CLAMP_QUANTILE)
    limit = min(limit, own) if own is not None else limit
    tmp = tempfile.TemporaryDirectory(prefix="deepinfer-clamp-")
    checkpoint = clamp_checkpoint(run.model_dir, limit, Path(tmp.name))
    probe = ClampProbe()
    decode = _reference_decode(checkpoint, run.ids, run.max_new_tokens, kernels=probe)
    return ClampReference(checkpoint, limit, decode, probe.reached, probe.seen, tmp)


def _clamp(run: E2ERun, kernels: Kernels, device: Device) -> list[CaseResult]:
    ref = run.reference("clamp", lambda: _clamp_reference(run))
    reach = f"SwiGLU clamp (limit {ref.limit:g}) reached at {ref.reached} of {ref.seen} inputs in the reference run"
    if ref.reached == 0:
        return _same(run.prompt_ids, _base("clamp", run.dtype), ("not_supported", f"{reach}: the case checks nothing"))
    results = _decode_case(run, kernels, device, "clamp", run.ids, run.prompt_ids, ref.decode, run.dtype, ref.checkpoint)
    for r in results:
        r.message = f"{reach}; {r.message}"
    return results


# sampling


def sample_inputs(settings: Sequence[SampleSetting], logits: torch.Tensor, draws: int = SAMPLE_DRAWS,
                  seed: int = SAMPLE_SEED) -> dict[str, torch.Tensor]:
    """``sample``'s CPU arguments: ``logits`` ``[R, V]`` repeated ``draws`` times, rows taking ``settings`` in turn,
    and seeded Exp(1) noise."""
    rows = logits.float().repeat(draws, 1)
    per_row = [settings[i % len(settings)] for i in range(rows.shape[0])]
    noise = torch.empty_like(rows).exponential_(generator=torch.Generator().manual_seed(seed))
    return dict(
        logits=rows,
        temperature=torch.tensor([s.temperature for s in per_row], dtype=torch.float32),
        top_k=torch.tensor([s.top_k for s in per_row], dtype=torch.int64),
        top_p=torch.tensor([s.top_p for s in per_row], dtype=torch.float32),
        min_p=torch.tensor([s.min_p for s in per_row], dtype=torch.float32),
        noise=noise,
    )


@dataclass
class SampleParity:
    """How the backend's draws and sampling distributions compare with the reference's on the same inputs."""

    draws: int
    mismatched: int
    at_ties: int
    max_tv: float
    finite: bool


def compare_samples(args: dict[str, torch.Tensor], ref_tokens: torch.Tensor, got_tokens: torch.Tensor,
                    ref_probs: torch.Tensor, got_probs: torch.Tensor) -> SampleParity:
    """Count differing draws, and those at a tie: the reference's race score (probability / noise, or the logit
    on a greedy row) of the backend's token within ``SAMPLE_TIE_RTOL`` of its own token's."""
    differ = (got_tokens != ref_tokens).nonzero().flatten().tolist()
    ties = 0
    vocab = ref_probs.shape[-1]
    for r in differ:
        a, b = int(ref_tokens[r]), int(got_tokens[r])
        if not 0 <= b < vocab:
            continue
        if float(args["temperature"][r]) <= 0:
            score_a, score_b = float(args["logits"][r, a]), float(args["logits"][r, b])
        else:
            if float(ref_probs[r, b]) <= 0:
                continue  # a token the reference's filters remove
            score_a = float(ref_probs[r, a] / args["noise"][r, a])
            score_b = float(ref_probs[r, b] / args["noise"][r, b])
        ties += score_b >= score_a - SAMPLE_TIE_RTOL * abs(score_a)
    finite = bool(torch.isfinite(got_probs).all())
    tv = float(0.5 * (got_probs - ref_probs).abs().sum(-1).max()) if finite and got_probs.numel() else 0.0
    return SampleParity(int(ref_tokens.numel()), len(differ), ties, tv if finite else float("inf"), finite)


def judge_samples(parity: SampleParity) -> tuple[str, str]:
    """Status and message of one sampling case."""
    parts = [f"{parity.mismatched} of {parity.draws} draws differ from the reference's on the same logits and noise"
             f" ({parity.at_ties} at near ties)"]
    parts.append(f"max total variation of sampling_probs {parity.max_tv:.2e} (tolerance {SAMPLE_TV:g})")
    if not parity.finite:
        parts.append("the backend's sampling_probs are not finite")
    if parity.mismatched > parity.at_ties or not parity.finite or parity.max_tv > WARN_FACTOR * SAMPLE_TV:
        return "fail", "; ".join(parts)
    if parity.mismatched or parity.max_tv > SAMPLE_TV:
        return "warn", "; ".join(parts)
    return "pass", "; ".join(parts)


def _sample_on(kernels: Kernels, device: Device, args: dict[str, torch.Tensor], batch: int | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The backend's ``sample`` tokens and ``sampling_probs`` on ``args``, ``batch`` rows per call (None: all at once);
    a result of the wrong shape raises with one line."""
    rows = args["logits"].shape[0]
    step = batch or rows
    tokens, probs = [], []
    for start in range(0, rows, step):
        moved = {k: v[start:start + step].to(device.torch_device) for k, v in args.items()}
        n = moved["logits"].shape[0]
        got = kernels.sample(**moved)
        dist = kernels.sampling_probs(**{k: v for k, v in moved.items() if k != "noise"})
        if tuple(got.shape) != (n,) or tuple(dist.shape) != tuple(moved["logits"].shape):
            raise ValueError(f"for a batch of {n}, sample returned shape {tuple(got.shape)} (expected ({n},)) "
                             f"and sampling_probs {tuple(dist.shape)}")
        tokens.append(got.cpu().to(torch.int64))
        probs.append(dist.cpu().float())
    device.synchronize()
    return torch.cat(tokens), torch.cat(probs)


def _sample(run: E2ERun, kernels: Kernels, device: Device) -> list[CaseResult]:
    logits = _greedy_reference(run).logprobs.flatten(0, 1)  # the reference's own next-token distributions
    reference = Kernels()
    base = _base("sample", torch.float32)
    mixed = SAMPLE_CASES["mixed"]
    # (case, settings, logits, rows per call): each setting in one batch, then a batch of one at a time
    plan = [(case, settings, logits, None) for case, settings in SAMPLE_CASES.items()]
    plan.append(("one_row", mixed, logits[: 2 * len(mixed)], 1))
    results = []
    for case, settings, rows, batch in plan:
        args = sample_inputs(settings, rows, draws=1 if batch else SAMPLE_DRAWS)
        ref_tokens = reference.sample(**args)
        ref_probs = reference.sampling_probs(**{k: v for k, v in args.items() if k != "noise"})
        got, problem = _attempt(lambda: _sample_on(kernels, device, args, batch))
        if problem is not None:
            results += _same([case], base, problem)
            continue
        parity = compare_samples(args, ref_tokens, got[0], ref_probs, got[1])
        status, message = judge_samples(parity)
        results.append(CaseResult(
            case=case, status=status, message=message, max_abs_err=parity.max_tv,
            frac_out_of_tol=parity.mismatched / max(1, parity.draws), **dict(base, atol=SAMPLE_TV),
        ))
    return results


# shared by the cases


def _base(op: str, dtype: torch.dtype) -> dict[str, Any]:
    return dict(suite="e2e", op=op, dtype=dtype_name(dtype), atol=e2e_tolerance(dtype).logprob)


def _judged(case_ids: list[str], ref: Decode, got_lp: torch.Tensor, tol: E2ETolerance, base: dict) -> list[CaseResult]:
    results = []
    for i, pid in enumerate(case_ids):
        parity = compare_prompt(ref.logprobs[i], got_lp[i], ref.tokens[i])
        status, message = judge(parity, tol)
        above = float((parity.kl > tol.kl).float().mean())
        results.append(CaseResult(
            case=pid, status=status, message=message, max_abs_err=parity.max_abs_logprob_err,
            frac_out_of_tol=above, **base,
        ))
    return results


def _attempt(fn: Callable[[], Any]) -> tuple[Any, tuple[str, str] | None]:
    """``(fn(), None)``, or ``(None, (status, line))`` when it raised: ``not_supported`` or ``error``."""
    try:
        return fn(), None
    except NotSupportedError as exc:
        return None, ("not_supported", str(exc).splitlines()[0] if str(exc) else "not supported")
    except Exception as exc:  # reported per case; the other cases and suites go on
        return None, ("error", _error_line(exc))


def _same(case_ids: list[str], base: dict, problem: tuple[str, str]) -> list[CaseResult]:
    """The same status and message for every case id."""
    status, message = problem
    return [CaseResult(case=pid, status=status, message=message, **base) for pid in case_ids]


def _error_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
