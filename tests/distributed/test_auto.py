"""``ra.attention`` and ``strategy="auto"``: the cost model's work counts against brute
force, its choices where the answer is known, and auto on gloo ranks (1-D group and a 2x2
mesh) exact against float64 on every rank, with the same measured model on every rank."""

import logging

import pytest
import torch
import torch.distributed as dist

import ringattn as ra
from ringattn.strategies.auto import CallShape, choose, estimate, measure, work
from ringattn.layouts import Zigzag, get_layout, local_positions
from test_exact import cases, check, run_cases
from test_hybrid import mesh


def _brute_work(lay, w, s, causal, window, cu):
    owner = {}
    for r in range(w):
        for p in local_positions(lay, r, w, s).tolist():
            if p < s:
                owner[p] = r
    doc = [max(d for d in range(len(cu) - 1) if cu[d] <= i) if cu else 0 for i in range(s)]
    out = torch.zeros(w, w, dtype=torch.float64)
    for i in range(s):
        for j in range(s):
            seen = doc[i] == doc[j] and not (causal and j > i)
            seen = seen and not (window[0] >= 0 and j < i - window[0])
            seen = seen and not (not causal and window[1] >= 0 and j > i + window[1])
            out[owner[i], owner[j]] += seen
    return out


@pytest.mark.parametrize("layout,w,s,causal,window,cu", [
    ("zigzag", 3, 37, True, (-1, -1), None), ("striped", 4, 30, False, (3, 2), None),
    ("contiguous", 2, 25, True, (4, -1), None), ("zigzag", 3, 40, True, (-1, -1), (0, 7, 20, 40)),
    ("zigzag", 2, 40, False, (2, 5), (0, 7, 20, 40)), ("striped", 5, 23, False, (-1, -1), None)])
def test_work_counts_every_visible_pair(layout, w, s, causal, window, cu):
    lay = get_layout(layout, cu)
    assert torch.equal(work(lay, w, s, causal, window, cu), _brute_work(lay, w, s, causal, window, cu))


H100x64 = ra.CostModel(flops=450e12, inner=ra.Link(350e9, 10e-6), outer=ra.Link(45e9, 25e-6))


def _shape(s, heads=32, kv_heads=8, mesh_shape=(8, 8), layout=Zigzag(), causal=True):
    w = mesh_shape[0] * mesh_shape[1] if mesh_shape else 8
    return CallShape(1, s, heads, kv_heads, 128, 128, 2, True, layout, causal, (-1, -1), None,
                     mesh_shape, w)


def test_choices_where_the_answer_is_known():
    # 64 ranks, 32 heads: Ulysses leaves half the ranks without a head; at 1M tokens the
    # ring hides its hops and the hybrid's all-to-alls cost more than the ring saves
    est = estimate(_shape(1 << 20), H100x64)
    assert est["ulysses"].compute > 1.9 * est["ring"].compute
    assert choose(_shape(1 << 20), H100x64) in ("ring", "hybrid")
    # at 128K the flat ring's hops cross InfiniBand with too little compute to hide them;
    # the hybrid keeps the all-to-alls on NVLink
    assert choose(_shape(1 << 17), H100x64) == "hybrid"
    # a contiguous layout's causal ring waits on its last rank at every step: slower than
    # zigzag's, while Ulysses does not care
    z, c = (estimate(_shape(1 << 17, layout=lay), H100x64) for lay in (Zigzag(), get_layout("contiguous")))
    assert c["ring"].compute > 1.7 * z["ring"].compute
    assert c["ulysses"].total == pytest.approx(z["ulysses"].total)
    # links a thousand times slower: the call is communication-bound, and Ulysses sends
    # four shards' worth per rank where the ring and all-gather send W-1 K/V shards
    slow = ra.CostModel(flops=450e12, inner=ra.Link(350e6, 10e-6))
    one_d = _shape(1 << 17, heads=8, kv_heads=8, mesh_shape=None)
    est = estimate(one_d, slow)
    assert est["ring"].comm > est["ulysses"].comm and choose(one_d, slow) == "ulysses"
    # infinitely fast links, W = 8 = H: all three compute the same balanced work
    fast = ra.CostModel(flops=450e12, inner=ra.Link(1e30, 0.0))
    est = estimate(one_d, fast)
    assert est["ring"].total == pytest.approx(est["ulysses"].total, rel=0.02)
    assert est["allgather"].total == pytest.approx(est["ulysses"].total, rel=0.02)
    # no hybrid without a mesh
    assert "hybrid" not in estimate(one_d, H100x64)
    # CPU ranks: a hop does not hide behind the kernels (overlap 0), so the ring pays both
    hidden = estimate(one_d, slow)["ring"]
    cpu = estimate(one_d, ra.CostModel(flops=450e12, inner=ra.Link(350e6, 10e-6), overlap=0.0))["ring"]
    assert cpu.compute == pytest.approx(hidden.compute) and cpu.total > hidden.total


def auto_rank(shape):
    """Rank side: exact cases through ra.attention(strategy="auto") (on a mesh for
    ``shape``), the measured model, and what was logged."""
    group = mesh(*shape) if shape else None
    records = []
    handler = logging.Handler()
    handler.emit = records.append
    logger = logging.getLogger("ringattn")
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    try:
        picked = [c for c in cases(dist.get_world_size()) if c.name in (
            "causal-gqa-odd-S-B2", "full-mqa-odd-S", "causal-window-left", "window-two-sided")]
        res = run_cases("zigzag", picked, "float32", "attention",
                        {"strategy": "auto", "group": group} if group else {"strategy": "auto"})
        res2 = run_cases("zigzag", picked[:1], "float32", "attention",
                         {"strategy": "auto", "group": group} if group else {"strategy": "auto"})
    finally:
        logger.removeHandler(handler)
    model = measure(group)
    return res, res2, model, [r.getMessage() for r in records]


@pytest.mark.timeout(200)
@pytest.mark.parametrize("shape", [None, (2, 2)])
def test_auto_exact_and_agreed(clusters, worst_errors, shape):
    world = 2 if shape is None else 4
    per_rank = clusters(world).run(auto_rank, shape, timeout=180)
    check([r[0] for r in per_rank], "float32", worst_errors)
    check([r[1] for r in per_rank], "float32", worst_errors)
    models = [r[2] for r in per_rank]
    assert all(m == models[0] for m in models), models
    assert models[0].flops > 0 and models[0].inner.bandwidth > 0
    assert 0.0 <= models[0].overlap <= 1.0
    assert (models[0].outer is not None) == (shape is not None)
    for rank, (_, _, _, logged) in enumerate(per_rank):
        # one line per new call shape (4 cases), none for the repeated one
        assert len(logged) == 4 and all("strategy='auto' chose" in m for m in logged), (rank, logged)


def named_strategies():
    """Rank side: every strategy by name through ra.attention gives the ring's output;
    a bad name fails on every rank."""
    s = 11
    g = torch.Generator().manual_seed(3)
    q, k, v = (ra.shard(torch.randn(1, s, h, 8, generator=g), seqlen=s) for h in (4, 2, 2))
    ref = ra.ring_attention(q, k, v, causal=True, seqlen=s)
    diffs = {}
    for name in ("ring", "ulysses", "allgather", "hybrid"):
        group = mesh(2, 2) if name == "hybrid" else None
        out = ra.attention(q, k, v, group=group, strategy=name, causal=True, seqlen=s,
                           heads_k_stride=1, backward_overlap="kv")
        diffs[name] = float((out - ref).abs().max())
    try:
        ra.attention(q, k, v, strategy="ulyses", seqlen=s)
        err = "no error"
    except ValueError as exc:
        err = str(exc)
    return diffs, err


@pytest.mark.timeout(120)
def test_named_strategies(clusters):
    for rank, (diffs, err) in enumerate(clusters(4).run(named_strategies, timeout=100)):
        assert all(d < 1e-5 for d in diffs.values()), (rank, diffs)
        assert "unknown strategy 'ulyses'" in err and "hybrid" in err, (rank, err)
