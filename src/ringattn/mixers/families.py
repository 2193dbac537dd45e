"""Recurrent mixers as thin users of ``linear_recurrence``: each gives its local scan (from
an entering state) and its chunk transition, nothing about ranks.

Legend: B batch, L local seq, H heads, dk/dv key/value head dims (gated delta rule), P head
dim and N state size (Mamba2), G groups of B/C (Mamba2).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..layouts import DEFAULT_LAYOUT
from .core import agreed, linear_recurrence

__all__ = ["diagonal_recurrence", "gated_delta_rule", "mamba2_ssd"]


@agreed(sharded=("a", "x"))
def diagonal_recurrence(a: torch.Tensor, x: torch.Tensor, *, group=None,
                        layout: str = DEFAULT_LAYOUT, seqlen: int | None = None,
                        cu_seqlens=None) -> torch.Tensor:
    """h_t = a_t * h_{t-1} + x_t, elementwise, h = 0 before each document; returns every h_t
    (RG-LRU's recurrence, with a_t and x_t already gated; a decayed linear scan).

    Arguments:
        a, x: [B, L, *F] this rank's shards (same shape).
        group, layout, seqlen, cu_seqlens: as for ``linear_recurrence``.

    Returns:
        [B, L, *F], zero on padding slots.
    """
    feat = tuple(x.shape[2:]) if isinstance(x, torch.Tensor) else ()
    batch = x.shape[0] if isinstance(x, torch.Tensor) else 0

    def scan(piece, state):
        a_, x_ = piece
        h = state if state is not None else x_.new_zeros((batch, *feat))
        out = []
        for t in range(a_.shape[1]):
            h = a_[:, t] * h + x_[:, t]
            out.append(h)
        return torch.stack(out, dim=1), h

    def transition(piece):
        return piece[0].prod(dim=1)

    def entry_output(piece, state):  # h_t gains (a_1 ... a_t) * h_0
        return piece[0].cumprod(dim=1) * state[:, None]

    error = None
    if not (isinstance(a, torch.Tensor) and isinstance(x, torch.Tensor)):
        error = TypeError(f"diagonal_recurrence: a and x must be tensors, got "
                          f"{type(a).__name__} and {type(x).__name__}")
    elif a.shape != x.shape:
        error = ValueError(f"diagonal_recurrence: a and x must have one shape, got "
                           f"{tuple(a.shape)} and {tuple(x.shape)}")
    if error is not None:
        return _refuse(error, "diagonal_recurrence", group, layout, seqlen, cu_seqlens)
    return linear_recurrence(scan, transition, (a, x), state_shape=(batch, *feat),
                             map_shape=(batch, *feat), out_shape=feat, kind="diagonal",
                             group=group, layout=layout, seqlen=seqlen, cu_seqlens=cu_seqlens,
                             name="diagonal_recurrence", entry_output=entry_output)


def _refuse(error, name, group, layout, seqlen, cu_seqlens):
    """Report this rank's error in its own arguments on every rank (the agreement)."""
    return linear_recurrence(None, None, (), state_shape=(), map_shape=(), out_shape=(),
                             group=group, layout=layout, seqlen=seqlen, cu_seqlens=cu_seqlens,
                             name=name, error=error)


def _tensors(name, **named):
    for key, t in named.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name}: {key} must be a torch.Tensor, got {type(t).__name__}")


def _l2norm(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """transformers' (and fla's) l2norm of the gated delta rule: x / sqrt(sum x^2 + eps)."""
    return x * torch.rsqrt((x * x).sum(dim=-1, keepdim=True) + eps)


def _gdn_scan(q, k, v, g, beta, state, scale):
    """Token by token, [B, n, H, *] inputs, state [B, H, dk, dv] or None."""
    b, n, h, dk = k.shape
    dv = v.shape[-1]
    s = state if state is not None else v.new_zeros((b, h, dk, dv))
    out = []
    for t in range(n):
        decay = g[:, t].exp()  # [B, H] (per head) or [B, H, dk] (per key channel)
        s = s * (decay[..., None] if decay.dim() == 3 else decay[..., None, None])
        kt = k[:, t]
        remembered = (s * kt[..., None]).sum(dim=-2)  # k^T S: [B, H, dv]
        delta = (v[:, t] - remembered) * beta[:, t][..., None]
        s = s + kt[..., None] * delta[..., None, :]
        out.append((s * (q[:, t] * scale)[..., None]).sum(dim=-2))
    return torch.stack(out, dim=1), s


def _gdn_entry_scan(scan, q, k, g, beta):
    """The run's entering-state maps from ONE call of its own scan: the recurrence is linear
    in (state, v), so scanning with v = 0 (width dk) from the identity state leaves P_t, the
    product M_t ... M_1 of M_t = (I - beta_t k_t k_t^T) D_t (D_t = exp(g_t), a scalar or,
    with a gate per key channel, the diagonal matrix diag(exp(g_t))), as its state: the
    final state is the run's transition map M = P_n [B, H, dk, dk], and its outputs are
    o_t = P_t^T (scale q_t) [B, n, H, dk], so entering with S adds o_t^T S to token t's
    output. Same q/k conventions (scale, l2norm, grouped heads) as the real scan."""
    b, n, h, dk = k.shape
    eye = torch.eye(dk, dtype=k.dtype, device=k.device).expand(b, h, dk, dk).contiguous()
    o, m = scan((q, k, k.new_zeros((b, n, h, dk)), g, beta), eye)
    return o, m


def _gdn_transition(k, g, beta, scan=None):
    """prod_t (I - beta_t k_t k_t^T) exp(g_t), later tokens on the left: [B, H, dk, dk]
    (the final state of ``_gdn_entry_scan``; ``scan`` defaults to the token loop)."""
    if scan is None:
        def scan(piece, state):
            return _gdn_scan(*piece, state, 1.0)
    return _gdn_entry_scan(scan, torch.zeros_like(k), k, g, beta)[1]


@agreed(sharded=("query", "key", "value", "g", "beta"))
def gated_delta_rule(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                     g: torch.Tensor, beta: torch.Tensor, *, scale: float | None = None,
                     use_qk_l2norm: bool = False, kernel=None, group=None,
                     layout: str = DEFAULT_LAYOUT, seqlen: int | None = None,
                     cu_seqlens=None) -> torch.Tensor:
    """The gated delta rule (Gated DeltaNet, Qwen3-Next's linear attention; with a gate per
    key channel, Kimi Delta Attention) under context parallelism, with transformers'
    ``torch_chunk_gated_delta_rule`` conventions:
    S_t = (I - beta_t k_t k_t^T) D_t S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T (scale q_t),
    S = 0 before each document, where D_t = exp(g_t) (one decay per head) or
    diag(exp(g_t)) (one decay per key channel, Kimi Linear's ``chunk_kimi_delta_attention``).

    Arguments:
        query, key: [B, L, Hk, dk]; value: [B, L, Hv, dv] (Hv a multiple of Hk: each key
            head serves Hv / Hk consecutive value heads); beta: [B, L, Hv]; g (log decay,
            <= 0): [B, L, Hv] (per head) or [B, L, Hv, dk] (per key channel). This rank's
            shards.
        scale: the query's scale (default 1 / sqrt(dk)).
        use_qk_l2norm: l2-normalise q and k first (transformers' use_qk_l2norm_in_kernel).
        kernel: None (a token-by-token torch loop), or a chunked kernel with transformers'
            / fla's signature ``kernel(q, k, v, g, beta, initial_state=,
            output_final_state=True, use_qk_l2norm_in_kernel=False) -> (out, final)`` on
            [B, n, H, *] runs (e.g. ``torch_chunk_gated_delta_rule``; with g per key
            channel, Kimi Linear's ``chunk_kimi_delta_attention``); it scales q by
            1 / sqrt(dk) itself, so ``scale`` must be None with it.
        group, layout, seqlen, cu_seqlens: as for ``linear_recurrence``.

    Returns:
        [B, L, Hv, dv] in value's dtype (computed in float32 for half inputs), zero on
        padding slots.
    """
    tensors = (query, key, value, g, beta)
    try:
        _tensors("gated_delta_rule", query=query, key=key, value=value, g=g, beta=beta)
        ok = (query.dim() == key.dim() == value.dim() == 4 and beta.dim() == 3
              and query.shape == key.shape and value.shape[:2] == key.shape[:2]
              and key.shape[2] > 0 and value.shape[2] % key.shape[2] == 0
              and tuple(beta.shape) == tuple(value.shape[:3])
              and tuple(g.shape) in (tuple(value.shape[:3]), (*value.shape[:3], key.shape[3])))
        if not ok:
            raise ValueError(
                f"gated_delta_rule: q, k must be [B, L, Hk, dk], v [B, L, Hv, dv] with Hv a "
                f"multiple of Hk, beta [B, L, Hv], g [B, L, Hv] or [B, L, Hv, dk]; got q "
                f"{tuple(query.shape)}, k "
                f"{tuple(key.shape)}, v {tuple(value.shape)}, g {tuple(g.shape)}, beta "
                f"{tuple(beta.shape)}")
        if kernel is not None and scale is not None:
            raise ValueError("gated_delta_rule: a kernel scales q itself: pass scale=None")
    except (TypeError, ValueError) as exc:
        return _refuse(exc, "gated_delta_rule", group, layout, seqlen, cu_seqlens)
    out_dtype = value.dtype
    work = torch.float32 if value.dtype in (torch.bfloat16, torch.float16) else value.dtype
    q, k, v, g_, b_ = (t.to(work) for t in tensors)
    rep = v.shape[2] // k.shape[2]
    if rep > 1:
        q, k = q.repeat_interleave(rep, dim=2), k.repeat_interleave(rep, dim=2)
    if use_qk_l2norm:
        q, k = _l2norm(q), _l2norm(k)
    b, _, h, dk = k.shape
    dv = v.shape[-1]
    factor = 1.0 / math.sqrt(dk) if scale is None else float(scale)

    if kernel is None:
        def scan(piece, state):
            return _gdn_scan(*piece, state, factor)
    else:
        def scan(piece, state):
            out, final = kernel(*piece, initial_state=state, output_final_state=True,
                                use_qk_l2norm_in_kernel=False)
            return out, final

    # A chunk that both exports its map and continues another needs the same identity scan
    # twice (transition, then entry_output once the entering state is known): keep its
    # outputs from the first, keyed by where the run starts and its length.
    kept = {}

    def where(piece):
        kk = piece[1]
        return (kk.data_ptr(), kk.shape[1]) if kk.stride(1) != 0 else None

    def transition(piece):
        o, m = _gdn_entry_scan(scan, piece[0], piece[1], piece[3], piece[4])
        if where(piece) is not None:
            kept[where(piece)] = o
        return m

    def entry_output(piece, state):  # o_t gains (P_t^T scale q_t)^T S_in
        o = kept.pop(where(piece), None) if where(piece) is not None else None
        if o is None:
            o = _gdn_entry_scan(scan, piece[0], piece[1], piece[3], piece[4])[0]
        return torch.einsum("bnhk,bhkv->bnhv", o, state.to(o.dtype))

    y = linear_recurrence(scan, transition, (q, k, v, g_, b_), state_shape=(b, h, dk, dv),
                          map_shape=(b, h, dk, dk), out_shape=(h, dv), kind="matrix",
                          group=group, layout=layout, seqlen=seqlen, cu_seqlens=cu_seqlens,
                          name="gated_delta_rule", entry_output=entry_output)
    kept.clear()
    return y.to(out_dtype)


def _ssd_scan(x, dt, bm, cm, a, d, state):
    """Token by token: x [B, n, H, P], dt [B, n, H], bm/cm [B, n, H, N], state [B, H, P, N]."""
    b, n, h, p = x.shape
    s = state if state is not None else x.new_zeros((b, h, p, bm.shape[-1]))
    out = []
    for t in range(n):
        s = s * (dt[:, t] * a).exp()[..., None, None] + \
            (dt[:, t][..., None] * x[:, t])[..., None] * bm[:, t][:, :, None, :]
        y = (s * cm[:, t][:, :, None, :]).sum(dim=-1)
        if d is not None:
            y = y + d[:, None] * x[:, t]
        out.append(y)
    return torch.stack(out, dim=1), s


@agreed(sharded=("hidden_states", "dt", "B", "C"))
def mamba2_ssd(hidden_states: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, B: torch.Tensor,
               C: torch.Tensor, *, D: torch.Tensor | None = None, dt_bias: torch.Tensor | None = None,
               dt_softplus: bool = False, dt_limit: tuple[float, float] = (0.0, float("inf")),
               kernel=None, group=None, layout: str = DEFAULT_LAYOUT,
               seqlen: int | None = None, cu_seqlens=None) -> torch.Tensor:
    """Mamba2's state-space dual (SSD) scan under context parallelism, with transformers'
    ``mamba2_chunk_scan`` arguments: dt' = clamp(softplus?(dt + dt_bias), dt_limit),
    h_t = exp(dt'_t A) h_{t-1} + dt'_t x_t B_t^T, y_t = h_t C_t + D x_t, h = 0 before each
    document.

    Arguments:
        hidden_states: [B, L, H, P]; dt: [B, L, H]; B, C: [B, L, G, N] (H a multiple of G:
            each group serves H / G consecutive heads). This rank's shards.
        A, D, dt_bias: [H] parameters (the same on every rank; their gradient on each rank
            is this rank's share: sum over ranks for the one-process gradient).
        dt_softplus, dt_limit: as transformers'.
        kernel: None (a token-by-token torch loop) or a kernel with transformers'
            ``mamba2_chunk_scan`` keywords, called as ``kernel(x, dt, A, B, C, D=D,
            initial_states=, return_final_states=True) -> (y, final)`` on [B, n, ...] runs
            with dt already processed and B, C per head (e.g. functools.partial of
            ``mamba2_chunk_scan`` with a chunk_size).
        group, layout, seqlen, cu_seqlens: as for ``linear_recurrence``.

    Returns:
        [B, L, H, P] in hidden_states' dtype (float32 work for half inputs), zero on padding.
    """
    x = hidden_states
    tensors = (x, dt, B, C)
    try:
        _tensors("mamba2_ssd", hidden_states=x, dt=dt, A=A, B=B, C=C)
        ok = (x.dim() == 4 and dt.dim() == 3 and B.dim() == C.dim() == 4 and B.shape == C.shape
              and tuple(dt.shape) == tuple(x.shape[:3]) and B.shape[:2] == x.shape[:2]
              and B.shape[2] > 0 and x.shape[2] % B.shape[2] == 0
              and tuple(A.shape) == (x.shape[2],)
              and all(t is None or (isinstance(t, torch.Tensor) and tuple(t.shape) == (x.shape[2],))
                      for t in (D, dt_bias)))
        if not ok:
            raise ValueError(
                f"mamba2_ssd: hidden_states must be [B, L, H, P], dt [B, L, H], B and C "
                f"[B, L, G, N] with H a multiple of G, A, D and dt_bias [H]; got "
                f"hidden_states {tuple(x.shape)}, dt {tuple(dt.shape)}, B {tuple(B.shape)}, "
                f"C {tuple(C.shape)}, A {tuple(A.shape)}")
    except (TypeError, ValueError) as exc:
        return _refuse(exc, "mamba2_ssd", group, layout, seqlen, cu_seqlens)
    out_dtype = x.dtype
    work = torch.float32 if x.dtype in (torch.bfloat16, torch.float16) else x.dtype
    xw, dtw, bw, cw = (t.to(work) for t in tensors)
    if dt_bias is not None:
        dtw = dtw + dt_bias.to(work)
    if dt_softplus:
        dtw = F.softplus(dtw)
    dtw = dtw.clamp(min=dt_limit[0], max=dt_limit[1])
    h = x.shape[2]
    rep = h // B.shape[2]
    bw = bw.repeat_interleave(rep, dim=2)
    cw = cw.repeat_interleave(rep, dim=2)
    aw = A.to(work)
    dw = None if D is None else D.to(work)
    batch, p, n = x.shape[0], x.shape[3], B.shape[3]

    if kernel is None:
        def scan(piece, state):
            return _ssd_scan(*piece, aw, dw, state)
    else:
        def scan(piece, state):
            xs, dts, bs, cs = piece
            return kernel(xs, dts, aw, bs, cs, D=dw, initial_states=state,
                          return_final_states=True)

    def transition(piece):
        return (piece[1].sum(dim=1) * aw).exp()[..., None, None]

    def entry_output(piece, state):  # y_t gains exp(A (dt_1 + ... + dt_t)) h_0 C_t
        decay = (piece[1].cumsum(dim=1) * aw).exp()  # [B, n, H]
        return decay[..., None] * torch.einsum("bhpn,bthn->bthp", state, piece[3])

    y = linear_recurrence(
        scan, transition, (xw, dtw, bw, cw), state_shape=(batch, h, p, n),
        map_shape=(batch, h, 1, 1), out_shape=(h, p), kind="diagonal", group=group,
        layout=layout, seqlen=seqlen, cu_seqlens=cu_seqlens, name="mamba2_ssd",
        entry_output=entry_output,
        params=tuple(t for t in (A, D, dt_bias) if t is not None))
    return y.to(out_dtype)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
