"""DeepSeek V4.1's tail-only prefill: compute and time saved on a long prompt of a tiny random config.

The layers after the last KV source keep no shared state, so a prompt needs them
only over its last windows (``CacheGeometry.prefill_tail``: ``(layers to the
end) · (W − 1) + 1`` positions per layer). This prefills one ``--tokens`` prompt
(32K by default) through the engine with the fast path on and off, and prints the
token-layers computed (the work every layer does is per token), the prefill
seconds, the first token's equality, and the same work count for the released
V4.1-Flash schedule (40 layers, the last KV source at 20, W = 128).

The tiny config keeps the release's proportions: sliding layers, a ratio-2 group
and a ratio-1 group whose source is the last KV source, then five decoder layers
of twelve (the release: 19 of 40).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.common import add_json_flag, emit_json  # noqa: E402
from deepinfer import LLM, SamplingParams  # noqa: E402
from tests.helpers.tiny_v41 import write_tiny_v41  # noqa: E402

LAYERS = dict(
    num_hidden_layers=12, compress_ratios=[0, 0, 2, 2, 2, 2, 1, 1, 1, 1, 1, 1],
    kv_source_layer_ids=[2, 6], index_source_layer_ids=[2, 4, 6, 8, 10], candidate_source_layer_id=6,
    sliding_window=128, index_topk=64, candidate_topk_blocks=256, candidate_block_size=8,
    engram_layer_ids=[1, 5],
)


def token_layers(prompt: int, layers: int, last_source: int, window: int, fast: bool) -> int:
    """Token-layer passes a prompt of ``prompt`` tokens takes through ``layers`` layers."""
    if not fast:
        return prompt * layers
    tails = [min(prompt, (layers - layer) * (window - 1) + 1) for layer in range(last_source + 1, layers)]
    return prompt * (last_source + 1) + sum(tails)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokens", type=int, default=32768, help="prompt length")
    parser.add_argument("--chunk", type=int, default=2048, help="prefill chunk (max_prefill_chunk)")
    add_json_flag(parser)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        ckpt = write_tiny_v41(Path(tmp) / "tiny", max_position_embeddings=max(65536, 2 * args.tokens), **LAYERS)
        prompt = [(7919 * i + 13) % 4000 + 5 for i in range(args.tokens)]
        rows = {}
        for fast in (False, True):
            llm = LLM(model=str(ckpt), backend="cpu", max_model_len=args.tokens + 8, max_prefill_chunk=args.chunk,
                      max_num_batched_tokens=args.chunk, enable_prefix_caching=False, prefill_fast_path=fast,
                      kv_cache_memory=1 << 30)
            t0 = time.perf_counter()
            out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=1))[0]
            rows[fast] = dict(seconds=time.perf_counter() - t0, token=out.outputs[0].token_ids[0],
                              token_layers=token_layers(args.tokens, 12, 6, 128, fast))
            del llm
    off, on = rows[False], rows[True]
    release_off = token_layers(args.tokens, 40, 20, 128, False)
    release_on = token_layers(args.tokens, 40, 20, 128, True)
    print(f"prompt {args.tokens} tokens, chunks of {args.chunk}, tiny V4.1 (12 layers, the last KV source at 6, W 128)")
    print(f"{'':24}{'full':>14}{'tail-only':>14}{'ratio':>10}")
    print(f"{'token-layers':24}{off['token_layers']:>14,}{on['token_layers']:>14,}{on['token_layers'] / off['token_layers']:>10.3f}")
    print(f"{'prefill seconds':24}{off['seconds']:>14.2f}{on['seconds']:>14.2f}{on['seconds'] / off['seconds']:>10.3f}")
    print(f"{'first token':24}{off['token']:>14}{on['token']:>14}{'equal' if on['token'] == off['token'] else 'DIFFERS':>10}")
    print(f"{'V4.1-Flash token-layers':24}{release_off:>14,}{release_on:>14,}{release_on / release_off:>10.3f}")
    emit_json(args.json, {
        "tokens": args.tokens, "chunk": args.chunk, "full": off, "tail_only": on,
        "saved_compute": 1 - on["token_layers"] / off["token_layers"], "speedup": off["seconds"] / on["seconds"],
        "same_first_token": on["token"] == off["token"],
        "v41_flash_token_layers": {"full": release_off, "tail_only": release_on},
    })


if __name__ == "__main__":
    main()
