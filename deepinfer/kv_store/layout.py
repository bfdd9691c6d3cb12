"""Where blocks live in a store directory: ``ROOT/<class>/<fingerprint>/<hh>/<hash>.kvb``.

The retention class is the top level so that pruning a class walks one tree;
the fingerprint (model, dtype, block size, kernels) keeps engines that must not
share state apart; ``hh`` (the hash's first two hex digits) keeps directories
small.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from .block_file import SUFFIX, TMP_SUFFIX
from .policy import CLASS_NAME


def block_path(root: Path, cache_class: str, fingerprint: str, block_hash: int) -> Path:
    name = f"{block_hash:032x}"
    return root / cache_class / fingerprint / name[:2] / f"{name}{SUFFIX}"


@dataclass(frozen=True)
class StoredFile:
    path: Path
    fingerprint: str
    size: int
    #: last use (written or read), seconds since the epoch
    mtime: float
    temporary: bool = False


#: a fingerprint directory's name
FINGERPRINT = re.compile(r"^[0-9a-f]{32}$")


def class_names(root: Path) -> list[str]:
    """The class directories under ``root``: those holding a fingerprint directory (other entries of a
    shared mount are not the store's)."""
    try:
        entries = [e for e in os.scandir(root) if e.is_dir() and CLASS_NAME.match(e.name)]
    except OSError:
        return []
    return sorted(e.name for e in entries if any(FINGERPRINT.match(d.name) for d in _dirs(Path(e.path))))


def class_files(root: Path, cache_class: str) -> Iterator[StoredFile]:
    """Every block file (and leftover temporary file) of one class; files that vanish meanwhile are skipped."""
    for fp in _dirs(root / cache_class):
        for shard in _dirs(fp):
            try:
                entries = list(os.scandir(shard))
            except OSError:
                continue
            for e in entries:
                temporary = e.name.endswith(TMP_SUFFIX)
                if not (temporary or e.name.endswith(SUFFIX)):
                    continue
                try:
                    st = e.stat()
                except OSError:
                    continue
                yield StoredFile(Path(e.path), fp.name, st.st_size, st.st_mtime, temporary)


def _dirs(path: Path) -> list[Path]:
    try:
        return [Path(e.path) for e in os.scandir(path) if e.is_dir()]
    except OSError:
        return []
