"""The installed package's version (what ``/server_info`` reports and what keys cached profiles)."""

from __future__ import annotations


def package_version() -> str:
    """deepinfer's version, or ``unknown`` for a source tree without package metadata."""
    try:
        from importlib.metadata import version

        return version("deepinfer")
    except Exception:  # noqa: BLE001 - a source checkout without metadata
        return "unknown"
