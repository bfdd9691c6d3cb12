"""One stored token block as one file: a header naming what it holds, the raw rows, a checksum.

Layout: ``MAGIC`` (8 bytes), the header's length (4 bytes, little endian), the
header (JSON: format version, store fingerprint, block hash, dtype, the parts'
names and shapes), the payload (each part's rows, in order), and a 16-byte
BLAKE2b digest of everything before it. A truncated, corrupted or foreign file
fails ``decode`` with the reason; files appear only whole (``write_atomic``).
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import struct
from dataclasses import dataclass
from pathlib import Path

import torch

MAGIC = b"DIKVBLK\x01"
FORMAT_VERSION = 1
DIGEST_BYTES = 16
SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"


class BadBlockFile(ValueError):
    """A stored block that cannot be used (the reason says why); it is ignored and recomputed."""


@dataclass(frozen=True)
class PartShape:
    """One part of a block: ``rows`` rows of ``width`` elements (``ModelCache.block_parts``)."""

    name: str
    rows: int
    width: int


def encode(fingerprint: str, block_hash: int, dtype: torch.dtype, parts: list[PartShape], tensors: list[torch.Tensor]) -> bytes:
    """The file contents of one block."""
    header = json.dumps({
        "version": FORMAT_VERSION,
        "fingerprint": fingerprint,
        "hash": f"{block_hash:032x}",
        "dtype": str(dtype).removeprefix("torch."),
        "parts": [[p.name, p.rows, p.width] for p in parts],
    }, separators=(",", ":")).encode()
    body = [MAGIC, struct.pack("<I", len(header)), header]
    body += [t.contiguous().view(torch.uint8).numpy().tobytes() for t in tensors]
    data = b"".join(body)
    return data + hashlib.blake2b(data, digest_size=DIGEST_BYTES).digest()


def decode(data: bytes, fingerprint: str, block_hash: int, dtype: torch.dtype, parts: list[PartShape]) -> list[torch.Tensor]:
    """The tensors of a block file written by ``encode`` for the same fingerprint, hash and parts."""
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
    if header.get("version") != FORMAT_VERSION:
        raise BadBlockFile(f"format version {header.get('version')} (this engine reads {FORMAT_VERSION})")
    if header.get("fingerprint") != fingerprint:
        raise BadBlockFile("written for another model, dtype, block size or kernel set (fingerprint mismatch)")
    if header.get("hash") != f"{block_hash:032x}":
        raise BadBlockFile("holds another block than its name says")
    if header.get("dtype") != str(dtype).removeprefix("torch.") or header.get("parts") != [[p.name, p.rows, p.width] for p in parts]:
        raise BadBlockFile("its layout differs from this cache's")
    item = torch.empty((), dtype=dtype).element_size()
    offset = start + n
    if len(body) - offset != sum(p.rows * p.width * item for p in parts):
        raise BadBlockFile("payload length does not match its header")
    out = []
    raw = bytearray(body[offset:])
    flat = torch.frombuffer(raw, dtype=torch.uint8) if raw else torch.empty(0, dtype=torch.uint8)
    pos = 0
    for p in parts:
        size = p.rows * p.width * item
        out.append(flat[pos : pos + size].view(dtype).reshape(p.rows, p.width))
        pos += size
    return out


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
