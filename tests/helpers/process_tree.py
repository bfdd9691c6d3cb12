"""The processes below a process, and whether they are still alive, from ``/proc`` (Linux).

A process is a ``Proc``: its pid and its start time (``/proc/<pid>/stat`` field 22, in clock ticks since
boot), so a pid the kernel has given to a new process since is not mistaken for the one recorded.

- ``descendants(pid)``: every process below ``pid``, walking ``/proc/<pid>/task/*/children``.
- ``living(procs)``: those of ``procs`` still running (a zombie is dead: it only waits to be reaped).
- ``wait_gone(procs, timeout)``: waits until none is alive; those left.
- ``kill_all(procs)``: SIGKILL the ones still alive (cleanup, pid reuse checked).
- ``describe(procs)``: one line per process, its pid and command line, for an assertion's message.
"""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path
from typing import NamedTuple


class Proc(NamedTuple):
    pid: int
    #: clock ticks after boot when it started (``/proc/<pid>/stat`` field 22)
    start: int


def _stat(pid: int) -> list[str] | None:
    """``/proc/<pid>/stat``'s fields from the third (the state) on; None when there is no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2:].split()  # the command name may hold spaces and parentheses


def proc(pid: int) -> Proc | None:
    """``pid`` as a ``Proc``; None when it does not exist."""
    fields = _stat(pid)
    return Proc(pid, int(fields[19])) if fields is not None else None


def parent(p: Proc) -> int | None:
    """The pid of ``p``'s parent now (None when ``p`` is gone)."""
    fields = _stat(p.pid) if is_alive(p) else None
    return int(fields[1]) if fields is not None else None


def children(pid: int) -> list[int]:
    """The pids of ``pid``'s children (of every one of its threads)."""
    kids: list[int] = []
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            kids += [int(k) for k in (task / "children").read_text().split()]
        except OSError:
            continue
    return kids


def descendants(pid: int) -> list[Proc]:
    """Every process below ``pid``, parents before their children."""
    found: list[Proc] = []
    todo = children(pid)
    while todo:
        kid = todo.pop(0)
        p = proc(kid)
        if p is not None and p not in found:
            found.append(p)
            todo += children(kid)
    return found


def is_alive(p: Proc) -> bool:
    """Whether ``p`` (that very process, not a later one with its pid) still runs; a zombie does not."""
    fields = _stat(p.pid)
    return fields is not None and int(fields[19]) == p.start and fields[0] not in ("Z", "X")


def living(procs: list[Proc]) -> list[Proc]:
    return [p for p in procs if is_alive(p)]


def wait_gone(procs: list[Proc], timeout: float) -> list[Proc]:
    """Waits up to ``timeout`` s until none of ``procs`` is alive; those still alive then."""
    deadline = time.monotonic() + timeout
    while True:
        left = living(procs)
        if not left or time.monotonic() > deadline:
            return left
        time.sleep(0.1)


def kill_all(procs: list[Proc], sig: int = signal.SIGKILL) -> None:
    """Send ``sig`` to each of ``procs`` still alive (checked by start time, so a reused pid is spared)."""
    for p in procs:
        if is_alive(p):
            try:
                os.kill(p.pid, sig)
            except (ProcessLookupError, PermissionError):
                pass


def cmdline(p: Proc) -> str:
    try:
        return Path(f"/proc/{p.pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def describe(procs: list[Proc]) -> str:
    return "\n".join(f"  {p.pid} (parent {parent(p)}): {cmdline(p)[:160]}" for p in procs)
