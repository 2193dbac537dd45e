"""Multi-node launch as on a cluster, on this machine: two ``torchrun --nnodes 2
--nproc-per-node 2`` launchers (one per "node") meet at a c10d rendezvous on localhost;
every one of the 4 gloo ranks runs ``multinode_run.py`` (ring, Ulysses, and the hybrid on
``ra.hybrid_mesh(ulysses=LOCAL_WORLD_SIZE)``: Ulysses within a node, the ring across) and
must be exact against float64 (fp32 within 1e-5 relative; measured at most 2.3e-7).

The same ranks then run the README's multi-node block as printed (read from README.md,
given the Usage names it takes: ``q_l``, ``k_l``, ``v_l``, ``S``, ``ra``): its ``out``,
unsharded, and the gradients through it must equal float64 alike.

This file is also the script the ranks run (``python test_multinode.py <outdir>``).
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

HERE = Path(__file__).resolve().parent
MARKER = 'mesh = ra.hybrid_mesh(ulysses=int(os.environ["LOCAL_WORLD_SIZE"]))'
"""A line of the README's multi-node block (and of no other block)."""
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
           "--rdzv-id", uuid.uuid4().hex, __file__, str(tmp_path)]
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
    for r in range(4):
        rec = json.loads((tmp_path / f"readme{r}.json").read_text())
        # the block's mesh: one node per row, as above
        assert rec["mesh"] == [[0, 1], [2, 3]] and rec["dims"] == ["ring", "ulysses"], rec
        bad = {n: e for n, e in rec["errors"].items() if not e <= TOL}
        assert not bad, f"README multi-node block, rank {r}: {bad}"


def readme_block_on_ranks(out_dir: Path) -> None:
    """Rank side: the README block on Usage-style zigzag shards of the world group (S=41
    divides neither W nor 2W), against float64; writes ``OUT/readme<RANK>.json``."""
    import torch
    import torch.distributed as dist

    import ringattn as ra
    from readme_blocks import readme_block
    from reference import reference, rel_err, visible

    S, H, HKV, D = 41, 4, 2, 16
    g = torch.Generator().manual_seed(1)  # the same global tensors on every rank
    q = torch.randn(1, S, H, D, generator=g, requires_grad=True)
    k, v = (torch.randn(1, S, HKV, D, generator=g, requires_grad=True) for _ in range(2))
    dout = torch.randn(1, S, H, D, generator=g)
    q_l, k_l, v_l = (ra.shard(t, layout="zigzag", seqlen=S) for t in (q, k, v))
    names = {"ra": ra, "q_l": q_l, "k_l": k_l, "v_l": v_l, "S": S}
    exec(compile(readme_block(MARKER), "README.md (multi-node block)", "exec"), names)
    out = ra.unshard(names["out"], layout="zigzag", seqlen=S)  # [1, S, H, D] on every rank
    out.backward(dout)  # q.grad, k.grad, v.grad: the full gradients, every rank
    ref = reference(q, k, v, dout, visible(S, True, (-1, -1)))
    errors = {n: rel_err(x, r) for n, x, r in
              zip(("out", "dq", "dk", "dv"), (out, q.grad, k.grad, v.grad), (ref[0], *ref[2:]))}
    mesh = names["mesh"]
    record = {"mesh": mesh.mesh.tolist(), "dims": list(mesh.mesh_dim_names), "errors": errors}
    (out_dir / f"readme{dist.get_rank()}.json").write_text(json.dumps(record))


def _rank_main(out_dir: Path) -> None:
    """One worker: multinode_run.py's checks, then the README block on the same ranks."""
    import torch.distributed as dist

    sys.path[:0] = [str(HERE), str(HERE.parent)]  # multinode_run; tests/: the oracle
    import multinode_run

    multinode_run.main(out_dir, keep_group=True)  # the README block runs on the same group
    try:
        readme_block_on_ranks(out_dir)
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))
