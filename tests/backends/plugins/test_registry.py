"""Plugin discovery, selection and the errors users see, through real entry points."""

import json

import pytest

from deepinfer.errors import PluginError
from deepinfer.registry import list_backends, select_backend
from deepinfer_interfaces.version import INTERFACE_VERSION
from tests.helpers.plugins import make_plugin_dist, run_cli

BROKEN = {"deepinfer_test_broken": "raise ImportError('vendor SDK libfoo.so not found')\n"}
OLD = {
    "deepinfer_test_old": """
        from deepinfer_cpu.backend import CPUBackend
        class OldBackend(CPUBackend):
            name = "old"
            interface_version = "0.9.0"
    """
}
VENDOR = {
    "deepinfer_test_vendor": """
        from deepinfer_interfaces import Backend, INTERFACE_VERSION, Kernels
        class VendorKernels(Kernels):
            name = "vendor"
            interface_version = INTERFACE_VERSION
            def rms_norm(self, x, weight, eps):
                return super().rms_norm(x, weight, eps)
        class VendorBackend(Backend):
            name = "vendor"
            interface_version = INTERFACE_VERSION
            device = "cpu"
            kernels = "vendor"
            priority = 50
            @classmethod
            def is_available(cls):
                return True, None
    """
}
#: a bundle and a kernel set that state no contract version (Backend's and Kernels' own do not count)
UNVERSIONED = {
    "deepinfer_test_unversioned": """
        from deepinfer_interfaces import Backend, Kernels
        class UnversionedKernels(Kernels):
            name = "unversioned"
        class UnversionedBackend(Backend):
            name = "unversioned"
            device = "cpu"
            kernels = "reference"
            @classmethod
            def is_available(cls):
                return True, None
    """
}


@pytest.fixture
def plugin_dir(tmp_path):
    make_plugin_dist(tmp_path, "broken-plugin", {"deepinfer.backends": {"broken": "deepinfer_test_broken:Backend"}}, BROKEN)
    make_plugin_dist(tmp_path, "old-plugin", {"deepinfer.backends": {"old": "deepinfer_test_old:OldBackend"}}, OLD)
    make_plugin_dist(
        tmp_path,
        "vendor-plugin",
        {
            "deepinfer.backends": {"vendor": "deepinfer_test_vendor:VendorBackend"},
            "deepinfer.kernels": {"vendor": "deepinfer_test_vendor:VendorKernels"},
        },
        VENDOR,
    )
    make_plugin_dist(
        tmp_path,
        "unversioned-plugin",
        {
            "deepinfer.backends": {"unversioned": "deepinfer_test_unversioned:UnversionedBackend"},
            "deepinfer.kernels": {"unversioned": "deepinfer_test_unversioned:UnversionedKernels"},
        },
        UNVERSIONED,
    )
    return tmp_path


def test_builtin_backends_listed_with_status():
    by_name = {s.name: s for s in list_backends()}
    assert by_name["cpu"].available and by_name["cpu"].reason is None
    assert not by_name["cuda"].available and "CUDA" in by_name["cuda"].reason
    assert not by_name["ascend"].available and "torch_npu" in by_name["ascend"].reason
    assert by_name["cpu"].parts == {"device": "cpu", "communicator": "torch-distributed", "kernels": "reference"}
    assert by_name["cpu"].package == "deepinfer"


def test_backends_json_lists_plugins_from_installed_distributions(plugin_dir):
    proc = run_cli(["backends", "--json"], extra_path=plugin_dir)
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert set(rows) >= {"cpu", "cuda", "ascend", "broken", "old", "vendor"}
    for row in rows.values():
        assert set(row) == {"name", "available", "reason", "parts", "overrides", "interface_version", "package",
                            "engine_interface_version", "routed_to_reference"}
        assert row["engine_interface_version"] == INTERFACE_VERSION
    assert rows["broken"]["available"] is False
    assert "libfoo.so not found" in rows["broken"]["reason"]
    assert rows["broken"]["package"] == "broken-plugin"
    assert rows["old"]["available"] is False and "0.9.0" in rows["old"]["reason"] and INTERFACE_VERSION in rows["old"]["reason"]
    assert rows["vendor"]["available"] is True
    assert rows["vendor"]["overrides"] == ["rms_norm"]
    assert rows["vendor"]["package"] == "vendor-plugin"
    assert rows["vendor"]["interface_version"] == INTERFACE_VERSION and rows["vendor"]["routed_to_reference"] == []
    assert rows["unversioned"]["available"] is False and rows["unversioned"]["interface_version"] is None
    assert "declares no interface_version: add interface_version" in rows["unversioned"]["reason"]


@pytest.mark.parametrize("args", [["--backend", "unversioned"], ["--backend", "cpu", "--kernels", "unversioned"]])
def test_plugin_without_a_declared_version_is_refused_in_one_line(plugin_dir, args):
    proc = run_cli(["conformance", *args, "--ops", "rms_norm"], extra_path=plugin_dir)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    (line,) = proc.stderr.strip().splitlines()
    assert "refused: declares no interface_version: add interface_version = " in line
    assert "deepinfer_test_unversioned.Unversioned" in line and INTERFACE_VERSION in line


def test_auto_picks_highest_priority_available(plugin_dir):
    proc = run_cli(["conformance", "--ops", "rms_norm"], extra_path=plugin_dir)
    assert proc.returncode == 0, proc.stderr
    assert "backend=vendor kernels=vendor" in proc.stdout


def test_incompatible_interface_version_refused_with_both_versions(plugin_dir):
    proc = run_cli(["conformance", "--backend", "old"], extra_path=plugin_dir)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1
    assert "0.9.0" in lines[0] and INTERFACE_VERSION in lines[0]


def test_broken_plugin_selected_gives_its_error(plugin_dir):
    proc = run_cli(["conformance", "--backend", "broken"], extra_path=plugin_dir)
    assert proc.returncode == 2
    assert proc.stderr.strip().count("\n") == 0
    assert "libfoo.so not found" in proc.stderr


def test_unknown_backend_lists_installed():
    with pytest.raises(PluginError) as exc:
        select_backend("tpu")
    msg = str(exc.value)
    assert "unknown backend 'tpu'" in msg and "cpu" in msg and "cuda (unavailable:" in msg


def test_unknown_backend_cli_one_line_exit_2():
    proc = run_cli(["conformance", "--backend", "tpu"])
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    assert proc.stderr.startswith("deepinfer: error: unknown backend 'tpu'")
    assert len(proc.stderr.strip().splitlines()) == 1


def test_unavailable_backend_gives_reason():
    proc = run_cli(["conformance", "--backend", "ascend"])
    assert proc.returncode == 2
    assert "backend 'ascend' is unavailable: torch_npu is not installed" in proc.stderr


def test_unknown_kernel_set():
    with pytest.raises(PluginError, match="unknown kernel 'nope'.*reference"):
        select_backend("cpu", kernels="nope")


def test_kernel_override_on_backend():
    sel = select_backend("cpu", kernels="reference")
    assert sel.kernels_name == "reference" and sel.device.type == "cpu"


def test_selection_precedence_flag_env_file(tmp_path, plugin_dir):
    cfg = tmp_path / "cfg.yaml"
    cfg.write_text("backend: old\n")
    # file alone: chosen (and refused for its version)
    proc = run_cli(["--config", str(cfg), "conformance", "--ops", "rms_norm"], extra_path=plugin_dir)
    assert proc.returncode == 2 and "'old' refused" in proc.stderr
    # environment beats the file
    proc = run_cli(["--config", str(cfg), "conformance", "--ops", "rms_norm"], extra_path=plugin_dir, env={"DEEPINFER_BACKEND": "cpu"})
    assert proc.returncode == 0 and "backend=cpu" in proc.stdout
    # the flag beats the environment
    proc = run_cli(
        ["--config", str(cfg), "conformance", "--backend", "vendor", "--ops", "rms_norm"],
        extra_path=plugin_dir,
        env={"DEEPINFER_BACKEND": "cpu"},
    )
    assert proc.returncode == 0 and "backend=vendor" in proc.stdout
