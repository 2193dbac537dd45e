"""Hybrid models' layers under context parallelism against one process: time, per-rank
peak memory and the bytes the mixers exchange.

Legend: B batch (1), S global seq, L local seq, W world size, H heads, dk/dv key/value
head dims, P head dim and N state size (Mamba2), G groups of B/C, k conv kernel.

Three blocks, each a residual layer with random weights on x [1, S, 256], fp32, one
forward and one backward (``torch.autograd.grad`` of the output against a fixed upstream
gradient, w.r.t. x and every weight):

* ``gdn``: Qwen3-Next's linear-attention layer: projections to q, k (Hk=2, dk=32), v
  (Hv=4, dv=32), z, b, a; a short causal convolution (k=4, SiLU) over q, k, v; beta =
  sigmoid(b), g = -exp(A_log) softplus(a + dt_bias); the gated delta rule with l2-normed q
  and k; gated RMSNorm (silu(z)); output projection.
* ``mamba2``: Mamba2's mixer: projections to z, x (H=8, P=32), B, C (G=1, N=32), dt; a
  short causal convolution (k=4, SiLU) over x, B, C; the SSD scan with D, dt_bias and
  softplus; gated RMSNorm; output projection.
* ``attn``: for reference, an attention layer (H=8, Hkv=2, D=32, causal, no RoPE):
  projections, attention, output projection.

Methods:

* ``1p``: one process, one thread, transformers' own functions on the whole sequence:
  ``torch_chunk_gated_delta_rule`` (Qwen3-Next, chunk 64), ``mamba2_chunk_scan``
  (Mamba2, chunk 64), the convolution as transformers' torch path computes it
  (``F.conv1d`` with k-1 padding, cut to S) and ``F.scaled_dot_product_attention``.
* ``cp-W`` (W = 1, 2, 4): ``ringattn.mixers.causal_conv1d``, ``gated_delta_rule`` (with
  ``kernel=`` transformers' ``torch_chunk_gated_delta_rule``, chunk 64), ``mamba2_ssd``
  (``kernel=`` ``mamba2_chunk_scan``, chunk 64) and ``ringattn.ring_attention`` on W gloo
  ranks (``common.Cluster``: one compute thread each), zigzag shards of the same global
  inputs and the same weights. W=1 is the same code on a one-rank group (the mechanism's
  cost without communication). On a 2-core machine W=4 runs four one-thread ranks on two
  cores: oversubscribed.

Before timing, each (block, S, W) is checked against ``1p`` on every rank: the output and
dx shards, and every weight's gradient summed over the ranks (the mixers give each rank
its share, as data parallelism expects), must agree within 1e-5 relative
(||x - ref|| / ||ref||), else the run stops. That call also warms up (plans, caches).

Per (block, S, W), on every rank, one more fwd+bwd runs inside two dispatch modes:
``common.TensorBytes`` (peak of live tensor bytes allocated during the call; inputs and
weights made before it are not counted) and ``Collectives`` below, which records every
c10d collective the call issues (what torch's dispatcher sees: nothing is wrapped or
patched): op, dtype and bytes. Received bytes per rank: an all-gather's output minus this
rank's own part; an all-to-all's receive buffer minus this rank's own split (gloo's
reduce-scatter in ``ringattn.comm`` is an all-to-all and a local sum); a recv's buffer.
Float collectives are the data (the mixers' state maps and convolution halos, their
reduce-scatters in the backward, attention's K/V); integer ones are the agreement (the
one metadata check every call makes on every rank). The data bytes are cross-checked
against the plan's shapes (``planned_data_bytes``: rows per rank x (map + state) or (k-1)
x channels, x (W - 1), forward and backward).

Time: paired rounds (as ``bench_paired.py``): each round times one fwd+bwd of every
method back to back (order rotated per round; a CP time is the slowest rank's, barrier
before, all-reduce MAX after) and gives its own ratio cp-W / 1p. The tables give the
median (range) of the rounds' ratios.

Then ``breakdown``: where the gated delta rule's CP time goes (one chunk's transition map
against transformers' kernel scanning the chunk; see its docstring).

    python benchmarks/bench_mixers.py --quick    # S 2048, 8192; 2 rounds: 7 min at load ~15
    python benchmarks/bench_mixers.py            # S 4096, 16384; 3 rounds: 10 min at load ~12
    python benchmarks/bench_mixers.py --smoke    # S 512, 1 round, to results/smoke/: 2 min
    python benchmarks/bench_mixers.py --breakdown-only   # the breakdown alone: 30 s
    python benchmarks/bench_mixers.py --replot   # redraw mixers.png from mixers.json

Writes ``<out>/mixers.json`` (every round, per-rank peaks and collectives, errors, machine,
load average), ``mixers.png`` and ``mixers_breakdown.json``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import tempfile
import time
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from common import RESULTS, Cluster, TensorBytes, machine_info, write_json

BLOCKS = ("gdn", "mamba2", "attn")
HIDDEN = 256
CONV_K = 4
CHUNK = 64
GDN = {"hk": 2, "hv": 4, "dk": 32, "dv": 32}
M2 = {"h": 8, "p": 32, "g": 1, "n": 32}
ATTN = {"h": 8, "hkv": 2, "d": 32}
TOL = 1e-5


# ---------------------------------------------------------------------------- the blocks


def make_weights(block: str, seed: int = 0) -> dict:
    """The block's weights, the same in every process for a seed."""
    g = torch.Generator().manual_seed(seed)

    def lin(i, o):
        return torch.randn(i, o, generator=g) / math.sqrt(i)

    if block == "gdn":
        hk, hv, dk, dv = GDN["hk"], GDN["hv"], GDN["dk"], GDN["dv"]
        conv_dim = 2 * hk * dk + hv * dv
        return {"w_qkv": lin(HIDDEN, conv_dim), "w_z": lin(HIDDEN, hv * dv),
                "w_ba": lin(HIDDEN, 2 * hv), "conv": torch.randn(conv_dim, CONV_K, generator=g) / 2,
                "a_log": torch.rand(hv, generator=g).log(), "dt_bias": torch.randn(hv, generator=g) / 4,
                "norm": 1 + torch.randn(dv, generator=g) / 10, "w_o": lin(hv * dv, HIDDEN)}
    if block == "mamba2":
        h, p, gg, n = M2["h"], M2["p"], M2["g"], M2["n"]
        inner = h * p
        conv_dim = inner + 2 * gg * n
        return {"w_in": lin(HIDDEN, inner + conv_dim + h), "conv": torch.randn(conv_dim, CONV_K, generator=g) / 2,
                "a_log": torch.rand(h, generator=g).mul(4).add(1).log(), "d": torch.ones(h),
                "dt_bias": torch.randn(h, generator=g) / 4 - 1,
                "norm": 1 + torch.randn(inner, generator=g) / 10, "w_out": lin(inner, HIDDEN)}
    if block == "attn":
        h, hkv, d = ATTN["h"], ATTN["hkv"], ATTN["d"]
        return {"w_qkv": lin(HIDDEN, (h + 2 * hkv) * d), "w_o": lin(h * d, HIDDEN)}
    raise ValueError(f"unknown block {block!r}; blocks: {list(BLOCKS)}")


def _rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _conv_1p(x, w):
    """transformers' torch path: nn.Conv1d(groups=channels, padding=k-1) cut to S, SiLU."""
    s = x.shape[1]
    y = F.conv1d(x.transpose(1, 2), w[:, None], padding=w.shape[1] - 1, groups=x.shape[2])
    return F.silu(y[..., :s]).transpose(1, 2)


def block_forward(block: str, x: torch.Tensor, w: dict, cp: dict | None) -> torch.Tensor:
    """The block on x [1, S or L, HIDDEN]; ``cp`` None: one process, transformers'
    functions; else the keywords (seqlen, group) of the ringattn calls on this rank."""
    import ringattn as ra
    from transformers.models.mamba2.modeling_mamba2 import mamba2_chunk_scan
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    b, n, _ = x.shape
    if block == "gdn":
        hk, hv, dk, dv = GDN["hk"], GDN["hv"], GDN["dk"], GDN["dv"]
        qkv = x @ w["w_qkv"]
        qkv = _conv_1p(qkv, w["conv"]) if cp is None else ra.mixers.causal_conv1d(
            qkv, w["conv"], activation="silu", **cp)
        q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], dim=-1)
        q, k, v = q.view(b, n, hk, dk), k.view(b, n, hk, dk), v.view(b, n, hv, dv)
        bb, a = (x @ w["w_ba"]).chunk(2, dim=-1)
        beta = bb.sigmoid()
        g = -w["a_log"].exp() * F.softplus(a + w["dt_bias"])
        kernel = partial(torch_chunk_gated_delta_rule, chunk_size=CHUNK)
        if cp is None:
            o = kernel(q, k, v, g, beta, use_qk_l2norm_in_kernel=True)[0]
        else:
            o = ra.mixers.gated_delta_rule(q, k, v, g, beta, use_qk_l2norm=True, kernel=kernel, **cp)
        z = (x @ w["w_z"]).view(b, n, hv, dv)
        o = _rms(o, w["norm"]) * F.silu(z)
        return x + o.reshape(b, n, hv * dv) @ w["w_o"]
    if block == "mamba2":
        h, p, gg, nn_ = M2["h"], M2["p"], M2["g"], M2["n"]
        inner = h * p
        z, xbc, dt = (x @ w["w_in"]).split([inner, inner + 2 * gg * nn_, h], dim=-1)
        xbc = _conv_1p(xbc, w["conv"]) if cp is None else ra.mixers.causal_conv1d(
            xbc, w["conv"], activation="silu", **cp)
        xs, bm, cm = xbc.split([inner, gg * nn_, gg * nn_], dim=-1)
        xs, bm, cm = xs.view(b, n, h, p), bm.view(b, n, gg, nn_), cm.view(b, n, gg, nn_)
        a = -w["a_log"].exp()
        ssd = {"D": w["d"], "dt_bias": w["dt_bias"], "dt_softplus": True}
        if cp is None:
            y = mamba2_chunk_scan(xs, dt, a, bm, cm, chunk_size=CHUNK, **ssd)
        else:
            y = ra.mixers.mamba2_ssd(xs, dt, a, bm, cm, kernel=partial(mamba2_chunk_scan, chunk_size=CHUNK),
                                     **ssd, **cp)
        y = _rms(y.reshape(b, n, inner) * F.silu(z), w["norm"])
        return x + y @ w["w_out"]
    h, hkv, d = ATTN["h"], ATTN["hkv"], ATTN["d"]
    q, k, v = (x @ w["w_qkv"]).split([h * d, hkv * d, hkv * d], dim=-1)
    q, k, v = q.view(b, n, h, d), k.view(b, n, hkv, d), v.view(b, n, hkv, d)
    if cp is None:
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                           is_causal=True, enable_gqa=True).transpose(1, 2)
    else:
        o = ra.ring_attention(q, k, v, causal=True, **cp)
    return x + o.reshape(b, n, h * d) @ w["w_o"]


def global_inputs(s: int, seed: int = 1):
    g = torch.Generator().manual_seed(seed + s)
    return torch.randn(1, s, HIDDEN, generator=g), torch.randn(1, s, HIDDEN, generator=g)


def make_step(block: str, s: int, cp: dict | None):
    """A closure running one fwd+bwd; returns (out, dx, weight grads)."""
    import ringattn as ra

    weights = {k: v.requires_grad_() for k, v in make_weights(block).items()}
    x, dout = global_inputs(s)
    if cp is not None:
        x, dout = (ra.shard(t, seqlen=s, group=cp["group"]).detach() for t in (x, dout))
    x.requires_grad_()
    leaves = [x, *weights.values()]

    def step():
        out = block_forward(block, x, weights, cp)
        grads = torch.autograd.grad(out, leaves, dout)
        return out.detach(), grads[0], dict(zip(weights, grads[1:]))

    return step


# ---------------------------------------------------------------------------- collectives


class Collectives(TorchDispatchMode):
    """Records every c10d op dispatched inside it: (op, dtype, received bytes)."""

    def __init__(self, world: int):
        super().__init__()
        self.world = world
        self.calls: list[tuple[str, str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = str(func.name())
        if name.startswith("c10d::"):
            ts = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            ts = [t for t in ts if t.dim() > 0 or t.is_floating_point()]
            data = [t for t in ts if t.numel() > 0]
            nbytes = lambda t: t.numel() * t.element_size()  # noqa: E731
            op = name.split("::")[1]
            if "allgather" in op and len(data) >= 2:  # (output, input)
                got = nbytes(data[0]) - nbytes(data[1])
            elif "alltoall" in op and data:  # (output, input, splits...)
                got = nbytes(data[0]) * (self.world - 1) // self.world
            elif op.startswith("recv") and data:
                got = nbytes(data[0])
            else:
                got = 0
            dtype = str(data[0].dtype).replace("torch.", "") if data else "-"
            self.calls.append((op, dtype, got))
        return func(*args, **kwargs)


def planned_data_bytes(block: str, s: int, world: int) -> int:
    """What the mixers' data all-gathers and reduce-scatters receive per rank, from the plan's
    shapes: rows x row bytes x (W - 1), forward and backward (the same table size)."""
    if world == 1 or block == "attn":
        return 0
    from ringattn.layouts import get_layout
    from ringattn.mixers._plan import make_plan

    rows = make_plan(get_layout("zigzag", None), world, 0, s, None).rows
    if block == "gdn":
        h, dk, dv = GDN["hv"], GDN["dk"], GDN["dv"]
        conv_ch = 2 * GDN["hk"] * dk + h * dv
        mix = h * dk * dk + h * dk * dv  # matrix map M and state C
    else:
        h, p, n = M2["h"], M2["p"], M2["n"]
        conv_ch = h * p + 2 * M2["g"] * n
        mix = h + h * p * n  # diagonal map [H, 1, 1] and state
    per_row = (CONV_K - 1) * conv_ch + mix
    return 2 * rows * per_row * 4 * (world - 1)


# ---------------------------------------------------------------------------- rank tasks

_CACHE: dict = {}


def _cp_step(block, s):
    import torch.distributed as dist

    key = (block, s)
    if key not in _CACHE:
        _CACHE.clear()
        _CACHE[key] = make_step(block, s, {"seqlen": s, "group": dist.group.WORLD})
    return _CACHE[key]


def check_task(block, s, ref_path):
    """Rank side: one fwd+bwd (warm-up) compared with the one-process reference."""
    import torch.distributed as dist

    import ringattn as ra

    out, dx, wg = _cp_step(block, s)()
    ref = torch.load(ref_path)
    errs = {"out": _rel(out, ra.shard(ref["out"], seqlen=s)),
            "dx": _rel(dx, ra.shard(ref["dx"], seqlen=s))}
    for name, gr in wg.items():
        total = gr.clone()
        dist.all_reduce(total)
        errs[f"d{name}"] = _rel(total, ref["grads"][name])
    return errs


def measure_task(block, s):
    """Rank side: peak tensor bytes and the collectives of one fwd+bwd."""
    import torch.distributed as dist

    step = _cp_step(block, s)
    with TensorBytes() as mem, Collectives(dist.get_world_size()) as comm:
        step()
    return {"peak_bytes": mem.peak, "calls": comm.calls}


def time_task(block, s):
    """Rank side: seconds of one fwd+bwd, the slowest rank's."""
    import torch.distributed as dist

    step = _cp_step(block, s)
    dist.barrier()
    t0 = time.perf_counter()
    step()
    t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return t.item()


def _rel(x, ref) -> float:
    return ((x.double() - ref.double()).norm() / ref.double().norm().clamp_min(1e-30)).item()


# ---------------------------------------------------------------------------- driver


def summarize_calls(calls) -> dict:
    data = [c for c in calls if c[1].startswith(("float", "bfloat"))]
    meta = [c for c in calls if c not in data]
    ops: dict[str, int] = {}
    for op, _, _ in data:
        ops[op] = ops.get(op, 0) + 1
    return {"data_calls": len(data), "data_bytes": sum(c[2] for c in data), "data_ops": ops,
            "meta_calls": len(meta), "meta_bytes": sum(c[2] for c in meta)}


def run(seqlens, worlds, rounds, out_dir: Path) -> dict:
    data = {"machine": machine_info(), "dtype": "fp32", "hidden": HIDDEN, "conv_k": CONV_K,
            "chunk": CHUNK, "gdn": GDN, "mamba2": M2, "attn": ATTN, "layout": "zigzag",
            "seqlens": seqlens, "worlds": worlds, "rounds": rounds, "cases": [],
            "loadavg": {"start": os.getloadavg()}}
    torch.set_num_threads(1)
    t_start = time.monotonic()
    clusters = {w: Cluster(w) for w in worlds}
    tmp = Path(tempfile.mkdtemp(prefix="bench-mixers-"))
    try:
        for s in seqlens:
            for block in BLOCKS:
                rec = {"block": block, "S": s, "errors": {}, "peak_bytes": {}, "comm": {},
                       "planned_data_bytes": {}, "times_s": {"1p": []}, "loadavg": []}
                one = make_step(block, s, None)
                out, dx, wg = one()  # warm-up, and the reference
                ref_path = tmp / "ref.pt"
                torch.save({"out": out, "dx": dx, "grads": wg}, ref_path)
                del out, dx, wg
                with TensorBytes() as mem:
                    one()
                rec["peak_bytes"]["1p"] = mem.peak
                for w in worlds:
                    c = clusters[w]
                    errs = c.run(check_task, block, s, str(ref_path))
                    worst = {k: max(e[k] for e in errs) for k in errs[0]}
                    rec["errors"][f"cp-{w}"] = worst
                    if max(worst.values()) > TOL:
                        write_json(out_dir / "mixers.json", data)
                        raise SystemExit(f"{block} S={s} W={w}: CP differs from one process: {worst}")
                    got = c.run(measure_task, block, s)
                    rec["peak_bytes"][f"cp-{w}"] = [g["peak_bytes"] for g in got]
                    rec["comm"][f"cp-{w}"] = [summarize_calls(g["calls"]) for g in got]
                    rec["planned_data_bytes"][f"cp-{w}"] = planned_data_bytes(block, s, w)
                    rec["times_s"][f"cp-{w}"] = []
                methods = ["1p", *(f"cp-{w}" for w in worlds)]
                for r in range(rounds):
                    order = methods[r % len(methods):] + methods[:r % len(methods)]
                    for m in order:
                        if m == "1p":
                            t0 = time.perf_counter()
                            one()
                            rec["times_s"]["1p"].append(time.perf_counter() - t0)
                        else:
                            w = int(m.split("-")[1])
                            rec["times_s"][m].append(clusters[w].run(time_task, block, s)[0])
                    rec["loadavg"].append(os.getloadavg()[0])
                rec["ratios"] = {m: [a / b for a, b in zip(rec["times_s"][m], rec["times_s"]["1p"])]
                                 for m in methods[1:]}
                data["cases"].append(rec)
                print(describe(rec), flush=True)
                write_json(out_dir / "mixers.json", data)
    finally:
        for c in clusters.values():
            c.close()
    data["loadavg"]["end"] = os.getloadavg()
    data["elapsed_s"] = round(time.monotonic() - t_start, 1)
    write_json(out_dir / "mixers.json", data)
    return data


def _med(xs):
    return statistics.median(xs)


def describe(rec) -> str:
    one = _med(rec["times_s"]["1p"])
    parts = [f"{rec['block']} S={rec['S']}: 1p {one:.2f} s, peak {rec['peak_bytes']['1p'] / 2**20:.0f} MiB"]
    for m, ratios in rec["ratios"].items():
        comm = rec["comm"][m]
        parts.append(f"{m}: time/1p {_med(ratios):.2f} ({min(ratios):.2f}-{max(ratios):.2f}), "
                     f"peak/1p {max(rec['peak_bytes'][m]) / rec['peak_bytes']['1p']:.2f}, "
                     f"data {max(c['data_bytes'] for c in comm) / 2**10:.0f} KiB in "
                     f"{max(c['data_calls'] for c in comm)} calls, "
                     f"agreement {max(c['meta_calls'] for c in comm)} calls")
    return "; ".join(parts)


def table(data) -> str:
    """The markdown table of RESULTS.md."""
    lines = ["| block | S | W | time / 1p | peak per rank / 1p | data received per rank (KiB, calls) "
             "| planned KiB | agreement calls | max rel. error |",
             "|---|---|---|---|---|---|---|---|---|"]
    for rec in data["cases"]:
        one = _med(rec["times_s"]["1p"])
        lines.append(f"| {rec['block']} | {rec['S']} | 1p | {one:.2f} s | "
                     f"{rec['peak_bytes']['1p'] / 2**20:.1f} MiB | - | - | - | - |")
        for m, ratios in rec["ratios"].items():
            comm = rec["comm"][m]
            kib = max(c["data_bytes"] for c in comm) / 2**10
            calls = max(c["data_calls"] for c in comm)
            lines.append(
                f"| {rec['block']} | {rec['S']} | {m.split('-')[1]} | {_med(ratios):.2f} "
                f"({min(ratios):.2f}-{max(ratios):.2f}) | "
                f"{max(rec['peak_bytes'][m]) / rec['peak_bytes']['1p']:.2f} | "
                f"{kib:.0f} ({calls}) | {rec['planned_data_bytes'][m] / 2**10:.0f} | "
                f"{max(c['meta_calls'] for c in comm)} | {max(rec['errors'][m].values()):.1e} |")
    return "\n".join(lines)


def plot(data: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_t, ax_m) = plt.subplots(1, 2, figsize=(12, 4.5))
    cases = data["cases"]
    labels = [f"{c['block']} S={c['S']}" for c in cases]
    methods = [m for m in cases[0]["ratios"]]
    width = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs = [j + (i - (len(methods) - 1) / 2) * width for j in range(len(cases))]
        ax_t.bar(xs, [_med(c["ratios"][m]) for c in cases], width, label=m)
        ax_m.bar(xs, [max(c["peak_bytes"][m]) / c["peak_bytes"]["1p"] for c in cases], width, label=m)
    for ax, title in ((ax_t, "fwd+bwd time / one process (median of paired rounds)"),
                      (ax_m, "peak tensor bytes per rank / one process")):
        ax.set_xticks(range(len(cases)), labels, rotation=30, ha="right", fontsize=8)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(title, fontsize=10)
        ax.legend(fontsize=8)
    fig.suptitle("Hybrid-model blocks under CP (zigzag, fp32, one thread per rank; "
                 "W=4 oversubscribes the 2 cores), CPU gloo", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def breakdown(seqlens, worlds, rounds, out_dir: Path) -> dict:
    """Where the gated delta rule's CP time and memory go, in this process (one thread): on
    a chunk of n = S / (2W) tokens (a zigzag chunk) of the ``gdn`` block's shapes, fwd+bwd
    of the chunk's transition map (``ringattn.mixers.families._gdn_transition``, which
    every rank but rank 0 computes for each of its two chunks) against transformers'
    chunked kernel scanning the same n tokens from an entering state, paired rounds; and
    each one's peak tensor bytes. Writes ``<out>/mixers_breakdown.json``."""
    from ringattn.mixers.families import _gdn_transition
    from transformers.models.qwen3_next.modeling_qwen3_next import torch_chunk_gated_delta_rule

    torch.set_num_threads(1)
    h, dk, dv = GDN["hv"], GDN["dk"], GDN["dv"]
    data = {"machine": machine_info(), "gdn": GDN, "chunk": CHUNK, "rounds": rounds, "cases": [],
            "loadavg": {"start": os.getloadavg()}}
    for s in seqlens:
        for w in worlds:
            if w == 1:
                continue
            n = s // (2 * w)
            g = torch.Generator().manual_seed(n)
            q, k = (F.normalize(torch.randn(1, n, h, dk, generator=g), dim=-1) for _ in range(2))
            v = torch.randn(1, n, h, dv, generator=g)
            gg = -torch.rand(1, n, h, generator=g) / 10
            beta = torch.rand(1, n, h, generator=g)
            state = torch.randn(1, h, dk, dv, generator=g)
            leaves = [t.requires_grad_() for t in (q, k, v, gg, beta, state)]

            def kernel_scan(piece, entering):  # the scan the gdn block's CP run uses
                return torch_chunk_gated_delta_rule(*piece, chunk_size=CHUNK,
                                                    initial_state=entering,
                                                    output_final_state=True)

            def transition():
                m = _gdn_transition(k, gg, beta, scan=kernel_scan)
                torch.autograd.grad(m, [k, gg, beta], torch.ones_like(m))

            def scan():
                o, fin = torch_chunk_gated_delta_rule(q, k, v, gg, beta, chunk_size=CHUNK,
                                                      initial_state=state, output_final_state=True)
                torch.autograd.grad((o, fin), leaves, (torch.ones_like(o), torch.ones_like(fin)))

            rec = {"S": s, "W": w, "n": n, "times_s": {"transition": [], "scan": []}, "peak_bytes": {}}
            for name, fn in (("transition", transition), ("scan", scan)):
                fn()  # warm-up
                with TensorBytes() as mem:
                    fn()
                rec["peak_bytes"][name] = mem.peak
            for r in range(rounds):
                for name, fn in ((("transition", transition), ("scan", scan)) if r % 2 == 0
                                 else (("scan", scan), ("transition", transition))):
                    t0 = time.perf_counter()
                    fn()
                    rec["times_s"][name].append(time.perf_counter() - t0)
            rec["ratios"] = [a / b for a, b in zip(rec["times_s"]["transition"], rec["times_s"]["scan"])]
            data["cases"].append(rec)
            print(f"S={s} W={w} chunk n={n}: transition fwd+bwd {_med(rec['times_s']['transition']):.3f} s, "
                  f"{rec['peak_bytes']['transition'] / 2**20:.0f} MiB; kernel scan "
                  f"{_med(rec['times_s']['scan']):.3f} s, {rec['peak_bytes']['scan'] / 2**20:.0f} MiB; "
                  f"transition / scan {_med(rec['ratios']):.1f} ({min(rec['ratios']):.1f}-"
                  f"{max(rec['ratios']):.1f})", flush=True)
    data["loadavg"]["end"] = os.getloadavg()
    write_json(out_dir / "mixers_breakdown.json", data)
    return data


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="S 2048 and 8192, 2 rounds")
    ap.add_argument("--smoke", action="store_true", help="S=512, 1 round, to results/smoke/")
    ap.add_argument("--seqlens", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--replot", action="store_true", help="redraw mixers.png from mixers.json")
    ap.add_argument("--breakdown-only", action="store_true",
                    help="only the gated delta rule's transition against its scan, per chunk")
    args = ap.parse_args(argv)
    seqlens, rounds = args.seqlens, args.rounds
    if args.quick:
        seqlens, rounds = [2048, 8192], 2
    if args.smoke:
        seqlens, rounds = [512], 1
    out = args.out or (RESULTS / "smoke" if args.smoke else RESULTS)
    if args.breakdown_only:
        breakdown(seqlens, [w for w in args.worlds if w > 1], max(rounds, 3), out)
        return
    if args.replot:
        data = json.loads((out / "mixers.json").read_text())
    else:
        data = run(seqlens, args.worlds, rounds, out)
    plot(data, out / "mixers.png")
    print(table(data))
    if not args.replot:
        breakdown(seqlens, [w for w in args.worlds if w > 1], max(rounds, 3), out)
    if not args.replot:
        print(f"wrote {out / 'mixers.json'} in {data['elapsed_s']:.0f} s")


if __name__ == "__main__":
    main()
