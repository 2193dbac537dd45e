"""Selective scans: the Mamba2 layer (SSD: Mamba2, Granite 4 hybrids, Bamba, Nemotron-H,
Falcon-H1, Zamba2), the Mamba layer (Mamba, FalconMamba, Jamba) and Zamba's multi-head
Mamba: a short causal convolution, then the scan across ranks (``mamba2_ssd``,
``diagonal_recurrence``). Mamba2's CausalLM does not pass keyword arguments to its
backbone, nor the Mamba blocks of Mamba, FalconMamba and Jamba to their mixer: their layers
get the context of their model's forward. Zamba and Zamba2 stack these with a shared
transformer block whose attention calls the attention interface with the model's keyword
arguments; their decoder layers pass them on to the mixers.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

from ....mixers import causal_conv1d, diagonal_recurrence, mamba2_ssd
from ....structure import plain_weights
from ..checks import register_mixers
from .base import _RingMixer, _keep, _conv, _masked, _ring_args


class _Mamba2(_RingMixer):
    """The Mamba2 layer (Mamba2, Granite 4 hybrids, Bamba, Nemotron-H, Falcon-H1 with its
    multipliers): conv(x, B, C), then SSD, gated norm (or a SiLU gate)."""

    def _ssd_kernel(self):
        scan = getattr(self._family, "mamba2_chunk_scan", None)
        return None if scan is None else functools.partial(scan, chunk_size=self.chunk_size)

    def _ring_forward(self, hidden, ctx, **_):
        ring = _ring_args(ctx)
        batch, length, _ = hidden.shape
        dtype = hidden.dtype
        keep = _keep(ctx, batch, hidden.device, dtype)
        hidden = _masked(hidden, keep)
        if hasattr(self, "ssm_in_multiplier"):  # Falcon-H1's multipliers
            hidden = hidden * self.ssm_in_multiplier
        projected = self.in_proj(hidden)
        if hasattr(self, "mup_vector"):
            projected = projected * self.mup_vector
        gate, xbc, dt = projected.split([self.intermediate_size, self.conv_dim, self.num_heads],
                                        dim=-1)
        xbc = causal_conv1d(xbc, *_conv(self.conv1d),
                            activation=self.activation, **ring)
        xbc = _masked(xbc, keep)
        groups_n = self.n_groups * self.ssm_state_size
        x, bm, cm = torch.split(xbc, [self.intermediate_size, groups_n, groups_n], dim=-1)
        y = mamba2_ssd(x.reshape(batch, length, self.num_heads, self.head_dim), dt,
                       -torch.exp(self.A_log.float()),
                       bm.reshape(batch, length, self.n_groups, self.ssm_state_size),
                       cm.reshape(batch, length, self.n_groups, self.ssm_state_size),
                       D=self.D, dt_bias=self.dt_bias, dt_softplus=True,
                       dt_limit=tuple(self.time_step_limit), kernel=self._ssd_kernel(), **ring)
        y = y.reshape(batch, length, -1)
        if getattr(self, "mamba_rms_norm", True):
            y = self.norm(y, gate)
        else:  # Falcon-H1 without its gated norm
            y = y * F.silu(gate)
        return self.out_proj(y.to(dtype))


class _Mamba(_RingMixer):
    """The Mamba layer (Mamba; Jamba and FalconMamba with their dt/B/C norms): conv(x), then
    the selective scan h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t ([d_inner, N] state,
    ``diagonal_recurrence``), y = h C + D x, SiLU gate."""

    def _ring_forward(self, hidden, ctx, **_):
        ring = _ring_args(ctx)
        dtype = hidden.dtype
        keep = _keep(ctx, hidden.shape[0], hidden.device, dtype)
        x, gate = self.in_proj(_masked(hidden, keep)).chunk(2, dim=-1)
        x = _masked(causal_conv1d(x, *_conv(self.conv1d),
                                  activation=self.activation, **ring), keep)
        step, bm, cm = torch.split(self.x_proj(x), [self.time_step_rank, self.ssm_state_size,
                                                    self.ssm_state_size], dim=-1)
        if hasattr(self, "dt_layernorm"):  # Jamba, FalconMamba
            step, bm, cm = self.dt_layernorm(step), self.b_layernorm(bm), self.c_layernorm(cm)
        dt_weight, dt_bias = plain_weights(self.dt_proj, torch.nn.Linear,
                                           f"{type(self).__name__}.dt_proj")
        dt = step @ dt_weight.t()
        if dt_bias is not None:
            dt = dt + dt_bias.float()
        dt = F.softplus(dt)  # [B, L, D]
        a = torch.exp(-torch.exp(self.A_log.float()) * dt[..., None])  # [B, L, D, N]
        u = dt[..., None] * bm[:, :, None, :].float() * x[..., None].float()
        h = diagonal_recurrence(a, u, **ring)
        y = (h * cm[:, :, None, :].float()).sum(-1) + x * self.D
        return self.out_proj((y * F.silu(gate)).to(dtype))


class _ZambaMamba(_RingMixer):
    """Zamba's multi-head Mamba mixer: the selective scan of each head as one
    ``diagonal_recurrence`` over a [heads, head_dim, N] state per token."""

    def _ring_forward(self, hidden, ctx, **_):
        ring = _ring_args(ctx)
        batch, length, _ = hidden.shape
        dtype = hidden.dtype
        heads, dim = self.n_mamba_heads, self.mamba_head_dim
        keep = _keep(ctx, batch, hidden.device, dtype)
        # transformers views the projection [B, 2I, L] as [B, I, 2, L]: channel 2i is x_i,
        # channel 2i + 1 is gate_i
        projected = self.in_proj(_masked(hidden, keep)).reshape(batch, length, -1, 2)
        x, gate = projected[..., 0].contiguous(), projected[..., 1]
        x = _masked(causal_conv1d(x, *_conv(self.conv1d),
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


register_mixers("mamba", {
    "GraniteMoeHybridMambaLayer": _Mamba2,
    "BambaMixer": _Mamba2,
    "Mamba2Mixer": _Mamba2,
    "NemotronHMamba2Mixer": _Mamba2,
    "FalconH1Mixer": _Mamba2,
    "Zamba2MambaMixer": _Mamba2,
    "JambaMambaMixer": _Mamba,
    "MambaMixer": _Mamba,
    "FalconMambaMixer": _Mamba,
    "ZambaMambaMixer": _ZambaMamba,
}, families=("granitemoehybrid", "bamba", "mamba2", "nemotron_h", "falcon_h1", "zamba2",
             "jamba", "mamba", "falcon_mamba", "zamba"),
   kwargs_stop=("mamba2", "jamba", "mamba", "falcon_mamba"))


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
