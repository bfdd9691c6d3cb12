"""Runs steps on the device in submission order, on a thread of its own when scheduling overlaps.

With overlap scheduling the engine hands a ``Step`` to the executor and
schedules the next one while this one runs. Tokens the next step needs but the
host has not seen yet are placeholders in its records; the runner fills them
from the previous step's samples on the device, so no host round trip sits
between two forwards.
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

from .model_runner import ModelRunner
from .step import Step, StepResult

T = TypeVar("T")


class StepExecutor:
    """Runs steps in order: inline, or on its ``deepinfer-device`` thread when ``threaded``."""

    def __init__(self, runner: ModelRunner, threaded: bool) -> None:
        self.runner = runner
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="deepinfer-device") if threaded else None

    @property
    def threaded(self) -> bool:
        return self._pool is not None

    def submit(self, step: Step) -> Future[StepResult]:
        return self.call(self.runner.execute, step)

    def call(self, fn: Callable[..., T], *args: object) -> Future[T]:
        """Run ``fn(*args)`` on the device in order with the steps (cache copies between two steps)."""
        if self._pool is not None:
            return self._pool.submit(fn, *args)
        fut: Future[T] = Future()
        try:
            fut.set_result(fn(*args))
        except BaseException as exc:  # surfaced by .result() like the threaded path
            fut.set_exception(exc)
        return fut

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)
