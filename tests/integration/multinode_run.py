"""One torchrun worker of tests/integration/test_multinode.py: ring, Ulysses and the hybrid
on ``ra.hybrid_mesh(ulysses=LOCAL_WORLD_SIZE)`` (Ulysses within a node, the ring across
nodes), each against the float64 oracle on the whole sequence. Writes
``OUT/rank<RANK>.json``: the node's rank and local rank, the mesh rows, and each
strategy's relative errors of out, dq, dk, dv.

    torchrun --nnodes 2 --nproc-per-node 2 --rdzv-backend c10d \
        --rdzv-endpoint HOST:PORT tests/integration/multinode_run.py OUT
"""

import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # tests/: the oracle

import ringattn as ra  # noqa: E402
from reference import reference, rel_err, visible  # noqa: E402

S, H, HKV, D = 37, 4, 2, 16  # S divides neither W nor 2W


def main(out_dir: Path, keep_group: bool = False) -> None:
    """The checks on this launcher's ranks; ``keep_group``: leave the group up for more."""
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, local = dist.get_rank(), int(os.environ["LOCAL_WORLD_SIZE"])
    g = torch.Generator().manual_seed(0)  # the same global inputs on every rank
    q = torch.randn(1, S, H, D, generator=g)
    k, v = (torch.randn(1, S, HKV, D, generator=g) for _ in range(2))
    dout = torch.randn(1, S, H, D, generator=g)
    ref = reference(q, k, v, dout, visible(S, True, (-1, -1)))
    mesh = ra.hybrid_mesh(ulysses=local)
    runs = {"ring": (ra.ring_attention, None), "ulysses": (ra.ulysses_attention, None),
            "hybrid": (ra.hybrid_attention, mesh)}
    errors = {}
    for name, (fn, group) in runs.items():
        shards = [ra.shard(t, group=group, seqlen=S) for t in (q, k, v, dout)]
        leaves = [t.detach().requires_grad_() for t in shards[:3]]
        out = fn(*leaves, group=group, causal=True, seqlen=S)
        out.backward(shards[3])
        got = [ra.unshard(t, group=group, seqlen=S) for t in [out] + [x.grad for x in leaves]]
        errors[name] = {n: rel_err(x, r) for n, x, r in
                        zip(("out", "dq", "dk", "dv"), got, (ref[0], *ref[2:]))}
    record = {"rank": rank, "world": dist.get_world_size(), "node": int(os.environ["GROUP_RANK"]),
              "local_rank": int(os.environ["LOCAL_RANK"]), "mesh": mesh.mesh.tolist(),
              "errors": errors}
    (out_dir / f"rank{rank}.json").write_text(json.dumps(record))
    if not keep_group:
        dist.destroy_process_group()


if __name__ == "__main__":
    main(Path(sys.argv[1]))
