"""DeepSeek V4.1's Engram n-gram memory: the hash layout, the compressed vocabulary, memory-mapped tables, the module.

On each Engram layer (``engram_layer_ids``) every token's 2- to N-gram (the
token and up to N−1 before it, in compressed ids) is hashed into that layer's
table; the rows looked up are projected into a key per residual stream and one
value, which a gate adds to the ``hc_mult`` streams before the layer's
attention. The math is the reference ops' (``Kernels.engram_hash``,
``engram_lookup``, ``engram_inject``); this module holds what the engine owns:

- ``EngramLayout.from_config(text_config)``: per layer its primes, column
  offsets, multipliers and row count, checked against ``engram_num_embeddings``.
- ``compressed_vocabulary(tokenizer, expected_size)``: token id -> compressed id.
- ``EngramHasher(layout, device)``: windows -> each layer's ``[T, C]`` hash ids.
- ``EngramTable``: one table (FP8 codes + UE8M0 scales, or unquantized), held in
  memory or memory-mapped from a safetensors file at the tensor's byte offsets
  (the file is never read whole; only the rows looked up are paged in).
- ``Engram``: one layer's module (a ``ParamTree``): ``wkv.weight``, ``q_weight``,
  ``k_weight`` and the table ``embed.weight`` / ``embed.scale``.

How ``DeepseekV41Model`` wires it: ``EngramTable.from_catalog`` maps each
layer's table when the model is built (``checkpoint_kwargs``), the loader skips
the tables' tensors (``TABLE_KEYS``), ``bind_engram`` builds the compressed
vocabulary and one ``EngramHasher``, and each forward reads every token's
``[T, N]`` window of compressed ids from the cache's token ring
(``DeepseekV41Model.ngrams``), hashes it once for all Engram layers and hands
each layer its ids (``Engram.__call__`` before the layer's attention).

With ``table=None`` the module allocates the table as ordinary parameters
(``embed.weight`` and, for FP8, ``embed.scale``) that the loader fills: for
small models and tests, not for the release's ~100 GB tables.

Once loaded, the engine places the tables (``table_placement``): left mapped,
in host memory the device reads in place, or on the device. Where a table
stays mapped on the host and the model runs on an accelerator, the lookup
copies its hash ids to the host (a synchronisation), so the runner runs such a
model eagerly (``DeepseekV41Model.graph_blocker``).
"""

from __future__ import annotations

import ctypes
import json
import mmap
import os
import struct
import sys
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from deepinfer_interfaces import Kernels

from ...errors import CheckpointError, ConfigError
from ...loader.safetensors_reader import HEADER_DTYPES, TensorEntry
from .text_config import V41TextConfig
from ..common.linear import PLAIN, Storage, linear, linear_param
from ..common.params import ParamTree

INT64_MAX = 2**63 - 1
#: the per-layer seed of the multipliers is this prime times the layer id
MULTIPLIER_SEED_PRIME = 10007
#: the release's table storage: e4m3 codes, one UE8M0 scale byte per 32 channels of a row
TABLE_STORAGE = Storage("e4m3", (1, 32), torch.uint8)
#: the table's tensors under a layer's ``engram.`` prefix (memory-mapped, not loaded, when a table is given)
TABLE_KEYS = ("embed.weight", "embed.scale")
#: bases that make Miller-Rabin exact below 3.3 · 10^24 (every 64-bit integer included)
_WITNESSES = (2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41)
_MILLER_RABIN_LIMIT = 3_317_044_064_679_887_385_961_981
#: safetensors headers above this are refused as corrupt
_MAX_HEADER_BYTES = 100 << 20


# ---- primes and the layout -------------------------------------------------------------------------


def is_prime(n: int) -> bool:
    """Whether ``n`` is prime: trial division by small primes, then Miller-Rabin with fixed witnesses."""
    if n < 2:
        return False
    for p in _WITNESSES:
        if n % p == 0:
            return n == p
    if n >= _MILLER_RABIN_LIMIT:
        raise ValueError(f"is_prime is exact below {_MILLER_RABIN_LIMIT}; {n} is beyond it")
    d, r = n - 1, 0
    while d % 2 == 0:
        d, r = d // 2, r + 1
    for a in _WITNESSES:
        x = pow(a, d, n)
        if x in (1, n - 1):
            continue
        for _ in range(r - 1):
            x = x * x % n
            if x == n - 1:
                break
        else:
            return False
    return True


def next_prime(after: int) -> int:
    """The smallest prime strictly above ``after``."""
    n = max(after + 1, 2)
    while not is_prime(n):
        n += 1
    return n


def multipliers(layer_id: int, max_ngram_size: int, compressed_vocab_size: int) -> tuple[int, ...]:
    """One odd multiplier per look-back ``0..N−1`` for layer ``layer_id``, drawn from numpy's default
    generator seeded ``10007 · layer_id`` below ``2 · max(1, (int64_max // vocab) // 2)``."""
    bound = max(1, (INT64_MAX // compressed_vocab_size) // 2)
    draws = np.random.default_rng(MULTIPLIER_SEED_PRIME * layer_id).integers(0, bound, size=(max_ngram_size,), dtype=np.int64)
    return tuple(int(v) * 2 + 1 for v in draws)


@dataclass(frozen=True)
class EngramLayerLayout:
    """One Engram layer's hashing constants and table size."""

    layer_id: int
    #: ``[N−1][H]``: the modulus of each (n-gram size, head) column
    primes: tuple[tuple[int, ...], ...]
    #: ``[(N−1)·H]``: where each column's rows start in the layer's table
    offsets: tuple[int, ...]
    #: ``[N]``: one odd multiplier per look-back
    multipliers: tuple[int, ...]
    #: rows of the layer's table (the sum of its primes)
    rows: int

    def tensors(self, device: torch.device | str = "cpu") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(multipliers [N], primes [N−1, H], offsets [(N−1)·H])`` as int64 on ``device``: ``engram_hash``'s constants."""
        def as_tensor(values) -> torch.Tensor:
            return torch.tensor(values, dtype=torch.int64, device=device)

        return as_tensor(self.multipliers), as_tensor(self.primes), as_tensor(self.offsets)


@dataclass(frozen=True)
class EngramLayout:
    """Every Engram layer's layout: primes drawn as one ascending sequence over layers, n-gram sizes and heads."""

    layers: tuple[EngramLayerLayout, ...]
    max_ngram_size: int
    n_heads: int

    @property
    def columns(self) -> int:
        """Hash columns (rows looked up) per token and layer: ``(N−1)·H``."""
        return (self.max_ngram_size - 1) * self.n_heads

    def layer(self, layer_id: int) -> EngramLayerLayout:
        for layer in self.layers:
            if layer.layer_id == layer_id:
                return layer
        raise KeyError(f"layer {layer_id} has no Engram module; Engram layers: {[l.layer_id for l in self.layers]}")

    @classmethod
    def build(
        cls, layer_ids: list[int], max_ngram_size: int, n_heads: int, vocab_size: int, compressed_vocab_size: int
    ) -> "EngramLayout":
        """The layout of ``layer_ids`` in order: for each layer, n-gram size ``2..N`` and head, the next prime
        above the previous one (the first: the smallest prime ≥ ``vocab_size``)."""
        layers = []
        last = vocab_size - 1
        for layer_id in layer_ids:
            primes = []
            for _ in range(max_ngram_size - 1):
                row = []
                for _ in range(n_heads):
                    last = next_prime(last)
                    row.append(last)
                primes.append(tuple(row))
            flat = [p for row in primes for p in row]
            offsets = tuple(int(v) for v in np.cumsum([0, *flat[:-1]]))
            layers.append(EngramLayerLayout(
                layer_id, tuple(primes), offsets, multipliers(layer_id, max_ngram_size, compressed_vocab_size), sum(flat)
            ))
        return cls(tuple(layers), max_ngram_size, n_heads)

    @classmethod
    def from_config(cls, config: V41TextConfig) -> "EngramLayout":
        """The layout ``config`` describes; a ``ConfigError`` when a table's ``engram_num_embeddings`` differs
        from the rows its primes give (the checkpoint then hashes differently from what deepinfer computes)."""
        layout = cls.build(
            list(config.engram_layer_ids), config.engram_max_ngram_size, config.engram_n_heads,
            config.engram_vocab_size, config.engram_compressed_vocab_size,
        )
        for row, (layer, stated) in enumerate(zip(layout.layers, config.engram_num_embeddings)):
            if layer.rows != stated:
                raise ConfigError(
                    f"text_config.engram_num_embeddings[{row}] is {stated} for Engram layer {layer.layer_id}, but its "
                    f"{layout.columns} primes above engram_vocab_size={config.engram_vocab_size} add up to {layer.rows} rows; "
                    "the table was built with another Engram layout (check engram_vocab_size, engram_n_heads, "
                    "engram_max_ngram_size and engram_layer_ids)"
                )
        return layout


# ---- the compressed vocabulary ---------------------------------------------------------------------

#: stands for a text that is exactly one space while the normaliser strips
_SPACE_SENTINEL = "\ue000"


def _key_normalizer():
    from tokenizers import Regex, normalizers

    return normalizers.Sequence([
        normalizers.NFKC(),
        normalizers.NFD(),
        normalizers.StripAccents(),
        normalizers.Lowercase(),
        normalizers.Replace(Regex(r"[ \t\r\n]+"), " "),
        normalizers.Replace(Regex(r"^ $"), _SPACE_SENTINEL),
        normalizers.Strip(),
        normalizers.Replace(_SPACE_SENTINEL, " "),
    ])


def compressed_vocabulary(tokenizer: Any, expected_size: int | None = None) -> tuple[np.ndarray, int]:
    """``(lookup, size)``: ``lookup[token_id]`` (int64) is the compressed id of each of the tokenizer's ids.

    ``tokenizer`` is a ``tokenizers.Tokenizer`` or a transformers fast tokenizer
    (its ``backend_tokenizer`` is used). Each id is decoded alone (special tokens
    kept); a text holding U+FFFD (part of a UTF-8 sequence) keys by its raw
    token string, any other by its normalised text (NFKC, NFD, accents
    stripped, lowercased, whitespace runs as one space, stripped unless it is
    exactly one space), or by the text itself when that normalises to nothing.
    Distinct keys take ids in order of first appearance. With
    ``expected_size`` (``engram_compressed_vocab_size``), a different count is
    a ``ConfigError``: every multiplier derives from it.
    """
    backend = getattr(tokenizer, "backend_tokenizer", tokenizer)
    count = backend.get_vocab_size(with_added_tokens=True)
    texts = backend.decode_batch([[i] for i in range(count)], skip_special_tokens=False)
    normalizer = _key_normalizer()
    keys: dict[str, int] = {}
    lookup = np.empty(count, dtype=np.int64)
    for token_id, text in enumerate(texts):
        if "\ufffd" in text:
            key = backend.id_to_token(token_id) or text
        else:
            key = normalizer.normalize_str(text) or text
        lookup[token_id] = keys.setdefault(key, len(keys))
    size = len(keys)
    if expected_size is not None and size != expected_size:
        raise ConfigError(
            f"the tokenizer's {count} tokens compress to {size} distinct Engram tokens, but "
            f"text_config.engram_compressed_vocab_size is {expected_size}; the tokenizer and config.json come from "
            "different checkpoints"
        )
    return lookup, size


class EngramHasher:
    """Each Engram layer's hash ids from ``[T, N]`` windows, through ``Kernels.engram_hash``; constants on one device."""

    def __init__(self, layout: EngramLayout, device: torch.device | str = "cpu") -> None:
        self.layout = layout
        self.constants = {layer.layer_id: layer.tensors(device) for layer in layout.layers}

    def __call__(self, k: Kernels, windows: torch.Tensor) -> dict[int, torch.Tensor]:
        """Layer id -> ``[T, (N−1)·H]`` int64 row ids into that layer's table."""
        return {layer_id: k.engram_hash(windows, *consts) for layer_id, consts in self.constants.items()}


# ---- the table -------------------------------------------------------------------------------------


@dataclass(frozen=True, eq=False)
class _Region:
    """One read-only file mapping that a table's tensor views; kept alive as long as the table."""

    mapping: mmap.mmap
    address: int
    path: Path
    #: the file offset the mapping starts at
    offset: int


@dataclass(frozen=True, eq=False)
class EngramTable:
    """One Engram table: ``codes`` ``[rows, head_dim]`` (e4m3 codes, or a float dtype) and ``scales``
    ``[rows, head_dim / 32]`` UE8M0 bytes (None for an unquantized table), in memory or memory-mapped."""

    codes: torch.Tensor
    scales: torch.Tensor | None
    regions: tuple[_Region, ...] = field(default=(), repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.codes.dim() != 2:
            raise ValueError(f"an Engram table's codes are [rows, head_dim]; got shape {tuple(self.codes.shape)}")
        if self.scales is not None and (self.scales.dim() != 2 or self.scales.shape[0] != self.codes.shape[0]):
            raise ValueError(f"an Engram table's scales are [rows, head_dim / 32] = {tuple(self.codes.shape)}; got {tuple(self.scales.shape)}")

    @property
    def rows(self) -> int:
        return self.codes.shape[0]

    @property
    def head_dim(self) -> int:
        return self.codes.shape[1]

    @property
    def mapped(self) -> bool:
        """Whether the table is a view of files on disk (else it is held in memory)."""
        return bool(self.regions)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in (self.codes, self.scales) if t is not None)

    def lookup(self, k: Kernels, ids: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """Rows ``ids`` ``[T, C]`` dequantized: ``[T, C, head_dim]`` in ``dtype`` on ``ids.device``."""
        return k.engram_lookup(self.codes, self.scales, ids, dtype)

    @classmethod
    def open(cls, path: str | Path, weight: str, scale: str | None = None, scale_path: str | Path | None = None) -> "EngramTable":
        """Map tensor ``weight`` (codes) of the safetensors file ``path`` and ``scale`` (of ``scale_path``,
        default the same file), reading only the headers.

        The mappings are read-only and advised for random access, so a lookup
        pages in only the rows it touches (never write to the tensors)."""
        codes, region = _map_tensor(Path(path), weight)
        if scale is None:
            return cls(codes, None, (region,))
        if codes.dtype not in (torch.float8_e4m3fn, torch.uint8):
            raise CheckpointError(f"{Path(path).name}: {weight!r} is {codes.dtype} with a scale tensor; FP8 Engram codes are F8_E4M3 or U8")
        scales, scale_region = _map_tensor(Path(scale_path or path), scale)
        if scales.dtype not in (torch.uint8, torch.float8_e8m0fnu):
            raise CheckpointError(f"{Path(scale_path or path).name}: {scale!r} is {scales.dtype}; Engram scales are UE8M0 bytes (U8 or F8_E8M0)")
        return cls(codes, scales.view(torch.uint8), (region, scale_region))

    @classmethod
    def from_catalog(cls, catalog: dict[str, TensorEntry], layer_id: int) -> "EngramTable":
        """Layer ``layer_id``'s table from a checkpoint catalog (``read_catalog``), under the release's names
        (``layers.{i}.engram.embed.weight`` / ``.scale``) or transformers' (with a ``model.`` prefix)."""
        for prefix in (f"layers.{layer_id}.engram.", f"model.layers.{layer_id}.engram."):
            weight = catalog.get(prefix + TABLE_KEYS[0])
            if weight is not None:
                scale = catalog.get(prefix + TABLE_KEYS[1])
                if scale is None:
                    return cls.open(weight.file, weight.name)
                return cls.open(weight.file, weight.name, scale.name, scale.file)
        raise CheckpointError(
            f"the checkpoint has no Engram table for layer {layer_id} (layers.{layer_id}.engram.{TABLE_KEYS[0]}); "
            "it was exported without its Engram tables"
        )

    def resident_bytes(self) -> int | None:
        """Bytes of the mapped table now in the page cache (``mincore``), or None where that cannot be asked
        (an in-memory table, or a system without ``mincore``)."""
        if not self.regions or not sys.platform.startswith("linux"):
            return None
        libc = ctypes.CDLL(None, use_errno=True)
        page = mmap.PAGESIZE
        total = 0
        for region in self.regions:
            length = len(region.mapping)
            vec = (ctypes.c_ubyte * ((length + page - 1) // page))()
            if libc.mincore(ctypes.c_void_p(region.address), ctypes.c_size_t(length), vec) != 0:
                return None
            total += sum(b & 1 for b in bytes(vec)) * page
        return total

    def drop_cache(self) -> bool:
        """Ask the kernel to evict the mapped table's clean pages from the page cache: unmap them from this
        process (``madvise`` DONTNEED; a later read faults them in again from the file), then ``posix_fadvise``
        DONTNEED (a filesystem such as tmpfs may keep them). False where that cannot be asked."""
        if not self.regions or not hasattr(os, "posix_fadvise") or not hasattr(mmap, "MADV_DONTNEED"):
            return False
        for region in self.regions:
            region.mapping.madvise(mmap.MADV_DONTNEED)  # a page mapped here is not evicted
            fd = os.open(region.path, os.O_RDONLY)
            try:
                os.posix_fadvise(fd, region.offset, len(region.mapping), os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)
        return True


def _read_header(path: Path) -> tuple[dict, int, int]:
    """A safetensors file's header, the file offset of its data and the file size."""
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            raw = f.read(8)
            length = struct.unpack("<Q", raw)[0] if len(raw) == 8 else -1
            if not 0 < length <= min(_MAX_HEADER_BYTES, size - 8):
                raise CheckpointError(f"checkpoint file {path.name!r} has no valid safetensors header; re-download it")
            header = json.loads(f.read(length))
    except OSError as exc:
        raise CheckpointError(f"cannot open checkpoint file {str(path)!r}: {exc}") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint file {path.name!r} has a corrupt safetensors header ({exc}); re-download it") from exc
    return header, 8 + length, size


def _map_tensor(path: Path, name: str) -> tuple[torch.Tensor, _Region]:
    """Tensor ``name`` of a safetensors file as a view of a read-only, random-access mapping of its bytes."""
    header, data_start, file_size = _read_header(path)
    entry = header.get(name)
    if not isinstance(entry, dict):
        raise CheckpointError(f"checkpoint file {path.name!r} has no tensor {name!r}")
    dtype = HEADER_DTYPES.get(entry.get("dtype"))
    if dtype is None or dtype == torch.float4_e2m1fn_x2:
        raise CheckpointError(f"tensor {name!r} in {path.name!r} has dtype {entry.get('dtype')}, which an Engram table cannot be")
    shape = tuple(int(d) for d in entry["shape"])
    begin, end = (data_start + int(v) for v in entry["data_offsets"])
    numel = int(np.prod(shape, dtype=np.int64))
    if len(shape) != 2 or numel == 0 or end - begin != numel * dtype.itemsize or end > file_size:
        raise CheckpointError(
            f"tensor {name!r} in {path.name!r} (shape {list(shape)}, bytes {begin}..{end}) is not a [rows, width] table "
            f"inside the file's {file_size} bytes; the file is truncated or corrupt: re-download it"
        )
    offset = begin - begin % mmap.ALLOCATIONGRANULARITY  # a mapping starts on a page boundary
    with open(path, "rb") as f:
        mapping = mmap.mmap(f.fileno(), end - offset, access=mmap.ACCESS_READ, offset=offset)
    if hasattr(mmap, "MADV_RANDOM"):
        mapping.madvise(mmap.MADV_RANDOM)  # hash lookups are random: no read-ahead around each row
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")  # read-only by design: lookups only gather
        view = torch.frombuffer(mapping, dtype=dtype, count=numel, offset=begin - offset).view(shape)
    return view, _Region(mapping, view.data_ptr() - (begin - offset), path, offset)


# ---- the module ------------------------------------------------------------------------------------


class Engram(ParamTree):
    """One layer's Engram module: look up the token's n-gram rows, project them, gate them into the streams.

    ``table``: the layer's table (``EngramTable.from_catalog`` memory-maps it);
    None allocates it as the parameters ``embed.weight`` / ``embed.scale`` in
    ``table_storage`` (FP8 e4m3 with UE8M0 scales per 32 channels, as
    released, or ``PLAIN`` for ``dtype``). ``wkv_storage``: how ``wkv.weight``
    ``[(n+1)·D, C·head_dim]`` is held (the release stores it FP8).
    """

    def __init__(
        self,
        config: V41TextConfig,
        layer_id: int,
        dtype: torch.dtype,
        device: torch.device | str,
        table: EngramTable | None = None,
        wkv_storage: Storage = PLAIN,
        table_storage: Storage = TABLE_STORAGE,
    ) -> None:
        super().__init__(device)
        if layer_id not in config.engram_layer_ids:
            raise ConfigError(f"layer {layer_id} is not one of text_config.engram_layer_ids {config.engram_layer_ids}")
        self.layer_id = layer_id
        self.streams = n = config.hc_mult
        d, head_dim = config.hidden_size, config.engram_head_dim
        self.columns = (config.engram_max_ngram_size - 1) * config.engram_n_heads
        self.eps = config.rms_norm_eps
        rows = config.engram_num_embeddings[config.engram_layer_ids.index(layer_id)]
        self.wkv = linear_param(self, "wkv", (n + 1) * d, self.columns * head_dim, dtype, wkv_storage)
        self.q_weight = self.param("q_weight", (n, d), dtype)
        self.k_weight = self.param("k_weight", (n, d), dtype)
        if table is None:
            table = self._own_table(rows, head_dim, dtype, table_storage)
        elif (table.rows, table.head_dim) != (rows, head_dim):
            raise CheckpointError(
                f"layer {layer_id}'s Engram table is [{table.rows}, {table.head_dim}], but config.json gives "
                f"[{rows}, {head_dim}] (engram_num_embeddings, engram_head_dim)"
            )
        self.table = table

    def _own_table(self, rows: int, head_dim: int, dtype: torch.dtype, storage: Storage) -> EngramTable:
        if not storage.quantized:
            return EngramTable(self.param(TABLE_KEYS[0], (rows, head_dim), dtype), None)
        if storage != TABLE_STORAGE:
            raise ConfigError(f"an Engram table is FP8 e4m3 with UE8M0 scales per 32 channels, or plain; got {storage}")
        codes = self.param(TABLE_KEYS[0], (rows, head_dim), torch.float8_e4m3fn)
        return EngramTable(codes, self.param(TABLE_KEYS[1], (rows, head_dim // 32), torch.uint8))

    def __call__(self, k: Kernels, streams: torch.Tensor, hash_ids: torch.Tensor) -> torch.Tensor:
        """``streams`` ``[T, n, D]`` with this layer's Engram value gated in; ``hash_ids`` ``[T, C]``
        (``EngramHasher``'s ids for this layer, on the table's device or the streams')."""
        rows = self.table.lookup(k, hash_ids, streams.dtype)
        return self.project(k, streams, rows.to(streams.device, non_blocking=True))

    def project(self, k: Kernels, streams: torch.Tensor, rows: torch.Tensor) -> torch.Tensor:
        """The injection from already looked-up ``rows`` ``[T, C, head_dim]``: ``wkv`` maps the flattened rows
        to a key per stream (the first ``n·D`` outputs) and a value (the last ``D``), then ``engram_inject``."""
        t, n, d = streams.shape
        kv = linear(k, rows.flatten(1).to(streams.dtype), self.wkv)
        key, value = kv[:, : n * d].reshape(t, n, d), kv[:, n * d :]
        weight = self.q_weight.to(torch.float32) * self.k_weight.to(torch.float32)
        return k.engram_inject(streams, key, value, weight, self.eps)
