"""DeepInfer's DeepSeek V4.1 logits against an independent dense oracle of the published math.

``tests/helpers/v41_oracle.py`` re-derives V4.1's forward (transformers'
main-branch ``deepseek_v41``) in float64 over one whole sequence, reading the
tiny random checkpoints of ``tests/helpers/tiny_v41.py`` under the release's
names. The engine must give the same logits at every position whether it
prefills the prompt at once, in chunks that cut the compress groups, or decodes
it token by token. The configs use ``head_dim`` / ``index_head_dim`` that are
not multiples of 16 / 32, where the published QAT fake quantization is inert,
and prompts long enough that ``index_topk`` and ``candidate_topk_blocks``
truncate. A last test shows the comparison can fail.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from deepinfer.models.common import Batch, CausalLM, ContiguousCache
from deepinfer_interfaces import Kernels
from tests.helpers.tiny_v41 import write_tiny_v41
from tests.helpers.v41_oracle import OracleResult, oracle_forward
from deepinfer.models.registry import load_model

#: the default roles (sliding, a ratio-2 group, a ratio-1 group with a candidate source) at inert-quant dims
DEFAULT = dict(head_dim=24, qk_rope_head_dim=8, index_head_dim=12)
#: other candidate blocks, more indexer heads, a wider window, YaRN on the compress rope, three experts a token
BLOCKS = dict(
    head_dim=20, qk_rope_head_dim=8, index_head_dim=20, index_n_heads=4, index_topk=7,
    candidate_block_size=3, candidate_topk_blocks=5, sliding_window=16, num_experts_per_tok=3,
    rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 1024, "beta_fast": 32, "beta_slow": 1},
)
#: no two-level top-k
NO_CANDIDATES = dict(head_dim=24, qk_rope_head_dim=8, index_head_dim=12, candidate_source_layer_id=-1, index_topk=5)

CASES = {
    "default": (DEFAULT, 0, 72),
    "blocks": (BLOCKS, 1, 120),
    "no_candidates": (NO_CANDIDATES, 2, 96),
}

#: fp32 engine against the fp64 oracle, logits of magnitude ~5
ATOL = 1e-4


def _prompt(n: int, salt: int) -> list[int]:
    return [(37 * i + 11 + 101 * salt) % 4000 + 5 for i in range(n)]


@pytest.fixture(scope="module")
def case(request, tmp_path_factory) -> tuple[Path, CausalLM, list[int], OracleResult]:
    overrides, seed, length = CASES[request.param]
    ckpt = write_tiny_v41(tmp_path_factory.mktemp("v41_oracle") / request.param, seed=seed, **overrides)
    ids = _prompt(length, seed)
    model = load_model(ckpt, Kernels(), dtype=torch.float32)
    return ckpt, model, ids, oracle_forward(ckpt, ids)


def _engine_logits(model: CausalLM, ids: list[int], chunks: list[int]) -> torch.Tensor:
    """``[T, vocab]``: ``ids`` fed in chunks of the given sizes through one cache, every position's logits."""
    cache = ContiguousCache(model.config, 1, 256, dtype=torch.float32)
    slot = cache.allocate()
    out, at = [], 0
    for n in chunks:
        out.append(model(Batch.build([ids[at : at + n]], [slot], [at], "all"), cache))
        at += n
    assert at == len(ids)
    return torch.cat(out).double()


def _schedules(length: int) -> dict[str, list[int]]:
    """Whole; chunks of odd sizes (cutting ratio-2 groups and candidate blocks); a prefill then decoding."""
    chunks, at, sizes = [], 0, (13, 1, 22, 7, 30)
    while at < length:
        n = min(sizes[len(chunks) % len(sizes)], length - at)
        chunks.append(n)
        at += n
    prefill = length - 24  # decode the last 24 tokens: several ratio-2 groups and candidate blocks
    return {"whole": [length], "chunks": chunks, "decode": [prefill] + [1] * (length - prefill)}


@pytest.mark.parametrize("case", list(CASES), indirect=True)
def test_engine_logits_equal_the_oracle(case):
    ckpt, model, ids, oracle = case
    # a top-k choice closer than ~1e-6 of its row's scale could go either way under fp32 rounding (these
    # prompts' closest are 5e-6 .. 3e-5); exact ties (scores of exactly 0 after the relu) are broken alike,
    # towards the lower index
    assert oracle.min_margin > 2e-6, f"a near tie in a top-k choice ({oracle.min_margin:.2e}): pick another prompt"
    v = model.config.text
    visible = len(ids)  # ratio-1 entries the last query sees
    assert v.index_topk < len(ids) // 2 and v.candidate_topk_blocks * v.candidate_block_size < visible
    for name, chunks in _schedules(len(ids)).items():
        got = _engine_logits(model, ids, chunks)
        diff = (got - oracle.logits).abs().amax(-1)
        assert float(diff.max()) < ATOL, (
            f"{name}: max |engine - oracle| {float(diff.max()):.3e}; first bad positions "
            f"{(diff >= ATOL).nonzero().flatten()[:8].tolist()}"
        )


def _swap_experts(ckpt: Path, layer: int, a: int, b: int) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        out = {}
        for w in ("w1", "w2", "w3"):
            pa, pb = f"layers.{layer}.ffn.experts.{a}.{w}.weight", f"layers.{layer}.ffn.experts.{b}.{w}.weight"
            out[pa], out[pb] = f.get_tensor(pb), f.get_tensor(pa)
        return out


def _negate(ckpt: Path, name: str) -> dict[str, torch.Tensor]:
    from safetensors import safe_open

    with safe_open(str(ckpt / "model.safetensors"), framework="pt") as f:
        return {name: -f.get_tensor(name)}


@pytest.mark.parametrize("case", ["default"], indirect=True)
def test_the_oracle_notices_a_perturbed_checkpoint_or_collapse(case):
    """Swapped experts, a negated compressor gate or indexer key weight, or each site collapsing with its
    own ``pre``: the oracle's logits move well past the tolerance, so the parity above means something."""
    ckpt, model, ids, oracle = case
    ids = ids[:40]
    engine = _engine_logits(model, ids, [len(ids)])
    assert float((engine - oracle.logits[: len(ids)]).abs().max()) < ATOL  # causal: a prefix is a prefix
    variants = {
        "experts 0 and 1 of layer 3 swapped": dict(overrides=_swap_experts(ckpt, 3, 0, 1)),
        "ratio-2 compressor gate negated": dict(overrides=_negate(ckpt, "layers.2.attn.compressor.wgate.weight")),
        "ratio-1 indexer key projection negated": dict(overrides=_negate(ckpt, "layers.5.attn.indexer.wk.weight")),
        "collapse with the site's own pre": dict(swap_collapse=True),
    }
    for name, kwargs in variants.items():
        moved = float((oracle_forward(ckpt, ids, **kwargs).logits - engine).abs().max())
        assert moved > 100 * ATOL, f"{name}: the logits moved only {moved:.2e}"
