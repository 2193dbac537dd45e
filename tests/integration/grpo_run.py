"""Run by tests/integration/test_trl_grpo.py: short GRPO runs of a tiny Llama, either TRL's
``GRPOTrainer`` in one process (``--ref``; under torchrun, TRL's own data parallelism) or
``RingGRPOTrainer`` under torchrun (``--cp-size``: dp x cp), every case in one launch.

Every process writes ``<out>/<case>.<rank>.json`` (the log history: every metric GRPO
logs) and ``<out>/<case>.<rank>.pt`` (every parameter's gradient at every optimizer step and
the completions generated), as soon as the case ends.

Cases (prompts of 2 to 9 words, left-padded by TRL; completions sampled by transformers'
``generate`` at temperature 0.9, up to 8 tokens, so rows of unequal lengths; two reward
functions; ``beta=0.1`` with the reference model TRL loads from the policy's directory;
SGD without clipping):

* ``grpo``: TRL's default loss, 2 generations per prompt, 4 rows per micro-batch, gradient
  accumulation 2 (one generation batch of 8 rows per optimizer step), three steps;
* ``grpo_iter``: ``num_iterations=2`` (the old policy's log-probabilities are computed and
  the clipping acts), ``loss_type="grpo"``, ``epsilon=0.05``, ``mask_truncated_completions``;
* ``grpo_hybrid``: a tiny Qwen3-Next (a Gated DeltaNet layer and an attention layer),
  converted by ``convert`` under CP (TRL's reference too), two steps;
* ``refusals`` (CP only): the errors of the refused options and of ranks whose rewards
  differ;
* ``docs``: docs/trainers.md's ``RingGRPOTrainer`` block as printed (CP), or TRL's trainer
  on the same names (``--ref``).
"""

import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/ (models.py)
sys.path.insert(0, str(Path(__file__).resolve().parent))
from launches import error_text, start_runner  # noqa: E402
from models import tiny_causal_lm  # noqa: E402
from trl_run import Grads, tokenizer, words  # noqa: E402


def prompts(n, seed):
    from datasets import Dataset

    g = torch.Generator().manual_seed(seed)
    return Dataset.from_list([{"prompt": words(g, 2, 9)} for _ in range(n)])


def distinct(completions, **kwargs):
    """A reward: the share of distinct words."""
    return [len(set(c.split())) / max(1, len(c.split())) for c in completions]


def short(completions, **kwargs):
    """A reward: shorter is better (a few completions end at <eos>)."""
    return [-0.1 * len(c.split()) for c in completions]


def model_dir(out: Path) -> str:
    """The tiny Llama saved once (TRL loads the reference model from the policy's path)."""
    import os

    path = out / f"tiny-{os.environ.get('RANK', 0)}"  # one per rank: no two writers
    if not (path / "config.json").exists():
        model = tiny_causal_lm("llama", "eager")
        # words w2..w12 end a completion too (TRL reads the generation config's ids), so
        # that completions end at different lengths
        model.generation_config.eos_token_id = list(range(1, 13))
        model.save_pretrained(path)  # (before torch.distributed runs: every rank saves)
        tokenizer().save_pretrained(path)
    return str(path)


def hybrid_dir(out: Path) -> str:
    """A tiny Qwen3-Next (Gated DeltaNet and attention layers), saved once: by the first
    rank once torch.distributed runs (transformers saves on rank 0 only), the others wait."""
    import torch.distributed as dist

    from families import build

    path = out / "qwen3_next"
    first = not dist.is_initialized() or dist.get_rank() == 0
    if first and not (path / "config.json").exists():
        model = build("qwen3_next", "eager")
        model.generation_config.eos_token_id = list(range(1, 13))
        model.save_pretrained(path)
        tokenizer().save_pretrained(path)
    if dist.is_initialized():
        dist.barrier()
    return str(path)


def grpo_hybrid(ref, out):
    """GRPO of a hybrid model: converted by ``convert`` under CP (its reference too)."""
    from transformers import AutoModelForCausalLM
    from trl import GRPOTrainer

    from ringattn.integrations import transformers as ra_hf
    from ringattn.integrations.trl import RingGRPOTrainer

    path = hybrid_dir(out)
    attn = "eager" if ref else "ringattn"
    # its experts' router loss off (the case is about the Gated DeltaNet layers)
    args = config(out / "grpo_hybrid", model_init_kwargs={"attn_implementation": attn,
                                                         "dtype": torch.float32}, max_steps=2,
                  router_aux_loss_coef=0.0)
    grads = Grads()
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=attn,
                                                 dtype=torch.float32)
    kw = dict(reward_funcs=[distinct, short], args=args, train_dataset=prompts(16, 3),
              processing_class=tokenizer(), callbacks=[grads.callback])
    trainer = (GRPOTrainer(model=model, **kw) if ref
               else RingGRPOTrainer(model=ra_hf.convert(model), **kw, layout="zigzag"))
    return train(trainer, grads)


def config(out, **overrides):
    from trl import GRPOConfig

    kw = dict(output_dir=str(out), use_cpu=True, per_device_train_batch_size=4,
              gradient_accumulation_steps=2, num_generations=2, max_completion_length=8,
              temperature=0.9, beta=0.1, optim="sgd", learning_rate=0.5, max_grad_norm=0,
              logging_steps=1, report_to=[], save_strategy="no", seed=0, max_steps=3,
              lr_scheduler_type="constant", disable_tqdm=True, bf16=False)
    kw.update(overrides)
    return GRPOConfig(**kw)


CP_SIZE = None  # --cp-size: ranks per CP group (None: the world)


def grpo(ref, out, name, **overrides):
    from trl import GRPOTrainer

    from ringattn.integrations.trl import RingGRPOTrainer

    path = model_dir(out)
    attn = "eager" if ref else "ringattn"
    args = config(out / name, model_init_kwargs={"attn_implementation": attn,
                                                "dtype": torch.float32}, **overrides)
    grads = Grads()
    kw = dict(model=path, reward_funcs=[distinct, short], args=args,
              train_dataset=prompts(16, 3), processing_class=tokenizer(),
              callbacks=[grads.callback])
    trainer = (GRPOTrainer(**kw) if ref
               else RingGRPOTrainer(**kw, layout="zigzag", cp_size=CP_SIZE))
    return train(trainer, grads)


def train(trainer, grads):
    """Train; (the log history, {every step's gradients, every generation's completions})."""
    seen = []
    generate = trainer._generate

    def keep(prompts_):  # the completions, to compare with one process's
        res = generate(prompts_)
        seen.append([list(map(int, c)) for c in res[1]])
        return res

    trainer._generate = keep
    trainer.train()
    return trainer.state.log_history, {"grads": grads.steps, "completions": seen}


def refusals(ref, out):
    from trl import GRPOTrainer  # noqa: F401

    from ringattn.integrations.trl import RingGRPOTrainer

    path = model_dir(out)
    found = {}

    def build(args, **kw):
        return RingGRPOTrainer(model=path, reward_funcs=[distinct], args=args,
                               train_dataset=prompts(8, 4), processing_class=tokenizer(), **kw)

    init = {"attn_implementation": "ringattn", "dtype": torch.float32}
    for what, over in (("use_vllm", dict(use_vllm=True)),
                       ("scale_rewards", dict(scale_rewards="batch")),
                       ("top_entropy_quantile", dict(top_entropy_quantile=0.5)),
                       ("neftune", dict(neftune_noise_alpha=5.0))):
        found[what] = error_text(lambda: build(config(out / "refused", model_init_kwargs=init,
                                                      **over)))
    found["eval_dataset"] = error_text(lambda: build(
        config(out / "refused", model_init_kwargs=init), eval_dataset=prompts(4, 5)))
    found["sdpa model"] = error_text(lambda: build(config(
        out / "refused", model_init_kwargs={"attn_implementation": "sdpa"})))

    import torch.distributed as dist

    rank = dist.get_rank()

    def per_rank(completions, **kwargs):  # a reward that differs on one rank
        return [float(rank == 1) for _ in completions]

    trainer = RingGRPOTrainer(model=path, reward_funcs=[per_rank],
                              args=config(out / "per_rank", model_init_kwargs=init, max_steps=1),
                              train_dataset=prompts(8, 4), processing_class=tokenizer())
    found["rewards differ"] = error_text(trainer.train)
    return found


def docs(ref, out):
    """docs/trainers.md's RingGRPOTrainer block as printed (CP), or TRL's GRPOTrainer on the
    same names in one process; the log history."""
    from trl import GRPOTrainer

    from trl_run import docs_block

    page = Path(__file__).resolve().parents[2] / "docs" / "trainers.md"
    names = {"model_path": model_dir(out), "reward": distinct, "prompts": prompts(8, 6),
             "grpo_args": config(out / "docs", max_steps=2), "tokenizer": tokenizer()}
    if ref:
        names["grpo_args"].model_init_kwargs = {"attn_implementation": "eager"}
        trainer = GRPOTrainer(model=names["model_path"], reward_funcs=names["reward"],
                              args=names["grpo_args"], train_dataset=names["prompts"],
                              processing_class=names["tokenizer"])
        trainer.train()
    else:
        block = docs_block("trainer = RingGRPOTrainer(", page)
        exec(compile(block, str(page), "exec"), names)
        trainer = names["trainer"]
    return {"logs": trainer.state.log_history}


CASES = {
    "grpo": lambda ref, out: grpo(ref, out, "grpo"),
    "grpo_iter": lambda ref, out: grpo(ref, out, "grpo_iter", num_iterations=2,
                                       loss_type="grpo", epsilon=0.05,
                                       mask_truncated_completions=True),
    "grpo_hybrid": grpo_hybrid,
    "refusals": refusals,
    "docs": docs,
}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--ref", action="store_true")
    ap.add_argument("--out", required=True, type=Path)
    ap.add_argument("--cases", default="grpo,grpo_iter,grpo_hybrid,docs")
    ap.add_argument("--cp-size", type=int, default=None,
                    help="ranks per CP group (dp x cp); with --ref under torchrun: TRL's DP")
    args = ap.parse_args()
    global CP_SIZE
    CP_SIZE = args.cp_size
    rank = start_runner(args)
    for name in args.cases.split(","):
        res = CASES[name](args.ref, args.out)
        if isinstance(res, dict):
            (args.out / f"{name}.{rank}.json").write_text(json.dumps(res))
            continue
        logs, tensors = res
        torch.save(tensors, args.out / f"{name}.{rank}.pt")
        (args.out / f"{name}.{rank}.json").write_text(json.dumps(logs))
    import torch.distributed as dist

    if dist.is_initialized():  # leave together
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
