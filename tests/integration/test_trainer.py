"""HF Trainer recipe: ``RingTrainer`` under torchrun on 2 CPU ranks logs the same losses
(and so takes the same steps) as a plain Trainer in one process on the same batches."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

RUN = Path(__file__).with_name("trainer_run.py")


def _run(cmd, tmp_path):
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


@pytest.mark.timeout(300)
def test_ring_trainer_under_torchrun_matches_one_process(tmp_path, worst_errors):
    _run([sys.executable, str(RUN), "--ref", "--out", str(tmp_path / "ref.json")], tmp_path)
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2"]
    _run([*torchrun, str(RUN), "--out", str(tmp_path / "cp.json")], tmp_path)
    ref = json.loads((tmp_path / "ref.json.0").read_text())
    assert len(ref) == 4
    for rank in range(2):  # every rank logs the global loss
        cp = json.loads((tmp_path / f"cp.json.{rank}").read_text())
        assert len(cp) == len(ref), (rank, cp)
        for step, (a, b) in enumerate(zip(cp, ref)):
            err = abs(a - b) / abs(b)
            key = ("Trainer", "loss")  # printed in make test's summary of worst errors
            worst_errors[key] = (max(worst_errors.get(key, (0.0, 1e-5))[0], err), 1e-5)
            assert err <= 1e-5, (rank, step, a, b)
