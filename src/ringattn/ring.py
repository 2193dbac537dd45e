"""The ring loop: one for forward, one for backward, shared by every layout and mask.

Legend: B batch, L local seq (S_pad / W), H heads, Hkv kv heads, D head dim (Dv of the
values, which may differ: MLA), W world size.

At step t rank r holds the K/V that started on rank (r - t) mod W. Before computing on
them it posts the hop that passes them on, then asks the plan which blocks to compute.

Forward keeps fp32 accumulators (out, lse) and folds every block in with ``merge_``.
Backward sends K/V around again; each block's gradients are computed against the FINAL
out and lse, dQ accumulates locally, and a dK/dV accumulator (fp32) travels one step behind
its K/V, gaining each rank's contribution, until it arrives home after a full turn.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

import torch
import torch.distributed as dist

from .comm import RingComm, metadata_device
from .kernels import Kernel
from .layouts import Layout, local_positions
from .merge import merge_, merge_weights
from .plan import Plan
from .spec import AttnSpec, accumulator_dtype

__all__ = ["BACKWARD_OVERLAP", "Ring", "attention_backward", "attention_forward",
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


BACKWARD_OVERLAP = ("all", "kv", "none")
"""How much communication the backward overlaps with compute, from fastest to leanest."""


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
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=ring.comm.group)
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
        dsinks = -(p_sink * delta_BHL).sum((0, 2)).to(sinks.dtype)
    if not fold:
        return (*ring_backward(dout, q, k, v, out, lse, ring), dsinks)
    if dlse is None:
        dlse = torch.zeros_like(lse)
    d, dv_width = q.shape[-1], v.shape[-1]
    padded = _fold_lse_grad(q, k, v, dout, out, dlse)
    dq, dk, dv = ring_backward(padded[3], *padded[:3], padded[4], lse, ring)
    return dq[..., :d], dk[..., :d], dv[..., :dv_width], dsinks
