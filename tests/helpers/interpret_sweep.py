"""A backend's op conformance under Triton's interpreter, in one fresh process: the CLI's route on one op, then
every other op spec case by case, less the cases a test leaves to other checks.

Under the interpreter a case costs roughly its programs times its tile work, so the real-width cases (a
129280-token row, 64 heads of 512 channels, 200 tokens of grouped experts) take most of a full sweep while
crossing no block boundary the small cases and the ``*_beyond_spec*`` checks do not cross already. A test
names each case it leaves out and the check that covers what it exercises; ``DEEPINFER_FULL_INTERPRET_SWEEP=1``
runs every case again (what ``deepinfer conformance --backend NAME --interpret`` runs).
"""

from __future__ import annotations

import json
import os
import textwrap

from tests.helpers.subprocesses import run_python

#: set to 1 to run every case of every op (the left-out ones too): minutes on two cores
FULL_SWEEP_ENV = "DEEPINFER_FULL_INTERPRET_SWEEP"

_SCRIPT = textwrap.dedent(
    """
    import contextlib, dataclasses, io, json, sys
    from deepinfer.cli import main
    from deepinfer.registry import select_backend
    from deepinfer_conformance.ops import INTERPRET_MAX_ELEMENTS, run_spec
    from deepinfer_interfaces import Kernels
    from deepinfer_interfaces.specs import SPECS

    backend, cli_args, ops, left_out = json.loads(sys.argv[1])
    with contextlib.redirect_stdout(io.StringIO()) as table:
        cli_status = main(cli_args)
    selected = select_backend(backend, None, True)
    kernels, reference = selected.kernels.for_conformance(), Kernels()
    rows, names = [], {}
    for op in ops:
        spec = SPECS[op]
        cases = spec.cases()
        names[op] = [c.name for c in cases]
        kept = [c for c in cases if c.name not in left_out.get(op, ())]
        one = dataclasses.replace(spec, cases=lambda kept=kept: kept)
        rows += [r.as_dict() for r in run_spec(one, kernels, selected.device, reference, INTERPRET_MAX_ELEMENTS)]
    print(json.dumps({"cli_status": cli_status, "cli_table": table.getvalue(), "rows": rows, "case_names": names}))
    """
)


def full_sweep() -> bool:
    return os.environ.get(FULL_SWEEP_ENV, "") not in ("", "0")


def sweep(backend: str, cli_args: list[str], ops: list[str], left_out: dict[str, dict[str, str]],
          env: dict | None = None, timeout: float = 600) -> dict:
    """``deepinfer CLI_ARGS`` (its exit status and table), then ``ops``' cases but ``left_out`` (op -> case -> why),
    all under the interpreter in one process: ``{"cli_status", "cli_table", "rows", "case_names"}``."""
    skip = {} if full_sweep() else {op: sorted(cases) for op, cases in left_out.items()}
    proc = run_python(["-c", _SCRIPT, json.dumps([backend, cli_args, ops, skip])], interpret=True, env=env, timeout=timeout)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def interpret_limited(row: dict) -> bool:
    """A case not run because it is above the interpreter's element limit (left to the device)."""
    from deepinfer_conformance.ops import INTERPRET_LIMIT_NOTE

    return row["status"] == "not_supported" and INTERPRET_LIMIT_NOTE in row["message"]


def assert_left_out_cases_exist(result: dict, left_out: dict[str, dict[str, str]]) -> None:
    """Every left-out case is still a case of its op's spec (a renamed case would otherwise run unnoticed)
    and carries a reason."""
    for op, cases in left_out.items():
        assert op in result["case_names"], f"{op}: left-out cases of an op the sweep did not run"
        stale = set(cases) - set(result["case_names"][op])
        assert not stale, f"{op}: no such cases any more: {sorted(stale)}"
        assert all(why.strip() for why in cases.values()), op
