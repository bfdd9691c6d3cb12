"""Engram lookups from a memory-mapped FP8 table on disk: the cost per token of one layer's hash, gather and dequantize.

Writes one Engram table as a safetensors file (the release's layout: e4m3 codes
``[rows, 256]`` and one UE8M0 scale byte per 32 channels, 264 bytes a row) of
``--gb`` GiB, in chunks, and memory-maps it the way the engine does
(``EngramTable.open``: only the header is read, random-access advice, no
read-ahead). The hash layout is V4.1's (4-grams, 8 heads: 24 rows per token)
with primes scaled down so the 24 columns fill the table. For batches of 1, 64
and 1024 tokens it times ``engram_hash`` of random ``[T, 4]`` windows followed
by ``engram_lookup`` of the ``[T, 24]`` rows to bf16 on ``--device``:

- cold: before each run the file's pages are evicted (``posix_fadvise``
  DONTNEED after an ``fsync``, which needs no root; where the filesystem keeps
  them anyway the report says so, and the fresh random rows of each run then
  still mostly miss the cache because the table is far larger than what the
  runs touch); new tokens every run.
- warm: the same tokens again, their rows already in the page cache.

Per row: median ms per batch, µs per token, rows gathered per second and MB/s
of table bytes gathered; ``hash_ms`` is the hash alone. ``resident`` is the
largest share of the table in the page cache before a cold run (0: truly cold).

    .venv/bin/python benchmarks/engram_lookup.py [--gb 1.5] [--dir DIR] [--keep] [--device cpu] [--reps 5] [--json]

The table file is deleted at exit unless ``--keep``; ``--json`` prints every
figure as one JSON object, the output's last line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import struct
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from common import add_json_flag, emit_json

from deepinfer.models.deepseek_v41.engram import EngramLayout, EngramTable
from deepinfer_interfaces import Kernels

HEAD_DIM = 256
SCALES = HEAD_DIM // 32
ROW_BYTES = HEAD_DIM + SCALES
#: V4.1's Engram hashing: 2- to 4-grams, 8 heads, 99092 compressed tokens; the first Engram layer is 1
NGRAM, HEADS, COMPRESSED_VOCAB, LAYER = 4, 8, 99092, 1
WEIGHT, SCALE = f"layers.{LAYER}.engram.embed.weight", f"layers.{LAYER}.engram.embed.scale"
BATCHES = (1, 64, 1024)
CHUNK_ROWS = 1 << 18  # 64 MiB of codes per write


@dataclass
class Row:
    tokens: int
    cache: str
    ms: float
    us_per_token: float
    rows_per_s: float
    mb_per_s: float
    hash_ms: float
    #: the largest share of the table in the page cache before a cold run
    resident: float | None


def write_table(path: Path, rows: int, seed: int) -> None:
    """A safetensors file of one FP8 Engram table, written a chunk at a time (never whole in memory)."""
    codes_bytes = rows * HEAD_DIM
    header = {
        WEIGHT: {"dtype": "F8_E4M3", "shape": [rows, HEAD_DIM], "data_offsets": [0, codes_bytes]},
        SCALE: {"dtype": "U8", "shape": [rows, SCALES], "data_offsets": [codes_bytes, codes_bytes + rows * SCALES]},
    }
    raw = json.dumps(header).encode()
    raw += b" " * (-len(raw) % 8)
    rng = np.random.default_rng(seed)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for start in range(0, rows, CHUNK_ROWS):
            chunk = rng.integers(0, 256, size=(min(CHUNK_ROWS, rows - start), HEAD_DIM), dtype=np.uint8)
            chunk[(chunk & 0x7F) == 0x7F] = 0x38  # no NaN codes
            f.write(chunk.tobytes())
        for start in range(0, rows, CHUNK_ROWS * 8):
            f.write(rng.integers(120, 135, size=(min(CHUNK_ROWS * 8, rows - start), SCALES), dtype=np.uint8).tobytes())
        f.flush()
        os.fsync(f.fileno())  # clean pages: the cold runs can evict them


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _timed(fn, device: torch.device) -> float:
    _sync(device)
    start = time.perf_counter()
    fn()
    _sync(device)
    return 1e3 * (time.perf_counter() - start)


def run(args) -> dict:
    device = torch.device(args.device)
    k = Kernels()
    target_rows = int(args.gb * (1 << 30)) // ROW_BYTES
    layout = EngramLayout.build([LAYER], NGRAM, HEADS, max(2, target_rows // ((NGRAM - 1) * HEADS)), COMPRESSED_VOCAB)
    layer = layout.layers[0]
    consts = layer.tensors(device)
    directory = Path(args.dir or tempfile.mkdtemp(prefix="engram-bench-"))
    path = directory / "engram_table.safetensors"
    start = time.perf_counter()
    write_table(path, layer.rows, args.seed)
    write_s = time.perf_counter() - start
    figures: dict = {"device": str(device), "table_bytes": path.stat().st_size, "table_rows": layer.rows,
                     "rows_per_token": layout.columns, "write_s": write_s, "path": str(path) if args.keep else None}
    try:
        table = EngramTable.open(path, WEIGHT, SCALE)
        table.drop_cache()
        resident = table.resident_bytes()
        evictable = resident is not None and resident < table.nbytes() * 0.01
        figures["evictable"] = evictable
        print(f"table: {path.stat().st_size / 2**30:.2f} GiB, {layer.rows:,} rows of {ROW_BYTES} B, written in {write_s:.1f} s; "
              f"page cache {'evicted before each cold run' if evictable else 'NOT evictable here: cold = rows not touched before'}")
        g = torch.Generator().manual_seed(args.seed)
        rows: list[Row] = []
        for t in BATCHES:
            def batch():
                return torch.randint(0, COMPRESSED_VOCAB, (t, NGRAM), generator=g).to(device)

            def step(windows):
                return k.engram_lookup(table.codes, table.scales, k.engram_hash(windows, *consts), torch.bfloat16)

            cold, warm, hashes, before = [], [], [], []
            last = None
            for _ in range(args.reps):
                if evictable:
                    table.drop_cache()
                frac = table.resident_bytes()
                before.append(frac / table.nbytes() if frac is not None else None)
                last = batch()
                cold.append(_timed(lambda: step(last), device))
            step(last)  # the last cold batch's rows are now cached
            for _ in range(args.reps):
                warm.append(_timed(lambda: step(last), device))
                hashes.append(_timed(lambda: k.engram_hash(last, *consts), device))
            hash_ms = statistics.median(hashes)
            known = [b for b in before if b is not None]
            for name, times, res in (("cold", cold, max(known) if known else None), ("warm", warm, None)):
                ms = statistics.median(times)
                n_rows = t * layout.columns
                rows.append(Row(t, name, ms, 1e3 * ms / t, n_rows / (ms * 1e-3), n_rows * ROW_BYTES / (ms * 1e-3) / 1e6, hash_ms, res))
        print(f"{'tokens':>7} {'cache':>5} {'ms/batch':>10} {'us/token':>10} {'rows/s':>12} {'MB/s':>9} {'hash ms':>8} {'resident':>9}")
        for r in rows:
            res = "-" if r.resident is None else f"{100 * r.resident:.2f}%"
            print(f"{r.tokens:>7} {r.cache:>5} {r.ms:>10.3f} {r.us_per_token:>10.2f} {r.rows_per_s:>12,.0f} {r.mb_per_s:>9.1f} {r.hash_ms:>8.3f} {res:>9}")
        figures["rows"] = [asdict(r) for r in rows]
    finally:
        if not args.keep:
            path.unlink(missing_ok=True)
            if not args.dir:
                directory.rmdir()
    return figures


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=1.5, help="table size in GiB (default 1.5; the release's are ~94 GiB each)")
    ap.add_argument("--dir", default=None, help="where to write the table (default: a new temporary directory)")
    ap.add_argument("--keep", action="store_true", help="keep the table file")
    ap.add_argument("--device", default="cpu", help="where hash ids and the looked-up rows live (the table stays on the host)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--seed", type=int, default=0)
    add_json_flag(ap)
    args = ap.parse_args(argv)
    emit_json(args.json, run(args))


if __name__ == "__main__":
    main()
