"""Finding and importing torch_npu safely, and saying why it cannot be used.

torch_npu without the CANN libraries fails to import (``libhccl.so`` or
``libascendcl.so`` missing). Importing it is therefore only ever done here, on
demand, with every failure caught and turned into a one-line reason.

``import torch`` itself is protected separately: torch_npu registers a
``torch.backends`` entry point that ``import torch`` loads automatically, so a
broken torch_npu would take ``import torch`` down before any of our code runs.
The ``deepinfer`` CLI sets ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` before importing
torch; Python-API users on a machine with a broken torch_npu set it in their
environment (see docs/ascend-bring-up.md). With autoload off, torch_npu is
loaded only by :func:`load_torch_npu`.

A failed import leaves no half-imported ``torch_npu.*`` modules behind in
``sys.modules``, so the rest of the process sees a clean "not importable"
state rather than a partly initialised package.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
import os
import re
import sys
from types import ModuleType

INSTALL_HINT = "pip install 'deepinfer[ascend]' matched to your CANN version"

#: an import error naming a missing shared library (``libhccl.so: cannot open shared object file``)
_MISSING_LIB = re.compile(r"(lib[\w.+-]*\.so[\w.]*)")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


def _cann_hint() -> str:
    if os.environ.get("ASCEND_HOME_PATH") or os.environ.get("ASCEND_TOOLKIT_HOME"):
        return ""
    return " (ASCEND_HOME_PATH is unset: source CANN's set_env.sh, e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh)"


def _forget_partial_import() -> None:
    """Drop ``torch_npu`` submodules that a failed import left in ``sys.modules``."""
    for name in [m for m in sys.modules if m == "torch_npu" or m.startswith("torch_npu.")]:
        del sys.modules[name]


def import_failure_reason(exc: BaseException) -> str:
    """The reason shown for a torch_npu that is installed but does not import."""
    first = _first_line(exc)
    missing = _MISSING_LIB.search(first)
    if isinstance(exc, OSError) or missing:
        lib = missing.group(1) if missing else "a CANN shared library"
        return f"torch_npu is installed but the CANN libraries are missing ({lib}: {first}){_cann_hint()}"
    return f"torch_npu is installed but failed to import: {type(exc).__name__}: {first}{_cann_hint()}"


@functools.lru_cache(maxsize=1)
def load_torch_npu() -> tuple[ModuleType | None, str | None]:
    """``(torch_npu, None)`` when it imports, else ``(None, reason)``; never raises."""
    if "torch_npu" not in sys.modules and importlib.util.find_spec("torch_npu") is None:
        return None, f"torch_npu is not installed ({INSTALL_HINT})"
    try:
        module = importlib.import_module("torch_npu")
    except BaseException as exc:  # OSError/ImportError/RuntimeError without CANN; never let it escape
        if isinstance(exc, (KeyboardInterrupt, SystemExit)):
            raise
        _forget_partial_import()
        return None, import_failure_reason(exc)
    return module, None


def npu_namespace() -> ModuleType | None:
    """``torch_npu.npu`` (the ``torch.npu`` device module) when torch_npu imports, else None."""
    module, _ = load_torch_npu()
    return getattr(module, "npu", None) if module is not None else None


def visible_devices_note() -> str:
    """What ``ASCEND_RT_VISIBLE_DEVICES`` restricts the process to, for reasons and logs."""
    value = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
    if value is None:
        return "ASCEND_RT_VISIBLE_DEVICES is unset"
    if not value.strip():
        return "ASCEND_RT_VISIBLE_DEVICES is set but empty, which hides every NPU"
    return f"ASCEND_RT_VISIBLE_DEVICES={value}"


def npu_device_count() -> int:
    """NPUs visible to the process (the runtime honours ASCEND_RT_VISIBLE_DEVICES); 0 if torch_npu is unusable."""
    npu = npu_namespace()
    if npu is None:
        return 0
    try:
        return int(npu.device_count())
    except Exception:
        return 0


def availability() -> tuple[bool, str | None]:
    """``(True, None)`` when torch_npu imports and sees at least one NPU, else ``(False, reason)``."""
    module, reason = load_torch_npu()
    if module is None:
        return False, reason
    if npu_namespace() is None:
        return False, "torch_npu imported but has no torch_npu.npu device module (reinstall torch_npu matched to torch)"
    if npu_device_count() == 0:
        return False, f"torch_npu imported but no NPU is visible (check the driver with npu-smi info; {visible_devices_note()})"
    return True, None
