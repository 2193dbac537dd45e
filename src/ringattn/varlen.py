"""flash-attn's packed-documents call (``flash_attn_varlen_func``) on any ringattn strategy.

Legend: T local packed tokens (this rank's shard of the S packed tokens), H heads, Hkv kv
heads, D head dim (Dv of the values), W world size.

flash-attn takes packed documents as ``[total_tokens, H, D]`` with ``cu_seqlens_q/k`` and
``max_seqlen_q/k``; under context parallelism each rank holds its shard ``[T, H, D]`` of
the packed tokens (made by ``ringattn.shard(x, dim=0, cu_seqlens=cu, layout=...)``) and
passes the GLOBAL ``cu_seqlens``. The call is ``ring_attention`` (or any strategy) with
``cu_seqlens``, on a batch of one.
"""

from __future__ import annotations

import torch

from .strategies.auto import attention
from .validate import STRATEGY_CHOICES
from .layouts import DEFAULT_LAYOUT, SHARD_TAG
from .masks import check_cu_seqlens

__all__ = ["varlen_attention"]


def _offsets(name: str, cu) -> tuple[int, ...]:
    """cu_seqlens as a tuple of ints (a tensor is read once, on the host)."""
    if isinstance(cu, torch.Tensor):
        if cu.dim() != 1 or cu.dtype.is_floating_point:
            raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got a "
                            f"{cu.dtype} tensor of shape {tuple(cu.shape)}")
        return tuple(int(x) for x in cu.tolist())
    if isinstance(cu, (list, tuple)):
        return tuple(cu)
    raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got "
                    f"{type(cu).__name__}")


def _as_batch(name: str, t):
    """[T, heads, D] -> [1, T, heads, D], carrying ``ringattn.shard``'s tag (made along
    dim 0 of the packed tensor) over to the batch view."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dim() != 3:
        raise ValueError(f"{name} must be 3-D [T, heads, D] (packed tokens, flash-attn's varlen "
                         f"layout), got shape {tuple(t.shape)}")
    batch = t.unsqueeze(0)
    tag = getattr(t, SHARD_TAG, None)
    if tag is not None:
        layout, seqlen, cu, dim, ndim, members = tag
        if dim != 0:
            raise ValueError(f"{name} was sharded by ringattn.shard along dim {dim}, but "
                             f"varlen_attention takes [T, heads, D] sharded along dim 0")
        setattr(batch, SHARD_TAG, (layout, seqlen, cu, 1, 4, members))
    return batch


def varlen_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q: int,
    max_seqlen_k: int,
    dropout_p: float = 0.0,
    softmax_scale: float | None = None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softcap: float = 0.0,
    alibi_slopes=None,
    deterministic: bool = False,
    return_attn_probs: bool = False,
    *,
    group=None,
    layout: str = DEFAULT_LAYOUT,
    strategy: str = "ring",
    return_lse: bool = False,
    **strategy_kwargs,
):
    """Exact attention over packed documents sharded across ``group``, with
    ``flash_attn_varlen_func``'s names and conventions.

    Arguments:
        q: [T, H, D] this rank's shard of the packed queries (``ringattn.shard(x, dim=0,
            cu_seqlens=cu_seqlens_q, layout=layout, group=group)`` of the [S, H, D] tensor).
        k, v: [T, Hkv, D] and [T, Hkv, Dv], sharded the same way (H % Hkv == 0).
        cu_seqlens_q, cu_seqlens_k: [n_docs + 1] GLOBAL document offsets (flash-attn's
            int32 tensor or a list), 0 .. S. Under context parallelism queries and keys are
            the same tokens, so the two must be equal.
        max_seqlen_q, max_seqlen_k: at least the longest document (flash-attn sizes its
            kernels by them; ringattn reads the lengths from cu_seqlens and only checks).
        dropout_p: must be 0 (dropout is not supported: it would not be exact).
        softmax_scale, causal, window_size, softcap, alibi_slopes: as in flash-attn, in
            positions inside each document's global order (causal is per document; the
            window is in global positions, which inside a document are its positions).
        deterministic: accepted for compatibility; ringattn is always deterministic.
        return_attn_probs: as flash-attn's: also return (lse, None) (no probabilities).
        group: a ProcessGroup, a DeviceMesh (the hybrid's 2-D one for strategy="hybrid")
            or None for the default group.
        layout: how the packed tokens were sharded: "zigzag" (every document zigzagged
            over the ranks; the default), "contiguous" (one contiguous slice of the packed
            tokens per rank, Llama 3's split), "doc_contiguous" (every document cut in W
            contiguous chunks) or "striped".
        strategy: "ring" (default), "ulysses", "allgather", "hybrid" or "auto".
        return_lse: also return lse.
        strategy_kwargs: the strategy's own options (``heads_k_stride``,
            ``backward_overlap``, ``kernel``, ``sinks``, ``mask``).

    Returns:
        out [T, H, Dv] in q's dtype; with ``return_lse`` (out, lse) and with
        ``return_attn_probs`` (out, lse, None); lse is [H, T] float32 (flash-attn's varlen
        layout), -inf on padding slots.

    Raises:
        TypeError, ValueError: bad input or ranks that disagree, on every rank (the checks
            of this function's own arguments: dropout_p, cu_seqlens_q against cu_seqlens_k,
            max_seqlen, block tables, run before any communication; ranks that pass
            different values there get a ``PeerError`` naming the rank that did not come).
    """
    if dropout_p != 0:
        raise ValueError(f"dropout_p must be 0 (ringattn computes exact attention without "
                         f"dropout), got {dropout_p!r}")
    if strategy_kwargs.get("block_table") is not None:
        raise ValueError("block_table (paged KV caches) is an inference feature; "
                         "varlen_attention takes packed training sequences")
    strategy_kwargs.pop("block_table", None)
    if strategy not in STRATEGY_CHOICES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {list(STRATEGY_CHOICES)}")
    cu_q, cu_k = _offsets("cu_seqlens_q", cu_seqlens_q), _offsets("cu_seqlens_k", cu_seqlens_k)
    if cu_q != cu_k:
        raise ValueError(f"cu_seqlens_q {list(cu_q)} and cu_seqlens_k {list(cu_k)} differ: "
                         f"under context parallelism queries and keys are the same packed "
                         f"tokens")
    cu = check_cu_seqlens(cu_q, None)
    longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    for name, value in (("max_seqlen_q", max_seqlen_q), ("max_seqlen_k", max_seqlen_k)):
        if isinstance(value, torch.Tensor) and value.numel() == 1:
            value = int(value.item())
        if not isinstance(value, int) or isinstance(value, bool) or value < longest:
            raise ValueError(f"{name} must be an int >= the longest document ({longest} "
                             f"tokens), got {value!r}")
    q4, k4, v4 = (_as_batch(n, t) for n, t in (("q", q), ("k", k), ("v", v)))
    want_lse = bool(return_lse or return_attn_probs)
    result = attention(q4, k4, v4, group=group, strategy=strategy, causal=causal,
                       window_size=window_size, softmax_scale=softmax_scale, layout=layout,
                       seqlen=cu[-1], cu_seqlens=cu, return_lse=want_lse, softcap=softcap,
                       alibi_slopes=alibi_slopes, **strategy_kwargs)
    if not want_lse:
        return result[0]
    out, lse = result[0][0], result[1][0]
    return (out, lse, None) if return_attn_probs else (out, lse)
