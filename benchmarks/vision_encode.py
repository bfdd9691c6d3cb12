"""DeepSeek V4.1's vision encode on this machine: seconds per image by size, at the released tower's width.

Builds a V4.1 model whose vision tower has the released ``vision_config``
(1024 wide, 16 heads, 2816 MLP, 14-pixel patches, 3 × 3 merge into a
``--text-hidden`` aligner output, the released pixel floor and 1024-token cap)
with random weights, a tiny text backbone beside it (the encode never touches
it), and times ``model.encode_images`` of one image at a time for 224², 448²,
896² and 1920×1080 sources, each preprocessed as released (the grid, the
gray-padded fit, the normalised patches: the engine's ``V41ImageReader``)
and timed apart from the encode. Per size: the source, the ViT patch grid, the
span's tokens, preprocessing ms, encode ms (median of ``--reps`` after a
warm-up) and patches per second.

``--layers N`` builds a tower of N blocks instead of 32 for a quick run; the
report then adds ``est_32_layers_ms``: an EXTRAPOLATION, not a measurement —
the per-block time from a second tower of one block (two when N is 1; the
difference of the two encodes over the difference of their blocks) times the
32 − N blocks not built, added to the measured encode.

    .venv/bin/python benchmarks/vision_encode.py [--layers 32] [--reps 3] [--dtype float32] [--threads N]
        [--sizes 224x224,448x448,896x896,1920x1080] [--json]

The released tower is ~400M parameters; a 1920×1080 image is 8418 patches, so
on a small CPU the full 32 blocks take many minutes per image: ``--layers 2``
with its labelled extrapolation is the quick run.

``--json`` prints every figure as one JSON object, the output's last line.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import numpy as np  # noqa: E402
import torch  # noqa: E402
from PIL import Image  # noqa: E402

from benchmarks.common import add_json_flag, emit_json  # noqa: E402
from deepinfer.models.deepseek_v41.config import DeepseekV41Config, V41VisionConfig  # noqa: E402
from deepinfer.models.deepseek_v41.image_processor import V41ImageReader, image_reader  # noqa: E402
from deepinfer.models.deepseek_v41.model import DeepseekV41Model  # noqa: E402
from deepinfer_interfaces import Kernels  # noqa: E402
from tests.helpers.tiny_v41 import TEXT  # noqa: E402

SIZES = ((224, 224), (448, 448), (896, 896), (1920, 1080))
RELEASED_LAYERS = 32
VISION_PREFIXES = ("vision.", "aligner.", "image_")


@dataclass
class Row:
    width: int
    height: int
    vit_h: int
    vit_w: int
    tokens: int
    preprocess_ms: float
    encode_ms: float
    patches_per_s: float
    #: only with --layers below 32: an extrapolation to the released 32 blocks (see the module docstring)
    est_32_layers_ms: float | None = None


def build(layers: int, text_hidden: int, dtype: torch.dtype) -> tuple[DeepseekV41Model, V41ImageReader]:
    """A V4.1 model with the released vision tower of ``layers`` blocks and a tiny text backbone, random weights."""
    vision = dict(V41VisionConfig().model_dump(), num_hidden_layers=layers)
    raw = {
        "model_type": "deepseek_v41",
        "text_config": dict(TEXT, hidden_size=text_hidden, engram_layer_ids=[], num_hidden_layers=2, compress_ratios=[0, 0],
                            kv_source_layer_ids=[], index_source_layer_ids=[], candidate_source_layer_id=-1),
        "vision_config": vision,
        "image_token_id": 4090,
    }
    model = DeepseekV41Model(DeepseekV41Config.from_hf(raw).to_model_config(), Kernels(), dtype=dtype)
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters().items():
            if not name.startswith(VISION_PREFIXES):
                continue
            if name.endswith("norm.weight") or name.endswith("norm1.weight") or name.endswith("norm2.weight"):
                param.fill_(1.0)
            else:
                param.copy_(torch.randn(param.shape, generator=gen) * param.shape[-1] ** -0.5)
    return model, image_reader(raw)


def image(width: int, height: int) -> Image.Image:
    rng = np.random.default_rng(width * 10007 + height)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def median_ms(fn, reps: int) -> float:
    fn()  # warm-up
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return 1000 * statistics.median(times)


def measure(built: tuple[DeepseekV41Model, V41ImageReader], sizes, reps: int) -> list[Row]:
    rows = []
    model, reader = built
    for w, h in sizes:
        source = image(w, h)
        prep = median_ms(lambda: reader.span(source, 0), reps)
        one = reader.span(source, 0)
        grid = one.grid
        enc = median_ms(lambda: model.encode_images([one]), reps)
        rows.append(Row(w, h, grid.vit_h, grid.vit_w, grid.tokens, prep, enc, grid.patches / (enc / 1000)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--layers", type=int, default=RELEASED_LAYERS, help="ViT blocks (released: 32)")
    parser.add_argument("--reps", type=int, default=3, help="timed encodes per size (median)")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    parser.add_argument("--text-hidden", type=int, default=4096, help="the aligner's output width (the text hidden size)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    parser.add_argument("--sizes", default=",".join(f"{w}x{h}" for w, h in SIZES), help="source sizes, WxH comma-separated")
    add_json_flag(parser)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    sizes = [tuple(int(v) for v in size.split("x")) for size in args.sizes.split(",")]
    rows = measure(build(args.layers, args.text_hidden, dtype), sizes, args.reps)
    if args.layers != RELEASED_LAYERS:
        other = 1 if args.layers > 1 else 2
        short = measure(build(other, args.text_hidden, dtype), sizes, args.reps)
        for row, base in zip(rows, short):
            per_layer = (row.encode_ms - base.encode_ms) / (args.layers - other)
            row.est_32_layers_ms = row.encode_ms + (RELEASED_LAYERS - args.layers) * per_layer
    print(f"vision encode, {args.dtype}, {args.layers} of {RELEASED_LAYERS} ViT blocks, {torch.get_num_threads()} threads, "
          f"aligner to {args.text_hidden}; median of {args.reps}")
    head = f"{'source':>11} {'ViT grid':>9} {'tokens':>6} {'prep ms':>8} {'encode ms':>10} {'patch/s':>8}"
    print(head + ("  est. 32-block ms (EXTRAPOLATED)" if args.layers != RELEASED_LAYERS else ""))
    for r in rows:
        line = (f"{r.width:>5}x{r.height:<5} {r.vit_h:>4}x{r.vit_w:<4} {r.tokens:>6} {r.preprocess_ms:>8.1f} {r.encode_ms:>10.1f} "
                f"{r.patches_per_s:>8.0f}")
        print(line + (f"  {r.est_32_layers_ms:>10.1f}" if r.est_32_layers_ms is not None else ""))
    emit_json(args.json, {"dtype": args.dtype, "layers": args.layers, "threads": torch.get_num_threads(),
                          "text_hidden": args.text_hidden, "extrapolated": args.layers != RELEASED_LAYERS,
                          "rows": [asdict(r) for r in rows]})


if __name__ == "__main__":
    main()
