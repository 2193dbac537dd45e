"""Hybrid families under context parallelism: ``convert_mixers(model)``.

transformers' hybrid decoders mix the sequence in layers that are not attention: Gated
DeltaNet layers (a short causal convolution, then the gated delta rule: Qwen3-Next,
Qwen3.5), short convolutions (LFM2), Mamba2 layers (a short convolution, then the SSD
scan: Granite 4 hybrids, Bamba, Mamba2, Nemotron-H, Falcon-H1) and Mamba layers (a short
convolution, then the selective scan: Mamba, FalconMamba, Jamba) RecurrentGemma's
RG-LRU blocks (a convolution, then a gated diagonal recurrence) and MiniMax's lightning
attention (a linear attention with a decay per head). On a shard of the sequence those layers would see only
this rank's tokens. ``convert_mixers`` replaces, on the model instance, each such layer by
an instance of a subclass of its own class that shares its parameters, buffers and hooks
(the module's ``__class__`` is set to the subclass: no parameter is copied, and
``state_dict`` keys do not change); the subclass's forward computes the same function with
``ringattn.mixers`` (``causal_conv1d``, ``gated_delta_rule``, ``mamba2_ssd``,
``diagonal_recurrence``) on the batch's ``RingContext``, which reaches the layer in the
keyword arguments transformers' decoder layers pass on (``ring_context``, from
``shard_batch`` / ``prepare_batch``), or, for the families whose model or blocks do not
pass them on (``_KWARGS_STOP``), from a forward pre-hook on the model.

Nothing of transformers is patched. Without a ring context (one process: evaluation,
generation) the converted layer runs transformers' own forward. Under a ring context it
refuses a cache (training and prefill of whole sequences are served; pass
``use_cache=False``).

Padding: transformers zeroes the inputs of these layers at padded positions
(``apply_mask_to_padding_states`` with the 2-D attention mask, and Mamba2 again after its
convolution); the converted layer zeroes the same positions from the ring context's key
padding, so a left-padded batch through ``prepare_batch`` gives one process's result.

    from ringattn.integrations import transformers as ra_hf
    ra_hf.register()
    model = ra_hf.convert_mixers(Qwen3NextForCausalLM(config))   # attn_implementation="ringattn"
    local = ra_hf.prepare_batch(model, batch, group=cp_group)
    out = model(**local, use_cache=False)

``check_model`` (and so ``prepare_batch``), the mask function and the attention function
accept a converted model; an unconverted hybrid is refused with a message naming
``convert_mixers``. Families whose layers ``convert_mixers`` does not know are refused by
it with a ValueError naming the family (and why, for those a module's ``REFUSED`` lists:
Qwen4-Exp's indexed attention).
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F

from .state import MISSING, bind_context, bound_call, conversion, current_call, missing_error, owner, record

__all__ = ["CONVERTIBLE", "convert_mixers", "mixers_converted"]

CONVERTIBLE = frozenset({"qwen3_next", "qwen3_5_text", "qwen3_5_moe_text", "lfm2", "lfm2_moe",
                         "granitemoehybrid",
                         "bamba", "mamba2", "nemotron_h", "falcon_h1", "jamba", "mamba",
                         "falcon_mamba", "recurrent_gemma", "minimax"})
"""model_type of the families whose non-attention layers ``convert_mixers`` serves. Their
attention layers call transformers' attention interface (some of their model classes do
not declare ``_supports_attention_backend``, which ``check_model`` otherwise reads as
"computes attention itself"); the tests compare each with one process."""


def mixers_converted(model) -> bool:
    """Whether every sequence mixer of this model instance runs ringattn.mixers: it holds
    converted layers and none of transformers' own (read from its modules' classes, not
    from its config, which other models may share)."""
    if conversion(model) is None:  # raises TypeError for a config
        return False
    found = False
    for module in model.modules():
        if isinstance(module, _RingMixer):
            found = True
        elif type(module).__name__ in _LAYERS and type(module).__module__.startswith("transformers."):
            return False
    return found


# -- the ring context and padding ------------------------------------------------------------

def _ring_args(ctx) -> dict:
    """group, layout, seqlen, cu_seqlens of the mixers from a RingContext."""
    return dict(group=ctx.group, layout=ctx.layout, seqlen=ctx.seqlen, cu_seqlens=ctx.cu_seqlens)


def _keep(ctx, batch: int, device, dtype) -> torch.Tensor | None:
    """[B, L, 1] 1 on this rank's slots that are not padding of their row, 0 on padding (what
    transformers' 2-D attention mask is at those positions); None without padding."""
    if ctx.mask is None:
        return None
    from ..masks import evaluate
    from ..sharding import positions

    pos = positions(ctx.seqlen, group=ctx.group, layout=ctx.layout, cu_seqlens=ctx.cu_seqlens)
    pos = pos[0] if ctx.cu_seqlens is not None else pos
    seen = evaluate(ctx.mask, ctx.seqlen, torch.zeros(1, dtype=pos.dtype), pos, batch, 1)
    return seen[:, 0, 0, :].expand(batch, -1).to(device=device, dtype=dtype)[..., None]


def _masked(hidden, keep):
    return hidden if keep is None else (hidden * keep).to(hidden.dtype)


def _context(module, kwargs):
    """The ring context of this call, or None (one process); refuses what is not served."""
    ctx = kwargs.get("ring_context")
    if ctx is None:  # layers whose callers drop it: the context of their model's forward
        ctx = bound_call(module).context if bound_call(module) is not None else None
    if ctx is MISSING or (ctx is None and getattr(owner(module), "_ringattn_context_parallel",
                                                  False)):
        raise missing_error(module)
    if ctx is None:
        return None
    cache = next((kwargs[k] for k in ("cache", "cache_params", "past_key_values")
                  if kwargs.get(k) is not None), None)
    if cache is not None or (kwargs.get("use_cache") and getattr(module, "_stateful", False)):
        raise ValueError(f"{type(module).__name__} (converted by convert_mixers) got a cache "
                         f"under context parallelism; call the model with use_cache=False")
    ctx.record_call()
    return ctx


# -- the converted layers ------------------------------------------------------------------

class _RingMixer:
    """Mixin of the converted classes: transformers' forward without a ring context. Under
    one, each chunk of the sequence is scanned by the family's own chunked function where
    its module has one (``_family``: transformers' ``torch_chunk_gated_delta_rule`` or
    ``mamba2_chunk_scan``, which transformers maps to flash-linear-attention's or
    mamba-ssm's kernels where they are installed), else by ringattn.mixers' loop."""

    _family = None

    def forward(self, hidden_states, *args, **kwargs):
        names = ("cache", "attention_mask")
        for name, value in zip(names, args):  # the decoder layers pass keywords; be safe
            kwargs[name] = value
        ctx = _context(self, kwargs)
        if ctx is None:
            return super().forward(hidden_states, **kwargs)
        return self._ring_forward(hidden_states, ctx, **kwargs)


class _GatedDeltaNet(_RingMixer):
    """Qwen3-Next / Qwen3.5 GatedDeltaNet: conv(q, k, v) then the gated delta rule."""

    def _project(self, hidden):
        """(mixed_qkv [B, L, 2 key_dim + value_dim], z [B, L, Hv, dv], b, a [B, L, Hv])."""
        if hasattr(self, "in_proj_qkvz"):  # Qwen3-Next: grouped by key head
            q, k, v, z, b, a = self.fix_query_key_value_ordering(self.in_proj_qkvz(hidden),
                                                                 self.in_proj_ba(hidden))
            q, k, v = (t.reshape(t.shape[0], t.shape[1], -1) for t in (q, k, v))
            return torch.cat((q, k, v), dim=-1), z, b, a
        batch, length, _ = hidden.shape  # Qwen3.5: one projection each
        z = self.in_proj_z(hidden).reshape(batch, length, -1, self.head_v_dim)
        return self.in_proj_qkv(hidden), z, self.in_proj_b(hidden), self.in_proj_a(hidden)

    def _ring_forward(self, hidden, ctx, **_):
        from ..mixers import causal_conv1d, gated_delta_rule

        ring = _ring_args(ctx)
        batch, length, _ = hidden.shape
        hidden = _masked(hidden, _keep(ctx, batch, hidden.device, hidden.dtype))
        mixed, z, b, a = self._project(hidden)
        mixed = causal_conv1d(mixed, self.conv1d.weight, self.conv1d.bias,
                              activation=self.activation, **ring)
        q, k, v = torch.split(mixed, [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = q.reshape(batch, length, -1, self.head_k_dim)
        k = k.reshape(batch, length, -1, self.head_k_dim)
        v = v.reshape(batch, length, -1, self.head_v_dim)
        beta = b.sigmoid()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        out = gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True,
                               kernel=getattr(self._family, "torch_chunk_gated_delta_rule", None),
                               **ring)
        # transformers' kernel returns float32 for float32 q; ours returns v's dtype
        out = self.norm(out.reshape(-1, out.shape[-1]), z.reshape(-1, z.shape[-1]))
        return self.out_proj(out.reshape(batch, length, -1))


class _ShortConv(_RingMixer):
    """LFM2's short convolution: (B * x) convolved, times C."""

    def _ring_forward(self, hidden, ctx, **_):
        from ..mixers import causal_conv1d

        hidden = _masked(hidden, _keep(ctx, hidden.shape[0], hidden.device, hidden.dtype))
        bm, cm, x = self.in_proj(hidden).chunk(3, dim=-1)
        y = causal_conv1d(bm * x, self.conv.weight, self.conv.bias, **_ring_args(ctx))
        return self.out_proj((cm * y).contiguous())


class _Mamba2(_RingMixer):
    """The Mamba2 layer (Mamba2, Granite 4 hybrids, Bamba, Nemotron-H, Falcon-H1 with its
    multipliers): conv(x, B, C), then SSD, gated norm (or a SiLU gate)."""

    def _ssd_kernel(self):
        scan = getattr(self._family, "mamba2_chunk_scan", None)
        return None if scan is None else functools.partial(scan, chunk_size=self.chunk_size)

    def _ring_forward(self, hidden, ctx, **_):
        from ..mixers import causal_conv1d, mamba2_ssd

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
        xbc = causal_conv1d(xbc, self.conv1d.weight, self.conv1d.bias,
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
        from ..mixers import causal_conv1d, diagonal_recurrence

        ring = _ring_args(ctx)
        dtype = hidden.dtype
        keep = _keep(ctx, hidden.shape[0], hidden.device, dtype)
        x, gate = self.in_proj(_masked(hidden, keep)).chunk(2, dim=-1)
        x = _masked(causal_conv1d(x, self.conv1d.weight, self.conv1d.bias,
                                  activation=self.activation, **ring), keep)
        step, bm, cm = torch.split(self.x_proj(x), [self.time_step_rank, self.ssm_state_size,
                                                    self.ssm_state_size], dim=-1)
        if hasattr(self, "dt_layernorm"):  # Jamba, FalconMamba
            step, bm, cm = self.dt_layernorm(step), self.b_layernorm(bm), self.c_layernorm(cm)
        dt = step @ self.dt_proj.weight.t()
        if self.dt_proj.bias is not None:
            dt = dt + self.dt_proj.bias.float()
        dt = F.softplus(dt)  # [B, L, D]
        a = torch.exp(-torch.exp(self.A_log.float()) * dt[..., None])  # [B, L, D, N]
        u = dt[..., None] * bm[:, :, None, :].float() * x[..., None].float()
        h = diagonal_recurrence(a, u, **ring)
        y = (h * cm[:, :, None, :].float()).sum(-1) + x * self.D
        return self.out_proj((y * F.silu(gate)).to(dtype))


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
        from ..mixers import causal_conv1d, diagonal_recurrence

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
        x = causal_conv1d(self.linear_x(hidden), self.conv_1d.weight, self.conv_1d.bias, **ring)
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
        from ..mixers import linear_recurrence

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


_LAYERS = {
    "Qwen3NextGatedDeltaNet": _GatedDeltaNet,
    "Qwen3_5GatedDeltaNet": _GatedDeltaNet,
    "Qwen3_5MoeGatedDeltaNet": _GatedDeltaNet,
    "Lfm2ShortConv": _ShortConv,
    "Lfm2MoeShortConv": _ShortConv,
    "GraniteMoeHybridMambaLayer": _Mamba2,
    "BambaMixer": _Mamba2,
    "Mamba2Mixer": _Mamba2,
    "NemotronHMamba2Mixer": _Mamba2,
    "FalconH1Mixer": _Mamba2,
    "JambaMambaMixer": _Mamba,
    "MambaMixer": _Mamba,
    "FalconMambaMixer": _Mamba,
    "RecurrentGemmaRecurrentBlock": _RecurrentBlock,
    "MiniMaxLightningAttention": _Lightning,
}
"""transformers' sequence-mixer classes (by name) and the mixin of their converted class."""

_SUBCLASSES: dict[type, type] = {}


def _converted_class(cls: type) -> type:
    """The subclass of transformers' ``cls`` whose forward runs ringattn.mixers."""
    if cls not in _SUBCLASSES:
        _SUBCLASSES[cls] = type(f"Ring{cls.__name__}", (_LAYERS[cls.__name__], cls),
                                {"__module__": __name__, "__qualname__": f"Ring{cls.__name__}",
                                 "_family": sys.modules[cls.__module__]})
    return _SUBCLASSES[cls]


_NOT_MIXERS = frozenset({"mlp", "moe"})
"""Entries of per-layer type lists that mix no sequence (Nemotron-H's feed-forward layers)."""


def _mixer_layers(config) -> int | None:
    """How many layers the config's per-layer types (the fields _config_problem reads; some
    configs hold the same list under two names) say are sequence mixers other than
    attention; None for a config without such a list (Mamba2: every layer is one)."""
    from .transformers import _ATTENTION_LAYER_TYPES, _LAYER_TYPE_FIELDS

    counts = [sum(str(k) not in _ATTENTION_LAYER_TYPES | _NOT_MIXERS for k in value)
              for value in (getattr(config, field, None) for field in _LAYER_TYPE_FIELDS)
              if isinstance(value, (list, tuple))]
    return max(counts, default=None)


def convert_mixers(model):
    """Make the sequence mixers of a transformers hybrid model exact under ring attention.

    Arguments:
        model: a transformers model of a family in ``CONVERTIBLE`` (built with
            attn_implementation="ringattn").

    Returns:
        ``model`` itself, each of its GatedDeltaNet, short-conv and Mamba2 layers now an
        instance of a ``Ring...`` subclass of its class (same parameters and hooks) that
        runs ``ringattn.mixers`` under a ring context. Converting twice is a no-op.

    Raises:
        TypeError: ``model`` is not a transformers model.
        ValueError: the family has sequence layers ``convert_mixers`` does not serve (named),
            or a layer of a non-attention type was not found.
    """
    config = getattr(model, "config", None)
    if config is None or not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert_mixers takes a transformers model, got {type(model).__name__}")
    family = getattr(config, "model_type", type(config).__name__)
    if mixers_converted(model):
        return model
    if family not in CONVERTIBLE:
        raise ValueError(f"convert_mixers does not serve {family}: " + (
            _WHY_NOT[family] if family in _WHY_NOT else
            f"its sequence layers are not among {sorted(_LAYERS)} "
            f"(families: {sorted(CONVERTIBLE)})"))
    done = 0
    for module in model.modules():
        cls = type(module)
        if cls.__name__ in _LAYERS and cls.__module__.startswith("transformers."):
            module.__class__ = _converted_class(cls)
            done += 1
        elif isinstance(module, _RingMixer):
            done += 1
    expected = _mixer_layers(config)
    if done == 0 or done != (done if expected is None else expected):
        raise ValueError(f"convert_mixers found {done} sequence-mixer layers in "
                         f"{type(model).__name__} but its config lists {expected} "
                         f"non-attention layers")
    record(model, mixers=True)
    if family in _KWARGS_STOP:  # the CausalLM does not pass ring_context on to its layers
        mixers = [m for m in model.modules() if isinstance(m, _RingMixer)]
        bind_context(model, mixers)
        if any(getattr(m, "_reads_padding", False) for m in mixers) and not model.__dict__.get(
                "_ringattn_padding_hook"):
            model.register_forward_pre_hook(_restore_padding, with_kwargs=True)
            model.__dict__["_ringattn_padding_hook"] = True
    return model


_KWARGS_STOP = frozenset({"mamba2", "jamba", "mamba", "falcon_mamba"})
"""Families whose CausalLM or decoder layers do not pass their keyword arguments on to the
mixers (Mamba2ForCausalLM calls its backbone with named arguments only; the Mamba blocks of
Mamba, FalconMamba and Jamba call their mixer so): each converted layer gets the context of
the model forward that runs it (``state.bind_context``: bound to that forward, also when
gradient checkpointing recomputes the layer after other forwards)."""


def _restore_padding(model, args, kwargs):
    """Layers that read the padding positions (RWKV, xLSTM) get the padding's own ids back."""
    ctx = kwargs.get("ring_context")
    call = current_call(model)
    if (ctx is None or getattr(ctx, "padded_ids", None) is None
            or kwargs.get("input_ids") is None or call is None):
        return None
    call.padding_restored = True
    return args, {**kwargs, "input_ids": ctx.padded_ids}


# -- more families, one module per kind of layer ----------------------------------------------

_MORE = ("_hybrid_zamba", "_hybrid_delta", "_hybrid_more", "_hybrid_rnn")
"""Modules of this package that convert more families' layers with the mixins above: each
defines ``LAYERS`` (transformers' class name -> mixin), ``FAMILIES`` (model_type) and
``KWARGS_STOP`` (the families among them whose model does not pass ``ring_context`` on)."""


def _extend() -> frozenset:
    import importlib

    families = set(CONVERTIBLE)
    for name in _MORE:
        module = importlib.import_module(f".{name}", __package__)
        _LAYERS.update(module.LAYERS)
        families |= set(module.FAMILIES)
        globals()["_KWARGS_STOP"] = _KWARGS_STOP | frozenset(module.KWARGS_STOP)
        _WHY_NOT.update(getattr(module, "REFUSED", {}))
    return frozenset(families)


_WHY_NOT: dict = {}
"""model_type -> why ``convert_mixers`` refuses that family (a module's ``REFUSED``)."""


CONVERTIBLE = _extend()


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
