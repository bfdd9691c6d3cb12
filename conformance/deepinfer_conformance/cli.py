"""``deepinfer conformance``: run the suites on a backend and write the reports."""

from __future__ import annotations

import argparse

from deepinfer.registry import select_backend

from .comm import run_comm
from .e2e import MAX_NEW_TOKENS, PROMPTS, graphs_by_default, resolve_dtype, resolve_model, run_e2e
from .ops import dtype_name, run_ops
from .report import build_report, failed, summary_table, write_json, write_junit

SUITES = ("ops", "comm", "e2e")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", default=None, help="backend to check (default: the configured or auto-selected one)")
    p.add_argument("--kernels", default=None, help="kernel set to check instead of the backend's own")
    p.add_argument("--interpret", action="store_true", help="run Triton kernels on CPU tensors through Triton's interpreter")
    p.add_argument("--ops", action="append", default=None, metavar="GLOB", help="only ops matching GLOB (repeatable)")
    p.add_argument("--suite", default="ops", help=f"comma-separated suites among {', '.join(SUITES)}")
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


def run(args: argparse.Namespace, backend: str, interpret: bool) -> int:
    """Run the chosen suites; return 0 exactly when nothing failed or errored."""
    from deepinfer.errors import ConfigError

    suites = [s.strip() for s in args.suite.split(",") if s.strip()]
    unknown = [s for s in suites if s not in SUITES]
    if unknown:
        raise ConfigError(f"unknown suite '{unknown[0]}' (choose from {', '.join(SUITES)})")
    selected = select_backend(backend, args.kernels, interpret)
    e2e_settings = None
    if "e2e" in suites:
        # settle the model and dtype before any suite runs, so a bad flag fails at once
        model_dir = resolve_model(args.model)
        dtype = resolve_dtype(args.dtype, selected.device)
        graphs = graphs_by_default(selected.device) if args.graphs == "auto" else args.graphs == "on"
        e2e_settings = {
            "model": str(model_dir), "dtype": dtype_name(dtype), "max_new_tokens": MAX_NEW_TOKENS,
            "prompts": dict(PROMPTS), "graphs": graphs,
        }
    results = []
    if "ops" in suites:
        results += run_ops(selected.kernels, selected.device, args.ops)
    if "comm" in suites:
        results += run_comm(selected.name, args.kernels, interpret, communicator_cls=selected.communicator_cls)
    if e2e_settings is not None:
        results += run_e2e(selected.kernels, selected.device, model_dir, dtype, graphs=graphs)
    report = build_report(selected.name, selected.kernels_name, results, e2e=e2e_settings)
    if args.report:
        write_json(report, args.report)
    if args.junit:
        write_junit(report, args.junit)
    print(summary_table(report))
    return 1 if failed(report) else 0
