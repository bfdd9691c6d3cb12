"""The DeepSeek-V4 reference ops against independent, element-by-element formulas."""

from __future__ import annotations

import math

import torch

from deepinfer_interfaces import Kernels

K = Kernels()
G = torch.Generator().manual_seed(0)


def rnd(*shape: int, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(*shape, generator=G, dtype=torch.float64) * scale


def close(a, b, tol: float = 1e-9) -> bool:
    return abs(float(a) - float(b)) <= tol


def test_cache_write_stores_rows_and_skips_minus_one():
    pool = torch.zeros(5, 2)
    K.cache_write(pool, torch.tensor([3, -1, 0]), torch.tensor([[1.0, 2.0], [9.0, 9.0], [3.0, 4.0]], dtype=torch.float64))
    assert pool.tolist() == [[3.0, 4.0], [0, 0], [0, 0], [1.0, 2.0], [0, 0]]
    assert pool.dtype == torch.float32


def test_sparse_attention_softmax_with_sink():
    q, kv = rnd(2, 3, 4), rnd(6, 4)
    idx = torch.tensor([[4, 0, -1], [-1, -1, -1]])
    sinks = rnd(3)
    out = K.sparse_attention(q, kv, idx, sinks, 0.5)
    for h in range(3):
        s = [0.5 * float(q[0, h] @ kv[j]) for j in (4, 0)]
        z = sum(math.exp(v) for v in s) + math.exp(float(sinks[h]))
        for c in range(4):
            expect = sum(math.exp(s[n]) / z * float(kv[j, c]) for n, j in enumerate((4, 0)))
            assert close(out[0, h, c], expect)
    assert out[1].abs().max() == 0  # no valid row: everything went to the sink


def test_indexer_scores_weighted_relu_sum():
    q, w, keys = rnd(2, 3, 4), rnd(2, 3), rnd(5, 4)
    idx = torch.tensor([[1, 4, -1], [0, 0, 2]])
    out = K.indexer_scores(q, w, keys, idx, 0.3)
    for t in range(2):
        for j in range(3):
            if idx[t, j] < 0:
                assert out[t, j] == float("-inf")
                continue
            expect = 0.3 * sum(float(w[t, h]) * max(0.0, float(q[t, h] @ keys[idx[t, j]])) for h in range(3))
            assert close(out[t, j], expect)


def test_topk_select_orders_by_score_and_pads():
    scores = torch.tensor([[0.1, 3.0, -1.0, 2.0], [float("-inf"), 1.0, float("-inf"), float("-inf")]])
    values = torch.tensor([[10, 11, 12, 13], [20, 21, 22, 23]])
    assert K.topk_select(scores, values, 3).tolist() == [[11, 13, 10], [21, -1, -1]]
    assert K.topk_select(scores, values, 6).tolist()[0] == [11, 13, 10, 12, -1, -1]


def test_topk_select_breaks_ties_by_column():
    assert K.topk_select(torch.tensor([[1.0, 2.0, 2.0, 1.0]]), torch.tensor([[5, 6, 7, 8]]), 3).tolist() == [[6, 7, 5]]


def _softmax_pool(pairs: list[tuple[float, float]]) -> float:
    """Σ softmax(z)·v over (z, v) pairs."""
    z = sum(math.exp(a) for a, _ in pairs)
    return sum(math.exp(a) / z * v for a, v in pairs)


def test_compress_kv_plain_window():
    kv, gate, bias = rnd(8, 3), rnd(8, 3), rnd(4, 3)
    idx = torch.tensor([[4, 5, 6, 7], [0, 1, -1, -1]])
    out = K.compress_kv(kv, gate, bias, idx)
    for e in range(2):
        for c in range(3):
            pairs = [(float(gate[i, c] + bias[j, c]), float(kv[i, c])) for j, i in enumerate(idx[e].tolist()) if i >= 0]
            assert close(out[e, c], _softmax_pool(pairs))


def test_compress_kv_overlapping_windows():
    d = 2
    kv, gate, bias = rnd(8, 2 * d), rnd(8, 2 * d), rnd(4, 2 * d)
    cur = torch.tensor([[4, 5, 6, 7], [0, 1, 2, 3]])
    prev = torch.tensor([[0, 1, 2, 3], [-1, -1, -1, -1]])
    out = K.compress_kv(kv, gate, bias, cur, prev)
    assert out.shape == (2, d)
    for e in range(2):
        for c in range(d):
            pairs = [(float(gate[i, c] + bias[j, c]), float(kv[i, c])) for j, i in enumerate(prev[e].tolist()) if i >= 0]
            pairs += [(float(gate[i, d + c] + bias[j, d + c]), float(kv[i, d + c])) for j, i in enumerate(cur[e].tolist())]
            assert close(out[e, c], _softmax_pool(pairs))


def _sig(x: float) -> float:
    return 1 / (1 + math.exp(-x))


def test_mhc_pre_post_head_formulas():
    n, d, eps, hc_eps = 2, 3, 1e-6, 1e-6
    x = rnd(1, n, d)
    fn, base, scale = rnd((2 + n) * n, n * d), rnd((2 + n) * n), rnd(3).abs() + 0.5
    collapsed, post, comb = K.mhc_pre(x, fn, base, scale, eps, hc_eps, 3)
    flat = x[0].flatten().tolist()
    r = math.sqrt(sum(v * v for v in flat) / len(flat) + eps)
    u = [sum(float(fn[o, i]) * flat[i] / r for i in range(n * d)) for o in range((2 + n) * n)]
    pre = [_sig(u[j] * float(scale[0]) + float(base[j])) + hc_eps for j in range(n)]
    post_e = [2 * _sig(u[n + j] * float(scale[1]) + float(base[n + j])) for j in range(n)]
    logits = [[u[2 * n + j * n + k] * float(scale[2]) + float(base[2 * n + j * n + k]) for k in range(n)] for j in range(n)]
    m = [[math.exp(v) / sum(math.exp(w) for w in row) + hc_eps for v in row] for row in logits]

    def cols(a):
        return [[a[j][k] / (sum(a[i][k] for i in range(n)) + hc_eps) for k in range(n)] for j in range(n)]

    def rows(a):
        return [[a[j][k] / (sum(a[j]) + hc_eps) for k in range(n)] for j in range(n)]

    m = cols(rows(cols(rows(cols(m)))))
    for j in range(n):
        assert close(post[0, j], post_e[j])
        for k in range(n):
            assert close(comb[0, j, k], m[j][k])
    for c in range(d):
        assert close(collapsed[0, c], sum(pre[j] * float(x[0, j, c]) for j in range(n)))

    y = rnd(1, d)
    out = K.mhc_post(y, x, post, comb)
    for k in range(n):
        for c in range(d):
            expect = float(post[0, k]) * float(y[0, c]) + sum(float(comb[0, j, k]) * float(x[0, j, c]) for j in range(n))
            assert close(out[0, k, c], expect)

    hfn, hbase, hscale = rnd(n, n * d), rnd(n), rnd(1).abs()
    head = K.mhc_head(x, hfn, hbase, hscale, eps, hc_eps)
    hu = [sum(float(hfn[o, i]) * flat[i] / r for i in range(n * d)) for o in range(n)]
    hpre = [_sig(hu[j] * float(hscale[0]) + float(hbase[j])) + hc_eps for j in range(n)]
    for c in range(d):
        assert close(head[0, c], sum(hpre[j] * float(x[0, j, c]) for j in range(n)))


def test_moe_route_sqrtsoftplus_bias_chooses_and_scores_weigh():
    logits = torch.tensor([[0.5, -1.0, 2.0, 0.0]], dtype=torch.float64)
    bias = torch.tensor([0.0, 5.0, 0.0, 0.0], dtype=torch.float64)
    w, ids = K.moe_route(logits, bias, 2, 1.5)
    assert ids.tolist() == [[1, 2]]  # expert 1 wins only through its bias
    s = [math.sqrt(math.log1p(math.exp(float(v)))) for v in logits[0]]
    assert close(w[0, 0], 1.5 * s[1] / (s[1] + s[2])) and close(w[0, 1], 1.5 * s[2] / (s[1] + s[2]))
    w, ids = K.moe_route(logits, None, 1, 2.0, "sigmoid", renormalize=False)
    assert ids.tolist() == [[2]] and close(w[0, 0], 2.0 * _sig(2.0))
    w, ids = K.moe_route(logits, None, 2, 1.0, "softmax")
    z = sum(math.exp(float(v)) for v in logits[0])
    p = [math.exp(float(v)) / z for v in logits[0]]
    assert ids.tolist() == [[2, 0]] and close(w[0, 0], p[2] / (p[2] + p[0]))


def test_hash_route_takes_table_experts():
    logits = rnd(2, 4)
    table = torch.tensor([[3, 1], [0, 2], [2, 3]])
    w, ids = K.hash_route(logits, torch.tensor([2, 0]), table, 1.0)
    assert ids.tolist() == [[2, 3], [3, 1]]
    s = [[math.sqrt(math.log1p(math.exp(float(v)))) for v in row] for row in logits]
    assert close(w[0, 0], s[0][2] / (s[0][2] + s[0][3])) and close(w[1, 1], s[1][1] / (s[1][3] + s[1][1]))


def _swiglu(g: float, u: float, limit: float | None) -> float:
    if limit is not None:
        g, u = min(g, limit), max(-limit, min(u, limit))
    return g / (1 + math.exp(-g)) * u


def test_swiglu_clamps_gate_above_and_up_both_sides():
    gate = torch.tensor([[5.0, -5.0, 0.5]], dtype=torch.float64)
    up = torch.tensor([[5.0, -5.0, 0.2]], dtype=torch.float64)
    out = K.swiglu(gate, up, 1.0)
    for c in range(3):
        assert close(out[0, c], _swiglu(float(gate[0, c]), float(up[0, c]), 1.0))
    assert close(K.swiglu(gate, up, None)[0, 0], _swiglu(5.0, 5.0, None))


def test_moe_experts_weighted_sum_skips_invalid_ids():
    t, d, i, e = 3, 4, 2, 3
    x, w13, w2 = rnd(t, d), rnd(e, 2 * i, d), rnd(e, d, i)
    ids = torch.tensor([[0, 2], [1, -1], [5, 1]])
    wts = rnd(t, 2)
    out = K.moe_experts(x, ids, wts, w13, w2, 0.7)
    for tok in range(t):
        for c in range(d):
            expect = 0.0
            for slot in range(2):
                ex = int(ids[tok, slot])
                if not 0 <= ex < e:
                    continue
                h = [float(w13[ex, r] @ x[tok]) for r in range(2 * i)]
                act = [_swiglu(h[r], h[i + r], 0.7) for r in range(i)]
                expect += float(wts[tok, slot]) * sum(float(w2[ex, c, r]) * act[r] for r in range(i))
            assert close(out[tok, c], expect)
