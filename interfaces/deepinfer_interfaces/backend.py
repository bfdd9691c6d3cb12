"""The Backend contract: a named bundle of a device, a communicator and a kernel set.

A bundle names its parts by their entry-point names in the ``deepinfer.devices``,
``deepinfer.communicators`` and ``deepinfer.kernels`` groups, so a user can swap
one part (``--kernels reference``) while keeping the others. Importing a bundle
must stay cheap: heavy dependencies (triton, torch_npu) are imported only by
``is_available`` and by the parts when they are used.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar



class Backend(ABC):
    """Declarative description of one backend plugin."""

    #: the name users select with ``--backend``
    name: ClassVar[str]
    #: entry-point names of the parts
    device: ClassVar[str]
    communicator: ClassVar[str] = "torch-distributed"
    kernels: ClassVar[str]
    #: the contract version this plugin was written for, e.g. ``"1.6.0"``: required, declared by the plugin's
    #: own class (the registry refuses a bundle without one); it also decides the device features it gets
    interface_version: ClassVar[str]
    #: names of features newer than ``interface_version`` that the bundle's device implements (``features.py``)
    extra_features: ClassVar[tuple[str, ...]] = ()
    #: ``auto`` picks the available backend with the highest priority
    priority: ClassVar[int] = 0

    @classmethod
    @abstractmethod
    def is_available(cls) -> tuple[bool, str | None]:
        """``(True, None)`` when this backend can run here, else ``(False, reason)``; never raises."""
