"""DSpark speculative decoding in the engine: lossless against plain decoding (greedy token for token,
sampled in distribution), admission that verifies less on a busy device, and the metrics it reports."""

from __future__ import annotations

import functools
import math

import pytest
import torch

from deepinfer import LLM, SamplingParams, StructuredOutputsParams
from deepinfer.engine import BUNDLED_MODEL
from deepinfer.errors import ConfigError
from deepinfer.models.common.cache_spec import CacheGeometry, block_size_for
from deepinfer.spec_decode import StepCostProfile, admit
from deepinfer.spec_decode.live_costs import LiveCosts
from deepinfer_interfaces import Kernels
from tests.helpers.checkpoints import make_tiny_checkpoint
from deepinfer.models.registry import load_config

pytestmark = pytest.mark.usefixtures("one_thread")

SYSTEM = "".join(
    f"def {name}(path):\n    \"\"\"Return the {what} of the given path.\"\"\"\n    return {name}_impl(path)\n\n"
    for name, what in [("read_file", "file object"), ("size", "size in bytes"), ("owner", "owner name"),
                       ("mtime", "modification time"), ("lines", "number of lines"), ("kind", "file type")]
)  # long enough that a prefix hit beats recomputing the draft's 128-token context
STEMS = ["def ", "class ", "import ", "Return the ", "    if ", "def get_", "def set_", "    return ", "The ", "    \"\"\""]


def _prompts() -> list[str]:
    """Fifty prompts: half share a long prefix (prefix-cache hits), half stand alone."""
    shared = [SYSTEM + stem + word for stem, word in zip(STEMS * 3, ["name", "value", "path", "item", "key"] * 6)][:25]
    alone = [stem + word + "(" for stem, word in zip(STEMS * 3, ["read", "write", "open", "close", "walk"] * 6)][:25]
    return shared + alone


@functools.cache
def _budget(speculative: bool) -> int:
    """Cache room for six slots and sixty blocks, so the batch preempts, whether the draft's context rings
    take their share of it or not (the same blocks either way: the same prefix hits and evictions)."""
    config = load_config(BUNDLED_MODEL)
    g = CacheGeometry.build(config, block_size_for(config, 16), 48, 320)
    ring = LLM(backend="cpu", max_num_seqs=1, max_model_len=320).engine.runner.plan.draft_bytes_per_slot if speculative else 0
    return 6 * (g.bytes_per_slot(torch.float32) + ring) + 60 * g.bytes_per_block(torch.float32)


def _params() -> list[SamplingParams]:
    params = [SamplingParams(temperature=0.0, max_tokens=12 + (i % 7) * 4, logprobs=1 if i % 5 == 0 else None) for i in range(50)]
    params[3] = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=StructuredOutputsParams(regex="[a-z_]{4,20}\\("))
    params[31] = SamplingParams(temperature=0.0, max_tokens=30, structured_outputs=StructuredOutputsParams(
        json={"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}))
    return params


def _run(**kw):
    llm = LLM(backend="cpu", max_num_seqs=6, max_model_len=320, max_prefill_chunk=48, kv_cache_memory=_budget("speculative_method" not in kw), **kw)
    outs = llm.generate(_prompts(), _params())
    assert all(o.error is None for o in outs), [o.error for o in outs if o.error]
    return outs, llm.get_metrics()


@pytest.fixture(scope="module")
def plain():
    return _run(speculative_method=None)


@pytest.mark.parametrize("policy,overlap", [("all", False), ("threshold", False), ("adaptive", True)])
def test_greedy_outputs_with_speculation_equal_plain_decoding(plain, policy, overlap):
    want, plain_metrics = plain
    got, m = _run(speculative_policy=policy, overlap_scheduling=overlap)
    for g, w in zip(got, want):
        assert g.outputs[0].token_ids == w.outputs[0].token_ids and g.outputs[0].text == w.outputs[0].text
        if w.outputs[0].logprobs is not None:
            for a, b in zip(g.outputs[0].logprobs, w.outputs[0].logprobs):
                assert a.keys() == b.keys() and all(abs(a[t].logprob - b[t].logprob) < 1e-4 for t in a)
    # the run really speculated, hit the prefix cache and preempted; with overlap, records chained
    assert m["spec_verifications"] > 50 and m["spec_mean_accepted_length"] > 1.5, m
    assert (m["spec_chained_records"] > 100) == overlap, m
    assert m["cached_tokens"] > 0 and m["preemptions"] > 0 and plain_metrics["spec_verifications"] == 0
    assert m["steps"] < plain_metrics["steps"]
    assert len(m["spec_acceptance_per_position"]) == 5 and 0 < m["spec_draft_share"] < 1
    if policy == "all":
        assert m["spec_verified_tokens_per_step"] > 4.0


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlap"])
def test_structured_requests_verify_drafts_their_grammar_allows(overlap):
    # synchronous: drafts the grammar refuses are not verified; overlap: a chained record's drafts are
    # checked once known, and a refused one is masked out at its own row, so verification rejects it
    params = SamplingParams(temperature=0.0, max_tokens=40, structured_outputs=StructuredOutputsParams(regex="[a-z ]{10,40}"))
    prompts = ["Return the number of", "class Stack:"]
    want = LLM(backend="cpu", speculative_method=None).generate(prompts, params)
    llm = LLM(backend="cpu", speculative_policy="all", overlap_scheduling=overlap)
    got = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert all(c.isalpha() or c == " " for o in got for c in o.outputs[0].text)
    assert llm.get_metrics()["spec_verifications"] > 0


def test_rejection_sampling_emits_the_target_distribution_whatever_the_draft():
    # one position: p and a very different q; the emitted token must follow p
    k = Kernels()
    g = torch.Generator().manual_seed(0)
    n, v = 40000, 6
    p = torch.tensor([0.4, 0.25, 0.15, 0.1, 0.07, 0.03])
    q = torch.tensor([0.05, 0.05, 0.1, 0.2, 0.3, 0.3])
    drafts = torch.multinomial(q, n, replacement=True, generator=g)[:, None]
    target = p.expand(n, 2, v).clone()
    accepted, tokens = k.rejection_sample(
        target, q.expand(n, 1, v).clone(), drafts, torch.ones(n, dtype=torch.int64),
        torch.rand(n, 1, generator=g), torch.empty(n, 2, v).exponential_(generator=g),
    )
    first = torch.bincount(tokens[:, 0], minlength=v).double()
    chi2 = float(((first - n * p) ** 2 / (n * p)).sum())
    assert chi2 < 20.5, (chi2, first / n)  # 5 degrees of freedom: p > 0.001
    # the acceptance rate is sum(min(p, q)) = 0.05 + 0.05 + 0.1 + 0.1 + 0.07 + 0.03
    assert abs(float(accepted.double().mean()) - 0.40) < 0.01
    # a bonus token follows an accepted draft, drawn from p at the next position
    bonus = torch.bincount(tokens[accepted == 1, 1], minlength=v).double()
    m = float(bonus.sum())
    assert float(((bonus - m * p) ** 2 / (m * p)).sum()) < 20.5


@functools.cache
def _first_two(speculative: bool, overlap: bool = False, partial: bool = False) -> list[tuple[int, int]]:
    kw = dict(speculative_policy="adaptive" if partial else "all") if speculative else dict(speculative_method=None)
    llm = LLM(backend="cpu", max_num_seqs=256, max_model_len=64, overlap_scheduling=overlap, **kw)
    if partial:  # some sequences draft, the rest decode plainly: both kinds of second token mix
        llm.engine.speculation.costs = LiveCosts(StepCostProfile.monotone([1, 600, 2048], [1.0, 1.0, 4.0]), PARTIAL_DRAFT, learn=False)
    # three tokens: the second comes from verifying a draft (a step verifies none when only one token remains)
    # a prompt whose continuations spread over many pairs, at a temperature and top-k that keep ~20 of them frequent
    params = [SamplingParams(n=250, temperature=0.5, top_k=40, max_tokens=3, ignore_eos=True, seed=1000 * s) for s in range(8)]
    outs = llm.generate(["def get_"] * 8, params)
    if speculative:
        m = llm.get_metrics()
        assert m["spec_verifications"] >= (300 if partial else 1500) and (m["spec_chained_records"] >= 2000) == overlap, m
        assert (m["spec_drafting_request_share"] < 0.9) == partial, m
    return [tuple(c.token_ids[:2]) for o in outs for c in o.outputs]


@pytest.mark.parametrize("overlap,partial", [(False, False), (True, False), (False, True)], ids=["synchronous", "overlap", "partial"])
def test_speculative_sampling_keeps_the_distribution_of_the_first_two_tokens(overlap, partial):
    # with overlap the second token comes from a chained record: it verifies the drafts of the step still
    # in flight when it was scheduled, its position resolved by the runner; partial: only some sequences
    # draft (the policy pauses the rest), so verified and plainly decoded second tokens mix
    plain, spec = _first_two(False), _first_two(True, overlap, partial)
    assert len(plain) == len(spec) == 2000
    pooled: dict[tuple[int, int], int] = {}
    for pair in plain + spec:
        pooled[pair] = pooled.get(pair, 0) + 1
    bins = [pair for pair, c in sorted(pooled.items(), key=lambda kv: -kv[1]) if c >= 20]
    index = {pair: i for i, pair in enumerate(bins)}

    def counts(pairs):
        c = [0] * (len(bins) + 1)
        for pair in pairs:
            c[index.get(pair, len(bins))] += 1
        return c

    a, b = counts(plain), counts(spec)
    chi2 = sum((x - y) ** 2 / (x + y) for x, y in zip(a, b) if x + y)  # two samples of equal size
    dof = len(bins)
    # significance 0.001: the Wilson–Hilferty approximation of the chi-square quantile
    z = 3.09
    critical = dof * (1 - 2 / (9 * dof) + z * math.sqrt(2 / (9 * dof))) ** 3
    assert dof >= 8 and chi2 < critical, (chi2, critical, dof)


def test_adaptive_admission_verifies_fewer_drafts_as_the_batch_grows():
    # a device whose step cost is flat up to 64 tokens (memory-bound), then grows in proportion (compute-bound)
    profile = StepCostProfile.monotone([1, 16, 64, 128, 256, 512], [1.0, 1.0, 1.0, 2.0, 4.0, 8.0])
    survival = [0.9, 0.75, 0.6, 0.45, 0.3]
    per_request = []
    for batch in (1, 4, 8, 16, 32, 64, 128):
        rows = [survival] * batch
        adaptive = admit(rows, "adaptive", profile=profile)
        everything = admit(rows, "all")
        assert all(a <= e for a, e in zip(adaptive, everything)) and everything == [5] * batch
        per_request.append(sum(adaptive) / batch)
    # idle: every draft; the free tokens shared out as the batch grows; compute-bound: none
    assert per_request == [5, 5, 5, 3, 1, 0, 0], per_request
    # threshold keeps the positions whose survival reaches it
    assert admit([survival], "threshold", threshold=0.5) == [3]
    # the monotone profile never falls, and one slow measurement is averaged with the ones after it that fall
    noisy = StepCostProfile.monotone([4, 1, 2, 8], [2.0, 1.0, 3.0, 2.5])
    assert noisy.seconds == (1.0, 2.5, 2.5, 2.5) and noisy.cost(100) >= noisy.cost(8)
    spike = StepCostProfile.monotone([1, 8, 32, 64, 128], [1.0, 1.2, 3.0, 1.6, 2.0])
    assert spike.seconds == pytest.approx((1.0, 1.2, 2.2, 2.2, 2.2))


def test_speculation_is_on_by_default_with_a_draft_and_refused_without_one(tmp_path):
    assert LLM(backend="cpu").engine.runner.proposer is not None
    assert LLM(backend="cpu", speculative_method=None).engine.runner.proposer is None
    ckpt = make_tiny_checkpoint(tmp_path, "mixed")
    assert LLM(model=str(ckpt), backend="cpu", max_model_len=128, kv_cache_memory=16 << 20).engine.runner.proposer is None
    with pytest.raises(ConfigError, match="needs a checkpoint with DSpark draft stages.*--speculative none"):
        LLM(model=str(ckpt), backend="cpu", max_model_len=128, kv_cache_memory=16 << 20, speculative_method="dspark")


#: a fixed cost model under which drafting pays while at most three sequences decode: a step costs the same
#: up to eight tokens and one more per token past them; a draft pass costs a whole step
PAUSING_STEP = StepCostProfile.monotone([1, 8, 64], [1.0, 1.0, 57.0])
PAUSING_DRAFT = StepCostProfile.monotone([1, 64], [1.0, 1.0])
#: one under which a full batch of six drafts for a few of its sequences, a shrinking one for all
PARTIAL_STEP = StepCostProfile.monotone([1, 10, 64], [1.0, 1.0, 55.0])
PARTIAL_DRAFT = StepCostProfile.monotone([1, 64], [0.3, 0.3])


def test_a_request_that_pauses_drafting_under_load_resumes_with_the_same_tokens():
    llm = LLM(backend="cpu", max_num_seqs=16)
    engine = llm.engine
    engine.speculation.costs = LiveCosts(PAUSING_STEP, PAUSING_DRAFT, learn=False)
    greedy = SamplingParams(temperature=0.0, max_tokens=150, ignore_eos=True)
    short = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    burst = [stem + "name(" for stem in STEMS[:8]]
    trace: list[tuple[int, bool]] = []  # (sequences decoding, whether the long request drafts next) per step

    def run(until) -> None:
        while engine.has_unfinished and not until():
            engine.step()
            trace.append((len(engine.scheduler.running), long.spec.proposing))

    long = engine.add_request(SYSTEM + "def size(", greedy)
    run(lambda: len(trace) == 8)
    alone = len(trace)
    shorts = [engine.add_request(p, short) for p in burst]
    run(lambda: all(r.finished for r in shorts))
    loaded = len(trace)
    assert not long.finished
    run(lambda: False)
    want = LLM(backend="cpu", speculative_method=None).generate([SYSTEM + "def size(", *burst], [greedy] + [short] * 8)
    got = [engine.output(r) for r in [long, *shorts]]
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    # it drafted alone, stopped while nine sequences decoded, and drafted again once alone
    assert all(p for _, p in trace[2:alone]), trace[:alone]
    assert any(n >= 4 and not p for n, p in trace[alone:loaded]), trace[alone:loaded]
    assert any(n == 1 and p for n, p in trace[loaded:]), trace[loaded:]
    m = llm.get_metrics()
    assert 0 < m["spec_drafting_step_share"] < 1 and 0 < m["spec_drafting_request_share"] < 1


@pytest.mark.parametrize("overlap", [False, True], ids=["synchronous", "overlap"])
def test_greedy_outputs_equal_plain_decoding_across_drafting_pauses(plain, overlap):
    # six slots and fifty requests: a full batch drafts for some sequences, so requests pause drafting and resume
    want, _ = plain
    llm = LLM(backend="cpu", max_num_seqs=6, max_model_len=320, max_prefill_chunk=48, kv_cache_memory=_budget(True),
              overlap_scheduling=overlap)
    llm.engine.speculation.costs = LiveCosts(PARTIAL_STEP, PARTIAL_DRAFT, learn=False)
    got = llm.generate(_prompts(), _params())
    assert all(o.error is None for o in got)
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]
    m = llm.get_metrics()
    assert m["spec_verifications"] > 20 and 0.05 < m["spec_drafting_request_share"] < 0.95, m


def test_engines_of_one_configuration_share_their_start_up_profiles():
    # the start-up profiles are the policy's prior: measured once per configuration in a process
    a, b, c = (LLM(backend="cpu", max_num_seqs=n).engine.speculation.costs for n in (2, 2, 3))
    assert a.prior is b.prior and a.draft_prior is b.draft_prior
    assert c.prior is not a.prior and c.prior.tokens[-1] == 3 * 6 and c.draft_prior.tokens[-1] == 3
