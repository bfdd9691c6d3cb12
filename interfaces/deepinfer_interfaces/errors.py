"""Exceptions shared by the contract and its implementations."""


class NotSupportedError(RuntimeError):
    """Raised by a kernel or device when it cannot run a case on this hardware.

    The conformance suite reports it as ``not_supported`` with the message,
    not as a failure.
    """
