"""Where the Engram tables live while the model runs (``EngineConfig.engram_tables``).

- ``mapped``: the checkpoint's file mappings, as loaded. On a device other than
  the host a lookup gathers its rows on the host, a synchronisation, so decode
  steps run eagerly.
- ``host``: host memory the device reads in place (``Device.map_host``: pinned
  memory under unified addressing on CUDA), so the lookup kernel gathers rows
  inside a captured graph; refused on a device that cannot.
- ``device``: copied into device memory; refused when it does not fit.
- ``auto``: mapped where the tables already are the model's device memory (the
  host CPU), else host where the device maps host memory, else device where the
  tables fit in ``DEVICE_SHARE`` of its free memory, else mapped (eager, for the
  reason the placement records).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from deepinfer_interfaces import Device

from ...errors import ConfigError
from .engram import EngramTable

#: the choices of ``EngineConfig.engram_tables``
Placement = Literal["auto", "mapped", "host", "device"]
#: the most of the device's free memory ``auto`` gives the tables (the KV cache takes its share of what is left)
DEVICE_SHARE = 0.25
_GIB = float(1 << 30)


@dataclass(frozen=True)
class TablePlacement:
    """Where the tables went, and why (one line, for the log and for why decode graphs are off)."""

    where: Literal["mapped", "host", "device"]
    reason: str
    nbytes: int

    def describe(self) -> str:
        return f"Engram tables ({self.nbytes / _GIB:.2f} GiB): {self.where} ({self.reason})"


def place_tables(
    tables: list[EngramTable], asked: Placement, device: Device
) -> tuple[list[EngramTable], TablePlacement]:
    """``tables`` where ``asked`` puts them on ``device``; a one-line ``ConfigError`` when that cannot be."""
    nbytes = sum(t.nbytes() for t in tables)
    target = device.torch_device
    if asked == "mapped":
        return tables, TablePlacement("mapped", "engram_tables=mapped", nbytes)
    if asked == "auto" and all(t.codes.device == target for t in tables):
        return tables, TablePlacement("mapped", f"{device.type} reads the file mappings in place", nbytes)
    if asked in ("host", "auto"):
        mapped = _map_host(tables, device)
        if mapped is not None:
            return mapped, TablePlacement("host", f"{device.type} reads host memory in place", nbytes)
        if asked == "host":
            raise ConfigError(
                f"engram_tables=host needs a device that reads host memory in place, and {device.describe()} cannot "
                "(Device.map_host); use engram_tables=device (copied onto the device) or mapped (eager decoding)"
            )
    free, _ = device.memory_info()
    if asked == "device":
        if nbytes > free:
            raise ConfigError(
                f"engram_tables=device: the Engram tables take {nbytes / _GIB:.2f} GiB and {device.describe()} has "
                f"{free / _GIB:.2f} GiB free; use engram_tables=host or mapped"
            )
        return [_on_device(t, target) for t in tables], TablePlacement("device", "engram_tables=device", nbytes)
    if nbytes <= DEVICE_SHARE * free:
        return [_on_device(t, target) for t in tables], TablePlacement(
            "device", f"{device.type} cannot read host memory in place; they fit in {DEVICE_SHARE:.0%} of its free memory", nbytes
        )
    return tables, TablePlacement(
        "mapped",
        f"{device.type} cannot read host memory in place and they exceed {DEVICE_SHARE:.0%} of its "
        f"{free / _GIB:.2f} GiB free; engram_tables=device copies them anyway",
        nbytes,
    )


def _map_host(tables: list[EngramTable], device: Device) -> list[EngramTable] | None:
    """Each table as host memory the device reads in place, or None where it cannot."""
    out = []
    for table in tables:
        codes = device.map_host(table.codes)
        if codes is None:
            return None
        scales = device.map_host(table.scales) if table.scales is not None else None
        out.append(table if codes is table.codes else EngramTable(codes, scales))
    return out


def _on_device(table: EngramTable, target: torch.device) -> EngramTable:
    scales = table.scales.to(target) if table.scales is not None else None
    return EngramTable(table.codes.to(target), scales)
