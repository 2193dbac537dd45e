"""Train a transformers causal LM under context parallelism (ring attention over a gloo group).

Legend: B batch, S global seq, L local seq (padded S / W), V vocab, W world size,
N bytes of the text file.

The model is a small ``LlamaForCausalLM`` (random weights, GQA, no hub access), or the
user's (``--model``: a local directory saved by ``save_pretrained``, loaded with its
weights, or a config, a ``config.json`` file or a directory holding only one, built with
seeded random weights). Training runs through transformers' ``Trainer``: on the ranks it is
``RingTrainer`` (``ringattn.integrations.hf_trainer``, ``attn_implementation="ringattn"``:
every rank reads the same global batch, shards it along the sequence and adds its share of
the global mean loss; DDP sums the gradients), in one process a plain ``Trainer`` with
transformers' own attention ("sdpa" or "eager"): the same optimizer (AdamW, cosine decay),
batches and steps on both sides, so the two runs' losses and weights agree to float32
rounding. ``--save-steps`` writes Trainer checkpoints to the output directory, and
``--resume CHECKPOINT`` continues one as if the run had never stopped.

Data: the copy task by default (a random first half, then its copy: a second-half token is
predictable only by attending S/2 positions back, which the zigzag and contiguous layouts
put on another rank), or byte-level windows of a local text file (``--data PATH``).

Run it under torchrun (ranks from RANK / WORLD_SIZE / MASTER_ADDR)::

    torchrun --nproc-per-node 2 -m ringattn.apps.train --steps 300 --out train_out

or let it spawn its own ranks (``python -m ringattn.apps.train --world 2``, ``ringattn train``,
or ``spawn(cfg, world=2)`` from Python). Rank 0 shows a progress bar, logs loss and
tokens/s, and writes ``train.json`` (the curves) and ``loss.png`` to the output directory.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import os
import re
import resource
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F

from ..validate import STRATEGY_CHOICES, check_strategy
from ..batch import all_reduce_metrics
from ..comm import resolve_group
from ..integrations import transformers as ra_hf
from ..layouts import LAYOUTS
from . import Number, Parser, World, hub_hint, require_extra, world_problem

__all__ = [
    "TrainConfig", "model_source", "build_model", "make_batches", "read_checkpoint", "train",
    "spawn", "plot_curves",
    "add_arguments", "run_from_args", "run_and_report", "main",
]

IGNORE = -100
"""Label of a token that has no target (transformers' ``ignore_index``)."""

SINGLE_ATTN = ("sdpa", "eager")
"""transformers' own attention implementations accepted for the single-process run."""

BYTE_VOCAB = 256
"""Vocabulary of text data: one token per byte."""

BUILT_IN_SIZES = ("hidden", "intermediate", "heads", "kv_heads", "layers", "init_std")
"""The ``TrainConfig`` fields that size the built-in model (not a ``model`` of the user's)."""

RESUMABLE = ("layout", "strategy", "ulysses", "log_every", "save_steps")
"""The ``TrainConfig`` fields a resumed run may change: they do not change what is computed
(every layout and strategy is exact)."""

RECORD = "ringattn_train.json"
"""The file in each checkpoint that holds the configuration and the curves so far."""

MIN_SEQLEN = 4
"""The shortest global sequence S (the copy task's prefix and its copy, two tokens each)."""

SEED_MAX = 2**32 - 1
"""The largest seed: Trainer seeds numpy too, whose seeds lie in [0, 2**32 - 1]."""

ATTENTION_DROPOUT = re.compile(r"(attn|attention).*drop|drop.*(attn|attention)", re.IGNORECASE)
"""Config fields of an attention dropout (``attention_dropout``, GPT-2's ``attn_pdrop``,
BERT's ``attention_probs_dropout_prob``, MPT's ``attn_config.attn_pdrop``, ...)."""

STRATEGY_WORDS = {"ring": "ring attention", "ulysses": "Ulysses attention",
                  "allgather": "all-gather attention", "hybrid": "hybrid attention",
                  "auto": "auto"}
"""How the progress bar, the log lines and the plot name a CP strategy."""


def _is_int(value, low: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= low


@dataclass(frozen=True, kw_only=True)
class TrainConfig:
    """Everything that decides what is computed (the same on every rank and in one process)."""

    steps: int = 200
    """Optimizer steps."""

    seqlen: int = 250
    """Global sequence length S; need not divide W (250 divides neither 2*2 nor 2*4)."""

    batch: int = 8
    """Sequences per step B (every rank holds all B rows, each cut to its shard)."""

    layout: str = "zigzag"
    """Token placement on the ranks: "contiguous", "zigzag" or "striped"."""

    strategy: str = "ring"
    """How attention runs over the shards: "auto", "ring", "ulysses", "allgather" or
    "hybrid" (Ulysses over ``ulysses`` ranks within, the ring across)."""

    ulysses: int = 2
    """With strategy "hybrid": ranks of the Ulysses dimension (divides W)."""

    data: str | None = None
    """A local text file trained on as bytes (V = 256); None: the synthetic copy task."""

    model: str | None = None
    """The user's model: a local directory saved by ``save_pretrained`` (loaded with its
    weights), or a config (a ``config.json`` file, or a directory holding a config and no
    weights: built with random weights seeded by ``seed``); its vocabulary must hold the
    data's V tokens. None: the built-in ``LlamaForCausalLM`` of the sizes below (which must
    keep their defaults with a ``model``)."""

    copy_vocab: int = 16
    """Vocabulary V of the copy task (ignored with ``data``)."""

    hidden: int = 128
    """Model width."""

    intermediate: int = 128
    """MLP width."""

    heads: int = 4
    """Query heads H."""

    kv_heads: int = 2
    """Key/value heads Hkv (GQA: H % Hkv == 0)."""

    layers: int = 2
    """Decoder layers."""

    lr: float = 2e-3
    """Peak AdamW learning rate (cosine decay to 0 over ``steps``)."""

    init_std: float = 0.05
    """Standard deviation of the initial weights (transformers' ``initializer_range``).

    Llama's 0.02 leaves the copy task on a long plateau whose sudden end amplifies
    rounding: two exact runs that differ only in summation order (CP and one process, or
    transformers' "sdpa" and "eager") then part by up to 1e-2 relative for a while. With
    0.05 and lr 2e-3 the copy is learned within ~150 steps, and sdpa and eager stayed
    within 4e-6 of each other over 200 steps for seeds 0 to 3.
    """

    seed: int = 0
    """Seed of the initial weights and of the batches."""

    log_every: int = 25
    """Rank 0 prints a log line every this many steps (0: none)."""

    save_steps: int = 0
    """Write a Trainer checkpoint (``checkpoint-<step>`` in the output directory: weights,
    optimizer, schedule, RNG states, and the curves so far) every this many steps and at
    the last step (0: none)."""

    def __post_init__(self) -> None:
        for name in ("steps", "batch", "copy_vocab", "hidden", "intermediate", "heads",
                     "kv_heads", "layers"):
            if not _is_int(getattr(self, name), 1):
                raise ValueError(f"{name} must be an int >= 1, got {getattr(self, name)!r}")
        if not _is_int(self.seqlen, MIN_SEQLEN):
            raise ValueError(f"seqlen must be an int >= {MIN_SEQLEN}, got {self.seqlen!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; choose one of {sorted(LAYOUTS)}")
        check_strategy(self.strategy)
        if not _is_int(self.ulysses, 1):
            raise ValueError(f"ulysses must be an int >= 1, got {self.ulysses!r}")
        if self.copy_vocab < 2:
            raise ValueError(f"copy_vocab must be >= 2, got {self.copy_vocab!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.hidden % self.heads or (self.hidden // self.heads) % 2:
            raise ValueError(
                f"hidden={self.hidden} must split into {self.heads} heads of an even size (RoPE)"
            )
        if not (isinstance(self.lr, float) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite float > 0, got {self.lr!r}")
        if not (isinstance(self.init_std, float) and math.isfinite(self.init_std)
                and self.init_std > 0):
            raise ValueError(f"init_std must be a finite float > 0, got {self.init_std!r}")
        if not _is_int(self.seed, 0) or self.seed > SEED_MAX:
            raise ValueError(f"seed must be an int in [0, {SEED_MAX}], got {self.seed!r}")
        if not _is_int(self.log_every, 0):
            raise ValueError(f"log_every must be an int >= 0, got {self.log_every!r}")
        if not _is_int(self.save_steps, 0):
            raise ValueError(f"save_steps must be an int >= 0, got {self.save_steps!r}")
        if self.data is not None:
            if not os.path.isfile(self.data):
                raise ValueError(f"data={self.data!r} is not a file")
            size = os.path.getsize(self.data)
            if size < self.seqlen:
                raise ValueError(
                    f"data={self.data!r} has {size} bytes, fewer than seqlen={self.seqlen}"
                )
        if self.model is not None:
            defaults = TrainConfig()
            for name in BUILT_IN_SIZES:
                if getattr(self, name) != getattr(defaults, name):
                    raise ValueError(
                        f"{name}={getattr(self, name)!r} sizes the built-in model; with "
                        f"model={self.model!r} its config sets the sizes")
            model_source(self)

    def check_world(self, world: int) -> None:
        """Refuse a world size W this configuration cannot run on under ring attention
        (``spawn`` and the CLI call it before starting any rank).

        Raises:
            ValueError: W not an int >= 1, (strategy "hybrid") ``ulysses`` not a divisor of
                W, or a ``model`` ring attention cannot run exactly (``check_cp_model``).
        """
        if not _is_int(world, 1):
            raise ValueError(f"world must be an int >= 1, got {world!r}")
        if self.strategy == "hybrid" and world % self.ulysses:
            raise ValueError(f"strategy 'hybrid' needs ulysses={self.ulysses} to divide the "
                             f"world of {world} ranks")
        if self.model is not None:
            config, _ = model_source(self)
            try:
                check_cp_model(config)
            except ValueError as exc:
                raise ValueError(f"model={self.model!r}: {exc}") from None

    @property
    def vocab(self) -> int:
        """Vocabulary size V of the model."""
        return BYTE_VOCAB if self.data is not None else self.copy_vocab

    @property
    def period(self) -> int:
        """Copy task: length of the random prefix; token t >= period repeats token t - period."""
        return -(-self.seqlen // 2)


# ----------------------------------------------------------------------------- model, data


WEIGHT_FILES = (".safetensors", ".bin", ".safetensors.index.json", ".bin.index.json")
"""Endings of the weight files ``save_pretrained`` writes: a model directory holding one is
loaded with its weights."""


def attention_dropout(config) -> tuple[str, float] | None:
    """The first field of ``config``'s text config (dotted: ``text_config.attention_dropout``,
    ``attn_config.attn_pdrop``) that sets an attention dropout other than 0, and its value;
    None when there is none."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    prefix = "" if text is config else next(
        (f"{k}." for k, v in vars(config).items() if v is text), "")

    def fields(d: dict, at: str):
        for key, value in d.items():
            if isinstance(value, dict):
                yield from fields(value, f"{at}{key}.")
            else:
                yield f"{at}{key}", str(key), value

    for name, key, value in fields(text.to_dict(), prefix):
        if (isinstance(value, (int, float)) and not isinstance(value, bool) and value
                and ATTENTION_DROPOUT.search(key)):
            return name, value
    return None


def build_attention(config, attn_implementation: str) -> str:
    """The attention implementation ``build_model`` builds ``config``'s model with: "eager"
    for ring attention of a family whose constructor cannot take a registered name (Falcon,
    GPT-Neo: ``ra_hf.BUILT_EAGER``), which ``ra_hf.convert`` then switches to ring
    attention; ``attn_implementation`` otherwise."""
    if (attn_implementation == ra_hf.NAME
            and getattr(config, "model_type", None) in ra_hf.BUILT_EAGER):
        return "eager"
    return attn_implementation


def check_cp_model(config) -> None:
    """Refuse, before any rank starts, a causal-LM config that ring attention cannot train
    under ``RingTrainer``: what ``integrations.transformers.check_model`` refuses of its
    class, an attention dropout (the attention call refuses it on every rank), and what
    ``RingTrainer`` refuses of the model built from it (on the meta device: no weights) and
    converted, as ``build_model`` builds and converts it.

    Raises:
        ValueError: naming the config field to change, or what the class cannot do.
    """
    from transformers import AutoModelForCausalLM
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    cls = MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    attn = build_attention(config, ra_hf.NAME)
    built = copy.deepcopy(config)
    built._attn_implementation = attn  # how build_model builds it
    ra_hf.check_model(cls, built)
    dropout = attention_dropout(config)
    if dropout is not None:
        field, value = dropout
        raise ValueError(f"its config sets {field}={value!r}, and ring attention has no "
                         f"attention dropout: set {field} to 0 in its config.json")
    ra_hf.register()
    try:
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(copy.deepcopy(config),
                                                     attn_implementation=attn)
    except Exception:  # noqa: BLE001 - a class that cannot be built on meta: the ranks say
        return
    if attn == ra_hf.NAME:  # (built "eager": convert puts ring attention in)
        ra_hf.check_attention(model)
    ra_hf.convert(model)  # as build_model does: refuses what it cannot make exact
    ra_hf.check_attention(model)
    ra_hf.check_model(model)


def model_source(cfg: TrainConfig):
    """The config of ``cfg.model`` and whether it comes with weights, checked.

    Returns:
        (the transformers config, True for a directory with weight files: ``from_pretrained``;
        False for a config alone: ``from_config``).

    Raises:
        ValueError: a path that does not exist, a directory without ``config.json``, a
            config transformers cannot read or that has no causal-LM class, a vocabulary
            smaller than the data's, or ``max_position_embeddings`` below ``seqlen``.
    """
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    path = cfg.model
    if not isinstance(path, str) or not os.path.exists(path):
        raise ValueError(f"model={path!r} does not exist (a model directory, or a config.json)"
                         f"{hub_hint(path)}")
    weights = False
    if os.path.isdir(path):
        if not os.path.isfile(os.path.join(path, "config.json")):
            raise ValueError(f"model={path!r} is a directory without a config.json")
        weights = any(f.endswith(WEIGHT_FILES) for f in os.listdir(path))
    try:
        config = AutoConfig.from_pretrained(path, local_files_only=True)
    except Exception as exc:  # transformers raises OSError, ValueError, KeyError, JSON errors
        first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise ValueError(f"model={path!r}: transformers cannot read its config ({first})") from None
    if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:
        raise ValueError(f"model={path!r}: transformers has no causal-LM class for its "
                         f"model_type {config.model_type!r}")
    vocab = getattr(config.get_text_config(), "vocab_size", None)
    if not isinstance(vocab, int) or vocab < cfg.vocab:
        data = "the copy task's copy_vocab" if cfg.data is None else "byte-level text"
        raise ValueError(f"model={path!r} has vocab_size {vocab}, fewer than the {cfg.vocab} "
                         f"tokens of {data}")
    limit = getattr(config.get_text_config(), "max_position_embeddings", None)
    if isinstance(limit, int) and limit < cfg.seqlen:
        raise ValueError(f"model={path!r} has max_position_embeddings {limit}, below "
                         f"seqlen={cfg.seqlen}")
    return config, weights


def build_model(cfg: TrainConfig, attn_implementation: str):
    """The model of ``cfg``, the same in every process: the built-in tiny
    ``LlamaForCausalLM`` with seeded random weights, or ``cfg.model`` (its saved weights, or
    its config with random weights seeded by ``cfg.seed``).

    Arguments:
        cfg: the configuration (sizes or model, seed).
        attn_implementation: "ringattn" (registered here), "sdpa" or "eager"; it does not
            change the weights.

    Returns:
        The model in float32, in training mode, ``convert``-ed under ring attention (a
        hybrid's sequence mixers and an MoE router loss run across ranks; Falcon and
        GPT-Neo, built "eager", get their ring attention from it: ``build_attention``).
        The global RNG is left untouched.

    Raises:
        ValueError: an unknown attn_implementation; a ``cfg.model`` ``model_source`` refuses.
    """
    from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    if attn_implementation == ra_hf.NAME:
        ra_hf.register()
    elif attn_implementation not in SINGLE_ATTN:
        raise ValueError(
            f"attn_implementation must be {ra_hf.NAME!r} or one of {SINGLE_ATTN}, "
            f"got {attn_implementation!r}"
        )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        if cfg.model is None:
            config = LlamaConfig(
                vocab_size=cfg.vocab, hidden_size=cfg.hidden, intermediate_size=cfg.intermediate,
                num_hidden_layers=cfg.layers, num_attention_heads=cfg.heads,
                num_key_value_heads=cfg.kv_heads, max_position_embeddings=cfg.seqlen,
                bos_token_id=None, eos_token_id=None, pad_token_id=None,
            )
            config.initializer_range = cfg.init_std
            config._attn_implementation = attn_implementation
            model = LlamaForCausalLM(config)
        else:
            config, weights = model_source(cfg)
            kw = dict(attn_implementation=build_attention(config, attn_implementation),
                      dtype=torch.float32)
            model = (AutoModelForCausalLM.from_pretrained(cfg.model, local_files_only=True, **kw)
                     if weights else AutoModelForCausalLM.from_config(config, **kw))
    if attn_implementation == ra_hf.NAME:  # a hybrid's mixers, a router loss: made global
        model = ra_hf.convert(model)
    return model.float().train()


def make_batches(cfg: TrainConfig):
    """Yield ``cfg.steps`` global batches ``ids_BS`` (int64), the same in every process.

    Copy task: a random prefix of ``cfg.period`` tokens followed by its copy, cut to S.
    Text: B windows of S bytes at random offsets of the file (read into memory once).
    """
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    if cfg.data is None:
        for _ in range(cfg.steps):
            prefix_BP = torch.randint(cfg.copy_vocab, (cfg.batch, cfg.period), generator=gen)
            yield torch.cat((prefix_BP, prefix_BP), dim=1)[:, : cfg.seqlen]
        return
    with open(cfg.data, "rb") as f:
        bytes_N = torch.frombuffer(bytearray(f.read()), dtype=torch.uint8).long()
    window_S = torch.arange(cfg.seqlen)
    for _ in range(cfg.steps):
        start_B = torch.randint(bytes_N.numel() - cfg.seqlen + 1, (cfg.batch, 1), generator=gen)
        yield bytes_N[start_B + window_S]


def lr_factor(step: int, *, steps: int) -> float:
    """Cosine decay of the learning rate from 1x to 0x over ``steps`` steps.

    The decay also keeps two runs that differ only in summation order (CP and one process)
    together: at a constant rate, once the task is solved, Adam keeps taking lr-sized steps
    on gradients that are mostly rounding noise, and the runs drift apart.
    """
    return 0.5 * (1.0 + math.cos(math.pi * min(step, steps) / steps))


def _token_stats(logits_BLV, targets_BL, pos_L, cfg: TrainConfig) -> dict:
    """This process's ``{metric: (sum, count)}`` over its targets (for ``all_reduce_metrics``).

    ``pos_L`` are the global positions of the tokens; on the copy task ``copy_*`` count
    only the targets that repeat an earlier token (learnable only through attention).
    """
    valid_BL = targets_BL != IGNORE
    ce_BL = F.cross_entropy(logits_BLV.flatten(0, 1).float(), targets_BL.flatten(),
                            ignore_index=IGNORE, reduction="none").view_as(targets_BL)
    correct_BL = (logits_BLV.argmax(-1) == targets_BL) & valid_BL
    n = valid_BL.sum()
    stats = {"loss": (ce_BL.sum(), n), "accuracy": (correct_BL.sum(), n)}
    if cfg.data is None:
        copy_BL = valid_BL & (pos_L >= cfg.period - 1)
        n_copy = copy_BL.sum()
        stats["copy_loss"] = ((ce_BL * copy_BL).sum(), n_copy)
        stats["copy_accuracy"] = ((correct_BL & copy_BL).sum(), n_copy)
    return stats


def _rss_mib() -> float | None:
    """Resident set size of this process now, MiB (None where /proc is missing)."""
    try:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20
    except (OSError, ValueError, IndexError):
        return None


def peak_rss_mib() -> float:
    """High-water resident set size of this process, MiB (ru_maxrss: KiB on Linux, B on macOS)."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / 2**20 if sys.platform == "darwin" else peak / 2**10


# ----------------------------------------------------------------------------- training (Trainer)


class _Rows(torch.utils.data.Dataset):
    """The rows of ``make_batches``, batch after batch: row ``i`` is row ``i % B`` of batch
    ``i // B``. Batches are made when read (one held at a time; a read behind the current
    one replays the generator from the start), so a long run holds no copy of its data."""

    def __init__(self, cfg: TrainConfig):
        self.cfg, self._batches, self._k, self._held = cfg, None, -1, None

    def __len__(self) -> int:
        return self.cfg.steps * self.cfg.batch

    def __getitem__(self, i: int) -> dict:
        k, row = divmod(int(i), self.cfg.batch)
        if k < self._k or self._batches is None:
            self._batches, self._k = make_batches(self.cfg), -1
        while self._k < k:
            self._held, self._k = next(self._batches), self._k + 1
        ids_S = self._held[row]
        return {"input_ids": ids_S, "labels": ids_S}


class _StepMetrics:
    """Trainer mixin: ``compute_loss`` also takes the step's token metrics (global means
    over every target, ``_token_stats``) from the logits, into ``self.step_metrics``."""

    def __init__(self, *args, lm_cfg: TrainConfig, **kwargs):
        super().__init__(*args, **kwargs)
        self.lm_cfg, self.step_metrics = lm_cfg, []

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        loss, outputs = super().compute_loss(model, inputs, return_outputs=True,
                                             num_items_in_batch=num_items_in_batch)
        cfg = self.lm_cfg
        with torch.no_grad():
            if "ring_context" in inputs:  # this rank's shard (RingTrainer.get_batch_samples)
                targets_BL, pos_BL = inputs["shift_labels"], inputs["position_ids"]
            else:
                targets_BL = F.pad(inputs["labels"][:, 1:], (0, 1), value=IGNORE)
                pos_BL = torch.arange(targets_BL.shape[1])
            stats = _token_stats(outputs.logits.detach(), targets_BL, pos_BL, cfg)
        if "ring_context" in inputs:  # RingTrainer's CP group: the whole world
            self.step_metrics.append(all_reduce_metrics(stats, dist.group.WORLD))
        else:
            self.step_metrics.append({k: float(s) / float(n) if n else float("nan")
                                      for k, (s, n) in stats.items()})
        return (loss, outputs) if return_outputs else loss


def _trainer_classes():
    """(the context-parallel trainer class, the one-process trainer class)."""
    from transformers import Trainer

    from ..integrations.trainers.hf_trainer import RingTrainer

    class LMRingTrainer(_StepMetrics, RingTrainer):
        """``RingTrainer`` recording the step's token metrics (accuracy and the copy task's
        metrics read every logit of the shard: the loss is not tiled)."""

        def __init__(self, *args, **kwargs):
            super().__init__(*args, loss_tile=None, **kwargs)

    class LMTrainer(_StepMetrics, Trainer):
        """transformers' ``Trainer`` recording the step's token metrics."""

    return LMRingTrainer, LMTrainer


def cp_label(strategy: str, world: int, ulysses: int = 2,
             chosen: list[str] | None = None) -> str:
    """How the progress bar, the log lines and the plot name a context-parallel run:
    "ring attention, W=2", "hybrid attention (Ulysses 2 x ring 2), W=4", "auto, W=2"
    and, once ``chosen`` is known, "auto: Ulysses attention, W=2"."""
    if strategy == "hybrid":
        words = f"hybrid attention (Ulysses {ulysses} x ring {world // ulysses})"
    elif strategy == "auto" and chosen:
        words = "auto: " + " and ".join(STRATEGY_WORDS.get(c, c) for c in chosen)
    else:
        words = STRATEGY_WORDS.get(strategy, strategy)
    return f"{words}, W={world}"


def _auto_choices():
    """A function returning the strategies ``strategy="auto"`` chose in this process since
    this call (``ringattn.strategies.auto`` records each (call shape, choice) once; an
    earlier run in this process with the same shapes recorded them already: then all of
    them)."""
    from ..strategies import auto

    before = set(auto._LOGGED)

    def chosen() -> list[str]:
        now = set(auto._LOGGED)
        return sorted({s for _, s in (now - before) or now})

    return chosen


def _steps_callback(cfg: TrainConfig, trainer, curves: dict, *, what: str, show: bool,
                    start: int, world: int | None = None):
    """A ``TrainerCallback`` that keeps the curves (the step's metrics and tokens/s), shows
    the progress bar and log lines (``show``: rank 0), and writes the configuration and the
    curves so far into every checkpoint (``RECORD``), for a resumed run's curves. Under CP
    (``world``) with strategy "auto" it names, after the first step, what auto chose
    (``chosen``; else ``[cfg.strategy]``), in the bar, the log lines and a line of its own."""
    from tqdm import tqdm
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR

    auto = world is not None and cfg.strategy == "auto"
    choices = _auto_choices() if auto else None

    class Steps(TrainerCallback):
        def __init__(self):
            # a bar advanced by hand: one wrapped around the batches counts a step only when
            # its next batch is drawn and redraws at most every 0.1 s, while set_postfix
            # redraws every step with the count it last synced (the bar sat at 0/N)
            self.bar = tqdm(total=cfg.steps, initial=start, desc=what, disable=not show,
                            leave=False)
            self.t0 = 0.0
            self.what = what
            self.chosen = None if world is None or auto else [cfg.strategy]

        def on_step_begin(self, args, state, control, **kwargs):
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            if auto and not self.chosen:
                self.chosen = choices() or None
                if self.chosen:
                    self.what = cp_label(cfg.strategy, world, cfg.ulysses, self.chosen)
                    if show:
                        self.bar.set_description(self.what, refresh=False)
                        self.bar.write(f"strategy 'auto' chose {' and '.join(self.chosen)} "
                                       f"(W={world})")
            what = self.what
            means = trainer.step_metrics[-1]
            for key, value in means.items():
                curves.setdefault(key, []).append(value)
            curves["tokens_per_s"].append(cfg.batch * cfg.seqlen / (time.perf_counter() - self.t0))
            if show:
                step = state.global_step
                self.bar.update(1)
                self.bar.set_postfix(loss=f"{means['loss']:.4f}",
                                     tok_s=f"{curves['tokens_per_s'][-1]:.0f}")
                if cfg.log_every and (step % cfg.log_every == 0 or step == cfg.steps):
                    extra = "".join(f"  {k} {means[k]:.4f}" for k in means if k != "loss")
                    self.bar.write(f"[{what}] step {step}/{cfg.steps}  loss {means['loss']:.4f}"
                                   f"{extra}  tokens/s {curves['tokens_per_s'][-1]:.0f}")

        def on_save(self, args, state, control, **kwargs):
            if state.is_world_process_zero:
                path = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}",
                                    RECORD)
                with open(path, "w") as f:
                    json.dump({"step": state.global_step, "config": asdict(cfg),
                               "curves": curves}, f)

        def on_train_end(self, args, state, control, **kwargs):
            self.bar.close()

    return Steps()


def read_checkpoint(cfg: TrainConfig, resume: str) -> dict:
    """The record of a checkpoint ``resume`` written by a run of ``cfg``'s computation.

    Returns:
        ``{"step", "config", "curves"}``: the step it was written at, the configuration of
        the run that wrote it and that run's curves up to that step.

    Raises:
        ValueError: not a checkpoint directory of ``ringattn train`` (no Trainer state or no
            ``RECORD``), written with another configuration (a field other than
            ``RESUMABLE``'s differs: named with both values), or at a step not before
            ``cfg.steps``.
    """
    if not isinstance(resume, str) or not os.path.isdir(resume):
        raise ValueError(f"resume={resume!r} is not a checkpoint directory")
    path = os.path.join(resume, RECORD)
    if not (os.path.isfile(path) and os.path.isfile(os.path.join(resume, "trainer_state.json"))):
        raise ValueError(f"resume={resume!r} is not a checkpoint of ringattn train (it has no "
                         f"trainer_state.json and {RECORD})")
    with open(path) as f:
        record = json.load(f)
    then, now = record["config"], asdict(cfg)
    differ = [f"{k}={then.get(k)!r} (now {now[k]!r})" for k in now
              if k not in RESUMABLE and then.get(k) != now[k]]
    if differ:
        raise ValueError(f"resume={resume!r} was written with another configuration: "
                         f"{', '.join(differ)}")
    if record["step"] >= cfg.steps:
        raise ValueError(f"resume={resume!r} is at step {record['step']}, not before the last "
                         f"of steps={cfg.steps}: nothing to train")
    return record


def train(cfg: TrainConfig, *, group=None, attn_implementation: str | None = None,
          progress: bool = True, out_dir: str | None = None, resume: str | None = None) -> dict:
    """Train the model with transformers' ``Trainer``; with a group, ``RingTrainer`` under
    context parallelism (every rank of the group calls this).

    Arguments:
        cfg: the configuration.
        group: the context-parallel group, the whole world (ProcessGroup, 1-D DeviceMesh):
            ``RingTrainer`` trains over every rank; None trains in this process alone on
            whole sequences with a plain ``Trainer``.
        attn_implementation: with a group "ringattn" (the default; the only choice); without
            one "sdpa" (default) or "eager".
        progress: progress bar and log lines (on rank 0 only).
        out_dir: rank 0 writes ``train.json`` and ``loss.png`` there, and the Trainer its
            checkpoints (``cfg.save_steps``); None: nothing (checkpoints are refused).
        resume: a checkpoint of this configuration (``read_checkpoint``) to continue from:
            the weights, optimizer, schedule and data position of its step; the curves of
            the steps before it are the checkpoint's.

    Returns:
        dict, the same on every rank except ``rank``: ``config``, ``world``, ``attn``,
        ``model`` (the class and parameter count), per-step lists ``loss``, ``accuracy``
        (global means over all target tokens), ``copy_loss``/``copy_accuracy`` (copy task),
        ``tokens_per_s`` (the B * S global tokens of a step over its wall time);
        ``strategy_chosen`` (under CP the strategies that ran: ``[cfg.strategy]``, or what
        "auto" chose; None in one process, or when auto's choice was not seen),
        ``resumed_at`` (the checkpoint's step, 0 without ``resume``), ``seconds`` (of this
        run's steps), ``tokens_per_s_mean`` (harmonic mean after the first step, which
        builds the ring's plans), per-rank lists ``rss_start_mib`` (before the first step)
        and ``peak_rss_mib`` (high water of the whole process).

    Raises:
        ValueError: a bad attn_implementation, a group that is not initialized or not the
            whole world, checkpoints without ``out_dir``, a ``resume`` ``read_checkpoint``
            refuses; ``RingTrainer``'s refusals.
        RuntimeError: parameter replicas that differ at the end (gradients not in sync).
    """
    from transformers import PrinterCallback, TrainingArguments
    from transformers.utils import logging as hf_logging

    cp = group is not None
    attn = attn_implementation or (ra_hf.NAME if cp else SINGLE_ATTN[0])
    if cp and attn != ra_hf.NAME:
        raise ValueError(f"with a group, attn_implementation must be {ra_hf.NAME!r}, got {attn!r}")
    if not cp and attn not in SINGLE_ATTN:
        raise ValueError(f"without a group, attn_implementation must be one of {SINGLE_ATTN}, "
                         f"got {attn!r}")
    if cfg.save_steps and out_dir is None:
        raise ValueError(f"save_steps={cfg.save_steps} needs an out_dir for the checkpoints")
    record = read_checkpoint(cfg, resume) if resume is not None else None
    pg = resolve_group(group) if cp else None
    rank, world = (dist.get_rank(pg), dist.get_world_size(pg)) if cp else (0, 1)
    if cp:
        if world != dist.get_world_size():
            raise ValueError(f"group must hold every rank (RingTrainer trains over the whole "
                             f"world of {dist.get_world_size()}), got a group of {world}")
        _distributed_env(rank, world)
    model = build_model(cfg, attn)
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, partial(lr_factor, steps=cfg.steps))
    start = record["step"] if record else 0
    curves: dict[str, list[float]] = {"loss": [], "accuracy": [], "tokens_per_s": []}
    if record:
        curves = {k: list(v) for k, v in record["curves"].items()}
    what = cp_label(cfg.strategy, world, cfg.ulysses) if cp else f"one process ({attn})"
    ring_cls, one_cls = _trainer_classes()
    # Trainer seeds the global RNG (and a resumed one restores a checkpoint's): the caller's
    # is left as it was
    with tempfile.TemporaryDirectory(prefix="ringattn-train-") as scratch, \
            torch.random.fork_rng(devices=[]):
        targs = TrainingArguments(
            output_dir=out_dir if out_dir is not None else scratch, use_cpu=True,
            per_device_train_batch_size=cfg.batch, max_steps=cfg.steps, seed=cfg.seed,
            train_sampling_strategy="sequential", max_grad_norm=0.0,  # no clipping
            logging_strategy="no", report_to=[], disable_tqdm=True,
            save_strategy="steps" if cfg.save_steps else "no", save_steps=cfg.save_steps or 1,
            dataloader_pin_memory=False,
            # every parameter of the built-in model has a gradient (DDP then skips a search
            # for unused ones); a user's model keeps Trainer's default
            ddp_find_unused_parameters=False if cfg.model is None else None,
            **({"ddp_backend": "gloo"} if cp else {}))
        kw = dict(model=model, args=targs, train_dataset=_Rows(cfg), optimizers=(opt, sched),
                  lm_cfg=cfg)
        trainer = (ring_cls(**kw, layout=cfg.layout, strategy=cfg.strategy,
                            ulysses_size=cfg.ulysses) if cp else one_cls(**kw))
        trainer.remove_callback(PrinterCallback)  # it prints Trainer's summary dict
        steps = _steps_callback(cfg, trainer, curves, what=what, show=progress and rank == 0,
                                start=start, world=world if cp else None)
        trainer.add_callback(steps)
        rss_start = _rss_mib()
        t_start = time.perf_counter()
        bars = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()  # "Writing model shards" at every checkpoint
        try:
            trainer.train(resume_from_checkpoint=resume)
        finally:
            if bars:
                hf_logging.enable_progress_bar()
        seconds = time.perf_counter() - t_start
    params = list(model.parameters())
    rss = torch.zeros(2, world, dtype=torch.float64)
    rss[:, rank] = torch.tensor([rss_start or float("nan"), peak_rss_mib()])
    if cp:
        _check_replicas(params, pg, rank)
        dist.all_reduce(rss, group=pg)
    tail = curves["tokens_per_s"][start + 1:] or curves["tokens_per_s"][start:]
    result = {
        "config": asdict(cfg), "world": world, "attn": attn, "rank": rank,
        "model": {"class": type(model).__name__, "parameters": sum(p.numel() for p in params)},
        "strategy_chosen": steps.chosen, **curves, "resumed_at": start,
        "seconds": seconds, "tokens_per_s_mean": len(tail) / sum(1 / t for t in tail),
        "rss_start_mib": rss[0].tolist(), "peak_rss_mib": rss[1].tolist(),
    }
    if out_dir is not None and rank == 0:
        write_outputs(result, out_dir)
    return result


def _distributed_env(rank: int, world: int) -> None:
    """Tell accelerate (which reads the environment) about ranks started without torchrun
    (``spawn``): it then finds the initialised group and trains with DDP over it."""
    for key, value in (("RANK", rank), ("WORLD_SIZE", world), ("LOCAL_RANK", rank),
                       ("LOCAL_WORLD_SIZE", world), ("OMP_NUM_THREADS", torch.get_num_threads())):
        os.environ.setdefault(key, str(value))


def _check_replicas(params, pg, rank: int) -> None:
    """Raise if the ranks' parameters differ (they took the same steps on summed gradients)."""
    flat = torch.cat([p.detach().reshape(-1) for p in params])
    lo, hi = flat.clone(), flat.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=pg)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=pg)
    if not torch.equal(lo, hi):
        raise RuntimeError(
            f"rank {rank}: parameter replicas diverged (max spread "
            f"{float((hi - lo).abs().max()):.3e}); gradients were not identical on all ranks"
        )


# ----------------------------------------------------------------------------- outputs


def plot_curves(path: str, curves: list[tuple[str, list[float], dict]], *, title: str,
                ylabel: str = "next-token loss", rel_diff: list[float] | None = None,
                tolerance: float | None = None) -> None:
    """Write a PNG of loss curves, optionally over a panel of their relative difference.

    Arguments:
        path: the PNG to write.
        curves: ``(label, per-step values, matplotlib line keywords)`` for each curve.
        title, ylabel: the axes' texts.
        rel_diff: per-step relative difference of two runs, drawn on a log scale below.
        tolerance: a horizontal line in the difference panel.
    """
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    if rel_diff is None:
        fig, ax = plt.subplots(figsize=(8, 4.5))
    else:
        fig, (ax, ax_diff) = plt.subplots(2, 1, figsize=(8, 7), sharex=True,
                                          gridspec_kw={"height_ratios": [3, 1.4]})
    for label, ys, style in curves:
        ax.plot(range(1, len(ys) + 1), ys, label=label, **style)
    ax.set_ylabel(ylabel)
    ax.set_title(title, fontsize="medium")
    ax.legend()
    ax.grid(alpha=0.3)
    if rel_diff is None:
        ax.set_xlabel("step")
    else:
        steps = range(1, len(rel_diff) + 1)
        nonzero = [(i, d) for i, d in zip(steps, rel_diff) if d > 0]
        running, worst = [], 0.0
        for d in rel_diff:
            worst = max(worst, d)
            running.append(worst)
        if nonzero:
            ax_diff.semilogy(*zip(*nonzero), ".", ms=3, color="tab:green",
                             label="|CP - single| / single (equal steps not shown)")
        if worst > 0:
            ax_diff.semilogy(steps, running, color="tab:green", lw=1, label="running maximum")
        ax_diff.set_yscale("log")
        if tolerance is not None:
            ax_diff.axhline(tolerance, color="tab:red", ls=":", label=f"tolerance {tolerance:g}")
        ax_diff.set_xlabel("step")
        ax_diff.set_ylabel("relative difference")
        ax_diff.legend(loc="upper left", fontsize="small")
        ax_diff.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def write_outputs(result: dict, out_dir: str) -> None:
    """Write ``train.json`` (the result) and ``loss.png`` (its curves) to ``out_dir``."""
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "train.json"), "w") as f:
        json.dump(result, f, indent=1)
    cfg = result["config"]
    curves = [("all targets", result["loss"], {"color": "tab:blue"})]
    if "copy_loss" in result:
        curves.append(("copied half", result["copy_loss"], {"color": "tab:orange"}))
    how = (cp_label(cfg["strategy"], result["world"], cfg["ulysses"],
                    result.get("strategy_chosen")) if result["attn"] == ra_hf.NAME
           else result["attn"])
    data = "copy task" if cfg["data"] is None else os.path.basename(cfg["data"])
    plot_curves(os.path.join(out_dir, "loss.png"), curves,
                title=f"{result['model']['class']}, {data}, S={cfg['seqlen']}, {how}")


# ----------------------------------------------------------------------------- processes


def leave_together() -> None:
    """Barrier before tearing the group down, after a run that ended well on every rank.

    Rank 0 writes its outputs after the last collective; a rank that destroys its gloo group
    and exits meanwhile can make gloo abort the process ("terminate called without an
    active exception", seen under torchrun), so the ranks leave together.
    """
    dist.barrier()  # once, at teardown: not in any attention call's path


PR_SET_PDEATHSIG = 1
"""Linux prctl(2) option: the signal this process gets when the thread that started it ends."""


def die_with_launcher() -> None:
    """End this spawned rank as soon as the process that spawned it ends, however it ends.

    torch.multiprocessing asks Linux for SIGINT on the parent's death, which a rank ignores
    when the launcher was started in the background (a shell starts background jobs with
    SIGINT ignored, and Python then installs no handler), and which only interrupts Python
    code, not a rank waiting in a collective: killing the launcher left its ranks running.
    Here: SIGKILL on the parent's death (Linux; then a parent already gone ends the rank at
    once), elsewhere a daemon thread that polls the parent pid every second.
    """
    import multiprocessing
    import signal
    import threading

    parent = multiprocessing.parent_process()
    if parent is None:
        return
    if sys.platform.startswith("linux"):
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0) == 0:
            if os.getppid() != parent.pid:  # the launcher died before prctl
                os._exit(1)
            return

    def watch() -> None:
        while os.getppid() == parent.pid:
            time.sleep(1.0)
        os._exit(1)

    threading.Thread(target=watch, name="ringattn-launcher-watch", daemon=True).start()


def _spawned_rank(rank: int, cfg, world: int, init_file: str, result_path: str,
                  progress: bool, out_dir: str | None, fn) -> None:
    """One rank started by ``spawn`` (the target of ``torch.multiprocessing.spawn``)."""
    die_with_launcher()
    torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))  # ranks share the cores
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=300))
    try:
        result = (fn or train)(cfg, group=dist.group.WORLD, progress=progress, out_dir=out_dir)
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump(result, f)
        leave_together()
    finally:
        dist.destroy_process_group()


def spawn(cfg, *, world: int, progress: bool = True, out_dir: str | None = None,
          fn=None) -> dict:
    """Train under context parallelism on ``world`` local gloo ranks started here.

    Arguments:
        cfg: the configuration of ``fn``, with a ``check_world(world)`` method that
            raises ValueError for a world it cannot run on (called before any rank starts).
        world: number of ranks W (each gets cpu_count // W threads, at least 1), at most
            ``apps.world_limit()``: this machine's cores, or 8 if it has fewer. The ranks
            end with the process that spawned them (``die_with_launcher``).
        progress, out_dir: as for ``train``.
        fn: the importable training function every rank calls as
            ``fn(cfg, group=WORLD, progress=..., out_dir=...)``; default ``train``.

    Returns:
        rank 0's result of ``fn``.

    Raises:
        ValueError: more ranks than this machine runs; a world the configuration cannot run
            on (``cfg.check_world``).
        torch.multiprocessing.ProcessRaisedException: when a rank fails.
    """
    if not _is_int(world, 1):
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    problem = world_problem(world)
    if problem is not None:
        raise ValueError(f"world {problem}")
    cfg.check_world(world)
    with tempfile.TemporaryDirectory(prefix="ringattn-train-") as tmp:
        init_file, result_path = os.path.join(tmp, "store"), os.path.join(tmp, "result.json")
        mp.spawn(_spawned_rank, args=(cfg, world, init_file, result_path, progress, out_dir, fn),
                 nprocs=world, join=True, start_method="spawn")
        with open(result_path) as f:
            return json.load(f)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """Add the training options (the fields of ``TrainConfig``, W and the output) to a parser."""
    d = TrainConfig()
    parser.add_argument("--world", type=World(), default=2,
                        help="ranks to spawn when not under torchrun (default 2; at most this "
                        "machine's cores, or 8 if it has fewer)")
    parser.add_argument("--attn", choices=[ra_hf.NAME, *SINGLE_ATTN], default=ra_hf.NAME,
                        help="ringattn: context parallel over the ranks; sdpa/eager: one "
                        "process, no CP (default ringattn)")
    parser.add_argument("--data", default=None,
                        help="text file trained on as bytes (default: the synthetic copy task)")
    parser.add_argument("--model", default=None,
                        help="your causal LM: a local directory saved by save_pretrained "
                        "(loaded with its weights), or a config (a config.json, or a directory "
                        "with only one: random weights from --seed); default: the built-in "
                        "tiny Llama sized by --hidden ... --init-std")
    for name, kind in (("steps", Number(int, 1)), ("seqlen", Number(int, MIN_SEQLEN)),
                       ("batch", Number(int, 1)), ("copy_vocab", Number(int, 2)),
                       ("hidden", Number(int, 1)), ("intermediate", Number(int, 1)),
                       ("heads", Number(int, 1)), ("kv_heads", Number(int, 1)),
                       ("layers", Number(int, 1)), ("lr", Number(float, above=0)),
                       ("init_std", Number(float, above=0)), ("seed", Number(int, 0, SEED_MAX)),
                       ("log_every", Number(int, 0)), ("save_steps", Number(int, 0))):
        what = {"save_steps": "write a checkpoint to --out every this many steps and at "
                "the last (0: none); "}.get(name, "")
        parser.add_argument(f"--{name.replace('_', '-')}", dest=name, type=kind,
                            default=getattr(d, name), help=f"{what}(default {getattr(d, name)})")
    parser.add_argument("--resume", default=None, metavar="CHECKPOINT",
                        help="continue from a checkpoint of a run with the same options "
                        "(--layout, --strategy, --ulysses, --log-every, --save-steps may "
                        "differ): the losses go on as if the run had not stopped")
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default=d.layout,
                        help=f"token placement on the ranks (default {d.layout})")
    parser.add_argument("--strategy", choices=STRATEGY_CHOICES, default=d.strategy,
                        help=f"how attention runs over the shards (default {d.strategy})")
    parser.add_argument("--ulysses", type=Number(int, 1), default=None,
                        help=f"with --strategy hybrid only: ranks of the Ulysses dimension, a "
                             f"divisor of the world (default {d.ulysses})")
    parser.add_argument("--out", default="train_out",
                        help="output directory for train.json, loss.png and the checkpoints "
                        "(default train_out/)")
    parser.add_argument("--no-progress", dest="progress", action="store_false",
                        help="no progress bar or log lines")


def run_from_args(args: argparse.Namespace) -> dict:
    """Train as the parsed arguments say: under torchrun, spawned ranks, or one process.

    Under torchrun (``WORLD_SIZE`` in the environment) every process joins the default gloo
    group from the environment and trains its shard with ``RingTrainer``; otherwise
    ``--attn ringattn`` spawns ``--world`` ranks and ``--attn sdpa|eager`` trains here alone
    with a plain ``Trainer``. ``--resume`` continues a checkpoint on any of them.

    Returns:
        the result of ``train`` (rank 0's when ranks were spawned).

    Raises:
        ValueError: a bad option, naming it, before any rank starts or joins the group
            (``TrainConfig``'s checks, ``check_world``, ``read_checkpoint``).
    """
    fields = ("steps", "seqlen", "batch", "layout", "strategy", "data", "model", "copy_vocab",
              "hidden", "intermediate", "heads", "kv_heads", "layers", "lr", "init_std", "seed",
              "log_every", "save_steps")
    ulysses = getattr(args, "ulysses", None)
    if ulysses is not None and args.strategy != "hybrid":
        raise ValueError(f"--ulysses applies only with --strategy hybrid, got --strategy "
                         f"{args.strategy}")
    cfg = TrainConfig(**{k: getattr(args, k) for k in fields},
                      **({} if ulysses is None else {"ulysses": ulysses}))
    resume = getattr(args, "resume", None)
    if resume is not None:
        read_checkpoint(cfg, resume)
    torchrun = "WORLD_SIZE" in os.environ  # torchrun: RANK, WORLD_SIZE, MASTER_ADDR/PORT
    if torchrun or args.attn == ra_hf.NAME:
        cfg.check_world(int(os.environ["WORLD_SIZE"]) if torchrun else args.world)
    if torchrun:
        if args.attn != ra_hf.NAME:
            raise ValueError(f"under torchrun --attn must be {ra_hf.NAME!r}, got {args.attn!r}")
        dist.init_process_group("gloo")
        try:
            result = train(cfg, group=dist.group.WORLD, progress=args.progress, out_dir=args.out,
                           resume=resume)
            leave_together()
            return result
        finally:
            dist.destroy_process_group()
    if args.attn == ra_hf.NAME:
        return spawn(cfg, world=args.world, progress=args.progress, out_dir=args.out,
                     fn=None if resume is None else partial(train, resume=resume))
    return train(cfg, attn_implementation=args.attn, progress=args.progress, out_dir=args.out,
                 resume=resume)


def run_and_report(args: argparse.Namespace) -> dict:
    """``run_from_args``, then a summary line on rank 0; a bad option exits with status 2.

    Returns:
        the result of ``train``.
    """
    try:
        result = run_from_args(args)
    except ValueError as exc:
        print(f"ringattn train: {exc}", file=sys.stderr)
        raise SystemExit(2) from None
    if result["rank"] == 0:
        print(f"final loss {result['loss'][-1]:.4f} after {len(result['loss'])} steps, "
              f"{result['tokens_per_s_mean']:.0f} tokens/s, peak RSS per rank (MiB) "
              f"{[round(m) for m in result['peak_rss_mib']]}; wrote "
              f"{os.path.join(args.out, 'train.json')} and loss.png"
              + (f", checkpoints {os.path.join(args.out, 'checkpoint-<step>')}"
                 if result["config"]["save_steps"] else ""))
    return result


def main(argv: list[str] | None = None) -> int:
    """``python -m ringattn.apps.train [options]`` (also ``ringattn train``); see ``--help``.

    Returns:
        0 (bad options exit through ``SystemExit(2)``).
    """
    parser = Parser(prog="python -m ringattn.apps.train",
                                     description=__doc__.split("\n\n")[0])
    add_arguments(parser)
    args = parser.parse_args(argv)
    require_extra("demo", "python -m ringattn.apps.train")
    run_and_report(args)
    return 0


if __name__ == "__main__":
    main()
