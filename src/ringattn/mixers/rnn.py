"""Recurrences whose state is kept on a running maximum's log scale: RWKV-4's WKV and
xLSTM's mLSTM, as users of ``linear_recurrence`` with a ``compose`` of their own.

Both are linear recurrences in their real state (RWKV: a numerator and a denominator;
mLSTM: a matrix memory C and a normaliser n), with exponential weights that overflow
float32 when taken as they are: a key of 100 weighs e^100. So the state is kept as
(real / exp(m), m), with m a running maximum of the log weights seen. A run of tokens maps
the entering state to the leaving one by a decay of its log scale (``M``, the run's summed
log decay) and adds what the run leaves from an empty state (C, with its own m): the two
meet on the larger of the two scales, ``compose`` below, which is the affine map
S_out = exp(M) S_in + C written on log scales. That is the only change to the mechanism:
the chunks' (M, C) travel in the same all-gather.

Legend: B batch, L local seq, D channels (RWKV), H heads, dk/dv key/value head dims (mLSTM).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ..layouts import DEFAULT_LAYOUT, SHARD_TAG
from .core import agreed, linear_recurrence
from .families import _refuse, _tensors

__all__ = ["mlstm", "wkv"]

_EMPTY = -1e38
"""The log scale of an empty state (transformers' RWKV starts its running maximum there):
exp(_EMPTY - anything finite) is 0, and _EMPTY plus a decay stays finite in float32."""


def _compose(decay, entry, fresh):
    """The state after a run with summed log decay ``decay`` [..., 1], entered with ``entry``
    [..., V + 1] (V scaled values, then their log scale), where an empty entry leaves
    ``fresh`` [..., V + 1]: both terms brought to the larger log scale."""
    old, new = entry[..., -1:] + decay, fresh[..., -1:]
    top = torch.maximum(old, new)
    values = torch.exp(old - top) * entry[..., :-1] + torch.exp(new - top) * fresh[..., :-1]
    return torch.cat([values, top], dim=-1)


def _work(dtype):
    return torch.float32 if dtype in (torch.bfloat16, torch.float16) else dtype


# ------------------------------------------------------------------------------ RWKV's WKV

def _wkv_scan(w, u, k, v, state):
    """Token by token: w = exp(time_decay), u = time_first [D]; k, v [B, n, D]; state
    [B, D, 3] (numerator, denominator, log scale) or None (empty)."""
    if state is None:
        num = k.new_zeros(k[:, 0].shape)
        den = k.new_zeros(k[:, 0].shape)
        scale = torch.full_like(num, _EMPTY)
    else:
        num, den, scale = state.unbind(-1)
    out = []
    for t in range(k.shape[1]):
        kt, vt = k[:, t], v[:, t]
        now = u + kt  # the current token's own weight, exp(u + k_t)
        top = torch.maximum(scale, now)
        old, cur = torch.exp(scale - top), torch.exp(now - top)
        out.append((old * num + cur * vt) / (old * den + cur))
        decayed = scale - w
        top = torch.maximum(decayed, kt)
        old, cur = torch.exp(decayed - top), torch.exp(kt - top)
        num, den, scale = old * num + cur * vt, old * den + cur, top
    return torch.stack(out, dim=1), torch.stack([num, den, scale], dim=-1)


@agreed(sharded=("key", "value"))
def wkv(time_decay: torch.Tensor, time_first: torch.Tensor, key: torch.Tensor,
        value: torch.Tensor, *, kernel=None, group=None, layout: str = DEFAULT_LAYOUT,
        seqlen: int | None = None, cu_seqlens=None) -> torch.Tensor:
    """RWKV-4's WKV under context parallelism, with transformers' RWKV conventions
    (``rwkv_linear_attention_cpu``): w = exp(time_decay), u = time_first,

        out_t = (a_{t-1} + e^{u + k_t} v_t) / (b_{t-1} + e^{u + k_t}),
        a_t = e^{-w} a_{t-1} + e^{k_t} v_t,   b_t = e^{-w} b_{t-1} + e^{k_t},

    a = b = 0 before each document, computed on a running maximum's log scale (any k that
    float32 holds: no exp(k) is ever formed).

    Arguments:
        time_decay, time_first: [D] parameters (the same on every rank; each rank gets its
            share of their gradient: sum over the ranks for the one-process gradient).
        key, value: [B, L, D] this rank's shards.
        kernel: None (a token loop), or a function with the signature of transformers'
            ``rwkv_linear_attention_cpu``: ``kernel(time_decay, time_first, key, value,
            state=[num, den, max] or None, return_state=True) -> (out, [num, den, max])``.
        group, layout, seqlen, cu_seqlens: as for ``linear_recurrence``.

    Returns:
        [B, L, D] in key's dtype (float32 work for half inputs), zero on padding slots.
    """
    try:
        _tensors("wkv", time_decay=time_decay, time_first=time_first, key=key, value=value)
        if not (key.dim() == 3 and key.shape == value.shape
                and tuple(time_decay.shape) == tuple(time_first.shape) == (key.shape[2],)):
            raise ValueError(f"wkv: key and value must be [B, L, D], time_decay and time_first "
                             f"[D]; got key {tuple(key.shape)}, value {tuple(value.shape)}, "
                             f"time_decay {tuple(time_decay.shape)}, time_first "
                             f"{tuple(time_first.shape)}")
    except (TypeError, ValueError) as exc:
        return _refuse(exc, "wkv", group, layout, seqlen, cu_seqlens)
    work = _work(key.dtype)
    k, v = key.to(work), value.to(work)
    batch, _, d = k.shape

    if kernel is None:
        w, u = torch.exp(time_decay.to(work)), time_first.to(work)

        def scan(piece, state):
            return _wkv_scan(w, u, *piece, state)
    else:
        def scan(piece, state):
            out, final = kernel(time_decay, time_first, *piece,
                                state=None if state is None else list(state.unbind(-1)),
                                return_state=True)
            return out, torch.stack(final, dim=-1)

    def transition(piece):  # the log scale decays by w per token
        return (-piece[0].shape[1] * torch.exp(time_decay.to(work)))[None, :, None]

    out = linear_recurrence(scan, transition, (k, v), state_shape=(batch, d, 3),
                            map_shape=(batch, d, 1), out_shape=(d,), kind="diagonal",
                            group=group, layout=layout, seqlen=seqlen, cu_seqlens=cu_seqlens,
                            name="wkv", params=(time_decay, time_first), compose=_compose)
    return out.to(key.dtype)


# ------------------------------------------------------------------------- xLSTM's mLSTM

def _mlstm_scan(q, k, v, igate, fgate, state, eps, fresh):
    """Token by token: q, k [B, n, H, dk], v [B, n, H, dv], igate, fgate [B, n, H]
    (pre-activations); state [B, H, dk*dv + dk + 1] (C, n, m) or None: empty, with m = 0 if
    ``fresh`` (a document's start, as transformers starts) else the empty log scale."""
    b, n, h, dk = k.shape
    dv = v.shape[-1]
    if state is None:
        mem, norm = k.new_zeros((b, h, dk, dv)), k.new_zeros((b, h, dk))
        top = k.new_full((b, h), 0.0 if fresh else _EMPTY)
    else:
        mem = state[..., :dk * dv].reshape(b, h, dk, dv)
        norm, top = state[..., dk * dv:-1], state[..., -1]
    logf = F.logsigmoid(fgate)
    scale = dk ** -0.5
    out = []
    for t in range(n):
        new = torch.maximum(logf[:, t] + top, igate[:, t])
        keep, write = torch.exp(logf[:, t] + top - new), torch.exp(igate[:, t] - new)
        kt = k[:, t]
        outer = kt[..., None] * v[:, t][..., None, :]  # k_t v_t^T [B, H, dk, dv]
        mem = keep[..., None, None] * mem + write[..., None, None] * outer
        norm = keep[..., None] * norm + write[..., None] * kt
        top = new
        qt = q[:, t] * scale
        num = (qt[..., None] * mem).sum(dim=-2)  # [B, H, dv]
        den = (qt * norm).sum(dim=-1, keepdim=True).abs()
        out.append(num / (torch.maximum(den, torch.exp(-top)[..., None]) + eps))
    final = torch.cat([mem.reshape(b, h, dk * dv), norm, top[..., None]], dim=-1)
    return torch.stack(out, dim=1), final


def _starts(like, group, layout, seqlen, cu_seqlens):
    """[B, L] 1.0 on this rank's slots that start a document (global position 0 or a
    cu_seqlens start), else 0."""
    from ..comm import resolve_group
    from ..sharding import positions

    if seqlen is None and cu_seqlens is None:
        tag = getattr(like, SHARD_TAG, None)
        seqlen = tag.seqlen if tag is not None else like.shape[1] * dist.get_world_size(
            resolve_group(group))
    elif cu_seqlens is not None:
        seqlen = int(cu_seqlens[-1])
    pos = positions(seqlen, group=group, layout=layout, cu_seqlens=cu_seqlens)
    inside = pos[1] if cu_seqlens is not None else pos
    first = (inside == 0) & ((pos[0] if cu_seqlens is not None else pos) < seqlen)
    return first.to(like.device, like.dtype)[None].expand(like.shape[0], -1)


@agreed(sharded=("query", "key", "value", "igate", "fgate"))
def mlstm(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, igate: torch.Tensor,
          fgate: torch.Tensor, *, eps: float = 1e-6, kernel=None, group=None,
          layout: str = DEFAULT_LAYOUT, seqlen: int | None = None,
          cu_seqlens=None) -> torch.Tensor:
    """xLSTM's mLSTM cell under context parallelism, with the conventions of transformers'
    xLSTM backend (``mlstm_recurrent_step_native``; its chunkwise kernel computes the same
    function): with q scaled by dk^-1/2,

        m_t = max(log sigmoid(f_t) + m_{t-1}, i_t),
        C_t = e^{log sigmoid(f_t) + m_{t-1} - m_t} C_{t-1} + e^{i_t - m_t} k_t v_t^T,
        n_t = (the same weights) n_{t-1}, k_t,
        h_t = q_t C_t / (max(|q_t . n_t|, e^{-m_t}) + eps),

    with C = 0, n = 0 and m = 0 before each document. The stabiliser m is part of the
    function (through eps, h_t is q C' / (max(|q n'|, 1) + eps e^{m_t}) in the real state
    C' = C e^m), and m is itself a max-plus recurrence, so the exchanged state carries it:
    every token gets the m one process gives it.

    Arguments:
        query, key: [B, L, H, dk]; value: [B, L, H, dv]; igate, fgate: [B, L, H], the
            gates' pre-activations. This rank's shards.
        eps: the config's ``eps``.
        kernel: None (a token loop), or a function with the keywords of transformers'
            xLSTM inference kernel (``xLSTMBackend._inference_fn``): ``kernel(query=,
            key=, value=, igate=, fgate=, c_initial=, n_initial=, m_initial=) ->
            (h, (c, n, m))`` on [B, H, n, d] runs (None initial states: a document's start).
        group, layout, seqlen, cu_seqlens: as for ``linear_recurrence``.

    Returns:
        [B, L, H, dv] in value's dtype (float32 work for half inputs), zero on padding.
    """
    tensors = (query, key, value, igate, fgate)
    try:
        _tensors("mlstm", query=query, key=key, value=value, igate=igate, fgate=fgate)
        if not (query.dim() == key.dim() == value.dim() == 4 and query.shape == key.shape
                and value.shape[:3] == key.shape[:3]
                and tuple(igate.shape) == tuple(fgate.shape) == tuple(key.shape[:3])):
            raise ValueError(f"mlstm: query and key must be [B, L, H, dk], value [B, L, H, dv], "
                             f"igate and fgate [B, L, H]; got query {tuple(query.shape)}, key "
                             f"{tuple(key.shape)}, value {tuple(value.shape)}, igate "
                             f"{tuple(igate.shape)}, fgate {tuple(fgate.shape)}")
        first = _starts(key, group, layout, seqlen, cu_seqlens)
    except (TypeError, ValueError) as exc:
        return _refuse(exc, "mlstm", group, layout, seqlen, cu_seqlens)
    work = _work(value.dtype)
    q, k, v, i, f = (t.to(work) for t in tensors)
    b, _, h, dk = k.shape
    dv = v.shape[-1]

    if kernel is None:
        def scan(piece, state):
            return _mlstm_scan(*piece[:5], state, eps, bool(piece[5][0, 0] > 0))
    else:
        def scan(piece, state):
            qs, ks, vs, is_, fs = (t.transpose(1, 2) for t in piece[:5])
            if state is None and bool(piece[5][0, 0] > 0):
                initial = (None, None, None)
            elif state is None:
                initial = (ks.new_zeros((b, h, dk, dv)), ks.new_zeros((b, h, dk)),
                           ks.new_full((b, h, 1), _EMPTY))
            else:
                initial = (state[..., :dk * dv].reshape(b, h, dk, dv),
                           state[..., dk * dv:-1], state[..., -1:])
            out, (mem, norm, top) = kernel(
                query=qs.contiguous(), key=ks.contiguous(), value=vs.contiguous(),
                igate=is_.contiguous(), fgate=fs.contiguous(), c_initial=initial[0],
                n_initial=initial[1], m_initial=initial[2])
            final = torch.cat([mem.reshape(b, h, dk * dv), norm, top.reshape(b, h, 1)], dim=-1)
            return out.transpose(1, 2), final.to(work)

    def transition(piece):  # the log scale decays by log sigmoid(f) per token
        return F.logsigmoid(piece[4]).sum(dim=1)[..., None]

    out = linear_recurrence(scan, transition, (q, k, v, i, f, first.to(work)),
                            state_shape=(b, h, dk * dv + dk + 1), map_shape=(b, h, 1),
                            out_shape=(h, dv), kind="diagonal", group=group, layout=layout,
                            seqlen=seqlen, cu_seqlens=cu_seqlens, name="mlstm",
                            compose=_compose)
    return out.to(value.dtype)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
