"""A plugin's kernel set and device as the engine calls them: newer features than it declares run the reference.

``versioned_kernels(cls)`` returns ``cls`` itself for a kernel set written for the
current minor version, else a subclass made for the run (the plugin's class is not
modified) in which

- each op of a newer feature is the reference method, whatever the plugin defines;
- each op that a newer *argument* may reach (a ``PackedPool`` where 1.0 had a tensor)
  runs the plugin's own method on the arguments it was written for and the
  reference on the others;
- while a newer *mode* (a switch on the kernel set) is on, each of the plugin's
  own ops runs the reference: its code never promised what the mode asks.

``versioned_device(cls, version)`` does the same for ``Device`` methods, by the
version of the bundle (``Backend``) the device runs in. A plugin that implements
a newer feature itself names it in ``extra_features`` (of its kernel set or bundle).
"""

from __future__ import annotations

import functools
from typing import Any, Callable, TypeVar

from .device import Device
from .features import BY_NAME, Feature, holds, newer_features
from .kernels import Kernels
from .version import declared_version

K = TypeVar("K", bound=type)


def routed_features(cls: type, base: type) -> tuple[Feature, ...]:
    """The features plugin class ``cls`` (a ``base`` subclass) gets from the reference."""
    version = declared_version(cls, base)
    if version is None:
        raise ValueError(f"{cls.__name__} declares no interface_version")
    return newer_features(version, getattr(cls, "extra_features", ()))


def unknown_extra_features(cls: type) -> list[str]:
    """Names in ``cls.extra_features`` that are no feature of this contract."""
    return [n for n in getattr(cls, "extra_features", ()) if n not in BY_NAME]


def _own_unless(kind: type, own: Callable, reference: Callable) -> Callable:
    """``own`` for calls without a ``kind`` argument, ``reference`` for calls with one."""

    @functools.wraps(own)
    def method(self, *args: Any, **kwargs: Any) -> Any:
        if holds(args, kind) or holds(kwargs.values(), kind):
            return reference(self, *args, **kwargs)
        return own(self, *args, **kwargs)

    return method


def _own_unless_mode(mode: str, own: Callable, reference: Callable) -> Callable:
    """``own`` while the instance's ``mode`` switch is off, ``reference`` while it is on."""

    @functools.wraps(own)
    def method(self, *args: Any, **kwargs: Any) -> Any:
        return reference(self, *args, **kwargs) if getattr(self, mode, False) else own(self, *args, **kwargs)

    return method


def versioned_kernels(cls: K) -> K:
    """``cls`` as the engine calls it: every feature newer than its declared version on the reference."""
    if cls is Kernels:
        return cls  # the reference is the contract of its own version
    routed = tuple(f for f in routed_features(cls, Kernels) if f.ops or f.argument_ops or f.mode)
    if not routed:
        return cls
    body: dict[str, Any] = {"routed_features": routed, "__module__": cls.__module__, "__qualname__": cls.__qualname__,
                            "__doc__": cls.__doc__}
    whole = {op for f in routed for op in f.ops}
    for op in whole:
        body[op] = getattr(Kernels, op)
    for f in routed:
        for op in f.argument_ops:
            own = getattr(cls, op)
            if op not in whole and own is not getattr(Kernels, op):
                body[op] = _own_unless(f.argument, body.get(op, own), getattr(Kernels, op))
        for op in Kernels.ops() if f.mode else ():
            own = getattr(cls, op)
            if op not in whole and own is not getattr(Kernels, op):
                body[op] = _own_unless_mode(f.mode, body.get(op, own), getattr(Kernels, op))
    return type(cls.__name__, (cls,), body)


def device_features(version: str, extra_features: tuple[str, ...] = ()) -> tuple[Feature, ...]:
    """The ``Device`` features newer than ``version`` (less ``extra_features``): a bundle's device keeps their defaults."""
    return tuple(f for f in newer_features(version, extra_features) if f.device_methods)


def versioned_device(cls: K, version: str, extra_features: tuple[str, ...] = ()) -> K:
    """Device class ``cls`` in a bundle declaring ``version`` (and ``extra_features``): device methods newer than
    that keep ``Device``'s default."""
    routed = device_features(version, extra_features)
    body = {m: getattr(Device, m) for f in routed for m in f.device_methods if getattr(cls, m) is not getattr(Device, m)}
    if not body:
        return cls
    return type(cls.__name__, (cls,), {**body, "__module__": cls.__module__, "__qualname__": cls.__qualname__})
