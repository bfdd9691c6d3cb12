"""The ``deepinfer`` command line: ``backends``, ``conformance``, ``generate``.

User errors print one line and exit with status 2, never a traceback.
"""

from __future__ import annotations

import os

# torch_npu's autoload hook breaks ``import torch`` where CANN is missing; the
# Ascend plugin imports torch_npu itself when it is selected.
os.environ.setdefault("TORCH_DEVICE_BACKEND_AUTOLOAD", "0")

import argparse  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402

from .config import load_config  # noqa: E402
from .errors import DeepInferError  # noqa: E402


def _cmd_backends(args: argparse.Namespace) -> int:
    from .registry import list_backends

    statuses = list_backends()
    if args.json:
        print(json.dumps([s.as_dict() for s in statuses], indent=2))
        return 0
    for s in statuses:
        state = "available" if s.available else f"unavailable: {s.reason}"
        parts = ", ".join(f"{k}={v}" for k, v in s.parts.items())
        print(f"{s.name:<10} {state}")
        if parts:
            print(f"{'':<10} parts: {parts}; interface {s.interface_version}; package {s.package}")
            print(f"{'':<10} own kernels: {', '.join(s.overrides) if s.overrides else 'none (reference everywhere)'}")
    return 0


def _cmd_conformance(args: argparse.Namespace) -> int:
    from deepinfer_conformance.cli import run

    cfg = load_config({"backend": args.backend, "kernels": args.kernels, "interpret": args.interpret or None}, args.config)
    return run(args, cfg.backend, cfg.interpret)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="deepinfer", description="Offline DeepSeek-V4 inference on pluggable hardware backends")
    parser.add_argument("--config", default=None, help="YAML or JSON file of EngineConfig fields")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("backends", help="list every discovered backend plugin and whether it can run here")
    p.add_argument("--json", action="store_true", help="print a JSON list instead of a table")
    p.set_defaults(func=_cmd_backends)

    p = sub.add_parser("conformance", help="check a backend against the reference")
    from deepinfer_conformance.cli import add_arguments

    add_arguments(p)
    p.set_defaults(func=_cmd_conformance)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        return args.func(args)
    except DeepInferError as exc:
        print(f"deepinfer: error: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
