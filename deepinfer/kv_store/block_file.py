"""One stored token block as one file: a header naming what it holds, the raw rows, a checksum.

Layout: ``MAGIC`` (8 bytes), the header's length (4 bytes, little endian), the
header (JSON: format version, store fingerprint, block hash, and per part its
name, shape and storage: the element dtype and, for a packed cache's part, the
record format's fields), the payload (each part's rows, in order), and a 16-byte
BLAKE2b digest of everything before it. A truncated, corrupted or foreign file,
one laid out for another cache (another ``kv_cache_dtype``), or a packed record
whose scale is not a scale fails ``decode`` with the reason; files appear only
whole (``write_atomic``).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from deepinfer_interfaces.kv_format import KVFormat, bad_scales

MAGIC = b"DIKVBLK\x01"
FORMAT_VERSION = 2
DIGEST_BYTES = 16
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"


class BadBlockFile(ValueError):
    """A stored block that cannot be used (the reason says why); it is ignored and recomputed."""


@dataclass(frozen=True)
class PartShape:
    """One part of a block (``ModelCache.block_parts``): ``rows`` rows of ``width`` elements of ``dtype``; for a
    packed cache, uint8 records of ``format`` (``width`` = its record bytes)."""

    name: str
    rows: int
    width: int
    dtype: torch.dtype
    format: KVFormat | None = None

    @property
    def nbytes(self) -> int:
        return self.rows * self.width * torch.empty((), dtype=self.dtype).element_size()

    def header(self) -> list[Any]:
        """How the file's header names the part: name, shape, dtype, the record format's fields (or None)."""
        fmt = dataclasses.asdict(self.format) if self.format is not None else None
        return [self.name, self.rows, self.width, str(self.dtype).removeprefix("torch."), fmt]

    def storage(self) -> str:
        """The part's storage in words (for a refusal's reason)."""
        what = f"{self.format.name} records" if self.format is not None else "rows"
        return f"{self.rows} {what} of {self.width} {str(self.dtype).removeprefix('torch.')}"


def encode(fingerprint: str, block_hash: int, parts: list[PartShape], tensors: list[torch.Tensor]) -> bytes:
    """The file contents of one block."""
    header = json.dumps({
        "version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "hash": f"{block_hash:032x}",
        "parts": [p.header() for p in parts],
    }, separators=(",", ":")).encode()
    body = [MAGIC, struct.pack("<I", len(header)), header]
    body += [t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]
    data = b"".join(body)
    return data + hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


def decode(data: bytes, fingerprint: str, block_hash: int, parts: list[PartShape]) -> list[torch.Tensor]:
    """The tensors of a block file written by ``encode`` for the same parts, fingerprint and hash, every
    packed record's scales checked."""
    if len(data) < len(MAGIC) + 4 + DIGEST_BYTES or data[: len(MAGIC)] != MAGIC:
        raise BadBlockFile("not a block file (bad magic or too short)")
    body, digest = data[:-DIGEST_BYTES], data[-DIGEST_BYTES:]
    if hashlib.blake2b(body, digest_size=DIGEST_BYTES).digest() != digest:
        raise BadBlockFile("checksum mismatch (truncated or corrupted)")
    (n,) = struct.unpack_from("<I", body, len(MAGIC))
    start = len(MAGIC) + 4
    try:
        header = json.loads(body[start : start + n])
    except ValueError:
        raise BadBlockFile("unreadable header") from None
    if not isinstance(header, dict) or header.get("version") != FORMAT_VERSION:
        version = header.get("version") if isinstance(header, dict) else None
        raise BadBlockFile(f"format version {version} (this engine reads {FORMAT_VERSION})")
    _check_layout(header.get("parts"), parts)
    if header.get("fingerprint") != fingerprint:
        raise BadBlockFile("written for another model, dtype, cache format, block size or kernel set (fingerprint mismatch)")
    if header.get("hash") != f"{block_hash:032x}":
        raise BadBlockFile("holds another block than its name says")
    offset = start + n
    if len(body) - offset != sum(p.nbytes for p in parts):
        raise BadBlockFile("payload length does not match its header")
    out = []
    raw = bytearray(body[offset:])
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    pos = 0
    for p in parts:
        t = flat[pos : pos + p.nbytes].view(p.dtype).reshape(p.rows, p.width)
        pos += p.nbytes
        if p.format is not None and p.rows:
            bad = bad_scales(t, p.format)
            if bool(bad.any()):
                row = int(bad.nonzero()[0, 0])
                raise BadBlockFile(f"scale out of range (NaN, infinite, zero or negative) in part {p.name}, record {row}")
        out.append(t)
    return out


def _check_layout(stored: Any, parts: list[PartShape]) -> None:
    """Refuse a file whose parts are not this cache's, naming the first that differs."""
    mine = [p.header() for p in parts]
    if stored == mine:
        return
    if not isinstance(stored, list) or len(stored) != len(mine):
        count = len(stored) if isinstance(stored, list) else "no"
        raise BadBlockFile(f"its layout differs from this cache's ({count} parts, this cache has {len(mine)})")
    k = next(i for i, (a, b) in enumerate(zip(stored, mine)) if a != b)
    theirs = stored[k]
    if isinstance(theirs, list) and len(theirs) == 5 and isinstance(theirs[4], (dict, type(None))):
        fmt = f"{theirs[4].get('name')} records" if isinstance(theirs[4], dict) else "rows"
        seen = f"{theirs[1]} {fmt} of {theirs[2]} {theirs[3]}"
    else:
        seen = "an unreadable entry"
    raise BadBlockFile(f"its layout differs from this cache's: part {parts[k].name} is stored as {seen}, this cache holds {parts[k].storage()}"
                       " (written with another kv_cache_dtype or model)")


def write_atomic(path: Path, data: bytes) -> None:
    """Write ``path`` so readers see the old file, no file, or all of ``data``: a private temporary file
    in the same directory, renamed over ``path``."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{secrets.token_hex(4)}{TMP_SUFFIX}")
    try:
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
    except BaseException:
        try:
            tmp.unlink()
        except OSError:
            pass
        raise
