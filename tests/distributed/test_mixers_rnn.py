"""ringattn.mixers.wkv (RWKV-4) and ringattn.mixers.mlstm (xLSTM), whose states are kept on a
running maximum's log scale, under context parallelism equal a float64 token loop in one
process that takes the exponentials as they are (no stabiliser): outputs and every input's
gradient, on every rank, for each layout that serves them, S a multiple of the layout's unit
or not, a rank with no real token, and packed documents; keys up to about 100 (exp(k)
overflows float32, so a cross-rank exchange of unscaled states would give inf); and
transformers' own functions (``rwkv_linear_attention_cpu``, xLSTM's inference kernel) as the
local scan, against those functions on the whole sequence in float32. Refusals raise on
every rank, and transformers' RWKV and xLSTM models are refused unconverted (by
``prepare_batch``; by ``check_consumed`` on the ``shard_batch``-only path) and with a cache
under CP."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

import ringattn as ra
from ringattn import mixers
from test_mixers import _raises  # (type name, message) of what fn raises

EPS = 1e-2
"""eps of the mLSTM cases (xLSTM's default is 1e-6): large, so that the stabiliser m, which
the output depends on through eps e^m, weighs in every case (a wrong m shows at 1e-4, not
at 1e-9)."""


def _doc_starts(seqlen, cu):
    return set(cu[:-1]) if cu is not None else {0}


def ref_wkv(td, tfirst, k, v, cu):
    """k, v [B, S, D]; the numerator and denominator as they are (float64 holds e^100)."""
    w, u = torch.exp(td), tfirst
    starts = _doc_starts(k.shape[1], cu)
    out = []
    for t in range(k.shape[1]):
        if t in starts:
            a = b = torch.zeros_like(k[:, 0])
        now = torch.exp(u + k[:, t])
        out.append((a + now * v[:, t]) / (b + now))
        a = torch.exp(-w) * a + torch.exp(k[:, t]) * v[:, t]
        b = torch.exp(-w) * b + torch.exp(k[:, t])
    return torch.stack(out, dim=1)


def ref_mlstm(q, k, v, i, f, eps, cu):
    """q, k [B, S, H, dk], v [B, S, H, dv], i, f [B, S, H]: the real memory and normaliser
    (C e^m, n e^m), and the stabiliser m (0 at a document's start) only where transformers'
    output depends on it: h = q C' / (max(|q n'|, 1) + eps e^m)."""
    starts = _doc_starts(k.shape[1], cu)
    scale = k.shape[-1] ** -0.5
    out = []
    for t in range(k.shape[1]):
        if t in starts:
            mem = torch.zeros(*k.shape[:1], k.shape[2], k.shape[3], v.shape[3], dtype=k.dtype)
            norm = torch.zeros_like(k[:, 0])
            m = torch.zeros_like(i[:, 0])
        logf = F.logsigmoid(f[:, t])
        m = torch.maximum(logf + m, i[:, t])
        gate, write = torch.exp(logf), torch.exp(i[:, t])
        mem = gate[..., None, None] * mem + write[..., None, None] * (
            k[:, t][..., None] * v[:, t][..., None, :])
        norm = gate[..., None] * norm + write[..., None] * k[:, t]
        qt = q[:, t] * scale
        num = (qt[..., None] * mem).sum(dim=-2)
        den = (qt * norm).sum(dim=-1, keepdim=True).abs()
        out.append(num / (torch.clamp(den, min=1.0) + eps * torch.exp(m)[..., None]))
    return torch.stack(out, dim=1)


def _err(got, want, floor=1e-30):
    """Largest difference over the largest reference entry (at least ``floor``: a gradient
    that is analytically zero, RWKV's d out / d k of a document's only token, is rounding
    noise of about 1e-16 in float64, which no relative error can compare)."""
    got, want = got.detach(), want.detach()
    return float((got - want).abs().max() / want.abs().max().clamp(min=floor))


def _inputs(family, b, seqlen, g, key_scale):
    def rnd(*shape, scale=1.0):
        return torch.randn(*shape, generator=g, dtype=torch.float64) * scale

    if family == "wkv":
        d = 3
        glob = {"k": rnd(b, seqlen, d, scale=key_scale), "v": rnd(b, seqlen, d)}
        par = {"td": rnd(d), "tf": rnd(d)}
        return glob, par, (b, seqlen, d)
    h, dk, dv = 2, 3, 2
    glob = {"q": rnd(b, seqlen, h, dk), "k": rnd(b, seqlen, h, dk), "v": rnd(b, seqlen, h, dv),
            "i": rnd(b, seqlen, h, scale=key_scale / 8) - 2.0, "f": rnd(b, seqlen, h, scale=3.0)}
    return glob, {}, (b, seqlen, h, dv)


def _case(family, layout, seqlen, cu, dtype, seed, key_scale):
    """One call under CP against the float64 reference: [(what, relative error)]."""
    g = torch.Generator().manual_seed(seed)
    glob, par, out_shape = _inputs(family, 2, seqlen, g, key_scale)
    weight = torch.randn(*out_shape, generator=g, dtype=torch.float64)
    leaves = {n: t.detach().clone().to(dtype).requires_grad_() for n, t in {**glob, **par}.items()}
    kw = dict(layout=layout, seqlen=seqlen, cu_seqlens=cu)
    sh = {n: ra.shard(leaves[n], **kw) for n in glob}
    if family == "wkv":
        out = mixers.wkv(leaves["td"], leaves["tf"], sh["k"], sh["v"], **kw)
    else:
        out = mixers.mlstm(sh["q"], sh["k"], sh["v"], sh["i"], sh["f"], eps=EPS, **kw)
    assert out.dtype == dtype, (family, out.dtype)
    real = ra.positions(seqlen, layout=layout, cu_seqlens=cu)
    real = (real[0] if cu is not None else real) >= seqlen
    assert bool((out[:, real] == 0).all()), (family, "padding slots are not zero")
    full = ra.unshard(out, **kw)
    assert bool(torch.isfinite(full).all()), (family, "not finite")
    (full * weight.to(dtype)).sum().backward()
    got = {n: torch.zeros_like(t) if t.grad is None else t.grad.clone() for n, t in leaves.items()}
    for n in par:  # this rank's share: the one-process gradient is their sum
        dist.all_reduce(got[n])
    ref = {n: t.detach().clone().requires_grad_() for n, t in {**glob, **par}.items()}
    if family == "wkv":
        want = ref_wkv(ref["td"], ref["tf"], ref["k"], ref["v"], cu)
    else:
        want = ref_mlstm(ref["q"], ref["k"], ref["v"], ref["i"], ref["f"], EPS, cu)
    (want * weight).sum().backward()
    errs = [("out", _err(full.double(), want))]
    errs += [(f"d{n}", _err(got[n].double(), torch.zeros_like(ref[n]) if ref[n].grad is None
                             else ref[n].grad, 1e-3)) for n in ref]  # None: no path (S = 1)
    return errs


def exact_cases():
    """Both functions on: contiguous and zigzag with S a multiple of 2W and not, a rank with
    no real token (S < W), packed documents under zigzag (per document), contiguous and
    doc_contiguous; float64 to 1e-10 with keys up to about 100 (RWKV's k; xLSTM's input
    gate up to about 12), and float32 to 1e-5 with keys up to about 30 (float32's own
    rounding of these functions grows with the spread of the weights, in one process too).
    Returns the number of cases and the worst error per family and dtype."""
    world = dist.get_world_size()
    unit = 2 * world
    short = [0, 1, 5, 6, 13]
    long = [0, 4, 4 + unit + 1, 4 + unit + 3]
    shapes = [("contiguous", 2 * unit + 1, None), ("zigzag", 2 * unit, None),
              ("zigzag", 2 * unit + 1, None), ("zigzag", world - 1, None),
              ("zigzag", short[-1], short), ("contiguous", long[-1], long),
              ("doc_contiguous", short[-1], short), ("zigzag", long[-1], long),
              ("zigzag", 37, None)]
    worst = {}
    cases = [(family, *shape) for family in ("wkv", "mlstm") for shape in shapes]
    for i, (family, layout, s, cu) in enumerate(cases):
        for dtype, tol, scale in ((torch.float64, 1e-10, 40.0), (torch.float32, 1e-5, 10.0)):
            for what, err in _case(family, layout, s, cu, dtype, i, scale):
                assert err <= tol, (dist.get_rank(), family, layout, s, cu, dtype, what, err)
                key = (family, str(dtype))
                worst[key] = max(worst.get(key, 0.0), err)
    return len(cases), worst


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_exact_against_one_process(clusters, world):
    results = clusters(world).run(exact_cases, timeout=240)
    n = results[0][0]
    assert n == 18 and all(r[0] == n for r in results)
    assert {k for k in results[0][1]} == {(f, str(d)) for f in ("wkv", "mlstm")
                                          for d in (torch.float64, torch.float32)}


def kernels_fit():
    """transformers' own functions as the local scan (they take an entering state and
    return the leaving one), against those functions on the whole sequence in one process,
    float32, S = 37 (RWKV's keys up to about 100: the naive exp(k) is inf in float32;
    xLSTM with chunk size 16, so that one process runs its chunkwise kernel on 32 tokens
    and its recurrent one on 5, and input gates up to about 15, its soft cap, where the
    stabiliser weighs in the output through eps e^m): (worst output error, worst gradient
    error) over both, outputs and the gradients of every input."""
    import transformers as tf
    from transformers.models.rwkv.modeling_rwkv import rwkv_linear_attention_cpu
    from transformers.models.xlstm.modeling_xlstm import xLSTMBackend

    seqlen, kw = 37, dict(layout="zigzag", seqlen=37)
    g = torch.Generator().manual_seed(7)
    errs = {}

    def compare(name, ours, theirs, leaves_ours, leaves_theirs, weight):
        (ours * weight).sum().backward()
        (theirs * weight).sum().backward()
        errs[name] = {"out": _err(ours, theirs), "grad": 0.0}
        for a, b in zip(leaves_ours, leaves_theirs):
            grad = a.grad.clone()
            if a.dim() == 1:  # a parameter: each rank holds its share
                dist.all_reduce(grad)
            errs[name]["grad"] = max(errs[name]["grad"], _err(grad, b.grad))

    d = 8
    k = torch.randn(2, seqlen, d, generator=g) * 40
    assert not bool(torch.isfinite(torch.exp(k)).all())  # a naive exp(k) overflows
    v = torch.randn(2, seqlen, d, generator=g)
    td, tfirst = torch.randn(d, generator=g), torch.randn(d, generator=g)
    mine = [t.clone().requires_grad_() for t in (td, tfirst, k, v)]
    theirs = [t.clone().requires_grad_() for t in (td, tfirst, k, v)]
    out = mixers.wkv(mine[0], mine[1], ra.shard(mine[2], **kw), ra.shard(mine[3], **kw),
                     kernel=rwkv_linear_attention_cpu, **kw)
    want = rwkv_linear_attention_cpu(*theirs)[0]
    compare("wkv", ra.unshard(out, **kw), want, mine, theirs,
            torch.randn(want.shape, generator=g))

    backend = xLSTMBackend(tf.xLSTMConfig(hidden_size=64, num_heads=4, chunk_size=16))
    h, dk, dv = 4, 8, 16
    # q and k positive: q . n sums terms of one sign. Where it cancels (|q . n| small next to
    # its terms, then divided by), float32 rounding alone moves h by about 4e-4 here, in one
    # process too: with random q and k, transformers' chunkwise and recurrent kernels differ
    # by 4.1e-4 on these inputs.
    q, kk = (torch.randn(2, h, seqlen, dk, generator=g).abs() for _ in range(2))
    vv = torch.randn(2, h, seqlen, dv, generator=g)
    ig = 15 * torch.tanh(torch.randn(2, h, seqlen, generator=g) * 2)  # the config's soft cap
    fg = 15 * torch.tanh(torch.randn(2, h, seqlen, generator=g))
    mine = [t.clone().requires_grad_() for t in (q, kk, vv, ig, fg)]
    theirs = [t.clone().requires_grad_() for t in (q, kk, vv, ig, fg)]
    out = mixers.mlstm(*(ra.shard(t.transpose(1, 2), **kw) for t in mine),
                       eps=backend.config.eps, kernel=backend._inference_fn, **kw)
    want = backend(*theirs)[0].transpose(1, 2)
    compare("mlstm", ra.unshard(out, **kw), want, mine, theirs,
            torch.randn(want.shape, generator=g))
    return errs


@pytest.mark.timeout(120)
def test_transformers_functions_as_the_local_scan(clusters):
    for rank, errs in enumerate(clusters(2).run(kernels_fit, timeout=90)):
        for name in ("wkv", "mlstm"):
            assert errs[name]["out"] < 1e-5 and errs[name]["grad"] < 1e-5, (rank, errs)


def refusals():
    rank, world = dist.get_rank(), dist.get_world_size()
    s = 4 * world
    k = torch.randn(1, 4, 3, dtype=torch.float64)
    p = torch.randn(3, dtype=torch.float64)
    q = torch.randn(1, 4, 2, 3, dtype=torch.float64)
    gate = torch.randn(1, 4, 2, dtype=torch.float64)
    said = {}
    said["wkv_shape"] = _raises(lambda: mixers.wkv(p if rank else p[:2], p, k, k,
                                                   layout="contiguous", seqlen=s))
    said["mlstm_shape"] = _raises(lambda: mixers.mlstm(q, q, q, gate if rank else gate[..., :1],
                                                       gate, layout="contiguous", seqlen=s))
    said["striped"] = _raises(lambda: mixers.mlstm(q, q, q, gate, gate, layout="striped", seqlen=s))
    said["seqlen"] = _raises(lambda: mixers.wkv(p, p, k, k, layout="contiguous",
                                                seqlen=s if rank else s - 1))
    ok = mixers.mlstm(q, q, q, gate, gate, layout="contiguous", seqlen=s)
    return said, tuple(ok.shape)


@pytest.mark.timeout(120)
def test_refusals_on_every_rank(clusters):
    for rank, (said, shape) in enumerate(clusters(2).run(refusals, timeout=90)):
        assert shape == (1, 4, 2, 3), (rank, shape)
        assert said["wkv_shape"][0] == "ValueError" and "time_decay" in said["wkv_shape"][1], said
        assert said["mlstm_shape"][0] == "ValueError" and "igate" in said["mlstm_shape"][1], said
        assert said["striped"][0] == "ValueError" and "'striped'" in said["striped"][1], said
        assert said["seqlen"][0] == "ValueError" and "disagree on seqlen" in said["seqlen"][1], said


# ---------------------------------------------------------------- the models, unconverted


def model_refusals():
    """RWKV and xLSTM under ringattn, on this rank: unconverted, ``prepare_batch`` refuses
    them (``check_model``) and, on the ``shard_batch``-only path, where no ringattn code
    runs in their forward, ``check_consumed`` does; converted, a cache under CP is refused.
    Returns {what: message or None}."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "integration"))
    from families import build
    from test_transformers import _batch

    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    batch = _batch("plain", 37)
    said = {}
    for name in ("rwkv", "xlstm"):
        said[f"{name} prepare"] = _raises(
            lambda: ra_hf.prepare_batch(build(name, "ringattn"), batch))[1]
        model, local = build(name, "ringattn"), ra.shard_batch(batch)
        model(**local, use_cache=False)
        said[f"{name} consumed"] = _raises(lambda: local["ring_context"].check_consumed(model))[1]
        model = ra_hf.convert(build(name, "ringattn"))
        said[f"{name} cache"] = _raises(
            lambda: model(**ra_hf.prepare_batch(model, batch), use_cache=True))[1]
    return said


@pytest.mark.timeout(180)
def test_models_refused_unconverted_and_with_a_cache(clusters):
    pytest.importorskip("transformers")
    for rank, said in enumerate(clusters(2).run(model_refusals, timeout=150)):
        for name in ("rwkv", "xlstm"):
            assert "sequence layers other than attention" in said[f"{name} prepare"] \
                and "convert" in said[f"{name} prepare"], (rank, said)
            assert "ran without calling ring attention" in said[f"{name} consumed"], (rank, said)
            assert "use_cache=False" in said[f"{name} cache"], (rank, said)
