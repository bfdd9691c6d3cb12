"""Disaggregated serving in tests: the shared request body and prompts, a server's counter from ``/metrics``,
and one request prefilled on one server and decoded on another the way vLLM's router drives them."""

from __future__ import annotations

import re

import httpx

BODY = {"model": "tiny-v4", "max_tokens": 24, "temperature": 0.0, "ignore_eos": True}
PROMPTS = ["def read_file(path):", "import numpy as np\n" * 12]


def metric(url: str, name: str) -> float:
    """The first sample of ``deepinfer:<name>`` on the server's ``/metrics``."""
    text = httpx.get(url + "/metrics", timeout=30).text
    return float(re.search(rf"^deepinfer:{name}\S* (\S+)$", text, re.M).group(1))


def prefill_then_decode(prefill_url: str, decode_url: str, prompt: str, before_decode=None) -> httpx.Response:
    """Prefill (``max_tokens`` 1, ``do_remote_decode``), then decode with the prefill answer's ``kv_transfer_params``;
    ``before_decode`` runs in between (a fault to inject). The decode response."""
    first = httpx.post(prefill_url + "/v1/completions", json={**BODY, "prompt": prompt, "max_tokens": 1,
                                                              "kv_transfer_params": {"do_remote_decode": True}}, timeout=120)
    assert first.status_code == 200, first.text
    params = first.json()["kv_transfer_params"]
    if before_decode is not None:
        before_decode()
    return httpx.post(decode_url + "/v1/completions", json={**BODY, "prompt": prompt, "kv_transfer_params": params}, timeout=120)
