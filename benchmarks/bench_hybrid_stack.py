"""A transformers hybrid model's whole layer stack under context parallelism against one
process: time, per-rank peak memory, and the bytes attention and the mixers exchange.

Legend: B batch (1), S global seq, W world size, V vocabulary, L layers.

Models (random weights, seed 0, fp32, V=1024, hidden 256, L=8 with transformers' own
interleave of three sequence-mixer layers to one full-attention layer; ``--family``):

* ``qwen3_5`` (default): ``Qwen3_5ForCausalLM``: six Gated DeltaNet layers (short conv
  k=4, the gated delta rule; Hk=2, Hv=4, dk=dv=32, the ``gdn`` block of
  ``bench_mixers.py``) and two gated full-attention layers (H=8, Hkv=2, D=32, RoPE), MLP
  512 in every layer.
* ``granite4``: ``GraniteMoeHybridForCausalLM`` as Granite 4.0-H-Micro is built (dense
  shared MLP, no experts, no position embedding): six Mamba2 layers (expand 2: H=16, P=32,
  G=1, N=32, conv k=4, chunk 256) and two attention layers (H=8, Hkv=2), MLP 512.

Methods (one forward of the whole model with the loss on ``labels = input_ids``, then
``loss.backward()``; the gradients are set to None before each step, so every step
allocates them):

* ``1p``: one process, one thread, transformers' own model on the whole sequence: its
  mixers (``torch_chunk_gated_delta_rule`` / ``mamba2_chunk_scan`` and its conv path) and
  SDPA attention (``attn_implementation="sdpa"``; CPU flash). transformers' "eager"
  attention materialises the [H, S, S] scores (8 GiB per layer at S=16384), so it is the
  exactness reference only where S <= ``--eager-max-s`` (default 4096): there CP is
  checked against both.
* ``cp-W`` (W = 1, 2, 4): the same model built with ``attn_implementation="ringattn"``,
  ``ra_hf.convert(model)`` (its mixers run ``ringattn.mixers`` with transformers' chunked
  functions as the local scans), ``ra_hf.prepare_batch(model, batch)`` (zigzag) and
  ``model(**local, use_cache=False)``, ``loss.backward()`` on W gloo ranks
  (``common.Cluster``: one compute thread each). W=1 is the same code on a one-rank group
  (the mechanism without communication); W=4 on a 2-core machine is four one-thread ranks
  on two cores: oversubscribed.

Before timing, each (S, W) runs one step inside the measuring dispatch modes on every rank
(it also warms up: plans, caches) and compares it with one process: the loss summed over
the ranks, the gathered logits, and every parameter's gradient summed over the ranks
(relative to its reference gradient or 1e-3 of the whole model's gradient where that is
larger, as the family survey's ``_errors``) must agree within 1e-5 relative, else the run
stops. During that step ``common.TensorBytes`` follows the live tensor bytes allocated
(the peak; the model's parameters, made before, are not counted; gradients are) and
``Collectives`` (``bench_mixers.py``: every c10d op torch's dispatcher sees; nothing is
wrapped or patched) records each collective's bytes received by this rank. ``Split`` below
attributes each to its caller from the Python stack at dispatch (forward and backward:
autograd runs the ring's and the mixers' backward functions in Python): ``mixers`` (a
frame in ``ringattn/mixers/``), ``attention`` (a frame in ``ringattn/strategies/``: the
ring and its agreement), ``batch`` (``prepare_batch``'s agreement in ``shard_batch``), else
``other``. Data = float collectives, agreement = the integer
metadata checks. The mixers' data bytes are cross-checked against the plan's shapes
(``planned_mixer_bytes``). For these collectives (all-gather, equal-split all-to-all, the
ring's send/receive pairs) a rank sends as many bytes as it receives.

Time: paired rounds (as ``bench_mixers.py``): each round times one step of every method
back to back (order rotated per round; a CP time is the slowest rank's, barrier before,
all-reduce MAX after; ``prepare_batch`` included) and gives its own ratio cp-W / 1p; the
tables give the median (range) over rounds. After every step of every method, outside the
timed window, the process gives its freed heap back to the OS (``trim``: one machine's
memory holds all the ranks and the driver).

    python benchmarks/bench_hybrid_stack.py                     # S 4096, 8192; 3 rounds: 6 min
    python benchmarks/bench_hybrid_stack.py --quick             # S 1024, 4096; 1 round: 2-4.5 min
    python benchmarks/bench_hybrid_stack.py --family granite4 --seqlens 2048 4096   # the Mamba2 hybrid: 5 min
    python benchmarks/bench_hybrid_stack.py --smoke             # S 256, W 1 2, 1 round, to results/smoke/
    python benchmarks/bench_hybrid_stack.py --replot            # table and PNG from the JSON

S stops at 8192 by default: at S=16384 the W=1 check of ``qwen3_5`` misses 1e-5 against one
fp32 process (1.04e-5 on layer 0's ``A_log`` gradient), where that one process is itself
1.04e-5 from the same model in float64 and CP 6.2e-6 (``--fp64``; benchmarks/RESULTS.md).

Writes ``<out>/hybrid_stack_<family>.json`` (every round, per-rank peaks and collectives
per caller, errors, machine, load average) and ``hybrid_stack_<family>.png``.
"""

from __future__ import annotations

import argparse
import ctypes
import gc
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

from bench_mixers import Collectives, summarize_calls
from common import RESULTS, Cluster, TensorBytes, machine_info, write_json

VOCAB = 1024
HIDDEN = 256
LAYERS = 8
TOL = 1e-5
GRAD_FLOOR = 1e-3
"""A parameter's gradient error is relative to its reference gradient or to this fraction
of the whole model's reference gradient, where that is larger (the survey's floor)."""
FAMILY_NAMES = ("qwen3_5", "granite4")
KINDS = ("attention", "mixers", "batch", "other")


# ---------------------------------------------------------------------------- the models


def make_config(family: str):
    """(config, CausalLM class) of the benchmark's model of ``family``."""
    import transformers as tf

    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=LAYERS,
                  num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=65536,
                  pad_token_id=0, bos_token_id=1, eos_token_id=2)
    if family == "qwen3_5":  # the default layer_types: three linear, one full (interval 4)
        return tf.Qwen3_5TextConfig(
            **common, intermediate_size=512, head_dim=32, linear_conv_kernel_dim=4,
            linear_key_head_dim=32, linear_value_head_dim=32, linear_num_key_heads=2,
            linear_num_value_heads=4), tf.Qwen3_5ForCausalLM
    if family == "granite4":
        return tf.GraniteMoeHybridConfig(
            **common, intermediate_size=512, shared_intermediate_size=512, num_local_experts=0,
            position_embedding_type=None, layer_types=["mamba", "mamba", "mamba", "attention"] * 2,
            mamba_n_heads=16, mamba_d_head=32, mamba_n_groups=1, mamba_d_state=32,
            mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=256), tf.GraniteMoeHybridForCausalLM
    raise ValueError(f"unknown family {family!r}; families: {list(FAMILY_NAMES)}")


def build(family: str, attn: str):
    """The model with attention implementation ``attn``, the same weights in every process."""
    cfg, cls = make_config(family)
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return cls(cfg).float()


def describe_model(model) -> dict:
    cfg = model.config
    kinds = getattr(cfg, "layer_types", None)
    return {"class": type(model).__name__, "layer_types": list(kinds) if kinds else None,
            "parameters": sum(p.numel() for p in model.parameters())}


def global_batch(s: int, seed: int = 1) -> dict:
    g = torch.Generator().manual_seed(seed + s)
    ids = torch.randint(3, VOCAB, (1, s), generator=g)
    return {"input_ids": ids, "labels": ids.clone()}


def one_step(model, batch):
    """One process: fwd with the loss, backward; returns the output."""
    model.zero_grad(set_to_none=True)
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return out


def flat_grads(model) -> torch.Tensor:
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for p in model.parameters()])


def planned_mixer_bytes(model, s: int, world: int) -> int:
    """What the mixers' data all-gathers (forward) and reduce-scatters (backward) receive per
    rank, from the plan's shapes: rows x ((k-1) x conv channels + map + state) x 4 bytes x
    (W - 1) per layer, both directions. Gated DeltaNet: map Hv x dk x dk, state Hv x dk x dv;
    Mamba2: map H (diagonal), state H x P x N."""
    if world == 1:
        return 0
    from ringattn.integrations.hybrid import _GatedDeltaNet, _Mamba2
    from ringattn.layouts import get_layout
    from ringattn.mixers._plan import make_plan

    rows = make_plan(get_layout("zigzag", None), world, 0, s, None).rows
    per_row = 0
    for m in model.modules():
        if isinstance(m, _GatedDeltaNet):
            conv = (m.conv1d.weight.shape[-1] - 1) * m.conv1d.weight.shape[0]
            h, dk, dv = m.num_v_heads, m.head_k_dim, m.head_v_dim
            per_row += conv + h * dk * dk + h * dk * dv
        elif isinstance(m, _Mamba2):
            conv = (m.conv1d.weight.shape[-1] - 1) * m.conv1d.weight.shape[0]
            per_row += conv + m.num_heads + m.num_heads * m.head_dim * m.ssm_state_size
    return 2 * rows * per_row * 4 * (world - 1)


# ---------------------------------------------------------------------------- collectives


def _caller() -> str:
    """Who issued the collective being dispatched, from the ringattn code on the Python stack:
    ``mixers`` (ringattn/mixers/), ``attention`` (ringattn/strategies/: the ring and its
    agreement), ``batch`` (``prepare_batch``'s ``shard_batch`` agreement), else ``other``."""
    f = sys._getframe(1)
    seen = "other"
    while f is not None:
        name = f.f_code.co_filename.replace(os.sep, "/")
        if "/ringattn/mixers/" in name:
            return "mixers"
        if "/ringattn/strategies/" in name:
            return "attention"
        if name.endswith(("/ringattn/sharding.py", "/ringattn/batch.py")):
            seen = "batch"
        f = f.f_back
    return seen


class Split(Collectives):
    """``Collectives`` that also records each call's caller (``_caller``) in ``kinds``."""

    def __init__(self, world: int):
        super().__init__(world)
        self.kinds: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        before = len(self.calls)
        out = super().__torch_dispatch__(func, types, args, kwargs)
        if len(self.calls) > before:
            self.kinds.append(_caller())
        return out

    def summary(self) -> dict:
        return {kind: summarize_calls([c for c, k in zip(self.calls, self.kinds) if k == kind])
                for kind in KINDS}


# ---------------------------------------------------------------------------- rank tasks

_STATE: dict = {}


def trim() -> None:
    """Give freed heap back to the OS (``malloc_trim``), after every step of every method,
    outside the timed window: the ranks and the driver share one machine's memory, and each
    would otherwise keep its high water."""
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)


def release_task() -> None:
    """Rank side: drop the model and batch of the last (family, S)."""
    _STATE.clear()
    trim()


def _cp(family: str, s: int):
    """(model, batch) on this rank, kept across calls of one (family, S)."""
    from ringattn.integrations import transformers as ra_hf

    key = (family, s)
    if key not in _STATE:
        _STATE.clear()
        ra_hf.register()
        _STATE[key] = (ra_hf.convert(build(family, "ringattn")), global_batch(s))
    return _STATE[key]


def _cp_step(model, batch):
    import torch.distributed as dist

    from ringattn.integrations import transformers as ra_hf

    model.zero_grad(set_to_none=True)
    local = ra_hf.prepare_batch(model, batch, group=dist.group.WORLD)
    out = model(**local, use_cache=False)
    out.loss.backward()
    return out, local


def errors(model, loss, logits, refs: dict, names) -> dict:
    """Relative errors of a CP step's summed loss, gathered logits and summed gradients
    against each reference in ``refs`` ({name: saved one-process step})."""
    import torch.distributed as dist

    loss = loss.detach().clone()
    grads = flat_grads(model)
    dist.all_reduce(loss)
    dist.all_reduce(grads)
    return {ref_name: compare(loss, logits, grads, ref, names) for ref_name, ref in refs.items()}


def compare(loss, logits, grads, ref: dict, names) -> dict:
    """Relative errors of (loss, logits, flat gradients) against a saved step; a parameter's
    gradient error is relative to max(its reference norm, GRAD_FLOOR x the whole one's)."""
    ref_grads = ref["grads"].double()
    floor = GRAD_FLOOR * float(ref_grads.norm())
    worst, worst_name, start = 0.0, "", 0
    for pname, n in names:
        g_ref = ref_grads[start:start + n]
        err = float((grads[start:start + n].double() - g_ref).norm()) / max(float(g_ref.norm()), floor)
        err = err if err == err else float("inf")
        start += n
        if err > worst or not worst_name:
            worst, worst_name = err, pname
    return {"loss": rel_error(loss, ref["loss"]), "logits": rel_error(logits, ref["logits"]),
            "grads": worst, "worst_grad": worst_name}


def check_task(family: str, s: int, ref_paths: dict):
    """Rank side: one step (warm-up) inside the memory and collective modes, compared with
    the one-process references."""
    import torch.distributed as dist

    import ringattn as ra

    model, batch = _cp(family, s)
    with TensorBytes() as mem, Split(dist.get_world_size()) as comm:
        out, local = _cp_step(model, batch)
    local["ring_context"].check_consumed(model)
    logits = ra.unshard(out.logits.detach(), seqlen=s)
    refs = {name: torch.load(path) for name, path in ref_paths.items()}
    names = [(n, p.numel()) for n, p in model.named_parameters()]
    errs = errors(model, out.loss, logits, refs, names)
    del out, local, logits, refs
    model.zero_grad(set_to_none=True)
    trim()
    return {"errors": errs, "peak_bytes": mem.peak, "comm": comm.summary(),
            "planned_mixer_bytes": planned_mixer_bytes(model, s, dist.get_world_size())}


def time_task(family: str, s: int) -> float:
    """Rank side: seconds of one step, the slowest rank's."""
    import torch.distributed as dist

    model, batch = _cp(family, s)
    dist.barrier()
    t0 = time.perf_counter()
    _cp_step(model, batch)
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    model.zero_grad(set_to_none=True)
    trim()
    return t.item()


def rel_error(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------- driver


def _reference(model, batch, path: Path) -> None:
    out = one_step(model, batch)
    torch.save({"loss": out.loss.detach(), "logits": out.logits.detach(),
                "grads": flat_grads(model)}, path)
    del out
    model.zero_grad(set_to_none=True)
    trim()


def run(family: str, seqlens, worlds, rounds, eager_max_s: int, out_dir: Path,
        fp64: bool = False, stop: bool = True) -> dict:
    torch.set_num_threads(1)
    probe = build(family, "sdpa")
    data = {"machine": machine_info(), "family": family, "model": describe_model(probe),
            "config": probe.config.to_dict(), "dtype": "fp32", "layout": "zigzag",
            "seqlens": seqlens, "worlds": worlds, "rounds": rounds, "eager_max_s": eager_max_s, "fp64": fp64,
            "cases": [], "loadavg": {"start": os.getloadavg()}}
    data["config"].pop("transformers_version", None)
    del probe
    path = out_dir / f"hybrid_stack_{family}.json"
    t_start = time.monotonic()
    clusters = {w: Cluster(w) for w in worlds}
    tmp = Path(tempfile.mkdtemp(prefix="bench-hybrid-stack-"))
    try:
        for s in seqlens:
            t_case = time.monotonic()
            batch = global_batch(s)
            rec = {"S": s, "errors": {}, "peak_bytes": {}, "comm": {}, "planned_mixer_bytes": {},
                   "times_s": {"1p": []}, "loadavg": []}
            refs = {}
            if s <= eager_max_s:
                refs["eager"] = str(tmp / "eager.pt")
                _reference(build(family, "eager"), batch, Path(refs["eager"]))
            one = build(family, "sdpa")
            refs["sdpa"] = str(tmp / "sdpa.pt")
            _reference(one, batch, Path(refs["sdpa"]))  # also the warm-up
            if fp64:  # the same model in float64: what fp32 rounding costs one process
                refs["fp64"] = str(tmp / "fp64.pt")
                _reference(build(family, "sdpa").double(), batch, Path(refs["fp64"]))
                mine, ref = torch.load(refs["sdpa"]), torch.load(refs["fp64"])
                names = [(n, p.numel()) for n, p in one.named_parameters()]
                rec["errors"]["1p"] = {"fp64": compare(mine["loss"], mine["logits"], mine["grads"],
                                                       ref, names)}
            with TensorBytes() as mem:
                one_step(one, batch)
            rec["peak_bytes"]["1p"] = mem.peak
            one.zero_grad(set_to_none=True)
            trim()
            for w in worlds:
                got = clusters[w].run(check_task, family, s, refs, timeout=1800)
                worst = {ref: {k: max(g["errors"][ref][k] for g in got) for k in ("loss", "logits", "grads")}
                         for ref in refs}
                for ref in refs:
                    worst[ref]["worst_grad"] = max(got, key=lambda g: g["errors"][ref]["grads"])[
                        "errors"][ref]["worst_grad"]
                m = f"cp-{w}"
                rec["errors"][m] = worst
                rec["peak_bytes"][m] = [g["peak_bytes"] for g in got]
                rec["comm"][m] = [g["comm"] for g in got]
                rec["planned_mixer_bytes"][m] = got[0]["planned_mixer_bytes"]
                rec["times_s"][m] = []
                bad = {ref: e for ref, e in worst.items()
                       if ref != "fp64" and max(e["loss"], e["logits"], e["grads"]) > TOL}
                if bad and not stop:
                    rec["failed"] = {**rec.get("failed", {}), m: bad}
                    print(f"{family} S={s} W={w}: CP differs from one process: {bad}", flush=True)
                elif bad:
                    data["cases"].append(rec)
                    write_json(path, data)
                    raise SystemExit(f"{family} S={s} W={w}: CP differs from one process: {bad}")
            methods = ["1p", *(f"cp-{w}" for w in worlds)]
            for r in range(rounds):
                order = methods[r % len(methods):] + methods[:r % len(methods)]
                for m in order:
                    if m == "1p":
                        t0 = time.perf_counter()
                        one_step(one, batch)
                        rec["times_s"]["1p"].append(time.perf_counter() - t0)
                        one.zero_grad(set_to_none=True)
                        trim()
                    else:
                        w = int(m.split("-")[1])
                        rec["times_s"][m].append(clusters[w].run(time_task, family, s, timeout=1800)[0])
                rec["loadavg"].append(os.getloadavg()[0])
            rec["ratios"] = {m: [a / b for a, b in zip(rec["times_s"][m], rec["times_s"]["1p"])]
                             for m in methods[1:]}
            rec["elapsed_s"] = round(time.monotonic() - t_case, 1)
            del one
            trim()
            for c in clusters.values():
                c.run(release_task)
            data["cases"].append(rec)
            print(describe(rec), flush=True)
            write_json(path, data)
    finally:
        for c in clusters.values():
            c.close()
    data["loadavg"]["end"] = os.getloadavg()
    data["elapsed_s"] = round(time.monotonic() - t_start, 1)
    write_json(path, data)
    return data


def _med(xs):
    return statistics.median(xs)


def _kib(comm, kind, what="data_bytes") -> float:
    return max(c[kind][what] for c in comm) / 2**10


def _worst(rec, m) -> float:
    """The largest error against one process (fp32: SDPA, eager)."""
    return max(max(e["loss"], e["logits"], e["grads"]) for ref, e in rec["errors"][m].items()
               if ref != "fp64")


def fp64_table(data) -> str:
    """Errors against one process in float64 (``--fp64``): one process's own and CP's."""
    lines = ["| S | method | loss | logits | grads (worst parameter) |", "|---|---|---|---|---|"]
    for rec in data["cases"]:
        for m, errs in rec["errors"].items():
            e = errs.get("fp64")
            if e is not None:
                lines.append(f"| {rec['S']} | {m} | {e['loss']:.1e} | {e['logits']:.1e} | "
                             f"{e['grads']:.1e} ({e['worst_grad']}) |")
    return "\n".join(lines)


def _span(xs, unit="") -> str:
    return f"{_med(xs):.2f}{unit} ({min(xs):.2f}-{max(xs):.2f})" if xs else "-"


def describe(rec) -> str:
    parts = [f"S={rec['S']}: 1p {_span(rec['times_s']['1p'], ' s')}, "
             f"peak {rec['peak_bytes']['1p'] / 2**20:.0f} MiB"]
    for m, ratios in rec["ratios"].items():
        comm = rec["comm"][m]
        parts.append(f"{m}: time/1p {_span(ratios)}, "
                     f"peak/1p {max(rec['peak_bytes'][m]) / rec['peak_bytes']['1p']:.2f}, "
                     f"attention {_kib(comm, 'attention'):.0f} KiB, mixers {_kib(comm, 'mixers'):.0f} KiB "
                     f"(planned {rec['planned_mixer_bytes'][m] / 2**10:.0f}), error {_worst(rec, m):.1e}")
    return "; ".join(parts)


def table(data) -> str:
    """The markdown table of RESULTS.md."""
    lines = ["| S | W | time / 1p | peak per rank / 1p | attention: KiB received per rank (data calls) "
             "| mixers: KiB (data calls) | mixers planned KiB | agreement calls (attention + mixers) "
             "| max rel. error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rec in data["cases"]:
        if "ratios" not in rec:
            continue
        lines.append(f"| {rec['S']} | 1p | {_span(rec['times_s']['1p'], ' s')} "
                     f"| {rec['peak_bytes']['1p'] / 2**20:.0f} MiB "
                     f"| - | - | - | - | - |")
        for m, ratios in rec["ratios"].items():
            comm = rec["comm"][m]
            calls = {k: max(c[k]["data_calls"] for c in comm) for k in ("attention", "mixers")}
            meta = max(c["attention"]["meta_calls"] + c["mixers"]["meta_calls"] for c in comm)
            lines.append(
                f"| {rec['S']} | {m.split('-')[1]} | {_span(ratios)} "
                f"| {max(rec['peak_bytes'][m]) / rec['peak_bytes']['1p']:.2f} "
                f"| {_kib(comm, 'attention'):.0f} ({calls['attention']}) "
                f"| {_kib(comm, 'mixers'):.0f} ({calls['mixers']}) "
                f"| {rec['planned_mixer_bytes'][m] / 2**10:.0f} | {meta} | {_worst(rec, m):.1e} |")
    return "\n".join(lines)


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cases = [c for c in data["cases"] if "ratios" in c]
    fig, (ax_t, ax_m, ax_c) = plt.subplots(1, 3, figsize=(15, 4.5))
    methods = list(cases[0]["ratios"])
    labels = [f"S={c['S']}" for c in cases]
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(cases))]
        med = [_med(c["ratios"][m] or [0.0]) for c in cases]
        lo = [a - min(c["ratios"][m] or [a]) for a, c in zip(med, cases)]
        hi = [max(c["ratios"][m] or [a]) - a for a, c in zip(med, cases)]
        ax_t.bar(xs, med, width, yerr=[lo, hi], capsize=3, label=m)
        ax_m.bar(xs, [max(c["peak_bytes"][m]) / c["peak_bytes"]["1p"] for c in cases], width, label=m)
        att = [_kib(c["comm"][m], "attention") / 2**10 for c in cases]
        mix = [_kib(c["comm"][m], "mixers") / 2**10 for c in cases]
        ax_c.bar(xs, att, width, label=f"{m} attention", color=f"C{i}")
        ax_c.bar(xs, mix, width, bottom=att, label=f"{m} mixers", color=f"C{i}", hatch="//", alpha=0.6)
    for ax, title in ((ax_t, "step time / one process (median of paired rounds, range)"),
                      (ax_m, "peak tensor bytes per rank / one process"),
                      (ax_c, "MiB received per rank in one step (hatched: mixers)")):
        ax.set_xticks(range(len(cases)), labels)
        if ax is not ax_c:
            ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=7)
    fig.suptitle(f"{data['model']['class']} ({LAYERS} layers, hidden {HIDDEN}, fp32) under CP: "
                 f"zigzag, one thread per rank, CPU gloo (W=4 oversubscribes 2 cores)", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--family", choices=FAMILY_NAMES, default="qwen3_5")
    ap.add_argument("--quick", action="store_true", help="S 1024 and 4096, 1 round")
    ap.add_argument("--smoke", action="store_true", help="S=256, W 1 and 2, 1 round, to results/smoke/")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 8192])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=3, help="timed rounds (0: check and measure only)")
    ap.add_argument("--eager-max-s", type=int, default=4096,
                    help="also check against eager attention in one process up to this S")
    ap.add_argument("--fp64", action="store_true",
                    help="also compare one process's fp32 step and CP's with one process in float64")
    ap.add_argument("--no-stop", action="store_true",
                    help="with --rounds 0: record a failed check and go on (nothing is timed)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--replot", action="store_true", help="table and PNG from the JSON")
    args = ap.parse_args(argv)
    if args.no_stop and args.rounds != 0:
        ap.error("--no-stop times nothing: it needs --rounds 0")
    seqlens, worlds, rounds = args.seqlens, args.worlds, args.rounds
    if args.quick:
        seqlens, rounds = [1024, 4096], 1
    if args.smoke:
        seqlens, worlds, rounds = [256], [1, 2], 1
    out = args.out or (RESULTS / "smoke" if args.smoke else RESULTS)
    if args.replot:
        data = json.loads((out / f"hybrid_stack_{args.family}.json").read_text())
    else:
        data = run(args.family, seqlens, worlds, rounds, args.eager_max_s, out, args.fp64,
                   not args.no_stop)
    plot(data, out / f"hybrid_stack_{args.family}.png")
    print(table(data))
    if data.get("fp64"):
        print(fp64_table(data))
    if not args.replot:
        print(f"wrote {out / f'hybrid_stack_{args.family}.json'} in {data['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
