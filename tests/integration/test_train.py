"""``ringattn.apps.train`` as users start it: under torchrun on a text file, and ``ringattn train``.

Under torchrun (2 gloo ranks, byte-level tokens of a text file, S = 37 which 2 does not
divide) the per-step losses must equal the same model trained in one process with
transformers' "eager" attention within 1e-5 relative: three steps, before training can
amplify float32 rounding (~1e-7) by much.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from ringattn.apps import cli
from ringattn.apps.train import TrainConfig, train

pytest.importorskip("transformers")

TEXT = b"It was the best of times, it was the worst of times, it was the age of wisdom. " * 8
ARGS = ["--steps", "3", "--seqlen", "37", "--batch", "2", "--no-progress"]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("strategy,world", [("ring", 2), ("ulysses", 2), ("hybrid", 4),
                                            ("auto", 2)])
def test_torchrun_on_text_equals_one_process(tmp_path, strategy, world):
    """--strategy hybrid runs on 4 ranks, a 2 (ring) x 2 (ulysses) mesh."""
    data = tmp_path / "text.txt"
    data.write_bytes(TEXT)
    out = tmp_path / "out"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           str(world), "-m", "ringattn.apps.train", "--data", str(data), "--out", str(out), *ARGS,
           "--strategy", strategy, *(["--ulysses", "2"] if strategy == "hybrid" else [])]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=150, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    got = json.loads((out / "train.json").read_text())
    assert got["world"] == world and got["attn"] == "ringattn" and got["config"]["data"] == str(data)
    assert got["config"]["strategy"] == strategy
    assert len(got["peak_rss_mib"]) == world and (out / "loss.png").stat().st_size > 10_000
    cfg = TrainConfig(steps=3, seqlen=37, batch=2, data=str(data))
    want = train(cfg, attn_implementation="eager", progress=False)["loss"]
    for step, (a, b) in enumerate(zip(got["loss"], want, strict=True)):
        assert abs(a - b) <= 1e-5 * abs(b), (step, a, b)


def test_cli_train_one_process(tmp_path, capsys):
    out = tmp_path / "out"
    assert cli.main(["train", "--attn", "sdpa", "--out", str(out), *ARGS]) == 0
    got = json.loads((out / "train.json").read_text())
    assert got["world"] == 1 and got["attn"] == "sdpa" and len(got["loss"]) == 3
    assert "final loss" in capsys.readouterr().out


def test_cli_train_rejects_bad_options(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main(["train", "--data", str(tmp_path / "missing.txt"), *ARGS])
    assert exc.value.code == 2
    assert "missing.txt" in capsys.readouterr().err


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


@pytest.mark.timeout(60)
@pytest.mark.parametrize("argv,torchrun_world,named", [
    (["train", "--world", "3", "--strategy", "hybrid", "--ulysses", "2"], None,
     "ulysses=2 to divide the world of 3"),
    (["train", "--strategy", "hybrid", "--ulysses", "2"], "3", "ulysses=2 to divide the world of 3"),
    (["train", "--world", "3", "--ulysses", "2"], None, "--ulysses applies only with --strategy hybrid"),
    (["train", "--world", "0"], None, "world must be an int >= 1"),
    (["demo", "--target", "lm", "--world", "0"], None, "world must be an int >= 1"),
])
def test_cli_refuses_arguments_before_spawning(monkeypatch, capsys, argv, torchrun_world, named):
    """Arguments that cannot run exit with status 2 and one line naming them, before any
    rank is spawned or joins a group (``--world 3 --strategy hybrid --ulysses 2`` once
    failed after 45 s of spawning with a 40-line traceback)."""
    import torch.distributed as dist
    import torch.multiprocessing as mp

    def started(*args, **kwargs):
        raise AssertionError("a rank was started before the arguments were checked")

    monkeypatch.setattr(mp, "spawn", started)
    monkeypatch.setattr(dist, "init_process_group", started)
    if torchrun_world is not None:
        monkeypatch.setenv("WORLD_SIZE", torchrun_world)
    else:
        monkeypatch.delenv("WORLD_SIZE", raising=False)
    with pytest.raises(SystemExit) as exc:
        cli.main([*argv, *ARGS] if argv[0] == "train" else argv)
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert named in err and len(err.strip().splitlines()) <= 3, err


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
