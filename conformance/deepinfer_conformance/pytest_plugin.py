"""The pytest entry: ``pytest --pyargs deepinfer_conformance --backend NAME [--kernels NAME] [--interpret] [--model DIR] [--dtype D]``.

Installed as a ``pytest11`` entry point, so this module loads in every pytest
run of an environment that has deepinfer. It registers its options only when
the command line names the conformance package, so it never claims
``--backend`` (a common option name) in anyone else's test suite, the
project's own included. The tests themselves are ``test_conformance.py``.
"""

from __future__ import annotations

from typing import Any

PACKAGE = "deepinfer_conformance"


def _names_package(args: list[str]) -> bool:
    return any(PACKAGE in str(a) for a in args)


def add_options(parser: Any) -> None:
    """The options of the conformance tests (stored as ``deepinfer_<name>``)."""
    group = parser.getgroup("deepinfer-conformance", "DeepInfer conformance (pytest --pyargs deepinfer_conformance)")
    group.addoption("--backend", dest="deepinfer_backend", default=None,
                    help="backend to check (default: DEEPINFER_BACKEND, the config file, or auto)")
    group.addoption("--kernels", dest="deepinfer_kernels", default=None, help="kernel set to check instead of the backend's own")
    group.addoption("--interpret", dest="deepinfer_interpret", action="store_true", default=False,
                    help="run Triton kernels on CPU tensors through Triton's interpreter")
    group.addoption("--model", dest="deepinfer_model", default=None, help="model for the e2e tests (default: the bundled model)")
    group.addoption("--dtype", dest="deepinfer_dtype", default="auto", choices=["auto", "float32", "bfloat16", "float16"],
                    help="dtype the backend runs the e2e model in")
    group.addoption("--graphs", dest="deepinfer_graphs", default="auto", choices=["auto", "on", "off"],
                    help="also replay the e2e decode steps from captured graphs (auto: where the engine captures by default)")


def pytest_load_initial_conftests(early_config: Any, parser: Any, args: list[str]) -> None:
    """Register the options when the run is about the conformance package."""
    if _names_package(args):
        add_options(parser)
