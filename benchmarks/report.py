"""Write the measured tables of benchmarks/RESULTS.md from the benchmarks' JSON.

    python benchmarks/report.py        # after the bench_*.py scripts

Everything between the two GENERATED markers in RESULTS.md is replaced; the text around
them (what the numbers mean) is kept as written.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
BEGIN, END = "<!-- GENERATED: benchmarks/report.py -->", "<!-- END GENERATED -->"


def _fmt_s(x):
    return "-" if x is None else f"{x:.3g}"


def _machine(m: dict) -> str:
    return (f"{m['date']}, {m['cpu']} ({m['nproc']} cores, {m.get('mem_total_gib', '?')} GiB), "
            f"torch {m['torch']}, Python {m['python']}, ringattn {m['ringattn']} "
            f"(git {m['git']}); command: `{m['command']}`")


def attention_tables(data: dict) -> list[str]:
    out = [f"Measured {_machine(data['machine'])}.", ""]
    out += ["### Targets (ratios measured in this run)", "", "| target | measured |", "|---|---|"]
    for name, value in data.get("targets", {}).items():
        out.append(f"| {name} | {'not measured' if value is None else f'{value:.3f}'} |")
    out.append("")
    # time: one table per (S, mask, dtype, Hkv); rows = methods, columns = W
    groups: dict = {}
    for r in data["time"]:
        groups.setdefault((r["S"], r["causal"], r["dtype"], r["Hkv"]), []).append(r)
    out += ["### fwd+bwd seconds: median (min..max) of the timed iterations, max over ranks", ""]
    for (s, causal, dt, hkv), rows in sorted(groups.items(), key=lambda kv: (kv[0][0], not kv[0][1], kv[0][2], -kv[0][3])):
        ws = sorted({r["W"] for r in rows if r["W"] is not None})
        out += [f"**S={s}, {'causal' if causal else 'full'}, {dt}, H=8, Hkv={hkv}, D=64**", "",
                "| method | " + " | ".join(f"W={w}" for w in ws) + " |",
                "|---|" + "---|" * len(ws)]
        methods = sorted({r["method"] for r in rows if r["W"] is not None})
        for m in methods:
            cells = []
            for w in ws:
                hit = [r for r in rows if r["method"] == m and r["W"] == w]
                cells.append("-" if not hit else
                             f"{hit[0]['median_s']:.3g} ({hit[0]['min_s']:.3g}..{hit[0]['max_s']:.3g})")
            out.append(f"| {m} | " + " | ".join(cells) + " |")
        for r in sorted((r for r in rows if r["W"] is None), key=lambda r: r["threads"]):
            out.append(f"| SDPA, 1 process, {r['threads']} thread(s) | "
                       + " | ".join(f"{r['median_s']:.3g} ({r['min_s']:.3g}..{r['max_s']:.3g})" for _ in ws) + " |")
        out.append("")
    if data.get("memory"):
        out += ["### Per-rank peak memory of one fwd+bwd (causal fp32, H=Hkv=8, D=64), max over ranks", "",
                "tensor = peak live tensor bytes (inputs q, k, v, dout included); RSS = VmHWM over "
                "the RSS before the call (inputs excluded).", "",
                "| method | S | W | tensor MiB | RSS MiB |", "|---|---|---|---|---|"]
        for r in sorted(data["memory"], key=lambda r: (r["method"], r["S"], r["W"] or 0)):
            out.append(f"| {r['method']} | {r['S']} | {r['W'] or '1 process'} | "
                       f"{r['max_tensor_peak_bytes'] / 2**20:.1f} | {r['max_rss_delta'] / 2**20:.1f} |")
        out.append("")
    if data.get("check"):
        worst = max(c["max_err"] for c in data["check"])
        out += [f"PyTorch's ring and ringattn were cross-checked before timing: worst max abs "
                f"difference of out/dq/dk/dv {worst:.1e} over {len(data['check'])} configurations.", ""]
    return out


def scaling_tables(data: dict) -> list[str]:
    out = [f"Measured {_machine(data['machine'])}.", "",
           f"Cap: {data['cap_bytes'] / 2**20:g} MiB of live tensor bytes per process; causal fp32, "
           f"B=1, H=Hkv={data['H']}, D={data['D']}.", "",
           "| method | ranks | longest S within the cap | first S over the cap | us/token at longest S |",
           "|---|---|---|---|---|"]
    for name, rec in data["results"].items():
        last = rec["points"][-1] if rec["points"] else None
        fail = rec["failed_at"]["S"] if rec["failed_at"] else "-"
        out.append(f"| {name} | {rec['W']} ({rec['threads']} thread(s) each) | {rec['max_s']} | {fail} | "
                   f"{_fmt_s(last['s_per_token'] * 1e6) if last else '-'} |")
    out.append("")
    return out


def paired_tables(data: dict) -> list[str]:
    import statistics

    out = [f"Measured {_machine(data['machine'])}.", "",
           f"S={data['S']}, W={data['W']}, {data['dtype']}, B=1, H={data['H']}, D={data['D']}; "
           f"{data['rounds']} rounds after one warm-up round, each round one fwd+bwd of every "
           "method back to back.", "",
           "| mask | Hkv | ratio | median | range over rounds |", "|---|---|---|---|---|"]
    for rec in data["cases"]:
        for name, xs in rec["ratios"].items():
            out.append(f"| {'causal' if rec['causal'] else 'full'} | {rec['Hkv']} | {name} | "
                       f"{statistics.median(xs):.3f} | {min(xs):.3f}..{max(xs):.3f} |")
    out.append("")
    return out


def masks_tables(data: dict) -> list[str]:
    import statistics

    bal = data["balance"]
    ss, ws = bal["S"], bal["W"]
    layouts = ("contiguous", "striped", "zigzag", "doc-zigzag")
    worst = {(r["layout"], r["S"], r["W"]): r for r in bal["worst"]}
    cols = [(s, w) for s in ss for w in ws]
    head = "| layout | " + " | ".join(f"S={s} W={w}" for s, w in cols) + " |"
    rule = "|---|" + "---|" * len(cols)
    out = [f"Measured {_machine(data['machine'])}.", "",
           f"Packs: document lengths log-normal (median {bal['median']:g} tokens, sigma "
           f"{bal['sigma']:g}), clipped to [1, S], drawn until S; {len(bal['seeds'])} packs "
           "(seeds) per S. Work of a rank = visible (query, key) pairs of its queries under "
           "the document & causal mask. `zigzag` is the sequence-level `Zigzag()`, "
           "`doc-zigzag` the per-document `DocumentZigzag`.", "",
           "### Busiest rank's work / mean: worst over the packs (median)", "", head, rule]
    for lay in layouts:
        out.append(f"| {lay} | " + " | ".join(
            f"{worst[lay, s, w]['worst_max_over_mean']:.3f} ({worst[lay, s, w]['median_max_over_mean']:.3f})"
            for s, w in cols) + " |")
    out += ["", "### Least busy rank's work / mean: worst over the packs", "", head, rule]
    for lay in layouts:
        out.append(f"| {lay} | " + " | ".join(
            f"{worst[lay, s, w]['worst_min_over_mean']:.3f}" for s, w in cols) + " |")
    out += ["", f"doc-zigzag: every rank within {data['balance_tol']:.0%} of the mean in every "
            f"pack: {'yes' if bal['doc_zigzag_within_tol'] else 'NO'} (largest deviation "
            f"{bal['doc_zigzag_worst_dev']:.2%}); real tokens per rank, max - min: "
            f"{max(worst['doc-zigzag', s, w]['worst_token_spread'] for s, w in cols)} at most.", ""]
    tiles = bal.get("tile_balance") or []
    if tiles:
        tws = sorted({r["W"] for r in tiles})
        out += [f"### What the CPU kernels compute (pack {tiles[0]['seed']}, S={tiles[0]['S']}, "
                "tiles of up to 256x128 cut at segment boundaries)", "",
                "(query, key) pairs the busiest rank's kernel calls compute / mean visible pairs "
                "per rank; in parentheses the same for the mean rank, then the busiest rank's "
                "kernel calls per forward. A PARTIAL tile is computed whole, with a mask.", "",
                "| layout | " + " | ".join(f"W={w}" for w in tws) + " |", "|---|" + "---|" * len(tws)]
        for lay in layouts:
            cells = []
            for w in tws:
                r = next((x for x in tiles if (x["layout"], x["W"]) == (lay, w)), None)
                cells.append("-" if r is None else
                             f"{r['max_computed_over_mean_visible']:.2f} "
                             f"({r['mean_computed_over_mean_visible']:.2f}; {r['max_calls']} calls)")
            out.append(f"| {lay} | " + " | ".join(cells) + " |")
        out.append("")
    for rec in data.get("time", []):
        if "ratios" not in rec:
            continue
        n_rounds = len(next(iter(rec["times_s"].values())))
        out += [f"### Masked batch: S={rec['S']}, H={rec['H']}, Hkv={rec['Hkv']}, D={rec['D']}, "
                f"fp32, W={rec['W']}", "",
                f"{len(rec['doc_lengths'])} documents of lengths {rec['doc_lengths']}; dense-mask "
                f"SDPA backend: {rec['sdpa_backend']}; {n_rounds} paired rounds. Ratios: median "
                "(range) over rounds of the row's time / the column's.", "",
                "| method | seconds: median (min..max) | / sdpa-dense-2t | / sdpa-dense-1t | / sdpa-per-doc-2t |",
                "|---|---|---|---|---|"]
        for m, xs in rec["times_s"].items():
            cells = []
            for base in ("sdpa-dense-2t", "sdpa-dense-1t", "sdpa-per-doc-2t"):
                r = rec["ratios"].get(f"{m} / {base}")
                cells.append("-" if r is None else
                             f"{statistics.median(r):.3f} ({min(r):.3f}..{max(r):.3f})")
            out.append(f"| {m} | {statistics.median(xs):.3g} ({min(xs):.3g}..{max(xs):.3g}) | "
                       + " | ".join(cells) + " |")
        checks = ", ".join(f"{m} {max(e['rel_norm'] for e in c.values()):.1e}"
                           for m, c in rec["check"].items())
        out += ["", f"Cross-check against the dense-mask SDPA (worst of out, dq, dk, dv of "
                f"||x - ref|| / ||ref||, tolerance {data['check_tol']:g}): {checks}.", ""]
        out += ["| method | rank | FULL / PARTIAL kernel calls (fwd) | calls per ring step | "
                "visible pairs (M) | computed pairs (M) | of which in PARTIAL tiles (M) |",
                "|---|---|---|---|---|---|---|"]
        for m, per_rank in rec["plans"].items():
            for p in per_rank:
                out.append(f"| {m} | {p['rank']} | {p['full_blocks']} / {p['partial_blocks']} | "
                           f"{p['blocks_per_step']} | {p['visible_pairs'] / 1e6:.2f} | "
                           f"{p['computed_pairs'] / 1e6:.2f} | "
                           f"{p['computed_pairs_in_partial_blocks'] / 1e6:.2f} |")
        out.append("")
        if rec.get("profile"):
            out += ["Where each rank's time goes (block-kernel stopwatch, mean of "
                    f"{data.get('profile_calls', 3)} fwd+bwd after the rounds): kernel seconds and "
                    "ns per (query, key) pair and head, fwd+bwd, for FULL blocks and masked PARTIAL tiles.", "",
                    "| method | rank | wall s | kernels s | FULL s (ns/pair) | masked s (ns/pair) |",
                    "|---|---|---|---|---|---|"]
            for m, per_rank in rec["profile"].items():
                for p in per_rank:
                    cells = []
                    for kind in ("full", "masked"):
                        sec = p["kernel_s"][f"fwd_{kind}"] + p["kernel_s"][f"bwd_{kind}"]
                        pairs = p["kernel_pairs"][f"fwd_{kind}"]  # bwd computes the same blocks
                        per = f"{sec / pairs * 1e9 / rec['H']:.2f}" if pairs else "-"
                        cells.append(f"{sec:.3f} ({per})")
                    out.append(f"| {m} | {p['rank']} | {p['wall_s']:.3f} | {p['kernel_total_s']:.3f} | "
                               + " | ".join(cells) + " |")
            out.append("")
    return out


def eagle3_tables(data: dict) -> list[str]:
    import statistics

    m = data["model"]
    out = [f"Measured {_machine(data['machine'])}. Device: CPU, {data['machine']['nproc']} "
           "cores, gloo (every cp rank a local process).", "",
           f"Model: target {m['target_layers']}-layer Llama (hidden {m['hidden']}, H={m['heads']}, "
           f"Hkv={m['kv_heads']}, intermediate {m['intermediate']}, vocab {m['vocab']}), draft "
           f"vocab {m['draft_vocab']}, {m['ttt_steps']} TTT steps; fp32, B={m['batch']}, pad "
           f"{data['pad']}, layout {m['layout']}. A step = target forward under CP + "
           "eagle3_step forward + backward + gradient all-reduce + AdamW; each measurement in "
           f"fresh processes after one warm-up step at S={data['warmup_S']}.", "",
           f"### One training step at S={data['S']}: per-rank memory (max over ranks) and tokens/s",
           "",
           "Memory runs: MALLOC_MMAP_THRESHOLD_ set, 1 thread per rank; RSS before = right before "
           "the step (torch, transformers, models, AdamW state); peak = ru_maxrss after it; step "
           "= peak - RSS before. Timing runs: default malloc, cores // W threads per rank, median "
           f"of {data['timed_steps']} steps after the measured one (slowest rank); every cp size "
           "shares the same cores, so the ratio to cp=1 is CP's overhead, not a speedup.", "",
           "| cp size | RSS before MiB | peak RSS MiB | step memory MiB | step memory / cp=1 | "
           "peak RSS, default malloc MiB | threads per rank | step s | tokens/s | tokens/s / cp=1 |",
           "|---|---|---|---|---|---|---|---|---|---|"]
    step1 = data["fixed"][0]["memory"]["step_mib"]
    for rec in data["fixed"]:
        mem, sp = rec["memory"], rec["speed"]
        out.append(f"| {rec['W']} | {mem['rss_before_mib']:.0f} | {mem['peak_mib']:.0f} | "
                   f"{mem['step_mib']:.0f} | {mem['step_mib'] / step1:.3f} | {sp['peak_mib']:.0f} | "
                   f"{sp['threads']} | {sp['step_s']:.2f} | {sp['tokens_per_s']:.0f} | "
                   f"{sp['tokens_per_s_over_w1']:.2f} |")
    runs = [rec["memory"] for rec in data["fixed"]]
    runs += [p for rec in data["search"] for p in rec["probes"][1:]]
    below = all(r["hwm_before_mib"] < r["peak_mib"] for run in runs for r in run["ranks"])
    out += ["", f"The RSS high water before the measured step (imports, warm-up) was below the "
            f"step's peak on every rank of every memory run: {'yes' if below else 'NO'}.", ""]
    if data["search"]:
        out += [f"### Longest S that trains one step within a step-memory cap of "
                f"{data['cap_mib']:g} MiB per process", "",
                f"Cap on {data['cap']}; the search stops when the longest S that fits and the "
                f"shortest that does not are within {data['tol']:.0%}. Probes: S (step MiB), "
                "in the order run, the first being the fixed-S run.", "",
                "| cp size | longest S within the cap | shortest S over it | probes |",
                "|---|---|---|---|"]
        for rec in data["search"]:
            probes = ", ".join(f"{p['S']} ({p['step_mib']:.0f})" for p in rec["probes"])
            out.append(f"| {rec['W']} | {rec['max_s']} | {rec['first_over']} | {probes} |")
        out.append("")
    t = data.get("ttt")
    if t:
        out += [f"### Step-0 keys: the ring at every TTT step or one all-gather per batch "
                f"(W={t['W']}, S={t['S']}, H={t['H']}, Hkv={t['Hkv']}, D={t['D']}, "
                f"T={t['T']}, fp32, {t['threads']} thread per rank)", "",
                "Seconds of forward+backward summed over the TTT steps j = 0..T-1 (slowest "
                f"rank), {t['rounds']} rounds after a warm-up round, the variants' order "
                "rotating; ratios within each round. `ring`: ttt_attention (step-0 keys on the "
                "ring at every j). `gather`: one all-gather of K0/V0, SDPA (flash) with an "
                "explicit causal + diagonal boolean mask over [K0 of all S; the j cached key "
                "sets], one reduce-scatter of the gathered keys' gradients. "
                "`gather-step0-only`: the same without the cached key sets (it leaves out the "
                "diagonal, so it does less than a TTT step needs). SDPA with a mask computes "
                "every (query, key) pair of its columns, masked or not, while the causal ring "
                "skips the blocks above the diagonal: the times compare kernels as much as "
                "communication.", "",
                "| variant | seconds: median (min..max) | / ring: median (range) |",
                "|---|---|---|"]
        for name, xs in t["times_s"].items():
            r = t["ratios"].get(f"{name} / ring")
            cell = "1" if r is None else f"{statistics.median(r):.3f} ({min(r):.3f}..{max(r):.3f})"
            out.append(f"| {name} | {statistics.median(xs):.3g} ({min(xs):.3g}..{max(xs):.3g}) | "
                       f"{cell} |")
        out += ["", f"Held per rank for the step-0 keys: gather {t['gathered_kv_bytes'] / 2**20:.2f} "
                f"MiB (2 * S * Hkv * D * 4 bytes, K0 and V0 of the whole sequence, and as much "
                f"again for their gradients in the backward), ring {t['ring_kv_bytes'] / 2**20:.2f} "
                "MiB (the local block and the one in flight: 2 / W of gather's, equal at W=2, "
                "and independent of W for a fixed S / W). The explicit mask of the `gather` "
                f"variant reaches {t['mask_bytes_last_step'] / 2**20:.1f} MiB at the last step "
                "(a cost of this benchmark, not of the design).", ""]
    return out


def main() -> None:
    results = HERE / "results"
    lines = [BEGIN, "", "## Attention: speed and memory (`bench_attention.py --quick`)", ""]
    lines += attention_tables(json.loads((results / "attention.json").read_text()))
    lines += ["![time](results/attention_time.png)", "", "![memory](results/memory.png)", ""]
    paired = results / "paired.json"
    if paired.exists():
        lines += ["## Time targets in paired rounds (`bench_paired.py`)", ""]
        lines += paired_tables(json.loads(paired.read_text()))
    scaling = results / "scaling.json"
    if scaling.exists():
        lines += ["## Longest sequence under a memory cap (`bench_scaling.py`)", ""]
        lines += scaling_tables(json.loads(scaling.read_text()))
        lines += ["![scaling](results/scaling.png)", ""]
    masks = results / "masks.json"
    if masks.exists():
        lines += ["## Packed documents: balance and masked-batch speed (`bench_masks.py`)", ""]
        lines += masks_tables(json.loads(masks.read_text()))
        lines += ["![balance](results/masks_balance.png)", "", "![masked time](results/masks_time.png)", ""]
    eagle3 = results / "eagle3.json"
    if eagle3.exists():
        lines += ["## Eagle3 draft training under CP (`bench_eagle3.py`)", ""]
        lines += eagle3_tables(json.loads(eagle3.read_text()))
        lines += ["![eagle3](results/eagle3.png)", ""]
    lines.append(END)
    path = HERE / "RESULTS.md"
    text = path.read_text() if path.exists() else f"# Benchmark results\n\n{BEGIN}\n{END}\n"
    if BEGIN not in text or END not in text:
        sys.exit(f"{path} lacks the markers {BEGIN} ... {END}")
    head, rest = text.split(BEGIN, 1)
    tail = rest.split(END, 1)[1]
    path.write_text(head + "\n".join(lines) + tail)
    print(f"wrote the generated part of {path}")


if __name__ == "__main__":
    main()
