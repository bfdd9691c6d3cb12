"""Deterministic mode through ``deepinfer serve``: a colocated server (its own batches and adaptive speculation,
the probe sent among other requests) and a PD pair give the offline engine's token ids and logprobs bit for bit
for the probe (greedy, and seeded at temperature 0.8 with ``n = 3``): the decode side continues exactly where
the prefill side stopped, its first token's logprobs included. (EP 2 is checked offline, in
``tests/engine/test_deterministic.py``: a server at EP 2 takes half a minute to start on this machine.)"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from contextlib import ExitStack

import httpx
import pytest

from deepinfer import LLM, SamplingParams
from deepinfer.serve.deltas import completion_logprobs, decoder
from tests.helpers.servers import ServerProcess

PROMPT = "def read_file(path):\n    with open(path) as f:\n        return f.read()\n\nclass Cache:\n    def get(self, key):"
SEED = 20261207
TOKENS = 12
BODY = {"model": "tiny-v4", "prompt": PROMPT, "max_tokens": TOKENS, "ignore_eos": True, "logprobs": 3}
GREEDY = {**BODY, "temperature": 0.0}
SEEDED = {**BODY, "temperature": 0.8, "seed": SEED}


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    """A prefill server, a decode server and a colocated server, all deterministic, started side by side."""
    log_dir = tmp_path_factory.mktemp("deterministic")
    procs = [ServerProcess(["--deterministic", *args], log_dir=log_dir) for args in
             (["--disaggregation-mode", "prefill"], ["--disaggregation-mode", "decode"], [])]
    with ExitStack() as stack:
        for p in procs:
            stack.callback(p.close)
        with ThreadPoolExecutor(len(procs)) as pool:
            for started in [pool.submit(p.start) for p in procs]:
                started.result()
        yield procs


@pytest.fixture(scope="module")
def offline() -> dict[str, list[dict]]:
    """The offline engine's choices (text and completions-API logprobs), alone and without speculation."""
    llm = LLM(backend="cpu", deterministic=True, speculative_method=None, max_model_len=256, max_num_seqs=4)
    decode = decoder(llm.get_tokenizer())
    greedy, seeded = llm.generate([PROMPT, PROMPT], [
        SamplingParams(temperature=0.0, max_tokens=TOKENS, ignore_eos=True, logprobs=3),
        SamplingParams(n=3, temperature=0.8, seed=SEED, max_tokens=TOKENS, ignore_eos=True, logprobs=3)])
    choices = lambda o: [{"text": c.text, "logprobs": completion_logprobs(c.token_ids, c.logprobs, 3, decode, 0)} for c in o.outputs]
    return {"greedy": choices(greedy), "seeded": choices(seeded)}


def _choices(url: str, body: dict) -> list[dict]:
    r = httpx.post(url + "/v1/completions", json=body, timeout=120)
    assert r.status_code == 200, r.text
    return [{"text": c["text"], "logprobs": c["logprobs"]} for c in sorted(r.json()["choices"], key=lambda c: c["index"])]


def _split(prefill: str, decode: str, body: dict) -> list[dict]:
    """Prefill one token on ``prefill`` (holding its state for a remote decode), decode the rest on ``decode``."""
    first = httpx.post(prefill + "/v1/completions", json={**body, "max_tokens": 1, "kv_transfer_params": {"do_remote_decode": True}},
                       timeout=120)
    assert first.status_code == 200, first.text
    return _choices(decode, {**body, "kv_transfer_params": first.json()["kv_transfer_params"]})


def test_colocated_server_among_other_requests_equals_offline(servers, offline):
    url = servers[2].url
    others = [{"model": "tiny-v4", "prompt": f"item {i}: " + "x" * (7 * i), "max_tokens": 4 + 3 * i, "ignore_eos": True,
               "temperature": 0.8 * (i % 2)} for i in range(8)]
    with ThreadPoolExecutor(12) as pool:
        noise = [pool.submit(_choices, url, body) for body in others[:4]]
        greedy = pool.submit(_choices, url, GREEDY)
        seeded = pool.submit(_choices, url, {**SEEDED, "n": 3})
        noise += [pool.submit(_choices, url, body) for body in others[4:]]
        assert greedy.result() == offline["greedy"]
        assert seeded.result() == offline["seeded"]
        assert all(len(f.result()) == 1 for f in noise)


def test_pd_pair_equals_offline(servers, offline):
    prefill, decode = servers[:2]
    assert _split(prefill.url, decode.url, GREEDY) == offline["greedy"]
    assert _split(prefill.url, decode.url, SEEDED) == offline["seeded"][:1]
