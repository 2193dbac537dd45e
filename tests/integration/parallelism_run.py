"""Run by tests/integration/test_trainer_parallelism.py: ``RingTrainer`` with
``TrainingArguments(parallelism_config=ParallelismConfig(dp_shard_size=D, cp_size=C))``
under torchrun (W = D x C gloo CPU ranks: FSDP2 over dp_shard x cp, ring attention over
cp), or (``--ref``) a plain transformers ``Trainer`` in one process reading, per step, the
rows all D replicas read (``per_device_train_batch_size x D`` rows).

Every process writes, per case, ``<out>/<case>.<rank>.json`` (logged losses, gradient
norms, eval loss) and ``<out>/<case>.<rank>.pt`` (every parameter's gradient at every
optimizer step, just before the step, and every parameter after training: FSDP2's
DTensors gathered with ``full_tensor``), as soon as the case ends.

Cases (``--cases``, comma separated; the world size must be the case's D x C):

* ``dp2_cp2``: D=2, C=2 (W=4), 2 rows per replica, three SGD steps (into the second
  epoch; a ``save_only_model`` checkpoint at step 3), then ``evaluate`` and
  ``save_model``.
* ``dp2_cp2_accum``: the same with gradient accumulation 2 (3 steps of 8 rows: the
  reduce-scatter waits for the second micro-batch) and gradient clipping at 1.0.
* ``cp3``: D=1, C=3 (W=3), 2 rows: ``evaluate``, four steps clipped at 1.0, ``evaluate``
  and ``predict`` (5 rows; the logits in the ``.pt``).
* ``refusals4`` (W=4, not ``--ref``): the ValueError of each configuration RingTrainer
  refuses, or None (and of two it accepts).

Rows: trainer_run.py's (S=37, not a multiple of 2C; odd rows right-padded; prompts
unlabelled).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (models.py)
from launches import start_runner  # noqa: E402
from models import tiny_causal_lm  # noqa: E402
from trainer_run import Rows, logged  # noqa: E402

CASES = {  # name: (dp_shard_size, cp_size, steps, TrainingArguments overrides)
    "dp2_cp2": (2, 2, 3, dict(save_strategy="steps", save_steps=3, save_only_model=True)),
    "dp2_cp2_accum": (2, 2, 3, dict(gradient_accumulation_steps=2, max_grad_norm=1.0)),
    "cp3": (1, 3, 4, dict(max_grad_norm=1.0)),
}


def _full(t):
    """A plain tensor of ``t`` (a DTensor gathered: a collective, every rank calls it)."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def _grad_recorder(steps, meshes):
    """A callback appending {name: gradient} to ``steps`` before each optimizer step, and
    to ``meshes`` the size of the mesh each gradient is sharded over (0: a plain tensor)."""
    from transformers import TrainerCallback

    class Record(TrainerCallback):
        def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
            grads = {n: p.grad for n, p in model.named_parameters()}
            meshes.append(sorted({g.device_mesh.size() if hasattr(g, "device_mesh") else 0
                                  for g in grads.values()}))
            steps.append({n: _full(g).detach().clone() for n, g in grads.items()})

    return Record()


def _args(out, ref, dp, cp, steps, **overrides):
    from accelerate import ParallelismConfig
    from transformers import TrainingArguments

    # plain SGD: a gradient off by a factor moves the next steps' losses
    kw = dict(output_dir=str(out), use_cpu=True, per_device_train_batch_size=2,
              per_device_eval_batch_size=2, optim="sgd", learning_rate=0.5, max_grad_norm=0,
              logging_steps=1, report_to=[], save_strategy="no", seed=0,
              lr_scheduler_type="constant", disable_tqdm=True, max_steps=steps)
    if ref:  # one process reads the D replicas' rows as one batch
        kw["per_device_train_batch_size"] *= dp
    else:
        kw["parallelism_config"] = ParallelismConfig(dp_shard_size=dp, cp_size=cp)
    return TrainingArguments(**{**kw, **overrides})


def train_case(name, ref, out):
    from transformers import Trainer

    from ringattn.integrations.hf_trainer import RingTrainer

    dp, cp, steps, overrides = CASES[name]
    args = _args(out / name, ref, dp, cp, steps, **overrides)
    grads, meshes = [], []
    data = dict(train_dataset=Rows(8, 3), eval_dataset=Rows(5, 4),
                callbacks=[_grad_recorder(grads, meshes)])
    if ref:
        trainer = Trainer(model=tiny_causal_lm("llama", "eager"), args=args, **data)
    else:
        trainer = RingTrainer(model=tiny_causal_lm("llama", "ringattn"), args=args,
                              layout="zigzag", **data)
    first = {}
    if name == "cp3":  # evaluating first leaves the root's parameters unsharded
        first["eval_loss_first"] = trainer.evaluate()["eval_loss"]
    result = trainer.train()
    res = {"loss": logged(trainer, "loss"), "grad_norm": logged(trainer, "grad_norm"),
           "train_loss": result.training_loss, "grad_meshes": meshes, **first}
    res["eval_loss"] = trainer.evaluate()["eval_loss"]
    logits = None
    if name == "cp3":  # the logits of the whole sequence, on every rank
        logits = torch.as_tensor(trainer.predict(Rows(5, 4)).predictions)
    if not ref:
        res["mesh"] = list(trainer.device_mesh.mesh_dim_names)
    weights = {n: _full(p).detach().clone() for n, p in trainer.model.named_parameters()}
    if name == "dp2_cp2":  # save_pretrained of the sharded model: the full weights
        trainer.save_model(str(out / name / "saved"))
    return res, {"grads": grads, "weights": weights, "logits": logits}


def refusals4(ref, out):
    """What RingTrainer says for each configuration it refuses, on 4 ranks."""
    from accelerate import ParallelismConfig
    from transformers import TrainingArguments

    from ringattn.integrations.hf_trainer import RingTrainer

    def error(pc, cp_size=None, **overrides):
        kw = dict(output_dir=str(out / "refusals"), use_cpu=True, report_to=[], max_steps=1,
                  save_strategy="no", parallelism_config=pc)
        try:
            RingTrainer(model=tiny_causal_lm("llama", "ringattn"),
                        args=TrainingArguments(**{**kw, **overrides}), train_dataset=Rows(8, 3),
                        cp_size=cp_size)
        except ValueError as e:
            return str(e)
        return None

    return {
        "tp": error(ParallelismConfig(tp_size=2, cp_size=2)),
        "dp_replicate": error(ParallelismConfig(dp_replicate_size=2, dp_shard_size=2)),
        "cp_conflict": error(ParallelismConfig(dp_shard_size=2, cp_size=2), cp_size=4),
        "total": error(ParallelismConfig(cp_size=2)),
        "save": error(ParallelismConfig(dp_shard_size=2, cp_size=2), save_strategy="steps"),
        # accepted: the same cp_size both ways, checkpoints of the weights only
        "cp_same": error(ParallelismConfig(dp_shard_size=2, cp_size=2), cp_size=2),
        "save_only_model": error(ParallelismConfig(dp_shard_size=2, cp_size=2),
                                 save_strategy="steps", save_only_model=True),
        # last: TrainingArguments(fsdp=...) sets ACCELERATE_USE_FSDP in this process
        "fsdp": error(ParallelismConfig(dp_shard_size=2, cp_size=2), fsdp="full_shard"),
    }, None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", action="store_true")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--cases", required=True)
    args = ap.parse_args()
    rank = start_runner(args)
    for name in args.cases.split(","):
        res, tensors = (refusals4(args.ref, args.out) if name == "refusals4"
                        else train_case(name, args.ref, args.out))
        if tensors is not None:
            torch.save(tensors, args.out / f"{name}.{rank}.pt")
        (args.out / f"{name}.{rank}.json").write_text(json.dumps(res))
    if not args.ref:  # leave together: a rank tearing gloo down early can abort another
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
