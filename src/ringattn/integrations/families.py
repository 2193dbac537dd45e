"""Model families that need more than the attention function: ``convert(model)``.

Some transformers families compute something from the rank's own tokens that one process
computes from the whole sequence, so registering ring attention is not enough:

* MoE families with a router auxiliary loss (``output_router_logits=True``: Mixtral,
  Qwen2-MoE, Qwen3-MoE, PhiMoE, OLMoE, GraniteMoE, gpt-oss, ...): transformers'
  ``load_balancing_loss_func`` averages the router's top-k counts and probabilities over the
  tokens it sees. ``convert`` adds a forward hook to the model that replaces the per-rank
  value by the global one: the per-expert sums over this rank's real tokens are all-reduced
  over the context-parallel group (with autograd: the backward all-reduces their
  gradients), and each rank's loss carries ``1/W`` of ``router_aux_loss_coef * aux``, so
  the ranks' losses sum to one process's loss and their gradients to its gradients.
  ``output.aux_loss`` is the global value on every rank.
* Llama 4's query temperature tuning on its NoPE layers (``attn_temperature_tuning``):
  transformers scales each query by ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))``
  with ``p = arange(local length)``. ``convert`` switches the module's own scaling off and
  scales the output of its ``q_proj`` (a forward hook) by the same function of each local
  slot's GLOBAL position (from the batch's ``RingContext``: layout, S, documents), which is
  what one process computes; without a ring context, by the positions transformers uses.
* Families that compute attention in their own modules: BLOOM and MPT (ALiBi: ring
  attention with their slopes as ``alibi_slopes``), XGLM, Falcon and GPT-NeoX-Japanese
  (rotary), OpenAI GPT (learned positions) and GPT-Neo (unscaled scores, windowed local
  layers). ``convert`` swaps those
  module instances' class for a subclass that keeps their projections (and rotary
  embedding) and calls ring attention. Falcon and GPT-Neo cannot be built with "ringattn"
  (their constructors look the attention class up in a dict of their own: KeyError), so
  they are built with "eager" and ``convert`` selects ring attention (``BUILT_EAGER``).
* StableLM and Nemotron, whose decoder layers do not pass the batch's keyword arguments to
  their attention: ``convert`` hands their attention modules the batch's ``ring_context``.
  Families whose layers drop keyword arguments get the context of the model forward that
  runs them (``state.bind_context``: also when gradient checkpointing recomputes a layer
  after other forwards).

Nothing of transformers is patched: ``convert`` registers torch hooks on the model's own
modules, swaps the class of module instances, and records what it did on the model
instance (``state.record``; never in a registry keyed by its config, which other models may
share), which lets ``check_model``, the mask function and the attention function accept
what it made exact on this model and refuse it on another. It returns the model:

    from ringattn.integrations import transformers as ra_hf
    ra_hf.register()
    model = ra_hf.convert(MixtralForCausalLM(config))   # config.output_router_logits = True
    local = ra_hf.prepare_batch(model, batch, group=cp_group)
    out = model(**local)        # out.loss: this rank's share; out.aux_loss: the global value

Families that need nothing are returned unchanged; families it cannot make exact raise
``check_model``'s ValueError.
"""

from __future__ import annotations

import inspect

import torch
import torch.distributed as dist

from .state import MISSING, bind_context, bound_context, conversion, missing_error, record

__all__ = ["BUILT_EAGER", "convert", "converted", "convertible", "global_router_loss"]

_REFERENCE_LOSS = ("transformers.models.mixtral.modeling_mixtral", "load_balancing_loss_func")
"""The router loss ``_global_router_loss`` computes globally. A family is converted only if
its module's ``load_balancing_loss_func`` has the same source and its CausalLM calls it with
``(router_logits, self.num_experts, self.num_experts_per_tok, attention_mask)``."""

_CALL = ("load_balancing_loss_func(", "outputs.router_logits,", "self.num_experts,",
         "self.num_experts_per_tok,", "attention_mask,")

_COEFFICIENTS = ("router_aux_loss_coef", "aux_loss_coef")
"""The CausalLM attribute that weighs the router loss (JetMoe names it ``aux_loss_coef``);
its forward must add ``self.<attribute> * aux_loss`` to the loss."""


def _router_coef(model) -> str | None:
    """The name of ``model``'s router loss coefficient attribute, or None."""
    return next((a for a in _COEFFICIENTS if isinstance(getattr(model, a, None), (int, float))),
                None)


def converted(model) -> bool:
    """Whether ``convert`` ran on this model instance (its record is on the model; another
    model built from the same config is not converted)."""
    done = conversion(model)  # raises TypeError for a config
    return bool(done and done.get("converted"))


def global_router_loss(model) -> bool:
    """Whether this model instance computes its router auxiliary loss globally (``convert``
    put the global router loss hook on it), so ``output_router_logits=True`` is exact."""
    conversion(model)  # raises TypeError for a config
    return any(hook is _router_hook for hook in model._forward_hooks.values())


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the backward sums the gradients (each rank's output is used by
    that rank's loss only, and every rank's input feeds every rank's output)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _local_positions(ring_context) -> torch.Tensor:
    """[L] global position of each local slot (>= S on the slots that pad S up)."""
    from ..sharding import positions

    pos = positions(ring_context.seqlen, group=ring_context.group, layout=ring_context.layout,
                    cu_seqlens=ring_context.cu_seqlens)
    return pos[0] if ring_context.cu_seqlens is not None else pos


def _local_real(ring_context, batch: int, device) -> torch.Tensor:
    """[B, L] float: 1 on this rank's real tokens (not padding, not a slot padding S up)."""
    from ..masks import evaluate

    pos = _local_positions(ring_context)
    real = (pos < ring_context.seqlen).view(1, -1).expand(batch, -1)
    if ring_context.mask is not None:  # key padding of the batch rows, in global positions
        seen = evaluate(ring_context.mask, ring_context.seqlen, pos[:1].clamp(max=0), pos,
                        batch, 1)  # [B or 1, 1, 1, L]
        real = real & seen[:, 0, 0, :].expand(batch, -1)
    return real.to(device=device, dtype=torch.float32)


def _global_router_loss(router_logits, num_experts: int, top_k: int, real_BL, group):
    """transformers' load-balancing loss over the tokens of every rank of ``group``:
    ``num_experts * sum_e f_e * P_e`` with f_e the fraction of top-k assignments to expert e
    and P_e its mean router probability, both over the real tokens of all layers."""
    flat = real_BL.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=flat.device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=flat.device)
    rows = torch.zeros((), dtype=torch.float32, device=flat.device)
    for logits in router_logits:
        weights = torch.softmax(logits.to(flat.device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        counts = counts.scatter_add(0, chosen.reshape(-1), flat.repeat_interleave(top_k))
        probs = probs + (weights.float() * flat.unsqueeze(-1)).sum(0)
        rows = rows + flat.sum()
    counts = counts.clone()
    dist.all_reduce(counts, group=group)  # no gradient: top-k is piecewise constant
    rows = rows.clone()
    dist.all_reduce(rows, group=group)
    probs = _AllReduceSum.apply(probs, group)
    return torch.sum((counts / rows) * (probs / rows)) * num_experts


def _router_loss_problem(model) -> str | None:
    """Why ``convert`` cannot make this model's router loss global, or None."""
    import importlib

    family = type(model).__module__
    try:
        own = importlib.import_module(family).load_balancing_loss_func
        ref = getattr(importlib.import_module(_REFERENCE_LOSS[0]), _REFERENCE_LOSS[1])
        same = inspect.getsource(own) == inspect.getsource(ref)
        source = inspect.getsource(type(model).forward)
    except (AttributeError, ImportError, OSError, TypeError):
        return f"{type(model).__name__} has no load_balancing_loss_func that ringattn knows"
    calls = "".join(source.split())
    coef = _router_coef(model)
    if not same or "".join(_CALL) not in calls or (
            coef is not None and f"loss+=self.{coef}*aux_loss" not in calls):
        return (f"{type(model).__name__}'s router auxiliary loss is not the one ringattn makes "
                f"global (Mixtral's load_balancing_loss_func on the router logits)")
    for attr in ("num_experts", "num_experts_per_tok"):
        if not isinstance(getattr(model, attr, None), (int, float)):
            return f"{type(model).__name__} has no {attr}"
    if coef is None:
        return f"{type(model).__name__} has no router_aux_loss_coef"
    return None


def _router_hook(model, args, kwargs, output):
    """Forward hook: the global router loss in place of this rank's."""
    ctx = kwargs.get("ring_context")
    aux = getattr(output, "aux_loss", None)
    if ctx is None or aux is None or not isinstance(aux, torch.Tensor):
        return None  # one process, or no router loss asked for: transformers' value
    logits = getattr(output, "router_logits", None)
    ids = kwargs.get("input_ids", args[0] if args else None)
    shape = ids.shape if ids is not None else kwargs["inputs_embeds"].shape[:2]
    real = _local_real(ctx, shape[0], aux.device)
    world = dist.get_world_size(ctx.group)
    glob = _global_router_loss(logits, model.num_experts, model.num_experts_per_tok, real,
                               ctx.group)
    coef = getattr(model, _router_coef(model))
    if output.loss is not None:  # this rank's value out, its 1/W share of the global one in
        output.loss = output.loss - coef * aux.to(output.loss.device) + (coef / world) * glob
    output.aux_loss = glob
    return output


def _temperature_pre_hook(module, args, kwargs):
    """Llama 4 NoPE attention: the per-token query scale, from global positions."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    ctx = kwargs.get("ring_context")
    if ctx is not None:
        pos = _local_positions(ctx).to(hidden.device)
    else:  # as transformers counts: after the cached tokens
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        seen = cache.get_seq_length(module.layer_idx) if cache is not None else 0
        pos = torch.arange(hidden.shape[1], device=hidden.device) + seen
    scale = torch.log1p(torch.floor((pos.float() + 1.0) / module.floor_scale))
    module.q_proj._ring_query_scale = scale * module.attn_scale + 1.0
    return None


def _temperature_q_hook(q_proj, args, output):
    scale = q_proj.__dict__.pop("_ring_query_scale", None)
    if scale is None:
        raise ValueError("a converted Llama 4 q_proj ran outside its attention module")
    return (output * scale.view(1, -1, 1)).to(output.dtype)


def _convert_temperature(model) -> int:
    """Move Llama 4's query temperature to global positions; the number of layers."""
    done = 0
    for module in model.modules():
        if (getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True)
                and hasattr(module, "q_proj") and hasattr(module, "floor_scale")):
            module.attn_temperature_tuning = False  # transformers' local-position scaling off
            module.register_forward_pre_hook(_temperature_pre_hook, with_kwargs=True)
            module.q_proj.register_forward_hook(_temperature_q_hook)
            done += 1
    return done


_ALIBI = frozenset({"bloom", "mpt"})
"""Families whose attention modules (ALiBi, computed in the module) ``convert`` replaces."""
BUILT_EAGER = frozenset({"gpt_neo", "falcon"})
"""Families whose constructor looks its attention class up by attn_implementation in a dict
of its own (a bare KeyError for "ringattn"): built with "eager", then converted (``convert``
replaces the attention modules and sets the config's attention implementation)."""
_OWN_ATTENTION = frozenset({"xglm", "gpt_neo", "falcon", "gpt_neox_japanese", "openai-gpt"})
_INTERFACE = frozenset({"biogpt"})
"""Families whose attention calls the attention interface with the batch's keyword
arguments although their class does not declare it (``is_backend_compatible()`` False):
``convert`` only records that they were checked."""
"""Families whose attention modules compute plain softmax attention themselves (no
positional term inside): ``convert`` replaces them by ring attention."""
_RELAY = {"stablelm": "StableLmAttention", "nemotron": "NemotronAttention"}
"""Families whose attention calls the attention interface with its keyword arguments but
whose decoder layer does not pass the batch's on: ``convert`` hands the ring_context to
these attention classes."""


def convertible(model_type) -> bool:
    """Whether ``convert`` replaces the attention of this family (which computes attention
    itself: ``check_model`` on its class accepts it, on an unconverted model refuses it)."""
    return (model_type in _ALIBI or model_type in _RELAY or model_type in _OWN_ATTENTION
            or model_type in _INTERFACE)


def _ring_context(module):
    ctx = bound_context(module)
    if ctx is MISSING:
        raise missing_error(module)
    if ctx is None:
        raise ValueError(
            f"{type(module).__name__} (converted by ringattn's convert) needs the batch's "
            f"ring_context: call the model with the dict from prepare_batch / shard_batch")
    return ctx


def _alibi_attention(module, q, k, v, attention_mask, scale, slopes, dropout):
    """Ring attention of [B, L, H, D] q, k, v with ALiBi ``slopes`` (flash-attn's
    ``-slope * |i - j|`` in global positions: under the causal mask it differs from the
    models' key-position bias by a constant per query, which softmax ignores)."""
    from ..strategies.auto import attention
    from ..validate import caller_error
    from .transformers import ModelMask, _ring_arguments

    ctx = _ring_context(module)
    error = None
    try:  # this rank's refusals travel in the attention's agreement (every rank raises)
        if dropout and module.training:
            raise ValueError(f"ring attention has no attention dropout, got {dropout}")
        if attention_mask is not None and not isinstance(attention_mask, ModelMask):
            raise TypeError(f"{type(module).__name__} got a dense attention mask; padding "
                            f"goes through ringattn.shard_batch")
        causal, window, mask = _ring_arguments(module, attention_mask, None, True, ctx)
        if not causal or window != (-1, -1) or mask is not None:
            raise ValueError(f"{type(module).__name__} asked for a {attention_mask.kind} mask; "
                             f"ALiBi attention runs causal")
    except (TypeError, ValueError) as exc:
        error = exc
    with caller_error(error):
        out = attention(q, k, v, strategy=ctx.strategy, causal=True, softmax_scale=scale,
                        alibi_slopes=slopes, **ctx.attention_kwargs())
    ctx.record_call()
    return out


def _bloom_slopes(num_heads: int) -> list[float]:
    from transformers.models.bloom.modeling_bloom import build_alibi_tensor

    bias = build_alibi_tensor(torch.ones(1, 2), num_heads, torch.float32)  # [H, 1, 2]
    return [float(x) for x in bias[:, 0, 1] - bias[:, 0, 0]]


def _mpt_slopes(num_heads: int) -> list[float]:
    from transformers.models.mpt.modeling_mpt import build_mpt_alibi_tensor

    bias = build_mpt_alibi_tensor(num_heads, 2)  # [H, 1, 2]: the bias of keys 0 and 1
    return [float(x) for x in bias[:, 0, 1] - bias[:, 0, 0]]


def _ring_bloom_attention(base):
    class RingBloomAttention(base):
        """BLOOM's attention over the ring: its own fused projection, ALiBi slopes and
        output projection, ring attention in between."""

        def forward(self, hidden_states, residual, alibi, attention_mask, layer_past=None,
                    use_cache=False, output_attentions=False, **kwargs):
            from transformers.models.bloom.modeling_bloom import dropout_add

            if output_attentions:
                raise TypeError("ring attention returns no attention weights")
            b, length, _ = hidden_states.shape
            q, k, v = self._reshape(self.query_key_value(hidden_states))  # [B, H, L, D]
            if layer_past is not None:
                k, v = layer_past.update(k, v, self.layer_idx)
            out = _alibi_attention(self, q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                   attention_mask, self.inv_norm_factor, self._ring_slopes,
                                   self.attention_dropout.p)
            out = self.dense(out.reshape(b, length, -1))
            return dropout_add(out, residual, self.hidden_dropout, self.training), None

    return RingBloomAttention


def _ring_mpt_attention(base):
    class RingMptAttention(base):
        """MPT's attention over the ring: its own projections, ``clip_qkv``, scale and
        ALiBi slopes, ring attention in between."""

        def forward(self, hidden_states, position_bias=None, cache=None, attention_mask=None,
                    **kwargs):
            b, length = hidden_states.shape[:2]
            qkv = self.Wqkv(hidden_states)
            if self.clip_qkv:
                qkv = qkv.clamp(min=-self.clip_qkv, max=self.clip_qkv)
            q, k, v = (t.reshape(b, length, self.n_heads, self.head_dim) for t in qkv.chunk(3, 2))
            if cache is not None:
                k, v = (t.transpose(1, 2) for t in cache.update(
                    k.transpose(1, 2), v.transpose(1, 2), self.layer_idx))
            out = _alibi_attention(self, q, k, v, attention_mask, self.softmax_scale,
                                   self._ring_slopes, self.attn_dropout_p)
            return self.out_proj(out.reshape(b, length, -1)), None

    return RingMptAttention


def _ring_xglm_attention(base):
    class RingXGLMAttention(base):
        """XGLM's self-attention over the ring: its own projections (queries pre-scaled),
        ring attention through the registered attention function."""

        def forward(self, hidden_states, key_value_states=None, cache=None,
                    attention_mask=None, **kwargs):
            from .transformers import ring_attention_forward

            if key_value_states is not None:
                raise TypeError("ring attention runs XGLM's self-attention, not cross-attention")
            b, length, _ = hidden_states.shape
            q, k, v = ((proj(hidden_states) * scale).view(b, length, -1, self.head_dim)
                       .transpose(1, 2) for proj, scale in
                       ((self.q_proj, self.scaling), (self.k_proj, 1.0), (self.v_proj, 1.0)))
            if cache is not None:
                k, v = cache.update(k, v, self.layer_idx)
            out, _ = ring_attention_forward(
                self, q, k, v, attention_mask, dropout=self.dropout if self.training else 0.0,
                scaling=1.0, **kwargs)
            return self.out_proj(out.reshape(b, length, -1)), None

    return RingXGLMAttention


def _ring_gpt_neo_attention(base):
    class RingGPTNeoSelfAttention(base):
        """GPT-Neo's self-attention over the ring: its own projections, no score scaling,
        its local layers' window (keys q - window_size < k <= q) as the sliding window."""

        def forward(self, hidden_states, attention_mask=None, layer_past=None, use_cache=False,
                    output_attentions=False, **kwargs):
            from .transformers import ring_attention_forward

            b, length, _ = hidden_states.shape
            q, k, v = (self._split_heads(proj(hidden_states), self.num_heads, self.head_dim)
                       for proj in (self.q_proj, self.k_proj, self.v_proj))
            if layer_past is not None:
                k, v = layer_past.update(k, v, self.layer_id)
            window = self.config.window_size if self.attention_type == "local" else None
            out, _ = ring_attention_forward(
                self, q, k, v, attention_mask,
                dropout=self.attn_dropout.p if self.training else 0.0, scaling=1.0,
                sliding_window=window, output_attentions=output_attentions,
                ring_context=_ring_context(self))
            out = self.out_proj(out.reshape(b, length, -1))
            return self.resid_dropout(out), None

    return RingGPTNeoSelfAttention


def _ring_falcon_attention(base):
    class RingFalconAttention(base):
        """Falcon's rotary self-attention over the ring: its own fused projection, head
        split and rotary embedding, ring attention through the registered function."""

        def forward(self, hidden_states, alibi, attention_mask, position_ids=None,
                    layer_past=None, use_cache=False, output_attentions=False,
                    position_embeddings=None, **kwargs):
            from transformers.models.falcon.modeling_falcon import apply_rotary_pos_emb

            from .transformers import ring_attention_forward

            b, length, _ = hidden_states.shape
            kv_heads = self.num_heads if self.new_decoder_architecture else self.num_kv_heads
            q, k, v = self._split_heads(self.query_key_value(hidden_states))  # [B, L, h, D]
            q, k, v = (t.transpose(1, 2).reshape(b, heads, length, self.head_dim) for t, heads in
                       ((q, self.num_heads), (k, kv_heads), (v, kv_heads)))
            cos, sin = position_embeddings
            q, k = apply_rotary_pos_emb(q, k, cos, sin)
            if layer_past is not None:
                k, v = layer_past.update(k, v, self.layer_idx)
            out, _ = ring_attention_forward(
                self, q, k, v, attention_mask, scaling=self.inv_norm_factor,
                output_attentions=output_attentions, ring_context=_ring_context(self))
            return self.dense(out.reshape(b, length, -1)), None

    return RingFalconAttention


def _ring_gpt_neox_japanese_attention(base):
    class RingGPTNeoXJapaneseAttention(base):
        """GPT-NeoX-Japanese's attention over the ring: its own fused projection, rotary
        embedding and output projection (its layer adds the bias), ring attention in between."""

        def _attn(self, query, key, value, attention_mask=None):
            from .transformers import ring_attention_forward

            out, _ = ring_attention_forward(  # [B, L, H, D]; the caller merges [B, H, L, D]
                self, query, key, value, attention_mask,
                dropout=self.attention_dropout.p if self.training else 0.0,
                scaling=1.0 / self.norm_factor, ring_context=_ring_context(self))
            return out.transpose(1, 2), None

    return RingGPTNeoXJapaneseAttention


def _ring_openai_gpt_attention(base):
    class RingOpenAIGPTAttention(base):
        """OpenAI GPT's attention over the ring: its own fused projection and output
        projection, scores scaled by 1/sqrt(D) where the block says so, causal (its mask
        buffer), ring attention in between."""

        def _attn(self, q, k, v, attention_mask=None, output_attentions=False):
            from .transformers import ring_attention_forward

            if output_attentions:
                raise TypeError("ring attention returns no attention weights "
                                "(output_attentions=True)")
            out, _ = ring_attention_forward(  # k arrives [B, H, D, L]; out [B, L, H, D]
                self, q, k.transpose(-1, -2), v, attention_mask, is_causal=True,
                dropout=self.attn_dropout.p if self.training else 0.0,
                scaling=v.shape[-1] ** -0.5 if self.scale else 1.0,
                ring_context=_ring_context(self))
            return [out.transpose(1, 2)]

    return RingOpenAIGPTAttention


def _convert_own_attention(model) -> None:
    """Replace XGLM's, GPT-Neo's, Falcon's, GPT-NeoX-Japanese's or OpenAI GPT's attention
    modules by ring attention."""
    from .transformers import NAME

    if model.config.model_type == "falcon":
        from transformers.models.falcon.modeling_falcon import FalconAttention as base

        if model.config.alibi:
            raise ValueError("ringattn converts Falcon with rotary embeddings, not with ALiBi "
                             "(config.alibi=True: its bias is rounded to bfloat16)")
        cls = _ring_falcon_attention(base)
    elif model.config.model_type == "xglm":
        from transformers.models.xglm.modeling_xglm import XGLMAttention as base

        cls = _ring_xglm_attention(base)
    elif model.config.model_type == "openai-gpt":
        from transformers.models.openai.modeling_openai import Attention as base

        cls = _ring_openai_gpt_attention(base)
    elif model.config.model_type == "gpt_neox_japanese":
        from transformers.models.gpt_neox_japanese.modeling_gpt_neox_japanese import (
            GPTNeoXJapaneseAttention as base)

        cls = _ring_gpt_neox_japanese_attention(base)
    else:
        from transformers.models.gpt_neo.modeling_gpt_neo import GPTNeoSelfAttention as base

        cls = _ring_gpt_neo_attention(base)
    found = tuple(m for m in model.modules() if type(m) is base)
    if not found:
        raise ValueError(f"{type(model).__name__} has no {base.__name__} to convert")
    for module in found:
        module.__class__ = cls
    if model.config.model_type != "xglm":  # their blocks do not pass keyword arguments
        bind_context(model, found)
    if model.config.model_type in BUILT_EAGER:
        model.config._attn_implementation = NAME  # the mask function, check_attention


def _relay_pre_hook(module, args, kwargs):
    """The ring_context the model was called with, for an attention module whose decoder
    layer dropped it."""
    if kwargs.get("ring_context") is None:
        ctx = bound_context(module)
        if ctx is MISSING:
            raise missing_error(module)
        kwargs = {**kwargs, "ring_context": ctx}
    return args, kwargs


def _convert_relay(model) -> None:
    """Pass the batch's ring_context to the attention modules of a ``_RELAY`` family."""
    name = _RELAY[model.config.model_type]
    found = tuple(m for m in model.modules() if type(m).__name__ == name)
    if not found:
        raise ValueError(f"{type(model).__name__} has no {name} to convert")
    for module in found:
        module.register_forward_pre_hook(_relay_pre_hook, with_kwargs=True)
    bind_context(model, found)


def _convert_alibi(model) -> None:
    """Replace BLOOM's / MPT's attention modules by ring attention with their ALiBi."""
    family = model.config.model_type
    if family == "bloom":
        from transformers.models.bloom.modeling_bloom import BloomAttention as base

        make, slopes = _ring_bloom_attention, _bloom_slopes(model.config.n_head)
    else:
        from transformers.models.mpt.modeling_mpt import MptAttention as base

        make, slopes = _ring_mpt_attention, _mpt_slopes(model.config.n_heads)
    cls = make(base)
    found = []
    for module in model.modules():
        if type(module) is base:
            module.__class__ = cls
            module._ring_slopes = slopes
            found.append(module)
    if not found:
        raise ValueError(f"{type(model).__name__} has no {base.__name__} to convert")
    bind_context(model, found)


def convert(model):
    """Make ``model`` exact under ring attention where registering it is not enough.

    Arguments:
        model: a transformers model (built with attn_implementation="ringattn").

    Returns:
        ``model`` itself, with hooks on its own modules: a global router auxiliary loss
        (MoE families with ``output_router_logits``), Llama 4's query temperature from
        global positions; ring attention inside the attention modules of families that
        compute attention themselves; and, for hybrid families (``hybrid.CONVERTIBLE``),
        their sequence mixers across ranks (``convert_mixers``). A model that needs none of
        these comes back unchanged. Converting twice is a no-op.

    Raises:
        ValueError: ``check_model`` refuses the model for something else (a family that
            computes attention itself, non-attention sequence layers), or its router loss
            is not one ``convert`` knows.
    """
    from .transformers import _computes_attention_itself, _config_problem, check_model

    from .hybrid import CONVERTIBLE, convert_mixers

    config = getattr(model, "config", None)
    if config is None or not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert takes a transformers model, got {type(model).__name__}")
    if converted(model):
        return model
    if getattr(model, "_ringattn_context_parallel", False):
        raise ValueError(f"convert {type(model).__name__} before entering context_parallel: "
                         f"the manager's hooks must see the converted model's")
    if getattr(config, "model_type", None) in CONVERTIBLE:  # hybrid: its sequence mixers
        convert_mixers(model)
    record(model)  # the model, on its own modules, for functions that see only those
    problem = _config_problem(config, router=False, model=model)  # what convert leaves
    if problem is not None:
        raise ValueError(f"ring attention cannot run {type(model).__name__} exactly: {problem}")
    own = hasattr(model, "is_backend_compatible") and not model.is_backend_compatible()
    family = getattr(config, "model_type", None)
    # hybrids whose classes say so still call the interface (test_hybrid_families.py)
    if own and not convertible(family) and family not in CONVERTIBLE:
        raise ValueError(_computes_attention_itself(type(model).__name__, config))
    asked = bool(getattr(config, "output_router_logits", False))
    problem = (_router_loss_problem(model) if _router_coef(model) is not None
               else f"{type(model).__name__} has no router_aux_loss_coef")
    if asked and problem is not None:
        raise ValueError(f"ringattn cannot make this router loss global: {problem}")
    if problem is None:  # also serves output_router_logits=True passed to forward later
        model.register_forward_hook(_router_hook, with_kwargs=True)
    _convert_temperature(model)
    if family in _ALIBI:
        _convert_alibi(model)
    elif family in _RELAY:
        _convert_relay(model)
    elif family in _OWN_ATTENTION:
        _convert_own_attention(model)
    record(model, converted=True)
    check_model(model)
    return model


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
