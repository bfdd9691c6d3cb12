"""The forward never waits for the host: zero graph breaks for decode and mixed steps, and padding changes nothing.

``torch._dynamo.explain`` traces ``model.forward`` over the step's device
inputs; any ``.item()``, ``nonzero`` or data-dependent shape would show up as a
graph break. The same inputs padded to larger static sizes (as a captured
graph runs them) must give the same logits and leave the same cache state.
DeepSeek V4.1 with Engram layers (tables on layers 1 and 4) traces whole too, on
a device test double whose memory refuses every host read
(``tests/helpers/meta_device``) once its tables are where it reads them in place.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from deepinfer.engine import BUNDLED_MODEL
from deepinfer.models.common import Batch, ContiguousCache, StepLayout, StepShape
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer.models.deepseek_v41.model import DeepseekV41Model
from deepinfer.models.common.config import CSA, HCA, SLIDING
from deepinfer.models.common.inputs import fill_step_inputs, step_inputs
from deepinfer_interfaces import Kernels
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.meta_device import MetaDevice
from tests.helpers.tiny_v41 import write_tiny_v41


@pytest.fixture(scope="module")
def bundled():
    return DeepseekV4Model.from_pretrained(BUNDLED_MODEL, Kernels(), dtype=torch.float32)


@pytest.fixture(scope="module")
def every_type(tmp_path_factory):
    """Four layers (HCA, CSA, sliding, CSA), a YaRN compress rope, four streams, an active SwiGLU clamp."""
    ckpt = make_tiny_checkpoint(tmp_path_factory.mktemp("ck"), "compressed_yarn")
    model = DeepseekV4Model.from_pretrained(ckpt, Kernels(), dtype=torch.float32)
    assert set(model.config.layer_types) == {SLIDING, CSA, HCA}
    return model


@pytest.fixture(scope="module")
def v41_ckpt(tmp_path_factory):
    return write_tiny_v41(tmp_path_factory.mktemp("v41") / "tiny")


def _prefilled(model, lens, kv_cache_dtype="model"):
    cache = ContiguousCache(model.config, len(lens), 160, dtype=torch.float32, kv_cache_dtype=kv_cache_dtype, device=model.device)
    slots = [cache.allocate() for _ in lens]
    model(Batch.build([[(7 * i + j) % 200 + 1 for j in range(n)] for i, n in enumerate(lens)], slots, [0] * len(lens)), cache)
    return cache, slots


def _breaks(model, cache, batch) -> tuple[int, int]:
    cache.begin_forward(batch)
    explained = torch._dynamo.explain(model.forward)(step_inputs(batch, cache, model.device), cache)
    return explained.graph_break_count, explained.graph_count


@pytest.mark.parametrize("kv_cache_dtype", ["model", "fp8"])
@pytest.mark.parametrize("which", ["bundled", "every_type"])
def test_decode_and_mixed_steps_trace_without_graph_breaks(which, kv_cache_dtype, request):
    """Packed records (``fp8``) are written and read without a host sync too."""
    model = request.getfixturevalue(which)
    lens = [33, 64, 5]
    cache, slots = _prefilled(model, lens, kv_cache_dtype)
    assert cache.formats.packed == (kv_cache_dtype == "fp8")
    decode = Batch.build([[3], [4], [5]], slots, lens)
    assert _breaks(model, cache, decode) == (0, 1)
    starts = [n + 1 for n in lens]
    mixed = Batch.build([[6], list(range(9, 40)), [8]], slots, starts, logits=[[0], [0, 30], [0]])
    assert _breaks(model, cache, mixed) == (0, 1)


def test_v41_steps_trace_whole_on_a_device_that_refuses_host_reads(v41_ckpt):
    """Tables placed where the device reads them in place: decode and mixed steps, zero breaks, nothing read on
    the host (the meta device would raise). The mapped tables' host gather is what it refuses."""
    model = DeepseekV41Model.from_pretrained(v41_ckpt, Kernels(), dtype=torch.float32, device="meta")
    assert len(model.engram_layers) == 2
    model.place_tables(MetaDevice(), "host")
    assert model.graph_blocker() is None and all(e.table.codes.device.type == "meta" for e in model.engram_layers)
    lens = [33, 64, 5]
    cache, slots = _prefilled(model, lens)
    assert _breaks(model, cache, Batch.build([[3], [4], [5]], slots, lens)) == (0, 1)
    mixed = Batch.build([[6], list(range(9, 40)), [8]], slots, [n + 1 for n in lens], logits=[[0], [0, 30], [0]])
    assert _breaks(model, cache, mixed) == (0, 1)

    mapped = DeepseekV41Model.from_pretrained(v41_ckpt, Kernels(), dtype=torch.float32, device="meta")
    mapped.place_tables(MetaDevice(), "mapped")
    assert mapped.graph_blocker() is not None
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        _prefilled(mapped, lens)


@pytest.mark.parametrize("kv_cache_dtype", ["model", "fp8"])
def test_padded_inputs_give_the_same_logits_and_cache(every_type, kv_cache_dtype):
    model = every_type
    lens = [29, 47]
    runs = []
    for pad in (False, True):
        cache, slots = _prefilled(model, lens, kv_cache_dtype)
        batch = Batch.build([[11], [12]], slots, lens)
        cache.begin_forward(batch)
        shape = StepShape.padded(8, 8, 8, 160, cache.geometry) if pad else StepShape.exact(batch, cache.geometry)
        layout = StepLayout(shape, cache.geometry)
        host = np.empty(layout.numel, dtype=np.int64)
        fill_step_inputs(host, layout, batch, cache)
        with torch.inference_mode():
            logits = model.forward(layout.forward_inputs(torch.from_numpy(host)), cache)
        runs.append((logits[:2].clone(), [t.clone() for t in cache.pools()]))
    (a, pools_a), (b, pools_b) = runs
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    assert all(torch.equal(x, y) if x.dtype == torch.uint8 else torch.allclose(x, y, atol=1e-6) for x, y in zip(pools_a, pools_b))
