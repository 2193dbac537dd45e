"""Score biases one step to the side of the family survey (ringattn.score_bias and
integrations/transformers/families/score_bias.py).

* ``ring_attention_with_bias`` (a per-query relative bias over global distances, per-query
  sinks, a window) equals a dense float64 oracle on every rank, output and every gradient
  (q, k, v, the bias rows, the sinks), zigzag and contiguous, W = 2, 3 and 4 with S = 5
  (at W = 4 the zigzag shards hold 2 slots each: the last rank's shard is all padding), and
  packed documents.
* Bad input on ONE rank (a bias row of the wrong extent) raises the same ValueError on
  every rank, before any ring message; never a hang.
* Doge with S above keep_window_size (its per-row top-k keys) is refused on every rank with
  a ValueError naming keep_window_size and the sequence length.
* Inkling with its logarithmic query scaling (``log_scaling_n_floor``, off in the survey's
  config) equals one process at W = 2: plain, left-padded, packed and contiguous.
"""

from __future__ import annotations

import sys
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ringattn as ra
from families import FAMILIES

TOL = 1e-10  # float64 against the float64 oracle
_INTEGRATION = str(Path(__file__).resolve().parents[1] / "integration")
"""The survey's helpers (test_transformers' batches, test_hybrid_families' cases)."""


def _helpers():
    if _INTEGRATION not in sys.path:
        sys.path.insert(0, _INTEGRATION)


def _oracle(q, k, v, table, sinks, scale, window, starts=None):
    """Dense attention with the relative bias table[b, i, h, i - j] and per-row sinks."""
    b, s, h, _ = q.shape
    groups = h // k.shape[2]
    kk, vv = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, kk) * scale
    dist_ = torch.arange(s)[:, None] - torch.arange(s)[None, :]
    extent = table.shape[-1]
    rows = table.permute(0, 2, 1, 3)
    bias = rows.gather(-1, dist_.clamp(0, extent - 1).expand(b, h, s, s))
    scores = scores + bias.masked_fill((dist_ < 0) | (dist_ >= extent), 0.0)
    ok = (dist_ >= 0) & (dist_ <= window)
    if starts is not None:
        doc = torch.searchsorted(torch.tensor(starts), torch.arange(s), right=True)
        ok = ok & (doc[:, None] == doc[None, :])
    scores = scores.masked_fill(~ok, float("-inf"))
    scores = torch.cat([scores, sinks[..., None]], dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", scores.softmax(-1)[..., :-1], vv)


def _biased_case(seqlen, layout, cu=None):
    """Rank function: max abs error of the output and every gradient against the oracle."""
    from ringattn.score_bias import ring_attention_with_bias

    g = torch.Generator().manual_seed(seqlen)
    b, h, hkv, d, extent, window = 2, 4, 2, 8, 4, 3
    full = [torch.randn(b, seqlen, *shape, generator=g, dtype=torch.float64)
            for shape in ((h, d), (hkv, d), (hkv, d), (h, extent))]
    sinks = torch.randn(b, h, seqlen, generator=g, dtype=torch.float64)
    for t in (*full, sinks):
        t.requires_grad_()
    ref = _oracle(*full, sinks, 0.4, window, None if cu is None else cu[:-1])
    grad = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    ref.backward(grad)
    kw = dict(layout=layout, cu_seqlens=cu)
    local = [ra.shard(t.detach(), **kw).requires_grad_() for t in full]
    local_sinks = ra.shard(sinks.detach().transpose(1, 2), **kw).transpose(1, 2).contiguous()
    local_sinks.requires_grad_()
    out = ring_attention_with_bias(*local[:3], local[3], rel_extent=extent,
                                   query_sinks=local_sinks, causal=True, window_size=(window, 0),
                                   softmax_scale=0.4, seqlen=seqlen, **kw)
    (out * ra.shard(grad, **kw)).sum().backward()

    def back(x):
        return ra.unshard(x, seqlen=seqlen, **kw)

    errs = {"out": back(out.detach()) - ref.detach()}
    for name, mine, theirs in zip(("dq", "dk", "dv", "dbias"), local, full):
        errs[name] = back(mine.grad) - theirs.grad
    errs["dsinks"] = back(local_sinks.grad.transpose(1, 2)).transpose(1, 2) - sinks.grad
    return {name: float(e.abs().max()) for name, e in errs.items()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", (2, 3, 4))
def test_relative_bias_and_sinks_equal_the_oracle(clusters, world):
    cases = [(13, "zigzag", None), (13, "contiguous", None), (5, "zigzag", None),
             (16, "zigzag", [0, 5, 6, 16])]
    for seqlen, layout, cu in cases:
        for rank, errs in enumerate(clusters(world).run(_biased_case, seqlen, layout, cu,
                                                        timeout=120)):
            for name, err in errs.items():
                assert err <= TOL, (world, seqlen, layout, cu, rank, name, err)


def _bad_extent():
    """Rank function: rank 1 passes a bias row one distance too short; what each rank raised."""
    from ringattn.score_bias import ring_attention_with_bias

    q = ra.shard(torch.randn(1, 12, 2, 8))
    kv = ra.shard(torch.randn(1, 12, 2, 8))
    extent = 3 if dist.get_rank() == 1 else 4
    table = torch.randn(1, q.shape[1], 2, extent)
    try:
        ring_attention_with_bias(q, kv, kv, table, rel_extent=4, seqlen=12)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(120)
def test_bad_bias_on_one_rank_is_refused_on_every_rank(clusters):
    said = clusters(2).run(_bad_extent, timeout=60)
    assert all(s and "rel_bias has extent 3" in s for s in said), said


def _doge_too_long():
    """Rank function: Doge (keep_window_size 8) on S = 37 under CP: the message."""
    from ringattn.integrations import transformers as ra_hf

    _helpers()
    from test_transformers import _batch

    ra_hf.register()
    config, cls = FAMILIES["doge"]()
    config.keep_window_size = 8
    config._attn_implementation = "ringattn"
    torch.manual_seed(0)
    model = ra_hf.convert(cls(config).float())
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    local = ra_hf.prepare_batch(model, _batch("plain", 37), group=group)
    try:
        model(**local, use_cache=False)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(120)
def test_doge_top_k_beyond_keep_window_size_is_refused_on_every_rank(clusters):
    said = clusters(2).run(_doge_too_long, timeout=60)
    assert all(s and "keep_window_size=8" in s and "sequence length 37" in s for s in said), said


def _inkling_log_scaled():
    config, cls = FAMILIES["inkling_text"]()
    config.log_scaling_n_floor = 4
    return config, cls


def _log_cases():
    _helpers()
    import test_hybrid_families as hybrid

    hybrid.EXTRA["inkling_log_scaled"] = _inkling_log_scaled
    return hybrid.exact_cases(["inkling_log_scaled"])


@pytest.mark.timeout(300)
def test_inkling_log_scaling_equals_one_process(clusters):
    for rank, results in enumerate(clusters(2).run(_log_cases, timeout=240)):
        assert {k for _, k in results} == {"plain", "padded", "packed", "contiguous",
                                           "no ring context"}
        for key, errs in results.items():
            assert isinstance(errs, dict), (rank, key, errs)
            for what, err in errs.items():
                if what != "worst_grad":
                    assert err <= 1e-5, (rank, key, what, err)
