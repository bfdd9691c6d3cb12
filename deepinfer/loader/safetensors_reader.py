"""Finding a checkpoint's safetensors shards and reading their headers and tensors.

A checkpoint is one `*.safetensors` file, several, or several listed by
`model.safetensors.index.json` (whose `weight_map` names the shard of each tensor).
Headers are read first, without tensor data, so naming and shape errors surface
before any weight is copied.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

from ..errors import CheckpointError
from .files import model_directory, read_json

INDEX_FILE = "model.safetensors.index.json"

HEADER_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64,
    "F32": torch.float32,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E8M0": torch.float8_e8m0fnu,
    "F4": torch.float4_e2m1fn_x2,
    "I64": torch.int64,
    "I32": torch.int32,
    "I16": torch.int16,
    "I8": torch.int8,
    "U64": torch.uint64,
    "U32": torch.uint32,
    "U16": torch.uint16,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}


@dataclass(frozen=True)
class TensorEntry:
    """One tensor of the checkpoint: where it lives, its dtype and the shape `get_tensor` returns."""

    name: str
    file: Path
    dtype: torch.dtype
    shape: tuple[int, ...]


@contextmanager
def open_shard(path: Path) -> Iterator:
    """`safe_open` one shard, reporting a truncated or corrupt file as a one-line CheckpointError."""
    try:
        handle = safe_open(str(path), framework="pt")
    except SafetensorError as exc:
        raise CheckpointError(
            f"checkpoint file {path.name!r} is truncated or corrupt (safetensors: {exc}); re-download it"
        ) from exc
    except OSError as exc:
        raise CheckpointError(f"cannot open checkpoint file {str(path)!r}: {exc}") from exc
    with handle as f:
        yield f


def read_tensor(f, entry: TensorEntry) -> torch.Tensor:
    """One tensor's data from an open shard."""
    try:
        return f.get_tensor(entry.name)
    except SafetensorError as exc:
        raise CheckpointError(
            f"cannot read tensor {entry.name!r} from {entry.file.name!r} (safetensors: {exc}); re-download the file"
        ) from exc


def shard_files(model_dir: str | Path) -> tuple[list[Path], dict[str, str] | None]:
    """The checkpoint's shard files, in order, and the index's weight_map when there is an index."""
    directory = model_directory(model_dir)
    index_path = directory / INDEX_FILE
    if index_path.is_file():
        index = read_json(index_path, "checkpoint index")
        weight_map = index.get("weight_map") if isinstance(index, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) for v in weight_map.values()):
            raise CheckpointError(
                f"checkpoint index {str(index_path)!r} has no 'weight_map' object of tensor name -> shard file; "
                "re-download it"
            )
        files: list[Path] = []
        for shard in sorted(set(weight_map.values())):
            path = directory / shard
            if not path.is_file():
                raise CheckpointError(
                    f"{INDEX_FILE} names shard {shard!r}, which is not in {str(directory)!r}; "
                    "download the missing shard or fix the index"
                )
            files.append(path)
        return files, weight_map
    files = sorted(p for p in directory.glob("*.safetensors") if p.is_file())
    if not files:
        raise CheckpointError(
            f"no *.safetensors files in {str(directory)!r}; put the checkpoint's model*.safetensors shards there"
        )
    return files, None


def _entry(f, name: str, path: Path) -> TensorEntry:
    view = f.get_slice(name)
    header_dtype = view.get_dtype()
    dtype = HEADER_DTYPES.get(header_dtype)
    if dtype is None:
        raise CheckpointError(
            f"tensor {name!r} in {path.name!r} has dtype {header_dtype}, which deepinfer cannot load; "
            f"supported: {', '.join(HEADER_DTYPES)}"
        )
    shape = tuple(int(d) for d in view.get_shape())
    if dtype == torch.float4_e2m1fn_x2:  # the header counts values, torch counts byte pairs
        shape = (*shape[:-1], shape[-1] // 2)
    return TensorEntry(name, path, dtype, shape)


def read_catalog(files: list[Path], weight_map: dict[str, str] | None) -> dict[str, TensorEntry]:
    """Every tensor of every shard, from headers only; checks duplicates and the index against the shards."""
    catalog: dict[str, TensorEntry] = {}
    for path in files:
        with open_shard(path) as f:
            for name in f.keys():
                if name in catalog:
                    raise CheckpointError(
                        f"tensor {name!r} is stored twice, in {catalog[name].file.name!r} and {path.name!r}; "
                        "remove the stray file from the model directory"
                    )
                catalog[name] = _entry(f, name, path)
    if weight_map is not None:
        for name, shard in weight_map.items():
            entry = catalog.get(name)
            shard_parts = Path(shard).parts
            if entry is None or entry.file.parts[-len(shard_parts):] != shard_parts:
                raise CheckpointError(
                    f"{INDEX_FILE} places tensor {name!r} in {shard!r}, but that shard does not hold it; "
                    "the index and shards are from different downloads: re-download both"
                )
    return catalog
