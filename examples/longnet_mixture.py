"""LongNet's dilated attention under context parallelism, as an LSE merge.

LongNet (Ding et al., 2023) mixes several dilated attentions, each with its own segment
length w and dilation r, with weights proportional to their softmax denominators:

    out = sum_i a_i out_i,   a_i = exp(lse_i) / sum_j exp(lse_j)

which is exactly ``ringattn.merge`` of the (out_i, lse_i) pairs. Each dilated attention is
one ``ring_attention`` call with a ``masks.dilated`` mask (heads use offsets h % r, so
together they cover every position); rows outside a pattern have lse = -inf and weight 0.
The lse is differentiable, so the mixture trains.

Run on CPU ranks (gloo):  python examples/longnet_mixture.py --world 2
It prints the largest difference to the same mixture computed in one process in float64.
"""

from __future__ import annotations

import argparse
import os
import tempfile

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import ringattn as ra

CONFIGS = ((64, 1), (128, 2), (256, 4))  # (segment length w, dilation r), as in LongNet


def dilated_mixture(q_l, k_l, v_l, configs=CONFIGS, *, causal=True, **ring_kw):
    """LongNet attention of local shards: one ring per (segment, dilation), merged by LSE.

    Arguments:
        q_l, k_l, v_l: [B, S_local, H, D] / [B, S_local, Hkv, D] shards.
        configs: (segment, dilation) pairs.
        causal: and-ed with every dilated mask.
        ring_kw: passed to ``ring_attention`` (group, layout, seqlen, ...).

    Returns:
        (out [B, S_local, H, D], lse [B, H, S_local]).
    """
    out = lse = None
    for segment, dilation in configs:
        o, l = ra.ring_attention(q_l, k_l, v_l, mask=ra.masks.dilated(segment, dilation),
                                 causal=causal, return_lse=True, **ring_kw)
        out, lse = (o, l) if out is None else ra.merge(out, lse, o, l)
    return out, lse


def dense_mixture(q, k, v, configs=CONFIGS, causal=True):
    """The same mixture on one device, from dense masks (float64 reference)."""
    b, s, h, d = q.shape
    i, j = torch.arange(s)[:, None], torch.arange(s)[None, :]
    outs, lses = [], []
    for segment, r in configs:
        off = torch.arange(h).view(h, 1, 1) % r
        ok = (i // segment == j // segment) & (i % r == off) & (j % r == off)
        if causal:
            ok = ok & (j <= i)
        kk = k.transpose(1, 2).repeat_interleave(h // k.shape[2], 1)
        vv = v.transpose(1, 2).repeat_interleave(h // v.shape[2], 1)
        sc = (q.transpose(1, 2) @ kk.transpose(-1, -2)) / d ** 0.5
        sc = sc.masked_fill(~ok, float("-inf"))
        dead = ~ok.any(-1, keepdim=True)
        lse = torch.logsumexp(sc.masked_fill(dead, 0), -1).masked_fill(dead[..., 0], float("-inf"))
        p = torch.softmax(sc.masked_fill(dead, 0), -1).masked_fill(dead, 0)
        outs.append((p @ vv).transpose(1, 2))
        lses.append(lse)
    lse = torch.logsumexp(torch.stack(lses), 0)
    w = [torch.exp(x - lse).nan_to_num(0.0).transpose(1, 2).unsqueeze(-1) for x in lses]
    return sum(wi * oi for wi, oi in zip(w, outs)), lse


def _rank(rank, world, path, seqlen):
    dist.init_process_group("gloo", init_method=f"file://{path}", rank=rank, world_size=world)
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, seqlen, 8, 32) for _ in range(3))
    kw = dict(layout="zigzag", seqlen=seqlen)
    q_l, k_l, v_l = (ra.shard(t, **kw) for t in (q, k, v))
    out_l, _ = dilated_mixture(q_l, k_l, v_l, **kw)
    out = ra.unshard(out_l, **kw)
    ref, _ = dense_mixture(q.double(), k.double(), v.double())
    err = (out.double() - ref).abs().max().item()
    if rank == 0:
        print(f"LongNet mixture {CONFIGS} on {world} ranks, S={seqlen}: max |diff| to one "
              f"process in float64 = {err:.2e}")
    dist.destroy_process_group()


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--seqlen", type=int, default=1000)
    args = ap.parse_args()
    fd, path = tempfile.mkstemp()
    os.close(fd)
    os.unlink(path)
    mp.spawn(_rank, args=(args.world, path, args.seqlen), nprocs=args.world, join=True)


if __name__ == "__main__":
    main()
