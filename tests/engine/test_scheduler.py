"""Scheduler and cache bookkeeping: budgets, chunking, FCFS, preemption, prefix reuse, eviction."""

from deepinfer.block_pool import BlockPool, chain_hashes
from deepinfer.kv_cache_manager import KVCacheManager
from deepinfer.request import Request, RequestStatus
from deepinfer.sampling_params import SamplingParams
from deepinfer.scheduler import Scheduler


def _req(rid, n, first=0):
    return Request(rid, None, list(range(first, first + n)), SamplingParams(max_tokens=4))


class _Chunk:
    """A scheduled record with its request, for readable assertions."""

    def __init__(self, seq, reqs):
        self.request = reqs[seq.request_id]
        self.start, self.num_tokens, self.samples = seq.start, seq.num_tokens, seq.sample is not None


def _step(sched, sampled=7):
    """Run one schedule and pretend the device computed it (the scheduler already counted the tokens)."""
    reqs = {r.request_id: r for r in [*sched.running, *sched.waiting]}
    out = sched.schedule()
    chunks = [_Chunk(s, reqs) for s in out.sequences]
    for c in chunks:
        sched.kv.commit(c.request)
        if c.samples:
            c.request.num_pending -= 1
            c.request.output_token_ids.append(sampled)
    out.chunks = chunks
    return out


def test_chunked_prefill_mixes_with_decode_under_budget():
    kv = KVCacheManager(num_blocks=64, block_size=4, num_slots=8)
    s = Scheduler(kv, max_num_seqs=8, max_num_batched_tokens=10)
    a, b = _req("a", 3), _req("b", 25, 100)
    s.add(a)
    s.add(b)
    out = _step(s)
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [("a", 0, 3), ("b", 0, 7)]
    out = _step(s)
    # a decodes one token, b continues its prompt with the rest of the budget
    assert [(c.request.request_id, c.start, c.num_tokens) for c in out.chunks] == [("a", 3, 1), ("b", 7, 9)]
    assert not out.chunks[1].samples
    out = _step(s)
    assert [(c.request.request_id, c.num_tokens) for c in out.chunks] == [("a", 1), ("b", 9)]
    assert out.chunks[1].samples and len(b.output_token_ids) == 1


def test_max_num_seqs_and_fcfs():
    kv = KVCacheManager(num_blocks=64, block_size=4, num_slots=8)
    s = Scheduler(kv, max_num_seqs=2, max_num_batched_tokens=100)
    reqs = [_req(str(i), 5, 10 * i) for i in range(4)]
    for r in reqs:
        s.add(r)
    out = _step(s)
    assert [c.request.request_id for c in out.chunks] == ["0", "1"]
    s.finish(reqs[0], "stop")
    out = _step(s)
    assert [c.request.request_id for c in out.chunks] == ["1", "2"]


def test_preemption_newest_first_and_recompute():
    kv = KVCacheManager(num_blocks=6, block_size=4, num_slots=4)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    old, new = _req("old", 8), _req("new", 8, 50)
    s.add(old)
    s.add(new)
    _step(s)  # both prefilled: 2 blocks each (+1 token sampled)
    for _ in range(6):
        _step(s)
    # the cache cannot hold both growing sequences: the newest was preempted and waits
    assert s.stats.preemptions >= 1 and new.status is RequestStatus.WAITING and new.num_computed_tokens == 0
    assert old.status is RequestStatus.RUNNING
    assert new.metrics.num_preemptions >= 1 and new.output_token_ids  # keeps its tokens, recomputes them
    s.finish(old, "length")
    out = _step(s)
    chunk = out.chunks[0]
    assert chunk.request is new and chunk.samples
    assert chunk.start + chunk.num_tokens == new.num_tokens - 1  # everything recomputed, one token sampled


def test_prefix_hit_reuses_full_blocks_and_leaves_a_token_to_compute():
    kv = KVCacheManager(num_blocks=32, block_size=4, num_slots=4)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    a = _req("a", 10)
    s.add(a)
    _step(s)
    s.finish(a, "stop")
    b = _req("b", 12)  # same first 10 tokens, then 2 more
    s.add(b)
    out = _step(s)
    assert b.num_cached_tokens == 8 and out.chunks[0].start == 8 and out.chunks[0].num_tokens == 4
    c = _req("c", 8)  # exactly two cached blocks: the last token must still be computed
    s.add(c)
    out = _step(s)
    chunk = [x for x in out.chunks if x.request is c][0]
    assert chunk.start == 4 and chunk.num_tokens == 4


def test_prefix_caching_off():
    kv = KVCacheManager(num_blocks=32, block_size=4, num_slots=4, enable_prefix_caching=False)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=100)
    a = _req("a", 10)
    s.add(a)
    _step(s)
    s.finish(a, "stop")
    b = _req("b", 10)
    s.add(b)
    assert _step(s).chunks[0].start == 0


def test_block_pool_lru_eviction_keeps_recent():
    pool = BlockPool(4, 2)
    h = chain_hashes([1, 2, 3, 4, 5, 6, 7, 8], 2)
    ids = pool.allocate(4)
    for i, hh in zip(ids, h):
        pool.register(i, hh)
    pool.release(ids[:2])
    pool.release(ids[2:])
    assert pool.lookup(h) == ids
    fresh = pool.allocate(1)  # evicts the least recently freed
    assert fresh == [ids[0]] and pool.num_evictions == 1
    assert pool.lookup(h) == []  # the chain is broken at its first block
    assert pool.lookup(h[1:]) == ids[1:]


def test_chain_hash_depends_on_prefix_and_salt():
    a = chain_hashes([1, 2, 3, 4], 2)
    b = chain_hashes([9, 9, 3, 4], 2)
    assert a[1] != b[1]
    assert chain_hashes([1, 2], 2, salt="x") != chain_hashes([1, 2], 2, salt="y")
