"""End-to-end parity: the reference passes every case on a tiny model, a correct reordered-sum set passes with a
wide margin, the clamp case really reaches the clamp, and the verdict rules hold on constructed inputs."""

import pytest
import torch

from deepinfer_conformance import e2e
from deepinfer_conformance.e2e import PROMPTS, compare_prompt, judge, resolve_dtype, run_e2e
from deepinfer_conformance.tolerances import E2ETolerance, e2e_tolerance
from deepinfer_cpu.device import CPUDevice
from deepinfer_interfaces import Kernels
from deepinfer_interfaces.kernels import unpack_bitmask
from tests.conformance import mutants
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.plugins import run_cli

TOL = E2ETolerance(logprob=0.1, kl=1e-3)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "mixed")


def test_reference_kernels_pass_with_identical_distributions(tiny):
    results = run_e2e(Kernels(), CPUDevice(), tiny, max_new_tokens=6, cases=["greedy"])
    assert [r.case for r in results] == [pid for pid, _ in PROMPTS]
    for r in results:
        assert (r.suite, r.op, r.dtype, r.status) == ("e2e", "greedy", "float32", "pass"), r
        assert r.max_abs_err == 0.0 and r.frac_out_of_tol == 0.0
        assert "no greedy divergence in 6 steps" in r.message and "mean KL 0.00e+00" in r.message
        assert "min top-5 overlap 5/5" in r.message


def test_every_case_runs_and_passes_on_the_reference(tiny):
    results = run_e2e(Kernels(), CPUDevice(), tiny, max_new_tokens=6)
    expected = [(op, case) for op, case in e2e.case_ids() if op != "greedy-graph"]  # graphs are off on cpu
    assert [(r.op, r.case) for r in results] == expected
    assert all(r.status == "pass" for r in results), [r for r in results if r.status != "pass"][:2]
    assert {r.dtype for r in results if r.op == "greedy-bf16"} == {"bfloat16"}
    assert all("0 of" in r.message and "draws differ" in r.message for r in results if r.op == "sample")


def test_a_correct_reordered_sum_set_keeps_a_wide_margin(tiny):
    """Worst step KL of a correct set that sums in another order, as a fraction of the fp32 limit."""
    run = e2e.make_run(CPUDevice(), tiny)
    ref = e2e._greedy_reference(run)
    model = e2e._load(run.model_dir, mutants.ReorderedSumsKernels(), torch.float32, torch.device("cpu"))
    got = e2e._forced(model, run.ids, ref, CPUDevice())
    assert not torch.equal(got, ref.logprobs)  # the sums really are in another order
    worst = max(float(compare_prompt(ref.logprobs[i], got[i], ref.tokens[i]).kl.max()) for i in range(len(run.ids)))
    assert worst < 1e-3 * e2e_tolerance(torch.float32).kl  # measured ~1e-6 of the limit


def test_the_clamp_case_reaches_the_clamp(tiny):
    run = e2e.make_run(CPUDevice(), tiny, cases=["clamp"])
    results = run.check(Kernels(), CPUDevice())
    ref = run.reference("clamp", lambda: pytest.fail("the case made no clamp reference"))
    assert 0.02 < ref.reached / ref.seen < 0.3  # about one input in ten, by the chosen quantile
    recount = e2e.ClampProbe()
    e2e._reference_decode(ref.checkpoint, run.ids, run.max_new_tokens, kernels=recount)
    assert recount.reached == ref.reached > 0
    assert all(f"limit {ref.limit:g}) reached at {ref.reached} of" in r.message and r.status == "pass" for r in results)


def test_the_clamp_probe_counts_what_the_clamp_changes():
    probe = e2e.ClampProbe()
    probe.swiglu(torch.tensor([[2.0, 0.5, -3.0]]), torch.tensor([[0.1, -2.0, 1.5]]), 1.0)
    assert (probe.reached, probe.seen) == (3, 6)  # gate 2.0 above; up -2.0 and 1.5 beyond ±1


def test_bitmask_packing_is_xgrammars_layout():
    allowed = torch.zeros(2, 64, dtype=torch.bool)
    allowed[0, [0, 31, 33]] = True
    allowed[1, 63] = True
    words = e2e.pack_bitmask(allowed)
    assert words.dtype == torch.int32 and words[1, 1] == -(2**31)
    assert torch.equal(unpack_bitmask(words, 64), allowed)
    masks = e2e.constraint_masks(4, 3, 100)
    assert all(m.shape == (4, 4) for m in masks)
    single = unpack_bitmask(masks[0], 100)[0]  # (prompt 0, step 0) forces one token
    assert int(single.sum()) == 1


def test_a_misread_bitmask_fails_constrained_and_names_the_token(tiny):
    results = run_e2e(mutants.BitmaskMsbFirstKernels(), CPUDevice(), tiny, max_new_tokens=4, cases=["constrained"])
    assert results and all(r.status == "fail" and r.message.startswith("bitmask: ") for r in results)
    assert "bit " in results[0].message and "of word" in results[0].message


def test_sampling_ties_are_warnings_and_other_differences_fail():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.2], [0.5, 0.3, 0.2]]))
    args = e2e.sample_inputs([e2e.SampleSetting(1.0)], logits, draws=1)
    args["noise"] = torch.tensor([[1.0, 0.6, 5.0], [1.0, 0.3, 5.0]])  # row 0: 0.5/1 vs 0.3/0.6, a tie
    probs = Kernels().sampling_probs(**{k: v for k, v in args.items() if k != "noise"})
    ref = torch.tensor([0, 1])
    tie = e2e.compare_samples(args, ref, torch.tensor([1, 1]), probs, probs)
    assert (tie.mismatched, tie.at_ties) == (1, 1) and e2e.judge_samples(tie)[0] == "warn"
    wrong = e2e.compare_samples(args, ref, torch.tensor([0, 2]), probs, probs)
    assert e2e.judge_samples(wrong)[0] == "fail"
    drift = e2e.compare_samples(args, ref, ref, probs, probs + torch.tensor([0.01, -0.01, 0.0]))
    assert drift.max_tv == pytest.approx(0.01) and e2e.judge_samples(drift)[0] == "fail"


def test_an_unknown_case_is_a_clear_error(tiny):
    from deepinfer.errors import ConfigError

    with pytest.raises(ConfigError, match="unknown e2e case 'beam'"):
        run_e2e(Kernels(), CPUDevice(), tiny, cases=["beam"])


def _logprobs(rows):
    return torch.log_softmax(torch.tensor(rows, dtype=torch.float32), dim=-1)


def test_divergence_at_a_near_tie_is_a_warning():
    ref = _logprobs([[2.0, 1.0, 0.0, -1.0], [1.0, 0.98, 0.0, -1.0], [0.0, 3.0, 0.0, 0.0]])
    got = _logprobs([[2.0, 1.0, 0.0, -1.0], [0.98, 1.0, 0.0, -1.0], [0.0, 3.0, 0.0, 0.0]])
    parity = compare_prompt(ref, got, [0, 0, 1], top_k=2)
    assert parity.divergence == 1 and parity.divergence_gap == pytest.approx(0.02, abs=1e-5)
    status, message = judge(parity, TOL, top_k=2)
    assert status == "warn"
    assert "first greedy divergence at step 1 of 3 (reference logprob gap 0.02, within tolerance 0.1)" in message


def test_divergence_past_the_tolerance_fails_even_with_a_small_kl():
    ref = _logprobs([[1.0, 0.7, 0.0]])
    got = _logprobs([[0.7, 1.0, 0.0]])
    status, message = judge(compare_prompt(ref, got, [0]), E2ETolerance(logprob=0.1, kl=1.0))
    assert status == "fail" and "beyond tolerance 0.1" in message


def test_kl_bands_without_divergence():
    ref = _logprobs([[3.0, 0.0, 0.0, 0.0]] * 4)
    slightly = _logprobs([[3.0, 0.05, 0.0, 0.0]] * 4)
    far = _logprobs([[3.0, 1.5, 0.0, 0.0]] * 4)
    kl_small = float(compare_prompt(ref, slightly, [0] * 4).kl.mean())
    assert judge(compare_prompt(ref, slightly, [0] * 4), E2ETolerance(1e-3, kl_small * 2))[0] == "pass"
    assert judge(compare_prompt(ref, slightly, [0] * 4), E2ETolerance(1e-3, kl_small / 2))[0] == "warn"
    status, message = judge(compare_prompt(ref, far, [0] * 4), E2ETolerance(1e-3, kl_small))
    assert status == "fail" and "no greedy divergence in 4 steps" in message


def test_non_finite_backend_logits_fail():
    ref = _logprobs([[1.0, 0.0]])
    got = torch.tensor([[float("nan"), float("nan")]])
    status, message = judge(compare_prompt(ref, got, [0]), TOL)
    assert status == "fail" and "not finite" in message


def test_top_k_overlap_counts_shared_candidates():
    ref = _logprobs([[5.0, 4.0, 3.0, 0.0, -1.0]])
    got = _logprobs([[5.0, 0.0, 3.0, 4.0, -1.0]])
    assert compare_prompt(ref, got, [0], top_k=3).min_overlap == 2


def test_dtype_choice_follows_the_engine_default_and_checks_support():
    from deepinfer.errors import ConfigError

    assert resolve_dtype(None, CPUDevice()) == torch.float32
    assert resolve_dtype("bfloat16", CPUDevice()) == torch.bfloat16
    with pytest.raises(ConfigError, match="unknown --dtype 'int8'"):
        resolve_dtype("int8", CPUDevice())


def test_cli_names_model_when_the_directory_is_not_a_model(tmp_path):
    proc = run_cli(["conformance", "--backend", "cpu", "--suite", "e2e", "--model", str(tmp_path / "missing")])
    assert proc.returncode == 2
    assert "--model" in proc.stderr and "no config.json" in proc.stderr and "Traceback" not in proc.stderr
