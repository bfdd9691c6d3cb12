"""The communicator conformance suite: passes the CPU backend's gloo communicator,
fails a communicator whose dispatch loses a token, and turns a hang into errors."""

from __future__ import annotations

import json
import time

import pytest

from deepinfer_conformance.comm import run_comm
from deepinfer_conformance.comm_cases import comm_cases
from deepinfer_interfaces.distributed import TorchDistributedCommunicator
from tests.helpers.plugins import run_cli

VERBS = {"all_reduce", "all_gather", "reduce_scatter", "all_to_all", "broadcast", "barrier", "subgroup", "dispatch", "combine"}


class DropLastToken(TorchDistributedCommunicator):
    """Dispatch forgets each rank's last token: it is never sent to any expert."""

    def dispatch(self, hidden, topk_ids, topk_weights, expert_rank, expert_local, capacity=None):
        ids = topk_ids.clone()
        ids[-1:] = -1
        return super().dispatch(hidden, ids, topk_weights, expert_rank, expert_local, capacity)


class HangingBarrier(TorchDistributedCommunicator):
    """Rank 0 never reaches the barrier, so the other ranks wait in it forever."""

    def barrier(self) -> None:
        if self.rank == 0:
            time.sleep(3600)
        super().barrier()


def test_cli_comm_suite_passes_on_cpu(tmp_path):
    report = tmp_path / "comm.json"
    proc = run_cli(["conformance", "--backend", "cpu", "--suite", "comm", "--report", str(report)], timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    results = json.loads(report.read_text())["results"]
    assert len(results) == len(comm_cases(2)) + len(comm_cases(4))
    assert {r["suite"] for r in results} == {"comm"} and {r["op"] for r in results} == VERBS
    assert {r["case"].split("_")[0] for r in results} == {"world2", "world4"}
    assert {"world4_uneven", "world4_empty_sends", "world4_large_uneven", "world2_skewed", "world4_skewed_fixed_capacity"} <= {r["case"] for r in results}
    assert all(r["status"] == "pass" for r in results), [r for r in results if r["status"] != "pass"]


def test_dispatch_that_drops_a_token_fails():
    results = run_comm("cpu", communicator_cls=DropLastToken, world_sizes=(2,))
    bad = {(r.op, r.case, r.dtype): r for r in results if r.status != "pass"}
    assert {op for op, _, _ in bad} == {"dispatch", "combine"}
    assert all(r.status == "fail" for r in bad.values()), [r.message for r in bad.values()]
    assert ("dispatch", "world2_uneven", "bfloat16") in bad and ("combine", "world2_skewed", "float32") in bad
    assert ("dispatch", "world2_uneven_fixed_capacity", "float32") in bad and ("combine", "world2_skewed_fixed_capacity", "float32") in bad
    assert "received" in bad[("dispatch", "world2_uneven", "float32")].message
    assert "combined hidden" in bad[("combine", "world2_uneven", "float32")].message


def test_hanging_verb_becomes_errors_after_timeout():
    start = time.monotonic()
    results = run_comm("cpu", communicator_cls=HangingBarrier, world_sizes=(2,), timeout=10)
    assert time.monotonic() - start < 30
    ops = [r.op for r in results]
    first_barrier = ops.index("barrier")
    assert all(r.status == "pass" for r in results[:first_barrier]), [r for r in results[:first_barrier] if r.status != "pass"]
    hung = results[first_barrier]
    assert hung.status == "error" and "timed out after 10 s" in hung.message
    assert all(r.status == "error" for r in results[first_barrier:])


def test_communicator_class_must_be_importable():
    class Local(TorchDistributedCommunicator):
        pass

    with pytest.raises(ValueError, match="top level of an importable module"):
        run_comm("cpu", communicator_cls=Local, world_sizes=(2,))
    with pytest.raises(ValueError, match="world sizes of at least 2"):
        run_comm("cpu", world_sizes=(1,))

