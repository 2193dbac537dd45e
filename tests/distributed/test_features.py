"""Score modifications and shapes beyond plain attention, exact on every rank and layout:
soft-capping (Gemma 2), attention sinks (gpt-oss; their gradient too), ALiBi (global
distances), a value head dim that differs from the query's (MLA), and autocast.

fp32: ||x - ref|| / ||ref|| <= 1e-5 against float64 attention written from the definitions
(tests/reference.py). bf16: within 2x the error of the same attention computed eagerly in
bf16 over the whole sequence (what a model's eager attention does; no fused op soft-caps),
with the 1e-6 floor for lse that test_exact.py explains.
"""

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import ringattn as ra
from reference import attention, rel_err
from test_exact import check

FP32_TOL = 1e-5
LAYOUTS = ["contiguous", "zigzag", "striped"]


@dataclass(frozen=True)
class Case:
    name: str
    seqlen: int
    causal: bool = True
    window: tuple = (-1, -1)
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 16
    value_dim: int = 16
    softcap: float = 0.0
    sinks: bool = False
    docs: bool = False
    dilated: bool = False
    alibi: bool = False
    lse_grad: bool = True
    seed: int = 0


def cases(world):
    s = 7 * world + 3  # divides neither W nor 2W
    return [
        Case("softcap-causal", s, softcap=2.0, seed=1),
        Case("softcap-window-noncausal", s, causal=False, window=(3, 2), softcap=1.5, seed=2),
        Case("softcap-docs", s, softcap=3.0, docs=True, kv_heads=1, seed=3),
        Case("sinks-causal", s, sinks=True, seed=4),
        Case("sinks-softcap-window", s, window=(4, -1), sinks=True, softcap=2.0, seed=5),
        Case("sinks-dead-rows", s, causal=False, sinks=True, dilated=True, seed=6),
        Case("sinks-no-lse-grad", s, sinks=True, lse_grad=False, docs=True, seed=7),
        Case("mla-wide-v", s, head_dim=12, value_dim=20, seed=8),
        Case("mla-narrow-v-docs", s, head_dim=24, value_dim=8, docs=True, seed=9),
        Case("mla-sinks-softcap", s, head_dim=16, value_dim=8, sinks=True, softcap=2.0, seed=10),
        Case("alibi-causal", s, alibi=True, seed=11),
        Case("alibi-window-docs", s, causal=False, window=(4, 3), alibi=True, docs=True, seed=12),
        Case("alibi-softcap-sinks-mla", s, alibi=True, softcap=2.0, sinks=True, value_dim=8,
             seed=13),
    ]


def _visibility(case, cu):
    s = case.seqlen
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    ok = torch.ones(s, s, dtype=torch.bool)
    left, right = case.window
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    if case.causal:
        ok &= j <= i
    kw = {}
    if case.docs:
        doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
        ok &= doc[:, None] == doc[None, :]
        kw["cu_seqlens"] = cu
    if case.dilated:  # rows outside the pattern see no key: lse is the sink alone
        h = torch.arange(case.heads).view(-1, 1, 1)
        ok = ok & (i % 3 == h % 3) & (j % 3 == h % 3)
        kw["mask"] = ra.masks.dilated(s, 3, head_offsets=True)
    return ok, kw


def _data(case, dtype):
    g = torch.Generator().manual_seed(case.seed)
    b, s = 2, case.seqlen
    q = torch.randn(b, s, case.heads, case.head_dim, generator=g).to(dtype)
    k = torch.randn(b, s, case.kv_heads, case.head_dim, generator=g).to(dtype)
    v = torch.randn(b, s, case.kv_heads, case.value_dim, generator=g).to(dtype)
    do = torch.randn(b, s, case.heads, case.value_dim, generator=g).to(dtype)
    dlse = torch.randn(b, case.heads, s, generator=g) if case.lse_grad else None
    sinks = torch.randn(case.heads, generator=g) if case.sinks else None
    alibi = torch.rand(case.heads, generator=g) if case.alibi else None  # slopes in [0, 1)
    cu = [0, 1, 4, s // 2 + 2, s]
    return q, k, v, do, dlse, sinks, alibi, cu


def _grads(q, k, v, do, dlse, sinks, alibi, ok, case, dtype):
    """out, lse, dq, dk, dv, dsinks of ``attention`` on the whole sequence in ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
    sk = None if sinks is None else sinks.detach().to(dtype).requires_grad_()
    out, lse = attention(*leaves, ok, softcap=case.softcap, sinks=sk, alibi=alibi)
    loss = (out * do.to(dtype)).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse.to(dtype)).sum()
    loss.backward()
    res = [out.detach(), lse.detach()] + [t.grad for t in leaves]
    return res + ([sk.grad] if sk is not None else [])


def run_cases(layout, picked, dtype_name, strategy="ring_attention", options=None):
    """Rank side: {case: {tensor: (err, tol, max_abs)}} for every case, with ``ra.<strategy>``."""
    dtype = getattr(torch, dtype_name)
    results = {}
    for case in picked:
        q, k, v, do, dlse, sinks, alibi, cu = _data(case, dtype)
        ok, extra = _visibility(case, cu)
        refs = _grads(q, k, v, do, dlse, sinks, alibi, ok, case, torch.float64)
        if dtype == torch.float32:
            tols = [FP32_TOL] * len(refs)
        else:
            eager = _grads(q, k, v, do, dlse, sinks, alibi, ok, case, dtype)
            tols = [2 * rel_err(x, r) + (1e-6 if i == 1 else 0.0)
                    for i, (x, r) in enumerate(zip(eager, refs))]
        leaves = [t.clone().requires_grad_() for t in (q, k, v)]
        sk = None if sinks is None else sinks.clone().requires_grad_()
        kw = dict(layout=layout, seqlen=case.seqlen, cu_seqlens=extra.get("cu_seqlens"))
        ql, kl, vl = (ra.shard(t, **kw) for t in leaves)
        out_l, lse_l = getattr(ra, strategy)(
            ql, kl, vl, causal=case.causal, window_size=case.window, softcap=case.softcap,
            sinks=sk, alibi_slopes=alibi, mask=extra.get("mask"), return_lse=True, **kw,
            **(options or {}))
        assert out_l.dtype == dtype and out_l.shape[-1] == case.value_dim
        loss = (ra.unshard(out_l, **kw) * do).sum()
        if dlse is not None:
            lse_g = ra.unshard(lse_l, dim=2, **kw)
            loss = loss + (torch.where(torch.isfinite(lse_g), lse_g, 0.0) * dlse).sum()
        loss.backward()
        pos = ra.positions(case.seqlen, layout=layout, cu_seqlens=kw["cu_seqlens"])
        pos = pos[0] if kw["cu_seqlens"] is not None else pos
        real = pos < case.seqlen
        got = [out_l[:, real], lse_l[:, :, real], *(t.grad for t in leaves)]
        want = [refs[0][:, pos[real]], refs[1][:, :, pos[real]], *refs[2:5]]
        names = ["out", "lse", "dq", "dk", "dv"]
        if sk is not None:  # each rank holds its queries' share of the sinks' gradient
            dsinks = sk.grad.clone()
            dist.all_reduce(dsinks)
            got.append(dsinks)
            want.append(refs[5])
            names.append("dsinks")
        results[case.name] = {
            f"features {n}": (rel_err(x, r), tol, float((x.detach().double() - r).abs().max()))
            for n, x, r, tol in zip(names, got, want, tols)}
    return results


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_features_fp32_exact(clusters, worst_errors, world, layout):
    per_rank = clusters(world).run(run_cases, layout, cases(world), "float32", timeout=200)
    check(per_rank, "float32", worst_errors)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", ["zigzag", "striped"])
@pytest.mark.parametrize("world", [2, 3])
def test_features_bf16_within_twice_eager(clusters, worst_errors, world, layout):
    per_rank = clusters(world).run(run_cases, layout, cases(world), "bfloat16", timeout=200)
    check(per_rank, "bfloat16", worst_errors)


def autocast_cases():
    """Rank side: under autocast, fp32 (and mixed) q, k, v give exactly what the same call
    on bf16 inputs gives, in bf16, forward and backward; outside autocast a mixed-dtype
    call is refused."""
    g = torch.Generator().manual_seed(0)
    s = 5 * dist.get_world_size() + 1
    q, k, v = (torch.randn(1, s, h, 16, generator=g) for h in (4, 2, 2))
    kw = dict(seqlen=s, causal=True)
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        # k arrives in bf16 (as RoPE'd keys of a model under autocast can), q and v in fp32
        mixed = [leaves[0], leaves[1].to(torch.bfloat16), leaves[2]]
        out = ra.ring_attention(*(ra.shard(t, seqlen=s) for t in mixed), **kw)
        loss = out.float().square().sum()
    loss.backward()
    plain = [t.to(torch.bfloat16).requires_grad_() for t in (q, k, v)]
    ref = ra.ring_attention(*(ra.shard(t, seqlen=s) for t in plain), **kw)
    ref.float().square().sum().backward()
    same = [torch.equal(out, ref)] + [torch.equal(a.grad.to(torch.bfloat16), b.grad)
                                      for a, b in zip(leaves, plain)]
    try:
        ra.ring_attention(*(ra.shard(t, seqlen=s) for t in (q, k.to(torch.bfloat16), v)), **kw)
        refused = ""
    except TypeError as exc:
        refused = str(exc)
    return out.dtype, same, refused


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 2])
def test_autocast_computes_in_the_autocast_dtype(clusters, world):
    for rank, (dtype, same, refused) in enumerate(clusters(world).run(autocast_cases, timeout=100)):
        assert dtype == torch.bfloat16, rank
        assert all(same), (rank, same)
        assert "share a dtype" in refused, (rank, refused)


def default_layout_case():
    """Rank side: zigzag shards attended WITHOUT layout= (and shards made with defaults)
    give the float64 result (before, ring_attention defaulted to contiguous and was wrong);
    returns the worst relative error of out over both."""
    g = torch.Generator().manual_seed(5)
    s = 4 * dist.get_world_size() + 3
    q, k, v = (torch.randn(1, s, 2, 8, generator=g) for _ in range(3))
    ok = torch.ones(s, s, dtype=torch.bool).tril()
    ref, _ = attention(q.double(), k.double(), v.double(), ok)
    errs = []
    for shard_kw in (dict(layout="zigzag"), {}):
        local = [ra.shard(t, seqlen=s, **shard_kw) for t in (q, k, v)]
        out = ra.unshard(ra.ring_attention(*local, causal=True, seqlen=s), seqlen=s)
        errs.append(rel_err(out, ref))
    return max(errs)


@pytest.mark.timeout(120)
def test_zigzag_shards_attended_with_defaults_are_exact(clusters):
    for rank, err in enumerate(clusters(3).run(default_layout_case, timeout=100)):
        assert err <= FP32_TOL, (rank, err)
