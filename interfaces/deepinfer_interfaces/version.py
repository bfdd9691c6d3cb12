"""The version of the backend contract (semver).

A plugin declares the version it was written against; the registry refuses a
plugin whose major version differs from ours.
"""

INTERFACE_VERSION = "1.6.0"


def major(version: str) -> int:
    """The major component of a semver string."""
    return int(str(version).split(".")[0])
