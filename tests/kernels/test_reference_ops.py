"""The reference kernels against independent, element-by-element formulas."""

import math

import torch

from deepinfer_interfaces import Kernels
from deepinfer_interfaces.kernels import unpack_bitmask

K = Kernels()


def test_rms_norm_formula():
    x = torch.tensor([[1.0, -2.0, 3.0, 0.5]])
    w = torch.tensor([1.0, 2.0, 0.5, -1.0])
    eps = 0.1
    ms = sum(v * v for v in x[0].tolist()) / 4
    expect = [x[0, i].item() / math.sqrt(ms + eps) * w[i].item() for i in range(4)]
    assert torch.allclose(K.rms_norm(x, w, eps)[0], torch.tensor(expect), atol=1e-6)
    assert torch.allclose(K.rms_norm(x, None, eps)[0], torch.tensor(expect) / w, atol=1e-6)


def test_rms_norm_keeps_dtype_and_handles_empty():
    x = torch.randn(3, 8, dtype=torch.bfloat16)
    assert K.rms_norm(x, torch.ones(8), 1e-6).dtype == torch.bfloat16
    assert K.rms_norm(torch.empty(0, 8), torch.ones(8), 1e-6).shape == (0, 8)


def test_rope_interleaved_pairs_on_trailing_dims():
    d = 6  # 2 pass-through channels, then 2 interleaved pairs of rope dims
    x = torch.arange(1.0, 7.0).view(1, d)
    theta = [0.3, 1.1]
    cos = torch.tensor([[math.cos(t) for t in theta]])
    sin = torch.tensor([[math.sin(t) for t in theta]])
    out = K.rope(x, cos, sin)[0].tolist()
    assert out[:2] == [1.0, 2.0]
    for i, t in enumerate(theta):
        a, b = x[0, 2 + 2 * i].item(), x[0, 3 + 2 * i].item()
        assert math.isclose(out[2 + 2 * i], a * math.cos(t) - b * math.sin(t), abs_tol=1e-6)
        assert math.isclose(out[3 + 2 * i], a * math.sin(t) + b * math.cos(t), abs_tol=1e-6)


def test_rope_inverse_undoes_forward_per_head():
    x = torch.randn(5, 3, 16)
    ang = torch.rand(5, 4) * 10
    y = K.rope(K.rope(x, ang.cos(), ang.sin()), ang.cos(), ang.sin(), inverse=True)
    assert torch.allclose(y, x, atol=1e-5)


def _params(b, **kw):
    base = dict(temperature=torch.ones(b), top_k=torch.zeros(b, dtype=torch.long), top_p=torch.ones(b), min_p=torch.zeros(b))
    base.update({k: torch.as_tensor(v) for k, v in kw.items()})
    return base


def test_sample_greedy_is_argmax():
    logits = torch.tensor([[0.1, 3.0, 2.9], [5.0, -1.0, 4.0]])
    out = K.sample(logits, **_params(2, temperature=[0.0, 0.0]), noise=torch.rand(2, 3) + 0.01)
    assert out.tolist() == [1, 0]


def test_sample_is_exponential_race_over_allowed_tokens():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2]]))
    noise = torch.tensor([[10.0, 0.1, 0.01]])
    # unrestricted: argmax p/q = 0.2/0.01 -> token 2
    assert K.sample(logits, **_params(1), noise=noise).item() == 2
    # top_k=2 removes token 2: 0.3/0.1=3 beats 0.5/10 -> token 1
    assert K.sample(logits, **_params(1, top_k=[2]), noise=noise).item() == 1
    # top_p=0.5: token 0 alone reaches the mass
    assert K.sample(logits, **_params(1, top_p=[0.5]), noise=noise).item() == 0
    # top_p=0.75: tokens 0 and 1 (0.5 < 0.75, 0.8 >= 0.75)
    assert K.sample(logits, **_params(1, top_p=[0.75]), noise=noise).item() == 1
    # min_p=0.5: keep p >= 0.25 -> tokens 0, 1
    assert K.sample(logits, **_params(1, min_p=[0.5]), noise=noise).item() == 1
    # min_p=0.7: keep p >= 0.35 -> token 0
    assert K.sample(logits, **_params(1, min_p=[0.7]), noise=noise).item() == 0


def test_sample_frequencies_follow_tempered_distribution():
    g = torch.Generator().manual_seed(0)
    logits = torch.tensor([[1.0, 2.0, 0.5, -1.0]]).repeat(20000, 1)
    t = 0.7
    noise = torch.empty(20000, 4).exponential_(generator=g)
    out = K.sample(logits, **_params(20000, temperature=[t] * 20000), noise=noise)
    freq = torch.bincount(out, minlength=4).float() / 20000
    expect = torch.softmax(logits[0] / t, -1)
    assert torch.allclose(freq, expect, atol=0.015)


def test_bitmask_bits_are_little_endian_words():
    mask = torch.tensor([[0b101, 1 << 1]], dtype=torch.int32)  # tokens 0, 2 and 33
    allowed = unpack_bitmask(mask, 40)[0].nonzero().flatten().tolist()
    assert allowed == [0, 2, 33]
    logits = torch.zeros(1, 40)
    K.apply_token_bitmask(logits, mask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [0, 2, 33]


def test_bitmask_sign_bit_and_short_mask():
    mask = torch.tensor([[-(2**31)]], dtype=torch.int32)  # only bit 31
    logits = torch.zeros(1, 40)  # tokens 32..39 not covered by the mask: masked
    K.apply_token_bitmask(logits, mask)
    assert torch.isfinite(logits[0]).nonzero().flatten().tolist() == [31]
