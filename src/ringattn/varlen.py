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

import contextlib
import difflib
import inspect
import re
from functools import lru_cache

import torch

from .strategies.auto import STRATEGIES, attention
from .validate import caller_error, check_strategy
from .layouts import DEFAULT_LAYOUT, SHARD_TAG, check_origin
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
        check_origin(name, t, tag.members, "passed to varlen_attention", 0, 3,
                     " ([T, heads, D] sharded along dim 0)")
        setattr(batch, SHARD_TAG, tag._replace(dim=1, ndim=4))
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
            ``backward_overlap``, ``kernel``, ``mask``, ``sinks``: gpt-oss's [H] float
            tensor, differentiable, its gradient this rank's share); any other keyword is a
            TypeError naming it.

    Returns:
        out [T, H, Dv] in q's dtype; with ``return_lse`` (out, lse) and with
        ``return_attn_probs`` (out, lse, None); lse is [H, T] float32 (flash-attn's varlen
        layout), -inf on padding slots.

    Raises:
        TypeError, ValueError: bad input or ranks that disagree, the same error on every
            rank before any communication of the attention, in this function's words
            ([T, H, D], ``varlen_attention``). This function's own checks (dropout_p,
            cu_seqlens_q against cu_seqlens_k, max_seqlen, block tables, keywords no
            strategy takes) travel in the strategy's agreement, so a rank alone in passing
            a bad value raises with the others; with strategy="auto" (which measures the
            group before it chooses) they raise on the rank that found them.
    """
    return varlen_call(
        "varlen_attention", None, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
        max_seqlen_k, dropout_p=dropout_p, softmax_scale=softmax_scale, causal=causal,
        window_size=window_size, softcap=softcap, alibi_slopes=alibi_slopes,
        return_attn_probs=return_attn_probs, group=group, layout=layout, strategy=strategy,
        return_lse=return_lse, strategy_kwargs=strategy_kwargs)


def varlen_call(api: str, error, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                max_seqlen_k, *, dropout_p=0.0, softmax_scale=None, causal=False,
                window_size=(-1, -1), softcap=0.0, alibi_slopes=None, return_attn_probs=False,
                group=None, layout=DEFAULT_LAYOUT, strategy="ring", return_lse=False,
                strategy_kwargs=None):
    """``varlen_attention`` for the function ``api`` the user called (its name in every
    message), with ``error``: a TypeError/ValueError that ``api`` found in its own arguments
    on this rank (or None), raised on every rank by the strategy's agreement like this
    function's own checks (with strategy="auto", on this rank alone: choosing a strategy
    measures the group first)."""
    check_strategy(strategy, group)  # the program's constants: the same on every rank
    strategy_kwargs = dict(strategy_kwargs or {})
    with reworded(api, packed=True):
        prepared = None
        if error is None:
            try:
                prepared = _prepare(api, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                    max_seqlen_k, dropout_p, strategy, strategy_kwargs)
            except (TypeError, ValueError) as exc:
                error = exc
        if error is not None:
            if strategy == "auto":
                raise error
            with caller_error(error):  # the agreement raises it, on every rank
                STRATEGIES[strategy](q, k, v, group=group)
            raise error  # (unreachable: the agreement raised)
        q4, k4, v4, cu = prepared
        want_lse = bool(return_lse or return_attn_probs)
        result = attention(q4, k4, v4, group=group, strategy=strategy, causal=causal,
                           window_size=window_size, softmax_scale=softmax_scale, layout=layout,
                           seqlen=cu[-1], cu_seqlens=cu, return_lse=want_lse, softcap=softcap,
                           alibi_slopes=alibi_slopes, **strategy_kwargs)
    if not want_lse:
        return result[0]
    out, lse = result[0][0], result[1][0]
    return (out, lse, None) if return_attn_probs else (out, lse)


def _prepare(api, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p,
             strategy, strategy_kwargs):
    """This rank's checks of the varlen arguments: (q, k, v as [1, T, heads, D], the global
    offsets), or a TypeError/ValueError. ``strategy_kwargs`` loses a None block_table."""
    if dropout_p != 0:
        raise ValueError(f"dropout_p must be 0 (ringattn computes exact attention without "
                         f"dropout), got {dropout_p!r}")
    if strategy_kwargs.get("block_table") is not None:
        raise ValueError(f"block_table (paged KV caches) is an inference feature; {api} "
                         f"takes packed training sequences")
    strategy_kwargs.pop("block_table", None)
    _check_keywords(api, strategy, strategy_kwargs)
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
    return q4, k4, v4, cu


_SET_HERE = frozenset({"group", "causal", "window_size", "softmax_scale", "layout",
                       "return_lse", "softcap", "alibi_slopes", "strategy"})
"""The strategies' keywords that varlen_attention passes from its own arguments."""

_FROM_CU = frozenset({"seqlen", "cu_seqlens"})
"""The strategies' keywords that varlen_attention derives from cu_seqlens_q."""


@lru_cache(maxsize=None)
def _strategy_keywords(strategy: str) -> tuple[str, ...]:
    """What ``**strategy_kwargs`` may hold with ``strategy``: its function's own keywords
    (every strategy's for "auto"), ``attention``'s ``cost`` and the options ``attention``
    drops for strategies without them (``heads_k_stride``, ``backward_overlap``)."""
    fns = STRATEGIES.values() if strategy == "auto" else [STRATEGIES[strategy]]
    names = {"cost", "heads_k_stride", "backward_overlap", "block_table"}
    for fn in fns:
        names |= {p.name for p in inspect.signature(fn).parameters.values()
                  if p.kind is p.KEYWORD_ONLY}
    return tuple(sorted(names - _SET_HERE - _FROM_CU))


def _check_keywords(api: str, strategy: str, strategy_kwargs: dict) -> None:
    """A keyword neither ``api`` nor ``strategy`` takes: a TypeError naming it (and the
    nearest name), as Python's own for ``api``."""
    allowed = _strategy_keywords(strategy)
    for name in strategy_kwargs:
        if name in _FROM_CU:
            raise TypeError(f"{api}() takes no {name}=: the documents and S (the last offset) "
                            f"are cu_seqlens_q's")
        if name not in allowed:
            own = [p for p in inspect.signature(varlen_attention).parameters
                   if p != "strategy_kwargs"]
            near = difflib.get_close_matches(name, own + list(allowed), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise TypeError(f"{api}() got an unexpected keyword argument {name!r}{hint}; with "
                            f"strategy={strategy!r} it takes {list(allowed)} besides its own "
                            f"arguments")


_PACKED_WORDS = (
    # the batch API's shapes [B, S_local, heads, D] (B = 1 here) -> [T, heads, D]
    (re.compile(r"dim (\d) of \[B, S_local"),
     lambda m: f"dim {int(m.group(1)) - 1} of [B, S_local"),
    (re.compile(r"\[B=\d+, S_local=(\d+), "), r"[T=\1, "),
    (re.compile(r"\[B, S_local, "), "[T, "),
    (re.compile(r"\bS_local\b"), "T"),
    (re.compile(r"\(sequence on dim 1\)"), "(packed tokens on dim 0)"),
    (re.compile(r"SDPA(?:-layout|'s) \[B, H, S, D\]"), "head-first [H, T, D]"),
    (re.compile(r"\[B, H, S, D\]"), "[H, T, D]"),
    (re.compile(r"transpose\(1, 2\)"), "transpose(0, 1)"),
    (re.compile(r",? and seqlen= the global S"), " (dim=0, cu_seqlens=cu_seqlens_q)"),
    (re.compile(r"\(1, (\d+), (\d+), (\d+)\)"), r"(\1, \2, \3)"),
    (re.compile(r"\bseqlen=(\d+) with layout"), r"S=\1 (cu_seqlens[-1]) with layout"),
    (re.compile(r"ranks disagree on local_len\b"),
     "ranks disagree on T (their packed tokens, dim 0 of [T, H, D])"),
)


def reword(message: str, api: str, packed: bool) -> str:
    """An error of the batch API in the words of ``api``: its name for ``ring_attention``'s
    and, with ``packed``, [T, heads, D] for [B, S_local, heads, D]."""
    if packed:
        for pattern, words in _PACKED_WORDS:
            message = pattern.sub(words, message)
    return re.sub(r"\bring_attention\b(?!_)", api, message)


@contextlib.contextmanager
def reworded(api: str, packed: bool):
    """TypeError/ValueError raised inside (the agreement raises them on every rank, so each
    rank rewords the same message) speak ``api``'s words (``reword``)."""
    try:
        yield
    except (TypeError, ValueError) as exc:
        if len(exc.args) == 1 and isinstance(exc.args[0], str):
            exc.args = (reword(exc.args[0], api, packed),)
        raise


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
