"""Fixtures shared by the test modules."""

import os

# Before torch (and its OpenMP runtime) loads here or in any subprocess a test starts: an OpenMP worker that
# waits spins ~300000 rounds by default, so when more threads want the two cores than there are (a test's
# servers, workers and this process; other jobs on the machine) every parallel region can cost a whole time
# slice, and a 2-thread prefill was measured 10x slower next to one other 2-thread torch process. After 30000
# rounds a waiter sleeps instead: no slower on an idle machine, about half the time under that contention.
# An explicit setting in the environment wins.
os.environ.setdefault("GOMP_SPINCOUNT", "30000")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models run fastest on one thread, and the machine is shared."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


#: test folders whose tests exercise one backend, marked so a device run selects them (``-m cuda``)
BACKEND_FOLDERS = {"cuda": ("backends", "cuda"), "ascend": ("backends", "ascend")}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark each test under ``tests/backends/<name>/`` with the backend's marker."""
    root = config.rootpath / "tests"
    for item in items:
        try:
            parts = item.path.relative_to(root).parts
        except ValueError:
            continue
        for marker, folder in BACKEND_FOLDERS.items():
            if parts[: len(folder)] == folder:
                item.add_marker(getattr(pytest.mark, marker))
