"""Measure a trained checkpoint without retraining: held-out perplexity vs the unigram baseline,
expert load, greedy samples, and (when the checkpoint has one) DSpark acceptance.

    python -m training.evaluate_checkpoint [--model deepinfer/bundled/tiny-v4] [--report FILE.json]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

from .corpus import build_corpus
from .data import corpus_streams
from .target import greedy_continue, heldout_metrics
from .tokenizer import EOS_TOKEN
from .train_tiny import DEFAULT_OUT, SETTINGS, sample_prompts, set_determinism


def draft_acceptance(model_dir: Path, hf, heldout_ids: torch.Tensor, eos_id: int) -> dict | None:
    """The checkpoint's DSpark acceptance on held-out text with the training script's settings (None without a draft)."""
    raw = json.loads((model_dir / "config.json").read_text())
    if "dspark_block_size" not in raw:
        return None
    from deepinfer.models.deepseek_v4.model import DeepseekV4Model
    from deepinfer.models.common.dspark import DSparkDraft
    from deepinfer_interfaces import Kernels

    from .dspark_train import acceptance

    target = DeepseekV4Model.from_pretrained(model_dir, Kernels(), dtype=torch.float32)
    draft = DSparkDraft.from_target(target, raw)
    d = SETTINGS[False]["draft"]
    return acceptance(hf, draft, heldout_ids, d["seq_len"], eos_id, generate=d["eval_generate"])


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(prog="python -m training.evaluate_checkpoint", description=__doc__.splitlines()[0])
    p.add_argument("--model", type=Path, default=DEFAULT_OUT)
    p.add_argument("--report", type=Path, default=None)
    args = p.parse_args(argv)
    set_determinism(0, 1)
    from tokenizers import Tokenizer
    from transformers import DeepseekV4ForCausalLM

    s = SETTINGS[False]
    tok = Tokenizer.from_file(str(args.model / "tokenizer.json"))
    eos = tok.token_to_id(EOS_TOKEN)
    corpus = build_corpus(heldout_per_mille=s["heldout_per_mille"])
    train_ids, heldout_ids = corpus_streams(tok, corpus)
    hf = DeepseekV4ForCausalLM.from_pretrained(str(args.model)).eval()
    report = heldout_metrics(hf, heldout_ids, train_ids, s["seq_len"])
    print(f"held-out perplexity {report['perplexity']:.2f} vs unigram {report['unigram_perplexity']:.2f} over {report['heldout_tokens']} tokens")
    for i, load in enumerate(report["expert_load"]):
        print(f"layer {i} ({load['kind']}): expert load max/mean {load['max_over_mean']:.2f}, min/mean {load['min_over_mean']:.2f}, "
              f"per-token route concentration {load.get('token_route_concentration', float('nan')):.2f}")
    report["samples"] = []
    for prompt in sample_prompts(corpus.heldout, 3):
        out = greedy_continue(hf, tok.encode(prompt).ids, 40, eos)
        report["samples"].append(dict(prompt=prompt, token_ids=out, text=tok.decode(out, skip_special_tokens=False)))
        print(f"--- {prompt!r}\n{report['samples'][-1]['text']!r}")
    acc = draft_acceptance(args.model, hf, heldout_ids, eos)
    if acc is not None:
        from .dspark_train import describe_acceptance

        report["acceptance"] = acc
        print(describe_acceptance(acc))
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=1))
    return report


if __name__ == "__main__":
    main()
