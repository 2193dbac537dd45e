"""Local gloo process groups for tests, benchmarks and experiments on one machine.

``LocalCluster(W)`` starts W processes (spawn), joins them in one gloo group through a file
store (no port to pick), and keeps them alive: each ``run(fn, *args)`` sends an importable
function to every rank and returns every rank's result. Importing torch costs seconds per
process, so many calls reuse one cluster. A rank that raises is named with its traceback; a
rank that does not answer in time is named as hung; either way the cluster is torn down,
because its other ranks may be stuck in a collective.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from datetime import timedelta

__all__ = ["LocalCluster", "RankFailure", "count_collectives"]


class RankFailure(AssertionError):
    """A call raised on some ranks; ``failed`` maps each such rank to its traceback."""

    def __init__(self, what: str, failed: dict[int, str]):
        self.failed = failed
        detail = "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(failed.items()))
        super().__init__(f"{what} failed on rank(s) {sorted(failed)}:\n{detail}")


def _worker(rank: int, world: int, init_file: str, tasks, results, timeout_s: float) -> None:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # ranks share the machine's cores: one compute thread each
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank,
                            world_size=world, timeout=timedelta(seconds=timeout_s))
    results.put((rank, True, "ready"))
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args = item
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # every failure goes back to the caller, which names the rank
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


@contextlib.contextmanager
def _environ(extra: dict[str, str]):
    saved = {k: os.environ.get(k) for k in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


class LocalCluster:
    """W gloo ranks in spawned processes, each running calls until closed.

    Arguments:
        world: number of ranks W.
        env: extra environment variables for the ranks (read at process start, e.g.
            glibc's ``MALLOC_MMAP_THRESHOLD_``).
        timeout_s: gloo's collective timeout inside the ranks.
        start_timeout_s: how long the ranks may take to import torch and join the group.

    Raises:
        TimeoutError: naming the ranks that never started.
    """

    def __init__(self, world: int, *, env: dict[str, str] | None = None,
                 timeout_s: float = 300.0, start_timeout_s: float = 300.0):
        self.world = world
        ctx = mp.get_context("spawn")
        fd, self._init_file = tempfile.mkstemp(prefix="ringattn-gloo-")
        os.close(fd)
        os.unlink(self._init_file)  # the file store creates it
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world)]
        with _environ({"OMP_NUM_THREADS": "1", **(env or {})}):
            self._procs = [
                ctx.Process(target=_worker, daemon=True, args=(
                    r, world, self._init_file, self._tasks[r], self._results, timeout_s))
                for r in range(world)
            ]
            for p in self._procs:
                p.start()
        self.alive = True
        # wait until every rank has joined, so that a call's timeout measures the call
        self._collect("start-up", start_timeout_s)

    def _collect(self, what: str, timeout: float) -> list:
        got: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world:
            try:
                rank, ok, value = self._results.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                missing = sorted(set(range(self.world)) - set(got))
                self.close(force=True)
                raise TimeoutError(
                    f"{what}: rank(s) {missing} of {self.world} did not answer within "
                    f"{timeout:.0f} s (hung); ranks {sorted(got)} finished"
                ) from None
            got[rank] = (ok, value)
        failed = {r: v for r, (ok, v) in got.items() if not ok}
        if failed:
            self.close(force=True)
            raise RankFailure(what, failed)
        return [got[r][1] for r in range(self.world)]

    def run(self, fn, *args, timeout: float = 600.0) -> list:
        """Run ``fn(*args)`` on every rank; return the per-rank results in rank order.

        ``fn`` must be importable by name (a module-level function) and ``args`` picklable.

        Raises:
            RankFailure: naming each rank whose call raised, with its traceback.
            TimeoutError: naming each rank that did not answer in time (it hung).
        """
        if not self.alive:
            raise RuntimeError("this cluster was closed (after a failure or by close())")
        pickle.dumps((fn, args))  # fail here, not in a queue's feeder thread and a timeout
        for q in self._tasks:
            q.put((fn, args))
        return self._collect(fn.__name__, timeout)

    def close(self, force: bool = False) -> None:
        """Stop the ranks (politely unless ``force``); idempotent."""
        if not self.alive:
            return
        self.alive = False
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=30)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=10)


_COLLECTIVES = ("all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_single",
                "all_gather_object", "all_to_all", "all_to_all_single", "broadcast",
                "reduce_scatter", "reduce_scatter_tensor", "reduce_scatter_single", "send", "recv",
                "batch_isend_irecv", "barrier")
# isend/irecv stay unwrapped: P2POp accepts only the original functions, and ringattn
# posts its point-to-point ops through batch_isend_irecv, which is counted.


@contextlib.contextmanager
def count_collectives():
    """Record every torch.distributed communication call made inside the block.

    Yields a list that fills with ``(name, bytes)``: the function called and the bytes of
    the tensors it sends (for ``batch_isend_irecv``, of its send ops); ringattn's metadata
    agreement is one ``("agreement", bytes of its row)``. The real functions
    run; they are only wrapped (also where ringattn keeps its own reference to one).
    """
    import torch
    import torch.distributed as dist

    from . import comm

    calls: list[tuple[str, int]] = []

    def size(x):
        if isinstance(x, torch.Tensor):
            return x.numel() * x.element_size()
        if isinstance(x, (list, tuple)):
            return sum(size(t) for t in x)
        return 0

    def wrap(name, fn):
        def counted(*args, **kwargs):
            if name == "batch_isend_irecv":
                sent = sum(size(op.tensor) for op in args[0] if op.op.__name__ == "isend")
            elif name in ("all_gather_into_tensor", "all_gather_single", "all_to_all_single",
                          "reduce_scatter_tensor", "reduce_scatter_single", "agreement"):
                sent = size(args[1] if len(args) > 1 else kwargs.get("input"))
            else:
                sent = size(args[0]) if args else 0
            calls.append((name, sent))
            return fn(*args, **kwargs)
        return counted

    saved = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}
    saved_comm = comm._all_gather_single, comm._reduce_scatter_single, comm._exchange
    try:
        for name, fn in saved.items():
            setattr(dist, name, wrap(name, fn))
        comm._all_gather_single = wrap("all_gather_single", saved_comm[0])
        comm._reduce_scatter_single = wrap("reduce_scatter_single", saved_comm[1])
        comm._exchange = wrap("agreement", saved_comm[2])  # its row's bytes
        yield calls
    finally:
        for name, fn in saved.items():
            setattr(dist, name, fn)
        comm._all_gather_single, comm._reduce_scatter_single, comm._exchange = saved_comm



if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
