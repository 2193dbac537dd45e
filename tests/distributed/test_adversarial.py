"""One step to the side of the documented paths: hybrid meshes in every rank order, shards
made over another group or along another dim, sinks that differ by rank or are -inf where a
head holds no rank, only the sinks requiring a gradient, and collectives whose peer never
comes. Every case is exact against float64 on every rank, or raises the same error on every
rank, or (a missing peer) a PeerError within ringattn's timeout, never a hang."""

import json
import os
import time

import pytest
import torch
import torch.distributed as dist

import ringattn as ra
from ringattn.comm import PeerError, set_timeout
from ringattn.testing import LocalCluster
from reference import attention, rel_err

TOL = 1e-5  # float32 against the float64 oracle (README's contract)


def _ok(seqlen, causal=True):
    i = torch.arange(seqlen)
    return (i[None, :] <= i[:, None]) if causal else torch.ones(seqlen, seqlen, dtype=torch.bool)


def _inputs(seqlen, h, hkv, d=8, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, seqlen, h, d, generator=g)
    k = torch.randn(2, seqlen, hkv, d, generator=g)
    v = torch.randn(2, seqlen, hkv, d, generator=g)
    do = torch.randn(2, seqlen, h, d, generator=g)
    return q, k, v, do


def _errors_or_message(fn):
    """fn() -> dict of errors; or the (class, message) of what it raised."""
    try:
        return fn()
    except (TypeError, ValueError) as exc:
        return (type(exc).__name__, str(exc))


def _exact_run(group, strategy, seqlen, h, hkv, sinks=None, shard_group=None):
    """Errors of out, lse and the grads (q, k, v, and sinks summed over the ranks) of one
    call against float64, for this rank."""
    q, k, v, do = _inputs(seqlen, h, hkv)
    sg = group if shard_group is None else shard_group
    ql, kl, vl, dol = (ra.shard(t, group=sg, seqlen=seqlen).detach().requires_grad_()
                       for t in (q, k, v, do))
    sink_leaf = None if sinks is None else sinks.clone().requires_grad_()
    fn = getattr(ra, f"{strategy}_attention")
    out, lse = fn(ql, kl, vl, group=group, causal=True, seqlen=seqlen, return_lse=True,
                  sinks=sink_leaf)
    (out * dol).sum().backward()
    qd, kd, vd = (t.double().requires_grad_() for t in (q, k, v))
    sd = None if sinks is None else sinks.double().requires_grad_()
    ref_out, ref_lse = attention(qd, kd, vd, _ok(seqlen), sinks=sd)
    (ref_out * do.double()).sum().backward()
    pg = ra.comm.resolve_group(group)
    ref_lse_l = ra.shard(ref_lse.float(), group=pg, seqlen=seqlen, dim=2)
    n_real = (ra.positions(seqlen, group=pg) < seqlen)
    errs = {
        "out": rel_err(out, ra.shard(ref_out, group=pg, seqlen=seqlen)),
        "lse": rel_err(lse[..., n_real], ref_lse_l[..., n_real].double(), floor=1.0),
        "dq": rel_err(ql.grad, ra.shard(qd.grad, group=pg, seqlen=seqlen)),
        "dk": rel_err(kl.grad, ra.shard(kd.grad, group=pg, seqlen=seqlen)),
        "dv": rel_err(vl.grad, ra.shard(vd.grad, group=pg, seqlen=seqlen)),
    }
    if sinks is not None:
        ds = sink_leaf.grad.clone()
        dist.all_reduce(ds, group=pg)
        errs["dsinks"] = rel_err(ds, sd.grad)
    return errs


def _mesh(rows):
    from torch.distributed.device_mesh import DeviceMesh
    return DeviceMesh("cpu", torch.tensor(rows), mesh_dim_names=("ring", "ulysses"))


def mesh_cases(rows_list):
    """Rank side: for each mesh, the hybrid's errors or its refusal (twice: a refused call
    leaves nothing in flight)."""
    out = []
    for rows in rows_list:
        mesh = _mesh(rows)
        for _ in range(2):
            out.append(_errors_or_message(lambda: _exact_run(mesh, "hybrid", 13, 4, 2)))
    return out


def _assert_same_everywhere_exact_or_refused(per_rank, expect_refused, words=""):
    for case in zip(*per_rank):
        if expect_refused:
            assert all(isinstance(c, tuple) for c in case), case
            assert len({c for c in case}) == 1, f"ranks raised different errors: {case}"
            assert words in case[0][1], case[0]
        else:
            for rank, errs in enumerate(case):
                assert isinstance(errs, dict), (rank, errs)
                for name, err in errs.items():
                    assert err <= TOL, (rank, name, err)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,rows,exact", [
    (4, [[0, 1], [2, 3]], True),
    (4, [[0, 1], [3, 2]], False),
    (4, [[0, 2], [1, 3]], False),  # column-major
    (4, [[3, 2], [1, 0]], False),
    (6, [[0, 1, 2], [3, 4, 5]], True),
    (6, [[0, 1], [2, 3], [4, 5]], True),
    (6, [[0, 1, 2], [4, 5, 3]], False),
    (6, [[0, 3], [1, 4], [2, 5]], False),
])
def test_hybrid_mesh_rank_order(clusters, world, rows, exact):
    per_rank = clusters(world).run(mesh_cases, [rows], timeout=200)
    _assert_same_everywhere_exact_or_refused(per_rank, not exact, "increasing order row by row")


def group_cases():
    """Rank side (4 ranks): shards over subgroups or the world, attended over another."""
    rank = dist.get_rank()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    q = torch.randn(1, 8, 2, 4)
    results = []
    # made over the pair, attended over the world: refused everywhere
    ql = ra.shard(q, group=mine, seqlen=8)
    results.append(_errors_or_message(
        lambda: {"n": ra.ring_attention(ql, ql, ql, seqlen=4 * ql.shape[1]).numel()}))
    # made over the world, attended over the pair (each pair calls its own): refused
    qw = ra.shard(q, seqlen=8)
    for strategy in ("ring", "ulysses", "allgather"):
        fn = getattr(ra, f"{strategy}_attention")
        results.append(_errors_or_message(
            lambda: {"n": fn(qw, qw, qw, group=mine, seqlen=2 * qw.shape[1]).numel()}))
    # the same members under another group object (a 1-D mesh of the world): exact
    from torch.distributed.device_mesh import init_device_mesh
    mesh1 = init_device_mesh("cpu", (4,))
    results.append(_errors_or_message(lambda: _exact_run(mesh1, "ring", 11, 2, 1,
                                                         shard_group=dist.group.WORLD)))
    return results


@pytest.mark.timeout(180)
def test_shard_remembers_its_group(clusters):
    per_rank = clusters(4).run(group_cases, timeout=150)
    for i, case in enumerate(zip(*per_rank)):
        if i < 4:
            assert all(isinstance(c, tuple) and c[0] == "ValueError" for c in case), case
            # within each group the ranks raise the same message
            assert "sharded by ringattn.shard over the ranks" in case[0][1], case[0]
            assert case[0] == case[1] and case[2] == case[3], case
        else:
            for errs in case:
                assert isinstance(errs, dict), errs
                assert max(errs.values()) <= TOL, errs


def dim_cases():
    """Rank side: shards along another dim, SDPA-layout tensors, messages naming the layout."""
    s = 12
    x = torch.randn(1, 4, s, 8)  # [B, H, S, D]
    xl = ra.shard(x, dim=2, seqlen=s)  # sharded along S of an SDPA-layout tensor
    out = [_errors_or_message(lambda: {"n": ra.ring_attention(xl, xl, xl, seqlen=s).numel()})]
    # the same tensor transposed as asked: [B, S_local, H, D], attended exactly by shape
    out.append(_errors_or_message(
        lambda: {"n": ra.ring_attention(xl.transpose(1, 2).contiguous(),
                                        xl.transpose(1, 2).contiguous(),
                                        xl.transpose(1, 2).contiguous(), seqlen=s).numel() * 0}))
    # an SDPA-layout local tensor with an explicit seqlen: the length check names the layout
    y = torch.randn(1, 4, 6, 8)
    out.append(_errors_or_message(lambda: {"n": ra.ring_attention(y, y, y, seqlen=12).numel()}))
    return out


@pytest.mark.timeout(120)
def test_shard_dim_and_layout_messages(clusters):
    per_rank = clusters(2).run(dim_cases, timeout=100)
    for r in per_rank:
        assert r[0][0] == "ValueError" and "along dim 2" in r[0][1], r[0]
        assert r[1] == {"n": 0}, r[1]
        assert r[2][0] == "ValueError" and "[B, S_local, H, D]" in r[2][1], r[2]
    assert per_rank[0] == per_rank[1]


def sink_cases():
    """Rank side (3 ranks): sinks that differ on one rank are refused by every strategy;
    NaN and +inf sinks are refused; only the sinks needing a gradient with a rank that
    holds no head (Ulysses, H=2 on 3 ranks) is exact."""
    rank = dist.get_rank()
    out = []
    base = torch.tensor([0.5, -1.0])
    for strategy in ("ring", "ulysses", "allgather"):
        sinks = base + (0.25 if rank == 1 else 0.0)
        out.append(_errors_or_message(lambda: _exact_run(None, strategy, 10, 2, 1, sinks)))
    for bad in (float("nan"), float("inf")):
        out.append(_errors_or_message(
            lambda: _exact_run(None, "ring", 10, 2, 1, torch.tensor([bad, 0.0]))))
    # only the sinks require grad; rank 2 holds no head under Ulysses (H=2, W=3)
    q, k, v, do = _inputs(10, 2, 1)
    qs, ks, vs, dos = (ra.shard(t, seqlen=10) for t in (q, k, v, do))
    for strategy in ("ulysses", "ring", "allgather"):
        sinks = base.clone().requires_grad_()
        o = getattr(ra, f"{strategy}_attention")(qs, ks, vs, causal=True, seqlen=10,
                                                   sinks=sinks)
        (o * dos).sum().backward()
        ds = sinks.grad.clone()
        dist.all_reduce(ds)
        sd = base.double().requires_grad_()
        ro, _ = attention(q.double(), k.double(), v.double(), _ok(10), sinks=sd)
        (ro * do.double()).sum().backward()
        out.append({"dsinks": rel_err(ds, sd.grad)})
    return out


@pytest.mark.timeout(180)
def test_sinks_agreed_and_sinks_only_grad(clusters):
    per_rank = clusters(3).run(sink_cases, timeout=150)
    for i, case in enumerate(zip(*per_rank)):
        if i < 3:
            assert all(c == case[0] for c in case), case
            assert case[0][0] == "ValueError" and "ranks disagree on sinks" in case[0][1], case
        elif i < 5:
            assert all(c == case[0] for c in case), case
            assert "sinks must be finite or -inf" in case[0][1], case
        else:
            for errs in case:
                assert errs["dsinks"] <= TOL, errs


def hybrid_sinks_only(rows):
    """Rank side (2x2 mesh, H=1: two ranks hold no head): only the sinks need a gradient."""
    mesh = _mesh(rows)
    q, k, v, do = _inputs(9, 1, 1)
    qs, ks, vs, dos = (ra.shard(t, group=mesh, seqlen=9) for t in (q, k, v, do))
    sinks = torch.tensor([0.3], requires_grad=True)
    o = ra.hybrid_attention(qs, ks, vs, group=mesh, causal=True, seqlen=9, sinks=sinks)
    (o * dos).sum().backward()
    ds = sinks.grad.clone()
    dist.all_reduce(ds)
    sd = torch.tensor([0.3], dtype=torch.float64, requires_grad=True)
    ro, _ = attention(q.double(), k.double(), v.double(), _ok(9), sinks=sd)
    (ro * do.double()).sum().backward()
    return {"out": rel_err(o, ra.shard(ro, group=mesh, seqlen=9)), "dsinks": rel_err(ds, sd.grad)}


@pytest.mark.timeout(120)
def test_hybrid_sinks_only_grad_with_headless_ranks(clusters):
    per_rank = clusters(4).run(hybrid_sinks_only, [[0, 1], [2, 3]], timeout=100)
    for errs in per_rank:
        assert max(errs.values()) <= TOL, errs


def missing_peer(out_dir, op):
    """Rank side (3 ranks, timeout 2 s): rank 2 never makes the collective ``op``; ranks 0
    and 1 must raise PeerError naming it within the timeout."""
    rank = dist.get_rank()
    set_timeout(2.0)
    t0 = time.monotonic()
    seen = {"outcome": "skipped"}
    if rank != 2:
        x = torch.ones(6)
        try:
            if op == "all-to-all":
                ra.comm.all_to_all_single(torch.empty(6), x, [2, 2, 2], [2, 2, 2], dist.group.WORLD,
                                          what="all-to-all of the test")
            elif op == "all-gather":
                ra.comm.all_gather_single(torch.empty(18), x, dist.group.WORLD,
                                          what="all-gather of the test")
            else:
                ra.comm.reduce_scatter_single(torch.empty(2), x, dist.group.WORLD,
                                              what="reduce-scatter of the test")
            seen = {"outcome": "finished"}
        except PeerError as exc:
            seen = {"outcome": "PeerError", "message": str(exc)}
    seen["seconds"] = time.monotonic() - t0
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(seen, f)
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("op", ["all-to-all", "all-gather", "reduce-scatter"])
def test_collectives_wait_at_most_the_timeout(tmp_path, op):
    cluster = LocalCluster(3, timeout_s=60)
    try:
        cluster.run(missing_peer, str(tmp_path), op, timeout=60)
    finally:
        cluster.close(force=True)
    for rank in (0, 1):
        seen = json.loads((tmp_path / f"{rank}.json").read_text())
        assert seen["outcome"] == "PeerError", seen
        assert f"{op} of the test" in seen["message"] and "ranks [0, 1, 2]" in seen["message"]
        assert seen["seconds"] < 10, seen


def extra_call_cases():
    """Rank side (3 ranks): rank 1 makes one extra call from another line, which must not
    pair with the others' next call; with the check off, calls from different lines on
    purpose run exactly."""
    rank = dist.get_rank()
    q, k, v, _ = _inputs(9, 2, 1)
    ql, kl, vl = (ra.shard(t, seqlen=9) for t in (q, k, v))
    out = []
    try:
        if rank == 1:
            ra.ring_attention(ql, kl, vl, causal=True, seqlen=9)  # the extra call
        got = ra.ring_attention(ql, kl, vl, causal=True, seqlen=9)
        out.append(("finished", float(got.sum())))
    except ValueError as exc:
        out.append(("ValueError", str(exc), "".join(getattr(exc, "__notes__", []))))
    ra.comm.set_caller_check(False)
    try:
        if rank == 0:
            got = ra.ring_attention(ql, kl, vl, causal=True, seqlen=9)
        else:
            got = ra.ring_attention(ql, kl, vl, causal=True, seqlen=9)
    finally:
        ra.comm.set_caller_check(True)
    ref, _ = attention(q.double(), k.double(), v.double(), _ok(9))
    out.append(rel_err(got, ra.shard(ref, seqlen=9)))
    return out


@pytest.mark.timeout(120)
def test_extra_call_from_another_line_refused(clusters):
    per_rank = clusters(3).run(extra_call_cases, timeout=100)
    first = [r[0] for r in per_rank]
    assert all(f[0] == "ValueError" for f in first), first
    assert len({f[1] for f in first}) == 1, "ranks raised different messages"
    assert "ranks disagree on caller" in first[0][1], first[0]
    assert "rank 1 made this call from test_adversarial.py" in first[1][2], first[1]
    for r in per_rank:
        assert r[1] <= TOL, r


_SUBSETS = [("q",), ("k",), ("v",), ("sinks",), ("k", "sinks"), ("q", "v")]


def partial_grad_cases(strategies, h, hkv, rows=None):
    """Rank side: for every subset of (q, k, v, sinks) requiring a gradient (the others
    plain tensors), the present gradients' errors against float64 (sinks' summed over
    the ranks) and the names of the absent ones that came back non-None."""
    group = None if rows is None else _mesh(rows)
    pg = ra.comm.resolve_group(group)
    s = 10
    q, k, v, do = _inputs(s, h, hkv)
    sinks = torch.linspace(-0.5, 0.5, h)
    results = []
    for strategy in strategies:
        fn = getattr(ra, f"{strategy}_attention")
        for subset in _SUBSETS:
            leaves = {n: ra.shard(t, group=pg, seqlen=s) for n, t in (("q", q), ("k", k), ("v", v))}
            leaves["sinks"] = sinks.clone()
            for n in subset:
                leaves[n].requires_grad_()
            out = fn(leaves["q"], leaves["k"], leaves["v"], group=group, causal=True, seqlen=s,
                     sinks=leaves["sinks"])
            (out * ra.shard(do, group=pg, seqlen=s)).sum().backward()
            ref = {n: t.double().requires_grad_() for n, t in
                   (("q", q), ("k", k), ("v", v), ("sinks", sinks))}
            ro, _ = attention(ref["q"], ref["k"], ref["v"], _ok(s), sinks=ref["sinks"])
            (ro * do.double()).sum().backward()
            errs = {}
            for n in subset:
                g = leaves[n].grad
                if n == "sinks":
                    g = g.clone()
                    dist.all_reduce(g, group=pg)
                    errs[n] = rel_err(g, ref[n].grad)
                else:
                    errs[n] = rel_err(g, ra.shard(ref[n].grad, group=pg, seqlen=s))
            stray = [n for n in leaves if n not in subset and leaves[n].grad is not None]
            results.append((strategy, subset, errs, stray))
    return results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,h,hkv,rows", [
    (3, 2, 1, None),          # Ulysses: rank 2 holds no head
    (4, 1, 1, [[0, 1], [2, 3]]),  # hybrid 2x2, H=1: two ranks hold no head
])
def test_partial_requires_grad(clusters, world, h, hkv, rows):
    strategies = ("ring", "ulysses", "allgather") if rows is None else ("hybrid",)
    per_rank = clusters(world).run(partial_grad_cases, strategies, h, hkv, rows, timeout=200)
    for rank, results in enumerate(per_rank):
        for strategy, subset, errs, stray in results:
            assert not stray, (rank, strategy, subset, stray)
            for name, err in errs.items():
                assert err <= TOL, (rank, strategy, subset, name, err)
