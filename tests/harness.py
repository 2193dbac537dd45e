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

    def close(self) -> None:
        for c in self._by_world.values():
            c.close()
