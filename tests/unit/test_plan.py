"""The plan, layouts and masks, without processes: pure functions checked exhaustively."""

import itertools

import pytest
import torch

from reference import visible
from ringattn.layouts import LAYOUTS, get_layout, local_positions, restore_index
from ringattn.masks import BlockKind, WindowMask
from ringattn.plan import kv_source, plan_counts, plan_step

WORLDS = [1, 2, 3, 4, 5, 6]
WINDOWS = [  # (causal, (left, right))
    (True, (-1, -1)), (False, (-1, -1)), (True, (3, -1)), (False, (2, 3)),
    (False, (-1, 1)), (True, (0, -1)), (False, (0, 0)), (True, (9, 4)),
]


def window_mask(seqlen, causal, window):
    left = None if window[0] < 0 else window[0]
    right = None if window[1] < 0 else window[1]
    if causal:
        right = 0 if right is None else min(right, 0)
    return WindowMask(seqlen, left, right)


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("world", WORLDS)
def test_layout_is_a_permutation(layout, world):
    for seqlen in (1, world, 2 * world + 1, 37):
        lay = get_layout(layout)
        padded = lay.padded_len(seqlen, world)
        assert padded % lay.multiple(world) == 0 and padded - seqlen < lay.multiple(world)
        shards = [local_positions(layout, r, world, seqlen) for r in range(world)]
        assert all(s.numel() == lay.local_len(seqlen, world) for s in shards)
        if lay.increasing:  # the plan's one-triangle own step relies on this
            assert all(bool((s[1:] > s[:-1]).all()) for s in shards)
        perm = torch.cat(shards)
        assert torch.equal(perm.sort().values, torch.arange(padded))
        assert torch.equal(perm[restore_index(layout, world, seqlen)], torch.arange(padded))


def test_layout_definitions():
    w, s = 3, 24  # zigzag chunks of 4; striped stride 3
    assert local_positions("zigzag", 1, w, s).tolist() == [4, 5, 6, 7, 16, 17, 18, 19]
    assert local_positions("striped", 2, w, s).tolist() == [2, 5, 8, 11, 14, 17, 20, 23]
    assert local_positions("contiguous", 2, w, s).tolist() == list(range(16, 24))
    with pytest.raises(ValueError, match="unknown layout 'ring'"):
        get_layout("ring")


@pytest.mark.parametrize("layout", sorted(LAYOUTS))
@pytest.mark.parametrize("world", WORLDS)
def test_plan_covers_exactly_the_visible_pairs(layout, world):
    """For every rank and step, the blocks' bands, put back in global positions, equal the
    independently written dense mask: every visible pair once, no invisible pair."""
    for seqlen, (causal, window) in itertools.product((1, 2 * world + 1, 4 * world), WINDOWS):
        mask = window_mask(seqlen, causal, window)
        lay = get_layout(layout)
        padded = lay.padded_len(seqlen, world)
        dense = torch.zeros(padded, padded, dtype=torch.bool)
        dense[:seqlen, :seqlen] = visible(seqlen, causal, window)
        for rank in range(world):
            qpos = local_positions(layout, rank, world, seqlen)
            for step in range(world):
                kpos = local_positions(layout, kv_source(rank, step, world), world, seqlen)
                covered = torch.zeros(qpos.numel(), kpos.numel(), dtype=torch.int32)
                for b in plan_step(lay, mask, world, rank, step):
                    assert b.kind is not BlockKind.EMPTY
                    nq, nk = b.q_stop - b.q_start, b.k_stop - b.k_start
                    ok = (torch.ones(nq, nk, dtype=torch.bool) if b.mask is None
                          else b.mask.dense(range(nq), range(nk)))
                    # every row handed to a kernel sees at least one key
                    assert ok.any(dim=1).all(), (layout, world, seqlen, rank, step, b)
                    covered[b.q_start:b.q_stop, b.k_start:b.k_stop] += ok.int()
                want = dense[qpos][:, kpos].int()
                assert torch.equal(covered, want), (layout, world, seqlen, causal, window, rank, step)


@pytest.mark.parametrize("world", [2, 3, 4, 5, 6])
def test_causal_block_counts(world):
    """Empty blocks are skipped; the counts are the textbook ones for each layout."""
    seqlen = 8 * world  # divisible by 2W: no padding
    mask = window_mask(seqlen, True, (-1, -1))
    for rank in range(world):
        zz = plan_counts(get_layout("zigzag"), mask, world, rank)
        # own step: one causal triangle over both chunks; every other step: one full block
        assert zz == {BlockKind.PARTIAL: 1, BlockKind.FULL: world - 1}
        st = plan_counts(get_layout("striped"), mask, world, rank)
        assert st == {BlockKind.PARTIAL: world, BlockKind.FULL: 0}  # one triangle per step
        co = plan_counts(get_layout("contiguous"), mask, world, rank)
        assert co == {BlockKind.PARTIAL: 1, BlockKind.FULL: rank}  # later ranks: skipped
        for lay in ("zigzag", "striped", "contiguous"):  # the own step is a single triangle
            (own,) = plan_step(get_layout(lay), mask, world, rank, 0)
            assert (own.q_start, own.q_stop, own.k_start, own.k_stop) == (0, 8, 0, 8)
            assert own.mask is not None and own.mask.is_causal


def test_window_block_counts():
    world, seqlen = 4, 64  # contiguous shards of 16; a window of 5 reaches one shard back
    mask = window_mask(seqlen, True, (5, -1))
    for rank in range(world):
        counts = plan_counts(get_layout("contiguous"), mask, world, rank)
        assert counts == {BlockKind.PARTIAL: 1 + (rank > 0), BlockKind.FULL: 0}
    # two-sided window (3, 3) reaches one shard each way, never further
    mask = window_mask(seqlen, False, (3, 3))
    for rank in range(world):
        counts = plan_counts(get_layout("contiguous"), mask, world, rank)
        assert counts == {BlockKind.PARTIAL: 1 + (rank > 0) + (rank < world - 1), BlockKind.FULL: 0}


def test_zigzag_off_diagonal_blocks_are_coalesced():
    world, seqlen = 4, 64
    mask = window_mask(seqlen, True, (-1, -1))
    for rank in range(world):
        for step in range(1, world):
            (blk,) = plan_step(get_layout("zigzag"), mask, world, rank, step)
            assert blk.kind is BlockKind.FULL
            src = kv_source(rank, step, world)
            # earlier source: all our queries see its first chunk; later: our second chunk sees all
            want = (0, 16, 0, 8) if src < rank else (8, 16, 0, 16)
            assert (blk.q_start, blk.q_stop, blk.k_start, blk.k_stop) == want


def test_plan_is_cached_and_pure():
    mask = window_mask(40, True, (-1, -1))
    a = plan_step(get_layout("zigzag"), mask, 5, 2, 3)
    b = plan_step(get_layout("zigzag"), window_mask(40, True, (-1, -1)), 5, 2, 3)
    assert a is b


# ------------------------------------------------------------------ general masks, varlen

from ringattn import masks as M  # noqa: E402
from ringattn.layouts import DocumentZigzag  # noqa: E402
from ringattn.plan import make_plan  # noqa: E402


def _docs(seqlen, seed):
    g = torch.Generator().manual_seed(seed)
    cu = [0]
    while cu[-1] < seqlen:
        cu.append(min(seqlen, cu[-1] + int(torch.randint(1, 12, (1,), generator=g))))
    return cu


def _dense_doc_causal(cu, seqlen):
    doc = torch.tensor([d for d in range(len(cu) - 1) for _ in range(cu[d], cu[d + 1])])
    i, j = torch.arange(seqlen)[:, None], torch.arange(seqlen)[None, :]
    return (doc[:, None] == doc[None, :]) & (j <= i)


@pytest.mark.parametrize("world", [1, 2, 3, 5])
def test_document_zigzag_layout(world):
    """A permutation with ranks holding ceil(S/W) slots, S/W +- 1 real tokens, every document
    cut into 2W chunks differing by at most one token, rank r holding chunks r and 2W-1-r."""
    for seed, seqlen in ((0, 61), (1, 7 * world + 3), (2, 1)):
        cu = _docs(seqlen, seed)
        lay = get_layout("zigzag", tuple(cu))
        assert isinstance(lay, DocumentZigzag)
        shards = [local_positions(lay, r, world, seqlen) for r in range(world)]
        assert all(s.numel() == -(-seqlen // world) for s in shards)
        assert all(bool((s[1:] > s[:-1]).all()) for s in shards)
        real = [int((s < seqlen).sum()) for s in shards]
        assert max(real) - min(real) <= 1 and sum(real) == seqlen
        perm = torch.cat(shards)
        assert torch.equal(perm[restore_index(lay, world, seqlen)], torch.arange(perm.numel()))
        owner = torch.empty(perm.numel(), dtype=torch.long)
        for r, s in enumerate(shards):
            owner[s] = r
        for a, b in zip(cu[:-1], cu[1:]):
            ranks = torch.unique_consecutive(owner[a:b]).tolist()
            # chunks in document order belong to ranks 0..W-1, W-1..0 (empty chunks skipped)
            it = iter(list(range(world)) + list(reversed(range(world))))
            assert all(any(r == x for x in it) for r in ranks), (cu, a, b, ranks)
            base = (b - a) // (2 * world)  # each rank: two chunks of base or base + 1
            held = torch.bincount(owner[a:b], minlength=world)
            assert bool(((held >= 2 * base) & (held <= 2 * base + 2)).all()), (a, b, held)


def _covered(plan_blocks, nq, nk):
    covered = torch.zeros(nq, nk, dtype=torch.int32)
    for b in plan_blocks:
        n, m = b.q_stop - b.q_start, b.k_stop - b.k_start
        if b.mask is None:
            ok = torch.ones(n, m, dtype=torch.bool)
        else:
            ok = b.mask.dense()
            assert ok.shape[-2:] == (n, m)
            ok = ok.any(0).any(0)  # masks here do not depend on batch or head
        covered[b.q_start:b.q_stop, b.k_start:b.k_stop] += ok.int()
    return covered


@pytest.mark.parametrize("tile", [(4, 4), (8, 3), (256, 128), None])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_general_plan_covers_exactly_the_visible_pairs(world, tile):
    """Documents & causal on every layout (per-document zigzag included): the blocks of every
    rank and step, put back in global positions, equal the dense mask written from the
    definition, each visible pair once; FULL blocks contain no invisible pair."""
    for seed, seqlen in ((0, 6 * world + 5), (3, 40)):
        cu = _docs(seqlen, seed)
        dense = _dense_doc_causal(cu, seqlen)
        mask = M.document(cu) & M.causal()
        for lay in (get_layout("contiguous"), get_layout("striped"), get_layout("zigzag"),
                    get_layout("zigzag", tuple(cu))):
            for rank in range(world):
                plan = make_plan(lay, mask, world, rank, seqlen, tile=tile)
                qpos = local_positions(lay, rank, world, seqlen)
                assert plan.last_step == max(
                    (t for t, bl in enumerate(plan.steps) if bl), default=0)
                for step in range(world):
                    kpos = local_positions(lay, kv_source(rank, step, world), world, seqlen)
                    want = torch.zeros(qpos.numel(), kpos.numel(), dtype=torch.int32)
                    rq, rk = qpos < seqlen, kpos < seqlen
                    want[rq.nonzero()[:, 0][:, None], rk.nonzero()[:, 0][None, :]] = \
                        dense[qpos[rq]][:, kpos[rk]].int()
                    got = _covered(plan.steps[step], qpos.numel(), kpos.numel())
                    assert torch.equal(got, want), (lay, world, rank, step, tile)


def test_general_plan_block_classes():
    """Hand-derived: contiguous, W=4, S=64 (shards of 16), documents [8,24) and [24,40),
    tiles of 4x4. Rank 1 holds 16..31. Own step: each document's diagonal gives partial
    tiles on the diagonal and one full tile below it (rows 4-7 x cols 0-3, rows 12-15 x
    cols 8-11). Step 1 (keys 0..15): rows of document [8,24) see keys 8..15, all earlier:
    one coalesced full block rows 0-7 x cols 8-15. Steps 2 and 3 are empty."""
    cu = [0, 8, 24, 40, 56, 64]
    plan = make_plan(get_layout("contiguous"), M.document(cu) & M.causal(), 4, 1, 64,
                     tile=(4, 4))
    step0 = [(b.kind, b.q_start, b.q_stop, b.k_start, b.k_stop) for b in plan.steps[0]]
    F, P = BlockKind.FULL, BlockKind.PARTIAL
    assert sorted(step0, key=str) == sorted([
        (P, 0, 4, 0, 4), (F, 4, 8, 0, 4), (P, 4, 8, 4, 8),
        (P, 8, 12, 8, 12), (F, 12, 16, 8, 12), (P, 12, 16, 12, 16)], key=str)
    assert [(b.kind, b.q_start, b.q_stop, b.k_start, b.k_stop) for b in plan.steps[1]] == [
        (F, 0, 8, 8, 16)]
    assert plan.steps[2] == () and plan.steps[3] == () and plan.last_step == 1
    assert plan.counts() == {F: 3, P: 4}
    # partial blocks keep their dense mask with the plan; the plan is cached
    assert all(b.mask.stored is not None for b in plan.steps[0] if b.kind is P)
    again = make_plan(get_layout("contiguous"), M.document(cu) & M.causal(), 4, 1, 64,
                      tile=(4, 4))
    assert again is plan
    # documents that never cross a shard: nothing but the own step, on every rank
    for rank in range(4):
        p = make_plan(get_layout("contiguous"), M.document([0, 16, 32, 48, 64]) & M.causal(),
                      4, rank, 64)
        assert p.last_step == 0


def test_band_masks_take_the_analytic_path():
    """causal() & sliding_window(...) is a band: same blocks as the window shorthand."""
    lay = get_layout("zigzag")
    for world, rank in ((3, 1), (4, 3)):
        plan = make_plan(lay, M.causal() & M.sliding_window(5, 2), world, rank, 50)
        for step in range(world):
            assert plan.steps[step] == plan_step(lay, WindowMask(50, 5, 0), world, rank, step)


def test_mask_algebra_and_evaluation():
    q = torch.arange(10)
    ok = M.evaluate(M.prefix_lm(4), 10, q, q, 1, 1)[0, 0]
    i, j = q[:, None], q[None, :]
    assert torch.equal(ok, (j < 4) | (j <= i))
    both = M.causal() & M.sliding_window(2, 0)
    assert both.band == (2, 0) and (M.causal() | M.sliding_window(2, 0)).band is None
    assert hash(M.document([0, 3, 10])) == hash(M.document(torch.tensor([0, 3, 10])))
    pad = M.evaluate(M.full(), 8, torch.arange(10), torch.arange(10), 1, 1)[0, 0]
    assert not pad[8:].any() and not pad[:, 8:].any() and pad[:8, :8].all()  # padding >= S
    dil = M.evaluate(M.dilated(4, 2), 8, torch.arange(8), torch.arange(8), 1, 2)
    assert dil.shape == (1, 2, 8, 8) and dil[0, 1, 1, 3] and not dil[0, 0, 1, 3]
    with pytest.raises(ValueError, match="must return a bool tensor, got torch.int64"):
        M.evaluate(M.from_function(lambda b, h, q, kv: q - kv), 8, q, q, 1, 1)
    with pytest.raises(ValueError, match="failed on global position tensors: ZeroDivision"):
        M.evaluate(M.from_function(lambda b, h, q, kv: 1 / 0), 8, q, q, 1, 1)


@pytest.mark.parametrize("bad,match", [
    ([1, 5, 10], "must start at 0"),
    ([0, 5, 5, 10], "strictly increasing"),
    ([0, 7, 3, 10], "strictly increasing"),
    ([0, 5, 9], "must end at S=10"),
    ([0.0, 10.0], "integer"),
    ([10], "at least 2 entries"),
])
def test_cu_seqlens_are_validated(bad, match):
    err = TypeError if isinstance(bad[0], float) else ValueError
    with pytest.raises(err, match=match):
        M.check_cu_seqlens(torch.tensor(bad) if isinstance(bad[0], float) else bad, 10)


def test_tiles_follow_segments():
    """Per-document zigzag, documents of 150-600 tokens: tiles are cut at chunk boundaries,
    so the kernels compute few pairs beyond the visible ones (only the diagonal tiles'
    upper halves), and every rank computes the same amount."""
    g = torch.Generator().manual_seed(0)
    cu = [0]
    while cu[-1] < 4096:
        cu.append(min(4096, cu[-1] + int(torch.randint(150, 600, (1,), generator=g))))
    lengths = torch.tensor(cu).diff()
    visible = int((lengths * (lengths + 1) // 2).sum())
    mask = M.document(cu) & M.causal()
    for world in (2, 4):
        lay = get_layout("zigzag", tuple(cu))
        computed = []
        for rank in range(world):
            plan = make_plan(lay, mask, world, rank, 4096)
            computed.append(sum((b.q_stop - b.q_start) * (b.k_stop - b.k_start)
                                for blocks in plan.steps for b in blocks))
        # measured 1.25 (W=2) and 1.22 (W=4); fixed tiles that straddle chunks: 3.9 and 7.4
        assert sum(computed) / visible < 1.3, (world, sum(computed) / visible)
        assert max(computed) / (sum(computed) / world) < 1.05, (world, computed)


def test_plan_cache_is_bounded_by_bytes_and_names_masks_that_defeat_it(caplog, monkeypatch):
    """New mask objects for the same mask each get a plan; the cache keeps their bytes under
    PLAN_CACHE_BYTES and says once (a warning) that new objects defeat it. The same object
    reuses its plan."""
    import logging

    from ringattn import plan as plan_mod
    from ringattn.layouts import Zigzag
    from ringattn.masks import from_function

    def checker(b, h, q, kv):
        return ((q // 3 + kv // 5) % 2 == 0) & (kv <= q)

    plan_mod.PLAN_CACHE.clear()
    limit = 64 << 10
    monkeypatch.setattr(plan_mod, "PLAN_CACHE_BYTES", limit)
    monkeypatch.setattr(plan_mod.PLAN_CACHE, "warned", False)
    with caplog.at_level(logging.WARNING, logger="ringattn"):
        masks = [from_function(checker) for _ in range(12)]
        plans = [make_plan(Zigzag(), m, 2, 0, 300, tile=(64, 64)) for m in masks]
        assert make_plan(Zigzag(), masks[-1], 2, 0, 300, tile=(64, 64)) is plans[-1]
    one = plan_mod.plan_bytes(plans[0])
    assert one > 0 and plan_mod.PLAN_CACHE.bytes() <= max(limit, one)
    assert len(plan_mod.PLAN_CACHE.plans) == max(1, limit // one)
    warned = [r for r in caplog.records if "digest of a cached one" in r.getMessage()]
    assert len(warned) == 1
    plan_mod.PLAN_CACHE.clear()
