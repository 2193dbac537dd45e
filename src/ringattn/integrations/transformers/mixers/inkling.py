"""Inkling's and Inkling2's short convolutions: the static depthwise convolutions on keys,
values and the residual branches (``causal_conv1d`` across ranks, each chunk with the halo
of the k-1 inputs before it) and Inkling2's dynamic key/value convolution (per-token taps
from a projection of the layer input, plus static ones), whose window of the k-1 earlier
inputs comes from the same halo exchange (``conv._shifted``).

Their attention (a relative position bias computed per query, per-query sinks) is converted
by ``families/score_bias.py``; Inkling's decoder layers call the convolutions without the
batch's keyword arguments, so they get the context of their model's forward.
"""

from __future__ import annotations

import math

import torch

from ....mixers import causal_conv1d
from ..checks import register_mixers
from .base import _context, _keep, _conv, _masked, _RingMixer, _ring_args
from .conv import _shifted


class _InklingConv(_RingMixer):
    """Inkling's ``ShortConvolution`` (x + conv(x), in float32) and Inkling2's (the same,
    divided by sqrt(k + 1)); Inkling2's calls pass a ``dynamic_input`` they ignore."""

    def forward(self, hidden_states, *args, **kwargs):
        ctx = _context(self, kwargs)
        if ctx is None:
            return super(_RingMixer, self).forward(hidden_states, *args, **kwargs)
        dtype = hidden_states.dtype
        x = hidden_states.float()
        keep = _keep(ctx, x.shape[0], x.device, x.dtype)
        y = causal_conv1d(_masked(x, keep), *_conv(self.conv1d), **_ring_args(ctx))
        y = y + x
        if type(self).__name__.startswith("RingInkling2"):
            y = y / math.sqrt(self.conv_kernel_size + 1)
        return y.to(dtype)


class _InklingDynamicConv(_RingMixer):
    """Inkling2's ``DynamicShortConvolution``: taps static + projected per token, shared by
    the channels of a key/value head, over the token and the k-1 before it."""

    def forward(self, hidden_states, dynamic_input, *args, **kwargs):
        ctx = _context(self, kwargs)
        if ctx is None:
            return super(_RingMixer, self).forward(hidden_states, dynamic_input, *args, **kwargs)
        dtype = hidden_states.dtype
        batch, length, width = hidden_states.shape
        taps = self.conv_kernel_size
        dynamic = self.weight_proj(dynamic_input).float().view(batch, length, self.num_heads, 1, taps)
        weights = self.static_weight.float().T.view(self.num_heads, -1, taps) + dynamic
        x = hidden_states.float()
        context = _masked(x, _keep(ctx, batch, x.device, x.dtype))
        lags = [context] + (_shifted(context, taps - 1, _ring_args(ctx)) if taps > 1 else [])
        windows = torch.stack(lags, dim=-1).view(batch, length, self.num_heads, -1, taps)
        y = (windows * weights).sum(-1).reshape(batch, length, width)
        return ((y + x) / math.sqrt(2 * taps + 1)).to(dtype)


_FAMILIES = ("inkling_text", "inkling2_text", "inkling2_loop_text")

register_mixers("inkling", {
    "InklingShortConvolution": _InklingConv,
    "Inkling2ShortConvolution": _InklingConv,
    "Inkling2LoopShortConvolution": _InklingConv,
    "Inkling2DynamicShortConvolution": _InklingDynamicConv,
    "Inkling2LoopDynamicShortConvolution": _InklingDynamicConv,
}, families=_FAMILIES, kwargs_stop=_FAMILIES, per_layer=dict.fromkeys(_FAMILIES, 4))


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
