"""The Eagle3 draft model and its TTT training step, one code path with or without CP.

Legend: B batch, L local seq (S without CP), S global seq, H hidden size, V target vocab,
Vd draft vocab, T TTT steps.

The draft is one Llama decoder layer (transformers' ``LlamaRMSNorm``, ``LlamaMLP``,
``LlamaRotaryEmbedding``, ``apply_rotary_pos_emb``) whose attention input is
[norm(token embedding); norm(hidden)] (2H wide), fed at step 0 by ``fc`` of the target's
three auxiliary hidden states and afterwards by its own previous output. Its head predicts
the draft vocabulary; ``d2t`` (draft id -> target id offset) and ``t2d`` (target id -> in the
draft vocabulary) map between the two, as in EAGLE's checkpoints.

The training step (``eagle3_step``), with SpecForge's alignment: at step j the draft at
index i reads token i + 1 + j, is taught by the target's distribution at position i + 1 + j
restricted to the draft vocabulary, and counts where loss_mask[i + j] is set, position
i + 1 + j is a real token of the same document (SpecForge also trains a right-padded row's
last real token against the target's logits at the first padding position; that teacher
is not a prediction of anything, so it is not trained on here) and the target's top
token is in the draft vocabulary. Step j's loss is the soft cross-entropy
summed over those tokens / (B * S); the total weighs step j by ``decay ** j``. Under CP
every shift reads across shard boundaries through ``Lookahead``, RoPE uses global positions
+ j, and the attention is ``ttt_attention``; without CP it is ``dense_ttt_attention``.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from functools import lru_cache

import torch
import torch.distributed as dist
from torch import nn

from ..comm import collective, resolve_group
from ..masks import check_cu_seqlens
from ..sharding import positions, shard
from .attention import dense_ttt_attention, ttt_attention
from ..loss import DEFAULT_TILE
from .shift import Lookahead
from .teacher import (TeacherHead, check_kept_logits, keep_final_hidden, marks, teacher_head,
                      tiled_ttt_loss)

__all__ = ["Eagle3Draft", "TargetOutputs", "StepResult", "aux_layer_ids", "capture_aux_hidden",
           "check_aux_layers", "decoder_layers", "draft_vocabulary", "run_target",
           "shard_target_outputs", "eagle3_step"]


def aux_layer_ids(num_layers: int) -> tuple[int, int, int]:
    """EAGLE3's auxiliary layers (low, middle, high), as 0-based decoder-layer indices whose
    raw OUTPUT the draft reads (before the final norm; ``capture_aux_hidden``): SpecForge's
    default (1, n // 2 - 1, n - 4) where those are strictly increasing (n >= 7); for
    4 <= n < 7, (0, (n - 1) // 2, n - 2), which stays below the last layer, whose output
    SGLang's capture loop never reaches; for n = 3, (0, 1, 2) (vLLM captures the last
    layer's raw output, SGLang does not).

    Raises:
        ValueError: fewer than 3 layers (three distinct layers are needed: vLLM captures a
            repeated id once).
    """
    if not isinstance(num_layers, int) or isinstance(num_layers, bool) or num_layers < 3:
        raise ValueError(f"Eagle3 reads three distinct target layers; got num_layers={num_layers!r}")
    if num_layers == 3:
        return (0, 1, 2)
    ids = (1, num_layers // 2 - 1, num_layers - 4)
    if not ids[0] < ids[1] < ids[2]:
        ids = (0, (num_layers - 1) // 2, num_layers - 2)
    return ids


def check_aux_layers(layers, num_layers: int | None = None) -> tuple[int, ...]:
    """``layers`` as a tuple of ints, checked as the servers need them.

    Arguments:
        num_layers: the target's decoder layers; None: not known here.

    Raises:
        ValueError: not three strictly ascending ids in [0, num_layers) (vLLM sorts and
            de-duplicates the ids it captures, so any other order or a repeat would feed
            ``fc`` other states than training did).
    """
    ids = tuple(int(i) for i in layers)
    top = float("inf") if num_layers is None else num_layers
    if len(ids) != 3 or any(not 0 <= i < top for i in ids) or not ids[0] < ids[1] < ids[2]:
        where = "" if num_layers is None else f" in [0, {num_layers})"
        raise ValueError(f"aux layers must be three strictly ascending decoder-layer indices"
                         f"{where}, got {tuple(layers)!r}")
    return ids


_BLOCK_LISTS = {"rwkv": ("rwkv", "blocks"), "xlstm": ("backbone", "blocks")}
"""Families (model_type) whose decoder layers are not ``model.layers``: (owner, list). Their
blocks return ``(hidden, state, ...)`` with the block's raw output first, before the final
norm, as the captured layers' outputs must be. (RWKV in eval mode also halves the residual
after every ``rescale_every``-th block, outside the block: the capture keeps the block's own
output, as for every other family.)"""


def decoder_layers(target) -> nn.ModuleList:
    """The target's decoder layers (``target.model.layers`` for Llama-like models;
    ``rwkv.blocks`` for RWKV, ``backbone.blocks`` for xLSTM).

    Raises:
        ValueError: a model without such a list.
    """
    owners = [getattr(target, "model", None), getattr(target, "get_decoder", lambda: None)()]
    names = ["layers"]
    family = getattr(getattr(target, "config", None), "model_type", None)
    if family in _BLOCK_LISTS:
        owners.insert(0, getattr(target, _BLOCK_LISTS[family][0], None))
        names.insert(0, _BLOCK_LISTS[family][1])
    for owner in owners:
        for name in names:
            layers = getattr(owner, name, None)
            if isinstance(layers, nn.ModuleList):
                return layers
    raise ValueError(f"{type(target).__name__} has no decoder-layer list (model.layers; "
                     f"{', '.join(f'{o}.{n} for {f}' for f, (o, n) in _BLOCK_LISTS.items())}): "
                     f"the auxiliary hidden states cannot be captured")


def capture_aux_hidden(target, layers, **forward_kwargs):
    """Run ``target(**forward_kwargs)`` and capture the raw outputs of decoder ``layers``, as
    vLLM and SGLang do (``hidden_states + residual`` after the layer, before the final norm;
    transformers' ``output_hidden_states[i + 1]`` equals it except for the last layer, whose
    entry there is normed).

    Arguments:
        layers: decoder-layer indices in [0, n) (repeats allowed).
        forward_kwargs: the model's call (``output_hidden_states`` is not needed).

    Returns:
        (the model's output, [B, L, len(layers) * H] the captured states concatenated).

    Raises:
        ValueError: an index outside the model, or a layer that did not run.
    """
    blocks = decoder_layers(target)
    ids = tuple(int(i) for i in layers)
    bad = [i for i in ids if not 0 <= i < len(blocks)]
    if bad:
        raise ValueError(f"aux layers {bad} lie outside the target's {len(blocks)} decoder layers")
    seen: dict[int, torch.Tensor] = {}

    def keep(i):
        def hook(module, args, output):
            seen[i] = output[0] if isinstance(output, (tuple, list)) else output
        return hook

    handles = [blocks[i].register_forward_hook(keep(i)) for i in sorted(set(ids))]
    try:
        out = target(**forward_kwargs)
    finally:
        for h in handles:
            h.remove()
    missing = [i for i in ids if i not in seen]
    if missing:
        raise ValueError(f"decoder layers {missing} did not run in the target's forward")
    return out, torch.cat([seen[i] for i in ids], dim=-1)


def draft_vocabulary(token_ids: torch.Tensor, vocab_size: int, size: int) -> torch.Tensor:
    """The ``size`` most frequent target token ids in ``token_ids`` (ties: lower id first),
    sorted: the draft vocabulary, as EAGLE3 builds it from the training data."""
    counts = torch.bincount(token_ids.flatten().long().cpu(), minlength=vocab_size).double()
    return top_ids(counts, size)


def top_ids(counts: torch.Tensor, size: int) -> torch.Tensor:
    """The ``size`` ids with the largest ``counts`` [V] (ties: lower id first), sorted.

    Raises:
        ValueError: ``size`` outside [1, V].
    """
    vocab_size = counts.numel()
    if not 1 <= size <= vocab_size:
        raise ValueError(f"draft vocabulary size must lie in [1, {vocab_size}], got {size}")
    order = torch.argsort(-counts.double(), stable=True)  # equal counts: lower id first
    return torch.sort(order[:size]).values


def _check_draft_ids(ids: torch.Tensor, vocab_size: int) -> None:
    """Raises ValueError unless ``ids`` [Vd] is non-empty, strictly ascending and in [0, V).
    """
    if ids.numel() == 0:
        raise ValueError("the draft vocabulary is empty")
    if int(ids.min()) < 0 or int(ids.max()) >= vocab_size:
        raise ValueError(f"draft ids must lie in [0, {vocab_size}), got ids from "
                         f"{int(ids.min())} to {int(ids.max())}")
    down = torch.nonzero(ids[1:] <= ids[:-1]).flatten()
    if down.numel():
        i = int(down[0])
        raise ValueError(f"draft ids must be strictly ascending (SpecForge, speculators and the "
                         f"servers assume a sorted draft vocabulary): id {int(ids[i + 1])} at "
                         f"index {i + 1} follows {int(ids[i])}")


class Eagle3Draft(nn.Module):
    """One-layer Eagle3 draft.

    Arguments:
        config: a transformers ``LlamaConfig`` for the draft layer (hidden_size,
            num_attention_heads, num_key_value_heads, head_dim, intermediate_size,
            rms_norm_eps, rope parameters); ``vocab_size`` is the TARGET's vocabulary.
        target_hidden_size: width of each of the target's three auxiliary hidden states.
        draft_ids: [Vd] strictly ascending target ids of the draft vocabulary (all V of
            them: the whole vocabulary, which both formats export without ``d2t``/``t2d``).
        aux_layers: the target's three auxiliary layers (``aux_layer_ids``), strictly
            ascending, kept for export; None: not known yet.

    Raises:
        ValueError: draft ids not strictly ascending or outside [0, V) (SpecForge,
            speculators and the servers assume a sorted draft vocabulary), or aux layers
            not three strictly ascending indices >= 0.
    """

    def __init__(self, config, target_hidden_size: int, draft_ids: torch.Tensor,
                 aux_layers: tuple[int, int, int] | None = None):
        super().__init__()
        self.config = config
        self.target_hidden_size = target_hidden_size
        if aux_layers is not None:
            aux_layers = check_aux_layers(aux_layers)
        self.aux_layers = aux_layers
        """The target layers whose raw outputs feed ``fc`` (0-based, see ``aux_layer_ids``)."""
        from transformers.models.llama.modeling_llama import (
            LlamaMLP, LlamaRMSNorm, LlamaRotaryEmbedding,
        )

        h, eps = config.hidden_size, config.rms_norm_eps
        self.heads, self.kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or h // self.heads
        draft_ids = torch.as_tensor(draft_ids, dtype=torch.long).reshape(-1).cpu()
        _check_draft_ids(draft_ids, config.vocab_size)
        self.register_buffer("d2t", draft_ids - torch.arange(draft_ids.numel()))
        t2d = torch.zeros(config.vocab_size, dtype=torch.bool)
        t2d[draft_ids] = True
        self.register_buffer("t2d", t2d)
        self.embed_tokens = nn.Embedding(config.vocab_size, h)
        self.embed_tokens.weight.requires_grad_(False)  # the target's, frozen
        self.fc = nn.Linear(3 * target_hidden_size, h, bias=False)
        self.input_layernorm = LlamaRMSNorm(h, eps=eps)
        self.hidden_norm = LlamaRMSNorm(h, eps=eps)
        self.q_proj = nn.Linear(2 * h, self.heads * self.head_dim, bias=False)
        self.k_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        self.v_proj = nn.Linear(2 * h, self.kv_heads * self.head_dim, bias=False)
        self.o_proj = nn.Linear(self.heads * self.head_dim, h, bias=False)
        self.rotary_emb = LlamaRotaryEmbedding(config)
        self.post_attention_layernorm = LlamaRMSNorm(h, eps=eps)
        self.mlp = LlamaMLP(config)
        self.norm = LlamaRMSNorm(h, eps=eps)
        self.lm_head = nn.Linear(h, draft_ids.numel(), bias=False)

    @property
    def whole_vocabulary(self) -> bool:
        """Whether the draft predicts every target token (identity mapping: ``d2t`` all
        zeros)."""
        return self.d2t.numel() == self.t2d.numel()

    @property
    def draft_ids(self) -> torch.Tensor:
        """[Vd] target id of every draft token."""
        return self.d2t + torch.arange(self.d2t.numel(), device=self.d2t.device)

    def layer(self, embeds_BLH, hidden_BLH, position_ids_BL, cache, attend):
        """One TTT step of the decoder layer; appends this step's K/V to ``cache``."""
        from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

        b, n, _ = hidden_BLH.shape
        x = torch.cat([self.input_layernorm(embeds_BLH), self.hidden_norm(hidden_BLH)], dim=-1)
        q = self.q_proj(x).view(b, n, self.heads, self.head_dim)
        k = self.k_proj(x).view(b, n, self.kv_heads, self.head_dim)
        v = self.v_proj(x).view(b, n, self.kv_heads, self.head_dim)
        cos, sin = self.rotary_emb(x, position_ids_BL)
        q, k = apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=2)
        cache[0].append(k)
        cache[1].append(v)
        attn = attend(q, cache[0], cache[1])
        hidden = hidden_BLH + self.o_proj(attn.reshape(b, n, -1))
        return hidden + self.mlp(self.post_attention_layernorm(hidden))

    def logits(self, hidden_BLH):
        return self.lm_head(self.norm(hidden_BLH))


@dataclass
class TargetOutputs:
    """What the draft learns from, for this rank's tokens (all [B, L, ...])."""

    aux_hidden: torch.Tensor
    """[B, L, 3 H_target]: the three auxiliary hidden states, concatenated."""
    logits: torch.Tensor | None
    """[B, L, V]: the target's logits; None when the teacher is computed in tiles from
    ``final_hidden`` and ``head``."""
    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    position_ids: torch.Tensor
    """[B, L] global positions (RoPE)."""
    valid_len: tuple[int, ...] | None
    """Right padding: row b's real tokens are [0, valid_len[b]); None without padding."""
    seqlen: int
    layout: str
    group: object
    """The CP group (None: one process), or the hybrid's (ring, ulysses) DeviceMesh."""
    strategy: str = "ring"
    """How the draft's TTT attention runs (``ttt_attention``'s ``strategy``)."""
    valid_mask: torch.Tensor | None = None
    """[B, L] bool: real tokens (not right padding, not the shards' padding slots); None:
    every slot below S."""
    cu_seqlens: tuple[int, ...] | None = None
    """Packed documents of the (B = 1) rows: flash-attn's offsets over the global S."""
    final_hidden: torch.Tensor | None = None
    """[B, L, H_target]: the target's last hidden states (after its final norm), from which
    ``head`` gives the teacher one tile at a time (``teacher.py``); None with ``logits``."""
    head: TeacherHead | None = None
    """The target's head as the teacher reads it (``teacher.TeacherHead``)."""

    def top_tokens(self, tile=DEFAULT_TILE) -> torch.Tensor:
        """[B, L] the target's top token at each position (``argmax`` over V), from the
        logits or a tile of them at a time."""
        if self.logits is not None:
            return self.logits.argmax(-1)
        return marks(self.head, self.head, None, self.final_hidden, tile,
                     targets_only=True)[0]


def _valid_len(attention_mask):
    if attention_mask is None:
        return None
    keep = attention_mask.to(torch.bool)
    n = keep.sum(1)
    right = torch.arange(keep.shape[1], device=keep.device)[None, :] < n[:, None]
    if not bool((keep == right).all()):
        raise ValueError("Eagle3 batches must be right padded: every attention_mask row must "
                         "be ones followed by zeros")
    return None if bool(keep.all()) else tuple(int(x) for x in n.tolist())


def _loss_mask(batch: dict) -> torch.Tensor:
    """The batch's loss_mask; default: its attention_mask, else all ones."""
    for key in ("loss_mask", "attention_mask"):
        if batch.get(key) is not None:
            return batch[key]
    return torch.ones_like(batch["input_ids"])


@torch.no_grad()
def run_target(target, batch: dict, *, group=None, layout: str = "zigzag",
               aux_layers=None, strategy: str = "ring", teacher: str = "auto") -> TargetOutputs:
    """Run the target on a global batch (the same on every CP rank) and keep this rank's
    share of what the draft needs. Under CP the target runs context-parallel through the
    transformers integration (``attn_implementation="ringattn"``); alone, as it is.

    Arguments:
        batch: ``input_ids`` [B, S]; optional ``attention_mask`` [B, S] (right padding) and
            ``loss_mask`` [B, S] (default: the attention mask, or all ones).
        aux_layers: three decoder-layer indices; default ``aux_layer_ids``.
        strategy: "ring", "ulysses" or "hybrid" (``group`` the hybrid's mesh), for the
            target's attention and the draft's.
        teacher: "tiled": the target's head runs on one position only and the outputs
            carry its final hidden states (``final_hidden``, ``head``: the teacher is
            computed a tile at a time, no [L, V] tensor); "logits": the target's [L, V]
            logits; "auto": tiled where the target's head can be read
            (``teacher.teacher_head``), else the logits.

    Raises:
        ValueError: ``teacher="tiled"`` for a target whose head is not a plain linear map
            of its final hidden state and a row of the head table (named), or whose logits
            at the kept position are not its head's output (on every rank under CP).
    """
    if teacher not in ("auto", "tiled", "logits"):
        raise ValueError(f"teacher must be 'auto', 'tiled' or 'logits', got {teacher!r}")
    head = decoder = None
    if teacher != "logits":
        try:
            head, decoder = teacher_head(target)
        except ValueError:
            if teacher == "tiled":
                raise
    if head is not None:  # the head runs under the autocast the caller's region sets
        dev = head.weight.device.type
        if torch.is_autocast_enabled(dev):
            head = replace(head, autocast=torch.get_autocast_dtype(dev))
    from ..batch import shard_batch

    ids = batch["input_ids"]
    b, s = ids.shape
    valid = _valid_len(batch.get("attention_mask"))
    loss_mask = _loss_mask(batch)
    cu = _documents(batch, b, s)
    keep = _real_tokens(batch)
    layers = aux_layers or getattr(target, "eagle3_aux_layers", None) \
        or aux_layer_ids(target.config.num_hidden_layers)
    if group is None:
        pos = _rope_positions(cu, b, s, ids.device)
        # packed: no attention mask and restarting positions, from which transformers
        # builds its document mask (use_cache=False: it does so only without a cache)
        with keep_final_hidden(decoder, s) as (extra, final):
            out, aux = capture_aux_hidden(
                target, layers, input_ids=ids, position_ids=pos, use_cache=False,
                attention_mask=None if cu is not None else batch.get("attention_mask"), **extra)
        local_ids, lm, local_keep = ids, loss_mask, keep
    else:
        sharded = {"input_ids": ids, "attention_mask": batch.get("attention_mask")}
        if cu is not None:
            sharded["cu_seqlens"] = cu
        local = shard_batch(sharded, group=group, layout=layout, strategy=strategy)
        with keep_final_hidden(decoder, local["input_ids"].shape[1]) as (extra, final):
            out, aux = capture_aux_hidden(target, layers, input_ids=local["input_ids"],
                                          position_ids=local["position_ids"], use_cache=False,
                                          ring_context=local["ring_context"], **extra)
        local["ring_context"].check_consumed(target)
        local_ids = local["input_ids"]
        kw = dict(group=group, layout=layout, seqlen=s, cu_seqlens=cu)
        # global positions (padding slots >= S), or positions inside each packed document
        pos = (positions(s, group=group, layout=layout, device=ids.device).expand(b, -1)
               if cu is None else local["position_ids"])
        both = shard(torch.stack([loss_mask.to(keep.dtype), keep], -1), **kw)  # one agreement
        lm, local_keep = both[..., 0].to(loss_mask.dtype), both[..., 1]
    layout = layout if group is not None else "contiguous"  # one process: no shard padding
    if head is None:
        return TargetOutputs(aux, out.logits, local_ids, lm, pos, valid, s, layout, group,
                             strategy, local_keep.to(torch.bool), cu)
    hidden = final[0] if final else None
    check_kept_logits(target, head, hidden, out.logits, group)
    return TargetOutputs(aux, None, local_ids, lm, pos, valid, s, layout, group, strategy,
                         local_keep.to(torch.bool), cu, hidden, head)


def _documents(batch: dict, b: int, s: int):
    """The batch's packed documents (``cu_seqlens``: flash-attn's offsets over S), or None.

    Raises:
        ValueError: bad offsets, or documents with B > 1.
    """
    cu = batch.get("cu_seqlens")
    if cu is None:
        return None
    cu = check_cu_seqlens(cu, s)
    if b != 1:
        raise ValueError(f"packed documents (cu_seqlens) need B = 1 rows, got B={b}")
    return cu


def _real_tokens(batch: dict) -> torch.Tensor:
    """[B, S] 1 for real tokens (the attention mask; all ones without one)."""
    keep = batch.get("attention_mask")
    return torch.ones_like(batch["input_ids"]) if keep is None else keep


def _rope_positions(cu, b: int, s: int, device) -> torch.Tensor:
    """[B, S] positions: 0..S-1, or restarting at every packed document."""
    pos = torch.arange(s, device=device)
    if cu is not None:
        starts = torch.tensor(cu[:-1], device=device)
        pos = pos - starts[torch.bucketize(pos, starts, right=True) - 1]
    return pos.expand(b, s)


def shard_target_outputs(batch: dict, *, head: TeacherHead | None = None, group=None,
                         layout: str = "zigzag") -> TargetOutputs:
    """This rank's share of PRECOMPUTED target outputs (offline Eagle3 training).

    Arguments:
        batch: global tensors, the same on every CP rank: ``input_ids`` [B, S],
            ``aux_hidden`` [B, S, 3 H_target] (the three auxiliary hidden states,
            concatenated), and the teacher: EITHER ``final_hidden`` [B, S, H_target] (the
            target's last hidden states after its final norm; offline format version 3)
            with its head, OR ``logits`` [B, S, V] (the target's; version 2); optional
            ``attention_mask`` (right padding), ``loss_mask`` [B, S] and ``cu_seqlens``
            (packed documents, B = 1). ``OfflineSamples.batch`` gives one (its version 3
            batches hold the head as ``head``).
        head: with ``final_hidden``, the target's ``TeacherHead`` (default:
            ``batch["head"]``).
        group: the CP group (None: one process keeps everything).
        layout: how to shard (any S).

    Returns:
        ``TargetOutputs`` with ``final_hidden`` and ``head`` (``logits`` None: the teacher
        is computed in tiles), or with ``logits``.

    Raises:
        ValueError: missing or misshapen tensors, both or neither of ``final_hidden`` and
            ``logits``, ``final_hidden`` without a head (or a head of another width, or two
            heads), a head with ``logits``, left padding.
    """
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("batch['input_ids'] must be a [B, S] tensor")
    b, s = ids.shape
    given = [k for k in ("final_hidden", "logits") if batch.get(k) is not None]
    if len(given) != 1:
        raise ValueError(f"batch must hold the teacher as either 'final_hidden' (with the "
                         f"target's head: offline version 3) or 'logits' (version 2), not "
                         f"{' and '.join(map(repr, given)) or 'neither'}")
    teach = given[0]
    if head is not None and batch.get("head") is not None and batch["head"] is not head:
        raise ValueError("two heads: head= and batch['head'] (pass one)")
    head = batch.get("head") if head is None else head
    if teach == "logits" and head is not None:
        raise ValueError("batch['logits'] is the teacher: a head goes with 'final_hidden' "
                         "only (pass no head)")
    if teach == "final_hidden":
        if not isinstance(head, TeacherHead):
            raise ValueError(f"batch['final_hidden'] needs the target's head (head=, a "
                             f"TeacherHead: OfflineSamples.head), got {type(head).__name__}")
        width = batch["final_hidden"].shape[-1]
        if head.weight.dim() != 2 or head.weight.shape[1] != width:
            raise ValueError(f"the head's weight {tuple(head.weight.shape)} does not read "
                             f"batch['final_hidden']'s {width} features")
    for key in ("aux_hidden", teach, "attention_mask", "loss_mask"):
        t = batch.get(key)
        if t is None and key == "aux_hidden":
            raise ValueError(f"batch[{key!r}] is missing")
        if t is not None and (not isinstance(t, torch.Tensor) or tuple(t.shape[:2]) != (b, s)):
            raise ValueError(f"batch[{key!r}] must be a tensor of shape [B={b}, S={s}, ...]")
    valid = _valid_len(batch.get("attention_mask"))
    cu = _documents(batch, b, s)
    parts = {k: batch[k] for k in ("input_ids", "aux_hidden", teach)}
    parts["loss_mask"] = _loss_mask(batch)
    parts["keep"] = _real_tokens(batch)
    if group is None:
        local, layout, pos = parts, "contiguous", _rope_positions(cu, b, s, ids.device)
    else:
        kw = dict(group=group, layout=layout, seqlen=s, cu_seqlens=cu)
        local = {k: shard(v, **kw) for k, v in parts.items()}
        where = positions(s, group=group, layout=layout, cu_seqlens=cu, device=ids.device)
        pos = (where if cu is None else where[1]).expand(b, -1)
    return TargetOutputs(local["aux_hidden"], local.get("logits"), local["input_ids"],
                         local["loss_mask"], pos, valid, s, layout, group, "ring",
                         local["keep"].to(torch.bool), cu, local.get("final_hidden"),
                         head if teach == "final_hidden" else None)


@dataclass
class StepResult:
    loss: torch.Tensor
    """This rank's share of sum_j decay**j loss_j (the CP group's sum is the whole loss)."""
    losses: list[float]
    """Global per-step losses (over the CP group)."""
    accuracies: list[float]
    """Global per-step accuracies (over the CP group; nan where nothing counts)."""
    sums: torch.Tensor
    """[3, T] float64 global (loss, correct, counted) sums, for reducing over DP too."""


class _SoftCrossEntropy(torch.autograd.Function):
    """scale * sum over active rows of -sum_v p_v log softmax(z)_v, with the teacher p read
    through ``Lookahead.take``. It keeps the logits and their logsumexp for the backward and
    takes p again there, instead of keeping p and log softmax(z): one [B, L, Vd] tensor per
    TTT step fewer alive until the backward (the draft vocabulary is large: 32k in
    practice)."""

    @staticmethod
    def forward(ctx, logits, active, scale, ahead, ext_teacher, k):
        p = ahead.take(ext_teacher, k)
        lse = torch.logsumexp(logits, dim=-1)
        ce = lse * p.sum(-1) - (p * logits).sum(-1)  # -(p * (z - lse)).sum(-1)
        ctx.save_for_backward(logits, lse, active)
        ctx.args = (scale, ahead, ext_teacher, k)
        return (ce * active).sum() * scale

    @staticmethod
    def backward(ctx, grad):
        logits, lse, active = ctx.saved_tensors
        scale, ahead, ext_teacher, k = ctx.args
        p = ahead.take(ext_teacher, k)
        weight = (active * (scale * grad)).unsqueeze(-1)
        dz = (torch.exp(logits - lse.unsqueeze(-1)) * p.sum(-1, keepdim=True) - p) * weight
        return dz, None, None, None, None, None


def _check_vocabulary(draft: Eagle3Draft, vocab: int) -> None:
    """The draft's target vocabulary must be the target's (its ``t2d`` maps target ids).

    Raises:
        ValueError: naming both sizes."""
    if draft.t2d.numel() != vocab:
        raise ValueError(f"the draft maps a target vocabulary of {draft.t2d.numel()} tokens "
                         f"(its t2d) but the target's head gives {vocab} logits: a draft built "
                         f"for another target")


@lru_cache(maxsize=8)
def _lookahead(group, layout: str, seqlen: int, width: int, cu_seqlens=None) -> Lookahead:
    """One ``Lookahead`` per (group, layout, S, width, documents): its set-up exchange runs
    once."""
    return Lookahead(group=group, layout=layout, seqlen=seqlen, width=width,
                     cu_seqlens=cu_seqlens)


def eagle3_step(draft: Eagle3Draft, tgt: TargetOutputs, *, steps: int = 7,
                decay: float = 0.8, tile=DEFAULT_TILE) -> StepResult:
    """The TTT forward of one batch: per-step losses and accuracies, the loss to backward.

    One process (``tgt.group`` None) uses the dense TTT mask; under CP, ``ttt_attention``.
    The diagonal keys never leave their rank; every shift of inputs, teacher and masks reads
    across shard boundaries (``Lookahead``: one all_to_all per tensor per batch, after a
    set-up made once per (group, layout, S, steps)).

    With ``tgt.final_hidden`` (``run_target``'s tiled teacher) the teacher and every step's
    loss are computed a tile at a time (``teacher.py``; ``tile``: rows or a byte budget of
    one tile's logits, as ``tiled_lm_loss``'s): the shifts move final hidden rows, and no
    [B, L, V] or [B, L, Vd] tensor exists. With ``tgt.logits``, the untiled computation.
    Both give the same losses, accuracies and gradients.
    """
    if not isinstance(steps, int) or not 1 <= steps <= 64:
        raise ValueError(f"steps must be an int in [1, 64], got {steps!r}")
    b = tgt.input_ids.shape[0]
    ahead = _lookahead(tgt.group, tgt.layout, tgt.seqlen, steps, tgt.cu_seqlens)
    draft_ids = draft.draft_ids
    tiled = tgt.logits is None
    if tiled:
        _check_vocabulary(draft, tgt.head.weight.shape[0])
        teacher_d = tgt.head.restricted(draft_ids)  # [Vd, H]: the draft vocabulary's rows
        _, in_vocab, top_d = marks(tgt.head, teacher_d, draft.t2d, tgt.final_hidden, tile)
        ext_teacher = ahead.extend(tgt.final_hidden)  # hidden rows travel, not probabilities
    else:
        _check_vocabulary(draft, tgt.logits.shape[-1])
        teacher = torch.softmax(tgt.logits[..., draft_ids].float(), dim=-1)  # [B, L, Vd]
        in_vocab, top_d = draft.t2d[tgt.logits.argmax(-1)], teacher.argmax(-1)
        ext_teacher = ahead.extend(teacher)
    ext_top = ahead.extend(top_d)  # the teacher's top draft token (accuracy)
    ext_in_vocab = ahead.extend(in_vocab, False)
    real = tgt.valid_mask
    if real is None:
        real = (tgt.position_ids < tgt.seqlen) if tgt.cu_seqlens is None else \
            torch.ones_like(tgt.loss_mask, dtype=torch.bool)
    # the loss mask and the real-token flags travel together: [B, L, 2]
    ext_flags = ahead.extend(torch.stack([tgt.loss_mask.to(torch.bool), real], -1), False)
    ext_ids = ahead.extend(tgt.input_ids)
    if tgt.group is None:
        def attend(q, keys, values):
            return dense_ttt_attention(q, keys, values, valid_len=tgt.valid_len,
                                       cu_seqlens=tgt.cu_seqlens)
    else:
        def attend(q, keys, values):
            return ttt_attention(q, keys, values, group=tgt.group, layout=tgt.layout,
                                 seqlen=tgt.seqlen, valid_len=tgt.valid_len,
                                 strategy=tgt.strategy, cu_seqlens=tgt.cu_seqlens)
    hidden = draft.fc(tgt.aux_hidden.to(draft.fc.weight.dtype))
    cache: tuple[list, list] = ([], [])
    total = hidden.new_zeros(())
    sums = torch.zeros(3, steps, dtype=torch.float64, device=hidden.device)
    scale = 1.0 / (b * tgt.seqlen)
    normed, actives = [], []
    for j in range(steps):
        embeds = draft.embed_tokens(ahead.take(ext_ids, 1 + j)).to(hidden.dtype)
        hidden = draft.layer(embeds, hidden, tgt.position_ids + j, cache, attend)
        # a token counts where it has a loss and its teacher (position i + 1 + j) is a real
        # token of its document: not right padding, not past the end
        counted = ahead.take(ext_flags, j)[..., 0] & ahead.take(ext_flags, 1 + j)[..., 1]
        active = ahead.take(ext_in_vocab, 1 + j) & counted
        sums[2, j] = counted.sum().double()
        if tiled:  # the head and the loss of every step after the loop, in tiles
            normed.append(draft.norm(hidden))
            actives.append(active)
            continue
        logits = draft.logits(hidden).float()
        loss = _SoftCrossEntropy.apply(logits, active, scale, ahead, ext_teacher, 1 + j)
        total = total + decay ** j * loss
        with torch.no_grad():
            correct = ((logits.argmax(-1) == ahead.take(ext_top, 1 + j)) & active).sum()
            sums[:2, j] = torch.stack([loss.double(), correct.double()])
    if tiled:
        total, losses, hits = tiled_ttt_loss(draft.lm_head, normed, teacher_d, ahead,
                                             ext_teacher, actives, scale,
                                             [decay ** j for j in range(steps)], tile)
        sums[0], sums[1] = losses.to(sums.device), hits.to(sums.device)
    if tgt.group is not None:  # (gloo: CPU tensors; NCCL: the tensors' GPU)
        pg = resolve_group(tgt.group)
        collective("Eagle3's loss and accuracy sums", pg,
                   lambda: dist.all_reduce(sums, group=pg, async_op=True))
    sums = sums.cpu()  # the one host sync of the step
    accs = [float(c / n) if n > 0 else float("nan") for c, n in zip(sums[1], sums[2])]
    return StepResult(total, [float(x) for x in sums[0]], accs, sums)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
