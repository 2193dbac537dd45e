"""TRL's ``GRPOTrainer``, context-parallel: the scoring forwards of long rollouts sharded.

Legend: B rows of a micro-batch (prompt + completion), S their padded length, W the world
(one context-parallel group), N the rows of a generation batch.

    from ringattn.integrations.trl import RingGRPOTrainer
    trainer = RingGRPOTrainer(model=path, reward_funcs=reward, args=GRPOConfig(...),
                              train_dataset=prompts, processing_class=tokenizer)

Each CP group is ONE data-parallel replica (``cp_size``: ranks per group; the world by
default): its ranks read the prompts one of TRL's data-parallel processes reads (TRL's
``RepeatSampler``, its generation batch sized for the dp replicas), generate the same
completions (transformers' ``generate``, run with the "sdpa" attention for the generation
and checked to agree on every rank), computes the same rewards (checked to agree) and the
same advantages (every rank takes the group's first rank's random state before it
samples). What CP shards is what grows with the rollout: every forward that scores
tokens (the policy's in the loss, the old policy's and the reference model's in
``_generate_and_score_completions``) runs on this rank's shard of each sequence with TRL's
fused LM head (per-token log-probabilities and entropies in tiles, never the [B, S, V]
logits), and the per-token values are gathered into the global [B, S - 1] tensors by
``ringattn.unshard`` (autograd: its backward hands each rank the gradient of its own
tokens). TRL's own ``_compute_loss`` then runs on them unchanged, so the loss, the KL, the
clip ratios and the entropy are the one-process values on every rank; the loss is
multiplied by the CP size for DDP's averaging (each rank's gradient holds its tokens'
share).

TRL's collectives run over the world, which holds cp copies of each replica's values:
means, minima and maxima are unchanged, and the counts TRL divides by the number of
processes come out right; ``num_tokens`` counts one copy; the standard deviations of the logged rewards are recomputed on
one copy; the logged completion tables (deques of one generation batch) keep the last copy.

Refused with a ValueError, on every rank, before training: what ``RingSFTTrainer`` refuses
(``neftune_noise_alpha``, ``use_liger_kernel``; but dp x cp is served), vLLM
generation (``use_vllm``: not run here), ``scale_rewards="batch"`` and
``multi_objective_aggregation="normalize_then_sum"`` (a standard deviation over every
process's rewards, each of which a CP rank holds W times), ``top_entropy_quantile`` < 1 (a
quantile over every process's entropies, likewise), evaluation (``eval_dataset``),
vision inputs, a MoE router auxiliary loss, and a model or reference model whose attention
is not ring attention. At run time: completions or rewards that differ across the ranks.

A hybrid model (Gated DeltaNet, Mamba) runs converted: pass the policy converted by
``ringattn.integrations.transformers.convert`` (with its ``config._name_or_path`` the
directory TRL loads the reference from); the reference TRL loads is converted alike.
"""

from __future__ import annotations

import contextlib
import hashlib

import torch
import torch.distributed as dist
from trl import GRPOTrainer

from ..transformers import check_attention, check_model, convert, converted
from .hf_trainer import RingTrainerMixin
from .trl import _bound, _refuse_args, _refuse_built, _ShardedModel, _unwrapped, as_read

__all__ = ["RingGRPOTrainer"]

_MULTIMODAL = ("pixel_values", "image_grid_thw", "num_images", "pixel_attention_mask",
               "spatial_shapes", "num_tiles", "image_sizes", "token_type_ids",
               "mm_token_type_ids", "image_position_ids")


def _refuse_grpo(name: str, args) -> None:
    """GRPO options that a CP group cannot compute as one process (the module doc)."""
    if args is None:
        return
    _refuse_args(name, args)
    refused = [
        (args.use_vllm, "use_vllm=True (generation in vLLM is not run under ringattn's CP; "
         "transformers' generate is)"),
        (args.scale_rewards == "batch", "scale_rewards='batch' (TRL's standard deviation runs "
         "over every process's rewards, and each rank of the CP group holds the same ones: "
         "use 'group' or 'none')"),
        (args.multi_objective_aggregation == "normalize_then_sum",
         "multi_objective_aggregation='normalize_then_sum' (a standard deviation over every "
         "process's rewards, which each CP rank holds W times)"),
        (args.top_entropy_quantile < 1.0, f"top_entropy_quantile={args.top_entropy_quantile} "
         "(a quantile over every process's entropies, which each CP rank holds W times)"),
    ]
    for bad, what in refused:
        if bad:
            raise ValueError(f"{name} does not support {what}")


def _digest(*parts) -> str:
    """A digest of nested lists/tensors of ints (the same on every rank that holds them)."""
    h = hashlib.sha256()
    for part in parts:
        h.update(repr(part.tolist() if isinstance(part, torch.Tensor) else part).encode())
    return h.hexdigest()


def _agree(group, value: str, what: str) -> None:
    """Raise the same ValueError on every rank of ``group`` unless all hold ``value``."""
    seen = [None] * dist.get_world_size(group)
    dist.all_gather_object(seen, value, group=group)
    if len(set(seen)) > 1:
        ranks = [r for r, v in enumerate(seen) if v != seen[0]]
        raise ValueError(f"RingGRPOTrainer: {what} differ across the ranks of the "
                         f"context-parallel group (ranks {ranks} against rank 0): every "
                         f"rank must hold the same ones, or its advantages and loss would "
                         f"be another replica's")


def _nanstd(x: torch.Tensor) -> float:
    """TRL's ``nanstd`` (unbiased, NaNs left out)."""
    x = x[~torch.isnan(x)]
    return float(x.std()) if x.numel() > 1 else float("nan")


class RingGRPOTrainer(RingTrainerMixin, GRPOTrainer):
    """TRL's ``GRPOTrainer``, context-parallel (the module doc): arguments are
    GRPOTrainer's plus ``RingTrainerMixin``'s.

    Raises:
        ValueError: see the module doc and ``RingTrainerMixin``.
    """

    def __init__(self, *args, **kwargs):
        bound = _bound(GRPOTrainer, args, kwargs)
        grpo_args = bound.get("args")
        name = type(self).__name__
        _refuse_grpo(name, grpo_args)
        if grpo_args is None:
            raise ValueError(f"{name} needs args=GRPOConfig(...): its generation batch is "
                             "sized for one replica before TRL reads it")
        if bound.get("eval_dataset") is not None:
            raise ValueError(f"{name} does not evaluate yet (eval_dataset): its generation "
                             "batches are not sharded for evaluation")
        # the generation batch of the dp replicas (each CP group one), not of W processes
        world = dist.get_world_size() if dist.is_initialized() else 1
        cp = kwargs.get("cp_size") or world
        replicas = world // cp if world % cp == 0 else 1  # (else the mixin refuses cp_size)
        grpo_args.generation_batch_size = (grpo_args.per_device_train_batch_size * replicas
                                           * grpo_args.steps_per_generation)
        if grpo_args.generation_batch_size % grpo_args.num_generations:
            raise ValueError(
                f"{name}: per_device_train_batch_size x dp x steps_per_generation = "
                f"{grpo_args.generation_batch_size} (the generation batch) must be "
                f"divisible by num_generations={grpo_args.num_generations}")
        super().__init__(*args, **kwargs)
        _refuse_built(self, dp=True)
        self.cp_size = dist.get_world_size(self.cp_group)
        if self.dp_size > 1:  # TRL seeds process p with seed + p: replica r is process r
            from accelerate.utils import set_seed

            set_seed(self.args.seed + self.dp_rank)
        if self.ref_model is not None:
            ref = _unwrapped(self.ref_model)
            # TRL loads the reference from the policy's path: a converted policy (a hybrid
            # model's sequence mixers, a global router loss) gets a converted reference
            if converted(_unwrapped(self.model)) and not converted(ref):
                convert(ref)
            check_attention(ref)
            check_model(ref)

    # ---- data: the one-process generation batches on every rank ----------------------

    def get_train_dataloader(self):
        """Every rank of a CP group reads what one data-parallel process of TRL reads: TRL's
        ``RepeatSampler`` over the dataset, split over the dp replicas only."""
        from accelerate.data_loader import prepare_data_loader
        from torch.utils.data import DataLoader, IterableDataset

        if isinstance(self.train_dataset, IterableDataset):
            raise ValueError(f"{type(self).__name__} takes an indexable train_dataset")
        dataset = self.train_dataset
        collator = self.data_collator
        from transformers.utils import is_datasets_available

        if is_datasets_available():
            import datasets

            if isinstance(dataset, datasets.Dataset):
                dataset = self._remove_unused_columns(dataset, description="Training")
        loader = DataLoader(dataset, batch_size=self._train_batch_size *
                            self.args.steps_per_generation, sampler=self._get_train_sampler(dataset),
                            collate_fn=collator, drop_last=self.args.dataloader_drop_last,
                            num_workers=self.args.dataloader_num_workers)
        return prepare_data_loader(loader, self.args.device, num_processes=self.dp_size,
                                   process_index=self.dp_rank, put_on_device=True)

    def get_batch_samples(self, epoch_iterator, num_batches, device):
        """The micro-batches as read (GRPO shards inside its scoring forwards); no count."""
        return as_read(epoch_iterator, num_batches), None

    # ---- generation and rewards: the same on every rank, checked ---------------------

    @contextlib.contextmanager
    def _generation_attention(self):
        """transformers' generate runs the policy unsharded (with a cache): "sdpa" while it
        does, ring attention again after."""
        model = _unwrapped(self.model)
        ring = model.config._attn_implementation
        model.set_attn_implementation("sdpa")
        try:
            yield
        finally:
            model.set_attn_implementation(ring)

    def _same_random_state(self) -> None:
        """Every rank of the group takes its first rank's torch random state (TRL seeds each
        process apart, ``device_specific``, for different samples per replica): the group
        then samples what one process samples."""
        group = self.cp_group
        state = [torch.get_rng_state(),
                 torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None]
        dist.broadcast_object_list(state, src=dist.get_global_rank(group, 0), group=group)
        torch.set_rng_state(state[0])
        if state[1] is not None:
            torch.cuda.set_rng_state_all(state[1])

    def _generate(self, prompts: list):
        self._same_random_state()
        before = self.state.num_input_tokens_seen
        with self._generation_attention():
            out = super()._generate(prompts)
        # TRL counts the tokens of every process: each replica's cp copies, once
        seen = before + (self.state.num_input_tokens_seen - before) // self.cp_size
        self.state.num_input_tokens_seen = seen
        mode = "train" if self.model.training else "eval"
        if self._metrics[mode].get("num_tokens"):
            self._metrics[mode]["num_tokens"] = [seen]
        prompt_ids, completion_ids = out[0], out[1]
        _agree(self.cp_group, _digest(prompt_ids, completion_ids), "the generated completions")
        return out

    def _calculate_rewards(self, inputs, prompts, completions, completion_ids_list):
        """TRL's rewards of every process (cp copies of each replica's): checked to be equal
        within each CP group; one copy per replica is kept for the logged standard
        deviations."""
        rewards = super()._calculate_rewards(inputs, prompts, completions, completion_ids_list)
        # [dp, cp, N, F]: the mesh's ranks are replica-major
        copies = torch.nan_to_num(rewards, nan=-1.5e308).view(
            self.dp_size, self.cp_size, -1, rewards.shape[-1])
        same = bool((copies == copies[:, :1]).all())
        if not same:  # every rank sees the same gathered tensor: the same decision
            raise ValueError("RingGRPOTrainer: the reward functions returned different values "
                             "on the ranks of the context-parallel group for the same "
                             "completions (a reward drawn per rank, or read from per-rank "
                             "state): every rank must compute the same rewards")
        self._ring_rewards = rewards.view(self.dp_size, self.cp_size, -1, rewards.shape[-1])[
            :, 0].reshape(-1, rewards.shape[-1]).clone()
        return rewards

    def _generate_and_score_completions(self, inputs):
        mode = "train" if self.model.training else "eval"
        out = super()._generate_and_score_completions(inputs)
        block = self._ring_rewards  # [N, F]: this group's rewards, one copy
        metrics = self._metrics[mode]
        for i, fname in enumerate(self.reward_func_names):
            metrics[f"rewards/{fname}/std"][-1] = _nanstd(block[:, i])
        unscorable = torch.isnan(block).all(dim=1)
        total = (block * self.reward_weights.to(block.device).unsqueeze(0)).nansum(dim=1)
        total[unscorable] = torch.nan
        metrics["reward_std"][-1] = _nanstd(total)
        return out

    # ---- scoring: sharded forwards, global per-token values --------------------------

    def _get_per_token_logps_and_entropies(self, model, input_ids, attention_mask,
                                           logits_to_keep, batch_size=None,
                                           compute_entropy=False, compute_aux_loss=False,
                                           **kwargs):
        """TRL's per-token log-probabilities (and entropies) of the global rows, each
        forward run on this rank's shards (``_ShardedModel``)."""
        given = sorted(k for k, v in kwargs.items() if v is not None)
        if given or compute_aux_loss:
            raise ValueError(f"RingGRPOTrainer does not shard {given or 'a router aux loss'}")
        checked = self.model if model is self.model or model is self.model_wrapped else model
        return super()._get_per_token_logps_and_entropies(
            _ShardedModel(self, model, _unwrapped(checked)), input_ids, attention_mask,
            logits_to_keep, batch_size=batch_size, compute_entropy=compute_entropy)

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        """GRPO's loss of the replica's micro-batch, times the CP size (DDP averages over
        dp x cp ranks, each of whose gradients holds its own tokens' share; TRL's DP
        averages over dp)."""
        return GRPOTrainer.compute_loss(self, model, inputs, return_outputs) * self.cp_size

    def training_step(self, model, inputs, num_items_in_batch=None):
        """GRPO's step; returns the replica's loss, which its ranks hold already."""
        loss = GRPOTrainer.training_step(self, model, inputs, num_items_in_batch)
        return loss / self.cp_size


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
