"""The Ascend path of the vision tower's attention, checked without an NPU: ``npu_fusion_attention`` in its TND
layout through a stand-in torch_npu that computes what the op reference documents (each query attends within its
own sequence, the sequences given by their cumulative ends; no mask with ``sparse_mode=0`` and the full pre/next
token counts) and takes exactly the arguments the wheel's schema declares; the inputs it refuses, its fallback
on error, and the strict view without torch_npu."""

from __future__ import annotations

import inspect
import logging

import pytest
import torch

from deepinfer_ascend.kernels import AscendKernels
from deepinfer_interfaces import Kernels, NotSupportedError
from tests.backends.ascend.test_ascend_fused_v4 import ASCEND_950, StandInNpu

REF = Kernels()


class DocumentedFusionAttention:
    """``torch_npu.npu_fusion_attention`` for ``input_layout="TND"`` without masks or dropout, in plain torch."""

    def __init__(self, raises: Exception | None = None) -> None:
        self.npu = StandInNpu(ASCEND_950)
        self.raises = raises
        self.calls: list[dict] = []

    def npu_fusion_attention(self, query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                             scale=1.0, keep_prob=1.0, pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0,
                             prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0, gen_mask_parallel=True,
                             sync=False, softmax_layout="", sink=None, dropout_mask=None, seed=0, offset=0):
        self.calls.append(dict(head_num=head_num, layout=input_layout, qlen=actual_seq_qlen, kvlen=actual_seq_kvlen))
        if self.raises is not None:
            raise self.raises
        assert input_layout == "TND" and query.shape[1] == head_num and query.is_contiguous()
        assert atten_mask is None and sparse_mode == 0 and keep_prob == 1.0
        assert pre_tockens >= query.shape[0] and next_tockens >= query.shape[0]
        assert actual_seq_qlen == actual_seq_kvlen and actual_seq_qlen[-1] == query.shape[0]
        assert all(a < b for a, b in zip([0, *actual_seq_qlen], actual_seq_qlen)), "ends strictly increase"
        out = torch.empty_like(query)
        for start, end in zip([0, *actual_seq_qlen], actual_seq_qlen):
            s = torch.einsum("qnd,knd->nqk", query[start:end].float(), key[start:end].float()) * scale
            out[start:end] = torch.einsum("nqk,knd->qnd", s.softmax(-1), value[start:end].float()).to(query.dtype)
        return out, None, None, None, 0, 0, 0


def _inputs(lengths, h=4, d=32, dtype=torch.bfloat16, seed=0):
    g = torch.Generator().manual_seed(seed)
    qkv = torch.randn(sum(lengths), 3, h, d, generator=g).to(dtype)
    q, k, v = qkv.unbind(1)  # strided views, as the tower passes them
    return q, k, v, torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32), d**-0.5


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_packed_images_run_the_fused_op_and_match_the_reference(dtype):
    tn = DocumentedFusionAttention()
    args = _inputs([9, 1, 0, 22], dtype=dtype)
    got = AscendKernels(torch_npu=tn).vit_attention(*args)
    assert tn.calls == [dict(head_num=4, layout="TND", qlen=[9, 10, 32], kvlen=[9, 10, 32])]  # the empty image left out
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), REF.vit_attention(*args).float(), atol=tol, rtol=tol)


def test_inputs_the_op_does_not_take_run_the_reference_or_are_not_supported_when_strict():
    tn = DocumentedFusionAttention()
    odd = _inputs([5, 3], d=24)  # head dim not a multiple of 16
    torch.testing.assert_close(AscendKernels(torch_npu=tn).vit_attention(*odd), REF.vit_attention(*odd))
    with pytest.raises(NotSupportedError, match="multiple of 16 up to 512, not 24"):
        AscendKernels(strict=True, torch_npu=tn).vit_attention(*odd)
    assert tn.calls == []
    empty = _inputs([], d=32)
    assert AscendKernels(strict=True, torch_npu=tn).vit_attention(*empty).shape == (0, 4, 32)


def test_an_error_from_the_op_falls_back_to_the_reference_once_and_for_all(caplog):
    tn = DocumentedFusionAttention(raises=RuntimeError("EZ9999: no kernel"))
    kernels = AscendKernels(torch_npu=tn)
    args = _inputs([6, 6])
    with caplog.at_level(logging.WARNING, logger="deepinfer.ascend"):
        torch.testing.assert_close(kernels.vit_attention(*args), REF.vit_attention(*args))
        kernels.vit_attention(*args)
    assert len(tn.calls) == 1 and "vit_attention" in kernels.failed
    assert "npu_fusion_attention" in caplog.text


def test_without_torch_npu_the_strict_view_says_so():
    assert AscendKernels.paths()["vit_attention"] == "torch_npu:npu_fusion_attention"
    args = _inputs([4])
    torch.testing.assert_close(AscendKernels().vit_attention(*args), REF.vit_attention(*args))
    with pytest.raises(NotSupportedError, match="needs torch_npu: torch_npu:npu_fusion_attention"):
        AscendKernels(strict=True).vit_attention(*args)


def test_the_stand_in_takes_exactly_the_arguments_the_wheel_declares():
    from tests.helpers.npu_schemas import codegen_schemas, parse_schema
    from tests.helpers.torch_npu_wheel import WheelUnavailable, torch_npu_wheel

    try:
        wheel = torch_npu_wheel()
    except WheelUnavailable as exc:
        pytest.skip(str(exc))
    schema = parse_schema(codegen_schemas(wheel.path)["npu_fusion_attention"])
    params = list(inspect.signature(DocumentedFusionAttention.npu_fusion_attention).parameters.values())[1:]
    assert [(p.name, p.kind == p.KEYWORD_ONLY) for p in params] == [(p.name, p.keyword_only) for p in schema.params]
