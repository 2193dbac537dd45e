"""``ra.merge``: forward and backward against float64 autograd of the formula, rows that see
no key on one or both sides (finite, zero gradients), and the precision of its weights.

Legend: B batch, S rows, H heads, D head dim.
"""

import torch

import ringattn as ra
from ringattn.merge import merge_

NEG_INF = float("-inf")


def _inputs(seed=0, b=2, s=7, h=3, d=5, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    o_a, o_b = (torch.randn(b, s, h, d, generator=g) for _ in range(2))
    lse_a, lse_b = (torch.randn(b, h, s, generator=g) * scale for _ in range(2))
    return o_a, lse_a, o_b, lse_b


def _formula(o_a, lse_a, o_b, lse_b):
    """The definition, for rows that see a key on at least one side."""
    lse = torch.logaddexp(lse_a, lse_b)
    w_a = torch.exp(lse_a - lse).transpose(1, 2).unsqueeze(-1)
    w_b = torch.exp(lse_b - lse).transpose(1, 2).unsqueeze(-1)
    return o_a * w_a + o_b * w_b, lse


def _loss(out, lse, g_out, g_lse):
    """A loss that ignores non-finite lse (as a caller masking dead rows does)."""
    return (out * g_out).sum() + (torch.where(torch.isfinite(lse), lse, 0.0) * g_lse).sum()


def _grads(fn, inputs, g_out, g_lse, dtype):
    leaves = [t.detach().to(dtype).requires_grad_() for t in inputs]
    out, lse = fn(*leaves)
    _loss(out, lse, g_out.to(dtype), g_lse.to(dtype)).backward()
    return out.detach(), lse.detach(), [t.grad for t in leaves]


def test_forward_and_gradients_equal_float64_autograd_of_the_formula():
    inputs = _inputs()
    g = torch.Generator().manual_seed(1)
    g_out = torch.randn(inputs[0].shape, generator=g)
    g_lse = torch.randn(inputs[1].shape, generator=g)
    out, lse, grads = _grads(ra.merge, inputs, g_out, g_lse, torch.float32)
    ref_out, ref_lse, ref_grads = _grads(_formula, inputs, g_out, g_lse, torch.float64)
    assert out.dtype == torch.float32 and lse.dtype == torch.float32
    for name, x, r in [("out", out, ref_out), ("lse", lse, ref_lse)] + list(
            zip(("do_a", "dlse_a", "do_b", "dlse_b"), grads, ref_grads)):
        err = float((x.double() - r).norm() / r.norm())
        assert err <= 1e-6, (name, err)


def test_rows_that_see_no_key_have_finite_zero_gradients():
    """Both sides -inf: out 0, lse -inf, every gradient 0 (was NaN for lse_a and lse_b).
    One side -inf: the other side's result, with the gradients of the formula."""
    o_a, lse_a, o_b, lse_b = _inputs(seed=2)
    lse_a[0, 1, 2] = lse_b[0, 1, 2] = NEG_INF  # dead on both sides
    lse_a[1, :, 4] = lse_b[1, :, 4] = NEG_INF
    lse_a[0, 0, 0] = NEG_INF  # dead on one side only
    lse_b[1, 2, 6] = NEG_INF
    g = torch.Generator().manual_seed(3)
    g_out, g_lse = torch.randn(o_a.shape, generator=g), torch.randn(lse_a.shape, generator=g)
    out, lse, grads = _grads(ra.merge, (o_a, lse_a, o_b, lse_b), g_out, g_lse, torch.float32)
    for name, x in zip(("do_a", "dlse_a", "do_b", "dlse_b"), grads):
        assert bool(torch.isfinite(x).all()), name
    dead = torch.zeros_like(lse_a, dtype=torch.bool)
    dead[0, 1, 2] = True
    dead[1, :, 4] = True
    assert bool((lse[dead] == NEG_INF).all()) and not bool(torch.isinf(lse[~dead]).any())
    dead_rows = dead.transpose(1, 2)  # [B, S, H]
    assert bool((out[dead_rows] == 0).all())
    for x in (grads[1], grads[3]):
        assert bool((x[dead] == 0).all())
    for x in (grads[0], grads[2]):
        assert bool((x[dead_rows] == 0).all())
    # everywhere else: float64 autograd of the formula (finite with one side at -inf)
    ref_out, ref_lse, ref_grads = _grads(_formula, (o_a, lse_a, o_b, lse_b), g_out,
                                         g_lse.masked_fill(dead, 0.0), torch.float64)
    assert torch.allclose(out[~dead_rows].double(), ref_out[~dead_rows], rtol=0, atol=1e-6)
    assert torch.allclose(lse[~dead].double(), ref_lse[~dead], rtol=0, atol=1e-6)
    for name, x, r, live in zip(("do_a", "dlse_a", "do_b", "dlse_b"), grads, ref_grads,
                                (~dead_rows, ~dead, ~dead_rows, ~dead)):
        assert torch.allclose(x[live].double(), r[live], rtol=0, atol=1e-6), name


def test_in_place_merge_matches_and_keeps_dead_rows():
    o_a, lse_a, o_b, lse_b = _inputs(seed=4)
    lse_a[:, 0] = lse_b[:, 0] = NEG_INF
    o_a[:, :, 0] = 0.0
    want_out, want_lse = ra.merge(o_a, lse_a, o_b, lse_b)
    merge_(o_a, lse_a, o_b, lse_b)
    assert torch.equal(o_a, want_out) and torch.equal(lse_a, want_lse)
    assert bool((o_a[:, :, 0] == 0).all()) and bool((lse_a[:, 0] == NEG_INF).all())


def test_weights_do_not_carry_the_rounding_of_a_large_merged_lse():
    """Large logits make lse large (hundreds): exp(lse_a - lse) would be off by the rounding
    of lse, |lse| * 2^-24 relative; the sigmoid of the difference is not. Measured: 6e-8
    relative, against 8.3e-6 for exp(lse_a - lse) on these inputs."""
    o_a, lse_a, o_b, lse_b = _inputs(seed=5, scale=1.0)
    lse_a, lse_b = lse_a + 500.0, lse_b + 500.0  # fp32 inputs, |lse| ~ 500
    out, lse = ra.merge(o_a, lse_a, o_b, lse_b)
    ref_out, ref_lse = _formula(*(t.double() for t in (o_a, lse_a, o_b, lse_b)))
    err = float((out.double() - ref_out).norm() / ref_out.norm())
    assert err <= 2e-7, err
    assert float((lse.double() - ref_lse).abs().max()) <= 2 ** -24 * 600
