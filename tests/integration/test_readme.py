"""The README's first two ```python blocks (Usage, then Masks and packed documents), run as
printed, one after the other, under ``torchrun --nproc-per-node 2`` on gloo CPU ranks."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[2] / "README.md"


@pytest.mark.timeout(240)
def test_usage_and_masks_blocks_run_as_printed(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(), re.S)
    assert blocks[0].startswith("import torch, torch.distributed as dist")
    assert "ra.masks.from_function" in blocks[1]
    script = tmp_path / "readme_usage.py"
    script.write_text(blocks[0] + blocks[1])
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         str(script)], capture_output=True, text=True, timeout=220,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]


def _make_dry_run(target: str, path: str | None = None) -> str:
    """``make -n -B target``: the commands make would run (nothing is run)."""
    env = {**os.environ, **({"PATH": path} if path else {})}
    proc = subprocess.run(["make", "-n", "-B", target], cwd=README.parent, capture_output=True,
                          text=True, timeout=60, env=env)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


@pytest.mark.skipif(shutil.which("make") is None, reason="needs make")
@pytest.mark.parametrize("system", ["Linux", "Darwin"])
def test_make_installs_the_cpu_build_it_names(tmp_path, system):
    """``make`` printed "(CPU build)" and installed ``torch==2.13.0``, which on Linux without
    a local CPU wheel is PyPI's CUDA build. On Linux it installs ``torch==2.13.0+cpu`` (a
    local wheel or pip's cache first, else PyTorch's CPU index), for ``.venv`` and the
    SpecForge venv; elsewhere (``uname`` faked as Darwin) PyPI's torch, the CPU build there.
    The README says the same."""
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "uname").write_text(f"#!/bin/sh\necho {system}\n")
    (fake / "uname").chmod(0o755)
    pin = "torch==2.13.0+cpu" if system == "Linux" else "torch==2.13.0"
    index = "--extra-index-url https://download.pytorch.org/whl/cpu"
    for target, pip in ((".venv/.installed", ".venv/bin/pip install -q"),
                        (".venv-specforge/.installed",
                         ".venv-specforge/bin/python -m pip install -q")):
        commands = _make_dry_run(target, f"{fake}:{os.environ['PATH']}").replace("\\\n", " ")
        torch_lines = [line for line in commands.splitlines() if f'"{pin}"' in line
                       and "pip install" in line and "torch==" in line.split("||")[-1]]
        assert torch_lines, (target, commands)
        first, fallback = torch_lines[0].split("||")[-2:]
        assert first.strip() == f'{pip} "{pin}" 2>/dev/null', (target, torch_lines[0])
        assert fallback.split() == [*pip.split(), f'"{pin}"', *index.split()], torch_lines[0]
        if target == ".venv/.installed":
            assert f"make: installing {pin} (CPU build) into .venv" in commands, commands
    readme = " ".join(README.read_text().split())
    assert ("install torch 2.13.0's CPU build there if no torch is present (`torch==2.13.0+cpu` "
            "on Linux: from a local wheel or pip's cache, else from PyTorch's CPU index") in readme
