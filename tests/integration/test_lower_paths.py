"""Adversarial cases for the integration's lower public paths: ``ra.shard_batch`` then
``model(**local)`` with nothing else (the README's lower path), ``prepare_batch`` on a model
that is not set up for ring attention, and batches that the family survey does not draw
(padding in the middle of a row, left padding with the batch's own position ids, right
padding). Each case ends, on EVERY rank, either exact against the same model in one
process (gathered logits, summed loss and gradients within test_families.TOL) or refused
with the named error; never a wrong answer, a NaN gradient or an AttributeError.

All cases of one world size run in one cluster call (one fresh group per case), each
through test_families' own runner, so the outcome classes and tolerances are the survey's.

Legend: B batch (2), S global seq (37), W world size.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from families import build
from test_families import (EXACT, GROUP_TIMEOUT_S, LAYOUT, REFUSED, SEQLEN, TOL, _failure,
                           _one_path, _reference)
from test_transformers import _batch

pytest.importorskip("transformers")


def _lower_batch(kind: str) -> dict:
    """A [B, S] batch of ``kind``: "plain", "left" (row 1 left-padded by 7 with id 0),
    "left+positions" (the same with the position ids OPT counts, given by the batch),
    "middle" (row 1 has 5 padding tokens, id 0, at 10..14: their queries see real keys
    before them, real queries after them must not see them), "right" (row 1's last 6)."""
    if kind in ("plain", "right"):
        return _batch({"plain": "plain", "right": "right-padding"}[kind], SEQLEN)
    batch = _batch("left-padding", SEQLEN)
    if kind == "left+positions":
        keep = batch["attention_mask"]
        batch["position_ids"] = (keep.cumsum(1) * keep - 1).clamp(min=0)
    elif kind == "middle":
        ids = batch["input_ids"].clone()
        ids[1, :7] = ids[0, :7]  # row 1 is real from its start again
        keep = torch.ones_like(ids)
        keep[1, 10:15] = 0
        ids = ids.masked_fill(keep == 0, 0)
        labels = ids.masked_fill(keep == 0, -100)
        labels[1, 15] = -100  # predicted by a padding token: no target (see shard_batch)
        batch = dict(input_ids=ids, labels=labels, attention_mask=keep)
    return batch


def _eager_through_prepare_batch(name: str, batch: dict, group) -> tuple[str, str]:
    """prepare_batch on a model built with transformers' eager attention."""
    from ringattn.integrations import transformers as ra_hf

    try:
        ra_hf.prepare_batch(build(name, "eager"), batch, group=group, layout=LAYOUT)
    except Exception as exc:
        return _failure(exc)
    return "not refused", "prepare_batch accepted an eager model"


# (family, batch kind, path, W, outcome, a fragment of the refusal's message)
CASES = [
    # OPT counts positions from the padding mask: shard_batch alone cannot know them
    ("opt", "left", "shard", 2, REFUSED, "counts its position ids from the attention mask"),
    ("opt", "left", "shard", 3, REFUSED, "counts its position ids from the attention mask"),
    ("opt", "middle", "shard", 2, REFUSED, "counts its position ids from the attention mask"),
    ("opt", "middle", "prepare", 3, EXACT, None),
    ("opt", "left+positions", "shard", 3, EXACT, None),  # the batch's own positions
    ("opt", "right", "shard", 2, EXACT, None),  # slots = counted positions on real tokens
    # models that use the mask object, or compute attention themselves: check_model's words
    ("doge", "plain", "shard", 2, REFUSED, "computes a dense attention mask of its own"),
    ("mpt", "left", "shard", 3, REFUSED, "computes attention itself"),
    ("bloom", "plain", "shard", 2, REFUSED, "computes attention itself"),
    ("xglm", "left", "shard", 3, REFUSED, "computes attention itself"),
    # padding id 0 has a zero embedding: dead rows must not turn gradients into NaN
    ("gemma3n", "left", "shard", 3, EXACT, None),
    ("gemma3n", "middle", "shard", 2, EXACT, None),
    ("gemma3n", "left+positions", "prepare", 2, EXACT, None),
    ("llama", "middle", "shard", 3, EXACT, None),
    ("gpt2", "middle", "shard", 2, EXACT, None),
    # a model not built for ring attention: refused by prepare_batch, not run shard-local
    ("llama", "plain", "eager-prepare", 2, REFUSED, "not ring attention"),
    ("opt", "left", "eager-prepare", 3, REFUSED, "not ring attention"),
]
WORLDS = sorted({c[3] for c in CASES})


def run_cases(cases) -> list[tuple[str, object]]:
    """Rank function: (outcome, detail) of every case, each on a fresh group."""
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    results = []
    for name, kind, path, _, _, _ in cases:
        batch = _lower_batch(kind)
        group = dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
        if path == "eager-prepare":
            results.append(_eager_through_prepare_batch(name, batch, group))
        else:
            ref_model, ref = _reference(name, batch)
            nonfinite = sum(int((~torch.isfinite(p.grad)).sum()) for p in ref_model.parameters()
                            if p.grad is not None)
            assert nonfinite == 0, f"{name}, {kind}: one process has non-finite gradients"
            results.append(_one_path(name, batch, group, path, ref_model, ref))
        if results[-1][0] != "hang":
            dist.destroy_process_group(group)
    return results


@pytest.fixture(scope="module")
def outcomes(clusters):
    """``outcomes(W)``: every rank's results of the cases of world size W (run once)."""
    done: dict = {}

    def get(world: int) -> list[list]:
        if world not in done:
            done[world] = clusters(world).run(run_cases, [c for c in CASES if c[3] == world],
                                              timeout=240)
        return done[world]

    return get


@pytest.mark.timeout(300)
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c[:4])))
def test_lower_path_is_exact_or_refused_by_name(outcomes, worst_errors, case):
    name, kind, path, world, want, fragment = case
    index = [c for c in CASES if c[3] == world].index(case)
    for rank, results in enumerate(outcomes(world)):
        outcome, detail = results[index]
        assert outcome == want, f"{case}, rank {rank}: {outcome} (expected {want}): {detail}"
        if want == REFUSED:
            assert fragment in detail, f"{case}, rank {rank}: {detail}"
            assert "AttributeError" not in detail, f"{case}, rank {rank}: {detail}"
        else:
            for t in ("logits", "loss", "grads"):
                key = ("HF lower paths", t)
                worst_errors[key] = (max(worst_errors.get(key, (0.0, TOL))[0], detail[t]), TOL)
