"""Finding and importing torch_npu safely.

torch_npu without the CANN libraries fails to import (``libhccl.so`` missing),
and its ``torch.backends`` autoload hook would take ``import torch`` down with
it. We import it only on demand, catch every failure, and turn it into a reason.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
from types import ModuleType


@functools.lru_cache(maxsize=1)
def load_torch_npu() -> tuple[ModuleType | None, str | None]:
    """``(torch_npu, None)`` when it imports, else ``(None, reason)``."""
    if importlib.util.find_spec("torch_npu") is None:
        return None, "torch_npu is not installed (pip install 'deepinfer[ascend]' matched to your CANN version)"
    if not os.environ.get("ASCEND_HOME_PATH") and not os.environ.get("ASCEND_TOOLKIT_HOME"):
        cann_hint = " (ASCEND_HOME_PATH is unset: source CANN's set_env.sh)"
    else:
        cann_hint = ""
    try:
        module = importlib.import_module("torch_npu")
    except Exception as exc:  # torch_npu raises OSError/ImportError/RuntimeError without CANN
        first = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        return None, f"torch_npu is installed but failed to import: {first}{cann_hint}"
    return module, None


def npu_device_count() -> int:
    """NPUs visible to the process (honours ASCEND_RT_VISIBLE_DEVICES); 0 if torch_npu is unusable."""
    module, _ = load_torch_npu()
    if module is None:
        return 0
    import torch

    try:
        return int(torch.npu.device_count())
    except Exception:
        return 0
