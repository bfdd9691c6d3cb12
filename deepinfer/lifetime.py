"""A child process's life is bound to its parent's.

The processes ``deepinfer serve`` and an expert-parallel engine start (the engine process, the spawned
ranks, the workers torchrun starts) must not outlive the process that started them: a server killed
with SIGKILL cannot stop them itself, and an orphaned rank keeps its device memory and its port, or an
orphaned torchrun rank 0 keeps serving HTTP. ``die_with_parent`` asks the kernel to kill this process
when its parent dies (Linux ``PR_SET_PDEATHSIG``); elsewhere a watchdog thread notices the parent is gone.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import time

#: ``prctl`` option: the signal this process receives when its parent dies (linux/prctl.h)
PR_SET_PDEATHSIG = 1
#: seconds between the watchdog's looks at the parent
WATCHDOG_INTERVAL_S = 0.5
#: exit status of a process that found its parent gone (a killed process's 128 + SIGKILL)
ORPHAN_EXIT_STATUS = 128 + 9


def die_with_parent(parent_pid: int | None = None, *, parent_thread_lives: bool = True) -> None:
    """End this process when its parent dies, whatever it is doing then.

    ``parent_pid`` is the parent's pid as the parent itself knew it (None: the parent now); when this
    process's parent is already another one (the parent died before this call), it exits at once.
    On Linux the kernel sends SIGKILL at the parent's death (``PR_SET_PDEATHSIG``); on other systems,
    when ``prctl`` fails, or when ``parent_thread_lives`` is False, a daemon thread polls the parent
    instead. The kernel's signal fires when the parent's *thread* that started this process ends, so
    a parent that started it from a thread that may end before the process does passes
    ``parent_thread_lives=False``. Calling it again is harmless."""
    expected = os.getppid() if parent_pid is None else parent_pid
    if not (parent_thread_lives and sys.platform.startswith("linux") and _set_pdeathsig(signal.SIGKILL)):
        _start_watchdog(expected)
    if os.getppid() != expected:  # the parent died before the kernel (or the watchdog) was told
        os._exit(ORPHAN_EXIT_STATUS)


def _set_pdeathsig(sig: int) -> bool:
    """``prctl(PR_SET_PDEATHSIG, sig)`` through libc; whether it took."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, ctypes.c_ulong(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


_watched: set[int] = set()


def _start_watchdog(parent_pid: int) -> None:
    """A daemon thread that exits this process at once when its parent is no longer ``parent_pid``
    (an orphan is adopted by init or a subreaper)."""
    if parent_pid in _watched:
        return
    _watched.add(parent_pid)

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(WATCHDOG_INTERVAL_S)
        os._exit(ORPHAN_EXIT_STATUS)

    threading.Thread(target=watch, daemon=True, name="deepinfer-parent-watchdog").start()
