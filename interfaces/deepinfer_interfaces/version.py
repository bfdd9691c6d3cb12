"""The version of the backend contract (semver), and reading the versions plugins declare.

A plugin declares the version it was written for in its own class
(``interface_version``); the registry refuses a plugin of another major version,
one newer than the engine, or one that declares none, and hands a plugin of an
older minor version only the features that version had (``features.py``).
"""

INTERFACE_VERSION = "1.7.0"


def major(version: str) -> int:
    """The major component of a semver string."""
    return int(str(version).split(".")[0])


def major_minor(version: str) -> tuple[int, int]:
    """``(major, minor)`` of ``"1.4"`` or ``"1.4.2"``; ``ValueError`` for anything else."""
    parts = str(version).split(".")
    if not 2 <= len(parts) <= 3 or not all(p.isdigit() for p in parts):
        raise ValueError(f"interface version {version!r} is not MAJOR.MINOR[.PATCH]")
    return int(parts[0]), int(parts[1])


def declared_version(cls: type, base: type) -> str | None:
    """The ``interface_version`` that ``cls`` or one of its own ancestors (below ``base``) declares, or None.

    What ``base`` (``Backend``, ``Kernels``) carries does not count: a plugin states the contract it was
    written for; it does not inherit whatever version happens to be installed. ``base`` itself (the
    reference kernel set) is written for the current contract.
    """
    for klass in cls.__mro__:
        if klass is base and cls is not base:
            return None
        if "interface_version" in vars(klass):
            return str(vars(klass)["interface_version"])
    return None
