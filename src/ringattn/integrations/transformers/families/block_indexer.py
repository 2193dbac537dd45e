"""Block-sparse indexed attention: each query attends only to the blocks of keys an indexer
scores highest over its causal prefix (Qwen4-Exp's ``indexed_attention`` layers, whose QSA
indexer pools each block of ``indexer_compress_ratio`` visible keys into one key;
MiniMax-M3's ``minimax_m3_sparse`` layers, whose lightning indexer max-pools token scores
over blocks of ``index_block_size`` slots and forces the ``index_local_blocks`` blocks at
and before each query's own).

transformers' indexers score each query against the whole sequence and keep the top blocks
with ``torch.topk``, whose tie rule is its own algorithm's (it depends on the whole score
row). ``convert`` swaps the class of each indexed attention module for a subclass that, under
a ring context:

1. agrees once with every rank on the call (shapes, layout, block size, top k; refusals
   such as a cache, a strategy other than the ring, a packed MiniMax row, or
   left padding a later MiniMax layer would score: the same ValueError on every rank,
   before any tensor travels) and on a selection number;
2. all-gathers the indexer's keys of every rank (one head of ``index_head_dim``, detached:
   the selection has no gradient in transformers either; Qwen4-Exp's also with the RoPE
   rows its block keys take) and puts them in global order. The block summaries are cheap,
   but a block straddles shards under any layout, and pooling it from the gathered keys is
   the same arithmetic as one process's: gathering the small keys is simpler than ringing
   partial pools, and exact;
3. runs the indexer's own forward on this rank's queries, in chunks, against the global
   keys (handed over by the cache hook it calls, ``update_indexer`` / ``update_index``) and,
   for Qwen4-Exp, the one-process mask rows of those queries (causal, padding, documents):
   the same score rows and the same ``torch.topk`` calls, so the same selection, ties
   included. Block boundaries are therefore transformers' own: global slots for MiniMax
   (``position_ids // index_block_size``), every ``compress_ratio`` visible keys of a row's
   document for Qwen4-Exp (they move with left padding and restart in each document);
4. turns the selection into the DSA indexers' value-keyed ``Mask`` (``indexer.Selection``
   with each key's block as its unit: for each local query row, the sorted list of key
   blocks it sees, per key/value head for MiniMax) that is and-ed with the batch's mask,
   so the ring runs its one loop, forward and backward, over exactly the selected blocks
   (blocks nobody selected are skipped by its plan).

A real query that would see no key at all (one process's eager attention then averages
every value of the row: undefined) is refused on every rank.

Without a ring context (one process) the modules are transformers' own.
"""

from __future__ import annotations

import torch

from ....comm import resolve_group
from ....layouts import get_layout, local_positions
from ....masks import Mask, and_keys, causal, document, evaluate, mask_key
from ....strategies.auto import attention
from ....validate import caller_error
from ..attention import _check_call
from ..checks import register_attention
from ..state import (SwapMixin, bind_context, bound_call, current_call, hook_restore_padding,
                     layer_context, owner, swap_class)
from .indexer import (IndexerKeys, Selection, agreed_token, crc, gather_sequence, own_keys,
                      refuse_cache, ring_only, unit_lists)

__all__ = ["convert_block_indexer"]

LAYER_TYPES = {"qwen4_exp_text": ("indexed_attention",),
               "minimax_m3_vl_text": ("minimax_m3_sparse",)}
"""The families this file converts -> their indexed (block-sparse) attention layer types."""
register_attention("block indexer", tuple(LAYER_TYPES), layer_types=LAYER_TYPES)

SCORE_ELEMENTS = 1 << 24
"""Score (or mask) elements one chunk of queries may hold at a time ([B, heads, chunk, S])."""



def _base_mask(ctx) -> Mask:
    """What one process's mask is for these layers, in global positions: causal, the
    batch's padding, its documents."""
    mask = causal()
    for part in (ctx.mask, None if ctx.cu_seqlens is None else document(ctx.cu_seqlens)):
        if part is not None:
            mask = mask & part
    return mask


def _real_keys(ctx, batch: int, device) -> torch.Tensor:
    """[B, S] bool: the keys of each row that are not padding."""
    keys = torch.arange(ctx.seqlen, device=device)
    if ctx.mask is None:
        return torch.ones(batch, ctx.seqlen, dtype=torch.bool, device=device)
    seen = evaluate(ctx.mask, ctx.seqlen, torch.zeros(1, dtype=torch.long, device=device), keys,
                    batch, 1)
    return seen[:, 0, 0, :].expand(batch, -1).contiguous()


def _qwen4_blocks(ctx, batch: int, ratio: int, device) -> torch.Tensor:
    """[B, S] the block of each key as Qwen4-Exp's indexer forms them: every ``ratio``
    visible keys of a row's document, counted from its first real key (-1: padding)."""
    s = ctx.seqlen
    real = _real_keys(ctx, batch, device)
    cu = ctx.cu_seqlens or (0, s)
    starts = torch.tensor(cu[:-1], device=device)
    doc = torch.searchsorted(starts, torch.arange(s, device=device), right=True) - 1
    count = real.long().cumsum(1)  # real keys up to and including each slot
    before = torch.cat([torch.zeros(batch, 1, dtype=torch.long, device=device),
                        count[:, :-1]], 1)[:, starts]  # [B, docs]: real keys before each doc
    order = count - before[:, doc] - 1  # each real key's index among its document's
    in_doc = count[:, [c - 1 for c in cu[1:]]] - before  # [B, docs]
    blocks = -(-in_doc // ratio)
    offset = torch.cumsum(blocks, 1) - blocks
    return torch.where(real, offset[:, doc] + torch.div(order, ratio, rounding_mode="floor"),
                       torch.full_like(order, -1))


def _checks(module, ctx, cache, n, kwargs, attention_mask):
    """This rank's refusals before anything travels (ValueError / TypeError)."""
    refuse_cache(module, cache)
    ring_only(ctx, "the block indexer's selection",
              "each rank holds its own query rows' selection")
    dropout = module.attention_dropout if module.training else 0.0
    is_causal, window, extra = _check_call(module, attention_mask, dropout, None, True, ctx,
                                           False, None, kwargs)
    if not is_causal or window != (-1, -1) or extra is not None:
        raise ValueError(f"{type(module).__name__} is causal attention; it was asked for "
                         f"another mask ({getattr(attention_mask, 'kind', attention_mask)})")
    world = torch.distributed.get_world_size(resolve_group(ctx.group))
    lay = get_layout(ctx.layout, ctx.cu_seqlens)
    if lay.local_len(ctx.seqlen, world) != n:
        raise ValueError(f"the block indexer got {n} tokens, but a shard of S={ctx.seqlen} on "
                         f"{world} ranks ({lay.name}) holds {lay.local_len(ctx.seqlen, world)}")
    return lay


def _unseen(selection, ctx, rows_pos, batch, heads, device) -> str | None:
    """Where a real query of this rank sees no key under the selection, or None."""
    s = ctx.seqlen
    real = _real_keys(ctx, batch, device)
    mask = selection & _base_mask(ctx)
    keys = torch.arange(s, device=device)
    chunk = max(1, SCORE_ELEMENTS // max(1, batch * heads * s))
    rows_pos = rows_pos.to(device)
    for a in range(0, rows_pos.numel(), chunk):
        pos = rows_pos[a:a + chunk]
        seen = evaluate(mask, s, pos, keys, batch, heads).any(-1).all(1)  # [B, rows]
        wanted = (pos < s)[None, :] & real[:, pos.clamp(max=s - 1)]
        bad = torch.nonzero(wanted & ~seen)
        if bad.numel():
            row, i = bad[0].tolist()
            return (f"the query at position {int(pos[i])} of batch row {row} sees no key after "
                    f"the indexer's block selection (one process's eager attention gives such a "
                    f"row the mean of every value of the sequence: undefined)")
    return None


def _attend(module, q, k, v, selection, error, ctx):
    """Ring attention of [B, H, L, D] q, k, v under the batch's mask and the selection ->
    [B, L, H, Dv] (every rank raises ``error`` if any rank has one)."""
    kw = ctx.attention_kwargs()
    if selection is not None:
        kw["mask"] = and_keys(kw["mask"], mask_key(selection))
    with caller_error(error):
        out = attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                        strategy=ctx.strategy, causal=True, softmax_scale=module.scaling, **kw)
    ctx.record_call()
    return out


@torch.no_grad()
def _qwen4_selection(module, hidden, position_embeddings, attention_mask, cache, ctx, kwargs):
    """(the ``Selection`` of this rank's query rows (key blocks), or None; an error to
    raise on every rank at the attention call, or None) for Qwen4-Exp's QSA indexer."""
    indexer = module.indexer
    pg = resolve_group(ctx.group)
    world, rank = torch.distributed.get_world_size(pg), torch.distributed.get_rank(pg)
    b, n = hidden.shape[:2]
    s, device = ctx.seqlen, hidden.device
    error, lay, raw = None, None, None
    fields = dict.fromkeys(("batch", "local_len", "seqlen", "layout", "block", "topk",
                            "key_dim", "rope_dim"), -1)
    cos, sin = position_embeddings
    try:
        lay = _checks(module, ctx, cache, n, kwargs, attention_mask)
        raw = own_keys(lambda keys: indexer(hidden, position_embeddings, None, keys),
                       type(indexer).__name__)
        fields = {"batch": b, "local_len": n, "seqlen": s, "layout": crc(lay),
                  "block": int(indexer.compress_ratio), "topk": int(indexer.block_topk),
                  "key_dim": int(raw.shape[-1]), "rope_dim": int(cos.shape[-1])}
    except (TypeError, ValueError) as exc:
        error = exc
    token = agreed_token(pg, fields, error, "a block indexer selection")  # raises the same error on every rank
    rot = cos.shape[-1]
    every = gather_sequence(torch.cat([raw, cos.to(raw.dtype), sin.to(raw.dtype)],
                                      -1).detach(), 1, pg, lay, world, s,
                            "all-gather of the block indexer's keys")
    keys = every[..., :raw.shape[-1]].to(raw.dtype)
    full_cos = every[..., raw.shape[-1]:raw.shape[-1] + rot].to(cos.dtype)
    full_sin = every[..., raw.shape[-1] + rot:].to(sin.dtype)
    pos = local_positions(lay, rank, world, s).to(device)
    base = _base_mask(ctx)
    key_block = _qwen4_blocks(ctx, b, int(indexer.compress_ratio), device)
    blocks = int(key_block.max()) + 1 if key_block.numel() else 0
    chosen = torch.zeros(b, 1, n, blocks + 1, dtype=torch.bool, device=device)
    all_keys = torch.arange(s, device=device)
    chunk = max(1, SCORE_ELEMENTS // max(1, b * s))
    for a in range(0, n, chunk):
        z = min(n, a + chunk)
        rows = evaluate(base, s, pos[a:z], all_keys, b, 1).expand(b, 1, -1, -1)
        picked = indexer(hidden[:, a:z],
                         (torch.cat([full_cos, cos[:, a:z]], 1),
                          torch.cat([full_sin, sin[:, a:z]], 1)),
                         rows, IndexerKeys(keys))  # [B, 1, rows, S] bool: the selected keys
        where = torch.where(picked[:, 0], key_block[:, None, :], blocks)  # [B, rows, S]
        chosen[:, 0, a:z].scatter_(-1, where, True)
    chosen[..., blocks] = False
    selection = Selection(token, pos.cpu(), unit_lists(chosen[..., :blocks]).cpu(), 1,
                          key_block)
    return selection, _unseen(selection, ctx, pos, b, 1, device)


@torch.no_grad()
def _minimax_selection(module, hidden, position_embeddings, position_ids, attention_mask,
                       cache, ctx, kwargs):
    """As ``_qwen4_selection``, for MiniMax-M3's lightning indexer (one selection per
    key/value head)."""
    indexer = module.indexer
    pg = resolve_group(ctx.group)
    world, rank = torch.distributed.get_world_size(pg), torch.distributed.get_rank(pg)
    b, n = hidden.shape[:2]
    s, device = ctx.seqlen, hidden.device
    error, lay, keys = None, None, None
    fields = dict.fromkeys(("batch", "local_len", "seqlen", "layout", "block", "topk",
                            "local", "key_dim", "heads"), -1)
    cos, sin = position_embeddings
    try:
        lay = _checks(module, ctx, cache, n, kwargs, attention_mask)
        if ctx.cu_seqlens is not None:
            raise ValueError(
                "MiniMax-M3's indexer anchors its blocks to slots and hides the keys after "
                "each query's position id, which restarts in every packed document: in one "
                "process a document's queries score the keys of earlier documents, and those "
                "that keep no block of their own see no key (undefined); packed rows are "
                "refused")
        if ctx.left_padding is not None:
            # the forward's call, also when gradient checkpointing recomputes the layer
            # after the model's forward has returned (``bind_context``)
            call = bound_call(module) or current_call(owner(module))
            if module.layer_idx != 0:
                raise ValueError(
                    f"MiniMax-M3's sparse layer {module.layer_idx} scores the left padding's "
                    f"keys, whose hidden states after an attention layer are undefined (one "
                    f"process's eager attention averages every value in their fully masked "
                    f"rows): left padding is exact only when the sparse layers come first")
            if call is None or not call.padding_restored:
                raise ValueError(
                    "MiniMax-M3's indexer scores the left padding's keys, so it needs the "
                    "padding's own ids in input_ids (ringattn's convert puts them back from "
                    "the ring context; inputs_embeds cannot be)")
        if position_ids is None or tuple(position_ids.shape[-1:]) != (n,):
            raise ValueError("MiniMax-M3's sparse layers need the shard's position_ids (the "
                             "dict from prepare_batch / shard_batch has them)")
        keys = own_keys(lambda cache_: indexer(hidden, position_embeddings, cache_,
                                               position_ids.expand(b, -1)),
                        type(indexer).__name__)
        fields = {"batch": b, "local_len": n, "seqlen": s, "layout": crc(lay),
                  "block": int(indexer.block_size), "topk": int(indexer.topk_blocks),
                  "local": int(indexer.local_blocks), "key_dim": int(keys.shape[-1]),
                  "heads": int(indexer.num_heads)}
    except (TypeError, ValueError) as exc:
        error = exc
    token = agreed_token(pg, fields, error, "a block indexer selection")  # raises the same error on every rank
    every = gather_sequence(keys[:, 0].detach(), 1, pg, lay, world, s,
                            "all-gather of the block indexer's keys")[:, None]  # [B, 1, S, D]
    pos = local_positions(lay, rank, world, s).to(device)
    ids = torch.where(pos < s, position_ids.expand(b, -1), 0)  # padding slots: any block
    size = int(indexer.block_size)
    blocks = -(-s // size)
    heads = int(indexer.num_heads)
    chosen = torch.zeros(b, heads, n, blocks + 1, dtype=torch.bool, device=device)
    chunk = max(1, SCORE_ELEMENTS // max(1, b * heads * s))
    for a in range(0, n, chunk):
        z = min(n, a + chunk)
        picked = indexer(hidden[:, a:z], (cos[:, a:z], sin[:, a:z]), IndexerKeys(every),
                         ids[:, a:z])  # [B, heads, rows, topk], -1: none
        chosen[:, :, a:z].scatter_(-1, torch.where(picked < 0, blocks, picked).long(), True)
    chosen[..., blocks] = False
    key_block = torch.div(torch.arange(s, device=device), size,
                          rounding_mode="floor").expand(b, -1)
    group = module.config.num_attention_heads // heads
    selection = Selection(token, pos.cpu(), unit_lists(chosen[..., :blocks]).cpu(), group,
                          key_block)
    return selection, _unseen(selection, ctx, pos, b, module.config.num_attention_heads,
                              device)


class _Qwen4ExpTextAttention(SwapMixin):
    """Qwen4-Exp's indexed attention over the ring: its own projections, gate and
    norms; the QSA indexer's block selection over the whole sequence as a ring mask."""

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None,
                **kwargs):
        from transformers.models.qwen4_exp.modeling_qwen4_exp import apply_rotary_pos_emb

        ctx = layer_context(self, kwargs, pop=True)
        if ctx is None:
            return super().forward(hidden_states, position_embeddings, attention_mask,
                                   cache=cache, **kwargs)
        selection, error = _qwen4_selection(self, hidden_states, position_embeddings,
                                            attention_mask, cache, ctx, kwargs)
        length = hidden_states.shape[1]
        cos, sin = (x[:, -length:, :] for x in position_embeddings)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q, gate = torch.chunk(self.q_proj(hidden_states).view(*input_shape, -1,
                                                              self.head_dim * 2), 2, dim=-1)
        gate = gate.reshape(*input_shape, -1)
        q = self.q_norm(q.reshape(hidden_shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = _attend(self, q, k, v, selection, error, ctx)
        out = out.reshape(*input_shape, -1).contiguous() * torch.sigmoid(gate)
        return self.o_proj(out), None



class _MiniMaxM3VLAttention(SwapMixin):
    """MiniMax-M3's sparse attention over the ring: its own projections, norms and
    partial RoPE; the lightning indexer's block selection over the whole sequence (one
    per key/value head) as a ring mask."""

    def forward(self, hidden_states, position_embeddings, attention_mask, cache=None,
                **kwargs):
        from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (
            apply_rotary_pos_emb)

        ctx = layer_context(self, kwargs, pop=True)
        if ctx is None:
            return super().forward(hidden_states, position_embeddings, attention_mask,
                                   cache=cache, **kwargs)
        position_ids = kwargs.get("position_ids")
        selection, error = _minimax_selection(self, hidden_states, position_embeddings,
                                              position_ids, attention_mask, cache, ctx,
                                              kwargs)
        input_shape = hidden_states.shape[:-1]
        hidden_shape = (*input_shape, -1, self.head_dim)
        q = self.q_norm(self.q_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        k = self.k_norm(self.k_proj(hidden_states).view(hidden_shape)).transpose(1, 2)
        v = self.v_proj(hidden_states).view(hidden_shape).transpose(1, 2)
        cos, sin = position_embeddings
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        out = _attend(self, q, k, v, selection, error, ctx)
        return self.o_proj(out.reshape(*input_shape, -1).contiguous()), None



def convert_block_indexer(model) -> None:
    """Replace the indexed attention modules of a Qwen4-Exp or MiniMax-M3 text model by
    ones that select key blocks over the whole sequence under a ring context.

    Raises:
        ValueError: Qwen4-Exp with per-layer n-gram embeddings (``ple_layer_ids``: they hash
            each token's predecessors, which another rank holds), or no indexed layer.
    """
    family = model.config.model_type
    if family == "qwen4_exp_text":
        from transformers.models.qwen4_exp.modeling_qwen4_exp import Qwen4ExpTextAttention as base

        if getattr(model.config, "ple_layer_ids", None):
            raise ValueError(
                f"ringattn converts Qwen4-Exp without per-layer n-gram embeddings "
                f"(ple_layer_ids={list(model.config.ple_layer_ids)}: they hash each token's "
                f"predecessors, which another rank holds)")
        mixin = _Qwen4ExpTextAttention
    else:
        from transformers.models.minimax_m3_vl.modeling_minimax_m3_vl import (
            MiniMaxM3VLAttention as base)

        mixin = _MiniMaxM3VLAttention
    found = [m for m in model.modules()
             if type(m) is base and getattr(m, "indexer", None) is not None]
    if not found:
        raise ValueError(f"{type(model).__name__} has no indexed attention layer to convert")
    for module in found:
        module.__class__ = swap_class(mixin, base)
    if family == "minimax_m3_vl_text":  # its indexer scores the left padding's keys
        hook_restore_padding(model)
        bind_context(model, found)  # the call (padding restored?) reaches a recomputation


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
