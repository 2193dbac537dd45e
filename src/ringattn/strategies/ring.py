"""The ring strategy (``ring_attention``) and the ring loop every strategy runs.

Legend: B batch, L local seq (S_pad / W), H heads, Hkv kv heads, D head dim (Dv of the
values, which may differ: MLA), W world size.

The loop: at step t rank r holds the K/V that started on rank (r - t) mod W. Before
computing on them it posts the hop that passes them on, then asks the plan which blocks to
compute. Forward keeps fp32 accumulators (out, lse) and folds every block in with
``merge_``. Backward sends K/V around again; each block's gradients are computed against
the FINAL out and lse, dQ accumulates locally, and a dK/dV accumulator (fp32) travels one
step behind its K/V, gaining each rank's contribution, until it arrives home after a full
turn. Ulysses, all-gather and the hybrid run this same loop (over one rank, or over the
ring dimension of a mesh); variants (layouts, masks) are data given to it.

This file owns: the loop (``Ring``, ``ring_forward``, ``ring_backward``,
``attention_forward``/``attention_backward`` with sinks and the lse gradient), the
autograd Function ``RingAttention``, the public ``ring_attention``, ``build_ring`` (its
validation, agreement and plan), and the compile op pair ``ringattn::ring_attention`` /
``ringattn::ring_attention_backward``.

Under ``torch.compile`` the ring cannot be traced: it agrees on metadata with a collective,
reads plans from Python caches and posts point-to-point sends (point-to-point calls inside
a compiled region fail). ``ring_attention`` therefore calls, while compiling, two opaque
ops that take only tensors and plain values (the group by name, masks by a registry key)
and have fake implementations for shapes. The forward op runs the same validation and
agreement as eager calls, then the loop's forward; the backward op rebuilds the ring from
the cached plan and the ``steps`` agreed in forward (a 0-d tensor) and runs the loop's
backward: one implementation, two entry points.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from ..comm import RingComm, collective, metadata_device, resolve_group
from ..kernels import Kernel
from ..layouts import DEFAULT_LAYOUT, Layout, local_positions
from ..masks import Mask, mask_key
from ..merge import merge_, merge_weights
from ..plan import Plan
from ..spec import BACKWARD_OVERLAP, AttnSpec, accumulator_dtype
from ..validate import (agreed, autocast_inputs, caller_error, check_local, differentiable_once,
                        no_autocast, op_call_args, optional_tensor, tag_result, unit_stride)

__all__ = ["BACKWARD_OVERLAP", "Ring", "RingAttention", "attention_backward",
           "attention_forward", "build_ring", "compiled_ring_attention", "ring_attention",
           "ring_backward", "ring_forward"]

@dataclass(frozen=True)
class Ring:
    """Everything the loop needs besides tensors: who we are, what to compute, with what."""

    comm: RingComm
    spec: AttnSpec
    plan: Plan
    kernel: Kernel
    steps: int
    """Ring steps taken: 1 + the last step at which ANY rank has a block (agreed by all
    ranks). K/V stop travelling after it; the dK/dV accumulators then go straight home."""
    backward_overlap: str = "all"
    layout: Layout | None = None
    """Where tokens live (needed only for position-dependent scores: ALiBi)."""
    positions: tuple | None = None
    """(query positions [L], key positions [columns]) of a one-step ring whose keys are not
    one rank's shard (all-gathered keys); None: from ``layout``."""
    query_shard: tuple[int, int] | None = None
    """(rank, world) of ``layout`` whose shard the queries are, where that is not the comm's
    (the all-gather's one-rank ring over every rank's keys); None: the comm's."""
    score_bias: object | None = None
    """A per-query score modification computed from data this rank holds (``score_bias``'s
    ``RelativeBias``: each query's own bias-vs-distance row, indexed by the global distance
    to the key); None: none. Its ``options`` give the kernel a block's share."""

    def blocks(self, step: int):
        return self.plan.steps[step]

    def kernel_options(self, step: int, blk, device) -> dict:
        """Keyword arguments for the kernel beyond (q, k, v, scale, mask): only what is
        used, so kernels that never soft-cap (or bias) need not take the arguments. ALiBi
        gets the slopes and the GLOBAL positions of the block's rows and columns."""
        opts = {"softcap": self.spec.softcap} if self.spec.softcap else {}
        if self.spec.alibi_slopes is not None:
            w, s, me = self.comm.world, self.spec.seqlen, self.comm.rank
            if self.positions is not None:
                q_pos, kv_pos = (p.to(device) for p in self.positions)
            else:
                q_pos = _positions_on(self.layout, me, w, s, str(device))
                kv_pos = _positions_on(self.layout, (me - step) % w, w, s, str(device))
            slopes = _slopes_on(self.spec.alibi_slopes, str(device))
            opts["alibi"] = (slopes, q_pos[blk.q_start:blk.q_stop], kv_pos[blk.k_start:blk.k_stop])
        if self.score_bias is not None:
            w, s, me = self.comm.world, self.spec.seqlen, self.comm.rank
            q_pos = _positions_on(self.layout, me, w, s, str(device))
            kv_pos = _positions_on(self.layout, (me - step) % w, w, s, str(device))
            opts["rel_bias"] = self.score_bias.options(blk, q_pos, kv_pos)
        return opts

    def padding_rows(self, device) -> torch.Tensor | None:
        """[L] bool: the query slots past the global S (padding), or None without a layout."""
        if self.layout is None:
            return None
        rank, world = self.query_shard or (self.comm.rank, self.comm.world)
        pos = _positions_on(self.layout, rank, world, self.spec.seqlen, str(device))
        return pos >= self.spec.seqlen


@lru_cache(maxsize=64)
def _positions_on(layout: Layout, rank: int, world: int, seqlen: int, device: str):
    return local_positions(layout, rank, world, seqlen).to(device)


@lru_cache(maxsize=64)
def _slopes_on(slopes: tuple[float, ...], device: str):
    return torch.tensor(slopes, dtype=torch.float64, device=device)


def ring_forward(q_BLHD, k_BLHD, v_BLHD, ring: Ring, keep_accumulator: bool = False):
    """Return (out [B, L, H, D] in q's dtype, lse [B, H, L] float32/float64); out stays in
    the accumulator dtype with ``keep_accumulator`` (for callers that merge more keys in)."""
    b, n, h, _ = q_BLHD.shape
    acc = accumulator_dtype(q_BLHD.dtype)
    steps, scale = ring.steps, ring.spec.softmax_scale
    out_BLHD = torch.zeros(b, n, h, v_BLHD.shape[3], dtype=acc, device=q_BLHD.device)
    lse_BHL = torch.full((b, h, n), float("-inf"), dtype=acc, device=q_BLHD.device)
    kv, split = _kv_buffer(k_BLHD, v_BLHD, steps)
    spare = torch.empty_like(kv) if steps > 1 else None
    written: list[tuple[int, int]] = []  # row spans that hold a partial result already
    for step in range(steps):
        hop = (ring.comm.hop(kv, spare, RingComm.KV_TAG, what=f"forward, K/V hop of step {step}")
               if step + 1 < steps else None)
        k_, v_ = split(kv)
        for blk in ring.blocks(step):
            rows, cols = slice(blk.q_start, blk.q_stop), slice(blk.k_start, blk.k_stop)
            o, lse = ring.kernel.forward(
                q_BLHD[:, rows], k_[:, cols], v_[:, cols], scale, blk.mask,
                **ring.kernel_options(step, blk, q_BLHD.device),
            )
            if any(lo < blk.q_stop and blk.q_start < hi for lo, hi in written):
                merge_(out_BLHD[:, rows], lse_BHL[:, :, rows], o, lse)
            else:  # first result for these rows: merging with (0, -inf) is a copy
                out_BLHD[:, rows] = o
                lse_BHL[:, :, rows] = lse
            written.append((blk.q_start, blk.q_stop))
        if hop is not None:
            kv, spare = hop.wait(), kv
    return (out_BLHD if keep_accumulator else out_BLHD.to(q_BLHD.dtype)), lse_BHL


def ring_backward(dout_BLHD, q_BLHD, k_BLHD, v_BLHD, out_BLHD, lse_BHL, ring: Ring,
                  keep_accumulator: bool = False):
    """Return (dq, dk, dv) in the dtypes of q, k, v (dq in the accumulator dtype with
    ``keep_accumulator``, for callers that add more to it).

    The dK/dV accumulator of step t arrives from the previous rank, which sent it after its
    own step t-1. ``ring.backward_overlap`` decides what travels while the kernels run:

    * "all": the next K/V and both accumulators (the one leaving, the one arriving); the
      accumulator is awaited after the kernels. Fastest; the most buffers alive.
    * "kv": the next K/V only; the accumulator is awaited before the kernels and the block
      gradients go straight into it (one accumulator fewer alive during the kernels).
    * "none": nothing; K/V move after the kernels, then the accumulator, each in its own
      hop, so no receive buffer is alive during the kernels. Leanest; every hop is exposed.

    Measured per-rank peaks are in benchmarks/RESULTS.md.
    """
    acc = accumulator_dtype(q_BLHD.dtype)
    steps, scale, overlap = ring.steps, ring.spec.softmax_scale, ring.backward_overlap
    dq_BLHD = _Rows(q_BLHD.shape, acc, q_BLHD.device)
    kv, split = _kv_buffer(k_BLHD, v_BLHD, steps)
    dk_width = k_BLHD.shape[3]
    spare = torch.empty_like(kv) if steps > 1 and overlap != "none" else None
    grad_hop = None
    for step in range(steps):
        more = step + 1 < steps
        hop = (ring.comm.hop(kv, spare, RingComm.KV_TAG, what=f"backward, K/V hop of step {step}")
               if more and spare is not None else None)
        dkv = None  # this step's accumulator, holding the contributions of earlier ranks
        if step == 0:  # dK and dV side by side on the head dim: [B, L, Hkv, D + Dv]
            shape = (*k_BLHD.shape[:3], dk_width + v_BLHD.shape[3])
            dkv = (torch.zeros(shape, dtype=acc, device=k_BLHD.device) if steps > 1
                   else _Rows(shape, acc, k_BLHD.device, split=dk_width))  # never travels
        elif overlap != "all":
            dkv = grad_hop.wait()
        pending = []
        k_, v_ = split(kv)
        for blk in ring.blocks(step):
            rows, cols = slice(blk.q_start, blk.q_stop), slice(blk.k_start, blk.k_stop)
            dq, dk, dv = ring.kernel.backward(
                dout_BLHD[:, rows], q_BLHD[:, rows], k_[:, cols], v_[:, cols],
                out_BLHD[:, rows], lse_BHL[:, :, rows], scale, blk.mask,
                **ring.kernel_options(step, blk, q_BLHD.device),
            )
            dq_BLHD.add(rows, dq)
            pending.append((cols, dk, dv))
            del dq, dk, dv  # held by ``pending`` only, so adding them in releases them
            if dkv is not None:
                _add_block_grads(dkv, pending)
        if dkv is None:
            dkv = grad_hop.wait()
            _add_block_grads(dkv, pending)
        if more and spare is None:  # "none": K/V move now, into a buffer made for them
            kv = ring.comm.hop(kv, torch.empty_like(kv), RingComm.KV_TAG,
                               what=f"backward, K/V hop of step {step}").wait()
        if steps > 1:
            # on to the next rank; after the last step, straight home to the K/V's owner
            # (``step`` ranks back, which is the next rank when the ring makes a full turn)
            shift = 1 if more else -step
            grad_hop = ring.comm.hop(dkv, torch.empty_like(dkv), RingComm.GRAD_TAG, shift,
                                     what=f"backward, dK/dV hop of step {step}")
            del dkv  # the hop holds it until its send completes
        if hop is not None:
            kv, spare = hop.wait(), kv
    if grad_hop is not None:
        dkv = grad_hop.wait()  # our own block's gradients, home after a full turn
    dq = dq_BLHD.parts()[0]
    dq = dq if keep_accumulator else dq.to(q_BLHD.dtype)
    if isinstance(dkv, _Rows):  # a one-step ring: nothing travelled
        dk, dv = dkv.parts()
    else:
        dk, dv = dkv[..., :dk_width], dkv[..., dk_width:]
    return dq, dk.to(k_BLHD.dtype).contiguous(), dv.to(v_BLHD.dtype).contiguous()


class _Rows:
    """A sum over row ranges (dim 1) made only when needed: the first contribution that
    covers every row is taken as it is (in the accumulator dtype), so a one-block step (a
    one-rank ring: Ulysses, all-gather) keeps no zero-filled copy beside the kernel's
    output. With ``split`` it holds two parts of the last dim apart (dK and dV of a ring
    whose accumulator never travels)."""

    def __init__(self, shape, dtype, device, split: int | None = None):
        self.shape, self.dtype, self.device, self.split = tuple(shape), dtype, device, split
        self._parts = None

    def add(self, rows: slice, *xs) -> None:
        if self._parts is None and rows.start == 0 and rows.stop == self.shape[1]:
            self._parts = [x.to(self.dtype) for x in xs]
            return
        for part, x in zip(self.parts(), xs):
            part[:, rows] += x

    def parts(self) -> list[torch.Tensor]:
        """The sum (two parts with ``split``): zeros if nothing was added."""
        if self._parts is None:
            widths = [self.shape[-1]] if self.split is None else [self.split, self.shape[-1] - self.split]
            self._parts = [torch.zeros((*self.shape[:-1], w), dtype=self.dtype, device=self.device)
                           for w in widths]
        return self._parts


def _add_block_grads(dkv_BLHE, pending) -> None:
    """Add and release the block gradients in ``pending`` (a list of (cols, dk, dv)) into
    the [B, L, Hkv, D + Dv] accumulator (a tensor, or a ``_Rows`` at step 0)."""
    for cols, dk, dv in pending:
        if isinstance(dkv_BLHE, _Rows):
            dkv_BLHE.add(cols, dk, dv)
            continue
        d = dk.shape[-1]
        dkv_BLHE[:, cols, :, :d] += dk
        dkv_BLHE[:, cols, :, d:] += dv
    pending.clear()


def _kv_buffer(k_BLHD, v_BLHD, steps):
    """(buffer, split): K and V side by side on the head dim, [B, L, Hkv, D + Dv], as one
    message when they travel (as they are otherwise), and the function that views any
    such buffer as (k, v)."""
    d = k_BLHD.shape[3]
    if steps == 1:
        return (k_BLHD, v_BLHD), lambda kv: kv
    return torch.cat((k_BLHD, v_BLHD), dim=3), lambda kv: (kv[..., :d], kv[..., d:])


# ---------------------------------------------------------------------------------------
# What every strategy wraps around the loops: attention sinks and the gradient of lse.
# ---------------------------------------------------------------------------------------

LSE_GRAD_COLUMNS = 8
"""Extra head-dim columns that carry the lse gradient through the backward (8 keeps CUDA
kernels' alignment)."""


def _fold_lse_grad(q, k, v, dout, out, dlse_BHL):
    """Inputs of a backward whose result includes the gradient of lse.

    d lse_i / d s_ij = p_ij, so the lse gradient g adds g_i p_ij to the score gradient
    ds_ij = p_ij (dp_ij - delta_i), delta_i = dout_i . out_i: it is the same backward with
    delta_i - g_i in place of delta_i. Every kernel computes delta from (dout, out), so one
    extra column with dout = 1 and out = -g (and 0 in q, k, v, so scores and dp do not
    change) makes it so. The extra columns of dq, dk, dv are dropped.
    """
    e = LSE_GRAD_COLUMNS
    pad = [torch.nn.functional.pad(t, (0, e)) for t in (q, k, v, dout, out)]
    g = torch.where(torch.isfinite(dlse_BHL), dlse_BHL, 0.0).transpose(1, 2)  # [B, L, H]
    pad[3][..., -e] = 1
    pad[4][..., -e] = -g.to(out.dtype)
    return pad


def _sink_lse(lse_BHL, sinks_H, ring: Ring):
    """[B, H, L] the sink logit of every row in lse's dtype: ``sinks[h]``, but -inf on
    padding rows (query slots past S see no key and no sink: out 0, lse -inf)."""
    if sinks_H.dim() == 3:  # one sink logit per query row: [B, H, L]
        sink_BHL = sinks_H.to(lse_BHL.dtype).expand_as(lse_BHL)
    else:
        sink_BHL = sinks_H.to(lse_BHL.dtype).view(1, -1, 1).expand_as(lse_BHL)
    padding_L = ring.padding_rows(lse_BHL.device)
    if padding_L is not None:
        sink_BHL = sink_BHL.masked_fill(padding_L, float("-inf"))
    return sink_BHL


def _add_sinks(out_BLHD, lse_BHL, sink_BHL):
    """Fold attention sinks into a finished result: a sink is a key with logit ``sinks[h]``
    and value 0 in every row's softmax (gpt-oss), so it is the merge with (out 0, lse
    sink): lse' = logaddexp(lse, sink), out' = out * sigmoid(lse - sink). A row with
    neither keys nor sink (a -inf sink, padding) keeps out 0 and lse -inf."""
    new_BHL, keep, _ = merge_weights(lse_BHL, sink_BHL)
    return out_BLHD * keep, new_BHL


def attention_forward(q, k, v, sinks, ring: Ring):
    """(out, lse) of this rank's queries over every key of the ring (and the sinks)."""
    if sinks is None:
        return ring_forward(q, k, v, ring)
    acc_out, lse = ring_forward(q, k, v, ring, keep_accumulator=True)
    acc_out, lse = _add_sinks(acc_out, lse, _sink_lse(lse, sinks.detach(), ring))
    return acc_out.to(q.dtype), lse


def attention_backward(ring: Ring, lse_grad: bool, q, k, v, out, lse, sinks, dout, dlse,
                       need_dsinks: bool):
    """(dq, dk, dv, dsinks or None) for upstream gradients ``dout`` and ``dlse`` (either may
    be None), against the final out and lse (sinks included).

    The ring runs against the FINAL out and lse: p_ij = exp(s_ij - lse_i) is then each
    key's true probability, so per-block gradients add up exactly; the sink of head h gets
    -sum_i p_sink_i (delta_i - dlse_i) over this rank's rows, delta_i = dout_i . out_i (its
    share: sum it over the group like any parameter's). With ``lse_grad`` every rank takes
    part in one small all-reduce that decides whether any rank has an lse gradient.
    """
    dout = torch.zeros_like(out) if dout is None else dout.contiguous()
    fold = dlse is not None
    if lse_grad and ring.comm.world > 1:
        # every rank must send the same shapes: fold if any rank has an lse gradient
        flag = torch.tensor([int(fold)], device=metadata_device(ring.comm.group))
        collective("backward's agreement on an lse gradient", ring.comm.group,
                   lambda: dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ring.comm.group,
                                           async_op=True))
        fold = bool(flag.item())
    dsinks = None
    if sinks is not None and need_dsinks:
        acc = accumulator_dtype(q.dtype)
        delta_BHL = (dout.to(acc) * out.to(acc)).sum(-1).transpose(1, 2)
        if dlse is not None:
            delta_BHL = delta_BHL - torch.where(torch.isfinite(dlse), dlse, 0.0).to(acc)
        # a row without keys and sink (lse -inf: a -inf sink, padding) has p_sink 0
        lse_acc = lse.to(acc)
        sink_BHL = _sink_lse(lse_acc, sinks.detach(), ring)
        p_sink = torch.where(lse_acc > float("-inf"), torch.exp(sink_BHL - lse_acc), 0.0)
        dsinks = -(p_sink * delta_BHL)
        dsinks = (dsinks if sinks.dim() == 3 else dsinks.sum((0, 2))).to(sinks.dtype)
    if not fold:
        return (*ring_backward(dout, q, k, v, out, lse, ring), dsinks)
    if dlse is None:
        dlse = torch.zeros_like(lse)
    d, dv_width = q.shape[-1], v.shape[-1]
    padded = _fold_lse_grad(q, k, v, dout, out, dlse)
    dq, dk, dv = ring_backward(padded[3], *padded[:3], padded[4], lse, ring)
    return dq[..., :d], dk[..., :d], dv[..., :dv_width], dsinks


class RingAttention(torch.autograd.Function):
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
    @differentiable_once
    def backward(ctx, dout, dlse):
        q, k, v, out, lse, sinks = ctx.saved_tensors
        with no_autocast(q.device.type):  # backward() may run under autocast
            grads = attention_backward(ctx.ring, ctx.lse_grad, q, k, v, out, lse, sinks, dout,
                                       dlse, ctx.needs_input_grad[3])
        return (*grads, None, None)


def dropout_error(dropout_p) -> ValueError | None:
    """The check of flash-attn's ``dropout_p``, which the attention functions take so that
    a flash-attn call ports as it is: None for 0 (``0.0`` or ``0``), else the ValueError
    naming the value, for ``caller_error``: the call's agreement raises it on every rank,
    before any send (a rank that alone passes dropout never leaves the others waiting)."""
    if isinstance(dropout_p, (int, float)) and not isinstance(dropout_p, bool) and dropout_p == 0:
        return None
    return ValueError(f"dropout_p={dropout_p!r}: ringattn computes exact attention, without "
                      f"dropout (dropout_p must be 0)")


def ring_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    group=None,
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
        dropout_p: flash-attn's; must be 0 (``0.0`` or ``0``): the attention is exact,
            without dropout (any other value: ValueError on every rank).
        causal: query i sees key j only if j <= i.
        window_size: (left, right), as in flash-attn: query i sees key j iff
            i - left <= j <= i + right; -1 is unbounded on that side.
        softmax_scale: scale of q.k before the softmax; default 1 / sqrt(D).
        layout: "zigzag" (the default everywhere: shard, unshard, positions, shard_batch),
            "contiguous" or "striped": how global tokens were placed on ranks. A tensor
            made by ``ringattn.shard`` remembers its layout, S and documents; passing it
            with others raises.
        seqlen: the global S (any value >= 1). Defaults to cu_seqlens[-1], else the S a
            ``ringattn.shard`` tag on q carries; an untagged q (a projection, reshape or
            clone of a shard) without either is refused, since padded shards cannot be
            told from unpadded ones (pass W * S_local for unpadded shards). Shards hold
            ``layout.local_len(S, W)`` tokens; slots past S are padding, masked as keys and
            yielding zeros as queries.
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
            queries: sum it over the group, as any parameter's under CP. Finite or -inf (a
            head without a sink: its rows that see no key give out 0, lse -inf); the ranks
            compare the values in the agreement (one copy of H floats to the host per call).
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
    given_q = q
    refused = dropout_error(dropout_p)
    q, k, v = autocast_inputs(q, k, v)
    if torch.compiler.is_compiling():  # opaque custom ops: see the end of this file
        if refused is not None:
            raise refused
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
    with caller_error(refused):  # raised by the agreement, on every rank, before any send
        ring = build_ring(
            q, k, v, group=group, causal=causal, window_size=window_size,
            softmax_scale=softmax_scale, layout=layout, seqlen=seqlen, mask=mask,
            cu_seqlens=cu_seqlens, return_lse=return_lse, kernel=kernel,
            backward_overlap=backward_overlap, softcap=softcap, sinks=sinks,
            alibi_slopes=alibi_slopes,
        )
    q, k, v = unit_stride(q, k, v)
    with no_autocast(q.device.type):  # the kernels accumulate in fp32 themselves
        out, lse = RingAttention.apply(q, k, v, sinks, ring, bool(return_lse))
    return tag_result(given_q, out, lse, return_lse)




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
    pg, comm, checked, last = agreed(
        q, k, v, group, extra_fields, extra_check, plan_ring=True, causal=causal,
        window_size=window_size, softmax_scale=softmax_scale, layout=layout, seqlen=seqlen,
        mask=mask, cu_seqlens=cu_seqlens, kernel=kernel, backward_overlap=backward_overlap,
        return_lse=return_lse, softcap=softcap, sinks=sinks, alibi_slopes=alibi_slopes)
    return Ring(comm, checked.spec, checked.plan, checked.kernel, last + 1, backward_overlap,
                checked.layout)




# -- the compile op pair ------------------------------------------------------------------

@torch.library.custom_op("ringattn::ring_attention", mutates_args=())
def _ring_attention_op(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, sinks: torch.Tensor,
    cu_seqlens: torch.Tensor, alibi_slopes: torch.Tensor, group_name: str, causal: bool, window_left: int,
    window_right: int, softmax_scale: float, layout: str, seqlen: int, mask_key: int,
    softcap: float, kernel: str, backward_overlap: str, return_lse: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    args = op_call_args(cu_seqlens, group_name, causal, window_left, window_right,
                      softmax_scale, layout, seqlen, mask_key)
    ring = build_ring(q, k, v, **args, return_lse=return_lse, kernel=kernel,
                      backward_overlap=backward_overlap, softcap=softcap, sinks=optional_tensor(sinks),
                      alibi_slopes=optional_tensor(alibi_slopes))
    with torch.autocast(q.device.type, enabled=False):  # kernels pick their own dtypes
        out, lse = attention_forward(q, k, v, optional_tensor(sinks), ring)
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
    args = op_call_args(cu_seqlens, group_name, causal, window_left, window_right,
                      softmax_scale, layout, seqlen, mask_key)
    pg = args.pop("group")
    comm = RingComm(pg)
    # validated and agreed in forward: the cached plan, no second agreement
    checked = check_local(
        q, k, v, comm, args["causal"], args["window_size"], args["softmax_scale"],
        args["layout"], args["seqlen"], args["mask"], args["cu_seqlens"], kernel,
        backward_overlap, return_lse, pg, softcap, optional_tensor(sinks), optional_tensor(alibi_slopes))
    ring = Ring(comm, checked.spec, checked.plan, checked.kernel, int(steps), backward_overlap,
                checked.layout)
    with torch.autocast(q.device.type, enabled=False):
        dq, dk, dv, dsinks = attention_backward(
            ring, return_lse, q, k, v, out, lse, optional_tensor(sinks), dout, optional_tensor(dlse),
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



if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
