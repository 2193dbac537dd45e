"""Ring attention as ``torch.library`` custom ops, so ``torch.compile`` traces through it.

Legend: B batch, L local seq, H heads, Hkv kv heads, D head dim, Dv value head dim.

Under ``torch.compile`` the ring cannot be traced: it agrees on metadata with a collective,
reads plans from Python caches and posts point-to-point sends (FACTS.md: P2P calls inside a
compiled region fail). ``ring_attention`` therefore calls, while compiling, two opaque ops
that take only tensors and plain values (the group by name, masks by a registry key) and
have fake implementations for shapes:

* ``ringattn::ring_attention(q, k, v, sinks, cu_seqlens, ...) -> (out, lse, steps)`` runs
  the same validation and agreement as eager calls (the same error on every rank, before
  any send), then the ring's forward;
* ``ringattn::ring_attention_backward(dout, dlse, q, k, v, out, lse, sinks, ..., steps)``
  runs the ring's backward. ``steps`` (the ring length all ranks agreed on in forward, as a
  0-d tensor) lets it rebuild the ring from the cached plan without a second agreement.

Both call the functions eager calls use (``ring.attention_forward`` / ``attention_backward``):
one implementation, two entry points.

Ulysses and the hybrid have their own pair, ``ringattn::heads_attention`` and its backward:
the forward op also returns the head-sharded q, k, v, out and lse it attended with (what
eager autograd would save), and the backward op runs the all-to-alls and the ring's backward
on them. All-gather goes through ``ringattn::allgather_attention``, which calls the eager
function: the forward without autograd, the backward by running that forward again with
autograd and differentiating it (one more forward; its eager backward gathers K/V again
anyway). Groups and meshes travel as keys of a registry (``group_key``). Tensors that carry no value are passed empty
(``sinks`` without sinks, ``cu_seqlens`` without documents), since an op's outputs and
inputs must be tensors.
"""

from __future__ import annotations

import math

import torch

from .api import _check_local, build_ring, unit_stride
from .comm import RingComm, group_by_name, resolve_group
from .masks import registered_mask
from .ring import Ring, attention_backward, attention_forward
from .spec import accumulator_dtype
from .ulysses import _gather, _scatter

__all__ = ["compiled_allgather_attention", "compiled_heads_attention", "compiled_ring_attention",
           "group_key"]


def _optional(t: torch.Tensor):
    return None if t.numel() == 0 else t


def _call_args(cu_seqlens, group_name, causal, window_left, window_right, softmax_scale,
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


@torch.library.custom_op("ringattn::ring_attention", mutates_args=())
def _ring_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
    cu_seqlens: torch.Tensor, alibi_slopes: torch.Tensor, group_name: str, causal: bool, window_left: int,
    window_right: int, softmax_scale: float, layout: str, seqlen: int, mask_key: int,
    softcap: float, kernel: str, backward_overlap: str, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    args = _call_args(cu_seqlens, group_name, causal, window_left, window_right,
                      softmax_scale, layout, seqlen, mask_key)
    ring = build_ring(q, k, v, **args, return_lse=return_lse, kernel=kernel,
                      backward_overlap=backward_overlap, softcap=softcap, sinks=_optional(sinks),
                      alibi_slopes=_optional(alibi_slopes))
    with torch.autocast(q.device.type, enabled=False):  # kernels pick their own dtypes
        out, lse = attention_forward(q, k, v, _optional(sinks), ring)
    return out, lse, torch.tensor(ring.steps, dtype=torch.int64)


@_ring_attention_op.register_fake
def _(q, k, v, sinks, cu_seqlens, alibi_slopes, group_name, causal, window_left, window_right,
      softmax_scale, layout, seqlen, mask_key, softcap, kernel, backward_overlap, return_lse):
    b, n, h, _ = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out = q.new_empty(b, n, h, v.shape[-1])
    lse = q.new_empty(b, h, n, dtype=acc)
    return out, lse, torch.empty((), dtype=torch.int64)


@torch.library.custom_op("ringattn::ring_attention_backward", mutates_args=())
def _ring_attention_backward_op(
    dout: torch.Tensor, dlse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor,
    cu_seqlens: torch.Tensor, alibi_slopes: torch.Tensor, steps: torch.Tensor, group_name: str, causal: bool,
    window_left: int, window_right: int, softmax_scale: float, layout: str, seqlen: int,
    mask_key: int, softcap: float, kernel: str, backward_overlap: str, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    args = _call_args(cu_seqlens, group_name, causal, window_left, window_right,
                      softmax_scale, layout, seqlen, mask_key)
    pg = args.pop("group")
    comm = RingComm(pg)
    # validated and agreed in forward: the cached plan, no second agreement
    checked = _check_local(
        q, k, v, comm, args["causal"], args["window_size"], args["softmax_scale"],
        args["layout"], args["seqlen"], args["mask"], args["cu_seqlens"], kernel,
        backward_overlap, return_lse, pg, softcap, _optional(sinks), _optional(alibi_slopes))
    ring = Ring(comm, checked.spec, checked.plan, checked.kernel, int(steps), backward_overlap,
                checked.layout)
    with torch.autocast(q.device.type, enabled=False):
        dq, dk, dv, dsinks = attention_backward(
            ring, return_lse, q, k, v, out, lse, _optional(sinks), dout, _optional(dlse),
            sinks.numel() > 0)
    dsinks = sinks.new_empty(0) if dsinks is None else dsinks
    return tuple(t.contiguous() for t in (dq, dk, dv, dsinks))  # strides as the fake says


@_ring_attention_backward_op.register_fake
def _(dout, dlse, q, k, v, out, lse, sinks, cu_seqlens, alibi_slopes, steps, *plain):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(sinks)


_PLAIN = ("group_name", "causal", "window_left", "window_right", "softmax_scale", "layout",
          "seqlen", "mask_key", "softcap", "kernel", "backward_overlap", "return_lse")


def _setup_context(ctx, inputs, output):
    q, k, v, sinks, cu_seqlens, alibi_slopes, *plain = inputs
    out, lse, steps = output
    ctx.save_for_backward(q, k, v, out, lse, sinks, cu_seqlens, alibi_slopes, steps)
    ctx.plain = dict(zip(_PLAIN, plain))


def _backward(ctx, dout, dlse, _dsteps):
    q, k, v, out, lse, sinks, cu_seqlens, alibi_slopes, steps = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    if dlse is None or not ctx.plain["return_lse"]:  # lse not returned: no gradient on it
        dlse = lse.new_empty(0)
    dq, dk, dv, dsinks = torch.ops.ringattn.ring_attention_backward(
        dout, dlse, q, k, v, out, lse, sinks, cu_seqlens, alibi_slopes, steps, **ctx.plain)
    return dq, dk, dv, (dsinks if sinks.numel() else None), None, None, *([None] * len(_PLAIN))


_ring_attention_op.register_autograd(_backward, setup_context=_setup_context)


def compiled_ring_attention(q, k, v, *, group_name: str, causal: bool, window_size,
                            softmax_scale: float, layout: str, seqlen: int | None, mask_key: int,
                            cu_seqlens, return_lse: bool, kernel: str, backward_overlap: str,
                            softcap: float, sinks, alibi_slopes=None):
    """``ring_attention`` through the custom ops (the caller resolved every plain value)."""
    empty = q.new_empty(0)
    cu = (torch.empty(0, dtype=torch.int64) if cu_seqlens is None
          else torch.as_tensor(cu_seqlens, dtype=torch.int64))
    slopes = (torch.empty(0, dtype=torch.float64) if alibi_slopes is None
              else torch.as_tensor(alibi_slopes, dtype=torch.float64))
    out, lse, _ = torch.ops.ringattn.ring_attention(
        q, k, v, empty if sinks is None else sinks, cu, slopes, group_name, causal,
        int(window_size[0]), int(window_size[1]), softmax_scale, layout,
        -1 if seqlen is None else seqlen, mask_key, softcap, kernel, backward_overlap,
        return_lse)
    return out, lse


# ---------------------------------------------------------------------------------------
# All-gather: one op pair whose backward runs the forward again.
# ---------------------------------------------------------------------------------------

_GROUPS: dict[str, object] = {}
"""Groups and meshes handed to compiled calls, by the key ``group_key`` gave them (held, so
a key is never reused for another object)."""


@torch.compiler.assume_constant_result
def group_key(group) -> str:
    """A plain key for ``group`` (a ProcessGroup, a DeviceMesh or None), for custom ops; a
    compiled graph holds it as a constant."""
    if group is None:
        return "default"
    key = f"{type(group).__name__}:{id(group)}"
    _GROUPS[key] = group
    return key


def _group(key: str):
    return None if key == "default" else _GROUPS[key]


def _allgather_call(q, k, v, sinks, cu_seqlens, alibi_slopes, group_key_, causal,
                    window_left, window_right, softmax_scale, layout, seqlen, mask_key,
                    softcap, kernel, heads_k_stride):
    """The eager ``allgather_attention``'s (out, lse) for the op's values (one code path
    with eager calls)."""
    from .api import allgather_attention

    args = _call_args(cu_seqlens, "", causal, window_left, window_right, softmax_scale,
                      layout, seqlen, mask_key, resolve=False)
    with torch.autocast(q.device.type, enabled=False):
        return allgather_attention(
            q, k, v, group=_group(group_key_), **args, return_lse=True, kernel=kernel,
            softcap=softcap, sinks=_optional(sinks),
            alibi_slopes=None if alibi_slopes.numel() == 0 else alibi_slopes.tolist(),
            heads_k_stride=None if heads_k_stride < 0 else heads_k_stride)


@torch.library.custom_op("ringattn::allgather_attention", mutates_args=())
def _allgather_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
    cu_seqlens: torch.Tensor, alibi_slopes: torch.Tensor, group_key_: str,
    causal: bool, window_left: int, window_right: int, softmax_scale: float, layout: str,
    seqlen: int, mask_key: int, softcap: float, kernel: str, heads_k_stride: int,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor]:
    with torch.no_grad():
        out, lse = _allgather_call(q, k, v, sinks, cu_seqlens, alibi_slopes, group_key_,
                                   causal, window_left, window_right, softmax_scale, layout,
                                   seqlen, mask_key, softcap, kernel, heads_k_stride)
    return out.contiguous(), lse.contiguous()


@_allgather_op.register_fake
def _(q, k, v, sinks, cu_seqlens, alibi_slopes, *plain):
    b, n, h, _ = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    return q.new_empty(b, n, h, v.shape[-1]), q.new_empty(b, h, n, dtype=acc)


def _autograd_recording():
    """A guard under which autograd records again inside a custom op's implementation
    (torch runs it with the autograd dispatch keys excluded). torch has no public way to
    say so; the dispatch-key guard is private and used here and nowhere else: the exclude
    set keeps only its autocast keys."""
    keys = torch._C.DispatchKey
    excluded = torch._C._dispatch_tls_local_exclude_set()
    keep = torch._C.DispatchKeySet(keys.Undefined)
    for name in dir(keys):
        if name.startswith("Autocast") and excluded.has(getattr(keys, name)):
            keep = keep.add(getattr(keys, name))
    return torch._C._ForceDispatchKeyGuard(torch._C._dispatch_tls_local_include_set(), keep)


@torch.library.custom_op("ringattn::allgather_attention_backward", mutates_args=())
def _allgather_backward_op(
    dout: torch.Tensor, dlse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, sinks: torch.Tensor, cu_seqlens: torch.Tensor,
    alibi_slopes: torch.Tensor, group_key_: str, causal: bool,
    window_left: int, window_right: int, softmax_scale: float, layout: str, seqlen: int,
    mask_key: int, softcap: float, kernel: str, heads_k_stride: int, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # the forward again, with autograd, then its backward: the op pair keeps no Python
    # state between forward and backward (one more forward, its collectives included)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    has_sinks = sinks.numel() > 0
    sinks_leaf = sinks.detach().requires_grad_() if has_sinks else sinks
    with _autograd_recording(), torch.enable_grad():
        out, lse = _allgather_call(*leaves, sinks_leaf, cu_seqlens, alibi_slopes, group_key_,
                                   causal, window_left, window_right, softmax_scale, layout,
                                   seqlen, mask_key, softcap, kernel, heads_k_stride)
        outputs, grads = [out], [dout]
        if return_lse:  # the same on every rank, so every rank runs the same collectives
            outputs.append(lse)
            grads.append(dlse if dlse.numel() else torch.zeros_like(lse))
        wrt = leaves + ([sinks_leaf] if has_sinks else [])
        got = torch.autograd.grad(outputs, wrt, grads, allow_unused=True)
    got = [torch.zeros_like(x) if g is None else g for g, x in zip(got, wrt)]
    dsinks = got[3] if has_sinks else sinks.new_empty(0)
    return tuple(t.contiguous() for t in (*got[:3], dsinks))


@_allgather_backward_op.register_fake
def _(dout, dlse, q, k, v, sinks, *plain):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(sinks)


_ALLGATHER_PLAIN = ("group_key_", "causal", "window_left", "window_right", "softmax_scale",
                    "layout", "seqlen", "mask_key", "softcap", "kernel", "heads_k_stride",
                    "return_lse")


def _allgather_setup_context(ctx, inputs, output):
    q, k, v, sinks, cu_seqlens, alibi_slopes, *plain = inputs
    ctx.save_for_backward(q, k, v, sinks, cu_seqlens, alibi_slopes)
    ctx.plain = dict(zip(_ALLGATHER_PLAIN, plain))


def _allgather_backward(ctx, dout, dlse):
    q, k, v, sinks, cu_seqlens, alibi_slopes = ctx.saved_tensors
    if dout is None:
        dout = q.new_zeros(*q.shape[:3], v.shape[-1])
    if dlse is None or not ctx.plain["return_lse"]:
        dlse = q.new_empty(0, dtype=torch.float32)
    dq, dk, dv, dsinks = torch.ops.ringattn.allgather_attention_backward(
        dout, dlse, q, k, v, sinks, cu_seqlens, alibi_slopes, **ctx.plain)
    return (dq, dk, dv, dsinks if sinks.numel() else None, None, None,
            *([None] * len(_ALLGATHER_PLAIN)))


_allgather_op.register_autograd(_allgather_backward, setup_context=_allgather_setup_context)


def _op_tensors(kernel, cu_seqlens, alibi_slopes):
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


def compiled_allgather_attention(q, k, v, *, group, causal: bool, window_size, softmax_scale,
                                 layout: str, seqlen, mask, cu_seqlens, return_lse: bool,
                                 kernel, softcap: float, sinks, alibi_slopes=None,
                                 heads_k_stride=None):
    """``allgather_attention`` under torch.compile: one opaque op whose forward is the
    eager function's and whose backward runs that forward again with autograd (no Python
    state crosses from forward to backward; the cost is one more forward, measured in
    benchmarks/RESULTS.md)."""
    from .masks import mask_key as key_of

    cu, slopes = _op_tensors(kernel, cu_seqlens, alibi_slopes)
    out, lse = torch.ops.ringattn.allgather_attention(
        q, k, v, q.new_empty(0) if sinks is None else sinks, cu, slopes,
        group_key(group), bool(causal), int(window_size[0]), int(window_size[1]),
        1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale),
        layout, -1 if seqlen is None else seqlen,
        mask if isinstance(mask, int) else key_of(mask), float(softcap), kernel or "auto",
        -1 if heads_k_stride is None else heads_k_stride, bool(return_lse))
    return (out, lse) if return_lse else out


# ---------------------------------------------------------------------------------------
# Ulysses and the hybrid: an op pair that hands the head-sharded tensors to the backward.
# ---------------------------------------------------------------------------------------


def _heads_call(q, k, v, sinks, cu_seqlens, alibi_slopes, strategy, group_key_, causal,
                window_left, window_right, softmax_scale, layout, seqlen, mask_key, softcap,
                kernel, backward_overlap, return_lse, steps=None):
    """``api._heads_setup`` for the op's values: agreed (forward) or rebuilt (``steps``)."""
    from .api import _heads_setup, _Topology

    group = _group(group_key_)
    topo = (_Topology.hybrid(group) if strategy == "hybrid"
            else _Topology.ulysses(resolve_group(group)))
    args = _call_args(cu_seqlens, "", causal, window_left, window_right, softmax_scale,
                      layout, seqlen, mask_key, resolve=False)
    return _heads_setup(
        q, k, v, topo, return_lse=return_lse, sinks=_optional(sinks),
        backward_overlap=backward_overlap, steps=steps, kernel=kernel, softcap=softcap,
        alibi_slopes=None if alibi_slopes.numel() == 0 else alibi_slopes.tolist(), **args)


def _lse_to_seq(lse_BHL, ex, heads):
    return _gather(lse_BHL.transpose(1, 2).unsqueeze(-1).contiguous(), ex, heads).squeeze(-1).transpose(1, 2)


def _lse_to_heads(lse_BHL, ex):
    return _scatter(lse_BHL.transpose(1, 2).unsqueeze(-1).contiguous(), ex).squeeze(-1).transpose(1, 2)


@torch.library.custom_op("ringattn::heads_attention", mutates_args=())
def _heads_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
    cu_seqlens: torch.Tensor, alibi_slopes: torch.Tensor, strategy: str, group_key_: str,
    causal: bool, window_left: int, window_right: int, softmax_scale: float, layout: str,
    seqlen: int, mask_key: int, softcap: float, kernel: str, backward_overlap: str,
    return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor,
           torch.Tensor, torch.Tensor, torch.Tensor]:
    hd = _heads_call(q, k, v, sinks, cu_seqlens, alibi_slopes, strategy, group_key_, causal,
                     window_left, window_right, softmax_scale, layout, seqlen, mask_key,
                     softcap, kernel, backward_overlap, return_lse)
    b, h = q.shape[0], q.shape[2]
    split = hd.topo.U > 1
    with torch.autocast(q.device.type, enabled=False):
        q_f, k_f, v_f = ((_scatter(q, hd.ex_q), _scatter(k, hd.ex_kv), _scatter(v, hd.ex_kv))
                         if split else (q, k, v))
        q_f, k_f, v_f = unit_stride(q_f, k_f, v_f)
        if hd.hi > hd.lo:
            heads_sinks = None if sinks.numel() == 0 else sinks[hd.lo:hd.hi]
            out_f, lse_f = attention_forward(q_f, k_f, v_f, heads_sinks, hd.ring(backward_overlap))
        else:
            out_f = q_f.new_zeros(b, q_f.shape[1], 0, v.shape[3])
            lse_f = q_f.new_zeros(b, 0, q_f.shape[1], dtype=accumulator_dtype(q.dtype))
        if not split:  # nothing moved: the backward takes q, k, v, out, lse themselves
            empty = q.new_empty(0)
            return (out_f.contiguous(), lse_f.contiguous(), empty, empty.clone(), empty.clone(),
                    empty.clone(), lse_f.new_empty(0), torch.tensor(hd.steps))
        out, lse = _gather(out_f, hd.ex_q, h), _lse_to_seq(lse_f, hd.ex_q, h)
    return (out.contiguous(), lse.contiguous(), q_f.contiguous(), k_f.contiguous(),
            v_f.contiguous(), out_f.contiguous(), lse_f.contiguous(), torch.tensor(hd.steps))


@_heads_op.register_fake
def _(q, k, v, sinks, cu_seqlens, alibi_slopes, strategy, group_key_, *plain):
    from .api import _Topology
    from .ulysses import head_split

    group = _group(group_key_)
    topo = (_Topology.hybrid(group) if strategy == "hybrid"
            else _Topology.ulysses(resolve_group(group)))
    b, n, h, d = q.shape
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    out, lse = q.new_empty(b, n, h, v.shape[-1]), q.new_empty(b, h, n, dtype=acc)
    steps = torch.empty((), dtype=torch.int64)
    if topo.U == 1:
        empty = q.new_empty(0)
        return out, lse, empty, empty.clone(), empty.clone(), empty.clone(), lse.new_empty(0), steps
    split = head_split(h, k.shape[2], topo.U)
    nq, nkv, m = len(split.q_heads[topo.u]), len(split.kv_heads[topo.u]), topo.U * n
    return (out, lse, q.new_empty(b, m, nq, d), q.new_empty(b, m, nkv, k.shape[-1]),
            q.new_empty(b, m, nkv, v.shape[-1]), q.new_empty(b, m, nq, v.shape[-1]),
            q.new_empty(b, nq, m, dtype=acc), steps)


@torch.library.custom_op("ringattn::heads_attention_backward", mutates_args=())
def _heads_backward_op(
    dout: torch.Tensor, dlse: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
    v: torch.Tensor, sinks: torch.Tensor, cu_seqlens: torch.Tensor,
    alibi_slopes: torch.Tensor, out: torch.Tensor, lse: torch.Tensor, q_f: torch.Tensor,
    k_f: torch.Tensor, v_f: torch.Tensor, out_f: torch.Tensor, lse_f: torch.Tensor,
    steps: torch.Tensor, strategy: str, group_key_: str, causal: bool, window_left: int,
    window_right: int, softmax_scale: float, layout: str, seqlen: int, mask_key: int,
    softcap: float, kernel: str, backward_overlap: str, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    # validated and agreed in forward: the cached plan and the agreed steps, no exchange
    hd = _heads_call(q, k, v, sinks, cu_seqlens, alibi_slopes, strategy, group_key_, causal,
                     window_left, window_right, softmax_scale, layout, seqlen, mask_key,
                     softcap, kernel, backward_overlap, return_lse, steps=int(steps))
    h, hkv = q.shape[2], k.shape[2]
    split = hd.topo.U > 1
    if return_lse and dlse.numel() == 0:  # every rank moves an lse gradient (zeros here)
        dlse = torch.zeros_like(lse)
    with torch.autocast(q.device.type, enabled=False):
        if split:
            dout_f = _scatter(dout.contiguous(), hd.ex_q)
            dlse_f = _lse_to_heads(dlse, hd.ex_q) if return_lse else None
        else:
            q_f, k_f, v_f, out_f, lse_f = q, k, v, out, lse
            dout_f, dlse_f = dout.contiguous(), (dlse if return_lse else None)
        dsinks = None
        if hd.hi > hd.lo:
            heads_sinks = None if sinks.numel() == 0 else sinks[hd.lo:hd.hi]
            dq_f, dk_f, dv_f, dsinks_h = attention_backward(
                hd.ring(backward_overlap), return_lse, q_f, k_f, v_f, out_f, lse_f,
                heads_sinks, dout_f, dlse_f, heads_sinks is not None)
            if dsinks_h is not None:
                dsinks = sinks.new_zeros(h)
                dsinks[hd.lo:hd.hi] = dsinks_h
        else:
            dq_f, dk_f, dv_f = (torch.zeros_like(t) for t in (q_f, k_f, v_f))
        if split:
            dq = _gather(dq_f.contiguous(), hd.ex_q, h)
            dk, dv = (_gather(t.contiguous(), hd.ex_kv, hkv) for t in (dk_f, dv_f))
        else:
            dq, dk, dv = dq_f, dk_f, dv_f
    if dsinks is None:
        dsinks = sinks.new_zeros(h) if sinks.numel() else sinks.new_empty(0)
    return tuple(t.contiguous() for t in (dq, dk, dv, dsinks))


@_heads_backward_op.register_fake
def _(dout, dlse, q, k, v, sinks, *rest):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(sinks)


_HEADS_PLAIN = ("strategy", "group_key_", "causal", "window_left", "window_right",
                "softmax_scale", "layout", "seqlen", "mask_key", "softcap", "kernel",
                "backward_overlap", "return_lse")


def _heads_setup_context(ctx, inputs, output):
    q, k, v, sinks, cu_seqlens, alibi_slopes, *plain = inputs
    out, lse, q_f, k_f, v_f, out_f, lse_f, steps = output
    ctx.save_for_backward(q, k, v, sinks, cu_seqlens, alibi_slopes, out, lse, q_f, k_f, v_f,
                          out_f, lse_f, steps)
    ctx.plain = dict(zip(_HEADS_PLAIN, plain))


def _heads_backward(ctx, dout, dlse, *_unused):
    q, k, v, sinks, cu, slopes, out, lse, q_f, k_f, v_f, out_f, lse_f, steps = ctx.saved_tensors
    if dout is None:
        dout = torch.zeros_like(out)
    if dlse is None or not ctx.plain["return_lse"]:
        dlse = lse.new_empty(0)
    dq, dk, dv, dsinks = torch.ops.ringattn.heads_attention_backward(
        dout, dlse, q, k, v, sinks, cu, slopes, out, lse, q_f, k_f, v_f, out_f, lse_f, steps,
        **ctx.plain)
    return (dq, dk, dv, dsinks if sinks.numel() else None, None, None,
            *([None] * len(_HEADS_PLAIN)))


_heads_op.register_autograd(_heads_backward, setup_context=_heads_setup_context)


def compiled_heads_attention(strategy: str, q, k, v, *, group, causal: bool, window_size,
                             softmax_scale, layout: str, seqlen, mask, cu_seqlens,
                             return_lse: bool, kernel, softcap: float, sinks,
                             alibi_slopes=None, backward_overlap: str = "all"):
    """``ulysses_attention`` / ``hybrid_attention`` (``strategy``) under torch.compile: the
    forward op returns the head-sharded q, k, v, out and lse it computed with, and the
    backward op runs the ring's backward on them (no forward again)."""
    from .masks import mask_key as key_of

    cu, slopes = _op_tensors(kernel, cu_seqlens, alibi_slopes)
    out, lse, *_ = torch.ops.ringattn.heads_attention(
        q, k, v, q.new_empty(0) if sinks is None else sinks, cu, slopes, strategy,
        group_key(group), bool(causal), int(window_size[0]), int(window_size[1]),
        1.0 / math.sqrt(q.shape[-1]) if softmax_scale is None else float(softmax_scale),
        layout, -1 if seqlen is None else seqlen,
        mask if isinstance(mask, int) else key_of(mask), float(softcap), kernel or "auto",
        backward_overlap, bool(return_lse))
    return (out, lse) if return_lse else out
