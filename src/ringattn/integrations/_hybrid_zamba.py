"""Hybrid families' layers converted by ``convert_mixers`` (see ``hybrid``): Zamba, Zamba2.

Both stack Mamba layers and, every few layers, a shared transformer block (attention and an
MLP whose weights several layers tie) fed with the concatenation of the hidden states and
the token embeddings; its output, through a per-layer linear map, is added to the next
Mamba layer's input. The shared blocks call transformers' attention interface with the
keyword arguments the model was called with (``ring_context`` among them), and Zamba2's
rotary embedding reads the batch's position ids: ring attention serves them as it is. The
decoder layers pass their keyword arguments on to the Mamba mixers, so no pre-hook is
needed.

* Zamba2's mixer is the Mamba2 layer (``hybrid._Mamba2``: conv(x, B, C), SSD with the
  config's lower dt limit, gated RMSNorm over ``mamba_ngroups`` groups).
* Zamba's mixer is a multi-head Mamba (``_ZambaMamba`` below): one input projection whose
  output interleaves x and the gate channel by channel, one convolution over all of x, then
  per head its own x_proj (dt rank, B, C) and dt_proj, and the selective scan of each head,
  h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t, y_t = h_t C_t + D x_t, gated by SiLU(gate).

Padding is zeroed where transformers zeroes it with the 2-D mask (before the input
projection and after the convolution), from the ring context's key padding.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from .hybrid import _Mamba2, _RingMixer, _keep, _masked, _ring_args


class _ZambaMamba(_RingMixer):
    """Zamba's multi-head Mamba mixer: the selective scan of each head as one
    ``diagonal_recurrence`` over a [heads, head_dim, N] state per token."""

    def _ring_forward(self, hidden, ctx, **_):
        from ..mixers import causal_conv1d, diagonal_recurrence

        ring = _ring_args(ctx)
        batch, length, _ = hidden.shape
        dtype = hidden.dtype
        heads, dim = self.n_mamba_heads, self.mamba_head_dim
        keep = _keep(ctx, batch, hidden.device, dtype)
        # transformers views the projection [B, 2I, L] as [B, I, 2, L]: channel 2i is x_i,
        # channel 2i + 1 is gate_i
        projected = self.in_proj(_masked(hidden, keep)).reshape(batch, length, -1, 2)
        x, gate = projected[..., 0].contiguous(), projected[..., 1]
        x = _masked(causal_conv1d(x, self.conv1d.weight, self.conv1d.bias,
                                  activation=self.activation, **ring), keep)
        x = x.reshape(batch, length, heads, dim)
        params = torch.einsum("blhd,hkd->blhk", x, self.x_proj_weight)
        step, bm, cm = torch.split(params, [self.time_step_rank, self.ssm_state_size,
                                            self.ssm_state_size], dim=-1)
        dt = torch.einsum("blhr,hdr->blhd", step, self.dt_proj_weight)
        dt = F.softplus(dt + self.dt_proj_bias.float())  # [B, L, H, d]
        a = torch.exp(-torch.exp(self.A_log.float()) * dt[..., None])  # [B, L, H, d, N]
        u = dt[..., None] * bm[:, :, :, None, :].float() * x[..., None].float()
        h = diagonal_recurrence(a, u, **ring)
        y = (h * cm[:, :, :, None, :].float()).sum(-1) + x * self.D.float()
        y = y * F.silu(gate.reshape(batch, length, heads, dim))
        return self.out_proj(y.reshape(batch, length, -1).to(dtype))


LAYERS: dict = {
    "ZambaMambaMixer": _ZambaMamba,
    "Zamba2MambaMixer": _Mamba2,
}
"""transformers' layer class name -> the mixin of its converted class."""
FAMILIES: frozenset = frozenset({"zamba", "zamba2"})
"""model_type of the families these layers complete."""
KWARGS_STOP: frozenset = frozenset()
"""The families among FAMILIES whose model does not pass ring_context on to its layers."""

if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
