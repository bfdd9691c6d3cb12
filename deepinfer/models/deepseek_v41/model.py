"""The DeepSeek V4.1 causal LM: shared compressed KV, Engram n-gram memory, V4.1's mHC, and its vision tower.

Parameters carry the names the V4 model uses for the same tensors (the
release's names map to them through ``loader/names.py``); the Engram tables
are memory-mapped from the checkpoint's files, then placed where the engine
asks (``place_tables``: the mappings, host memory the device reads in place, or
device memory), and only the rows a step's n-grams hash to are read.
"""

from __future__ import annotations

import torch

from deepinfer_interfaces import Device, Kernels

from .attention import SharedIndices
from ..common.cache import ModelCache
from .config import V41ModelConfig
from .draft import DSparkDraftV41
from .engram import TABLE_KEYS, TABLE_STORAGE, EngramHasher, EngramLayout, EngramTable, compressed_vocabulary
from ..common.inputs import ForwardInputs
from .layer import DecoderLayerV41
from ..common.linear import PLAIN, QuantPlan, Storage
from ..common.metadata import build_layer_metas
from .table_placement import TablePlacement, place_tables
from ..common.causal_lm import CausalLM
from ..common.moe import ExpertSharding
from ...multimodal import ImageSpan
from .vision import VISION_PREFIXES, VisionTower


class DeepseekV41Model(CausalLM):
    """Weights in ``dtype`` except those kept in fp32 (norms, hyper-connections, sinks, router biases) and
    those the ``plan`` keeps quantized. The Engram layers need the tokenizer's compressed vocabulary
    (``loaded`` builds it from the checkpoint directory, or call ``bind_engram``)."""

    config_class = V41ModelConfig
    draft_class = DSparkDraftV41

    def __init__(
        self,
        config: V41ModelConfig,
        kernels: Kernels,
        *,
        dtype: torch.dtype = torch.bfloat16,
        device: torch.device | str = "cpu",
        plan: QuantPlan | None = None,
        sharding: ExpertSharding | None = None,
        tables: dict[int, EngramTable] | None = None,
        table_storage: Storage = TABLE_STORAGE,
    ) -> None:
        """``tables``: the Engram tables by layer, memory-mapped from the checkpoint (``from_pretrained``);
        None: held as parameters the loader fills (small models), as ``table_storage``."""
        if not isinstance(config, V41ModelConfig):
            raise ValueError(f"DeepseekV41Model needs a DeepSeek V4.1 config (V41ModelConfig), not {type(config).__name__}")
        super().__init__(config, kernels, dtype=dtype, device=device, plan=plan, sharding=sharding)
        c = config
        self.mapped_tables = tables is not None
        tables = tables or {}
        self.layers = [
            DecoderLayerV41(c, role, dtype, device, self.plan, sharding, tables.get(role.index), table_storage) for role in c.text.layers()
        ]
        for layer in self.layers:
            self.body.child(f"layers.{layer.index}", layer)
        self.norm = self.body.param("norm.weight", (c.hidden_size,), torch.float32)
        #: the vision tower, under the release's top-level names (None: the config declares none)
        self.vision: VisionTower | None = None
        if c.vision is not None:
            self.vision = self.child("", VisionTower(c.vision, c.hidden_size, dtype, device))
        self.engram_layers = [layer.engram for layer in self.layers if layer.engram is not None]
        #: the Engram n-gram hashing, the compressed id of every token and of the pad token (``bind_engram``)
        self.hasher: EngramHasher | None = None
        self.token_map: torch.Tensor | None = None
        self.pad_id = 0
        #: where ``place_tables`` put the memory-mapped tables (None: not placed yet, or the tables are parameters)
        self.table_placement: TablePlacement | None = None

    @classmethod
    def checkpoint_kwargs(cls, config: V41ModelConfig, checkpoint) -> dict:
        """The Engram tables, memory-mapped from the checkpoint's files (never loaded whole)."""
        return {"tables": {i: EngramTable.from_catalog(checkpoint.catalog, i) for i in config.text.engram_layer_ids}}

    @classmethod
    def inventory_kwargs(cls, quantized: bool) -> dict:
        """The Engram tables as parameters: FP8 rows as the release stores them, or dequantized."""
        return {"table_storage": TABLE_STORAGE if quantized else PLAIN}

    def inventory_part(self, name: str) -> str:
        """The Engram tables apart (one copy per rank, never split by expert parallelism), and the vision tower."""
        if name.startswith(VISION_PREFIXES):
            return "vision"
        return "engram" if ".engram." in name and name.endswith(TABLE_KEYS) else "backbone"

    @torch.inference_mode()
    def encode_images(self, spans: list[ImageSpan]) -> list[torch.Tensor]:
        """Each image's span embedding ``[span.length, hidden]`` in the model dtype (its start, rows of patch tokens
        each ended by a newline, its end), every image of the call in one ViT pass; nothing is read back."""
        if (why := self.image_blocker()) is not None:
            raise ValueError(why)
        return self.vision.encode(self.kernels, spans)

    def image_blocker(self) -> str | None:
        if self.vision is None:
            return ("this DeepSeek V4.1 checkpoint has no vision tower (config.json declares no vision_config layers); "
                    "send text only, or load a checkpoint with one")
        return None

    def loaded(self, checkpoint) -> None:
        """Hash the n-grams with the checkpoint's tokenizer."""
        if self.engram_layers:
            from ...loader.tokenizer import load_tokenizer

            self.bind_engram(load_tokenizer(checkpoint.directory))

    def bind_engram(self, tokenizer) -> None:
        """Build the n-gram hashing from ``tokenizer`` (its compressed vocabulary must be the config's size)."""
        v = self.config.text
        lookup, _ = compressed_vocabulary(tokenizer, v.engram_compressed_vocab_size)
        table = torch.zeros(max(self.config.vocab_size, len(lookup)), dtype=torch.int64)
        table[: len(lookup)] = torch.from_numpy(lookup)
        self.token_map = table.to(self.device)
        self.pad_id = int(lookup[v.engram_pad_token_id])
        self.hasher = EngramHasher(EngramLayout.from_config(v), self.device)

    def place_tables(self, device: Device, placement: str) -> str | None:
        """Move the memory-mapped Engram tables where ``placement`` asks (``table_placement.place_tables``)."""
        if not self.mapped_tables or not self.engram_layers:
            return None
        tables, self.table_placement = place_tables([e.table for e in self.engram_layers], placement, device)
        for engram, table in zip(self.engram_layers, tables):
            engram.table = table
        return self.table_placement.describe()

    def graph_blocker(self) -> str | None:
        """Engram tables on the host that the model's device does not read in place: each lookup copies its
        hash ids to the host, which a captured graph cannot do."""
        for engram in self.engram_layers:
            if engram.table.codes.device != self.device:
                why = f" ({self.table_placement.reason})" if self.table_placement is not None else ""
                return f"the Engram tables are memory-mapped on the host{why} and the model runs on {self.device}"
        return None

    def not_loaded(self, name: str) -> bool:
        """Also memory-mapped Engram tables' tensors: read by rows from the files, never loaded."""
        table = self.mapped_tables and ".engram." in name and name.endswith(TABLE_KEYS)
        return table or super().not_loaded(name)

    def forward(self, inputs: ForwardInputs, cache: ModelCache, hidden_layers: tuple[int, ...] = ()) -> torch.Tensor:
        """One step, as ``DeepseekV4Model.forward``: every layer's state written into ``cache``, ``[L, vocab]``
        logits returned, nothing read back to the host."""
        k = self.kernels
        c = self.config
        metas = build_layer_metas(inputs, cache.geometry, self.rope_main, self.rope_compress)
        if self.sharding is not None:
            self.sharding.begin_forward(inputs.positions, inputs.live)
        ids = inputs.input_ids
        embeds, image = self.embed[ids], None
        if inputs.image_rows is not None:  # image positions take their span's rows, before the streams expand
            embeds = embeds.index_copy(0, inputs.image_rows, inputs.image_embeds.to(embeds.dtype))
            image = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device).index_fill_(0, inputs.image_rows, True)
        streams = embeds[:, None, :].expand(-1, c.hc_mult, -1).contiguous()
        pre = torch.zeros(ids.shape[0], c.hc_mult, dtype=torch.float32, device=ids.device)
        pre[:, 0] = 1.0  # the first site collapses stream 0
        hash_ids = self.hasher(k, self.ngrams(inputs, cache)) if self.engram_layers else {}
        shared = SharedIndices()
        self.hidden_states = {}
        tail_from = len(self.layers) - len(inputs.tail_rows or ())
        rows = None  # the batch rows the layers compute from here on (None: all)
        for layer in self.layers:
            meta = metas[layer.layer_type]
            j = layer.index - tail_from
            if j >= 0 and (rows is not None or inputs.tail_rows[j].shape[0] < ids.shape[0]):
                # a prefill's early positions need no layer past the last KV source: compute its tail only
                take, rows = inputs.tail_take[j], inputs.tail_rows[j]
                streams, pre, ids = streams[take], pre[take], ids[take]
                image = image[take] if image is not None else None
                hash_ids = {i: h[take] for i, h in hash_ids.items()}
                shared.topk = shared.topk[take] if shared.topk is not None else None
                shared.candidates = shared.candidates[take] if shared.candidates is not None else None
            if rows is not None:
                meta = meta.select(rows)
            streams, pre = layer(k, streams, pre, ids, meta, cache, shared, hash_ids, image)
            if layer.index in hidden_layers:
                mean = streams.mean(dim=1)
                if rows is not None:  # rows the tail skipped hold zeros (never read: see prefill_margin)
                    mean = torch.zeros(inputs.input_ids.shape[0], mean.shape[1], dtype=mean.dtype,
                                       device=mean.device).index_copy_(0, rows, mean)
                self.hidden_states[layer.index] = mean
        out = inputs.logits_indices if rows is None else inputs.tail_logits
        h = k.mhc_collapse(streams[out], pre[out])
        return k.linear(k.rms_norm(h, self.norm, c.rms_norm_eps), self.head)

    def ngrams(self, inputs: ForwardInputs, cache: ModelCache) -> torch.Tensor:
        """``[T, N]`` compressed ids of each token's n-gram (itself first, then the ones before it; the pad id
        before the sequence start), through the cache's ring of raw token ids. An image position (its id is
        ``image_token_id``) ends the n-grams reaching it as the sequence start does: it and every older
        position read as the pad id."""
        if self.hasher is None:
            raise ValueError("the Engram layers need the tokenizer's compressed vocabulary: call bind_engram(tokenizer)")
        ring = cache.history
        self.kernels.cache_write(ring, inputs.history_seed_rows, inputs.history_seed_ids)
        self.kernels.cache_write(ring, inputs.history_write, inputs.input_ids)
        rows = inputs.history_rows
        raw = ring[rows.clamp(min=0)]
        cut = rows < 0
        if self.vision is not None:
            cut = cut | (raw == self.config.image_token_id)
        cut = torch.cummax(cut.to(torch.int32), dim=1).values.bool()  # a cut reaches every older look-back
        return torch.where(cut, self.pad_id, self.token_map[raw])

