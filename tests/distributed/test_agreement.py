"""What the agreement before every call compares beyond shapes and options: masks on every
position a rank's plan evaluates, and the ranks' call counts.

A mask that differs on one rank at one position (q=100, kv=50 of S=300) slipped past the old
probe (``masks.fingerprint`` samples about 80 positions; the test asserts it still does) and
gave a wrong row. Now each rank digests the mask over its own region and the next rank's,
and the ranks compare: the call raises on every rank exactly when the odd rank's mask is
evaluated at that position by a rank, and is otherwise exact against float64 (the odd
rank never uses the position). Every strategy: ring, all-gather, Ulysses (W=3) and the
hybrid on a 2x2 mesh (W=4).
"""

import pytest
import torch
import torch.distributed as dist

import ringattn as ra
from ringattn import comm
from ringattn.layouts import get_layout, local_positions
from ringattn.masks import fingerprint
from reference import attention
from test_hybrid import mesh

S, Q, KV = 300, 100, 50  # the one position where the odd rank's mask differs


def _mask(odd: bool):
    """Causal, except that the odd rank also hides key KV from query Q."""
    def fn(b, h, q, kv):
        ok = kv <= q
        return ok & ~((q == Q) & (kv == KV)) if odd else ok
    return ra.masks.from_function(fn)


def _rows(strategy: str, j: int, world: int) -> set:
    """The query positions group rank j's plan evaluates (all of its heads)."""
    lay = get_layout("zigzag")
    if strategy == "ulysses":
        return set(range(S))
    if strategy == "hybrid":  # 2x2: ring rank j // 2 holds the shards of flat ranks 2r, 2r+1
        r = j // 2
        return {int(p) for u in (0, 1) for p in local_positions(lay, 2 * r + u, world, S)}
    return {int(p) for p in local_positions(lay, j, world, S)}


def one_position_masks(strategy):
    """Rank side: for each odd rank d, (raised?, message or the worst error vs float64)."""
    rank, world = dist.get_rank(), dist.get_world_size()
    group = mesh(2, 2) if strategy == "hybrid" else None
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(1, S, 2, 8, generator=g, dtype=torch.float64) for _ in range(3))
    ok = torch.arange(S)[None, :] <= torch.arange(S)[:, None]
    ref = attention(q, k, v, ok)[0]
    dout = torch.randn(ref.shape, generator=g, dtype=torch.float64)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    (attention(qr, kr, vr, ok)[0] * dout).sum().backward()
    ref_grads = (qr.grad, kr.grad, vr.grad)
    seen = {"probe_misses": fingerprint(_mask(True), S, 1, 2) == fingerprint(_mask(False), S, 1, 2)}
    for d in range(world):
        local = [ra.shard(t.float(), group=group, seqlen=S).requires_grad_() for t in (q, k, v)]
        try:
            out = ra.attention(*local, strategy=strategy, group=group, seqlen=S,
                               mask=_mask(rank == d))
        except ValueError as exc:
            seen[d] = ("raised", str(exc))
            continue
        (out * ra.shard(dout.float(), group=group, seqlen=S)).sum().backward()
        want = [ra.shard(t, group=group, seqlen=S) for t in (ref, *ref_grads)]
        got = [out.detach(), *(t.grad for t in local)]
        err = max(float((a.double() - b).abs().max() / b.abs().max()) for a, b in zip(got, want))
        seen[d] = ("exact", err)
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,world", [("ring", 3), ("allgather", 3), ("ulysses", 3),
                                            ("hybrid", 4)])
def test_a_mask_differing_at_one_position_is_reported(clusters, strategy, world):
    per_rank = clusters(world).run(one_position_masks, strategy, timeout=100)
    raised_somewhere = False
    for rank, seen in enumerate(per_rank):
        assert seen["probe_misses"], "the position must be one the old probe did not sample"
        for d in range(world):
            kind, what = seen[d]
            used = Q in _rows(strategy, d, world) | _rows(strategy, (d + 1) % world, world)
            if used:
                assert kind == "raised", (rank, d, seen[d])
                assert "disagree on the mask" in what and "rank-local data" in what, what
                raised_somewhere = True
            else:  # the odd rank never evaluates row Q: the answer is the common mask's
                assert kind == "exact" and what < 1e-5, (rank, d, seen[d])
    assert raised_somewhere
    if strategy == "ulysses":  # every rank evaluates every row for its heads
        assert all(per_rank[0][d][0] == "raised" for d in range(world))


def value_masks_and_call_counts():
    """Rank side: (a key_mask that differs at one key on rank 1: message; a rank whose
    call count ran ahead: message; a good call right after: ok)."""
    rank = dist.get_rank()
    x = ra.shard(torch.randn(1, S, 2, 8, generator=torch.Generator().manual_seed(0)), seqlen=S)
    real = torch.ones(1, S, dtype=torch.bool)
    if rank == 1:
        real[0, KV] = False
    out = []
    for edit in ("key_mask", "count"):
        name = comm.control_group(dist.group.WORLD).group_name
        if edit == "count" and rank == 1:
            comm._CALLS[name] += 1  # as if rank 1 had made a call the others did not make
        try:
            mask = ra.masks.key_mask(real) if edit == "key_mask" else None
            ra.ring_attention(x, x, x, causal=True, seqlen=S, mask=mask)
            out.append("no error")
        except ValueError as exc:
            out.append(str(exc))
        if edit == "count" and rank == 1:
            comm._CALLS[name] -= 1  # back in step
    y = ra.ring_attention(x, x, x, causal=True, seqlen=S)
    out.append(bool(torch.isfinite(y).all()))
    return out


@pytest.mark.timeout(60)
def test_value_masks_and_call_counts_are_agreed(clusters):
    for rank, (masked, counted, after) in enumerate(clusters(3).run(value_masks_and_call_counts,
                                                                    timeout=45)):
        assert "ranks disagree on mask: ranks 0, 2 have a mask with digest" in masked, masked
        assert ("ringattn calls out of step on this group: ranks 0, 2 are at call" in counted
                and "rank 1 is at call" in counted), counted
        assert after is True
