"""DeepSeek-V4's compressed attention (``deepseek_v4``): each query attends to the keys of its
sliding window, to compressed entries of the whole causal prefix, and to a per-head sink.

In transformers' model (one process, no cache) a layer's compressor pools every ``m``
consecutive slots of the row into one entry (``heavily_compressed_attention``, HCA; m =
``compress_rates[...]``), or every ``2m`` slots with stride m in two halves
(``compressed_sparse_attention``, CSA: the previous window's first half-channels, the
current one's second), as a per-channel softmax over the window's gates plus a learned bias,
then its RMSNorm and RoPE at the entry's first slot. Windows count slots of the row (padding
and packed documents included), and query t sees entry w iff ``w < (position_ids[t] + 1) //
m``; a CSA layer's indexer (its own compressor at ``index_head_dim``) scores each query
against all entries and keeps its top ``index_topk`` of those (``torch.topk``), and its
query sees only those. The softmax spans the window keys, the entries and the sink.

``convert`` swaps the class of each ``DeepseekV4Attention`` instance for a subclass that,
under a ring context:

1. agrees once with every rank on the call (shapes, layout, rates, top k; a cache, another
   strategy than the ring, a striped layout, a dense mask: the same error on every rank,
   before any tensor travels);
2. builds the entries this rank owns (those whose window ends in its shard) from its own
   slots and a halo: every chunk's last ``m - 1`` (HCA) or ``2m - 1`` (CSA) projected slots,
   one all-gather (``mixers.core.halo``, the causal convolution's halo, windows crossing
   documents as transformers' do), with the module's own parameters and operations in
   transformers' order;
3. all-gathers the entries (one row per owned entry; every rank then holds the layer's
   T = S // m entries, O(S / m) per rank: the queries of every rank may see any of them),
   differentiable (the backward reduce-scatters their gradients to the owners);
4. for CSA, runs the indexer the same way (its entries gathered without gradients: the
   selection is integers, and the indexer gets no gradient in transformers either) and
   scores this rank's queries against every entry with the indexer's own scorer, in chunks
   of queries: the one-process score rows, so the same ``torch.topk`` selection, ties
   included;
5. attends: the window keys by the ring (sliding window, the batch's padding and
   documents, with the log-sum-exp), the entries locally (HCA: every entry under the
   causal threshold; CSA: the k selected entries gathered per query, O(L k) per rank; both
   in chunks of queries recomputed in the backward, ``ENTRY_ELEMENTS``), the two merged by
   their log-sum-exp (``ringattn.merge``) and the sink folded in last.

Why not the ring for the entries, as the DSA indexers' selection is: once gathered, the
entries are local to every rank, so a query's selected entries are a local gather, not a
key mask for keys that travel. ``convert`` takes only transformers' own compressor,
indexer and scorer classes, and only the transformers code it reproduces (``PINNED``).

Everything else in the model (hyper-connections, the hash router, the MoE) is per token.
Left padding needs the padding's own ids (its slots are pooled into entries): ``convert``
puts them back from the ring context, as for MiniMax-M3.

Without a ring context the modules are transformers' own.
"""

from __future__ import annotations

import torch

from ....comm import agree, resolve_group
from ....layouts import get_layout, local_positions
from ....masks import and_keys
from ....merge import merge
from ....mixers._plan import conv_sources, make_plan
from ....mixers.core import Tie, gather_rows, halo
from ....strategies.auto import attention
from ..attention import _check_call
from ..checks import pinned_problem, register_attention
from ..state import (SwapMixin, bind_context, bound_call, current_call, hook_restore_padding,
                     layer_context, owner, swap_class)
from .indexer import crc, refuse_cache, ring_only

__all__ = ["convert_compressed"]

FAMILIES = ("deepseek_v4",)
register_attention("compressed", FAMILIES, layer_types={
    "deepseek_v4": ("compressed_sparse_attention", "heavily_compressed_attention")})

SCORE_ELEMENTS = 1 << 24
"""Indexer scores ([B, chunk, index heads, T] floats) one chunk of queries may hold."""

ENTRY_ELEMENTS = 1 << 24
"""Gathered entries ([B, chunk, k, D]) or scores over them ([B, H, chunk, T]) one chunk of
queries of the entry attention may hold."""

_LAYER_TYPES = {"sliding_attention": 0, "compressed_sparse_attention": 1,
                "heavily_compressed_attention": 2}

PINNED = {"DeepseekV4Attention.forward": 1079488739,
          "DeepseekV4HCACompressor.forward": 1390939516,
          "DeepseekV4CSACompressor.forward": 1487698464,
          "DeepseekV4Indexer.forward": 1296470858,
          "eager_attention_forward": 1057793864}
"""The transformers code (5.24.0) whose arithmetic this file reproduces (``checks.
source_digest``): ``convert`` refuses a transformers that writes any of it otherwise."""


def _modeling():
    from transformers.models.deepseek_v4 import modeling_deepseek_v4

    return modeling_deepseek_v4


def _exact_parts(module) -> str | None:
    """Why ``module`` (a DeepseekV4Attention) is not the structure this file reproduces,
    or None: its compressor, indexer and scorer must be transformers' own classes."""
    m = _modeling()
    want = {"compressed_sparse_attention": m.DeepseekV4CSACompressor,
            "heavily_compressed_attention": m.DeepseekV4HCACompressor,
            "sliding_attention": type(None)}.get(module.layer_type)
    if want is None:
        return f"layer type {module.layer_type!r}"
    if type(module.compressor) is not want:
        return f"compressor {type(module.compressor).__name__} (not {want.__name__})"
    if want is m.DeepseekV4CSACompressor:
        if type(module.compressor.indexer) is not m.DeepseekV4Indexer:
            return f"indexer {type(module.compressor.indexer).__name__}"
        if type(module.compressor.indexer.scorer) is not m.DeepseekV4IndexerScorer:
            return f"indexer scorer {type(module.compressor.indexer.scorer).__name__}"
        if module.compressor.indexer.compress_rate != module.compressor.compress_rate:
            return (f"an indexer rate {module.compressor.indexer.compress_rate} other than "
                    f"its compressor's {module.compressor.compress_rate}")
    return None


class _Owned:
    """Which compressed entries each rank builds (those whose window's last slot it holds)
    and where each entry lands in the gathered table."""

    def __init__(self, lay, world: int, rank: int, seqlen: int, rate: int, device):
        every = []
        for r in range(world):
            pos = local_positions(lay, r, world, seqlen)
            ends = (pos < seqlen) & ((pos + 1) % rate == 0)
            every.append((torch.nonzero(ends).flatten(), (pos[ends] + 1) // rate - 1))
        self.rows = max(1, max(len(w) for _, w in every))
        self.count = seqlen // rate
        place = torch.empty(self.count, dtype=torch.long)
        for r, (_, w) in enumerate(every):
            place[w] = r * self.rows + torch.arange(len(w))
        self.place = place.to(device)  # entry w -> its row of the [W * rows] table
        slots, w = every[rank]
        self.slots, self.entries = slots.to(device), w.to(device)


_OWNED: dict = {}


def _owned(lay, world: int, rank: int, seqlen: int, rate: int, device) -> _Owned:
    """``_Owned`` for this call's shape, made once."""
    key = (lay, world, rank, seqlen, rate, str(device))
    if key not in _OWNED:
        if len(_OWNED) > 256:
            _OWNED.clear()
        _OWNED[key] = _Owned(lay, world, rank, seqlen, rate, device)
    return _OWNED[key]


def _pool(module, ext, windows, before, entries, overlap: bool):
    """The entries [B, n, D] of compressor (or indexer) ``module`` from the slots
    ``windows`` [n, span] of ``ext`` (its kv and gate projections side by side; span = m, or
    2m with ``overlap``), ``before`` [n, span] marking slots before the sequence; the
    operations of the module's forward, in its order and dtypes."""
    mod = _modeling()
    b = ext.shape[0]
    n, span = windows.shape
    rate, dim = module.compress_rate, module.head_dim
    width = ext.shape[-1] // 2
    kv, gate = ext[:, windows].split(width, dim=-1)  # [B, n, span, C]
    gate = (gate.view(b, n, span // rate, rate, width) + module.position_bias).view(
        b, n, span, width)
    if overlap:  # the previous window's first channels, then this window's last ones
        kv = torch.cat([kv[:, :, :rate, :dim], kv[:, :, rate:, dim:]], dim=2)
        gate = torch.cat([gate[:, :, :rate, :dim], gate[:, :, rate:, dim:]], dim=2)
        off = before.view(1, n, span, 1)
        kv = kv.masked_fill(off, 0.0)
        gate = gate.masked_fill(off, float("-inf"))
    pooled = module.kv_norm(
        (kv * gate.softmax(dim=2, dtype=torch.float32).to(kv.dtype)).sum(dim=2))
    positions = (entries * rate).unsqueeze(0).expand(b, -1)
    cos, sin = module.rotary_emb(pooled, position_ids=positions,
                                 layer_type=module.rope_layer_type)
    return mod.apply_rotary_pos_emb(pooled.unsqueeze(1), cos, sin).squeeze(1)


def _entries(module, hidden, plan, owned: _Owned, pg, overlap: bool, what: str):
    """[B, T, D] every entry of ``module``'s compressor, on every rank (differentiable
    where grad is enabled)."""
    rate = module.compress_rate
    span = 2 * rate if overlap else rate
    x = torch.cat([module.kv_proj(hidden), module.gate_proj(hidden)], dim=-1)
    b = x.shape[0]
    anchors = [x] if x.requires_grad else []
    if span > 1:
        ext, table = halo(x, plan, span - 1, pg, f"{what}: all-gather of the windows' halo",
                          anchors)
    else:  # windows of one slot: no halo
        ext, table = torch.cat([x, x.new_zeros((b, 1, x.shape[-1]))], dim=1), x
    if owned.slots.numel():
        src = conv_sources(plan, span - 1).to(x.device)  # [span - 1, L]
        back = src[:, owned.slots].flip(0)  # slot s - 1 .. 1 before each window's end
        windows = torch.cat([back.t(), owned.slots.unsqueeze(1)], dim=1)  # [n, span]
        before = windows == ext.shape[1] - 1  # the zero slot: before the sequence
        mine = _pool(module, ext, windows, before, owned.entries, overlap)  # [B, n, D]
        mine = mine.transpose(0, 1)
    else:  # nothing to build here; the halo's backward still runs on this rank
        mine = Tie.apply(x.new_zeros((0, b, module.head_dim)), table) if anchors else \
            x.new_zeros((0, b, module.head_dim))
    rows = torch.cat([mine, mine.new_zeros((owned.rows - mine.shape[0], *mine.shape[1:]))])
    every = gather_rows(rows, pg, f"{what}: all-gather of the compressed entries",
                        anchors)  # [W, rows, B, D]
    every = every.reshape(-1, *every.shape[2:])
    return every.index_select(0, owned.place).transpose(0, 1)  # [B, T, D]


@torch.no_grad()
def _selection(indexer, hidden, q_residual, position_ids, keys):
    """[B, L, k] the entries this rank's queries keep (-1: none), by the indexer's own
    query projection, RoPE and scorer on the one-process score rows, in chunks."""
    mod = _modeling()
    b, n = hidden.shape[:2]
    count = keys.shape[1]
    top = min(int(indexer.index_topk), count)
    heads = int(indexer.num_heads)
    chunk = max(1, SCORE_ELEMENTS // max(1, b * heads * count))
    entry = torch.arange(count, device=hidden.device)
    picked = []
    for a in range(0, n, chunk):
        z = min(n, a + chunk)
        ids = position_ids[:, a:z]
        cos, sin = indexer.rotary_emb(hidden, position_ids=ids,
                                      layer_type=indexer.rope_layer_type)
        q = indexer.q_b_proj(q_residual[:, a:z]).view(b, z - a, -1, indexer.head_dim)
        q = mod.apply_rotary_pos_emb(q.transpose(1, 2), cos, sin).transpose(1, 2)
        scores = indexer.scorer(q, keys, hidden[:, a:z])  # [B, rows, T]
        threshold = (ids + 1) // indexer.compress_rate
        future = entry.view(1, 1, -1) >= threshold.unsqueeze(-1)
        best = scores.masked_fill(future, float("-inf")).topk(top, dim=-1).indices
        picked.append(torch.where(best >= threshold.unsqueeze(-1), -1, best))
    return torch.cat(picked, dim=1)


def _entry_attention(q, entries, visible, picked, scaling):
    """(out [B, L, H, D], lse [B, H, L]) of queries ``q`` [B, H, L, D] over the entries
    [B, T, D] (keys and values): every entry where ``visible`` [B, L, T], or the entries
    ``picked`` [B, L, k] (-1: none) when given. A row that sees none: lse -inf, out 0, and
    zero gradients. In chunks of queries of at most ``ENTRY_ELEMENTS`` gathered entries or
    scores each, recomputed in the backward when there is more than one (so the
    backward keeps only q, the entries and the result)."""
    b, h, n, d = q.shape
    width = picked.shape[-1] * d if picked is not None else h * entries.shape[1]
    chunk = max(1, ENTRY_ELEMENTS // max(1, b * width))
    if chunk >= n:
        return _entry_chunk(q, entries, visible, picked, scaling)
    from torch.utils.checkpoint import checkpoint

    outs, lses = [], []
    for a in range(0, n, chunk):
        z = min(n, a + chunk)
        out, lse = checkpoint(_entry_chunk, q[:, :, a:z], entries,
                              None if visible is None else visible[:, a:z],
                              None if picked is None else picked[:, a:z], scaling,
                              use_reentrant=False)
        outs.append(out)
        lses.append(lse)
    return torch.cat(outs, dim=1), torch.cat(lses, dim=2)


def _entry_chunk(q, entries, visible, picked, scaling):
    """``_entry_attention`` on one chunk of queries."""
    if picked is not None:
        b = picked.shape[0]
        rows = torch.arange(b, device=q.device).view(b, 1, 1)
        values = entries[rows, picked.clamp(min=0)]  # [B, L, k, D]
        scores = torch.einsum("bhld,blkd->bhlk", q, values) * scaling
        seen = picked >= 0
    else:
        values = entries
        scores = torch.matmul(q, entries.unsqueeze(1).transpose(-1, -2)) * scaling
        seen = visible
    seen = seen.unsqueeze(1)
    scores = scores.masked_fill(~seen, float("-inf"))
    any_row = seen.any(-1, keepdim=True)  # [B, 1, L, 1]
    lse = torch.logsumexp(torch.where(any_row, scores, 0.0), dim=-1, keepdim=True)
    probs = torch.exp(scores - torch.where(any_row, lse, 0.0))
    if picked is not None:
        out = torch.einsum("bhlk,blkd->blhd", probs.to(values.dtype), values)
    else:
        out = torch.matmul(probs.to(values.dtype), values.unsqueeze(1)).transpose(1, 2)
    lse = torch.where(any_row, lse, float("-inf")).squeeze(-1)
    return out, lse


def _checks(module, ctx, cache, attention_mask, position_ids, n, kwargs):
    """This rank's refusals before anything travels; (layout, window, extra mask)."""
    refuse_cache(module, cache)
    ring_only(ctx, "DeepSeek-V4's compressed attention",
              "each rank selects and attends to the entries of its own queries")
    problem = _exact_parts(module)
    if problem is not None:
        raise TypeError(f"ringattn reproduces DeepseekV4Attention with transformers' own "
                        f"compressor classes, got {problem}")
    dropout = module.attention_dropout if module.training else 0.0
    causal, window, extra = _check_call(module, attention_mask, dropout,
                                        module.sliding_window, True, ctx, False, None,
                                        dict(kwargs))
    if not causal:
        raise ValueError(f"{type(module).__name__} is causal attention; it was asked for a "
                         f"bidirectional mask")
    if position_ids is None or position_ids.shape[-1] != n:
        raise ValueError("DeepSeek-V4's compressed entries need the shard's position_ids (the "
                         "dict from prepare_batch / shard_batch has them)")
    world = torch.distributed.get_world_size(resolve_group(ctx.group))
    lay = get_layout(ctx.layout, ctx.cu_seqlens)
    if lay.local_len(ctx.seqlen, world) != n:
        raise ValueError(f"DeepSeek-V4's attention got {n} tokens, but a shard of "
                         f"S={ctx.seqlen} on {world} ranks ({lay.name}) holds "
                         f"{lay.local_len(ctx.seqlen, world)}")
    if module.compressor is not None and not lay.unit_stride:
        raise ValueError(f"layout {lay.name!r} puts token t on rank t mod W: every window "
                         f"DeepSeek-V4's compressors pool would cross ranks; shard with "
                         f"'zigzag' or 'contiguous'")
    if ctx.left_padding is not None and module.compressor is not None:
        call = bound_call(module) or current_call(owner(module))
        if call is None or not call.padding_restored:
            raise ValueError("DeepSeek-V4's compressors pool the left padding's slots, so "
                             "they need the padding's own ids in input_ids (ringattn's "
                             "convert puts them back from the ring context; inputs_embeds "
                             "cannot be)")
    return lay, window, extra


class _DeepseekV4Attention(SwapMixin):
    """DeepSeek-V4's attention over the ring: its own projections, norms, RoPE, sinks and
    grouped output; the window keys by the ring, the compressed entries built over the
    whole sequence (module docstring)."""

    def forward(self, hidden_states, position_embeddings, position_ids, attention_mask,
                cache=None, **kwargs):
        mod = _modeling()
        ctx = layer_context(self, kwargs, pop=True)
        if ctx is None:
            return super().forward(hidden_states, position_embeddings, position_ids,
                                   attention_mask, cache=cache, **kwargs)
        pg = resolve_group(ctx.group)
        world, rank = torch.distributed.get_world_size(pg), torch.distributed.get_rank(pg)
        b, n = hidden_states.shape[:2]
        comp = self.compressor
        csa = comp is not None and self.layer_type == "compressed_sparse_attention"
        error, lay, window, extra = None, None, (-1, -1), None
        fields = dict.fromkeys(("batch", "local_len", "seqlen", "layout", "layer", "rate",
                                "index_rate", "topk", "window"), -1)
        try:
            lay, window, extra = _checks(self, ctx, cache, attention_mask, position_ids, n,
                                         kwargs)
            fields = {"batch": b, "local_len": n, "seqlen": ctx.seqlen, "layout": crc(lay),
                      "layer": _LAYER_TYPES[self.layer_type],
                      "rate": -2 if comp is None else int(comp.compress_rate),
                      "index_rate": int(comp.indexer.compress_rate) if csa else -2,
                      "topk": int(comp.indexer.index_topk) if csa else -2,
                      "window": window[0]}
        except (TypeError, ValueError) as exc:
            error = exc
        agree(pg, fields, error, what="DeepSeek-V4's compressed attention")
        if position_ids.shape[0] != b:
            position_ids = position_ids.expand(b, -1)

        cos, sin = position_embeddings[self.rope_layer_type]
        hidden_shape = (b, n, -1, self.head_dim)
        q_residual = self.q_a_norm(self.q_a_proj(hidden_states))
        q = self.q_b_norm(self.q_b_proj(q_residual).view(*hidden_shape).transpose(1, 2))
        q = mod.apply_rotary_pos_emb(q, cos, sin)  # [B, H, L, D]
        kv = self.kv_norm(self.kv_proj(hidden_states)).view(*hidden_shape).transpose(1, 2)
        kv = mod.apply_rotary_pos_emb(kv, cos, sin)  # [B, 1, L, D]

        part = None  # the compressed entries' (out, lse), computed before the ring's
        if comp is not None and ctx.seqlen // comp.compress_rate > 0:
            plan = make_plan(lay, world, rank, ctx.seqlen, None)
            owned = _owned(lay, world, rank, ctx.seqlen, comp.compress_rate, q.device)
            entries = _entries(comp, hidden_states, plan, owned, pg, csa,
                               f"layer {self.layer_idx}'s compressor")
            picked, visible = None, None
            if csa:
                indexer = comp.indexer
                with torch.no_grad():
                    keys = _entries(indexer, hidden_states, plan, owned, pg, True,
                                    f"layer {self.layer_idx}'s indexer")
                picked = _selection(indexer, hidden_states, q_residual, position_ids, keys)
            else:
                threshold = (position_ids + 1) // comp.compress_rate
                visible = (torch.arange(owned.count, device=q.device).view(1, 1, -1)
                           < threshold.unsqueeze(-1))
            part = _entry_attention(q, entries, visible, picked, self.scaling)

        kw = ctx.attention_kwargs()
        if extra is not None:
            kw["mask"] = and_keys(kw["mask"], extra)
        out, lse = attention(q.transpose(1, 2), kv.transpose(1, 2), kv.transpose(1, 2),
                             strategy="ring", causal=True, window_size=window,
                             softmax_scale=self.scaling, return_lse=True, **kw)
        ctx.record_call()
        if part is not None:
            out, lse = merge(out, lse, part[0].to(out.dtype), part[1])
        # the sink: one more logit per head, of value 0
        keep = torch.sigmoid(lse - self.sinks.to(lse.dtype).view(1, -1, 1))
        out = (out.to(keep.dtype) * keep.transpose(1, 2).unsqueeze(-1)).to(q.dtype)

        out = mod.apply_rotary_pos_emb(out.transpose(1, 2), cos, -sin).transpose(1, 2)
        grouped = out.reshape(b, n, self.config.o_groups, -1)
        grouped = self.o_a_proj(grouped).flatten(2)
        return self.o_b_proj(grouped), None


def convert_compressed(model) -> None:
    """Replace the attention modules of a DeepSeek-V4 model by ones that attend over the
    whole sequence under a ring context.

    Raises:
        ValueError: no DeepseekV4Attention to convert, or a transformers whose code of it
            differs from the one this file reproduces (``PINNED``).
        TypeError: a module whose compressor, indexer or scorer is not transformers' own
            class (named).
    """
    base = _modeling().DeepseekV4Attention
    found = [m for m in model.modules() if type(m) is base]
    if not found:
        raise ValueError(f"{type(model).__name__} has no DeepseekV4Attention to convert")
    changed = pinned_problem(_modeling(), PINNED)
    if changed is not None:
        raise ValueError(f"ringattn cannot convert {type(model).__name__}: {changed} (its "
                         f"compressed attention under context parallelism would not be "
                         f"this transformers' model)")
    for module in found:
        problem = _exact_parts(module)
        if problem is not None:
            raise TypeError(f"ringattn converts DeepseekV4Attention with transformers' own "
                            f"compressor classes; layer {module.layer_idx} has {problem}")
    for module in found:
        module.__class__ = swap_class(_DeepseekV4Attention, base)
    hook_restore_padding(model)  # its compressors pool the left padding's slots
    bind_context(model, found)  # the call (padding restored?) reaches a recomputation


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
