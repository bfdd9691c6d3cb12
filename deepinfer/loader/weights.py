"""Streaming a checkpoint into preallocated parameters, shard by shard.

Tensor names go through ``names.model_name`` first (DeepSeek's release names and
transformers' both load). Headers are checked against the parameters (unexpected,
missing, shape and dtype errors come before any copy); then each shard is opened
once and its tensors are copied one at a time into `params[name]`, so peak memory
stays about one tensor above the model. Block-quantized weights (FP8, or FP4
experts) whose scale the model does not declare as a parameter are dequantized
into the parameter's dtype; a model that declares the scale too receives both as
stored (one-byte codes and UE8M0 scales into ``uint8`` parameters byte for byte).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from typing import Callable

import torch

from ..errors import CheckpointError
from .files import model_directory, read_config
from .block_scales import DEFAULT_BLOCK, FP4_DTYPES, FP8_DTYPES, block_for, dequantize
from .names import model_name
from .safetensors_reader import TensorEntry, open_shard, read_catalog, read_tensor, shard_files

DEQUANT_TARGETS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
SHOWN_NAMES = 5


#: one-byte dtypes whose raw bytes load into a ``uint8`` parameter unchanged (codes, UE8M0 scales)
RAW_BYTE_DTYPES = (torch.int8, torch.uint8, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2)


@dataclass(frozen=True)
class Checkpoint:
    """A checkpoint directory's shards and tensors (by model parameter name), read from headers."""

    directory: Path
    files: list[Path]
    catalog: dict[str, TensorEntry]
    #: quantization_config.weight_block_size, (128, 128) when absent
    block: tuple[int, int]


def read_checkpoint(model_dir: str | Path) -> Checkpoint:
    """Headers of every shard, names mapped to the model's; two stored names for one parameter are an error."""
    directory = model_directory(model_dir)
    block = _block_size(directory)
    files, weight_map = shard_files(directory)
    stored = read_catalog(files, weight_map)
    catalog: dict[str, TensorEntry] = {}
    for name, entry in stored.items():
        key = model_name(name)
        if key in catalog:
            raise CheckpointError(
                f"checkpoint tensors {catalog[key].name!r} and {name!r} both load into {key!r}; "
                "the directory mixes two naming schemes: keep one checkpoint's files"
            )
        catalog[key] = entry
    return Checkpoint(directory, files, catalog, block)


@dataclass(frozen=True)
class _Item:
    """One load step: copy/dequantize `entry` into a param, or keep it aside (`keep`)."""

    entry: TensorEntry
    scale: TensorEntry | None = None
    block: tuple[int, int] | None = None
    keep: bool = False


def _fmt_shape(shape) -> str:
    return "[" + ", ".join(str(int(d)) for d in shape) + "]"


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _names(names: list[str]) -> str:
    shown = ", ".join(repr(n) for n in names[:SHOWN_NAMES])
    return shown + (f" and {len(names) - SHOWN_NAMES} more" if len(names) > SHOWN_NAMES else "")


def _block_size(directory: Path) -> tuple[int, int]:
    """quantization_config.weight_block_size from config.json, (128, 128) when absent."""
    if not (directory / "config.json").is_file():
        return DEFAULT_BLOCK
    quant = read_config(directory).get("quantization_config") or {}
    block = quant.get("weight_block_size", list(DEFAULT_BLOCK)) if isinstance(quant, dict) else None
    if (
        not isinstance(block, (list, tuple))
        or len(block) != 2
        or not all(isinstance(b, int) and not isinstance(b, bool) and b > 0 for b in block)
    ):
        raise CheckpointError(
            f"config.json quantization_config.weight_block_size is {block!r}; it must be two positive integers such as [128, 128]"
        )
    return int(block[0]), int(block[1])


def _scale_names(name: str) -> tuple[str, ...]:
    """Names a block-scale companion of weight `name` may have (V3 `_scale_inv`, V4 `.scale`)."""
    if name.endswith(".weight"):
        base = name[: -len(".weight")]
        return base + ".weight_scale_inv", base + ".scale"
    return name + "_scale_inv", name + ".scale"


def _is_quantized(dtype: torch.dtype) -> bool:
    return dtype in FP8_DTYPES or dtype in FP4_DTYPES


def _logical_shape(entry: TensorEntry) -> tuple[int, ...]:
    """The value shape of a quantized weight: FP4 packs two values per stored element."""
    if entry.dtype in FP4_DTYPES:
        return (*entry.shape[:-1], 2 * entry.shape[-1])
    return entry.shape


def _integer(dtype: torch.dtype) -> bool:
    return not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool


def _check_copy_dtype(entry: TensorEntry, param: torch.Tensor) -> None:
    """Reject casts that would corrupt values: raw FP8/FP4 into another dtype, float <-> int, bool.
    One-byte codes and scales load into a ``uint8`` param as their bytes."""
    src, dst = entry.dtype, param.dtype
    where = f"checkpoint tensor {entry.name!r} in {entry.file.name!r}"
    if dst == torch.uint8 and src in RAW_BYTE_DTYPES:
        return
    if src in FP8_DTYPES or src == torch.float4_e2m1fn_x2:
        if dst != src:
            scales = " or ".join(repr(n) for n in _scale_names(entry.name))
            raise CheckpointError(
                f"{where} is {_dtype_name(src)} with no block-scale tensor ({scales}) to dequantize it, "
                f"so it cannot load into a {_dtype_name(dst)} param; use a {_dtype_name(src)} param or a checkpoint with its scales"
            )
        return
    ok = (
        (src.is_floating_point and dst.is_floating_point)
        or (_integer(src) and _integer(dst))
        or (src == torch.bool and dst == torch.bool)
    )
    if not ok:
        raise CheckpointError(
            f"{where} is {_dtype_name(src)} but the model param is {_dtype_name(dst)}; "
            "the checkpoint does not match this model (a float/int/bool mismatch cannot be cast)"
        )


def _check_shape(entry: TensorEntry, shape: tuple[int, ...], param: torch.Tensor) -> None:
    if tuple(shape) != tuple(param.shape) and entry.name.endswith((".scale", "_scale_inv")):
        raise CheckpointError(
            f"scale tensor {entry.name!r} in {entry.file.name!r} has shape {_fmt_shape(shape)} but its weight's block grid is "
            f"{_fmt_shape(param.shape)}; the scale does not match its weight: re-download the shard or fix "
            "quantization_config.weight_block_size"
        )
    if tuple(shape) != tuple(param.shape):
        raise CheckpointError(
            f"checkpoint tensor {entry.name!r} in {entry.file.name!r} has shape {_fmt_shape(shape)} but the model "
            f"expects {_fmt_shape(param.shape)}; the checkpoint does not match config.json"
        )


def _plan(
    params: dict[str, torch.Tensor],
    catalog: dict[str, TensorEntry],
    keep_prefixes: tuple[str, ...],
    block: tuple[int, int],
    directory: Path,
    skip: Callable[[str], bool] | None = None,
) -> list[_Item]:
    """Validate the checkpoint against `params` from headers alone and list the load steps."""
    if skip is not None:  # another rank's tensors: never read, neither missing nor unexpected here
        catalog = {name: entry for name, entry in catalog.items() if not skip(name)}
    consumed: set[str] = set()
    pairs: dict[str, TensorEntry] = {}
    for name, entry in catalog.items():
        if name not in params or not _is_quantized(entry.dtype):
            continue
        scale_name = next((s for s in _scale_names(name) if s in catalog), None)
        if scale_name is None or scale_name in params:
            continue  # no scale: a raw tensor; a declared scale: both load as stored
        pairs[name] = catalog[scale_name]
        consumed.add(scale_name)

    items: list[_Item] = []
    unexpected: list[str] = []
    for name, entry in catalog.items():
        if name in consumed:
            continue
        if name in params:
            param = params[name]
            scale = pairs.get(name)
            if scale is None:
                _check_shape(entry, entry.shape, param)
                _check_copy_dtype(entry, param)
                items.append(_Item(entry))
                continue
            shape = _logical_shape(entry)
            _check_shape(entry, shape, param)
            if param.dtype not in DEQUANT_TARGETS:
                raise CheckpointError(
                    f"checkpoint tensor {name!r} is block-quantized {_dtype_name(entry.dtype)} and is dequantized on load, "
                    f"but its param is {_dtype_name(param.dtype)}; use a float32/bfloat16/float16 param, "
                    f"or declare {scale.name!r} as a param to load both as stored"
                )
            if not (scale.dtype.is_floating_point or scale.dtype == torch.uint8):
                raise CheckpointError(
                    f"scale tensor {scale.name!r} in {scale.file.name!r} has dtype {_dtype_name(scale.dtype)}; "
                    "block scales must be float32, bfloat16 or float8_e8m0fnu"
                )
            tile = block_for(shape, scale.shape, block)
            if tile is None:
                raise CheckpointError(
                    f"scale tensor {scale.name!r} in {scale.file.name!r} has shape {_fmt_shape(scale.shape)}, which does not "
                    f"tile weight {name!r} of shape {_fmt_shape(shape)} with weight_block_size {list(block)} or any exact split; "
                    "fix quantization_config.weight_block_size in config.json or re-download the checkpoint"
                )
            items.append(_Item(entry, scale=scale, block=tile))
        elif name.startswith(tuple(keep_prefixes)):
            items.append(_Item(entry, keep=True))
        else:
            unexpected.append(name)

    if unexpected:
        raise CheckpointError(
            f"{len(unexpected)} checkpoint tensor(s) have no matching model param: {_names([catalog[n].name for n in unexpected])} "
            f"(first in {catalog[unexpected[0]].file.name!r}); the checkpoint does not match this model's config.json, "
            "or pass their prefix in keep_prefixes to keep them aside"
        )
    loaded = {model_name(item.entry.name) for item in items if not item.keep}
    missing = [name for name in params if name not in loaded]
    if missing:
        raise CheckpointError(
            f"checkpoint in {str(directory)!r} lacks {len(missing)} tensor(s) the model needs: {_names(missing)}; "
            "the checkpoint is incomplete or does not match config.json: re-download it"
        )
    return items


def _as_param(tensor: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    """``tensor`` ready to copy into ``param``: one-byte codes and scales by their bytes."""
    if param.dtype == torch.uint8 and tensor.dtype != torch.uint8 and tensor.element_size() == 1:
        return tensor.view(torch.uint8)
    return tensor


def _read_scale(f, item: _Item) -> torch.Tensor:
    """The item's scale tensor, from the open shard or, when stored elsewhere, from its own shard."""
    if item.scale.file == item.entry.file:
        return read_tensor(f, item.scale)
    with open_shard(item.scale.file) as other:
        return read_tensor(other, item.scale)


def load_weights(
    params: dict[str, torch.Tensor],
    model_dir: str | Path | Checkpoint,
    *,
    keep_prefixes: tuple[str, ...] = ("mtp.",),
    skip: Callable[[str], bool] | None = None,
) -> dict[str, torch.Tensor]:
    """Copy a checkpoint into the preallocated `params` (casting to each param's dtype).

    Every checkpoint tensor must match a param by name and shape, except those whose
    name starts with one of `keep_prefixes`: those are returned as stored (scales
    included), for components built later such as the MTP/DSpark draft layers.
    Tensors whose model name `skip` accepts (another rank's experts) are not read.
    """
    if isinstance(keep_prefixes, str):
        keep_prefixes = (keep_prefixes,)
    checkpoint = model_dir if isinstance(model_dir, Checkpoint) else read_checkpoint(model_dir)
    files, catalog, block, directory = checkpoint.files, checkpoint.catalog, checkpoint.block, checkpoint.directory
    items = _plan(params, catalog, tuple(keep_prefixes), block, directory, skip)

    by_file: dict[Path, list[_Item]] = {}
    for item in items:
        by_file.setdefault(item.entry.file, []).append(item)
    kept: dict[str, torch.Tensor] = {}
    with torch.no_grad():
        for path in files:
            if path not in by_file:
                continue
            with open_shard(path) as f:
                for item in by_file[path]:
                    tensor = read_tensor(f, item.entry)
                    if item.keep:
                        kept[model_name(item.entry.name)] = tensor
                        continue
                    if item.scale is not None:
                        tensor = dequantize(tensor, _read_scale(f, item), item.block)
                    key = model_name(item.entry.name)
                    params[key].copy_(_as_param(tensor, params[key]))
                    del tensor
    return kept
