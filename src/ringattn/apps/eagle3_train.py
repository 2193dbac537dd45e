"""Eagle3 draft training, online against a transformers target, on a DP x CP mesh.

Every step: the target (a tiny random-weight ``LlamaForCausalLM``, frozen) runs on the batch
under context parallelism through the transformers integration, the draft unrolls its TTT
steps on this rank's tokens (``eagle3_step``), the draft's gradients are summed over the CP
ranks and averaged over the DP replicas (one all-reduce each: ``train_step``), and AdamW
steps. Per-TTT-step loss
and accuracy are global means (over CP and DP). Without a group the same code runs in one
process with the dense TTT mask: the baseline the CP run must match.

    python -m ringattn.apps.eagle3_train --world 2          # spawns 2 gloo CPU ranks
    torchrun --nproc-per-node 4 -m ringattn.apps.eagle3_train --dp 2   # DP 2 x CP 2
"""

from __future__ import annotations

import functools
import json
import math
import os
import sys
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..comm import metadata_device, resolve_group
from ..integrations import transformers as ra_hf
from ..layouts import LAYOUTS, local_positions
from . import Number, Parser, World, check_model_dir, number_error, require_extra
from .train import leave_together, peak_rss_mib, plot_curves, spawn
from ..eagle3.draft import (Eagle3Draft, aux_layer_ids, draft_vocabulary, eagle3_step, run_target,
                    shard_target_outputs)
from ..eagle3.export import FORMATS, export_draft
from ..eagle3.target import OfflineSamples, load_target

__all__ = ["Eagle3Config", "build_target", "build_draft", "make_batches", "train_step",
           "train_eagle3", "spawn_eagle3", "shard_ranges", "SYNTHETIC_MIN_SEQLEN"]


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
STRATEGIES = ("ring", "ulysses")
"""CP strategies of the training run (the hybrid needs a 2-D mesh: the library call)."""


@dataclass(frozen=True)
class Eagle3Config:
    """Sizes and schedule of an Eagle3 draft training run (defaults: the demo's)."""

    seqlen: int = 250
    """Global S (need not divide 2 x the CP size)."""
    batch: int = 2
    """Rows per DP replica; the last row of each batch is right padded."""
    steps: int = 100
    """Optimizer steps."""
    ttt_steps: int = 7
    decay: float = 0.8
    vocab: int = 96
    draft_vocab: int = 48
    hidden: int = 64
    heads: int = 4
    kv_heads: int = 2
    intermediate: int = 128
    target_layers: int = 4
    teacher: str = "auto"
    """``run_target``'s teacher: "auto" (in tiles where the target's head can be read: no
    [L, V] logits), "tiled" or "logits" (the target's whole logits)."""
    target_init_std: float = 0.05
    """Initial weight scale of the random target."""
    target_embed_scale: float = 3.0
    """The random target ties its input and output embeddings, scaled by this: its next-token
    distribution then peaks (about 0.8) on a token determined mostly by the current one, a
    teacher a draft learns in tens of steps (at 1.0 the distributions are nearly uniform)."""
    lr: float = 3e-3
    """Peak AdamW learning rate."""
    warmup: int = 0
    """Optimizer steps of linear warm-up to ``lr``; then cosine decay to ``min_lr_ratio``."""
    min_lr_ratio: float = 0.1
    """The cosine schedule ends at this fraction of ``lr``."""
    grad_clip: float = 1.0
    """Clip the global gradient norm (over every rank's share) to this; 0: no clipping."""
    accumulate: int = 1
    """Batches per optimizer step (gradient accumulation)."""
    dtype: str = "float32"
    """"float32", or "bfloat16": the target and the draft's compute in bf16 (autocast), the
    draft's master weights, gradients, reductions and optimizer in fp32."""
    save_every: int = 0
    """Save a checkpoint (resumable state and the exported draft) every this many optimizer
    steps, and at the end (0: only at the end; needs ``out_dir``)."""
    layout: str = "zigzag"
    strategy: str = "ring"
    """How the target's attention and the draft's TTT attention run under CP: "ring" or
    "ulysses" (heads over the ranks; the heads must divide by the CP size)."""
    dp: int = 1
    """Data-parallel replicas; the world is dp x cp."""
    seed: int = 0
    pad: int = 37
    """Right padding of each batch's last row (tokens; synthetic data only)."""
    target: str | None = None
    """A local transformers model directory (``load_target``); None: the tiny random Llama
    above (``vocab``, ``hidden``, ... describe it)."""
    data: str | None = None
    """JSON lines of conversations (``data.load_conversations``), rendered with the target's
    tokenizer and chat template (needs ``target``); None: synthetic random tokens."""
    pack: bool = False
    """Pack several conversations per row (``cu_seqlens``; then ``batch`` must be 1)."""
    shard_target: bool = False
    """Shard the frozen target's parameters over every rank with FSDP2 (``fully_shard`` per
    decoder layer and at the root): for targets that do not fit one device; each layer's
    weights are all-gathered for its forward and freed after."""
    offline: str | None = None
    """A directory ``python -m ringattn.apps.eagle3_target`` wrote: train on the stored target
    outputs instead of running the target (``target`` still gives the draft its layer
    config and embedding)."""
    held_out: int = 0
    """With ``data`` (or ``offline``): the last this many conversations (stored samples)
    are left out of training and of the draft vocabulary; the command line's closing
    evaluation prompts from them."""

    def __post_init__(self):
        for name in ("seqlen", "batch", "steps", "ttt_steps", "vocab", "draft_vocab", "hidden",
                     "heads", "kv_heads", "intermediate", "target_layers", "dp", "accumulate"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        for name in ("warmup", "save_every", "held_out"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{name} must be an int >= 0, got {v!r}")
        if not (isinstance(self.lr, (int, float)) and not isinstance(self.lr, bool)
                and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite float > 0, got {self.lr!r}")
        if not 0 <= self.min_lr_ratio <= 1:
            raise ValueError(f"min_lr_ratio must lie in [0, 1], got {self.min_lr_ratio!r}")
        if not self.grad_clip >= 0:
            raise ValueError(f"grad_clip must be >= 0, got {self.grad_clip!r}")
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {sorted(DTYPES)}, got {self.dtype!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {self.layout!r}")
        if self.strategy not in STRATEGIES:
            raise ValueError(f"strategy must be one of {STRATEGIES}, got {self.strategy!r}")
        if self.teacher not in ("auto", "tiled", "logits"):
            raise ValueError(f"teacher must be one of ('auto', 'tiled', 'logits'), got "
                             f"{self.teacher!r}")
        if self.strategy != "ring" and self.offline is not None:
            raise ValueError("offline training runs the draft's attention on the ring only")
        if not 0 <= self.pad < self.seqlen:
            raise ValueError(f"pad must lie in [0, seqlen={self.seqlen}), got {self.pad}")
        if self.draft_vocab > self.vocab and self.target is None:
            raise ValueError(f"draft_vocab={self.draft_vocab} exceeds vocab={self.vocab}")
        if self.offline is not None and (self.target is None or self.data is not None):
            raise ValueError("offline needs target (the draft's config and embedding) and no data")
        if self.data is not None and self.target is None:
            raise ValueError("data needs a target (its tokenizer renders the conversations)")
        if self.pack and (self.data is None or self.batch != 1):
            raise ValueError("pack needs data and batch=1 (packed rows carry their own documents)")
        if self.held_out and self.data is None and self.offline is None:
            raise ValueError("held_out needs data or offline (conversations to hold out)")

    def check_world(self, world: int) -> None:
        """Refuse a world size W this configuration cannot run on (``spawn`` and the CLI
        call it before starting any rank).

        Raises:
            ValueError: W not an int >= 1, or not a multiple of ``dp``.
        """
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            raise ValueError(f"world must be an int >= 1, got {world!r}")
        if world % self.dp:
            raise ValueError(f"the world of {world} ranks does not split into dp={self.dp} "
                             f"replicas")


PROMPT_TOKENS = 8
"""Synthetic rows: the first this many tokens are a prompt, not trained on."""

SYNTHETIC_MIN_SEQLEN = PROMPT_TOKENS + Eagle3Config.ttt_steps + 1
"""The shortest synthetic row (``make_batches``) on which every TTT step trains: TTT step j
counts a position i >= ``PROMPT_TOKENS`` whose token i + 1 + j is in the row, so the last
of the ``ttt_steps`` needs ``PROMPT_TOKENS + ttt_steps + 1`` tokens (16; shorter rows leave
steps, or below 10 every step, with no target: losses 0, accuracies nan)."""


def synthetic_min_seqlen(cfg: Eagle3Config) -> int:
    """``SYNTHETIC_MIN_SEQLEN`` for ``cfg.ttt_steps``."""
    return PROMPT_TOKENS + cfg.ttt_steps + 1


def build_target(cfg: Eagle3Config, attn_implementation: str):
    """The frozen target: ``cfg.target`` loaded (``load_target``), or a tiny random
    ``LlamaForCausalLM``, seeded (the same in every process)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if cfg.target is not None:
        return load_target(cfg.target, dtype=cfg.dtype, attn_implementation=attn_implementation)
    if attn_implementation == ra_hf.NAME:
        ra_hf.register()
    config = LlamaConfig(
        vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
        num_hidden_layers=cfg.target_layers, num_attention_heads=cfg.heads,
        num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.seqlen + cfg.ttt_steps,
        bos_token_id=None, eos_token_id=None, pad_token_id=None, tie_word_embeddings=True,
    )
    config.initializer_range = cfg.target_init_std
    config._attn_implementation = attn_implementation
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        model = LlamaForCausalLM(config).float().eval()
    model.get_input_embeddings().weight.data.mul_(cfg.target_embed_scale)
    return model.requires_grad_(False)


def shard_target(target, group) -> None:
    """FSDP2 over ``group``: ``fully_shard`` every decoder layer, then the root module (the
    target stays frozen: no gradient is reduced)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp import fully_shard

    device = "cuda" if "nccl" in str(dist.get_backend(group)) else "cpu"
    mesh = DeviceMesh.from_group(group, device)
    for layer in target.model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(target, mesh=mesh)


def draft_config(target_config):
    """The draft layer's ``LlamaConfig`` for a target: its width, heads, head dim, MLP width
    and activation, norm epsilon, vocabulary, context length and RoPE (what EAGLE3 drafts
    and the servers' ``LlamaForCausalLMEagle3`` use), one layer, untied head."""
    from transformers import LlamaConfig

    t = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    heads = t.num_attention_heads
    return LlamaConfig(
        hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        num_attention_heads=heads, num_key_value_heads=getattr(t, "num_key_value_heads", heads),
        head_dim=getattr(t, "head_dim", None) or t.hidden_size // heads,
        rms_norm_eps=getattr(t, "rms_norm_eps", 1e-6), vocab_size=t.vocab_size,
        max_position_embeddings=t.max_position_embeddings,
        rope_parameters=dict(getattr(t, "rope_parameters", None) or {"rope_type": "default",
                                                                      "rope_theta": 10000.0}),
        hidden_act=getattr(t, "hidden_act", "silu"), num_hidden_layers=1,
        tie_word_embeddings=False, initializer_range=0.02,
        bos_token_id=None, eos_token_id=None, pad_token_id=None)


def build_draft(cfg: Eagle3Config, target, draft_ids: torch.Tensor) -> Eagle3Draft:
    """A seeded one-layer draft sharing the target's (frozen) token embedding, reading the
    target's ``eagle3_aux_layers`` (``load_target``) or ``aux_layer_ids``."""
    config = draft_config(target.config)
    layers = getattr(target, "eagle3_aux_layers", None) or aux_layer_ids(
        target.config.num_hidden_layers)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed + 7)
        draft = Eagle3Draft(config, target.config.hidden_size, draft_ids, layers).float()
        for name, p in draft.named_parameters():
            if p.dim() == 2 and name != "embed_tokens.weight":
                torch.nn.init.normal_(p, std=0.02)
    draft.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight.float())
    return draft.train()


def _check_held_out(cfg: Eagle3Config, count: int, what: str) -> None:
    if cfg.held_out >= count:
        raise ValueError(f"{what} holds {count} conversations: holding out held_out="
                         f"{cfg.held_out} (the command line's --eval-prompts) for the closing "
                         f"evaluation leaves none to train on")


def chat_rows(cfg: Eagle3Config, *, held_out: bool = False) -> tuple[list[dict], list]:
    """(training rows, rendered samples) of ``cfg.data`` with ``cfg.target``'s tokenizer:
    every conversation but the last ``cfg.held_out``; with ``held_out``, (None, the held
    out conversations' samples)."""
    from transformers import AutoTokenizer

    from ..eagle3.data import load_conversations, make_rows, render

    conversations = load_conversations(cfg.data)
    _check_held_out(cfg, len(conversations), f"data {cfg.data!r}")
    keep = len(conversations) - cfg.held_out
    conversations = conversations[keep:] if held_out else conversations[:keep]
    tok = AutoTokenizer.from_pretrained(cfg.target, local_files_only=True)
    samples = [render(tok, c, max_len=cfg.seqlen) for c in conversations]
    if held_out:
        return None, samples
    pad = tok.pad_token_id if tok.pad_token_id is not None else 0
    return make_rows(samples, cfg.seqlen, pad_id=pad, pack=cfg.pack), samples


def offline_rows(cfg: Eagle3Config, *, held_out: bool = False) -> tuple[list[dict], list]:
    """(rows of ``cfg.offline``'s stored samples but the last ``cfg.held_out``, one per row
    cut or padded to S; their (ids, loss mask) pairs for the draft vocabulary); with
    ``held_out``, those of the last ``cfg.held_out`` samples."""
    stored = OfflineSamples(cfg.offline)
    _check_held_out(cfg, len(stored), f"offline {cfg.offline!r}")
    keep = len(stored) - cfg.held_out
    rows = [stored.batch([i], cfg.seqlen)
            for i in (range(keep, len(stored)) if held_out else range(keep))]
    samples = [(r["input_ids"][0][r["attention_mask"][0].bool()],
                r["loss_mask"][0][r["attention_mask"][0].bool()].bool()) for r in rows]
    return rows, samples


def check_inputs(cfg: Eagle3Config, resume: str | None = None) -> None:
    """Check what a run reads from disk before any rank starts (the command line calls it,
    so that a bad path is one line, not a failure on every rank): ``cfg.target`` is a
    model directory, ``cfg.data`` parses and holds more than ``cfg.held_out``
    conversations, ``cfg.offline`` is an offline directory stored for this target, and
    ``resume`` a checkpoint of this configuration before its last step.

    Raises:
        ValueError: naming the path and what is wrong with it.
    """
    if cfg.target is not None:
        check_model_dir(cfg.target, "target")
    if cfg.data is not None:
        from ..eagle3.data import load_conversations

        if not os.path.isfile(cfg.data):
            raise ValueError(f"data {cfg.data!r} is not a file")
        _check_held_out(cfg, len(load_conversations(cfg.data)), f"data {cfg.data!r}")
    if cfg.offline is not None:
        from transformers import AutoConfig

        stored = OfflineSamples(cfg.offline)
        _check_held_out(cfg, len(stored), f"offline {cfg.offline!r}")
        config = AutoConfig.from_pretrained(cfg.target, local_files_only=True)
        t = config.get_text_config() if hasattr(config, "get_text_config") else config
        index = stored.index
        want = {"target_hidden_size": t.hidden_size, "vocab_size": t.vocab_size,
                "aux_layers": list(aux_layer_ids(t.num_hidden_layers))}
        differ = [f"{k} {index.get(k)!r} (target {v!r})" for k, v in want.items()
                  if index.get(k) != v]
        if differ:
            raise ValueError(f"offline {cfg.offline!r} was not stored for target "
                             f"{cfg.target!r}: " + ", ".join(differ))
    if resume is not None:
        _check_resume_step(resume, read_checkpoint(resume, cfg, mmap=True), cfg)


def _check_resume_step(resume: str, state: dict, cfg: Eagle3Config) -> None:
    """Refuse a checkpoint at or past the last step: the run would train and export nothing
    (what ``ringattn train`` refuses too)."""
    step = int(state["step"])
    if step >= cfg.steps:
        raise ValueError(f"resume {resume!r} is at step {step}, not before the last of "
                         f"steps={cfg.steps}: nothing to train or export (raise --steps to "
                         f"train on from it)")


def _data_batches(cfg: Eagle3Config, rows: list[dict], replica: int | None):
    """``cfg.steps * cfg.accumulate`` batches of ``rows``: every epoch in a seeded order;
    batch t holds global rows t*dp*B .. (t+1)*dp*B - 1 of that order, replica r the r-th
    B of them (None: all)."""
    per = cfg.dp * cfg.batch
    order: list[int] = []
    epoch = 0
    for t in range(cfg.steps * cfg.accumulate):
        while len(order) < (t + 1) * per:
            gen = torch.Generator().manual_seed(cfg.seed * 1000 + epoch)
            order += torch.randperm(len(rows), generator=gen).tolist()
            epoch += 1
        picked = order[t * per:(t + 1) * per]
        if replica is not None:
            picked = picked[replica * cfg.batch:(replica + 1) * cfg.batch]
        keys = [k for k in ("input_ids", "loss_mask", "attention_mask", "aux_hidden",
                            "final_hidden", "logits") if k in rows[picked[0]]]
        batch = {k: torch.cat([rows[i][k] for i in picked]) for k in keys}
        if "head" in rows[picked[0]]:  # offline version 3: the target's head, one for all rows
            batch["head"] = rows[picked[0]]["head"]
        if cfg.pack:
            batch["cu_seqlens"] = rows[picked[0]]["cu_seqlens"]
            batch.pop("attention_mask")  # the padding is a document of its own
        yield batch


def make_batches(cfg: Eagle3Config, replica: int | None = 0, rows: list[dict] | None = None):
    """Yield ``cfg.steps * cfg.accumulate`` global batches for DP replica ``replica`` (the
    rows of chat data when ``rows`` are given, ``_data_batches``; else synthetic, the same on its CP
    ranks; None: all replicas' rows, for one process): ``input_ids`` [B, S],
    ``attention_mask`` (each replica's last row right padded by ``pad``) and ``loss_mask``
    (a prompt of ``PROMPT_TOKENS`` tokens is not trained on, nor is padding)."""
    if rows is not None:
        yield from _data_batches(cfg, rows, replica)
        return
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + 17)
    for _ in range(cfg.steps * cfg.accumulate):
        ids = torch.randint(cfg.vocab, (cfg.dp, cfg.batch, cfg.seqlen), generator=gen)
        keep = torch.ones_like(ids)
        keep[:, -1, cfg.seqlen - cfg.pad:] = 0
        loss_mask = keep.clone()
        loss_mask[:, :, :PROMPT_TOKENS] = 0
        picked = slice(None) if replica is None else slice(replica, replica + 1)
        yield {"input_ids": ids.masked_fill(keep == 0, 0)[picked].flatten(0, 1),
               "attention_mask": keep[picked].flatten(0, 1),
               "loss_mask": loss_mask[picked].flatten(0, 1)}


def shard_ranges(seqlen: int, layout: str, rank: int, world: int) -> list[list[int]]:
    """The global positions [start, stop) a CP rank holds, as runs (padding left out)."""
    pos = [p for p in local_positions(layout, rank, world, seqlen).tolist() if p < seqlen]
    runs: list[list[int]] = []
    for p in pos:
        if runs and runs[-1][1] == p:
            runs[-1][1] = p + 1
        else:
            runs.append([p, p + 1])
    return runs


def _describe_ranges(runs) -> str:
    if len(runs) > 4:
        return f"{len(runs)} positions, every {runs[1][0] - runs[0][0]}th from {runs[0][0]}"
    return " + ".join(f"[{a}, {b})" for a, b in runs)


def _mesh(dp: int):
    """(cp group, dp group, dp rank, cp rank, cp size) on a DP x CP mesh of the world."""
    from torch.distributed.device_mesh import init_device_mesh

    world = dist.get_world_size()
    if world % dp:
        raise ValueError(f"the world of {world} ranks does not split into dp={dp} replicas")
    mesh = init_device_mesh("cpu", (dp, world // dp), mesh_dim_names=("dp", "cp"))
    return (mesh["cp"].get_group(), mesh["dp"].get_group(), mesh.get_local_rank("dp"),
            mesh.get_local_rank("cp"), world // dp)


def _draft_ids(cfg: Eagle3Config, target, group, samples=None):
    """The draft vocabulary: with chat data, the most frequent loss tokens of the data
    (``data.frequency_vocabulary``); else the target's most frequent top tokens on the
    first batch."""
    if samples is not None:
        from ..eagle3.data import frequency_vocabulary

        return frequency_vocabulary(samples, target.config.vocab_size, cfg.draft_vocab)
    first = next(make_batches(Eagle3Config(**{**asdict(cfg), "steps": 1}), replica=0))
    tgt = run_target(target, first, group=group, layout=cfg.layout,
                     strategy=cfg.strategy if group is not None else "ring")
    top = tgt.top_tokens()[tgt.valid_mask]  # real tokens (not the shards' padding)
    vocab = target.config.vocab_size
    counts = torch.bincount(top, minlength=vocab)
    if group is not None:
        dist.all_reduce(counts, group=group)
    return draft_vocabulary(torch.repeat_interleave(torch.arange(vocab), counts), vocab,
                            cfg.draft_vocab)


def lr_factor(step: int, cfg: Eagle3Config) -> float:
    """The learning-rate multiplier of optimizer step ``step`` (0-based): linear warm-up over
    ``cfg.warmup`` steps, then cosine decay from 1 to ``cfg.min_lr_ratio`` at the last step."""
    if step < cfg.warmup:
        return (step + 1) / cfg.warmup
    span = max(cfg.steps - cfg.warmup - 1, 1)
    t = min((step - cfg.warmup) / span, 1.0)
    return cfg.min_lr_ratio + (1 - cfg.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * t))


def make_optimizer(draft: Eagle3Draft, cfg: Eagle3Config):
    """(AdamW over the draft's trainable parameters, its warm-up + cosine scheduler)."""
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=0.0)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: lr_factor(step, cfg))


def train_step(target, draft: Eagle3Draft, opt, batch, cfg: Eagle3Config, *,
               cp_group=None, dp_group=None, scheduler=None) -> torch.Tensor:
    """One optimizer step: for each batch (a dict, or a list of ``cfg.accumulate`` dicts)
    the target under CP, the TTT unroll and its backward; then the draft's gradients summed
    over the CP shares (one all-reduce) and averaged over the DP replicas (one more, with
    ``dp_group``), clipped to ``cfg.grad_clip`` globally, AdamW, the scheduler.

    With ``cfg.dtype`` bfloat16 the unroll computes under CPU/CUDA autocast; parameters,
    gradients and reductions stay fp32.

    Returns:
        [3, T] float64 (loss, correct, counted) sums of every TTT step over CP and DP and
        the accumulated batches (each loss sum is a batch's replica mean; divide by
        replicas x batches).
    """
    batches = batch if isinstance(batch, list) else [batch]
    params = [p for p in draft.parameters() if p.requires_grad]
    opt.zero_grad(set_to_none=False)
    sums = None
    for one in batches:
        if "aux_hidden" in one:  # offline: the target's outputs were stored (OfflineSamples)
            tgt = shard_target_outputs(one, group=cp_group, layout=cfg.layout)
        else:
            tgt = run_target(target, one, group=cp_group, layout=cfg.layout,
                             strategy=cfg.strategy if cp_group is not None else "ring",
                             teacher=cfg.teacher)
        dev = tgt.aux_hidden.device.type
        with torch.autocast(dev, dtype=torch.bfloat16, enabled=cfg.dtype == "bfloat16"):
            res = eagle3_step(draft, tgt, steps=cfg.ttt_steps, decay=cfg.decay)
        (res.loss / len(batches)).backward()
        sums = res.sums if sums is None else sums + res.sums
    if cp_group is not None:
        flat = torch.cat([p.grad.reshape(-1) for p in params])
        dist.all_reduce(flat, group=cp_group)  # each rank holds its share's gradient
        if dp_group is not None:
            dist.all_reduce(flat, group=dp_group)
            flat /= dist.get_world_size(dp_group)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset:offset + p.numel()].view_as(p))
            offset += p.numel()
        if dp_group is not None:
            reduced = sums.to(metadata_device(dp_group))
            dist.all_reduce(reduced, group=dp_group)
            sums = reduced.cpu()
    if cfg.grad_clip:  # the same global norm on every rank: the gradients are reduced
        torch.nn.utils.clip_grad_norm_(params, cfg.grad_clip)
    opt.step()
    if scheduler is not None:
        scheduler.step()
    return sums


def save_random_target(target, path: str) -> str | None:
    """Save the tiny random target (``save_pretrained``) into ``path`` so that the
    speculators export can name it as its verifier; returns ``path``, or None for a
    sharded (FSDP2) target, whose gathering would be a collective."""
    if any(type(p).__name__ == "DTensor" for p in target.parameters()):
        return None
    target.save_pretrained(path)
    return path


CHECKPOINT = "state.pt"
"""A checkpoint directory's resumable state (``save_checkpoint``)."""


def save_checkpoint(path: str, draft: Eagle3Draft, opt, scheduler, step: int,
                    cfg: Eagle3Config, history: dict) -> None:
    """Write ``path``/state.pt: the draft, optimizer, scheduler, the optimizer steps done (the
    data position: batches are a function of the step), torch's RNG state, the config and
    the curves so far. Rank 0 writes; every rank holds the same draft."""
    os.makedirs(path, exist_ok=True)
    state = {"draft": draft.state_dict(), "optimizer": opt.state_dict(),
             "scheduler": scheduler.state_dict(), "step": step, "rng": torch.get_rng_state(),
             "config": asdict(cfg), "history": history}
    tmp = os.path.join(path, CHECKPOINT + ".tmp")
    torch.save(state, tmp)
    os.replace(tmp, os.path.join(path, CHECKPOINT))  # a crash mid-write keeps the old one


def read_checkpoint(path: str, cfg: Eagle3Config, *, mmap: bool = False) -> dict:
    """The state ``save_checkpoint`` wrote into ``path``, checked against ``cfg``
    (``mmap``: tensors mapped from the file, not read, for a check alone).

    Raises:
        ValueError: no checkpoint there, or one written with another configuration (other
            than the number of steps and the save interval).
    """
    file = os.path.join(str(path), CHECKPOINT)
    if not os.path.isfile(file):
        raise ValueError(f"no Eagle3 checkpoint at {path!r} (expected {CHECKPOINT} there)")
    try:
        try:
            state = torch.load(file, map_location="cpu", weights_only=False, mmap=mmap)
        except RuntimeError:
            if not mmap:
                raise
            state = torch.load(file, map_location="cpu", weights_only=False)  # not a zip
        theirs = state["config"]
    except Exception as exc:  # a truncated or foreign file: say which, not torch's internals
        raise ValueError(f"{file!r} is not a readable Eagle3 checkpoint ({exc})") from None
    ours = asdict(cfg)
    # a field added since the checkpoint was written counts as its default
    differ = sorted(k for k in ours if k not in ("steps", "save_every")
                    and ours[k] != theirs.get(k, getattr(Eagle3Config, k)))
    if differ:
        raise ValueError(f"checkpoint {path!r} was written with another configuration: "
                         + ", ".join(f"{k}={theirs.get(k)!r} (now {ours[k]!r})" for k in differ))
    return state


def load_checkpoint(path: str, draft: Eagle3Draft, opt, scheduler, cfg: Eagle3Config) -> tuple[int, dict]:
    """Restore what ``save_checkpoint`` wrote into ``draft``, ``opt`` and ``scheduler``;
    return (optimizer steps done, curves so far).

    Raises:
        ValueError: no checkpoint there, or one written with another configuration (other
            than the number of steps and the save interval).
    """
    state = read_checkpoint(path, cfg)
    draft.load_state_dict(state["draft"])
    opt.load_state_dict(state["optimizer"])
    scheduler.load_state_dict(state["scheduler"])
    torch.set_rng_state(state["rng"])
    return int(state["step"]), state["history"]


def train_eagle3(cfg: Eagle3Config, *, group=None, progress: bool = True,
                 out_dir: str | None = None, log_every: int = 10,
                 resume: str | None = None, keep_draft: bool = False) -> dict:
    """Train the draft; with a group (the whole world, split dp x cp), under CP.

    Rank 0 prints every rank's shard ranges at start, shows a tqdm bar, and (with
    ``progress``) a line of per-TTT-step losses and accuracies every ``log_every`` steps;
    with ``out_dir`` it writes ``eagle3.json``, ``eagle3.png`` (per-TTT-step loss),
    ``eagle3_accuracy.png``, checkpoints ``checkpoint-<step>/`` every ``cfg.save_every``
    steps and ``checkpoint-last/`` at the end (each resumable, ``save_checkpoint``).
    ``resume``: a checkpoint directory to continue from (the same configuration; the run
    then gives the losses and parameters of one that was never stopped).

    Returns:
        dict (the same on every rank): ``config``, ``world``, ``cp``, ``dp``, per-step
        ``loss`` (the weighted total) and ``lr``, per-TTT-step lists ``step_loss[j]`` and
        ``step_accuracy[j]`` over the optimizer steps (including those before ``resume``),
        ``shard_ranges`` (per CP rank), ``tokens_per_s_mean``, ``seconds``,
        ``peak_rss_mib`` (per rank); with ``keep_draft``, ``draft`` (the trained
        ``Eagle3Draft``; the rest of the dict is JSON).
    """
    from tqdm.auto import tqdm

    if group is None:
        cp_group = dp_group = None
        rank = dp_rank = cp_rank = 0
        world = cp = 1
        target = build_target(cfg, "sdpa")
    else:
        pg = resolve_group(group)
        world, rank = dist.get_world_size(pg), dist.get_rank(pg)
        cp_group, dp_group, dp_rank, cp_rank, cp = _mesh(cfg.dp)
        target = build_target(cfg, ra_hf.NAME)
    rows, samples = chat_rows(cfg) if cfg.data is not None else (None, None)
    if cfg.offline is not None:
        rows, samples = offline_rows(cfg)
    draft = build_draft(cfg, target, _draft_ids(cfg, target, cp_group, samples))
    if cfg.shard_target and group is not None:
        shard_target(target, pg)  # after build_draft copied the (whole) embedding
    opt, scheduler = make_optimizer(draft, cfg)
    history = {"loss": [], "lr": [], "step_loss": [[] for _ in range(cfg.ttt_steps)],
               "step_accuracy": [[] for _ in range(cfg.ttt_steps)]}
    start = 0
    if resume is not None:
        start, history = load_checkpoint(resume, draft, opt, scheduler, cfg)
        _check_resume_step(resume, {"step": start}, cfg)  # the same on every rank
    # every rank reports the positions it holds; rank 0 prints them in rank order
    mine = (dp_rank, cp_rank, shard_ranges(cfg.seqlen, cfg.layout, cp_rank, cp))
    reports = [mine]
    if group is not None:
        reports = [None] * world
        dist.all_gather_object(reports, mine, group=pg)
    ranges = [runs for d, c, runs in sorted(reports, key=lambda x: x[1]) if d == 0]
    show = progress and rank == 0
    if show:
        for r, (d, c, runs) in enumerate(reports):
            print(f"rank {r} (dp {d}, cp {c}) holds {_describe_ranges(runs)} "
                  f"of S={cfg.seqlen}", flush=True)
    rates = []
    t_start = time.perf_counter()
    replicas = 1 if group is None else cfg.dp  # one process takes every replica's rows
    batches = make_batches(cfg, None if group is None else dp_rank, rows)
    for _ in range(start * cfg.accumulate):  # the data position: batches follow the step
        next(batches)
    weights = torch.tensor([cfg.decay ** j for j in range(cfg.ttt_steps)], dtype=torch.float64)
    # advanced by hand after each step (a bar wrapped around the steps shows the count it
    # last synced when set_postfix redraws it: 0/N throughout on fast steps)
    bar = tqdm(total=cfg.steps, initial=start, disable=not show,
               desc="eagle3 draft, " + ("one process" if group is None else
                                         f"dp {cfg.dp} x cp {cp}, {cfg.strategy}"))
    for step in range(start, cfg.steps):
        t0 = time.perf_counter()
        lr = scheduler.get_last_lr()[0]
        sums = train_step(target, draft, opt, [next(batches) for _ in range(cfg.accumulate)],
                          cfg, cp_group=cp_group, dp_group=dp_group if replicas > 1 else None,
                          scheduler=scheduler)
        per = replicas * cfg.accumulate
        history["loss"].append(float((sums[0] * weights).sum()) / per)
        history["lr"].append(lr)
        for j in range(cfg.ttt_steps):
            history["step_loss"][j].append(float(sums[0, j]) / per)
            history["step_accuracy"][j].append(
                float(sums[1, j] / sums[2, j]) if sums[2, j] > 0 else float("nan"))
        rates.append(cfg.batch * cfg.dp * cfg.accumulate * cfg.seqlen / (time.perf_counter() - t0))
        acc = history["step_accuracy"]
        bar.update(1)
        bar.set_postfix(loss=f"{history['loss'][-1]:.4f}", acc0=f"{acc[0][-1]:.3f}",
                        acc_last=f"{acc[-1][-1]:.3f}")
        n = step + 1
        if show and log_every and (n % log_every == 0 or n == cfg.steps):
            per_step = " ".join(f"{history['step_loss'][j][-1]:.3f}" for j in range(cfg.ttt_steps))
            bar.write(f"step {n}: loss {history['loss'][-1]:.4f}; per TTT step loss {per_step}; "
                      f"accuracy {' '.join(f'{acc[j][-1]:.3f}' for j in range(cfg.ttt_steps))}")
        if out_dir is not None and rank == 0:
            # the last step is both checkpoint-<n> (when save_every divides it) and -last
            names = ([f"checkpoint-{n}"] if cfg.save_every and n % cfg.save_every == 0 else []) \
                + (["checkpoint-last"] if n == cfg.steps else [])
            for name in names:
                save_checkpoint(os.path.join(out_dir, name), draft, opt, scheduler, n, cfg,
                                history)
            if n == cfg.steps:  # what servers load (SGLang / SpecForge, and vLLM's speculators)
                verifier = cfg.target or save_random_target(target, os.path.join(out_dir, "target"))
                for fmt in FORMATS:
                    export_draft(draft, os.path.join(out_dir, f"draft-{fmt}"), fmt,
                                 target=verifier)
    bar.close()
    seconds = time.perf_counter() - t_start
    later = rates[1:] or rates or [float("nan")]
    peak = torch.tensor([peak_rss_mib()], dtype=torch.float64)
    peaks = [float(peak)]
    if group is not None:
        gathered = [torch.zeros_like(peak) for _ in range(world)]
        dist.all_gather(gathered, peak, group=pg)
        peaks = [float(t) for t in gathered]
    result = {
        "config": asdict(cfg), "world": world, "cp": cp, "dp": cfg.dp, **history,
        "shard_ranges": ranges, "seconds": seconds,
        "target_sharded": any(type(p).__name__ == "DTensor" for p in target.parameters()),
        "tokens_per_s_mean": len(later) / sum(1.0 / r for r in later),
        "peak_rss_mib": peaks,
    }
    if out_dir is not None and rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "eagle3.json"), "w") as f:
            json.dump(result, f, indent=1)
        title = f"Eagle3 draft, S={cfg.seqlen}, dp {cfg.dp} x cp {cp}"
        step_loss, step_acc = history["step_loss"], history["step_accuracy"]
        plot_curves(os.path.join(out_dir, "eagle3.png"),
                    [(f"TTT step {j}", step_loss[j], {}) for j in range(cfg.ttt_steps)],
                    title=title, ylabel="per-TTT-step loss")
        plot_curves(os.path.join(out_dir, "eagle3_accuracy.png"),
                    [(f"TTT step {j}", step_acc[j], {}) for j in range(cfg.ttt_steps)],
                    title=title, ylabel="per-TTT-step accuracy")
    if keep_draft:
        result["draft"] = draft
    return result


def spawn_eagle3(cfg: Eagle3Config, *, world: int, progress: bool = True,
                 out_dir: str | None = None, resume: str | None = None) -> dict:
    """``train_eagle3`` on ``world`` local gloo ranks (dp x cp = world); rank 0's result.
    ``resume``: a checkpoint directory to continue from (``train_eagle3``)."""
    fn = train_eagle3 if resume is None else functools.partial(train_eagle3, resume=resume)
    return spawn(cfg, world=world, progress=progress, out_dir=out_dir, fn=fn)


EVAL_NEW_TOKENS = 32
"""Tokens generated per prompt by the closing evaluation."""
EVAL_DRAFT_LEN = 3
"""Proposals per round in the closing evaluation (the speculators export's
``speculative_tokens``)."""


def report_run(cfg: Eagle3Config, out_dir: str, *, prompts: int = 8) -> dict | None:
    """After a run: speculative decoding of the target with the EXPORTED draft (read back by
    ``load_draft``, as a server reads it) on ``prompts`` held-out prompts, printed as mean
    accepted tokens per round and acceptance per draft position, then where the checkpoint
    and both exports are. Held out: synthetic rows from a seed training never draws; with
    ``data`` (``offline``), the last ``cfg.held_out`` conversations (stored samples), which
    training left out, each up to its first trained (assistant) token.

    Returns:
        ``evaluate.acceptance``'s dict (None with ``prompts`` 0).
    """
    from ..eagle3.evaluate import acceptance
    from ..eagle3.export import load_draft

    result = None
    speculators = os.path.join(out_dir, "draft-speculators")
    if prompts > 0:
        with open(os.path.join(speculators, "config.json")) as f:
            verifier = json.load(f)["speculators_config"]["verifier"]["name_or_path"]
    if prompts > 0 and verifier is None:
        print("no held-out evaluation: the export names no target (an FSDP2-sharded random "
              "target is not saved)", flush=True)
    elif prompts > 0:
        target = load_target(verifier, attn_implementation="sdpa")
        draft = load_draft(speculators).eval()
        result = acceptance(target, draft, _eval_prompts(cfg, prompts),
                            max_new_tokens=EVAL_NEW_TOKENS, draft_len=EVAL_DRAFT_LEN)
        where = "synthetic rows" if cfg.data is None and cfg.offline is None else \
            f"the last {prompts} conversations, not trained on"
        print(f"held-out speculative decoding ({prompts} prompts: {where}; {EVAL_NEW_TOKENS} "
              f"new tokens, {EVAL_DRAFT_LEN} proposals per round, {result['rounds']} rounds): "
              f"{result['mean_accepted_per_round']:.3f} tokens per round; acceptance per draft "
              f"position " + " ".join(f"{a:.3f}" for a in result["per_position"]), flush=True)
    print(f"checkpoint: {os.path.abspath(os.path.join(out_dir, 'checkpoint-last'))}\n"
          f"SGLang / SpecForge draft: {os.path.abspath(os.path.join(out_dir, 'draft-sglang'))}\n"
          f"vLLM (speculators) draft: {os.path.abspath(speculators)}", flush=True)
    return result


def _eval_prompts(cfg: Eagle3Config, n: int) -> list[torch.Tensor]:
    """``n`` prompts: 16 tokens (fewer for shorter rows) of held-out synthetic rows; with
    data, the held-out conversations (``cfg.held_out`` of them, which must be ``n``), each
    up to its first trained token (its first assistant turn is what the target generates),
    or its first 16 tokens if it has none or starts with one."""
    length = min(16, cfg.seqlen)
    if cfg.data is not None or cfg.offline is not None:
        if cfg.held_out != n:
            raise ValueError(f"{n} evaluation prompts asked for, but held_out={cfg.held_out} "
                             f"conversations were left out of training")
        held = (chat_rows if cfg.data is not None else offline_rows)(cfg, held_out=True)[1]
        prompts = []
        for ids, mask in held:
            first = int(mask.nonzero()[0, 0]) if mask.any() else 0
            prompts.append(ids[:first] if first > 0 else ids[:length])
        return prompts
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + 99991)  # training draws seed*1000+17
    return list(torch.randint(cfg.vocab, (n, length), generator=gen))


PROG = "python -m ringattn.apps.eagle3_train"


def main(argv=None) -> int:
    """``python -m ringattn.apps.eagle3_train [options]``; see ``--help``.

    Returns:
        0 (bad arguments and paths exit with status 2 and one line, before any rank starts).
    """
    parser = Parser(prog=PROG, description=__doc__.split("\n\n")[0])
    d = Eagle3Config
    parser.add_argument("--world", type=World(), default=2,
                        help="ranks to spawn (ignored under torchrun; default 2; at most this "
                        "machine's cores, or 8 if it has fewer)")
    parser.add_argument("--dp", type=Number(int, 1), default=1,
                        help="data-parallel replicas; cp = world / dp (default 1)")
    parser.add_argument("--target", default=None,
                        help="a local transformers model directory (default: a tiny random Llama)")
    parser.add_argument("--data", default=None,
                        help="JSON lines of conversations (needs --target; default: synthetic "
                        "random tokens)")
    parser.add_argument("--pack", action="store_true",
                        help="pack conversations (needs --data and --batch 1; default off)")
    parser.add_argument("--shard-target", action="store_true",
                        help="shard the target's weights over all ranks with FSDP2 (default off)")
    parser.add_argument("--offline", default=None,
                        help="train on target outputs stored by python -m ringattn.apps.eagle3_target "
                        "(needs --target: the draft's config and embedding; default: run the "
                        "target online)")
    parser.add_argument("--steps", type=Number(int, 1), default=d.steps,
                        help=f"optimizer steps (default {d.steps})")
    parser.add_argument("--seqlen", type=Number(int, 1), default=d.seqlen,
                        help=f"global sequence length S of a row (default {d.seqlen}; at "
                        f"least {SYNTHETIC_MIN_SEQLEN} on the synthetic data)")
    parser.add_argument("--pad", type=Number(int, 0), default=None,
                        help=f"right padding of each batch's last row, synthetic data only "
                        f"(default {d.pad}, or seqlen // 4 when seqlen <= {d.pad})")
    parser.add_argument("--batch", type=Number(int, 1), default=d.batch,
                        help=f"rows per replica per batch (default {d.batch})")
    parser.add_argument("--accumulate", type=Number(int, 1), default=d.accumulate,
                        help=f"batches per optimizer step (default {d.accumulate})")
    parser.add_argument("--draft-vocab", type=Number(int, 1), default=d.draft_vocab,
                        help=f"draft vocabulary size; the target's whole vocabulary exports "
                        f"without d2t/t2d (default {d.draft_vocab})")
    parser.add_argument("--lr", type=Number(float, above=0), default=d.lr,
                        help=f"peak AdamW learning rate (default {d.lr})")
    parser.add_argument("--warmup", type=Number(int, 0), default=d.warmup,
                        help=f"steps of linear warm-up, then cosine decay (default {d.warmup})")
    parser.add_argument("--grad-clip", type=Number(float, 0), default=d.grad_clip,
                        help=f"global gradient-norm clip, 0: none (default {d.grad_clip})")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default=d.dtype,
                        help=f"compute dtype; bfloat16 keeps fp32 master weights (default "
                        f"{d.dtype})")
    parser.add_argument("--save-every", type=Number(int, 0), default=d.save_every,
                        help=f"checkpoint every this many steps, 0: only at the end (default "
                        f"{d.save_every})")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="zigzag",
                        help="how the sequence is split over the CP ranks (default zigzag)")
    parser.add_argument("--strategy", choices=STRATEGIES, default=d.strategy,
                        help=f"CP attention: ring, or ulysses (heads over the ranks) (default "
                        f"{d.strategy})")
    parser.add_argument("--eval-prompts", type=Number(int, 0), default=8,
                        help="held-out prompts of the closing speculative-decoding evaluation, "
                        "0: none; with --data or --offline the last this many conversations, "
                        "left out of training (default 8)")
    parser.add_argument("--resume", default=None,
                        help="a checkpoint directory to continue from, with --world or under "
                        "torchrun (default: start afresh)")
    parser.add_argument("--output", "--out", dest="out", default="eagle3_out",
                        help="directory for curves, checkpoints and the exported drafts "
                        "(default eagle3_out)")
    args = parser.parse_args(argv)
    if args.data is None and args.offline is None:  # synthetic rows: a prompt, then TTT
        number_error(parser, "--seqlen", Number(int, SYNTHETIC_MIN_SEQLEN), args.seqlen,
                     f"on the synthetic data ({PROMPT_TOKENS} prompt tokens, then one for each "
                     f"of the {d.ttt_steps} TTT steps)")
    require_extra("demo", PROG)
    try:
        chats = args.data is not None or args.offline is not None
        cfg = Eagle3Config(steps=args.steps, seqlen=args.seqlen, layout=args.layout, dp=args.dp,
                           target=args.target, data=args.data, pack=args.pack, batch=args.batch,
                           offline=args.offline, shard_target=args.shard_target,
                           accumulate=args.accumulate, draft_vocab=args.draft_vocab, lr=args.lr,
                           warmup=args.warmup, grad_clip=args.grad_clip, dtype=args.dtype,
                           save_every=args.save_every, strategy=args.strategy,
                           held_out=args.eval_prompts if chats else 0,
                           pad=args.pad if args.pad is not None
                           else d.pad if d.pad < args.seqlen else args.seqlen // 4)
        torchrun = "LOCAL_RANK" in os.environ
        cfg.check_world(int(os.environ.get("WORLD_SIZE", 1)) if torchrun else args.world)
        check_inputs(cfg, args.resume)
    except ValueError as exc:
        print(f"{PROG}: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if torchrun:
        dist.init_process_group("gloo")
        try:
            train_eagle3(cfg, group=dist.group.WORLD, out_dir=args.out, resume=args.resume)
            leave_together()
        finally:
            dist.destroy_process_group()
        if int(os.environ.get("RANK", 0)) != 0:
            return 0
    else:
        spawn_eagle3(cfg, world=args.world, out_dir=args.out, resume=args.resume)
    report_run(cfg, args.out, prompts=args.eval_prompts)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
