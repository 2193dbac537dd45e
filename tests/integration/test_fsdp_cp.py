"""FSDP2 over data parallelism x ring attention over context parallelism, on 4 CPU ranks:
the README's FSDP2 block, executed as printed.

A 2 x 2 DeviceMesh (dp, cp): each dp rank takes one row of the batch, its 2 cp ranks shard
that row's sequence with ``shard_batch``. Parameters are sharded by FSDP2 over all 4 ranks
(the flattened dp x cp mesh), so gradients are reduced over both dimensions: FSDP averages
over the 4 ranks, and each rank's loss is its share of its row's mean, so the loss is
scaled by the cp size before backward (the sum over cp, the mean over dp). Five SGD steps
must give the losses of the same model trained in one process on the mean of the rows'
losses, within fp32 tolerance.

The block is read from README.md and run verbatim, given the names its prose says are the
reader's (``device``, ``dp``, ``cp``, ``model``, ``my_rows``, ``lr``); the losses it
computes are read by a forward hook on the model.
"""


import pytest
import torch
import torch.distributed as dist

from models import tiny_causal_lm
from readme_blocks import readme_block

pytest.importorskip("transformers")

STEPS, LR, SEQLEN = 5, 0.5, 29
MARKER = 'mesh = init_device_mesh(device, (dp, cp), mesh_dim_names=("dp", "cp"))'
"""A line of the README's FSDP2 block (and of no other block)."""


def _batches():
    """One batch of random tokens, five times: the model memorises it, so the loss falls."""
    ids = torch.randint(1, 97, (2, SEQLEN), generator=torch.Generator().manual_seed(1))
    return [ids] * STEPS


def fsdp_cp_losses():
    """Rank side: the README block on a 2 x 2 CPU mesh; the global loss of every step."""
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    model = tiny_causal_lm("llama", "ringattn")
    seen = []
    model.register_forward_hook(lambda mod, args, out: seen.append(out.loss.detach().clone()))
    dp_rank = dist.get_rank() // 2  # init_device_mesh lays the ranks out row by row
    rows = [dict(input_ids=ids[dp_rank:dp_rank + 1], labels=ids[dp_rank:dp_rank + 1])
            for ids in _batches()]
    names = {"device": "cpu", "dp": 2, "cp": 2, "model": model, "my_rows": rows, "lr": LR}
    exec(compile(readme_block(MARKER), "README.md (FSDP2 block)", "exec"), names)
    assert names["mesh"]["dp"].get_local_rank() == dp_rank and len(seen) == STEPS
    losses = torch.stack(seen)  # this rank's share of its row's mean, per step
    dist.all_reduce(losses)  # summed over the 4 ranks: row 0's mean + row 1's mean
    return (losses / 2).tolist()


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
def test_fsdp_x_cp_readme_block_trains_like_one_process(clusters):
    want = one_process_losses()
    for rank, got in enumerate(clusters(4).run(fsdp_cp_losses, timeout=200)):
        assert len(got) == STEPS, (rank, got)
        for step, (a, b) in enumerate(zip(got, want)):
            assert abs(a - b) <= 1e-5 * abs(b), (rank, step, a, b)
        assert want[-1] < want[0]  # it trains
