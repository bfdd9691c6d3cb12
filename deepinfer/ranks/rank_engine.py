"""Building one rank: its device, data communicator, control group, expert sharding and engine."""

from __future__ import annotations

import torch.distributed as dist

from ..config import EngineConfig
from ..engine import Engine, resolve_model_dir
from ..expert_parallel.eplb import EPLBSettings
from ..expert_parallel.sharding import ExpertParallel
from ..loader import read_config
from ..net import advertised_host, answer_probes, collective_interfaces, is_loopback
from ..registry import select_backend
from .launch import RankPlace
from .rank_server import RankServer, control_group
from ..models.registry import parse_config


def eplb_settings(config: EngineConfig, num_nodes: int = 1) -> EPLBSettings:
    """The balancer's settings from the engine config."""
    return EPLBSettings(
        num_redundant=config.num_redundant_experts, interval=config.eplb_interval, window=config.eplb_window, num_nodes=num_nodes
    )


def build_rank(config: EngineConfig, place: RankPlace, control_timeout_s: float | None = None) -> RankServer:
    """This process as rank ``place.rank``: every rank must call it (the groups are created collectively)."""
    backend = select_backend(config.backend, config.kernels, config.interpret)
    if backend.device.type != "cpu":
        backend.device.set_device(place.local_rank)
    if place.rendezvous_host is not None:  # across machines: offer the peers the interface that reaches them
        collective_interfaces(place.rendezvous_host, backend.device.dist_backend)
    comm = backend.make_communicator(place.rank, place.world_size, place.init_method, timeout_s=config.ep_timeout_s)
    group = control_group(control_timeout_s or config.ep_timeout_s)
    model_config = parse_config(read_config(resolve_model_dir(config.model)))
    sharding = ExpertParallel(
        comm, model_config.num_hidden_layers, model_config.n_routed_experts, model_config.num_experts_per_tok,
        backend.device.torch_device, eplb_settings(config, place.num_nodes), deterministic=config.deterministic,
    )
    peers = None
    if place.rendezvous_host is not None and not is_loopback(place.rendezvous_host):  # across machines: name a lost rank
        peers = [None] * place.world_size
        address = advertised_host(None, None, peer=place.rendezvous_host)
        dist.all_gather_object(peers, (address, answer_probes(address)), group=group)
    server = RankServer(Engine(config, backend, sharding), group, peers, config.ep_timeout_s)
    if peers is not None:
        server.watch_peers()
    return server
