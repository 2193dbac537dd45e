"""Hybrid families' layers converted by ``convert_mixers`` (see ``hybrid``): rnn.

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
blocks: a forward pre-hook on the model hands it to the converted layers (``KWARGS_STOP``).
"""

from __future__ import annotations

import torch

from .hybrid import _context, _ring_args, _RingMixer

LAYERS: dict = {}
"""transformers' layer class name -> the mixin of its converted class."""
FAMILIES: frozenset = frozenset({"rwkv", "xlstm"})
"""model_type of the families these layers complete."""
KWARGS_STOP: frozenset = frozenset({"rwkv", "xlstm"})
"""The families among FAMILIES whose model does not pass ring_context on to its layers."""


def _unpadded(module, ctx, family: str) -> None:
    """A left-padded row's real tokens read its padding tokens (transformers masks nothing
    there): the model's pre-hook gives it the padding's own ids (``ctx.padded_ids``, with
    ``input_ids`` passed by keyword); without them, refused. Right padding comes after every
    real token: nothing real reads it."""
    from .state import bound_call

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
    from ..mixers import causal_conv1d

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
        from ..mixers import wkv

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
        from ..mixers import mlstm

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


LAYERS.update({
    "RwkvSelfAttention": _RwkvTimeMix,
    "RwkvFeedForward": _RwkvChannelMix,
    "xLSTMBackend": _MLstmBackend,
})

if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
