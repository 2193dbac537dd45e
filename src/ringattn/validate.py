"""What every strategy does before it communicates: validate one rank's call, describe it
as ints every rank must agree on, agree (``comm.agree``), and plan. No strategy logic.

Legend: B batch, L local seq (S_pad / W), S global seq, H heads, Hkv kv heads, D head dim
(Dv of the values), W world size.

* ``check_local``: this rank's inputs -> ``Checked`` (spec, plan, kernel, layout, mask and
  the fields of the agreement), or a TypeError/ValueError naming the bad value.
* ``agreed``: ``check_local`` on every rank, then one metadata exchange, so that bad or
  inconsistent input raises the same error on every rank before any other collective.
* ``heads_plan``: the ring plan of a subset of the query heads (strategies that split heads).
* ``option_value``, ``option_text``: an option's value as every agreement of options
  compares it (numbers by value, a tensor option by its shape and values).
* ``check_strategy``, ``STRATEGY_NAMES``, ``STRATEGY_CHOICES``: strategy names.
* autocast and stride helpers every strategy's entry applies; ``op_call_args`` and
  ``op_tensors``: the plain values of the compiled op pairs and back.
"""

from __future__ import annotations

import contextvars
import enum
import functools
import hashlib
import math
import numbers
import struct
import zlib
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist

from .comm import (HYBRID_DIMS, RingComm, agree, caller_site, control_group, group_by_name, group_members,
                   is_hybrid_mesh, resolve_group, site_digest)
from .kernels import available_kernels, get_kernel
from .layouts import LAYOUT_NAMES, SHARD_TAG, Layout, check_origin, check_tag, get_layout, same_tag
from .masks import (Mask, check_cu_seqlens, check_length, document, fingerprint, head_offset,
                    registered_mask, sliding_window, value_digest)
from .plan import Plan, make_plan, view_digest
from .spec import BACKWARD_OVERLAP, AttnSpec

__all__ = ["Checked", "FIELD_NAMES", "STRATEGY_CHOICES", "STRATEGY_NAMES", "agreed",
           "caller_error", "differentiable_once", "tag_result",
           "autocast_inputs", "check_local", "check_strategy", "effective_mask", "heads_plan",
           "no_autocast", "op_call_args", "op_tensors", "optional_tensor", "option_text",
           "option_value", "unit_stride"]

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_DEVICES = ("cpu", "cuda")
_LAYOUT_NAMES = LAYOUT_NAMES


def _float_bits(x: float) -> int:
    return struct.unpack("<q", struct.pack("<d", x))[0]


def describe_field(name: str, value: int) -> str:
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


# ------------------------------------------------------------ an option's value, digested

def option_value(value):
    """The plain value an option stands for, by which the agreement compares it: a 0-d
    tensor that does not require grad (under grad mode) is its ``.item()``; a real number
    (int, float, a numpy scalar, a complex with no imaginary part; never a bool) is an
    ``int`` when it is integral and else a ``float``, every NaN the one ``math.nan``; any
    other value is itself. So ``1``, ``1.0``, ``torch.tensor(1.0)`` and
    ``torch.tensor(1, dtype=torch.int8)`` are the same option, as ``==`` says; ``-0.0`` is
    ``0``; NaN agrees with NaN (a NaN option is not refused here: it is the same NaN call on
    every rank). A bool stays a bool: ``True`` and ``1`` differ (a flag is not a count, and
    the messages can say ``True``)."""
    if isinstance(value, torch.Tensor) and value.dim() == 0 and not (
            value.requires_grad and torch.is_grad_enabled()):
        try:
            value = value.detach().item()  # (a device sync for a GPU tensor)
        except (RuntimeError, NotImplementedError):  # meta or fake tensors: no value
            return value
    if isinstance(value, bool) or not isinstance(value, numbers.Complex):
        return value
    if not isinstance(value, numbers.Real):
        if value.imag != 0:
            return complex(value)
        value = value.real
    if isinstance(value, numbers.Integral):
        return int(value)
    f = float(value)
    if math.isnan(f):
        return math.nan
    return int(f) if f.is_integer() else f


def _number_text(n) -> str:
    if isinstance(n, complex):
        return f"complex({_number_text(option_value(n.real))}, {_number_text(option_value(n.imag))})"
    return "nan" if isinstance(n, float) and math.isnan(n) else repr(n)


_SMALL_TENSOR = 8
"""Tensor options of at most this many elements are written out value by value (in the
messages too); larger ones by a digest (blake2b) of their values."""


def _tensor_values(t: torch.Tensor) -> str:
    """A tensor's values as compared by ``option_text``: bools as bools, complex numbers as
    (real, imaginary) pairs, other numbers as float64 (exact for every float dtype and for
    integers up to 2**53; larger integer tensors are compared as int64), NaN as one NaN,
    -0.0 as 0.0; not its dtype or device."""
    data = t.detach()
    if data.layout != torch.strided:
        data = data.to_dense()
    data = data.to("cpu")
    if data.dtype == torch.bool:
        kind, data = "bools", data.to(torch.uint8)
    elif data.is_complex():
        kind, data = "complex", torch.view_as_real(data.to(torch.complex128))
    elif not data.is_floating_point() and data.numel() and int(data.abs().max()) > 1 << 53:
        kind, data = "ints", data.to(torch.int64)
    else:
        kind, data = "reals", data.to(torch.float64)
    if data.is_floating_point():
        data = torch.where(data.isnan(), math.nan, data) + 0.0  # one NaN; -0.0 + 0.0 = 0.0
    if data.numel() > _SMALL_TENSOR:
        digest = hashlib.blake2b(data.contiguous().numpy().tobytes(), digest_size=8)
        return f"{kind} with digest {digest.hexdigest()}"
    if kind == "bools":
        return repr([bool(x) for x in data.reshape(-1).tolist()])
    if kind == "complex":
        pairs = data.reshape(-1, 2).tolist()
        return "[" + ", ".join(_number_text(option_value(complex(a, b))) for a, b in pairs) + "]"
    return "[" + ", ".join(_number_text(option_value(x)) for x in data.reshape(-1).tolist()) + "]"


def _type_name(value) -> str:
    return f"an instance of {type(value).__module__}.{type(value).__qualname__}"


def option_text(value, other=_type_name, _depth: int = 0) -> str:
    """A text of an option's value, equal on two ranks exactly when they pass the same
    option (the one digest every agreement of options uses: ``ringattn.mixers``' arguments,
    ``context_parallel``'s keyword arguments and settings); readable, for the messages.

    Values compare as ``option_value`` says (``1 == 1.0 == torch.tensor(1.0)``, NaN ==
    NaN, ``True != 1``); a tensor of any other shape, or one that requires grad, by its
    shape, its values (``_tensor_values``: after promotion to float64, so the same values
    in float32 and float64 agree, while ``torch.tensor(0.1)`` and
    ``torch.tensor(0.1, dtype=torch.float64)`` differ, as their values do; never its device,
    whose index is each rank's own) and its requires_grad (it decides which gradients
    backward computes); tuples and lists alike, item by item; dicts by their items in
    sorted order; dtypes by name; devices by type. Anything else goes to ``other``
    (default: its type only), e.g. the mixers name a callable by its qualified name.

    Arguments:
        value: the option, as the caller passed it.
        other: text of a value that is none of the above (a callable, an object).
    """
    value = option_value(value)
    if value is None or isinstance(value, (bool, str, bytes)):
        return repr(value)
    if isinstance(value, (int, float, complex)):
        return _number_text(value)
    if isinstance(value, torch.Tensor):
        grad = ", requires_grad" if value.requires_grad and torch.is_grad_enabled() else ""
        try:
            values = _tensor_values(value)
        except (RuntimeError, NotImplementedError, TypeError):  # meta/fake: no values
            values = f"values unread ({value.dtype} on {value.device.type})"
        return f"tensor({list(value.shape)}, {values}{grad})"
    if isinstance(value, torch.dtype):
        return str(value)
    if isinstance(value, torch.device):
        return f"device {value.type}"  # the index is each rank's own
    if isinstance(value, enum.Enum):
        return f"{type(value).__module__}.{type(value).__qualname__}.{value.name}"
    if _depth < 8 and isinstance(value, (tuple, list)):
        return "(" + ", ".join(option_text(v, other, _depth + 1) for v in value) + ")"
    if _depth < 8 and isinstance(value, dict):
        items = sorted(f"{option_text(k, other, _depth + 1)}: {option_text(v, other, _depth + 1)}"
                       for k, v in value.items())
        return "{" + ", ".join(items) + "}"
    return other(value)


def effective_mask(spec: AttnSpec, mask: Mask | None, cu: tuple[int, ...] | None) -> Mask:
    """The user's mask & the document mask of ``cu_seqlens`` & the causal/window shorthands."""
    parts = [m for m in (mask, None if cu is None else document(cu)) if m is not None]
    if spec.left is not None or spec.right is not None or not parts:
        left, right = spec.left, spec.right
        parts.append(sliding_window(-1 if left is None else left, -1 if right is None else right))
    result = parts[0]
    for m in parts[1:]:
        result = result & m
    if spec.seqlen is not None:
        check_length(result, spec.seqlen)
    return result


def _dtensor_type():
    """torch's DTensor class, or None on builds without it (checked once, at import)."""
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # torch builds without distributed tensors
        return None
    return DTensor


_DTENSOR = _dtensor_type()


def _check_shard_origin(name, t, pg):
    """A tensor made by ``ringattn.shard`` was sharded along dim 1 of [B, S_local, H, D]
    and over the ranks of the group it is attended over (checked before its length)."""
    tag = getattr(t, SHARD_TAG, None)
    check_origin(name, t, group_members(pg), "attended",
                 1 if tag is not None and tag.ndim == 4 else None, 4,
                 " ([B, S_local, H, D], the sequence on dim 1): shard [B, S, H, D] tensors "
                 "with dim=1 (an SDPA-layout [B, H, S, D] tensor needs .transpose(1, 2) first)")



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


def check_local(q, k, v, comm, causal, window_size, softmax_scale, layout, seqlen, mask,
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
    given = seqlen is not None
    if seqlen is None:  # a shard's own S (ringattn.shard remembers it)
        tag = getattr(q, SHARD_TAG, None)
        if tag is None and world > 1:
            raise ValueError(
                f"q carries no shard tag (it was computed from a shard: a projection, a "
                f"reshape or a .clone() drops ringattn.shard's tag) and no seqlen= was given: "
                f"the global S cannot be read from S_local={n}, and if the shards were padded "
                f"(S not a multiple of the layout's unit), taking S = W x S_local = "
                f"{world * n} would attend the padding slots as real keys. Pass seqlen=, the "
                f"global S ({world * n} when the shards are unpadded)")
        seqlen = n * world if tag is None else tag.seqlen
    if not isinstance(seqlen, int) or isinstance(seqlen, bool) or seqlen < 1:
        raise ValueError(f"seqlen must be an int >= 1, got {seqlen!r}")
    cu_digest = -2 if cu is None else zlib.crc32(repr(cu).encode()) & 0x7FFFFFFF
    for name, t in (("q", q), ("k", k), ("v", v)):
        tag = getattr(t, SHARD_TAG, None)
        if tag is not None:  # its members are the group's (_check_shard_origin)
            check_tag(name, t, lay, seqlen, cu_digest, tag.members.index(dist.get_rank()),
                      len(tag.members), "attended")
    expected = lay.local_len(seqlen, world)
    if expected != n:
        said = (f"seqlen={seqlen}" if given else
                f"seqlen not given (taken as W x S_local = {world} x {n} = {seqlen}; pass "
                f"seqlen=, the global S, when the shards are padded)")
        raise ValueError(
            f"{said} with layout {lay.name!r} on {world} ranks gives shards of "
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
    full_mask = effective_mask(spec, mask, cu)
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
        "mask_view": 0, "mask_next_view": 0,  # set by agreed for masks with functions
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


FIELD_NAMES = (
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


def heads_plan(checked: Checked, lo: int, hi: int, layout: Layout, world: int, rank: int,
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


DOUBLE_BACKWARD = (
    "ringattn's attention is differentiable once: its backward (the ring's, Ulysses', "
    "all-gather's) has no backward of its own, so a gradient of its gradient (double "
    "backward, e.g. a gradient penalty through attention) cannot be computed; the first "
    "gradients taken with create_graph=True are exact")


class _RefuseTwice(torch.autograd.Function):
    """A gradient computed without a graph, passed through so that differentiating it
    raises ``DOUBLE_BACKWARD`` instead of silently treating it as a constant."""

    @staticmethod
    def forward(ctx, grad, *incoming):
        return grad.view_as(grad)

    @staticmethod
    def backward(ctx, *grads):
        raise ValueError(DOUBLE_BACKWARD)


def differentiable_once(backward):
    """Decorate an autograd Function's ``backward`` whose gradients are not differentiable
    (they come from collectives and fused kernels): under ``create_graph=True`` it runs
    without a graph, exact, and its gradients refuse a second differentiation by name, on
    every rank alike (each rank refuses before any communication of its own)."""

    @functools.wraps(backward)
    def wrapped(ctx, *grads):
        if not torch.is_grad_enabled():  # the usual backward: nothing to do
            return backward(ctx, *grads)
        with torch.no_grad():
            result = backward(ctx, *grads)
        # the gradients depend on the incoming gradients and on the saved inputs
        incoming = [t for t in (*grads, *getattr(ctx, "saved_tensors", ()))
                    if isinstance(t, torch.Tensor) and t.requires_grad]
        if not incoming:
            return result
        return tuple(_RefuseTwice.apply(g, *incoming) if isinstance(g, torch.Tensor) else g
                     for g in result)

    return wrapped


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
    # a cast shard is still the shard it was: its tag is checked as the input's
    return tuple(same_tag(t.to(dtype), t) if t.dtype in low else t for t in (q, k, v))


def tag_result(q, out, lse, return_lse: bool):
    """An attention call's (out, lse) or out, tagged as shards of the same placement as
    ``q`` when q is one (``unshard(out)`` then needs no seqlen): out along dim 1 of
    [B, L, H, D], lse along dim 2 of [B, H, L]."""
    tag = getattr(q, SHARD_TAG, None)
    if tag is not None:
        setattr(out, SHARD_TAG, tag._replace(dim=1, ndim=out.dim()))
        if return_lse:
            setattr(lse, SHARD_TAG, tag._replace(dim=2, ndim=lse.dim()))
    return (out, lse) if return_lse else out


def no_autocast(device_type: str):
    """Autocast off around our own ops: the kernels choose their accumulation dtypes."""
    return torch.autocast(device_type, enabled=False)


def unit_stride(*tensors):
    """Kernels need unit stride on the head dim (views of a fused qkv projection may not
    have it)."""
    return tuple(t if t.stride(-1) == 1 else t.contiguous() for t in tensors)




_CALLER_ERROR: contextvars.ContextVar = contextvars.ContextVar("ringattn_caller_error",
                                                               default=None)


class caller_error:
    """``with caller_error(error):`` the next ringattn call's agreement inside reports
    ``error`` (a TypeError/ValueError that a wrapper found in its own arguments on this
    rank, or None) on every rank, as if that call's own checks had raised it: a wrapper's
    checks (the compat layers' ``dropout_p``, a shard's tag) never raise on some ranks
    alone while the others wait in a collective. With None it does nothing (so compiled
    code traces through it); under torch.compile's tracing an error is raised at once."""

    def __init__(self, error: Exception | None):
        self.error, self._token = error, None

    def __enter__(self):
        if self.error is not None:
            if torch.compiler.is_compiling():
                raise self.error
            self._token = _CALLER_ERROR.set(self.error)
        return self

    def __exit__(self, *exc_info):
        if self._token is not None:
            _CALLER_ERROR.reset(self._token)
            self._token = None
        return False


def agreed(q, k, v, group, extra_fields, extra_check, *, plan_ring=False, planner=None,
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
    error, fields, checked = None, dict.fromkeys(FIELD_NAMES + tuple(extra_fields), -1), None
    site = caller_site()
    try:
        pending = _CALLER_ERROR.get()
        if pending is not None:  # a wrapper's own check failed on this rank
            raise pending
        # first: a caller's own inputs get its own messages (Eagle3's key sets); it must
        # raise only TypeError/ValueError whatever q, k, v are
        extra = () if extra_check is None else tuple(extra_check())
        checked = check_local(
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
            return describe_field(name, value)
        if value == 0:
            return "the caller check off (ringattn.comm.set_caller_check)"
        return (f"a call from the source line with digest {value} (a rank made an extra "
                f"ringattn call or skipped one; ranks that call from different lines on "
                f"purpose: ringattn.comm.set_caller_check(False) on every rank)")

    try:
        own = [f for f in extra_fields if f not in FIELD_NAMES]  # e.g. Eagle3's key sets
        what = "an attention call" + (f" with {', '.join(own)}" if own else "")
        last = agree(pg, fields, error, describe, reduce=("last_step",), what=what, chained=(
            ("mask_view", "mask_next_view",
             "the mask (it evaluates differently on their processes: a mask function that "
             "reads rank-local data? build it from the same values on every rank) on the "
             "positions"),)
        )["last_step"]
    except ValueError as exc:  # the same message everywhere; each rank adds its own site
        if "disagree on caller" in str(exc):
            exc.add_note(f"rank {dist.get_rank()} made this call from {site}")
        if str(exc).startswith("ranks disagree on cu_seqlens"):  # every rank is here
            raise ValueError(_documents_differ(pg, args["cu_seqlens"])) from exc
        hint = _DISAGREEMENT_HINTS.get(str(exc).partition(":")[0].removeprefix("ranks disagree on "))
        if hint is not None:
            raise ValueError(f"{exc} ({hint})") from exc
        raise
    return pg, comm, checked, last


_DISAGREEMENT_HINTS = {
    "local_len": "every rank's shard of one sequence has the same number of slots: a split "
                 "whose pieces differ in length (S not a multiple of W, or 2W for zigzag) "
                 "needs the shards ringattn.shard makes, which pad, and seqlen= the global S",
    "heads": "a tensor in SDPA's [B, H, S, D] layout is read as [B, S_local, H, D] when its H "
             "and S_local are swapped on some rank: transpose(1, 2) first",
    "kv_heads": "a tensor in SDPA's [B, H, S, D] layout is read as [B, S_local, H, D] when its "
                "H and S_local are swapped on some rank: transpose(1, 2) first",
}
"""What most likely makes ranks disagree on a field, added to the agreement's message."""


def _documents_differ(pg, cu_seqlens) -> str:
    """The message for ranks that passed different cu_seqlens, naming the first offset where
    they differ (one more exchange, of the offsets, made by every rank of the call)."""
    try:
        mine = None if cu_seqlens is None else list(check_cu_seqlens(cu_seqlens, None))
    except (TypeError, ValueError):
        mine = None
    world = dist.get_world_size(pg)
    every: list = [None] * world
    dist.all_gather_object(every, mine, group=control_group(pg))
    groups: dict = {}
    for r, cu in enumerate(every):
        groups.setdefault(None if cu is None else tuple(cu), []).append(r)
    (first, at_first), (other, at_other) = list(groups.items())[:2]

    def ranks(rs):
        return (f"rank {rs[0]} passes" if len(rs) == 1
                else "ranks " + ", ".join(map(str, rs)) + " pass")

    if first is None or other is None:
        def shown(cu):
            return "none" if cu is None else str(list(cu[:8]))[:-1] + (", ...]" if len(cu) > 8 else "]")
        return (f"ranks disagree on cu_seqlens: {ranks(at_first)} {shown(first)}, "
                f"{ranks(at_other)} {shown(other)}")
    i = next((i for i, (a, b) in enumerate(zip(first, other)) if a != b),
             min(len(first), len(other)))
    at = [c[i] if i < len(c) else f"nothing (only {len(c)} offsets)" for c in (first, other)]
    return (f"ranks disagree on cu_seqlens: at offset {i} {ranks(at_first)} {at[0]}, "
            f"{ranks(at_other)} {at[1]} (every rank passes the same global document offsets)")



def optional_tensor(t: torch.Tensor):
    return None if t.numel() == 0 else t



def op_call_args(cu_seqlens, group_name, causal, window_left, window_right, softmax_scale,
               layout, seqlen, mask_key, resolve=True):
    """The ring_attention arguments the op's plain values stand for (no ``group`` without
    ``resolve``)."""
    group = {"group": group_by_name(group_name)} if resolve else {}
    return dict(
        **group, causal=causal,
        window_size=(window_left, window_right), softmax_scale=softmax_scale,
        layout=layout, seqlen=None if seqlen < 0 else seqlen,
        mask=None if mask_key < 0 else registered_mask(mask_key),
        cu_seqlens=None if cu_seqlens.numel() == 0 else cu_seqlens.tolist(),
    )


def op_tensors(kernel, cu_seqlens, alibi_slopes):
    """(cu_seqlens, alibi_slopes) as the tensors the ops take (empty for None).

    Raises:
        TypeError: a kernel object (compiled calls name kernels).
    """
    if kernel is not None and not isinstance(kernel, str):
        raise TypeError("under torch.compile, kernel must be a name or None")
    cu = (torch.empty(0, dtype=torch.int64) if cu_seqlens is None
          else torch.as_tensor(cu_seqlens, dtype=torch.int64))
    slopes = (torch.empty(0, dtype=torch.float64) if alibi_slopes is None
              else torch.as_tensor(alibi_slopes, dtype=torch.float64))
    return cu, slopes



if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
