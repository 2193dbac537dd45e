"""SpecForge's own Eagle3 trainer with ringattn as its context-parallel attention
(``ringattn.integrations.specforge``), against SpecForge's own one-process training.

``make test-specforge`` runs these (SpecForge 0.2.0 installed --no-deps into
``.venv-specforge``, beside torch 2.13 and transformers 5.24); in other venvs they are
skipped. On a tiny random Llama target, offline features of lengths 37, 29, 45, 23, 41, 33,
50, 27 (batches of 2 right-padded rows, T = the longer row, never a multiple of 2W), a
one-layer fp32 draft, TTT length 3, DDP (``fsdp_sharding: NO_SHARD``), AdamW at 1e-4, six
optimizer steps, CPU gloo:

* the reference is SpecForge's ``specforge train`` worker path on one rank (its registry,
  ``init_distributed``, ``build_application_run``: offline reader, collator, TargetHead,
  ``OnlineEagle3Model`` with the sdpa draft, ``Eagle3TrainStrategy``, BF16Optimizer), with
  its Triton loss replaced by SpecForge's own torch reference of it (no GPU driver here);
* the CP run is the same config with the draft config naming RingLlamaForCausalLMEagle3,
  built by ``ringattn.integrations.specforge.build`` on W ranks (CP group = all W);
* asserted: every step's logged loss, per-step losses, accuracies and grad norm, every draft
  gradient (recorded before clipping, after DDP) and the final weights equal the reference
  to 1e-5 relative; refusals raise the same error on every rank.

Both sides run with TORCHDYNAMO_DISABLE=1 (SpecForge compiles some helpers; compiled and
eager differ by ~5e-7, which AdamW would carry from step to step).
"""

import os
import subprocess
import sys

import pytest

try:  # (a bare "import specforge" would find this tests/specforge folder)
    import specforge.config  # noqa: F401
except ImportError:
    pytest.skip("make test-specforge runs these (SpecForge in its own venv, .venv-specforge)",
                allow_module_level=True)

import torch  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
RUN = os.path.join(HERE, "specforge_run.py")
TOL = 1e-5


def _run(*args, timeout=600):
    env = dict(os.environ, TORCHDYNAMO_DISABLE="1", PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, RUN, *map(str, args)], env=env, timeout=timeout,
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return proc


@pytest.fixture(scope="module")
def work(tmp_path_factory):
    work = tmp_path_factory.mktemp("specforge")
    _run("fixture", work)
    _run("reference", work, work / "reference.pt")
    return work


def _rel(a, b) -> float:
    a, b = torch.as_tensor(a, dtype=torch.float64), torch.as_tensor(b, dtype=torch.float64)
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


@pytest.mark.timeout(600)
@pytest.mark.parametrize("world,layout,strategy", [(2, "zigzag", "ring"), (3, "zigzag", "ring"),
                                                   (3, "contiguous", "ring"),
                                                   (2, "zigzag", "ulysses")])
def test_specforge_trainer_under_cp_equals_its_one_process_training(work, world, layout,
                                                                     strategy):
    out = work / f"ring-w{world}-{layout}-{strategy}.pt"
    _run("ring", work, out, "--world", world, "--layout", layout, "--strategy", strategy)
    _compare(torch.load(out), torch.load(work / "reference.pt"), f"W={world} {layout} {strategy}")


def _compare(cp, ref, label):
    assert len(ref["logs"]) == len(cp["logs"]) == len(ref["grads"]) == len(cp["grads"]) == 6
    worst = {"loss": 0.0, "metric": 0.0, "grad": 0.0}
    for i, (m, r) in enumerate(zip(cp["logs"], ref["logs"])):
        loss = _rel(m["loss"], r["loss"])
        metric = max(_rel(m[k], r[k]) for k in r
                     if k.startswith(("ploss_", "acc", "grad_norm")) and r[k] != 0)
        assert all(m[k] == r[k] for k in r if k.startswith("acc") and r[k] == 0)
        assert cp["grads"][i].keys() == ref["grads"][i].keys()
        grad = max(_rel(cp["grads"][i][k], ref["grads"][i][k]) for k in ref["grads"][i])
        print(f"[{label}] step {i + 1}: loss {m['loss']:.7f} (reference {r['loss']:.7f}, rel "
              f"{loss:.1e}), worst metric rel {metric:.1e}, worst gradient rel {grad:.1e}")
        assert loss <= TOL and metric <= TOL and grad <= TOL, (i, loss, metric, grad)
        worst = {"loss": max(worst["loss"], loss), "metric": max(worst["metric"], metric),
                 "grad": max(worst["grad"], grad)}
    weights = max(_rel(cp["final"][k], ref["final"][k]) for k in ref["final"])
    print(f"[{label}] worst over 6 steps: loss {worst['loss']:.1e}, metrics "
          f"{worst['metric']:.1e}, gradients {worst['grad']:.1e}; final weights {weights:.1e}")
    assert weights <= TOL


@pytest.mark.timeout(600)
def test_compact_teacher_under_cp_equals_its_one_process_training(work):
    """SpecForge's own compact teacher (``training.compact_teacher: true``: the teacher from
    the target's hidden states in vocabulary chunks of 5, never the [T, V] logits) on each
    rank's collated rows, W = 3, against SpecForge's one-process run with the same option."""
    _run("reference", work, work / "reference-compact.pt", "--compact")
    _run("ring", work, work / "ring-w3-compact.pt", "--world", 3, "--compact")
    _compare(torch.load(work / "ring-w3-compact.pt"), torch.load(work / "reference-compact.pt"),
             "W=3 zigzag ring, compact teacher")


@pytest.mark.timeout(600)
def test_dp_by_cp_equals_specforge_data_parallel_training(work):
    """4 ranks as 2 DP replicas x CP 2 (``--cp-size 2``) against SpecForge's own training on
    2 DP ranks without CP: the same samples per replica, the same losses (SpecForge reduces
    them over the world), gradients and weights."""
    _run("reference", work, work / "reference-dp2.pt", "--world", 2)
    _run("ring", work, work / "ring-w4-cp2.pt", "--world", 4, "--cp-size", 2)
    _compare(torch.load(work / "ring-w4-cp2.pt"), torch.load(work / "reference-dp2.pt"),
             "W=4 = DP 2 x CP 2, zigzag ring, vs SpecForge DP 2")


@pytest.mark.timeout(600)
def test_refusals_raise_the_same_error_on_every_rank(work):
    world = 2
    _run("refusals", work, work / "refusals", "--world", world)
    seen = [torch.load(f"{work}/refusals.{r}") for r in range(world)]
    assert seen[0] == seen[1], seen
    expected = {"flex_attention backend": "attention_backend",
                "striped layout": "striped", "stock architecture": "RingLlamaForCausalLMEagle3",
                "cp size not dividing the world": "--cp-size 3 must divide",
                "left padding": "right-padded"}
    assert seen[0].keys() == expected.keys()
    for case, words in expected.items():
        assert seen[0][case] is not None and seen[0][case].startswith("ValueError") and \
            words in seen[0][case], (case, seen[0][case])


@pytest.mark.timeout(600)
def test_cp_trained_draft_exports_with_specforge_and_loads_in_ringattn(work):
    """The CP run's last checkpoint, exported by SpecForge's own ``specforge export --to
    sglang`` (given a copy of the draft config naming SpecForge's architecture, as
    docs/specforge.md says), holds the CP run's final weights, and ringattn's ``load_draft``
    reads it."""
    import json

    from safetensors.torch import load_file

    from ringattn.eagle3 import load_draft

    run = work / "ring-w2-zigzag-ring"
    out = work / "ring-w2-zigzag-ring.pt"
    if not out.exists():
        _run("ring", work, out, "--world", 2)
    (checkpoint,) = (run / "out").glob("*-step6")
    config = json.loads((run / "draft_config.json").read_text())
    config["architectures"] = ["LlamaForCausalLMEagle3"]
    del config["ringattn"]
    (work / "export_config.json").write_text(json.dumps(config))
    env = dict(os.environ, PYTHONWARNINGS="ignore")
    proc = subprocess.run([sys.executable, "-m", "specforge.cli", "export", "--to", "sglang",
                           "--checkpoint", str(checkpoint), "--draft-config",
                           str(work / "export_config.json"), "--output-dir",
                           str(work / "exported")], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    exported = load_file(str(work / "exported" / "model.safetensors"))
    final = torch.load(out)["final"]
    trained = {k: v for k, v in final.items() if k in exported}
    assert trained and set(final) - set(trained) <= {"embed_tokens.weight"}, set(final) ^ set(exported)
    for name, weight in trained.items():  # (SpecForge's SGLang export is in its dtype, bf16)
        assert torch.equal(exported[name], weight.to(exported[name].dtype)), name
    index = json.loads((work / "target" / "model.safetensors.index.json").read_text())
    shard = index["weight_map"]["model.embed_tokens.weight"]
    embedding = load_file(str(work / "target" / shard))["model.embed_tokens.weight"]
    draft = load_draft(work / "exported", embed_tokens=embedding)
    ours = list(draft.state_dict().values())
    for name in trained:
        assert any(t.shape == exported[name].shape and
                   torch.equal(t.to(exported[name].dtype), exported[name]) for t in ours), name
    print(f"exported by SpecForge ({exported['fc.weight'].dtype}) and loaded by "
          f"ringattn: {len(trained)} trained tensors, each the CP run's final weight")
