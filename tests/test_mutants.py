"""Every mutant kernel set (``tests/mutants.py``) fails op parity on exactly the ops it breaks, and e2e parity.

Each mutant is installed as a real plugin (a dist-info next to a copy of the
module) and checked by ``deepinfer conformance --kernels NAME --suite ops,e2e``
in its own process, every op spec included so that "only the ops it breaks" is
checked against the whole suite (the full op suite takes about a second). The
processes run side by side.

E2E needs a checkpoint where the bug changes the model's output:

- ``mixed`` (every layer type, hash and learned routing) for most;
- ``compressed_yarn`` for the clamp: its ``swiglu_limit`` of 0.3 is active,
  while ``mixed`` keeps transformers' default limit of 10, which its
  activations never reach;
- ``mixed`` with ``rms_norm_eps`` raised to 1e-2 for the missing eps: at the
  default 1e-6 the eps is far below the mean square of every normed vector, so
  dropping it changes the logits by ~1e-6, under any fair fp32 threshold.

The communicator mutant (a dispatch that drops the last token) is covered by
``tests/test_conformance_comm.py::test_dispatch_that_drops_a_token_fails``.
"""

import json
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests import mutants
from tests.helpers.checkpoints import make_tiny_checkpoint
from tests.helpers.published import make_published_checkpoint
from tests.helpers.plugins import make_plugin_dist, run_cli

#: mutant -> (ops whose parity it must fail, checkpoint for e2e)
EXPECTED = {
    "mutant-no-eps": ({"rms_norm"}, "large_eps"),
    "mutant-rope-halves": ({"rope"}, "mixed"),
    "mutant-no-sink": ({"sparse_attention"}, "mixed"),
    "mutant-window-short": ({"sparse_attention"}, "mixed"),
    "mutant-no-route-bias": ({"moe_route"}, "mixed"),
    "mutant-no-renorm": ({"moe_route", "hash_route"}, "mixed"),
    "mutant-no-clamp": ({"swiglu", "moe_experts"}, "compressed_yarn"),
    "mutant-short-sinkhorn": ({"mhc_pre"}, "mixed"),
    "mutant-fp8-last-block-scale": ({"fp8_linear"}, "published"),
    "mutant-fp4-swapped-nibbles": ({"moe_experts_quantized"}, "published"),
}


def test_every_mutant_has_an_expectation():
    assert set(EXPECTED) == set(mutants.MUTANTS)


@pytest.fixture(scope="module")
def plugin_root(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("mutants")
    return make_plugin_dist(
        root,
        "deepinfer-test-mutants",
        {"deepinfer.kernels": {name: f"deepinfer_test_mutants:{cls}" for name, cls in mutants.MUTANTS.items()}},
        {"deepinfer_test_mutants": Path(mutants.__file__).read_text()},
    )


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory) -> dict[str, Path]:
    tmp = tmp_path_factory.mktemp("ckpt")
    mixed = make_tiny_checkpoint(tmp, "mixed")
    large_eps = tmp / "tiny-mixed-eps1e-2"
    shutil.copytree(mixed, large_eps)
    config = json.loads((large_eps / "config.json").read_text())
    config["rms_norm_eps"] = 1e-2
    (large_eps / "config.json").write_text(json.dumps(config))
    return {
        "mixed": mixed, "large_eps": large_eps, "compressed_yarn": make_tiny_checkpoint(tmp, "compressed_yarn"),
        "published": make_published_checkpoint(tmp),
    }


@pytest.fixture(scope="module")
def reports(plugin_root, checkpoints, tmp_path_factory) -> dict[str, tuple[object, dict | None]]:
    out = tmp_path_factory.mktemp("reports")

    def check(name: str):
        report = out / f"{name}.json"
        proc = run_cli(
            ["conformance", "--backend", "cpu", "--kernels", name, "--suite", "ops,e2e",
             "--model", str(checkpoints[EXPECTED[name][1]]), "--report", str(report)],
            extra_path=plugin_root, env={"OMP_NUM_THREADS": "1"},
        )
        return proc, json.loads(report.read_text()) if report.exists() else None

    with ThreadPoolExecutor(max_workers=4) as pool:
        return dict(zip(EXPECTED, pool.map(check, EXPECTED)))


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_mutant_fails_its_ops_and_e2e(name, reports):
    proc, report = reports[name]
    assert report is not None, proc.stdout + proc.stderr
    assert proc.returncode == 1, proc.stdout + proc.stderr
    assert report["kernels"] == name
    rows = report["results"]
    ops_failing = {r["op"] for r in rows if r["suite"] == "ops" and r["status"] == "fail"}
    assert ops_failing == EXPECTED[name][0], [r for r in rows if r["status"] == "fail"][:3]
    assert all(r["status"] == "pass" for r in rows if r["suite"] == "ops" and r["op"] not in EXPECTED[name][0])
    e2e = [r for r in rows if r["suite"] == "e2e"]
    assert e2e and any(r["status"] == "fail" for r in e2e), e2e
    assert all(r["status"] in ("fail", "warn") for r in e2e), e2e
    assert "e2e    greedy" in proc.stdout
