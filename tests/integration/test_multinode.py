"""Multi-node launch as on a cluster, on this machine: two ``torchrun --nnodes 2
--nproc-per-node 2`` launchers (one per "node") meet at a c10d rendezvous on localhost;
every one of the 4 gloo ranks runs ``multinode_run.py`` (ring, Ulysses, and the hybrid on
``ra.hybrid_mesh(ulysses=LOCAL_WORLD_SIZE)``: Ulysses within a node, the ring across) and
must be exact against float64 (fp32 within 1e-5 relative; measured at most 2.3e-7).
"""

import json
import os
import signal
import socket
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

RUN = Path(__file__).with_name("multinode_run.py")
TOL = 1e-5
LIMIT_S = 150


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("localhost", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(LIMIT_S + 30)
def test_two_nodes_of_two_ranks(tmp_path):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--nproc-per-node",
           "2", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"localhost:{_free_port()}",
           "--rdzv-id", uuid.uuid4().hex, str(RUN), str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    nodes = [subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, start_new_session=True)
             for _ in range(2)]
    logs = []
    try:
        for p in nodes:
            logs.append(p.communicate(timeout=LIMIT_S)[0])
    except subprocess.TimeoutExpired:
        for p in nodes:  # each launcher leads its own session: stop it and its workers
            if p.poll() is None:
                os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"the two launchers did not finish within {LIMIT_S} s (hung)")
    for i, (p, log) in enumerate(zip(nodes, logs)):
        assert p.returncode == 0, f"launcher {i} exited {p.returncode}:\n{log[-4000:]}"
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert sorted((r["node"], r["local_rank"]) for r in records) == [(0, 0), (0, 1), (1, 0), (1, 1)]
    for rec in records:
        assert rec["world"] == 4 and rec["mesh"] == [[0, 1], [2, 3]], rec
        # torchrun numbers ranks node by node: a mesh row (a Ulysses group) is one node
        assert rec["rank"] // 2 == rec["node"], rec
        bad = {f"{s} {n}": e for s, errs in rec["errors"].items() for n, e in errs.items()
               if not e <= TOL}
        assert not bad, f"rank {rec['rank']}: {bad}"
