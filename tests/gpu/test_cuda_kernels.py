"""CUDA block kernels and the ring on one GPU (skipped without CUDA; CI has none).

The CUDA fused kernel is checked against the float64 oracle exactly as the CPU one is:
fp32 within 1e-5 relative, bf16 within 2x torch's own bf16 SDPA error on the same inputs.
"""

import os
import tempfile

import pytest
import torch

from reference import attention, rel_err
from ringattn.kernels import get_kernel
from ringattn.masks import Band

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")

BANDS = [None, Band(0, None), Band(-3, 2), Band(-2, None), Band(None, 4)]


def _inputs(sq, sk, h, hkv, d, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(2, n, hh, d, generator=g).to("cuda", dtype)
            for n, hh in ((sq, h), (sk, hkv), (sk, hkv), (sq, h))]


@pytest.mark.parametrize("band", BANDS, ids=str)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", [(300, 310, 8, 2, 64), (77, 77, 4, 4, 128)])
def test_cuda_kernel_matches_float64(band, dtype, shape):
    sq, sk, h, hkv, d = shape
    q, k, v, do = _inputs(sq, sk, h, hkv, d, dtype)
    ok = torch.ones(sq, sk, dtype=torch.bool, device="cuda") if band is None else band.dense(range(sq), range(sk), device="cuda")
    kern = get_kernel(None, q.device, dtype)
    assert kern.name == "sdpa-cuda"
    out, lse = kern.forward(q, k, v, 0.125, band)
    dq, dk, dv = kern.backward(do, q, k, v, out, lse, 0.125, band)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = attention(q64, k64, v64, ok, 0.125)
    ref_out.backward(do.double())
    refs = [ref_out, ref_lse, q64.grad, k64.grad, v64.grad]
    if dtype == torch.float32:
        tols = [1e-5] * 5
    else:  # 2x the error torch's own bf16 attention makes on the same inputs
        qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
        mask = ok if band is not None else None
        ob = torch.nn.functional.scaled_dot_product_attention(
            qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2), attn_mask=mask,
            scale=0.125, enable_gqa=True).transpose(1, 2)
        ob.backward(do)
        base = [rel_err(ob, ref_out), 5e-7, rel_err(qb.grad, q64.grad),
                rel_err(kb.grad, k64.grad), rel_err(vb.grad, v64.grad)]
        tols = [2 * b for b in base]
    for name, x, ref, tol in zip(("out", "lse", "dq", "dk", "dv"), (out, lse, dq, dk, dv), refs, tols):
        assert rel_err(x, ref) <= tol, (name, rel_err(x, ref), tol)


def test_ring_on_one_gpu_nccl():
    """W = 1 over NCCL equals plain attention (the only multi-rank check one GPU allows)."""
    import torch.distributed as dist

    import ringattn as ra
    from reference import reference, visible

    fd, path = tempfile.mkstemp()
    os.close(fd)
    os.unlink(path)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        q, k, v, do = _inputs(1000, 1000, 8, 2, 64, torch.float32)
        qx = q.clone().requires_grad_()
        out, lse = ra.ring_attention(qx, k, v, causal=True, layout="zigzag", seqlen=1000, return_lse=True)
        out.backward(do)
        ref = reference(q, k, v, do, visible(1000, True, (-1, -1)).cuda())
        assert rel_err(out, ref[0]) < 1e-5 and rel_err(lse, ref[1]) < 1e-5
        assert rel_err(qx.grad, ref[2]) < 1e-5
    finally:
        dist.destroy_process_group()
