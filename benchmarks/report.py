"""Write the measured tables of benchmarks/RESULTS.md from the benchmarks' JSON.

    python benchmarks/report.py        # after bench_attention.py and bench_scaling.py

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
