"""One long prefill in its own process, for tests and benchmarks that measure its peak memory.

``python -m tests.helpers.long_prefill CKPT TOKENS OUT.json [--parity N] [--replay bounded|exact]``
runs a ``TOKENS``-token random prompt through the engine with a fixed KV budget,
then the same prompt plus its first generated token (a prefix hit), and writes
the process's peak RSS, every step's seconds, the tokens the hit replayed and
the tokens to ``OUT.json``. With
``--parity N`` it then rebuilds the prompt's cache state with the model alone
and computes its last ``N`` positions twice, through the tiled ops and through
the untiled ops they replace (``indexer_scores`` + ``topk_select`` over
per-token lists, ``sparse_attention`` over the window and every entry), and
writes the largest difference of the last position's logits.
"""

from __future__ import annotations

import argparse
import gc
import json
import resource
import time

import torch

from deepinfer import LLM, SamplingParams
from deepinfer.outputs import RequestOutput
from deepinfer.models.common.batch import Batch
from deepinfer.models.common.cache import ContiguousCache
from deepinfer_interfaces import Kernels
from deepinfer.models.registry import load_model

#: the KV budget and length limit every run shares, so that only the prompt length differs
KV_BUDGET = 96 << 20
MAX_MODEL_LEN = (1 << 17) + 1024
CHUNK = 8192


class UntiledKernels(Kernels):
    """The long-context ops through the per-token ops they fuse: ``[T, N]`` lists, no tiles."""

    @staticmethod
    def _lists(table: torch.Tensor, token_seq: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        cols = torch.arange(table.shape[1], device=table.device)
        return torch.where(cols[None, :] < visible[:, None], table[token_seq], -1)

    def indexer_topk(self, q, weights, keys, table, token_seq, visible, scale, k):
        lists = self._lists(table, token_seq, visible)
        scores = self.indexer_scores(q, weights, keys, lists, scale)
        entries = torch.arange(table.shape[1], device=q.device).expand_as(lists).contiguous()
        picked = self.topk_select(scores, entries, k)
        return picked

    def entry_attention(self, q, kv, indices, table, token_seq, visible, sinks, scale):
        rows = torch.cat([indices, self._lists(table, token_seq, visible)], dim=1)
        return self.sparse_attention(q, kv, rows, sinks, scale)


def peak_rss_mib() -> float:
    """The process's peak resident memory since the last ``reset_peak`` (device memory is not in it)."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024
    except (OSError, StopIteration):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def rss_mib() -> float:
    """The process's resident memory now."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("VmRSS:")) / 1024
    except (OSError, StopIteration):
        return peak_rss_mib()


def reset_peak() -> None:
    """Start the peak over from the current resident memory (Linux: ``/proc/self/clear_refs``), so that a
    prefill's peak is its own rather than the engine's start-up's."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:
        pass


def prompt(tokens: int) -> list[int]:
    return torch.randint(0, 256, (tokens,), generator=torch.Generator().manual_seed(tokens)).tolist()


def _timed(llm: LLM, ids: list[int], params: SamplingParams) -> tuple[RequestOutput, list[float]]:
    """Run one request to completion, with the wall seconds of every engine step."""
    engine = llm.engine
    req = engine.add_request(ids, params)
    times = []
    while not req.all_finished:
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    out = engine.output(req)
    engine.release([req.request_id])
    return out, times


def engine_run(
    ckpt: str, tokens: int, replay: str = "exact", max_model_len: int = MAX_MODEL_LEN, kv_budget: int = KV_BUDGET, backend: str = "cpu"
) -> dict:
    """Prefill ``tokens`` through the engine, then hit the prompt plus its first token in the prefix cache."""
    llm = LLM(model=ckpt, backend=backend, max_model_len=max_model_len, kv_cache_memory=kv_budget, max_num_seqs=2,
              max_num_batched_tokens=CHUNK, max_prefill_chunk=CHUNK, swa_replay=replay)
    ids = prompt(tokens)
    gc.collect()
    reset_peak()
    before = rss_mib()
    first, steps = _timed(llm, ids, SamplingParams(temperature=0.0, max_tokens=2, logprobs=1))
    peak = peak_rss_mib()
    a1, a2 = first.outputs[0].token_ids
    replayed = llm.get_metrics()["replayed_tokens"]
    hit, hit_steps = _timed(llm, ids + [a1], SamplingParams(temperature=0.0, max_tokens=1, logprobs=1))
    logprob = lambda out, i: next(iter(out.outputs[0].logprobs[i].values())).logprob  # noqa: E731
    report = dict(
        tokens=tokens, replay=replay, rss_before_mib=before, peak_rss_mib=peak, prefill_s=sum(steps), step_s=steps,
        generated=[a1, a2], first_logprob=logprob(first, 0), second_logprob=logprob(first, 1),
        hit_s=sum(hit_steps), hit_token=hit.outputs[0].token_ids[0], hit_logprob=logprob(hit, 0),
        hit_cached_tokens=hit.num_cached_tokens, hit_replayed_tokens=llm.get_metrics()["replayed_tokens"] - replayed,
        plan=llm.engine.runner.plan.describe(),
    )
    del llm
    gc.collect()
    return report


def parity_run(ckpt: str, tokens: int, tail: int) -> dict:
    """Logits of the last position, computed tiled and untiled over the same compressed state."""
    tiled = load_model(ckpt, Kernels(), dtype=torch.float32)
    untiled = load_model(ckpt, UntiledKernels(), dtype=torch.float32)
    cache = ContiguousCache(tiled.config, 1, tokens + 16, max_step_tokens=CHUNK, dtype=torch.float32)
    slot = cache.allocate()
    ids = prompt(tokens)
    head = tokens - tail
    with torch.no_grad():
        for start in range(0, head, CHUNK):
            chunk = ids[start: min(head, start + CHUNK)]
            tiled(Batch.build([chunk], [slot], [start]), cache)
        last = Batch.build([ids[head:]], [slot], [head])
        want = untiled(last, cache)  # writes the tail's state; the tiled pass rewrites it with equal values
        cache.truncate(slot, head)
        got = tiled(last, cache)
    return dict(parity_tail=tail, parity_max_abs=float((got.float() - want.float()).abs().max()),
                parity_logits_scale=float(want.float().abs().max()))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("ckpt")
    parser.add_argument("tokens", type=int)
    parser.add_argument("out")
    parser.add_argument("--parity", type=int, default=0, metavar="N", help="also compare the last N positions tiled and untiled")
    parser.add_argument("--replay", choices=["bounded", "exact"], default="exact")
    parser.add_argument("--max-model-len", type=int, default=MAX_MODEL_LEN)
    parser.add_argument("--kv-budget", type=int, default=KV_BUDGET, help="KV cache bytes")
    parser.add_argument("--backend", default="cpu")
    args = parser.parse_args()
    report = engine_run(args.ckpt, args.tokens, args.replay, args.max_model_len, args.kv_budget, args.backend)
    if args.parity:
        report.update(parity_run(args.ckpt, args.tokens, args.parity))
    with open(args.out, "w") as f:
        json.dump(report, f)


if __name__ == "__main__":
    main()
