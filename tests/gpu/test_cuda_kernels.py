"""CUDA block kernels and the ring on one GPU (skipped without CUDA; CI has none).

The CUDA kernels are checked against the float64 oracle exactly as the CPU one is: fp32
within 1e-5 relative, bf16 within 2x torch's own bf16 SDPA error on the same inputs.

One GPU cannot host several NCCL ranks, so general masks are checked in two ways: the real
``ring_attention`` at W = 1 over NCCL, and every rank's plan of a W-rank ring executed
block by block in this process (``_blockwise``), which is what each rank's loop computes.
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


# ----------------------------------------------------------------- general masks on CUDA

import ringattn as ra  # noqa: E402
from ringattn.layouts import get_layout, local_positions  # noqa: E402
from ringattn.merge import merge_  # noqa: E402
from ringattn.plan import kv_source, make_plan  # noqa: E402
from reference import reference  # noqa: E402

S_GEN = 333


def _mask_case(name, heads):
    i, j = torch.arange(S_GEN)[:, None], torch.arange(S_GEN)[None, :]
    if name == "docs-causal":
        cu = [0, 1, 40, 41, 200, 290, S_GEN]
        doc = torch.tensor([d for d in range(len(cu) - 1) for _ in range(cu[d], cu[d + 1])])
        return ra.masks.document(cu) & ra.masks.causal(), (doc[:, None] == doc[None, :]) & (j <= i), cu
    if name == "dilated-heads":
        h = torch.arange(heads).view(heads, 1, 1)
        ok = (i // 64 == j // 64) & (i % 2 == h % 2) & (j % 2 == h % 2)
        return ra.masks.dilated(64, 2), ok, None
    raise ValueError(name)


def _blockwise(kern, lay, mask, world, q, k, v, do, scale):
    """Run every rank's plan through ``kern`` (forward, then backward against the merged
    out/lse) and return the global out, lse, dq, dk, dv in global order."""
    b, s, h, d = q.shape
    pos = [local_positions(lay, r, world, s).cuda() for r in range(world)]

    def local(x, r):
        idx = pos[r]
        return torch.where((idx < s).view(1, -1, 1, 1), x[:, idx.clamp(max=s - 1)], 0)

    qs, ks, vs, dos = ([local(x, r) for r in range(world)] for x in (q, k, v, do))
    outs, lses = [], []
    for r in range(world):
        plan = make_plan(lay, mask, world, r, s, batch=b, heads=h, device=q.device, tile=kern.tile)
        out = torch.zeros(qs[r].shape, dtype=torch.float32, device="cuda")
        lse = torch.full((b, h, qs[r].shape[1]), float("-inf"), device="cuda")
        for t in range(world):
            src = kv_source(r, t, world)
            for blk in plan.steps[t]:
                rows, cols = slice(blk.q_start, blk.q_stop), slice(blk.k_start, blk.k_stop)
                o, l = kern.forward(qs[r][:, rows], ks[src][:, cols], vs[src][:, cols], scale, blk.mask)
                merge_(out[:, rows], lse[:, :, rows], o, l)
        outs.append(out.to(q.dtype))
        lses.append(lse)
    dqs = [torch.zeros_like(x, dtype=torch.float32) for x in qs]
    dks = [torch.zeros_like(x, dtype=torch.float32) for x in ks]
    dvs = [torch.zeros_like(x, dtype=torch.float32) for x in vs]
    for r in range(world):
        plan = make_plan(lay, mask, world, r, s, batch=b, heads=h, device=q.device, tile=kern.tile)
        for t in range(world):
            src = kv_source(r, t, world)
            for blk in plan.steps[t]:
                rows, cols = slice(blk.q_start, blk.q_stop), slice(blk.k_start, blk.k_stop)
                dq, dk, dv = kern.backward(dos[r][:, rows], qs[r][:, rows], ks[src][:, cols],
                                           vs[src][:, cols], outs[r][:, rows],
                                           lses[r][:, :, rows], scale, blk.mask)
                dqs[r][:, rows] += dq
                dks[src][:, cols] += dk
                dvs[src][:, cols] += dv

    def glob(parts, dim=1):
        full = torch.cat(parts, dim=dim)
        order = torch.argsort(torch.cat(pos))[:s]
        return full.index_select(dim, order)

    return glob(outs), glob(lses, 2), glob(dqs), glob(dks), glob(dvs)


def _tolerances(dtype, q, k, v, do, ok, refs):
    """fp32: 1e-5. bf16: 2x the error of torch's own SDPA on the same bf16 inputs. SDPA
    gives NaN for rows that see no key, so its baseline lets such rows see key 0, gives them
    no upstream gradient, and compares its output on the other rows only."""
    if dtype == torch.float32:
        return [1e-5] * 5
    ok4 = ok.reshape((1,) * (4 - ok.dim()) + tuple(ok.shape)).cuda()
    dead = ~ok4.any(-1, keepdim=True)
    first = torch.zeros_like(ok4)
    first[..., 0] = True
    alive = (~dead).to(q.dtype)
    qb, kb, vb = (t.clone().requires_grad_() for t in (q, k, v))
    ob = torch.nn.functional.scaled_dot_product_attention(
        qb.transpose(1, 2), kb.transpose(1, 2), vb.transpose(1, 2),
        attn_mask=ok4 | (dead & first), scale=0.125, enable_gqa=True)
    ob.backward(do.transpose(1, 2) * alive)
    out_err = rel_err(ob * alive, refs[0].transpose(1, 2))
    # lse: SDPA does not return one; every kernel accumulates it in fp32, so the fp32 bound
    return [2 * out_err, 1e-5, 2 * rel_err(qb.grad, refs[2]), 2 * rel_err(kb.grad, refs[3]),
            2 * rel_err(vb.grad, refs[4])]


@pytest.mark.parametrize("kernel", ["flex", "sdpa-cuda"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("name", ["docs-causal", "dilated-heads"])
@pytest.mark.parametrize("layout,world", [("zigzag", 2), ("striped", 3)])
def test_general_masks_blockwise(kernel, dtype, name, layout, world):
    h, hkv, d = 4, 2, 64
    mask, ok, cu = _mask_case(name, h)
    q, k, v, do = _inputs(S_GEN, S_GEN, h, hkv, d, dtype)
    q, k, v, do = (t[:1] for t in (q, k, v, do))
    refs = reference(q, k, v, do, ok.cuda(), 0.125)
    kern = get_kernel(kernel, q.device, dtype)
    lay = get_layout(layout, tuple(cu) if cu else None)
    got = _blockwise(kern, lay, mask, world, q, k, v, do, 0.125)
    tols = _tolerances(dtype, q, k, v, do, ok, refs)
    for what, x, ref, tol in zip(("out", "lse", "dq", "dk", "dv"), got, refs, tols):
        assert what == "lse" or bool(torch.isfinite(x).all()), what
        assert rel_err(x, ref) <= tol, (what, rel_err(x, ref), tol)


def test_auto_kernel_for_general_masks_is_flex():
    assert get_kernel(None, torch.device("cuda"), torch.bfloat16, general=True).name == "flex"
    assert get_kernel(None, torch.device("cuda"), torch.bfloat16).name == "sdpa-cuda"


def test_ring_api_general_masks_on_one_gpu_nccl():
    """ring_attention itself (W = 1 over NCCL, flex picked automatically) with packed
    documents and a per-row prefix-LM mask, fp32, against float64."""
    import torch.distributed as dist

    fd, path = tempfile.mkstemp()
    os.close(fd)
    os.unlink(path)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        h, hkv = 4, 2
        mask, ok, cu = _mask_case("docs-causal", h)
        q, k, v, do = _inputs(S_GEN, S_GEN, h, hkv, 64, torch.float32)
        qx, kx, vx = (t.clone().requires_grad_() for t in (q, k, v))
        out, lse = ra.ring_attention(qx, kx, vx, causal=True, cu_seqlens=cu, layout="zigzag",
                                     return_lse=True)
        out.backward(do)
        refs = reference(q, k, v, do, ok.cuda())
        for x, ref in zip((out, lse, qx.grad, kx.grad, vx.grad), refs):
            assert rel_err(x, ref) < 1e-5, rel_err(x, ref)
        i, j = torch.arange(S_GEN)[:, None], torch.arange(S_GEN)[None, :]
        n = torch.tensor([5, 100]).view(2, 1, 1, 1)
        out = ra.ring_attention(q, k, v, mask=ra.masks.prefix_lm([5, 100]))
        ref = reference(q, k, v, do, ((j < n) | (j <= i)).cuda())[0]
        assert rel_err(out, ref) < 1e-5
    finally:
        dist.destroy_process_group()


def test_eagle3_ttt_attention_on_one_gpu_nccl():
    """ra.eagle3.ttt_attention (W = 1 over NCCL: the step-0 ring picks its CUDA kernel for
    causal & key padding) against float64 with the TTT mask written out, fp32, 7 key sets."""
    import torch.distributed as dist

    import ringattn as ra

    fd, path = tempfile.mkstemp()
    os.close(fd)
    os.unlink(path)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        s, t, h, hkv, d = 203, 7, 4, 2, 64
        g = torch.Generator().manual_seed(3)
        q, do = (torch.randn(2, s, h, d, generator=g).cuda() for _ in range(2))
        ks = [torch.randn(2, s, hkv, d, generator=g).cuda() for _ in range(t)]
        vs = [torch.randn(2, s, hkv, d, generator=g).cuda() for _ in range(t)]
        valid = [s, s - 50]
        qx = q.clone().requires_grad_()
        kx = [x.clone().requires_grad_() for x in ks]
        vx = [x.clone().requires_grad_() for x in vs]
        out = ra.eagle3.ttt_attention(qx, kx, vx, valid_len=valid, layout="zigzag")
        out.backward(do)
        ok = ra.eagle3.ttt_mask(s, t - 1, valid, device="cuda")[:, None]  # [B, 1, S, T*S]
        refs = reference(q, torch.cat(ks, 1), torch.cat(vs, 1), do, ok)
        assert rel_err(out, refs[0]) < 1e-5
        assert rel_err(qx.grad, refs[2]) < 1e-5
        got_dk, got_dv = torch.cat([x.grad for x in kx], 1), torch.cat([x.grad for x in vx], 1)
        assert rel_err(got_dk, refs[3]) < 1e-5 and rel_err(got_dv, refs[4]) < 1e-5
    finally:
        dist.destroy_process_group()


def test_ring_call_makes_no_device_sync():
    """After a first call (plans and digests cached), a ring call and its backward over NCCL
    make no device-to-host synchronisation (torch raises on one in "error" mode): the
    agreement runs on a CPU control group."""
    import torch.distributed as dist

    fd, path = tempfile.mkstemp()
    os.close(fd)
    os.unlink(path)
    dist.init_process_group("nccl", init_method=f"file://{path}", rank=0, world_size=1)
    try:
        q, k, v, do = _inputs(1000, 1000, 8, 2, 64, torch.bfloat16)
        qx = q.clone().requires_grad_()
        ra.ring_attention(qx, k, v, causal=True, seqlen=1000).backward(do)  # warm-up
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            ra.ring_attention(qx, k, v, causal=True, seqlen=1000).backward(do)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    finally:
        dist.destroy_process_group()
