"""Eagle3's test-time-training (TTT) attention, exact under context parallelism.

Legend: B batch, L local seq, S global seq, H heads, Hkv kv heads, D head dim, G = H / Hkv,
T number of key sets (TTT step j uses T = j + 1: the step-0 keys and j cached ones).

At TTT step j (0-based) the draft query at index i sees

* the step-0 keys of indices i' <= i (causal over the whole sequence, or within i's document
  for packed sequences; right padding masked);
* the keys of steps 1..j at the SAME index i (the cached "diagonal");

with one softmax over all of them. Written out, over the keys [k_0; k_1; ...; k_j] (each S
long), row i of the mask is ``causal row i | e_i | e_i | ... | e_i`` (``ttt_mask``).

Under context parallelism the step-0 part is causal ring attention, and the diagonal keys sit
on their query's rank, so they need no communication. The forward merges the two by their
log-sum-exp; the backward runs the ring's backward against the MERGED out and lse (each block
gradient only needs the final softmax normaliser) and adds the diagonal's closed-form
gradients, so the diagonal costs no collective in either direction.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from ..strategies.ring import Ring, build_ring, ring_backward, ring_forward
from ..strategies.ulysses import split_heads_attention
from ..validate import autocast_inputs, differentiable_once, unit_stride
from ..comm import resolve_group
from ..masks import key_padding
from ..spec import accumulator_dtype

__all__ = ["ttt_attention", "dense_ttt_attention", "ttt_mask", "modelopt_ttt_mask"]

MAX_KEY_SETS = 64
"""Sanity bound on the number of key sets (Eagle3 trains with 7 or fewer TTT steps)."""


def _diagonal_scores(q_BLHD, keys, scale):
    """[B, L, Hkv, G, T-1] fp32 scores of every query against its own cached keys."""
    b, n, h, d = q_BLHD.shape
    hkv = keys[0].shape[2]
    acc = accumulator_dtype(q_BLHD.dtype)
    q = q_BLHD.reshape(b, n, hkv, h // hkv, d).to(acc)
    k = torch.stack([t.to(acc) for t in keys], dim=3)  # [B, L, Hkv, T-1, D]
    return torch.einsum("blkgd,blktd->blkgt", q, k) * scale


def _merge_diagonal(out0_BLHD, lse0_BHL, scores, values):
    """Fold the diagonal keys into the step-0 result: merged (out in acc dtype, lse [B,H,L]).
    ``scores`` are ``_diagonal_scores``; ``out0`` is in the accumulator dtype."""
    b, n, h, d = out0_BLHD.shape
    hkv = values[0].shape[2]
    g = h // hkv
    lse0 = lse0_BHL.transpose(1, 2).reshape(b, n, hkv, g)
    lse = torch.logaddexp(lse0, torch.logsumexp(scores, dim=-1))
    p = torch.exp(scores - lse[..., None])  # [B, L, Hkv, G, T-1]
    v = torch.stack([t.to(scores.dtype) for t in values], dim=3)  # [B, L, Hkv, T-1, D]
    w0 = torch.exp(lse0 - lse)[..., None]  # 0 where step 0 saw nothing (lse0 = -inf)
    out = out0_BLHD.to(scores.dtype).reshape(b, n, hkv, g, d) * w0
    out = out + torch.einsum("blkgt,blktd->blkgd", p, v)
    return out.reshape(b, n, h, d), lse.reshape(b, n, h).transpose(1, 2)


class _TTTAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ring: Ring, q, k0, v0, *cached):
        j = len(cached) // 2
        keys, values = cached[:j], cached[j:]
        out0, lse0 = ring_forward(q, k0, v0, ring, keep_accumulator=True)
        if j == 0:
            out, lse = out0.to(q.dtype), lse0
        else:
            scores = _diagonal_scores(q, keys, ring.spec.softmax_scale)
            out, lse = _merge_diagonal(out0, lse0, scores, values)
            out = out.to(q.dtype)
        ctx.ring = ring
        ctx.save_for_backward(q, k0, v0, out, lse, *cached)
        return out

    @staticmethod
    @differentiable_once
    def backward(ctx, dout):
        q, k0, v0, out, lse, *cached = ctx.saved_tensors
        ring = ctx.ring
        dout = dout.contiguous()
        # step-0 keys: each block's gradient against the final (merged) softmax
        j = len(cached) // 2
        dq, dk0, dv0 = ring_backward(dout, q, k0, v0, out, lse, ring, keep_accumulator=j > 0)
        if j == 0:
            return None, dq, dk0, dv0
        keys, values = cached[:j], cached[j:]
        b, n, h, d = q.shape
        hkv = k0.shape[2]
        g = h // hkv
        scale = ring.spec.softmax_scale
        scores = _diagonal_scores(q, keys, scale)
        acc = scores.dtype
        lse_g = lse.transpose(1, 2).reshape(b, n, hkv, g)
        p = torch.exp(scores - lse_g[..., None])
        dout_g = dout.to(acc).reshape(b, n, hkv, g, d)
        delta = (dout_g * out.to(acc).reshape(b, n, hkv, g, d)).sum(-1)  # [B, L, Hkv, G]
        k = torch.stack([t.to(acc) for t in keys], dim=3)
        v = torch.stack([t.to(acc) for t in values], dim=3)
        dp = torch.einsum("blkgd,blktd->blkgt", dout_g, v)
        ds = p * (dp - delta[..., None]) * scale
        q_g = q.to(acc).reshape(b, n, hkv, g, d)
        dq = dq + torch.einsum("blkgt,blktd->blkgd", ds, k).reshape(b, n, h, d)
        dk = torch.einsum("blkgt,blkgd->blktd", ds, q_g)  # [B, L, Hkv, T-1, D]
        dv = torch.einsum("blkgt,blkgd->blktd", p, dout_g)
        grads_k = [dk[:, :, :, t].to(keys[t].dtype) for t in range(j)]
        grads_v = [dv[:, :, :, t].to(values[t].dtype) for t in range(j)]
        return (None, dq.to(q.dtype), dk0, dv0, *grads_k, *grads_v)


def _check_keys(q, keys, values, valid_len, seqlen_for_check):
    """Local checks of the TTT inputs; returns (number of cached key sets,)."""
    if not isinstance(keys, (list, tuple)) or not isinstance(values, (list, tuple)):
        raise TypeError(
            f"keys and values must be lists of tensors (one per TTT step), got "
            f"{type(keys).__name__} and {type(values).__name__}"
        )
    if len(keys) != len(values) or not keys:
        raise ValueError(
            f"keys and values must be non-empty lists of one length, got {len(keys)} keys "
            f"and {len(values)} values"
        )
    if len(keys) > MAX_KEY_SETS:
        raise ValueError(f"got {len(keys)} key sets; at most {MAX_KEY_SETS} are supported")
    for i, (k, v) in enumerate(zip(keys, values)):
        for name, t in (("keys", k), ("values", v)):
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{name}[{i}] must be a torch.Tensor, got {type(t).__name__}")
            if t.shape != keys[0].shape or t.dtype != keys[0].dtype or t.device != keys[0].device:
                raise ValueError(
                    f"{name}[{i}] is {tuple(t.shape)} {t.dtype} on {t.device}; every step's "
                    f"keys and values must match keys[0]: {tuple(keys[0].shape)} "
                    f"{keys[0].dtype} on {keys[0].device}"
                )
    if valid_len is not None and isinstance(q, torch.Tensor) and q.dim() == 4:
        b = q.shape[0]  # (a q that is not [B, S_local, H, D] is reported by the ring's checks)
        if len(valid_len) != b:
            raise ValueError(f"valid_len has {len(valid_len)} entries for a batch of {b}")
        bad = [x for x in valid_len if x < 0 or (isinstance(seqlen_for_check, int) and x > seqlen_for_check)]
        if bad:
            raise ValueError(f"valid_len entries must lie in [0, S={seqlen_for_check}], got {bad}")
    return (len(keys),)


def _valid_len_tuple(valid_len):
    if valid_len is None:
        return None
    if isinstance(valid_len, torch.Tensor):
        if valid_len.dim() != 1 or valid_len.dtype.is_floating_point or valid_len.dtype == torch.bool:
            raise TypeError(f"valid_len must be a 1-D integer tensor, got {valid_len.dtype} "
                            f"shape {tuple(valid_len.shape)}")
        return tuple(int(x) for x in valid_len.tolist())
    if isinstance(valid_len, (list, tuple)) and all(
        isinstance(x, int) and not isinstance(x, bool) for x in valid_len
    ):
        return tuple(valid_len)
    raise TypeError(f"valid_len must be a list of ints or a 1-D integer tensor, got {valid_len!r}")


TTT_STRATEGIES = ("ring", "ulysses", "hybrid")


def ttt_attention(q, keys, values, *, group=None, layout: str = "zigzag",
                  seqlen: int | None = None, softmax_scale: float | None = None,
                  valid_len=None, kernel=None, strategy: str = "ring", cu_seqlens=None):
    """Eagle3 TTT attention of one draft step over a sequence sharded across ``group``.

    Arguments:
        q: [B, S_local, H, D] this step's queries (rotated at their positions + step).
        keys, values: lists of j + 1 tensors [B, S_local, Hkv, D] for TTT step j: the
            step-0 keys/values, then those of steps 1..j (each rotated at its own step's
            positions), all this rank's shards in ``layout``.
        group: the context-parallel group (ProcessGroup, 1-D DeviceMesh, None: default).
        layout, seqlen: as for ``ring_attention`` (S need not divide W).
        softmax_scale: default 1 / sqrt(D).
        valid_len: [B] ints: row b's real tokens are [0, valid_len[b]) (right padding);
            the step-0 keys past it are masked for every query. None: no padding.
        cu_seqlens: packed documents (flash-attn's offsets, B = 1 rows or rows packed
            alike): step-0 keys are seen only within a query's document; the shards are
            per-document zigzag for layout "zigzag" (``ra.shard(..., cu_seqlens=...)``).
        kernel: the local block kernel for the step-0 ring (see ``ring_attention``).
        strategy: "ring"; "ulysses" (q and every key set go to head shards by all-to-all:
            each rank then holds the whole sequence for its heads, the diagonal keys still
            beside their queries); "hybrid" (``group`` the (ring, ulysses) mesh: Ulysses
            within, the step-0 ring across).

    Returns:
        out [B, S_local, H, D] in q's dtype. Differentiable in q and every key and value.
        With the ring, the diagonal keys cost no communication: the collectives are those
        of one causal ring over the step-0 keys, whatever the step. Under Ulysses they
        travel in the all-to-alls like the step-0 keys.

    Raises:
        TypeError, ValueError: bad input or ranks that disagree (on shapes, options, the
            number of key sets or valid_len), on every rank before any ring send.
    """
    if isinstance(keys, (list, tuple)) and isinstance(values, (list, tuple)) and keys and \
            len(keys) == len(values):  # under autocast: everything in its dtype, as SDPA
        cast = [autocast_inputs(q, k, v) for k, v in zip(keys, values)]
        q, keys, values = cast[0][0], [c[1] for c in cast], [c[2] for c in cast]
    lengths = None
    error = None
    try:
        lengths = _valid_len_tuple(valid_len)
    except TypeError as exc:  # reported through the ring's agreement below
        error = exc
    mask = None if lengths is None or error is not None else key_padding(lengths)

    def check():
        if error is not None:
            raise error
        s = seqlen
        if s is None and isinstance(q, torch.Tensor) and q.dim() == 4:
            s = q.shape[1] * dist.get_world_size(resolve_group(group))
        return _check_keys(q, keys, values, lengths, s)

    if strategy not in TTT_STRATEGIES:
        raise ValueError(f"ttt_attention's strategy must be one of {TTT_STRATEGIES}, got "
                         f"{strategy!r}")
    first_k = keys[0] if isinstance(keys, (list, tuple)) and keys else keys
    first_v = values[0] if isinstance(values, (list, tuple)) and values else values
    if strategy != "ring":
        def core(ring, q_f, k_f, v_f, cached_f, _sinks):
            return _TTTAttention.apply(ring, q_f, k_f, v_f, *cached_f), None

        lists = isinstance(keys, (list, tuple)) and isinstance(values, (list, tuple))
        cached = (*keys[1:], *values[1:]) if lists else ()  # (checked in the agreement)
        return split_heads_attention(
            q, first_k, first_v, group=group, strategy=strategy, causal=True,
            window_size=(-1, -1), softmax_scale=softmax_scale, layout=layout, seqlen=seqlen,
            mask=mask, cu_seqlens=cu_seqlens, return_lse=False, kernel=kernel,
            backward_overlap="all", softcap=0.0, sinks=None, alibi_slopes=None,
            extra_kv=cached, core=core, extra_fields=("ttt_key_sets",), extra_check=check)
    ring = build_ring(
        q, first_k, first_v, group=group, causal=True, window_size=(-1, -1),
        softmax_scale=softmax_scale, layout=layout, seqlen=seqlen, mask=mask,
        cu_seqlens=cu_seqlens,
        return_lse=False, kernel=kernel, backward_overlap="all",
        extra_fields=("ttt_key_sets",), extra_check=check,
    )
    q, *kv = unit_stride(q, *keys, *values)
    j = len(keys) - 1
    k0, cached_k = kv[0], kv[1:j + 1]
    v0, cached_v = kv[j + 1], kv[j + 2:]
    with torch.autocast(q.device.type, enabled=False):  # the kernels pick their dtypes
        return _TTTAttention.apply(ring, q, k0, v0, *cached_k, *cached_v)


# ---------------------------------------------------------------------------------------
# The single-device formulation: the TTT mask written out (O(S^2) memory; the oracle).
# ---------------------------------------------------------------------------------------


def ttt_mask(seqlen: int, step: int, valid_len=None, device=None,
             cu_seqlens=None) -> torch.Tensor:
    """The TTT mask of step ``step`` written out: [B or 1, S, (step + 1) * S] bool.

    Query i sees key column c = t * S + i' iff (t = 0 and i' <= i and i' < valid_len[b]
    and i' is in i's document) or (1 <= t <= step and i' = i).
    """
    i = torch.arange(seqlen, device=device)
    causal = i[None, :] <= i[:, None]
    if cu_seqlens is not None:
        doc = torch.bucketize(i, torch.as_tensor(list(cu_seqlens), device=device), right=True)
        causal = causal & (doc[None, :] == doc[:, None])
    if valid_len is not None:
        lengths = torch.as_tensor(list(_valid_len_tuple(valid_len)), device=device)
        causal = causal[None] & (i[None, None, :] < lengths[:, None, None])
    else:
        causal = causal[None]
    eye = torch.eye(seqlen, dtype=torch.bool, device=device).expand(causal.shape[0], -1, -1)
    return torch.cat([causal] + [eye] * step, dim=-1)


def modelopt_ttt_mask(seqlen: int, step: int, device=None) -> torch.Tensor:
    """The TTT mask in ModelOpt's token-aligned formulation: [S, (step + 1) * S] bool.

    ModelOpt keeps every TTT step's hidden states aligned with the token they predict, so
    at step j its row r is index r - j of ``ttt_mask`` and its key column t * S + c is
    index c - t of step t. It is the same attention with rows and keys relabelled
    (``tests/distributed/test_eagle3.py`` checks it entry by entry).
    """
    q = torch.arange(seqlen, device=device)[:, None]
    kv = torch.arange((step + 1) * seqlen, device=device)[None, :]
    ok = kv <= q - step
    for t in range(1, step + 1):
        ok = ok | ((kv == q + t * seqlen - (step - t)) & (kv >= t * seqlen))
    return ok


def dense_ttt_attention(q, keys, values, *, softmax_scale: float | None = None,
                        valid_len=None, cu_seqlens=None):
    """Single-device TTT attention through the written-out mask (what SpecForge's and
    ModelOpt's sdpa paths compute; O(S^2) memory). Same arguments and result as
    ``ttt_attention`` on unsharded tensors; rows that see no key give 0."""
    b, s, h, d = q.shape
    hkv = keys[0].shape[2]
    scale = 1.0 / math.sqrt(d) if softmax_scale is None else softmax_scale
    ok = ttt_mask(s, len(keys) - 1, valid_len, q.device, cu_seqlens)[:, None]  # [B|1,1,S,T*S]
    k = torch.cat(list(keys), dim=1).transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    v = torch.cat(list(values), dim=1).transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    scores = (q.transpose(1, 2) @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~ok, float("-inf"))
    dead = ~ok.any(-1, keepdim=True)
    p = torch.softmax(scores.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return (p @ v).transpose(1, 2)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
