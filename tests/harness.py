"""Persistent gloo clusters for distributed tests.

Importing torch costs seconds per process, so each world size gets one cluster of W
processes for the whole test session; a test sends a function (importable by name) to all
ranks and gets every rank's result back. A rank that does not answer within the timeout
is named in the error, and the cluster is torn down and started afresh for the next test.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle
import queue
import tempfile
import time
import traceback
from datetime import timedelta


def _worker(rank: int, world: int, init_file: str, tasks, results) -> None:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"file://{init_file}", rank=rank, world_size=world,
        timeout=timedelta(seconds=120),
    )
    results.put((rank, True, "ready"))
    while True:
        item = tasks.get()
        if item is None:
            break
        fn, args = item
        try:
            results.put((rank, True, fn(*args)))
        except BaseException:  # report every failure, including assertion errors, to the test
            results.put((rank, False, traceback.format_exc()))
    dist.destroy_process_group()


class RankFailure(AssertionError):
    pass


class Cluster:
    """W gloo ranks, each running a task loop."""

    def __init__(self, world: int):
        self.world = world
        ctx = mp.get_context("spawn")
        fd, self._init_file = tempfile.mkstemp(prefix="ringattn-gloo-")
        os.close(fd)
        os.unlink(self._init_file)
        self._results = ctx.Queue()
        self._tasks = [ctx.Queue() for _ in range(world)]
        self._procs = [
            ctx.Process(target=_worker, args=(r, world, self._init_file, self._tasks[r], self._results), daemon=True)
            for r in range(world)
        ]
        for p in self._procs:
            p.start()
        self.alive = True
        # wait until every rank has imported torch and joined the group, so that a test's
        # timeout measures the test, not the start-up
        ready = set()
        deadline = time.monotonic() + 180
        while len(ready) < world:
            try:
                rank, _, _ = self._results.get(timeout=max(deadline - time.monotonic(), 0.01))
            except queue.Empty:
                self.close(force=True)
                raise TimeoutError(f"ranks {sorted(set(range(world)) - ready)} of {world} never started") from None
            ready.add(rank)

    def run(self, fn, *args, timeout: float = 120.0) -> list:
        """Run ``fn(*args)`` on every rank; return the per-rank results in rank order.

        Raises:
            RankFailure: naming each rank whose call raised, with its traceback.
            TimeoutError: naming each rank that did not answer in time (it hung).
        """
        pickle.dumps((fn, args))  # fail here, not as a silent feeder-thread error and a timeout
        for q in self._tasks:
            q.put((fn, args))
        got: dict[int, tuple[bool, object]] = {}
        deadline = time.monotonic() + timeout
        while len(got) < self.world:
            left = deadline - time.monotonic()
            try:
                rank, ok, value = self._results.get(timeout=max(left, 0.01))
            except queue.Empty:
                missing = sorted(set(range(self.world)) - set(got))
                self.close(force=True)
                raise TimeoutError(
                    f"{fn.__name__}: rank(s) {missing} of {self.world} did not answer within "
                    f"{timeout:.0f} s (hung); ranks {sorted(got)} finished"
                ) from None
            got[rank] = (ok, value)
        failed = [r for r in range(self.world) if not got[r][0]]
        if failed:
            # the other ranks may be stuck in (or have timed out of) a collective: start afresh
            self.close(force=True)
            detail = "\n".join(f"--- rank {r} ---\n{got[r][1]}" for r in failed)
            raise RankFailure(f"{fn.__name__} failed on rank(s) {failed}:\n{detail}")
        return [got[r][1] for r in range(self.world)]

    def close(self, force: bool = False) -> None:
        if not self.alive:
            return
        self.alive = False
        if not force:
            for q in self._tasks:
                q.put(None)
            for p in self._procs:
                p.join(timeout=10)
        for p in self._procs:
            if p.is_alive():
                p.kill()
                p.join(timeout=5)


class Clusters:
    """One live cluster per world size, restarted after a hang."""

    def __init__(self):
        self._by_world: dict[int, Cluster] = {}

    def __call__(self, world: int) -> Cluster:
        c = self._by_world.get(world)
        if c is None or not c.alive:
            c = self._by_world[world] = Cluster(world)
        return c

    def close(self) -> None:
        for c in self._by_world.values():
            c.close()
