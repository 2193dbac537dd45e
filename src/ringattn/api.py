"""Public attention functions and their autograd Function (thin: the work is in ring.py).

Legend: B batch, L local seq (S_pad / W), S global seq, H heads, Hkv kv heads, D head dim
(Dv of the values), W world size.
"""

from __future__ import annotations

import math
import struct
import zlib
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .allgather import GatherGroup, allgather_attention_apply, local_ring
from .comm import (HYBRID_DIMS, LocalComm, RingComm, agree, caller_site, is_hybrid_mesh,
                   mesh_groups, resolve_group, site_digest)
from .kernels import available_kernels, get_kernel
from .layouts import DEFAULT_LAYOUT, LAYOUT_NAMES, Layout, get_layout, grouped, local_positions
from .masks import (Mask, check_cu_seqlens, document, fingerprint, head_offset, mask_key,
                    registered_mask, sliding_window, value_digest)
from .plan import Plan, make_plan, view_digest
from .ring import BACKWARD_OVERLAP, Ring, attention_backward, attention_forward
from .sharding import SHARD_TAG, group_members
from .spec import AttnSpec, accumulator_dtype
from .ulysses import Exchange, head_split, heads_to_seq, seq_to_heads

__all__ = ["allgather_attention", "hybrid_attention", "ring_attention", "ulysses_attention"]

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_DEVICES = ("cpu", "cuda")
_LAYOUT_NAMES = LAYOUT_NAMES


class _RingAttention(torch.autograd.Function):
    """out, lse = attention of this rank's queries over all keys (and the sinks, if any)."""

    @staticmethod
    def forward(ctx, q, k, v, sinks, ring: Ring, lse_grad: bool):
        out, lse = attention_forward(q, k, v, sinks, ring)
        if any(ctx.needs_input_grad[:4]):
            ctx.save_for_backward(q, k, v, out, lse, sinks)
        ctx.ring, ctx.lse_grad = ring, lse_grad
        if not lse_grad:
            ctx.mark_non_differentiable(lse)
        ctx.set_materialize_grads(False)
        return out, lse

    @staticmethod
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        with _no_autocast(q.device.type):  # backward() may run under autocast
            grads = attention_backward(ctx.ring, ctx.lse_grad, q, k, v, out, lse, sinks, dout,
                                       dlse, ctx.needs_input_grad[3])
        return (*grads, None, None)


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def _describe(name: str, value: int) -> str:
    if value == -1:
        return "nothing (its input was invalid)"
    if name == "dtype":
        return str(_DTYPES[value])
    if name == "device":
        return _DEVICES[value]
    if name == "layout":
        return repr(_LAYOUT_NAMES[value])
    if name in ("softmax_scale", "softcap"):
        return repr(struct.unpack("<d", struct.pack("<q", value))[0])
    if name == "kernel":
        return repr(available_kernels()[value]) if value < len(available_kernels()) else "a custom kernel"
    if name == "mask":
        return f"a mask with digest {value}"
    if name == "cu_seqlens":
        return "none" if value == -2 else f"cu_seqlens with digest {value}"
    if name == "sinks":
        return "no sinks" if value == -2 else f"sinks with digest {value}"
    if name == "strategy":
        return repr(STRATEGY_NAMES[value])
    if name == "heads_k_stride":
        return f"heads_k_stride={value}"
    if name == "grads":
        wants = [n for i, n in enumerate(("q", "k", "v", "sinks")) if value >> i & 1]
        return f"gradients for {wants or 'nothing'}"
    if name == "alibi_slopes":
        return "no ALiBi" if value == -2 else f"ALiBi slopes with digest {value}"
    return str(value)


def _effective_mask(spec: AttnSpec, mask: Mask | None, cu: tuple[int, ...] | None) -> Mask:
    """The user's mask & the document mask of ``cu_seqlens`` & the causal/window shorthands."""
    parts = [m for m in (mask, None if cu is None else document(cu)) if m is not None]
    if spec.left is not None or spec.right is not None or not parts:
        left, right = spec.left, spec.right
        parts.append(sliding_window(-1 if left is None else left, -1 if right is None else right))
    result = parts[0]
    for m in parts[1:]:
        result = result & m
    return result


def _dtensor_type():
    """torch's DTensor class, or None on builds without it (checked once, at import)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch builds without distributed tensors
        return None
    return DTensor


_DTENSOR = _dtensor_type()


def _check_shard_tag(name, t, layout_name, seqlen, cu_digest):
    """A tensor made by ``ringattn.shard`` must be attended with the layout, S and documents
    it was sharded with."""
    tag = getattr(t, SHARD_TAG, None)
    if tag is None:
        return
    made_layout, made_seqlen, made_cu = tag[:3]
    made = {"layout": made_layout, "seqlen": made_seqlen, "cu_seqlens": made_cu}
    used = {"layout": layout_name, "seqlen": seqlen, "cu_seqlens": cu_digest}
    for key in made:
        if made[key] != used[key]:
            what = {"layout": repr, "seqlen": str,
                    "cu_seqlens": lambda x: "none" if x == -2 else f"digest {x}"}[key]
            raise ValueError(
                f"{name} was sharded by ringattn.shard with {key}={what(made[key])} but is "
                f"attended with {key}={what(used[key])}; pass the same layout, seqlen and "
                f"cu_seqlens to shard and ring_attention"
            )


def _check_shard_origin(name, t, pg):
    """A tensor made by ``ringattn.shard`` was sharded along dim 1 of [B, S_local, H, D]
    and over the ranks of the group it is attended over (checked before its length)."""
    tag = getattr(t, SHARD_TAG, None)
    if tag is None:
        return
    dim, ndim, members = tag[3:]
    if ndim == 4 and dim != 1:
        raise ValueError(
            f"{name} was sharded by ringattn.shard along dim {dim}, but attention takes "
            f"[B, S_local, H, D] with the sequence on dim 1: shard [B, S, H, D] tensors with "
            f"dim=1 (an SDPA-layout [B, H, S, D] tensor needs .transpose(1, 2) first)")
    if members != group_members(pg):
        raise ValueError(
            f"{name} was sharded by ringattn.shard over the ranks {list(members)} but is "
            f"attended over the group of ranks {list(group_members(pg))}: shard and attend "
            f"with the same group")


@dataclass(frozen=True)
class Checked:
    """One rank's validated call: what every strategy needs to run it."""

    spec: AttnSpec
    plan: Plan | None
    """The ring's plan for this rank (None when not asked for)."""
    kernel: object
    layout: Layout
    mask: Mask
    """The effective mask: the user's & documents & causal/window, in global positions."""
    fields: dict
    """What every rank must agree on (``agree``)."""


def _check_local(q, k, v, comm, causal, window_size, softmax_scale, layout, seqlen, mask,
                 cu_seqlens, kernel, backward_overlap, return_lse, pg, softcap, sinks,
                 alibi_slopes=None, plan_ring=True) -> Checked:
    """Validate this rank's inputs and (``plan_ring``) plan its ring."""
    world = comm.world
    if backward_overlap not in BACKWARD_OVERLAP:
        raise ValueError(
            f"backward_overlap must be one of {list(BACKWARD_OVERLAP)}, got {backward_overlap!r}"
        )
    for name, t in (("q", q), ("k", k), ("v", v)):
        if _DTENSOR is not None and isinstance(t, _DTENSOR):
            raise TypeError(
                f"{name} is a DTensor (placements {tuple(t.placements)}); ring_attention takes "
                f"this rank's shard as a plain tensor: pass {name}.to_local() (sharded on the "
                f"sequence dim with ringattn's layout, as ringattn.shard makes it)"
            )
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D [B, S_local, H, D] (sequence on dim 1), got "
                             f"shape {tuple(t.shape)}")
        if t.dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; supported: {list(_DTYPES)}")
        if t.device.type not in _DEVICES:
            raise ValueError(f"{name} is on {t.device}; supported device types: {list(_DEVICES)}")
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_shard_origin(name, t, pg)
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k, v must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"q, k, v must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[:3] != v.shape[:3]:
        raise ValueError(
            f"k and v must have the same [B, S_local, Hkv] of [B, S_local, Hkv, D], got "
            f"{tuple(k.shape)} and {tuple(v.shape)}"
        )
    b, n, h, d = q.shape
    if (k.shape[0], k.shape[1]) != (b, n):
        raise ValueError(
            f"q is [B={b}, S_local={n}, H, D] but k is [B={k.shape[0]}, "
            f"S_local={k.shape[1]}, Hkv, D] (q, k, v are [B, S_local, H, D]; SDPA-layout "
            f"[B, H, S, D] tensors need .transpose(1, 2))"
        )
    if k.shape[3] != d:
        raise ValueError(f"q has head dim {d} but k has head dim {k.shape[3]} (dim 3 of "
                         f"[B, S_local, H, D])")
    hkv = k.shape[2]
    if hkv == 0 or h % hkv != 0:
        raise ValueError(f"q has {h} heads, not a multiple of k's {hkv} heads (dim 2 of "
                         f"[B, S_local, H, D]; SDPA-layout [B, H, S, D] tensors need "
                         f".transpose(1, 2))")
    if b == 0 or n == 0 or d == 0 or v.shape[3] == 0:
        raise ValueError(f"q or v has an empty dimension: shapes {tuple(q.shape)}, {tuple(v.shape)}")
    if sinks is not None:
        if not isinstance(sinks, torch.Tensor) or not sinks.dtype.is_floating_point:
            raise TypeError(f"sinks must be a float tensor [H], got {type(sinks).__name__}"
                            + (f" of {sinks.dtype}" if isinstance(sinks, torch.Tensor) else ""))
        if tuple(sinks.shape) != (h,):
            raise ValueError(f"sinks must have shape [H]=[{h}] (one logit per query head), "
                             f"got {tuple(sinks.shape)}")
        if sinks.device != q.device:
            raise ValueError(f"sinks is on {sinks.device} but q is on {q.device}")
        sink_values = sinks.detach().to("cpu", torch.float64)  # (a device sync on CUDA)
        if bool(torch.isnan(sink_values).any() | (sink_values == float("inf")).any()):
            raise ValueError(f"sinks must be finite or -inf (a head without a sink), got "
                             f"{sink_values.tolist()}")
        sink_digest = zlib.crc32(sink_values.numpy().tobytes()) & 0x7FFFFFFF
    if isinstance(softcap, (int, float)) and not isinstance(softcap, bool):
        softcap = float(softcap)
    slopes = _alibi_slopes(alibi_slopes, h)
    backend = str(dist.get_backend(pg))
    if (backend == "nccl" and q.device.type != "cuda") or (backend == "gloo" and q.device.type != "cpu"):
        raise ValueError(f"tensors on {q.device} cannot travel over a {backend!r} process group")
    if isinstance(mask, int) and not isinstance(mask, bool):
        mask = None if mask < 0 else registered_mask(mask)
    if mask is not None and not isinstance(mask, Mask):
        raise TypeError(f"mask must be a ringattn.masks.Mask (see ringattn.masks.from_function), "
                        f"got {type(mask).__name__}")
    cu = None
    if cu_seqlens is not None:
        cu = check_cu_seqlens(cu_seqlens, seqlen)
        seqlen = cu[-1] if seqlen is None else seqlen
    lay = get_layout(layout, cu)
    if seqlen is None:
        seqlen = n * world
    if not isinstance(seqlen, int) or isinstance(seqlen, bool) or seqlen < 1:
        raise ValueError(f"seqlen must be an int >= 1, got {seqlen!r}")
    expected = lay.local_len(seqlen, world)
    if expected != n:
        raise ValueError(
            f"seqlen={seqlen} with layout {lay.name!r} on {world} ranks gives shards of "
            f"{expected} tokens, but q has S_local={n} on dim 1 of [B, S_local, H, D] (use "
            f"ringattn.shard to make shards; SDPA-layout [B, H, S, D] tensors need "
            f".transpose(1, 2))"
        )
    if softmax_scale is None:
        softmax_scale = 1.0 / math.sqrt(d)
    elif isinstance(softmax_scale, (int, float)) and not isinstance(softmax_scale, bool):
        softmax_scale = float(softmax_scale)
    if not isinstance(window_size, (tuple, list)):
        raise ValueError(f"window_size must be a pair (left, right), got {window_size!r}")
    spec = AttnSpec(
        causal=causal, window_size=tuple(window_size), softmax_scale=softmax_scale,
        seqlen=seqlen, layout=lay.name, softcap=softcap, alibi_slopes=slopes,
    )
    cu_digest = -2 if cu is None else zlib.crc32(repr(cu).encode()) & 0x7FFFFFFF
    for name, t in (("q", q), ("k", k), ("v", v)):
        _check_shard_tag(name, t, lay.name, seqlen, cu_digest)
    full_mask = _effective_mask(spec, mask, cu)
    general = full_mask.band is None
    needs = frozenset(({"softcap"} if spec.softcap else set())
                      | ({"alibi"} if slopes is not None else set())
                      | ({"value_dim"} if v.shape[3] != d else set()))
    kern = get_kernel(kernel, q.device, q.dtype, general=general, needs=needs)
    digest = fingerprint(full_mask, seqlen, b, h, q.device)  # the plan cache's key
    valued = value_digest(full_mask)  # exact for masks made of values; None for functions
    plan = None if not plan_ring else make_plan(
        lay, full_mask, world, comm.rank, seqlen, batch=b, heads=h, device=q.device,
        tile=getattr(kern, "tile", (256, 128)), digest=digest)
    names = available_kernels()
    fields = {
        "batch": b, "local_len": n, "heads": h, "kv_heads": hkv, "head_dim": d,
        "value_head_dim": v.shape[3], "softcap": _float_bits(spec.softcap),
        "sinks": -2 if sinks is None else sink_digest,  # their values: ranks must agree
        "alibi_slopes": -2 if slopes is None else zlib.crc32(struct.pack(f"<{h}d", *slopes)) & 0x7FFFFFFF,
        "dtype": _DTYPES.index(q.dtype), "device": _DEVICES.index(q.device.type),
        "layout": _LAYOUT_NAMES.index(lay.name), "seqlen": seqlen, "causal": int(causal),
        "window_left": spec.window_size[0], "window_right": spec.window_size[1],
        "softmax_scale": _float_bits(softmax_scale),
        "kernel": names.index(kern.name) if kern.name in names else len(names),
        "needs_grad": int(torch.is_grad_enabled() and any(
            t is not None and t.requires_grad for t in (q, k, v, sinks))),
        "cu_seqlens": cu_digest,  # before the mask: documents are part of the mask's digest
        "mask": digest if valued is None else valued,
        "mask_view": 0, "mask_next_view": 0,  # set by _agreed for masks with functions
        "last_step": 0 if plan is None else plan.last_step,
        "return_lse": int(bool(return_lse)),
        "strategy": 0, "grads": 0, "heads_k_stride": 0,  # set by the strategies
    }
    return Checked(spec, plan, kern, lay, full_mask, fields)


def _alibi_slopes(alibi_slopes, heads: int):
    """ALiBi slopes as a tuple of H floats (None for None)."""
    if alibi_slopes is None:
        return None
    if isinstance(alibi_slopes, torch.Tensor):
        if alibi_slopes.requires_grad:
            raise TypeError("alibi_slopes are constants (no gradient), as in flash-attn")
        values = alibi_slopes.detach().to("cpu", torch.float64).reshape(-1).tolist()
        shape = tuple(alibi_slopes.shape)
    elif isinstance(alibi_slopes, (list, tuple)):
        values, shape = [float(x) for x in alibi_slopes], (len(alibi_slopes),)
    else:
        raise TypeError(f"alibi_slopes must be a tensor or a list of H floats, got "
                        f"{type(alibi_slopes).__name__}")
    if shape != (heads,):
        raise ValueError(f"alibi_slopes must have shape [H]=[{heads}], got {shape}")
    if not all(math.isfinite(x) for x in values):
        raise ValueError(f"alibi_slopes must be finite, got {values}")
    return tuple(values)


_FIELD_NAMES = (
    "batch", "local_len", "heads", "kv_heads", "head_dim", "value_head_dim", "softcap", "sinks",
    "alibi_slopes",
    "dtype", "device", "layout",
    "seqlen", "causal", "window_left", "window_right", "softmax_scale", "kernel", "needs_grad",
    "cu_seqlens", "mask", "mask_view", "mask_next_view", "last_step", "return_lse", "strategy",
    "grads", "heads_k_stride", "caller",
)
"""What every call agrees on, whatever its strategy (the same row on every rank, so ranks
that chose different strategies get an error, not mismatched collectives)."""

STRATEGY_NAMES = ("ring", "ulysses", "allgather", "hybrid")


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
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
    """Exact attention over a sequence sharded across the ranks of ``group``.

    Every rank passes its shard of one global sequence (as made by ``ringattn.shard`` with
    the same ``layout``); every rank gets the attention output for its own queries over
    ALL keys of the sequence, as if one device had computed it, forward and backward.

    Causal and window alignment, in GLOBAL positions (query i, key j; window (2, 1)):

        causal=True        window_size=(2, 1)     causal=True, window_size=(2, -1)
        1 0 0 0 0          1 1 0 0 0              1 0 0 0 0
        1 1 0 0 0          1 1 1 0 0              1 1 0 0 0
        1 1 1 0 0          1 1 1 1 0              1 1 1 0 0
        1 1 1 1 0          0 1 1 1 1              0 1 1 1 0
        1 1 1 1 1          0 0 1 1 1              0 0 1 1 1

    Arguments:
        q: [B, S_local, H, D] this rank's queries.
        k, v: [B, S_local, Hkv, D] this rank's keys and values; H % Hkv == 0 (GQA/MQA).
            They travel the ring with their own Hkv heads. v may have its own head dim Dv
            (MLA: [B, S_local, Hkv, Dv]); out then has Dv.
            Under ``torch.autocast`` q, k, v are cast to the autocast dtype (as SDPA is),
            so q, k, v of mixed dtypes from a model under autocast work; the result is in
            that dtype. Outside autocast they must share a dtype.
        group: a ProcessGroup, a 1-D DeviceMesh, or None for the default group.
        causal: query i sees key j only if j <= i.
        window_size: (left, right), as in flash-attn: query i sees key j iff
            i - left <= j <= i + right; -1 is unbounded on that side.
        softmax_scale: scale of q.k before the softmax; default 1 / sqrt(D).
        layout: "zigzag" (the default everywhere: shard, unshard, positions, shard_batch),
            "contiguous" or "striped": how global tokens were placed on ranks. A tensor
            made by ``ringattn.shard`` remembers its layout, S and documents; passing it
            with others raises.
        seqlen: the global S (any value >= 1). Defaults to cu_seqlens[-1], else
            W * S_local. Shards hold ``layout.local_len(S, W)`` tokens; slots past S are
            padding, masked as keys and yielding zeros as queries.
        mask: a ``ringattn.masks.Mask`` (or its int key from ``masks.mask_key``, which is
            what compiled code should pass: a graph guards on the int's value, not on the
            mask object): any function of GLOBAL (batch, head, q_pos,
            kv_pos), e.g. ``masks.document(cu) & masks.causal()``, ``masks.prefix_lm(n)``,
            ``masks.dilated(...)`` or ``masks.from_function(mask_mod)``. It is and-ed with
            ``causal``/``window_size`` and the document mask of ``cu_seqlens``. Blocks are
            classified empty (skipped), full (unmasked kernel) or partial (masked) once per
            (mask, layout, S, W, B, H) and the result is reused. Rows that see no key give
            out = 0 and lse = -inf.
        cu_seqlens: [n_docs + 1] ints (flash-attn's convention, global, starting at 0 and
            ending at S): packed documents. Implies the document mask (no token attends
            across a document boundary); with ``layout="zigzag"`` the layout is zigzag per
            document (``layouts.DocumentZigzag``), balancing every document's causal work.
            Shard with ``ringattn.shard(..., cu_seqlens=...)``.
        return_lse: also return the log-sum-exp of the scaled scores per query row.
        kernel: None/"auto", a name from ``ringattn.kernels.available_kernels()``, or a
            ``Kernel`` object: the local block kernel.
        backward_overlap: what the backward sends while its kernels run: "all" (next K/V
            and the dK/dV accumulators; fastest), "kv" (next K/V only: one accumulator
            fewer alive) or "none" (nothing: no receive buffer alive during the kernels;
            leanest, every hop exposed). Measured peaks per rank at W=4 relative to
            "all": "kv" 0.91x, "none" about 0.8x (benchmarks/RESULTS.md); ranks may differ.
        softcap: > 0 soft-caps the scaled scores to ``softcap * tanh(s / softcap)`` before
            the softmax (Gemma 2's ``attn_logit_softcapping``; flash-attn's ``softcap``).
            Computed exactly by the reference kernel (fused SDPA ops cannot; row tiles of
            256 queries bound its memory).
        sinks: [H] float tensor (gpt-oss's ``sinks``, differentiable): one extra logit per
            head in every row's softmax denominator, with value 0 (a row then sums to less
            than 1). lse includes it. Its gradient on each rank is the share of this rank's
            queries: sum it over the group, as any parameter's under CP.
        alibi_slopes: [H] floats (flash-attn's ``alibi_slopes``, constants): adds
            ``-alibi_slopes[h] * |i - j|`` to the score of query i and key j (GLOBAL
            positions, after soft-capping). Computed by the reference kernel.

    Returns:
        out [B, S_local, H, Dv] in q's dtype, or (out, lse) with lse [B, H, S_local] float32
        (float64 for float64 inputs; -inf for rows that see no key, such as padding). lse is
        differentiable (for LSE merges such as LongNet's mixture, Eagle3's TTT keys): when
        any rank's lse receives a gradient, the backward carries it in 8 extra head-dim
        columns (one small all-reduce decides, so ranks agree).

    Raises:
        TypeError, ValueError: on bad input or when ranks disagree on shapes or options; the
            same error is raised on every rank, before any ring communication.
    """
    q, k, v = autocast_inputs(q, k, v)
    if torch.compiler.is_compiling():  # opaque custom ops: see ringattn.ops
        if kernel is not None and not isinstance(kernel, str):
            raise TypeError("under torch.compile, kernel must be a name or None")
        out, lse = compiled_ring_attention(
            q, k, v, group_name=resolve_group(group).group_name, causal=causal,
            window_size=window_size,
            softmax_scale=1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale),
            layout=layout, seqlen=seqlen, cu_seqlens=cu_seqlens,
            mask_key=mask if isinstance(mask, int) else mask_key(mask),
            return_lse=bool(return_lse), kernel=kernel or "auto",
            backward_overlap=backward_overlap, softcap=float(softcap), sinks=sinks,
            alibi_slopes=alibi_slopes)
        return (out, lse) if return_lse else out
    ring = build_ring(
        q, k, v, group=group, causal=causal, window_size=window_size,
        softmax_scale=softmax_scale, layout=layout, seqlen=seqlen, mask=mask,
        cu_seqlens=cu_seqlens, return_lse=return_lse, kernel=kernel,
        backward_overlap=backward_overlap, softcap=softcap, sinks=sinks,
        alibi_slopes=alibi_slopes,
    )
    q, k, v = unit_stride(q, k, v)
    with _no_autocast(q.device.type):  # the kernels accumulate in fp32 themselves
        out, lse = _RingAttention.apply(q, k, v, sinks, ring, bool(return_lse))
    return (out, lse) if return_lse else out


def ulysses_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    layout: str = DEFAULT_LAYOUT,
    seqlen: int | None = None,
    mask: Mask | None = None,
    cu_seqlens=None,
    return_lse: bool = False,
    kernel=None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes=None,
):
    """``ring_attention``'s computation by Ulysses' all-to-all: the same arguments, shards,
    semantics and guarantees (exact; the same error on every rank before any collective).

    Each rank sends every other rank the heads it will attend with, for its own tokens (one
    all-to-all each for q, k, v), attends over the WHOLE sequence for its share of the
    heads, and sends the outputs back (one all-to-all; one more for lse). Any H, Hkv and
    W: heads split as evenly as possible (a rank may get none when H < W); kv heads are
    sent only to the ranks whose query heads read them, replicated only where a rank's
    query heads do not cover whole kv groups (see ``ringattn.ulysses``). Head-dependent
    masks see global head indices.

    Memory contract: a rank holds q, k, v and out of the whole sequence for its ~H/W heads
    (S x H/W, the same size as its shards of all heads), no tensor of all heads x S.

    Arguments, Returns, Raises: as ``ring_attention`` (no ``backward_overlap``: nothing is
    overlapped). sinks' gradient on each rank covers its own heads; sum it over the group.
    """
    return _split_heads_entry(
        "ulysses", q, k, v, group=group, causal=causal, window_size=window_size,
        softmax_scale=softmax_scale, layout=layout, seqlen=seqlen, mask=mask,
        cu_seqlens=cu_seqlens, kernel=kernel, return_lse=return_lse, softcap=softcap,
        sinks=sinks, alibi_slopes=alibi_slopes, backward_overlap="all")


def hybrid_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group,
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
    that a Ulysses group is one node. Each rank all-to-alls its shard over its Ulysses group
    (getting the U shards of that group for ~H/U heads, as ``ulysses_attention``), then the
    R groups run the ring over those unions (``layouts.Grouped``: zigzag over W grouped by
    U is zigzag over R, so causal work stays balanced), then the outputs go back.

    Memory contract: a rank holds S / R tokens of ~H/U heads (the size of its shards of all
    heads, times U/U), and the ring's one visiting K/V block of that size.

    Arguments, Returns, Raises: as ``ring_attention``. sinks' gradient on each rank covers
    its own heads and queries; sum it over the mesh.
    """
    return _split_heads_entry(
        "hybrid", q, k, v, group=group, causal=causal, window_size=window_size,
        softmax_scale=softmax_scale, layout=layout, seqlen=seqlen, mask=mask,
        cu_seqlens=cu_seqlens, kernel=kernel, return_lse=return_lse, softcap=softcap,
        sinks=sinks, alibi_slopes=alibi_slopes, backward_overlap=backward_overlap)


def _split_heads_entry(strategy: str, q, k, v, **kwargs):
    """``ulysses_attention`` and ``hybrid_attention``: under torch.compile their custom op
    pair (``ringattn.ops``), else ``split_heads_attention``."""
    if torch.compiler.is_compiling():
        return compiled_heads_attention(strategy, *autocast_inputs(q, k, v), **kwargs)
    return split_heads_attention(q, k, v, strategy=strategy, **kwargs)


@dataclass(frozen=True)
class _Topology:
    """Where a head-splitting strategy runs: ``flat`` (every rank, shard order) is the
    Ulysses dimension (``uly``, U ranks, this rank u) x the ring dimension (``ring``, R
    ranks, this rank r), with flat rank r * U + u. Pure Ulysses has R = 1."""

    flat: dist.ProcessGroup
    uly: dist.ProcessGroup | None
    u: int
    U: int
    ring: dist.ProcessGroup | None
    r: int
    R: int
    mesh: bool = False
    """Made from the hybrid's 2-D mesh (else pure Ulysses over one group)."""
    error: Exception | None = None
    """Why this rank cannot run on this mesh (raised by every rank in the agreement)."""

    @staticmethod
    def ulysses(pg):
        w = dist.get_world_size(pg)
        return _Topology(pg, pg, dist.get_rank(pg), w, None, 0, 1)

    @staticmethod
    def hybrid(mesh):
        flat, ring, uly = mesh_groups(mesh)
        t = _Topology(flat, uly, dist.get_rank(uly), dist.get_world_size(uly), ring,
                      dist.get_rank(ring), dist.get_world_size(ring), mesh=True)
        # Every process group orders its members by global rank, while shards and the
        # hybrid's places go by mesh coordinate (ring r, Ulysses u at r * U + u): the two
        # agree on every rank exactly when the mesh lists its ranks in increasing order row
        # by row. A rank that sees a difference reports it in the agreement, so every rank
        # raises it (the others cannot see it from their own coordinates).
        coordinate = mesh.get_coordinate()
        if coordinate is None:
            raise ValueError(f"rank {dist.get_rank()} is not in the hybrid's mesh "
                             f"{mesh.mesh.tolist()}: call it only on the mesh's ranks")
        r, u = coordinate
        if (dist.get_rank(flat), t.r, t.u) != (r * t.U + u, r, u):
            return replace(t, error=ValueError(
                f"the hybrid's mesh places global rank {dist.get_rank()} at ring {r}, Ulysses "
                f"{u} (shard {r * t.U + u}), but torch orders the mesh's process groups by "
                f"global rank, which puts it at shard {dist.get_rank(flat)}: list the mesh's "
                f"ranks in increasing order row by row (make it with ra.hybrid_mesh(group, "
                f"ulysses=U) or init_device_mesh(..., mesh_dim_names={HYBRID_DIMS}))"))
        return t


@dataclass(frozen=True)
class _Heads:
    """One head-splitting call, agreed: this rank's query heads [lo, hi) of ``split``, the
    exchanges that move them (None when U = 1) and the ring over the unions."""

    topo: _Topology
    checked: Checked
    split: object
    lo: int
    hi: int
    layout: Layout
    spec: AttnSpec
    steps: int
    ex_q: Exchange | None
    ex_kv: Exchange | None

    def ring(self, backward_overlap: str) -> Ring:
        comm = LocalComm() if self.topo.R == 1 else RingComm(self.topo.ring)
        return Ring(comm, self.spec, self.checked.plan, self.checked.kernel, self.steps,
                    backward_overlap, self.layout)


def _heads_setup(q, k, v, topo: _Topology, *, return_lse, sinks, backward_overlap, steps=None,
                 extra_fields=(), extra_check=None, **args) -> _Heads:
    """Validate, agree and plan a head-splitting call (``steps`` None), or rebuild one that
    was agreed in its forward from the cached plan and the ``steps`` it agreed on."""

    def check():  # which inputs need a gradient decides which reverse all-to-alls run
        if topo.error is not None:
            raise topo.error
        wants = [bool(getattr(t, "requires_grad", False)) for t in (q, k, v, sinks)]
        own = () if extra_check is None else tuple(extra_check())
        return (sum(int(w) << i for i, w in enumerate(wants)), *own)

    mine = {}  # this rank's heads and the ring's spec and plan for them

    def planner(c: Checked) -> Plan:
        split = head_split(c.fields["heads"], c.fields["kv_heads"], topo.U)
        lo, hi = split.q_range(topo.u)
        lay = grouped(c.layout, topo.U, topo.R)
        spec, plan = _heads_plan(c, lo, hi, lay, topo.R, topo.r, c.fields["batch"], q.device) \
            if hi > lo else (c.spec, Plan(((),) * topo.R))
        mine.update(split=split, lo=lo, hi=hi, layout=lay, spec=spec, mask=c.mask)
        return plan

    def region(j):  # what flat rank j's plan evaluates: its ring rank's rows, its heads
        lo_j, hi_j = mine["split"].q_range(j % topo.U)
        return mine["layout"], head_offset(mine["mask"], lo_j), topo.R, j // topo.U, hi_j - lo_j

    if steps is None:
        _, _, checked, last = _agreed(
            q, k, v, topo.flat, ("grads", *extra_fields), check, planner=planner, region=region,
            return_lse=return_lse, strategy="hybrid" if topo.mesh else "ulysses",
            sinks=sinks, backward_overlap=backward_overlap, **args)
        steps = last + 1 if topo.R > 1 else 1
    else:  # agreed in the forward: validation again, no exchange
        checked = _check_local(
            q, k, v, RingComm(topo.flat), args["causal"], args["window_size"],
            args["softmax_scale"], args["layout"], args["seqlen"], args["mask"],
            args["cu_seqlens"], args["kernel"], backward_overlap, return_lse, topo.flat,
            args["softcap"], sinks, args["alibi_slopes"], plan_ring=False)
        checked = replace(checked, plan=planner(checked))
    split, lay, s = mine["split"], mine["layout"], checked.spec.seqlen
    ex_q = ex_kv = None
    if topo.U > 1:
        ex_q, ex_kv = (Exchange(topo.uly, topo.u, topo.U, heads, lay, topo.r, topo.R, s)
                       for heads in (split.q_heads, split.kv_heads))
    return _Heads(topo, checked, split, mine["lo"], mine["hi"], lay, mine["spec"], steps,
                  ex_q, ex_kv)


def _split_heads_attention(q, k, v, topo: _Topology, *, return_lse, sinks, backward_overlap,
                           extra_kv=(), core=None, extra_fields=(), extra_check=None, **args):
    """Ulysses over ``topo.uly`` (~H/U heads of the U members' shards on each rank), the ring
    over ``topo.ring`` on those unions, and back (see ``ulysses_attention`` and
    ``hybrid_attention``).

    ``extra_kv`` are more [B, L, Hkv, E] tensors sent with K/V (Eagle3's cached keys), and
    ``core(ring, q, k, v, extra_kv, sinks)`` -> (out, lse or None) replaces the attention
    on the gathered heads (default: ``_RingAttention``); ``extra_fields``/``extra_check``
    as ``build_ring``'s."""
    q, k, v = autocast_inputs(q, k, v)
    hd = _heads_setup(q, k, v, topo, return_lse=return_lse, sinks=sinks,
                      backward_overlap=backward_overlap, extra_fields=extra_fields,
                      extra_check=extra_check, **args)
    b, h = q.shape[0], q.shape[2]
    lo, hi, ex_q = hd.lo, hd.hi, hd.ex_q
    if topo.U > 1:  # [B, U*L, heads_u, D] each
        q_f, k_f, v_f, *extra_f = seq_to_heads((ex_q, *[hd.ex_kv] * (2 + len(extra_kv))),
                                               q, k, v, *extra_kv)
    else:
        q_f, k_f, v_f, extra_f = q, k, v, list(extra_kv)
    with _no_autocast(q.device.type):
        if hi > lo:
            ring = hd.ring(backward_overlap)
            heads_sinks = None if sinks is None else sinks[lo:hi]
            q_f, k_f, v_f, *extra_f = unit_stride(q_f, k_f, v_f, *extra_f)
            if core is None:
                out_f, lse_f = _RingAttention.apply(q_f, k_f, v_f, heads_sinks, ring,
                                                    bool(return_lse))
            else:
                out_f, lse_f = core(ring, q_f, k_f, v_f, extra_f, heads_sinks)
        else:  # no head here; still part of the autograd graph, so backward's collectives run
            # a 0 that depends on every differentiable input (the only one needing a
            # gradient may be the sinks); empty slices, so an infinite sink stays out of it
            zero = sum(t.reshape(-1)[:0].sum().to(q_f.dtype)
                       for t in (q_f, k_f, v_f, *extra_f, *([] if sinks is None else [sinks])))
            out_f = q_f.new_zeros(b, q_f.shape[1], 0, v.shape[3]) + zero.to(q.dtype)
            lse_f = zero.new_zeros(b, 0, q_f.shape[1], dtype=accumulator_dtype(q.dtype)) + zero
    if topo.U == 1:
        return (out_f, lse_f) if return_lse else out_f
    if not return_lse:
        return heads_to_seq(ex_q, h, out_f)[0]
    out, lse_BLH1 = heads_to_seq(ex_q, h, out_f, lse_f.transpose(1, 2).unsqueeze(-1))
    return out, lse_BLH1.squeeze(-1).transpose(1, 2)


def split_heads_attention(q, k, v, *, group, strategy: str, **kwargs):
    """Ulysses (``strategy="ulysses"``, ``group`` a group) or the hybrid (``"hybrid"``,
    ``group`` its 2-D mesh) with ``_split_heads_attention``'s hooks, for attention
    variants built on them (Eagle3's TTT)."""
    if strategy == "hybrid":
        if not is_hybrid_mesh(group):
            what = (f"a {group.ndim}-D DeviceMesh" if hasattr(group, "ndim")
                    else type(group).__name__)
            raise TypeError(f"strategy='hybrid' takes group= a 2-D DeviceMesh with "
                            f"mesh_dim_names={HYBRID_DIMS}, got {what}")
        topo = _Topology.hybrid(group)
    else:
        topo = _Topology.ulysses(resolve_group(group))
    return _split_heads_attention(q, k, v, topo, **kwargs)


def allgather_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
    causal: bool = False,
    window_size: tuple[int, int] = (-1, -1),
    softmax_scale: float | None = None,
    layout: str = DEFAULT_LAYOUT,
    seqlen: int | None = None,
    mask: Mask | None = None,
    cu_seqlens=None,
    return_lse: bool = False,
    kernel=None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    alibi_slopes=None,
    heads_k_stride: int | None = None,
):
    """``ring_attention``'s computation by all-gathering K/V (Llama 3's CP): the same
    arguments, shards, semantics and guarantees.

    Every rank gathers the K/V of the whole sequence, ``heads_k_stride`` kv heads at a time
    (all at once by default), attends its own queries to them with the ring's plan (empty
    tiles skipped), and sends dK/dV home by reduce-scatter; the backward gathers K/V again
    instead of keeping them.

    Memory contract: K/V of the WHOLE sequence for ``heads_k_stride`` kv heads (and their
    dK/dV in the backward) at a time: S x heads_k_stride x (D + Dv), not O(S / W).

    Arguments, Returns, Raises: as ``ring_attention``, and
        heads_k_stride: kv heads gathered at a time (divides Hkv; None: all of them).
    """
    q, k, v = autocast_inputs(q, k, v)
    if torch.compiler.is_compiling():  # one opaque op: see ringattn.ops
        return compiled_allgather_attention(
            q, k, v, group=group, causal=causal,
            window_size=window_size, softmax_scale=softmax_scale, layout=layout, seqlen=seqlen,
            mask=mask, cu_seqlens=cu_seqlens, return_lse=return_lse, kernel=kernel,
            softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes, heads_k_stride=heads_k_stride)

    def stride_field():
        if not isinstance(k, torch.Tensor) or k.dim() != 4:
            return (-1,)  # the checks that follow report k
        n = k.shape[2] if heads_k_stride is None else heads_k_stride
        if not isinstance(n, int) or isinstance(n, bool) or n < 1 or k.shape[2] % n:
            raise ValueError(f"heads_k_stride must divide the {k.shape[2]} kv heads, got "
                             f"{heads_k_stride!r}")
        return (n,)

    pg, comm, checked, _ = _agreed(
        q, k, v, group, ("heads_k_stride",), stride_field, strategy="allgather", causal=causal,
        window_size=window_size,
        softmax_scale=softmax_scale, layout=layout, seqlen=seqlen, mask=mask,
        cu_seqlens=cu_seqlens, kernel=kernel, return_lse=return_lse, softcap=softcap,
        sinks=sinks, alibi_slopes=alibi_slopes)
    spec, lay = checked.spec, checked.layout
    hkv, stride = k.shape[2], checked.fields["heads_k_stride"]
    b, n, h, _ = q.shape
    world, rank, s = comm.world, comm.rank, spec.seqlen
    per = h // hkv
    q_pos = kv_pos = None  # global positions, for ALiBi only
    if spec.alibi_slopes is not None:
        q_pos = local_positions(lay, rank, world, s)
        kv_pos = torch.cat([local_positions(lay, r, world, s) for r in range(world)])
    groups = []
    for a in range(0, hkv, stride):
        qa, qb = a * per, (a + stride) * per
        spec_g, plan = _heads_plan(checked, qa, qb, lay, world, rank, b, q.device)
        ring = local_ring(spec_g, plan, checked.kernel, lay, world, rank, n, q_pos, kv_pos)
        groups.append(GatherGroup(a, a + stride, qa, qb, ring))
    q, k, v = unit_stride(q, k, v)
    with _no_autocast(q.device.type):
        out, lse = allgather_attention_apply(q, k, v, sinks, groups, pg, world, bool(return_lse))
    return (out, lse) if return_lse else out


def _heads_plan(checked: Checked, lo: int, hi: int, layout: Layout, world: int, rank: int,
                batch: int, device) -> tuple[AttnSpec, Plan]:
    """The call's spec and the ring plan of ``rank`` for query heads [lo, hi) only (their
    ALiBi slopes; the mask sees global head indices), for strategies that split heads."""
    spec = checked.spec
    slopes = None if spec.alibi_slopes is None else spec.alibi_slopes[lo:hi]
    spec = replace(spec, layout=layout.name, alibi_slopes=slopes)
    mask = head_offset(checked.mask, lo)
    plan = make_plan(layout, mask, world, rank, spec.seqlen, batch=batch, heads=hi - lo,
                     device=device, tile=getattr(checked.kernel, "tile", (256, 128)),
                     digest=fingerprint(mask, spec.seqlen, batch, hi - lo, device))
    return spec, plan


def autocast_inputs(q, k, v):
    """q, k, v in the autocast dtype when autocast is on for their device (as SDPA does:
    attention is one of autocast's lower-precision ops), else as they are."""
    if not all(isinstance(t, torch.Tensor) for t in (q, k, v)):
        return q, k, v  # reported by the checks
    dev = q.device.type
    if dev not in _DEVICES or not torch.is_autocast_enabled(dev):
        return q, k, v
    dtype = torch.get_autocast_dtype(dev)
    # autocast's own rule: float32/16 tensors are cast, float64 ones are left alone
    low = (torch.float32, torch.float16, torch.bfloat16)
    return tuple(t.to(dtype) if t.dtype in low else t for t in (q, k, v))


def _no_autocast(device_type: str):
    """Autocast off around our own ops: the kernels choose their accumulation dtypes."""
    return torch.autocast(device_type, enabled=False)


def unit_stride(*tensors):
    """Kernels need unit stride on the head dim (views of a fused qkv projection may not
    have it)."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)


def build_ring(q, k, v, *, group, causal, window_size, softmax_scale, layout, seqlen, mask,
               cu_seqlens, return_lse, kernel, backward_overlap, softcap=0.0, sinks=None,
               alibi_slopes=None, extra_fields=(), extra_check=None) -> Ring:
    """Validate every rank's inputs, agree on them in one metadata exchange, plan the ring.

    ``extra_check`` (optional) runs inside the validation: it checks a caller's own inputs
    and returns ints for ``extra_fields`` (in that order) that every rank must agree on too
    (e.g. Eagle3's step count), or raises TypeError/ValueError, which every rank reports.

    Raises:
        TypeError, ValueError: the same error on every rank, before any ring communication.
    """
    pg, comm, checked, last = _agreed(
        q, k, v, group, extra_fields, extra_check, plan_ring=True, causal=causal,
        window_size=window_size, softmax_scale=softmax_scale, layout=layout, seqlen=seqlen,
        mask=mask, cu_seqlens=cu_seqlens, kernel=kernel, backward_overlap=backward_overlap,
        return_lse=return_lse, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes)
    return Ring(comm, checked.spec, checked.plan, checked.kernel, last + 1, backward_overlap,
                checked.layout)


def _agreed(q, k, v, group, extra_fields, extra_check, *, plan_ring=False, planner=None,
            region=None, backward_overlap="all", strategy="ring", **args):
    """Validate this rank's call (planning its ring with ``plan_ring``, or with
    ``planner(checked)`` for strategies whose ring is not over ``group``), add the ints
    ``extra_check()`` returns for ``extra_fields`` (it runs first and may raise only
    TypeError/ValueError), and agree with every rank
    in one metadata exchange: (group, comm, Checked, the last ring step any rank needs).

    A mask with a user function in it is compared on every position a rank's plan
    evaluates: each rank digests its own region and the next rank's (``region(j)`` ->
    (layout, mask, ring world, ring rank, heads) of group rank j, after ``planner``; by
    default rank j's shard of the ring over ``group``, all heads), and ``agree`` compares
    the two digests of every region.

    Raises:
        TypeError, ValueError: the same error on every rank, before any other collective.
    """
    pg = resolve_group(group)
    comm = RingComm(pg)
    error, fields, checked = None, dict.fromkeys(_FIELD_NAMES + tuple(extra_fields), -1), None
    site = caller_site()
    try:
        # first: a caller's own inputs get its own messages (Eagle3's key sets); it must
        # raise only TypeError/ValueError whatever q, k, v are
        extra = () if extra_check is None else tuple(extra_check())
        checked = _check_local(
            q, k, v, comm, args["causal"], args["window_size"], args["softmax_scale"],
            args["layout"], args["seqlen"], args["mask"], args["cu_seqlens"], args["kernel"],
            backward_overlap, args["return_lse"], pg, args["softcap"], args["sinks"],
            args["alibi_slopes"], plan_ring=plan_ring)
        fields = dict(checked.fields)
        fields.update(zip(extra_fields, extra, strict=True))
        fields["strategy"] = STRATEGY_NAMES.index(strategy)
        fields["caller"] = site_digest(site)
        plan = checked.plan if planner is None else planner(checked)
        if planner is not None:
            fields["last_step"] = plan.last_step
        if comm.world > 1 and value_digest(checked.mask) is None:
            if region is None:
                def region(j, c=checked):
                    return c.layout, c.mask, comm.world, j, c.fields["heads"]
            s, b, dev = checked.spec.seqlen, checked.fields["batch"], str(q.device)
            fields["mask_view"], fields["mask_next_view"] = (
                view_digest(lay, m, w, r, s, b, h, dev)
                for lay, m, w, r, h in map(region, (comm.rank, (comm.rank + 1) % comm.world)))
        checked = replace(checked, fields=fields, plan=plan)
    except (TypeError, ValueError) as exc:  # reported on every rank by agree() below
        error = exc
    def describe(name, value):
        if name != "caller":
            return _describe(name, value)
        if value == 0:
            return "the caller check off (ringattn.comm.set_caller_check)"
        return (f"a call from the source line with digest {value} (a rank made an extra "
                f"ringattn call or skipped one; ranks that call from different lines on "
                f"purpose: ringattn.comm.set_caller_check(False) on every rank)")

    try:
        last = agree(pg, fields, error, describe, reduce=("last_step",), chained=(
            ("mask_view", "mask_next_view",
             "the mask (it evaluates differently on their processes: a mask function that "
             "reads rank-local data? build it from the same values on every rank) on the "
             "positions"),)
        )["last_step"]
    except ValueError as exc:  # the same message everywhere; each rank adds its own site
        if "disagree on caller" in str(exc):
            exc.add_note(f"rank {dist.get_rank()} made this call from {site}")
        raise
    return pg, comm, checked, last


# the custom ops build on the functions above (torch.compile's entry into the ring)
from .ops import (compiled_allgather_attention, compiled_heads_attention,  # noqa: E402
                  compiled_ring_attention)


STRATEGIES = {"ring": ring_attention, "ulysses": ulysses_attention,
              "allgather": allgather_attention, "hybrid": hybrid_attention}
"""Strategy name -> its attention function (the same arguments; ``backward_overlap`` is the
ring's own, ``heads_k_stride`` all-gather's)."""


STRATEGY_CHOICES = ("auto", *STRATEGY_NAMES)
"""What ``strategy=`` takes wherever it is an argument (``ringattn.attention``)."""


def check_strategy(strategy, group=None) -> str:
    """``strategy`` if it names one of ``STRATEGY_CHOICES`` (and, with ``group`` given,
    "hybrid" only with the hybrid's 2-D mesh).

    Raises:
        ValueError: any other value, with the valid names.
    """
    if not isinstance(strategy, str) or strategy not in STRATEGY_CHOICES:
        raise ValueError(f"unknown strategy {strategy!r}; choose one of {list(STRATEGY_CHOICES)}")
    if strategy == "hybrid" and group is not None and not is_hybrid_mesh(group):
        raise ValueError(f"strategy='hybrid' needs group= a 2-D DeviceMesh with "
                         f"mesh_dim_names={HYBRID_DIMS}, got {type(group).__name__}")
    return strategy
