"""Start-up cost profiles kept across processes, so an engine does not time its forwards again at every start.

A profile (``StepCostProfile``: seconds a forward or a draft pass takes at each size) is the adaptive
speculation policy's prior; the engine corrects it online from the steps it runs (``LiveCosts``), so a
prior measured once per machine and setting serves every later engine of that setting. Profiles are
kept in memory for this process and as one JSON file each under ``$DEEPINFER_CACHE_DIR/profiles`` (else
``$XDG_CACHE_HOME/deepinfer/profiles``, else ``~/.cache/deepinfer/profiles``), named by a digest of
everything that shapes them: the kind and sizes measured, the model (its directory and its files' sizes
and times), backend, kernels, dtype, device, slots, context, threads, and the versions of deepinfer and
torch. A cache that cannot be read or written is passed over: the profile is measured as before.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import tempfile
from pathlib import Path

from .spec_decode import StepCostProfile

log = logging.getLogger("deepinfer")

#: where profiles are kept (a directory); unset: the user's cache directory
CACHE_DIR_ENV = "DEEPINFER_CACHE_DIR"
#: bumped when the file's layout changes
FORMAT = 1


def cache_dir() -> Path:
    """The directory profiles are kept in."""
    root = os.environ.get(CACHE_DIR_ENV)
    if root:
        return Path(root) / "profiles"
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "deepinfer" / "profiles"


def model_fingerprint(model_dir: Path) -> tuple[str, ...]:
    """The model's directory and each file's name, size and modification time (a changed checkpoint is
    another model)."""
    entries = []
    for path in sorted(p for p in Path(model_dir).iterdir() if p.is_file()):
        stat = path.stat()
        entries.append(f"{path.name}:{stat.st_size}:{stat.st_mtime_ns}")
    return (str(Path(model_dir).resolve()), *entries)


class ProfileCache:
    """Profiles by key: this process's, then the directory's."""

    def __init__(self, directory: Path | None = None) -> None:
        self.directory = directory
        self._memory: dict[str, StepCostProfile] = {}

    def _path(self, digest: str) -> Path:
        return (self.directory or cache_dir()) / f"{digest}.json"

    @staticmethod
    def digest(key: tuple) -> str:
        return hashlib.sha256(json.dumps([FORMAT, *map(str, key)]).encode()).hexdigest()[:32]

    def get(self, key: tuple) -> StepCostProfile | None:
        digest = self.digest(key)
        found = self._memory.get(digest)
        if found is not None:
            return found
        try:
            data = json.loads(self._path(digest).read_text())
            found = StepCostProfile(tuple(int(t) for t in data["tokens"]), tuple(float(s) for s in data["seconds"]))
        except (OSError, ValueError, KeyError, TypeError):
            return None
        self._memory[digest] = found
        return found

    def put(self, key: tuple, profile: StepCostProfile) -> None:
        """Keep ``profile`` here and on disk (atomically: a reader sees the whole file or none)."""
        digest = self.digest(key)
        self._memory[digest] = profile
        path = self._path(digest)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=path.parent, suffix=".tmp", delete=False) as f:
                json.dump({"tokens": list(profile.tokens), "seconds": list(profile.seconds)}, f)
            os.replace(f.name, path)
        except OSError as exc:
            log.debug("the cost profile could not be kept in %s: %s", path.parent, exc)
