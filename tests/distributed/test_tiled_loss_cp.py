"""``ringattn.tiled_lm_loss`` under context parallelism: each rank's loss on its shard of
the hidden states, with ``shard_batch``'s ``shift_labels`` and global ``num_items_in_batch``,
sums over the ranks to the one-process loss (labels shifted in one process), and the ranks'
gradients of the hidden states (gathered) and of the head (summed) equal one process's.
Plain, left-padded and packed batches, W = 2 and 3 (S = 29 divides neither 2W), float64."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

import ringattn as ra

S, H, V = 29, 8, 23


def _batches():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (2, S), generator=g)
    plain = dict(input_ids=ids, labels=ids.clone())
    keep = torch.ones(2, S, dtype=torch.long)
    keep[1, :5] = 0
    padded = dict(input_ids=ids, labels=ids.masked_fill(keep == 0, -100), attention_mask=keep)
    padded["labels"][1, 5] = -100  # predicted by a padding token: no target (shard_batch)
    pos = torch.cat([torch.arange(n) for n in (7, 1, 12, 9)])[None]
    packed_labels = ids[:1].clone()
    packed_labels[0, [0, 7, 8, 20]] = -100  # no target across documents (flattening collators)
    packed = dict(input_ids=ids[:1], labels=packed_labels, position_ids=pos)
    return {"plain": plain, "padded": padded, "packed": packed}


def tiled_cases():
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(1)  # the same head on every rank
    head = torch.nn.Linear(H, V, bias=True).double()
    hidden_all = torch.randn(2, S, H, generator=g, dtype=torch.float64)
    results = {}
    for name, batch in _batches().items():
        rows = batch["input_ids"].shape[0]
        full = hidden_all[:rows].clone().requires_grad_()
        head.zero_grad()
        shifted = torch.full_like(batch["labels"], -100)
        shifted[:, :-1] = batch["labels"][:, 1:]
        ref = ra.tiled_lm_loss(full, head, shift_labels=shifted, tile=S * rows)  # untiled: one tile
        ref.backward()
        ref_w, ref_h = head.weight.grad.clone(), full.grad.clone()
        head.zero_grad()
        local = ra.shard_batch(batch)
        cu = local["ring_context"].cu_seqlens
        mine = ra.shard(hidden_all[:rows], seqlen=S, cu_seqlens=cu).detach().requires_grad_()
        loss = ra.tiled_lm_loss(mine, head, shift_labels=local["shift_labels"], tile=3,
                                num_items_in_batch=local["num_items_in_batch"])
        loss.backward()
        total = loss.detach().clone()
        dist.all_reduce(total)
        d_w = head.weight.grad.clone()
        dist.all_reduce(d_w)
        d_h = ra.unshard(mine.grad, seqlen=S, cu_seqlens=cu)
        results[name] = (float((total - ref).abs() / ref.abs()),
                         float((d_w - ref_w).norm() / ref_w.norm()),
                         float((d_h - ref_h).norm() / ref_h.norm()), world)
    return results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_tiled_loss_sums_to_the_one_process_loss(clusters, world):
    for rank, results in enumerate(clusters(world).run(tiled_cases, timeout=150)):
        for name, (loss, d_w, d_h, w) in results.items():
            assert w == world
            assert loss < 1e-12 and d_w < 1e-10 and d_h < 1e-10, (name, rank, loss, d_w, d_h)
