"""Score biases one step to the side of the family survey (ringattn.score_bias and
integrations/transformers/families/score_bias.py).

* ``ring_attention_with_bias`` (a per-query relative bias over global distances, per-query
  sinks, a window) equals a dense float64 oracle on every rank, output and every gradient
  (q, k, v, the bias rows, the sinks), zigzag and contiguous, W = 2, 3 and 4 with S = 5
  (at W = 4 the zigzag shards hold 2 slots each: the last rank's shard is all padding), and
  packed documents.
* Bad input on ONE rank (a bias row of the wrong extent) raises the same ValueError on
  every rank, before any ring message; never a hang.
* Doge with S above keep_window_size (each query's top keep_window_size keys of its bias)
  equals one process in float64 on every rank, W = 2 and 3, plain and left-padded, a layer
  whose bias ties on every key included; a keep_window_size that differs between ranks
  raises the same ValueError on every rank.
* Under bf16 autocast, mixed-dtype q, k, v are cast to bf16 as ``ring_attention`` casts
  them (Inkling under autocast raised "q, k, v must share a dtype" before).
* Inkling with its logarithmic query scaling (``log_scaling_n_floor``, off in the survey's
  config) equals one process at W = 2: plain, left-padded, packed and contiguous.
* Inkling, Inkling2 and Doge sharded for Ulysses or the all-gather strategy are refused on
  every rank, naming the strategy.
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


def _eager64(module, query, key, value, attention_mask, scaling, dropout=0.0, **kwargs):
    """transformers' eager attention with its softmax in the inputs' dtype (its own takes
    float32), so a float64 model is a float64 reference."""
    from transformers.models.doge.modeling_doge import repeat_kv

    keys = repeat_kv(key, module.num_key_value_groups)
    values = repeat_kv(value, module.num_key_value_groups)
    scores = torch.matmul(query, keys.transpose(2, 3)) * scaling
    if attention_mask is not None:
        scores = scores + attention_mask
    out = torch.matmul(scores.softmax(-1), values)
    return out.transpose(1, 2).contiguous(), None


def _doge(keep: int, kind: str, group, with_ring: bool = True):
    """Doge in float64 with keep_window_size ``keep``: layer 0's bias tied on every key
    (A = 0: each query's top-k among equal entries), layer 1's distinct; (model, output)
    of the CP run (``with_ring``) or of one process (eager, the whole batch)."""
    from ringattn.integrations import transformers as ra_hf

    _helpers()
    from test_transformers import _batch

    config, cls = FAMILIES["doge"]()
    config.keep_window_size = keep
    if not with_ring:  # transformers' eager attention with its softmax in float64, through
        from transformers import AttentionInterface, AttentionMaskInterface  # the registries
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

        AttentionInterface.register("eager_float64", _eager64)
        AttentionMaskInterface.register("eager_float64", ALL_MASK_ATTENTION_FUNCTIONS["eager"])
    config._attn_implementation = "ringattn" if with_ring else "eager_float64"
    torch.manual_seed(0)
    model = cls(config).double()
    with torch.no_grad():
        attention = [m for m in model.modules() if hasattr(m, "keep_window_size")]
        attention[0].A.zero_()
        for m in attention[1:]:
            m.A.copy_(torch.linspace(-1.5, 1.0, m.A.numel(), dtype=torch.float64))
    batch = _batch(kind, 37)
    if not with_ring:
        out = model(**batch, use_cache=False)
        out.loss.backward()
        return model, out
    model = ra_hf.convert(model)
    local = ra_hf.prepare_batch(model, batch, group=group)
    out = model(**local, use_cache=False)
    local["ring_context"].check_consumed(model)
    out.loss.backward()
    return model, out


def _doge_top_k(keep: int):
    """Rank function: {kind: the survey's errors (logits, loss, every gradient) of Doge
    under CP against one process}, both in float64."""
    from ringattn.integrations import transformers as ra_hf

    _helpers()
    from test_families import _errors
    from test_transformers import _batch

    ra_hf.register()
    results = {}
    for kind in ("plain", "left-padding"):
        ref_model, ref = _doge(keep, kind, None, with_ring=False)
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
        model, out = _doge(keep, kind, group)
        results[kind] = _errors(_batch(kind, 37), ref_model, ref, model, out, group)
        dist.destroy_process_group(group)
    return results


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", (2, 3))
def test_doge_top_k_keys_equal_one_process(clusters, world):
    """Doge keeps each query's top keep_window_size keys (16 and 5 of S = 37; 36 keeps all
    but a few of the last rows' keys): exact on every rank, ties included."""
    for keep in (16, 5, 36):
        for rank, results in enumerate(clusters(world).run(_doge_top_k, keep, timeout=240)):
            assert set(results) == {"plain", "left-padding"}
            for kind, errs in results.items():
                for what in ("logits", "grads"):
                    assert errs[what] <= TOL, (world, keep, rank, kind, what, errs)
                # transformers' causal LM loss takes float32 logits (ForCausalLMLoss)
                assert errs["loss"] <= 1e-6, (world, keep, rank, kind, errs)


def _doge_bad_keep(other: int):
    """Rank function: rank 1's Doge keeps ``other`` keys, rank 0's 16: what each raised."""
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    keep = other if dist.get_rank() == 1 else 16
    group = dist.new_group(backend="gloo", timeout=timedelta(seconds=30))
    try:
        _doge(keep, "plain", group)
    except ValueError as exc:
        return str(exc)
    return None


@pytest.mark.timeout(120)
@pytest.mark.parametrize("other", (12, 64))
def test_doge_keep_window_size_differing_between_ranks_is_refused_on_every_rank(clusters,
                                                                                 other):
    """keep_window_size 12 on rank 1 (both select, with different k) or 64 (rank 1 needs no
    selection, rank 0 does): the same ValueError on every rank, never a hang."""
    said = clusters(2).run(_doge_bad_keep, other, timeout=60)
    assert said[0] == said[1], said
    want = "ranks disagree on keep_window_size" if other == 12 else "out of step"
    assert all(s and want in s for s in said), said


def _autocast_case():
    """Rank function: under bf16 autocast, q in bf16 beside fp32 k, v (what a model's
    projections give under autocast: Inkling's path) run, and equal the call on q, k, v
    cast to bf16 by hand, bit for bit; the output is bf16."""
    from ringattn.score_bias import ring_attention_with_bias

    g = torch.Generator().manual_seed(9)
    q, k, v = (ra.shard(torch.randn(1, 13, h, 8, generator=g), seqlen=13) for h in (4, 2, 2))
    table = ra.shard(torch.randn(1, 13, 4, 3, generator=g), seqlen=13)
    kw = dict(rel_extent=3, seqlen=13, softmax_scale=0.3)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        mixed = ring_attention_with_bias(q.bfloat16(), k, v, table, **kw)
    by_hand = ring_attention_with_bias(q.bfloat16(), k.bfloat16(), v.bfloat16(), table, **kw)
    return mixed.dtype, bool(torch.equal(mixed, by_hand))


@pytest.mark.timeout(120)
def test_bias_under_autocast_takes_its_dtype(clusters):
    for rank, (dtype, equal) in enumerate(clusters(2).run(_autocast_case, timeout=100)):
        assert dtype == torch.bfloat16 and equal, (rank, dtype, equal)


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


def _other_strategies():
    """Rank function: {(family, strategy): what the converted model's forward raised} for
    a batch sharded for Ulysses or the all-gather strategy (S = 37: above Doge's
    keep_window_size, so its selection runs)."""
    _helpers()
    from test_transformers import _batch

    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    said = {}
    for family in ("inkling_text", "inkling2_text", "doge"):
        config, cls = FAMILIES[family]()
        config._attn_implementation = "ringattn"
        torch.manual_seed(0)
        model = ra_hf.convert(cls(config))
        for strategy in ("ulysses", "allgather"):
            local = ra_hf.prepare_batch(model, _batch("plain", 37), strategy=strategy)
            try:
                model(**local, use_cache=False)
                said[family, strategy] = None
            except ValueError as exc:
                said[family, strategy] = str(exc)
    return said


@pytest.mark.timeout(300)
def test_other_strategies_are_refused_on_every_rank(clusters):
    """The score-bias families (Inkling's bias rows, Doge's selection) run on the ring
    strategy only: Ulysses and the all-gather strategy raise on every rank, naming both."""
    for rank, said in enumerate(clusters(2).run(_other_strategies, timeout=240)):
        assert len(said) == 6
        for (family, strategy), message in said.items():
            assert message and "'ring'" in message and repr(strategy) in message, (
                rank, family, strategy, message)
