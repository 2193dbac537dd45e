"""NVIDIA ModelOpt integration: its Eagle3 training under context parallelism, exact.

Legend: B batch, S global seq, L local seq (this rank's shard), H hidden size, V target
vocabulary, Vd draft vocabulary, T ``eagle_ttt_steps``, W context-parallel ranks.

A ModelOpt user keeps ``mtsp.convert(model, [("eagle", config)])``, ModelOpt's data,
collators, loss and ``TrainingArguments``; the switch is one ``register`` call before the
conversion, ``attn_implementation="ringattn"`` for the target, and ``EagleRingTrainer`` in
place of ModelOpt's example trainer (docs/modelopt.md):

    from ringattn.integrations import modelopt as ra_mo
    ra_mo.register(LlamaForCausalLM)            # before mtsp.convert (or a restore)
    model = LlamaForCausalLM.from_pretrained(path, attn_implementation="ringattn")
    mtsp.convert(model, [("eagle", eagle_cfg)])
    trainer = ra_mo.EagleRingTrainer(model=model, args=args, train_dataset=ds,
                                     data_collator=collator)

Nothing of ModelOpt, transformers or torch is patched. ``register`` puts ``RingEagleModel``
(a subclass of ModelOpt's ``HFEagleModel``) in ModelOpt's ``EagleDMRegistry`` for the
target's class, so ``mtsp.convert`` builds the Eagle model from it, and registers the draft's
TTT attention under ``TTT_NAME`` in transformers' ``AttentionInterface``. The saved
``modelopt_state`` is ModelOpt's own ("eagle" and its config): checkpoints load without
ringattn.

What becomes global under CP (ModelOpt's own one-process computation is the contract):
the rolls of the input ids/embeddings and of the draft's hidden states (ModelOpt rolls
each shard on its own, so every shard's boundary token is wrong: see docs/modelopt.md), the
TTT loss slices, the loss normalisation (ModelOpt's CP averages per-rank means), the
accuracies, the padding masks, ``loss_mask`` and offline ``base_model_outputs`` (which
ModelOpt's CP does not shard). The draft runs ``ringattn.eagle3.ttt_attention``: only the
step-0 keys ride the ring; the keys of the later TTT steps stay beside their queries.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, replace

import torch
import torch.distributed as dist
from modelopt.torch.speculative.eagle.conversion import EagleDMRegistry
from modelopt.torch.speculative.plugins.hf_eagle import HFEagleModel
from modelopt.torch.speculative.plugins.modeling_eagle import EagleBaseModelOutput
from modelopt.torch.speculative.plugins.modeling_final_norm import _maybe_apply_base_final_norm
from modelopt.torch.speculative.utils import temporary_set_config_value
from transformers import DynamicCache, PreTrainedModel
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding
from transformers.utils import ModelOutput

from ..batch import RingContext, shard_batch
from ..eagle3.attention import TTT_STRATEGIES, ttt_attention
from ..eagle3.shift import Lookahead
from ..eagle3.teacher import TeacherHead, check_kept_logits, keep_final_hidden, tiled_ttt_loss
from ..layouts import DEFAULT_LAYOUT, local_positions
from ..loss import DEFAULT_TILE, tile_rows
from ..masks import _KeyPadding
from ..sharding import shard
from ..structure import plain_layer_problem, plain_weights
from . import transformers as ra_hf
from .transformers.head import LogitsNotComputed, teacher_head
from .trainers.hf_trainer import RingTrainer

__all__ = ["TTT_NAME", "PADDING_MODES", "TEACHERS", "TTTMask", "RingEagleModel", "EagleRingTrainer",
           "register", "shard_eagle_batch", "ttt_attention_forward", "served_draft",
           "export_draft"]

TTT_NAME = "ringattn_eagle3"
"""The draft's attention implementation while ``RingEagleModel`` trains under CP."""

TEACHERS = ("auto", "tiled", "logits")
"""``RingEagleModel.forward``'s ``teacher`` values (see there)."""

PADDING_MODES = ("modelopt", "every_step")
"""How the draft masks padded keys: "modelopt" as ModelOpt does in one process (at TTT step
0 a row of L < S real tokens hides keys >= L - 1, at later steps nothing); "every_step"
hides keys >= L at every step. They differ only where ``loss_mask`` covers padding."""

# transformers >= 5.19: LlamaRotaryEmbedding.__init__(self, config) lost the ``device``
# argument that ModelOpt 0.47's EagleModule._maybe_init_rope passes (a TypeError). That
# method builds the rotary embedding only when the draft has none, so ``RingEagleModel.modify``
# builds it first, the way transformers now takes it (inv_freq is a non-persistent buffer:
# the state dict and the export are unchanged).
_ROPE_TAKES_DEVICE = "device" in inspect.signature(LlamaRotaryEmbedding.__init__).parameters


@dataclass(frozen=True)
class TTTMask:
    """What the draft's attention at TTT step ``step`` needs; it travels where ModelOpt passes
    its dense mask (``EagleModule.forward`` hands ``attention_mask`` to every layer as is)."""

    ring_context: RingContext
    step: int
    valid_len: tuple[int, ...] | None
    """Row b's step-0 keys >= valid_len[b] are hidden (None: none are)."""


def ttt_attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None,
                          sliding_window=None, **kwargs):
    """transformers attention function of the draft under ``RingEagleModel``'s CP forward.

    Arguments:
        query: [B, Hd, L, D] this TTT step's queries.
        key, value: [B, Hkv, (j + 1) L, D] at TTT step j: ModelOpt's ``DynamicCache`` holds
            the step-0 keys then those of steps 1..j, concatenated.
        attention_mask: a ``TTTMask``.
        dropout: 0 only. scaling: the softmax scale.

    Returns:
        (out [B, L, Hd, D], None).

    Raises:
        TypeError: ``attention_mask`` is not a ``TTTMask`` (the draft runs outside
            ``RingEagleModel``'s CP forward, with a dense mask of its shard).
        ValueError: dropout, a sliding window, or key sets that do not match the TTT step.
    """
    if not isinstance(attention_mask, TTTMask):
        raise TypeError(f"attention {TTT_NAME!r} needs a TTTMask from RingEagleModel's "
                        f"context-parallel forward, got {type(attention_mask).__name__}")
    if dropout != 0:
        raise ValueError(f"attention {TTT_NAME!r} supports dropout 0 only, got {dropout}")
    if sliding_window is not None:
        raise ValueError(f"attention {TTT_NAME!r} has no sliding window, got {sliding_window}")
    mask, n = attention_mask, query.shape[2]
    if key.shape[2] != (mask.step + 1) * n or value.shape[2] != key.shape[2]:
        raise ValueError(f"TTT step {mask.step} needs {mask.step + 1} key sets of {n} rows, got "
                         f"{key.shape[2]} keys and {value.shape[2]} values")
    ctx = mask.ring_context
    keys = [k.transpose(1, 2) for k in key.split(n, dim=2)]
    values = [v.transpose(1, 2) for v in value.split(n, dim=2)]
    out = ttt_attention(query.transpose(1, 2), keys, values,
                        group=ctx.mesh if ctx.mesh is not None else ctx.group,
                        layout=ctx.layout, seqlen=ctx.seqlen, softmax_scale=scaling,
                        valid_len=mask.valid_len, strategy=ctx.strategy)
    ctx.record_call()
    return out, None


def _row_lengths(ctx: RingContext, b: int) -> tuple[int, ...]:
    """Each row's real tokens (right padding), from the batch's ring context.

    Raises:
        ValueError: left padding, or padding between real tokens.
    """
    if ctx.left_padding is not None:
        raise ValueError(f"RingEagleModel supports right padding only; the batch has left "
                         f"padding {list(ctx.left_padding)} (ModelOpt's rolls assume the "
                         f"real tokens come first)")
    if ctx.mask is None:
        return (ctx.seqlen,) * b
    if not isinstance(ctx.mask, _KeyPadding):
        raise ValueError("RingEagleModel supports right padding only; the batch's "
                         "attention_mask has padding between real tokens")
    return ctx.mask.valid_len


class RingEagleModel(HFEagleModel):
    """ModelOpt's ``HFEagleModel`` that also trains under context parallelism.

    ``register`` puts it in ``EagleDMRegistry``; ``mtsp.convert`` then builds the Eagle model
    from it. Without a ring context every method is ModelOpt's (plus the rotary fix of
    ``modify``).
    """

    def modify(self, config):
        """ModelOpt's ``modify``, then the draft's rotary embedding built the way this
        transformers takes it (see ``_ROPE_TAKES_DEVICE``)."""
        super().modify(config)
        if (not _ROPE_TAKES_DEVICE and self.eagle_decoder_type == "llama"
                and not hasattr(self.eagle_module, "rotary_emb")):
            self.eagle_module.rotary_emb = LlamaRotaryEmbedding(config=self.eagle_module.config)

    def forward(self, input_ids=None, attention_mask=None, position_ids=None,
                past_key_values=None, inputs_embeds=None, labels=None, use_cache=None,
                output_attentions=None, output_hidden_states=None, cache_position=None,
                logits_to_keep=0, loss_mask=None, ring_context: RingContext | None = None,
                ttt_padding: str = "modelopt", teacher: str = "auto", tile=DEFAULT_TILE,
                **kwargs):
        """ModelOpt's forward; with ``ring_context``, that forward on this rank's shard.

        Arguments (besides ModelOpt's):
            ring_context: the ``RingContext`` of a batch sharded by ``shard_eagle_batch``
                (``input_ids``, ``position_ids``, ``loss_mask`` [B, L] and offline
                ``base_model_outputs`` this rank's shards). None: ModelOpt's forward.
            ttt_padding: one of ``PADDING_MODES``.
            teacher: "tiled": the target's head runs on one position, and the teacher and
                every TTT step's loss are computed ``tile`` rows at a time from the final
                hidden states (no [L, V] or [L, Vd] tensor: ``ringattn.eagle3.teacher``);
                "logits": ModelOpt's [L, V] base logits and [L, Vd] draft logits per step;
                "auto": tiled where the target's head (``teacher_head``: the family's head
                table row; offline, ModelOpt's base ``lm_head``) and the draft's head are
                plain linear maps and no offline ``base_model_logits`` are given.
            tile: rows, or a byte budget of one tile's logits ("16MiB"), as
                ``tiled_lm_loss``'s.

        Returns:
            ModelOpt's ``ModelOutput``. Under CP: ``loss`` is this rank's share (the group's
            sum is ModelOpt's one-process loss), ``train_acc`` the global accuracies,
            ``hidden_states`` the local shard's [B, L, H], ``logits`` its [B, L, V] (the
            logits path) or a ``LogitsNotComputed`` that raises on use (the tiles).

        Raises:
            ValueError: under CP, what it cannot compute exactly, by name, on every rank:
                ``eagle_mix_hidden_states``, ``eagle_base_lora``, an unfrozen base, a draft
                other than "llama", a cache, ``inputs_embeds``, left or inner padding,
                packed documents, a strategy ``ttt_attention`` lacks, a bad ``ttt_padding``.
        """
        if ring_context is None:
            return super().forward(
                input_ids, attention_mask=attention_mask, position_ids=position_ids,
                past_key_values=past_key_values, inputs_embeds=inputs_embeds, labels=labels,
                use_cache=use_cache, output_attentions=output_attentions,
                output_hidden_states=output_hidden_states, cache_position=cache_position,
                logits_to_keep=logits_to_keep, loss_mask=loss_mask, **kwargs)
        self._check_cp(ring_context, past_key_values, inputs_embeds, ttt_padding, teacher, tile)
        return self._cp_forward(input_ids, position_ids, loss_mask, ring_context, ttt_padding,
                                kwargs.get("base_model_outputs"), teacher, tile)

    def _check_cp(self, ctx, past_key_values, inputs_embeds, ttt_padding, teacher,
                  tile) -> None:
        """Refuse, before any collective, what the CP forward cannot compute exactly (the
        same decision on every rank: configuration and the batch's context only)."""
        refused = [
            (self.eagle_mix_hidden_states, "eagle_mix_hidden_states=True (its random rows are "
             "drawn per shard)"),
            (self.eagle_base_lora, "eagle_base_lora=True (the preservation loss is a mean over "
             "the local shard)"),
            (not self.eagle_freeze_base_model, "eagle_freeze_base_model=False (the base loss is "
             "a mean over the local shard)"),
            (self.eagle_decoder_type != "llama", f"eagle_decoder_type="
             f"{self.eagle_decoder_type!r} (only the 'llama' draft calls its attention "
             f"through transformers)"),
            (past_key_values is not None, "past_key_values (training takes no cache)"),
            (inputs_embeds is not None, "inputs_embeds (pass input_ids)"),
            (ctx.cu_seqlens is not None, "packed documents (ModelOpt trains padded rows)"),
            (ctx.strategy not in TTT_STRATEGIES, f"strategy {ctx.strategy!r} (use one of "
             f"{TTT_STRATEGIES})"),
            (ttt_padding not in PADDING_MODES, f"ttt_padding={ttt_padding!r} (use one of "
             f"{PADDING_MODES})"),
            (teacher not in TEACHERS, f"teacher={teacher!r} (use one of {TEACHERS})"),
        ]
        for bad, what in refused:
            if bad:
                raise ValueError(f"RingEagleModel under context parallelism does not support "
                                 f"{what}")
        tile_rows(tile, self.eagle_config.draft_vocab_size, torch.float32, "tile")

    def _teacher(self, teacher: str, offline):
        """(the target's ``TeacherHead``, its decoder module (None offline)) when the teacher
        and the TTT loss run in tiles, or (None, None): the logits path.

        Online the head is the family's (``teacher_head``: its head table row applied, as
        its logits are); offline without ``base_model_logits`` it is ModelOpt's own rule,
        the base ``lm_head`` on the (re-normed) hidden states and nothing else."""
        if teacher == "tiled" and offline is not None \
                and offline.get("base_model_logits") is not None:
            raise ValueError("teacher='tiled' with offline base_model_logits: the teacher is "
                             "those logits; drop them from the data, or pass teacher='auto'")
        if teacher == "logits" or (offline is not None
                                   and offline.get("base_model_logits") is not None):
            return None, None
        problem = plain_layer_problem(self._draft_head(), torch.nn.Linear)
        try:
            if problem is not None:
                raise ValueError(f"the draft's lm_head is not read as a plain linear: "
                                 f"{problem}; pass teacher='logits'")
            if offline is not None:
                weight, bias = plain_weights(self._base_model_lm_head, torch.nn.Linear,
                                             "ModelOpt's offline teacher (the base lm_head)")
                family = str(getattr(self._base_llm_config, "model_type", None))
                head = TeacherHead(weight.detach(), None if bias is None else bias.detach(),
                                   None, None, family)
                decoder = None
            else:
                head, decoder = teacher_head(self, super(HFEagleModel, self).forward.__func__)
        except ValueError:
            if teacher == "tiled":
                raise
            return None, None
        dev = head.weight.device.type
        if torch.is_autocast_enabled(dev):  # the head runs under the caller's autocast
            head = replace(head, autocast=torch.get_autocast_dtype(dev))
        return head, decoder

    def _cp_forward(self, input_ids, position_ids, loss_mask, ctx, ttt_padding, offline,
                    teacher, tile):
        pg = ctx.group
        b, n = input_ids.shape
        s, world, rank = ctx.seqlen, dist.get_world_size(pg), dist.get_rank(pg)
        lengths = _row_lengths(ctx, b)
        steps = self.eagle_ttt_steps if self.training else 1
        pos_L = local_positions(ctx.layout, rank, world, s).to(input_ids.device)
        real_L = pos_L < s
        if loss_mask is None:  # ModelOpt's default: the attention mask
            loss_mask = (pos_L < torch.tensor(lengths, device=pos_L.device)[:, None])
        lm_BL = loss_mask.to(torch.float32) * real_L
        if self.eagle_offline and offline is None:
            raise ValueError("an offline Eagle model needs base_model_outputs")
        head, decoder = self._teacher(teacher, offline if self.eagle_offline else None)
        final_BLH = None
        if self.eagle_offline:
            base = EagleBaseModelOutput.from_offline_dict(offline)
            if base.logits is None:  # ModelOpt's own rule for a pre-norm hidden state
                final_BLH = _maybe_apply_base_final_norm(base.out_hiddens, offline,
                                                         self._base_model_norm)
                if head is None:
                    base.logits = self._base_model_lm_head(final_BLH)
        else:
            with keep_final_hidden(decoder, n) as (extra, final):
                base, _ = self._eagle_base_model_forward(
                    input_ids, None, position_ids, None, True, None, ring_context=ctx, **extra)
            ctx.check_consumed(self)
            if head is not None:  # its logits at one position: the head's output, bit for bit
                final_BLH = final[0] if final else None
                check_kept_logits(self, head, final_BLH, base.logits, pg)
        with torch.no_grad():
            emb_BLH = (base.input_embeds if base.input_embeds is not None
                       else self._base_model_embeddings(input_ids)).detach()
        hidden_BLH = (self.eagle_module.fc(base.aux_hiddens)
                      if self.eagle_config.use_aux_hidden_state else base.out_hiddens)
        mapped = self.eagle_config.draft_vocab_size != self.eagle_config.vocab_size
        # token p + 1 + j of every chain p at step j, across shard boundaries
        ahead = Lookahead(group=pg, layout=ctx.layout, seqlen=s, width=steps)
        if head is not None:  # final hidden rows travel; the teacher is computed per tile
            teacher_d = head.restricted(self._draft_rows()) if mapped else head
            ext_teacher = ahead.extend(final_BLH.detach())
        else:
            logits = self._map_logits_to_draft_vocab(base.logits) if mapped else base.logits
            ext_teacher = ahead.extend(torch.softmax(logits, dim=2).detach())
            ext_top = ahead.extend(logits.argmax(dim=-1).detach())
            del logits
        ext_lm, ext_emb = ahead.extend(lm_BL), ahead.extend(emb_BLH)
        # ModelOpt divides step j's loss by the loss_mask of positions >= 1 + j (global)
        den = torch.stack([(lm_BL * (pos_L >= 1 + j)).sum() for j in range(steps)]).double()
        dist.all_reduce(den, group=pg)
        weights = None  # the tiled path's per-step weights (host floats: one sync)
        if head is not None:
            weights = [self.eagle_loss_decay_factor ** j / (den[j].float() + 1e-5).item()
                       for j in range(steps)]
        if ttt_padding == "modelopt":
            first = tuple(length if length == s else length - 1 for length in lengths)
            valid = [first if any(x < s for x in first) else None] + [None] * (steps - 1)
        else:
            every = lengths if any(x < s for x in lengths) else None
            valid = [every] * steps
        cache = DynamicCache(config=self.eagle_module.config)
        self.eagle_module._maybe_init_rope(device=hidden_BLH.device)
        draft_head = self._draft_head()
        loss, counts = None, torch.zeros(2, steps, dtype=torch.float64)
        normed, actives = [], []
        with temporary_set_config_value(self.eagle_module.config, "_attn_implementation",
                                        TTT_NAME):
            for j in range(steps):
                # ModelOpt's _eagle_forward without its head (the head runs below, or in tiles)
                post_BLH, hidden_BLH, cache = self.eagle_module(
                    hidden_BLH, ahead.take(ext_emb, 1 + j), attention_mask=TTTMask(ctx, j, valid[j]),
                    position_ids=position_ids + j, use_cache=True, past_key_values=cache)
                lm = ahead.take(ext_lm, 1 + j)
                counts[1, j] = lm.bool().sum()
                if head is not None:
                    normed.append(post_BLH)
                    actives.append(lm)
                    continue
                elog_BLV = draft_head(post_BLH)
                num = (lm[..., None] * ahead.take(ext_teacher, 1 + j)
                       * torch.log_softmax(elog_BLV, dim=2)).sum()
                term = self.eagle_loss_decay_factor ** j * (-num / (den[j].float() + 1e-5))
                loss = term if loss is None else loss + term
                with torch.no_grad():
                    counts[0, j] = ((elog_BLV.argmax(-1) == ahead.take(ext_top, 1 + j))
                                    & lm.bool()).sum()
        if head is not None:
            loss, _, hits = tiled_ttt_loss(draft_head, normed, teacher_d, ahead, ext_teacher,
                                           actives, 1.0, weights, tile, top_of="logits")
            counts[0] = hits.cpu()
        dist.all_reduce(counts, group=pg)
        accs = (counts[0] / counts[1].clamp_min(1)).tolist()
        logits_out = base.logits if head is None else _EagleLogitsNotComputed()
        return ModelOutput(loss=loss, logits=logits_out, past_key_values=None,
                           hidden_states=base.out_hiddens, train_acc=[accs], eagle_loss=loss,
                           preservation_loss=None)

    def _draft_head(self):
        """The draft's head, as ModelOpt's ``_eagle_forward`` picks it."""
        return (self.eagle_module.lm_head if hasattr(self.eagle_module, "lm_head")
                else self._base_model_lm_head)

    def _draft_rows(self) -> torch.Tensor:
        """[Vd] the target's vocabulary row of each draft token (``d2t``, as
        ``_map_logits_to_draft_vocab`` reads it)."""
        d2t = self.eagle_module.d2t
        return torch.arange(len(d2t), device=d2t.device) + d2t


class _EagleLogitsNotComputed(LogitsNotComputed):
    """``RingEagleModel``'s ``out.logits`` when its teacher ran in tiles."""

    __slots__ = ()
    MESSAGE = ("out.logits was not computed: the Eagle teacher and loss ran in tiles from the "
               "target's final hidden states (teacher='auto' or 'tiled'), one tile of logits "
               "at a time, none kept. For this shard's [B, L, V] logits pass teacher='logits' "
               "to RingEagleModel's forward or EagleRingTrainer")


def shard_eagle_batch(batch: dict, *, group=None, layout: str = DEFAULT_LAYOUT,
                      strategy: str = "ring") -> dict:
    """This rank's shard of a ModelOpt Eagle batch, ready for ``model(**local)``.

    Arguments:
        batch: what ModelOpt's collators give (the same on every rank): ``input_ids`` [B, S],
            ``attention_mask``, ``loss_mask`` (default: ``attention_mask``, as ModelOpt),
            ``labels`` (unused by a frozen base) and, offline, ``base_model_outputs`` (a
            dict; its [B, S, ...] tensors are sharded, other entries kept).
        group, layout, strategy: as for ``ringattn.shard_batch``.

    Returns:
        ``input_ids``, ``position_ids``, ``loss_mask`` [B, L], ``ring_context`` and
        offline ``base_model_outputs``.

    Raises:
        ValueError: a batch without ``input_ids`` [B, S] or with misshapen entries.
    """
    ids = batch.get("input_ids")
    if not isinstance(ids, torch.Tensor) or ids.dim() != 2:
        raise ValueError("batch['input_ids'] must be a [B, S] tensor")
    b, s = ids.shape
    mask = batch.get("attention_mask")
    loss_mask = batch.get("loss_mask")
    if loss_mask is None:
        loss_mask = mask if mask is not None else torch.ones_like(ids)
    glob = {"input_ids": ids, "loss_mask": loss_mask}
    if mask is not None:
        glob["attention_mask"] = mask
    local = shard_batch(glob, group=group, layout=layout, extra_keys=("loss_mask",),
                        strategy=strategy)
    outputs = batch.get("base_model_outputs")
    if outputs is not None:
        ctx = local["ring_context"]
        local["base_model_outputs"] = {
            key: shard(t, group=ctx.group, layout=layout, dim=1, seqlen=s)
            if isinstance(t, torch.Tensor) and t.dim() >= 2 and tuple(t.shape[:2]) == (b, s)
            else t for key, t in outputs.items()}
    return local


class EagleRingTrainer(RingTrainer):
    """``RingTrainer`` for a ``RingEagleModel``: ModelOpt's data, collators and arguments.

    Arguments (besides ``RingTrainer``'s: layout, strategy, ulysses_size, cp_size):
        ttt_padding: one of ``PADDING_MODES`` ("modelopt": ModelOpt's own masks).
        teacher, tile: ``RingEagleModel.forward``'s (default "auto": the teacher and the
            TTT loss in tiles of "16MiB" of logits wherever the heads allow).

    Gradient accumulation as ModelOpt's trainer under transformers' Trainer: with labels in
    the batch (ModelOpt's collators give them) the optimizer step takes the SUM of the
    micro-batches' mean losses (Trainer does not divide by the accumulation steps because
    the model takes loss kwargs); without labels, their mean.

    Raises:
        TypeError: a model that is not a ``RingEagleModel`` (call ``register`` before
            ``mtsp.convert``).
        ValueError: what ``RingTrainer`` refuses; a bad ``ttt_padding``, ``teacher`` or
            ``tile``.
    """

    loss_is_scaled_for_ga = None  # Trainer's own rule, as ModelOpt trains

    def __init__(self, *args, ttt_padding: str = "modelopt", teacher: str = "auto",
                 tile=DEFAULT_TILE, **kwargs):
        model = kwargs.get("model", args[0] if args else None)
        if not isinstance(model, RingEagleModel):
            raise TypeError(f"EagleRingTrainer needs a RingEagleModel, got "
                            f"{type(model).__name__}: call ringattn.integrations.modelopt."
                            f"register(<target class>) before mtsp.convert")
        if ttt_padding not in PADDING_MODES:
            raise ValueError(f"ttt_padding must be one of {PADDING_MODES}, got {ttt_padding!r}")
        if teacher not in TEACHERS:
            raise ValueError(f"teacher must be one of {TEACHERS}, got {teacher!r}")
        tile_rows(tile, 1, torch.float32, "tile")
        kwargs.setdefault("loss_tile", None)  # ModelOpt's Eagle loss, not the causal-LM one
        super().__init__(*args, **kwargs)
        self.ttt_padding, self.teacher, self.tile = ttt_padding, teacher, tile
        self.train_accs: list[list[float]] = []

    def _shard(self, inputs: dict) -> dict:
        return shard_eagle_batch(inputs, group=self.attn_group, layout=self.layout,
                                 strategy=self.strategy)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The micro-batches of one optimizer step, sharded; a count that is not None
        exactly when the batches have labels (what decides Trainer's GA scaling)."""
        shards, count = [], None
        for _ in range(num_batches):
            try:
                batch = next(epoch_iterator)
            except StopIteration:
                break
            if batch.get("labels") is not None:
                n = (batch["labels"] != -100).sum()
                count = n if count is None else count + n
            shards.append(self._shard(batch))
        return shards, None if count is None else count.to(device)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """This rank's share of ModelOpt's loss, times the number of processes (DDP averages
        the gradients; the shares' gradients add up)."""
        local = inputs if "ring_context" in inputs else self._shard(inputs)
        outputs = model(**local, ttt_padding=self.ttt_padding, teacher=self.teacher,
                            tile=self.tile)
        if self.model.training:
            self.train_accs.append(outputs.train_acc[0])
        loss = outputs.loss * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """The batch's eval loss (ModelOpt evaluates one TTT step), the same on every rank.

        Returns:
            (loss 0-d, None, None).
        """
        inputs = self._prepare_inputs(inputs)
        local = self._shard(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            outputs = model(**local, ttt_padding=self.ttt_padding, teacher=self.teacher,
                            tile=self.tile)
        loss = outputs.loss.detach().float()
        dist.all_reduce(loss, group=local["ring_context"].group)
        return loss, None, None


def register(target=None) -> str:
    """Register ring attention for ModelOpt's Eagle training; returns ``TTT_NAME``.

    Registers the target's "ringattn" attention (``integrations.transformers.register``), the
    draft's TTT attention under ``TTT_NAME``, and, given a target, ``RingEagleModel`` in
    ModelOpt's ``EagleDMRegistry`` for its class. Idempotent.

    Arguments:
        target: the target model class (e.g. ``LlamaForCausalLM``) or an unconverted model;
            None: register the attention functions only.

    Raises:
        TypeError: ``target`` is not a transformers ``PreTrainedModel`` (class), or a model
            ModelOpt already converted.
        ValueError: the class is already registered in ``EagleDMRegistry`` to another
            Eagle model (e.g. ModelOpt's own, by an earlier ``mtsp.convert``).
    """
    from transformers import AttentionInterface

    ra_hf.register()
    AttentionInterface.register(TTT_NAME, ttt_attention_forward)
    if target is None:
        return TTT_NAME
    if isinstance(target, HFEagleModel):
        raise TypeError(f"{type(target).__name__} is already converted by ModelOpt: register "
                        f"its class before mtsp.convert")
    cls = target if isinstance(target, type) else type(target)
    if not issubclass(cls, PreTrainedModel):
        raise TypeError(f"register takes a transformers PreTrainedModel class or model, got "
                        f"{target!r}")
    if cls in EagleDMRegistry:
        eagle = EagleDMRegistry.get(cls)
        if issubclass(eagle, RingEagleModel):
            return TTT_NAME
        raise ValueError(f"{cls.__name__} is already registered in ModelOpt's EagleDMRegistry "
                         f"to {eagle.__name__} (an earlier mtsp.convert registers it to "
                         f"HFEagleModel): call register before converting any {cls.__name__}")
    EagleDMRegistry.register({cls: f"ringattn.{cls.__name__}"})(RingEagleModel)
    return TTT_NAME


def served_draft(model):
    """The ``ringattn.eagle3.Eagle3Draft`` that vLLM and SGLang compute from ModelOpt's
    export of ``model``'s draft (its weights, draft vocabulary and auxiliary layers, the
    RoPE it was trained with), on the CPU.

    It is not exactly the function ModelOpt trains: ModelOpt 0.47 feeds the draft's
    attention ``hidden_norm(input_layernorm(h))`` (its pre-hook runs after the decoder
    layer's own ``input_layernorm``), the servers ``hidden_norm(h)``. The two differ through
    RMSNorm's epsilon while ``input_layernorm``'s weight is one, and by much more once
    training moves it (docs/modelopt.md, "Serving"). ``export_draft`` warns.

    Raises:
        TypeError: ``model`` is not a ModelOpt Eagle model.
        ValueError: what ``ringattn.eagle3.load_draft`` refuses (a draft other than one
            Llama layer with aux hidden states, ModelOpt's MTP / parallel draft options).
    """
    import tempfile

    from ..eagle3.export import load_draft

    if not isinstance(model, HFEagleModel):
        raise TypeError(f"served_draft takes a model converted by mtsp.convert (an "
                        f"HFEagleModel), got {type(model).__name__}")
    with tempfile.TemporaryDirectory() as tmp, \
            temporary_set_config_value(model, "eagle_export_rope_scaling", {}):
        model.get_exporter().export(tmp)  # ModelOpt's own exporter, at the trained RoPE
        return load_draft(tmp, embed_tokens=model.get_input_embeddings().weight)


def export_draft(model, path, format: str = "speculators", *, target=None) -> None:
    """Write ``model``'s ModelOpt draft into directory ``path`` so that vLLM serves the
    auxiliary layers it was trained on (``ringattn.eagle3.export_draft`` of
    ``served_draft(model)``; "speculators" is vLLM's format, "sglang" SpecForge's).

    ModelOpt 0.47's own export writes its layer ids in ``eagle_config``, which vLLM 0.32
    reads as hidden-state indices, one layer early (tests/serving/test_vllm.py shows vLLM
    proposing other tokens from it); and by default it exports YaRN RoPE (factor 32) for a
    draft trained with the default RoPE. This export writes the ids in each server's
    meaning and the RoPE the draft was trained with.

    Warns (``UserWarning``, naming how far ``input_layernorm``'s weight is from one): the
    served draft is not exactly the trained one (see ``served_draft``).

    Arguments:
        target: as ``ringattn.eagle3.export_draft``'s (recorded for "speculators"); None:
            the model's own ``name_or_path`` when it is a local directory.
    """
    import os
    import warnings

    from ..eagle3.export import export_draft as _export

    draft = served_draft(model)
    norm = model.eagle_module.layers[0].input_layernorm.weight.detach().float()
    warnings.warn(f"ModelOpt trains its draft on hidden_norm(input_layernorm(h)); vLLM and "
                  f"SGLang compute hidden_norm(h) (input_layernorm's weight is "
                  f"{float((norm - 1).abs().max()):.3g} from one at most): the served draft is "
                  f"not exactly the trained one (docs/modelopt.md, 'Serving')", UserWarning,
                  stacklevel=2)
    if target is None:
        name = getattr(model.config, "_name_or_path", None)
        target = name if name and os.path.isdir(name) else None
    _export(draft, path, format, target=target)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
