"""Bad input raises the same clear error on every rank before the first ring send: never a hang.

Each row of the table breaks the input on all ranks or on one rank only; every rank must
raise the expected exception class with the expected words, and a correct call right after
it must still work (no stray message was left in flight).
"""

import pytest
import torch
import torch.distributed as dist

import ringattn as ra

WORLD = 3
S = 12  # local length 4 with contiguous/striped, 4 with zigzag (2W = 6 -> padded 12)


def _good():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 4, 4, 8, generator=g)
    k = torch.randn(1, 4, 2, 8, generator=g)
    return dict(q=q, k=k, v=k.clone(), causal=True, layout="zigzag", seqlen=S)


def _dtensor(x):
    """x as a DTensor sharded on the sequence dim over the world (what FSDP/TP users hold)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    return DTensor.from_local(x, mesh, [Shard(1)], run_check=False)


def _tagged(x, layout):
    """x as ``ringattn.shard`` returns a shard made with ``layout`` (same local length)."""
    g = torch.Generator().manual_seed(1)
    full = torch.randn(x.shape[0], S, *x.shape[2:], generator=g)
    return ra.shard(full, layout=layout, seqlen=S)


def _everywhere(edit):
    return lambda a, rank: edit(a)


def _on_rank(r, edit):
    return lambda a, rank: edit(a) if rank == r else None


def _set(**kw):
    return lambda a: a.update(kw)


ROWS = [  # (id, edit(args, rank), exception (None: none), words)
    ("q-3d", _everywhere(lambda a: a.update(q=a["q"][0])), ValueError, "q must be 4-D"),
    ("heads-not-multiple", _everywhere(lambda a: a.update(k=a["k"][:, :, :1].expand(1, 4, 3, 8).contiguous(), v=a["v"][:, :, :1].expand(1, 4, 3, 8).contiguous())),
     ValueError, "ranks 0, 1, 2: q has 4 heads, not a multiple of k's 3 heads"),
    ("heads-not-multiple-rank1-only", _on_rank(1, lambda a: a.update(k=torch.zeros(1, 4, 3, 8), v=torch.zeros(1, 4, 3, 8))),
     ValueError, "rank 1: q has 4 heads, not a multiple of k's 3 heads"),
    ("dtype-mismatch", _everywhere(lambda a: a.update(k=a["k"].bfloat16())), TypeError, "share a dtype"),
    ("int-dtype", _everywhere(lambda a: a.update(q=a["q"].long())), TypeError, "torch.int64"),
    ("not-a-tensor-rank0", _on_rank(0, _set(q=[1, 2, 3])), TypeError, "rank 0: q must be a torch.Tensor"),
    ("unknown-layout", _everywhere(_set(layout="spiral")), ValueError, "unknown layout 'spiral'"),
    ("bad-window", _everywhere(_set(window_size=(-2, 0))), ValueError, "window_size"),
    ("window-not-pair", _everywhere(_set(window_size=5)), ValueError, "window_size"),
    ("seqlen-inconsistent", _everywhere(_set(seqlen=40)), ValueError, "seqlen=40"),
    ("seqlen-zero", _everywhere(_set(seqlen=0)), ValueError, "seqlen must be an int >= 1"),
    ("bad-scale", _everywhere(_set(softmax_scale=-1.0)), ValueError, "softmax_scale"),
    ("causal-not-bool", _everywhere(_set(causal="yes")), TypeError, "causal must be a bool"),
    ("backward-overlap-unknown-rank2", _on_rank(2, _set(backward_overlap="some")), ValueError,
     "rank 2: backward_overlap must be one of ['all', 'kv', 'none'], got 'some'"),
    ("unknown-kernel", _everywhere(_set(kernel="flash9")), ValueError, "unknown kernel 'flash9'"),
    ("kv-shape-mismatch", _everywhere(lambda a: a.update(v=a["v"][:, :, :1].contiguous())), ValueError, "same [B, S_local, Hkv]"),
    ("value-dim-differs-by-rank", _on_rank(1, lambda a: a.update(v=a["v"][..., :4].contiguous())), ValueError, "value_head_dim"),
    ("softcap-negative", _everywhere(_set(softcap=-1.0)), ValueError, "softcap"),
    ("softcap-on-one-rank", _on_rank(0, _set(softcap=5.0)), ValueError, "softcap"),
    ("sinks-wrong-shape", _everywhere(lambda a: a.update(sinks=torch.zeros(3))), ValueError, "sinks must have shape"),
    ("sinks-on-one-rank", _on_rank(2, lambda a: a.update(sinks=torch.zeros(4))), ValueError, "sinks"),
    ("sinks-not-tensor", _everywhere(_set(sinks=[0.0] * 4)), TypeError, "sinks must be a float tensor"),
    ("alibi-wrong-shape", _everywhere(_set(alibi_slopes=[0.5] * 3)), ValueError, "alibi_slopes must have shape"),
    ("alibi-on-one-rank", _on_rank(1, _set(alibi_slopes=[0.5] * 4)), ValueError, "alibi_slopes"),
    # flash-attn's dropout_p: 0 accepted (once a TypeError), anything else refused everywhere
    ("dropout-zero", _everywhere(_set(dropout_p=0.0)), None, ""),
    ("dropout-int-zero", _everywhere(_set(dropout_p=0)), None, ""),
    ("dropout", _everywhere(_set(dropout_p=0.1)), ValueError,
     "ranks 0, 1, 2: dropout_p=0.1: ringattn computes exact attention, without dropout "
     "(dropout_p must be 0)"),
    ("dropout-on-rank1-only", _on_rank(1, _set(dropout_p=0.5)), ValueError,
     "rank 1: dropout_p=0.5"),
    ("dropout-true", _everywhere(_set(dropout_p=True)), ValueError, "dropout_p=True"),
    ("dtensor-input", _everywhere(lambda a: a.update(q=_dtensor(a["q"]))), TypeError, ".to_local()"),
    ("layout-differs-from-shard", _everywhere(lambda a: a.update(q=_tagged(a["q"], "striped"))), ValueError, "sharded with layout 'striped' but is attended with layout 'zigzag'"),
    ("batch-differs-on-rank2", _on_rank(2, lambda a: a.update(q=a["q"].repeat(2, 1, 1, 1), k=a["k"].repeat(2, 1, 1, 1), v=a["v"].repeat(2, 1, 1, 1))),
     ValueError, "ranks disagree on batch: ranks 0, 1 have 1, rank 2 has 2"),
    ("causal-differs", _on_rank(1, _set(causal=False)), ValueError, "ranks disagree on causal"),
    ("layout-differs", _on_rank(0, _set(layout="striped")), ValueError, "ranks disagree on layout"),
    ("grad-on-one-rank", _on_rank(2, lambda a: a["q"].requires_grad_()), ValueError, "ranks disagree on needs_grad"),
    # masks and packed documents
    ("mask-raises", _everywhere(_set(mask=ra.masks.from_function(lambda b, h, q, kv: 1 / 0))),
     ValueError, "failed on global position tensors: ZeroDivisionError"),
    ("mask-raises-rank1-only", _on_rank(1, _set(mask=ra.masks.from_function(lambda b, h, q, kv: q.foo))),
     ValueError, "rank 1: mask (from_function"),
    ("mask-not-bool", _everywhere(_set(mask=ra.masks.from_function(lambda b, h, q, kv: q - kv))),
     ValueError, "must return a bool tensor, got torch.int64"),
    ("mask-wrong-shape", _everywhere(_set(causal=False, mask=ra.masks.from_function(lambda b, h, q, kv: torch.ones(3, 3, dtype=torch.bool)))),
     ValueError, "does not broadcast to [B, H, Sq, Sk]"),
    ("mask-not-a-mask", _everywhere(_set(mask=lambda b, h, q, kv: q >= kv)), TypeError,
     "mask must be a ringattn.masks.Mask"),
    ("mask-reads-rank-local-data", lambda a, rank: a.update(causal=False, mask=ra.masks.from_function(lambda b, h, q, kv: kv <= q + 3 * rank)),
     ValueError, "ranks disagree on mask"),
    ("cu-not-increasing", _everywhere(_set(cu_seqlens=[0, 6, 4, 12])), ValueError, "strictly increasing"),
    ("cu-repeated-entry", _everywhere(_set(cu_seqlens=[0, 6, 6, 12])), ValueError, "strictly increasing"),
    ("cu-not-from-0", _everywhere(_set(cu_seqlens=[2, 12])), ValueError, "must start at 0"),
    ("cu-not-ending-at-S", _everywhere(_set(cu_seqlens=[0, 5, 10])), ValueError, "must end at S=12"),
    ("cu-float", _everywhere(_set(cu_seqlens=torch.tensor([0.0, 12.0]))), TypeError, "integer tensor"),
    ("cu-differs-on-rank2", _on_rank(2, _set(cu_seqlens=[0, 6, 12])), ValueError,
     "ranks disagree on cu_seqlens: ranks 0, 1 pass none, rank 2 passes [0, 6, 12]"),
    ("cu-offset-differs-on-rank1",
     lambda a, rank: a.update(cu_seqlens=[0, 5 if rank == 1 else 6, 9, 12]), ValueError,
     "ranks disagree on cu_seqlens: at offset 1 ranks 0, 2 pass 6, rank 1 passes 5"),
    # one rank's q in SDPA's [B, H, S, D] layout whose H (4) equals S_local: heads differ
    ("sdpa-layout-on-rank1", _on_rank(1, lambda a: a.update(q=a["q"][:, :, :2])), ValueError,
     "ranks disagree on heads: ranks 0, 2 have 4, rank 1 has 2 (a tensor in SDPA's "
     "[B, H, S, D] layout"),
    # a split whose pieces differ in length (not ringattn.shard's)
    ("local-len-differs", lambda a, rank: a.update(
        **({n: a[n][:, :2] for n in "qkv"} if rank == 0 else {}), seqlen=None),
     ValueError, "rank 0: q carries no shard tag"),
    # untagged shards (a projection or a clone of a shard) without seqlen=: S is unknown
    ("seqlen-not-given", _everywhere(lambda a: a.update(**{n: a[n][:, :3] for n in "qkv"},
                                                        seqlen=None)),
     ValueError, "and no seqlen= was given: the global S cannot be read from S_local=3"),
    ("untagged-clone-without-seqlen", _everywhere(lambda a: a.update(
        **{n: a[n].clone() for n in "qkv"}, seqlen=None)),
     ValueError, "Pass seqlen=, the global S (12 when the shards are unpadded)"),
    # a document mask whose offsets do not end at S (its last tokens in no document)
    ("document-mask-short", _everywhere(_set(mask=ra.masks.document([0, 5, 10]))), ValueError,
     "mask document([0, 5, 10]) describes a sequence of 10 tokens but S=12"),
    ("document-mask-long", _everywhere(_set(mask=ra.masks.document([0, 5, 14]))), ValueError,
     "describes a sequence of 14 tokens but S=12"),
    ("key-mask-other-width", _everywhere(_set(mask=ra.masks.key_mask(
        torch.ones(2, 10, dtype=torch.bool)))), ValueError,
     "key_mask of [B, S]=[2, 10] describes 10 keys per row but S=12"),
]


def _rows(strategy):
    """The rows that apply to a strategy (Ulysses has no backward_overlap argument)."""
    return [r for r in ROWS if strategy == "ring_attention" or "backward-overlap" not in r[0]]


def raise_table(strategy="ring_attention"):
    """Rank side: apply each row's edit, call ``ra.<strategy>``, report what was raised."""
    rank = dist.get_rank()
    seen = {}
    for name, edit, _, _ in _rows(strategy):
        args = _good()
        edit(args, rank)
        q, k, v = args.pop("q"), args.pop("k"), args.pop("v")
        try:
            getattr(ra, strategy)(q, k, v, **args)
            seen[name] = ("no error", "")
        except (TypeError, ValueError) as exc:
            seen[name] = (type(exc).__name__, str(exc))
        # the ring still works right after a rejected call
        good = _good()
        out = ra.ring_attention(good.pop("q"), good.pop("k"), good.pop("v"), **good)
        if not torch.isfinite(out).all():
            seen[name] = ("non-finite output after the error", "")
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy", ["ring_attention", "ulysses_attention",
                                      "allgather_attention"])
def test_bad_input_raises_on_every_rank(clusters, strategy):
    per_rank = clusters(WORLD).run(raise_table, strategy, timeout=90)
    bad = []
    for rank, seen in enumerate(per_rank):
        for name, _, exc, words in _rows(strategy):
            kind, msg = seen[name]
            want = "no error" if exc is None else exc.__name__
            if kind != want or words not in msg:
                bad.append(f"rank {rank} {name}: got {kind}: {msg!r}; want {want} with {words!r}")
    assert not bad, "\n".join(bad)


def shard_errors():
    """Rank side: shard/unshard reject bad input on every rank too."""
    rank = dist.get_rank()
    seen = []
    x = torch.randn(2, 10, 3)
    for call in (
        lambda: ra.shard(x, dim=5),
        lambda: ra.shard(x, seqlen=11),
        lambda: ra.unshard(torch.randn(2, 4 if rank else 5, 3), seqlen=12),
        lambda: ra.shard(x, layout="diagonal"),
        lambda: ra.shard("tokens"),
    ):
        try:
            call()
            seen.append("no error")
        except (TypeError, ValueError) as exc:
            seen.append(f"{type(exc).__name__}: {exc}")
    return seen


@pytest.mark.timeout(60)
def test_shard_errors(clusters):
    for rank, seen in enumerate(clusters(WORLD).run(shard_errors, timeout=45)):
        assert "dim=5 is out of range" in seen[0], (rank, seen[0])
        assert "seqlen=11" in seen[1], (rank, seen[1])
        assert "rank 0: seqlen=12" in seen[2] and seen[2].startswith("ValueError"), (rank, seen[2])
        assert "unknown layout 'diagonal'" in seen[3], (rank, seen[3])
        assert seen[4].startswith("TypeError") and "torch.Tensor" in seen[4], (rank, seen[4])


def sleep_on_rank_one(seconds):
    if dist.get_rank() == 1:
        import time
        time.sleep(seconds)
    return dist.get_rank()


@pytest.mark.timeout(60)
def test_a_hung_rank_is_named(clusters):
    """The harness itself: a rank that does not answer fails the test by name, quickly."""
    with pytest.raises(TimeoutError, match=r"rank\(s\) \[1\] of 2 did not answer"):
        clusters(2).run(sleep_on_rank_one, 30, timeout=3)
    assert clusters(2).run(sleep_on_rank_one, 0) == [0, 1]  # a fresh cluster replaced it


def _raising_mask(b, h, q, kv):
    raise KeyError("the user's own bug")


def messages_and_members():
    """Rank side: (the cause chained to a failing mask's error, its message; what a rank
    outside a 2-rank group gets; the members' result)."""
    good = _good()
    q, k, v = good.pop("q"), good.pop("k"), good.pop("v")
    try:
        ra.ring_attention(q, k, v, mask=ra.masks.from_function(_raising_mask), **good)
        cause, msg = None, "no error"
    except ValueError as exc:
        cause, msg = exc.__cause__, str(exc)
        while cause is not None and not isinstance(cause, KeyError):
            cause = cause.__cause__
    pair = dist.new_group(ranks=[0, 1])
    try:
        x = torch.randn(1, 6, 2, 8, generator=torch.Generator().manual_seed(0))
        out = ra.ring_attention(x, x, x, group=pair, seqlen=12)
        member = ("ok", tuple(out.shape))
    except (TypeError, ValueError) as exc:
        member = (type(exc).__name__, str(exc))
    return repr(cause), msg, member


@pytest.mark.timeout(60)
def test_messages_chain_causes_and_name_non_members(clusters):
    """A mask that raises: every rank's ValueError names it once for all ranks ("ranks 0,
    1, 2: ...") and chains the user's own exception on each rank. A rank outside the group
    it passes is told so (not "got int")."""
    for rank, (cause, msg, member) in enumerate(clusters(WORLD).run(messages_and_members, timeout=45)):
        assert cause == "KeyError(\"the user's own bug\")", (rank, cause)
        assert msg.startswith("ranks 0, 1, 2: mask ") and msg.count("the user's own bug") == 1, (rank, msg)
        if rank < 2:
            assert member == ("ok", (1, 6, 2, 8)), (rank, member)
        else:
            assert member[0] == "ValueError" and "not a member of the group" in member[1], member
