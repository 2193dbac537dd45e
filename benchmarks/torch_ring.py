"""PyTorch's own context-parallel ring attention on CPU, callable like a plain function.

Legend: B batch, H heads, Hkv kv heads, S global seq, L local seq (S / W), D head dim,
W world size.

Benchmark-only adapter. torch (2.13) has no public function for "ring attention on these
local shards"; its ``context_parallel`` context manager patches SDPA and shards module
buffers. What it runs underneath is ``_templated_ring_attention`` (forward) and
``_templated_ring_attention_backward``; here they are called directly with torch's fused
CPU flash op, the same op ringattn's CPU kernel calls, so a comparison measures the ring
and not the local kernel. Everything private we touch is in this one file:

* ``_cp_options.enable_load_balance``: torch decides per step whether to skip, run with
  ``is_causal`` or run on half a shard from this flag. It must be True for causal attention
  on head-tail (zigzag) shards and False for full attention (torch raises otherwise).
* ``_cp_options.rotate_method``: default ALL_GATHER, i.e. the forward and the backward each
  all-gather the whole K/V once (every rank holds W shards of K/V); dK/dV travel by
  all-to-all. ``rotate="alltoall"`` selects torch's all-to-all rotation instead.

Both options are module-level state in torch; ``_options`` sets them for the duration of
one call and puts the previous values back.

Inputs are in torch's layout, [B, H, L, D] (sequence on dim 2), contiguous. Causal shards
are made with torch's own ``_HeadTailLoadBalancer`` (``shard``); that is the same
placement as ringattn's "zigzag" layout, which ``self_check`` verifies token by token.
"""

from __future__ import annotations

import contextlib
import math

import torch
import torch.distributed as dist
from torch.distributed.tensor.experimental._context_parallel import _attention as _cp
from torch.distributed.tensor.experimental._context_parallel._load_balancer import (
    _HeadTailLoadBalancer,
)

__all__ = ["torch_ring_attention", "shard", "positions", "self_check"]

SEQ_DIM = 2
"""Sequence dimension of torch's [B, H, S, D] layout."""

_FWD_OP = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu
_BWD_OP = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward
_ROTATE = {"allgather": _cp._RotateMethod.ALL_GATHER, "alltoall": _cp._RotateMethod.ALL_TO_ALL}


@contextlib.contextmanager
def _options(causal: bool, rotate: str):
    """Set torch's module-level CP options for one call; restore them afterwards."""
    opts = _cp._cp_options
    saved = (opts.enable_load_balance, opts.rotate_method)
    opts.enable_load_balance = causal  # head-tail shards for causal; torch rejects it for full
    opts.rotate_method = _ROTATE[rotate]
    try:
        yield
    finally:
        opts.enable_load_balance, opts.rotate_method = saved


class _TorchRing(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q_BHLD, k_BHLD, v_BHLD, group, causal, scale, rotate):
        with _options(causal, rotate):
            out_BHLD, lse_BHL = _cp._templated_ring_attention(
                group, SEQ_DIM, _FWD_OP, q_BHLD, k_BHLD, v_BHLD, is_causal=causal, scale=scale
            )
        ctx.save_for_backward(q_BHLD, k_BHLD, v_BHLD, out_BHLD, lse_BHL)
        ctx.args = (group, causal, scale, rotate)
        return out_BHLD

    @staticmethod
    def backward(ctx, dout_BHLD):
        group, causal, scale, rotate = ctx.args
        q_BHLD, k_BHLD, v_BHLD, out_BHLD, lse_BHL = ctx.saved_tensors
        with _options(causal, rotate):
            dq, dk, dv = _cp._templated_ring_attention_backward(
                group, SEQ_DIM, _BWD_OP, dout_BHLD.contiguous(), "grad_out",
                q_BHLD, k_BHLD, v_BHLD, out_BHLD, lse_BHL, causal,
                dropout_p=0.0, scale=scale,
            )
        return dq, dk, dv, None, None, None, None


def torch_ring_attention(q_BHLD, k_BHLD, v_BHLD, *, group=None, causal=False,
                         softmax_scale=None, rotate="allgather"):
    """PyTorch's CP ring attention over the ranks of ``group``, differentiable.

    Arguments:
        q_BHLD: [B, H, L, D] this rank's queries (head-tail shard when causal).
        k_BHLD, v_BHLD: [B, Hkv, L, D]; H % Hkv == 0 (the CPU flash op does GQA natively).
        group: a ProcessGroup (default: the world group).
        causal: causal attention on head-tail shards; False: full attention on contiguous
            shards.
        softmax_scale: default 1 / sqrt(D).
        rotate: "allgather" (torch's default) or "alltoall".

    Returns:
        out [B, H, L, D] in q's dtype.

    Raises:
        ValueError: H not a multiple of Hkv (the op would read out of bounds), unknown rotate.
    """
    group = dist.group.WORLD if group is None else group
    h, hkv = q_BHLD.shape[1], k_BHLD.shape[1]
    if hkv == 0 or h % hkv:
        raise ValueError(f"q has {h} heads, not a multiple of k's {hkv} heads")
    if rotate not in _ROTATE:
        raise ValueError(f"rotate={rotate!r}; choose one of {sorted(_ROTATE)}")
    scale = 1.0 / math.sqrt(q_BHLD.shape[-1]) if softmax_scale is None else float(softmax_scale)
    return _TorchRing.apply(q_BHLD, k_BHLD, v_BHLD, group, bool(causal), scale, rotate)


def positions(seqlen: int, *, group=None, causal: bool) -> torch.Tensor:
    """Global positions of this rank's local tokens under torch's sharding: [L] int64.

    Causal: torch's head-tail load balancer (S must divide by 2W). Full: contiguous chunks.
    """
    group = dist.group.WORLD if group is None else group
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    if seqlen % (2 * world if causal else world):
        raise ValueError(f"seqlen={seqlen} does not divide into {world} ranks' {'head-tail ' if causal else ''}shards")
    if causal:
        idx = _HeadTailLoadBalancer(seqlen, world, "cpu")._generate_indices()[0]
    else:
        idx = torch.arange(seqlen)
    return idx.chunk(world)[rank]


def shard(x_BHSD: torch.Tensor, *, group=None, causal: bool) -> torch.Tensor:
    """This rank's shard of a global [B, H, S, D] tensor, as torch's CP would make it."""
    pos = positions(x_BHSD.shape[SEQ_DIM], group=group, causal=causal)
    return x_BHSD.index_select(SEQ_DIM, pos).contiguous()


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item()


def self_check(q_BSHD, k_BSHD, v_BSHD, dout_BSHD, *, group=None, causal: bool) -> dict:
    """Run torch's ring and ringattn on the same global inputs; return the max abs errors.

    Global inputs are ringattn's [B, S, H, D]. ringattn runs with layout "zigzag" (causal)
    or "contiguous" (full), which must put the same tokens on this rank as torch's sharding
    (checked); then out, dq, dk, dv of the two are compared on this rank's shard, and
    ringattn's output is also compared with torch SDPA over the whole sequence.

    Returns:
        {"out": err, "dq": err, "dk": err, "dv": err, "out_vs_sdpa": err, "scale": max|out|}
        with errors in float64 of the max absolute difference.

    Raises:
        RuntimeError: the two sharding schemes put different tokens on this rank.
    """
    import ringattn

    group = dist.group.WORLD if group is None else group
    s = q_BSHD.shape[1]
    layout = "zigzag" if causal else "contiguous"
    ours_pos = ringattn.positions(s, group=group, layout=layout)
    theirs_pos = positions(s, group=group, causal=causal)
    if not torch.equal(ours_pos, theirs_pos):
        raise RuntimeError(f"ringattn {layout!r} and torch's sharding differ on this rank: "
                           f"{ours_pos[:8].tolist()}... vs {theirs_pos[:8].tolist()}...")

    def leaves(*ts):
        return [t.detach().clone().requires_grad_() for t in ts]

    with torch.no_grad():
        q_l, k_l, v_l, do_l = (ringattn.shard(t, group=group, layout=layout) for t in (q_BSHD, k_BSHD, v_BSHD, dout_BSHD))
    q1, k1, v1 = leaves(q_l, k_l, v_l)
    out1 = ringattn.ring_attention(q1, k1, v1, group=group, causal=causal, layout=layout,
                                   seqlen=s)
    g1 = torch.autograd.grad(out1, (q1, k1, v1), do_l)

    q2, k2, v2 = leaves(*(t.transpose(1, 2).contiguous() for t in (q_l, k_l, v_l)))
    out2 = torch_ring_attention(q2, k2, v2, group=group, causal=causal)
    g2 = torch.autograd.grad(out2, (q2, k2, v2), do_l.transpose(1, 2).contiguous())

    ref = torch.nn.functional.scaled_dot_product_attention(
        *(t.transpose(1, 2) for t in (q_BSHD, k_BSHD, v_BSHD)),
        is_causal=causal, enable_gqa=k_BSHD.shape[2] != q_BSHD.shape[2],
    ).transpose(1, 2)
    errs = {"out": _err(out1, out2.transpose(1, 2))}
    for name, a, b in zip(("dq", "dk", "dv"), g1, g2):
        errs[name] = _err(a, b.transpose(1, 2))
    errs["out_vs_sdpa"] = _err(out1, ref.index_select(1, ours_pos))
    errs["scale"] = out1.detach().abs().max().item()
    return errs


def _check_task(s: int, h: int, hkv: int, d: int, causal: bool) -> dict:
    from common import global_inputs

    return self_check(*global_inputs(s, h, hkv, d, torch.float32), causal=causal)


def main() -> None:
    """Cross-check torch's ring against ringattn on 1, 2 and 4 gloo ranks (S=1024, fp32)."""
    from common import Cluster

    tol, worst = 1e-5, 0.0  # see CHECK_TOL in bench_attention.py
    for w in (1, 2, 4):
        cluster = Cluster(w)
        try:
            for hkv in (8, 2):
                for causal in (True, False):
                    errs = cluster.run(_check_task, 1024, 8, hkv, 64, causal)
                    err = max(e[n] for e in errs for n in ("out", "dq", "dk", "dv"))
                    worst = max(worst, err)
                    print(f"W={w} Hkv={hkv} {'causal' if causal else 'full  '}: max abs error "
                          f"{err:.1e}, ringattn vs SDPA {max(e['out_vs_sdpa'] for e in errs):.1e}")
        finally:
            cluster.close()
    if worst > tol:
        raise SystemExit(f"torch's ring and ringattn differ by {worst:.2e} > {tol}")
    print(f"torch's ring matches ringattn within {tol} (worst {worst:.1e})")


if __name__ == "__main__":
    main()
