"""Retention classes of the KV store: how long an unused block is kept, and how many bytes a class may hold.

A class is named by requests (``SamplingParams.cache_class``); the engine
writes the policy it runs with next to the blocks (``retention.json``) so that
``deepinfer kv-store prune DIR`` applies the same rules without the engine's
configuration.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

POLICY_FILE = "retention.json"
CLASS_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")

_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(s|m|h|d|w)?\s*$", re.IGNORECASE)
_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgtp]?)(i?)b?\s*$", re.IGNORECASE)


def parse_duration(value: str | int | float) -> float:
    """Seconds in ``"7d"``, ``"36h"``, ``"90m"``, ``"45s"``, ``"2w"`` or a plain number of seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    else:
        m = _DURATION.match(str(value))
        if m is None:
            raise ValueError(f"{value!r} is not a duration; write a number with s, m, h, d or w (for example '7d')")
        seconds = float(m.group(1)) * _SECONDS[(m.group(2) or "s").lower()]
    if seconds <= 0:
        raise ValueError(f"retention {value!r} must be longer than zero")
    return seconds


def parse_size(value: str | int) -> int:
    """Bytes in ``"80GB"``, ``"512MiB"``, ``"1.5T"`` or a plain number of bytes (k/M/G/T/P: powers of 1024)."""
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    else:
        m = _SIZE.match(str(value))
        if m is None:
            raise ValueError(f"{value!r} is not a size; write bytes or a number with K, M, G, T or P (for example '80GB')")
        size = int(float(m.group(1)) * 1024 ** " kmgtp".index((m.group(2) or " ").lower()))
    if size <= 0:
        raise ValueError(f"capacity {value!r} must be more than zero bytes")
    return size


def check_class_name(name: str) -> str:
    if not CLASS_NAME.match(name):
        raise ValueError(f"cache class {name!r} is not a valid name; use letters, digits, '_', '-' or '.' (at most 64)")
    return name


class ClassPolicy(BaseModel):
    """One retention class: blocks unused for ``ttl_seconds`` expire; past ``capacity_bytes`` the least
    recently used go first (None: no limit)."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    ttl_seconds: float = Field(gt=0)
    capacity_bytes: int | None = Field(None, gt=0)


class StorePolicy(BaseModel):
    """Every retention class, and the one a request without ``cache_class`` uses."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    classes: dict[str, ClassPolicy]
    default_class: str

    @classmethod
    def build(
        cls, retention: dict[str, str | int | float], capacity: dict[str, str | int] | str | int | None, default_class: str | None
    ) -> "StorePolicy":
        """From the engine's ``kv_store_retention``, ``kv_store_capacity`` (one size for every class, or
        one per class) and ``kv_store_default_class`` (None: the first class)."""
        if not retention:
            raise ValueError("kv_store_retention needs at least one class, for example {'default': '7d'}")
        per_class = capacity if isinstance(capacity, dict) else {name: capacity for name in retention}
        unknown = sorted(set(per_class) - set(retention))
        if unknown:
            raise ValueError(f"kv_store_capacity names class {unknown[0]!r} that kv_store_retention does not define")
        classes = {
            check_class_name(name): ClassPolicy(
                ttl_seconds=parse_duration(ttl),
                capacity_bytes=None if per_class.get(name) is None else parse_size(per_class[name]),
            )
            for name, ttl in retention.items()
        }
        default = default_class or next(iter(classes))
        if default not in classes:
            raise ValueError(f"kv_store_default_class {default!r} is not a kv_store_retention class ({', '.join(classes)})")
        return cls(classes=classes, default_class=default)

    def class_for(self, requested: str | None) -> str:
        """The class a request writes to: its own, or the default."""
        name = requested or self.default_class
        if name not in self.classes:
            raise ValueError(f"cache_class {name!r} is not a retention class of the KV store (known: {', '.join(self.classes)}); use one of them")
        return name

    def save(self, root: Path) -> None:
        from .block_file import write_atomic

        write_atomic(root / POLICY_FILE, self.model_dump_json(indent=2).encode())

    @classmethod
    def load(cls, root: Path) -> "StorePolicy | None":
        """The policy last written to ``root`` by an engine, or None (none written, or unreadable)."""
        try:
            return cls.model_validate(json.loads((root / POLICY_FILE).read_text()))
        except (OSError, ValueError):
            return None


def store_policy(config: Any) -> StorePolicy:
    """The retention policy an ``EngineConfig`` asks for (its ``kv_store_*`` fields)."""
    return StorePolicy.build(config.kv_store_retention, config.kv_store_capacity, config.kv_store_default_class)
