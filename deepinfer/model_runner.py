"""One rank's model, cache and sampler on the selected backend's device.

The runner turns scheduled chunks into a flattened batch on the device, runs the
forward and returns logits. It touches the hardware only through the backend's
``Device`` and ``Kernels``; all per-rank state lives on the instance.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from .config import EngineConfig
from .errors import ConfigError
from .model.batch import Batch
from .model.model import DeepseekV4Model
from .paged_cache import PagedModelCache, block_size_for
from .registry import SelectedBackend

log = logging.getLogger("deepinfer")

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class CachePlan:
    """How the KV budget was split, reported at start-up."""

    block_size: int
    num_blocks: int
    num_slots: int
    bytes_per_block: int
    bytes_per_slot: int
    #: bytes the pools take (at most the configured budget)
    budget: int

    @property
    def token_capacity(self) -> int:
        return self.num_blocks * self.block_size

    def describe(self) -> str:
        mib = 1 << 20
        return (
            f"KV cache: {self.num_blocks} blocks of {self.block_size} tokens ({self.token_capacity} tokens of compressed state) "
            f"+ {self.num_slots} sequence slots, {self.budget / mib:.1f} MiB"
        )


class ModelRunner:
    def __init__(self, selected: SelectedBackend, model_dir: str | Path, cfg: EngineConfig) -> None:
        self.device = selected.device
        self.kernels = selected.kernels
        self.torch_device = self.device.torch_device
        self.dtype = self._dtype(cfg.dtype)
        self.device.manual_seed(cfg.seed)
        self.model = DeepseekV4Model.from_pretrained(model_dir, self.kernels, dtype=self.dtype, device=self.torch_device)
        self.config = self.model.config
        self.max_model_len = cfg.max_model_len or min(self.config.max_position_embeddings, 32768)
        if self.max_model_len > self.config.max_position_embeddings:
            raise ConfigError(
                f"max_model_len {self.max_model_len} exceeds the model's max_position_embeddings {self.config.max_position_embeddings}; lower it"
            )
        self.max_step_tokens = min(cfg.max_num_batched_tokens, cfg.max_prefill_chunk)
        self.plan = self._plan(cfg)
        log.info(self.plan.describe())
        max_blocks = -(-self.max_model_len // self.plan.block_size)
        self.cache = PagedModelCache(
            self.config, self.plan.num_slots, self.plan.num_blocks, self.plan.block_size, max_blocks,
            self.max_step_tokens, self.dtype, self.torch_device,
        )

    def _dtype(self, name: str) -> torch.dtype:
        if name == "auto":
            # exact fp32 on the host; bf16 where the accelerator has fast bf16 matmuls
            return torch.float32 if self.device.type == "cpu" else torch.bfloat16
        dtype = _DTYPES[name]
        if dtype not in self.device.capabilities().dtypes:
            raise ConfigError(f"dtype {name} is not supported by device {self.device.type}; choose another --dtype")
        return dtype

    def _plan(self, cfg: EngineConfig) -> CachePlan:
        block_size = block_size_for(self.config, cfg.block_size)
        per_block = PagedModelCache.bytes_per_block(self.config, block_size, self.dtype)
        per_slot = PagedModelCache.bytes_per_slot(self.config, self.max_step_tokens, self.dtype)
        if cfg.kv_cache_memory is not None:
            budget = cfg.kv_cache_memory
        else:
            free, _ = self.device.memory_info()
            budget = int(free * cfg.kv_cache_memory_fraction)
        slots = cfg.max_num_seqs
        need_blocks = -(-self.max_model_len // block_size)
        remaining = budget - slots * per_slot
        # more blocks than every slot at max_model_len can use would only hold cold prefixes
        ceiling = slots * need_blocks
        num_blocks = min(remaining // per_block, ceiling) if per_block else ceiling
        if remaining < 0 or num_blocks < need_blocks:
            need = slots * per_slot + need_blocks * per_block
            raise ConfigError(
                f"kv_cache_memory of {budget} bytes cannot hold one sequence of max_model_len {self.max_model_len}: "
                f"{slots} sequence slots take {slots * per_slot} bytes and {need_blocks} blocks take {need_blocks * per_block} "
                f"(at least {need} bytes needed); raise kv_cache_memory or lower max_model_len / max_num_seqs"
            )
        used = slots * per_slot + int(num_blocks) * per_block
        return CachePlan(block_size, int(num_blocks), slots, per_block, per_slot, used)

    def execute(
        self,
        tokens: list[list[int]],
        starts: list[int],
        offsets: list[list[int]],
        slots: list[int],
        fix: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> torch.Tensor:
        """Run one step (block tables already installed in ``self.cache``); return the
        fp32 logits of the requested rows, sequence by sequence.

        ``fix`` = (flat positions, token ids on the device) fills placeholder tokens.
        """
        batch = Batch.build(tokens, slots, starts, offsets, device=self.torch_device)
        if fix is not None:
            batch.input_ids[fix[0]] = fix[1]
        return self.model.forward(batch, self.cache).float()
