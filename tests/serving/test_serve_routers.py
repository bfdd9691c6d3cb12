"""The routers the field runs (``vllm-router``, ``sglang-router`` from PyPI) in front of ``deepinfer serve``,
unchanged: they register the workers, route completions and streams, and spread requests over replicas."""

from __future__ import annotations

import re

import httpx
import pytest
from openai import OpenAI

from tests.helpers.routers import router
from tests.helpers.servers import running_server

pytestmark = pytest.mark.slow

PROMPT = "def read_file(path):"


def _generated(url: str) -> float:
    text = httpx.get(url + "/metrics", timeout=30).text
    return float(re.search(r"^deepinfer:generation_tokens_total\S* (\S+)$", text, re.M).group(1))


@pytest.mark.parametrize("kind", ["vllm", "sglang"])
def test_router_routes_completions_and_streams(kind, tmp_path):
    with running_server([]) as server, router(kind, [server.url], "cache_aware", tmp_path / "router.log") as url:
        direct = OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)
        routed = OpenAI(base_url=url + "/v1", api_key="x", max_retries=0, timeout=120)
        expected = direct.completions.create(model="tiny-v4", prompt=PROMPT, max_tokens=16, temperature=0.0).choices[0].text
        assert routed.completions.create(model="tiny-v4", prompt=PROMPT, max_tokens=16, temperature=0.0).choices[0].text == expected
        chunks = routed.chat.completions.create(model="tiny-v4", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                                                temperature=0.0, stream=True)
        streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        whole = direct.chat.completions.create(model="tiny-v4", messages=[{"role": "user", "content": "hi"}], max_tokens=12,
                                               temperature=0.0)
        assert streamed == whole.choices[0].message.content


def test_round_robin_spreads_requests_over_replicas(tmp_path):
    with running_server([]) as a, running_server([]) as b, router("vllm", [a.url, b.url], "round_robin", tmp_path / "router.log") as url:
        before = [_generated(a.url), _generated(b.url)]
        for i in range(6):
            r = httpx.post(url + "/v1/completions", json={"model": "tiny-v4", "prompt": f"{PROMPT} {i}", "max_tokens": 4,
                                                         "ignore_eos": True, "temperature": 0.0}, timeout=120)
            assert r.status_code == 200, r.text
        after = [_generated(a.url), _generated(b.url)]
        assert all(x - y >= 4 for x, y in zip(after, before)), (before, after)
