"""Batch-invariant mode on the kernel side: the switch and its declared ops, the row-tiled primitives, and the
bundled model's logits for a sequence alone, among other sequences and cut into chunks, bit for bit.

The per-op check (every op that promises invariance, batch vs rows alone vs chunks) is the conformance
suite's ``invariance`` cases, run on the CPU reference by ``tests/conformance/test_conformance_ops.py``.
"""

from __future__ import annotations

import inspect

import pytest
import torch

from deepinfer.engine import BUNDLED_MODEL
from deepinfer.models.common.batch import Batch
from deepinfer.models.common.cache import ContiguousCache
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer_interfaces import Kernels
from deepinfer_interfaces.kernels import lanewise, row_tiled_matmul
from deepinfer_interfaces.specs import SPECS


def test_switch_is_off_by_default_and_per_instance():
    k, other = Kernels(), Kernels()
    assert k.batch_invariant is False
    k.set_batch_invariant(True)
    assert k.batch_invariant is True and other.batch_invariant is False
    k.set_batch_invariant(False)
    assert k.batch_invariant is False
    with pytest.raises(TypeError, match="takes a bool"):
        k.set_batch_invariant("yes")  # type: ignore[arg-type]


def test_every_promise_names_real_row_arguments_and_has_a_spec():
    promised = Kernels.batch_invariant_ops()
    assert {"linear", "rms_norm", "sparse_attention", "entry_attention", "moe_experts", "fp8_linear", "sample"} <= set(promised)
    for op, rows in promised.items():
        params = inspect.signature(getattr(Kernels, op)).parameters
        assert rows and set(rows) <= set(params), (op, rows)
        assert op in SPECS, op


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_row_tiled_matmul_gives_each_row_the_same_bits_whatever_its_neighbours(dtype):
    g = torch.Generator().manual_seed(0)
    w_t = torch.randn(96, 200, generator=g).to(dtype)
    x = torch.randn(70, 96, generator=g).to(dtype)
    full = row_tiled_matmul(x, w_t)
    torch.testing.assert_close(full.float(), (x.float() @ w_t.float()), atol=0.05 if dtype == torch.bfloat16 else 1e-4, rtol=0.02)
    for i in (0, 17, 69):
        assert torch.equal(row_tiled_matmul(x[i : i + 1], w_t), full[i : i + 1])
    assert torch.equal(row_tiled_matmul(x.flip(0), w_t), full.flip(0))
    assert torch.equal(row_tiled_matmul(x[5:40], w_t), full[5:40])


def test_lanewise_keeps_every_element_on_one_path():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(300, 100, generator=g)
    full = lanewise(torch.nn.functional.silu, x)
    torch.testing.assert_close(full, torch.nn.functional.silu(x), atol=1e-6, rtol=1e-6)
    for i in (0, 7, 299):
        assert torch.equal(lanewise(torch.nn.functional.silu, x[i : i + 1]), full[i : i + 1])


@pytest.fixture(scope="module")
def model() -> DeepseekV4Model:
    kernels = Kernels()
    kernels.set_batch_invariant(True)
    return DeepseekV4Model.from_pretrained(BUNDLED_MODEL, kernels, dtype=torch.float32)


def _logits(model: DeepseekV4Model, steps: list[list[tuple[int, list[int], int]]]) -> torch.Tensor:
    """Every logit row of sequence 0 over ``steps`` (each a list of (sequence, tokens, start position))."""
    cache = ContiguousCache(model.config, 8, 320, dtype=torch.float32)
    slots = [cache.allocate() for _ in range(8)]
    rows = []
    with torch.inference_mode():
        for step in steps:
            batch = Batch.build([t for _, t, _ in step], [slots[i] for i, _, _ in step], [s for _, _, s in step], logits="all")
            logits = model(batch, cache)
            at = 0
            for seq, tokens, _ in step:
                if seq == 0:
                    rows.append(logits[at : at + len(tokens)])
                at += len(tokens)
    return torch.cat(rows)


def test_model_logits_are_bitwise_the_same_alone_batched_and_chunked(model):
    g = torch.Generator().manual_seed(3)
    vocab = model.config.vocab_size
    probe = torch.randint(3, vocab, (150,), generator=g).tolist()
    others = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in (7, 90, 1, 200, 33)]
    alone = _logits(model, [[(0, probe, 0)]])
    batched = _logits(model, [[(0, probe, 0)] + [(i + 1, o, 0) for i, o in enumerate(others)]])
    assert torch.equal(batched, alone), (batched - alone).abs().max()
    for chunk in (16, 64):
        chunked = _logits(model, [[(0, probe[a : a + chunk], a)] for a in range(0, len(probe), chunk)])
        assert torch.equal(chunked, alone), (chunk, (chunked - alone).abs().max())
    # uneven chunks next to other sequences' prefills and decodes, the probe's decode-sized step in the middle
    mixed = _logits(model, [
        [(0, probe[:40], 0), (1, others[3], 0)],
        [(2, others[1], 0), (0, probe[40:41], 40), (3, others[2], 0)],
        [(0, probe[41:], 41), (1, others[0], 200), (4, others[4], 0)],
    ])
    assert torch.equal(mixed, alone), (mixed - alone).abs().max()
    assert torch.isfinite(alone).all() and alone.abs().max() > 0


def test_mode_changes_no_more_than_rounding(model):
    """The mode reorders sums; it computes the same function (within fp32 rounding of the default mode)."""
    g = torch.Generator().manual_seed(4)
    prompt = torch.randint(3, model.config.vocab_size, (40,), generator=g).tolist()
    invariant = _logits(model, [[(0, prompt, 0)]])
    model.kernels.set_batch_invariant(False)
    try:
        default = _logits(model, [[(0, prompt, 0)]])
    finally:
        model.kernels.set_batch_invariant(True)
    torch.testing.assert_close(invariant, default, atol=1e-4, rtol=1e-4)
