"""``ringattn train`` as users start it: under torchrun, on spawned ranks, in one process.

The app trains through transformers' Trainer: ``RingTrainer`` on the ranks, a plain
``Trainer`` in one process. One module fixture makes every run once (starting transformers
costs more than the runs): four multi-rank runs and their one-process references, each
with a checkpoint at every step. The CP runs must equal one process (the ``--attn eager``
or ``sdpa`` run of the same options) within 1e-5 relative in fp32: the loss of every step
and the gradient of every parameter (the first step's, read from the checkpoint's AdamW
``exp_avg``, which is 0.1 x the gradient after one step). Later weights are not compared
across the two: Adam's first steps move a weight by about lr x sign(gradient), so a
gradient that is rounding-sized (a near-cancelled sum) moves its weight by a different
lr-sized amount in each run (measured: 4e-4 of a tensor's largest weight after one step),
while the loss stays within 1e-7. A resumed run repeats the arithmetic of the run it
resumes, so its weights are compared.

* ``cp2``: torchrun, W=2, ring, zigzag, bytes of a text file, S=37 (2W=4 does not divide it),
  three steps;
* ``resumed``: torchrun, W=2, ``--resume`` from ``cp2``'s checkpoint of step 1: steps 2
  and 3 must repeat ``cp2``'s (losses and final weights, optimizer state);
* ``cp3``: ``ringattn train --world 3`` (spawned ranks), ``--model`` a directory saved by
  ``save_pretrained`` (loaded with its weights), strategy auto, contiguous layout, S=37,
  the copy task;
* ``cp4``: torchrun, W=4, hybrid (2 ring x 2 Ulysses), ``--model`` a directory with only a
  Qwen2 config (a sliding-window layer and a full one: random weights from the seed); its
  reference reads the same config as a ``config.json`` path.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ringattn.apps import cli

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/
from models import tiny_causal_lm  # noqa: E402
from reference import rel_err  # noqa: E402

TEXT = b"It was the best of times, it was the worst of times, it was the age of wisdom. " * 8
ARGS = ["--seqlen", "37", "--batch", "2", "--no-progress", "--save-steps", "1"]
TOL = 1e-5
TORCHRUN = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node"]
TRAIN = ["-m", "ringattn.apps.train"]


class _Launch:
    """A multi-rank command started now; ``failure()`` waits for it: its output tail, or
    None when it exited 0."""

    def __init__(self, cmd, cwd):
        env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)

    def failure(self) -> str | None:
        try:
            out, err = self.proc.communicate(timeout=420)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            out, err = self.proc.communicate()
            return f"timed out after 420 s: {self.cmd}\n{out[-3000:]}\n{err[-6000:]}"
        return None if self.proc.returncode == 0 else out[-3000:] + err[-6000:]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(directory, {run: failure or None}): the CP runs and, in this process through
    ``ringattn train --attn eager|sdpa``, their one-process references (``<run>_ref``).
    Runs that do not depend on each other overlap (each is mostly one core's work)."""
    out = tmp_path_factory.mktemp("train")
    text = out / "text.txt"
    text.write_bytes(TEXT)
    tiny_causal_lm("llama", "eager").save_pretrained(out / "saved")
    tiny_causal_lm("qwen2-sliding", "eager").config.save_pretrained(out / "config")
    cp2 = ["--data", str(text), "--steps", "3", *ARGS]
    cp3 = ["--model", str(out / "saved"), "--steps", "2", *ARGS]
    failures = {}
    cp2_run = _Launch([*TORCHRUN, "2", *TRAIN, *cp2, "--out", "cp2"], out)
    try:
        for name, argv in (("cp2", [*cp2, "--attn", "eager"]),
                           ("cp3", [*cp3, "--attn", "eager"]),
                           ("cp4", ["--model", str(out / "config" / "config.json"), "--steps",
                                    "2", *ARGS, "--attn", "sdpa"])):
            assert cli.main(["train", *argv, "--out", str(out / f"{name}_ref")]) == 0
    finally:
        failures["cp2"] = cp2_run.failure()
    resumed = _Launch([*TORCHRUN, "2", *TRAIN, *cp2, "--out", "resumed", "--resume",
                       str(out / "cp2" / "checkpoint-1")], out)
    cp3_run = _Launch([sys.executable, "-m", "ringattn.apps.cli", "train", "--world", "3", *cp3,
                       "--strategy", "auto", "--layout", "contiguous", "--out", "cp3"], out)
    failures["resumed"], failures["cp3"] = resumed.failure(), cp3_run.failure()
    failures["cp4"] = _Launch([*TORCHRUN, "4", *TRAIN, "--model", str(out / "config"), "--steps",
                               "2", *ARGS, "--strategy", "hybrid", "--ulysses", "2", "--out",
                               "cp4"], out).failure()
    return out, failures


def _run(runs, name) -> tuple[Path, dict]:
    out, failures = runs
    path = out / name / "train.json"
    if not path.exists():
        pytest.fail(f"run {name} wrote no train.json:\n{failures.get(name)}")
    return out / name, json.loads(path.read_text())


def _checkpoint(run_dir: Path, step: int) -> tuple[dict, dict]:
    """(the weights, the AdamW state by parameter name) of a run's checkpoint."""
    from safetensors.torch import load_file

    ck = run_dir / f"checkpoint-{step}"
    weights = load_file(ck / "model.safetensors")
    state = torch.load(ck / "optimizer.pt", weights_only=False)["state"]
    return weights, state


def _assert_losses(worst_errors, name, got, want):
    assert len(got) == len(want), (name, got, want)
    for step, (a, b) in enumerate(zip(got, want)):
        err = abs(a - b) / abs(b)
        worst_errors[("train", "loss")] = (max(worst_errors.get(("train", "loss"), (0, TOL))[0],
                                                err), TOL)
        assert err <= TOL, f"{name} step {step + 1}: loss {a} vs one process {b} ({err:.2e})"


@pytest.mark.timeout(900)
@pytest.mark.parametrize("name,world,strategy,model", [
    ("cp2", 2, "ring", "LlamaForCausalLM"), ("cp3", 3, "auto", "LlamaForCausalLM"),
    ("cp4", 4, "hybrid", "Qwen2ForCausalLM")])
def test_cp_run_equals_one_process(runs, worst_errors, name, world, strategy, model):
    """Every step's loss and the first step's gradient of every parameter (the AdamW
    state of checkpoint-1: exp_avg = 0.1 x gradient) equal the one-process run's."""
    cp_dir, got = _run(runs, name)
    ref_dir, want = _run(runs, f"{name}_ref")
    assert got["world"] == world and got["attn"] == "ringattn" and want["world"] == 1
    assert got["config"]["strategy"] == strategy and got["model"]["class"] == model
    assert got["model"] == want["model"] and len(got["peak_rss_mib"]) == world
    assert (cp_dir / "loss.png").stat().st_size > 10_000
    assert set(got) >= {"accuracy", "tokens_per_s", "seconds", "rss_start_mib"}
    for key in ("loss", *(["copy_loss"] if name != "cp2" else [])):
        _assert_losses(worst_errors, f"{name} {key}", got[key], want[key])
    # next-token accuracy: at most one of the B * (S - 1) targets on the other side of a tie
    cfg = got["config"]
    one = 1 / (cfg["batch"] * (cfg["seqlen"] - 1))
    assert all(abs(a - b) <= one for a, b in zip(got["accuracy"], want["accuracy"], strict=True))
    steps = got["config"]["steps"]
    assert sorted(p.name for p in cp_dir.glob("checkpoint-*")) == [
        f"checkpoint-{k}" for k in range(1, steps + 1)]
    weights, state = _checkpoint(cp_dir, 1)
    ref_weights, ref_state = _checkpoint(ref_dir, 1)
    assert weights.keys() == ref_weights.keys() and state.keys() == ref_state.keys()
    assert len(state) == len(ref_state) > 0
    for i in ref_state:
        err = rel_err(state[i]["exp_avg"], ref_state[i]["exp_avg"])
        worst_errors[("train", "grad")] = (max(worst_errors.get(("train", "grad"), (0, TOL))[0],
                                                err), TOL)
        assert err <= TOL, f"{name}: step-1 gradient of parameter {i}: relative error {err:.2e}"


@pytest.mark.timeout(900)
def test_resumed_run_repeats_the_uninterrupted_one(runs, worst_errors):
    """Resumed at step 1 of 3: the losses of steps 2 and 3 (and the curves of step 1, from
    the checkpoint), the final weights and the optimizer state are the uninterrupted run's."""
    run_dir, got = _run(runs, "resumed")
    full_dir, want = _run(runs, "cp2")
    assert got["resumed_at"] == 1 and want["resumed_at"] == 0
    assert got["loss"][0] == want["loss"][0]  # the step before the checkpoint, recorded in it
    _assert_losses(worst_errors, "resumed", got["loss"], want["loss"])
    assert sorted(p.name for p in run_dir.glob("checkpoint-*")) == ["checkpoint-2",
                                                                    "checkpoint-3"]
    weights, state = _checkpoint(run_dir, 3)
    full_weights, full_state = _checkpoint(full_dir, 3)
    for key, w in full_weights.items():
        err = rel_err(weights[key], w)
        assert err <= TOL, f"resumed final weight {key}: relative error {err:.2e}"
    for i, s in full_state.items():
        for key in ("exp_avg", "exp_avg_sq"):
            err = rel_err(state[i][key], s[key])
            assert err <= TOL, f"resumed {key} of parameter {i}: relative error {err:.2e}"
        assert float(state[i]["step"]) == float(s["step"]) == 3


def test_model_directory_is_loaded_with_its_weights(runs):
    """``--model`` a saved directory trains the saved weights: the first step's loss is the
    saved model's own on the first batch (random weights would not give it)."""
    from transformers import AutoModelForCausalLM

    from ringattn.apps.train import TrainConfig, make_batches

    out, _ = runs
    _, got = _run(runs, "cp3_ref")
    model = AutoModelForCausalLM.from_pretrained(out / "saved", attn_implementation="eager")
    ids = next(make_batches(TrainConfig(**{k: got["config"][k] for k in ("steps", "seqlen",
                                                                         "batch", "seed")})))
    with torch.no_grad():
        loss = float(model(input_ids=ids, labels=ids).loss)
    assert abs(got["loss"][0] - loss) <= TOL * loss, (got["loss"][0], loss)
    assert got["model"]["parameters"] == sum(p.numel() for p in model.parameters())


def test_one_process_run_prints_its_summary(runs):
    out, _ = runs
    _, got = _run(runs, "cp2_ref")
    assert got["world"] == 1 and got["attn"] == "eager" and len(got["loss"]) == 3
    assert (out / "cp2_ref" / "loss.png").stat().st_size > 10_000


@pytest.mark.timeout(240)
def test_eagle3_under_torchrun_dp_x_cp_equals_one_process(tmp_path):
    """``python -m ringattn.apps.eagle3_train`` under torchrun on 4 ranks, dp 2 x cp 2, S = 61:
    the per-step losses and accuracies of one process on both replicas' rows."""
    from ringattn.apps.eagle3_train import Eagle3Config, train_eagle3

    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "4",
           "-m", "ringattn.apps.eagle3_train", "--dp", "2", "--steps", "2", "--seqlen", "61",
           "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=200, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    for r, held in enumerate(["[0, 16) + [48, 61)", "[16, 48)"] * 2):
        assert f"rank {r} (dp {r // 2}, cp {r % 2}) holds {held}" in proc.stdout
    got = json.loads((out / "eagle3.json").read_text())
    assert got["cp"] == 2 and got["dp"] == 2 and len(got["peak_rss_mib"]) == 4
    assert (out / "eagle3.png").stat().st_size > 10_000
    want = train_eagle3(Eagle3Config(steps=2, seqlen=61, dp=2), progress=False)
    for step, (a, b) in enumerate(zip(got["loss"], want["loss"], strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)
    assert got["step_accuracy"] == want["step_accuracy"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("argv,torchrun_world,named", [
    (["--world", "3", "--strategy", "hybrid", "--ulysses", "2"], None,
     "ulysses=2 to divide the world of 3"),
    (["--strategy", "hybrid", "--ulysses", "2"], "3", "ulysses=2 to divide the world of 3"),
    (["--world", "3", "--ulysses", "2"], None, "--ulysses applies only with --strategy hybrid"),
    (["--world", "0"], None, "argument --world: must be an int >= 1, got 0"),
    (["--save-steps", "-1"], None, "argument --save-steps: must be an int >= 0, got -1"),
    (["--data", "{out}/missing.txt"], None, "data='{out}/missing.txt' is not a file"),
    (["--model", "{out}/nowhere"], None, "model='{out}/nowhere' does not exist"),
    (["--model", "{out}/cp2"], None, "model='{out}/cp2' is a directory without a config.json"),
    (["--model", "{out}/saved", "--hidden", "32"], None,
     "hidden=32 sizes the built-in model; with model='{out}/saved' its config sets the sizes"),
    (["--model", "{out}/saved", "--data", "{out}/text.txt"], None,
     "model='{out}/saved' has vocab_size 97, fewer than the 256 tokens of byte-level text"),
    (["--model", "{out}/saved", "--seqlen", "300"], None,
     "model='{out}/saved' has max_position_embeddings 256, below seqlen=300"),
    (["--model", "{out}/text.txt"], None, "model='{out}/text.txt': transformers cannot read"),
    (["--resume", "{out}/cp2"], None, "resume='{out}/cp2' is not a checkpoint of ringattn train"),
    (["--resume", "{out}/cp2/checkpoint-1", "--data", "{out}/text.txt", "--steps", "3",
      "--seqlen", "40"], None, "resume='{out}/cp2/checkpoint-1' was written with another "
     "configuration: seqlen=37 (now 40)"),
    (["--resume", "{out}/cp2/checkpoint-3", "--data", "{out}/text.txt", "--steps", "3"], "2",
     "resume='{out}/cp2/checkpoint-3' is at step 3, not before the last of steps=3"),
    (["--model", "{out}/cp2_ref/checkpoint-1", "--data", "{out}/text.txt", "--steps", "3",
      "--resume", "{out}/cp2/checkpoint-1"], None,
     "was written with another configuration: model=None (now '{out}/cp2_ref/checkpoint-1')"),
])
def test_cli_refuses_arguments_before_spawning(runs, monkeypatch, capsys, argv, torchrun_world,
                                               named):
    """Arguments that cannot run exit with status 2 and one line naming them, before any
    rank is spawned or joins a group (``--world 3 --strategy hybrid --ulysses 2`` once
    failed after 45 s of spawning with a 40-line traceback)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    out, _ = runs

    def started(*args, **kwargs):
        raise AssertionError("a rank was started before the arguments were checked")

    monkeypatch.setattr(mp, "spawn", started)
    monkeypatch.setattr(dist, "init_process_group", started)
    if torchrun_world is not None:
        monkeypatch.setenv("WORLD_SIZE", torchrun_world)
    else:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    argv = [a.format(out=out) for a in argv]
    base = ["--seqlen", "37", "--batch", "2", "--no-progress"]
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", *base, *argv])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named.format(out=out) in err and len(err.strip().splitlines()) == 1, err


@pytest.mark.timeout(60)
def test_demo_refuses_a_bad_world_before_spawning(monkeypatch, capsys):
    import torch.multiprocessing as mp

    def started(*args, **kwargs):
        raise AssertionError("a rank was started before the arguments were checked")

    monkeypatch.setattr(mp, "spawn", started)
    with pytest.raises(SystemExit) as exc:
        cli.main(["demo", "--target", "lm", "--world", "0"])
    assert exc.value.code == 2
    assert "argument --world: must be an int >= 1, got 0" in capsys.readouterr().err


@pytest.mark.timeout(60)
@pytest.mark.parametrize("torchrun", [False, True])
def test_eagle3_cli_refuses_a_world_that_dp_does_not_divide(monkeypatch, capsys, torchrun):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    from ringattn.apps import eagle3_train

    def started(*args, **kwargs):
        raise AssertionError("a rank was started before the arguments were checked")

    monkeypatch.setattr(mp, "spawn", started)
    monkeypatch.setattr(dist, "init_process_group", started)
    if torchrun:
        monkeypatch.setenv("LOCAL_RANK", "0")
        monkeypatch.setenv("WORLD_SIZE", "3")
    else:
        monkeypatch.delenv("LOCAL_RANK", raising=False)
    with pytest.raises(SystemExit) as exc:
        eagle3_train.main(["--world", "3", "--dp", "2", "--steps", "1"])
    assert exc.value.code == 2
    assert "does not split into dp=2" in capsys.readouterr().err


@pytest.mark.timeout(300)
def test_train_converts_a_hybrid_model(tmp_path):
    """``ringattn train --model`` a hybrid's config (Qwen3-Next: gated delta net + attention)
    converts it under ring attention: its losses equal one process's (``--attn eager``),
    where before the model was refused for its unconverted mixers."""
    from families import FAMILIES

    config, _ = FAMILIES["qwen3_next"]()
    config.save_pretrained(tmp_path / "qwen3_next")
    argv = ["--model", str(tmp_path / "qwen3_next"), "--steps", "2", "--seqlen", "37",
            "--batch", "2", "--no-progress"]
    run = _Launch([sys.executable, "-m", "ringattn.apps.cli", "train", "--world", "2", *argv,
                   "--out", "cp"], tmp_path)
    assert cli.main(["train", *argv, "--attn", "eager", "--out", str(tmp_path / "ref")]) == 0
    failure = run.failure()
    assert failure is None, failure
    got = json.loads((tmp_path / "cp" / "train.json").read_text())["loss"]
    want = json.loads((tmp_path / "ref" / "train.json").read_text())["loss"]
    assert len(got) == len(want) == 2
    for a, b in zip(got, want):
        assert abs(a - b) <= TOL * abs(b), (got, want)


def _rank_pids(launcher: int) -> list[int]:
    """The ranks ``torch.multiprocessing.spawn`` started from ``launcher`` (Linux /proc)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if int(stat.rsplit(")", 1)[1].split()[1]) == launcher and b"spawn_main" in cmdline:
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie, exited but not yet reaped, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.timeout(150)
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
@pytest.mark.parametrize("how", ["SIGKILL", "SIGTERM"])
def test_ranks_die_with_their_launcher(tmp_path, how):
    """Killing ``python -m ringattn.apps.train --world 2`` while its ranks train ends the
    ranks within seconds. They once ran on: torch asks for SIGINT at the launcher's death,
    which a launcher started in the background (a shell starts it with SIGINT ignored, as
    here) passes on ignored, and which cannot interrupt a rank waiting in a collective."""
    import signal

    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    launcher = subprocess.Popen(
        [sys.executable, *TRAIN, "--world", "2", "--steps", "100000", "--seqlen", "8",
         "--log-every", "1", "--out", "out"], cwd=tmp_path, env=env, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
    ranks = []
    try:
        for line in launcher.stdout:  # rank 0 logs each step: both ranks are training
            if "step 1/" in line:
                break
        ranks = _rank_pids(launcher.pid)
        assert len(ranks) == 2, ranks
        launcher.send_signal(getattr(signal, how))
        launcher.wait(timeout=30)
        deadline = time.monotonic() + 10
        while any(map(_alive, ranks)) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(map(_alive, ranks)), f"ranks {ranks} outlived their launcher ({how})"
    finally:
        for pid in [launcher.pid, *ranks]:  # what this test started, should it fail
            if _alive(pid):
                os.kill(pid, signal.SIGKILL)
        launcher.stdout.close()
        launcher.wait()


@pytest.mark.timeout(400)
def test_train_builds_and_converts_falcon_and_gpt_neo(tmp_path):
    """``ringattn train --model`` a Falcon or a GPT-Neo config trains under ring attention
    (their constructors take no registered attention name: the program builds them "eager"
    and ``ra_hf.convert`` puts ring attention in their modules): the losses equal one
    process's. Both were refused with advice to call ``convert``, a Python function."""
    from families import FAMILIES

    argv = ["--steps", "2", "--seqlen", "37", "--batch", "2", "--no-progress"]
    runs = {}
    for name in ("falcon", "gpt_neo"):
        config, _ = FAMILIES[name]()
        config.save_pretrained(tmp_path / name)
        runs[name] = _Launch([sys.executable, "-m", "ringattn.apps.cli", "train", "--world", "2",
                              "--model", str(tmp_path / name), *argv, "--out", f"cp_{name}"],
                             tmp_path)
    for name, run in runs.items():
        assert cli.main(["train", "--model", str(tmp_path / name), *argv, "--attn", "eager",
                         "--out", str(tmp_path / f"ref_{name}")]) == 0
        failure = run.failure()
        assert failure is None, (name, failure)
        got = json.loads((tmp_path / f"cp_{name}" / "train.json").read_text())["loss"]
        want = json.loads((tmp_path / f"ref_{name}" / "train.json").read_text())["loss"]
        assert len(got) == len(want) == 2
        for a, b in zip(got, want):
            assert abs(a - b) <= TOL * abs(b), (name, got, want)
