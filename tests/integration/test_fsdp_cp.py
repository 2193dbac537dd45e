"""FSDP2 over data parallelism x ring attention over context parallelism, on 4 CPU ranks.

A 2 x 2 DeviceMesh (dp, cp): each dp rank takes one row of the batch, its 2 cp ranks shard
that row's sequence with ``shard_batch``. Parameters are sharded by FSDP2 over all 4 ranks
(the flattened dp x cp mesh), so gradients are reduced over both dimensions: FSDP averages
over the 4 ranks, and each rank's loss is its share of its row's mean, so the loss is
scaled by the cp size before backward (the sum over cp, the mean over dp). Five SGD steps
must give the losses of the same model trained in one process on the mean of the rows'
losses, within fp32 tolerance.
"""

import pytest
import torch
import torch.distributed as dist

import ringattn as ra
from models import tiny_causal_lm

pytest.importorskip("transformers")

STEPS, LR, SEQLEN = 5, 0.5, 29


def _batches():
    """One batch of random tokens, five times: the model memorises it, so the loss falls."""
    ids = torch.randint(1, 97, (2, SEQLEN), generator=torch.Generator().manual_seed(1))
    return [ids] * STEPS


def fsdp_cp_losses():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "cp"))
    cp, dp_rank = mesh["cp"], mesh["dp"].get_local_rank()
    model = tiny_causal_lm("llama", "ringattn")
    shard_mesh = mesh["dp", "cp"]._flatten("dp_cp")
    for layer in model.model.layers:
        fully_shard(layer, mesh=shard_mesh)
    fully_shard(model, mesh=shard_mesh)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids in _batches():
        row = ids[dp_rank:dp_rank + 1]
        local = ra.shard_batch(dict(input_ids=row, labels=row), group=cp, layout="zigzag")
        loss = model(**local, use_cache=False).loss
        (loss * cp.size()).backward()
        opt.step()
        opt.zero_grad()
        row_loss = loss.detach().clone()
        dist.all_reduce(row_loss, group=cp.get_group())  # this row's mean
        dist.all_reduce(row_loss)  # summed over the 4 ranks: 2 x (row 0 + row 1)
        losses.append(float(row_loss) / 4)
    return losses


def one_process_losses():
    model = tiny_causal_lm("llama", "eager")
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    losses = []
    for ids in _batches():
        loss = sum(model(input_ids=ids[r:r + 1], labels=ids[r:r + 1]).loss for r in range(2)) / 2
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(float(loss.detach()))
    return losses


@pytest.mark.timeout(240)
def test_fsdp_x_cp_trains_like_one_process(clusters):
    want = one_process_losses()
    for rank, got in enumerate(clusters(4).run(fsdp_cp_losses, timeout=200)):
        for step, (a, b) in enumerate(zip(got, want)):
            assert abs(a - b) <= 1e-5 * abs(b), (rank, step, a, b)
        assert want[-1] < want[0]  # it trains
