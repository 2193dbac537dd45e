"""One live gloo cluster per world size for the whole test session, restarted after a failure."""

from __future__ import annotations

from ringattn.testing import LocalCluster


class Clusters:
    """``clusters(W)`` returns a live ``LocalCluster`` of W ranks, starting one if needed."""

    def __init__(self):
        self._by_world: dict[int, LocalCluster] = {}

    def __call__(self, world: int) -> LocalCluster:
        c = self._by_world.get(world)
        if c is None or not c.alive:
            c = self._by_world[world] = LocalCluster(world, timeout_s=120)
        return c

    def once_per_world(self, fn, *args, timeout: float):
        """``get(W)``: ``fn(*args)``'s results on every rank of the W-rank cluster, run on
        the first call for W and kept (a module's cases in one cluster call per W)."""
        done: dict = {}

        def get(world: int):
            if world not in done:
                done[world] = self(world).run(fn, *args, timeout=timeout)
            return done[world]

        return get

    def close(self) -> None:
        for c in self._by_world.values():
            c.close()
