"""ringattn: exact context-parallel (ring) attention for PyTorch.

One sequence is split across the ranks of a ``torch.distributed`` group; attention over
the whole sequence, forward and backward, is computed with each rank holding only its
shard. Results equal single-device attention up to floating-point rounding, for any
sequence length and world size.

Example (every rank runs this; ``pg`` is a process group of W ranks)::

    import torch, ringattn as ra
    S = 10_001                                   # need not divide W
    q, k, v = (torch.randn(1, S, 8, 64) for _ in range(3))      # same on every rank
    q_l, k_l, v_l = (ra.shard(t, group=pg, layout="zigzag", seqlen=S) for t in (q, k, v))
    out_l = ra.ring_attention(q_l, k_l, v_l, group=pg, causal=True, layout="zigzag", seqlen=S)
    out = ra.unshard(out_l, group=pg, layout="zigzag", seqlen=S)  # [1, S, 8, 64]
"""

from . import eagle3, kernels, layouts, masks, mixers, plan
from .strategies import auto
from .strategies.allgather import allgather_attention
from .strategies.auto import CostModel, Link, attention
from .strategies.hybrid import hybrid_attention
from .strategies.ring import ring_attention
from .strategies.ulysses import ulysses_attention
from .batch import RingContext, all_reduce_metrics, shard_batch
from .comm import hybrid_mesh
from .logprobs import LogProbs, TokenLoss, tiled_logprobs, tiled_token_loss
from .loss import tiled_lm_loss
from .merge import merge
from .sharding import positions, shard, unshard
from .spec import AttnSpec
from .varlen import varlen_attention

__all__ = [
    "AttnSpec",
    "CostModel",
    "Link",
    "attention",
    "auto",
    "allgather_attention",
    "RingContext",
    "all_reduce_metrics",
    "eagle3",
    "hybrid_attention",
    "hybrid_mesh",
    "kernels",
    "layouts",
    "masks",
    "merge",
    "plan",
    "positions",
    "ring_attention",
    "shard",
    "shard_batch",
    "tiled_lm_loss",
    "tiled_logprobs",
    "LogProbs",
    "tiled_token_loss",
    "TokenLoss",
    "ulysses_attention",
    "unshard",
    "varlen_attention",
]
__version__ = "0.1.0"
