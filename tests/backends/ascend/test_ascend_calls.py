"""The Ascend backend's torch_npu calls, checked against the torch-npu wheel built for the pinned torch.

Nothing here imports torch_npu: the wheel is downloaded once into a cache
(``tests/helpers/torch_npu_wheel.py``) and read as a zip. The op schemas are the
literals torch_npu registers in ``libtorch_npu.so`` (``tests/helpers/npu_schemas.py``);
the backend's calls are found with ``ast``, aliases and parameters followed
(``tests/helpers/npu_calls.py``). A renamed or removed op or argument fails
``test_backend_calls_fit_the_wheel`` with file:line, op and argument.

The wheel tests skip only when no cached wheel exists and the package index is
unreachable; the extractor's own tests need no wheel.
"""

from __future__ import annotations

import functools
import textwrap
from pathlib import Path

import pytest

from deepinfer_ascend.kernels import AscendKernels
from tests.helpers.npu_calls import NpuCall, SourceFile, check_calls, extract_calls, package_sources
from tests.helpers.npu_schemas import NpuApi, codegen_schemas, load_api, wheel_requires_torch
from tests.helpers.torch_npu_wheel import Wheel, WheelUnavailable, pinned_torch_version, torch_npu_wheel

ROOT = Path(__file__).resolve().parents[3]
BACKEND = ROOT / "backends" / "ascend" / "deepinfer_ascend"


@functools.lru_cache(maxsize=1)
def _fetch() -> Wheel | WheelUnavailable:
    """One fetch per session: a skip is decided once, not once per test."""
    try:
        return torch_npu_wheel()
    except WheelUnavailable as exc:
        return exc


@pytest.fixture(scope="module")
def wheel() -> Wheel:
    got = _fetch()
    if isinstance(got, WheelUnavailable):
        pytest.skip(str(got))
    return got


@pytest.fixture(scope="module")
def api(wheel: Wheel) -> NpuApi:
    return load_api(wheel.path, wheel.version)


@pytest.fixture(scope="module")
def backend_calls() -> list[NpuCall]:
    return extract_calls(package_sources(BACKEND, "deepinfer_ascend", ROOT))


def _calls(source: str) -> list[NpuCall]:
    return extract_calls([SourceFile("synthetic", "synthetic.py", textwrap.dedent(source))])


# ---- the extractor (no wheel needed) ----------------------------------------------------------


def test_extractor_follows_aliases_parameters_and_lambdas():
    calls = _calls(
        """
        import importlib
        import torch
        import torch_npu as tnpu
        from torch_npu import npu_swiglu as sw

        npu = tnpu

        def load():
            return importlib.import_module("torch_npu"), None

        def norm(tn, x):
            return tn.npu_rms_norm(x, x, epsilon=1e-6)[0]

        def run(fused):
            module, _ = load()
            return fused(module)

        class K:
            def __init__(self, tn=None):
                self.tn = tn

            def go(self, x):
                opts = dict(group_list=x, split_item=2)
                self.tn.npu_grouped_matmul([x], [x], **opts)
                return run(lambda tn: norm(tn, x))

        K(npu).go(1)
        sw(1, dim=-1)
        torch.ops.npu.npu_rotary_mul.default(1, 2, 3)
        getattr(npu, "npu", None).get_soc_version()
        """
    )
    got = {(c.line, c.target, c.positional, c.keywords) for c in calls if c.kind == "call"}
    assert got == {
        (13, "npu_rms_norm", 2, ("epsilon",)),
        (25, "npu_grouped_matmul", 2, ("group_list", "split_item")),
        (29, "npu_swiglu", 1, ("dim",)),
        (30, "npu_rotary_mul.default", 3, ()),
        (31, "npu.get_soc_version", 0, ()),
    }


def test_an_npu_call_on_an_untraceable_receiver_is_reported_not_skipped():
    calls = _calls(
        """
        def f(registry, x):
            return registry["torch_npu"].npu_swiglu(x)
        """
    )
    assert [(c.line, c.kind, c.target) for c in calls] == [(3, "unresolved", "npu_swiglu")]


def test_the_backend_calls_found_cover_every_fused_op_the_kernel_set_names(backend_calls):
    """If aliasing hid the module from the extractor, the check would pass empty: it must see these."""
    called = {c.target for c in backend_calls if c.kind == "call"}
    declared = {how.split(":", 1)[1] for how in AscendKernels.paths().values() if how.startswith("torch_npu:")}
    assert declared <= called, sorted(declared - called)
    assert {"npu_swiglu", "npu_dynamic_mx_quant", "npu_dynamic_block_quant", "npu_moe_distribute_dispatch",
            "npu_moe_distribute_combine", "npu.get_soc_version", "npu.get_device_name"} <= called
    assert not [c for c in backend_calls if c.kind == "unresolved"]


# ---- against the wheel -------------------------------------------------------------------


def test_the_wheel_is_the_torch_npu_built_for_the_pinned_torch(wheel):
    pin = pinned_torch_version()
    assert wheel.version == pin
    assert wheel_requires_torch(wheel.path) in (f"torch=={pin}.*", f"torch=={pin}")


def test_the_schema_scan_agrees_with_torch_npus_codegen_yaml(api, wheel, backend_calls):
    """The binary scan and the yaml the literals were generated from name the same schemas for every op called."""
    yaml = codegen_schemas(wheel.path)
    registered = {sig.target: sig.text for sigs in api.ops.values() for sig in sigs}
    assert len(api.ops) > 300 and not [t for t in api.unparsed if t.startswith("npu_")]
    for op in sorted({c.target for c in backend_calls if c.kind == "call" and "." not in c.target}):
        assert op in yaml and yaml[op] == registered[op], op


def test_the_checker_reports_wrong_keywords_missing_ops_and_missing_arguments(api):
    calls = _calls(
        """
        import torch_npu

        def f(x):
            torch_npu.npu_rms_norm(x, x, eps=1e-6)
            torch_npu.npu_no_such_op(x)
            torch_npu.npu_clipped_swiglu()
            torch_npu.npu_swiglu(x, -1, 0)
            torch_npu.npu.get_soc_version(0)
            torch_npu.npu.no_such_api()
            torch_npu.npu_rms_norm(x, x, epsilon=1e-6)
        """
    )
    problems = [str(p) for p in check_calls(calls, api)]
    version = api.version
    assert [p.split(" (schema: ")[0] for p in problems] == [
        "synthetic.py:5: torch_npu.npu_rms_norm: unknown keyword argument 'eps'",
        f"synthetic.py:6: torch_npu.npu_no_such_op: no op 'npu_no_such_op' is registered in torch_npu {version}",
        "synthetic.py:7: torch_npu.npu_clipped_swiglu: missing required argument 'x'",
        "synthetic.py:8: torch_npu.npu_swiglu: takes at most 2 positional arguments, 3 given",
        "synthetic.py:9: torch_npu.npu.get_soc_version: takes at most 0 positional arguments, 1 given",
        f"synthetic.py:10: torch_npu.npu.no_such_api: torch_npu {version} has no torch_npu.npu.no_such_api",
    ]
    # each arity problem cites the declaration it was checked against
    assert problems[0].endswith("(schema: npu_rms_norm(Tensor input, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor))")
    assert "(schema: def get_soc_version()  # torch_npu/npu/_backends.py:" in problems[4]


def test_backend_calls_fit_the_wheel(api, backend_calls):
    problems = check_calls(backend_calls, api)
    assert not problems, "torch_npu calls that do not fit torch_npu " + api.version + ":\n" + "\n".join(map(str, problems))
