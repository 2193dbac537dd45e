"""A W-rank ring simulated in one process on one device: the kernels' share of a real step.

Legend: B batch, S global seq, L local seq, H heads, Hkv kv heads, D head dim, W world size.

One GPU cannot host W NCCL ranks, yet what a W-rank ring costs in kernels (how well the
plan splits the work, how many calls it makes, how small its blocks get) is what decides
whether a W-rank step can take 1/W of the one-rank time. ``simulate`` runs the real ring
loops (``ring.ring_forward`` / ``ring_backward``: the same code as a distributed call) for
every rank of a W-rank ring in this process, one thread per rank, with the hops as local
copies between the threads (a mailbox per (receiver, sender, stream)). Kernel calls take a
lock and are timed one at a time (the device synchronised around each), so each rank's
kernel seconds are what its kernels would take alone on the device; everything else (the
copies standing in for hops, the merges) runs unmeasured between them.

The results are the real ones (out, lse, dq, dk, dv of every rank; tests compare them with
float64), so a simulation that is fast because it skipped work cannot pass.
"""

from __future__ import annotations

import queue
import threading
import time
from dataclasses import dataclass, field

import torch

from .kernels import get_kernel
from .layouts import get_layout, local_positions
from .masks import check_cu_seqlens
from .plan import make_plan
from .strategies.ring import Ring, ring_backward, ring_forward
from .spec import AttnSpec

__all__ = ["Simulated", "local_positions_of", "simulate"]


class _Mail:
    """Mailboxes of a simulated ring: (receiver, sender, stream tag) -> queue of tensors."""

    def __init__(self, world: int, timeout_s: float):
        self.world, self.timeout_s = world, timeout_s
        self.boxes: dict = {}
        self.lock = threading.Lock()

    def box(self, key) -> queue.Queue:
        with self.lock:
            return self.boxes.setdefault(key, queue.Queue())


class _Hop:
    def __init__(self, mail: _Mail, key, recv: torch.Tensor):
        self.mail, self.key, self.recv = mail, key, recv

    def wait(self) -> torch.Tensor:
        try:
            got = self.mail.box(self.key).get(timeout=self.mail.timeout_s)
        except queue.Empty:
            raise RuntimeError(f"simulated hop {self.key} got nothing in "
                               f"{self.mail.timeout_s} s") from None
        self.recv.copy_(got)  # the transfer's write into the receive buffer
        return self.recv


class _SimComm:
    """Rank ``rank`` of a simulated ring: ``RingComm``'s interface, hops through ``_Mail``."""

    group = None

    def __init__(self, mail: _Mail, rank: int):
        self.mail, self.rank, self.world = mail, rank, mail.world

    def hop(self, send, recv, tag, shift=1, what="ring hop") -> _Hop:
        to, frm = (self.rank + shift) % self.world, (self.rank - shift) % self.world
        self.mail.box((to, self.rank, tag)).put(send.clone())  # what the wire would carry
        return _Hop(self.mail, (self.rank, frm, tag), recv)


class _Stopwatch:
    """A kernel whose calls run one at a time (a process-wide lock) with the device
    synchronised before and after, adding their seconds to the calling thread's rank."""

    def __init__(self, inner, device: torch.device, ranks: dict):
        self.inner, self.device, self.ranks = inner, device, ranks
        self.name, self.tile = inner.name, getattr(inner, "tile", (256, 128))
        self.features = getattr(inner, "features", frozenset())
        self.lock = threading.Lock()

    def supports(self, device, dtype):
        return self.inner.supports(device, dtype)

    def _timed(self, which: str, fn, *args, **kwargs):
        rank = self.ranks[threading.get_ident()]
        with self.lock:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            t0 = time.perf_counter()
            out = fn(*args, **kwargs)
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)
            rank.seconds[which] += time.perf_counter() - t0
            rank.calls[which] += 1
        return out

    def forward(self, *args, **kwargs):
        return self._timed("forward", self.inner.forward, *args, **kwargs)

    def backward(self, *args, **kwargs):
        return self._timed("backward", self.inner.backward, *args, **kwargs)


@dataclass
class _RankResult:
    rank: int
    seconds: dict = field(default_factory=lambda: {"forward": 0.0, "backward": 0.0})
    calls: dict = field(default_factory=lambda: {"forward": 0, "backward": 0})
    out: torch.Tensor | None = None
    lse: torch.Tensor | None = None
    grads: tuple | None = None


@dataclass
class Simulated:
    """Every rank's result and kernel time; tensors are the ranks' shards (``ra.shard``'s
    layout) in ``ranks[r]``."""

    world: int
    ranks: list
    steps: int

    def kernel_seconds(self, which: str = "both") -> list[float]:
        """Per rank: seconds in its kernels ("forward", "backward" or "both")."""
        parts = ("forward", "backward") if which == "both" else (which,)
        return [sum(r.seconds[p] for p in parts) for r in self.ranks]


def _local(x: torch.Tensor, layout, rank: int, world: int, seqlen: int) -> torch.Tensor:
    """Rank ``rank``'s shard of the whole ``x`` (what ``ra.shard`` makes there): padding
    slots are zero."""
    pos = local_positions(layout, rank, world, seqlen).to(x.device)
    out = x.index_select(1, pos.clamp(max=seqlen - 1))
    out[:, pos >= seqlen] = 0
    return out


def local_positions_of(simulated: "Simulated", rank: int, layout, seqlen: int, cu_seqlens=None):
    """Global positions of rank ``rank``'s slots in a simulation (>= S: padding)."""
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, seqlen)
    return local_positions(get_layout(layout, cu), rank, simulated.world, seqlen)


def simulate(q, k, v, dout=None, *, world: int, causal: bool = False,
             window_size: tuple[int, int] = (-1, -1), softmax_scale: float | None = None,
             layout: str = "zigzag", mask=None, cu_seqlens=None, kernel=None,
             backward_overlap: str = "all", timeout_s: float = 600.0) -> Simulated:
    """Run ``ring_attention``'s forward (and, with ``dout``, its backward) as a ``world``-rank
    ring in this process, on q, k, v's device.

    Arguments:
        q, k, v: the WHOLE sequence, [B, S, H(kv), D]; each simulated rank gets its shard.
        dout: [B, S, H, Dv] upstream gradient of the whole output, or None (forward only).
        world: W, the simulated ranks.
        causal, window_size, softmax_scale, layout, mask, cu_seqlens, kernel,
            backward_overlap: as ``ring_attention``'s.
        timeout_s: how long a simulated hop waits before raising.

    Returns:
        ``Simulated``: per rank its out, lse and (with ``dout``) dq, dk, dv shards, and its
        kernel seconds and calls per direction.
    """
    from .validate import effective_mask  # the mask every rank of a real call plans with

    if q.dim() != 4 or k.shape != v.shape[:3] + k.shape[3:] or k.shape[:2] != q.shape[:2]:
        raise ValueError(f"q, k, v must be [B, S, H(kv), D] with the same B and S, got "
                         f"{tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    if q.shape[2] % k.shape[2]:
        raise ValueError(f"q has {q.shape[2]} heads, not a multiple of k's {k.shape[2]}")
    seqlen = q.shape[1]
    cu = None if cu_seqlens is None else check_cu_seqlens(cu_seqlens, seqlen)
    lay = get_layout(layout, cu)
    scale = q.shape[-1] ** -0.5 if softmax_scale is None else float(softmax_scale)
    spec = AttnSpec(causal=causal, window_size=tuple(window_size), softmax_scale=scale,
                    seqlen=seqlen, layout=lay.name)
    full = effective_mask(spec, mask, cu)
    inner = get_kernel(kernel, q.device, q.dtype, general=full.band is None)
    ranks = [_RankResult(r) for r in range(world)]
    by_thread: dict = {}
    timed = _Stopwatch(inner, q.device, by_thread)
    plans = [make_plan(lay, full, world, r, seqlen, batch=q.shape[0], heads=q.shape[2],
                       device=q.device, tile=timed.tile) for r in range(world)]
    steps = 1 + max(p.last_step for p in plans)  # what the ranks agree on
    mail = _Mail(world, timeout_s)
    shards = [[None if t is None else _local(t, lay, r, world, seqlen) for t in (q, k, v, dout)]
              for r in range(world)]
    errors: list = []

    def run(r: int):
        by_thread[threading.get_ident()] = ranks[r]
        try:
            ring = Ring(_SimComm(mail, r), spec, plans[r], timed, steps, backward_overlap, lay)
            ql, kl, vl, dl = shards[r]
            out, lse = ring_forward(ql, kl, vl, ring)
            ranks[r].out, ranks[r].lse = out, lse
            if dl is not None:
                ranks[r].grads = ring_backward(dl.contiguous(), ql, kl, vl, out, lse, ring)
        except Exception as exc:  # reported to the caller below, with the rank
            errors.append((r, exc))

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        r, exc = errors[0]
        raise RuntimeError(f"simulated rank {r} of {world} failed: {exc}") from exc
    return Simulated(world, ranks, steps)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
