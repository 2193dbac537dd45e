"""``accelerate launch`` with ``RingTrainer`` from an accelerate config file, on 2 CPU ranks:
the README's config (``distributed_type: MULTI_GPU``: accelerate starts the ranks through
torchrun; ``use_cpu=True`` in ``TrainingArguments`` puts them on gloo) runs the README's
RingTrainer block (trainer_run.py's ``readme`` scenario) and logs what a plain Trainer in
one process logs: losses, gradient norms and the eval loss within 1e-5 relative (the
float32 bound; the ranks' sums reorder float32 additions). And what accelerate 1.15 does
with a ``MULTI_CPU`` config on one machine: it starts one process, which RingTrainer
refuses.
"""

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

HERE = Path(__file__).resolve().parent
RUN = HERE / "trainer_run.py"
TOL = 1e-5
LIMIT_S = 240


def _readme_config() -> str:
    """The README's accelerate config (its ```yaml block), verbatim."""
    text = (HERE.parents[1] / "README.md").read_text()
    start = text.index("```yaml\ncompute_environment") + len("```yaml\n")
    return text[start:text.index("```", start)]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(LIMIT_S + 30)
def test_accelerate_launch_logs_one_process_losses(tmp_path):
    config = _readme_config()
    assert "distributed_type: MULTI_GPU" in config
    (tmp_path / "acc.yaml").write_text(config)
    (tmp_path / "cpu.yaml").write_text(config.replace("MULTI_GPU", "MULTI_CPU"))
    accelerate = [sys.executable, "-m", "accelerate.commands.launch"]
    script = [str(RUN), "--scenarios", "readme", "--out"]
    cmds = {
        "ref": [sys.executable, *script, str(tmp_path / "ref"), "--ref"],
        "acc": [*accelerate, "--config_file", str(tmp_path / "acc.yaml"),
                "--main_process_port", str(_free_port()), *script, str(tmp_path / "acc")],
        "cpu": [*accelerate, "--config_file", str(tmp_path / "cpu.yaml"), *script,
                str(tmp_path / "cpu")],
    }
    for name in cmds:
        (tmp_path / name).mkdir()
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    procs = {name: subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE,
                                    stderr=subprocess.STDOUT, text=True)
             for name, cmd in cmds.items()}
    logs = {}
    for name, p in procs.items():
        try:
            logs[name] = p.communicate(timeout=LIMIT_S)[0]
        except subprocess.TimeoutExpired:
            for q in procs.values():
                q.kill()
            pytest.fail(f"{name} did not finish within {LIMIT_S} s: {cmds[name]}")
    for name in ("ref", "acc"):
        assert procs[name].returncode == 0, f"{name} failed:\n{logs[name][-5000:]}"
    assert procs["cpu"].returncode != 0
    assert "RingTrainer needs torch.distributed initialised" in logs["cpu"], logs["cpu"][-3000:]

    ref = json.loads((tmp_path / "ref" / "readme.0.json").read_text())
    assert len(ref["loss"]) == 3
    for rank in range(2):
        got = json.loads((tmp_path / "acc" / f"readme.{rank}.json").read_text())
        for key in ("loss", "grad_norm", "eval_loss"):
            a, b = (x if isinstance(x, list) else [x] for x in (got[key], ref[key]))
            assert len(a) == len(b), (key, a, b)
            for step, (x, y) in enumerate(zip(a, b)):
                err = abs(x - y) / abs(y)
                assert err <= TOL, (f"{key}[{step}] on rank {rank}: {x} vs one process {y} "
                                    f"(relative error {err:.2e})")
