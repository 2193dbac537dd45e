"""``RingSFTTrainer`` with a MoE router auxiliary loss: TRL's ``SFTTrainer`` turns it on for
MoE models (``aux_loss_enabled``: ``output_router_logits`` with the config's
``router_aux_loss_coef``, here 0.1) and adds ``coef * aux_loss`` (over the accumulation
steps) to the loss. Under CP the model converted by ``ra_hf.convert`` computes that loss
over every rank's tokens; the trainer then logs what TRL's trainer logs in one process
(loss, grad_norm, aux_loss, entropy, mean_token_accuracy, num_tokens; the eval metrics) and
steps with the same gradients (every parameter, every optimizer step), on every rank, W = 2.

Cases (three steps each, plain SGD, no clipping): ``qwen3_moe_padded`` (Qwen3-MoE, text rows
of different lengths padded, gradient accumulation 2, then ``evaluate``) and
``mixtral_packed`` (Mixtral, prompt/completion pairs, completion-only loss, ``packing=True``:
padding-free rows, position ids restarting per document). Refused on every rank before
training, with a message saying to convert the model first: the same MoE model unconverted.

This file is also the script the runs start (``python test_sft_router.py --ref --out D``;
``torchrun --nproc-per-node 2 test_sft_router.py --out D``).
"""

import argparse
import json
import os
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path[:0] = [str(HERE), str(HERE.parent)]  # launches, trl_run; tests/ (families)

TOL = 1e-5
WORLD = 2
TIMEOUT = 400
CASES = ("qwen3_moe_padded", "mixtral_packed")


def _moe(family: str, ring: bool, convert: bool = True):
    """Tests/families.py's tiny MoE (router aux loss coefficient 0.1), eager for one process
    or ring attention (converted unless told otherwise)."""
    from families import build

    model = build(family, "ringattn" if ring else "eager")
    if ring and convert:
        from ringattn.integrations import transformers as ra_hf

        model = ra_hf.convert(model)
    return model


def _sft(ref: bool, out: Path, case: str):
    from trl import SFTConfig, SFTTrainer
    from trl_run import Grads, common, prompt_completion, text, tokenizer

    from ringattn.integrations.trl import RingSFTTrainer

    if case == "qwen3_moe_padded":
        family, train, evald = "qwen3_moe", text(12, 3), text(5, 4)
        over = dict(per_device_train_batch_size=3, gradient_accumulation_steps=2)
    else:
        family, train, evald = "mixtral", prompt_completion(12, 1), None
        over = dict(packing=True, max_length=23)
    args = SFTConfig(**common(out / case, **over))
    grads = Grads()
    kw = dict(model=_moe(family, ring=not ref), args=args, train_dataset=train,
              eval_dataset=evald, processing_class=tokenizer(), callbacks=[grads.callback])
    trainer = SFTTrainer(**kw) if ref else RingSFTTrainer(**kw, layout="zigzag")
    assert trainer.aux_loss_enabled
    trainer.train()
    if evald is not None:
        trainer.evaluate()
    return trainer, grads


def _refusals(out: Path) -> dict:
    from launches import error_text
    from trl import SFTConfig
    from trl_run import common, text, tokenizer

    from ringattn.integrations.trl import RingSFTTrainer

    def unconverted():
        return RingSFTTrainer(model=_moe("qwen3_moe", ring=True, convert=False),
                              args=SFTConfig(**common(out / "refusals")),
                              train_dataset=text(4, 0), processing_class=tokenizer())

    return {"unconverted": error_text(unconverted)}


def main():
    from launches import start_runner

    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", action="store_true")
    ap.add_argument("--out", required=True, type=Path)
    args = ap.parse_args()
    rank = start_runner(args)
    for case in CASES:
        trainer, grads = _sft(args.ref, args.out, case)
        torch.save(grads.steps, args.out / f"{case}.{rank}.pt")
        (args.out / f"{case}.{rank}.json").write_text(json.dumps(trainer.state.log_history))
    if not args.ref:
        (args.out / f"refusals.{rank}.json").write_text(json.dumps(_refusals(args.out)))
        import torch.distributed as dist

        dist.barrier()  # leave together: a rank tearing gloo down early can abort the other
        dist.destroy_process_group()


# ---- the tests ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(directory, {"ref": failure or None, WORLD: ...}): the one-process runs and one
    torchrun launch, started together."""
    pytest.importorskip("transformers")
    pytest.importorskip("trl")
    from launches import launch_all

    out = tmp_path_factory.mktemp("sft_router")
    me = str(Path(__file__).resolve())
    cmds = {"ref": [sys.executable, me, "--ref", "--out", str(out / "ref")],
            WORLD: [sys.executable, "-m", "torch.distributed.run", "--standalone",
                    "--nproc-per-node", str(WORLD), me, "--out", str(out / f"cp{WORLD}")]}
    return out, launch_all(cmds, out, TIMEOUT)


def _load(runs, kind, name, rank, ext="json"):
    out, failures = runs
    path = out / ("ref" if kind == "ref" else f"cp{kind}") / f"{name}.{rank}.{ext}"
    if not path.exists():
        pytest.fail(f"{kind} rank {rank} wrote no {name} results:\n{failures[kind]}")
    return json.loads(path.read_text()) if ext == "json" else torch.load(path)


@pytest.mark.timeout(TIMEOUT + 60)
@pytest.mark.parametrize("case", CASES)
def test_sft_with_router_loss_equals_one_process(runs, worst_errors, case):
    from test_trl import compare_grads, compare_logs

    want_logs = _load(runs, "ref", case, 0)
    want_grads = _load(runs, "ref", case, 0, "pt")
    train_logs = [h for h in want_logs if "loss" in h]
    assert len(train_logs) == 3 and all(h["aux_loss"] > 0 for h in train_logs), want_logs
    if case == "qwen3_moe_padded":
        assert any("eval_aux_loss" in h for h in want_logs), want_logs
    for rank in range(WORLD):
        logs = _load(runs, WORLD, case, rank)
        where = f"W={WORLD} rank {rank}"
        assert compare_logs(worst_errors, case, logs, want_logs, where) >= 15
        compare_grads(worst_errors, case, _load(runs, WORLD, case, rank, "pt"), want_grads,
                      where)


@pytest.mark.timeout(TIMEOUT + 60)
def test_unconverted_moe_is_refused_on_every_rank(runs):
    for rank in range(WORLD):
        got = _load(runs, WORLD, "refusals", rank)["unconverted"]
        assert got is not None and "convert the model first" in got, (rank, got)
        assert "router_aux_loss_coef=0.0" in got, (rank, got)


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
