"""FP8 block-scaled checkpoints stay FP8 in the model and compute what their dequantized weights compute."""

import json

import torch
from safetensors.torch import load_file, save_file

from deepinfer_interfaces.quant import quantize
from deepinfer.models.common.batch import Batch
from deepinfer.models.common.cache import ContiguousCache
from tests.helpers.checkpoints import BOS_ID, make_tiny_checkpoint
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer_interfaces import Kernels
from tests.helpers.reference import load_model

BLOCK = (16, 16)


LINEARS = (".attn.wq_a.", ".attn.wq_b.", ".attn.wkv.", ".attn.wo_a.", ".attn.wo_b.", ".experts.", ".shared_experts.")


def _is_linear(name: str, t: torch.Tensor) -> bool:
    """The projections published checkpoints store in FP8."""
    return t.dim() == 2 and name.endswith(".weight") and any(k in name for k in LINEARS)


def _rewrite(src, dst, keep_codes: bool):
    """Copy the checkpoint, with its linear weights FP8-quantized (or quantized then dequantized)."""
    dst.mkdir()
    for f in src.iterdir():
        if f.suffix == ".safetensors":
            tensors = load_file(str(f))
            out = {}
            for name, t in tensors.items():
                if t.dtype == torch.float32 and t.dim() == 2 and _is_linear(name, t):
                    q = quantize(t, "e4m3", BLOCK, ue8m0=False)
                    if keep_codes:
                        out[name], out[name + "_scale_inv"] = q.codes, q.scales
                    else:
                        out[name] = q.dequantize()
                else:
                    out[name] = t
            save_file(out, str(dst / f.name))
        elif f.name == "config.json":
            cfg = json.loads(f.read_text())
            if keep_codes:
                cfg["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "weight_block_size": list(BLOCK)}
            (dst / f.name).write_text(json.dumps(cfg))
        elif f.is_file():
            (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _logits(model, tokens):
    cache = ContiguousCache(model.config, 1, len(tokens) + 1, dtype=model.dtype)
    return model(Batch.build([tokens], [cache.allocate()], [0], "all"), cache)


def test_fp8_checkpoint_matches_dequantized_reference(tmp_path):
    src = make_tiny_checkpoint(tmp_path, "mixed")
    fp8 = _rewrite(src, tmp_path / "fp8", keep_codes=True)
    deq = _rewrite(src, tmp_path / "deq", keep_codes=False)
    n_fp8 = sum(t.dtype == torch.float8_e4m3fn for f in fp8.glob("*.safetensors") for t in load_file(str(f)).values())
    assert n_fp8 > 5
    tokens = [BOS_ID] + list(b"fp8 weights, kept as stored")
    model = load_model(fp8)
    held = {name: t.dtype for name, t in model.named_parameters().items()}
    # every FP8 tensor stays FP8 but wo_a, whose 8-row output groups would split its 16-row scale blocks
    wo_a = sum(".attn.wo_a." in name for name in held)
    assert sum(dtype == torch.float8_e4m3fn for dtype in held.values()) == n_fp8 - wo_a
    assert all(held[name] != torch.float8_e4m3fn for name in held if ".attn.wo_a." in name)
    got = _logits(model, tokens)
    ref = _logits(load_model(deq), tokens)
    assert torch.allclose(got, ref, atol=1e-4, rtol=1e-4)  # the same products, other matmul shapes
    dequantized = DeepseekV4Model.from_pretrained(fp8, Kernels(), dtype=torch.float32, quantization="dequantize")
    assert not any(t.dtype == torch.float8_e4m3fn for t in dequantized.named_parameters().values())
    assert torch.equal(_logits(dequantized, tokens), ref)
    original = _logits(load_model(src), tokens)
    # e4m3 keeps 3 mantissa bits: the logits move, but stay close to the full-precision ones
    assert (got - original).norm() < 0.2 * original.norm()  # routing near-ties may flip experts
