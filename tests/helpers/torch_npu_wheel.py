"""The torch-npu wheel matching the pinned torch, downloaded once into a cache and never installed.

Installing torch-npu on a machine without CANN breaks ``import torch`` (its
autoload hook), so the wheel is only ever read as a zip. One wheel serves every
host: the op schemas do not depend on the Python version or the machine, so the
tag is fixed (cp311, manylinux_2_28_x86_64) and CI caches a single file.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import tempfile
import time
import tomllib
import urllib.parse
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

#: the one wheel tag read (any tag holds the same schemas)
PYTHON_VERSION = "3.11"
PLATFORM = "manylinux_2_28_x86_64"

#: overrides the cache directory (CI points it at a cached path)
CACHE_ENV = "DEEPINFER_WHEEL_CACHE"


class WheelUnavailable(Exception):
    """No cached wheel and no network to fetch one: the reason a test skips."""


@dataclass(frozen=True)
class Wheel:
    """A torch-npu wheel on disk and how it got there."""

    path: Path
    version: str
    downloaded: bool
    seconds: float

    @property
    def size(self) -> int:
        return self.path.stat().st_size


def pinned_torch_version(pyproject: Path = ROOT / "pyproject.toml") -> str:
    """The ``torch==X`` pin of the project's dependencies (torch-npu releases share torch's version)."""
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    for dep in deps:
        name, sep, version = dep.replace(" ", "").partition("==")
        if name == "torch" and sep:
            return version
    raise LookupError(f"no torch==X pin in {pyproject}")


def cache_dir() -> Path:
    """``$DEEPINFER_WHEEL_CACHE``, else ``$XDG_CACHE_HOME/deepinfer/wheels`` (``~/.cache/deepinfer/wheels``)."""
    if os.environ.get(CACHE_ENV):
        return Path(os.environ[CACHE_ENV])
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
    return base / "deepinfer" / "wheels"


def wheel_name(version: str) -> str:
    tag = "cp" + PYTHON_VERSION.replace(".", "")
    return f"torch_npu-{version}-{tag}-{tag}-{PLATFORM}.whl"


def _usable(path: Path) -> bool:
    """A zip whose central directory reads (it sits at the end, so an interrupted copy fails here)."""
    try:
        with zipfile.ZipFile(path) as zf:
            return len(zf.namelist()) > 0
    except (zipfile.BadZipFile, OSError):
        return False


def _index_host() -> str:
    """The host pip downloads from: ``$PIP_INDEX_URL``'s, else PyPI's."""
    url = os.environ.get("PIP_INDEX_URL", "https://pypi.org/simple")
    return urllib.parse.urlparse(url).hostname or "pypi.org"


def network_reachable(host: str | None = None, timeout: float = 5.0) -> bool:
    """Whether a TCP connection to the package index opens."""
    try:
        with socket.create_connection((host or _index_host(), 443), timeout=timeout):
            return True
    except OSError:
        return False


def _download(version: str, dest: Path) -> Path:
    """``pip download`` the wheel into ``dest`` atomically (a temporary folder, then a rename)."""
    dest.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=dest, prefix=".download-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", f"torch-npu=={version}", "--no-deps", "--only-binary=:all:",
               "--python-version", PYTHON_VERSION, "--platform", PLATFORM, "--disable-pip-version-check", "--retries", "2",
               "-q", "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        got = Path(tmp) / wheel_name(version)
        if proc.returncode != 0 or not got.exists():
            tail = (proc.stderr or proc.stdout).strip().splitlines()[-1:] or ["no output"]
            if not network_reachable():
                raise WheelUnavailable(f"no cached {wheel_name(version)} in {dest} and the package index is unreachable "
                                       f"({tail[0]})")
            raise RuntimeError(f"pip download torch-npu=={version} failed with the network up: {proc.stderr[-2000:]}")
        target = dest / got.name
        os.replace(got, target)
        return target


def torch_npu_wheel(version: str | None = None, dest: Path | None = None) -> Wheel:
    """The cached wheel for ``version`` (default: the pinned torch's), downloading it on first use.

    Raises ``WheelUnavailable`` only when no usable cached wheel exists and the index is unreachable.
    """
    version = version or pinned_torch_version()
    dest = dest or cache_dir()
    path = dest / wheel_name(version)
    if path.exists() and _usable(path):
        return Wheel(path, version, downloaded=False, seconds=0.0)
    if path.exists():
        path.unlink()  # a truncated copy: fetch it again
    start = time.monotonic()
    got = _download(version, dest)
    return Wheel(got, version, downloaded=True, seconds=time.monotonic() - start)


def read_member(wheel: Path, name: str) -> bytes:
    """One member of the wheel, without extracting anything else."""
    with zipfile.ZipFile(wheel) as zf:
        return zf.read(name)

