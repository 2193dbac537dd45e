"""The one mechanism: a chunk's affine state map and a causal convolution's halo, exchanged
in global chunk order.

Legend: B batch, L local seq (S_pad / W), S global seq, W world size, k conv kernel size.

A linear recurrence S_t = M_t . S_{t-1} + U_t (``.`` elementwise for a diagonal transition,
a matrix product for a matrix one) maps the state entering a chunk to the state leaving it
by an affine map S_out = M S_in + C, where M is the product of the chunk's transitions and
C the state it leaves from a zero entering state. Every rank computes (M, C) of its own
chunks, one all-gather hands every rank every chunk's (M, C), and each rank composes, in
global order, the maps of the chunks before each of its own: its true entering state, with
which it scans the chunk again for its outputs. A document start resets the state (the
chain of maps starts there). A causal convolution's halo, the k-1 inputs before a chunk,
travels in the same kind of exchange.

Gradients: the all-gather is an autograd function whose backward is the reduce-scatter of
the gathered table's gradient (each rank gets the sum over ranks of the gradient of its own
rows), and everything else is local autograd. Autograd through the composition and the
scans is the transposed scan, exactly, for every family, with no backward written per
family; the price is that the local scans' intermediates are kept, as in one process.
"""

from __future__ import annotations

import contextvars
import functools
import hashlib
import inspect
import math
import struct
import zlib

import torch
import torch.distributed as dist

from ..comm import ROW_INTS, agree, all_gather_single, caller_site, group_members, reduce_scatter_single, resolve_group, site_digest
from ..layouts import DEFAULT_LAYOUT, LAYOUT_NAMES, SHARD_TAG, check_origin, check_tag, get_layout
from ..masks import check_cu_seqlens
from ..validate import describe_field, option_text, option_value
from ._plan import Plan, conv_sources, make_plan

__all__ = ["Tie", "causal_conv1d", "gather_rows", "halo", "linear_recurrence"]

_DTYPES = (torch.float32, torch.float64, torch.bfloat16, torch.float16)
_KINDS = ("diagonal", "matrix")
_ACTIVATIONS = (None, "silu", "swish")


# ------------------------------------------------------------ every argument is agreed

_ELSEWHERE = frozenset({"group", "layout", "seqlen", "cu_seqlens", "error"})
"""Arguments the agreement does not digest as given: the group (the one it runs on), the
layout, S and documents (``_setup`` agrees on their resolved values, so ``seqlen=None`` and
the S it stands for agree), and ``linear_recurrence``'s ``error`` (this rank's own failure,
which the agreement raises on every rank by its flag)."""

_SETUP_FIELDS = ("batch", "local_len", "seqlen", "layout", "cu_seqlens", "dtype", "device",
                 "needs_grad", "caller")
_MAX_EXTRA = 2  # the most fields a function's own ``extra_check`` adds

# One int64 per argument. An option is first its ``option_value`` (1, 1.0 and a 0-d tensor
# 1.0 alike; every NaN one NaN). A float is its IEEE-754 bits, so equal floats, and only
# they, agree, and every rank can print what each rank passed. Other values are positive
# quiet-NaN bit patterns that no float takes here: exponent all ones, a tag in bits 48-51
# (neither 0, infinity, nor 8, the canonical NaN) and a 48-bit payload: the value itself
# where it fits (None, a bool, a small int, a short string, a shard's dtype, requires_grad
# and small shape), else a stable digest (blake2b) of its ``option_text`` (a tensor option
# by its values).
_NAN_BITS = 0x7FF8000000000000
_EXP_BITS = 0x7FF0000000000000
_PAYLOAD = (1 << 48) - 1
_NONE, _BOOL, _INT, _BYTES, _WORD, _SEQ, _TENSOR, _CALLABLE, _BIG, _STR, _OTHER, _DTYPE, \
    _VALUES = (1, 2, 3, 4, 5, 6, 7, 9, 10, 11, 12, 13, 14)
_WORD_CHARS = "abcdefghijklmnopqrstuvwxyz_-. /"  # 5 bits a character (0: none), 9 of them
_TENSOR_DTYPES = (None, torch.float32, torch.float64, torch.float16, torch.bfloat16,
                  torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool,
                  torch.complex64, torch.complex128)


def _digest(text: str, bits: int = 48) -> int:
    """A stable digest (the same in every process, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(text.encode(), digest_size=8).digest(),
                          "little") & ((1 << bits) - 1)


def _callable_name(f) -> str:
    """What names a callable alike on every rank of one program (never its address)."""
    if isinstance(f, functools.partial):
        return (f"partial({_callable_name(f.func)}, {option_text(f.args, _other_text)}, "
                f"{option_text(f.keywords, _other_text)})")
    qualname = getattr(f, "__qualname__", None)
    if isinstance(qualname, str):
        owner = getattr(f, "__self__", None)
        bound = "" if owner is None or inspect.ismodule(owner) else \
            f" bound to an instance of {type(owner).__module__}.{type(owner).__qualname__}"
        return f"{getattr(f, '__module__', None) or ''}.{qualname}{bound}"
    return f"an instance of {type(f).__module__}.{type(f).__qualname__}"


def _tensor_text(t: torch.Tensor) -> str:
    """A shard's identity: dtype, shape but its sequence dim, requires_grad (its values are
    each rank's own)."""
    shape = ["S_local" if i == 1 else str(d) for i, d in enumerate(t.shape)]
    grad = ", requires_grad" if t.requires_grad and torch.is_grad_enabled() else ""
    return f"tensor({t.dtype}, [{', '.join(shape)}]{grad})"


def _other_text(v) -> str:
    """``option_text`` of a callable (its qualified name) or another object (its type)."""
    if callable(v):
        return "callable " + _callable_name(v)
    return f"an instance of {type(v).__module__}.{type(v).__qualname__}"


def _canonical(v, sharded: bool) -> str:
    """A text equal on two ranks exactly when ``v`` is the same argument there: a shard
    (``sharded``: a tensor, or tensors, whose dim 1 is the sequence) by its identity
    (``_tensor_text``), anything else by its value (``option_text``: numbers by value, a
    tensor option by its shape and values, callables by qualified name)."""
    if sharded and isinstance(v, torch.Tensor):
        return _tensor_text(v)
    if sharded and isinstance(v, (tuple, list)):
        return "(" + ", ".join(_canonical(x, True) for x in v) + ")"
    return option_text(v, _other_text)


def _tagged(tag: int, payload: int) -> int:
    return _EXP_BITS | tag << 48 | (payload & _PAYLOAD)


def _encode(v, sharded: bool) -> int:
    """The agreement's int64 for one argument (``sharded``: a shard, or shards, whose dim 1
    is the sequence: compared by identity, not value); ``_describe`` reads it back."""
    if not sharded:
        v = option_value(v)
    if v is None:
        return _tagged(_NONE, 0)
    if isinstance(v, bool):
        return _tagged(_BOOL, int(v))
    if isinstance(v, int):
        return _tagged(_INT, v) if -(1 << 47) <= v < 1 << 47 else _tagged(_BIG, _digest(str(v)))
    if isinstance(v, float):
        return _NAN_BITS if math.isnan(v) else struct.unpack("<q", struct.pack("<d", v))[0]
    if isinstance(v, str):
        if 0 < len(v) <= 9 and all(c in _WORD_CHARS for c in v):
            code = 0
            for c in v:
                code = code << 5 | (_WORD_CHARS.index(c) + 1)
            return _tagged(_WORD, code)
        raw = v.encode()
        if len(raw) <= 6 and b"\0" not in raw:
            return _tagged(_BYTES, int.from_bytes(raw, "big"))
        return _tagged(_STR, _digest(repr(v)))
    if isinstance(v, torch.Tensor) and not sharded:  # an option: its shape and values
        grad = int(v.requires_grad and torch.is_grad_enabled())
        return _tagged(_VALUES, grad << 47 | min(v.dim(), 7) << 44
                       | _digest(_canonical(v, False), 44))
    if isinstance(v, torch.Tensor):
        code = _TENSOR_DTYPES.index(v.dtype) if v.dtype in _TENSOR_DTYPES else 0
        grad = int(v.requires_grad and torch.is_grad_enabled())
        dims = [0 if i == 1 else int(d) for i, d in enumerate(v.shape)]
        head = code << 44 | grad << 43 | min(len(dims), 7) << 40
        width = 39 // max(len(dims), 1)
        if len(dims) < 7 and all(d < 1 << width for d in dims):
            packed = 0
            for d in dims:
                packed = packed << width | d
            return _tagged(_TENSOR, head | 1 << 39 | packed)
        return _tagged(_TENSOR, head | _digest(_tensor_text(v), 39))
    if isinstance(v, torch.dtype) and v in _TENSOR_DTYPES:
        return _tagged(_DTYPE, _TENSOR_DTYPES.index(v))
    if isinstance(v, (tuple, list)):
        return _tagged(_SEQ, min(len(v), 255) << 40 | _digest(_canonical(v, sharded), 40))
    if callable(v):
        return _tagged(_CALLABLE, _digest(_canonical(v, sharded)))
    return _tagged(_OTHER, _digest(_canonical(v, sharded)))


def _describe(code: int, sharded: bool) -> str:
    """What a rank passed, from its ``_encode``: the same words on every rank."""
    if code == -1:
        return "nothing (its input was invalid)"
    tag = code >> 48 & 0xF
    if code < 0 or code >> 52 != 0x7FF or tag in (0, 8):  # a float's bits
        return repr(struct.unpack("<d", struct.pack("<q", code))[0])
    p = code & _PAYLOAD
    if tag == _NONE:
        return "None"
    if tag == _BOOL:
        return repr(bool(p))
    if tag == _INT:
        return str(p - (1 << 48) if p >> 47 else p)
    if tag == _WORD:
        chars = []
        while p:
            chars.append(_WORD_CHARS[(p & 31) - 1])
            p >>= 5
        return repr("".join(reversed(chars)))
    if tag == _BYTES:
        return repr(p.to_bytes(6, "big").lstrip(b"\0").decode(errors="replace"))
    if tag == _STR:
        return f"a longer str (digest {p})"
    if tag == _BIG:
        return f"a large int (digest {p})"
    if tag == _SEQ:
        return f"a sequence of {p >> 40} items (digest {p & ((1 << 40) - 1)})"
    if tag == _CALLABLE:
        return f"a callable (digest {p})"
    if tag == _DTYPE:
        return str(_TENSOR_DTYPES[p]) if 0 < p < len(_TENSOR_DTYPES) else f"dtype {p}"
    if tag == _VALUES:
        ndim = p >> 44 & 7
        return (f"a {ndim if ndim < 7 else '7+'}-d tensor"
                f"{' requiring grad' if p >> 47 else ''} (values digest {p & ((1 << 44) - 1)})")
    if tag == _TENSOR:
        dtype = _TENSOR_DTYPES[p >> 44] if p >> 44 < len(_TENSOR_DTYPES) else None
        what = f"a {dtype} tensor" if dtype is not None else "a tensor of another dtype"
        grad = " requiring grad" if p >> 43 & 1 else ""
        ndim = p >> 40 & 7
        if p >> 39 & 1:
            width = 39 // max(ndim, 1)
            dims = [p >> width * (ndim - 1 - i) & ((1 << width) - 1) for i in range(ndim)]
            shape = ", ".join("S_local" if sharded and i == 1 else str(d)
                              for i, d in enumerate(dims))
            return f"{what} [{shape}]{grad}"
        return (f"{what} of {ndim if ndim < 7 else '7 or more'} dims{grad} "
                f"(digest {p & ((1 << 39) - 1)})")
    return f"a value of another kind (digest {p})"


def _tensors_in(v):
    if isinstance(v, torch.Tensor):
        yield v
    elif isinstance(v, (tuple, list)):
        for x in v:
            yield from _tensors_in(x)
    elif isinstance(v, dict):
        for x in v.values():
            yield from _tensors_in(x)


class _Call:
    """One public call's arguments as the agreement's fields, for the ``_setup`` it makes."""

    __slots__ = ("fields", "sharded", "taken")

    def __init__(self, fields: dict, sharded: frozenset):
        self.fields, self.sharded, self.taken = fields, sharded, False


_CALL: contextvars.ContextVar = contextvars.ContextVar("ringattn_mixers_call", default=None)


class _Hold(torch.autograd.Function):
    """``y`` (a copy) with ``held`` in its graph: their gradient is zeros where the call
    did not otherwise read them (a rank with no token), so every tensor argument that
    requires grad gets a gradient on every rank, never None."""

    @staticmethod
    def forward(ctx, y, *held):
        ctx.held = [(t.shape, t.dtype, t.device) for t in held]
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        return (grad, *(torch.zeros(shape, dtype=dtype, device=device)
                        for shape, dtype, device in ctx.held))


def agreed(*, sharded: tuple[str, ...] = ()):
    """Make a public mixer function agree on its whole call, by construction.

    The wrapper binds the call to the function's own signature (defaults applied: an
    argument given positionally or by keyword, or left at its default, is the same
    argument) and hands the call's ``_setup`` one field per parameter (``_encode``: a
    ``sharded`` argument, whose values are each rank's own, by its dtype, shape without the
    sequence dim and requires_grad; every other argument by its value, as
    ``ringattn.validate.option_value`` and ``option_text`` compare options: a number by
    value (1, 1.0 and a 0-d tensor 1.0 agree; NaN agrees with NaN; True and 1 differ), a
    tensor option (a 0-d ``scale``, a ``dt_limit`` of tensors, ``A``, a conv weight) by its
    shape, its values after promotion to float64 and its requires_grad, not its dtype or
    device, a callable by its qualified name), except the few ``_ELSEWHERE`` agrees on otherwise: ranks that
    differ in any of them raise one ValueError naming it, on every rank, before any
    exchange. A public function called inside another before its ``_setup`` (e.g.
    ``gated_delta_rule``'s ``linear_recurrence``) is covered by the outer call's fields.

    Its output then holds every tensor argument that requires grad in its graph
    (``_Hold``), so a rank with no token gets zero gradients, not None.
    """
    def wrap(fn):
        sig = inspect.signature(fn)
        unknown = set(sharded) - set(sig.parameters)
        if unknown:
            raise TypeError(f"{fn.__name__} has no parameters {sorted(unknown)}")
        names = [n for n in sig.parameters if n not in _ELSEWHERE]
        clash = set(names) & set(_SETUP_FIELDS)
        if clash or len(names) + len(_SETUP_FIELDS) + _MAX_EXTRA + 3 > ROW_INTS:
            raise TypeError(f"{fn.__name__}: its arguments do not fit the agreement's row "
                            f"(ROW_INTS={ROW_INTS}) or clash with its fields {sorted(clash)}")
        shards = frozenset(sharded)

        @functools.wraps(fn)
        def call(*args, **kwargs):
            outer = _CALL.get()
            if outer is not None and not outer.taken:  # inside another public call
                return fn(*args, **kwargs)
            bound = sig.bind(*args, **kwargs)
            bound.apply_defaults()
            fields = {n: _encode(bound.arguments[n], n in shards) for n in names}
            token = _CALL.set(_Call(fields, shards))
            try:
                y = fn(*args, **kwargs)
            finally:
                _CALL.reset(token)
            held = {id(t): t for n, v in bound.arguments.items() if n != "error"
                    for t in _tensors_in(v) if t.requires_grad}
            if held and torch.is_grad_enabled() and isinstance(y, torch.Tensor):
                y = _Hold.apply(y, *held.values())
            return y

        call.__ringattn_agreed__ = True
        return call
    return wrap


class _GatherRows(torch.autograd.Function):
    """Every rank's ``x`` stacked in rank order ([W, *x.shape]); backward: the sum over
    ranks of the gradient of this rank's row (a reduce-scatter). ``anchors`` (tensors that
    require grad on every rank when any input does) make the result part of the graph on a
    rank whose own rows are constants, so every rank's backward reaches the reduce-scatter."""

    @staticmethod
    def forward(ctx, x, group, what, *anchors):
        ctx.group, ctx.what, ctx.anchors = group, what, len(anchors)
        world = dist.get_world_size(group)
        x = x.contiguous()
        out = x.new_empty((world, *x.shape))
        all_gather_single(out.view(-1), x.view(-1), group, what=what)
        return out

    @staticmethod
    def backward(ctx, grad):
        got = grad.new_empty(grad.shape[1:])
        reduce_scatter_single(got.view(-1), grad.contiguous().view(-1), ctx.group,
                              what=f"{ctx.what}, backward")
        return (got, None, None) + (None,) * ctx.anchors


class Tie(torch.autograd.Function):
    """``y`` (a copy), with ``table`` in its graph: the gathered table's backward runs on
    every rank whose output's does, even where no output needed the table."""

    @staticmethod
    def forward(ctx, y, table):
        ctx.table = (table.shape, table.dtype, table.device)
        return y.clone()

    @staticmethod
    def backward(ctx, grad):
        shape, dtype, device = ctx.table
        return grad, torch.zeros(shape, dtype=dtype, device=device)


def gather_rows(x: torch.Tensor, pg, what: str, anchors) -> torch.Tensor:
    """Every rank's ``x`` stacked in rank order ([W, *x.shape]), differentiable: the
    backward reduce-scatters the gradient (``_GatherRows``; ``anchors`` as there)."""
    if dist.get_world_size(pg) == 1:
        return x.unsqueeze(0)
    return _GatherRows.apply(x, pg, what, *[a for a in anchors if a.requires_grad])


def _setup(what: str, tensors: dict, group, layout, seqlen, cu_seqlens, extra: dict,
           extra_check=None, params=(), pending=None):
    """Validate this rank's call and agree with every rank (one metadata exchange): the
    same TypeError/ValueError on every rank for bad or mismatched input.

    Returns:
        (process group, plan, needs_grad).
    """
    pg = resolve_group(group)
    world, rank = dist.get_world_size(pg), dist.get_rank(pg)
    call = _CALL.get()  # the public call's arguments (``agreed``), for this one setup
    if call is not None and call.taken:
        call = None
    if call is not None:
        call.taken = True
    arguments = {} if call is None else call.fields
    if set(extra) & (set(arguments) | set(_SETUP_FIELDS)) or len(extra) > _MAX_EXTRA:
        raise RuntimeError(f"{what}: its own fields {list(extra)} clash with its arguments'")
    fields = dict.fromkeys((*_SETUP_FIELDS, *arguments, *extra), -1)
    error, plan = None, None
    site = caller_site()
    try:
        if pending is not None:  # the caller's own check of its arguments failed here
            raise pending
        first = None
        for name, t in tensors.items():
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"{what}: {name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() < 2:
                raise ValueError(f"{what}: {name} must be [B, S_local, ...] (sequence on dim 1), "
                                 f"got shape {tuple(t.shape)}")
            if t.dtype not in _DTYPES:
                raise TypeError(f"{what}: {name} has dtype {t.dtype}; supported: {list(_DTYPES)}")
            if first is None:
                first = (name, t)
            elif t.shape[:2] != first[1].shape[:2]:
                raise ValueError(f"{what}: {name} is [B, S_local]={list(t.shape[:2])} on dims 0-1 "
                                 f"but {first[0]} is {list(first[1].shape[:2])}")
            if t.device != first[1].device:
                raise ValueError(f"{what}: {name} is on {t.device} but {first[0]} is on "
                                 f"{first[1].device}")
        name0, t0 = first
        backend = str(dist.get_backend(pg))
        if (backend == "gloo" and t0.device.type != "cpu") or (backend == "nccl" and t0.device.type != "cuda"):
            raise ValueError(f"{what}: tensors on {t0.device} cannot travel over a {backend!r} "
                             f"process group")
        cu = None
        if cu_seqlens is not None:
            cu = check_cu_seqlens(cu_seqlens, seqlen)
            seqlen = cu[-1]
        lay = get_layout(layout, cu)
        if not lay.unit_stride:
            raise ValueError(
                f"{what}: layout {lay.name!r} puts token t on rank t mod W: consecutive tokens "
                f"live on different ranks, so a recurrence or a causal convolution would "
                f"exchange its state at every token; shard with layout 'zigzag' or "
                f"'contiguous' (attention is exact with those too)")
        given = seqlen is not None
        if seqlen is None:
            tag = getattr(t0, SHARD_TAG, None)
            if tag is None and world > 1:
                raise ValueError(
                    f"{what}: {name0} carries no shard tag (a projection or a .clone() of a "
                    f"shard drops ringattn.shard's tag) and no seqlen= was given: the global S "
                    f"cannot be read from S_local={t0.shape[1]} when the shards are padded. "
                    f"Pass seqlen=, the global S ({t0.shape[1] * world} when the shards are "
                    f"unpadded)")
            seqlen = t0.shape[1] * world if tag is None else tag.seqlen
        if not isinstance(seqlen, int) or isinstance(seqlen, bool) or seqlen < 1:
            raise ValueError(f"{what}: seqlen must be an int >= 1, got {seqlen!r}")
        cu_digest = -2 if cu is None else zlib.crc32(repr(cu).encode()) & 0x7FFFFFFF
        members = group_members(pg)
        for name, t in tensors.items():
            tag = getattr(t, SHARD_TAG, None)
            if tag is None:
                continue
            check_origin(f"{what}: {name}", t, members, "mixed", 1, t.dim(),
                         " (the sequence is dim 1 of [B, S_local, ...])")
            check_tag(name, t, lay, seqlen, cu_digest, rank, world, f"mixed by {what}")
        n = t0.shape[1]
        if n != lay.local_len(seqlen, world):
            said = f"seqlen={seqlen}" if given else f"seqlen not given (taken as W x S_local = {seqlen})"
            raise ValueError(
                f"{what}: {said} with layout {lay.name!r} on {world} ranks gives shards of "
                f"{lay.local_len(seqlen, world)} tokens, but {name0} has S_local={n} on dim 1 "
                f"(ringattn.shard makes shards; pass seqlen=, the global S, when they are padded)")
        extra_values = {} if extra_check is None else extra_check()
        plan = make_plan(lay, world, rank, seqlen, cu)
        fields.update(
            batch=t0.shape[0], local_len=n, seqlen=seqlen, layout=LAYOUT_NAMES.index(lay.name),
            cu_seqlens=cu_digest, dtype=_DTYPES.index(t0.dtype), device=int(t0.device.type == "cuda"),
            needs_grad=int(torch.is_grad_enabled() and any(
                isinstance(t, torch.Tensor) and t.requires_grad
                for t in (*tensors.values(), *params))),
            caller=site_digest(site), **arguments, **extra_values)
    except (TypeError, ValueError) as exc:  # raised on every rank by agree()
        error = exc

    def describe(name, value):
        if name in arguments:
            return _describe(value, name in call.sharded)
        if name == "device":
            return ("cpu", "cuda")[value] if value >= 0 else describe_field(name, value)
        return describe_field(name, value)

    agree(pg, fields, error, describe, what=f"ringattn.mixers.{what}")
    return pg, plan, bool(fields["needs_grad"])


def _assemble(plan: Plan, parts: dict, like: torch.Tensor, tail_shape, dtype) -> torch.Tensor:
    """This rank's output [B, L, *tail_shape]: each chunk's pieces at their slots, zeros on
    padding slots."""
    b, local = like.shape[0], int(plan.real.numel())
    if local == 0:
        return like.new_zeros((b, 0, *tail_shape), dtype=dtype)
    out, at = [], 0
    for start in sorted(parts):
        if start > at:
            out.append(like.new_zeros((b, start - at, *tail_shape), dtype=dtype))
        out.append(parts[start].to(dtype))
        at = start + parts[start].shape[1]
    if at < local:
        out.append(like.new_zeros((b, local - at, *tail_shape), dtype=dtype))
    return torch.cat(out, dim=1)


@agreed(sharded=("inputs",))
def linear_recurrence(scan, transition, inputs, *, state_shape, map_shape, out_shape,
                      kind: str = "diagonal", state_dtype=None, group=None,
                      layout: str = DEFAULT_LAYOUT, seqlen: int | None = None, cu_seqlens=None,
                      name: str = "linear_recurrence", params=(), error=None,
                      entry_output=None, compose=None):
    """Exact context-parallel linear recurrence S_t = M_t . S_{t-1} + U_t with a readout.

    The family is given by two local functions (plain torch code, or a kernel that takes an
    initial state):

    * ``scan(pieces, state) -> (out, final)``: the recurrence over a run of consecutive
      tokens of one document; ``pieces`` is ``inputs``, each sliced to the run on dim 1,
      ``state`` the entering state [*state_shape] (None: zero); ``out`` [B, n, *out_shape],
      ``final`` the state after the run.
    * ``transition(pieces) -> M``: the product M_n ... M_1 of the run's transitions:
      with ``kind="diagonal"`` a tensor broadcastable to the state, applied elementwise
      (Mamba, Mamba2, RG-LRU, decayed linear attention); with ``kind="matrix"`` a
      [..., P, P] tensor applied as ``M @ S`` to the [..., P, Q] state (the gated delta rule).

    Arguments:
        inputs: tuple of this rank's shards [B, L, ...] (sequence on dim 1, made by
            ``ringattn.shard`` with this layout, S and documents); padding slots are ignored.
        state_shape, map_shape, out_shape: shapes of the state (with batch), of M, and of
            one token's output (without [B, n]); the same on every rank.
        kind: "diagonal" or "matrix".
        state_dtype: dtype of the exchanged maps (default: float32 for half inputs, else
            the inputs' dtype).
        group, layout, seqlen, cu_seqlens: as for ``ringattn.ring_attention``; layouts
            "contiguous", "zigzag" (per document with cu_seqlens) and "doc_contiguous";
            "striped" is refused.
        name: the caller's name in messages.
        entry_output: optional ``entry_output(pieces, state) -> [B, n, *out_shape]``, what a
            run's outputs gain from entering with ``state`` instead of zero (the readout
            of the decayed entering state; cheap for diagonal transitions). With it, a
            chunk that continues another and exports its own leaving state (which needs
            the scan from zero) is scanned once, from zero, and this is added; without
            it, it is scanned again from its entering state. A chunk that exports nothing
            is scanned once, from its entering state, either way.
        compose: optional ``compose(M, entry, C) -> state``, the state leaving a run whose
            map is M and whose state from a zero entry is C, when entered with ``entry``,
            for a state kept in a representation that is not linear: a running maximum's
            log scale (``ringattn.mixers.wkv``, ``mlstm``: the state is the pair
            (values / exp(m), m) and M the run's summed log decay). Default
            ``M * entry + C`` (diagonal) or ``M @ entry + C`` (matrix).
        error: a TypeError/ValueError the caller found in its own arguments on this rank
            (or None): raised on every rank by the agreement, as the call's own checks are.
        params: tensors the functions read besides ``inputs`` (e.g. Mamba2's A): their
            gradient on each rank is this rank's share, as for attention's sinks (sum it
            over the ranks, as data parallelism does, for the one-process gradient).

    Returns:
        [B, L, *out_shape]: each token's output, zero on padding slots. Every rank must
        backpropagate through it when any does (the backward has one collective).

    Raises:
        TypeError, ValueError: on every rank, before any exchange.
    """
    inputs = tuple(inputs)
    tensors = {f"inputs[{i}]": t for i, t in enumerate(inputs)}

    def check():
        if kind not in _KINDS:
            raise ValueError(f"{name}: kind must be one of {list(_KINDS)}, got {kind!r}")
        if not callable(scan) or not callable(transition):
            raise TypeError(f"{name}: scan and transition must be callables")
        shapes = tuple(tuple(int(d) for d in s) for s in (state_shape, map_shape, out_shape))
        return {"shapes": zlib.crc32(repr(shapes).encode()) & 0x7FFFFFFF}

    pg, plan, needs_grad = _setup(name, tensors, group, layout, seqlen, cu_seqlens,
                                  ("shapes",), check, params, error)
    x0 = inputs[0]
    sdtype = state_dtype or (torch.float32 if x0.dtype in (torch.bfloat16, torch.float16) else x0.dtype)
    state_shape, map_shape = tuple(state_shape), tuple(map_shape)
    m_numel, c_numel = _numel(map_shape), _numel(state_shape)
    me = plan.rank
    parts, later, rows = {}, [], []
    for c in plan.chunks[me]:
        m_row = c_row = None
        pieces = c.pieces()
        for i, (off, n) in enumerate(pieces):
            at = c.local_start + off
            piece = tuple(t[:, at:at + n] for t in inputs)
            needs_entry = i == 0 and not c.starts_doc
            exports = i == len(pieces) - 1 and plan.sends_state[me][c.index]
            # a piece that needs its entering state is scanned once, from it, after the
            # gather; one that also exports its leaving state is scanned from zero first
            # (the state it exports), and its entry then added by entry_output if given
            added = needs_entry and exports and entry_output is not None
            if not needs_entry or exports:
                out, final = scan(piece, None)
                if not needs_entry or added:
                    parts[at] = out
                if exports:
                    c_row = final.to(sdtype).reshape(-1)
            if needs_entry:
                later.append((c.index, at, piece, added))
        if plan.sends_map[me][c.index]:  # then it has no cuts: one piece, the whole chunk
            whole = tuple(t[:, c.local_start:c.local_start + c.length] for t in inputs)
            m_row = transition(whole).to(sdtype).expand(map_shape).reshape(-1)
        rows.append(torch.cat([
            m_row if m_row is not None else x0.new_zeros(m_numel, dtype=sdtype),
            c_row if c_row is not None else x0.new_zeros(c_numel, dtype=sdtype)]))
    rows += [x0.new_zeros(m_numel + c_numel, dtype=sdtype)] * (plan.rows - len(rows))
    anchors = [t for t in (*inputs, *params) if isinstance(t, torch.Tensor)] if needs_grad else []
    table = gather_rows(torch.stack(rows), pg,
                        f"{name}'s all-gather of the chunks' state maps", anchors)
    for index, at, piece, added in later:
        entry = None
        for r, i in plan.chains[index]:
            m = table[r, i, :m_numel].view(map_shape)
            s = table[r, i, m_numel:].view(state_shape)
            if entry is None:
                entry = s
            elif compose is not None:
                entry = compose(m, entry, s)
            else:
                entry = (m * entry if kind == "diagonal" else m @ entry) + s
        if added:
            parts[at] = (parts[at] + entry_output(piece, entry)).to(parts[at].dtype)
        else:
            parts[at] = scan(piece, entry)[0]
    dtype = next(iter(parts.values())).dtype if parts else x0.dtype
    y = _assemble(plan, parts, x0, tuple(out_shape), dtype)
    if needs_grad and plan.world > 1:
        y = Tie.apply(y, table)
    return y


def _numel(shape) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def halo(xs: torch.Tensor, plan: Plan, width: int, pg, what: str, anchors):
    """(ext, table): ``xs`` [B, L, D] this rank's inputs, then every chunk's last ``width``
    inputs (the table ``conv_sources(plan, width)`` indexes, rank-major, left-padded with
    zeros), then one zero slot: [B, L + W * rows * width + 1, D]; and the gathered table
    [W, rows, B, width, D] (one all-gather; its backward the reduce-scatter of the table's
    gradient, made on every rank whose result reaches the loss: ``anchors``, the tensors
    that require grad on every rank when any input does, keep it in the graph)."""
    b, d = xs.shape[0], xs.shape[2]
    tails = []
    for c in plan.chunks[plan.rank]:
        end = c.local_start + c.length
        tail = xs[:, max(c.local_start, end - width):end]
        if tail.shape[1] < width:
            tail = torch.cat([xs.new_zeros((b, width - tail.shape[1], d)), tail], dim=1)
        tails.append(tail)
    tails += [xs.new_zeros((b, width, d))] * (plan.rows - len(tails))
    table = gather_rows(torch.stack(tails), pg, what, anchors)  # [W, rows, B, width, D]
    ext = torch.cat([xs, table.permute(2, 0, 1, 3, 4).reshape(b, -1, d),
                     xs.new_zeros((b, 1, d))], dim=1)
    return ext, table


@agreed(sharded=("x",))
def causal_conv1d(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, *,
                  activation: str | None = None, group=None, layout: str = DEFAULT_LAYOUT,
                  seqlen: int | None = None, cu_seqlens=None) -> torch.Tensor:
    """Exact context-parallel depthwise causal convolution (Mamba's, GatedDeltaNet's, LFM2's
    short conv): out[t, d] = bias[d] + sum_j weight[d, j] * x[t - k + 1 + j, d], with inputs
    before the sequence or in another packed document taken as zero, then ``activation``.

    Each chunk's first k-1 outputs read the k-1 inputs before it (its halo), which come from
    the ranks that hold them in one all-gather of every chunk's last k-1 inputs.

    Arguments:
        x: [B, L, D] this rank's shard (sequence on dim 1; transformers' conv functions take
            [B, D, S]: pass ``x.transpose(1, 2)``).
        weight: [D, k] (or nn.Conv1d's [D, 1, k]) the same on every rank; its gradient on
            each rank is this rank's share (sum over ranks for the one-process gradient),
            as is ``bias``'s.
        bias: [D] or None.
        activation: None, "silu" or "swish".
        group, layout, seqlen, cu_seqlens: as for ``linear_recurrence``.

    Returns:
        [B, L, D] in x's dtype, zero on padding slots.

    Raises:
        TypeError, ValueError: on every rank, before any exchange.
    """
    def check():
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"causal_conv1d: weight must be a torch.Tensor, got {type(weight).__name__}")
        w = weight.squeeze(1) if weight.dim() == 3 and weight.shape[1] == 1 else weight
        if x.dim() != 3 or w.dim() != 2 or w.shape[0] != x.shape[2] or w.shape[1] < 1:
            raise ValueError(f"causal_conv1d: x must be [B, L, D] and weight [D, k] (or [D, 1, k]), "
                             f"got x {tuple(x.shape)} and weight {tuple(weight.shape)}")
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (x.shape[2],)):
            raise ValueError(f"causal_conv1d: bias must be a [D]=[{x.shape[2]}] tensor or None, got "
                             f"{tuple(bias.shape) if isinstance(bias, torch.Tensor) else type(bias).__name__}")
        if activation not in _ACTIVATIONS:
            raise ValueError(f"causal_conv1d: activation must be one of {list(_ACTIVATIONS)}, "
                             f"got {activation!r}")
        return {"kernel_size": w.shape[1], "channels": x.shape[2]}

    params = {"weight": weight} if isinstance(weight, torch.Tensor) else {}
    if isinstance(bias, torch.Tensor):
        params["bias"] = bias
    pg, plan, needs_grad = _setup("causal_conv1d", {"x": x}, group, layout, seqlen, cu_seqlens,
                                  ("kernel_size", "channels"), check,
                                  tuple(params.values()))
    w = weight.squeeze(1) if weight.dim() == 3 else weight
    k, width = w.shape[1], w.shape[1] - 1
    b, local, d = x.shape
    dtype = torch.promote_types(x.dtype, w.dtype)
    xs = x.to(dtype)
    w = w.to(dtype)
    out = xs * w[:, width]
    if width:
        ext, _ = halo(xs, plan, width, pg, "causal_conv1d's all-gather of the chunks' last "
                      "k-1 inputs", [x, *params.values()] if needs_grad else [])
        src = conv_sources(plan, width).to(x.device)
        for s in range(1, k):
            out = out + ext[:, src[s - 1]] * w[:, width - s]
    if bias is not None:
        out = out + bias.to(dtype)
    if activation is not None:
        out = torch.nn.functional.silu(out)
    out = torch.where(plan.real.to(x.device)[None, :, None], out, out.new_zeros(()))
    return out.to(x.dtype)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
