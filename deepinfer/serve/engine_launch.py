"""Spawning the engine process, from a module light enough to run before the server's own imports.

The engine process spends its start-up importing torch and building the engine; the server process spends
its own importing the web stack and torch. ``deepinfer serve`` launches the engine first thing, so the two
load side by side on separate cores, then hands the launch to ``AsyncEngine``, which waits for the engine's
ready message. Nothing here imports torch or the engine: the child imports those itself.
"""

from __future__ import annotations

import multiprocessing
from dataclasses import dataclass
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .engine_process import TransferSettings


@dataclass
class EngineLaunch:
    """A started engine process and the server's end of its pipe (its first message: ready, or why not)."""

    process: BaseProcess
    conn: Connection

    def kill(self) -> None:
        """Stop a launch the server will not use (its start-up failed before the engine was waited for)."""
        if self.process.is_alive():
            self.process.kill()
        self.process.join(5)
        self.conn.close()


def launch_engine(config_json: str, verbose: bool, transfer: TransferSettings | None = None) -> EngineLaunch:
    """Spawn the engine process for the engine configuration ``config_json``; returns at once."""
    ctx = multiprocessing.get_context("spawn")
    mine, theirs = ctx.Pipe()
    process = ctx.Process(target=_engine_main, args=(config_json, theirs, verbose, transfer), name="deepinfer-engine", daemon=True)
    process.start()
    theirs.close()
    return EngineLaunch(process, mine)


def _engine_main(config_json: str, conn: Connection, verbose: bool, transfer: TransferSettings | None) -> None:
    """In the child: import the engine process's loop (torch and all) and run it."""
    from .engine_process import run_engine_process

    run_engine_process(config_json, conn, verbose, transfer)
