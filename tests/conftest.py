"""Fixtures shared by the test modules."""

import pytest
import torch


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
