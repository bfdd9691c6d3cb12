"""``deepinfer conformance --bisect``: the swapped kernel set, the search, and the op it names for each mutant.

Every mutant of ``tests/conformance/mutants.py`` that end to end catches (and of
``tests/conformance/mutants_ops.py`` when that module exists and its mutants fail e2e) is
installed as a real plugin and bisected by ``deepinfer conformance --bisect``
(the commands in two processes side by side, sharing the reference's e2e
decodes); the culprits it prints must be the ops the mutant breaks.
"""

import re
from pathlib import Path

import pytest
import torch

from deepinfer_conformance.bisect import bisect_ops, with_reference
from deepinfer_conformance.results import CaseResult
from deepinfer_interfaces import Kernels
from tests.conformance import mutants, mutants_ops
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.plugins import make_plugin_dist, run_cli, run_cli_batch
from tests.conformance.test_mutants import EXPECTED


class _Marked(mutants.NoEpsKernels):
    def __init__(self, tag: str) -> None:
        self.tag = tag


def test_with_reference_swaps_only_the_chosen_ops_and_leaves_the_class_alone():
    own = _Marked("kept")
    swapped = with_reference(own, ["rms_norm"])
    assert type(swapped).rms_norm is Kernels.rms_norm and isinstance(swapped, _Marked)
    assert _Marked.rms_norm is mutants.NoEpsKernels.rms_norm  # the user's class is untouched
    assert swapped.tag == "kept" and swapped is not own
    x = torch.full((1, 4), 1e-4)
    assert torch.equal(swapped.rms_norm(x, None, 1.0), Kernels().rms_norm(x, None, 1.0))
    assert not torch.equal(own.rms_norm(x, None, 1.0), Kernels().rms_norm(x, None, 1.0))
    with pytest.raises(ValueError, match="not an op"):
        with_reference(own, ["no_such_op"])


def _checker(needed: set[str], together: bool):
    """A fake e2e: fails unless every op of ``needed`` is swapped (``together``) or any one is."""
    calls = []

    def check(swapped):
        calls.append(tuple(swapped))
        fixed = needed <= set(swapped) if together else bool(needed & set(swapped))
        return [CaseResult("e2e", "greedy", "prose", "float32", "pass" if fixed else "fail", max_abs_err=0.0, atol=1.0)]

    return check, calls


def test_a_single_swap_names_the_culprit():
    check, calls = _checker({"rope"}, together=False)
    found = bisect_ops(check, ["rms_norm", "rope", "sample"])
    assert found.culprits == ["rope"] and not found.together
    assert calls == [(), ("rms_norm",), ("rope",), ("sample",)]


def test_ops_that_only_fail_together_are_found_by_halving():
    check, _ = _checker({"moe_route", "swiglu"}, together=True)
    ops = ["hash_route", "moe_experts", "moe_route", "rms_norm", "rope", "swiglu"]
    found = bisect_ops(check, ops)
    assert found.together and sorted(found.culprits) == ["moe_route", "swiglu"]


def test_a_passing_set_has_nothing_to_bisect():
    check, calls = _checker(set(), together=True)
    found = bisect_ops(check, ["rope"])
    assert found.baseline.passes and found.culprits == [] and calls == [()]


def _extra_mutants() -> dict[str, tuple[str, set[str]]]:
    """``tests/conformance/mutants_ops.py``'s kernel sets: name -> (class, ops it overrides)."""
    return {name: (cls, set(getattr(mutants_ops, cls).overrides())) for name, cls in mutants_ops.MUTANTS.items()}


EXTRA = _extra_mutants()


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("plugins")
    modules = {"deepinfer_test_mutants": Path(mutants.__file__).read_text()}
    eps = {name: f"deepinfer_test_mutants:{cls}" for name, cls in mutants.MUTANTS.items()}
    modules["deepinfer_test_mutants_ops"] = Path(mutants_ops.__file__).read_text()
    eps.update({name: f"deepinfer_test_mutants_ops:{cls}" for name, (cls, _) in EXTRA.items()})
    make_plugin_dist(root, "deepinfer-test-bisect", {"deepinfer.kernels": eps}, modules)
    return root, make_tiny_checkpoint(tmp_path_factory.mktemp("ckpt"), "mixed")


#: mutants e2e catches on the ``mixed`` checkpoint -> the ops they break
CAUGHT = {name: ops for name, (ops, checkpoint, _) in EXPECTED.items() if checkpoint == "mixed"}


@pytest.fixture(scope="module")
def bisected(installed):
    root, checkpoint = installed
    names = [*CAUGHT, *EXTRA]
    commands = [["conformance", "--backend", "cpu", "--kernels", name, "--bisect", "--model", str(checkpoint)] for name in names]
    return dict(zip(names, run_cli_batch(commands, extra_path=root, env={"OMP_NUM_THREADS": "1"})))


def _culprits(stdout: str) -> set[str]:
    return set(re.findall(r"^culprit: (\w+)", stdout, flags=re.MULTILINE))


@pytest.mark.parametrize("name", sorted(CAUGHT))
def test_bisect_names_the_mutated_op(name, bisected):
    proc = bisected[name]
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert "Traceback" not in proc.stderr
    culprits = _culprits(proc.stdout)
    assert culprits and culprits <= CAUGHT[name], proc.stdout
    if len(CAUGHT[name]) == 1:
        assert culprits == CAUGHT[name]
    assert re.search(r"e2e cases failing.* -> 0 of \d+ e2e cases failing", proc.stdout), proc.stdout


#: the op-suite mutants (``tests/conformance/mutants_ops.py``) the e2e cases catch too -> the ops bisection may name; the
#: others are op-level mistakes the bundled checkpoint's e2e run does not reach (the op specs catch them)
OP_SUITE_CAUGHT_E2E = {"mutant-squeezed-route": {"moe_route"}}


@pytest.mark.parametrize("name", sorted(EXTRA))
def test_bisect_on_the_op_suite_mutants(name, bisected):
    proc = bisected[name]
    if name in OP_SUITE_CAUGHT_E2E:
        assert proc.returncode == 1 and _culprits(proc.stdout) == OP_SUITE_CAUGHT_E2E[name], proc.stdout
    else:
        assert proc.returncode == 0 and "nothing to bisect" in proc.stdout, proc.stdout


def test_bisect_of_a_correct_set_exits_0(installed):
    root, checkpoint = installed
    proc = run_cli(["conformance", "--backend", "cpu", "--kernels", "reference", "--bisect", "--model", str(checkpoint),
                    "--e2e-cases", "single,sample"], env={"OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "e2e passes" in proc.stdout and "nothing to bisect" in proc.stdout


def test_an_unknown_e2e_case_is_one_line():
    proc = run_cli(["conformance", "--backend", "cpu", "--bisect", "--e2e-cases", "greedy,nonsense"])
    assert proc.returncode == 2 and "unknown e2e case 'nonsense'" in proc.stderr and "Traceback" not in proc.stderr
