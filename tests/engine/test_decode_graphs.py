"""Decode graphs: replay computes what eager computes, across capture sizes, prefix hits, preemption and grammars.

The engine's graph machinery (capture sizes and context buckets, padded static
buffers, one host-to-device copy per step, placeholders filled on the device)
runs on test devices installed as real plugins (``tests/helpers/graph_devices``):
``replay`` re-runs the captured callable over the static buffers, so graph mode
must give eager's tokens and log-probabilities; ``stale`` replays its capture
run's outputs and must be caught by the conformance suite. One test compiles a
real CPU graph (inductor).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.graph_devices import make_graph_devices
from tests.helpers.plugins import run_cli
from deepinfer.models.registry import load_config

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ck"), "mixed")


@pytest.fixture(scope="module")
def plugins(tmp_path_factory):
    return make_graph_devices(tmp_path_factory.mktemp("plugins"))


def _python(code: str, plugins: Path, *args: str, timeout: float = 600) -> dict:
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugins), str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *args], env=env, capture_output=True, text=True, timeout=timeout, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


WORKLOAD = """
    import json, sys
    import torch
    from deepinfer import LLM, SamplingParams, StructuredOutputsParams
    from tests.helpers.checkpoints import BOS_ID

    def tokens(n, seed):
        g = torch.Generator().manual_seed(seed)
        return torch.randint(0, 256, (n,), generator=g).tolist()

    def run(backend, **kw):
        llm = LLM(model=sys.argv[1], backend=backend, max_model_len=256, max_num_seqs=8, max_num_batched_tokens=96,
                  max_prefill_chunk=48, graph_capture_sizes=[1, 2, 4, 8], **kw)
        system = [BOS_ID] + tokens(70, 0)
        prompts = [system + tokens(3 + 5 * i, 10 + i) for i in range(6)] + [[BOS_ID] + tokens(9 + i, 30 + i) for i in range(6)]
        params = [SamplingParams(temperature=0, max_tokens=4 + 3 * (i % 5), ignore_eos=True, logprobs=2) for i in range(len(prompts))]
        params[3] = SamplingParams(temperature=0, max_tokens=12, structured_outputs=StructuredOutputsParams(regex="[a-z]{3,9}"))
        params[7] = SamplingParams(temperature=0.8, seed=5, max_tokens=9, ignore_eos=True)
        first = llm.generate(prompts[:1], params[:1])  # the shared prefix is cached before the rest arrive
        outs = first + llm.generate(prompts[1:], params[1:])
        m = llm.get_metrics()
        graphs = llm.engine.runner.graphs
        sizes = sorted({g.size for g in graphs.graphs.values() if g.replays}) if graphs else []
        lps = [[[[t, lp.logprob] for t, lp in sorted(pos.items())] for pos in (o.outputs[0].logprobs or [])] for o in outs]
        return dict(tokens=[o.outputs[0].token_ids for o in outs], text=[o.outputs[0].text for o in outs], logprobs=lps,
                    replays=m["graph_replays"], captured=m["graphs_captured"], preemptions=m["preemptions"],
                    cached=m["cached_tokens"], sizes=sizes)

    budget = int(sys.argv[2])
    graph = run("replay", kv_cache_memory=budget, overlap_scheduling=True)  # placeholders filled into the static buffers
    eager = run("replay", kv_cache_memory=budget, enforce_eager=True, overlap_scheduling=False)
    diff = max([abs(a[1] - b[1]) for ga, ea in zip(graph["logprobs"], eager["logprobs"]) for pa, pe in zip(ga, ea) for a, b in zip(pa, pe)] or [0.0])
    same_ids = all([a[0] for a in pa] == [b[0] for b in pe] for ga, ea in zip(graph["logprobs"], eager["logprobs"]) for pa, pe in zip(ga, ea))
    print(json.dumps(dict(graph=graph, eager=eager, logprob_diff=diff, same_logprob_ids=same_ids)))
"""


def _budget(ckpt) -> int:
    """Room for one sequence of max_model_len and a block: the twelve requests preempt each other."""
    import torch

    from deepinfer.models.common.cache_spec import CacheGeometry, block_size_for

    config = load_config(ckpt)
    g = CacheGeometry.build(config, block_size_for(config, 16), 48, 256)
    return 8 * g.bytes_per_slot(torch.float32) + (g.blocks_for(256) + 1) * g.bytes_per_block(torch.float32)


@pytest.fixture(scope="module")
def v41(tmp_path_factory):
    from tests.helpers.tiny_v41 import write_tiny_v41

    return write_tiny_v41(tmp_path_factory.mktemp("v41") / "tiny")


@pytest.fixture(scope="module")
def v41_small(tmp_path_factory):
    """Three V4.1 layers (sliding, sliding with Engram, a ratio-2 KV source): the shortest forward with every kind
    of V4.1 state, for the compiled graph (compiling the eight-layer model from a cold cache takes minutes)."""
    from tests.helpers.tiny_v41 import write_tiny_v41

    return write_tiny_v41(tmp_path_factory.mktemp("v41s") / "tiny", num_hidden_layers=3, compress_ratios=[0, 0, 2],
                          kv_source_layer_ids=[2], index_source_layer_ids=[2], candidate_source_layer_id=None,
                          engram_layer_ids=[1])


@pytest.mark.parametrize("model", ["ckpt", "v41"])
def test_graph_replay_equals_eager_with_prefix_hits_preemption_and_grammar(model, plugins, request):
    """DeepSeek V4 and V4.1 (its shared pools, tail-only prefill, Engram ring and placeholders) alike."""
    ckpt = request.getfixturevalue(model)
    out = _python(WORKLOAD, plugins, str(ckpt), str(_budget(ckpt)))
    graph, eager = out["graph"], out["eager"]
    assert graph["tokens"] == eager["tokens"] and graph["text"] == eager["text"]
    assert out["same_logprob_ids"] and out["logprob_diff"] < 1e-4
    assert graph["captured"] == 4 and eager["captured"] == 0 and eager["replays"] == 0
    assert graph["replays"] > 10 and len(graph["sizes"]) >= 3, graph["sizes"]
    assert graph["preemptions"] > 0 and eager["preemptions"] > 0
    assert graph["cached"] > 0 and eager["cached"] > 0
    assert all(c.isalpha() for c in graph["text"][3]) and 3 <= len(graph["text"][3]) <= 9


def test_a_stale_v41_replay_is_caught_against_eager(v41, plugins):
    """The comparison above catches a device whose V4.1 replay is wrong: ``stale`` replays its capture run's
    outputs (every padding row's), so the Engram rows and logits a step gathers never reach its tokens."""
    out = _python("""
        import json, sys
        from deepinfer import LLM, SamplingParams
        prompts = [[5, 6, 7, 8, 9, 10], [11, 12, 13]]
        sp = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)
        runs = {}
        for backend, eager in (("replay", True), ("stale", False)):
            llm = LLM(model=sys.argv[1], backend=backend, enforce_eager=eager, max_model_len=64, max_num_seqs=2,
                      graph_capture_sizes=[2], kv_cache_memory=8 << 20)
            outs = llm.generate(prompts, sp)
            runs[backend] = dict(tokens=[o.outputs[0].token_ids for o in outs], replays=llm.get_metrics()["graph_replays"])
        print(json.dumps(runs))
    """, plugins, str(v41))
    assert out["replay"]["replays"] == 0 and out["stale"]["replays"] >= 5
    assert out["stale"]["tokens"] != out["replay"]["tokens"]


def test_conformance_checks_a_graph_implementation_against_eager(ckpt, plugins):
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugins), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"

    def conformance(backend: str, *extra: str):
        cmd = [sys.executable, "-m", "deepinfer.cli", "conformance", "--backend", backend, "--suite", "e2e", "--model", str(ckpt), *extra]
        return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)

    good = conformance("replay")  # graph_by_default: graph cases run without asking
    assert good.returncode == 0, good.stdout + good.stderr
    assert good.stdout.count("greedy-graph") >= 1
    bad = conformance("stale")
    assert bad.returncode == 1, bad.stdout + bad.stderr
    assert "greedy-graph" in bad.stdout and "FAIL" in bad.stdout.upper()
    off = conformance("stale", "--graphs", "off")
    assert off.returncode == 0, off.stdout + off.stderr


def test_verify_steps_replay_verify_graphs_with_eagers_tokens(plugins):
    # the bundled model has a DSpark draft: speculating requests' steps bring an anchor and up to five drafts
    # each, and replay the verify graph of their size (all padded to six tokens a sequence)
    out = _python("""
        import json
        from deepinfer import LLM, SamplingParams
        prompts = ["def read_file(path):", "class Stack:", "import os", "Return the number of", "def get_"]
        params = [SamplingParams(temperature=0.0, max_tokens=20 + 4 * i, ignore_eos=True, logprobs=1) for i in range(5)]

        def run(**kw):
            llm = LLM(max_model_len=256, max_num_seqs=4, graph_capture_sizes=[1, 2, 4], **kw)
            outs = llm.generate(prompts, params)
            m = llm.get_metrics()
            lps = [[next(iter(sorted(p.items())))[1].logprob for p in o.outputs[0].logprobs] for o in outs]
            return dict(tokens=[o.outputs[0].token_ids for o in outs], lps=lps, by_size=m["graph_replays_by_size"],
                        captured=m["graphs_captured"], verified=m["spec_verifications"])

        eager = run(backend="cpu", speculative_method=None)
        graph = run(backend="replay", speculative_policy="all")
        print(json.dumps(dict(eager=eager, graph=graph)))
    """, plugins)
    eager, graph = out["eager"], out["graph"]
    assert graph["tokens"] == eager["tokens"]
    assert max(abs(a - b) for p, q in zip(graph["lps"], eager["lps"]) for a, b in zip(p, q)) < 1e-4
    # three decode and three verify sizes, one context bucket
    assert graph["captured"] == 6 and graph["verified"] > 10
    verify = {k: v for k, v in graph["by_size"].items() if "x" in k}
    assert verify and all(k.endswith("x6") for k in verify) and sum(verify.values()) > 5, graph["by_size"]


def test_device_without_graph_capture_runs_eager(ckpt, plugins):
    out = _python("""
        import json, sys
        from deepinfer import LLM, SamplingParams
        llm = LLM(model=sys.argv[1], backend="nograph", enforce_eager=False, max_model_len=128, kv_cache_memory=16 << 20)
        o = llm.generate([[1, 2, 3]], SamplingParams(temperature=0, max_tokens=5, ignore_eos=True))[0]
        m = llm.get_metrics()
        print(json.dumps(dict(tokens=len(o.outputs[0].token_ids), captured=m["graphs_captured"], replays=m["graph_replays"])))
    """, plugins, str(ckpt))
    assert out == {"tokens": 5, "captured": 0, "replays": 0}


def test_failed_capture_is_one_line_naming_the_fix(ckpt, plugins):
    proc = run_cli(["generate", "--backend", "brokengraph", "--model", str(ckpt), "--prompt", "hi", "--max-model-len", "128",
                    "--kv-cache-memory", "16000000"], extra_path=plugins)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and "capturing the decode graph" in lines[0] and "stream is capturing" in lines[0]
    assert "enforce_eager=True" in lines[0]
    ok = run_cli(["generate", "--backend", "brokengraph", "--enforce-eager", "--model", str(ckpt), "--prompt", "hi",
                  "--max-model-len", "128", "--kv-cache-memory", "16000000", "--max-tokens", "3"], extra_path=plugins)
    assert ok.returncode == 0, ok.stderr


@pytest.mark.slow
@pytest.mark.parametrize("model", ["ckpt", "v41_small"])
def test_cpu_compiled_graph_matches_eager(model, plugins, request):
    """The CPU device's own graphs (inductor, whole forward, no graph break allowed) give eager's tokens; V4.1's
    graph hashes its n-grams and gathers its Engram rows from the mapped tables inside."""
    ckpt = request.getfixturevalue(model)
    out = _python("""
        import json, sys
        import torch
        from deepinfer import LLM, SamplingParams
        g = torch.Generator().manual_seed(0)
        prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (5, 17)]
        sp = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=1)
        res = {}
        for eager in (True, False):
            llm = LLM(model=sys.argv[1], backend="cpu", enforce_eager=eager, graph_capture_sizes=[2], max_num_seqs=2,
                      max_model_len=128, kv_cache_memory=16 << 20)
            outs = llm.generate(prompts, sp)
            res[eager] = dict(tokens=[o.outputs[0].token_ids for o in outs],
                              lps=[[max(p.values(), key=lambda x: x.logprob).logprob for p in o.outputs[0].logprobs] for o in outs],
                              replays=llm.get_metrics()["graph_replays"])
        diff = max(abs(a - b) for x, y in zip(res[True]["lps"], res[False]["lps"]) for a, b in zip(x, y))
        print(json.dumps(dict(same=res[True]["tokens"] == res[False]["tokens"], diff=diff, replays=res[False]["replays"])))
    """, plugins, str(ckpt), timeout=900)
    assert out["same"] and out["diff"] < 1e-4 and out["replays"] >= 6
