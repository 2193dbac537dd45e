"""The README's first two ```python blocks (Usage, then Masks and packed documents), run as
printed, one after the other, under ``torchrun --nproc-per-node 2`` on gloo CPU ranks."""

import os
import re
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
