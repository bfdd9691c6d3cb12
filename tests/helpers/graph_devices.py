"""Test devices with graph capture of their own, installed as real plugins (a dist-info on sys.path).

- ``replay``: "captures" by keeping the callable and re-running it on replay, so
  replay computes exactly what eager does over the static buffers; it says it
  captures by default, as an accelerator does. It checks the engine's graph
  machinery (padding, static buffers, one copy per step, placeholders) exactly.
- ``stale``: a wrong implementation that replays the outputs of its capture run.
- ``nograph``: a device without graph capture.
- ``brokengraph``: a device whose capture fails, as a real one does on an op that syncs.
"""

from __future__ import annotations

from pathlib import Path

from tests.helpers.plugins import make_plugin_dist

SOURCE = """
    import dataclasses

    from deepinfer_cpu.backend import CPUBackend
    from deepinfer_cpu.device import CPUDevice


    class ReplayDevice(CPUDevice):
        def capabilities(self):
            return dataclasses.replace(super().capabilities(), graph_capture=True, graph_by_default=True)

        def capture_graph(self, fn, pool=None):
            fn()
            return fn


    class StaleDevice(ReplayDevice):
        def capture_graph(self, fn, pool=None):
            out = fn()
            return lambda: out


    class BrokenGraphDevice(ReplayDevice):
        def capture_graph(self, fn, pool=None):
            raise RuntimeError("operation not permitted when stream is capturing")


    class NoGraphDevice(CPUDevice):
        def capabilities(self):
            return dataclasses.replace(super().capabilities(), graph_capture=False, graph_by_default=False)


    class ReplayBackend(CPUBackend):
        name = "replay"
        device = "replay-cpu"
        priority = -1


    class StaleBackend(CPUBackend):
        name = "stale"
        device = "stale-cpu"
        priority = -1


    class NoGraphBackend(CPUBackend):
        name = "nograph"
        device = "nograph-cpu"
        priority = -1


    class BrokenGraphBackend(CPUBackend):
        name = "brokengraph"
        device = "brokengraph-cpu"
        priority = -1
"""


def make_graph_devices(root: Path) -> Path:
    """Write the plugin under ``root`` and return the directory to put on ``sys.path``."""
    return make_plugin_dist(
        root,
        "graph-test-devices",
        {
            "deepinfer.backends": {
                "replay": "deepinfer_test_graphs:ReplayBackend",
                "stale": "deepinfer_test_graphs:StaleBackend",
                "nograph": "deepinfer_test_graphs:NoGraphBackend",
                "brokengraph": "deepinfer_test_graphs:BrokenGraphBackend",
            },
            "deepinfer.devices": {
                "replay-cpu": "deepinfer_test_graphs:ReplayDevice",
                "stale-cpu": "deepinfer_test_graphs:StaleDevice",
                "nograph-cpu": "deepinfer_test_graphs:NoGraphDevice",
                "brokengraph-cpu": "deepinfer_test_graphs:BrokenGraphDevice",
            },
        },
        {"deepinfer_test_graphs": SOURCE},
    )
