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
