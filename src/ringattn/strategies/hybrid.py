"""The 2-D hybrid (``hybrid_attention``): Ulysses within the "ulysses" dimension of a
DeviceMesh, the ring across its "ring" dimension (USP; TransformerEngine's a2a+p2p).

Legend: B batch, L local seq, H heads, Hkv kv heads, D head dim, R ring ranks, U Ulysses
ranks (W = R * U).

It is Ulysses' head-splitting machinery (``strategies.ulysses``: its exchanges, autograd
Functions and compile op pair) on the mesh's ``Topology``, whose ring over R ranks is the
loop of ``strategies.ring``. This file owns the public function and its contract.
"""

from __future__ import annotations

import torch

from ..layouts import DEFAULT_LAYOUT
from ..masks import Mask
from .ulysses import split_heads_entry

__all__ = ["hybrid_attention"]

def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group,
    dropout_p: float = 0.0,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    layout: str = DEFAULT_LAYOUT,
    seqlen: int | None = None,
    mask: Mask | None = None,
    cu_seqlens=None,
    return_lse: bool = False,
    kernel=None,
    backward_overlap: str = "all",
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes=None,
):
    """``ring_attention``'s computation on a 2-D DeviceMesh: Ulysses within, the ring across
    (USP; TransformerEngine's a2a+p2p). The same arguments, shards (``ra.shard`` with
    ``group=mesh``: a rank's shard index is ring_rank * U + ulysses_rank), semantics and
    guarantees.

    ``group`` is a DeviceMesh with mesh_dim_names ("ring", "ulysses") of sizes (R, U), made
    e.g. by ``init_device_mesh("cuda", (R, U), mesh_dim_names=("ring", "ulysses"))`` so
    that a Ulysses group is one node. Its ranks must be listed in increasing order row by
    row (as ``init_device_mesh`` and ``ra.hybrid_mesh`` make them): torch orders every
    process group by global rank, so any other order (``[[0, 1], [3, 2]]``, column-major)
    is refused with the same ValueError on every rank before any collective. Each rank
    all-to-alls its shard over its Ulysses group
    (getting the U shards of that group for ~H/U heads, as ``ulysses_attention``), then the
    R groups run the ring over those unions (``layouts.Grouped``: zigzag over W grouped by
    U is zigzag over R, so causal work stays balanced), then the outputs go back.

    Memory contract: a rank holds S / R tokens of ~H/U heads (the size of its shards of all
    heads, times U/U), and the ring's one visiting K/V block of that size.

    Arguments, Returns, Raises: as ``ring_attention``. sinks' gradient on each rank covers
    its own heads and queries; sum it over the mesh.
    """
    return split_heads_entry(
        "hybrid", q, k, v, group=group, dropout_p=dropout_p, causal=causal, window_size=window_size,
        softmax_scale=softmax_scale, layout=layout, seqlen=seqlen, mask=mask,
        cu_seqlens=cu_seqlens, kernel=kernel, return_lse=return_lse, softcap=softcap,
        sinks=sinks, alibi_slopes=alibi_slopes, backward_overlap=backward_overlap)




if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
