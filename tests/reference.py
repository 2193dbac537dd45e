"""The float64 oracle: single-device attention on the whole, unsharded sequence.

Written from the definitions (flash-attn's window convention), independently of ringattn's
masks and kernels, so it can catch their mistakes.
"""

from __future__ import annotations

import math

import torch


def visible(seqlen: int, causal: bool, window: tuple[int, int]) -> torch.Tensor:
    """[S, S] bool: query i sees key j iff i-left <= j <= i+right (-1 unbounded), j <= i if causal."""
    i = torch.arange(seqlen)[:, None]
    j = torch.arange(seqlen)[None, :]
    ok = torch.ones(seqlen, seqlen, dtype=torch.bool)
    left, right = window
    if left >= 0:
        ok &= j >= i - left
    if right >= 0:
        ok &= j <= i + right
    if causal:
        ok &= j <= i
    return ok


def attention(q, k, v, ok, scale=None, softcap=0.0, sinks=None, alibi=None):
    """Dense attention: q [B,S,H,D], k/v [B,S,Hkv,D|Dv], ok [S,S] or [B|1,H|1,S,S] ->
    out [B,S,H,Dv], lse [B,H,S]. A row that sees no key gives out = 0 and lse = -inf.
    ``softcap`` > 0: scores become softcap * tanh(scores / softcap) (Gemma 2). ``sinks`` [H]:
    one more logit per head in the softmax whose value is 0 (gpt-oss): the scores get a
    column of sinks, the softmax runs over both, and the column is dropped (its definition);
    a -inf sink is no sink.
    ``alibi`` [H]: -alibi[h] * |i - j| is added after soft-capping (flash-attn's ALiBi)."""
    h, hkv = q.shape[2], k.shape[2]
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale
    qh = q.transpose(1, 2)
    kh = k.transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    vh = v.transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    s = (qh @ kh.transpose(-1, -2)) * scale
    if softcap:
        s = softcap * torch.tanh(s / softcap)
    if alibi is not None:
        n = s.shape[-1]
        dist = (torch.arange(n)[:, None] - torch.arange(n)[None, :]).abs().to(s.dtype)
        s = s - alibi.to(s.dtype).view(1, h, 1, 1) * dist
    s = s.masked_fill(~ok, float("-inf"))
    if sinks is not None:
        col = sinks.to(s.dtype).view(1, h, 1, 1).expand(*s.shape[:3], 1)
        both = torch.cat([s, col], dim=-1)
        # a row with no visible key and a -inf sink: out 0, lse -inf, zero gradients
        none = both.amax(-1, keepdim=True) == float("-inf")
        both = both.masked_fill(none, 0.0)
        p = torch.softmax(both, dim=-1).masked_fill(none, 0.0)[..., :-1]
        lse = torch.logsumexp(both, dim=-1).masked_fill(none[..., 0], float("-inf"))
        return (p @ vh).transpose(1, 2), lse
    dead = ~ok.any(-1, keepdim=True)
    # a row that sees nothing: lse = -inf, with a zero (not NaN) gradient
    lse = torch.logsumexp(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead[..., 0], float("-inf"))
    p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0)
    return (p @ vh).transpose(1, 2), lse


def reference(q, k, v, dout, ok, scale=None, dlse=None):
    """float64 out, lse and the gradients of q, k, v for the upstream gradients ``dout``
    (of out) and ``dlse`` (of lse; None: lse not used; rows with lse = -inf get none)."""
    q, k, v = (t.detach().double().requires_grad_() for t in (q, k, v))
    out, lse = attention(q, k, v, ok, scale)
    loss = (out * dout.double()).sum()
    if dlse is not None:
        loss = loss + (torch.where(torch.isfinite(lse), lse, 0.0) * dlse.double()).sum()
    loss.backward()
    return out.detach(), lse.detach(), q.grad, k.grad, v.grad


FP32_TOL = 1e-5
"""The fp32 contract where the inputs are well conditioned: 1e-5 relative to float64."""


def fp32_tolerances(torch_errs):
    """The fp32 bound of each tensor: 1e-5 relative, or 2x the error (against the same
    float64 reference) of torch's own fused fp32 attention op on the whole sequence on one
    device, where that is larger (flash-attn's criterion, as for bf16).

    Why not 1e-5 everywhere, as measured (tests/distributed/test_exact.py ``_plain_fused``
    is that op; ringattn's kernels on CPU call the same op):

    * Large logits (softmax_scale=50, or inputs x30): the op's backward takes
      p = exp(s - lse) with lse stored in fp32, whose rounding (|lse| * 2^-24, 3e-5 at
      |lse| ~ 500) scales a whole row of p. dq 4.3e-5, dk 4.9e-5 for the op on one device;
      ringattn 4.3e-5 at W 1, 4.1e-5 at W 2, 2.9e-5 at W 3 (torch's eager math, which
      never stores lse, 2.7e-6). Every flash-style backward shares this.
    * A tiny reference (S=1: p = 1, so dp - delta cancels exactly in float64 and dq is
      scale * dlse * k with dlse ~ 1e-3): fp32 leaves ~1e-7 of dp - delta, which is 2.9e-4
      relative for the op and for ringattn alike.

    A NaN or infinite baseline error (the op on rows that see nothing) leaves 1e-5."""
    return [max(FP32_TOL, 2 * e) if math.isfinite(e) else FP32_TOL for e in torch_errs]


def rel_err(x: torch.Tensor, ref: torch.Tensor, floor: float = 0.0) -> float:
    """||x - ref|| / ||ref|| in float64; ||x|| when ref is exactly zero (e.g. the gradient of
    a query that sees a single key), where a relative error is undefined. Infinite entries
    of ref (lse = -inf of rows that see no key) must be matched exactly by x, else inf.
    ``floor``: the denominator is at least floor * sqrt(numel) (for lse, a logarithm whose
    rounding error is absolute: a row whose lse is near 0 has no meaningful relative one)."""
    x, ref = x.detach().double(), ref.detach().double()
    inf = torch.isinf(ref)
    if bool(inf.any()):
        if not torch.equal(x[inf], ref[inf]):
            return float("inf")
        x, ref = x[~inf], ref[~inf]
    norm = max(float(ref.norm()), floor * ref.numel() ** 0.5)
    if norm == 0:
        return float(x.norm())
    return float((x - ref).norm() / norm)
