"""DeepSeek sparse attention under context parallelism (``ra_hf.convert``'s indexer): each
query's top-k keys over the whole causal prefix, selected exactly as one process selects
them, ties included, then the ring over exactly those keys.

Every rank runs the family in one process (transformers' eager attention, float64; float32
for left-padded rows, see TOL) and the
converted model on its shard (``prepare_batch``), and checks, for every real query slot it
holds, that the converted indexer selected the same keys as the one-process indexer, and
that the logits, the loss and every gradient equal the one-process ones. Cases: plain rows,
scores that all tie (the indexer's query projection zeroed: every key scores 0, so only
torch.topk's own tie rule decides), a top-k at least the sequence length, a left-padded row
that leaves a rank's shard nothing but padding, packed documents, gradient checkpointing
(the backward recomputes the indexer); zigzag and contiguous layouts, W 2, 3, 4. Bad input (ranks with different top-k, a strategy that splits heads)
raises the same ValueError on every rank.

Legend: B batch, S global seq (37: divides none of 2, 3, 4), W world size.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from families import FAMILIES
from reference import rel_err

import ringattn as ra

pytest.importorskip("transformers")

SEQLEN = 37
TOL = {"float64": 1e-6, "float32": 1e-5}
"""HY-V4 is held to the float32 bound: its float64 gradients come within 1.9e-6 of one
process with either selection path (whole rows or the ring's running top k). Otherwise:
float64 against float64, but transformers' eager attention (the one-process side) takes
its softmax in float32: 1e-6 bounds that, and a single differing selected key would move
the outputs by far more. Left-padded batches run in float32 (the survey's bound): in float64
transformers' eager attention turns a padding query's row of float64-minimum scores into
float32 -inf, a NaN that its padding slots' values then carry into every row (0 x NaN)."""


def _batch(kind: str) -> dict:
    g = torch.Generator().manual_seed(SEQLEN)
    if kind == "packed":  # one row of documents, positions restarting at 0
        cu = [0, 5, 17, 18, SEQLEN]
        ids = torch.randint(3, 97, (1, SEQLEN), generator=g)
        pos = torch.cat([torch.arange(b - a) for a, b in zip(cu[:-1], cu[1:])])[None]
        labels = ids.clone()
        labels[0, cu[:-1]] = -100
        return dict(input_ids=ids, labels=labels, position_ids=pos)
    if kind == "padding-only rank":  # one row, left-padded by 12: on 4 contiguous ranks
        ids = torch.randint(3, 97, (1, SEQLEN), generator=g)  # rank 0 holds slots 0..9
        keep = torch.ones(1, SEQLEN, dtype=torch.long)
        keep[0, :12] = 0
        ids = ids.masked_fill(keep == 0, 0)
        labels = ids.masked_fill(keep == 0, -100)
        labels[0, 12] = -100
        return dict(input_ids=ids, labels=labels, attention_mask=keep)
    ids = torch.randint(3, 97, (2, SEQLEN), generator=g)
    batch = dict(input_ids=ids, labels=ids.clone())
    if kind == "left-padded":
        keep = torch.ones(2, SEQLEN, dtype=torch.long)
        keep[1, :7] = 0
        batch["input_ids"] = ids.masked_fill(keep == 0, 0)
        labels = batch["input_ids"].masked_fill(keep == 0, -100)
        labels[1, 7] = -100
        batch["labels"], batch["attention_mask"] = labels, keep
    return batch


def _model(family: str, attn: str, topk: int, ties: bool, topk_offset: int = 0,
           dtype=torch.float64, heads: int | None = None, checkpointing: bool = False):
    config, cls = FAMILIES[family]()
    config.index_topk = topk + topk_offset
    if heads is not None:  # many indexer heads: no key's score is an exact ReLU zero
        config.index_n_heads = heads
    config._attn_implementation = attn
    config._experts_implementation = "eager"  # grouped_mm takes no float64 on CPU
    torch.manual_seed(0)
    model = cls(config).to(dtype).train()
    if checkpointing:  # the backward recomputes each layer, its indexer included
        model.gradient_checkpointing_enable()
    if ties:  # the indexer's queries zeroed: every key of every row scores 0
        for module in model.modules():
            if hasattr(module, "index_topk") and hasattr(module, "wq_b"):
                torch.nn.init.zeros_(module.wq_b.weight)
    return model


def _selections(model, store: list):
    """Record what every indexer of ``model`` returns, in call order."""
    for module in model.modules():
        if hasattr(module, "index_topk"):
            module.register_forward_hook(lambda m, a, out: store.append(out.detach().clone()))


def _visible(batch) -> torch.Tensor:
    """[B, S, S] which keys each query of ``batch`` sees (causal, padding, documents)."""
    ids = batch["input_ids"]
    b, s = ids.shape
    seen = torch.ones(s, s, dtype=torch.bool).tril().expand(b, s, s).clone()
    if "attention_mask" in batch:
        seen &= batch["attention_mask"].bool()[:, None, :]
    if "position_ids" in batch:
        doc = torch.cumsum(batch["position_ids"] == 0, dim=-1)
        seen &= doc[:, :, None] == doc[:, None, :]
    return seen


def _dense(picked) -> torch.Tensor:
    """[B, rows, S] the keys a selection [B, rows, k] names (-1: none)."""
    picked = picked.long()
    out = torch.zeros(*picked.shape[:2], SEQLEN + 1, dtype=torch.bool)
    out.scatter_(-1, torch.where(picked < 0, SEQLEN, picked), True)
    return out[..., :SEQLEN]


def one_case(family, kind, layout, topk, ties, strategy="ring", heads=None,
             checkpointing=False) -> dict:
    """Rank side: errors of the converted model against one process, and the number of
    real query rows whose selection differs."""
    from ringattn.integrations import transformers as ra_hf
    from ringattn.integrations.transformers.families import indexer

    ra_hf.register()
    batch = _batch(kind)
    dtype = torch.float32 if "attention_mask" in batch else torch.float64
    ref_model = _model(family, "eager", topk, ties, dtype=dtype, heads=heads,
                       checkpointing=checkpointing)
    ref_sel: list = []
    _selections(ref_model, ref_sel)
    ref = ref_model(**batch, use_cache=False)
    ref.loss.backward()
    model = ra_hf.convert(_model(family, "ringattn", topk, ties, dtype=dtype, heads=heads,
                                 checkpointing=checkpointing))
    sel: list = []
    _selections(model, sel)
    local = ra_hf.prepare_batch(model, batch, layout=layout, strategy=strategy)
    before = dict(indexer.STATS)
    out = model(**local, use_cache=False)
    paths = {k: indexer.STATS[k] - before[k] for k in before}
    out.loss.backward()
    ctx = local["ring_context"]
    pos = ra.positions(SEQLEN, layout=layout, cu_seqlens=ctx.cu_seqlens)
    pos = pos[0] if isinstance(pos, tuple) else pos
    real = pos < SEQLEN
    differ = 0
    assert len(sel) == len(ref_sel) >= 1
    seen = _visible(batch)[:, pos[real]]  # [B, real rows, S]
    for mine, one in zip(sel, ref_sel):
        want = _dense(one[:, pos[real]]) & seen
        got = _dense(mine[:, real]) & seen
        differ += int((want != got).any(-1).sum())
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)
    logits = ra.unshard(out.logits.detach(), layout=layout, seqlen=SEQLEN,
                        cu_seqlens=ctx.cu_seqlens)
    keep = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
    errs = {"logits": rel_err(logits[keep], ref.logits[keep]), "loss": rel_err(loss, ref.loss)}
    worst = 0.0
    for (_, p), (_, q) in zip(model.named_parameters(), ref_model.named_parameters()):
        g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
        dist.all_reduce(g)
        want = torch.zeros_like(q) if q.grad is None else q.grad
        err = rel_err(g, want) if float(want.norm()) > 0 else float(g.norm())
        worst = max(worst, err if err == err else float("inf"))
    errs["grads"] = worst
    errs["rows that differ"] = differ
    errs["paths"] = paths
    errs["dtype"] = str(dtype).removeprefix("torch.")
    return errs


def cases(todo) -> list:
    return [one_case(*case) for case in todo]


CASES = {  # W -> (family, batch, layout, top-k, all scores tie)
    2: [("deepseek_v32", "plain", "zigzag", 8, False),
        ("deepseek_v32", "plain", "zigzag", 8, True),
        ("deepseek_v32", "packed", "zigzag", 8, True),
        ("glm_moe_dsa", "left-padded", "contiguous", 8, True),
        ("deepseek_v32", "left-padded", "zigzag", 8, False, "ring", 16, True),  # checkpointing
        ("deepseek_v32", "packed", "zigzag", 8, False, "ring", None, True)],
    3: [("deepseek_v32", "plain", "contiguous", 8, False),
        ("deepseek_v32", "left-padded", "zigzag", 8, True),
        ("deepseek_v32", "plain", "zigzag", 64, False),  # top-k >= S: every key
        ("deepseek_v32", "packed", "contiguous", 8, False),
        ("glm_moe_dsa", "plain", "zigzag", 8, True)],  # layer 1 reuses layer 0's selection
    4: [("deepseek_v32", "plain", "zigzag", 8, False, "ring", 16),  # the ring's top k
        ("glm_moe_dsa", "packed", "contiguous", 8, False, "ring", 16),
        ("hy_v4", "plain", "zigzag", 8, False, "ring", 16),
        ("axk2", "plain", "contiguous", 8, False, "ring", 16),
        ("dots3_note_text", "plain", "zigzag", 8, False, "ring", 16),
        ("deepseek_v32", "padding-only rank", "contiguous", 8, True),
        ("deepseek_v32", "padding-only rank", "zigzag", 8, False),
        ("deepseek_v32", "plain", "zigzag", 8, True),
        ("glm_moe_dsa", "packed", "contiguous", 40, False)],
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", sorted(CASES))
def test_indexer_selects_and_attends_as_one_process(clusters, worst_errors, world):
    results = clusters(world).run(cases, CASES[world], timeout=500)
    for rank, per_case in enumerate(results):
        for case, errs in zip(CASES[world], per_case):
            assert errs["rows that differ"] == 0, (world, rank, case, errs)
            # distinct scores: the ring's running top-k on every layer; all scores tied
            # (rows with more than k keys): whole rows, torch.topk's own choice
            paths = errs["paths"]
            if case[4]:
                assert paths["whole rows"] >= 1, (world, rank, case, paths)
            elif len(case) > 6 and case[6]:  # distinct scores: no tie at any k-th score
                assert paths["whole rows"] == 0 and paths["ring"] >= 1, (world, rank, case,
                                                                          paths)
            for name in ("logits", "loss", "grads"):
                tol = TOL[errs["dtype"]] if case[0] != "hy_v4" else TOL["float32"]
                assert errs[name] <= tol, (world, rank, case, name, errs)
                key = (errs["dtype"], f"DSA {name}")
                worst_errors[key] = (max(worst_errors.get(key, (0.0, tol))[0], errs[name]), tol)


def test_topk_ties_are_not_broken_by_position():
    """Why the ranks rebuild each query's whole score row: on rows with ties at the k-th
    score, torch.topk does not keep the lowest positions first (nor any rule that a merge
    of per-rank top-k lists could follow), so only topk on the same row gives its choice."""
    g = torch.Generator().manual_seed(0)
    rows = torch.randint(0, 3, (64, SEQLEN), generator=g).double()
    picked = torch.sort(rows.topk(8, dim=-1).indices, dim=-1).values
    by_position = torch.sort(torch.sort(rows, dim=-1, descending=True, stable=True).indices[:, :8],
                             dim=-1).values
    assert bool((picked != by_position).any())


def refused(family, offset_by_rank: bool, strategy: str) -> str:
    """Rank side: the message of the ValueError a bad call raises on this rank."""
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    model = ra_hf.convert(_model(family, "ringattn", 8, False,
                                 dist.get_rank() if offset_by_rank else 0))
    local = ra_hf.prepare_batch(model, _batch("plain"), layout="zigzag", strategy=strategy)
    try:
        model(**local, use_cache=False)
    except ValueError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("offset,strategy,said", [
    (True, "ring", "disagree on topk"),  # ranks built with different top-k
    (False, "ulysses", "runs with strategy 'ring'"),  # heads split: refused
])
def test_bad_calls_raise_the_same_error_on_every_rank(clusters, offset, strategy, said):
    messages = clusters(3).run(refused, "deepseek_v32", offset, strategy, timeout=200)
    assert all(said in m for m in messages), messages
    assert len({m.split(" (rank")[0] for m in messages}) == 1, messages


def position_cases(todo) -> list:
    """Rank side: for each case, the converted model with ``indexer_ties(model,
    "position")`` on all W ranks against the same model under a ring context of one rank
    (this rank alone, the whole batch): rows whose selection differs, errors of logits,
    loss and gradients, and the indexer paths the W-rank run took."""
    from ringattn.integrations import transformers as ra_hf
    from ringattn.integrations.transformers.families import indexer

    ra_hf.register()
    world = dist.get_world_size()
    alone = [dist.new_group([r], backend="gloo") for r in range(world)][dist.get_rank()]
    out = []
    for family, kind, layout, topk, ties in todo:
        batch = _batch(kind)
        dtype = torch.float32 if "attention_mask" in batch else torch.float64
        runs = {}
        for name, group in (("one rank", alone), ("W ranks", dist.group.WORLD)):
            model = ra_hf.indexer_ties(ra_hf.convert(
                _model(family, "ringattn", topk, ties, dtype=dtype)), "position")
            sel: list = []
            _selections(model, sel)
            local = ra_hf.prepare_batch(model, batch, layout=layout, group=group)
            before = dict(indexer.STATS)
            res = model(**local, use_cache=False)
            res.loss.backward()
            ctx = local["ring_context"]
            pos = ra.positions(SEQLEN, layout=layout, group=group, cu_seqlens=ctx.cu_seqlens)
            pos = pos[0] if isinstance(pos, tuple) else pos
            loss = res.loss.detach().clone()
            dist.all_reduce(loss, group=group)
            grads = []
            for p in model.parameters():
                g = torch.zeros_like(p) if p.grad is None else p.grad.clone()
                dist.all_reduce(g, group=group)
                grads.append(g)
            whole = {}  # each selection's rows at their global positions
            for i, picked in enumerate(sel):
                rows = torch.full((picked.shape[0], SEQLEN, picked.shape[-1]), -1,
                                  dtype=torch.long)
                real = pos < SEQLEN
                rows[:, pos[real]] = picked[:, real].long()
                dist.all_reduce(rows, op=dist.ReduceOp.MAX, group=group)  # every rank's rows
                whole[i] = rows
            logits = ra.unshard(res.logits.detach(), layout=layout, seqlen=SEQLEN,
                                cu_seqlens=ctx.cu_seqlens, group=group)
            runs[name] = (whole, logits, loss, grads,
                          {k: indexer.STATS[k] - before[k] for k in before})
        (s1, l1, loss1, g1, _), (sw, lw, lossw, gw, paths) = runs["one rank"], runs["W ranks"]
        seen = _visible(batch)
        differ = sum(int(((_dense(sw[i]) & seen) != (_dense(s1[i]) & seen)).any(-1).sum())
                     for i in s1)
        keep = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
        worst = max(rel_err(a, b) if float(b.norm()) > 0 else float(a.norm())
                    for a, b in zip(gw, g1))
        out.append({"rows that differ": differ, "logits": rel_err(lw[keep], l1[keep]),
                    "loss": rel_err(lossw, loss1), "grads": worst, "paths": paths,
                    "dtype": str(dtype).removeprefix("torch.")})
    return out


POSITION_CASES = {  # W -> (family, batch, layout, top-k, all scores tie)
    2: [("deepseek_v32", "plain", "zigzag", 8, True),
        ("glm_moe_dsa", "packed", "zigzag", 8, False)],
    3: [("deepseek_v32", "left-padded", "contiguous", 8, True),
        ("hy_v4", "plain", "zigzag", 8, False)],
    4: [("deepseek_v32", "padding-only rank", "contiguous", 8, False)],  # rank 0: padding
}


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world", sorted(POSITION_CASES))
def test_position_ties_agree_with_one_rank(clusters, world):
    """``indexer_ties(model, "position")``: equal scores in position order, always the
    ring's running top k (no whole rows, also with every score tied), and W ranks select
    and compute what one rank does on the whole batch."""
    results = clusters(world).run(position_cases, POSITION_CASES[world], timeout=500)
    for rank, per_case in enumerate(results):
        for case, errs in zip(POSITION_CASES[world], per_case):
            assert errs["rows that differ"] == 0, (world, rank, case, errs)
            assert errs["paths"]["whole rows"] == 0 and errs["paths"]["ring"] >= 1, errs
            for name in ("logits", "loss", "grads"):
                tol = TOL[errs["dtype"]] if case[0] != "hy_v4" else TOL["float32"]
                assert errs[name] <= tol, (world, rank, case, name, errs)


def test_indexer_ties_refuses_by_name():
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    model = ra_hf.convert(_model("deepseek_v32", "ringattn", 8, False))
    with pytest.raises(ValueError, match="rule must be one of"):
        ra_hf.indexer_ties(model, "lowest")
    with pytest.raises(TypeError, match="DSA indexers converted"):
        ra_hf.indexer_ties(_model("deepseek_v32", "ringattn", 8, False), "position")
    assert ra_hf.indexer_ties(model, "position") is model
