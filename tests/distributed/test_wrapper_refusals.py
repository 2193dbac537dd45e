"""A wrapper's own refusal on one rank (the transformers attention function's dropout or
unknown argument, a compat module's dropout_p) is raised on every rank by the attention's
agreement, never on that rank alone while the others wait in a collective."""

import pytest
import torch
import torch.distributed as dist

import ringattn as ra
from ringattn.integrations.transformers import ring_attention_forward


def hf_one_rank_refuses():
    rank, world = dist.get_rank(), dist.get_world_size()
    s = 4 * world + 1
    ids = torch.arange(s).view(1, s) % 7
    ctx = ra.shard_batch({"input_ids": ids})["ring_context"]
    g = torch.Generator().manual_seed(0)
    q = torch.randn(1, 2, ids.shape[1], 8, generator=g)
    local = ra.shard(q.transpose(1, 2), seqlen=s).transpose(1, 2)  # [B, H, L, D]
    module = torch.nn.Module()
    seen = []
    for kwargs in ({"dropout": 0.1 if rank == 0 else 0.0},
                   {"head_mask": torch.ones(1) if rank == world - 1 else None},
                   {"unknown_argument": 1 if rank == 1 else None}):
        try:
            ring_attention_forward(module, local, local, local, ring_context=ctx, **kwargs)
            seen.append(None)
        except (TypeError, ValueError) as exc:
            seen.append((type(exc).__name__, str(exc)))
    out, _ = ring_attention_forward(module, local, local, local, ring_context=ctx)
    return seen, tuple(out.shape)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 3])
def test_transformers_refusal_on_one_rank(clusters, world):
    for rank, (seen, shape) in enumerate(clusters(world).run(hf_one_rank_refuses, timeout=100)):
        dropout, head_mask, unknown = seen
        assert dropout == ("ValueError", "rank 0: ring attention has no attention dropout, "
                                         "got dropout=0.1"), (rank, dropout)
        assert head_mask[0] == "TypeError" and f"rank {world - 1}: " in head_mask[1], head_mask
        assert unknown[0] == "TypeError" and "['unknown_argument']" in unknown[1], unknown
        assert shape == (1, -(-(4 * world + 1) // (2 * world)) * 2, 2, 8), shape
