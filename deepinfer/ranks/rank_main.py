"""Entry point of a spawned rank (``python -m deepinfer.ranks.rank_main``; see ``launch.spawn_ranks``)."""

from __future__ import annotations

import json
import os
import sys
import traceback


def main() -> int:
    from ..lifetime import die_with_parent
    from .launch import SPEC_ENV, RankPlace, connect_front, failure_line, lead

    spec = json.loads(os.environ[SPEC_ENV])
    parent = spec.get("parent") or {}
    die_with_parent(parent.get("pid"), parent_thread_lives=parent.get("thread_lives", True))  # no rank outlives its front's process
    place = RankPlace(**spec["place"])
    conn = connect_front(spec)
    try:
        import torch

        torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
        from ..config import EngineConfig
        from .rank_engine import build_rank

        server = build_rank(EngineConfig.model_validate_json(spec["config"]), place)
        if place.rank == 0:
            lead(server, conn)
        else:
            server.serve()
        server.close()
        return 0
    except BaseException as exc:  # noqa: BLE001 - every failure becomes one line for the front
        traceback.print_exc()
        try:
            conn.send(("error", failure_line(exc)))
        except OSError:
            pass
        return 1


if __name__ == "__main__":
    sys.exit(main())
