"""DeepSeek-V4's compressed attention (integrations/transformers/families/compressed.py),
converted by ``ra_hf.convert``, equals the same model in one process (transformers' eager
attention on the whole batch) on every rank.

Compared: every layer's attention output (gathered, every slot: the padding's too, since
its slots are pooled into compressed entries), the logits on real tokens, the summed loss
and every parameter gradient summed over the ranks. The models are the survey's
(``families.py``: a CSA layer with compress rate 4 and an indexer keeping 4 entries, then an
HCA layer with rate 8; sliding window 8, hyper-connections, a hash-routed MoE layer) with
random sinks and random compressor / indexer position biases (transformers initialises
those to zero, which would leave the gates' bias untested).

Cases at W = 2 and 3, those where more ranks change who holds what also at W = 4 (one
cluster call per W), S = 37 (no multiple of 4, 8 or W): plain, left-padded (row 1 by 7),
right-padded (row 1's last 6) and packed rows (one row of documents by restarting
position_ids; compared with transformers' own run of that packed row, whose compressors
pool across documents and whose queries see entries by their position ids), zigzag and
contiguous layouts; ties (the indexers' query projections zeroed: every score is 0, so
``torch.topk``'s own rule picks the entries, on every rank as in one process); a top k
above the number of entries; rates 8 and 16 (an HCA window wider than every shard at W = 3
and 4: its halo comes from several ranks); a window-only layer (``sliding_attention``)
before a CSA layer; S = 4 and 9 (no HCA entry, a rank with no token of its own); gradient
checkpointing (fp32); the global router loss (``output_router_logits=True``); the lower
path (``ra.shard_batch`` then the model, padded and packed rows); the rows' own position
ids (counted from each row's first real token); eval mode without autograd;
``ra_hf.context_parallel`` on the global batch with its tiled loss (the loss on every rank,
the ranks' mean gradient); budgets of a few queries per chunk (the entry attention and the
indexer's scores in chunks, the former recomputed in the backward); bf16 weights and bf16
autocast (against the fp32 model, within ``HALF``). Float64 runs compare attention outputs
within ATTN64, their logits within LOGITS64 and loss and gradients within TOL
(transformers' loss upcasts the logits to float32, and the model keeps its RMSNorms in
float32); fp32 runs within TOL, gradients within the survey's GRAD_TOL for this family
(``test_fp32_gradients_are_that_sensitive`` measures why).

Refused on every rank with its reason: another strategy than the ring (Ulysses, all-gather),
the striped layout, a cache, left padding given as ``inputs_embeds``, attention dropout on
one rank's modules; and at ``convert``, a compressor class that is not transformers' own.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "integration"))

from families import FAMILIES, build  # noqa: E402
from reference import rel_err  # noqa: E402
from test_families import GRAD_FLOOR, GRAD_TOL, TOL, _errors, _flat_grads  # noqa: E402
from test_transformers import _batch  # noqa: E402

pytest.importorskip("transformers")

FAMILY = "deepseek_v4"
ATTN64 = 1e-12
"""Float64 attention outputs of every layer (measured: 4.8e-16)."""
LOGITS64 = 1e-7
"""Float64 logits (measured: 2e-8): the model keeps its RMSNorms in float32, where a last-bit
difference of float64 inputs sometimes rounds the other way."""
FP32_GRADS = GRAD_TOL[FAMILY]


def _rates(config):
    config.compress_rates = {"compressed_sparse_attention": 8,
                             "heavily_compressed_attention": 16}


def _sliding(config):  # a window-only layer (the "main" RoPE, no compressor) first
    config.layer_types = ["sliding_attention", "compressed_sparse_attention"]


_EDITS = {"rates": _rates, "sliding": _sliding}


def _model(variant, attn, dtype):
    """The survey's model (``build``), random position biases, the variant's change."""
    model = build(FAMILY, attn, _EDITS.get(variant))
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("position_bias"):
                p.copy_(torch.randn(p.shape, generator=g))
        for m in model.modules():
            if variant == "ties" and type(m).__name__ == "DeepseekV4Indexer":
                m.q_b_proj.weight.zero_()
            if variant == "wide" and type(m).__name__ == "DeepseekV4Indexer":
                m.index_topk = 64
    model = model.to(dtype)
    if dtype == torch.float64:  # grouped_mm has no float64 kernel: the experts' loop
        model.config._experts_implementation = "eager"
    if variant == "checkpointing":
        model.gradient_checkpointing_enable()
    model.train(variant != "no_grad")
    return model


def _attention_outputs(model):
    """{layer: [outputs]} recorded by forward hooks on each layer's attention."""
    seen = {}
    for name, m in model.named_modules():
        if name.endswith("self_attn"):
            m.register_forward_hook(
                lambda mod, args, out, name=name: seen.setdefault(name, []).append(
                    out[0].detach()))
    return seen


CASES = [  # (variant, batch kind, layout, S, dtype)
    *(("survey", k, lay, 37, torch.float64) for k in ("plain", "left-padding", "packed")
      for lay in ("zigzag", "contiguous")),
    ("survey", "right-padding", "zigzag", 37, torch.float64),
    *(("ties", k, "zigzag", 37, torch.float64) for k in ("plain", "left-padding")),
    ("wide", "plain", "contiguous", 37, torch.float64),
    *(("rates", k, lay, 37, torch.float64) for k in ("plain", "left-padding")
      for lay in ("zigzag", "contiguous")),
    *(("sliding", k, "zigzag", 37, torch.float64) for k in ("plain", "left-padding")),
    *(("survey", "plain", lay, s, torch.float64) for s in (4, 9)
      for lay in ("zigzag", "contiguous")),
    ("survey", "plain", "zigzag", 37, torch.float32),
    *(("checkpointing", k, "zigzag", 37, torch.float32) for k in ("plain", "left-padding")),
    ("router", "left-padding", "zigzag", 37, torch.float64),
    *(("shard", k, "contiguous", 37, torch.float64) for k in ("left-padding", "packed")),
    ("manager", "plain", "zigzag", 37, torch.float64),
    ("positions", "left-padding", "zigzag", 37, torch.float64),
    ("no_grad", "left-padding", "contiguous", 37, torch.float64),
    ("chunks", "left-padding", "zigzag", 37, torch.float64),
    ("chunks", "plain", "contiguous", 37, torch.float64),
    ("bf16", "plain", "zigzag", 37, torch.bfloat16),
    ("autocast", "left-padding", "zigzag", 37, torch.float32),
]

HALF = {"bf16": 3e-2, "autocast": 3e-2}
"""Variants in bfloat16 (the model's weights, or fp32 weights under bf16 autocast), compared
with the fp32 model in one process: their logits, loss and attention outputs within the
bound (bf16 rounds each value to 8 bits of mantissa, 4e-3); their gradients finite."""

REFUSALS = {  # name -> what every rank's ValueError says
    "ulysses": "runs with strategy 'ring'",
    "allgather": "runs with strategy 'ring'",
    "striped": "puts token t on rank t mod W",
    "cache": "use_cache=False",
    "embeds": "padding's own ids",
    "dropout": "attention dropout",
}
"""(``dropout``: attention dropout on the last rank's modules only; the others' calls are
valid, and every rank raises the last one's error.)"""


def _run(case):
    """This rank's errors for one case."""
    import ringattn as ra
    from ringattn.integrations import transformers as ra_hf
    from ringattn.integrations.transformers.families import compressed

    variant, kind, layout, seqlen, dtype = case
    batch = _batch(kind, seqlen)
    if variant == "positions":  # the rows' own position ids, counted from the first token
        keep = batch["attention_mask"]
        batch["position_ids"] = (keep.cumsum(-1) - 1).clamp(min=0)
    extra = {"output_router_logits": True} if variant == "router" else {}
    low = variant in HALF  # compared with the fp32 model in one process
    ref_model = _model(variant, "eager", torch.float32 if low else dtype)
    ref_attn = _attention_outputs(ref_model)
    graded = variant != "no_grad"  # eval mode, no autograd: the forward only
    with torch.set_grad_enabled(graded):
        ref = ref_model(**batch, use_cache=False, **extra)
    if graded:
        ref.loss.backward()
    group = dist.new_group(backend="gloo")
    budgets = (compressed.ENTRY_ELEMENTS, compressed.SCORE_ELEMENTS)
    if variant == "chunks":  # a few queries per chunk: the chunked, recomputed path
        compressed.ENTRY_ELEMENTS, compressed.SCORE_ELEMENTS = 300, 50
    try:
        model = ra_hf.convert(_model(variant, "ringattn", dtype))
        attn = _attention_outputs(model)
        if variant == "manager":  # context_parallel: the global batch, the tiled loss
            return _managed(model, batch, ref_model, ref, ref_attn, attn, group, layout,
                            seqlen)
        if variant == "shard":  # the lower path: shard_batch, then the model
            local = ra.shard_batch(batch, group=group, layout=layout)
        else:
            local = ra_hf.prepare_batch(model, batch, group=group, layout=layout)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=variant == "autocast"), \
                torch.set_grad_enabled(graded):
            out = model(**local, use_cache=False, **extra)
        local["ring_context"].check_consumed(model)
        if graded:
            out.loss.backward()
        cu = local["ring_context"].cu_seqlens
        if graded:
            errs = _errors(batch, ref_model, ref, model, out, group, layout, cu)
        else:  # no gradient to compare
            loss = out.loss.clone()
            dist.all_reduce(loss, group=group)
            logits = ra.unshard(out.logits, group=group, layout=layout, seqlen=seqlen)
            real = batch["attention_mask"].bool()
            errs = {"logits": rel_err(logits[real], ref.logits[real]),
                    "loss": rel_err(loss, ref.loss), "grads": 0.0}
        if variant == "router":
            aux = out.aux_loss.detach().clone()
            errs["aux"] = rel_err(aux, ref.aux_loss)
        errs["attention"] = max(
            rel_err(ra.unshard(attn[name][0].contiguous(), group=group, layout=layout,
                               seqlen=seqlen, cu_seqlens=cu), ref_attn[name][0])
            for name in ref_attn)
        return errs
    except Exception as exc:  # reported per case by the test
        return f"{type(exc).__name__}: {exc}"
    finally:
        compressed.ENTRY_ELEMENTS, compressed.SCORE_ELEMENTS = budgets
        dist.destroy_process_group(group)


def _managed(model, batch, ref_model, ref, ref_attn, attn, group, layout, seqlen):
    """Errors of a step under ``ra_hf.context_parallel`` (its default tiled loss): the loss
    on every rank, the ranks' mean gradient, the attention outputs."""
    import ringattn as ra
    from ringattn.integrations import transformers as ra_hf

    with ra_hf.context_parallel(model, group=group, layout=layout):
        out = model(**batch, use_cache=False)
        out.loss.backward()
    grads = _flat_grads(model)
    dist.all_reduce(grads, group=group)
    grads /= dist.get_world_size(group)
    ref_grads = _flat_grads(ref_model).double()
    floor = GRAD_FLOOR * float(ref_grads.norm())
    worst, start = 0.0, 0
    for p in ref_model.parameters():
        g_ref = ref_grads[start:start + p.numel()]
        diff = float((grads[start:start + p.numel()].double() - g_ref).norm())
        worst = max(worst, diff / max(float(g_ref.norm()), floor))
        start += p.numel()
    return {"logits": 0.0, "loss": rel_err(out.loss.detach(), ref.loss), "grads": worst,
            "attention": max(rel_err(ra.unshard(attn[n][0].contiguous(), group=group,
                                                layout=layout, seqlen=seqlen), ref_attn[n][0])
                             for n in ref_attn)}


def _refusal(name):
    """This rank's outcome of one call ringattn must refuse."""
    from ringattn.integrations import transformers as ra_hf

    batch = _batch("left-padding" if name == "embeds" else "plain", 37)
    group = dist.new_group(backend="gloo")
    try:
        model = ra_hf.convert(_model("survey", "ringattn", torch.float32))
        local = ra_hf.prepare_batch(
            model, batch, group=group, layout="striped" if name == "striped" else "zigzag",
            strategy=name if name in ("ulysses", "allgather") else "ring")
        if name == "embeds":
            local["inputs_embeds"] = model.get_input_embeddings()(local.pop("input_ids"))
        if name == "dropout" and dist.get_rank() == dist.get_world_size() - 1:
            for m in model.modules():
                if type(m).__name__ == "RingDeepseekV4Attention":
                    m.attention_dropout = 0.1
        model(**local, use_cache=name == "cache")
        return "ran"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"
    finally:
        dist.destroy_process_group(group)


def _at_four(case) -> bool:
    """The cases run at W = 4 as well (the layouts, padding, documents, wide windows and
    small S, where more ranks change who holds what; the rest run at W = 2 and 3)."""
    variant, kind, layout, seqlen, dtype = case
    return (variant in ("survey", "rates") and dtype == torch.float64) or (
        variant == "checkpointing" and kind == "plain")


def _cases(cases) -> dict:
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    if dist.get_world_size() == 4:
        cases = [c for c in cases if _at_four(c)]
    results = {case: _run(case) for case in cases}
    results.update({name: _refusal(name) for name in REFUSALS})
    return results


@pytest.fixture(scope="module")
def exact(clusters):
    return clusters.once_per_world(_cases, CASES, timeout=600)


def _name(case):
    variant, kind, layout, seqlen, dtype = case
    return f"{variant}-{kind}-{layout}-S{seqlen}-{str(dtype)[6:]}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize(("case", "world"), [
    pytest.param(c, w, id=f"{_name(c)}-W{w}") for w in (2, 3, 4) for c in CASES
    if w < 4 or _at_four(c)])
def test_compressed_attention_equals_one_process(exact, worst_errors, case, world):
    variant, dtype = case[0], case[-1]
    bounds = ({"attention": ATTN64, "logits": LOGITS64, "loss": TOL, "grads": TOL}
              if dtype == torch.float64 else
              {"attention": TOL, "logits": TOL, "loss": TOL, "grads": FP32_GRADS})
    if variant in HALF:
        bounds = dict.fromkeys(("attention", "logits", "loss"), HALF[variant])
        bounds["grads"] = float("inf")  # finite (NaN fails any bound)
    if variant == "router":
        bounds["aux"] = TOL
    for rank, errs in enumerate(exact(world)):
        got = errs[case]
        assert isinstance(got, dict), f"{_name(case)}, W={world}, rank {rank}: {got}"
        for what, bound in bounds.items():
            assert got[what] <= bound, f"{_name(case)}, W={world}, rank {rank}: {what} {got}"
            key = (f"HF deepseek_v4 {variant if variant in HALF else str(dtype)[6:]}", what)
            worst_errors[key] = max(worst_errors.get(key, (0.0, bound)), (got[what], bound))


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.parametrize("name", sorted(REFUSALS))
def test_what_cannot_be_exact_is_refused_on_every_rank(exact, name, world):
    for rank, errs in enumerate(exact(world)):
        got = errs[name]
        assert got.startswith("ValueError") and REFUSALS[name] in got, (name, rank, got)


def test_ties_are_real_and_convert_takes_only_its_own_classes():
    """The tie variant ties (one process's indexer picks among all-zero score rows), and
    ``convert`` refuses, before any rank is involved, a compressor class it does not know
    and a transformers whose code of the functions it reproduces differs (``PINNED``)."""
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    scores = []
    model = _model("ties", "eager", torch.float64)
    for m in model.modules():
        if type(m).__name__ == "DeepseekV4IndexerScorer":
            m.register_forward_hook(lambda mod, args, out: scores.append(out))
    model(**_batch("plain", 37), use_cache=False)
    assert scores and bool((scores[0] == 0).all()) and scores[0].shape[-1] == 9
    with pytest.raises(ValueError, match="convert it first"):
        ra_hf.check_model(_model("survey", "ringattn", torch.float32))
    model = _model("survey", "ringattn", torch.float32)
    comp = model.model.layers[1].self_attn.compressor
    comp.__class__ = type("MyCompressor", (type(comp),), {})
    with pytest.raises(TypeError, match="MyCompressor"):
        ra_hf.convert(model)
    from ringattn.integrations.transformers.families import compressed

    pinned = dict(compressed.PINNED)
    try:  # another transformers' code of a function it reproduces: refused, named
        compressed.PINNED["DeepseekV4Indexer.forward"] += 1
        with pytest.raises(ValueError, match="writes DeepseekV4Indexer.forward otherwise"):
            ra_hf.convert(_model("survey", "ringattn", torch.float32))
    finally:
        compressed.PINNED.update(pinned)
    model = ra_hf.convert(_model("survey", "ringattn", torch.float32))
    ra_hf.check_model(model)
    assert sorted({type(m).__name__ for m in model.modules()
                   if type(m).__name__.startswith("Ring")}) == ["RingDeepseekV4Attention"]


def test_fp32_gradients_are_that_sensitive():
    """Why the survey bounds this family's fp32 gradients by GRAD_TOL: multiplying one
    process's own attention outputs by (1 + 2.6e-7 x noise), the fp32 rounding any other
    attention algorithm differs by, moves its gradients by more than TOL / 3 (on the final
    hyper-connection head), and less than GRAD_TOL / 2."""
    batch = _batch("plain", 37)

    def grads(noise):
        model = build(FAMILY, "eager")
        g = torch.Generator().manual_seed(3)
        if noise:
            for name, m in model.named_modules():
                if name.endswith("self_attn"):
                    m.register_forward_hook(lambda mod, args, out: (
                        out[0] * (1 + noise * torch.randn(out[0].shape, generator=g)),
                        out[1]))
        model(**batch, use_cache=False).loss.backward()
        return {n: p.grad for n, p in model.named_parameters() if p.grad is not None}

    clean, moved = grads(0.0), grads(2.6e-7)
    floor = 1e-3 * float(torch.cat([g.flatten() for g in clean.values()]).norm())
    worst = max(float((moved[n] - g).norm()) / max(float(g.norm()), floor)
                for n, g in clean.items())
    assert TOL / 3 < worst < GRAD_TOL[FAMILY] / 2, worst
