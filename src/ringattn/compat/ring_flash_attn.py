"""ring-flash-attn's public functions on ringattn's strategies: change one import line.

Legend: B batch, L local seq, H heads, Hkv kv heads, D head dim, T local packed tokens,
W world size.

    from ring_flash_attn import zigzag_ring_flash_attn_func            # before
    from ringattn.compat.ring_flash_attn import zigzag_ring_flash_attn_func   # after

Every function keeps ring-flash-attn's signature, return values and local splits:

* ``ring_*`` (one contiguous slice per rank), ``zigzag_*`` (the sequence cut into 2W
  chunks, rank r holding chunks r and 2W-1-r) and ``stripe_*`` (token t on rank t mod W)
  take [B, L, H, D] (``*_kvpacked`` kv [B, L, 2, Hkv, D], ``*_qkvpacked`` qkv
  [B, L, 3, H, D]) and return out, or (out, lse [B, H, L], None) with
  ``return_attn_probs``.
* ``ring_flash_attn_varlen_*`` (every document cut in W contiguous chunks) and
  ``zigzag_ring_flash_attn_varlen_*`` (every document cut in 2W chunks, zigzagged) take
  [T, H, D] with the LOCAL ``cu_seqlens`` (the global ones divided by W, as ring-flash-attn
  writes them) and return out, or (out, lse [H, T], None).
* ``llama3_flash_attn_varlen_*`` (one contiguous slice of the packed tokens per rank; K/V
  all-gathered ``heads_k_stride`` kv heads at a time) with the values of
  ``llama3_flash_attn_prepare_cu_seqlens`` (every call gathers the global offsets from
  every rank's ``cu_seqlens_q``: nothing rides on the tensor, so a copy of it works).
* ``substitute_hf_flash_attn`` / ``update_ring_flash_attn_params``: the transformers hook,
  registered as the attention implementation "ringattn_varlen" (transformers'
  ``AttentionInterface``; nothing of transformers is patched). It honours every argument
  a model passes (gpt-oss's sinks ``s_aux`` included) or refuses it by name, and refuses a
  layer whose config was switched away from "ringattn_varlen" after it ran (a reference
  model built by ``from_config`` from the same config object does that: build it from a
  copy).

What differs (docs/compat.md): the answer is exact (float32 within 1e-5 of float64) on CPU
and CUDA; window_size and alibi_slopes are applied in global positions (ring-flash-attn
applies them inside each block); inputs the peer would compute wrong are refused with the
same error on every rank, in the words of the function called (an argument only some
ranks get wrong, such as ``dropout_p``, is reported by the attention's agreement on every
rank, never by one rank alone); ``dropout_p`` must be 0; the batch functions take an
extra keyword ``seqlen`` for sequences whose length does not divide (shards from
``ringattn.shard``).
"""

from __future__ import annotations

import operator
import weakref

import torch
import torch.distributed as dist

from ..strategies.ring import ring_attention
from ..comm import agree, all_gather_single, resolve_group
from ..layouts import SHARD_TAG
from ..validate import caller_error
from ..varlen import reworded, varlen_call

__all__ = [
    "llama3_flash_attn_prepare_cu_seqlens",
    "llama3_flash_attn_varlen_func",
    "llama3_flash_attn_varlen_kvpacked_func",
    "llama3_flash_attn_varlen_qkvpacked_func",
    "ring_flash_attn_func",
    "ring_flash_attn_kvpacked_func",
    "ring_flash_attn_qkvpacked_func",
    "ring_flash_attn_varlen_func",
    "ring_flash_attn_varlen_kvpacked_func",
    "ring_flash_attn_varlen_qkvpacked_func",
    "stripe_flash_attn_func",
    "stripe_flash_attn_kvpacked_func",
    "stripe_flash_attn_qkvpacked_func",
    "substitute_hf_flash_attn",
    "update_ring_flash_attn_params",
    "zigzag_ring_flash_attn_func",
    "zigzag_ring_flash_attn_kvpacked_func",
    "zigzag_ring_flash_attn_qkvpacked_func",
    "zigzag_ring_flash_attn_varlen_func",
    "zigzag_ring_flash_attn_varlen_kvpacked_func",
    "zigzag_ring_flash_attn_varlen_qkvpacked_func",
]


def _dropout_error(dropout_p) -> ValueError | None:
    if dropout_p != 0:
        return ValueError(f"dropout_p must be 0 (ringattn computes exact attention without "
                          f"dropout), got {dropout_p!r}")
    return None


def _unpack(packed, n: int, name: str, dim: int):
    """(the ``n`` tensors packed along ``dim`` (qkv: 3, kv: 2) as views, None), or
    ((packed,) * n, the ValueError that says why not)."""
    if not isinstance(packed, torch.Tensor) or packed.dim() <= dim or packed.shape[dim] != n:
        shape = tuple(packed.shape) if isinstance(packed, torch.Tensor) else type(packed).__name__
        return (packed,) * n, ValueError(f"{name} must have {n} on dim {dim} (ring-flash-attn's "
                                         f"packed layout), got {shape}")
    return packed.unbind(dim), None


def _refused(error: Exception, call, group):
    """Raise ``error`` (found by this rank in the wrapper's own arguments) on every rank: the
    attention's agreement reports it (``call(group)`` makes the rank's usual call into it).
    Under torch.compile it is raised here (a compiled op cannot carry it)."""
    if not torch.compiler.is_compiling():
        with caller_error(error):
            call(group)
    raise error


def _batch(layout: str, base: str):
    """The three batch functions of one layout (``*_func``, ``*_kvpacked_func``,
    ``*_qkvpacked_func``)."""

    def attend(api, q, k, v, error, dropout_p, softmax_scale, causal, window_size, alibi_slopes,
               return_attn_probs, group, seqlen):
        error = error or _dropout_error(dropout_p)
        if (seqlen is None and isinstance(q, torch.Tensor) and q.dim() >= 2
                and getattr(q, SHARD_TAG, None) is None and dist.is_initialized()):
            # ring-flash-attn's contract: the shards are x.chunk(W) pieces (S = W x S_local)
            seqlen = q.shape[1] * dist.get_world_size(resolve_group(group))
        with reworded(api, packed=False):
            if error is not None:
                _refused(error, lambda g: ring_attention(q, k, v, group=g, seqlen=seqlen), group)
            result = ring_attention(q, k, v, group=group, causal=causal,
                                    window_size=window_size, softmax_scale=softmax_scale,
                                    layout=layout, seqlen=seqlen, alibi_slopes=alibi_slopes,
                                    return_lse=bool(return_attn_probs))
        return (*result, None) if return_attn_probs else result

    def func(q, k, v, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
             alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None, *,
             seqlen=None):
        return attend(f"{base}_func", q, k, v, None, dropout_p, softmax_scale, causal,
                      window_size, alibi_slopes, return_attn_probs, group, seqlen)

    def kvpacked(q, kv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                 alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None,
                 *, seqlen=None):
        (k, v), error = _unpack(kv, 2, "kv", 2)
        return attend(f"{base}_kvpacked_func", q, k, v, error, dropout_p, softmax_scale, causal,
                      window_size, alibi_slopes, return_attn_probs, group, seqlen)

    def qkvpacked(qkv, dropout_p=0.0, softmax_scale=None, causal=False, window_size=(-1, -1),
                  alibi_slopes=None, deterministic=False, return_attn_probs=False, group=None,
                  *, seqlen=None):
        (q, k, v), error = _unpack(qkv, 3, "qkv", 2)
        return attend(f"{base}_qkvpacked_func", q, k, v, error, dropout_p, softmax_scale,
                      causal, window_size, alibi_slopes, return_attn_probs, group, seqlen)

    return func, kvpacked, qkvpacked


def _local_offsets(name: str, cu) -> list[int]:
    """ring-flash-attn's local cu_seqlens (a 1-D integer tensor or a list) as ints."""
    if isinstance(cu, torch.Tensor) and cu.dim() == 1 and not cu.dtype.is_floating_point:
        return [int(x) for x in cu.tolist()]
    if isinstance(cu, (list, tuple)):
        try:
            return [operator.index(x) for x in cu]
        except TypeError:
            pass
    raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got "
                    f"{type(cu).__name__}"
                    + (f" of {cu.dtype} and shape {tuple(cu.shape)}"
                       if isinstance(cu, torch.Tensor) else ""))


def _varlen(layout: str, base: str):
    """The three varlen functions of one document layout (local ``cu_seqlens``)."""

    def attend(api, q, k, v, error, cu_seqlens, max_seqlen, dropout_p, softmax_scale, causal,
               window_size, alibi_slopes, return_attn_probs, group):
        world = dist.get_world_size(resolve_group(group))
        cu, longest = [0, 1], 1
        try:
            if error is not None:
                raise error
            if (error := _dropout_error(dropout_p)) is not None:
                raise error
            local = _local_offsets("cu_seqlens", cu_seqlens)
            cu = [x * world for x in local]
            longest = max((b - a for a, b in zip(local[:-1], local[1:])), default=0)
            if isinstance(max_seqlen, torch.Tensor) and max_seqlen.numel() == 1:
                max_seqlen = int(max_seqlen.item())
            if not isinstance(max_seqlen, int) or max_seqlen < longest:
                raise ValueError(f"max_seqlen must be an int >= the longest local document "
                                 f"({longest} tokens), got {max_seqlen!r}")
        except (TypeError, ValueError) as exc:
            error = exc
        return varlen_call(api, error, q, k, v, cu, cu, longest * world, longest * world,
                           softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                           alibi_slopes=alibi_slopes, return_attn_probs=return_attn_probs,
                           group=group, layout=layout, strategy="ring")

    def func(q, k, v, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
             window_size=(-1, -1), alibi_slopes=None, deterministic=False,
             return_attn_probs=False, group=None):
        return attend(f"{base}_func", q, k, v, None, cu_seqlens, max_seqlen, dropout_p,
                      softmax_scale, causal, window_size, alibi_slopes, return_attn_probs, group)

    def kvpacked(q, kv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                 window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                 return_attn_probs=False, group=None):
        (k, v), error = _unpack(kv, 2, "kv", 1)
        return attend(f"{base}_kvpacked_func", q, k, v, error, cu_seqlens, max_seqlen,
                      dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                      return_attn_probs, group)

    def qkvpacked(qkv, cu_seqlens, max_seqlen, dropout_p=0.0, softmax_scale=None, causal=False,
                  window_size=(-1, -1), alibi_slopes=None, deterministic=False,
                  return_attn_probs=False, group=None):
        (q, k, v), error = _unpack(qkv, 3, "qkv", 1)
        return attend(f"{base}_qkvpacked_func", q, k, v, error, cu_seqlens, max_seqlen,
                      dropout_p, softmax_scale, causal, window_size, alibi_slopes,
                      return_attn_probs, group)

    return func, kvpacked, qkvpacked


ring_flash_attn_func, ring_flash_attn_kvpacked_func, ring_flash_attn_qkvpacked_func = \
    _batch("contiguous", "ring_flash_attn")
(zigzag_ring_flash_attn_func, zigzag_ring_flash_attn_kvpacked_func,
 zigzag_ring_flash_attn_qkvpacked_func) = _batch("zigzag", "zigzag_ring_flash_attn")
stripe_flash_attn_func, stripe_flash_attn_kvpacked_func, stripe_flash_attn_qkvpacked_func = \
    _batch("striped", "stripe_flash_attn")
(ring_flash_attn_varlen_func, ring_flash_attn_varlen_kvpacked_func,
 ring_flash_attn_varlen_qkvpacked_func) = _varlen("doc_contiguous", "ring_flash_attn_varlen")
(zigzag_ring_flash_attn_varlen_func, zigzag_ring_flash_attn_varlen_kvpacked_func,
 zigzag_ring_flash_attn_varlen_qkvpacked_func) = _varlen("zigzag", "zigzag_ring_flash_attn_varlen")


# -- Llama 3's varlen all-gather -------------------------------------------------------------

def llama3_flash_attn_prepare_cu_seqlens(cu_seqlens: torch.Tensor, causal: bool, rank: int,
                                         world_size: int):
    """This rank's share of the global ``cu_seqlens`` for Llama 3's split (rank r holds
    packed tokens [r * S / W, (r + 1) * S / W)), with ring-flash-attn's return values.

    Returns:
        (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, local_k_slice): the
        documents of this rank's queries (offsets inside its slice), those of the keys they
        need (offsets inside ``local_k_slice``), their longest lengths, and the slice of the
        global keys that this rank's queries attend to.

    Raises:
        ValueError: S not divisible by ``world_size`` (ring-flash-attn's requirement; use
            ``ringattn.varlen_attention`` with ``layout="contiguous"`` for any S).
    """
    cu = [int(x) for x in (cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor)
                           else cu_seqlens)]
    total = cu[-1]
    if total % world_size:
        raise ValueError(f"the packed length {total} does not divide the {world_size} ranks "
                         f"(ring-flash-attn's llama3 split); ringattn.varlen_attention with "
                         f"layout='contiguous' takes any length")
    per = total // world_size
    lo, hi = rank * per, (rank + 1) * per
    starts = [c for c in cu[:-1] if c < hi]
    first = max(c for c in starts if c <= lo)  # the document holding this slice's first token
    inside = [c for c in cu if lo < c < hi]
    bounds_q = [0] + [c - lo for c in inside] + [per]
    k_right = hi if causal else min(c for c in cu if c >= hi)
    bounds_k = [0] + [c - first for c in inside] + [k_right - first]
    like = cu_seqlens if isinstance(cu_seqlens, torch.Tensor) else torch.tensor(cu)
    cu_q = torch.tensor(bounds_q, dtype=like.dtype, device=like.device)
    cu_k = torch.tensor(bounds_k, dtype=like.dtype, device=like.device)
    max_q = max(b - a for a, b in zip(bounds_q[:-1], bounds_q[1:]))
    max_k = max(b - a for a, b in zip(bounds_k[:-1], bounds_k[1:]))
    return cu_q, cu_k, max_q, max_k, slice(first, k_right)


def _llama3_global_offsets(cu_seqlens_q, local_k_slice, q, group, error) -> list[int]:
    """The global offsets behind every rank's ``cu_seqlens_q``, gathered from every rank's
    slice (its inner boundaries; its first token starts a document when ``local_k_slice``
    starts there; the last rank's end is the sequence's). Every rank gathers, whatever its
    arguments carry: the first exchange (the agreement's) also reports ``error``, or any
    rank's bad argument, on every rank."""
    pg = resolve_group(group)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    mine: list[int] = []
    try:
        if error is not None:
            raise error
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise ValueError(f"q must be [T, H, D], got {getattr(q, 'shape', type(q).__name__)}")
        if not isinstance(local_k_slice, slice) or not isinstance(local_k_slice.start, int):
            raise TypeError(f"local_k_slice must be the slice "
                            f"llama3_flash_attn_prepare_cu_seqlens returns, got "
                            f"{type(local_k_slice).__name__}")
        local_len = q.shape[0]
        lo = rank * local_len
        inner = _local_offsets("cu_seqlens_q", cu_seqlens_q)[1:-1]
        mine = ([lo] if local_k_slice.start == lo else []) + [x + lo for x in inner] \
            + ([lo + local_len] if rank == world - 1 else [])
    except (TypeError, ValueError) as exc:
        error = exc
    width = agree(pg, {"offsets": len(mine)}, error, reduce=("offsets",),
                  what="llama3's cu_seqlens exchange")["offsets"]
    got = torch.empty(world * width, dtype=torch.int64)
    padded = torch.tensor(mine + [-1] * (width - len(mine)), dtype=torch.int64)
    all_gather_single(got, padded, pg, what="llama3 cu_seqlens")
    return sorted({int(x) for x in got.tolist() if x >= 0})


def _llama3(api, q, k, v, error, cu_seqlens_q, heads_k_stride, local_k_slice, dropout_p,
            softmax_scale, causal, window_size, alibi_slopes, return_attn_probs, group):
    cu = _llama3_global_offsets(cu_seqlens_q, local_k_slice, q, group,
                                error or _dropout_error(dropout_p))
    longest = max((b - a for a, b in zip(cu[:-1], cu[1:])), default=0)
    return varlen_call(api, None, q, k, v, cu, cu, longest, longest,
                       softmax_scale=softmax_scale, causal=causal, window_size=window_size,
                       alibi_slopes=alibi_slopes, return_attn_probs=return_attn_probs,
                       group=group, layout="contiguous", strategy="allgather",
                       strategy_kwargs={"heads_k_stride": heads_k_stride})


def llama3_flash_attn_varlen_func(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                  max_seqlen_k, heads_k_stride, local_k_slice, dropout_p=0.0,
                                  softmax_scale=None, causal=False, window_size=(-1, -1),
                                  alibi_slopes=None, deterministic=False,
                                  return_attn_probs=False, group=None):
    """Llama 3's context parallelism for packed documents (all-gather K/V,
    ``heads_k_stride`` kv heads at a time): q, k, v [T, heads, D] are this rank's
    contiguous slice of the packed tokens; the rest as
    ``llama3_flash_attn_prepare_cu_seqlens`` returns them. Returns out [T, H, Dv], or
    (out, lse [H, T], None) with ``return_attn_probs``. Every call gathers the global
    offsets from every rank's ``cu_seqlens_q`` (two small exchanges)."""
    return _llama3("llama3_flash_attn_varlen_func", q, k, v, None, cu_seqlens_q,
                   heads_k_stride, local_k_slice, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, return_attn_probs, group)


def llama3_flash_attn_varlen_kvpacked_func(q, kv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                           max_seqlen_k, heads_k_stride, local_k_slice,
                                           dropout_p=0.0, softmax_scale=None, causal=False,
                                           window_size=(-1, -1), alibi_slopes=None,
                                           deterministic=False, return_attn_probs=False,
                                           group=None):
    (k, v), error = _unpack(kv, 2, "kv", 1)
    return _llama3("llama3_flash_attn_varlen_kvpacked_func", q, k, v, error, cu_seqlens_q,
                   heads_k_stride, local_k_slice, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, return_attn_probs, group)


def llama3_flash_attn_varlen_qkvpacked_func(qkv, cu_seqlens_q, cu_seqlens_k, max_seqlen_q,
                                            max_seqlen_k, heads_k_stride, local_k_slice,
                                            dropout_p=0.0, softmax_scale=None, causal=False,
                                            window_size=(-1, -1), alibi_slopes=None,
                                            deterministic=False, return_attn_probs=False,
                                            group=None):
    (q, k, v), error = _unpack(qkv, 3, "qkv", 1)
    return _llama3("llama3_flash_attn_varlen_qkvpacked_func", q, k, v, error, cu_seqlens_q,
                   heads_k_stride, local_k_slice, dropout_p, softmax_scale, causal, window_size,
                   alibi_slopes, return_attn_probs, group)


# -- the transformers hook -------------------------------------------------------------------

HF_NAME = "ringattn_varlen"
"""The attention implementation ``substitute_hf_flash_attn`` registers: load the model
with ``attn_implementation="ringattn_varlen"`` (transformers' own "flash_attention_2" is
left alone; a name containing "flash" would make transformers look for a flash-attn
kernel)."""


class _HFState:
    """What ring-flash-attn's transformers hook keeps between calls: the group and stride
    of ``substitute_hf_flash_attn`` and the global offsets of the current batch
    (``update_ring_flash_attn_params``), as the peer's API requires."""

    group = None
    heads_k_stride = 1
    cu_seqlens: tuple[int, ...] | None = None


def update_ring_flash_attn_params(cu_seqlens: torch.Tensor, process_group) -> None:
    """Set the current batch's GLOBAL document offsets (flash-attn's cu_seqlens of the
    whole packed sequence) for the "ringattn_varlen" attention of transformers models.
    Every rank then feeds its contiguous slice ``torch.chunk(x, W, dim=1)[rank]`` of
    input_ids and position_ids."""
    cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
    _HFState.cu_seqlens = tuple(int(x) for x in cu)
    _HFState.group = process_group


def substitute_hf_flash_attn(process_group, heads_k_stride: int) -> str:
    """Register Llama 3's varlen context parallelism as transformers' attention
    implementation "ringattn_varlen" over ``process_group``, gathering ``heads_k_stride``
    kv heads at a time; returns the name to load models with (ring-flash-attn overrides
    "flash_attention_2" instead, which ringattn does not patch)."""
    from transformers import AttentionInterface

    _HFState.group, _HFState.heads_k_stride = process_group, heads_k_stride
    AttentionInterface.register(HF_NAME, _hf_attention)
    return HF_NAME


_GUARDED: weakref.WeakSet = weakref.WeakSet()
"""Attention modules that ran "ringattn_varlen" (each has ``_still_ringattn_varlen`` as a
forward pre-hook)."""


def _switched(module) -> ValueError | None:
    """Why ``module`` (an attention layer) no longer runs "ringattn_varlen", or None."""
    impl = getattr(getattr(module, "config", None), "_attn_implementation", HF_NAME)
    if impl == HF_NAME:
        return None
    return ValueError(
        f"{type(module).__name__} was built to run attention implementation {HF_NAME!r}, "
        f"but its config now names {impl!r}: every rank would attend over its own slice "
        f"alone. A model shares the config object it was built from, and transformers' "
        f"from_config(cfg, attn_implementation=...) (from_pretrained(..., config=cfg, "
        f"attn_implementation=...)) sets the implementation on that cfg: a second model (a "
        f"one-process reference) built from the same cfg switched this one. Build the other "
        f"model from a copy (copy.deepcopy(cfg)); to run this model another way on "
        f"purpose, build a new one from a copy of its config")


def _still_ringattn_varlen(module, args) -> None:
    """Forward pre-hook of a layer that ran "ringattn_varlen": transformers picks the
    attention function from the config on every call, so a switched config would never
    reach the hook (``_switched``)."""
    error = _switched(module)
    if error is not None:
        raise error


def _hf_attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None,
                  sliding_window=None, softcap=None, s_aux=None, is_causal=None,
                  output_attentions=False, head_mask=None, **kwargs):
    """transformers' attention call: query [1, H, T, D], key/value [1, Hkv, T, D] ->
    ([1, T, H, D], None), over the packed documents of the current batch (causal unless the
    module or ``is_causal`` says otherwise).

    Every argument is honoured or refused by name, as ringattn's "ringattn" implementation
    does: ``scaling``, ``sliding_window`` (keys q-W < kv <= q), ``softcap``, ``s_aux``
    (gpt-oss's sinks, differentiable), ``is_causal``; the model kwargs that do not change
    attention (``NOT_ATTENTION_KWARGS``) are ignored; a dense ``attention_mask``, dropout,
    ``output_attentions``, ``head_mask`` and any other argument are refused, as are models
    that ``integrations.transformers`` refuses by their config. A refusal found on one rank
    is raised on every rank (by the attention's agreement)."""
    from ..integrations.transformers.checks import NOT_ATTENTION_KWARGS, _config_problem

    error = None
    try:
        error = _switched(module) or _dropout_error(dropout)
        if error is not None:
            raise error
        if kwargs.pop("output_router_logits", None):
            raise ValueError("output_router_logits=True: each rank would normalise the router "
                             "auxiliary loss over its own tokens; pass "
                             "output_router_logits=False")
        unknown = sorted(n for n, x in kwargs.items()
                         if n not in NOT_ATTENTION_KWARGS and x is not None)
        if unknown:
            raise TypeError(f"{HF_NAME} does not implement the attention argument(s) {unknown} "
                            f"that {type(module).__name__} passes")
        if output_attentions or head_mask is not None:
            raise TypeError(f"{HF_NAME} returns no attention weights and takes no head_mask")
        if attention_mask is not None:
            raise TypeError(f"{HF_NAME} got an attention_mask "
                            f"({type(attention_mask).__name__}) from {type(module).__name__}: "
                            f"a mask the model computes itself cannot be sliced; the "
                            f"documents come from update_ring_flash_attn_params")
        problem = _config_problem(getattr(module, "config", None))
        if problem is not None:
            raise ValueError(f"{HF_NAME} cannot run this model exactly: {problem}")
        if query.shape[0] != 1:
            raise ValueError(f"{HF_NAME} takes packed documents as a batch of one, got a "
                             f"batch of {query.shape[0]} (pack them and pass cu_seqlens to "
                             f"update_ring_flash_attn_params)")
        if _HFState.cu_seqlens is None:
            raise ValueError("call update_ring_flash_attn_params(cu_seqlens, group) with the "
                             "batch's global cu_seqlens before the model's forward")
    except (TypeError, ValueError) as exc:
        error = exc
    if not torch.compiler.is_compiling() and module not in _GUARDED:
        module.register_forward_pre_hook(_still_ringattn_varlen)
        _GUARDED.add(module)
    q, k, v = (t[0].transpose(0, 1) for t in (query, key, value))
    cu = _HFState.cu_seqlens or (0, 1)
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = (-1, -1) if not sliding_window else (int(sliding_window) - 1, 0)
    longest = max(b - a for a, b in zip(cu[:-1], cu[1:]))
    # torch.chunk(x, W, dim=1)[rank] of a row whose length W does not divide: chunks of
    # ceil(S / W) tokens, the last ones shorter; the contiguous layout's shards have the
    # same boundaries and pad the short ones past S (padding that attends to nothing)
    real = q.shape[0]
    if error is None:
        pg = resolve_group(_HFState.group)
        world, rank = dist.get_world_size(pg), dist.get_rank(pg)
        width = -(-cu[-1] // world)
        if real == max(0, min(width, cu[-1] - rank * width)) and real < width:
            q, k, v = (torch.nn.functional.pad(t, (0, 0, 0, 0, 0, width - real))
                       for t in (q, k, v))
    out = varlen_call(HF_NAME, error, q, k, v, cu, cu, longest, longest, softmax_scale=scaling,
                      causal=causal, window_size=window,
                      softcap=float(softcap) if softcap else 0.0, group=_HFState.group,
                      layout="contiguous", strategy="allgather",
                      strategy_kwargs={"heads_k_stride": _HFState.heads_k_stride,
                                       "sinks": s_aux})
    return out[:real].unsqueeze(0), None


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
