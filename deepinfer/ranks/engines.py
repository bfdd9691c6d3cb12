"""The engine ``LLM`` runs: one process, spawned expert-parallel ranks, or this process as a torchrun rank."""

from __future__ import annotations

from ..config import EngineConfig
from ..engine import Engine
from ..engine_client import EngineClient
from ..errors import ConfigError
from ..lifetime import die_with_parent
from .launch import torchrun_rank

#: under torchrun, how long ranks other than 0 wait for rank 0's next tick (rank 0's caller may pause)
TORCHRUN_CONTROL_TIMEOUT_S = 24 * 3600.0


def make_engine(config: EngineConfig) -> EngineClient:
    """``Engine`` for one rank; ``ExpertParallelEngine`` when ``expert_parallel_size > 1`` or torchrun
    started this process. Under torchrun every process builds its rank; ranks other than 0 serve rank 0's
    ticks and exit when it shuts down, so only rank 0 returns."""
    place = torchrun_rank()
    if place is None and config.expert_parallel_size == 1:
        return Engine(config)
    from .front import ExpertParallelEngine

    if place is None:
        return ExpertParallelEngine(config)
    die_with_parent()  # a torchrun rank (an ``LLM``'s process) dies with torchrun's agent; idempotent where ``serve`` did it
    if config.expert_parallel_size not in (1, place.world_size):
        raise ConfigError(
            f"--ep {config.expert_parallel_size} differs from torchrun's world size {place.world_size}; drop --ep or match it"
        )
    config = config.model_copy(update={"expert_parallel_size": place.world_size})
    from .rank_engine import build_rank

    server = build_rank(config, place, control_timeout_s=TORCHRUN_CONTROL_TIMEOUT_S)
    if place.rank != 0:
        server.serve()
        server.close()
        raise SystemExit(0)
    return ExpertParallelEngine(config, server)
