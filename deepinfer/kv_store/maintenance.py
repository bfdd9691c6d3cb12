"""What a store holds and how it is trimmed: ``deepinfer kv-store stats DIR`` and ``... prune DIR``.

Pruning applies each class's rules: a block unused (neither written nor read)
for longer than the class's retention is deleted, then, while the class holds
more than its capacity, the least recently used blocks. Temporary files older
than an hour (a writer that died mid-write) go too. Classes without a rule are
left alone.
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from .layout import StoredFile, class_files, class_names
from .policy import StorePolicy

#: a temporary file this old belongs to a writer that is gone
STALE_TMP_SECONDS = 3600.0


@dataclass
class ClassSummary:
    files: int = 0
    bytes: int = 0
    #: distinct fingerprints (models / settings) with blocks in this class
    fingerprints: int = 0
    oldest_use_s: float | None = None
    newest_use_s: float | None = None
    ttl_seconds: float | None = None
    capacity_bytes: int | None = None


@dataclass
class PruneResult:
    cache_class: str
    kept_files: int = 0
    kept_bytes: int = 0
    expired_files: int = 0
    expired_bytes: int = 0
    evicted_files: int = 0
    evicted_bytes: int = 0
    temporary_files: int = 0


@dataclass
class PruneReport:
    classes: list[PruneResult] = field(default_factory=list)
    #: classes on disk that the policy does not name (left alone)
    unmanaged: list[str] = field(default_factory=list)

    @property
    def deleted_bytes(self) -> int:
        return sum(c.expired_bytes + c.evicted_bytes for c in self.classes)

    def as_dict(self) -> dict[str, Any]:
        return {"classes": [asdict(c) for c in self.classes], "unmanaged": self.unmanaged, "deleted_bytes": self.deleted_bytes}


def summarize(root: Path, policy: StorePolicy | None, now: float | None = None) -> dict[str, ClassSummary]:
    """Per class on disk (and per class the policy names): files, bytes, ages of last use."""
    now = time.time() if now is None else now
    names = sorted(set(class_names(root)) | set(policy.classes if policy else ()))
    out: dict[str, ClassSummary] = {}
    for name in names:
        s = ClassSummary()
        fps: set[str] = set()
        for f in class_files(root, name):
            if f.temporary:
                continue
            s.files += 1
            s.bytes += f.size
            fps.add(f.fingerprint)
            age = max(0.0, now - f.mtime)
            s.oldest_use_s = age if s.oldest_use_s is None else max(s.oldest_use_s, age)
            s.newest_use_s = age if s.newest_use_s is None else min(s.newest_use_s, age)
        s.fingerprints = len(fps)
        rule = policy.classes.get(name) if policy else None
        if rule is not None:
            s.ttl_seconds, s.capacity_bytes = rule.ttl_seconds, rule.capacity_bytes
        out[name] = s
    return out


def prune(root: Path, policy: StorePolicy, now: float | None = None, only: str | None = None) -> PruneReport:
    """Apply ``policy`` to every class under ``root`` (``only``: to that class alone)."""
    now = time.time() if now is None else now
    report = PruneReport()
    for name in class_names(root):
        if only is not None and name != only:
            continue
        rule = policy.classes.get(name)
        if rule is None:
            report.unmanaged.append(name)
            continue
        result = PruneResult(name)
        live: list[StoredFile] = []
        for f in class_files(root, name):
            if f.temporary:
                if now - f.mtime > STALE_TMP_SECONDS and _unlink(f.path):
                    result.temporary_files += 1
            elif now - f.mtime > rule.ttl_seconds:
                if _unlink(f.path):
                    result.expired_files += 1
                    result.expired_bytes += f.size
            else:
                live.append(f)
        total = sum(f.size for f in live)
        if rule.capacity_bytes is not None and total > rule.capacity_bytes:
            live.sort(key=lambda f: f.mtime)
            while live and total > rule.capacity_bytes:
                f = live.pop(0)
                total -= f.size
                if _unlink(f.path):
                    result.evicted_files += 1
                    result.evicted_bytes += f.size
        result.kept_files, result.kept_bytes = len(live), total
        report.classes.append(result)
    return report


def _unlink(path: Path) -> bool:
    try:
        path.unlink()
        return True
    except OSError:  # gone already (another pruner), or not ours to delete
        return False
