"""shard / unshard / positions: round trips on any dim, padding, gradients, group kinds."""

import pytest
import torch
import torch.distributed as dist

import ringattn as ra


def round_trips():
    rank, world = dist.get_rank(), dist.get_world_size()
    checked = 0
    for layout in ("contiguous", "zigzag", "striped"):
        for seqlen in (1, world + 1, 4 * world, 4 * world + 3):
            for shape, dim in (((seqlen, 3), 0), ((2, seqlen, 3, 4), 1), ((2, 3, seqlen), 2), ((2, 3, seqlen), -1)):
                g = torch.Generator().manual_seed(seqlen)
                x = torch.randn(*shape, generator=g, dtype=torch.float64, requires_grad=True)
                local = ra.shard(x, layout=layout, dim=dim, seqlen=seqlen)
                pos = ra.positions(seqlen, layout=layout)
                # each local slot holds the global entry at its position, padding is zero
                for slot, p in enumerate(pos.tolist()):
                    got = local.select(dim, slot)
                    want = x.select(dim, p) if p < seqlen else torch.zeros_like(got)
                    assert torch.equal(got, want), (layout, seqlen, dim, rank, slot, p)
                back = ra.unshard(local, layout=layout, dim=dim, seqlen=seqlen)
                assert torch.equal(back, x), (layout, seqlen, dim, rank)
                # replicated semantics: a loss counted once gives the full gradient everywhere
                w = torch.randn(*shape, generator=g, dtype=torch.float64)
                (back * w).sum().backward()
                assert torch.equal(x.grad, w), (layout, seqlen, dim, rank)
                checked += 1
    return checked


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [1, 3, 4])
def test_round_trips_and_gradients(clusters, world):
    assert clusters(world).run(round_trips, timeout=90) == [48] * world


def with_device_mesh():
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    q = torch.randn(1, 10, 2, 8, generator=torch.Generator().manual_seed(0))
    by_mesh = ra.ring_attention(ra.shard(q, group=mesh, layout="striped"), ra.shard(q, group=mesh, layout="striped"),
                                ra.shard(q, group=mesh, layout="striped"), group=mesh, causal=True,
                                layout="striped", seqlen=10)
    pg = mesh.get_group()
    by_group = ra.ring_attention(ra.shard(q, group=pg, layout="striped"), ra.shard(q, group=pg, layout="striped"),
                                 ra.shard(q, group=pg, layout="striped"), group=pg, causal=True,
                                 layout="striped", seqlen=10)
    mesh2 = init_device_mesh("cpu", (1, world), mesh_dim_names=("dp", "cp"))
    try:
        ra.ring_attention(q, q, q, group=mesh2)
        err = "no error"
    except ValueError as exc:
        err = str(exc)
    return torch.equal(by_mesh, by_group), err


@pytest.mark.timeout(120)
def test_device_mesh_groups(clusters):
    for rank, (same, err) in enumerate(clusters(2).run(with_device_mesh, timeout=90)):
        assert same, rank
        assert "1-D DeviceMesh" in err and "mesh[dim_name]" in err and "('ring', 'ulysses')" in err, (rank, err)


def document_round_trips():
    """cu_seqlens: the per-document zigzag shards, gathers back, and positions gives each
    slot's global position and its position inside its document."""
    rank, world = dist.get_rank(), dist.get_world_size()
    for cu in ([0, 1, 2, 9, 10, 37], [0, 37], [0, 3, 4, 5, 6, 7, 8, 30, 31, 37]):
        seqlen = cu[-1]
        g = torch.Generator().manual_seed(seqlen)  # the same global tensor on every rank
        x = torch.randn(2, seqlen, 3, generator=g, dtype=torch.float64, requires_grad=True)
        kw = dict(layout="zigzag", cu_seqlens=torch.tensor(cu, dtype=torch.int32))
        local = ra.shard(x, **kw)
        assert local.shape[1] == -(-seqlen // world)
        pos, in_doc = ra.positions(seqlen, **kw)
        starts = torch.tensor(cu[:-1])
        for slot, (p, d) in enumerate(zip(pos.tolist(), in_doc.tolist())):
            if p < seqlen:
                assert torch.equal(local[:, slot], x[:, p])
                assert d == p - int(starts[starts <= p].max()), (cu, rank, slot, p, d)
            else:
                assert torch.equal(local[:, slot], torch.zeros_like(local[:, slot])) and d == 0
        back = ra.unshard(local, **kw)
        assert torch.equal(back, x)
        back.sum().backward()
        assert torch.equal(x.grad, torch.ones_like(x))
    errs = []
    for seqlen in (None, 12):
        try:
            ra.shard(torch.zeros(1, 12), cu_seqlens=[0, 5, 11], seqlen=seqlen)
            errs.append("no error")
        except ValueError as exc:
            errs.append(str(exc))
    return errs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_document_sharding(clusters, world):
    for rank, errs in enumerate(clusters(world).run(document_round_trips, timeout=90)):
        assert "tensor has 12 entries along dim 1, but seqlen=11" in errs[0], (rank, errs)
        assert "cu_seqlens must end at S=12, but ends at 11" in errs[1], (rank, errs)


def batch_helpers():
    """shard_batch's labels are shifted globally; all_reduce_metrics gives global means."""
    rank, world = dist.get_rank(), dist.get_world_size()
    ids = torch.arange(1, 12)[None].repeat(2, 1)  # S = 11: pads to W shards
    keep = torch.ones(2, 11, dtype=torch.long)
    keep[0, 9:] = 0  # right padding on row 0
    local = ra.shard_batch(dict(input_ids=ids, labels=ids, attention_mask=keep), layout="zigzag")
    pos = ra.positions(11, layout="zigzag")
    for slot, p in enumerate(pos.tolist()):
        for row in range(2):
            target = int(local["shift_labels"][row, slot])
            if p >= 11 or p == 10 or (row == 0 and p >= 8):
                assert target == -100, (rank, row, slot, p, target)  # no target there
            else:
                assert target == p + 2, (rank, row, slot, p, target)  # the next token
    n = int(local["num_items_in_batch"])
    means = ra.all_reduce_metrics({"rank": (rank, 1), "tokens": (n, 1), "empty": (0, 0)})
    errs = []
    packed = torch.arange(1, 12)[None]  # documents [0, 4), [4, 11)
    pos = torch.cat([torch.arange(4), torch.arange(7)])[None]
    doc = (torch.arange(11) >= 4).long()[None]
    for bad in (dict(input_ids=ids, labels=ids[:, :5]),
                # a prefix-LM's token_type_ids: the model would run without them
                dict(input_ids=ids, token_type_ids=torch.zeros_like(ids)),
                dict(input_ids=ids, pixel_values=torch.zeros(2, 3, 4, 4)),
                # a padding-free collator's seq_idx that the documents do not give
                dict(input_ids=packed, position_ids=pos, seq_idx=torch.zeros_like(doc)),
                dict(input_ids=packed, seq_idx=doc)):
        try:
            ra.shard_batch(bad)
            errs.append(None)
        except ValueError as exc:
            errs.append(str(exc))
    # named in extra_keys, token_type_ids is sharded; a seq_idx that agrees is accepted
    extra = ra.shard_batch(dict(input_ids=ids, token_type_ids=ids * 10),
                           extra_keys=("token_type_ids",), layout="zigzag")
    real = ra.positions(11, layout="zigzag") < 11  # padding slots: first token vs zero
    assert torch.equal(extra["token_type_ids"][:, real], extra["input_ids"][:, real] * 10), rank
    agreed = ra.shard_batch(dict(input_ids=packed, position_ids=pos, seq_idx=doc.int()))
    assert agreed["ring_context"].cu_seqlens == (0, 4, 11), rank
    return n, means, errs


@pytest.mark.timeout(60)
def test_batch_helpers(clusters):
    for rank, (n, means, errs) in enumerate(clusters(3).run(batch_helpers, timeout=45)):
        assert n == 10 + 8, (rank, n)  # row 0: targets of positions 0..7; row 1: 0..9
        assert means["rank"] == 1.0 and means["tokens"] == 18.0, (rank, means)
        assert means["empty"] != means["empty"]  # nan: nothing counted
        assert "batch['labels'] must be a tensor of shape [B=2, S=11" in errs[0], (rank, errs)
        assert errs[1] and "entries ['token_type_ids']" in errs[1] \
            and "extra_keys" in errs[1], (rank, errs)
        assert errs[2] and "['pixel_values']" in errs[2], (rank, errs)
        assert errs[3] and "batch['seq_idx'] must be" in errs[3] and "[0, 4, 11]" in errs[3], (
            rank, errs)
        assert errs[4] and "batch['seq_idx'] must be" in errs[4] and "None" in errs[4], (
            rank, errs)
