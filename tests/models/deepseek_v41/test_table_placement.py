"""Where the Engram tables go (``EngineConfig.engram_tables``), one test per choice, and what decode graphs see.

The accelerator is a test double (``tests/helpers/meta_device``): the model runs
on torch's meta device, where any read of a device value on the host raises. The
tables mapped from the files stay on the host, so the lookup's host gather is
refused there and decode graphs are off; tables the device reads in place
(``map_host``) or copied onto it leave the forward nothing to read on the host.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer.errors import ConfigError
from deepinfer.models.common import Batch, ContiguousCache
from deepinfer.models.common.inputs import step_inputs
from deepinfer.models.deepseek_v41.model import DeepseekV41Model
from deepinfer_cpu.device import CPUDevice
from deepinfer_interfaces import Kernels
from tests.helpers.meta_device import MetaDevice, MetaDeviceWithoutMapping
from tests.helpers.tiny_v41 import write_tiny_v41


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return write_tiny_v41(tmp_path_factory.mktemp("v41") / "tiny")


def _model(ckpt, device: str = "meta") -> DeepseekV41Model:
    return DeepseekV41Model.from_pretrained(ckpt, Kernels(), dtype=torch.float32, device=device)


def _decode(model: DeepseekV41Model) -> torch.Tensor:
    """A prefill of two sequences, then one decode step: the decode step's logits."""
    dev = model.device
    cache = ContiguousCache(model.config, 2, 64, dtype=torch.float32, device=dev)
    slots = [cache.allocate() for _ in range(2)]
    with torch.inference_mode():
        model(Batch.build([[5, 6, 7, 8, 9], [10, 11, 12]], slots, [0, 0]), cache)
        batch = Batch.build([[13], [14]], slots, [5, 3])
        cache.begin_forward(batch)
        return model.forward(step_inputs(batch, cache, dev), cache)


def _tables(model: DeepseekV41Model) -> list:
    return [engram.table for engram in model.engram_layers]


def test_mapped_keeps_the_file_mappings_whose_host_gather_the_device_refuses(ckpt):
    model = _model(ckpt)
    line = model.place_tables(MetaDevice(), "mapped")
    assert model.table_placement.where == "mapped" and "mapped" in line
    assert all(t.mapped and t.codes.device.type == "cpu" for t in _tables(model))
    blocker = model.graph_blocker()
    assert blocker is not None and "engram_tables=mapped" in blocker and "meta" in blocker
    with pytest.raises(NotImplementedError, match="Cannot copy out of meta tensor"):
        _decode(model)  # the old path: the lookup gathers host rows by device ids


def test_host_gives_tables_the_device_reads_in_place(ckpt):
    model = _model(ckpt)
    model.place_tables(MetaDevice(), "host")
    assert model.table_placement.where == "host"
    assert all(t.codes.device.type == "meta" and t.scales.device.type == "meta" and not t.mapped for t in _tables(model))
    assert model.graph_blocker() is None
    logits = _decode(model)
    assert logits.shape == (2, model.config.vocab_size) and logits.device.type == "meta"


def test_host_is_refused_in_one_line_where_the_device_cannot_read_host_memory(ckpt):
    model = _model(ckpt)
    with pytest.raises(ConfigError) as err:
        model.place_tables(MetaDeviceWithoutMapping(), "host")
    message = str(err.value)
    assert "\n" not in message and "engram_tables=host" in message and "cannot" in message
    assert "engram_tables=device" in message and "mapped" in message


def test_device_copies_the_tables_and_refuses_when_they_do_not_fit(ckpt):
    model = _model(ckpt)
    model.place_tables(MetaDeviceWithoutMapping(), "device")
    assert model.table_placement.where == "device" and model.graph_blocker() is None
    assert all(t.codes.device.type == "meta" for t in _tables(model))
    assert _decode(model).device.type == "meta"
    small = _model(ckpt)
    nbytes = sum(t.nbytes() for t in _tables(small))
    with pytest.raises(ConfigError, match=r"engram_tables=device: the Engram tables take .* GiB free; use engram_tables=host or mapped"):
        small.place_tables(MetaDeviceWithoutMapping(free=nbytes - 1), "device")


def test_auto_maps_on_the_cpu_reads_host_memory_where_it_can_else_copies_what_fits(ckpt):
    cpu = _model(ckpt, "cpu")
    cpu.place_tables(CPUDevice(), "auto")
    assert cpu.table_placement.where == "mapped" and all(t.mapped for t in _tables(cpu)) and cpu.graph_blocker() is None

    mapping = _model(ckpt)
    mapping.place_tables(MetaDevice(), "auto")
    assert mapping.table_placement.where == "host" and mapping.graph_blocker() is None

    nbytes = sum(t.nbytes() for t in _tables(mapping))
    fits = _model(ckpt)
    fits.place_tables(MetaDeviceWithoutMapping(free=4 * nbytes), "auto")
    assert fits.table_placement.where == "device" and fits.graph_blocker() is None

    too_big = _model(ckpt)
    too_big.place_tables(MetaDeviceWithoutMapping(free=2 * nbytes), "auto")  # past the 25 % share
    assert too_big.table_placement.where == "mapped" and all(t.mapped for t in _tables(too_big))
    blocker = too_big.graph_blocker()
    assert blocker is not None and "cannot read host memory in place" in blocker and "25%" in blocker


def test_the_placement_changes_no_number_and_is_an_engine_flag(ckpt):
    """On the CPU, tables copied into memory (``device``) give the mapped tables' tokens and log-probabilities."""
    import argparse

    from deepinfer import LLM, SamplingParams
    from deepinfer.engine_flags import add_engine_arguments, engine_overrides

    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    assert engine_overrides(parser.parse_args(["--engram-tables", "host"])) == {"engram_tables": "host"}
    with pytest.raises(SystemExit):
        parser.parse_args(["--engram-tables", "pinned"])

    runs = {}
    for placement in ("mapped", "device"):
        llm = LLM(model=str(ckpt), backend="cpu", engram_tables=placement, max_model_len=64, kv_cache_memory=8 << 20)
        table = llm.engine.runner.model.engram_layers[0].table
        out = llm.generate([[5, 6, 7, 8, 9, 10, 11]], SamplingParams(temperature=0, max_tokens=6, ignore_eos=True, logprobs=1))[0]
        runs[placement] = (table.mapped, out.outputs[0].token_ids, [max(p.values(), key=lambda x: x.logprob).logprob
                                                                    for p in out.outputs[0].logprobs])
    assert runs["mapped"][0] and not runs["device"][0]
    assert runs["mapped"][1] == runs["device"][1] and runs["mapped"][2] == runs["device"][2]
