"""A shard's tag is honoured or refused wherever a shard is taken (``unshard`` as well as the
attention), placements are compared rather than names, calls of different kinds meet in the
agreement and say so, and a meta tensor is refused by name: on every rank, never a hang."""

import pytest
import torch
import torch.distributed as dist

import ringattn as ra


def _message(fn):
    try:
        fn()
    except (TypeError, ValueError) as exc:
        return type(exc).__name__, str(exc)
    return None


def unshard_cases():
    """Rank side: (exact round trips, messages of the refused unshards)."""
    world = dist.get_world_size()
    seqlen = 4 * world + 3  # padded in every layout
    x = torch.randn(2, seqlen, 3, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    exact = []
    for layout in ("contiguous", "zigzag", "striped"):
        local = ra.shard(x, layout=layout)
        # the same layout: exact; seqlen left out: the shard's own S, not W * L
        exact.append(torch.equal(ra.unshard(local, layout=layout), x))
        exact.append(torch.equal(ra.unshard(local.clone(), layout=layout, seqlen=seqlen), x))
    cu = [0, 3, 7, seqlen]
    docs = ra.shard(x, layout="zigzag", cu_seqlens=cu)
    exact.append(torch.equal(ra.unshard(docs, layout="zigzag", cu_seqlens=cu), x))
    z = ra.shard(x, layout="zigzag")
    sub = dist.new_group(list(range(world)))  # the same ranks, another group object: fine
    exact.append(torch.equal(ra.unshard(z, group=sub, layout="zigzag"), x))
    refused = [
        _message(lambda: ra.unshard(z, layout="striped")),
        _message(lambda: ra.unshard(z, layout="contiguous", seqlen=seqlen)),
        _message(lambda: ra.unshard(z, layout="zigzag", seqlen=seqlen + 1)),
        _message(lambda: ra.unshard(docs, layout="zigzag")),  # its documents left out
        _message(lambda: ra.unshard(z, layout="zigzag", cu_seqlens=cu)),
        _message(lambda: ra.unshard(ra.shard(x.transpose(1, 2), dim=2), dim=1, seqlen=3)),
        # a meta tensor (a model built on the meta device): refused by name
        _message(lambda: ra.shard(torch.empty(2, seqlen, 3, device="meta"))),
    ]
    if world > 2:  # shards made over other ranks than the group's
        pair = dist.new_group([0, 1])
        if dist.get_rank() < 2:
            zp = ra.shard(x, group=pair)
        dist.barrier()
        refused.append(_message(lambda: ra.unshard(zp if dist.get_rank() < 2 else z)))
    return exact, refused


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_unshard_honours_or_refuses_the_tag(clusters, world):
    per_rank = clusters(world).run(unshard_cases, timeout=150)
    wanted = [
        "sharded with layout 'zigzag' but is gathered by unshard with layout 'striped'",
        "sharded with layout 'zigzag' but is gathered by unshard with layout 'contiguous'",
        f"sharded with seqlen={4 * world + 3} but is gathered by unshard with "
        f"seqlen={4 * world + 4}",
        "sharded with cu_seqlens (digest",
        "sharded with no cu_seqlens but is gathered by unshard with cu_seqlens",
        "sharded by ringattn.shard along dim 2 of a 3-D tensor, not dim 1",
        "meta device",
        "sharded by ringattn.shard over the ranks [0, 1] but is gathered over the group of ranks",
    ]
    for rank, (exact, refused) in enumerate(per_rank):
        assert all(exact), (rank, exact)
        assert len(refused) == len(wanted) - (world == 2)
        for got, part in zip(refused, wanted):
            assert got is not None and got[0] == "ValueError" and part in got[1], (rank, got, part)


def kinds_out_of_step():
    """Rank side: rank 0 makes one extra call of another kind while the others go on; every
    rank must raise, and the group must still work after."""
    rank, world = dist.get_rank(), dist.get_world_size()
    x = torch.randn(1, 4 * world, 2, 8, generator=torch.Generator().manual_seed(1))
    local = ra.shard(x)
    messages = []
    # rank 0: an attention call; the others: unshard
    messages.append(_message(
        (lambda: ra.ring_attention(local, local, local, causal=True)) if rank == 0
        else (lambda: ra.unshard(local))))
    # rank 0: shard; the others: unshard (the same fields, another call)
    messages.append(_message((lambda: ra.shard(x)) if rank == 0 else (lambda: ra.unshard(local))))
    # rank 0: a ulysses call (strategy differs, same kind of agreement); others: ring
    messages.append(_message(
        (lambda: ra.ulysses_attention(local, local, local, causal=True)) if rank == 0
        else (lambda: ra.ring_attention(local, local, local, causal=True))))
    # rank 0: an Eagle3 TTT step over two key sets; the others: a plain attention call
    messages.append(_message(
        (lambda: ra.eagle3.ttt_attention(local, [local, local], [local, local])) if rank == 0
        else (lambda: ra.ring_attention(local, local, local, causal=True))))
    # then the same calls on every rank work again, exactly
    out = ra.unshard(ra.ring_attention(local, local, local, causal=True))
    ref = torch.nn.functional.scaled_dot_product_attention(
        *(x.transpose(1, 2).double(),) * 3, is_causal=True).transpose(1, 2)
    return messages, float((out.double() - ref).norm() / ref.norm())


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_calls_of_different_kinds_meet(clusters, world):
    per_rank = clusters(world).run(kinds_out_of_step, timeout=150)
    for rank, (messages, err) in enumerate(per_rank):
        first, second, third, fourth = messages
        assert first[0] == "ValueError" and "out of step" in first[1], (rank, first)
        assert "rank 0 is in an attention call" in first[1] and "in unshard" in first[1], first
        assert "rank 0 is in shard" in second[1] and "in unshard" in second[1], second
        assert third[0] == "ValueError" and "disagree on strategy" in third[1], (rank, third)
        assert ("rank 0 is in an attention call with ttt_key_sets" in fourth[1]
                and "in an attention call (" in fourth[1]), (rank, fourth)
        assert err < 1e-5, (rank, err)


def batch_outputs():
    """Rank side: shard_batch's outputs are shards: unshard honours them (S padded, left
    padding, documents) and refuses another layout."""
    world = dist.get_world_size()
    s = 3 * world + 1
    ids = torch.arange(2 * s).view(2, s) % 11 + 1
    keep = torch.ones(2, s, dtype=torch.long)
    keep[1, :2] = 0
    local = ra.shard_batch({"input_ids": ids, "labels": ids, "attention_mask": keep},
                           layout="striped")
    back = ra.unshard(local["position_ids"], layout="striped", dim=1)
    labels = ra.unshard(local["labels"], layout="striped", dim=1)
    docs = ra.shard_batch({"input_ids": ids[:1], "cu_seqlens": [0, 2, s]}, layout="zigzag")
    in_doc = ra.unshard(docs["position_ids"], layout="zigzag", cu_seqlens=[0, 2, s])
    refused = _message(lambda: ra.unshard(local["input_ids"], layout="zigzag", dim=1))
    return (torch.equal(back, torch.arange(s).expand(2, s)), labels.shape == (2, s),
            in_doc.tolist() == [[0, 1, *range(s - 2)]], refused)


@pytest.mark.timeout(120)
def test_shard_batch_outputs_are_shards(clusters):
    for rank, (*oks, refused) in enumerate(clusters(3).run(batch_outputs, timeout=100)):
        assert all(oks), (rank, oks)
        assert refused is not None and "sharded with layout 'striped'" in refused[1], refused


def outputs_are_shards():
    """Rank side: each strategy's out and lse carry q's tag (unshard needs no seqlen; another
    layout is refused); under autocast a cast shard is still checked."""
    world = dist.get_world_size()
    s = 4 * world + 1
    x = torch.randn(1, s, 2, 8, generator=torch.Generator().manual_seed(2))
    causal = torch.ones(s, s, dtype=torch.bool).tril()
    from reference import attention, rel_err

    ref_out, ref_lse = attention(*(x.double(),) * 3, causal)
    errors, refused = {}, {}
    for strategy in ("ring", "ulysses", "allgather"):
        q = ra.shard(x)
        out, lse = getattr(ra, f"{strategy}_attention")(q, q, q, causal=True, return_lse=True)
        errors[strategy] = (rel_err(ra.unshard(out), ref_out), rel_err(ra.unshard(lse, dim=2), ref_lse))
        refused[strategy] = _message(lambda: ra.unshard(out, layout="striped"))
        with torch.autocast("cpu", dtype=torch.bfloat16):
            refused[strategy + "-autocast"] = _message(
                lambda: getattr(ra, f"{strategy}_attention")(q, q, q, layout="striped"))
    return errors, refused


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_outputs_are_shards(clusters, world):
    for rank, (errors, refused) in enumerate(clusters(world).run(outputs_are_shards, timeout=100)):
        for strategy, (err_out, err_lse) in errors.items():
            assert err_out < 1e-5 and err_lse < 1e-5, (rank, strategy, err_out, err_lse)
        for name, got in refused.items():
            assert got is not None and "sharded with layout 'zigzag'" in got[1], (rank, name, got)
