"""Engram tables in pinned host memory read by CUDA graphs (``CUDADevice.map_host``): needs a CUDA device.

The alias is a CUDA tensor at the pinned copy's host address; the Triton
lookup gathers its rows inside a captured graph as the reference gathers them
on the host, and a V4.1 engine with ``engram_tables=host`` replays decode
graphs with the tokens of the mapped tables' eager run.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(importlib.util.find_spec("triton") is None, reason="triton is not installed (pip install -e '.[cuda]')"),
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


def test_map_host_aliases_pinned_memory_that_a_graph_reads():
    from deepinfer_cuda.device import CUDADevice
    from deepinfer_cuda.kernels import CUDAKernels
    from deepinfer_interfaces import Kernels

    device = CUDADevice()
    g = torch.Generator().manual_seed(0)
    codes = torch.randn(1000, 64, generator=g).to(torch.float8_e4m3fn)
    scales = torch.randint(120, 134, (1000, 2), generator=g, dtype=torch.int32).to(torch.uint8)
    host_codes, host_scales = device.map_host(codes), device.map_host(scales)
    assert host_codes.device.type == "cuda" and host_codes.dtype == codes.dtype and host_codes.shape == codes.shape
    assert host_codes.data_ptr() != codes.data_ptr()  # a pinned copy, read where it lies (under UVA: its host address)
    summed = host_codes.view(torch.uint8).to(torch.int64).sum(dim=1)  # a kernel reading the host rows
    assert torch.equal(summed.cpu(), codes.view(torch.uint8).to(torch.int64).sum(dim=1))
    free = torch.cuda.mem_get_info()[0]
    ids = torch.zeros(4, 6, dtype=torch.int64, device="cuda")
    k = CUDAKernels()
    graph = torch.cuda.CUDAGraph()
    k.engram_lookup(host_codes, host_scales, ids, torch.float32)  # compile outside the capture
    with torch.cuda.graph(graph):
        out = k.engram_lookup(host_codes, host_scales, ids, torch.float32)
    new_ids = torch.randint(0, 1000, (4, 6), generator=g)
    ids.copy_(new_ids)
    graph.replay()
    torch.cuda.synchronize()
    want = Kernels().engram_lookup(codes, scales, new_ids, torch.float32)
    assert torch.equal(out.cpu(), want)
    assert torch.cuda.mem_get_info()[0] > free - (8 << 20)  # the table is not in GPU memory


def test_v41_decode_graphs_read_host_tables_with_the_mapped_tables_tokens(tmp_path):
    from deepinfer import LLM, SamplingParams
    from tests.helpers.tiny_v41 import write_tiny_v41

    ckpt = write_tiny_v41(tmp_path / "v41")
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12, 13, 14]]
    sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)
    runs = {}
    for placement in ("mapped", "host", "device"):
        llm = LLM(model=str(ckpt), backend="cuda", dtype="float32", engram_tables=placement, max_model_len=64,
                  max_num_seqs=2, graph_capture_sizes=[1, 2], kv_cache_memory=64 << 20)
        outs = llm.generate(prompts, sp)
        runs[placement] = ([o.outputs[0].token_ids for o in outs], llm.get_metrics()["graph_replays"])
        del llm
    assert runs["mapped"][1] == 0 and runs["host"][1] > 5 and runs["device"][1] > 5
    assert runs["host"][0] == runs["mapped"][0] == runs["device"][0]
