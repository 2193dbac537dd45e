"""Rows that see nothing, with attention sinks, in every strategy: exact or zero, never NaN.

Legend: B batch, S global seq, L local seq, H heads, Hkv kv heads, D head dim, W world size.

A sink of -inf is no sink: a row that sees no key and has a -inf sink has out 0, lse -inf
and zero, finite gradients (q, k, v and the sinks). A row that sees no key but has a finite
sink has out 0 and lse = the sink. Padding rows (S not divisible by W) have out 0 and lse
-inf with or without sinks. Every case is compared on every rank, for ring, Ulysses and
all-gather at W 2 and 3 and the hybrid on a 2x2 mesh, against the float64 oracle
(tests/reference.py): fp32 within 1e-5 relative; bf16 within 2x the error of the same
eager attention computed in bf16 (test_features.py's criterion), and NaN-free.
"""

from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist

import ringattn as ra
from reference import attention, rel_err
from test_exact import check
from test_hybrid import mesh

FP32_TOL = 1e-5
NEG_INF = float("-inf")


@dataclass(frozen=True)
class Case:
    name: str
    mask: str
    """"dilated": rows outside each head's pattern see nothing; "strict-docs": packed
    documents, each query sees the keys strictly before it in its document (every
    document's first token sees nothing); "window-docs": documents & a window that excludes
    the query itself (rows at a document's start see nothing)."""
    sinks: tuple
    """Per head: a float, or None for -inf."""
    causal: bool = False
    kv_heads: int = 2
    lse_grad: bool = True
    seed: int = 0


CASES = [
    Case("dilated, -inf sinks on half the heads", "dilated", (None, 0.5, None, -1.0), seed=1),
    Case("strict docs, -inf sinks", "strict-docs", (None, None, 0.3, None), seed=2),
    Case("strict docs, finite sinks", "strict-docs", (0.2, -0.7, 1.1, 0.0), kv_heads=1, seed=3),
    Case("window docs, every sink -inf", "window-docs", (None,) * 4, causal=True, seed=4),
    Case("dilated, finite sinks, no lse grad", "dilated", (-0.4, 0.9, 0.1, 2.0), lse_grad=False,
         seed=5),
    Case("window docs, mixed sinks, MHA", "window-docs", (None, 1.5, None, -2.0), kv_heads=4,
         seed=6),
]
BF16_CASES = [CASES[0], CASES[3]]


def _setup(case, seqlen):
    """(keyword arguments of the call, the [H|1, S, S] visibility from the definitions)."""
    s = seqlen
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    causal = j <= i if case.causal else torch.ones(s, s, dtype=torch.bool)
    if case.mask == "dilated":
        h = torch.arange(4).view(4, 1, 1)
        ok = (i // 5 == j // 5) & (i % 3 == h % 3) & (j % 3 == h % 3)
        return dict(mask=ra.masks.dilated(5, 3, head_offsets=True)), ok & causal
    cu = [0, 1, 4, s // 2 + 1, s]
    doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
    same = doc[:, None] == doc[None, :]
    if case.mask == "strict-docs":
        return dict(cu_seqlens=cu, mask=_STRICT), (same & (j < i) & causal)[None]
    # window-docs: keys up to 3 before the query in its document, not the query itself
    ok = same & (j >= i - 3) & (j != i) & causal
    return dict(cu_seqlens=cu, window_size=(3, -1), mask=_NOT_SELF), ok[None]


_STRICT = ra.masks.from_function(lambda b, h, q, kv: kv < q)
_NOT_SELF = ra.masks.from_function(lambda b, h, q, kv: kv != q)


def _data(case, seqlen, dtype):
    g = torch.Generator().manual_seed(case.seed)
    b, h, d = 2, 4, 8
    q = torch.randn(b, seqlen, h, d, generator=g).to(dtype)
    k = torch.randn(b, seqlen, case.kv_heads, d, generator=g).to(dtype)
    v = torch.randn(b, seqlen, case.kv_heads, d, generator=g).to(dtype)
    do = torch.randn(b, seqlen, h, d, generator=g).to(dtype)
    dlse = torch.randn(b, h, seqlen, generator=g) if case.lse_grad else None
    sinks = torch.tensor([NEG_INF if x is None else x for x in case.sinks]).to(dtype)
    return q, k, v, do, dlse, sinks


def _grads(q, k, v, do, dlse, sinks, ok, dtype):
    """out, lse, dq, dk, dv, dsinks of the oracle on the whole sequence in ``dtype``."""
    leaves = [t.detach().to(dtype).requires_grad_() for t in (q, k, v, sinks)]
    out, lse = attention(*leaves[:3], ok, sinks=leaves[3])
    loss = (out * do.to(dtype)).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse.to(dtype)).sum()
    loss.backward()
    return [out.detach(), lse.detach()] + [t.grad for t in leaves]


def run_dead(strategy, dtype_name, hybrid=False):
    """Rank side: {case: {tensor: (err, tol, max_abs)}} for every case; a NaN or infinity
    anywhere (but lse's -inf where the oracle has it) gives an infinite error."""
    dtype = getattr(torch, dtype_name)
    world = dist.get_world_size()
    seqlen = 5 * world + 3  # divides neither W nor 2W: every layout pads
    options = {"group": mesh(2, 2)} if hybrid else {}
    results = {}
    for case in CASES if dtype == torch.float32 else BF16_CASES:
        q, k, v, do, dlse, sinks = _data(case, seqlen, dtype)
        extra, ok = _setup(case, seqlen)
        refs = _grads(q, k, v, do, dlse, sinks, ok, torch.float64)
        assert bool((~ok.any(-1)).any()), "every case has rows that see no key"
        if dtype == torch.float32:
            tols = [FP32_TOL] * len(refs)
        else:  # 2x the eager bf16 attention's error, plus 1e-6: lse is fp32 in both, and
            # where the reference is exactly 0 (dsinks of -inf sinks) so is the eager error
            eager = _grads(q, k, v, do, dlse, sinks, ok, dtype)
            tols = [2 * rel_err(x, r, floor=1.0 if i == 1 else 0.0) + 1e-6
                    for i, (x, r) in enumerate(zip(eager, refs))]
        leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
        cu = extra.pop("cu_seqlens", None)
        kw = dict(layout="zigzag", seqlen=seqlen, cu_seqlens=cu)
        ql, kl, vl = (ra.shard(t, **kw) for t in leaves[:3])
        out_l, lse_l = getattr(ra, strategy)(ql, kl, vl, sinks=leaves[3], return_lse=True,
                                             causal=case.causal, **extra, **kw, **options)
        loss = (ra.unshard(out_l, **kw) * do).sum()
        if dlse is not None:
            lse_g = ra.unshard(lse_l, dim=2, **kw)
            loss = loss + (torch.where(torch.isfinite(lse_g), lse_g, 0.0) * dlse).sum()
        loss.backward()
        pos = ra.positions(seqlen, layout="zigzag", cu_seqlens=cu)
        pos = pos[0] if cu is not None else pos
        real = pos < seqlen
        dsinks = leaves[3].grad.clone()
        dist.all_reduce(dsinks)  # each rank holds its rows' (or heads') share
        got = [out_l[:, real], lse_l[:, :, real], *(t.grad for t in leaves[:3]), dsinks]
        want = [refs[0][:, pos[real]], refs[1][:, :, pos[real]], *refs[2:]]
        errs = {}
        for name, x, r, tol in zip(("out", "lse", "dq", "dk", "dv", "dsinks"), got, want, tols):
            finite = bool(torch.isfinite(x).all()) if name != "lse" else not bool(x.isnan().any())
            err = rel_err(x, r, floor=1.0 if name == "lse" else 0.0) if finite else float("inf")
            errs[name] = (err, tol, float((x.detach().double() - r).abs().nan_to_num(1e9).max()))
        pad_ok = bool((out_l[:, ~real] == 0).all()) and bool((lse_l[:, :, ~real] == NEG_INF).all())
        errs["padding rows"] = (0.0 if pad_ok else float("inf"), 1.0, 0.0)
        results[case.name] = errs
    return results


SETTINGS = [(w, s) for w in (2, 3) for s in ("ring_attention", "ulysses_attention",
                                            "allgather_attention")] + [(4, "hybrid_attention")]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world,strategy", SETTINGS)
def test_dead_rows_and_sinks_fp32_exact(clusters, worst_errors, world, strategy):
    per_rank = clusters(world).run(run_dead, strategy, "float32", strategy == "hybrid_attention",
                                   timeout=150)
    check(per_rank, "float32", worst_errors)


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world,strategy", [(2, "ring_attention"), (3, "ulysses_attention"),
                                            (3, "allgather_attention")])
def test_dead_rows_and_sinks_bf16_nan_free(clusters, worst_errors, world, strategy):
    per_rank = clusters(world).run(run_dead, strategy, "bfloat16", timeout=150)
    check(per_rank, "bfloat16", worst_errors)
