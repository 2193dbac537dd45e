"""The demo: train a tiny causal LM with ring attention on W CPU ranks, and check it is exact.

Legend: B batch, S global seq, L local seq (padded S / W), C model width, H heads,
Hkv kv heads, D head dim, V vocab, W world size.

The data make attention over the WHOLE sequence necessary: every sequence is a random first
half followed by a copy of it, so a token of the second half is predictable only by attending
to the token S/2 positions back, which the contiguous and zigzag layouts put on another rank.
The model is trained twice from the same seed on the same batches with the same optimizer:

* context-parallel: W gloo ranks, each embedding only its shard of the tokens (layout
  ``zigzag`` by default) and calling ``ringattn.ring_attention``; the loss is the GLOBAL mean
  next-token loss and the gradients are summed over the ranks;
* single-process: the whole sequence in one process with torch's SDPA.

Exact attention means the two loss curves agree to float32 rounding at every step; the demo
fails (``result["failures"]`` non-empty, ``ringattn demo`` exits 1) when they do not, or when
the model did not learn to copy.
"""

from __future__ import annotations

import json
import math
import os
import socket
import tempfile
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from functools import partial

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch import nn

from .api import ring_attention
from .layouts import LAYOUTS
from .sharding import positions, shard

__all__ = ["DemoConfig", "TinyLM", "make_batches", "run_demo"]

IGNORE = -100
"""Label of a position that has no target (the last token, and padding slots)."""

REL_TOL = 1e-4
"""Largest allowed |loss_cp - loss_single| / loss_single at any step.

Both runs do the same float32 arithmetic except for summation order (per-rank partial sums
of the loss and of the gradients, blockwise LSE merging in the ring instead of one softmax),
so a step's loss differs by an ulp or two (~1e-7 relative), and so do the updates. Training
can amplify such differences: with a constant learning rate, even two single-process runs
that differ only in their thread count drift apart by orders of magnitude more than an ulp
once the copy task is solved and Adam keeps taking lr-sized steps on gradients that are
mostly rounding noise. The cosine decay of ``lr_factor`` stops that, and the runs stay
within a few 1e-7 for all steps (``ringattn demo`` prints the maximum it saw, for any
``--world`` and ``--layout``). 1e-4 leaves two orders of magnitude of headroom, while a
real error in attention or in the loss (a dropped key, a padding slot counted) shows at
the first step.
"""

LEARN_RATIO = 0.7
"""The copied half's final loss must be below this fraction of its initial loss."""


@dataclass(frozen=True, kw_only=True)
class DemoConfig:
    """Everything that decides what the demo computes (the same in both runs)."""

    world: int = 2
    """Number of CPU ranks W of the context-parallel run."""

    steps: int = 300
    """Optimizer steps of each run."""

    layout: str = "zigzag"
    """How tokens are placed on ranks: "contiguous", "zigzag" or "striped"."""

    seqlen: int = 250
    """Global sequence length S; 250 divides neither 2*2 nor 2*4, so shards are padded."""

    batch: int = 8
    """Sequences per step B."""

    vocab: int = 16
    """Vocabulary size V."""

    d_model: int = 64
    """Model width C."""

    heads: int = 4
    """Query heads H."""

    kv_heads: int = 2
    """Key/value heads Hkv (GQA: H % Hkv == 0)."""

    layers: int = 2
    """Transformer blocks."""

    lr: float = 3e-3
    """AdamW learning rate."""

    seed: int = 0
    """Seed of the initial weights and of the batches."""

    def __post_init__(self) -> None:
        for name in ("world", "steps", "batch", "d_model", "heads", "kv_heads", "layers"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"{name} must be an int >= 1, got {value!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"unknown layout {self.layout!r}; choose one of {sorted(LAYOUTS)}")
        if not isinstance(self.seqlen, int) or isinstance(self.seqlen, bool) or self.seqlen < 4:
            raise ValueError(f"seqlen must be an int >= 4, got {self.seqlen!r}")
        if not isinstance(self.vocab, int) or isinstance(self.vocab, bool) or self.vocab < 2:
            raise ValueError(f"vocab must be an int >= 2, got {self.vocab!r}")
        if self.heads % self.kv_heads:
            raise ValueError(f"heads={self.heads} is not a multiple of kv_heads={self.kv_heads}")
        if self.d_model % self.heads or (self.d_model // self.heads) % 2:
            raise ValueError(
                f"d_model={self.d_model} must split into {self.heads} heads of an even size (RoPE)"
            )
        if not (isinstance(self.lr, float) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"lr must be a finite float > 0, got {self.lr!r}")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed must be an int, got {self.seed!r}")

    @property
    def period(self) -> int:
        """Length of the random prefix; token t >= period repeats token t - period."""
        return -(-self.seqlen // 2)


# ----------------------------------------------------------------------------- the model


def rotary(pos_L: torch.Tensor, head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin [L, 1, D/2] of rotary position embedding (RoPE) at GLOBAL positions.

    Any integer position works, padding slots (>= S) included. Rotating q and k by their
    positions makes q.k depend on the offset between them, so "look S/2 back" is a pattern
    the model can learn at every position at once.
    """
    exponent_F = torch.arange(0, head_dim, 2, dtype=torch.float32) / head_dim
    freq_F = torch.exp(exponent_F * -math.log(10000.0))
    angle_LF = pos_L.to(torch.float32).unsqueeze(1) * freq_F
    return angle_LF.cos().unsqueeze(1), angle_LF.sin().unsqueeze(1)


def apply_rotary(x_BLHD: torch.Tensor, cos_sin: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
    """Rotate each (even, odd) channel pair of x [B, L, H, D] by its position's angle."""
    cos, sin = cos_sin
    x1, x2 = x_BLHD[..., 0::2], x_BLHD[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


def sdpa_attend(q_BSHD: torch.Tensor, k_BSHD: torch.Tensor, v_BSHD: torch.Tensor) -> torch.Tensor:
    """Plain single-process causal attention; GQA by repeating each kv head H/Hkv times.

    Arguments:
        q_BSHD: [B, S, H, D]; k_BSHD, v_BSHD: [B, S, Hkv, D] with H % Hkv == 0.

    Returns:
        [B, S, H, D].
    """
    groups = q_BSHD.shape[2] // k_BSHD.shape[2]
    q, k, v = (t.transpose(1, 2) for t in (q_BSHD, k_BSHD, v_BSHD))
    k, v = (t.repeat_interleave(groups, dim=1) for t in (k, v))
    return F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)


class Attention(nn.Module):
    """Multi-head self-attention with GQA; the attention op itself is passed to forward."""

    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.h, self.hkv, self.d = cfg.heads, cfg.kv_heads, cfg.d_model // cfg.heads
        self.qkv = nn.Linear(cfg.d_model, (self.h + 2 * self.hkv) * self.d, bias=False)
        self.proj = nn.Linear(self.h * self.d, cfg.d_model, bias=False)

    def forward(self, x_BLC: torch.Tensor, cos_sin, attend) -> torch.Tensor:
        b, n, _ = x_BLC.shape
        q, k, v = self.qkv(x_BLC).split([self.h * self.d, self.hkv * self.d, self.hkv * self.d], -1)
        out_BLHD = attend(
            apply_rotary(q.reshape(b, n, self.h, self.d), cos_sin),
            apply_rotary(k.reshape(b, n, self.hkv, self.d), cos_sin),
            v.reshape(b, n, self.hkv, self.d),
        )
        return self.proj(out_BLHD.reshape(b, n, self.h * self.d))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)), then x + mlp(ln(x))."""

    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(cfg.d_model), nn.LayerNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.mlp = nn.Sequential(
            nn.Linear(cfg.d_model, 4 * cfg.d_model),
            nn.GELU(),
            nn.Linear(4 * cfg.d_model, cfg.d_model),
        )

    def forward(self, x_BLC: torch.Tensor, cos_sin, attend) -> torch.Tensor:
        x_BLC = x_BLC + self.attn(self.ln1(x_BLC), cos_sin, attend)
        return x_BLC + self.mlp(self.ln2(x_BLC))


class TinyLM(nn.Module):
    """A small causal LM whose tokens may be any subset of the sequence (a rank's shard).

    Positions enter as rotary embeddings of GLOBAL positions, so a rank that holds tokens
    0..62 and 189..249 rotates their q and k by exactly those positions, and the attention op
    decides who sees whom.
    """

    def __init__(self, cfg: DemoConfig):
        super().__init__()
        self.head_dim = cfg.d_model // cfg.heads
        self.tok = nn.Embedding(cfg.vocab, cfg.d_model)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.layers))
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab, bias=False)

    def forward(self, ids_BL: torch.Tensor, pos_L: torch.Tensor, attend) -> torch.Tensor:
        """Logits for each token.

        Arguments:
            ids_BL: [B, L] int64 token ids (a shard, or the whole sequence with L = S).
            pos_L: [L] int64 global position of each slot.
            attend: ``f(q [B, L, H, D], k [B, L, Hkv, D], v [B, L, Hkv, D]) -> [B, L, H, D]``,
                causal in global positions.

        Returns:
            [B, L, V] float32 logits.
        """
        cos_sin = rotary(pos_L, self.head_dim)
        x_BLC = self.tok(ids_BL)
        for block in self.blocks:
            x_BLC = block(x_BLC, cos_sin, attend)
        return self.head(self.ln_f(x_BLC))


def build_model(cfg: DemoConfig) -> TinyLM:
    """The model with its initial weights, the same in every process (global RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed)
        return TinyLM(cfg)


# ----------------------------------------------------------------------------- the data


def make_batches(cfg: DemoConfig):
    """Yield ``cfg.steps`` global batches (ids_BS, labels_BS), the same in every process.

    ids: a random prefix of ``cfg.period`` tokens followed by its copy, cut to S.
    labels: labels[t] = ids[t + 1] (shifted on the GLOBAL sequence, before any sharding);
    the last position has no target (IGNORE).
    """
    gen = torch.Generator().manual_seed(cfg.seed + 1)
    for _ in range(cfg.steps):
        prefix_BP = torch.randint(cfg.vocab, (cfg.batch, cfg.period), generator=gen)
        ids_BS = torch.cat((prefix_BP, prefix_BP), dim=1)[:, : cfg.seqlen]
        labels_BS = torch.full_like(ids_BS, IGNORE)
        labels_BS[:, :-1] = ids_BS[:, 1:]
        yield ids_BS, labels_BS


def copy_targets(pos_L: torch.Tensor, cfg: DemoConfig) -> torch.Tensor:
    """[L] bool: the slot's target repeats an earlier token (the half only attention can learn)."""
    return (pos_L >= cfg.period - 1) & (pos_L < cfg.seqlen - 1)


# ----------------------------------------------------------------------------- training


def lr_factor(step: int, *, steps: int) -> float:
    """Cosine decay of the learning rate from 1x to 0x over ``steps`` steps."""
    return 0.5 * (1.0 + math.cos(math.pi * min(step, steps) / steps))


def _train(cfg: DemoConfig, model: TinyLM, attend, localize, reduce_, bar: str | None):
    """The one training loop of both runs; returns (losses, copied-half losses, parameters).

    Arguments:
        attend: the attention op handed to the model.
        localize: ``(ids_BS, labels_BS) -> (ids_BL, labels_BL, pos_L)``, this process's tokens;
            padding slots must carry IGNORE labels.
        reduce_: sums a flat float32 tensor over the processes, in place (or does nothing).
        bar: title of the progress bar, None for no bar.
    """
    from tqdm import tqdm

    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, betas=(0.9, 0.98), weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, partial(lr_factor, steps=cfg.steps))
    params = list(model.parameters())
    losses, copy_losses = [], []
    n_copy = cfg.batch * int(copy_targets(torch.arange(cfg.seqlen), cfg).sum())
    batches = tqdm(make_batches(cfg), total=cfg.steps, desc=bar, disable=bar is None, leave=False)
    for ids_BS, labels_BS in batches:
        # Divide by the GLOBAL number of targets (counted on the global labels, which every
        # process has), so that the per-process losses add up to the global mean loss.
        n_valid = int((labels_BS != IGNORE).sum())
        ids_BL, labels_BL, pos_L = localize(ids_BS, labels_BS)
        logits_BLV = model(ids_BL, pos_L, attend)
        tok_BL = F.cross_entropy(
            logits_BLV.flatten(0, 1), labels_BL.flatten(), ignore_index=IGNORE, reduction="none"
        ).view_as(labels_BL)
        loss = tok_BL.sum() / n_valid
        opt.zero_grad(set_to_none=False)
        loss.backward()
        copy_sum = (tok_BL.detach() * copy_targets(pos_L, cfg)).sum()
        # One collective per step: all gradients and the two loss sums in one flat buffer.
        sums = torch.stack((loss.detach(), copy_sum))
        flat = torch.cat([p.grad.reshape(-1) for p in params] + [sums])
        reduce_(flat)
        offset = 0
        for p in params:
            p.grad.copy_(flat[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
        opt.step()
        sched.step()
        losses.append(float(flat[-2]))
        copy_losses.append(float(flat[-1]) / n_copy)
        batches.set_postfix(loss=f"{losses[-1]:.4f}", copy=f"{copy_losses[-1]:.4f}")
    return losses, copy_losses, params


def _localize_shard(ids_BS, labels_BS, *, cfg: DemoConfig, pos_L: torch.Tensor):
    """This rank's ids and labels; padding slots (global position >= S) get IGNORE labels."""
    ids_BL = shard(ids_BS, layout=cfg.layout, dim=1, seqlen=cfg.seqlen)
    labels_BL = shard(labels_BS, layout=cfg.layout, dim=1, seqlen=cfg.seqlen)
    labels_BL = labels_BL.masked_fill((pos_L >= cfg.seqlen).unsqueeze(0), IGNORE)
    return ids_BL, labels_BL, pos_L


def _sum_over_ranks(flat: torch.Tensor) -> None:
    dist.all_reduce(flat, op=dist.ReduceOp.SUM)


def _cp_rank(rank: int, cfg: DemoConfig, init_method: str, result_path: str,
             progress: bool) -> None:
    """One rank of the context-parallel run (the target of ``torch.multiprocessing.spawn``)."""
    torch.set_num_threads(1)  # W ranks share the cores; more threads each only contend
    dist.init_process_group(
        "gloo", init_method=init_method, rank=rank, world_size=cfg.world,
        timeout=timedelta(seconds=120),
    )
    try:
        pos_L = positions(cfg.seqlen, layout=cfg.layout)
        attend = partial(ring_attention, causal=True, layout=cfg.layout, seqlen=cfg.seqlen)
        localize = partial(_localize_shard, cfg=cfg, pos_L=pos_L)
        model = build_model(cfg)
        bar = f"ring attention, W={cfg.world}" if progress and rank == 0 else None
        t0 = time.perf_counter()
        losses, copy_losses, params = _train(cfg, model, attend, localize, _sum_over_ranks, bar)
        seconds = time.perf_counter() - t0
        # Replicas must still be identical: every rank stepped with the same summed gradients.
        flat = torch.cat([p.detach().reshape(-1) for p in params])
        lo, hi = flat.clone(), flat.clone()
        dist.all_reduce(lo, op=dist.ReduceOp.MIN)
        dist.all_reduce(hi, op=dist.ReduceOp.MAX)
        if not torch.equal(lo, hi):
            raise RuntimeError(
                f"rank {rank}: parameter replicas diverged (max spread "
                f"{float((hi - lo).abs().max()):.3e}); gradients were not identical on all ranks"
            )
        if rank == 0:
            with open(result_path, "w") as f:
                json.dump({"loss": losses, "copy_loss": copy_losses, "seconds": seconds}, f)
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    """A TCP port that is free right now (bound to port 0, then released)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_cp(cfg: DemoConfig, progress: bool) -> dict:
    with tempfile.TemporaryDirectory(prefix="ringattn-demo-") as tmp:
        result_path = os.path.join(tmp, "cp.json")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        mp.spawn(_cp_rank, args=(cfg, init_method, result_path, progress), nprocs=cfg.world,
                 join=True, start_method="spawn")
        with open(result_path) as f:
            return json.load(f)


def _run_single(cfg: DemoConfig, progress: bool) -> dict:
    pos_S = torch.arange(cfg.seqlen)

    def localize(ids_BS, labels_BS):
        return ids_BS, labels_BS, pos_S

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # as on the ranks; the ops are too small to gain from a second thread
    try:
        t0 = time.perf_counter()
        losses, copy_losses, _ = _train(
            cfg, build_model(cfg), sdpa_attend, localize, lambda flat: None,
            "single process" if progress else None,
        )
        seconds = time.perf_counter() - t0
    finally:
        torch.set_num_threads(threads)
    return {"loss": losses, "copy_loss": copy_losses, "seconds": seconds}


# ----------------------------------------------------------------------------- reporting


def _table(result: dict, every: int) -> str:
    steps = len(result["cp_loss"])
    rows = sorted(set(range(0, steps, every)) | {steps - 1})
    lines = [
        f"{'step':>5}  {'CP loss':>10}  {'single loss':>11}  {'rel diff':>9}  "
        f"{'copied half: CP':>15}  {'single':>8}"
    ]
    for i in rows:
        lines.append(
            f"{i + 1:>5}  {result['cp_loss'][i]:>10.6f}  {result['single_loss'][i]:>11.6f}  "
            f"{result['rel_diff'][i]:>9.2e}  {result['cp_copy_loss'][i]:>15.6f}  "
            f"{result['single_copy_loss'][i]:>8.6f}"
        )
    return "\n".join(lines)


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg = result["config"]
    steps = range(1, len(result["cp_loss"]) + 1)
    fig, (ax, ax_diff) = plt.subplots(2, 1, figsize=(8, 7), sharex=True,
                                      gridspec_kw={"height_ratios": [3, 1.4]})
    curves = (("loss", "tab:blue", "all targets"), ("copy_loss", "tab:orange", "copied half"))
    for key, color, what in curves:
        ax.plot(steps, result[f"single_{key}"], color=color, lw=3, alpha=0.45,
                label=f"single process (SDPA), {what}")
        ax.plot(steps, result[f"cp_{key}"], color=color, lw=1, ls="--",
                label=f"ring attention W={cfg['world']}, {what}")
    ax.set_ylabel("next-token loss")
    ax.set_title(
        f"Tiny causal LM, S={cfg['seqlen']}, layout={cfg['layout']}, W={cfg['world']}: "
        "ring attention vs one process"
    )
    ax.legend()
    ax.grid(alpha=0.3)
    diff = result["rel_diff"]
    nonzero = [(i + 1, d) for i, d in enumerate(diff) if d > 0]
    running, worst = [], 0.0
    for d in diff:
        worst = max(worst, d)
        running.append(worst)
    if nonzero:
        ax_diff.semilogy(*zip(*nonzero), ".", ms=3, color="tab:green",
                         label="|CP - single| / single (steps where they are equal not shown)")
    if worst > 0:
        ax_diff.semilogy(steps, running, color="tab:green", lw=1, label="running maximum")
    ax_diff.set_yscale("log")
    ax_diff.axhline(result["tolerance"], color="tab:red", ls=":",
                    label=f"tolerance {result['tolerance']:g}")
    ax_diff.set_xlabel("step")
    ax_diff.set_ylabel("relative difference")
    ax_diff.legend(loc="center right", fontsize="small")
    ax_diff.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_demo(
    world: int = 2,
    steps: int = 300,
    out_dir: str = "demo_out",
    layout: str = "zigzag",
    seqlen: int = 250,
    *,
    seed: int = 0,
    tolerance: float = REL_TOL,
    verbose: bool = True,
) -> dict:
    """Train the tiny LM with ring attention on ``world`` CPU ranks and in one process; compare.

    Arguments:
        world: number of gloo ranks W of the context-parallel run.
        steps: AdamW steps of each run.
        out_dir: where ``losses.json`` and ``losses.png`` are written (created if missing).
        layout: "contiguous", "zigzag" or "striped".
        seqlen: global sequence length S (need not divide 2W).
        seed: seed of the weights and the batches.
        tolerance: largest allowed relative difference of the two losses at any step.
        verbose: show progress bars and print the loss table.

    Returns:
        dict with ``config``, per-step lists ``cp_loss``, ``single_loss``, ``cp_copy_loss``,
        ``single_copy_loss``, ``rel_diff``; ``max_rel_diff``, ``tolerance``, ``learned``,
        ``seconds`` and ``failures`` (empty when the curves agree and the model learned;
        the learning check applies only to runs of at least 100 steps).
        The same dict is written to ``out_dir/losses.json``.

    Raises:
        ValueError: on a bad argument, naming it.
        torch.multiprocessing.ProcessRaisedException: when a rank fails.
    """
    cfg = DemoConfig(world=world, steps=steps, layout=layout, seqlen=seqlen, seed=seed)
    if not (isinstance(tolerance, float) and 0 < tolerance <= 1e-3):
        raise ValueError(f"tolerance must be a float in (0, 1e-3], got {tolerance!r}")
    t0 = time.perf_counter()
    cp = _run_cp(cfg, verbose)
    single = _run_single(cfg, verbose)
    rel_diff = [abs(a - b) / abs(b) for a, b in zip(cp["loss"], single["loss"])]
    worst = max(range(len(rel_diff)), key=rel_diff.__getitem__)
    tail = max(1, min(10, steps // 10))
    first, last = cp["copy_loss"][0], sum(cp["copy_loss"][-tail:]) / tail
    learned = last < LEARN_RATIO * first
    failures = []
    if rel_diff[worst] > tolerance:
        failures.append(
            f"ring attention loss left the single-process loss: relative difference "
            f"{rel_diff[worst]:.3e} at step {worst + 1} (CP {cp['loss'][worst]:.7f}, single "
            f"{single['loss'][worst]:.7f}) exceeds the fp32 tolerance {tolerance:g}"
        )
    if steps >= 100 and not learned:
        failures.append(
            f"the model did not learn to copy: copied-half loss went from {first:.4f} to "
            f"{last:.4f} (mean of the last {tail} steps), not below {LEARN_RATIO} x {first:.4f}"
        )
    result = {
        "config": asdict(cfg),
        "cp_loss": cp["loss"],
        "single_loss": single["loss"],
        "cp_copy_loss": cp["copy_loss"],
        "single_copy_loss": single["copy_loss"],
        "rel_diff": rel_diff,
        "max_rel_diff": rel_diff[worst],
        "max_rel_diff_step": worst + 1,
        "tolerance": tolerance,
        "copy_loss_first": first,
        "copy_loss_last": last,
        "learned": learned,
        "seconds": {
            "cp": cp["seconds"], "single": single["seconds"], "total": time.perf_counter() - t0
        },
        "failures": failures,
    }
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "losses.json"), "w") as f:
        json.dump(result, f, indent=1)
    _plot(result, os.path.join(out_dir, "losses.png"))
    if verbose:
        print(_table(result, every=25))
        print(
            f"max relative difference {rel_diff[worst]:.2e} at step {worst + 1} "
            f"(tolerance {tolerance:g}); copied-half loss {first:.4f} -> {last:.4f}; "
            f"ring {cp['seconds']:.1f}s, single {single['seconds']:.1f}s; wrote "
            f"{os.path.join(out_dir, 'losses.json')} and losses.png"
        )
    return result
