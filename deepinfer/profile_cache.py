"""Start-up cost profiles kept across processes, so an engine does not time its forwards again at every start.

A profile (``StepCostProfile``: seconds a forward or a draft pass takes at each size) is the adaptive
speculation policy's prior; the engine corrects it online from the steps it runs (``LiveCosts``), so a
prior measured once per machine and setting serves every later engine of that setting. Profiles are
kept in memory for this process and as one JSON file each under ``$DEEPINFER_CACHE_DIR/profiles`` (else
``$XDG_CACHE_HOME/deepinfer/profiles``, else ``~/.cache/deepinfer/profiles``), named by a digest of
everything that shapes them: the kind and sizes measured, the model (its directory and its files' sizes
and times), backend, kernels, dtype, device, slots, context, threads, and the versions of deepinfer and
torch. A cache that cannot be read or written is passed over: the profile is measured as before.

A profile timed while the machine was busy is too slow, and a cache would keep it so. ``OnlineBound``
checks a profile against the steps the engine then runs: a step of ``t`` tokens that took ``s`` seconds
bounds the cost of every size up to ``t``; where the profile is well above those bounds it is lowered to
them, in this process and in the cache, so the next start begins from the corrected prior.
"""

from __future__ import annotations

import bisect
import hashlib
import json
import logging
import math
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


#: steps observed between two checks of a profile against them
CHECK_EVERY = 32
#: a profile point more than this many times the engine's observed bound there is corrected
DISAGREE = 1.25


class OnlineBound:
    """A start-up profile checked against observed steps (or draft passes) of its kind. Costs grow with size,
    so an observed ``(tokens, seconds)`` bounds the profile at every point up to ``tokens`` (the observed time
    also holds the host's work, so it never bounds too low). Every ``CHECK_EVERY`` observations, points above
    ``DISAGREE`` times their bound are lowered to it and the corrected profile replaces the cached one. A
    step slower than the profile raises nothing: that is the machine's load now, which the live costs follow."""

    def __init__(self, what: str, profile: StepCostProfile, key: tuple | None, cache: ProfileCache) -> None:
        self.what = what
        self.profile = profile
        self.key = key
        self.cache = cache
        #: the fastest observation at each profile point's size or above, kept at the largest point it covers
        self._fastest = [math.inf] * len(profile.tokens)
        self._seen = 0
        self.corrections = 0

    def observe(self, tokens: int, seconds: float) -> StepCostProfile | None:
        """One observation; the corrected profile when this one's check lowered it, else None."""
        if tokens < 1 or not math.isfinite(seconds) or seconds <= 0:
            return None
        i = bisect.bisect_right(self.profile.tokens, tokens) - 1
        if i >= 0 and seconds < self._fastest[i]:
            self._fastest[i] = seconds
        self._seen += 1
        return self._check() if self._seen % CHECK_EVERY == 0 else None

    def bounds(self) -> list[float]:
        """Per profile point: the fastest observation at its size or above (inf: none yet)."""
        out, best = [], math.inf
        for fastest in reversed(self._fastest):
            best = min(best, fastest)
            out.append(best)
        return out[::-1]

    def _check(self) -> StepCostProfile | None:
        bounds = self.bounds()
        if not any(s > DISAGREE * b for s, b in zip(self.profile.seconds, bounds)):
            return None
        old = self.profile
        self.profile = StepCostProfile.monotone(old.tokens, [min(s, b) for s, b in zip(old.seconds, bounds)])
        self.corrections += 1
        if self.key is not None:
            self.cache.put(self.key, self.profile)
        log.info("%s corrected from the steps observed (it was timed on a busier machine): %s", self.what,
                 ", ".join(f"{t}: {1e3 * a:.2f} -> {1e3 * b:.2f} ms" for t, a, b in zip(old.tokens, old.seconds, self.profile.seconds) if b < a))
        return self.profile
