"""Eagle3 TTT attention on every rank against the float64 oracle with the TTT mask written
out here from its definition; ModelOpt's token-aligned mask against ours; collectives.

fp32: 1e-5 relative; bf16: 2x the error of torch's fused CPU attention op on the same bf16
inputs with the dense mask (the criterion of test_exact.py).
"""

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import ringattn as ra
from reference import reference, rel_err
from test_exact import _plain_fused_raw, check

LAYOUTS = ["contiguous", "zigzag", "striped"]


@dataclass(frozen=True)
class TCase:
    name: str
    seqlen: int
    steps: int
    """j + 1: the number of key sets (step 0 and j cached ones)."""
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    batch: int = 1
    valid_len: tuple | None = None
    seed: int = 0


def tcases(world):
    s = 5 * world + 3  # divides neither W nor 2W
    return [
        TCase("step0-only", s, 1, seed=1),
        TCase("j=2-gqa", s, 3, seed=2),
        TCase("j=6-mha-B2", s, 7, heads=2, kv_heads=2, batch=2, seed=3),
        TCase("j=6-padded", s, 7, batch=2, valid_len=(s, s - world - 2), seed=4),
        TCase("j=3-mqa-padded-empty-row", s, 4, kv_heads=1, batch=2, valid_len=(3, 0), seed=5),
        TCase("S=1", 1, 3, seed=6),
    ]


def ttt_visible(s, steps, valid_len, batch):
    """[B, 1, S, steps * S]: query i sees step-0 key i' <= i (i' < valid_len[b]) and key i of
    every later step."""
    i, c = torch.arange(s)[:, None], torch.arange(steps * s)[None, :]
    t, i2 = c // s, c % s
    lens = torch.tensor(valid_len if valid_len is not None else [s] * batch).view(batch, 1, 1)
    step0 = (t == 0) & (i2 <= i) & (i2 < lens)
    diag = (t > 0) & (i2 == i)
    return (step0 | diag)[:, None]


def _data(case, dtype):
    g = torch.Generator().manual_seed(case.seed)
    b, s, d = case.batch, case.seqlen, case.head_dim
    q = torch.randn(b, s, case.heads, d, generator=g).to(dtype)
    ks = [torch.randn(b, s, case.kv_heads, d, generator=g).to(dtype) for _ in range(case.steps)]
    vs = [torch.randn(b, s, case.kv_heads, d, generator=g).to(dtype) for _ in range(case.steps)]
    do = torch.randn(b, s, case.heads, d, generator=g).to(dtype)
    return q, ks, vs, do


def run_ttt(layout, picked, dtype_name, strategy="ring", mesh_shape=None):
    """Rank side: {case: {tensor: (err, tol, max_abs)}} for out, dq and every dk_t, dv_t
    (with ``strategy``; the hybrid on a (ring, ulysses) mesh of ``mesh_shape``)."""
    dtype = getattr(torch, dtype_name)
    group = None
    if mesh_shape is not None:
        from test_hybrid import mesh

        group = mesh(*mesh_shape)
    results = {}
    for case in picked:
        q, ks, vs, do = _data(case, dtype)
        ok = ttt_visible(case.seqlen, case.steps, case.valid_len, case.batch)
        kcat, vcat = torch.cat(ks, 1), torch.cat(vs, 1)
        ref_out, _, ref_dq, ref_dk, ref_dv = reference(q, kcat, vcat, do, ok)
        if dtype == torch.float32:
            base = None
        else:
            fused = _plain_fused_raw(q, kcat, vcat, do, ok)
            base = [rel_err(fused[0], ref_out), rel_err(fused[2], ref_dq),
                    rel_err(fused[3], ref_dk), rel_err(fused[4], ref_dv)]
        kw = dict(layout=layout, seqlen=case.seqlen)
        qx = q.clone().requires_grad_()
        kx = [t.clone().requires_grad_() for t in ks]
        vx = [t.clone().requires_grad_() for t in vs]
        out_l = ra.eagle3.ttt_attention(
            ra.shard(qx, **kw), [ra.shard(t, **kw) for t in kx], [ra.shard(t, **kw) for t in vx],
            valid_len=case.valid_len, strategy=strategy, group=group, **kw)
        assert out_l.dtype == dtype
        (ra.unshard(out_l, **kw) * do).sum().backward()
        pos = ra.positions(case.seqlen, layout=layout)
        real = pos < case.seqlen
        got = {"out": out_l[:, real], "dq": qx.grad}
        want = {"out": ref_out[:, pos[real]], "dq": ref_dq}
        tols = {"out": 0, "dq": 1}
        s = case.seqlen
        for t in range(case.steps):
            got[f"dk{t}"], want[f"dk{t}"], tols[f"dk{t}"] = kx[t].grad, ref_dk[:, t * s:(t + 1) * s], 2
            got[f"dv{t}"], want[f"dv{t}"], tols[f"dv{t}"] = vx[t].grad, ref_dv[:, t * s:(t + 1) * s], 3
        res = {}
        for name in got:
            tol = 1e-5 if base is None else 2 * base[tols[name]]
            x, r = got[name].detach().double(), want[name]
            res[name] = (rel_err(x, r), tol, float((x - r).abs().max()) if r.numel() else 0.0)
        results[case.name] = res
    return results


def _summarise(per_rank):
    """Fold dk0..dk6 / dv0..dv6 into dk / dv for the worst-error summary."""
    out = []
    for res in per_rank:
        folded = {}
        for case, errs in res.items():
            for name, val in errs.items():
                folded.setdefault(f"{case}", {})[f"ttt {name.rstrip('0123456789')}"
                                                 if name[:2] in ("dk", "dv") else f"ttt {name}"] = val
        out.append(folded)
    return out


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4, 5])
def test_ttt_attention_fp32_exact(clusters, worst_errors, world, layout):
    per_rank = clusters(world).run(run_ttt, layout, tcases(world), "float32", timeout=200)
    check(per_rank, "float32", {})
    check(_summarise(per_rank), "float32", worst_errors)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["zigzag", "striped"])
@pytest.mark.parametrize("world", [2, 3])
def test_ttt_attention_bf16_within_twice_plain_sdpa(clusters, worst_errors, world, layout):
    picked = [c for c in tcases(world) if c.name in ("j=2-gqa", "j=6-padded")]
    per_rank = clusters(world).run(run_ttt, layout, picked, "bfloat16", timeout=200)
    check(per_rank, "bfloat16", {})
    check(_summarise(per_rank), "bfloat16", worst_errors)


def test_modelopt_token_aligned_mask_is_the_same_attention():
    """ModelOpt's row r at step j is our index r - j; its key column t*S + c is our index
    c - t of step t. Every (query, key) pair that exists in both agrees, and ModelOpt's rows
    without an index of ours (r < j) only see keys that have no index of ours either."""
    for s in (1, 5, 9):
        for j in range(7):
            ours = ra.eagle3.ttt_mask(s, j)[0]  # [S, (j+1) S]
            theirs = ra.eagle3.modelopt_ttt_mask(s, j)
            assert theirs.shape == ours.shape
            for r in range(s):
                i = r - j
                for col in range(theirs.shape[1]):
                    t, c = divmod(col, s)
                    i2 = c - t
                    if i >= 0 and i2 >= 0:
                        assert bool(theirs[r, col]) == bool(ours[i, t * s + i2]), (s, j, r, col)
                    elif theirs[r, col]:
                        assert i < 0 and i2 < 0 or t == 0 and i2 < 0, (s, j, r, col)
            # and each of our rows that ModelOpt keeps (i + j < S) sees the same number of keys
            for i in range(s - j):
                assert int(ours[i].sum()) == int(theirs[i + j].sum())


def test_library_ttt_mask_matches_the_definition():
    """ra.eagle3.ttt_mask (used by dense_ttt_attention, the one-process baseline) equals the
    mask written here from the definition."""
    for s in (1, 6, 13):
        for steps in (1, 4, 7):
            for valid in (None, (s, max(0, s - 3))):
                want = ttt_visible(s, steps, valid, 2)[:, 0]
                got = ra.eagle3.ttt_mask(s, steps - 1, valid)
                assert torch.equal(got.expand_as(want), want), (s, steps, valid)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [2, 3, 4])
def test_ttt_attention_ulysses_fp32_exact(clusters, worst_errors, world, layout):
    """Under Ulysses every key set goes to head shards with q (H=4 over W=3: uneven heads;
    MQA at W=4: the one kv head replicated), the diagonal stays beside its queries."""
    per_rank = clusters(world).run(run_ttt, layout, tcases(world), "float32", "ulysses",
                                   timeout=200)
    check(per_rank, "float32", {})
    check(_summarise(per_rank), "float32", worst_errors)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("shape,layout", [((2, 2), "zigzag"), ((2, 3), "striped"),
                                          ((3, 2), "contiguous")])
def test_ttt_attention_hybrid_fp32_exact(clusters, worst_errors, shape, layout):
    world = shape[0] * shape[1]
    per_rank = clusters(world).run(run_ttt, layout, tcases(world), "float32", "hybrid", shape,
                                   timeout=200)
    check(per_rank, "float32", {})
    check(_summarise(per_rank), "float32", worst_errors)
