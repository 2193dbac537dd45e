"""Dead and frozen peers on 3 gloo ranks: rank 2 SIGKILLs or SIGSTOPs itself mid-forward,
mid-backward, or instead of joining the agreement. The survivors must raise
``ringattn.comm.PeerError`` within seconds (ringattn's timeout set to 4 s, the process group's
is 300 s), naming a peer rank, the operation and the ring step, with the transport's error
chained. Each scenario spends its own cluster (a killed rank breaks the group); every rank
writes what it saw to a file, since the cluster call itself cannot finish."""

import json
import os
import signal
import time

import pytest
import torch
import torch.distributed as dist

import ringattn as ra
from ringattn.comm import PeerError, set_timeout
from ringattn.kernels import get_kernel
from ringattn.testing import LocalCluster

TIMEOUT_S = 4.0
S = 30


class _Dying:
    """The CPU SDPA kernel, except that rank 2 kills or stops itself at its ``at``-th call of
    ``phase`` ("forward" or "backward")."""

    features = frozenset()

    def __init__(self, phase: str, at: int, sig: int):
        self.base = get_kernel(None, torch.device("cpu"), torch.float32)
        self.name, self.tile = "dying", self.base.tile
        self.phase, self.at, self.sig, self.calls = phase, at, sig, 0

    def supports(self, device, dtype):
        return self.base.supports(device, dtype)

    def _tick(self, phase):
        if phase == self.phase and dist.get_rank() == 2:
            self.calls += 1
            if self.calls == self.at:
                os.kill(os.getpid(), self.sig)

    def forward(self, *args, **kwargs):
        self._tick("forward")
        return self.base.forward(*args, **kwargs)

    def backward(self, *args, **kwargs):
        self._tick("backward")
        return self.base.backward(*args, **kwargs)


def faulty_rank(out_dir, scenario):
    """Rank side: run the scenario and write (error class, message, cause, seconds) or
    "finished" to ``out_dir/<rank>.json``."""
    rank = dist.get_rank()
    set_timeout(TIMEOUT_S)
    with open(os.path.join(out_dir, f"{rank}.pid"), "w") as f:
        f.write(str(os.getpid()))
    g = torch.Generator().manual_seed(0)
    q, k, v = (ra.shard(torch.randn(1, S, 2, 8, generator=g), seqlen=S).requires_grad_()
               for _ in range(3))
    kernel = None
    what, phase = scenario.split("-")
    sig = signal.SIGKILL if what == "kill" else signal.SIGSTOP
    if phase == "forward":
        kernel = _Dying("forward", 1, sig)  # its first block: after posting hop 0
    elif phase == "backward":
        kernel = _Dying("backward", 2, sig)
    elif rank == 2:  # dead or frozen before the call: never agrees
        os.kill(os.getpid(), sig)
    t0 = time.monotonic()
    try:
        out = ra.ring_attention(q, k, v, causal=True, seqlen=S, kernel=kernel)
        out.sum().backward()
        seen = {"outcome": "finished"}
    except Exception as exc:  # what the survivors see is the subject of the test
        seen = {"outcome": type(exc).__name__, "message": str(exc),
                "cause": type(exc.__cause__).__name__ if exc.__cause__ else None}
    seen["seconds"] = time.monotonic() - t0
    with open(os.path.join(out_dir, f"{rank}.json"), "w") as f:
        json.dump(seen, f)
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("scenario,words", [
    ("kill-forward", "forward, K/V hop of step"),
    ("kill-backward", "backward, "),
    ("kill-agreement", "agreement before the ring"),
    ("stop-forward", "forward, K/V hop of step"),
    ("stop-backward", "backward, "),
    ("stop-agreement", "agreement before the ring"),
])
def test_dead_or_frozen_peer_is_named(tmp_path, scenario, words):
    cluster = LocalCluster(3)
    try:
        with pytest.raises(TimeoutError, match=r"rank\(s\) \[2\]"):
            cluster.run(faulty_rank, str(tmp_path), scenario, timeout=3 * TIMEOUT_S)
    finally:
        cluster.close(force=True)  # kills the stopped rank too
    seen = {r: json.loads((tmp_path / f"{r}.json").read_text()) for r in (0, 1)}
    assert not (tmp_path / "2.json").exists()
    for rank, s in seen.items():
        assert s["outcome"] == PeerError.__name__, (rank, s)
        assert words in s["message"] and "rank " in s["message"], (rank, s)
        assert s["cause"] == "RuntimeError", (rank, s)  # the transport's error, chained
        assert s["seconds"] < 3 * TIMEOUT_S, (rank, s)
    # somebody names the rank that failed
    assert any("rank 2" in s["message"] or "[2]" in s["message"] for s in seen.values()), seen
    if scenario.endswith("agreement"):
        for rank, s in seen.items():
            assert "rank(s) [2]" in s["message"], (rank, s)
    if scenario.startswith("stop"):  # nothing tells a frozen peer from a slow one but time
        for rank, s in seen.items():
            assert s["seconds"] >= TIMEOUT_S - 0.5, (rank, s)


def late_rank():
    """Rank side: rank 2 reaches its call after the others gave up on it, then every rank
    calls again. Returns (error class, message, seconds) of both calls."""
    rank = dist.get_rank()
    set_timeout(TIMEOUT_S)
    q = ra.shard(torch.randn(1, S, 2, 8, generator=torch.Generator().manual_seed(0)), seqlen=S)
    if rank == 2:
        time.sleep(TIMEOUT_S + 1.5)
    seen = []
    for _ in range(2):
        t0 = time.monotonic()
        try:
            ra.ring_attention(q, q, q, causal=True, seqlen=S)
            seen.append(("finished", "", time.monotonic() - t0))
        except Exception as exc:  # what each rank sees is the subject of the test
            seen.append((type(exc).__name__, str(exc), time.monotonic() - t0))
    return seen


@pytest.mark.timeout(120)
def test_a_late_rank_cannot_use_stale_messages():
    """The survivors time out naming rank 2; rank 2, arriving late, fails too (never runs
    the ring with them); after that, every later call on
    every rank fails at once (no call runs on a group whose messages are out of step)."""
    cluster = LocalCluster(3)
    try:
        per_rank = cluster.run(late_rank, timeout=6 * TIMEOUT_S)
    finally:
        cluster.close(force=True)
    for rank, (first, second) in enumerate(per_rank):
        assert first[0] == PeerError.__name__, (rank, first)
        if rank < 2:
            assert "rank(s) [2]" in first[1] and "agreement" in first[1], (rank, first)
        else:  # gloo closed the timed-out connections: it cannot even post (on transports
            # that keep them, the stale messages pass the agreement and its first hop fails)
            assert "agreement" in first[1] or "forward, K/V hop of step 0" in first[1], (rank, first)
        assert first[2] < 2 * TIMEOUT_S, (rank, first)
        assert second[0] == PeerError.__name__ and "an earlier ringattn call" in second[1], second
        assert second[2] < 0.5, (rank, second)
