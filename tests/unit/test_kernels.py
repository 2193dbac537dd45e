"""Block kernels and the merge, in one process, against the float64 oracle."""

import pytest
import torch

from reference import attention, rel_err
from ringattn import merge
from ringattn.kernels import available_kernels, get_kernel
from ringattn.kernels import sdpa as sdpa_module
from ringattn.masks import Band

# fp32 results of these kernels sit near 1e-7 relative to float64 (docs/platform.md: ~5e-7 out,
# 1e-6..5e-6 backward); 1e-5 is the project's contract for fp32.
TOL = 1e-5
BANDS = [None, Band(0, None), Band(-3, 2), Band(-2, None), Band(None, 4), Band(-40, -1)]


def _inputs(sq, sk, h, hkv, d, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(2, sq, h, d, generator=g).to(dtype)
    k = torch.randn(2, sk, hkv, d, generator=g).to(dtype)
    v = torch.randn(2, sk, hkv, d, generator=g).to(dtype)
    do = torch.randn(2, sq, h, d, generator=g).to(dtype)
    return q, k, v, do


def _visible_rows(band, sq, sk):
    ok = torch.ones(sq, sk, dtype=torch.bool) if band is None else band.dense(range(sq), range(sk))
    return ok


@pytest.mark.parametrize("name", ["sdpa-cpu", "reference"])
@pytest.mark.parametrize("band", BANDS, ids=str)
@pytest.mark.parametrize("shape", [(37, 29, 4, 2, 24), (300, 310, 2, 1, 16), (8, 8, 3, 3, 8)])
def test_kernel_matches_float64(name, band, shape):
    sq, sk, h, hkv, d = shape
    q, k, v, do = _inputs(sq, sk, h, hkv, d)
    ok = _visible_rows(band, sq, sk)
    rows = ok.any(dim=1)
    if not rows.all():  # the ring only hands rows that see a key: drop the trailing ones
        assert not rows[int(rows.sum()):].any()
        q, do, ok = q[:, rows], do[:, rows], ok[rows]
    kern = get_kernel(name, q.device, q.dtype)
    out, lse = kern.forward(q, k, v, 0.3, band)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref_out, ref_lse = attention(q64, k64, v64, ok, 0.3)
    ref_out.backward(do.double())
    dq, dk, dv = kern.backward(do, q, k, v, out, lse, 0.3, band)
    for what, x, ref in [("out", out, ref_out), ("lse", lse, ref_lse), ("dq", dq, q64.grad),
                         ("dk", dk, k64.grad), ("dv", dv, v64.grad)]:
        assert x.shape == ref.shape, what
        assert rel_err(x, ref.detach()) < TOL, (what, rel_err(x, ref.detach()))


def test_banded_blocks_are_tiled(monkeypatch):
    """A general band runs in row tiles whose masks never exceed TILE_ROWS x Sk."""
    monkeypatch.setattr(sdpa_module, "TILE_ROWS", 16)
    seen = []
    real = sdpa_module._additive

    def spy(ok, dtype):
        seen.append(tuple(ok.shape[-2:]))
        return real(ok, dtype)

    monkeypatch.setattr(sdpa_module, "_additive", spy)
    q, k, v, _ = _inputs(70, 70, 2, 2, 8)
    band = Band(-2, 3)
    out, _ = get_kernel("sdpa-cpu", q.device, q.dtype).forward(q, k, v, 0.5, band)
    ref, _ = attention(q.double(), k.double(), v.double(), band.dense(range(70), range(70)), 0.5)
    assert rel_err(out, ref) < TOL
    assert len(seen) == 5 and all(r <= 16 and c <= 16 + 5 for r, c in seen), seen


def test_registry():
    cpu = torch.device("cpu")
    assert get_kernel(None, cpu, torch.float32).name == "sdpa-cpu"
    assert get_kernel("auto", cpu, torch.bfloat16).name == "sdpa-cpu"
    assert "reference" in available_kernels()
    with pytest.raises(ValueError, match="unknown kernel 'flash3'"):
        get_kernel("flash3", cpu, torch.float32)
    with pytest.raises(ValueError, match=r"'sdpa-cuda' runs on cuda only, not on cpu; .* use "
                                         r"one of \['auto', 'sdpa-cpu', 'reference'\]"):
        get_kernel("sdpa-cuda", cpu, torch.float32)
    with pytest.raises(TypeError, match="kernel must be"):
        get_kernel(3, cpu, torch.float32)


def test_merge_equals_attention_over_the_union():
    q, k, v, _ = _inputs(20, 30, 4, 2, 16, dtype=torch.float64)
    ok = torch.ones(20, 30, dtype=torch.bool)
    ok[:5, 12:] = False  # rows 0..4 see only the first part
    ref_out, ref_lse = attention(q, k, v, ok)
    a_out, a_lse = attention(q, k[:, :12], v[:, :12], ok[:, :12])
    b_out, b_lse = attention(q, k[:, 12:], v[:, 12:], ok[:, 12:])
    b_out = torch.nan_to_num(b_out)  # softmax of an all-masked row: the merge must not need it
    out, lse = merge(a_out, a_lse, b_out, b_lse)
    assert rel_err(out, ref_out) < 1e-12 and rel_err(lse, ref_lse) < 1e-12


def test_merge_rows_that_see_nothing():
    out = torch.randn(1, 3, 2, 4)
    lse = torch.full((1, 2, 3), float("-inf"))
    m_out, m_lse = merge(torch.zeros_like(out), lse, torch.zeros_like(out), lse.clone())
    assert torch.equal(m_out, torch.zeros_like(out)) and torch.isneginf(m_lse).all()
    lse_b = torch.zeros(1, 2, 3)
    m_out, m_lse = merge(torch.zeros_like(out), lse, out, lse_b)
    assert torch.equal(m_out, out) and torch.equal(m_lse, lse_b)


def test_merge_is_differentiable_and_validates():
    a, b = torch.randn(1, 4, 2, 8, requires_grad=True), torch.randn(1, 4, 2, 8, requires_grad=True)
    la, lb = torch.randn(1, 2, 4, requires_grad=True), torch.randn(1, 2, 4, requires_grad=True)
    out, lse = merge(a, la, b, lb)
    (out.sum() + lse.sum()).backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (a, b, la, lb))
    with pytest.raises(ValueError, match="cannot merge"):
        merge(a, la, b[:, :3], lb)
