"""Eagle3 draft training, online against a transformers target, on a DP x CP mesh.

Every step: the target (a tiny random-weight ``LlamaForCausalLM``, frozen) runs on the batch
under context parallelism through the transformers integration, the draft unrolls its TTT
steps on this rank's tokens (``eagle3_step``), the draft's gradients are summed over the CP
ranks and averaged over the DP replicas (one all-reduce each: ``train_step``), and AdamW
steps. Per-TTT-step loss
and accuracy are global means (over CP and DP). Without a group the same code runs in one
process with the dense TTT mask: the baseline the CP run must match.

    python -m ringattn.eagle3.train --world 2          # spawns 2 gloo CPU ranks
    torchrun --nproc-per-node 4 -m ringattn.eagle3.train --dp 2   # DP 2 x CP 2
"""

from __future__ import annotations

import argparse
import json
import os
import time
from dataclasses import asdict, dataclass

import torch
import torch.distributed as dist

from ..comm import metadata_device, resolve_group
from ..integrations import transformers as ra_hf
from ..layouts import LAYOUTS, local_positions
from ..train import leave_together, peak_rss_mib, plot_curves, spawn
from .draft import Eagle3Draft, aux_layer_ids, draft_vocabulary, eagle3_step, run_target

__all__ = ["Eagle3Config", "build_target", "build_draft", "make_batches", "train_step",
           "train_eagle3", "spawn_eagle3", "shard_ranges"]


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
    target_init_std: float = 0.05
    """Initial weight scale of the random target."""
    target_embed_scale: float = 3.0
    """The random target ties its input and output embeddings, scaled by this: its next-token
    distribution then peaks (about 0.8) on a token determined mostly by the current one, a
    teacher a draft learns in tens of steps (at 1.0 the distributions are nearly uniform)."""
    lr: float = 3e-3
    layout: str = "zigzag"
    dp: int = 1
    """Data-parallel replicas; the world is dp x cp."""
    seed: int = 0
    pad: int = 37
    """Right padding of each batch's last row (tokens)."""

    def __post_init__(self):
        for name in ("seqlen", "batch", "steps", "ttt_steps", "vocab", "draft_vocab", "hidden",
                     "heads", "kv_heads", "intermediate", "target_layers", "dp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{name} must be an int >= 1, got {v!r}")
        if self.layout not in LAYOUTS:
            raise ValueError(f"layout must be one of {sorted(LAYOUTS)}, got {self.layout!r}")
        if not 0 <= self.pad < self.seqlen:
            raise ValueError(f"pad must lie in [0, seqlen={self.seqlen}), got {self.pad}")
        if self.draft_vocab > self.vocab:
            raise ValueError(f"draft_vocab={self.draft_vocab} exceeds vocab={self.vocab}")


def build_target(cfg: Eagle3Config, attn_implementation: str):
    """The frozen target: a tiny ``LlamaForCausalLM``, seeded (the same in every process)."""
    from transformers import LlamaConfig, LlamaForCausalLM

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


def build_draft(cfg: Eagle3Config, target, draft_ids: torch.Tensor) -> Eagle3Draft:
    """A seeded one-layer draft sharing the target's (frozen) token embedding."""
    config = target.config.__class__(**target.config.to_dict())
    config.initializer_range = 0.02
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(cfg.seed + 7)
        draft = Eagle3Draft(config, cfg.hidden, draft_ids,
                            aux_layer_ids(config.num_hidden_layers)).float()
        for name, p in draft.named_parameters():
            if p.dim() == 2 and name != "embed_tokens.weight":
                torch.nn.init.normal_(p, std=0.02)
    draft.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight)
    return draft.train()


def make_batches(cfg: Eagle3Config, replica: int | None = 0):
    """Yield ``cfg.steps`` global batches for DP replica ``replica`` (the same on its CP
    ranks; None: all replicas' rows, for one process): ``input_ids`` [B, S],
    ``attention_mask`` (each replica's last row right padded by ``pad``) and ``loss_mask``
    (a prompt of 8 tokens is not trained on, nor is padding)."""
    gen = torch.Generator().manual_seed(cfg.seed * 1000 + 17)
    for _ in range(cfg.steps):
        ids = torch.randint(cfg.vocab, (cfg.dp, cfg.batch, cfg.seqlen), generator=gen)
        keep = torch.ones_like(ids)
        keep[:, -1, cfg.seqlen - cfg.pad:] = 0
        loss_mask = keep.clone()
        loss_mask[:, :, :8] = 0
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


def _draft_ids(cfg: Eagle3Config, target, group):
    """The draft vocabulary: the target's most frequent top tokens on the first batch."""
    first = next(make_batches(Eagle3Config(**{**asdict(cfg), "steps": 1}), replica=0))
    tgt = run_target(target, first, group=group, layout=cfg.layout)
    top = tgt.logits.argmax(-1)[tgt.valid_mask]  # real tokens (not the shards' padding)
    counts = torch.bincount(top, minlength=cfg.vocab)
    if group is not None:
        dist.all_reduce(counts, group=group)
    return draft_vocabulary(torch.repeat_interleave(torch.arange(cfg.vocab), counts),
                            cfg.vocab, cfg.draft_vocab)


def train_step(target, draft: Eagle3Draft, opt, batch: dict, cfg: Eagle3Config, *,
               cp_group=None, dp_group=None) -> torch.Tensor:
    """One optimizer step on one batch: the target under CP, the TTT unroll, the backward,
    the draft's gradients summed over the CP shares (one all-reduce) and averaged over the
    DP replicas (one more, with ``dp_group``), AdamW.

    Returns:
        [3, T] float64 (loss, correct, counted) sums of every TTT step over CP and DP (the
        loss sums are each replica's mean; divide by the number of replicas).
    """
    params = [p for p in draft.parameters() if p.requires_grad]
    tgt = run_target(target, batch, group=cp_group, layout=cfg.layout)
    res = eagle3_step(draft, tgt, steps=cfg.ttt_steps, decay=cfg.decay)
    opt.zero_grad(set_to_none=False)
    res.loss.backward()
    sums = res.sums
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
    opt.step()
    return sums


def train_eagle3(cfg: Eagle3Config, *, group=None, progress: bool = True,
                 out_dir: str | None = None, log_every: int = 10) -> dict:
    """Train the draft; with a group (the whole world, split dp x cp), under CP.

    Rank 0 prints every rank's shard ranges at start, shows a tqdm bar, and (with
    ``progress``) a line of per-TTT-step losses and accuracies every ``log_every`` steps;
    with ``out_dir`` it writes ``eagle3.json``, ``eagle3.png`` (per-TTT-step loss) and
    ``eagle3_accuracy.png``.

    Returns:
        dict (the same on every rank): ``config``, ``world``, ``cp``, ``dp``, per-step
        ``loss`` (the weighted total), per-TTT-step lists ``step_loss[j]`` and
        ``step_accuracy[j]`` over the optimizer steps, ``shard_ranges`` (per CP rank),
        ``tokens_per_s_mean``, ``seconds``, ``peak_rss_mib`` (per rank).
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
    draft = build_draft(cfg, target, _draft_ids(cfg, target, cp_group))
    opt = torch.optim.AdamW([p for p in draft.parameters() if p.requires_grad], lr=cfg.lr,
                            weight_decay=0.0)
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
    losses, step_loss, step_acc, rates = [], [[] for _ in range(cfg.ttt_steps)], \
        [[] for _ in range(cfg.ttt_steps)], []
    t_start = time.perf_counter()
    replicas = 1 if group is None else cfg.dp  # one process takes every replica's rows
    bar = tqdm(make_batches(cfg, None if group is None else dp_rank), total=cfg.steps,
               disable=not show,
               desc=f"eagle3 draft, {'one process' if group is None else f'dp {cfg.dp} x cp {cp}'}")
    for batch in bar:
        t0 = time.perf_counter()
        sums = train_step(target, draft, opt, batch, cfg, cp_group=cp_group,
                          dp_group=dp_group if replicas > 1 else None)
        weights = torch.tensor([cfg.decay ** j for j in range(cfg.ttt_steps)], dtype=torch.float64)
        losses.append(float((sums[0] * weights).sum()) / replicas)
        for j in range(cfg.ttt_steps):
            step_loss[j].append(float(sums[0, j]) / replicas)
            step_acc[j].append(float(sums[1, j] / sums[2, j]) if sums[2, j] > 0 else float("nan"))
        rates.append(cfg.batch * cfg.dp * cfg.seqlen / (time.perf_counter() - t0))
        bar.set_postfix(loss=f"{losses[-1]:.4f}", acc0=f"{step_acc[0][-1]:.3f}",
                        acc_last=f"{step_acc[-1][-1]:.3f}")
        n = len(losses)
        if show and log_every and (n % log_every == 0 or n == cfg.steps):
            bar.write(f"step {n}: loss {losses[-1]:.4f}; per TTT step loss "
                      f"{' '.join(f'{step_loss[j][-1]:.3f}' for j in range(cfg.ttt_steps))}; "
                      f"accuracy "
                      f"{' '.join(f'{step_acc[j][-1]:.3f}' for j in range(cfg.ttt_steps))}")
    bar.close()
    seconds = time.perf_counter() - t_start
    later = rates[1:] or rates
    peak = torch.tensor([peak_rss_mib()], dtype=torch.float64)
    peaks = [float(peak)]
    if group is not None:
        gathered = [torch.zeros_like(peak) for _ in range(world)]
        dist.all_gather(gathered, peak, group=pg)
        peaks = [float(t) for t in gathered]
    result = {
        "config": asdict(cfg), "world": world, "cp": cp, "dp": cfg.dp,
        "loss": losses, "step_loss": step_loss, "step_accuracy": step_acc,
        "shard_ranges": ranges, "seconds": seconds,
        "tokens_per_s_mean": len(later) / sum(1.0 / r for r in later),
        "peak_rss_mib": peaks,
    }
    if out_dir is not None and rank == 0:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "eagle3.json"), "w") as f:
            json.dump(result, f, indent=1)
        title = f"Eagle3 draft, S={cfg.seqlen}, dp {cfg.dp} x cp {cp}"
        plot_curves(os.path.join(out_dir, "eagle3.png"),
                    [(f"TTT step {j}", step_loss[j], {}) for j in range(cfg.ttt_steps)],
                    title=title, ylabel="per-TTT-step loss")
        plot_curves(os.path.join(out_dir, "eagle3_accuracy.png"),
                    [(f"TTT step {j}", step_acc[j], {}) for j in range(cfg.ttt_steps)],
                    title=title, ylabel="per-TTT-step accuracy")
    return result


def spawn_eagle3(cfg: Eagle3Config, *, world: int, progress: bool = True,
                 out_dir: str | None = None) -> dict:
    """``train_eagle3`` on ``world`` local gloo ranks (dp x cp = world); rank 0's result."""
    return spawn(cfg, world=world, progress=progress, out_dir=out_dir, fn=train_eagle3)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ringattn.eagle3.train",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--world", type=int, default=2,
                        help="ranks to spawn (ignored under torchrun; default 2)")
    parser.add_argument("--dp", type=int, default=1, help="data-parallel replicas (default 1)")
    parser.add_argument("--steps", type=int, default=Eagle3Config.steps)
    parser.add_argument("--seqlen", type=int, default=Eagle3Config.seqlen)
    parser.add_argument("--layout", choices=sorted(LAYOUTS), default="zigzag")
    parser.add_argument("--out", default="eagle3_out")
    args = parser.parse_args(argv)
    cfg = Eagle3Config(steps=args.steps, seqlen=args.seqlen, layout=args.layout, dp=args.dp)
    if "LOCAL_RANK" in os.environ:  # torchrun
        dist.init_process_group("gloo")
        try:
            train_eagle3(cfg, group=dist.group.WORLD, out_dir=args.out)
            leave_together()
        finally:
            dist.destroy_process_group()
    else:
        spawn_eagle3(cfg, world=args.world, out_dir=args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
