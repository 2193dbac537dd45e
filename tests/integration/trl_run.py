"""Run by tests/integration/test_trl.py: short TRL runs of a tiny Llama, either TRL's plain
``SFTTrainer`` / ``DPOTrainer`` in one process (``--ref``) or ``RingSFTTrainer`` /
``RingDPOTrainer`` under torchrun, every case in one launch.

Every process writes ``<out>/<case>.<rank>.json`` (the log history: losses, gradient norms,
TRL's metrics, the eval metrics), ``<out>/<case>.<rank>.pt`` (every parameter's gradient
at every optimizer step, read before the step), ``<case>.<rank>.lengths.json`` (the S of
each training batch) and ``<case>.<rank>.predict.pt`` (``predict``'s logits and loss on the
eval set), as soon as the case ends.

Cases:

* ``sft_packed``: prompt/completion pairs (completion-only loss), ``packing=True`` (bfd:
  padding-free rows, position ids restarting per document), gradient accumulation 2,
  three steps, then ``evaluate`` and ``predict``.
* ``sft_padded``: plain text rows of different lengths (padded), three steps, ``evaluate``,
  ``predict``;
  through a user's subclass of SFTTrainer (``RingUserSFT(RingSFTTrainer, UserSFT)``), whose
  ``log`` adds ``loss_bits``.
* ``dpo``: prompt/chosen/rejected of different lengths (chosen and rejected padded to one
  S), sigmoid loss, three steps, ``evaluate``, ``predict``.
* ``dpo_mix``: DPO with ``loss_type=["ipo", "sft"]`` and ``ld_alpha``, gradient
  accumulation 2, three steps.
* ``refusals`` (CP only): the errors of the refused options.
* ``docs`` (only when named): the TRL blocks of the docs page (``--docs``, default
  docs/trainers.md) executed as printed under CP, with the names the page says are the
  reader's (``docs_names``); ``--ref`` runs the same with TRL's trainers.

The data is text over a word-level tokenizer built here (no download): words ``w2`` ...
``w96``, ``<pad>`` 0 and ``<eos>`` 1.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (models.py)
from launches import error_text, start_runner  # noqa: E402
from models import tiny_causal_lm  # noqa: E402

VOCAB = 97


def tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"<pad>": 0, "<eos>": 1, **{f"w{i}": i for i in range(2, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<eos>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def words(g, lo, hi):
    n = int(torch.randint(lo, hi + 1, (1,), generator=g))
    return " ".join(f"w{int(i)}" for i in torch.randint(2, VOCAB, (n,), generator=g))


def prompt_completion(n, seed):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = [{"prompt": words(g, 2, 9) + " ", "completion": words(g, 3, 12)} for _ in range(n)]
    return Dataset.from_list(rows)


def text(n, seed):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    return Dataset.from_list([{"text": words(g, 4, 30)} for _ in range(n)])


def pairs(n, seed):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    rows = [{"prompt": words(g, 2, 8) + " ", "chosen": words(g, 2, 13), "rejected": words(g, 1, 10)}
            for _ in range(n)]
    return Dataset.from_list(rows)


class Grads:
    """A callback keeping every parameter's gradient at each optimizer step."""

    def __init__(self):
        from transformers import TrainerCallback

        steps = self.steps = []

        class _Cb(TrainerCallback):
            def on_pre_optimizer_step(self, args, state, control, model=None, **kw):
                steps.append({n: p.grad.detach().clone() for n, p in model.named_parameters()
                              if p.grad is not None})

        self.callback = _Cb()


def common(out, **overrides):
    # plain SGD without clipping: a gradient off by a factor moves the next steps' losses
    kw = dict(output_dir=str(out), use_cpu=True, per_device_train_batch_size=2,
              per_device_eval_batch_size=2, optim="sgd", learning_rate=0.5, max_grad_norm=0,
              logging_steps=1, report_to=[], save_strategy="no", seed=0, max_steps=3,
              lr_scheduler_type="constant", disable_tqdm=True, dataset_num_proc=None,
              bf16=False)  # TRL's configs default to bf16=True (autocast), also on CPU
    kw.update(overrides)
    return kw


def user_sft():
    """A user's SFTTrainer subclass (logging the loss in bits too), and its ring version."""
    import math

    from trl import SFTTrainer

    from ringattn.integrations.trl import RingSFTTrainer

    class UserSFT(SFTTrainer):
        def log(self, logs, start_time=None):
            if "loss" in logs:
                logs["loss_bits"] = logs["loss"] / math.log(2)
            super().log(logs, start_time)

    class RingUserSFT(RingSFTTrainer, UserSFT):
        pass

    return UserSFT, RingUserSFT


def sft(ref, out, train, evald, user=False, **overrides):
    from trl import SFTConfig, SFTTrainer

    from ringattn.integrations.trl import RingSFTTrainer

    args = SFTConfig(**common(out, **overrides))
    grads = Grads()
    attn = "eager" if ref else "ringattn"
    kw = dict(model=tiny_causal_lm("llama", attn), args=args, train_dataset=train,
              eval_dataset=evald, processing_class=tokenizer(), callbacks=[grads.callback])
    one, ring = user_sft() if user else (SFTTrainer, RingSFTTrainer)
    trainer = one(**kw) if ref else ring(**kw, layout="zigzag")
    trainer.train()
    trainer.evaluate()
    return trainer, grads, trainer.predict(trainer.eval_dataset)


def dpo(ref, out, train, evald, **overrides):
    from trl import DPOConfig, DPOTrainer

    from ringattn.integrations.trl import RingDPOTrainer

    args = DPOConfig(**common(out, **overrides))
    grads = Grads()
    attn = "eager" if ref else "ringattn"
    kw = dict(model=tiny_causal_lm("llama", attn), ref_model=tiny_causal_lm("llama", attn),
              args=args, train_dataset=train, eval_dataset=evald,
              processing_class=tokenizer(), callbacks=[grads.callback])
    trainer = DPOTrainer(**kw) if ref else RingDPOTrainer(**kw, layout="zigzag")
    trainer.train()
    if evald is None:
        return trainer, grads, None
    trainer.evaluate()
    return trainer, grads, trainer.predict(trainer.eval_dataset)


def sft_packed(ref, out):
    return sft(ref, out / "sft_packed", prompt_completion(12, 1), prompt_completion(5, 2),
               packing=True, max_length=23, gradient_accumulation_steps=2)


def sft_padded(ref, out):
    return sft(ref, out / "sft_padded", text(9, 3), text(5, 4), user=True,
               per_device_train_batch_size=3)


def dpo_sigmoid(ref, out):
    return dpo(ref, out / "dpo", pairs(8, 5), pairs(5, 6), beta=0.5, learning_rate=0.1)


def dpo_mix(ref, out):
    return dpo(ref, out / "dpo_mix", pairs(8, 7), None, beta=0.5, learning_rate=0.1,
               loss_type=["ipo", "sft"], loss_weights=[1.0, 0.5], ld_alpha=0.5,
               gradient_accumulation_steps=2)


def refusals(ref, out):
    """Each refused option's error, on this rank."""
    from trl import DPOConfig, SFTConfig

    from ringattn.integrations.trl import RingDPOTrainer, RingSFTTrainer

    if ref:
        return {}

    tok = tokenizer()

    def sft_with(cp_size=None, **kw):
        return RingSFTTrainer(model=tiny_causal_lm("llama", "ringattn"),
                              args=SFTConfig(**common(out / "refusals", **kw)),
                              train_dataset=text(4, 0), processing_class=tok, cp_size=cp_size)

    def dpo_with(ref_model="ringattn", **kw):
        ref_model = tiny_causal_lm("llama", ref_model) if ref_model else None
        return RingDPOTrainer(model=tiny_causal_lm("llama", "ringattn"), ref_model=ref_model,
                              args=DPOConfig(**common(out / "refusals", **kw)),
                              train_dataset=pairs(4, 0), processing_class=tok)

    return {
        "sft_neftune": error_text(lambda: sft_with(neftune_noise_alpha=5.0)),
        "sft_liger": error_text(lambda: sft_with(use_liger_kernel=True)),
        "dpo_liger": error_text(lambda: dpo_with(use_liger_kernel=True)),
        "sft_dp_cp": error_text(lambda: sft_with(cp_size=1)),
        "dpo_neftune": error_text(lambda: dpo_with(neftune_noise_alpha=5.0)),
        "dpo_no_ref": error_text(lambda: dpo_with(ref_model=None)),
        "dpo_eager_ref": error_text(lambda: dpo_with(ref_model="eager")),
        "dpo_precompute": error_text(lambda: dpo_with(precompute_ref_log_probs=True)),
    }


DOCS_LINES = ("trainer = RingSFTTrainer(model=model", "trainer = RingDPOTrainer(model=policy")
DOCS = Path(__file__).resolve().parents[2] / "docs" / "trainers.md"


def docs_block(line, page):
    """The one ```python block of ``page`` holding ``line``."""
    text = page.read_text()
    found = [part[:part.index("```")] for part in text.split("```python\n")[1:]
             if line in part[:part.index("```")]]
    assert len(found) == 1, f"{len(found)} python blocks of {page} hold {line!r}"
    return found[0]


def docs_names(out):
    """The names the TRL blocks of the docs say are the reader's: ``config``, ``tokenizer``,
    ``sft_args`` / ``ds`` (prompt/completion pairs, packed) and ``dpo_args`` / ``pairs``."""
    from trl import DPOConfig, SFTConfig

    return {"config": tiny_causal_lm("llama", "eager").config, "tokenizer": tokenizer(),
            "sft_args": SFTConfig(**common(out / "docs_sft", packing=True, max_length=23)),
            "ds": prompt_completion(8, 8),
            "dpo_args": DPOConfig(**common(out / "docs_dpo", beta=0.5, learning_rate=0.1)),
            "pairs": pairs(6, 9)}


def docs(ref, out, page=None):
    """The docs' TRL blocks as printed (CP), or the same runs with TRL's trainers in one
    process; the log history of each."""
    from transformers import AutoModelForCausalLM
    from trl import DPOTrainer, SFTTrainer

    page = Path(page) if page else DOCS
    res = {}
    for line, key in zip(DOCS_LINES, ("sft", "dpo")):
        names = docs_names(out)
        torch.manual_seed(0)  # the same initial weights in both runs
        if ref:
            build = lambda: AutoModelForCausalLM.from_config(names["config"],  # noqa: E731
                                                              attn_implementation="eager")
            if key == "sft":
                trainer = SFTTrainer(model=build(), args=names["sft_args"],
                                     train_dataset=names["ds"],
                                     processing_class=names["tokenizer"])
            else:
                policy, reference = build(), build()
                reference.load_state_dict(policy.state_dict())
                trainer = DPOTrainer(model=policy, ref_model=reference, args=names["dpo_args"],
                                     train_dataset=names["pairs"],
                                     processing_class=names["tokenizer"])
            trainer.train()
        else:
            exec(compile(docs_block(line, page), str(page), "exec"), names)
            trainer = names["trainer"]
        res[key] = trainer.state.log_history
    return res


CASES = {"sft_packed": sft_packed, "sft_padded": sft_padded, "dpo": dpo_sigmoid,
         "dpo_mix": dpo_mix, "refusals": refusals, "docs": docs}
DEFAULT = ("sft_packed", "sft_padded", "dpo", "dpo_mix", "refusals")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", action="store_true")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--cases", default=",".join(DEFAULT))
    ap.add_argument("--docs", default=None, help="the page holding the TRL blocks (case docs; "
                    "default docs/trainers.md)")
    args = ap.parse_args()
    rank = start_runner(args)
    for name in args.cases.split(","):
        res = (docs(args.ref, args.out, args.docs) if name == "docs"
               else CASES[name](args.ref, args.out))
        if isinstance(res, dict):
            (args.out / f"{name}.{rank}.json").write_text(json.dumps(res))
            continue
        trainer, grads, pred = res
        torch.save(grads.steps, args.out / f"{name}.{rank}.pt")
        # the sequence lengths S of the training batches (after training: the loader is
        # made anew), and predict's logits and loss
        lengths = [b["input_ids"].shape[1] for b in trainer.get_train_dataloader()]
        (args.out / f"{name}.{rank}.lengths.json").write_text(json.dumps(lengths))
        if pred is not None:
            torch.save({"logits": torch.as_tensor(pred.predictions),
                        "loss": pred.metrics["test_loss"]},
                       args.out / f"{name}.{rank}.predict.pt")
        (args.out / f"{name}.{rank}.json").write_text(json.dumps(trainer.state.log_history))
    if not args.ref:  # leave together: a rank tearing gloo down early can abort the other
        import torch.distributed as dist

        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
