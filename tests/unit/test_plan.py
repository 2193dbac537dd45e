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
