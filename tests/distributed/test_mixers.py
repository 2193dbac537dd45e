"""ringattn.mixers: causal convolution and linear recurrences (diagonal, gated delta rule
with a gate per head or per key channel, Mamba2 SSD) under context parallelism equal a float64 token-by-token loop in one process:
outputs and every input's gradient, on every rank, for each layout that serves them, S a
multiple of the layout's unit or not, ranks with no real token, and packed documents; and
the refusals (striped, ranks that disagree, one rank's bad input) raise on every rank."""

import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ringattn as ra
from ringattn import mixers

# ---------------------------------------------------------------- one-process references


def _doc_starts(seqlen, cu):
    return set(cu[:-1]) if cu is not None else {0}


def ref_conv(x, w, bias, activation, cu):
    """x [B, S, D], w [D, k]: out[t] = bias + sum_j w[:, j] x[t - k + 1 + j] within t's doc."""
    b, s, d = x.shape
    k = w.shape[1]
    starts = sorted(_doc_starts(s, cu))
    doc = [max(i for i, st in enumerate(starts) if st <= t) for t in range(s)]
    out = []
    for t in range(s):
        acc = bias.clone() if bias is not None else x.new_zeros(d)
        acc = acc.expand(b, d)
        for j in range(k):
            p = t - k + 1 + j
            if p >= 0 and doc[p] == doc[t]:
                acc = acc + w[:, j] * x[:, p]
        out.append(acc)
    out = torch.stack(out, dim=1)
    return F.silu(out) if activation else out


def ref_diag(a, x, cu):
    starts = _doc_starts(x.shape[1], cu)
    h, out = None, []
    for t in range(x.shape[1]):
        h = x[:, t] if t in starts else a[:, t] * h + x[:, t]
        out.append(h)
    return torch.stack(out, dim=1)


def ref_gdn(q, k, v, g, beta, scale, l2norm, cu):
    rep = v.shape[2] // k.shape[2]
    q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    if l2norm:
        q = q / torch.sqrt((q * q).sum(-1, keepdim=True) + 1e-6)
        k = k / torch.sqrt((k * k).sum(-1, keepdim=True) + 1e-6)
    starts = _doc_starts(q.shape[1], cu)
    b, s, h, dk = k.shape
    eye = torch.eye(dk, dtype=k.dtype)
    out = []
    for t in range(s):
        if t in starts:
            st = v.new_zeros(b, h, dk, v.shape[-1])
        kt, bt = k[:, t], beta[:, t, :, None, None]
        decay = torch.exp(g[:, t])  # [b, h] per head, or [b, h, dk] per key channel (KDA)
        decay = torch.diag_embed(decay) if decay.dim() == 3 else decay[..., None, None] * eye
        m = (eye - bt * torch.einsum("bhi,bhj->bhij", kt, kt)) @ decay
        st = m @ st + bt * torch.einsum("bhi,bhj->bhij", kt, v[:, t])
        out.append(torch.einsum("bhkv,bhk->bhv", st, q[:, t] * scale))
    return torch.stack(out, dim=1)


def ref_ssd(x, dt, A, B, C, D, dt_bias, cu):
    dt = F.softplus(dt + dt_bias)
    rep = x.shape[2] // B.shape[2]
    B, C = B.repeat_interleave(rep, dim=2), C.repeat_interleave(rep, dim=2)
    starts = _doc_starts(x.shape[1], cu)
    out = []
    for t in range(x.shape[1]):
        upd = torch.einsum("bhp,bhn->bhpn", dt[:, t, :, None] * x[:, t], B[:, t])
        h = upd if t in starts else torch.exp(dt[:, t] * A)[..., None, None] * h + upd
        out.append(torch.einsum("bhpn,bhn->bhp", h, C[:, t]) + D[:, None] * x[:, t])
    return torch.stack(out, dim=1)


# ---------------------------------------------------------------- the cases, on every rank


def _err(got, want):
    got, want = got.detach(), want.detach()
    return float((got - want).abs().max() / want.abs().max().clamp(min=1e-30))


def _case(family, layout, seqlen, cu, dtype, seed):
    """One call under CP against the reference: [(what, relative error)]."""
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0, low=None):
        t = torch.randn(*shape, generator=g, dtype=torch.float64) * scale
        return t if low is None else low + t.abs()

    b = 2
    if family == "conv":
        d, k = 3, 4
        glob = {"x": rnd(b, seqlen, d)}
        par = {"w": rnd(d, k), "bias": rnd(d)}
    elif family == "diag":
        glob = {"a": torch.sigmoid(rnd(b, seqlen, 3)), "x": rnd(b, seqlen, 3)}
        par = {}
    elif family == "gdn":
        glob = {"q": rnd(b, seqlen, 1, 3), "k": rnd(b, seqlen, 1, 3), "v": rnd(b, seqlen, 2, 2),
                "g": -rnd(b, seqlen, 2, scale=0.3).abs(),
                "beta": torch.sigmoid(rnd(b, seqlen, 2))}
        par = {}
    elif family == "kda":  # the gated delta rule with a gate per key channel (Kimi Linear)
        glob = {"q": rnd(b, seqlen, 2, 3), "k": rnd(b, seqlen, 2, 3), "v": rnd(b, seqlen, 2, 2),
                "g": -rnd(b, seqlen, 2, 3, scale=0.3).abs(),
                "beta": torch.sigmoid(rnd(b, seqlen, 2))}
        par = {}
    else:  # ssd
        glob = {"x": rnd(b, seqlen, 2, 2), "dt": rnd(b, seqlen, 2), "B": rnd(b, seqlen, 1, 3),
                "C": rnd(b, seqlen, 1, 3)}
        par = {"A": -rnd(2, low=0.2), "D": rnd(2), "dt_bias": rnd(2, scale=0.5)}
    weight = rnd(*_out_shape(family, b, seqlen))
    leaves = {n: t.detach().clone().to(dtype).requires_grad_() for n, t in {**glob, **par}.items()}
    kw = dict(layout=layout, seqlen=seqlen, cu_seqlens=cu)
    sh = {n: ra.shard(leaves[n], **kw) for n in glob}
    p = {n: leaves[n] for n in par}
    if family == "conv":
        out = mixers.causal_conv1d(sh["x"], p["w"], p["bias"], activation="silu", **kw)
    elif family == "diag":
        out = mixers.diagonal_recurrence(sh["a"], sh["x"], **kw)
    elif family in ("gdn", "kda"):
        out = mixers.gated_delta_rule(sh["q"], sh["k"], sh["v"], sh["g"], sh["beta"],
                                      use_qk_l2norm=True, **kw)
    else:
        out = mixers.mamba2_ssd(sh["x"], sh["dt"], p["A"], sh["B"], sh["C"], D=p["D"],
                                dt_bias=p["dt_bias"], dt_softplus=True, **kw)
    assert out.dtype == dtype, (family, out.dtype)
    real = ra.positions(seqlen, layout=layout, cu_seqlens=cu)
    real = (real[0] if cu is not None else real) >= seqlen
    assert bool((out[:, real] == 0).all()), (family, "padding slots are not zero")
    full = ra.unshard(out, **kw)
    (full * weight.to(dtype)).sum().backward()
    got = {n: torch.zeros_like(t) if t.grad is None else t.grad.clone() for n, t in leaves.items()}
    for n in par:  # this rank's share: the one-process gradient is their sum
        dist.all_reduce(got[n])

    ref = {n: t.detach().clone().requires_grad_() for n, t in {**glob, **par}.items()}
    if family == "conv":
        want = ref_conv(ref["x"], ref["w"], ref["bias"], True, cu)
    elif family == "diag":
        want = ref_diag(ref["a"], ref["x"], cu)
    elif family in ("gdn", "kda"):
        want = ref_gdn(ref["q"], ref["k"], ref["v"], ref["g"], ref["beta"], 1 / math.sqrt(3), True, cu)
    else:
        want = ref_ssd(ref["x"], ref["dt"], ref["A"], ref["B"], ref["C"], ref["D"], ref["dt_bias"], cu)
    (want * weight).sum().backward()
    errs = [("out", _err(full.double(), want.detach()))]
    errs += [(f"d{n}", _err(got[n].double(), torch.zeros_like(ref[n]) if ref[n].grad is None
                             else ref[n].grad)) for n in ref]  # None: no path, zero
    return errs


def _out_shape(family, b, seqlen):
    return {"conv": (b, seqlen, 3), "diag": (b, seqlen, 3), "gdn": (b, seqlen, 2, 2),
            "ssd": (b, seqlen, 2, 2), "kda": (b, seqlen, 2, 2)}[family]


def exact_cases():
    """Every family on: contiguous and zigzag with S a multiple of 2W and not, a rank with
    no real token (S < W), packed documents under zigzag (per document), contiguous and
    doc_contiguous; float64 to 1e-10 and some float32 runs to 1e-5. Returns the number of
    cases and the worst error per family and dtype."""
    world = dist.get_world_size()
    unit = 2 * world
    short = [0, 1, 5, 6, 13]  # documents of 1 and 4 tokens, one of 1, then a long one
    long = [0, 4, 4 + unit + 1, 4 + unit + 3]  # a document that spans several chunks
    shapes = [("contiguous", 2 * unit + 1, None), ("zigzag", 2 * unit, None),
              ("zigzag", 2 * unit + 1, None), ("zigzag", world - 1, None),
              ("zigzag", short[-1], short), ("contiguous", long[-1], long),
              ("doc_contiguous", short[-1], short), ("zigzag", long[-1], long)]
    if world > 2:  # the layouts' arithmetic again, fewer shapes
        shapes = shapes[2:6] + shapes[7:]
    worst = {}
    cases = [(family, *shape) for family in ("conv", "diag", "gdn", "ssd", "kda")
             for shape in shapes]
    for i, (family, layout, s, cu) in enumerate(cases):
        runs = ((torch.float64, 1e-10),) + (((torch.float32, 1e-5),) if i % 5 == 0 else ())
        for dtype, tol in runs:
            for what, err in _case(family, layout, s, cu, dtype, seed=i):
                assert err <= tol, (dist.get_rank(), family, layout, s, cu, dtype, what, err)
                key = (family, str(dtype))
                worst[key] = max(worst.get(key, 0.0), err)
    return len(cases), worst


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_exact_against_one_process(clusters, world):
    results = clusters(world).run(exact_cases, timeout=200)
    n = results[0][0]
    assert n == 5 * (8 if world == 2 else 5) and all(r[0] == n for r in results)
    assert {k[1] for k in results[0][1]} == {"torch.float64", "torch.float32"}


# ---------------------------------------------------------------- transformers' kernels


def kernels_fit():
    """transformers' own chunked kernels plug in as the local scan (their initial_state /
    initial_states and final-state outputs are what the mechanism needs), and on one
    sequence each function under CP equals transformers' function on the whole sequence
    in one process (their kernels compute in float32): (largest error against our loop,
    largest error against transformers)."""
    from functools import partial

    from transformers.models.mamba2.modeling_mamba2 import causal_conv1d_fn, mamba2_chunk_scan
    from transformers.models.kimi_linear.modeling_kimi_linear import chunk_kimi_delta_attention
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    world = dist.get_world_size()
    errs, hf_errs = [], []
    for layout, seqlen, cu in (("zigzag", 4 * world + 3, None), ("zigzag", 13, [0, 1, 5, 6, 13])):
        g = torch.Generator().manual_seed(seqlen)
        kw = dict(layout=layout, seqlen=seqlen, cu_seqlens=cu)
        q, k = (torch.randn(1, seqlen, 2, 4, generator=g, dtype=torch.float64) for _ in range(2))
        v = torch.randn(1, seqlen, 2, 3, generator=g, dtype=torch.float64)
        gg = -torch.rand(1, seqlen, 2, generator=g, dtype=torch.float64)
        beta = torch.rand(1, seqlen, 2, generator=g, dtype=torch.float64)
        outs = [mixers.gated_delta_rule(*(ra.shard(t, **kw) for t in (q, k, v, gg, beta)),
                                        use_qk_l2norm=True, kernel=kern, **kw)
                for kern in (None, partial(torch_chunk_gated_delta_rule, chunk_size=4))]
        errs.append(_err(outs[1], outs[0]))
        x = torch.randn(1, seqlen, 2, 3, generator=g, dtype=torch.float64)
        dt = torch.randn(1, seqlen, 2, generator=g, dtype=torch.float64)
        bm, cm = (torch.randn(1, seqlen, 1, 4, generator=g, dtype=torch.float64) for _ in range(2))
        a = -torch.rand(2, generator=g, dtype=torch.float64) - 0.1
        d, bias = (torch.randn(2, generator=g, dtype=torch.float64) for _ in range(2))
        ssd = dict(D=d, dt_bias=bias, dt_softplus=True)
        souts = [mixers.mamba2_ssd(*(ra.shard(t, **kw) for t in (x, dt)), a,
                                   *(ra.shard(t, **kw) for t in (bm, cm)), kernel=kern,
                                   **ssd, **kw)
                 for kern in (None, partial(mamba2_chunk_scan, chunk_size=4))]
        errs.append(_err(souts[1], souts[0]))
        if cu is None:  # transformers' functions on the whole sequence, in one process
            want = torch_chunk_gated_delta_rule(q, k, v, gg, beta, use_qk_l2norm_in_kernel=True)[0]
            hf_errs.append(_err(ra.unshard(outs[0], **kw), want.double()))
            want = mamba2_chunk_scan(x, dt, a, bm, cm, chunk_size=8, **ssd)
            hf_errs.append(_err(ra.unshard(souts[0], **kw), want.double()))
            xc = torch.randn(1, seqlen, 5, generator=g, dtype=torch.float64)
            wc = torch.randn(5, 4, generator=g, dtype=torch.float64)
            bc = torch.randn(5, generator=g, dtype=torch.float64)
            got = mixers.causal_conv1d(ra.shard(xc, **kw), wc, bc, activation="silu", **kw)
            want = causal_conv1d_fn(xc.transpose(1, 2), wc, bc, activation="silu").transpose(1, 2)
            hf_errs.append(_err(ra.unshard(got, **kw), want))
        # a gate per key channel (Kimi Delta Attention) with Kimi Linear's chunked kernel
        g = torch.Generator().manual_seed(seqlen + 1)
        q, k = (torch.randn(1, seqlen, 2, 4, generator=g, dtype=torch.float64) for _ in range(2))
        v = torch.randn(1, seqlen, 2, 3, generator=g, dtype=torch.float64)
        gk = -torch.rand(1, seqlen, 2, 4, generator=g, dtype=torch.float64)
        beta = torch.rand(1, seqlen, 2, generator=g, dtype=torch.float64)
        kouts = [mixers.gated_delta_rule(*(ra.shard(t, **kw) for t in (q, k, v, gk, beta)),
                                         use_qk_l2norm=True, kernel=kern, **kw)
                 for kern in (None, partial(chunk_kimi_delta_attention, chunk_size=4))]
        errs.append(_err(kouts[1], kouts[0]))
        if cu is None:
            want = chunk_kimi_delta_attention(q, k, v, gk, beta, use_qk_l2norm_in_kernel=True)[0]
            hf_errs.append(_err(ra.unshard(kouts[0], **kw), want.double()))
    return max(errs), max(hf_errs)


@pytest.mark.timeout(120)
def test_transformers_kernels_as_the_local_scan(clusters):
    for ours, theirs in clusters(2).run(kernels_fit, timeout=90):
        assert ours < 1e-5 and theirs < 1e-5, (ours, theirs)  # their kernels compute in float32


# ---------------------------------------------------------------- refusals


def _raises(fn):
    try:
        fn()
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return None, "no error"


def refusals():
    rank, world = dist.get_rank(), dist.get_world_size()
    s = 4 * world
    x = torch.randn(1, 4, 3, dtype=torch.float64)
    a = torch.rand(1, 4, 3, dtype=torch.float64)
    w = torch.randn(3, 4, dtype=torch.float64)
    said = {}
    said["striped"] = _raises(lambda: mixers.causal_conv1d(x, w, layout="striped", seqlen=s))
    said["striped_rec"] = _raises(lambda: mixers.diagonal_recurrence(a, x, layout="striped", seqlen=s))
    # one rank's seqlen differs: every rank raises, naming it
    said["seqlen"] = _raises(lambda: mixers.diagonal_recurrence(
        a, x, layout="contiguous", seqlen=s if rank else s - 1))
    # one rank's shapes are wrong: every rank raises its message
    bad = x[:, :, :2] if rank == world - 1 else x
    said["shape"] = _raises(lambda: mixers.diagonal_recurrence(a, bad, layout="contiguous", seqlen=s))
    said["weight"] = _raises(lambda: mixers.causal_conv1d(
        x, w[:2] if rank == 0 else w, layout="contiguous", seqlen=s))
    said["length"] = _raises(lambda: mixers.causal_conv1d(x, w, layout="zigzag", seqlen=s + 5))
    # a shard made with another layout than the call's
    tagged = ra.shard(torch.randn(1, s, 3, dtype=torch.float64), layout="zigzag")
    said["tag"] = _raises(lambda: mixers.causal_conv1d(tagged, w, layout="contiguous"))
    # gradients wanted on one rank only: its backward would wait for the others'
    said["grad"] = _raises(lambda: mixers.diagonal_recurrence(
        a, x.clone().requires_grad_(rank == 0), layout="contiguous", seqlen=s))
    # and the group still works after all of them
    ok = mixers.diagonal_recurrence(a, x, layout="contiguous", seqlen=s)
    # bfloat16 in, bfloat16 out on every rank (the exchanged maps travel in float32)
    half = mixers.diagonal_recurrence(a.bfloat16(), x.bfloat16(), layout="zigzag", seqlen=s - 1)
    return said, (tuple(ok.shape), half.dtype), parameters_only()


def parameters_only():
    """Only Mamba2's A, D and dt_bias want gradients and one rank holds no real token (S=1):
    every rank still reaches the backward's collective, and the ranks' shares sum to the
    one-process gradients."""
    g = torch.Generator().manual_seed(5)
    x, bm, cm = (torch.randn(1, 1, 2, 2, generator=g, dtype=torch.float64) for _ in range(3))
    dt = torch.randn(1, 1, 2, generator=g, dtype=torch.float64)
    par = [torch.randn(2, generator=g, dtype=torch.float64) for _ in range(3)]
    mine = [p.clone().requires_grad_() for p in par]
    kw = dict(layout="zigzag", seqlen=1)
    out = mixers.mamba2_ssd(*(ra.shard(t, **kw) for t in (x, dt)), mine[0],
                            *(ra.shard(t, **kw) for t in (bm, cm)), D=mine[1], dt_bias=mine[2],
                            dt_softplus=True, **kw)
    ra.unshard(out, **kw).square().sum().backward()
    got = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for p in mine]
    for t in got:  # (the rank without tokens has no share: None)
        dist.all_reduce(t)
    ref = [p.clone().requires_grad_() for p in par]
    ref_ssd(x, dt, ref[0], bm, cm, ref[1], ref[2], None).square().sum().backward()
    return max(_err(a, torch.zeros_like(b) if b.grad is None else b.grad)  # None: A unused at S=1
               for a, b in zip(got, ref))


@pytest.mark.timeout(120)
def test_refusals_on_every_rank(clusters):
    for rank, (said, shape, err) in enumerate(clusters(2).run(refusals, timeout=90)):
        assert shape == ((1, 4, 3), torch.bfloat16), (rank, shape)
        assert err < 1e-12, (rank, err)
        assert said["tag"][0] == "ValueError" and "sharded with layout 'zigzag'" in said["tag"][1], said
        assert said["grad"][0] == "ValueError" and "disagree on needs_grad" in said["grad"][1], said
        for key in ("striped", "striped_rec"):
            assert said[key][0] == "ValueError" and "'striped'" in said[key][1], (rank, said[key])
        assert said["seqlen"][0] == "ValueError" and "disagree on seqlen" in said["seqlen"][1], said
        assert said["shape"][0] == "ValueError" and "rank 1" in said["shape"][1] \
            and "one shape" in said["shape"][1], said["shape"]
        assert said["weight"][0] == "ValueError" and "weight [D, k]" in said["weight"][1], said
        assert said["length"][0] == "ValueError" and "S_local=4" in said["length"][1], said
