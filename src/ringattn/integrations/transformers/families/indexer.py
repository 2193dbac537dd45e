"""DeepSeek sparse attention (DSA): each query attends only to the ``index_topk`` keys a
light indexer scores highest over its causal prefix (DeepSeek-V3.2, GLM-MoE-DSA, A.X K2,
HY-V4, dots3-note's indexed layers).

transformers' indexer scores every query against every key of the sequence and keeps the
top k with ``torch.topk`` (ties broken by topk's own algorithm on the whole score row); the
attention module folds the selection into the dense mask, or hands it to the attention
function as ``indices=`` for any other implementation. ``convert`` swaps the class of each
indexer instance for a subclass that computes, under a ring context:

1. one agreement of every rank's indexer call (shapes, top k, layout, strategy; the same
   ValueError on every rank before any tensor travels, never a hang);
2. the selection of this rank's queries, by one of two paths:

   * **the ring's running top k** (O(S / W + k) per rank): every rank's indexer keys (the
     keys the indexer's own forward computed for its shard, handed over by the
     ``update_indexer`` hook of the cache it takes) pass round the ring; each rank scores
     its queries against each block with the family's own score (its projections, RoPE,
     head weights and ReLU: the same operations in the same order, for the indexer classes
     in ``_recipes``; read from their forwards), masked as one process masks its rows
     (causal, padding, documents, a window), and keeps a running top k (+ 1) per query. No
     rank holds a score row or a mask row over all S keys.
   * **whole rows** (O(S) per rank): one all-gather of the keys, then the indexer's own
     forward on this rank's queries against them, on rows of the global length S, in
     chunks (at most ``SCORE_ELEMENTS`` scores at a time): the same score row as one
     process, so the same ``torch.topk`` call, ties included.

   ``torch.topk`` breaks ties at the k-th score by its own algorithm over the whole row
   (not by position: ``test_topk_ties_are_not_broken_by_position``), and it differs between
   devices. Under the default rule (``indexer_ties(model, "topk")``) the ring's top k is
   used when no row of any rank ties at its k-th score (its set is then the one-process
   set); a call in which one does (with the ReLU, exact zeros tie whenever a row has few
   more positive scores than k) selects by whole rows, decided in one agreement. Under
   ``indexer_ties(model, "position")`` equal scores are taken in position order (lowest
   first) and every call runs the ring's top k; ringattn's own reference for it is the
   model under a ring context of one rank. An indexer class without a recipe always
   selects by whole rows.

The selection travels with the indices tensor the indexer returns (``SELECTION``): a
value-keyed ``Mask`` (``Selection``) that the attention function ands with the batch's mask,
so the ring runs its one loop, forward and backward, over exactly the selected keys (a
per-block key mask, as any mask: blocks with no selected key are skipped). GLM-MoE-DSA's
shared layers reuse the tensor, and so the mask and its plan. The indexer runs without
gradients in transformers (``torch.no_grad``), and so here.

Why the selection as a key mask of the ring and not a fetch of the selected K/V rows: the
ring computes the backward (dK, dV travel home with it) and every strategy check as for any
mask, and needs no second loop; a fetch would move k rows per query (and their gradients
back) but compute only k keys per query instead of the causal prefix, which is cheaper in
FLOPs once S >> k; it is not implemented.

Per rank, the ring's top k: one block of keys in flight [B, L, index_head_dim], one chunk
of scores against it (``RING_SCORE_ELEMENTS``), the running [B, L, k + 1]; whole rows: the
gathered keys [B, S, index_head_dim] and one chunk's scores [chunk, S]. Both: the selection
[B, L, k] and the ring's plan of the selection mask (its partial tiles' bits kept up to the
plan's budget, evaluated again beyond it). benchmarks/bench_indexer_memory.py measures
both at a fixed S / W.

Without a ring context (one process) the indexer is transformers' own.
"""

from __future__ import annotations

import zlib

import torch

from ....comm import agree, all_gather_single, resolve_group
from ....layouts import get_layout, local_positions, restore_index
from ....masks import (
    Mask,
    causal,
    document,
    evaluate,
    full,
    registered_mask,
    sliding_window,
)
from ..attention import ModelMask, _ring_arguments
from ..checks import register_attention, source_digest
from ..state import MISSING, SwapMixin, bind_context, bound_context, missing_error, swap_class

__all__ = ["SELECTION", "Selection", "agreed_token", "attach_selection", "convert_indexer",
           "IndexerKeys", "crc", "gather_sequence", "indexer_ties", "own_keys", "refuse_cache",
           "ring_only", "row_chunks", "row_mask", "unit_lists"]

FAMILIES = ("deepseek_v32", "glm_moe_dsa", "axk2", "hy_v4", "dots3_note_text")
register_attention("indexer", FAMILIES)

SELECTION = "_ringattn_selection"
"""Attribute of the indices tensor a converted indexer returns: its ``Selection`` mask."""

SCORE_ELEMENTS = 1 << 24
"""Scores ([B, chunk, index heads, S] floats) one chunk of queries may hold at a time."""

RING_SCORE_ELEMENTS = 1 << 22
"""Scores ([B, chunk, index heads, L] floats) one chunk of queries may hold against one
block of keys in the ring's running top k."""

_LAST = [0]
"""The last selection number of this process (each call's is agreed across its ranks: the
maximum of their next ones)."""


class Selection(Mask):
    """Query q sees key kv iff the unit of kv is among the units selected for q: the key
    itself (DSA: ``unit`` None) or its block (the block indexers: ``unit`` [B, S], each
    key's block, -1 for none).

    Each rank holds the selection of its own query slots only (``selected`` [B, L, k], or
    [B, Hs, L, k] per selection head: units, a value < 0 selects nothing) and is only ever
    asked about them by its ring plan; other query positions (a probe) see nothing. With
    per-head rows, attention head h reads selection head h // ``group``. Keyed by a number
    every rank of the call agreed on, so ranks agree on it as on any value-keyed mask, and
    each selection is planned once. One representation for every sparse family: sorted
    lists of k units per row, O(L k) per rank.
    """

    def __init__(self, token: int, rows_pos: torch.Tensor, selected: torch.Tensor,
                 group: int | None = None, unit: torch.Tensor | None = None):
        real = rows_pos >= 0
        order = torch.argsort(rows_pos)
        self._pos = rows_pos[order]  # sorted global positions of this rank's query rows
        self._row = order
        selected = selected.long() if selected.dim() == 4 else selected.long().unsqueeze(1)
        self._sel = torch.sort(selected, dim=-1).values  # [B, Hs, L, k]
        self._unit = None if unit is None else unit.long().cpu()
        self._group = None if group is None or selected.shape[1] == 1 else int(group)
        self._real = bool(real.all())
        self.token = token
        self._on: dict = {}

    def key(self):
        return ("indexer_selection", self.token)

    def _tensors(self, device):
        device = torch.device(device)
        if device not in self._on:
            self._on[device] = tuple(None if t is None else t.to(device)
                                     for t in (self._pos, self._row, self._sel, self._unit))
        return self._on[device]

    def __call__(self, b, h, q, kv):
        pos, row, sel, unit = self._tensors(q.device)
        k = sel.shape[-1]
        at = torch.searchsorted(pos, q).clamp(max=pos.numel() - 1)
        mine = pos[at] == q
        rows = row[at]
        per_head = self._group is not None
        plain = (q.dim() == 4 and kv.dim() == 4 and q.shape[0] == q.shape[1] == q.shape[3] == 1
                 and kv.shape[:3] == (1, 1, 1) and b.dim() == 4 and b.shape[1:] == (1, 1, 1)
                 and (not per_head or (h.dim() == 4 and h.shape[0] == h.shape[2]
                                       == h.shape[3] == 1)))
        if plain:  # ring plans: [B, 1, 1, 1], [1, H, 1, 1], [1, 1, Sq, 1], [1, 1, 1, Sk]
            heads = (torch.div(h.reshape(-1), self._group, rounding_mode="floor") if per_head
                     else torch.zeros(1, dtype=torch.long, device=q.device))
            batch = b.reshape(-1)
            s = sel[batch][:, heads][:, :, rows.reshape(-1)]  # [B, Hm, Sq, k]
            units = (kv.reshape(1, -1).expand(batch.numel(), -1) if unit is None
                     else unit[batch][:, kv.reshape(-1)])  # [B, Sk]
            keys = units[:, None, None, :].expand(*s.shape[:3], -1).contiguous()
            at_k = torch.searchsorted(s, keys).clamp(max=k - 1)
            seen = (s.gather(-1, at_k) == keys) & (keys >= 0)
            return seen & mine.reshape(1, 1, -1, 1)
        head = (torch.div(h, self._group, rounding_mode="floor") if per_head
                else torch.zeros((), dtype=torch.long, device=q.device))
        s = sel[b, head, rows]  # any other broadcast (flex's scalars)
        units = kv if unit is None else unit[b, kv]
        return (s == units.unsqueeze(-1)).any(-1) & mine & (units >= 0)

    def __repr__(self):
        return f"indexer_selection({self.token})"


def unit_lists(chosen: torch.Tensor) -> torch.Tensor:
    """[..., n] bool (which of n units each row selects) -> [..., k] the selected units in
    order, -1 where a row selects fewer than k (the most any row selects, at least 1)."""
    n = chosen.shape[-1]
    k = max(1, int(chosen.sum(-1).max())) if chosen.numel() else 1
    index = torch.arange(n, device=chosen.device).expand_as(chosen)
    ranked = torch.where(chosen, index, n).sort(dim=-1).values[..., :k]
    return torch.where(ranked < n, ranked, -1)


def agreed_token(pg, fields: dict, error, what: str = "an indexer selection") -> int:
    """Agree on this call with every rank (raising the same error everywhere) and on a
    selection number, new in every process."""
    fields = {**fields, "selection": _LAST[0] + 1}
    token = agree(pg, fields, error, reduce=("selection",), what=what)["selection"]
    _LAST[0] = max(_LAST[0], token)
    return token


def gather_sequence(local: torch.Tensor, dim: int, pg, lay, world: int, seqlen: int,
                    what: str) -> torch.Tensor:
    """Every rank's ``local`` (its shard's slots on ``dim``) in global order: the same
    tensor with S positions on ``dim`` (one all-gather)."""
    rows = local.movedim(dim, 0).contiguous()  # [L, ...]
    every = rows.new_empty((world * rows.shape[0], *rows.shape[1:]))
    all_gather_single(every, rows, pg, what=what)
    order = restore_index(lay, world, seqlen)[:seqlen].to(every.device)
    return every.index_select(0, order).movedim(0, dim)


def row_chunks(mask: Mask, seqlen: int, pos: torch.Tensor, batch: int, per_key: int):
    """(a, z, rows) for this rank's query slots ``pos`` in chunks: ``rows`` [B, z - a, S]
    bool, the one-process score rows' visibility of slots a..z-1 under ``mask``; a chunk
    holds at most ``SCORE_ELEMENTS`` scores of ``per_key`` floats per (query, key)."""
    n = pos.numel()
    chunk = max(1, SCORE_ELEMENTS // max(1, per_key * seqlen))
    keys_all = torch.arange(seqlen, device=pos.device)
    for a in range(0, n, chunk):
        z = min(n, a + chunk)
        yield a, z, evaluate(mask, seqlen, pos[a:z], keys_all, batch, 1)[:, 0].expand(
            batch, -1, -1)


def attach_selection(selected: torch.Tensor, token: int, pos: torch.Tensor, seqlen: int,
                     group: int | None = None) -> torch.Tensor:
    """``selected`` (this rank's rows, [B, L, k] or [B, Hs, L, k] global key positions) with
    its ``Selection`` attached as ``SELECTION``, the mask the attention function ands."""
    rows_pos = torch.where(pos < seqlen, pos, torch.full_like(pos, -1))
    setattr(selected, SELECTION, Selection(token, rows_pos.cpu(), selected.cpu(), group))
    return selected


class IndexerKeys:
    """What an indexer's forward takes as its cache: the hook that receives the keys of the
    tokens it runs on and returns the keys it scores against (None: none yet, so the hook
    hands the keys over and stops the forward, ``own_keys``). The DSA indexers call
    ``update_indexer``; Qwen4-Exp's too; MiniMax-M3's ``layers[i].update_index``."""

    def __init__(self, keys=None):
        self.keys = keys

    @property
    def layers(self):
        return self

    def __getitem__(self, index):
        return self

    def update_indexer(self, keys, layer_idx):
        return self.update_index(keys)

    def update_index(self, keys):
        if self.keys is None:
            raise _Handover(keys)
        return self.keys


class _Handover(Exception):
    """The keys of this rank's tokens, computed by the indexer's own forward."""

    def __init__(self, keys):
        super().__init__("indexer keys")
        self.keys = keys


def own_keys(run, name: str):
    """The local keys an indexer's forward (``run(cache)``) hands its cache; it stops there.

    Raises:
        TypeError: it never hands them over (named ``name``).
    """
    try:
        run(IndexerKeys())
    except _Handover as got:
        return got.keys
    raise TypeError(f"{name} never handed its keys to its cache: ringattn cannot give it the "
                    f"whole sequence's")


def refuse_cache(module, cache) -> None:
    """Raise the ValueError of a converted layer given a cache under a ring context."""
    if cache is not None:
        raise ValueError(f"{type(module).__name__} got a cache under context parallelism; "
                         f"call the model with use_cache=False")


def ring_only(ctx, what: str, why: str) -> None:
    """Raise the ValueError of ``what`` (which runs on the ring strategy of a 1-D group
    only, ``why``) under any other strategy or a 2-D mesh."""
    if ctx.mesh is not None or ctx.strategy != "ring":
        raise ValueError(f"{what} runs with strategy 'ring' on a 1-D group ({why}), got "
                         f"strategy {ctx.strategy!r}"
                         + (" on a 2-D mesh" if ctx.mesh is not None else ""))


def check_selection(module, what: str, attention_mask, ctx, n: int, world: int):
    """The checks every per-query selection over the whole sequence makes before its
    agreement (raised there, on every rank): the ring strategy on a 1-D group, padding
    through ``shard_batch``, a shard of the context's length. Returns (layout, row mask)."""
    seqlen = ctx.seqlen
    ring_only(ctx, what, "each rank holds the selection of its own queries")
    if attention_mask is not None and not isinstance(attention_mask, ModelMask):
        raise TypeError(f"{type(module).__name__} got a dense attention mask; padding goes "
                        f"through ringattn.shard_batch")
    lay = get_layout(ctx.layout, ctx.cu_seqlens)
    if lay.local_len(seqlen, world) != n:
        raise ValueError(f"{what} got {n} tokens, but a shard of S={seqlen} on {world} ranks "
                         f"({lay.name}) holds {lay.local_len(seqlen, world)}")
    return lay, row_mask(module, attention_mask, ctx)


def row_mask(module, attention_mask, ctx) -> Mask:
    """The mask of the indexer's score rows in global positions: what the attention module
    passes it (causal, a window), the batch's padding and documents."""
    is_causal, window, extra = _ring_arguments(module, attention_mask, None, True, ctx)
    if window != (-1, -1):
        mask = sliding_window(*window)
    else:
        mask = causal() if is_causal else full()
    for part in (ctx.mask, None if ctx.cu_seqlens is None else document(ctx.cu_seqlens),
                 None if extra is None else registered_mask(extra)):
        if part is not None:
            mask = mask & part
    return mask


class _Indexer(SwapMixin):
    """The indexer over the whole sequence: its own forward on this rank's queries,
    against every rank's keys; the selection as a mask for the ring."""

    def forward(self, hidden_states, q_resid, position_embeddings, attention_mask,
                position_ids=None, cache=None, **kwargs):
        ctx = bound_context(self)
        if ctx is MISSING:
            raise missing_error(self)
        if ctx is None:
            return super().forward(hidden_states, q_resid, position_embeddings,
                                   attention_mask, position_ids, cache=cache, **kwargs)
        return _select(self, super().forward, hidden_states, q_resid, position_embeddings,
                       attention_mask, position_ids, cache, ctx)



@torch.no_grad()
def _select(module, own, hidden, q_resid, position_embeddings, attention_mask, position_ids,
            cache, ctx):
    """[B, L, k] int32 global key positions selected for this rank's query slots (the
    ``Selection`` attached); every rank of the group calls it together."""
    pg = resolve_group(ctx.group)
    world, rank = torch.distributed.get_world_size(pg), torch.distributed.get_rank(pg)
    b, n = hidden.shape[:2]
    seqlen = ctx.seqlen
    error, fields, local_keys, mask, lay = None, {}, None, None, None
    try:
        refuse_cache(module, cache)
        lay, mask = check_selection(module, "the indexer's top-k selection", attention_mask,
                                    ctx, n, world)
        local_keys = own_keys(lambda keys: own(hidden, q_resid, position_embeddings,
                                               attention_mask, position_ids, cache=keys),
                              type(module).__name__)
        if local_keys.dim() != 3 or tuple(local_keys.shape[:2]) != (b, n):
            raise TypeError(f"{type(module).__name__}'s keys are {tuple(local_keys.shape)}, "
                            f"not [B, L, D] = [{b}, {n}, D]")
        fields = {"batch": b, "local_len": n, "seqlen": seqlen, "topk": int(module.index_topk),
                  "key_dim": local_keys.shape[-1], "dtype": _dtype_code(local_keys.dtype),
                  "layout": crc(lay), "mask": crc(mask.key())}
    except (TypeError, ValueError) as exc:
        error = exc
    token = agreed_token(pg, fields, error)  # raises the same error on every rank
    pos = local_positions(lay, rank, world, seqlen).to(hidden.device)
    recipe = _recipe(module)
    if recipe is not None:
        picked = _ring_topk(module, recipe, hidden, q_resid, position_embeddings, local_keys,
                            mask, lay, pos, pg, world, rank, seqlen,
                            module.__dict__.get(_TIES, "topk"))
        if picked is not None:
            STATS["ring"] += 1
            return attach_selection(picked, token, pos, seqlen)
    STATS["whole rows"] += 1
    global_keys = gather_sequence(local_keys, 1, pg, lay, world, seqlen,
                                  "all-gather of the indexer keys")  # [B, S, D]
    # this rank's score rows, in chunks of queries, by the indexer's own forward
    heads = int(getattr(module, "n_heads", 1))
    cos, sin = position_embeddings
    picked = []
    for a, z, rows in row_chunks(mask, seqlen, pos, b, b * heads):
        picked.append(own(
            hidden[:, a:z], q_resid[:, a:z], (cos[:, a:z], sin[:, a:z]), rows,
            None if position_ids is None else position_ids[:, a:z], cache=IndexerKeys(global_keys)))
    return attach_selection(torch.cat(picked, dim=1), token, pos, seqlen)


STATS = {"ring": 0, "whole rows": 0}
"""How many indexer calls of this process selected by the ring's running top-k, and how
many by whole score rows (a tie at the k-th score in some row, or an indexer class without
a recipe)."""


def _transformers_class(module):
    """The transformers class ``module`` is an instance of (under ringattn's swap)."""
    return next((c for c in type(module).__mro__ if c.__module__.startswith("transformers.")),
                None)


def _rope(module, name: str):
    import sys

    return getattr(sys.modules[_transformers_class(module).__module__], name)


def _queries_half(module, hidden, q_resid, cos, sin, rope="apply_rotary_pos_emb", flip=False):
    """(q [B, L, H, D] float32, head weights [B, L, H] float32 with the score scale folded
    where the family folds it, the scale applied to q . k) of DeepSeek-V3.2's indexer
    (``rope``: the RoPE function of the family's module; ``flip``: HY-V4's RoPE slice last,
    its softmax scale in the weights). The same operations, in the same order and dtypes,
    as the family's forward."""
    b, n = hidden.shape[:2]
    heads, dim, rot = module.n_heads, module.head_dim, module.qk_rope_head_dim
    q = module.wq_b(q_resid).view(b, n, heads, dim)
    if flip:
        q_pass, q_rot = torch.split(q, [dim - rot, rot], dim=-1)
    else:
        q_rot, q_pass = torch.split(q, [rot, dim - rot], dim=-1)
    q_rot, _ = _rope(module, rope)(q_rot, q_rot[:, :, :1], cos, sin, unsqueeze_dim=2)
    q = torch.cat([q_pass, q_rot] if flip else [q_rot, q_pass], dim=-1)
    weights = module.weights_proj(hidden.to(module.weights_proj.weight.dtype)).float() * (
        heads ** -0.5)
    if flip:
        return q.float(), weights * module.softmax_scale, None
    return q.float(), weights, module.softmax_scale


def _recipes() -> dict:
    """The indexer classes whose scores ``_ring_topk`` computes, each with its queries'
    recipe (read from the classes' forwards, as transformers 5.24.0 writes them: a class
    whose forward's ``source_digest`` differs has no recipe, and any indexer without one
    selects by whole rows, its own forward)."""
    import functools
    import importlib

    interleave = functools.partial(_queries_half, rope="apply_rotary_pos_emb_interleave")
    table = {}
    for family, name, recipe, pinned in (
            ("deepseek_v32", "DeepseekV32Indexer", _queries_half, 308611404),
            ("axk2", "AXK2Indexer", _queries_half, 308611404),
            ("glm_moe_dsa", "GlmMoeDsaIndexer", interleave, 373164988),
            ("dots3_note", "Dots3NoteTextIndexer", interleave, 373164988),
            ("hy_v4", "HYV4Indexer", functools.partial(_queries_half, flip=True), 180310848)):
        try:
            module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
        except ImportError:
            continue
        cls = getattr(module, name, None)
        if cls is not None and source_digest(cls.forward) == pinned:
            table[cls] = recipe
    return table


_RECIPES: dict = {}
"""``_recipes()``, made on the first converted call (importing five modeling modules at
import time would slow every process's import)."""


def _recipe(module):
    """The score recipe of ``module``'s transformers class, or None."""
    if not _RECIPES:
        _RECIPES.update(_recipes())
    return _RECIPES.get(_transformers_class(module))


def _merge(values, places, keep: int, ties: str):
    """The ``keep`` best of candidate scores ``values`` at key positions ``places`` (both
    [..., C]): under "position", equal scores in position order (lowest first)."""
    if ties == "position":
        order = torch.argsort(places, dim=-1, stable=True)
        values, places = values.gather(-1, order), places.gather(-1, order)
        order = torch.argsort(values, dim=-1, descending=True, stable=True)[..., :keep]
        return values.gather(-1, order), places.gather(-1, order)
    top = values.topk(keep, dim=-1)
    return top.values, places.gather(-1, top.indices)


def _ring_topk(module, recipe, hidden, q_resid, position_embeddings, local_keys, mask, lay,
               pos, pg, world: int, rank: int, seqlen: int, ties: str = "topk"):
    """[B, L, k] global key positions selected for this rank's query slots (-1: none), by a
    running top (k + 1) as every rank's indexer keys pass round the ring: no rank holds a
    score row or a mask row over all S keys (per rank: one block of keys in flight, a chunk
    of scores against it, [B, L, k + 1] kept; [B, L, k] under "position", which needs no
    agreement). The scores are the family's own (its
    operations on the same values); the top k of a row is then the set ``torch.topk`` keeps
    on the one-process row whenever the row's k-th and (k + 1)-th scores differ. Where they
    tie in some row of some rank, ``torch.topk``'s own choice among the tied keys is only
    known from the whole row: every rank returns None (one agreement), and the caller
    selects by whole rows."""
    from ....comm import RingComm

    b, n = hidden.shape[:2]
    device = hidden.device
    k = min(int(module.index_topk), seqlen)
    cos, sin = position_embeddings
    q, weights, scale = recipe(module, hidden, q_resid, cos, sin)
    keep = min(k + 1, seqlen) if ties == "topk" else k
    best = torch.full((b, n, keep), float("-inf"), device=device)
    where = torch.full((b, n, keep), -1, dtype=torch.long, device=device)
    comm = RingComm(pg)
    block = local_keys.contiguous()
    heads = q.shape[2]
    chunk = max(1, RING_SCORE_ELEMENTS // max(1, b * heads * block.shape[1]))
    for step in range(world):
        hop = None
        if step < world - 1:
            hop = comm.hop(block, torch.empty_like(block), comm.KV_TAG,
                           what=f"indexer keys, step {step}")
        src = (rank - step) % world
        kpos = local_positions(lay, src, world, seqlen).to(device)
        real = kpos < seqlen
        keys_t = block.transpose(-1, -2).float().unsqueeze(1)  # [B, 1, D, Lb]
        for a in range(0, n, chunk):
            z = min(n, a + chunk)
            scores = torch.matmul(q[:, a:z], keys_t)
            if scale is not None:
                scores.mul_(scale)
            index = torch.matmul(weights[:, a:z].unsqueeze(-2), scores.relu_()).squeeze(-2)
            del scores
            seen = evaluate(mask, seqlen, pos[a:z], kpos, b, 1)[:, 0] & real
            values = torch.cat([best[:, a:z], index.masked_fill_(~seen, float("-inf"))], dim=-1)
            places = torch.cat([where[:, a:z], kpos.expand(b, z - a, -1)], dim=-1)
            best[:, a:z], where[:, a:z] = _merge(values, places, keep, ties)
        if hop is not None:
            block = hop.wait()
    if keep > k:  # the "topk" rule below S: one agreement on whether some row ties
        rows = (pos < seqlen).view(1, -1)
        kth, after = best[..., k - 1], best[..., k]
        tied = ((kth == after) & (kth > float("-inf")) & rows).any().to(torch.int64)
        torch.distributed.all_reduce(tied, op=torch.distributed.ReduceOp.MAX, group=pg)
        if bool(tied):
            return None
    picked = where[..., :k]
    return torch.where(best[..., :k] > float("-inf"), picked, -1).to(torch.int32)


_TIES = "_ringattn_indexer_ties"
TIE_RULES = ("topk", "position")


def indexer_ties(model, rule: str):
    """Choose how the DSA indexers of a converted ``model`` break ties at the k-th score
    under a ring context; returns ``model``.

    * ``"topk"`` (the default): the keys ``torch.topk`` keeps on the one-process score row,
      as transformers' model selects them on this device. Calls in which no row ties at its
      k-th score select by the ring's running top k (O(S / W + k) per rank); a call in which
      some row ties selects by whole score rows (every rank scores its queries against all
      S keys, in chunks).
    * ``"position"``: among keys of equal score, the lowest positions first, on every
      layout and W: always the ring's running top k. A row without a tie at its k-th score
      selects what transformers does; a tied row may select other tied keys than
      ``torch.topk`` (whose choice differs between devices). ringattn's own reference is the
      model under a ring context of one rank.

    Raises:
        TypeError: ``model`` is not a converted model with DSA indexers (named).
        ValueError: ``rule`` not one of ``TIE_RULES``.
    """
    if rule not in TIE_RULES:
        raise ValueError(f"indexer_ties: rule must be one of {TIE_RULES}, got {rule!r}")
    found = [m for m in model.modules() if isinstance(m, _Indexer)] if isinstance(
        model, torch.nn.Module) else []
    if not found:
        raise TypeError(f"indexer_ties takes a model with DSA indexers converted by "
                        f"ra_hf.convert, got {type(model).__name__}")
    unknown = sorted({type(m).__name__ for m in found if _recipe(m) is None})
    if rule == "position" and unknown:
        raise ValueError(f"indexer_ties: ringattn has no score recipe for {unknown}; only "
                         f"'topk' (whole score rows) serves them")
    for m in found:
        m.__dict__[_TIES] = rule
    return model


def crc(value) -> int:
    """A number for ``value``'s repr, for an agreement's fields."""
    return zlib.crc32(repr(value).encode()) & 0x7FFFFFFF


def _dtype_code(dtype) -> int:
    return (torch.float32, torch.float64, torch.bfloat16, torch.float16).index(dtype) \
        if dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16) else 9


def convert_indexer(model) -> None:
    """Replace the indexer modules of a DSA model by ones that select over the whole
    sequence under a ring context."""
    found = [m for m in model.modules()
             if type(m).__name__.endswith("Indexer") and hasattr(m, "index_topk")
             and type(m).__module__.startswith("transformers.")]
    if not found:
        raise ValueError(f"{type(model).__name__} has no indexer to convert")
    for module in found:
        module.__class__ = swap_class(_Indexer, type(module))
    bind_context(model, found)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
