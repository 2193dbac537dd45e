"""One CUDA GPU: ringattn's kernels and its W=1 path against torch's own attention.

Legend: B batch, S seq, H heads, Hkv kv heads, D head dim.

One GPU hosts one NCCL rank, so this measures what a rank's GPU does, not the ring's
communication: ``ring_attention`` at W = 1 (plan, kernel, merge, autograd) fwd+bwd, against

* causal: ``F.scaled_dot_product_attention(is_causal=True)`` (torch picks flash);
* packed documents & causal: ``flex_attention`` compiled with the same block mask built
  directly, and SDPA with the dense [S, S] boolean mask.

Times are medians of CUDA-event-timed fwd+bwd iterations after warm-up (triton's
``do_bench``); ratios are taken within one run. Also records the plan's first-call cost
(mask classification) against the cached call. Writes JSON to ``--out``.

    python benchmarks/bench_gpu.py --out results/gpu.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import tempfile
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "src"))
import ringattn as ra  # noqa: E402


def random_docs(seqlen, median, seed):
    g = torch.Generator().manual_seed(seed)
    cu = [0]
    while cu[-1] < seqlen:
        n = int(torch.exp(torch.randn((), generator=g) * 0.8) * median)
        cu.append(min(seqlen, cu[-1] + max(1, n)))
    return cu


def bench(fn, inputs, grad):
    from triton.testing import do_bench

    def step():
        for t in inputs:
            t.grad = None
        out = fn()
        out.backward(grad)

    return do_bench(step, warmup=100, rep=400, return_mode="median")


def flops(visible_pairs, h, d):
    return 4 * visible_pairs * h * d * 3.5  # forward: two matmuls (4 flops per pair per dim); backward 2.5x


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="gpu.json")
    ap.add_argument("--seqlens", default="8192,32768")
    args = ap.parse_args()
    fd, path = tempfile.mkstemp()
    os.close(fd)
    os.unlink(path)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1)
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    flex = torch.compile(flex_attention, dynamic=False)
    b, h, hkv, d, dtype = 1, 16, 4, 128, torch.bfloat16
    rows = []
    for s in map(int, args.seqlens.split(",")):
        g = torch.Generator(device="cuda").manual_seed(0)
        q = torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g).requires_grad_()
        k = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype, generator=g).requires_grad_()
        v = torch.randn(b, s, hkv, d, device="cuda", dtype=dtype, generator=g).requires_grad_()
        do = torch.randn(b, s, h, d, device="cuda", dtype=dtype, generator=g)
        qt, kt, vt = (x.detach().transpose(1, 2).contiguous().requires_grad_() for x in (q, k, v))
        dot = do.transpose(1, 2).contiguous()

        # causal
        t_ring = bench(lambda: ra.ring_attention(q, k, v, causal=True), (q, k, v), do)
        t_sdpa = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, is_causal=True, enable_gqa=True),
                       (qt, kt, vt), dot)
        pairs = s * (s + 1) // 2
        rows.append(dict(S=s, mask="causal", ringattn_ms=t_ring, sdpa_ms=t_sdpa,
                         ratio_ringattn_over_sdpa=t_ring / t_sdpa,
                         ringattn_tflops=flops(pairs, h, d) / t_ring / 1e9))
        print(rows[-1], flush=True)

        # packed documents & causal
        cu = random_docs(s, 2048, seed=s)
        doc = torch.repeat_interleave(torch.arange(len(cu) - 1, device="cuda"),
                                      torch.tensor(cu[1:]) .diff(prepend=torch.tensor([0])).cuda())
        t0 = time.perf_counter()
        out = ra.ring_attention(q, k, v, causal=True, cu_seqlens=cu)
        torch.cuda.synchronize()
        first_ms = (time.perf_counter() - t0) * 1e3
        t0 = time.perf_counter()
        out = ra.ring_attention(q, k, v, causal=True, cu_seqlens=cu)
        torch.cuda.synchronize()
        cached_ms = (time.perf_counter() - t0) * 1e3
        del out
        t_ring = bench(lambda: ra.ring_attention(q, k, v, causal=True, cu_seqlens=cu), (q, k, v), do)

        def doc_causal(bb, hh, i, j):
            return (doc[i] == doc[j]) & (j <= i)

        bm = create_block_mask(doc_causal, None, None, s, s, device="cuda")
        t_flex = bench(lambda: flex(qt, kt, vt, block_mask=bm, enable_gqa=True), (qt, kt, vt), dot)
        # forward only: flex with its own mask_mod against flex with the plan's block mask
        from triton.testing import do_bench

        from ringattn.kernels.flex import _block_mask
        from ringattn.layouts import get_layout
        from ringattn.plan import make_plan

        blk = make_plan(get_layout("contiguous"), ra.masks.document(cu) & ra.masks.causal(), 1, 0,
                        s, batch=b, heads=h, device="cuda", tile=None).steps[0][0]
        ours = _block_mask(blk.mask, s, s, "cuda")
        with torch.no_grad():
            fwd_direct = do_bench(lambda: flex(qt, kt, vt, block_mask=bm, enable_gqa=True),
                                  warmup=50, rep=200, return_mode="median")
            fwd_ours = do_bench(lambda: flex(qt, kt, vt, block_mask=ours, enable_gqa=True),
                                warmup=50, rep=200, return_mode="median")
        dense = (doc[:, None] == doc[None, :]) & torch.ones(s, s, dtype=torch.bool, device="cuda").tril()
        try:
            t_dense = bench(lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=dense, enable_gqa=True),
                            (qt, kt, vt), dot)
        except torch.OutOfMemoryError:
            t_dense = float("nan")
        del dense
        lengths = torch.tensor(cu[1:]) - torch.tensor(cu[:-1])
        pairs = int((lengths * (lengths + 1) // 2).sum())
        rows.append(dict(S=s, mask="documents&causal", docs=len(cu) - 1,
                         ringattn_ms=t_ring, flex_direct_ms=t_flex, sdpa_dense_mask_ms=t_dense,
                         ratio_ringattn_over_flex=t_ring / t_flex,
                         ratio_ringattn_over_sdpa_dense=t_ring / t_dense,
                         ringattn_tflops=flops(pairs, h, d) / t_ring / 1e9,
                         first_call_ms=first_ms, cached_call_ms=cached_ms,
                         flex_fwd_own_mask_ms=fwd_direct, flex_fwd_plan_block_mask_ms=fwd_ours))
        print(rows[-1], flush=True)
        torch.cuda.empty_cache()
    # per-call host cost: at S=512 the GPU work is tiny, so fwd+bwd time is launch overhead
    for label, kw in (("causal", dict(causal=True)), ("documents&causal", dict(causal=True, cu_seqlens=[0, 100, 300, 512]))):
        x = [t[:, :512].detach().requires_grad_() for t in (q, k, v)]
        t_small = bench(lambda: ra.ring_attention(*x, **kw), x, do[:, :512])
        xt = [t[:, :, :512].detach().requires_grad_() for t in (qt, kt, vt)]
        t_sdpa = bench(lambda: F.scaled_dot_product_attention(*xt, is_causal=True, enable_gqa=True), xt, dot[:, :, :512])
        rows.append(dict(S=512, mask=label, ringattn_ms=t_small, sdpa_causal_ms=t_sdpa,
                         note="per-call overhead: GPU work is negligible at this size"))
        print(rows[-1], flush=True)
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__,
                python=platform.python_version(), shape=dict(B=b, H=h, Hkv=hkv, D=d, dtype=str(dtype)),
                date=time.strftime("%Y-%m-%d"))
    with open(args.out, "w") as f:
        json.dump(dict(meta=meta, rows=rows), f, indent=1)
    dist.destroy_process_group()
    print("wrote", args.out)


if __name__ == "__main__":
    main()
