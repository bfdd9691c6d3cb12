"""``deepinfer conformance``: run the suites on a backend and write the reports, or bisect an e2e failure.

``--suite`` defaults to ``ops,invariance`` (op parity, then each op's
batch-invariance cases: ``invariance.py``); ``--suite all`` is the full
check (``ops,invariance,comm,e2e``); ``--suite e2e`` runs every e2e case
unless ``--e2e-cases`` names some. ``--bisect`` runs e2e only and names the
kernel set's ops whose own implementation makes it fail (``bisect.py``).
"""

from __future__ import annotations

import argparse

from deepinfer.registry import select_backend
from deepinfer_interfaces import Kernels
from deepinfer_interfaces.version import declared_version

from .comm import run_comm
from .e2e import CASES, make_run, resolve_dtype
from .ops import INTERPRET_MAX_ELEMENTS, dtype_name, run_ops
from .report import build_report, failed, summary_table, write_json, write_junit

SUITES = ("ops", "invariance", "comm", "e2e")
#: what ``--suite`` runs when not given, and what ``--suite all`` stands for
DEFAULT_SUITES = "ops,invariance"
ALL_SUITES = ",".join(SUITES)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default=None, help="backend to check (default: the configured or auto-selected one)")
    p.add_argument("--kernels", default=None, help="kernel set to check instead of the backend's own")
    p.add_argument("--interpret", action="store_true", help="run Triton kernels on CPU tensors through Triton's interpreter")
    p.add_argument(
        "--interpret-max-elements", type=int, default=INTERPRET_MAX_ELEMENTS, metavar="N",
        help=f"with --interpret, op cases with more input elements are not run (default {INTERPRET_MAX_ELEMENTS}: the real-shape cases)",
    )
    p.add_argument("--ops", action="append", default=None, metavar="GLOB", help="only ops matching GLOB (repeatable)")
    p.add_argument(
        "--suite", default=DEFAULT_SUITES,
        help=f"comma-separated suites among {', '.join(SUITES)}, or all (= {ALL_SUITES}, the full check); default {DEFAULT_SUITES}",
    )
    p.add_argument(
        "--e2e-cases", default=None, metavar="LIST",
        help=f"comma-separated e2e cases among {', '.join(CASES)} (default: all of them)",
    )
    p.add_argument(
        "--bisect", action="store_true",
        help="run e2e and, when it fails, name the kernel set's ops (those --ops selects) whose own implementation causes it; "
        "exit 1 when e2e fails, 0 when it passes",
    )
    p.add_argument("--model", default=None, metavar="DIR", help="model for the e2e suite (default: the bundled model)")
    p.add_argument(
        "--dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
        help="dtype the backend runs the e2e model in (auto: float32 on the host, bfloat16 on an accelerator)",
    )
    p.add_argument(
        "--graphs", default="auto", choices=["auto", "on", "off"],
        help="e2e: also replay decode steps from graphs the device captures, against eager (auto: where the engine captures by default)",
    )
    p.add_argument("--report", metavar="FILE.json", help="write the JSON report here")
    p.add_argument("--junit", metavar="FILE.xml", help="write a JUnit XML report here")


def _split(text: str) -> list[str]:
    return [s.strip() for s in text.split(",") if s.strip()]


def run(args: argparse.Namespace, backend: str, interpret: bool) -> int:
    """Run the chosen suites (or ``--bisect``); return 0 exactly when nothing failed or errored."""
    from deepinfer.errors import ConfigError

    suites = SUITES if args.suite.strip() == "all" else _split(args.suite)
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        raise ConfigError(f"unknown suite '{unknown[0]}' (choose from {', '.join(SUITES)}, or all)")
    if args.bisect:
        suites = ("e2e",)
    selected = select_backend(backend, args.kernels, interpret)
    e2e_run = None
    if "e2e" in suites:
        # settle the model, dtype and cases before any suite runs, so a bad flag fails at once
        dtype = resolve_dtype(args.dtype, selected.device)
        graphs = None if args.graphs == "auto" else args.graphs == "on"
        cases = _split(args.e2e_cases) if args.e2e_cases else None
        e2e_run = make_run(selected.device, args.model, dtype, graphs=graphs, cases=cases)
    if args.bisect:
        from .bisect import run_bisect

        return run_bisect(e2e_run, selected.kernels, selected.device, selected.kernels_name, args.ops)
    results = []
    if "ops" in suites:
        results += run_ops(selected.kernels, selected.device, args.ops, args.interpret_max_elements if interpret else None)
    if "invariance" in suites:
        from .invariance import run_invariance_suite

        results += run_invariance_suite(selected.kernels, selected.device, args.ops, args.interpret_max_elements if interpret else None)
    if "comm" in suites:
        results += run_comm(selected.name, args.kernels, interpret, communicator_cls=selected.communicator_cls)
    e2e_settings = None
    if e2e_run is not None:
        results += e2e_run.check(selected.kernels, selected.device)
        e2e_settings = {
            "model": str(e2e_run.model_dir), "dtype": dtype_name(e2e_run.dtype), "max_new_tokens": e2e_run.max_new_tokens,
            "prompts": dict(e2e_run.prompts), "graphs": e2e_run.graphs,
        }
    report = build_report(selected.name, selected.kernels_name, results, e2e=e2e_settings,
                          kernels_interface_version=declared_version(type(selected.kernels), Kernels))
    if args.report:
        write_json(report, args.report)
    if args.junit:
        write_junit(report, args.junit)
    print(summary_table(report))
    return 1 if failed(report) else 0
