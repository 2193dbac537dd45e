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
    fig = plt.figure(figsize=(8, 12), layout="constrained")
    curves, by_position = fig.subfigures(2, 1, height_ratios=[5.4, 2.2])
    ax_loss, ax_acc, ax_diff = curves.subplots(
        3, 1, sharex=True, gridspec_kw={"height_ratios": [2, 2, 1.2]})
    ax_pos = by_position.subplots()
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
    _plot_by_position(ax_pos, result["accepted_per_round"], cfg["seqlen"])
    ax_loss.set_title(
        f"Eagle3 draft (transformers Llama target), S={cfg['seqlen']}, {t} TTT steps, "
        f"layout={cfg['layout']}\nCP on {world} gloo ranks vs one process, same seed and "
        f"batches", fontsize="medium")
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _fmt(x) -> str:
    """A bucket's number, 2 decimals; "-" for a bucket without rounds."""
    return "-" if x is None else f"{x:.2f}"


def _plot_by_position(ax, accepted: dict, seqlen: int) -> None:
    """Bars: mean tokens per round (accepted + 1) of the trained and the untrained draft in
    each bucket of speculation start positions, the trained draft's rounds written above."""
    trained, untrained = (accepted["by_position"][k] for k in ("trained", "untrained"))
    x = range(len(trained))
    for shift, buckets, color, name in ((-0.2, trained, "tab:blue", "exported draft"),
                                        (0.2, untrained, "tab:gray", "untrained draft")):
        heights = [b["mean_accepted_per_round"] or 0.0 for b in buckets]
        ax.bar([i + shift for i in x], heights, width=0.38, color=color, label=name)
    for i, b in zip(x, trained):
        ax.annotate(f"{_fmt(b['mean_accepted_per_round'])}\n{b['rounds']} rounds",
                    (i - 0.2, b["mean_accepted_per_round"] or 0.0), ha="center",
                    va="bottom", fontsize="x-small")
    top = max([b["mean_accepted_per_round"] or 0.0 for b in trained + untrained] + [1.0])
    ax.set_ylim(0, top * 1.35)
    ax.axhline(1.0, color="tab:red", ls=":", lw=1, label="nothing accepted (1 token)")
    ax.set_xticks(list(x), [b["label"] for b in trained])
    ax.set_xlabel("position where the speculation starts (verified tokens before the round)")
    ax.set_ylabel("tokens per round")
    ax.legend(fontsize="small", loc="lower right")
    ax.grid(alpha=0.3, axis="y")
    ax.set_title(
        f"speculative decoding, {accepted['draft_len']} proposals per round, by start position "
        f"(demo buckets: S={seqlen} rows fill\nonly the default buckets' first, [0, 1024)); "
        f"{accepted['new_tokens']} new tokens after each of {accepted['prompts']} prompts of "
        f"{min(accepted['prompt_lengths'])}..{max(accepted['prompt_lengths'])} tokens",
        fontsize="small")


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

PROMPT_LENGTHS = tuple(range(8, 240, 15))
"""The 16 prompts' lengths (random tokens, as trained on): spread over the trained S=250."""

NEW_TOKENS = 11
"""Tokens generated per prompt: at least 2 rounds, 10 when nothing is accepted."""

BUCKETS = (0, 64, 128, 192)
"""The demo's context-position buckets: its rows are 250 tokens, which fill only
``evaluate.DEFAULT_BUCKETS``' first bucket, [0, 1024)."""


def _acceptance(cfg: Eagle3Config, out_dir: str) -> dict:
    """Mean tokens per verification round of speculative decoding with the CP run's exported
    draft (loaded back from ``out_dir/draft-sglang``) and with an untrained draft, overall
    and per bucket of ``BUCKETS`` (where a round's speculation starts), over ``NEW_TOKENS``
    generated after each of 16 prompts of ``PROMPT_LENGTHS`` from the training distribution
    (random tokens)."""
    import torch

    from ..eagle3.evaluate import acceptance
    from ..eagle3.export import load_draft
    from .eagle3_train import _draft_ids, build_draft, build_target

    target = build_target(cfg, "sdpa")
    trained = load_draft(os.path.join(out_dir, "draft-sglang"),
                         embed_tokens=target.get_input_embeddings().weight.detach())
    untrained = build_draft(cfg, target, _draft_ids(cfg, target, None))
    prompts = [torch.randint(cfg.vocab, (n,), generator=torch.Generator().manual_seed(100 + n))
               for n in PROMPT_LENGTHS]
    result = {"prompts": len(prompts), "prompt_lengths": list(PROMPT_LENGTHS),
              "new_tokens": NEW_TOKENS, "draft_len": DRAFT_LEN, "buckets": list(BUCKETS),
              "rounds": {}, "acceptance_rate": {}, "by_position": {}}
    for name, draft in (("trained", trained), ("untrained", untrained)):
        res = acceptance(target, draft.eval(), prompts, max_new_tokens=NEW_TOKENS,
                         draft_len=DRAFT_LEN, buckets=BUCKETS)
        result[name] = res["mean_accepted_per_round"]
        result["rounds"][name] = res["rounds"]
        result["acceptance_rate"][name] = res["acceptance_rate"]
        result["by_position"][name] = res["by_position"]
    return result


def run_eagle3_demo(world: int = 2, steps: int = Eagle3Config.steps, out_dir: str = "demo_out",
                    layout: str = "zigzag", seqlen: int = Eagle3Config.seqlen, *,
                    verbose: bool = True) -> dict:
    """Train the draft under CP on ``world`` CPU ranks and in one process; compare.

    Returns:
        dict with ``config``, ``world``, per-step ``cp_loss``, ``single_loss``,
        ``rel_diff``, per-TTT-step accuracy lists ``cp_accuracy``/``single_accuracy``,
        ``max_rel_diff``, ``max_acc_diff``, ``tolerance``, ``shard_ranges``, ``seconds``,
        ``tokens_per_s``, ``peak_rss_mib``, ``accepted_per_round`` (speculative decoding
        with the exported and an untrained draft: ``trained``, ``untrained`` tokens per
        round, ``rounds``, ``acceptance_rate`` and ``by_position``, each per draft, the last
        ``evaluate.by_position``'s buckets of ``BUCKETS``), ``chat`` and ``failures`` (empty
        on success; the learning check applies to runs of at least ``LEARN_STEPS`` steps:
        ``learning_judged``). Also written to ``out_dir/eagle3.json``, with the plot
        ``out_dir/eagle3.png``.

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
              f"forward (untrained draft: {accepted['untrained']:.2f}; "
              f"{accepted['rounds']['trained']} rounds of {DRAFT_LEN} proposals, "
              f"{NEW_TOKENS} new tokens after each of {accepted['prompts']} prompts of "
              f"{PROMPT_LENGTHS[0]}..{PROMPT_LENGTHS[-1]} tokens); output = the target's "
              f"greedy generation\nby where the speculation starts: " + "; ".join(
                  f"{t['label']} {_fmt(t['mean_accepted_per_round'])} (untrained "
                  f"{_fmt(u['mean_accepted_per_round'])}, {t['rounds']} rounds)"
                  for t, u in zip(accepted["by_position"]["trained"],
                                  accepted["by_position"]["untrained"])))
    return result


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
