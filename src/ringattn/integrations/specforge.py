"""SpecForge's own Eagle3 trainer with ringattn as its context-parallel attention.

A SpecForge (0.2.0) user keeps the run YAML, the offline features and SpecForge's Trainer;
two things change (docs/specforge.md):

* the draft config's ``architectures`` names ``RingLlamaForCausalLMEagle3`` (a registered
  subclass of SpecForge's ``LlamaForCausalLMEagle3``: same parameters, same checkpoint keys,
  its attention ``ringattn.eagle3.ttt_attention``), optionally with a ``"ringattn"`` entry
  ``{"layout": "zigzag" | "contiguous", "strategy": "ring" | "ulysses"}``;
* the launch line is ``torchrun --nproc_per_node N -m ringattn.apps.specforge_train train
  -c run.yaml --cp-size C`` (``ringattn.apps.specforge_train``), which runs what SpecForge's
  ``specforge train`` worker runs, with this module's algorithm registry and
  ``init_distributed(tp_size=C)``: the CP group is SpecForge's "tp" mesh dimension, so the
  ranks of one CP group read the same samples, as TP peers do.

What this module adds, all through SpecForge's extension points (no SpecForge function is
replaced):

* ``draft_class()``: the ``@register_draft`` class;
* ``RingAdapter`` (a ``BackendAdapter``, the seam SpecForge's own USP uses) inside an
  ``OnlineEagle3Model`` subclass: each rank takes its layout rows from the collated shard,
  and the loss, accuracies and acceptance come out global (each rank's share of SpecForge's
  ``B*T`` mean, summed over the CP group);
* ``collate_shard``: the offline collator. Each rank keeps the rows of its ringattn layout
  (zigzag or contiguous segments), each segment followed by a halo of ``ttt_length`` rows, so
  that SpecForge's own left shifts (the teacher's by one, the TTT loop's by one per step) are
  right on every kept row without any communication; ``T`` is the batch's longest sample, as
  in one process (no rounding up to the CP size);
* ``ring_registry()``: SpecForge's built-in algorithm registry with its "eagle3" entry
  accepting the ring architecture and using the above.

SpecForge is imported only inside functions, so this module imports without it.
"""

from __future__ import annotations

import dataclasses
import functools

import torch

__all__ = ["ARCHITECTURE", "LAYOUTS", "ring_options", "cp_group", "shard_plan",
           "collate_shard", "draft_class", "training_model_class", "ring_registry",
           "check_run_config", "build", "train"]

ARCHITECTURE = "RingLlamaForCausalLMEagle3"
"""The draft config's ``architectures`` entry that switches a SpecForge run to ringattn."""

LAYOUTS = ("zigzag", "contiguous")
"""Layouts whose local rows are contiguous segments (a halo per segment): striped is not."""

STRATEGIES = ("ring", "ulysses")


def ring_options(config) -> dict:
    """The draft config's ``"ringattn"`` entry, checked: ``{"layout", "strategy"}``.

    Raises:
        ValueError: an unknown key, layout or strategy.
    """
    raw = getattr(config, "ringattn", None) if not isinstance(config, dict) else \
        config.get("ringattn")
    raw = dict(raw or {})
    unknown = set(raw) - {"layout", "strategy"}
    if unknown:
        raise ValueError(f"the draft config's ringattn entry has unknown keys {sorted(unknown)};"
                         " it takes layout and strategy")
    layout = raw.get("layout", "zigzag")
    strategy = raw.get("strategy", "ring")
    if layout not in LAYOUTS:
        raise ValueError(f"ringattn layout {layout!r} is not supported with SpecForge: one of "
                         f"{LAYOUTS} (each rank's rows must be contiguous segments, each "
                         "followed by a ttt_length halo)")
    if strategy not in STRATEGIES:
        raise ValueError(f"ringattn strategy {strategy!r} is not supported with SpecForge: "
                         f"one of {STRATEGIES}")
    return {"layout": layout, "strategy": strategy}


def cp_group():
    """The context-parallel group: SpecForge's "tp" group (``init_distributed(tp_size=C)``)."""
    from specforge.distributed import get_tp_group

    return get_tp_group()


def shard_plan(layout: str, rank: int, world: int, seqlen: int, ttt_length: int):
    """(rows, keep) for one rank: ``rows`` the global positions the collator gives this rank
    (each layout segment followed by ``ttt_length`` halo positions), ``keep`` the indices in
    ``rows`` of the layout's own positions (what the draft attends and the loss sums)."""
    from ..layouts import local_positions

    pos = local_positions(layout, rank, world, seqlen).tolist()
    rows, keep, start = [], [], 0
    for i in range(1, len(pos) + 1):
        if i == len(pos) or pos[i] != pos[i - 1] + 1:
            segment = pos[start:i]
            keep.extend(range(len(rows), len(rows) + len(segment)))
            rows.extend(segment)
            rows.extend(range(segment[-1] + 1, segment[-1] + 1 + ttt_length))
            start = i
    return torch.tensor(rows, dtype=torch.long), torch.tensor(keep, dtype=torch.long)


def collate_shard(samples, *, layout: str, ttt_length: int, rank: int, world: int) -> dict:
    """SpecForge's offline batch (normalised samples, right-padded to the longest), with
    only this rank's rows and halos: ``input_ids``, ``loss_mask``, ``target``,
    ``hidden_state`` [B, R, ...]; ``position_ids`` [B, R] global positions; and the global
    ``attention_mask`` [B, T]. Rows past a sample's end are zero, as SpecForge's padding."""
    T = max(int(s["input_ids"].shape[1]) for s in samples)
    rows, _ = shard_plan(layout, rank, world, T, ttt_length)

    def take(x):
        out = x.new_zeros((x.shape[0], len(rows), *x.shape[2:]))
        inside = rows < x.shape[1]
        out[:, inside] = x[:, rows[inside]]
        return out

    batch = {k: torch.cat([take(s[k]) for s in samples])
             for k in ("input_ids", "loss_mask", "target", "hidden_state")}
    batch["attention_mask"] = torch.cat([torch.nn.functional.pad(
        s["attention_mask"], (0, T - s["attention_mask"].shape[1])) for s in samples])
    batch["position_ids"] = rows[None].expand(len(samples), -1).clone()
    return batch


def _right_padding_lengths(attention_mask: torch.Tensor) -> torch.Tensor:
    lengths = attention_mask.sum(-1)
    expected = torch.arange(attention_mask.shape[1], device=attention_mask.device)[None] < \
        lengths[:, None]
    if not torch.equal(attention_mask.bool(), expected):
        raise ValueError("RingLlamaForCausalLMEagle3 takes right-padded rows only: the "
                         "attention_mask has a 0 before a 1")
    return lengths


@functools.cache
def draft_class():
    """``RingLlamaForCausalLMEagle3``, registered with SpecForge's ``@register_draft`` (on
    the first call; ``ring_registry`` and the launcher call it)."""
    from transformers import LlamaConfig
    from specforge.modeling.draft.llama3_eagle import (LlamaAttention, LlamaForCausalLMEagle3,
                                                       apply_rotary_pos_emb)
    from specforge.modeling.draft.registry import DRAFT_REGISTRY, register_draft

    from .. import eagle3

    class RingTTTAttention(LlamaAttention):
        """SpecForge's draft attention (same projections and RoPE) with the TTT attention
        over the sequence sharded across the CP group: step-0 keys causal and
        padding-masked, the keys of steps 1..j on the diagonal."""

        def forward(self, hidden_states, cache_hidden=None, attention_mask=None,
                    position_ids=None, past_key_values=None, output_attentions=False,
                    use_cache=False):
            b, n, _ = hidden_states.shape
            q = self.q_proj(hidden_states).view(b, n, self.num_heads, self.head_dim)
            k = self.k_proj(hidden_states).view(b, n, self.num_key_value_heads, self.head_dim)
            v = self.v_proj(hidden_states).view(b, n, self.num_key_value_heads, self.head_dim)
            step = len(cache_hidden[0])
            # the mask is global: a refusal here is the same on every rank
            if attention_mask is None or attention_mask.dim() != 2:
                raise ValueError("RingLlamaForCausalLMEagle3 needs the global [B, T] "
                                 "attention_mask (training.attention_backend: sdpa)")
            lengths = _right_padding_lengths(attention_mask)
            seqlen = attention_mask.shape[1]
            cos, sin = self.rotary_emb(q, seq_len=int(position_ids.max()) + 1 + step)
            q, k = apply_rotary_pos_emb(q, k, cos, sin, position_ids + step, unsqueeze_dim=2)
            cache_hidden[0] = cache_hidden[0] + [k]
            cache_hidden[1] = cache_hidden[1] + [v]
            opts = self.ringattn
            out = eagle3.ttt_attention(q, cache_hidden[0], cache_hidden[1], group=cp_group(),
                                       layout=opts["layout"], seqlen=seqlen,
                                       valid_len=lengths, strategy=opts["strategy"])
            return self.o_proj(out.reshape(b, n, self.num_heads * self.head_dim))

    if ARCHITECTURE in DRAFT_REGISTRY:  # registered by an earlier import of another copy
        return DRAFT_REGISTRY[ARCHITECTURE]

    @register_draft
    class RingLlamaForCausalLMEagle3(LlamaForCausalLMEagle3):
        """SpecForge's Llama Eagle3 draft whose attention is ringattn's TTT attention."""

        config_class = LlamaConfig

        def __init__(self, config, quant_config=None, attention_backend="sdpa"):
            if attention_backend != "sdpa":
                raise ValueError(f"{ARCHITECTURE} runs with training.attention_backend: sdpa "
                                 f"(its attention is ringattn's), got {attention_backend!r}")
            options = ring_options(config)
            super().__init__(config, quant_config=quant_config, attention_backend="sdpa")
            attn = self.midlayer.self_attn
            attn.__class__ = RingTTTAttention
            attn.ringattn = options

        def prepare_decoder_attention_mask(self, attention_mask, **_):
            return attention_mask  # the global [B, T] mask, for the ring's valid lengths

    return RingLlamaForCausalLMEagle3


@functools.cache
def training_model_class():
    """``OnlineEagle3Model`` with the CP adapter (and, off CUDA, the KL term in torch)."""
    import torch.distributed.nn.functional as dist_nn
    from specforge.algorithms.eagle3.model import OnlineEagle3Model
    from specforge.core.eagle3_adapters import BackendAdapter, StepState
    from specforge.core.lk_loss import compute_acceptance_rate, compute_lk_loss

    class RingAdapter(BackendAdapter):
        """Each TTT step sees this rank's layout rows; metrics and the loss are global."""

        def step_view(self, *, idx, ttt_length, global_input_ids, attention_mask, loss_mask,
                      position_ids, hidden_states, target_p_padded,
                      target_p_on_draft_padded=None, target_token_ids_padded=None,
                      position_mask, seq_length):
            import torch.distributed as dist

            group = cp_group()
            opts = self.m.draft_model.midlayer.self_attn.ringattn
            T = attention_mask.shape[1]
            _, keep = shard_plan(opts["layout"], dist.get_rank(group),
                                 dist.get_world_size(group), T, ttt_length)
            keep = keep.to(hidden_states.device)
            if hidden_states.shape[1] == seq_length:  # step 0: the collated rows
                hidden_states = hidden_states[:, keep]
            ahead = keep + idx  # the teacher tensors are padded by ttt_length rows
            self.share = len(keep) / T
            self.rows = T / dist.get_world_size(group)  # each rank's part of B * T
            return StepState(
                input_ids=global_input_ids[:, keep], hidden_states=hidden_states,
                position_ids=position_ids[:, keep], attention_mask=attention_mask,
                target_p=target_p_padded[:, ahead],
                target_p_on_draft=None if target_p_on_draft_padded is None
                else target_p_on_draft_padded[:, ahead],
                target_token_ids=None if target_token_ids_padded is None
                else target_token_ids_padded[:, ahead],
                position_mask=position_mask[:, keep], loss_mask=loss_mask[:, keep])

        def reduce_metrics(self, *, local_correct, local_denom):
            group = cp_group()
            return (dist_nn.all_reduce(local_correct, group=group),
                    dist_nn.all_reduce(local_denom, group=group))

        def reduce_loss(self, loss):
            # the local loss is a mean over B * (kept rows); times kept/T it is this rank's
            # part of SpecForge's B * T mean, and the sum over the group is that mean
            return dist_nn.all_reduce(loss * self.share, group=cp_group())

    class RingOnlineEagle3Model(OnlineEagle3Model):
        def _make_adapter(self):
            return RingAdapter(self)

        def _acc_and_loss(self, *, logits, target_p, target_p_on_draft, target_token_ids,
                          position_mask, loss_mask, adapter):
            # the loss is global on every rank of the group; its weight in SpecForge's
            # metric reduction over the world (sum of loss * B * rows over sum of B * rows)
            # is B * T per CP group, shared among its ranks (as one DP rank's B * T)
            out = self._local_acc_and_loss(
                logits=logits, target_p=target_p, target_p_on_draft=target_p_on_draft,
                target_token_ids=target_token_ids, position_mask=position_mask,
                loss_mask=loss_mask, adapter=adapter)
            rows = torch.tensor(logits.shape[0] * adapter.rows, device=logits.device,
                                dtype=torch.float32)
            return (*out[:-1], rows)

        def _local_acc_and_loss(self, *, logits, target_p, target_p_on_draft,
                                target_token_ids, position_mask, loss_mask, adapter):
            if logits.is_cuda:  # SpecForge's Triton loss
                return super()._acc_and_loss(
                    logits=logits, target_p=target_p, target_p_on_draft=target_p_on_draft,
                    target_token_ids=target_token_ids, position_mask=position_mask,
                    loss_mask=loss_mask, adapter=adapter)
            # off CUDA there is no Triton driver: the same forward KL, written in torch
            with torch.no_grad():
                guess = logits.argmax(-1)
                hits = (guess + self.draft_model.d2t[guess]) == target_token_ids
                correct = (hits * loss_mask.squeeze(-1)).sum()
                denom = loss_mask.sum().clamp_min(1e-6)
                correct, denom = adapter.reduce_metrics(local_correct=correct,
                                                        local_denom=denom)
                acc = correct / denom
            logp = torch.log_softmax(logits.float(), dim=-1)
            kl = -(position_mask * (target_p * logp)).sum(-1).mean()
            kl = adapter.reduce_loss(kl)
            with torch.set_grad_enabled(self.lk_loss_type is not None):
                rate, log_rate = compute_acceptance_rate(
                    logits=logits, target_probs=target_p_on_draft, position_mask=position_mask,
                    reduce_fn=adapter.reduce_metrics)
            loss = kl if self.lk_loss_type is None else compute_lk_loss(
                kl_loss=kl, acceptance_rate=rate, log_acceptance_rate=log_rate,
                lk_loss_type=self.lk_loss_type, kl_scale=self.kl_scale, kl_decay=self.kl_decay)
            rows = torch.tensor(logits.shape[0] * logits.shape[1], device=logits.device,
                                dtype=torch.float32)
            return acc, rate, loss, correct, denom, loss.detach(), rows

    return RingOnlineEagle3Model


def check_run_config(cfg, world_size: int, cp_size: int) -> None:
    """Refuse what the ring path does not run (the same on every rank: the config is).

    Raises:
        ValueError: a backend other than sdpa, online or disaggregated data, SpecForge's
            own tp/sp sizes, or a world size that ``cp_size`` does not divide.
    """
    t = cfg.training
    if t.attention_backend != "sdpa":
        raise ValueError(f"ringattn's SpecForge draft runs with training.attention_backend: "
                         f"sdpa, not {t.attention_backend!r} (the draft's attention is "
                         "ringattn's whatever the backend name; sdpa is the one whose mask "
                         "and cache SpecForge builds for it)")
    if cfg.data.hidden_states_path is None:
        raise ValueError("ringattn's SpecForge launcher trains on offline features "
                         "(data.hidden_states_path); online capture is not supported")
    if cfg.deployment.mode != "local_colocated":
        raise ValueError(f"deployment.mode {cfg.deployment.mode!r} is not supported by "
                         "ringattn's SpecForge launcher (local_colocated only)")
    if (t.tp_size, t.sp_ulysses_size, t.sp_ring_size) != (1, 1, 1):
        raise ValueError("leave training.tp_size, sp_ulysses_size and sp_ring_size at 1: "
                         "the context-parallel size is the launcher's --cp-size")
    if cp_size < 1 or world_size % cp_size:
        raise ValueError(f"--cp-size {cp_size} must divide the world size {world_size}")


def ring_registry(*, ttt_length: int, layout: str = "zigzag"):
    """SpecForge's built-in algorithm registry whose "eagle3" entry also accepts
    ``RingLlamaForCausalLMEagle3``: its training model gets the CP adapter, its offline
    collator shards by ``layout`` (the draft config's ``ringattn.layout``) with halos of
    ``ttt_length`` (the run's ``training.ttt_length``) rows. Other drafts
    train as SpecForge trains them."""
    from specforge.algorithms.builtin import builtin_algorithm_registry
    from specforge.algorithms.common.providers import make_registration
    from specforge.algorithms.eagle3 import providers as eagle3_providers
    from specforge.algorithms.model_providers import build_eagle3_model
    from specforge.algorithms.registry import AlgorithmRegistry

    ring_options({"ringattn": {"layout": layout}})
    draft_class()
    Model = training_model_class()
    spec = eagle3_providers.algorithm_spec()
    arch = spec.draft.compatible_architectures | {ARCHITECTURE}
    spec = dataclasses.replace(spec, draft=dataclasses.replace(
        spec.draft, compatible_architectures=arch))
    prov = eagle3_providers.algorithm_providers()

    def build_training_model(cfg, draft, draft_config, target_config, tokenizer):
        parts = build_eagle3_model(cfg, draft, draft_config, target_config, tokenizer)
        if type(draft).__name__ == ARCHITECTURE:
            parts.model.__class__ = Model
        return parts

    def make_collator(stock):
        def build():
            fallback = stock()

            def collate(samples):
                import torch.distributed as dist

                if not dist.is_initialized():
                    return fallback(samples)
                group = cp_group()
                return collate_shard(samples, layout=layout, ttt_length=ttt_length,
                                     rank=dist.get_rank(group),
                                     world=dist.get_world_size(group))
            return collate
        return build

    prov = dataclasses.replace(
        prov,
        model=dataclasses.replace(
            prov.model, build_training_model=build_training_model,
            draft_config=dataclasses.replace(prov.model.draft_config,
                                             compatible_architectures=arch)),
        offline=tuple(dataclasses.replace(o, build_collator=make_collator(o.build_collator))
                      for o in prov.offline))
    registration = make_registration(spec, prov)
    others = [r for r in builtin_algorithm_registry() if r.name != "eagle3"]
    return AlgorithmRegistry((*others, registration))


def build(config_path: str, overrides=(), *, cp_size: int):
    """What SpecForge's ``specforge train`` worker does for an offline colocated run up to
    the run itself, with ``ring_registry`` and the CP group as SpecForge's "tp" dimension:
    returns SpecForge's application run (``.trainer``, ``.run()``), the process groups made
    (``specforge.distributed.destroy_distributed`` ends them). Needs the torchrun
    environment (one process per rank).

    Raises:
        ValueError: what ``check_run_config`` and ``ring_options`` refuse, or a draft config
            that does not name ``RingLlamaForCausalLMEagle3``; on every rank, before any
            process group is made.
    """
    import json
    import os

    from accelerate.utils import set_seed
    from specforge.application import build_application_run, resolve_run
    from specforge.config import load_config
    from specforge.distributed import destroy_distributed, init_distributed

    cfg = load_config(config_path, list(overrides))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    check_run_config(cfg, world, cp_size)
    with open(cfg.model.draft_model_config) as f:
        draft_config = json.load(f)
    options = ring_options(draft_config)
    if draft_config.get("architectures") != [ARCHITECTURE]:
        raise ValueError(f"the draft config {cfg.model.draft_model_config} must name "
                         f'"architectures": ["{ARCHITECTURE}"] for ringattn\'s launcher')
    resolved = resolve_run(cfg, ring_registry(ttt_length=cfg.training.ttt_length,
                                              layout=options["layout"]))
    os.environ["FSDP_SHARDING"] = cfg.training.fsdp_sharding
    set_seed(cfg.training.seed)
    init_distributed(timeout=cfg.training.dist_timeout, tp_size=cp_size)
    try:
        return build_application_run(resolved)
    except BaseException:
        destroy_distributed()
        raise


def train(config_path: str, overrides=(), *, cp_size: int) -> int:
    """``build`` then SpecForge's run; returns what it returns (the trainer's last step)."""
    from specforge.distributed import destroy_distributed

    run = build(config_path, overrides, cp_size=cp_size)
    try:
        return run.run()
    finally:
        destroy_distributed()


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
