"""``deepinfer kv-store stats DIR`` and ``deepinfer kv-store prune DIR``: what a KV store holds, and trimming it
by its retention classes (those the engines last wrote there, or the ones given)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from ..errors import ConfigError
from .maintenance import prune, summarize
from .policy import StorePolicy


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="kv_store_command", required=True)
    p = sub.add_parser("stats", help="blocks, bytes and ages of last use per retention class")
    p.add_argument("dir", help="the kv_store directory")
    p.add_argument("--json", action="store_true", help="print one JSON object: class -> files, bytes, ages, rules")
    p.set_defaults(func=_cmd_stats)
    p = sub.add_parser("prune", help="delete expired blocks, then the least recently used past each class's capacity")
    p.add_argument("dir", help="the kv_store directory")
    p.add_argument(
        "--retention", metavar="JSON",
        help="classes and how long an unused block is kept, e.g. '{\"chat\": \"7d\", \"agent\": \"3d\"}' (default: the store's retention.json)",
    )
    p.add_argument("--capacity", metavar="SIZE|JSON", help="bytes per class: one size for all ('80GB') or JSON class -> size")
    p.add_argument("--class", dest="only", metavar="NAME", help="prune this class alone")
    p.add_argument("--json", action="store_true", help="print one JSON object: per class files kept, expired, evicted")
    p.set_defaults(func=_cmd_prune)


def _root(args: argparse.Namespace) -> Path:
    root = Path(args.dir).expanduser()
    if not root.is_dir():
        raise ConfigError(f"kv-store directory {root} does not exist; give the directory an engine's kv_store names")
    return root


def _json_arg(flag: str, text: str) -> object:
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        raise ConfigError(f"{flag} {text!r} is not JSON; write for example '{{\"chat\": \"7d\"}}'") from None


def _policy(args: argparse.Namespace, root: Path) -> StorePolicy:
    """The rules given as flags, else the store's own."""
    if args.retention is None:
        if args.capacity is not None:
            raise ConfigError("--capacity needs --retention (the classes it limits)")
        policy = StorePolicy.load(root)
        if policy is None:
            raise ConfigError(f"{root} has no readable retention.json (no engine wrote to it); give --retention '{{\"default\": \"7d\"}}'")
        return policy
    retention = _json_arg("--retention", args.retention)
    if not isinstance(retention, dict):
        raise ConfigError("--retention must be a JSON object of class -> duration, e.g. '{\"chat\": \"7d\"}'")
    capacity = args.capacity
    if capacity is not None and capacity.strip().startswith("{"):
        capacity = _json_arg("--capacity", capacity)
    try:
        return StorePolicy.build(retention, capacity, None)
    except ValueError as exc:
        raise ConfigError(str(exc).splitlines()[0]) from None


def _age(seconds: float | None) -> str:
    if seconds is None:
        return "-"
    for unit, scale in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= scale:
            return f"{seconds / scale:.1f}{unit}"
    return f"{seconds:.0f}s"


def _cmd_stats(args: argparse.Namespace) -> int:
    root = _root(args)
    policy = StorePolicy.load(root)
    classes = summarize(root, policy)
    if args.json:
        print(json.dumps({"dir": str(root), "default_class": policy.default_class if policy else None,
                          "classes": {k: asdict(v) for k, v in classes.items()}}))
        return 0
    print(f"{'class':<16} {'blocks':>8} {'bytes':>14} {'models':>7} {'oldest use':>11} {'newest use':>11} {'retention':>10} {'capacity':>14}")
    for name, s in classes.items():
        cap = "-" if s.capacity_bytes is None else f"{s.capacity_bytes:,}"
        print(f"{name:<16} {s.files:>8} {s.bytes:>14,} {s.fingerprints:>7} {_age(s.oldest_use_s):>11} {_age(s.newest_use_s):>11} "
              f"{_age(s.ttl_seconds):>10} {cap:>14}")
    if policy is None:
        print("no retention.json: no engine has written here yet")
    return 0


def _cmd_prune(args: argparse.Namespace) -> int:
    root = _root(args)
    report = prune(root, _policy(args, root), only=args.only)
    if args.json:
        print(json.dumps(report.as_dict()))
        return 0
    print(f"{'class':<16} {'kept':>8} {'kept bytes':>14} {'expired':>8} {'evicted':>8} {'freed bytes':>14}")
    for c in report.classes:
        print(f"{c.cache_class:<16} {c.kept_files:>8} {c.kept_bytes:>14,} {c.expired_files:>8} {c.evicted_files:>8} "
              f"{c.expired_bytes + c.evicted_bytes:>14,}")
    for name in report.unmanaged:
        print(f"{name:<16} left alone: no retention rule names it")
    return 0
