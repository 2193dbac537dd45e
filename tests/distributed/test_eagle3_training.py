"""The whole Eagle3 draft step under CP against the single-process step with the dense TTT
mask (per-step losses, accuracies, every draft gradient); shifts across shard boundaries;
what crosses the wire; DP x CP training; errors."""

import copy

import pytest
import torch
import torch.distributed as dist

import ringattn as ra
from ringattn.eagle3.draft import eagle3_step, run_target
from ringattn.eagle3.shift import Lookahead
from ringattn.apps.eagle3_train import Eagle3Config, build_draft, build_target, make_batches, train_eagle3
from ringattn.testing import count_collectives
from reference import rel_err

FP32_TOL = 1e-5


def small_config(**kw):
    base = dict(seqlen=61, batch=2, ttt_steps=7, vocab=40, draft_vocab=20, hidden=16, heads=4,
                kv_heads=2, intermediate=32, target_layers=4, pad=9, steps=3)
    return Eagle3Config(**{**base, **kw})


def _models(cfg):
    cp_target, one_target = build_target(cfg, "ringattn"), build_target(cfg, "sdpa")
    draft_ids = torch.arange(0, cfg.vocab, 2)[: cfg.draft_vocab]
    draft = build_draft(cfg, cp_target, draft_ids)
    return cp_target, one_target, draft, copy.deepcopy(draft)


def step_errors(res, draft, one, draft_one, ttt_steps: int) -> dict:
    """{name: relative error} of a CP step's results ``res`` (this rank's share of the loss;
    backward run here) against one process's ``one``: the total and every TTT step's loss,
    every step's accuracy, and every draft gradient (summed over the ranks)."""
    res.loss.backward()
    total = res.loss.detach().clone()
    dist.all_reduce(total)
    grads = {n: p.grad.clone() for n, p in draft.named_parameters() if p.requires_grad}
    for g in grads.values():
        dist.all_reduce(g)  # each rank holds the gradient of its share of the loss
    one.loss.backward()
    errs = {"total loss": rel_err(total.double(), one.loss.detach().double())}
    for j in range(ttt_steps):
        errs[f"loss step {j}"] = abs(res.losses[j] - one.losses[j]) / abs(one.losses[j])
        errs[f"accuracy step {j}"] = abs(res.accuracies[j] - one.accuracies[j])
    for n, p in draft_one.named_parameters():
        if p.requires_grad:
            errs[f"grad {n}"] = rel_err(grads[n].double(), p.grad.double())
    return errs


def _judged(worst_errors, what: str, errs: dict, tol: float, where: str) -> list[str]:
    """Record ``errs`` ({name: relative error}) in the session's worst errors under
    ``what`` and return a line for each above ``tol`` (a NaN is above it)."""
    bad = []
    for name, err in errs.items():
        key = ("float32", f"{what} " + name.split(" ")[0])
        if key not in worst_errors or err > worst_errors[key][0]:
            worst_errors[key] = (err, tol)
        if not err <= tol:
            bad.append(f"{where} {name}: {err:.2e}")
    return bad


def run_step_vs_one_process(layout, seqlen, ttt_steps, strategy="ring", mesh_shape=None):
    """Rank side: relative differences of the CP step from the one-process dense step
    (target and draft attention by ``strategy``; the hybrid on a mesh of ``mesh_shape``)."""
    cfg = small_config(seqlen=seqlen, ttt_steps=ttt_steps, layout=layout)
    cp_target, one_target, draft, draft_one = _models(cfg)
    batch = next(make_batches(cfg))
    group = dist.group.WORLD
    if mesh_shape is not None:
        from test_hybrid import mesh

        group = mesh(*mesh_shape)
    saved = []

    def pack(t):  # record the shape of every tensor kept for the backward
        saved.append(tuple(t.shape))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        res = eagle3_step(draft, run_target(cp_target, batch, group=group, layout=layout,
                                            strategy=strategy), steps=ttt_steps)
    one = eagle3_step(draft_one, run_target(one_target, batch), steps=ttt_steps)
    errs = step_errors(res, draft, one, draft_one, ttt_steps)
    # no activation kept for the backward spans the global sequence (striped's halo is
    # about min(T, W - 1) shards, so the bound applies to the other layouts)
    biggest = max(max(s) for s in saved if s)
    return errs, biggest, res.losses


@pytest.mark.timeout(300)
@pytest.mark.parametrize("layout", ["zigzag", "contiguous", "striped"])
@pytest.mark.parametrize("world", [2, 3])
def test_draft_step_equals_one_process(clusters, worst_errors, world, layout):
    seqlen = 61  # divides neither W nor 2W; one row right padded
    per_rank = clusters(world).run(run_step_vs_one_process, layout, seqlen, 7, timeout=280)
    bad = []
    for rank, (errs, biggest, losses) in enumerate(per_rank):
        assert all(losses[j] > 0 for j in range(7))
        for name, err in errs.items():
            key = ("float32", "eagle3 " + name.split(" ")[0])
            if key not in worst_errors or err > worst_errors[key][0]:
                worst_errors[key] = (err, FP32_TOL)
            if not err <= FP32_TOL:
                bad.append(f"rank {rank} {name}: {err:.2e}")
        if layout != "striped" and world == 3:  # B * L = 44 < S (linears flatten B and L)
            assert biggest < seqlen, f"rank {rank} saved a tensor with a dimension of {biggest}"
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("strategy,world,shape", [("ulysses", 2, None), ("ulysses", 3, None),
                                                  ("hybrid", 4, (2, 2))])
def test_draft_step_equals_one_process_under_ulysses(clusters, worst_errors, strategy, world,
                                                     shape):
    """The target and the draft's TTT attention by Ulysses (and the 2x2 hybrid): the same
    per-step losses, accuracies and gradients as one process."""
    per_rank = clusters(world).run(run_step_vs_one_process, "zigzag", 61, 7, strategy, shape,
                                   timeout=280)
    bad = [f"rank {rank} {name}: {err:.2e}" for rank, (errs, _, _) in enumerate(per_rank)
           for name, err in errs.items() if not err <= FP32_TOL]
    assert not bad, "\n".join(bad)


def run_lookahead(layout, seqlen, width):
    """Rank side: every shift 0..width of a global tensor, read on shards, is exact."""
    g = torch.Generator().manual_seed(seqlen)
    x = torch.randn(2, seqlen, 3, generator=g)
    ids = torch.randint(100, (2, seqlen), generator=g)
    ahead = Lookahead(group=dist.group.WORLD, layout=layout, seqlen=seqlen, width=width)
    ext_x, ext_ids = ahead.extend(ra.shard(x, layout=layout)), ahead.extend(ra.shard(ids, layout=layout), -1)
    pos = ra.positions(seqlen, layout=layout)
    for k in range(width + 1):
        want_x = torch.zeros(2, pos.numel(), 3)
        want_ids = torch.full((2, pos.numel()), -1)
        ok = (pos < seqlen) & (pos + k < seqlen)
        want_x[:, ok] = x[:, pos[ok] + k]
        want_ids[:, ok] = ids[:, pos[ok] + k]
        assert torch.equal(ahead.take(ext_x, k), want_x), (layout, k)
        assert torch.equal(ahead.take(ext_ids, k), want_ids), (layout, k)
    return ahead.received


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 3, 4])
def test_lookahead_reads_across_shard_boundaries(clusters, world):
    for layout in ("zigzag", "contiguous", "striped"):
        for seqlen, width in ((1, 3), (5, 7), (4 * world + 3, 1), (50, 7)):
            got = clusters(world).run(run_lookahead, layout, seqlen, width, timeout=100)
            if layout == "zigzag" and seqlen == 50 and world > 1:
                # rank r needs `width` rows past the end of each of its two chunks, except
                # past the sequence's end: at most 2 * width rows, independent of S
                assert max(got) <= 2 * width


def run_counted(layout, seqlen):
    """Rank side: the collectives of ttt_attention (forward + backward) at each TTT step,
    and of plain causal ring attention with the same padding mask."""
    g = torch.Generator().manual_seed(0)
    kw = dict(layout=layout, seqlen=seqlen)
    valid = [seqlen, seqlen - 4]
    q = ra.shard(torch.randn(2, seqlen, 4, 8, generator=g), **kw).requires_grad_()
    ks = [ra.shard(torch.randn(2, seqlen, 2, 8, generator=g), **kw).requires_grad_() for _ in range(7)]
    vs = [ra.shard(torch.randn(2, seqlen, 2, 8, generator=g), **kw).requires_grad_() for _ in range(7)]
    per_step = []
    for j in range(7):
        with count_collectives() as calls:
            out = ra.eagle3.ttt_attention(q, ks[: j + 1], vs[: j + 1], valid_len=valid, **kw)
            out.sum().backward()
        per_step.append(calls)
    with count_collectives() as plain:
        out = ra.ring_attention(q, ks[0], vs[0], causal=True, mask=ra.masks.key_padding(valid), **kw)
        out.sum().backward()
    return per_step, plain


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_diagonal_keys_cost_no_communication(clusters, world):
    """Every TTT step makes exactly the collectives of one causal ring over the step-0 keys:
    the same calls, the same bytes, whatever the number of cached key sets (the metadata
    agreement's row is ROW_INTS int64s for every kind of call; the number of key sets is
    one of its fields)."""
    for rank, (per_step, plain) in enumerate(clusters(world).run(run_counted, "zigzag", 8 * world + 3)):
        assert [n for n, _ in plain].count("agreement") == 1
        assert plain[0][0] == "agreement"
        hops = plain[1:]
        assert hops and all(n == "batch_isend_irecv" for n, _ in hops)
        for j, calls in enumerate(per_step):
            assert calls[0] == ("agreement", plain[0][1]), (rank, j, calls[0])
            assert calls[1:] == hops, (rank, j, calls, plain)


def run_dp_cp(cfg):
    return train_eagle3(cfg, group=dist.group.WORLD, progress=False)


@pytest.mark.timeout(300)
def test_dp_x_cp_training_equals_one_process(clusters):
    """dp 2 x cp 2 on 4 ranks, 3 optimizer steps: per-step losses and accuracies equal one
    process training on both replicas' rows with the dense TTT mask."""
    cfg = small_config(dp=2, steps=3, ttt_steps=4)
    per_rank = clusters(4).run(run_dp_cp, cfg, timeout=280)
    one = train_eagle3(cfg, progress=False)
    for rank, res in enumerate(per_rank):
        assert res["cp"] == 2 and res["dp"] == 2
        for step in range(cfg.steps):
            assert abs(res["loss"][step] - one["loss"][step]) <= FP32_TOL * one["loss"][step]
            for j in range(cfg.ttt_steps):
                assert abs(res["step_accuracy"][j][step] - one["step_accuracy"][j][step]) < 1e-9
        assert res["shard_ranges"] == [[[0, 16], [48, 61]], [[16, 48]]]


def run_bad(case):
    kw = dict(layout="zigzag", seqlen=9)
    q = torch.zeros(1, 6, 2, 4)  # S=9 on 2 ranks in zigzag: 6 slots each
    k = torch.zeros(1, 6, 1, 4)
    try:
        if case == "empty":
            ra.eagle3.ttt_attention(q, [], [], **kw)
        elif case == "mismatch":
            ra.eagle3.ttt_attention(q, [k, k], [k], **kw)
        elif case == "shape":
            ra.eagle3.ttt_attention(q, [k, torch.zeros(1, 6, 2, 4)], [k, k], **kw)
        elif case == "valid_len":
            ra.eagle3.ttt_attention(q, [k], [k], valid_len=[10], **kw)
        elif case == "steps-differ":
            n = 1 + dist.get_rank()
            ra.eagle3.ttt_attention(q, [k] * n, [k] * n, **kw)
        elif case == "float-valid_len":
            ra.eagle3.ttt_attention(q, [k], [k], valid_len=torch.tensor([3.0]), **kw)
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return None


@pytest.mark.timeout(120)
def test_bad_input_raises_on_every_rank(clusters):
    expect = {"empty": "non-empty", "mismatch": "one length", "shape": "must match keys[0]",
              "valid_len": "valid_len entries", "steps-differ": "ttt_key_sets",
              "float-valid_len": "integer tensor"}
    for case, words in expect.items():
        got = clusters(2).run(run_bad, case, timeout=100)
        for rank, res in enumerate(got):
            assert res is not None, f"{case}: rank {rank} raised nothing"
            assert words in res[1], (case, rank, res)


OFFLINE_TOL = 1e-6
"""Offline against online at the same W, fp32: the same target outputs (the offline ones
from the target run in one process), so within a few float32 roundings."""


def run_offline_vs_one_process(layout):
    """Rank side: precomputed (global) target outputs sharded with shard_target_outputs
    (offline Eagle3 training) give the online step: version 3's final hidden states and
    head (no logits) under CP against the online step under CP, and in one process against
    the online step in one process; version 2's logits under CP against one process.
    {case: {name: relative error}}."""
    from ringattn.eagle3 import shard_target_outputs

    cfg = small_config(seqlen=47, layout=layout)
    cp_target, one_target, draft, _ = _models(cfg)
    batch = next(make_batches(cfg))
    group = dist.group.WORLD
    whole = run_target(one_target, batch)  # what an offline pipeline stores: version 3
    assert whole.logits is None
    logits = run_target(one_target, batch, teacher="logits")  # version 2
    ids = {k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask")}
    v3 = {**ids, "aux_hidden": whole.aux_hidden, "final_hidden": whole.final_hidden}
    v2 = {**ids, "aux_hidden": logits.aux_hidden, "logits": logits.logits}
    cases = {
        "v3 CP": (shard_target_outputs(v3, head=whole.head, group=group, layout=layout),
                  run_target(cp_target, batch, group=group, layout=layout)),
        "v3 one process": (shard_target_outputs(v3, head=whole.head), whole),
        "v2 CP": (shard_target_outputs(v2, group=group, layout=layout),
                  shard_target_outputs(v2)),
    }
    out = {}
    for case, (offline, online) in cases.items():
        assert (offline.logits is None) == case.startswith("v3")
        steps = []
        for tgt in (offline, online):
            d = copy.deepcopy(draft)
            res = eagle3_step(d, tgt, steps=cfg.ttt_steps)
            res.loss.backward()
            total = res.loss.detach().clone()
            grads = {n: p.grad.clone() for n, p in d.named_parameters() if p.requires_grad}
            if tgt.group is not None:  # each rank holds its share of the loss's gradient
                for t in (total, *grads.values()):
                    dist.all_reduce(t)
            steps.append((res, total, grads))
        (res, total, grads), (ref, ref_total, ref_grads) = steps
        errs = {"total loss": rel_err(total.double(), ref_total.double())}
        for j in range(cfg.ttt_steps):
            errs[f"loss step {j}"] = abs(res.losses[j] - ref.losses[j]) / abs(ref.losses[j])
            errs[f"accuracy step {j}"] = abs(res.accuracies[j] - ref.accuracies[j])
        for n, g in ref_grads.items():
            errs[f"grad {n}"] = rel_err(grads[n].double(), g.double())
        out[case] = errs
    return out


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,layout", [(2, "zigzag"), (3, "zigzag"), (3, "striped")])
def test_offline_sharded_target_outputs_equal_one_process(clusters, worst_errors, world,
                                                          layout):
    """Offline outputs train as the online target does, on every rank: version 3 (final
    hidden states and head) under CP at W = 2 and 3 and in one process, version 2
    (logits) under CP."""
    bad = []
    for rank, cases in enumerate(clusters(world).run(run_offline_vs_one_process, layout,
                                                     timeout=280)):
        for case, errs in cases.items():
            bad += _judged(worst_errors, "eagle3 offline", errs, OFFLINE_TOL,
                           f"W={world} {layout} rank {rank} {case}")
    assert not bad, "\n".join(bad)


def run_step_collectives(seqlen, ttt_steps):
    """Rank side: the collectives of one training step (target forward, draft forward twice:
    with a fresh Lookahead set-up and with the cached one, draft backward)."""
    from collections import Counter

    cfg = small_config(seqlen=seqlen, ttt_steps=ttt_steps)
    cp_target, _, draft, _ = _models(cfg)
    batch = next(make_batches(cfg))
    group = dist.group.WORLD
    counts = {}
    with count_collectives() as calls:
        tgt = run_target(cp_target, batch, group=group, layout="zigzag")
    counts["target"] = Counter(n for n, _ in calls)
    for name in ("draft forward, first", "draft forward"):
        with count_collectives() as calls:
            res = eagle3_step(draft, tgt, steps=ttt_steps)
        counts[name] = Counter(n for n, _ in calls)
    with count_collectives() as calls:
        res.loss.backward()
    counts["draft backward"] = Counter(n for n, _ in calls)
    return counts, cfg.target_layers


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_training_step_collective_counts(clusters, world):
    """The counts docs/eagle3.md gives, on every rank (zigzag, T = 7, S unique to this test
    so the Lookahead set-up is not cached yet)."""
    t = 7
    for rank, (counts, layers) in enumerate(clusters(world).run(run_step_collectives, 67 + world, t)):
        # target: per layer one metadata agreement and W - 1 hops; one agreement per tensor
        # shard_batch / run_target shard (input_ids, position_ids, loss_mask); one for the
        # teacher's head check on a target's first call
        assert counts["target"] == {"agreement": layers + 4,
                                    "batch_isend_irecv": layers * (world - 1)}, (rank, counts)
        # draft: per TTT step one agreement and W - 1 hops; one all_to_all per shifted tensor
        # (teacher, its top token, in-vocabulary flags, loss mask with real-token flags, ids),
        # 2 more to set up the Lookahead; one all-reduce of the metrics. Backward: 2W - 1
        # hops per TTT step.
        per_step = {"agreement": t, "batch_isend_irecv": t * (world - 1), "all_reduce": 1}
        assert counts["draft forward, first"] == {**per_step, "all_to_all_single": 7}, (rank, counts)
        assert counts["draft forward"] == {**per_step, "all_to_all_single": 5}, (rank, counts)
        assert counts["draft backward"] == {"batch_isend_irecv": t * (2 * world - 1)}, (rank, counts)


DOCS = (23, 17, 21)  # packed into S = 61 (divides neither 2W nor W for W in 2, 3)


def _packed_batch(cfg):
    """One packed row of three documents (their own loss masks: no loss on each one's first
    4 tokens) and the documents as rows of their own."""
    gen = torch.Generator().manual_seed(5)
    docs = [torch.randint(cfg.vocab, (1, n), generator=gen) for n in DOCS]
    masks = [torch.ones_like(d) for d in docs]
    for m in masks:
        m[:, :4] = 0
    cu = [0]
    for n in DOCS:
        cu.append(cu[-1] + n)
    packed = {"input_ids": torch.cat(docs, 1), "loss_mask": torch.cat(masks, 1), "cu_seqlens": cu}
    alone = [{"input_ids": d, "loss_mask": m} for d, m in zip(docs, masks)]
    return packed, alone


def _unscaled(res, b, s):
    """(loss, correct, counted) sums per TTT step, the loss no longer divided by B * S."""
    sums = res.sums.clone()
    sums[0] *= b * s
    return sums


def run_packed(layout, strategy):
    """Rank side: per-TTT-step sums of the packed row under CP, in one process, and of the
    documents run one by one in one process (float64 [3, T] each), and the CP gradients'
    distance from the one-process packed step."""
    cfg = small_config(seqlen=sum(DOCS), layout=layout)
    cp_target, one_target, draft, draft_one = _models(cfg)
    packed, alone = _packed_batch(cfg)
    res = eagle3_step(draft, run_target(cp_target, packed, group=dist.group.WORLD, layout=layout,
                                        strategy=strategy), steps=cfg.ttt_steps)
    res.loss.backward()
    one = eagle3_step(draft_one, run_target(one_target, packed), steps=cfg.ttt_steps)
    one.loss.backward()
    errs = {}
    for n, p in draft_one.named_parameters():
        if p.requires_grad:
            g = dict(draft.named_parameters())[n].grad.clone()
            dist.all_reduce(g)
            errs[n] = rel_err(g.double(), p.grad.double())
    s = sum(DOCS)
    separate = sum(_unscaled(eagle3_step(draft_one, run_target(one_target, doc),
                                         steps=cfg.ttt_steps), 1, doc["input_ids"].shape[1])
                   for doc in alone)
    return _unscaled(res, 1, s), _unscaled(one, 1, s), separate, errs


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,layout,strategy", [(2, "zigzag", "ring"), (3, "striped", "ring"),
                                                   (3, "contiguous", "ring"),
                                                   (2, "zigzag", "ulysses")])
def test_packed_documents_equal_the_documents_one_by_one(clusters, world, layout, strategy):
    """Three documents packed into one row (cu_seqlens): under CP and in one process, every
    TTT step's loss sum, correct and counted tokens equal those of the documents run one by
    one; the CP gradients equal the one-process packed step's."""
    for rank, (cp, one, separate, errs) in enumerate(
            clusters(world).run(run_packed, layout, strategy, timeout=280)):
        assert torch.equal(one[1:], separate[1:]) and torch.equal(cp[1:], one[1:]), (rank, cp, one, separate)
        assert float((one[0] - separate[0]).abs().max()) <= FP32_TOL * float(separate[0].abs().max())
        assert float((cp[0] - one[0]).abs().max()) <= FP32_TOL * float(one[0].abs().max())
        assert all(e <= FP32_TOL for e in errs.values()), (rank, errs)
        assert float(separate[2].sum()) > 0


def test_padded_row_last_token_is_not_trained_against_padding():
    """A right-padded row: no TTT step counts a token whose teacher (position i + 1 + j) is
    padding or past the end; every other loss token counts."""
    cfg = small_config(pad=9)
    target = build_target(cfg, "sdpa")
    draft = build_draft(cfg, target, torch.arange(0, cfg.vocab, 2)[: cfg.draft_vocab])
    batch = next(make_batches(cfg))
    res = eagle3_step(draft, run_target(target, batch), steps=cfg.ttt_steps)
    keep, lm = batch["attention_mask"].bool(), batch["loss_mask"].bool()
    s = cfg.seqlen
    for j in range(cfg.ttt_steps):  # counted: loss at i + j and a real teacher at i + 1 + j
        want = (lm[:, j:s - 1] & keep[:, j + 1:]).sum()
        assert int(res.sums[2, j]) == int(want), (j, res.sums[2, j], want)


def run_resume(out):
    """Rank side: a 6-step run saving at step 3, then a fresh run resumed from that
    checkpoint: (uninterrupted losses, resumed losses, max parameter difference)."""
    cfg = small_config(steps=6, save_every=3, warmup=2, accumulate=2, layout="zigzag")
    full = train_eagle3(cfg, group=dist.group.WORLD, progress=False, out_dir=out, keep_draft=True)
    dist.barrier()  # rank 0 has written the checkpoints
    again = train_eagle3(cfg, group=dist.group.WORLD, progress=False,
                         resume=f"{out}/checkpoint-3", keep_draft=True)
    diff = max(float((a.double() - b.double()).abs().max()) for a, b in
               zip(full["draft"].state_dict().values(), again["draft"].state_dict().values()))
    return full["loss"], again["loss"], full["lr"], again["lr"], diff


@pytest.mark.timeout(300)
def test_resume_equals_the_uninterrupted_run(clusters, tmp_path):
    """On 2 CP ranks (warm-up, cosine, clipping, 2 batches per step): resuming at step 3
    from the checkpoint gives the uninterrupted run's losses, learning rates and final
    parameters (the same arithmetic in the same order: equal, not just close)."""
    for rank, (full, again, lr_full, lr_again, diff) in enumerate(
            clusters(2).run(run_resume, str(tmp_path), timeout=280)):
        assert len(full) == len(again) == 6
        assert again[:3] == full[:3] and lr_again == lr_full, rank  # history from the file
        assert again[3:] == full[3:], (rank, full, again)
        assert diff == 0.0, (rank, diff)


def test_checkpoint_of_another_configuration_is_refused(tmp_path):
    cfg = small_config(steps=1)
    train_eagle3(cfg, progress=False, out_dir=str(tmp_path))
    with pytest.raises(ValueError, match="another configuration: lr="):
        train_eagle3(small_config(steps=2, lr=1e-3), progress=False,
                     resume=str(tmp_path / "checkpoint-last"))
    with pytest.raises(ValueError, match="no Eagle3 checkpoint"):
        train_eagle3(cfg, progress=False, resume=str(tmp_path / "nowhere"))


def run_bf16(layout):
    """Rank side: per-TTT-step losses of one step under bf16 autocast (CP and one process)
    and in fp32 (one process), and the dtypes of the draft's parameters and gradients."""
    cfg = small_config(layout=layout, dtype="bfloat16")
    cp_target, one_target, draft, draft_one = _models(cfg)
    batch = next(make_batches(cfg))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cp = eagle3_step(draft, run_target(cp_target, batch, group=dist.group.WORLD,
                                           layout=layout), steps=cfg.ttt_steps)
        one = eagle3_step(draft_one, run_target(one_target, batch), steps=cfg.ttt_steps)
    cp.loss.backward()
    fp32 = eagle3_step(copy.deepcopy(draft_one), run_target(one_target, batch), steps=cfg.ttt_steps)
    dtypes = {str(p.dtype) for p in draft.parameters()} | {
        str(p.grad.dtype) for p in draft.parameters() if p.requires_grad}
    return cp.losses, one.losses, fp32.losses, dtypes


@pytest.mark.timeout(200)
def test_bf16_step_is_as_close_to_fp32_as_one_process_bf16(clusters):
    """Under bf16 autocast the CP step's per-TTT-step losses are within 2x (plus 1e-3) of
    the one-process bf16 step's distance from fp32; parameters and gradients stay fp32."""
    for rank, (cp, one, fp32, dtypes) in enumerate(clusters(2).run(run_bf16, "zigzag", timeout=180)):
        assert dtypes == {"torch.float32"}, (rank, dtypes)
        for j, (a, b, r) in enumerate(zip(cp, one, fp32)):
            assert abs(a - r) <= 2 * abs(b - r) + 1e-3 * abs(r), (rank, j, a, b, r)


def run_sharded_target(cfg):
    res = train_eagle3(cfg, group=dist.group.WORLD, progress=False)
    assert res["target_sharded"], "the target's parameters are not FSDP2 DTensors"
    return res["loss"]


@pytest.mark.timeout(240)
def test_fsdp2_sharded_target_trains_like_one_process(clusters):
    """The target's weights sharded by FSDP2 over both CP ranks (shard_target): the draft
    trains with the losses of one process holding the whole target."""
    cfg = small_config(steps=3, shard_target=True)
    one = train_eagle3(small_config(steps=3), progress=False)["loss"]
    for rank, got in enumerate(clusters(2).run(run_sharded_target, cfg, timeout=200)):
        for step, (a, b) in enumerate(zip(got, one, strict=True)):
            assert abs(a - b) <= FP32_TOL * abs(b), (rank, step, a, b)


TILED_TOL = 1e-6
"""The teacher in tiles against the teacher from the whole logits, fp32: the same sums in
another order (tiles, then steps), so within a few float32 roundings."""


def run_tiled_vs_logits(layout, kind, tile):
    """Rank side: the step with the teacher in tiles (the target's final hidden states and
    head; ``run_target``'s default) against the step with the target's logits, on the same
    batch and the same draft: {name: relative difference} of this rank's loss share, every
    step's loss and accuracy, and every gradient of this rank's share; and whether the
    tiled outputs hold no logits."""
    cfg = small_config(seqlen=sum(DOCS) if kind == "packed" else 61, layout=layout,
                       pad=9 if kind == "padded" else 0)
    cp_target, _, draft, draft_tiled = _models(cfg)
    batch = _packed_batch(cfg)[0] if kind == "packed" else next(make_batches(cfg))
    group = dist.group.WORLD if dist.get_world_size() > 1 else None
    kw = dict(group=group, layout=layout) if group is not None else {}
    target = cp_target if group is not None else _models(cfg)[1]
    logits = run_target(target, batch, teacher="logits", **kw)
    tiled = run_target(target, batch, **kw)
    a = eagle3_step(draft, logits, steps=cfg.ttt_steps)
    b = eagle3_step(draft_tiled, tiled, steps=cfg.ttt_steps, tile=tile)
    a.loss.backward()
    b.loss.backward()
    errs = {"loss": rel_err(b.loss.detach().double(), a.loss.detach().double())}
    for j in range(cfg.ttt_steps):
        errs[f"loss step {j}"] = abs(b.losses[j] - a.losses[j]) / abs(a.losses[j])
        errs[f"accuracy step {j}"] = abs(b.accuracies[j] - a.accuracies[j])
        errs[f"counted step {j}"] = float((b.sums[2, j] - a.sums[2, j]).abs())
    for (n, p), (_, q) in zip(draft.named_parameters(), draft_tiled.named_parameters()):
        if p.requires_grad:
            errs["grad " + n] = rel_err(q.grad.double(), p.grad.double())
    top = (tiled.top_tokens(tile=3) == logits.logits.argmax(-1)).all().item()
    return errs, tiled.logits is None and tiled.final_hidden is not None, top


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world,cases", [
    (1, [("contiguous", "padded", 7), ("contiguous", "packed", "2KiB")]),
    (2, [("zigzag", "padded", 5), ("zigzag", "packed", 3), ("contiguous", "plain", "16MiB")]),
    (3, [("striped", "padded", 4), ("zigzag", "packed", "1KiB")]),
    (4, [("zigzag", "padded", 1)])])
def test_the_teacher_in_tiles_equals_the_teacher_from_logits(clusters, worst_errors, world,
                                                              cases):
    """The Eagle3 step with the teacher computed a tile at a time from the target's final
    hidden states (no [L, V] or [L, Vd] tensor) gives the losses, accuracies and gradients
    of the step with the target's logits: W = 1..4, padded and packed rows, tiles of 1 row
    to all of them, on every rank."""
    bad = []
    for layout, kind, tile in cases:
        for rank, (errs, no_logits, top) in enumerate(
                clusters(world).run(run_tiled_vs_logits, layout, kind, tile, timeout=280)):
            assert no_logits and top, (rank, layout, kind)
            bad += _judged(worst_errors, "eagle3 tiled", errs, TILED_TOL,
                           f"W={world} {layout} {kind} tile {tile} rank {rank}")
    assert not bad, "\n".join(bad)


def test_the_teacher_in_tiles_under_bf16_autocast_is_the_logits_teacher():
    """Under bf16 autocast (``Eagle3Config.dtype``) the tiled step runs the draft's head
    as autocast runs it and its teacher outside it (as the target ran): its loss and
    gradients are as far from the fp32 step as the logits path's are (one process), and
    its accuracies the same."""
    cfg = small_config(seqlen=61)
    _, target, draft, _ = _models(cfg)
    batch = next(make_batches(cfg))
    outputs = {t: run_target(target, batch, teacher=t) for t in ("logits", "tiled")}

    def run(teacher, bf16):
        d = copy.deepcopy(draft)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=bf16):
            res = eagle3_step(d, outputs[teacher], steps=cfg.ttt_steps, tile=5)
        res.loss.backward()
        return res, {n: p.grad for n, p in d.named_parameters() if p.grad is not None}

    ref, ref_grads = run("logits", False)
    errs = {}
    for teacher in ("logits", "tiled"):
        res, grads = run(teacher, True)
        assert res.accuracies == ref.accuracies, teacher
        errs[teacher] = (rel_err(res.loss.detach().double(), ref.loss.detach().double()),
                         max(rel_err(grads[n].double(), ref_grads[n].double()) for n in grads))
    assert errs["tiled"][0] <= 2 * errs["logits"][0] + 1e-7, errs
    assert errs["tiled"][1] <= 1.25 * errs["logits"][1], errs
    assert errs["logits"][1] > 1e-4  # bf16 matters here: the bound is not vacuous


def run_bad_teacher():
    """Rank side: a target whose head is a LoRA head (a Linear subclass: its weight is not
    its output) with teacher='tiled', and one whose head output differs from what the head
    table says (a hook scaling it), and a draft built for another vocabulary: each refused
    by name on every rank; 'auto' runs the first from its logits."""
    from test_tiled_head import LoRAHead

    cfg = small_config(seqlen=29, pad=0)
    target, _, draft, _ = _models(cfg)
    batch = next(make_batches(cfg))
    group = dist.group.WORLD
    said = {}
    plain = target.lm_head
    target.lm_head = LoRAHead(plain, 0.3)
    try:
        run_target(target, batch, group=group, teacher="tiled")
        said["lora"] = "ran"
    except ValueError as exc:
        said["lora"] = str(exc)
    said["lora auto"] = run_target(target, batch, group=group).logits is not None
    target.lm_head = plain
    handle = plain.register_forward_hook(lambda m, a, out: out * 2)
    try:  # a hooked head: not read by its weight (structure), the logits path instead
        said["hooked auto"] = run_target(target, batch, group=group).logits is not None
    finally:
        handle.remove()
    tgt = run_target(target, batch, group=group)
    from ringattn.apps.eagle3_train import draft_config
    from ringattn.eagle3.draft import Eagle3Draft

    config = draft_config(target.config)
    config.vocab_size = cfg.vocab + 4  # a draft for a target with 4 tokens more
    wide = Eagle3Draft(config, target.config.hidden_size, torch.arange(cfg.draft_vocab),
                       draft.aux_layers)
    try:
        eagle3_step(wide, tgt, steps=cfg.ttt_steps)
        said["vocab"] = "ran"
    except ValueError as exc:
        said["vocab"] = str(exc)
    return said


@pytest.mark.timeout(120)
def test_a_teacher_that_cannot_be_read_is_refused_by_name(clusters):
    for rank, said in enumerate(clusters(2).run(run_bad_teacher, timeout=100)):
        assert "LoRAHead, not exactly a torch.nn" in said["lora"], (rank, said)
        assert "pass teacher='logits'" in said["lora"], (rank, said)
        assert said["lora auto"] and said["hooked auto"], (rank, said)
        assert "a draft built for another target" in said["vocab"], (rank, said)
