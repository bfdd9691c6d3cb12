"""Exceptions shared by the contract and its implementations, and how they read as one line."""


def first_line(exc: BaseException) -> str:
    """``exc`` as one line for a report: its type and the first line of its message."""
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0] if lines else ''}".rstrip(": ")


class NotSupportedError(RuntimeError):
    """Raised by a kernel or device when it cannot run a case on this hardware.

    The conformance suite reports it as ``not_supported`` with the message,
    not as a failure.
    """
