"""Run by tests/integration/test_trainer.py: short HF Trainer runs of a tiny Llama, either a
plain ``Trainer`` in one process (``--ref``) or ``RingTrainer`` under torchrun, one scenario
after another in the same launch (starting transformers costs more than the runs).

Every process writes ``<out>/<scenario>.<rank>.json`` (what it logged) as soon as
the scenario ends, and ``<out>/predict.<rank>.pt`` (the predictions); a scenario
that raises leaves no file, so the scenarios before it still report.

Scenarios (``--scenarios``, comma separated):

* ``accumulate``: gradient accumulation 2, rows with masked prompts and right padding (the
  micro-batches have different target counts); three steps, so the second epoch starts;
  then ``evaluate`` with and without ``compute_metrics`` and ``predict`` on 5 rows (batches
  of 2, 2, 1).
* ``resume``: ``evaluate`` first (training must still synchronise gradients after it), then
  seven steps saving a checkpoint at step 5, then a fresh trainer resumed from it
  (mid-epoch in the second epoch) runs steps 6 and 7.
* ``bf16``: ``predict`` on 5 rows (``bf16_predict<suffix>.<rank>.pt``), then three steps,
  with ``bf16=True``; ``--ref`` runs them with eager and with sdpa attention, and in fp32:
  how far plain bf16 runs land from fp32 is the rounding the CP run is allowed.
* ``parallelism``: ``TrainingArguments(parallelism_config=ParallelismConfig(cp_size=2))``
  (RingTrainer shards the parameters with FSDP2 over the config's mesh): three steps, then
  ``evaluate`` (test_trainer_parallelism.py runs dp_shard x cp meshes).
* ``dp_cp``: ``RingTrainer(cp_size=2)`` on 4 ranks (dp 2 x cp 2, 2 rows per replica)
  against one process with batches of 4 rows: three steps (into the second epoch) with
  no accumulation, then ``evaluate``.
* ``ulysses``: ``RingTrainer(strategy="ulysses")``: three steps, then ``evaluate``.
* ``hybrid``: ``RingTrainer(strategy="hybrid", ulysses_size=2)`` on 4 ranks, the same.
* ``readme``: the README's ``RingTrainer`` block, executed as printed with the names it
  says are the reader's (``config``, ``args``, ``ds``, ``ev``): three steps; ``--ref``
  trains the same model built the same way with eager attention and a plain Trainer.
* ``refusals`` (CP only; last: a Trainer without ``use_cpu`` leaves accelerate's shared
  state without DDP): the errors of RingTrainer with ``use_cpu=False`` on these CPU
  ranks, and with a model whose attention is "eager".
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (models.py)
from launches import error_text  # noqa: E402
from models import tiny_causal_lm  # noqa: E402
from readme_blocks import readme_block  # noqa: E402

SEQLEN, VOCAB = 37, 97


class Rows(torch.utils.data.Dataset):
    """``n`` rows, the odd ones right-padded by up to 12 tokens, whose first 0 to 23 tokens (a
    prompt) have no label: batches hold very different numbers of targets."""

    def __init__(self, n, seed):
        g = torch.Generator().manual_seed(seed)
        self.ids = torch.randint(1, VOCAB, (n, SEQLEN), generator=g)
        prompt = torch.randint(0, 24, (n, 1), generator=g)
        odd = torch.arange(n)[:, None] % 2
        length = SEQLEN - torch.randint(0, 13, (n, 1), generator=g) * odd
        pos = torch.arange(SEQLEN)
        self.mask = (pos < length).long()
        self.ids = self.ids.masked_fill(self.mask == 0, 0)
        self.labels = self.ids.masked_fill((pos < prompt) | (self.mask == 0), -100)

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "attention_mask": self.mask[i], "labels": self.labels[i]}


def token_metrics(p):
    """The next-token NLL (float64) over every target of the set."""
    logits = torch.as_tensor(p.predictions, dtype=torch.float64)[:, :-1]
    labels = torch.as_tensor(p.label_ids)[:, 1:]
    keep = labels != -100
    nll = torch.nn.functional.cross_entropy(logits[keep], labels[keep])
    return {"nll": float(nll)}


def logged(trainer, key, after=0):
    return [h[key] for h in trainer.state.log_history if key in h and h["step"] > after]


def make_trainer(ref, out, attn="eager", cp_size=None, strategy="ring", ulysses_size=8,
                 **overrides):
    from transformers import Trainer, TrainingArguments

    from ringattn.integrations.hf_trainer import RingTrainer

    # plain SGD without clipping: a gradient off by a factor moves the next steps' losses
    # (Adam and clipping would hide it), and rounding differences stay rounding-sized
    kw = dict(output_dir=str(out), use_cpu=True, per_device_train_batch_size=2,
              per_device_eval_batch_size=2, optim="sgd", learning_rate=0.5, max_grad_norm=0,
              logging_steps=1, report_to=[], save_strategy="no", seed=0,
              lr_scheduler_type="constant", disable_tqdm=True)
    targs = TrainingArguments(**{**kw, **overrides})
    data = dict(train_dataset=Rows(8, 3), eval_dataset=Rows(5, 4))
    if ref:  # a plain Trainer in one process: its own data order, loss and logging
        return Trainer(model=tiny_causal_lm("llama", attn), args=targs, **data)
    return RingTrainer(model=tiny_causal_lm("llama", "ringattn"), args=targs, layout="zigzag",
                       cp_size=cp_size, strategy=strategy, ulysses_size=ulysses_size, **data)


def accumulate(ref, out):
    # logging every 2 steps of 3: the last step's loss reaches train_loss unlogged
    trainer = make_trainer(ref, out / "accumulate", gradient_accumulation_steps=2, max_steps=3,
                           logging_steps=2)
    result = trainer.train()
    res = {"loss": logged(trainer, "loss"), "grad_norm": logged(trainer, "grad_norm"),
           "train_loss": result.training_loss}
    res["eval_loss_only"] = trainer.evaluate()["eval_loss"]  # no compute_metrics: losses only
    trainer.compute_metrics = token_metrics
    res.update(trainer.evaluate())
    pred = trainer.predict(Rows(5, 4))
    rank = os.environ.get("RANK", 0)
    torch.save(torch.as_tensor(pred.predictions), out / f"predict.{rank}.pt")
    res["test_loss"] = pred.metrics["test_loss"]
    return res


def resume(ref, out):
    import torch.distributed as dist

    # the checkpoint must carry the momentum and the schedule's position (SGD with momentum,
    # not Adam: Adam turns rounding-sized gradient differences into lr-sized steps where a
    # gradient is near 0, and the runs would drift apart by more than rounding)
    args = dict(max_steps=7, save_strategy="steps", save_steps=5, optim_args="momentum=0.9",
                learning_rate=0.3, lr_scheduler_type="linear", max_grad_norm=1.0)
    trainer = make_trainer(ref, out / "resume", **args)
    # evaluated before training: the training after it must still synchronise gradients
    res = {"eval_loss_first": trainer.evaluate()["eval_loss"]}
    trainer.train()
    res.update(loss=logged(trainer, "loss"), grad_norm=logged(trainer, "grad_norm"))
    if not ref:  # every rank waits for rank 0's checkpoint, then resumes from it
        dist.barrier()
        again = make_trainer(ref, out / "resume", **args)
        again.train(resume_from_checkpoint=str(out / "resume" / "checkpoint-5"))
        res["resumed_loss"] = logged(again, "loss", after=5)
        res["resumed_grad_norm"] = logged(again, "grad_norm", after=5)
    return res


def bf16(ref, out):
    res = {}
    runs = [("", "eager", True), ("_sdpa", "sdpa", True), ("_fp32", "eager", False)]
    for suffix, attn, half in runs if ref else runs[:1]:
        trainer = make_trainer(ref, out / "bf16", attn=attn, bf16=half, max_steps=3)
        logits = trainer.predict(Rows(5, 4)).predictions  # the same weights in every run
        rank = os.environ.get("RANK", 0)
        torch.save(torch.as_tensor(logits), out / f"bf16_predict{suffix}.{rank}.pt")
        trainer.train()
        res["loss" + suffix] = logged(trainer, "loss")
        res["grad_norm" + suffix] = logged(trainer, "grad_norm")
    return res


def parallelism(ref, out):
    """``parallelism_config=ParallelismConfig(cp_size=2)`` on the 2 ranks (FSDP2 over cp):
    three steps and an evaluation (the reference: one process, as ``ulysses``'s)."""
    from accelerate import ParallelismConfig

    kw = {} if ref else dict(parallelism_config=ParallelismConfig(cp_size=2))
    trainer = make_trainer(ref, out / "parallelism", max_steps=3, **kw)
    trainer.train()
    res = {"loss": logged(trainer, "loss"), "grad_norm": logged(trainer, "grad_norm")}
    res["eval_loss"] = trainer.evaluate()["eval_loss"]
    return res


def dp_cp(ref, out):
    """dp 2 x cp 2 against one process reading the replicas' rows as one batch."""
    kw = dict(max_steps=3, per_device_eval_batch_size=2)
    trainer = (make_trainer(ref, out / "dp_cp", per_device_train_batch_size=4, **kw) if ref
               else make_trainer(ref, out / "dp_cp", cp_size=2, **kw))
    trainer.train()
    res = {"loss": logged(trainer, "loss"), "grad_norm": logged(trainer, "grad_norm")}
    res["eval_loss"] = trainer.evaluate()["eval_loss"]
    return res


def ulysses(ref, out):
    """RingTrainer(strategy="ulysses"): three steps and an evaluation."""
    trainer = make_trainer(ref, out / "ulysses", max_steps=3, strategy="ulysses")
    trainer.train()
    res = {"loss": logged(trainer, "loss"), "grad_norm": logged(trainer, "grad_norm")}
    res["eval_loss"] = trainer.evaluate()["eval_loss"]
    return res


def hybrid(ref, out):
    """RingTrainer(strategy="hybrid", ulysses_size=2) on 4 ranks (a 2 x 2 mesh): three
    steps and an evaluation (the reference: one process, as ``ulysses``'s)."""
    trainer = make_trainer(ref, out / "hybrid", max_steps=3, strategy="hybrid",
                           ulysses_size=2)
    trainer.train()
    res = {"loss": logged(trainer, "loss"), "grad_norm": logged(trainer, "grad_norm")}
    res["eval_loss"] = trainer.evaluate()["eval_loss"]
    return res


def readme(ref, out):
    """The README's RingTrainer block as printed (CP), or the same run in one process."""
    from transformers import AutoModelForCausalLM, Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(out / "readme"), use_cpu=True, max_steps=3,
                             per_device_train_batch_size=2, per_device_eval_batch_size=2,
                             optim="sgd", learning_rate=0.5, max_grad_norm=0, logging_steps=1,
                             report_to=[], save_strategy="no", seed=0, disable_tqdm=True,
                             lr_scheduler_type="constant")
    names = {"config": tiny_causal_lm("llama", "eager").config, "args": args,
             "ds": Rows(8, 3), "ev": Rows(5, 4)}
    torch.manual_seed(0)  # the same initial weights in both runs
    if ref:
        model = AutoModelForCausalLM.from_config(names["config"], attn_implementation="eager")
        trainer = Trainer(model=model, args=args, train_dataset=names["ds"],
                          eval_dataset=names["ev"])
        trainer.train()
    else:
        block = readme_block("from ringattn.integrations.hf_trainer import RingTrainer")
        exec(compile(block, "README.md", "exec"), names)
        trainer = names["trainer"]
    res = {"loss": logged(trainer, "loss"), "grad_norm": logged(trainer, "grad_norm")}
    res["eval_loss"] = trainer.evaluate()["eval_loss"]
    return res


def refusals(ref, out):
    """What RingTrainer says, on each rank, before training: with a model whose attention
    is eager, and without use_cpu=True on CPU ranks (transformers then sets up no DDP)."""
    from transformers import TrainingArguments

    from ringattn.integrations.hf_trainer import RingTrainer

    if ref:
        return {}

    eager_args = TrainingArguments(output_dir=str(out / "refusals"), use_cpu=True, report_to=[],
                                   max_steps=1)
    return {
        "eager": error_text(lambda: RingTrainer(model=tiny_causal_lm("llama", "eager"),
                                           args=eager_args, train_dataset=Rows(8, 3))),
        "no_use_cpu": error_text(lambda: make_trainer(ref, out / "refusals", max_steps=1,
                                                 use_cpu=False)),
    }


SCENARIOS = {"accumulate": accumulate, "resume": resume, "bf16": bf16,
             "parallelism": parallelism, "dp_cp": dp_cp, "ulysses": ulysses, "hybrid": hybrid,
             "readme": readme, "refusals": refusals}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", action="store_true")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    args = ap.parse_args()
    if not args.ref:
        from ringattn.integrations import transformers as ra_hf

        ra_hf.register()
    rank = int(os.environ.get("RANK", 0))
    for name in args.scenarios.split(","):
        res = SCENARIOS[name](args.ref, args.out)
        (args.out / f"{name}.{rank}.json").write_text(json.dumps(res))
    if not args.ref:  # leave together: a rank tearing gloo down early can abort the other
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
