"""Train the bundled tiny DeepSeek-V4 checkpoint from the standard library's docstrings.

Offline and deterministic: the corpus is read from this interpreter's stdlib
sources, seeds are fixed, each phase has a fixed thread count (the target one,
the draft two), and torch runs in deterministic mode. The result is written
with ``save_pretrained`` (upstream tensor names) beside a byte-level BPE tokenizer.

    python -m training.train_tiny                 # target, then DSpark draft: about 40 minutes on 2 cores
    python -m training.train_tiny --dspark-only   # only phase 2, on the target already in --out
    python -m training.train_tiny --smoke --out /tmp/micro   # a micro model in seconds
"""

from __future__ import annotations

import argparse
import json
import os
import random
import time
from pathlib import Path

import torch

from .corpus import build_corpus
from .data import corpus_streams
from .model_config import SMOKE, TINY, hf_config
from .routing import seed_hash_tables
from .target import greedy_continue, heldout_metrics, train_target
from .tokenizer import BOS_TOKEN, EOS_TOKEN, NOISE_TOKEN, save_tokenizer, train_tokenizer

DEFAULT_OUT = Path(__file__).resolve().parent.parent / "deepinfer" / "bundled" / "tiny-v4"

#: (full run, smoke run) settings
SETTINGS = {
    False: dict(shape=TINY, vocab=4096, seq_len=256, batch=8, steps=700, lr=3e-3, max_files=None, heldout_per_mille=50, eval_windows=None,
                draft=dict(steps=1600, batch=8, seq_len=128, anchors=40, lr=3e-3, generated=1536, real=4, tail=8, markov_rank=32, context_window=128, eval_windows=None, eval_generate=64,
                           calibration_per_mille=50, calibration_windows=None)),
    True: dict(shape=SMOKE, vocab=300, seq_len=32, batch=2, steps=3, lr=3e-3, max_files=25, heldout_per_mille=200, eval_windows=4,
               draft=dict(steps=3, batch=2, seq_len=32, anchors=4, lr=1e-3, generated=4, real=1, tail=6, markov_rank=8, context_window=16, eval_windows=4, eval_generate=16,
                          calibration_per_mille=100, calibration_windows=4)),
}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m training.train_tiny", description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="checkpoint directory to write")
    p.add_argument("--smoke", action="store_true", help="train a micro model for a few steps (seconds)")
    p.add_argument("--steps", type=int, default=None, help="target training steps (default: 700, smoke: 3)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch compute threads of phase 1 (the target)")
    p.add_argument("--draft-threads", type=int, default=2, help="torch compute threads of phase 2 (the DSpark draft)")
    p.add_argument("--report", type=Path, default=None, help="also write the measured figures as JSON here")
    p.add_argument("--dspark-only", action="store_true", help="skip phase 1: train the draft of the target already in --out")
    p.add_argument("--no-dspark", action="store_true", help="skip phase 2 (the DSpark draft)")
    return p.parse_args(argv)


def set_determinism(seed: int, threads: int) -> None:
    """Fixed seeds, a fixed thread count and deterministic torch kernels."""
    os.environ.setdefault("RAYON_NUM_THREADS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    random.seed(seed)
    torch.manual_seed(seed)
    torch.set_num_threads(threads)
    torch.use_deterministic_algorithms(True)


def sample_prompts(heldout: list[str], n: int) -> list[str]:
    """The first line of the first ``n`` held-out function records, opened as a docstring."""
    prompts = [rec.split("\n", 1)[0] + '\n    """' for rec in heldout if rec.startswith("def ")]
    return prompts[:n]


def train_target_phase(args, s: dict, corpus, tok, train_ids, heldout_ids) -> dict:
    """Phase 1: train, measure and save the target."""
    from transformers import DeepseekV4ForCausalLM, GenerationConfig

    bos, eos = tok.token_to_id(BOS_TOKEN), tok.token_to_id(EOS_TOKEN)
    config = hf_config(s["shape"], tok.get_vocab_size(), bos, eos)
    model = DeepseekV4ForCausalLM(config)
    seed_hash_tables(model, torch.Generator().manual_seed(args.seed + 1))
    steps = args.steps if args.steps is not None else s["steps"]
    log = train_target(model, train_ids, steps=steps, batch=s["batch"], seq_len=s["seq_len"], lr=s["lr"],
                       seed=args.seed + 2, dense_indexer_steps=steps // 3)
    metrics = heldout_metrics(model, heldout_ids, train_ids, s["seq_len"], s["eval_windows"])
    print(f"held-out perplexity {metrics['perplexity']:.2f} vs unigram {metrics['unigram_perplexity']:.2f} "
          f"over {metrics['heldout_tokens']} tokens", flush=True)
    for i, load in enumerate(metrics["expert_load"]):
        print(f"layer {i} ({load['kind']}): expert load max/mean {load['max_over_mean']:.2f}, min/mean {load['min_over_mean']:.2f}, "
              f"per-token route concentration {load.get('token_route_concentration', float('nan')):.2f}", flush=True)
    samples = []
    for prompt in sample_prompts(corpus.heldout, 3):
        out = greedy_continue(model, tok.encode(prompt).ids, 40, eos)
        samples.append(dict(prompt=prompt, token_ids=out, text=tok.decode(out, skip_special_tokens=False)))
        print(f"--- {prompt!r}\n{samples[-1]['text']!r}", flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(bos_token_id=bos, eos_token_id=eos, do_sample=False)
    model.save_pretrained(str(args.out))
    save_tokenizer(tok, args.out, model_max_length=s["seq_len"])
    return dict(target_steps=steps, target_log=log, samples=samples, params=sum(p.numel() for p in model.parameters()), **metrics)


def train_draft_phase(args, s: dict, tok, train_ids, heldout_ids) -> dict:
    """Phase 2: train the DSpark draft against the saved target on the training text but its last
    ``calibration_per_mille``, fit the confidence temperatures on that slice, measure acceptance on the held-out
    text, add the draft to the checkpoint."""
    from transformers import DeepseekV4ForCausalLM

    from .dspark_train import (acceptance, build_draft, chained_passes, describe_acceptance, dspark_fields, fit_temperatures,
                               save_draft, train_dspark)

    d = s["draft"]
    shape = s["shape"]
    torch.set_num_threads(args.draft_threads)
    eos = tok.token_to_id(EOS_TOKEN)
    fields = dspark_fields(shape["num_hidden_layers"], tok.token_to_id(NOISE_TOKEN), d["context_window"], d["markov_rank"])
    target, draft = build_draft(args.out, fields, args.seed + 3)
    hf = DeepseekV4ForCausalLM.from_pretrained(str(args.out)).eval()
    cut = train_ids.numel() - train_ids.numel() * d["calibration_per_mille"] // 1000
    draft_ids, calibration_ids = train_ids[:cut], train_ids[cut:]
    log = train_dspark(hf, target, draft, draft_ids, steps=d["steps"], batch=d["batch"], seq_len=d["seq_len"],
                       anchors=d["anchors"], lr=d["lr"], seed=args.seed + 4, generated=d["generated"],
                       real=d["real"], tail=d["tail"])
    calibration = chained_passes(hf, draft, calibration_ids, d["seq_len"], eos, d["calibration_windows"], d["eval_generate"])
    temps = fit_temperatures(calibration)
    draft.confidence_temperature.copy_(torch.tensor(temps))
    fields["dspark_confidence_temperatures"] = temps
    print(f"confidence temperatures {temps}, fitted on {calibration.accepted.numel()} passes after "
          f"{calibration.prompts} calibration prompts", flush=True)
    acc = acceptance(hf, draft, heldout_ids, d["seq_len"], eos, d["eval_windows"], d["eval_generate"])
    print(describe_acceptance(acc), flush=True)
    save_draft(args.out, draft, fields)
    return dict(draft_log=log, dspark=fields, acceptance=acc, calibration_passes=calibration.accepted.numel())


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    s = SETTINGS[args.smoke]
    set_determinism(args.seed, args.threads)
    t0 = time.monotonic()
    corpus = build_corpus(max_files=s["max_files"], heldout_per_mille=s["heldout_per_mille"])
    if args.dspark_only:
        from tokenizers import Tokenizer

        tok = Tokenizer.from_file(str(args.out / "tokenizer.json"))
    else:
        tok = train_tokenizer(corpus.train, s["vocab"])
    train_ids, heldout_ids = corpus_streams(tok, corpus)
    print(f"corpus: {len(corpus.train)} train / {len(corpus.heldout)} held-out records, "
          f"{train_ids.numel()} / {heldout_ids.numel()} tokens, vocab {tok.get_vocab_size()}", flush=True)
    report: dict = dict(train_tokens=train_ids.numel(), vocab_size=tok.get_vocab_size())
    if not args.dspark_only:
        report.update(train_target_phase(args, s, corpus, tok, train_ids, heldout_ids))
    if not args.no_dspark:
        report.update(train_draft_phase(args, s, tok, train_ids, heldout_ids))
    report["seconds"] = time.monotonic() - t0
    if args.report is not None:
        args.report.write_text(json.dumps(report, indent=1))
    print(f"saved {args.out} in {report['seconds']:.0f}s", flush=True)
    return report


if __name__ == "__main__":
    main()
