"""What SpecForge's Eagle3 teacher holds per rank under ringattn's CP: its two teacher
builds measured at Llama-3 vocabulary shapes (run with ``.venv-specforge``'s python).

Legend: L rows a rank holds (its layout rows and their halos), H hidden, V target
vocabulary, Vd draft vocabulary.

ringattn's SpecForge integration (``ringattn.integrations.specforge``) shards the offline
features, so each rank builds SpecForge's teacher from its own L rows, through SpecForge's
own code: the default (``_compute_target_p_padded`` on the target head's [1, L, V] output)
or ``training.compact_teacher: true`` (``compute_target_p_padded_from_hidden``: the [L, V]
logits streamed over vocabulary chunks). Both return two [1, L + ttt, Vd] float32 tensors
that live for the whole step (``target_p`` and ``target_p_on_draft``). Measured here: the
peak of live tensor bytes while the teacher is built (``common.TensorBytes``; the hidden
states, the head and the loss mask made before) and the bytes of what it returns, for V =
128256, Vd = 32000, H = 4096 (Llama-3.1-8B's), the head in bf16 as SpecForge's
``TargetHead`` loads it, ttt 7. Each TTT step also keeps its [1, L, Vd] draft logits for
the backward (not measured here: 4 x Vd bytes per row and step in float32).

    .venv-specforge/bin/python benchmarks/bench_specforge_teacher.py
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, TensorBytes, machine_info, write_json  # noqa: E402

V, VD, H, TTT = 128256, 32000, 4096, 7
ROWS = (256, 512, 1024)


def measure(rows: int, compact: bool) -> dict:
    from specforge.algorithms.eagle3.model import _compute_target_p_padded
    from specforge.core.compact_teacher import compute_target_p_padded_from_hidden

    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(1, rows, H, generator=g).to(torch.bfloat16)
    head = (torch.randn(V, H, generator=g) * 0.02).to(torch.bfloat16)
    t2d = torch.zeros(V, dtype=torch.bool)
    t2d[torch.randperm(V, generator=g)[:VD]] = True
    loss_mask = torch.ones(1, rows, 1)
    with torch.no_grad(), TensorBytes() as mode:
        if compact:
            out = compute_target_p_padded_from_hidden(hidden=hidden, lm_head_weight=head,
                                                      t2d=t2d, loss_mask=loss_mask,
                                                      length=TTT)
        else:
            target = torch.nn.functional.linear(hidden, head)  # TargetHead's fc
            out = _compute_target_p_padded(target=target, t2d=t2d, loss_mask=loss_mask,
                                           length=TTT)
            del target
        kept = sum(t.numel() * t.element_size() for t in out if isinstance(t, torch.Tensor))
    return {"rows": rows, "teacher": "compact" if compact else "logits",
            "peak_mib": mode.peak / 2**20, "kept_mib": kept / 2**20}


def main() -> None:
    data = {"machine": machine_info(), "V": V, "Vd": VD, "H": H, "ttt": TTT,
            "head_dtype": "bfloat16", "runs": []}
    for rows in ROWS:
        for compact in (False, True):
            data["runs"].append(measure(rows, compact))
            print(data["runs"][-1], flush=True)
    for r in data["runs"]:
        r["peak_kib_per_row"] = r["peak_mib"] * 1024 / r["rows"]
        r["kept_kib_per_row"] = r["kept_mib"] * 1024 / r["rows"]
    write_json(RESULTS / "specforge_teacher.json", data)
    print("| rows per rank | teacher | peak MiB while built | kept for the step MiB |")
    print("|---|---|---:|---:|")
    for r in data["runs"]:
        print(f"| {r['rows']} | {r['teacher']} | {r['peak_mib']:.0f} | {r['kept_mib']:.0f} |")
    print(json.dumps({r["teacher"]: round(r["peak_kib_per_row"], 1) for r in data["runs"]
                      if r["rows"] == ROWS[-1]}))


if __name__ == "__main__":
    main()
