"""One rank of the communicator suite: ``python -m deepinfer_conformance.comm_worker RANK CONFIG.json``.

It builds the backend's communicator through the plugin registry, runs every case of
``comm_cases`` in order, and appends one JSON line per case to its report file, so
whatever it finished is known even if a later collective hangs.
"""

from __future__ import annotations

import importlib
import json
import sys
from typing import Any, TextIO


def _load_class(path: str) -> type:
    module, _, qualname = path.partition(":")
    obj: Any = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    return obj


def _report(out: TextIO, case: int | str, status: str, message: str = "") -> None:
    out.write(json.dumps({"case": case, "status": status, "message": message}) + "\n")
    out.flush()


def run(rank: int, cfg: dict[str, Any]) -> None:
    """Run every case as ``rank`` of ``cfg['world']``, reporting to ``<scratch>/rank<rank>.jsonl``."""
    sys.path[:0] = [p for p in cfg["sys_path"] if p not in sys.path]
    import dataclasses

    import torch

    from deepinfer.registry import select_backend
    from deepinfer_interfaces.errors import first_line

    from .comm_cases import Context, comm_cases

    torch.set_num_threads(1)
    world = cfg["world"]
    with open(f"{cfg['scratch']}/rank{rank}.jsonl", "w") as out:
        try:
            selected = select_backend(cfg["backend"], cfg["kernels"], cfg["interpret"])
            if cfg["communicator"]:
                selected = dataclasses.replace(selected, communicator_cls=_load_class(cfg["communicator"]))
            if selected.device.type != "cpu":
                selected.device.set_device(rank)
            comm = selected.make_communicator(rank, world, cfg["init_method"])
            ctx = Context(rank, world, selected.device.torch_device, cfg["scratch"])
        except Exception as exc:
            _report(out, "fatal", "error", f"could not build the communicator: {first_line(exc)}")
            return
        for index, case in enumerate(comm_cases(world)):
            try:
                problem = case.run(comm, ctx)
                _report(out, index, "pass" if problem is None else "fail", problem or "")
            except Exception as exc:  # reported per case; the next cases still run
                _report(out, index, "error", first_line(exc))
        comm.close()
        _report(out, "done", "pass")


if __name__ == "__main__":
    with open(sys.argv[2]) as f:
        run(int(sys.argv[1]), json.load(f))
