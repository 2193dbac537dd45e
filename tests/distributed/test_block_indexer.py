"""The block-sparse indexer families (integrations/transformers/families/block_indexer.py):
Qwen4-Exp's QSA indexed attention and MiniMax-M3's minimax_m3_sparse layers, converted by
``ra_hf.convert``, equal the same model in one process (transformers' "eager" attention on
the whole batch) on every rank: gathered logits on real tokens, the summed loss and every
parameter gradient summed over the ranks.

Cases, each at W = 2 and 3 (one cluster call per W): the survey's configs on plain,
left-padded (row 1 by 7) and packed rows (Qwen4-Exp; compared with one process running
each document as its own sequence; MiniMax-M3 refuses packed rows on every rank), zigzag
and contiguous layouts, S = 37 (not a multiple of the block size 4, nor of 2W); ties (the
indexers' query projections zeroed: every score row is flat, so torch.topk's own tie rule
picks the blocks, here on every rank as in one process); a top k at least the number of
blocks; a rank whose shard holds only padding (S = 4 on 3 ranks); gradient checkpointing
on plain and left-padded rows (the backward recomputes the sparse layers after the model's
forward has returned); float64 (the models in
double against transformers' sdpa in double: MiniMax-M3's logits within 1e-8; losses and
gradients within 1e-5, as transformers' loss upcasts the logits to float32 and Qwen4-Exp's
Gated DeltaNet scans in float32).
MiniMax-M3 with left padding and a sparse layer after an attention layer is refused on
every rank with its reason, as Qwen4-Exp with per-layer n-gram embeddings is by
``convert``, and both families sharded for another strategy (Ulysses, all-gather) are.
"""

from __future__ import annotations

import os
import sys
from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "integration"))

from families import FAMILIES  # noqa: E402
from test_families import TOL, _errors  # noqa: E402
from test_transformers import _batch  # noqa: E402

pytest.importorskip("transformers")

FAMILY = {"qwen4": "qwen4_exp", "minimax": "minimax_m3_vl_text"}
TOL64 = 1e-8
"""MiniMax-M3's logits in float64 against the same float64 model in one process. Its loss
and gradients go through transformers' loss, which upcasts the logits to float32, and
Qwen4-Exp's Gated DeltaNet scans in float32 whatever the model's dtype: TOL for those."""
_REFERENCE = {torch.float32: "eager", torch.float64: "sdpa"}
"""One process's attention: transformers' eager softmax runs in float32 (a float64 row
masked with float64's minimum becomes -inf there: NaN on left padding), its sdpa in the
model's dtype."""


def _ties(model, family):
    """Zero the indexers' query projections: every block scores the same."""
    for m in model.modules():
        if type(m).__name__ == "Qwen4ExpTextQSAIndexer":
            heads = m.index_n_heads * m.index_head_dim
            with torch.no_grad():
                m.index_qk_proj.weight[:heads] = 0
        elif type(m).__name__ == "MiniMaxM3VLIndexer":
            with torch.no_grad():
                m.q_proj.weight.zero_()


def _config(family, variant):
    config, cls = FAMILIES[FAMILY[family]]()
    if variant == "wide":  # a top k of at least every block of the sequence
        if family == "qwen4":
            config.indexer_budget = 64
        else:
            config.index_topk_blocks = 16
    if variant == "late":  # MiniMax's sparse layer after a full attention layer
        config.layer_types = ["full_attention", "minimax_m3_sparse"]
    if variant == "ple":
        config.ple_layer_ids = [1]
    return config, cls


def _model(family, variant, attn, dtype):
    config, cls = _config(family, variant)
    config._attn_implementation = attn
    if dtype == torch.float64:  # grouped_mm has no float64 kernel: the experts' loop
        config._experts_implementation = "eager"
    torch.manual_seed(0)
    model = cls(config).to(dtype)
    if variant == "ties":
        _ties(model, family)
    if variant == "checkpointing":  # the backward recomputes each layer, after the forward
        model.gradient_checkpointing_enable()
        model.train()
    return model


def _per_document(family, variant, dtype, batch):
    """One process on a packed row, one sequence per document."""
    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"][0]
    starts = [*torch.nonzero(pos == 0).flatten().tolist(), ids.shape[1]]
    model = _model(family, variant, _REFERENCE[dtype], dtype)
    logits, total, count = [], 0.0, 0
    for a, b in zip(starts[:-1], starts[1:]):
        out = model(input_ids=ids[:, a:b], use_cache=False)
        logits.append(out.logits)
        if b - a > 1:
            ce = torch.nn.functional.cross_entropy(out.logits[0, :-1], labels[0, a + 1:b],
                                                   reduction="sum")
            total, count = total + ce, count + (b - a - 1)
    loss = total / count
    loss.backward()
    return model, SimpleNamespace(logits=torch.cat(logits, dim=1), loss=loss)


CASES = [  # (family, variant, batch kind, layout, S, dtype)
    *((f, "survey", k, "zigzag", 37, torch.float32) for f in FAMILY
      for k in ("plain", "left-padding", "packed")),
    *((f, "survey", "plain", "contiguous", 37, torch.float32) for f in FAMILY),
    *((f, "ties", k, lay, 37, torch.float64) for f in FAMILY
      for k in ("plain", "left-padding") for lay in ("zigzag", "contiguous")),
    *((f, "wide", "plain", "zigzag", 37, torch.float64) for f in FAMILY),
    *((f, v, "plain", lay, 4, torch.float64) for f in FAMILY for v in ("survey", "ties")
      for lay in ("contiguous", "zigzag")),
    ("qwen4", "ties", "packed", "contiguous", 37, torch.float64),
    ("minimax", "late", "plain", "zigzag", 37, torch.float32),
    ("minimax", "late", "left-padding", "zigzag", 37, torch.float32),
    *((f, "checkpointing", k, "zigzag", 37, torch.float32) for f in FAMILY
      for k in ("plain", "left-padding")),
    *((f, strategy, "plain", "zigzag", 37, torch.float32) for f in FAMILY
      for strategy in ("ulysses", "allgather")),
]

REFUSED = {("minimax", "survey", "packed"): "packed rows are refused",
           ("minimax", "late", "left-padding"): "sparse layers come first",
           **{(f, strategy, "plain"): "runs with strategy 'ring' on a 1-D group"
              for f in FAMILY for strategy in ("ulysses", "allgather")}}
"""(family, variant, batch kind) -> what every rank's ValueError says."""
STRATEGIES = ("ulysses", "allgather")
"""Variants that shard the batch with another strategy than the ring: refused."""


def _cases(cases) -> dict:
    """Rank function: {case: errors or "Type: message"}."""
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    results = {}
    for case in cases:
        family, variant, kind, layout, seqlen, dtype = case
        batch = _batch(kind, seqlen)
        if kind == "packed":
            ref_model, ref = _per_document(family, variant, dtype, batch)
        else:
            ref_model = _model(family, variant, _REFERENCE[dtype], dtype)
            ref = ref_model(**batch, use_cache=False)
            ref.loss.backward()
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=60))
        try:
            model = ra_hf.convert(_model(family, variant, "ringattn", dtype))
            local = ra_hf.prepare_batch(model, batch, group=group, layout=layout,
                                        strategy=variant if variant in STRATEGIES else "ring")
            out = model(**local, use_cache=False)
            local["ring_context"].check_consumed(model)
            out.loss.backward()
            results[case] = _errors(batch, ref_model, ref, model, out, group, layout,
                                    local["ring_context"].cu_seqlens)
        except Exception as exc:  # reported per case by the test
            results[case] = f"{type(exc).__name__}: {exc}"
        dist.destroy_process_group(group)
    return results


@pytest.fixture(scope="module")
def exact(clusters):
    return clusters.once_per_world(_cases, CASES, timeout=600)


def _name(case):
    family, variant, kind, layout, seqlen, dtype = case
    return f"{family}-{variant}-{kind}-{layout}-S{seqlen}-{str(dtype)[6:]}"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("world", (2, 3))
@pytest.mark.parametrize("case", CASES, ids=_name)
def test_block_indexer_equals_one_process(exact, worst_errors, case, world):
    family, variant, kind, layout, seqlen, dtype = case
    for rank, errs in enumerate(exact(world)):
        got = errs[case]
        refused = REFUSED.get((family, variant, kind))
        if refused is not None:
            assert isinstance(got, str) and got.startswith("ValueError"), (case, rank, got)
            assert refused in got, (case, rank, got)
            continue
        assert isinstance(got, dict), f"{_name(case)}, W={world}, rank {rank}: {got}"
        for what in ("logits", "loss", "grads"):
            bound = (TOL64 if dtype == torch.float64 and family == "minimax" and what == "logits"
                     else TOL)
            assert got[what] <= bound, f"{_name(case)}, W={world}, rank {rank}: {what} {got}"
            key = (f"HF block indexer {str(dtype)[6:]}", what)
            worst_errors[key] = max(worst_errors.get(key, (0.0, bound)), (got[what], bound))


def test_ties_are_real_and_refusals_name_their_reason():
    """The tie cases are ties (one process's score rows are flat beyond the top k), and
    what is refused is refused with its reason, before any rank is involved."""
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    seen = []

    def keep(module, args, output):
        seen.append(output)

    model = _model("minimax", "ties", "eager", torch.float64)
    for m in model.modules():
        if type(m).__name__ == "MiniMaxM3VLIndexer":
            m.register_forward_hook(keep)
    model(**_batch("plain", 37), use_cache=False)
    picked = seen[0]  # [B, heads, S, topk]: every real row keeps 2 of up to 10 blocks
    assert picked.shape[-1] == 2 and bool((picked[:, :, 12:] >= 0).all())
    with pytest.raises(ValueError, match="n-gram embeddings"):
        ra_hf.convert(_model("qwen4", "ple", "ringattn", torch.float32))
    for family in FAMILY:
        with pytest.raises(ValueError, match="convert it first"):
            ra_hf.check_model(_model(family, "survey", "ringattn", torch.float32))
        config, cls = _config(family, "survey")
        config._attn_implementation = "ringattn"
        ra_hf.check_model(cls, config)  # the class: convert serves it
        model = ra_hf.convert(_model(family, "survey", "ringattn", torch.float32))
        ra_hf.check_model(model)
        rings = sorted({type(m).__name__ for m in model.modules()
                        if type(m).__name__.startswith("Ring")})
        assert rings == (["RingQwen4ExpTextAttention", "RingQwen4ExpTextGatedDeltaNet"]
                         if family == "qwen4" else ["RingMiniMaxM3VLAttention"]), rings
