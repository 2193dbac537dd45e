"""Recurrences: RecurrentGemma's RG-LRU block (a convolution, then a gated diagonal
recurrence), MiniMax's lightning attention (a linear attention with a decay per head), and
the attention-free RWKV (token shift and WKV) and xLSTM (mLSTM) layers, across ranks with
``ringattn.mixers`` (``diagonal_recurrence``, ``linear_recurrence``, ``wkv``, ``mlstm``).

RWKV (RWKV-4) and xLSTM have no attention at all: every sequence layer is a recurrence.

* RWKV's time mixing (``RwkvSelfAttention``): a token shift (each token mixed with the one
  before it, zero before a document: ``causal_conv1d`` with the kernel [1, 0], the halo of
  one token from the previous chunk), then the WKV recurrence (``ringattn.mixers.wkv``, its
  state on a running maximum's log scale, each chunk scanned by transformers'
  ``rwkv_linear_attention_cpu``), the sigmoid receptance gate and the output projection.
  Its channel mixing (``RwkvFeedForward``) has the same token shift and nothing else that
  reads another token.
* xLSTM's mLSTM backend (``xLSTMBackend``): ``ringattn.mixers.mlstm`` with its stabiliser
  carried across the ranks, each chunk scanned by the backend's own inference kernel
  (chunkwise, then recurrent for the rest). Its projections, gates, soft caps, multi-head
  norm and output gate around it are per token and stay transformers'.

Neither model masks padding (transformers ignores their attention mask): a left-padded row's
real tokens read its padding tokens, which ``shard_batch`` replaces by the row's first real
token. Those tokens' values depend on the padding ids alone, so the model's pre-hook hands
the padding's own ids back (``RingContext.padded_ids``, with ``input_ids`` passed by
keyword) and a left-padded batch gives one process's result; called from ``inputs_embeds``
it is refused on every rank (``_unpadded``). Right padding comes after every real token of
its row, which none reads: exact. Packed rows start each document from an empty state.
(Unlike RecurrentGemma's, whose padding positions hold undefined attention outputs and whose
left-padded batches are refused.) Their models do not pass ``ring_context`` on to their
blocks: their layers get the context of their model's forward (``checks.KWARGS_STOP``).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ....mixers import causal_conv1d, diagonal_recurrence, linear_recurrence, mlstm, wkv
from ..checks import register_mixers
from ..state import bound_call
from .base import _RingMixer, _context, _keep, _conv, _masked, _ring_args


class _RecurrentBlock(_RingMixer):
    """RecurrentGemma's recurrent block: GeLU(W_y x) times RG-LRU(conv(W_x x)), where the
    RG-LRU is h_t = a_t h_{t-1} + sqrt(1 - a_t^2) (i_t x_t) (a_t = 0 and no normalisation
    where the position id is 0), a diagonal recurrence in float32. transformers' block does
    not mask padding: a padded row's real tokens read its padding positions, which after an
    attention layer hold the outputs of queries that see no key (undefined: with a
    recurrent layer after an attention layer, transformers' eager and sdpa attention differ
    by more than 1% relative on the real tokens of a left-padded row:
    test_recurrent_gemma_padding_is_undefined). A left-padded batch is refused; right
    padding follows every real token of its row, which none reads."""

    _stateful = True  # use_cache=True makes transformers' block keep its states

    def _ring_forward(self, hidden, ctx, position_ids=None, **_):
        if ctx.left_padding is not None or position_ids is None:  # right padding: unread
            raise ValueError(
                "RecurrentGemma's recurrent block reads the padding positions of a left-padded "
                "row (transformers masks nothing there), and after an attention layer those "
                "hold the output of queries that see no key, which no attention defines "
                "(transformers' own eager and sdpa differ there): its left-padded batches have "
                "no exact result to match; pad on the right, pack the rows (position_ids "
                "restarting at 0) or drop the padding"
                if ctx.left_padding is not None else
                "RecurrentGemma's recurrent block needs the position ids (its state resets "
                "where they are 0)")
        ring = _ring_args(ctx)
        dtype = hidden.dtype
        y = self.act_fn(self.linear_y(hidden))
        x = causal_conv1d(self.linear_x(hidden), *_conv(self.conv_1d), **ring)
        lru = self.rg_lru
        batch, length, width = x.shape
        heads, block = lru.num_attention_heads, lru.block_width
        xh = x.reshape(batch, length, heads, block)
        gate_in = torch.sigmoid(torch.einsum("blhi,hij->blhj", xh, lru.input_gate_weight)
                                + lru.input_gate_bias).reshape(batch, length, width)
        gate_a = torch.sigmoid(torch.einsum("blhi,hij->blhj", xh, lru.recurrent_gate_weight)
                               + lru.recurrent_gate_bias).reshape(batch, length, width)
        log_a = -8.0 * gate_a * F.softplus(lru.recurrent_param)
        reset = (position_ids == 0)[:, :, None].expand(batch, -1, -1)
        multiplier = self._family.SqrtBoundDerivative.apply(1 - torch.exp(2 * log_a))
        multiplier = reset + ~reset * multiplier
        normalized = x * gate_in * multiplier.type(dtype)
        a = torch.exp(log_a) * ~reset
        h = diagonal_recurrence(a.float(), normalized.float(), **ring).type(dtype)
        return self.linear_out(h * y), None


class _Lightning(_RingMixer):
    """MiniMax's lightning attention: a linear attention with a constant decay per head,
    S_t = exp(-s) S_{t-1} + k_t v_t^T, o_t = q_t S_t (transformers computes it in blocks),
    then RMSNorm, a sigmoid output gate and the output projection."""

    def _ring_forward(self, hidden, ctx, **_):
        ring = _ring_args(ctx)
        batch, length, _ = hidden.shape
        heads, dim = self.num_attention_heads, self.head_dim
        qkv = _masked(self.act_fn(self.qkv_proj(hidden)),
                      _keep(ctx, batch, hidden.device, hidden.dtype))
        q, k, v = torch.split(qkv.reshape(batch, length, heads, 3 * dim), dim, dim=3)
        slope = self.slope_rate.reshape(heads).to(q.dtype)  # a buffer: no gradient

        def scan(piece, state):
            q_, k_, v_ = piece
            s = state if state is not None else v_.new_zeros((batch, heads, dim, dim))
            decay = torch.exp(-slope)[None, :, None, None]
            out = []
            for t in range(q_.shape[1]):
                s = decay * s + k_[:, t, :, :, None] * v_[:, t, :, None, :]
                out.append(torch.einsum("bhd,bhde->bhe", q_[:, t], s))
            return torch.stack(out, dim=1), s

        def transition(piece):
            n = piece[0].shape[1]
            return torch.exp(-slope * n)[None, :, None, None].expand(batch, heads, 1, 1)

        def entry_output(piece, state):  # o_t gains exp(-s t) q_t S_0 (t = 1 .. n)
            steps = torch.arange(1, piece[0].shape[1] + 1, device=q.device, dtype=q.dtype)
            decay = torch.exp(-slope[None, :] * steps[:, None])  # [n, H]
            return decay[None, :, :, None] * torch.einsum("bthd,bhde->bthe", piece[0], state)

        out = linear_recurrence(scan, transition, (q, k, v), state_shape=(batch, heads, dim, dim),
                                map_shape=(batch, heads, 1, 1), out_shape=(heads, dim),
                                kind="diagonal", name="lightning attention",
                                entry_output=entry_output, **ring)
        out = self.norm(out.reshape(batch, length, heads * dim))
        out = torch.sigmoid(self.output_gate(hidden)) * out
        return self.out_proj(out), None


def _unpadded(module, ctx, family: str) -> None:
    """A left-padded row's real tokens read its padding tokens (transformers masks nothing
    there): the model's pre-hook gives it the padding's own ids (``ctx.padded_ids``, with
    ``input_ids`` passed by keyword); without them, refused. Right padding comes after every
    real token: nothing real reads it."""
    call = bound_call(module)
    if ctx.left_padding is not None and not (call is not None and call.padding_restored):
        raise ValueError(
            f"{family} reads the padding tokens of a left-padded row (transformers does not "
            f"mask them), which ringattn.shard_batch replaces by the row's first real token: "
            f"the converted model restores them only from input_ids passed by keyword "
            f"(model(**local) with shard_batch's input_ids), not from inputs_embeds")


def _shifted(hidden, ctx):
    """Each token's previous token (zero before a document), across the ranks: RWKV's
    ``time_shift``, as a causal convolution of kernel [1, 0] (exactly the previous
    token: it adds 0 * x_t)."""
    width = hidden.shape[-1]
    kernel = torch.tensor([1.0, 0.0], dtype=hidden.dtype, device=hidden.device).expand(width, 2)
    return causal_conv1d(hidden, kernel, **_ring_args(ctx))


class _RwkvTimeMix(_RingMixer):
    """RWKV's time mixing: the token shift, then WKV, times the sigmoid receptance."""

    _reads_padding = True

    def forward(self, hidden, state=None, use_cache=False):
        ctx = _context(self, {"cache": state})
        if ctx is None:
            return super(_RingMixer, self).forward(hidden, state=state, use_cache=use_cache)
        _unpadded(self, ctx, "RWKV")
        shifted = _shifted(hidden, ctx)
        key = hidden * self.time_mix_key + shifted * (1 - self.time_mix_key)
        value = hidden * self.time_mix_value + shifted * (1 - self.time_mix_value)
        receptance = hidden * self.time_mix_receptance + shifted * (1 - self.time_mix_receptance)
        key, value = self.key(key), self.value(value)
        receptance = torch.sigmoid(self.receptance(receptance))
        out = wkv(self.time_decay, self.time_first, key, value,
                  kernel=getattr(self._family, "rwkv_linear_attention_cpu", None),
                  **_ring_args(ctx))
        return self.output(receptance * out), None


class _RwkvChannelMix(_RingMixer):
    """RWKV's channel mixing: the token shift, then a squared-ReLU MLP gated by the sigmoid
    receptance (per token)."""

    _reads_padding = True

    def forward(self, hidden, state=None):
        ctx = _context(self, {"cache": state})
        if ctx is None:
            return super(_RingMixer, self).forward(hidden, state=state)
        _unpadded(self, ctx, "RWKV")
        shifted = _shifted(hidden, ctx)
        key = hidden * self.time_mix_key + shifted * (1 - self.time_mix_key)
        receptance = hidden * self.time_mix_receptance + shifted * (1 - self.time_mix_receptance)
        value = self.value(torch.square(torch.relu(self.key(key))))
        return torch.sigmoid(self.receptance(receptance)) * value, None


class _MLstmBackend(_RingMixer):
    """xLSTM's mLSTM backend: q, k, v [B, H, S, d] and the gates' pre-activations [B, H, S]
    in, h [B, H, S, dv] out; under a ring context the cell runs across the ranks
    (``mlstm``), each chunk scanned by the backend's inference kernel."""

    _reads_padding = True

    def forward(self, query, key, value, igate, fgate, c_initial=None, n_initial=None,
                m_initial=None, return_last_states=None, mode=None):
        initial = next((s for s in (c_initial, n_initial, m_initial) if s is not None), None)
        ctx = _context(self, {"cache": initial})
        if ctx is None:
            return super(_RingMixer, self).forward(query, key, value, igate, fgate, c_initial,
                                                   n_initial, m_initial, return_last_states, mode)
        _unpadded(self, ctx, "xLSTM")
        mode = self.config.mode if mode is None else mode
        chunk = self.config.chunk_size
        if "train" not in mode and "inference" not in mode:
            raise ValueError(f"xLSTM: unknown backend mode {mode!r}")
        if mode == "train" and ctx.seqlen % chunk != 0:  # as transformers' kernel refuses
            raise ValueError(f"xLSTM's mode 'train' needs the sequence length ({ctx.seqlen}) to "
                             f"be a multiple of chunk_size ({chunk}); use mode "
                             f"'train_with_padding' or 'inference'")
        h = mlstm(*(t.transpose(1, 2) for t in (query, key, value, igate, fgate)),
                  eps=self.config.eps, kernel=self._inference_fn, **_ring_args(ctx))
        return h.transpose(1, 2), None


register_mixers("recurrent", {
    "RecurrentGemmaRecurrentBlock": _RecurrentBlock,
    "MiniMaxLightningAttention": _Lightning,
    "RwkvSelfAttention": _RwkvTimeMix,
    "RwkvFeedForward": _RwkvChannelMix,
    "xLSTMBackend": _MLstmBackend,
}, families=("recurrent_gemma", "minimax", "rwkv", "xlstm"), kwargs_stop=("rwkv", "xlstm"))


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
