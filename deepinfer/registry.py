"""Plugin discovery and selection over the four entry-point groups, with stevedore.

Discovery imports each plugin's entry-point module, which must stay light: heavy
dependencies (triton, torch_npu) load only when a part is used. A plugin that
fails to import is recorded with its error; the others still load.
"""

from __future__ import annotations

import logging
import os
import sys
from importlib import metadata
from dataclasses import dataclass, field
from typing import Any, Iterable

from stevedore import ExtensionManager

from deepinfer_interfaces import INTERFACE_VERSION, Backend, Communicator, Device, Kernels
from deepinfer_interfaces.errors import first_line
from deepinfer_interfaces.features import Feature, oldest_supported
from deepinfer_interfaces.version import declared_version, major_minor
from deepinfer_interfaces.versioned import device_features, unknown_extra_features, versioned_device, versioned_kernels

from .errors import PluginError

log = logging.getLogger("deepinfer")

GROUPS = {
    "backends": "deepinfer.backends",
    "devices": "deepinfer.devices",
    "communicators": "deepinfer.communicators",
    "kernels": "deepinfer.kernels",
    "kv_connectors": "deepinfer.kv_connectors",
}


@dataclass
class Plugin:
    """One entry point: the loaded object, or the error that stopped it loading."""

    name: str
    group: str
    package: str | None
    obj: Any = None
    error: str | None = None


def _packages(namespace: str) -> dict[str, str]:
    """Entry-point name to the distribution that declares it."""
    out: dict[str, str] = {}
    for dist in metadata.distributions():
        for ep in dist.entry_points:
            if ep.group == namespace:
                out.setdefault(ep.name, dist.metadata["Name"])
    return out


def discover(kind: str) -> dict[str, Plugin]:
    """Every plugin in group ``kind`` (``backends``, ``devices``, ``communicators``, ``kernels``, ``kv_connectors``)."""
    namespace = GROUPS[kind]
    packages = _packages(namespace)
    found: dict[str, Plugin] = {}

    def failed(_manager: Any, entry_point: Any, exc: BaseException) -> None:
        name = entry_point.name
        found[name] = Plugin(name, namespace, packages.get(name), error=first_line(exc))

    manager = ExtensionManager(namespace, invoke_on_load=False, on_load_failure_callback=failed)
    for ext in manager.extensions:
        found[ext.name] = Plugin(ext.name, namespace, packages.get(ext.name), obj=ext.plugin)
    return dict(sorted(found.items()))


def load_part(kind: str, name: str) -> Any:
    """The class registered as ``name`` in group ``kind``; a clear error if missing or broken."""
    plugins = discover(kind)
    if name not in plugins:
        installed = ", ".join(plugins) or "none"
        raise PluginError(f"unknown {kind[:-1]} '{name}' (installed: {installed})")
    plugin = plugins[name]
    if plugin.error:
        raise PluginError(f"{kind[:-1]} plugin '{name}' failed to import: {plugin.error}")
    return plugin.obj


@dataclass
class BackendStatus:
    """What ``deepinfer backends`` reports for one backend plugin."""

    name: str
    available: bool
    reason: str | None
    parts: dict[str, str | None] = field(default_factory=dict)
    overrides: list[str] = field(default_factory=list)
    interface_version: str | None = None
    package: str | None = None
    priority: int = 0
    #: features newer than its kernel set (ops) or bundle (device methods) declares, which keep the reference's
    #: behaviour, as ``"name (since)"``
    routed_to_reference: list[str] = field(default_factory=list)

    def as_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "available": self.available,
            "reason": self.reason,
            "parts": self.parts,
            "overrides": self.overrides,
            "interface_version": self.interface_version,
            "engine_interface_version": INTERFACE_VERSION,
            "routed_to_reference": self.routed_to_reference,
            "package": self.package,
        }


def _version_problem(version: str | None, cls: type | None = None) -> str | None:
    """Why a plugin declaring ``version`` cannot run with this engine, or None."""
    if version is None:
        where = f" to class {cls.__module__}.{cls.__qualname__}" if cls is not None else ""
        return (f"declares no interface_version: add interface_version = \"{INTERFACE_VERSION}\"{where} "
                "(the contract version it was written for; it is not inherited)")
    try:
        declared, engine = major_minor(version), major_minor(INTERFACE_VERSION)
    except ValueError as exc:
        return f"{exc} (declare e.g. interface_version = \"{INTERFACE_VERSION}\")"
    if declared[0] != engine[0]:
        return (f"interface version {version} is incompatible with deepinfer's {INTERFACE_VERSION} "
                f"(major versions must match; deepinfer honours {oldest_supported(INTERFACE_VERSION)} and later; upgrade the plugin)")
    if declared > engine:
        return f"interface version {version} is newer than deepinfer's {INTERFACE_VERSION} (upgrade deepinfer)"
    unknown = unknown_extra_features(cls) if cls is not None else []
    if unknown:
        return f"extra_features names unknown feature '{unknown[0]}' (features of {INTERFACE_VERSION}: see deepinfer_interfaces.features)"
    return None


def describe_features(features: Iterable[Feature]) -> list[str]:
    """``"name (since)"`` for each feature, oldest first."""
    return [f"{f.name} ({f.since})" for f in sorted(features, key=lambda f: major_minor(f.since))]


def kernel_overrides(kernels_name: str) -> tuple[list[str], str | None, tuple[Feature, ...]]:
    """The ops a kernel set implements itself as the engine calls it, the reason it cannot be loaded (else None),
    and the newer features it leaves to the reference."""
    plugins = discover("kernels")
    plugin = plugins.get(kernels_name)
    if plugin is None:
        return [], f"kernel set '{kernels_name}' is not installed", ()
    if plugin.error:
        return [], f"kernel set '{kernels_name}' failed to import: {plugin.error}", ()
    problem = _version_problem(declared_version(plugin.obj, Kernels), plugin.obj)
    if problem:
        return plugin.obj.overrides(), f"kernel set '{kernels_name}' {problem}", ()
    versioned = versioned_kernels(plugin.obj)
    return versioned.overrides(), None, versioned.routed_features


def backend_status(plugin: Plugin) -> BackendStatus:
    """Availability of one backend plugin, with the reason when it cannot run here."""
    if plugin.error:
        return BackendStatus(plugin.name, False, f"plugin failed to import: {plugin.error}", package=plugin.package)
    cls: type[Backend] = plugin.obj
    parts = {"device": cls.device, "communicator": cls.communicator, "kernels": cls.kernels}
    overrides, kernel_problem, routed = kernel_overrides(cls.kernels)
    version = declared_version(cls, Backend)
    status = BackendStatus(plugin.name, False, None, parts, overrides, version, plugin.package, cls.priority)
    problem = _version_problem(version, cls)
    status.reason = (f"backend plugin '{plugin.name}' {problem}" if problem else None) or kernel_problem
    if problem is None:
        status.routed_to_reference = describe_features((*routed, *device_features(version, tuple(cls.extra_features))))
    if status.reason is None:
        try:
            ok, reason = cls.is_available()
        except Exception as exc:  # a plugin's availability check must not stop discovery
            ok, reason = False, f"is_available() raised {first_line(exc)}"
        status.available, status.reason = bool(ok), (None if ok else reason or "unavailable (no reason given)")
    return status


def list_backends() -> list[BackendStatus]:
    """Every discovered backend plugin with its status."""
    return [backend_status(p) for p in discover("backends").values()]


@dataclass
class SelectedBackend:
    """The parts of the chosen backend, ready to use."""

    name: str
    device: Device
    kernels: Kernels
    communicator_cls: type[Communicator]
    kernels_name: str
    interpret: bool = False

    def make_communicator(
        self, rank: int = 0, world_size: int = 1, init_method: str | None = None, timeout_s: float | None = None
    ) -> Communicator:
        """A communicator for this rank over the device's distributed backend (collectives bounded by ``timeout_s``)."""
        extra = {} if timeout_s is None else {"timeout_s": timeout_s}
        return self.communicator_cls(
            dist_backend=self.device.dist_backend,
            rank=rank,
            world_size=world_size,
            init_method=init_method,
            device=self.device.torch_device,
            **extra,
        )


def _describe_installed(statuses: list[BackendStatus]) -> str:
    return ", ".join(s.name if s.available else f"{s.name} (unavailable: {s.reason})" for s in statuses) or "none"


def _enable_interpreter() -> None:
    """Make Triton run kernels on CPU tensors; it must be set before Triton is imported."""
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        raise PluginError("--interpret must be chosen before Triton is imported (start a new process)")
    os.environ["TRITON_INTERPRET"] = "1"


def select_backend(name: str = "auto", kernels: str | None = None, interpret: bool = False) -> SelectedBackend:
    """Resolve a backend name (or ``auto``) and an optional kernel-set override into parts.

    With ``interpret``, the backend's kernels run on the CPU device through Triton's
    interpreter, so a GPU backend's kernels can be checked on a machine without one.
    """
    statuses = list_backends()
    by_name = {s.name: s for s in statuses}
    if name == "auto":
        ready = sorted((s for s in statuses if s.available), key=lambda s: -s.priority)
        if not ready:
            raise PluginError(f"no backend is available (installed: {_describe_installed(statuses)})")
        status = ready[0]
    elif name not in by_name:
        raise PluginError(f"unknown backend '{name}' (installed: {_describe_installed(statuses)}; choose one with --backend)")
    else:
        status = by_name[name]
    if not status.parts:
        raise PluginError(f"backend '{status.name}' is unavailable: {status.reason}")
    backend_cls = load_part("backends", status.name)
    version_problem = _version_problem(status.interface_version, backend_cls)
    if version_problem:
        raise PluginError(f"backend '{status.name}' refused: {version_problem}")
    if interpret:
        _enable_interpreter()
    elif not status.available:
        raise PluginError(f"backend '{status.name}' is unavailable: {status.reason}")
    kernels_name = kernels or status.parts["kernels"]
    device_name = "cpu" if interpret else status.parts["device"]
    device_cls = load_part("devices", device_name)
    device_routed: tuple[Feature, ...] = ()
    if not interpret:
        device_routed = device_features(status.interface_version, tuple(backend_cls.extra_features))
        device_cls = versioned_device(device_cls, status.interface_version, tuple(backend_cls.extra_features))
    device = device_cls()
    kernel_cls = load_part("kernels", kernels_name)
    kernel_problem = _version_problem(declared_version(kernel_cls, Kernels), kernel_cls)
    if kernel_problem:
        raise PluginError(f"kernel set '{kernels_name}' refused: {kernel_problem}")
    kernel_cls = versioned_kernels(kernel_cls)
    if kernel_cls.routed_features or device_routed:
        log.info(
            "backend '%s' (contract %s) with kernel set '%s' (contract %s) on deepinfer %s: the reference runs %s",
            status.name, status.interface_version, kernels_name, declared_version(kernel_cls, Kernels), INTERFACE_VERSION,
            ", ".join(describe_features((*kernel_cls.routed_features, *device_routed))),
        )
    return SelectedBackend(
        name=status.name,
        device=device,
        kernels=kernel_cls(),
        communicator_cls=load_part("communicators", status.parts["communicator"]),
        kernels_name=kernels_name,
        interpret=interpret,
    )
