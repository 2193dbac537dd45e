"""TRL's ``SFTTrainer`` and ``DPOTrainer``, context-parallel with ring attention.

Legend: B batch rows, S global seq, L local seq, W world size (the context-parallel group).

Launch with torchrun, one process per rank, a model with ``attn_implementation="ringattn"``
(``ringattn.integrations.transformers.register()`` first), and swap the class:

    from ringattn.integrations.trl import RingSFTTrainer, RingDPOTrainer
    trainer = RingSFTTrainer(model=model, args=SFTConfig(...), train_dataset=ds,
                             processing_class=tokenizer)
    trainer = RingDPOTrainer(model=model, ref_model=ref_model, args=DPOConfig(...),
                             train_dataset=pairs, processing_class=tokenizer)

Both are ``RingTrainerMixin`` (``ringattn.integrations.hf_trainer``) over TRL's trainer: every
rank reads the batches one process reads and holds one shard of each sequence. Logged losses,
gradients and every logged metric equal TRL's trainer in ONE process on the same data
(tested to 1e-5 relative in fp32 on 2 and 3 ranks: tests/integration/test_trl.py). How:

* ``RingSFTTrainer``: each rank runs TRL's fused LM head (per-token log-probabilities, no
  [B, S, V] logits) on its shard, with the labels shifted on the global sequence (packed
  documents: no target crosses a document end) and divides its summed token losses by the
  target count of the whole accumulated batch; the ranks' losses add up to the one-process
  loss and the loss is multiplied by W against DDP's averaging (hf_trainer's rule).
  ``entropy`` and ``mean_token_accuracy`` are the global sums over the CP group divided by
  the global target count; ``num_tokens`` counts the tokens of the global batch.
  ``padding_free`` / ``packing`` batches (one row, ``position_ids`` restarting per document)
  are sharded per document; ring attention keeps the documents apart on any device (no
  flash-attention kernel is needed). Completion-only (tested) and assistant-only losses are
  labels of -100, which the sharding carries.
  MoE router auxiliary loss (TRL turns it on for MoE models: ``aux_loss_enabled``, the
  config's or ``SFTConfig.router_aux_loss_coef``): served for a model converted with
  ``ringattn.integrations.transformers.convert``, whose router loss is global
  (``global_router_loss(model)``: Mixtral's load-balancing loss over the real tokens of
  every rank, its probabilities' gradient all-reduced). TRL's fused head drops the router
  logits from its output, so the trainer hands the backbone's to the converted model's hook
  for that call. Each rank's loss carries ``1 / W`` of TRL's ``coef * aux_loss`` (over the
  accumulation steps, as TRL divides it), so the ranks' losses add up to the one-process
  loss and the gradients to its gradients; ``aux_loss`` is logged with the global value
  (tested: Qwen3-MoE padded with gradient accumulation, Mixtral packed,
  tests/integration/test_sft_router.py). An unconverted MoE model is refused ("convert the
  model first").
* ``RingDPOTrainer``: DPO's loss needs each sequence's log-probability, a SUM over its
  tokens, before any non-linearity. Every rank runs policy and reference on its shards,
  and the per-token outputs of the fused head ([2B, L]: log-probabilities, entropy, mean
  logits, top-1 hits) are gathered into the global [2B, S - 1] tensors with
  ``ringattn.unshard`` (autograd: its backward hands each rank the gradient of its own
  tokens). TRL's own ``_compute_loss`` then runs unchanged on the global tensors, so the
  loss and every metric are the one-process ones, the same on every rank, whatever the loss
  type, ``ld_alpha``, ``use_weighting`` or f-divergence (tested: ``sigmoid``; ``ipo`` +
  ``sft`` with ``ld_alpha``). The loss is multiplied by W for DDP (each rank's gradient
  holds its tokens' share). Memory: O(B S) per rank for the gathered per-token values,
  never O(S V).

TRL's configs default to ``bf16=True`` (autocast), on CPU too: pass ``bf16=False`` for fp32
(the tests do).

Refused with a ValueError (on every rank, before training) where the result could not be
the one-process one: ``cp_size`` below the world size (dp x cp is not wired for TRL's
metrics), ``neftune_noise_alpha`` (each rank would draw other noise), ``use_liger_kernel``,
MoE router auxiliary losses of an unconverted model (SFT) and in DPO (a per-shard mean; its
gathered outputs carry no router logits), vision datasets (``pixel_values`` are not
sharded), and for DPO ``precompute_ref_log_probs`` (TRL runs it on rank-split batches in
``__init__``) and a missing ``ref_model`` (TRL would load one by name, or call the policy
with its adapter disabled, outside the sharding); besides what ``RingTrainerMixin`` refuses.

``trl`` is imported by this module only (``import ringattn`` does not need it).
"""

from __future__ import annotations

import contextlib
import inspect

import torch
import torch.distributed as dist
from trl import DPOTrainer, SFTTrainer
from trl.trainer.utils import FusedCausalLMOutput

from ...batch import shard_batch
from ...sharding import unshard
from .hf_trainer import RingTrainerMixin
from ..transformers import check_attention, check_model, global_router_loss

__all__ = ["RingSFTTrainer", "RingDPOTrainer"]

_TOKENS = "ring_num_tokens"  # the global batch's token count, carried next to a shard


def _bound(trainer_cls, args, kwargs) -> dict:
    """The arguments of a ``trainer_cls(*args, **kwargs)`` call, by name (the mixin's
    keywords left out)."""
    sig = inspect.signature(trainer_cls.__init__)
    mine = {k: v for k, v in kwargs.items() if k in sig.parameters}
    return sig.bind_partial(None, *args, **mine).arguments


def _refuse_args(name: str, args) -> None:
    """Options refused before TRL's ``__init__`` runs (see the module doc)."""
    if args is None:
        return
    if args.neftune_noise_alpha is not None:
        raise ValueError(f"{name} does not support neftune_noise_alpha="
                         f"{args.neftune_noise_alpha}: each rank would add other noise to its "
                         "shard's embeddings than one process adds")
    if args.use_liger_kernel:
        raise ValueError(f"{name} does not support use_liger_kernel=True: Liger's kernels are "
                         "not checked against ring attention's sharding")


def _unwrapped(model):
    """The model instance ``convert`` hooked: under DDP/FSDP wrappers (``.module``) and a PEFT
    model's base model."""
    from transformers.trainer_utils import unwrap_peft_model

    while isinstance(getattr(model, "module", None), torch.nn.Module):
        model = model.module
    return unwrap_peft_model(model)


def _router_loss_problem(name: str, model) -> str | None:
    """Why ``model``'s router auxiliary loss, which TRL turns on, cannot be exact under CP,
    or None (``convert`` made it global)."""
    model = _unwrapped(model)
    if global_router_loss(model):
        return None
    return (f"{name}: TRL adds {type(model).__name__}'s MoE router auxiliary loss "
            "(router_aux_loss_coef != 0), which each rank would average over its own shard; "
            "convert the model first (model = ringattn.integrations.transformers.convert(model), "
            "which makes the router loss global), or turn the loss off with "
            "SFTConfig(router_aux_loss_coef=0.0)")


def _aux_loss_asked(model, args) -> bool:
    """Whether TRL's ``SFTTrainer`` will enable the router auxiliary loss for ``model`` (as
    its ``__init__`` decides: a config with ``output_router_logits`` and a coefficient, the
    config's unless ``args`` sets one, that is not 0)."""
    config = getattr(_unwrapped(model), "config", None)
    if config is None:
        return False
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    coef = getattr(args, "router_aux_loss_coef", None)
    coef = getattr(text, "router_aux_loss_coef", 0.0) if coef is None else coef
    return hasattr(text, "output_router_logits") and coef != 0.0


def _refuse_built(trainer, dp: bool = False) -> None:
    """What the built trainer shows that cannot be exact (see the module doc); ``dp``: the
    trainer serves dp x cp."""
    name = type(trainer).__name__
    if trainer.dp_size > 1 and not dp:
        raise ValueError(f"{name} runs the whole world as one context-parallel group; cp_size="
                         f"{dist.get_world_size() // trainer.dp_size} of {dist.get_world_size()} "
                         "ranks (dp x cp) is not supported")
    if getattr(trainer, "aux_loss_enabled", False):
        if not isinstance(trainer, SFTTrainer):
            raise ValueError(f"{name} does not support a MoE router auxiliary loss "
                             "(output_router_logits): it is a mean over each rank's shard; "
                             "turn it off with router_aux_loss_coef=0.0")
        problem = _router_loss_problem(name, trainer.model)
        if problem is not None:
            raise ValueError(problem)
    if getattr(trainer, "_is_vision_dataset", False):
        raise ValueError(f"{name} does not support vision datasets: images are not sharded")


class RingSFTTrainer(RingTrainerMixin, SFTTrainer):
    """TRL's ``SFTTrainer``, context-parallel: arguments are SFTTrainer's plus
    ``RingTrainerMixin``'s (``layout``, ``strategy``, ``ulysses_size``).

    Raises:
        ValueError: see the module doc and ``RingTrainerMixin``.
    """

    def __init__(self, *args, **kwargs):
        bound = _bound(SFTTrainer, args, kwargs)
        name = type(self).__name__
        _refuse_args(name, bound.get("args"))
        model = bound.get("model")
        # before TRL's __init__ (and check_model's generic refusal): say what to do here
        if isinstance(model, torch.nn.Module) and _aux_loss_asked(model, bound.get("args")):
            problem = _router_loss_problem(name, model)
            if problem is not None:
                raise ValueError(problem)
        super().__init__(*args, **kwargs)
        _refuse_built(self)

    def _shard(self, inputs: dict) -> dict:
        """This rank's shard, plus the global batch's token count for TRL's ``num_tokens``
        (one process counts the attention mask, or the packed row's length)."""
        local = super()._shard(inputs)
        if inputs.get("attention_mask") is not None:
            count = inputs["attention_mask"].sum()
        else:
            count = torch.tensor(inputs["input_ids"].numel(), device=inputs["input_ids"].device)
        local[_TOKENS] = count
        return local

    def _local_loss(self, model, local: dict, num_items_in_batch=None):
        """This rank's share of TRL's SFT loss of one batch (the shares add up to it), and
        TRL's metrics of the global batch recorded as one process records them.

        Arguments:
            local: a ``_shard`` dict.
            num_items_in_batch: targets of the whole accumulated batch; None: this batch's.
        """
        mode = "train" if self.model.training else "eval"
        kw = {k: v for k, v in local.items() if k not in (_TOKENS, "num_items_in_batch")}
        # TRL's fused head scores the pre-shifted labels of the shard (shift_labels)
        if self.aux_loss_enabled:
            kw["output_router_logits"] = True  # as TRL asks (VLM wrappers read only this)
            with _router_logits_to_output(_unwrapped(self.model)):
                outputs = model(**kw, use_cache=False, fused_lm_head=True)
        else:
            outputs = model(**kw, use_cache=False, fused_lm_head=True)
        local["ring_context"].check_consumed(self.model)
        per_token_loss = -outputs.log_probs  # zero where the label is -100
        if self.args.loss_type == "dft":  # per token: local
            per_token_loss = per_token_loss * outputs.log_probs.exp().detach()
        count = local["num_items_in_batch"] if num_items_in_batch is None else num_items_in_batch
        share = per_token_loss.sum() / torch.as_tensor(count).clamp(min=1)
        if self.aux_loss_enabled:
            # outputs.aux_loss: the global router loss (the converted model's hook), the same
            # on every rank. TRL adds coef * aux_loss, over the accumulation steps when it
            # divides by the accumulated batch's targets: each rank carries 1/W of it (its
            # gradient reaches every rank's router through the hook's all-reduce)
            steps = (self.current_gradient_accumulation_steps if num_items_in_batch is not None
                     else 1)
            world = dist.get_world_size(self.cp_group)
            share = share + self.router_aux_loss_coef * outputs.aux_loss / (world * steps)

        stats = torch.stack([outputs.label_mask.sum(), outputs.entropy.detach().sum(),
                             outputs.is_top1.sum()]).double()
        dist.all_reduce(stats, group=self.cp_group)  # the global batch's sums
        valid, entropy, correct = stats.tolist()
        self._metrics[mode]["entropy"].append(entropy / valid if valid > 0 else 0.0)
        self._metrics[mode]["mean_token_accuracy"].append(correct / valid if valid > 0 else 0.0)
        if mode == "train":
            self._total_train_tokens += int(local[_TOKENS]) // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        if self.aux_loss_enabled:  # one process logs its micro-batch's aux_loss: the global one
            self._metrics[mode]["aux_loss"].append(float(outputs.aux_loss.detach()))
        return share, outputs

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """This rank's share of the loss, times W (DDP averages the ranks' gradients).

        Returns:
            the loss (with ``return_outputs``: and the fused head's outputs of this shard).
        """
        local = inputs if "ring_context" in inputs else self._shard(inputs)
        share, outputs = self._local_loss(model, local, num_items_in_batch)
        loss = share * self.accelerator.num_processes
        return (loss, outputs) if return_outputs else loss

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """One evaluation batch: the one-process mean loss (and, without
        ``prediction_loss_only``, the logits [B, S, V] of the whole sequence), recording the
        eval metrics as TRL does; the same on every rank."""
        inputs = self._prepare_inputs(inputs)
        local = self._shard(inputs)
        with torch.no_grad(), self.compute_loss_context_manager():
            share, _ = self._local_loss(model, local)
            loss = share.detach().float()
            dist.all_reduce(loss, group=self.cp_group)
            if prediction_loss_only:
                return loss, None, None
            ctx = local["ring_context"]
            kw = {k: v for k, v in local.items()
                  if k not in (_TOKENS, "num_items_in_batch", "labels", "shift_labels")}
            logits = model(**kw, use_cache=False).logits
        logits = unshard(logits, group=ctx.group, layout=ctx.layout, dim=1, seqlen=ctx.seqlen,
                         cu_seqlens=ctx.cu_seqlens)
        return loss, logits, inputs.get("labels")


@contextlib.contextmanager
def _router_logits_to_output(model):
    """During one call of ``model`` (the converted MoE model TRL's fused head patched): its
    backbone's router logits on the model's output, which TRL's ``FusedCausalLMOutput``
    leaves out, so that the global router loss hook ``convert`` put on the model (which
    reads ``output.router_logits``; this one is prepended, so it runs first) computes the
    loss over every rank's tokens."""
    kept = []

    def keep(module, args, output):
        kept.append(getattr(output, "router_logits", None))

    def attach(module, args, output):
        if getattr(output, "router_logits", None) is None and kept and kept[-1] is not None:
            output.router_logits = kept[-1]

    handles = [model.base_model.register_forward_hook(keep),
               model.register_forward_hook(attach, prepend=True)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class _ShardedModel:
    """A policy or reference model as DPO's ``_compute_loss`` calls it, on the global
    batch: runs this rank's shard through the model and returns the outputs of the whole
    batch (fused head: the per-token fields [2B, S - 1]; otherwise the logits [2B, S, V])."""

    _FIELDS = ("entropy", "log_sum_sq_probs", "mean_logits", "is_top1", "label_mask")

    def __init__(self, trainer, model, checked):
        self.trainer, self.model, self.checked = trainer, model, checked

    def __call__(self, input_ids, attention_mask=None, labels=None, fused_lm_head=False,
                 use_cache=False, **kwargs):
        if kwargs:
            raise ValueError(f"{type(self.trainer).__name__}: model inputs {sorted(kwargs)} are "
                             "not sharded")
        t = self.trainer
        batch = {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}
        local = shard_batch({k: v for k, v in batch.items() if v is not None},
                            group=t.attn_group, layout=t.layout, strategy=t.strategy)
        ctx = local.pop("ring_context")
        local.pop("num_items_in_batch", None)
        s = input_ids.shape[1]

        def gather(x):  # [2B, L] shard -> [2B, S] global, differentiable
            return unshard(x, group=ctx.group, layout=ctx.layout, dim=1, seqlen=s)

        if not fused_lm_head:
            out = self.model(**local, ring_context=ctx, use_cache=False)
            ctx.check_consumed(self.checked)
            out.logits = gather(out.logits)
            return out
        out = self.model(**local, ring_context=ctx, use_cache=False, fused_lm_head=True)
        ctx.check_consumed(self.checked)
        # slot t holds the target of token t + 1 (the global sequence's shift): the first
        # S - 1 slots are what one process's fused head returns
        fields = {"log_probs": gather(out.log_probs)[:, : s - 1]}
        present = [f for f in self._FIELDS if getattr(out, f) is not None]
        if present:
            stacked = torch.stack([getattr(out, f).detach().to(out.log_probs.dtype)
                                   for f in present])
            stacked = unshard(stacked, group=ctx.group, layout=ctx.layout, dim=2, seqlen=s)
            for f, v in zip(present, stacked[:, :, : s - 1]):
                fields[f] = v.to(getattr(out, f).dtype)
        return FusedCausalLMOutput(loss=None, aux_loss=None, **fields)


def as_read(epoch_iterator, num_batches: int) -> list:
    """Up to ``num_batches`` micro-batches of ``epoch_iterator``, as read (for trainers that
    shard inside their model calls)."""
    batches = []
    for _ in range(num_batches):
        try:
            batches.append(next(epoch_iterator))
        except StopIteration:
            break
    return batches


class RingDPOTrainer(RingTrainerMixin, DPOTrainer):
    """TRL's ``DPOTrainer``, context-parallel: arguments are DPOTrainer's (``ref_model``
    required, a ring-attention model too) plus ``RingTrainerMixin``'s.

    Raises:
        ValueError: see the module doc and ``RingTrainerMixin``.
    """

    # DPO's loss is a mean over the micro-batch's pairs: Trainer divides by the
    # accumulation steps, as in one process
    loss_is_scaled_for_ga = False

    def __init__(self, *args, **kwargs):
        bound = _bound(DPOTrainer, args, kwargs)
        dpo_args, ref_model = bound.get("args"), bound.get("ref_model")
        name = type(self).__name__
        _refuse_args(name, dpo_args)
        if ref_model is None:
            raise ValueError(f"{name} needs a ref_model (with attn_implementation='ringattn'): "
                             "without one TRL loads the reference by name or disables the policy's "
                             "adapter, outside the sharding")
        if dpo_args is not None and dpo_args.precompute_ref_log_probs:
            raise ValueError(f"{name} does not support precompute_ref_log_probs=True: TRL computes "
                             "them in __init__ on batches split over the ranks, not sharded")
        check_attention(ref_model)
        check_model(ref_model)
        super().__init__(*args, **kwargs)
        _refuse_built(self)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The global micro-batches (DPO shards inside the model calls); no target count:
        DPO's loss is a mean over pairs."""
        return as_read(epoch_iterator, num_batches), None

    def _compute_loss(self, model, inputs, return_outputs):
        """TRL's DPO loss and metrics, with policy and reference run sharded and their
        per-token outputs gathered (``_ShardedModel``): the one-process values."""
        ref = self.ref_model
        self.ref_model = _ShardedModel(self, ref, ref)
        before = self._total_train_tokens
        try:
            result = super()._compute_loss(_ShardedModel(self, model, self.model), inputs,
                                           return_outputs)
        finally:
            self.ref_model = ref
        # TRL gathers the batch's token count from every rank: each holds the global batch
        mode = "train" if self.model.training else "eval"
        if mode == "train":
            self._total_train_tokens = before + int(inputs["attention_mask"].sum()) // self._tp_size
        self._metrics[mode]["num_tokens"] = [self._total_train_tokens]
        return result

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """The DPO loss of the global batch, times W (DDP averages the ranks' gradients,
        each of which holds its own tokens' share)."""
        result = DPOTrainer.compute_loss(self, model, inputs, return_outputs)
        if return_outputs:
            return result[0] * self.accelerator.num_processes, result[1]
        return result * self.accelerator.num_processes

    def training_step(self, model, inputs, num_items_in_batch=None):
        """Trainer's step (backward of the global loss times W); returns the global loss,
        which every rank holds already (RingTrainerMixin's sum over ranks is for shares)."""
        loss = DPOTrainer.training_step(self, model, inputs, num_items_in_batch)
        return loss / self.accelerator.num_processes

    def prediction_step(self, model, inputs, prediction_loss_only, ignore_keys=None):
        """DPO's evaluation step (the loss, and with logits those of the whole sequence),
        the one-process values on every rank."""
        loss, logits, labels = DPOTrainer.prediction_step(self, model, inputs,
                                                          prediction_loss_only, ignore_keys)
        return loss / self.accelerator.num_processes, logits, labels


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
