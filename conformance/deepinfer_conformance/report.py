"""Reports: the JSON file, the JUnit XML file, and the one-screen summary table."""

from __future__ import annotations

import json
import platform
import sys
import xml.etree.ElementTree as ET
from collections import Counter, defaultdict
from importlib import metadata
from typing import Any

from deepinfer_interfaces import INTERFACE_VERSION

from .results import FAILING, STATUSES, CaseResult


def environment() -> dict[str, Any]:
    """Versions that decide what a run computed."""
    env: dict[str, Any] = {"python": sys.version.split()[0], "platform": platform.platform(), "interface_version": INTERFACE_VERSION}
    for pkg in ("deepinfer", "torch", "triton", "torch-npu"):
        try:
            env[pkg] = metadata.version(pkg)
        except metadata.PackageNotFoundError:
            env[pkg] = None
    return env


def summary(results: list[CaseResult]) -> dict[str, int]:
    counts = Counter(r.status for r in results)
    return {s: counts.get(s, 0) for s in STATUSES}


#: per-result fields only op parity measures; absent (null) for the other suites
OP_ONLY_FIELDS = ("rms_rel_err", "rms_limit")


def result_dict(result: CaseResult) -> dict[str, Any]:
    """One result as the report writes it: every field, ``OP_ONLY_FIELDS`` null where not measured."""
    return {**dict.fromkeys(OP_ONLY_FIELDS), **result.as_dict()}


def build_report(
    backend: str, kernels: str, results: list[CaseResult], e2e: dict[str, Any] | None = None,
    kernels_interface_version: str | None = None,
) -> dict[str, Any]:
    """The JSON report (shape: ``report.schema.json``); ``e2e`` records the e2e suite's model, dtype and prompts,
    ``kernels_interface_version`` the contract version the kernel set declares."""
    report: dict[str, Any] = {
        "backend": backend,
        "kernels": kernels,
        "reference": "deepinfer_interfaces.Kernels (CPU, fp64/fp32 oracle)",
        "environment": environment(),
        "summary": summary(results),
        "results": [result_dict(r) for r in results],
    }
    if e2e is not None:
        report["e2e"] = e2e
    if kernels_interface_version is not None:
        report["kernels_interface_version"] = kernels_interface_version
    return report


def write_json(report: dict[str, Any], path: str) -> None:
    with open(path, "w") as f:
        json.dump(report, f, indent=2, default=float)


def write_junit(report: dict[str, Any], path: str) -> None:
    """One testsuite per suite (ops, comm, e2e); fail/error as failures/errors, not_supported and not_applicable
    as skipped."""
    root = ET.Element("testsuites", name=f"deepinfer-conformance-{report['backend']}")
    by_suite: dict[str, list[dict]] = defaultdict(list)
    for r in report["results"]:
        by_suite[r["suite"]].append(r)
    for suite, rows in by_suite.items():
        counts = Counter(r["status"] for r in rows)
        el = ET.SubElement(
            root, "testsuite", name=suite, tests=str(len(rows)), failures=str(counts["fail"]),
            errors=str(counts["error"]), skipped=str(counts["not_supported"] + counts["not_applicable"]),
        )
        for r in rows:
            tc = ET.SubElement(el, "testcase", classname=f"{suite}.{r['op']}", name=f"{r['case']}[{r['dtype']}]")
            if r["status"] == "fail":
                ET.SubElement(tc, "failure", message=r["message"] or "out of tolerance")
            elif r["status"] == "error":
                ET.SubElement(tc, "error", message=r["message"])
            elif r["status"] in ("not_supported", "not_applicable"):
                ET.SubElement(tc, "skipped", message=r["message"])
            elif r["status"] == "warn":
                ET.SubElement(tc, "system-out").text = f"quality warning: {r['message']}"
    ET.ElementTree(root).write(path, encoding="utf-8", xml_declaration=True)


def _fmt(x: float | None) -> str:
    return "-" if x is None else f"{x:.1e}"


def summary_table(report: dict[str, Any]) -> str:
    """One line per (suite, op): counts per status and the worst error; failing cases listed after."""
    rows: dict[tuple[str, str], list[dict]] = defaultdict(list)
    for r in report["results"]:
        rows[(r["suite"], r["op"])].append(r)
    head = f"{'suite':<6} {'op':<28} {'pass':>5} {'warn':>5} {'fail':>5} {'n/s':>5} {'err':>5} {'n/a':>5} {'max_abs':>9}"
    lines = [f"conformance: backend={report['backend']} kernels={report['kernels']}", head, "-" * len(head)]
    for (suite, op_name), rs in rows.items():
        c = Counter(r["status"] for r in rs)
        errs = [r["max_abs_err"] for r in rs if r["max_abs_err"] is not None]
        lines.append(
            f"{suite:<6} {op_name:<28} {c['pass']:>5} {c['warn']:>5} {c['fail']:>5} {c['not_supported']:>5} {c['error']:>5} {c['not_applicable']:>5} {_fmt(max(errs) if errs else None):>9}"
        )
    bad = [r for r in report["results"] if r["status"] in FAILING]
    for r in bad[:20]:
        lines.append(f"  {r['status'].upper()}: {r['suite']}.{r['op']} {r['case']} [{r['dtype']}] {r['message']}")
    if len(bad) > 20:
        lines.append(f"  ... and {len(bad) - 20} more")
    s = report["summary"]
    lines.append("total: " + ", ".join(f"{k} {v}" for k, v in s.items()))
    return "\n".join(lines)


def failed(report: dict[str, Any]) -> bool:
    return any(report["summary"].get(s, 0) for s in FAILING)
