"""Expert parallelism over real gloo processes on the CPU: outputs equal one rank's, each rank holds only
its experts, rebalancing with redundant experts changes no output and balances the load, and a rank that
dies stops every process with one line."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from deepinfer import LLM, SamplingParams
from deepinfer.errors import ConfigError
from deepinfer.expert_parallel.eplb import EPLBSettings
from deepinfer.expert_parallel.lockstep import StepDispatch, StepKind
from deepinfer.expert_parallel.sharding import ExpertParallel
from deepinfer.models.deepseek_v4.model import DeepseekV4Model
from deepinfer.weight_memory import weight_memory
from deepinfer_interfaces import Kernels
from tests.helpers.graph_devices import make_graph_devices
from tests.helpers.published import make_published_checkpoint

ROOT = Path(__file__).resolve().parents[2]

PROMPTS = [
    "def read_file(path):",
    "class Stack:\n    def push(self, item):",
    "import os\n\ndef walk(top):",
    [0, 5, 9, 44, 17],
    "Return the number of",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=10, prompt_logprobs=1)
# the bundled model is fp32 on the CPU: lockstep ranks compute the same sums, in the same order
LOGPROB_TOL = 1e-5


def _run(llm: LLM, prompts=PROMPTS, params=GREEDY):
    outs = llm.generate(prompts, params)
    assert all(o.error is None for o in outs), [o.error for o in outs]
    return outs


GRAPH_RUN = """
    import json, sys
    from deepinfer import LLM, SamplingParams
    prompts, graph_kw = json.loads(sys.argv[1]), json.loads(sys.argv[2])
    # lengths differ: ranks finish at different steps, and an idle rank replays its graph over padding
    params = [SamplingParams(temperature=0.0, max_tokens=6 + 5 * i, ignore_eos=True, prompt_logprobs=1) for i in range(len(prompts))]

    def run(**kw):
        llm = LLM(seed=0, max_model_len=256, max_num_seqs=4, **kw)
        try:
            outs = llm.generate(prompts, params)
            m = llm.get_metrics()
        finally:
            llm.close()
        lps = [[next(iter(p.values())).logprob for p in o.prompt_logprobs[1:]] for o in outs]
        return dict(tokens=[o.outputs[0].token_ids for o in outs], logprobs=lps, metrics=m)

    eager = run(backend="cpu", speculative_method=None)
    graph = run(backend="replay", expert_parallel_size=2, graph_capture_sizes=[1, 2, 4], **graph_kw)
    m = graph["metrics"]
    print(json.dumps(dict(eager=eager["tokens"], graph=graph["tokens"], eager_lps=eager["logprobs"], graph_lps=graph["logprobs"],
                          captured=[r["graphs_captured"] for r in m["per_rank"]], replays=[r["graph_replays"] for r in m["per_rank"]],
                          by_size=[r["graph_replays_by_size"] for r in m["per_rank"]],
                          ep=m["expert_parallel"], verifications=m["spec_verifications"])))
"""


def _graph_run(tmp_path: Path, **graph_kw) -> dict:
    """``GRAPH_RUN`` in a fresh process on the ``replay`` test device: one eager rank without speculation,
    then EP 2 with graphs (and ``graph_kw``); every rank's graph figures."""
    plugins = make_graph_devices(tmp_path)
    env = {k: v for k, v in os.environ.items() if not k.startswith("DEEPINFER_")}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(plugins), str(ROOT), env.get("PYTHONPATH")]))
    env["OMP_NUM_THREADS"] = "1"
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(GRAPH_RUN), json.dumps(PROMPTS), json.dumps(graph_kw)],
                          env=env, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    assert out["graph"] == out["eager"]
    diff = max(abs(a - b) for p, q in zip(out["graph_lps"], out["eager_lps"]) for a, b in zip(p, q))
    assert diff <= LOGPROB_TOL
    return out


@pytest.fixture(scope="module")
def single():
    # one rank, no speculation: the EP runs below draft and verify (on by default with the bundled draft)
    llm = LLM(backend="cpu", seed=0, speculative_method=None)
    return _run(llm)


def _prompt_logprobs(out) -> list[float]:
    return [next(iter(p.values())).logprob for p in out.prompt_logprobs[1:]]


@pytest.mark.parametrize("ep", [2, 4])
def test_greedy_tokens_and_prompt_logprobs_equal_one_rank(single, ep):
    llm = LLM(backend="cpu", seed=0, expert_parallel_size=ep)
    try:
        outs = _run(llm)
        assert len(llm.engine.rank_pids) == ep
        metrics = llm.get_metrics()
    finally:
        llm.close()
    for got, want in zip(outs, single):
        assert got.outputs[0].token_ids == want.outputs[0].token_ids
        assert got.outputs[0].text == want.outputs[0].text
        a, b = _prompt_logprobs(got), _prompt_logprobs(want)
        assert len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b)) <= LOGPROB_TOL
    ep_metrics = metrics["expert_parallel"]
    assert ep_metrics["size"] == ep and len(metrics["per_rank"]) == ep
    assert metrics["spec_verifications"] > 0 and metrics["spec_mean_accepted_length"] > 1.0
    # requests were spread: every rank generated tokens, and the counters add up
    assert all(m["generated_tokens"] > 0 for m in metrics["per_rank"])
    assert metrics["generated_tokens"] == sum(len(o.outputs[0].token_ids) for o in outs)
    assert 0.0 < ep_metrics["dispatch_combine_share"] < 1.0
    assert all(b is not None and 0.0 < b <= 1.0 for b in ep_metrics["balancedness"])


def test_decode_graphs_replay_in_lockstep_under_ep_through_rebalancing(tmp_path):
    # the `replay` test device captures by default and re-runs the captured step over its static buffers: ranks
    # must capture the same graphs in the same order and replay the same size each step, or the collectives
    # inside (fixed-capacity dispatch and combine) do not meet; no speculation: this is about decode graphs
    out = _graph_run(tmp_path, num_redundant_experts=2, eplb_interval=4, eplb_window=4, speculative_method=None)
    assert out["captured"] == [3, 3]  # three sizes, one context bucket, on each rank
    assert all(r > 5 for r in out["replays"]), out["replays"]
    # every step, every rank replayed the graph of the agreed size (the request counts differ between ranks)
    assert out["by_size"][0] == out["by_size"][1] and len(out["by_size"][0]) >= 2, out["by_size"]
    # weights moved between ranks while graphs kept replaying
    assert out["ep"]["rebalances"] >= 1 and out["ep"]["layers_moved"] > 0, out["ep"]


def test_verify_graphs_replay_in_lockstep_under_ep(tmp_path):
    # speculation on (the bundled model's DSpark draft; drafts above a survival threshold verified, so some
    # sequences bring none): each step the ranks agree on one graph, the verify graph of the size holding the most
    # sequences any rank brings whenever one rank verifies, and every rank replays it (one that only decodes or
    # is idle, too); greedy verification keeps the tokens of one eager rank without speculation
    out = _graph_run(tmp_path, speculative_policy="threshold", speculative_threshold=0.7)
    assert out["verifications"] > 5, out
    assert out["captured"] == [6, 6]  # three decode and three verify sizes, one context bucket, on each rank
    verify = [{k: v for k, v in by.items() if "x" in k} for by in out["by_size"]]
    assert all(v and all(k.endswith("x6") for k in v) and sum(v.values()) >= 4 for v in verify), out["by_size"]
    # the same graphs, as often, on both ranks (their request counts and speculation differ)
    assert out["by_size"][0] == out["by_size"][1], out["by_size"]
    assert out["replays"][0] == out["replays"][1], out["replays"]


class _Peer:
    """Rank 0 of 2 whose peer's vote is given: ``all_reduce`` takes the element-wise max with it."""

    rank, world_size = 0, 2

    def __init__(self, seqs: int, tokens: int, kind: StepKind) -> None:
        self.peer = torch.tensor([seqs, tokens, int(kind)], dtype=torch.int64)

    def all_reduce(self, tensor: torch.Tensor, op: str) -> torch.Tensor:
        assert op == "max"
        return tensor.copy_(torch.maximum(tensor, self.peer))


@pytest.mark.parametrize(
    "mine, peer, drafts, want",
    [
        ((1, 1, StepKind.DECODE), (3, 3, StepKind.DECODE), 5, StepDispatch(4, (4, 1))),
        # one rank verifies: the decoding rank replays the same verify graph, sized by the most sequences
        ((2, 2, StepKind.DECODE), (1, 6, StepKind.VERIFY), 5, StepDispatch(12, (2, 6))),
        ((0, 0, StepKind.DECODE), (3, 10, StepKind.VERIFY), 5, StepDispatch(24, (4, 6))),
        # more sequences than the largest graph holds: eager on every rank, at the most tokens any rank brings
        ((5, 5, StepKind.DECODE), (1, 6, StepKind.VERIFY), 5, StepDispatch(6)),
        ((5, 5, StepKind.DECODE), (1, 1, StepKind.DECODE), 5, StepDispatch(5)),
        # no verify graphs: a verifying step runs eager at a fixed capacity
        ((2, 12, StepKind.VERIFY), (1, 1, StepKind.DECODE), 0, StepDispatch(12)),
        ((2, 12, StepKind.VERIFY), (4, 40, StepKind.PREFILL), 5, StepDispatch(None)),
    ],
)
def test_begin_step_agrees_on_one_graph_or_one_eager_capacity(mine, peer, drafts, want):
    ep = ExpertParallel(_Peer(*peer), num_layers=1, num_experts=4, top_k=2, device=torch.device("cpu"), eplb=EPLBSettings())
    ep.use_graphs([1, 2, 4], drafts)
    got = ep.begin_step(*mine)
    assert got == want and ep.capacity == want.capacity


def test_rebalancing_with_redundant_experts_keeps_outputs_and_balances_a_skewed_load():
    # one text repeated: hash layers route by token id and learned routers see the same tokens, so a few
    # experts take most of the traffic
    skewed = ["the the the the the the the the the the the the"] * 6
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    # without speculation: a fixed number of steps (one token each) before and after the rebalance
    want = _run(LLM(backend="cpu", seed=0, speculative_method=None), skewed, params)
    llm = LLM(backend="cpu", seed=0, expert_parallel_size=2, num_redundant_experts=2, eplb_interval=8, eplb_window=8,
              speculative_method=None)
    try:
        got = _run(llm, skewed, params)
        ep = llm.get_metrics()["expert_parallel"]
    finally:
        llm.close()
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert ep["rebalances"] >= 1 and ep["experts_moved"] > 0
    before, after = ep["balancedness_total_before"], ep["balancedness_total"]
    assert before is not None and before < 0.85, ep
    assert after >= 0.9, ep


def test_an_ep_that_does_not_divide_the_experts_is_refused_with_the_numbers():
    with pytest.raises(ConfigError, match=r"3.*8"):
        LLM(backend="cpu", expert_parallel_size=3)
    proc = subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", "generate", "--backend", "cpu", "--ep", "3", "--prompt", "x"],
        capture_output=True, text=True, timeout=120,
    )
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and "3" in lines[0] and "8" in lines[0], proc.stderr


class _Shard:
    """The expert sharding of one rank, for loading only (nothing is routed)."""

    def __init__(self, rank: int, world: int, experts: int) -> None:
        per = experts // world
        self.slots = list(range(rank * per, (rank + 1) * per))

    def local_experts(self, layer: int) -> list[int]:
        return list(self.slots)

    def begin_forward(self, positions: torch.Tensor, live: torch.Tensor) -> None:
        raise AssertionError("not for running")

    def routed(self, *args):
        raise AssertionError("not for running")


def test_each_rank_loads_only_its_experts_quantized_and_holds_what_inspect_says(tmp_path):
    directory = make_published_checkpoint(tmp_path)
    full = DeepseekV4Model.from_pretrained(directory, Kernels(), dtype=torch.float32)
    experts = full.config.n_routed_experts
    expected = weight_memory(directory, ep=2, dtype=torch.float32).per_rank_bytes
    for rank in range(2):
        shard = _Shard(rank, 2, experts)
        model = DeepseekV4Model.from_pretrained(directory, Kernels(), dtype=torch.float32, sharding=shard)
        held = model.named_parameters()
        names = [n for n in held if ".ffn.experts." in n]
        assert {int(n.split(".ffn.experts.")[1].split(".")[0]) for n in names} == set(shard.slots)
        assert sum(p.numel() * p.element_size() for p in held.values()) == expected
        for layer, ref in zip(model.layers, full.layers):
            assert layer.ffn.w13.codes.dtype == ref.ffn.w13.codes.dtype == torch.uint8  # FP4 pairs, still packed
            assert torch.equal(layer.ffn.w13.codes, ref.ffn.w13.codes[shard.slots])
            assert torch.equal(layer.ffn.w2.scales, ref.ffn.w2.scales[shard.slots])


_KILLED = textwrap.dedent(
    """
    import sys
    from deepinfer import LLM, SamplingParams
    from deepinfer.errors import DeepInferError
    llm = LLM(backend="cpu", expert_parallel_size=2, ep_timeout_s=float(sys.argv[1]))
    print("pids", *llm.engine.rank_pids, flush=True)
    try:
        for out in llm.generate_stream(["def f(x):"] * 4, SamplingParams(temperature=0.0, max_tokens=5000, ignore_eos=True)):
            print("token", flush=True)
    except DeepInferError as exc:
        print(exc, file=sys.stderr)
        sys.exit(3)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie has exited
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.parametrize(
    "sig, timeout_s, says",
    [(signal.SIGKILL, 20, "rank 1 of 2 was killed by signal 9"), (signal.SIGSTOP, 8, "rank 1 of 2 stopped answering")],
    ids=["killed", "hung"],
)
def test_a_dead_or_hung_rank_stops_every_process_with_one_line(sig, timeout_s, says):
    proc = subprocess.Popen([sys.executable, "-c", _KILLED, str(timeout_s)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        pids = [int(p) for p in proc.stdout.readline().split()[1:]]
        assert len(pids) == 2, proc.stderr.read()
        assert proc.stdout.readline().strip() == "token"
        os.kill(pids[1], sig)
        start = time.monotonic()
        _, err = proc.communicate(timeout=60)
        elapsed = time.monotonic() - start
    finally:
        if proc.poll() is None:
            proc.kill()
        for pid in pids:  # never leave a rank behind, whatever failed above
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
    assert proc.returncode == 3 and elapsed < 60
    lines = err.strip().splitlines()
    assert len(lines) == 1 and says in lines[0], err
    assert "Traceback" not in err
    deadline = time.monotonic() + 10
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids)


def test_generate_with_ep_prints_what_one_rank_prints():
    proc = subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", "generate", "--backend", "cpu", "--ep", "2", "--prompt", "def add(a, b):",
         "--max-tokens", "6", "--stats"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr
    single = subprocess.run(
        [sys.executable, "-m", "deepinfer.cli", "generate", "--backend", "cpu", "--prompt", "def add(a, b):", "--max-tokens", "6"],
        capture_output=True, text=True, timeout=300,
    )
    assert proc.stdout == single.stdout
    assert "EP 2: balancedness" in proc.stderr
