"""The op specs' rule, one-token, real-shape and accumulation cases catch the bugs made for them
(``tests/conformance/mutants_ops.py``), and a correct alternative implementation passes them.

Each mutant runs op parity in-process on the CPU device over every spec whose op any kernel set
here overrides, so "fails exactly the ops it mutates" is checked against its neighbours too.
"""

from __future__ import annotations

import pytest
import torch

from deepinfer_conformance.compare import RMS_MIN_ELEMENTS, compare, rms_rel_err
from deepinfer_conformance.ops import run_spec
from deepinfer_cpu.device import CPUDevice
from deepinfer_interfaces import Kernels
from deepinfer_interfaces.specs import SPECS, Case, OpSpec, Tolerance, register
from tests.conformance import mutants_ops

#: mutant -> {op: cases that must fail (each in at least one dtype)}; its other ops must pass
EXPECTED: dict[str, dict[str, set[str]]] = {
    "mutant-topk-tie-high-column": {"topk_select": {"equal_scores_in_column_order", "ties_across_the_cut_and_with_inf", "one_token_n4096_pick512_ties"}},
    "mutant-route-tie-high-expert": {"moe_route": {"equal_scores_in_expert_order", "equal_scores_equal_bias", "one_token_e256_k6_ties"}},
    "mutant-decode-ignores-padding": {"sparse_attention": {"one_token_one_head", "one_token_early_h8_d512_window_padded"}},
    "mutant-squeezed-route": {"moe_route": {"one_token_e256_k6", "one_token_e256_k6_ties"}},
    "mutant-head-dim-tile": {"sparse_attention": {"one_token_decode_h64_d512_window128", "t1_h64_d512_window128_topk512"}},
    "mutant-window-tile": {"compress_kv": {"hca_one_row_m128_c512", "hca_e2_m128_c512_partial"}},
    "mutant-bf16-accum-attention": {"sparse_attention": {"t1_h16_d512_long_list_2176", "t1_h64_d512_window128_topk512",
                                                         "accumulation_t2_h4_d64_2048_rows_rise_then_fall"}},
    "mutant-bf16-pooling-compressor": {"compress_kv": {"accumulation_hca_e2_m128_c512_rise_then_fall"}},
    "mutant-bf16-sum-of-squares": {"rms_norm": {"accumulation_t4_hidden_4096_outlier_channel_first"}},
    "mutant-bf16-accum-experts": {"moe_experts": {"one_token_d4096_i2048_k6_real_width", "accumulation_t2_d4096_i16_k2_rise_then_fall"}},
    "mutant-entry-topk-tie-high": {"indexer_topk": {"integer_inputs_equal_scores_in_entry_order"}},
    "mutant-entry-topk-first-tiles": {"indexer_topk": {"t2_long_context_32768_entries"}},
    "mutant-entry-attention-first-tiles": {"entry_attention": {"t2_long_context_8192_entries"}},
}
#: the bf16-accumulation mutants fail only by the statistic on these cases: per element they pass
STAT_ONLY = {("mutant-bf16-accum-attention", "t1_h16_d512_long_list_2176"), ("mutant-bf16-accum-experts", "one_token_d4096_i2048_k6_real_width")}

OPS = sorted({op for cases in EXPECTED.values() for op in cases} | set(mutants_ops.AlternativeKernels.overrides()))
KERNELS = {name: getattr(mutants_ops, cls) for name, cls in {**mutants_ops.MUTANTS, **mutants_ops.CORRECT}.items()}


@pytest.fixture(scope="module")
def results() -> dict[str, dict[str, list]]:
    """kernel set -> op -> results; the specs' cases are built once and shared by every kernel set."""
    device, reference = CPUDevice(), Kernels()
    specs = {op: SPECS[op] for op in OPS}
    built = {op: spec.cases() for op, spec in specs.items()}
    frozen = {op: OpSpec(**{**vars(spec), "cases": (lambda cs=built[op]: cs)}) for op, spec in specs.items()}
    return {name: {op: run_spec(frozen[op], cls(), device, reference) for op in OPS} for name, cls in KERNELS.items()}


def test_every_mutant_has_an_expectation():
    assert set(EXPECTED) == set(mutants_ops.MUTANTS)
    assert all(set(cases) <= set(SPECS) for cases in EXPECTED.values())


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_mutant_fails_exactly_its_ops_on_the_new_cases(results, name):
    failing = {op: {r.case for r in rows if r.status in ("fail", "error")} for op, rows in results[name].items()}
    assert {op for op, cases in failing.items() if cases} == set(EXPECTED[name]), failing
    for op, cases in EXPECTED[name].items():
        assert cases <= failing[op], f"{name} passes {sorted(cases - failing[op])} of {op}"


@pytest.mark.parametrize("name", sorted(mutants_ops.CORRECT))
def test_correct_alternative_passes_every_case(results, name):
    bad = [(op, r.case, r.dtype, r.status, r.message) for op, rows in results[name].items() for r in rows if r.status != "pass"]
    assert not bad


@pytest.mark.parametrize(("name", "case"), sorted(STAT_ONLY))
def test_bf16_accumulation_fails_by_the_statistic_alone(results, name, case):
    (op,) = EXPECTED[name]
    row = next(r for r in results[name][op] if r.case == case and r.dtype == "bfloat16")
    assert row.status == "fail" and row.frac_out_of_tol == 0.0, row
    assert row.rms_rel_err > row.rms_limit == SPECS[op].rms_limit(torch.bfloat16)
    assert "relative RMS error" in row.message
    good = next(r for r in results[mutants_ops.AlternativeKernels.name][op] if r.case == case and r.dtype == "bfloat16")
    assert good.rms_rel_err < row.rms_limit / 1.5, "the correct kernel should sit well below the limit"


def test_rms_statistic_measures_relative_error():
    e = torch.tensor([3.0, -4.0, float("-inf")]).repeat(RMS_MIN_ELEMENTS)
    assert rms_rel_err(e, e, 1e-5) == 0.0
    assert rms_rel_err(torch.tensor([3.3, -4.4, float("-inf")]).repeat(RMS_MIN_ELEMENTS), e, 1e-5) == pytest.approx(0.1)
    loose = Tolerance(atol=1.0, rtol=1.0)
    assert compare(e * 1.1, e, loose).status == "pass"
    assert compare(e[:3] * 1.1, e[:3], loose, rms_limit=0.05).status == "pass"  # too few elements to judge
    failed = compare(torch.tensor([3.3, -4.4, float("-inf")]).repeat(RMS_MIN_ELEMENTS), e, loose, rms_limit=0.05)
    assert failed.status == "fail" and failed.rms_rel_err == pytest.approx(0.1) and "above the limit 0.05" in failed.message


def test_limits_without_a_reason_are_refused():
    spec = OpSpec(op="not_an_op_either", cases=lambda: [Case("c", {})], cast=(), rms_limits={torch.bfloat16: 1e-3})
    with pytest.raises(ValueError, match="without a reason"):
        register(spec)
    assert "not_an_op_either" not in SPECS


def test_every_op_has_one_token_and_real_shape_cases():
    """A case named for one token, row or sequence and one at a V4-Flash (or V4.1) size, for every op."""
    one = ("one_", "t1_", "single")
    real = ("d512", "d4096", "d5120", "4096", "129280", "e256", "m128", "d128", "v41", "n3000", "i2048", "c1024", "_ties")
    for op, spec in SPECS.items():
        names = [c.name for c in spec.cases()]
        assert any(n.startswith(one) or "one_" in n for n in names), f"{op}: no one-token case in {names}"
        assert any(any(tag in n for tag in real) for n in names), f"{op}: no real-shape case in {names}"


def test_accumulation_sensitive_ops_carry_a_limit():
    ops = {"sparse_attention", "indexer_scores", "moe_experts", "fp8_linear", "moe_experts_quantized", "rms_norm", "compress_kv",
           "mhc_pre", "mhc_mix", "mhc_collapse", "mhc_post", "mhc_head", "engram_inject", "indexer_topk", "indexer_block_topk", "entry_attention",
           "vit_attention", "linear"}
    assert {op for op, s in SPECS.items() if s.rms_limits} == ops
    assert all(SPECS[op].rms_reason for op in ops)


#: 16-bit accumulators and the accumulation case of the rule each breaks
ACCUMULATION_MUTANTS = {
    "mutant-bf16-pooling-compressor": ("compress_kv", "accumulation_hca_e2_m128_c512_rise_then_fall"),
    "mutant-bf16-accum-attention": ("sparse_attention", "accumulation_t2_h4_d64_2048_rows_rise_then_fall"),
    "mutant-bf16-sum-of-squares": ("rms_norm", "accumulation_t4_hidden_4096_outlier_channel_first"),
    "mutant-bf16-accum-experts": ("moe_experts", "accumulation_t2_d4096_i16_k2_rise_then_fall"),
}


@pytest.mark.parametrize("name", sorted(ACCUMULATION_MUTANTS))
def test_16_bit_accumulation_fails_outright_not_as_a_warning(results, name):
    op, case = ACCUMULATION_MUTANTS[name]
    row = next(r for r in results[name][op] if r.case == case and r.dtype == "bfloat16")
    assert row.status == "fail" and "accumulation case, no warning band" in row.message, row
    assert row.frac_out_of_tol > 0.1, row
    good = next(r for r in results[mutants_ops.AlternativeKernels.name][op] if r.case == case and r.dtype == "bfloat16")
    assert good.status == "pass" and good.max_abs_err < row.max_abs_err / 20, good


def test_every_accumulation_rule_has_16_bit_cases():
    for op, spec in SPECS.items():
        cases = [c for c in spec.cases() if c.accumulation]
        assert bool(spec.accumulation) == bool(cases), op
        assert all(c.dtypes and torch.float32 not in c.dtypes for c in cases), op
    assert {op for op, s in SPECS.items() if s.accumulation} >= {"compress_kv", "sparse_attention", "rms_norm", "moe_experts"}
