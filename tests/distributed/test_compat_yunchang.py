"""``ringattn.compat.yunchang`` run as yunchang 0.6.4's README and tests use it (the same
inputs on every rank, ``set_seq_parallel_pg``, the local split of ``EXTRACT_FUNC_DICT`` or
``chunk``, the module's forward, ``backward`` of the local output gradient), checked on
every rank against the float64 single-device oracle; and its splits and ``SeqAllToAll4D``
against yunchang itself (installed with ``--no-deps``: it imports without flash-attn, and
its splits and all-to-all run on CPU; its attention layers need flash-attn or CUDA).

Tolerance: fp32 inputs within 1e-5 relative of float64 (the contract; these small,
well-conditioned inputs measure about 3e-7). The splits and the all-to-all move values
without arithmetic, so they must equal yunchang's exactly.
"""

import pytest
import torch
import torch.distributed as dist

import ringattn as ra
import ringattn.compat.yunchang as yc
from reference import FP32_TOL, reference, rel_err, visible

H, D = 4, 8


def _inputs(seqlen, kv_heads, batch=1, seed=0):
    """Global q, k, v, dout, the same on every rank (yunchang's tests broadcast them)."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(batch, seqlen, H, D, generator=g)
    k, v = (torch.randn(batch, seqlen, kv_heads, D, generator=g) for _ in range(2))
    return q, k, v, torch.randn(batch, seqlen, H, D, generator=g)


def _errors(split, got, ref):
    """Relative error of each local tensor against the same split of the reference."""
    return {name: rel_err(x, split(r)) for name, x, r in zip(("out", "dq", "dk", "dv"), got, ref)}


def _run(module, split, seqlen, kv_heads, causal, window=(-1, -1), seed=0, extra=None):
    """yunchang's documented call: split, forward with its keywords, backward (``extra``:
    ringattn's own keywords)."""
    q, k, v, dout = _inputs(seqlen, kv_heads, seed=seed)
    local = [split(t).detach().clone().requires_grad_() for t in (q, k, v)]
    out = module(*local, dropout_p=0.0, causal=causal, window_size=window, softcap=0.0,
                 alibi_slopes=None, deterministic=False, return_attn_probs=True,
                 **(extra or {}))
    out.backward(split(dout))
    ref_out, _, dq, dk, dv = reference(q, k, v, dout, visible(seqlen, causal, window))
    return _errors(split, [out] + [t.grad for t in local], [ref_out, dq, dk, dv])


_SETUP = {}


def _setup(ud, rd, low):
    """Both libraries' groups for (U, R, ulysses_low), made once per process: ours become
    current, yunchang's are kept to compare its splits with ours."""
    import yunchang
    from yunchang.globals import PROCESS_GROUP as theirs

    rank, world = dist.get_rank(), dist.get_world_size()
    if (ud, rd, low) not in _SETUP:
        yunchang.set_seq_parallel_pg(ud, rd, rank, world, use_ulysses_low=low)
        yc.set_seq_parallel_pg(ud, rd, rank, world, use_ulysses_low=low)
        _SETUP[ud, rd, low] = (vars(yc.PROCESS_GROUP).copy(), vars(theirs).copy())
    ours_state, their_state = _SETUP[ud, rd, low]
    vars(yc.PROCESS_GROUP).update(ours_state)
    vars(theirs).update(their_state)


def run_long_context(ud, rd, low, cases):
    """Rank side: for each (ring_impl_type, S, Hkv, causal, window): our split equals
    yunchang's, and LongContextAttention is exact; {case: errors}."""
    from yunchang import EXTRACT_FUNC_DICT as THEIRS

    _setup(ud, rd, low)
    rank, world = dist.get_rank(), dist.get_world_size()
    results = {}
    for impl, seqlen, kv_heads, causal, window in cases:
        def split(t, table=yc.EXTRACT_FUNC_DICT):
            return table[impl](t, rank, world_size=world, rd=rd, ud=ud)

        x = _inputs(seqlen, H)[0]
        same = torch.equal(split(x), split(x, THEIRS))
        attn = yc.LongContextAttention(ring_impl_type=impl, attn_type=yc.AttnType.FA)
        errs = _run(attn, split, seqlen, kv_heads, causal, window)
        results[f"{impl} S={seqlen} Hkv={kv_heads} causal={causal} window={window}"] = (
            same, errs)
    return results


def _check(per_rank):
    bad = []
    for rank, res in enumerate(per_rank):
        for case, (same, errs) in res.items():
            if not same:
                bad.append(f"rank {rank} {case}: the split differs from yunchang's")
            bad += [f"rank {rank} {case} {n}: rel {e:.2e} > {FP32_TOL:.0e}"
                    for n, e in errs.items() if not e <= FP32_TOL]
    assert not bad, "\n".join(bad)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("low", [True, False], ids=["ulysses_low", "ring_low"])
def test_long_context_2x2_exact(clusters, low):
    """U=2 x R=2 on 4 ranks, every ring_impl_type's split; GQA with one kv head (fewer
    than U: yunchang cannot split it); S not divisible by W with the basic split (the last
    rank short); a window. yunchang's own result is wrong for the basic and strip splits
    with use_ulysses_low=False and causal (its ring assumes contiguous ring shards):
    ringattn attends the same shards exactly."""
    cases = [(impl, 24, kv, causal, (-1, -1)) for impl in ("basic", "zigzag", "strip")
             for kv, causal in ((4, True), (1, False))]
    cases += [("basic", 23, 2, True, (-1, -1)), ("zigzag", 16, 2, False, (3, 1)),
              ("basic_pytorch", 21, 4, True, (5, 0))]
    _check(clusters(4).run(run_long_context, 2, 2, low, cases, timeout=100))


@pytest.mark.timeout(120)
@pytest.mark.parametrize("ud,rd", [(4, 1), (1, 4)])
def test_long_context_one_dimension(clusters, ud, rd):
    """Pure Ulysses (R=1) and pure ring (U=1) through LongContextAttention."""
    cases = [("zigzag", 24, 4, True, (-1, -1)), ("strip", 16, 2, True, (-1, -1)),
             ("basic", 22, 1, True, (-1, -1))]
    _check(clusters(4).run(run_long_context, ud, rd, True, cases, timeout=100))


def run_ulysses(cases):
    """Rank side: UlyssesAttention with yunchang's test split ``chunk(W)[rank]``."""
    rank, world = dist.get_rank(), dist.get_world_size()
    attn = yc.UlyssesAttention(None, attn_type=yc.AttnType.FA)
    results = {}
    for seqlen, kv_heads, causal, given in cases:
        def split(t):
            return t.chunk(world, dim=1)[rank]

        extra = {"seqlen": seqlen} if given else None
        results[f"S={seqlen} Hkv={kv_heads} causal={causal} seqlen given={given}"] = (
            True, _run(attn, split, seqlen, kv_heads, causal, extra=extra))
    return results


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_ulysses_exact(clusters, world):
    """W=2 and 3 (H=4 heads on 3 ranks, one kv head: yunchang needs both to divide W);
    S divisible and not (the last rank short), found by the ranks or given (``seqlen=``)."""
    cases = [(6 * world, 4, True, False), (6 * world + 1, 2, True, False),
             (5 * world - 1, 1, False, False), (6 * world + 1, 2, True, True)]
    _check(clusters(world).run(run_ulysses, cases, timeout=100))


def run_all_to_all(ud):
    """Rank side: our SeqAllToAll4D against yunchang's, forward and backward, over the
    world and over the Ulysses groups of U ranks (use_ulysses_low=True); exact equality."""
    from yunchang.comm.all_to_all import SeqAllToAll4D as Theirs

    _setup(ud, dist.get_world_size() // ud, True)
    ok = []
    g = torch.Generator().manual_seed(dist.get_rank())
    for group in (None, yc.PROCESS_GROUP.ULYSSES_PG):
        p = dist.get_world_size(group)
        for scatter, gather, shape in ((2, 1, (2, 3, 2 * p, 5)), (1, 2, (2, 3 * p, 2, 5))):
            x = torch.randn(*shape, generator=g)
            dy = torch.randn_like(Theirs.apply(group, x, scatter, gather, False))
            got = []
            for fn in (yc.SeqAllToAll4D, Theirs):
                xi = x.clone().requires_grad_()
                y = fn.apply(group, xi, scatter, gather, False)
                y.backward(dy)
                got.append((y.detach(), xi.grad))
            ok.append(torch.equal(got[0][0], got[1][0]) and torch.equal(got[0][1], got[1][1]))
    return ok


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,ud", [(2, 2), (4, 2)])
def test_seq_all_to_all_equals_yunchang(clusters, world, ud):
    per_rank = clusters(world).run(run_all_to_all, ud, timeout=100)
    assert all(all(ok) for ok in per_rank), per_rank


def run_refusals():
    """Rank side: the message of each refused call (every rank must raise)."""
    _setup(2, 2, True)
    rank, world = dist.get_rank(), dist.get_world_size()
    q, k, v, _ = _inputs(24, H)
    split = [yc.EXTRACT_FUNC_DICT["zigzag"](t, rank, world, rd=2, ud=2) for t in (q, k, v)]
    attn = yc.LongContextAttention(ring_impl_type="zigzag")
    messages = []
    calls = [
        lambda: yc.LongContextAttention(ring_impl_type="ring"),
        lambda: yc.LongContextAttention(attn_processor=torch.nn.Identity()),
        lambda: yc.UlyssesAttention(None, scatter_idx=1, gather_idx=2),
        lambda: attn(*split, dropout_p=0.1),
        # only rank 0 asks for dropout: every rank refuses, none waits for it
        lambda: attn(*split, dropout_p=0.1 if rank == 0 else 0.0),
        # one rank's shard one token short: not the zigzag split of any S
        lambda: attn(*[t[:, 1:] if rank == 3 else t for t in split]),
        lambda: yc.EXTRACT_FUNC_DICT["zigzag"](q[:, :22], rank, world, rd=2, ud=2),
        # the same, with seqlen given (no length exchange: the attention's agreement says it)
        lambda: attn(*split, dropout_p=0.1 if rank == 0 else 0.0, seqlen=24),
        # shards of one split given to a module of another: placements differ
        lambda: yc.LongContextAttention(ring_impl_type="basic")(*split),
        lambda: yc.LongContextAttention(ring_impl_type="basic")(*split, seqlen=24),
        lambda: yc.LongContextAttention(ring_impl_type="strip")(*split),
        # ringattn's own zigzag/striped shards: the same names, other placements on 2 x 2
        lambda: attn(*(ra.shard(t, layout="zigzag") for t in (q, k, v))),
        lambda: yc.LongContextAttention(ring_impl_type="strip")(
            *(ra.shard(t, layout="striped") for t in (q, k, v)), seqlen=24),
    ]
    for call in calls:
        try:
            call()
        except ValueError as exc:
            messages.append(str(exc))
        else:
            messages.append(None)
    return messages


@pytest.mark.timeout(120)
def test_refusals_on_every_rank(clusters):
    per_rank = clusters(4).run(run_refusals, timeout=100)
    wanted = ["unknown ring_impl_type 'ring'", "attn_processor=Identity", "scatter_idx=2",
              "dropout_p=0.1", "rank 0: dropout_p=0.1", "not the 'zigzag' split",
              "must be a multiple of 4", "rank 0: dropout_p=0.1",
              "sharded with layout 'zigzag' but is attended by this module with layout "
              "'contiguous'", "sharded with layout 'zigzag' but is attended by this module with layout "
              "'contiguous'",
              "layout 'zigzag' but is attended by this module with layout 'striped'",
              "the same name, another placement", "the same name, another placement"]
    for rank, messages in enumerate(per_rank):
        assert len(messages) == len(wanted)
        for i, (msg, part) in enumerate(zip(messages, wanted)):
            assert msg is not None and part in msg, f"rank {rank} call {i}: {msg!r}"
