"""Score biases computed by the attention module: Inkling's per-query relative position
bias (Inkling, Inkling2 and Inkling2-Loop, the latter two with a sink logit per query) and
Doge's learned per-key bias (its "dynamic mask").

``convert`` swaps those attention module instances' class for a subclass that keeps their
projections and, under a ring context, hands ring attention the bias as data:

* Inkling: each query's bias row over distances 0 .. rel_extent-1 (its relative states
  times the bank of profiles, [B, L, H, E], local to the query's rank) and, for Inkling2,
  its sink logits ([B, H, L]), through ``ringattn.score_bias`` (the ring's reference
  kernel adds ``row[i - j]`` to each score from the block's global positions). Inkling's
  logarithmic query scaling (``log_scaling_n_floor``) counts global positions (inside
  the packed document). Inkling2's depth attentions (block and message attention
  residuals: per-token attention over the layer outputs, no sequence involved) run their
  eager form on this rank's tokens. Their short convolutions are ``mixers/inkling.py``'s.
* Doge: ``b_j = exp(A * softplus(dt_proj(v_j)))`` per key and kv head is added to every
  visible score as one more head-dim channel, ``scale * [q, 1/scale] . [k, b] = scale *
  q.k + b`` (values unchanged), so any strategy and kernel computes it and the gradient of
  ``b`` is that channel's key gradient. Doge keeps, per (batch, kv head, query), the top
  ``keep_window_size`` entries of ``b`` + its mask when the key length exceeds it (the
  rest masked): when a row can see more keys than that (the sequence, or its longest
  document, is longer), every rank all-gathers ``b`` ([B, Hkv, S], one float per key and
  kv head), runs Doge's own ``prepare_dynamic_mask`` (its ``torch.topk``) on each local
  query's one-process row, and hands the kept keys to the ring as a per-head key mask:
  the DSA indexers' mechanism (``families/indexer.py``: ``Selection`` with a head per kv
  head, ``gather_sequence``, ``row_chunks``), so ties break as in one process. That runs
  with strategy 'ring' on a 1-D group only (each rank holds its own queries' selection);
  another strategy is refused on every rank.

Without a ring context the modules are transformers' own.
"""

from __future__ import annotations

import torch

from ....comm import resolve_group
from ....layouts import local_positions
from ....masks import and_keys
from ....score_bias import ring_attention_with_bias
from ....validate import caller_error
from ..attention import ModelMask, _ring_arguments, ring_attention_forward
from ..checks import NOT_ATTENTION_KWARGS, register_attention
from ..state import SwapMixin, layer_context, swap_class
from .indexer import (
    _dtype_code,
    agreed_token,
    attach_selection,
    check_selection,
    crc,
    gather_sequence,
    refuse_cache,
    row_chunks,
)
from .router import _local_positions

__all__ = ["convert_score_bias"]

FAMILIES = ("inkling_text", "inkling2_text", "inkling2_loop_text", "doge")
register_attention("score bias", FAMILIES)

_INKLING2 = ("inkling2_text", "inkling2_loop_text")


def _biased_attention(module, q, k, v, attention_mask, scale, sliding_window, table, extent,
                      sinks, ctx, kwargs):
    """Ring attention of [B, H, L, D] q, k, v with the per-query relative bias ``table``
    [B, L, H, E] and per-query ``sinks`` [B, H, L] or None: [B, L, H, Dv]."""
    error = None
    try:  # this rank's refusals travel in the attention's agreement (every rank raises)
        unknown = sorted(n for n, x in kwargs.items() if x is not None and x is not False
                         and n not in NOT_ATTENTION_KWARGS | {"ring_context", "seq_idx"})
        if unknown:
            raise TypeError(f"ring attention does not implement the attention argument(s) "
                            f"{unknown} that {type(module).__name__} passes")
        if module.training and getattr(module, "attention_dropout", 0.0):
            raise ValueError(f"ring attention has no attention dropout, got "
                             f"{module.attention_dropout}")
        if ctx.strategy != "ring" or ctx.mesh is not None:
            raise ValueError(f"{type(module).__name__}'s per-query score bias runs on the ring "
                             f"strategy only, not {ctx.strategy!r} (shard the batch with "
                             f"strategy='ring')")
        if attention_mask is not None and not isinstance(attention_mask, ModelMask):
            raise TypeError(f"{type(module).__name__} got a dense attention mask; padding "
                            f"goes through ringattn.shard_batch")
        causal, window, mask = _ring_arguments(module, attention_mask, sliding_window, True, ctx)
    except (TypeError, ValueError) as exc:
        error, causal, window, mask = exc, True, (-1, -1), None
    kw = ctx.attention_kwargs()
    if mask is not None:
        kw["mask"] = and_keys(kw["mask"], mask)
    with caller_error(error):
        out = ring_attention_with_bias(
            q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), table, rel_extent=extent,
            query_sinks=sinks, causal=causal, window_size=window, softmax_scale=scale, **kw)
    ctx.record_call()
    return out


class _InklingAttention(SwapMixin):
    """Inkling's attention over the ring: its projections, short convolutions, q/k norms
    and relative logits, the bias handed to ring attention per query."""

    def forward(self, hidden_states, attention_mask, conv_mask=None, cache=None, **kwargs):
        ctx = layer_context(self, kwargs)
        if ctx is None:
            return super().forward(hidden_states, attention_mask, conv_mask=conv_mask,
                                   cache=cache, **kwargs)
        refuse_cache(self, cache)
        shape = hidden_states.shape[:-1]
        hidden_shape = (*shape, -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        k = self.k_sconv(self.k_proj(hidden_states), conv_mask=conv_mask)
        v = self.v_sconv(self.v_proj(hidden_states), conv_mask=conv_mask)
        k = self.k_norm(k.view(hidden_shape)).transpose(1, 2)
        v = v.view(hidden_shape).transpose(1, 2)
        relative = self.r_proj(hidden_states).view(*shape, self.num_heads, -1)
        table = relative @ self.rel_logits_proj.proj  # [B, L, H, E]
        if not self.is_sliding and self.config.log_scaling_n_floor is not None:
            pos = _local_positions(ctx) if ctx.cu_seqlens is None else _in_document(ctx)
            effective = (pos.to(hidden_states.device) + 1).float()
            tau = 1.0 + self.config.log_scaling_alpha * torch.log(
                (effective / self.config.log_scaling_n_floor).clamp(min=1.0))
            q = (q.float() * tau.view(1, 1, -1, 1)).to(q.dtype)
            table = (table.float() * tau.view(1, -1, 1, 1)).to(table.dtype)
        out = _biased_attention(self, q, k, v, attention_mask, self.scaling,
                                self.sliding_window, table, self.rel_extent, None, ctx,
                                kwargs)
        return self.o_proj(out.reshape(*shape, -1).contiguous()), None



def _in_document(ctx) -> torch.Tensor:
    """[L] each local slot's position inside its packed document (0 on padding slots)."""
    from ....sharding import positions

    return positions(ctx.seqlen, group=ctx.group, layout=ctx.layout, cu_seqlens=ctx.cu_seqlens)[1]


class _Inkling2Attention(SwapMixin):
    """Inkling2's sliding or full attention over the ring: its projections (dynamic
    convolutions, clips, log scaling by position ids), relative bias and sink logits
    per query, handed to ring attention."""

    def forward(self, hidden_states, *args, **kwargs):
        ctx = layer_context(self, kwargs)
        if ctx is None or args:
            return super().forward(hidden_states, *args, **kwargs)
        refuse_cache(self, kwargs.pop("cache", None))
        key_states_in = kwargs.pop("key_hidden_states", None)
        value_states_in = kwargs.pop("value_hidden_states", None)
        key_states_in = hidden_states if key_states_in is None else key_states_in
        value_states_in = hidden_states if value_states_in is None else value_states_in
        attention_mask = kwargs.pop("attention_mask", None)
        kwargs.pop("relative_distance", None)  # local slots: the ring uses global ones
        conv_mask = kwargs.pop("conv_mask", None)
        offset = kwargs.pop("cache_offset", 0)
        position_ids = kwargs["position_ids"]
        shape = hidden_states.shape[:-1]
        q = self.q_proj(hidden_states, position_ids)
        k = self.k_proj(key_states_in, conv_mask=conv_mask, cache_offset=offset, **kwargs)
        v = self.v_proj(value_states_in, conv_mask=conv_mask, cache_offset=offset, **kwargs)
        bias = self.relative_position_bias
        relative = bias.linear(hidden_states).view(*shape, bias.num_heads, -1)
        table = bias.norm(relative, position_ids) @ bias.proj  # [B, L, H, E]
        sinks = self.sink_proj(hidden_states).transpose(1, 2)  # [B, H, L]
        out = _biased_attention(self, q, k, v, attention_mask, self.scaling,
                                self.sliding_window, table, bias.rel_extent, sinks, ctx,
                                kwargs)
        return self.o_proj(out.reshape(*shape, -1).contiguous(), hidden_states), None



class _EagerConfig:
    """A module's view of its model's config that names eager attention: Inkling2's depth
    attentions (over each token's layer outputs, not over the sequence) run their own eager
    function on this rank's tokens whatever the model's attention implementation."""

    _attn_implementation = "eager"

    def __init__(self, config):
        self.__dict__["_config"] = config

    def __getattr__(self, name):
        if "_config" not in self.__dict__:  # an empty copy that pickle or deepcopy fills
            raise AttributeError(name)
        return getattr(self.__dict__["_config"], name)


class _DogeAttention(SwapMixin):
    """Doge's attention over the ring: its projections, rotary embedding and dynamic
    mask, the mask's per-key bias carried as one more head-dim channel."""

    def forward(self, hidden_states, position_embeddings, attention_mask=None, cache=None,
                **kwargs):
        from transformers.models.doge.modeling_doge import apply_rotary_pos_emb

        ctx = layer_context(self, kwargs)
        if ctx is None:
            return super().forward(hidden_states, position_embeddings, attention_mask,
                                   cache=cache, **kwargs)
        refuse_cache(self, cache)
        shape = hidden_states.shape[:-1]
        hidden_shape = (*shape, -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        dt = self.dt_proj(v.transpose(1, 2).reshape(*shape, -1))
        bias = torch.exp(self.A * torch.nn.functional.softplus(dt)).transpose(-1, -2)
        longest = (max(b - a for a, b in zip(ctx.cu_seqlens[:-1], ctx.cu_seqlens[1:]))
                   if ctx.cu_seqlens is not None else ctx.seqlen)
        if longest > self.keep_window_size:  # the same global values on every rank
            kwargs["indices"] = _doge_selection(self, hidden_states, bias, attention_mask,
                                                ctx)
        # scale * [q, 1/scale] . [k, b] = scale * q.k + b: the bias as a head-dim channel
        q = torch.cat([q, q.new_full((*q.shape[:-1], 1), 1.0 / self.scaling)], dim=-1)
        k = torch.cat([k, bias.unsqueeze(-1).to(k.dtype)], dim=-1)
        out, _ = ring_attention_forward(
            self, q, k, v, attention_mask,
            dropout=self.attention_dropout if self.training else 0.0,
            scaling=self.scaling, **kwargs)
        return self.o_proj(out.reshape(*shape, -1).contiguous()), None



@torch.no_grad()
def _doge_selection(module, hidden, bias, attention_mask, ctx) -> torch.Tensor:
    """[B, Hkv, L, keep_window_size] global key positions Doge keeps for this rank's query
    slots (-1: none; the ``Selection`` attached, per kv head): its own
    ``prepare_dynamic_mask`` on each query's one-process row (the per-key bias ``bias``
    [B, Hkv, L] of every rank, gathered, masked as one process masks it), so the same
    ``torch.topk`` selection, ties included. Every rank of the group calls it together."""
    pg = resolve_group(ctx.group)
    world, rank = torch.distributed.get_world_size(pg), torch.distributed.get_rank(pg)
    b, n = hidden.shape[:2]
    seqlen, keep = ctx.seqlen, int(module.keep_window_size)
    error, fields, mask, lay = None, {}, None, None
    try:
        lay, mask = check_selection(module, f"doge's top keep_window_size={keep} keys per "
                                    f"query", attention_mask, ctx, n, world)
        fields = {"batch": b, "local_len": n, "seqlen": seqlen, "keep_window_size": keep,
                  "key_dim": bias.shape[1], "dtype": _dtype_code(hidden.dtype),
                  "layout": crc(lay), "mask": crc(mask.key())}
    except (TypeError, ValueError) as exc:
        error = exc
    token = agreed_token(pg, fields, error, what="doge's top-k keys")  # the same error everywhere
    every = gather_sequence(bias.detach(), 2, pg, lay, world, seqlen,
                            "all-gather of doge's key bias")  # [B, Hkv, S]
    pos = local_positions(lay, rank, world, seqlen).to(hidden.device)
    slots = torch.arange(seqlen, device=hidden.device)
    lowest = torch.finfo(hidden.dtype).min
    picked = []
    for a, z, rows in row_chunks(mask, seqlen, pos, b, 4 * b * every.shape[1]):
        scored = module.prepare_dynamic_mask(hidden_states=hidden[:, a:z], dt_states=every,
                                             keep_window_size=keep,
                                             attention_mask=rows.unsqueeze(1))
        kept = torch.where(scored != lowest, slots, -1)  # [B, Hkv, z - a, S]
        picked.append(kept.topk(keep, dim=-1).values)
    return attach_selection(torch.cat(picked, dim=2), token, pos, seqlen,
                            group=module.num_key_value_groups)


def _bases(family: str):
    """(transformers' attention classes to convert, depth-attention class names)."""
    if family == "doge":
        from transformers.models.doge.modeling_doge import DogeAttention

        return {DogeAttention: _DogeAttention}, ()
    if family == "inkling_text":
        from transformers.models.inkling.modeling_inkling import InklingAttention

        return {InklingAttention: _InklingAttention}, ()
    if family == "inkling2_text":
        from transformers.models.inkling2 import modeling_inkling2 as m

        return ({m.Inkling2SlidingAttention: _Inkling2Attention,
                 m.Inkling2FullAttention: _Inkling2Attention},
                ("Inkling2BlockAttentionResidual",))
    from transformers.models.inkling2_loop import modeling_inkling2_loop as m

    return ({m.Inkling2LoopSlidingAttention: _Inkling2Attention,
             m.Inkling2LoopFullAttention: _Inkling2Attention},
            ("Inkling2LoopBlockAttentionResidual", "Inkling2LoopMessageAttentionResidual"))


def convert_score_bias(model) -> None:
    """Replace the attention modules of an Inkling or Doge model by ring attention with
    their score biases; Inkling2's depth attentions run eagerly on this rank's tokens."""
    family = model.config.model_type
    bases, depth = _bases(family)
    found = []
    for module in model.modules():
        mixin = bases.get(type(module))
        if mixin is not None:
            module.__class__ = swap_class(mixin, type(module))
            found.append(module)
        elif type(module).__name__ in depth and not isinstance(module.config, _EagerConfig):
            module.config = _EagerConfig(module.config)
    if not found:
        raise ValueError(f"{type(model).__name__} has no attention module of {family} to convert")


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
