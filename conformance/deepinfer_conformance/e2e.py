"""End-to-end parity: the whole model, greedy, on the backend against the reference.

The reference (reference ``Kernels`` on the CPU in fp32) generates greedily from
a few fixed prompts, keeping each step's next-token log-probabilities. The
backend (its device and kernels, in its dtype) then runs the same steps fed the
reference's tokens (teacher forcing: prefill, then one token per step), so its
distribution at every step is compared on the same context, and its greedy
choice at step ``i`` is what it would have generated alone up to its first
divergence.

Per prompt: the first step whose greedy token differs, the mean and largest
KL(reference ‖ backend), and the smallest overlap of the two top-k token sets.
A divergence is accepted as a warning only when the reference itself saw a near
tie there: its log-probability of the backend's token is within the dtype's
``logprob`` tolerance of its own choice (the spirit of vLLM's logprob-closeness
check). All prompts run as one batch, so a run costs one prefill and one step
per generated token on each side.

With graph mode (``graphs``; by default where the engine captures graphs),
the backend runs the same teacher-forced steps again with every decode step
replayed from a graph its device captured, and those distributions are judged
against the backend's own eager run by the same rules (op ``greedy-graph``):
a vendor's graph implementation has to compute what its eager path computes.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import torch

from deepinfer_interfaces import Device, Kernels, NotSupportedError
from deepinfer_interfaces.specs import WARN_FACTOR

from .ops import dtype_name
from .results import CaseResult
from .tolerances import E2ETolerance, e2e_tolerance

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
    from deepinfer.model.model import CausalLM

    return CausalLM.from_pretrained(model_dir, kernels, dtype=dtype, device=device)


def step_logprobs(
    model, prompts: list[list[int]], steps: int, forced: list[list[int]] | None = None, device: Device | None = None
) -> tuple[torch.Tensor, list[list[int]]]:
    """Greedy (or, with ``forced``, teacher-forced) generation of all prompts as one batch.

    Returns ``[P, steps, V]`` fp32 CPU log-probabilities of each step's next
    token, and the tokens fed after each step (the argmax, or ``forced``). With
    ``device``, every decode step replays a graph that ``device`` captured
    before the prefill, as the engine does; else every step runs eager.
    """
    from deepinfer.decode_graphs import DecodeGraphs
    from deepinfer.model.batch import Batch
    from deepinfer.model.cache import ContiguousCache

    n = len(prompts)
    longest = max(len(p) for p in prompts)
    cache = ContiguousCache(model.config, n, longest + steps + 1, dtype=model.dtype, device=model.device)
    slots = [cache.allocate() for _ in range(n)]
    graphs = None
    if device is not None:
        graphs = DecodeGraphs(model, cache, device, [n], cache.max_len)
        graphs.capture()
    logits = model(Batch.build(prompts, slots, [0] * n), cache)
    out = torch.empty(n, steps, model.config.vocab_size)
    tokens: list[list[int]] = [[] for _ in range(n)]
    for i in range(steps):
        lp = torch.log_softmax(logits.float(), dim=-1).cpu()
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


def run_e2e(
    kernels: Kernels,
    device: Device,
    model: str | Path | None = None,
    dtype: torch.dtype | None = None,
    prompts: Sequence[tuple[str, str]] = PROMPTS,
    max_new_tokens: int = MAX_NEW_TOKENS,
    graphs: bool | None = None,
) -> list[CaseResult]:
    """One ``CaseResult(suite="e2e", op="greedy", case=prompt id)`` per prompt, and with ``graphs``
    one ``op="greedy-graph"`` per prompt: the backend's decode steps replayed from graphs its
    device captured, judged against the backend's own eager run.

    ``model`` is an HF-layout directory (None: the bundled model); ``dtype`` the
    backend's (None: the engine's default for ``device``); ``graphs`` None: on
    where the engine captures graphs by default.
    """
    model_dir = resolve_model(model)
    dtype = dtype or resolve_dtype(None, device)
    graphs = graphs_by_default(device) if graphs is None else graphs
    tol = e2e_tolerance(dtype)
    ids = encode_prompts(model_dir, prompts)
    base = dict(suite="e2e", op="greedy", dtype=dtype_name(dtype), atol=tol.logprob)
    reference = _load(model_dir, Kernels(), torch.float32, torch.device("cpu"))
    ref_lp, ref_tokens = step_logprobs(reference, ids, max_new_tokens)
    del reference
    try:
        backend = _load(model_dir, kernels, dtype, device.torch_device)
        got_lp, _ = step_logprobs(backend, ids, max_new_tokens, forced=ref_tokens)
        device.synchronize()
    except NotSupportedError as exc:
        return _all(prompts, "not_supported", str(exc).splitlines()[0] if str(exc) else "not supported", base, graphs)
    except Exception as exc:  # reported per prompt; the other suites go on
        return _all(prompts, "error", _error_line(exc), base, graphs)
    results = _judged(prompts, ref_lp, got_lp, ref_tokens, tol, base)
    if graphs:
        graph_base = dict(base, op="greedy-graph")
        try:
            graph_lp, _ = step_logprobs(backend, ids, max_new_tokens, forced=ref_tokens, device=device)
            device.synchronize()
        except NotSupportedError as exc:
            return results + _all(prompts, "not_supported", str(exc).splitlines()[0] if str(exc) else "not supported", graph_base, False)
        except Exception as exc:
            return results + _all(prompts, "error", _error_line(exc), graph_base, False)
        eager_tokens = [row.argmax(-1).tolist() for row in got_lp]
        results += _judged(prompts, got_lp, graph_lp, eager_tokens, tol, graph_base)
    return results


def _judged(prompts, ref_lp, got_lp, ref_tokens, tol: E2ETolerance, base: dict) -> list[CaseResult]:
    results = []
    for i, (pid, _) in enumerate(prompts):
        parity = compare_prompt(ref_lp[i], got_lp[i], ref_tokens[i])
        status, message = judge(parity, tol)
        above = float((parity.kl > tol.kl).float().mean())
        results.append(CaseResult(
            case=pid, status=status, message=message, max_abs_err=parity.max_abs_logprob_err,
            frac_out_of_tol=above, **base,
        ))
    return results


def _all(prompts, status: str, message: str, base: dict, graphs: bool) -> list[CaseResult]:
    """The same status for every prompt (and its graph case)."""
    out = [CaseResult(case=pid, status=status, message=message, **base) for pid, _ in prompts]
    if graphs:
        out += [CaseResult(case=pid, status=status, message=message, **dict(base, op="greedy-graph")) for pid, _ in prompts]
    return out


def _error_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")
