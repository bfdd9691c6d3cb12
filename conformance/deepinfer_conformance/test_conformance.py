"""The conformance suites as pytest tests, one per case, for vendors whose CI lives in pytest.

Run ``pytest --pyargs deepinfer_conformance --backend NAME [--kernels NAME]
[--interpret] [--model DIR] [--dtype D] [--graphs auto|on|off]`` (options from
``pytest_plugin``).
Each op spec case, communicator case and e2e case (per prompt or sampling
setting) is one test: ``fail`` and
``error`` fail it with the case's message, ``not_supported`` skips it, ``warn``
passes it with a ``ConformanceWarning``. Each suite runs once, on first use,
so ``-k`` selects cheaply.
"""

from __future__ import annotations

import warnings
from typing import Any

import pytest

from deepinfer_interfaces.specs import SPECS

from .comm_cases import comm_cases
from .e2e import case_ids
from .ops import dtype_name
from .results import CaseResult

WORLD_SIZES = (2, 4)


class ConformanceWarning(UserWarning):
    """A case within the quality-warning band: passes, but worth a look."""


OP_CASES = [
    (spec.op, case.name, dtype_name(dtype))
    for spec in sorted(SPECS.values(), key=lambda s: s.op)
    for dtype in spec.dtypes
    for case in spec.cases()
    if case.dtypes is None or dtype in case.dtypes
]
COMM_CASES = [(c.op, f"world{w}_{c.name}", c.dtype) for w in WORLD_SIZES for c in comm_cases(w)]
#: ``(op, case)`` of every e2e result (``e2e.CASES`` per prompt or sampling setting)
E2E_CASES = case_ids()


def _option(config: pytest.Config, name: str, default: Any = None) -> Any:
    return config.getoption(f"deepinfer_{name}", default)


class SuiteResults:
    """Runs each suite (each op spec) on first request and keeps its results."""

    def __init__(self, config: pytest.Config) -> None:
        self.config = config
        self._selected = None
        self._results: dict[tuple[str, str], dict[tuple[str, str, str], CaseResult]] = {}

    def selected(self):
        if self._selected is None:
            from deepinfer.config import load_config
            from deepinfer.errors import DeepInferError
            from deepinfer.registry import select_backend

            c = self.config
            try:
                cfg = load_config({
                    "backend": _option(c, "backend"), "kernels": _option(c, "kernels"),
                    "interpret": _option(c, "interpret") or None,
                })
                self._selected = select_backend(cfg.backend, cfg.kernels, cfg.interpret)
            except DeepInferError as exc:
                pytest.exit(f"deepinfer conformance: {exc}", returncode=pytest.ExitCode.USAGE_ERROR)
        return self._selected

    def _run(self, key: tuple[str, str], compute) -> dict[tuple[str, str, str], CaseResult]:
        if key not in self._results:
            self._results[key] = {(r.op, r.case, r.dtype): r for r in compute()}
        return self._results[key]

    def op(self, op: str) -> dict[tuple[str, str, str], CaseResult]:
        from .ops import run_spec

        s = self.selected()
        return self._run(("ops", op), lambda: run_spec(SPECS[op], s.kernels.for_conformance(), s.device))

    def comm(self) -> dict[tuple[str, str, str], CaseResult]:
        from .comm import run_comm

        s = self.selected()
        return self._run(("comm", ""), lambda: run_comm(
            s.name, s.kernels_name, s.interpret, communicator_cls=s.communicator_cls, world_sizes=WORLD_SIZES,
        ))

    def e2e(self) -> dict[tuple[str, str, str], CaseResult]:
        from deepinfer.errors import DeepInferError

        from .e2e import resolve_dtype, run_e2e

        s = self.selected()

        def compute() -> list[CaseResult]:
            try:
                dtype = resolve_dtype(_option(self.config, "dtype", "auto"), s.device)
                graphs = {"auto": None, "on": True, "off": False}[_option(self.config, "graphs", "auto")]
                return run_e2e(s.kernels, s.device, _option(self.config, "model"), dtype, graphs=graphs)
            except DeepInferError as exc:
                return [CaseResult("e2e", op, case, "", "error", message=str(exc)) for op, case in E2E_CASES]

        return self._run(("e2e", ""), compute)


@pytest.fixture(scope="session")
def conformance(pytestconfig: pytest.Config) -> SuiteResults:
    return SuiteResults(pytestconfig)


def check(result: CaseResult | None, what: str) -> None:
    """Turn one case's status into the test's outcome."""
    if result is None:
        pytest.fail(f"{what}: the suite reported no result for this case", pytrace=False)
    label = f"{result.suite}.{result.op} {result.case} [{result.dtype}]"
    if result.status in ("fail", "error"):
        pytest.fail(f"{result.status.upper()}: {label}: {result.message or 'out of tolerance'}", pytrace=False)
    if result.status == "not_supported":
        pytest.skip(f"not supported: {result.message}")
    if result.status == "not_applicable":
        pytest.skip(f"not applicable: {result.message}")
    if result.status == "warn":
        warnings.warn(ConformanceWarning(f"{label}: {result.message}"), stacklevel=2)


@pytest.mark.parametrize(("op", "case", "dtype"), OP_CASES, ids=[f"{o}-{c}-{d}" for o, c, d in OP_CASES])
def test_op(conformance: SuiteResults, op: str, case: str, dtype: str) -> None:
    check(conformance.op(op).get((op, case, dtype)), f"{op} {case} [{dtype}]")


@pytest.mark.parametrize(("op", "case", "dtype"), COMM_CASES, ids=[f"{o}-{c}-{d}" for o, c, d in COMM_CASES])
def test_comm(conformance: SuiteResults, op: str, case: str, dtype: str) -> None:
    check(conformance.comm().get((op, case, dtype)), f"{op} {case} [{dtype}]")


@pytest.mark.parametrize(("op", "case"), E2E_CASES, ids=[f"{o}-{c}" for o, c in E2E_CASES])
def test_e2e(conformance: SuiteResults, op: str, case: str) -> None:
    results = conformance.e2e()
    found = [r for (o, c, _), r in results.items() if o == op and c == case]
    if not found and op == "greedy-graph" and any(o == "greedy" for o, _, _ in results):
        pytest.skip("graph mode is off for this device (pass --graphs on to check it)")
    if not found and op == "greedy-bf16" and any(o == "greedy" for o, _, _ in results):
        pytest.skip("the run's dtype is already a reduced one; greedy covers it")
    check(found[0] if found else None, f"e2e {op} {case}")
