"""The Eagle3 demo: a draft trained under context parallelism trains like one process.

An Eagle3 draft (one Llama decoder layer, 7 TTT steps) is trained online against a tiny
random-weight transformers ``LlamaForCausalLM`` target, twice from the same seed on the same
batches (S not divisible by 2W, each batch's last row right padded):

* context-parallel: W gloo ranks; the target runs under ring attention through the
  transformers integration, the draft under ``ttt_attention``, every step shift reads across
  shard boundaries;
* single-process: the whole sequences, the target with transformers' "sdpa" attention and
  the draft with the dense TTT mask written out.

The demo fails (``result["failures"]``; ``ringattn demo`` exits 1) when the per-step losses
or accuracies of the two runs differ beyond float32 rounding, or the draft did not learn
(judged in runs of at least ``LEARN_STEPS`` steps).
"""

from __future__ import annotations

import os
import time

from .demo import run_costs, save_result
from .eagle3_train import (PROMPT_TOKENS, Eagle3Config, spawn_eagle3, synthetic_min_seqlen,
                           train_eagle3)

__all__ = ["LEARN_STEPS", "REL_TOL", "run_eagle3_demo"]

REL_TOL = 1e-4
"""Largest allowed relative difference of the two runs' total loss at any optimizer step
(the same float32 arithmetic in another summation order differs by ~1e-7 per step; AdamW
steps carry such differences forward, so 1e-4 leaves two orders of headroom while a dropped
key or token shows at the first step)."""

ACC_TOL = 0.01
"""Largest allowed difference of a TTT step's accuracy (a fraction) between the runs: a
near tie of two logits may resolve differently after rounding; 1% of the counted tokens
is a handful, far from what a wrong shift or mask causes."""

LEARN_RATIO = 1.5
"""Step-0 accuracy over the last 10 steps must reach this multiple of the first 10's."""

LEARN_STEPS = 50
"""The shortest run whose learning is judged (the accuracy ratio and the exported draft's
acceptance against an untrained one): a shorter run checks the curves only
(``result["learning_judged"]`` False; ``ringattn demo`` says so)."""


def _rel(a: float, b: float) -> float:
    """|a - b| / |b|: 0 for two equal losses (0 when a step had no token to train on), inf
    for a loss against a 0."""
    return 0.0 if a == b else abs(a - b) / abs(b) if b else float("inf")


def _plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    cfg, world = result["config"], result["world"]
    steps = range(1, len(result["cp_loss"]) + 1)
    fig, (ax_loss, ax_acc, ax_diff) = plt.subplots(
        3, 1, figsize=(8, 9), sharex=True, gridspec_kw={"height_ratios": [2, 2, 1.2]})
    ax_loss.plot(steps, result["single_loss"], color="tab:blue", lw=3, alpha=0.45,
                 label="one process (dense TTT mask)")
    ax_loss.plot(steps, result["cp_loss"], color="tab:blue", lw=1, ls="--",
                 label=f"ring attention, CP W={world}")
    ax_loss.set_ylabel("weighted TTT loss")
    ax_loss.legend()
    t = cfg["ttt_steps"]
    for j, color in ((0, "tab:green"), (t - 1, "tab:purple")):
        ax_acc.plot(steps, result["single_accuracy"][j], color=color, lw=3, alpha=0.45,
                    label=f"TTT step {j}, one process")
        ax_acc.plot(steps, result["cp_accuracy"][j], color=color, lw=1, ls="--",
                    label=f"TTT step {j}, CP W={world}")
    ax_acc.set_ylabel("draft accuracy")
    ax_acc.legend(fontsize="small")
    diffs = [(i, d) for i, d in zip(steps, result["rel_diff"]) if d > 0]
    if diffs:
        ax_diff.semilogy(*zip(*diffs), ".", ms=3, color="tab:green",
                         label="|CP - one process| / one process")
    ax_diff.set_yscale("log")
    ax_diff.axhline(result["tolerance"], color="tab:red", ls=":",
                    label=f"tolerance {result['tolerance']:g}")
    ax_diff.set_xlabel("optimizer step")
    ax_diff.set_ylabel("relative difference")
    ax_diff.legend(loc="upper left", fontsize="small")
    for ax in (ax_loss, ax_acc, ax_diff):
        ax.grid(alpha=0.3)
    ax_loss.set_title(
        f"Eagle3 draft (transformers Llama target), S={cfg['seqlen']}, {t} TTT steps, "
        f"layout={cfg['layout']}\nCP on {world} gloo ranks vs one process, same seed and "
        f"batches", fontsize="medium")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


CHAT_WORDS = ("the", "a", "cat", "dog", "sat", "ran", "on", "under", "mat", "tree", "is",
              "was", "big", "small", "red", "blue", "what", "where", "why", "how", "did", "it",
              "go", "see", "yes", "no", "maybe", "please", "thanks", "hello")
CHAT_SPECIAL = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")
CHAT_TEMPLATE = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' }} "
                 "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} <|end|>"
                 "{% endgeneration %}{% else %}{{ m['content'] }} <|end|>{% endif %} "
                 "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")


def demo_tokenizer(words=CHAT_WORDS, template: str = CHAT_TEMPLATE):
    """A small offline word-level chat tokenizer: ``<unk>`` 0, ``CHAT_SPECIAL`` 1..4, then
    ``words``; ``template`` its chat template (the demo's and the tests' stand-in for a real
    model's tokenizer, which needs a download)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", *CHAT_SPECIAL, *words])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": list(CHAT_SPECIAL)})
    fast.chat_template = template
    return fast


def run_chat_demo(world: int, out_dir: str, *, steps: int = 20, verbose: bool = True) -> dict:
    """The path users take, small: the demo's target saved as a local model directory with a
    chat tokenizer, 32 synthetic conversations as JSON lines, packed training under CP on
    ``world`` ranks (``python -m ringattn.apps.eagle3_train --target ... --data ... --pack``),
    the exported SGLang draft loaded back and used for speculative decoding.

    Returns:
        dict: ``losses``, ``exported`` (the two export directories), ``generation_ok``
        (speculative decoding reproduced the target's greedy tokens).
    """
    import json

    import torch

    from ..eagle3.evaluate import speculative_generate
    from ..eagle3.export import load_draft
    from .eagle3_train import build_target

    base = Eagle3Config()
    target_dir, chat_dir = os.path.join(out_dir, "target"), os.path.join(out_dir, "chat")
    target = build_target(base, "sdpa")
    target.save_pretrained(target_dir)
    demo_tokenizer().save_pretrained(target_dir)
    gen = torch.Generator().manual_seed(11)

    def words(n):
        return " ".join(CHAT_WORDS[i] for i in torch.randint(len(CHAT_WORDS), (n,), generator=gen))

    data = os.path.join(out_dir, "chats.jsonl")
    with open(data, "w") as f:
        for c in range(32):
            turns = [{"role": "user", "content": words(4 + c % 5)},
                     {"role": "assistant", "content": words(6 + c % 7)}]
            f.write(json.dumps({"messages": turns}) + "\n")
    cfg = Eagle3Config(target=target_dir, data=data, pack=True, batch=1, seqlen=96,
                       steps=steps, draft_vocab=24)
    res = spawn_eagle3(cfg, world=world, progress=verbose, out_dir=chat_dir)
    draft = load_draft(os.path.join(chat_dir, "draft-sglang"),
                       embed_tokens=target.get_input_embeddings().weight.detach())
    prompt = demo_tokenizer().apply_chat_template(
        [{"role": "user", "content": words(5)}], add_generation_prompt=True, tokenize=True,
        return_dict=True)["input_ids"]
    got, _ = speculative_generate(target, draft.eval(), torch.tensor(prompt), max_new_tokens=12)
    want = target.generate(torch.tensor([prompt]), max_new_tokens=12, do_sample=False,
                           pad_token_id=0)[0, len(prompt):].tolist()
    out = {"losses": res["loss"], "generation_ok": got == want[:len(got)] and len(got) == 12,
           "exported": [os.path.join(chat_dir, f"draft-{f}") for f in ("sglang", "speculators")]}
    if verbose:
        print(f"chat data: {len(res['loss'])} packed steps under CP on {world} ranks from "
              f"{target_dir} and {data}, loss {res['loss'][0]:.3f} -> {res['loss'][-1]:.3f}; "
              f"exported {out['exported'][0]} and {out['exported'][1]}; speculative decoding "
              f"with it reproduces the target's greedy tokens: {out['generation_ok']}")
    return out


DRAFT_LEN = 4
"""Proposals per speculative-decoding round in the demo's acceptance measurement."""


def _acceptance(cfg: Eagle3Config, out_dir: str) -> dict:
    """Mean tokens per verification round of speculative decoding with the CP run's exported
    draft (loaded back from ``out_dir/draft-sglang``) and with an untrained draft, one round
    after each of 16 prompts from the training distribution (random tokens), checking that
    the output equals the target's greedy generation."""
    import torch

    from ..eagle3.evaluate import speculative_generate
    from ..eagle3.export import load_draft
    from .eagle3_train import _draft_ids, build_draft, build_target

    target = build_target(cfg, "sdpa")
    trained = load_draft(os.path.join(out_dir, "draft-sglang"),
                         embed_tokens=target.get_input_embeddings().weight.detach())
    untrained = build_draft(cfg, target, _draft_ids(cfg, target, None))
    prompts = [torch.randint(cfg.vocab, (n,), generator=torch.Generator().manual_seed(100 + n))
               for n in range(8, 24)]
    result = {"rounds": len(prompts)}
    for name, draft in (("trained", trained), ("untrained", untrained)):
        per_round = []
        for p in prompts:
            tokens, rounds = speculative_generate(target, draft.eval(), p,
                                                  max_new_tokens=DRAFT_LEN + 1,
                                                  draft_len=DRAFT_LEN)
            per_round += rounds
        result[name] = sum(per_round) / len(per_round)
    return result


def run_eagle3_demo(world: int = 2, steps: int = Eagle3Config.steps, out_dir: str = "demo_out",
                    layout: str = "zigzag", seqlen: int = Eagle3Config.seqlen, *,
                    verbose: bool = True) -> dict:
    """Train the draft under CP on ``world`` CPU ranks and in one process; compare.

    Returns:
        dict with ``config``, ``world``, per-step ``cp_loss``, ``single_loss``,
        ``rel_diff``, per-TTT-step accuracy lists ``cp_accuracy``/``single_accuracy``,
        ``max_rel_diff``, ``max_acc_diff``, ``tolerance``, ``shard_ranges``, ``seconds``,
        ``tokens_per_s``, ``peak_rss_mib`` and ``failures`` (empty on success; the learning
        check applies to runs of at least ``LEARN_STEPS`` steps: ``learning_judged``). Also
        written to
        ``out_dir/eagle3.json``, with the plot ``out_dir/eagle3.png``.

    Raises:
        ValueError: a bad argument (also ``seqlen`` below ``SYNTHETIC_MIN_SEQLEN``, where
            TTT steps have nothing to train on), before any process starts.
    """
    if not (isinstance(world, int) and not isinstance(world, bool) and world >= 1):
        raise ValueError(f"world must be an int >= 1, got {world!r}")
    least = synthetic_min_seqlen(Eagle3Config())
    if not (isinstance(seqlen, int) and not isinstance(seqlen, bool) and seqlen >= least):
        raise ValueError(f"seqlen must be an int >= {least} ({PROMPT_TOKENS} prompt tokens, "
                         f"then one for each of the {Eagle3Config.ttt_steps} TTT steps), got "
                         f"{seqlen!r}")
    cfg = Eagle3Config(steps=steps, layout=layout, seqlen=seqlen,
                       pad=min(Eagle3Config.pad, seqlen // 4))
    t0 = time.perf_counter()
    cp = spawn_eagle3(cfg, world=world, progress=verbose, out_dir=out_dir)  # + exported drafts
    single = train_eagle3(cfg, progress=verbose)
    accepted = _acceptance(cfg, out_dir)
    rel_diff = [_rel(a, b) for a, b in zip(cp["loss"], single["loss"])]
    acc_diff = max(abs(a - b) for j in range(cfg.ttt_steps)
                   for a, b in zip(cp["step_accuracy"][j], single["step_accuracy"][j]))
    worst = max(range(len(rel_diff)), key=rel_diff.__getitem__)
    n = min(10, max(1, steps // 5))
    first = sum(cp["step_accuracy"][0][:n]) / n
    last = sum(cp["step_accuracy"][0][-n:]) / n
    failures = []
    if rel_diff[worst] > REL_TOL:
        failures.append(f"CP loss left the one-process loss: relative difference "
                        f"{rel_diff[worst]:.3e} at step {worst + 1} > {REL_TOL:g}")
    if acc_diff > ACC_TOL:
        failures.append(f"CP accuracy differs from one process by {acc_diff:.3f} > {ACC_TOL}")
    judged = steps >= LEARN_STEPS
    if judged and not last >= LEARN_RATIO * first:
        failures.append(f"the draft did not learn: step-0 accuracy {first:.3f} -> {last:.3f}, "
                        f"not {LEARN_RATIO}x")
    if judged and not accepted["trained"] > accepted["untrained"]:
        failures.append(f"the exported draft accepts {accepted['trained']:.2f} tokens per round, "
                        f"no more than an untrained one ({accepted['untrained']:.2f})")
    result = {
        "config": cp["config"], "world": world,
        "cp_loss": cp["loss"], "single_loss": single["loss"], "rel_diff": rel_diff,
        "cp_accuracy": cp["step_accuracy"], "single_accuracy": single["step_accuracy"],
        "cp_step_loss": cp["step_loss"], "single_step_loss": single["step_loss"],
        "max_rel_diff": rel_diff[worst], "max_rel_diff_step": worst + 1,
        "max_acc_diff": acc_diff, "tolerance": REL_TOL,
        "accuracy_step0_first": first, "accuracy_step0_last": last,
        "accepted_per_round": accepted,
        "learning_judged": judged, "learn_steps": LEARN_STEPS,
        "shard_ranges": cp["shard_ranges"],
        **run_costs(cp, single, t0),
        "failures": failures,
    }
    chat = run_chat_demo(world, out_dir, verbose=verbose)
    result["chat"] = chat
    if not chat["generation_ok"]:
        failures.append("speculative decoding with the chat-trained draft did not reproduce "
                        "the target's greedy tokens")
    save_result(result, out_dir, "eagle3", _plot)
    if verbose:
        print(f"{'step':>5}  {'CP loss':>10}  {'one-process':>11}  {'rel diff':>9}  "
              f"{'acc j=0 CP':>10}  {'acc j=6 CP':>10}")
        for i in sorted(set(range(0, steps, 10)) | {steps - 1}):
            print(f"{i + 1:>5}  {cp['loss'][i]:>10.6f}  {single['loss'][i]:>11.6f}  "
                  f"{rel_diff[i]:>9.2e}  {cp['step_accuracy'][0][i]:>10.3f}  "
                  f"{cp['step_accuracy'][-1][i]:>10.3f}")
        print(f"largest relative loss difference {rel_diff[worst]:.2e} (step {worst + 1}), "
              f"largest accuracy difference {acc_diff:.3f}; step-0 accuracy {first:.3f} -> "
              f"{last:.3f}; CP {cp['seconds']:.1f}s, one process {single['seconds']:.1f}s; "
              f"wrote {os.path.join(out_dir, 'eagle3.json')} and eagle3.png")
        print(f"speculative decoding with the exported draft ({out_dir}/draft-sglang, and "
              f"draft-speculators for vLLM): {accepted['trained']:.2f} tokens per target "
              f"forward (untrained draft: {accepted['untrained']:.2f}; {accepted['rounds']} "
              f"rounds of {DRAFT_LEN} proposals); output = the target's greedy generation")
    return result


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
