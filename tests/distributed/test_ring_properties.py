"""What the ring does, observed from inside: kernel calls per block class, the largest
tensor any rank creates, and what travels over the wire."""

import pytest
import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode

import ringattn as ra
from ringattn.kernels import get_kernel
from ringattn.layouts import get_layout
from ringattn.plan import make_plan

WORLD = 4


class CountingKernel:
    """The real CPU kernel, counting its calls by block class (full: no mask)."""

    def __init__(self):
        self.inner = get_kernel("sdpa-cpu", torch.device("cpu"), torch.float32)
        self.name = "counting"
        self.tile = self.inner.tile
        self.calls = {"fwd-full": 0, "fwd-partial": 0, "bwd-full": 0, "bwd-partial": 0}

    def supports(self, device, dtype):
        return self.inner.supports(device, dtype)

    def forward(self, q, k, v, scale, mask):
        self.calls["fwd-full" if mask is None else "fwd-partial"] += 1
        return self.inner.forward(q, k, v, scale, mask)

    def backward(self, dout, q, k, v, out, lse, scale, mask):
        self.calls["bwd-full" if mask is None else "bwd-partial"] += 1
        return self.inner.backward(dout, q, k, v, out, lse, scale, mask)


CONFIGS = {  # name: (layout, causal, window)
    "zigzag-causal": ("zigzag", True, (-1, -1)),
    "striped-causal": ("striped", True, (-1, -1)),
    "contiguous-causal": ("contiguous", True, (-1, -1)),
    "contiguous-window-5": ("contiguous", True, (5, -1)),
    "contiguous-window-3-3": ("contiguous", False, (3, 3)),
    "zigzag-full": ("zigzag", False, (-1, -1)),
}


def count_calls(seqlen):
    out = {}
    for name, (layout, causal, window) in CONFIGS.items():
        kern = CountingKernel()
        q = torch.randn(1, seqlen // WORLD, 2, 8, requires_grad=True)
        k = torch.randn(1, seqlen // WORLD, 2, 8, requires_grad=True)
        o = ra.ring_attention(q, k, k, causal=causal, window_size=window, layout=layout,
                              seqlen=seqlen, kernel=kern)
        o.sum().backward()
        out[name] = kern.calls
    return out


def expected(name, rank, w):
    """Textbook counts per rank (a whole forward, and the same again in backward)."""
    full, partial = {
        "zigzag-causal": (w - 1, 1),       # own step: one triangle over both chunks; others 1 full
        "striped-causal": (0, w),          # one shifted triangle per step
        "contiguous-causal": (rank, 1),    # earlier ranks full, own diagonal, later skipped
        "contiguous-window-5": (0, 1 + (rank > 0)),  # own block + the corner of the previous
        "contiguous-window-3-3": (0, 1 + (rank > 0) + (rank < w - 1)),
        "zigzag-full": (w, 0),             # every step one coalesced full block
    }[name]
    return {"fwd-full": full, "fwd-partial": partial, "bwd-full": full, "bwd-partial": partial}


@pytest.mark.timeout(120)
def test_empty_blocks_are_skipped_not_computed(clusters):
    per_rank = clusters(WORLD).run(count_calls, 64, timeout=90)  # shards of 16, no padding
    for rank, calls in enumerate(per_rank):
        for name, got in calls.items():
            assert got == expected(name, rank, WORLD), (rank, name, got)


class Peak(TorchDispatchMode):
    """Records the largest tensor any op creates, and the shapes handed to p2p sends."""

    def __init__(self):
        super().__init__()
        self.largest = 0
        self.sent = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if "send" in func.__name__ and _ring_traffic(args):
            self.sent.append(tuple(_message(args).shape))
        for t in out if isinstance(out, (list, tuple)) else (out,):
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def peak_memory(seqlen, layout, causal, window):
    w = dist.get_world_size()
    b, h, hkv, d = 1, 8, 2, 32
    n = seqlen // w
    q = torch.randn(b, n, h, d, requires_grad=True)
    k = torch.randn(b, n, hkv, d, requires_grad=True)
    v = torch.randn(b, n, hkv, d, requires_grad=True)
    with Peak() as peak:
        out = ra.ring_attention(q, k, v, causal=causal, window_size=window, layout=layout, seqlen=seqlen)
        out.backward(torch.ones_like(out))
    return peak.largest, sorted(set(peak.sent)), (b, n, h, hkv, d)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("layout,causal,window", [
    ("zigzag", True, (-1, -1)), ("striped", True, (-1, -1)), ("contiguous", False, (-1, -1)),
    ("contiguous", True, (40, -1)),
])
def test_memory_is_per_shard(clusters, layout, causal, window):
    """No rank creates a tensor that grows with the global S: the largest is at most the
    size of the local q (fp32 dq/out accumulators) or the K/V pair of the shard, and K/V
    travel with their own Hkv heads."""
    seqlen = 2048
    per_rank = clusters(WORLD).run(peak_memory, seqlen, layout, causal, window, timeout=90)
    for rank, (largest, sent, (b, n, h, hkv, d)) in enumerate(per_rank):
        local_q = b * n * h * d
        assert largest <= local_q, (rank, largest, local_q)
        assert largest < b * seqlen * h * d / 2, (rank, largest)
        # K/V (and dK/dV) side by side on the head dim, with their own Hkv heads
        assert set(sent) <= {(b, n, hkv, 2 * d)}, (rank, sent)
        assert sent, "no ring traffic was observed"


def _message(args):
    return args[0][0] if isinstance(args[0], (list, tuple)) else args[0]


def _ring_traffic(args) -> bool:
    """A send/recv of ring data (floating point), not of the agreement's int64 row."""
    return _message(args).is_floating_point()


class OpOrder(TorchDispatchMode):
    """Records, in order, ring sends (S), receives (R) and attention kernel calls (K)."""

    def __init__(self):
        super().__init__()
        self.events = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = func.__name__
        if name.startswith("send") and _ring_traffic(args):
            self.events.append("S")
        elif name.startswith("recv") and _ring_traffic(args):
            self.events.append("R")
        elif "flash_attention" in name:
            self.events.append("K")
        return func(*args, **(kwargs or {}))


def op_order():
    w = dist.get_world_size()
    q = torch.randn(1, 8, 2, 8, requires_grad=True)
    orders = {}
    for overlap in ("all", "kv", "none"):
        with OpOrder() as fwd:  # full attention: one block per step
            out = ra.ring_attention(q, q, q, layout="contiguous", seqlen=8 * w,
                                    backward_overlap=overlap)
        with OpOrder() as bwd:
            out.backward(torch.ones_like(out))
        orders[overlap] = ("".join(fwd.events), "".join(bwd.events))
    return orders


@pytest.mark.timeout(60)
def test_next_hop_is_posted_before_compute(clusters):
    """Each step posts its hop (send + receive) before its kernel call; the last forward
    step sends nothing; in backward the dK/dV accumulator leaves after each step's kernel,
    and with backward_overlap="none" the K/V hop waits for the kernel too."""
    for rank, orders in enumerate(clusters(WORLD).run(op_order, timeout=45)):
        for overlap, (fwd, bwd) in orders.items():
            assert fwd == "SRK" * (WORLD - 1) + "K", (rank, overlap, fwd)
            step = "KSRSR" if overlap == "none" else "SRKSR"
            assert bwd == step * (WORLD - 1) + "KSR", (rank, overlap, bwd)


def general_mask_traffic(cu):
    """Counted kernel calls and the op order of one fwd+bwd under documents & causal."""
    w, rank = dist.get_world_size(), dist.get_rank()
    kern = CountingKernel()
    kern.tile = (4, 4)  # small tiles, so shards of 16 have full and partial tiles
    q = torch.randn(1, 64 // w, 2, 8, requires_grad=True)
    k = torch.randn(1, 64 // w, 2, 8, requires_grad=True)
    with OpOrder() as fwd:
        out = ra.ring_attention(q, k, k, causal=True, layout="contiguous", seqlen=64,
                                cu_seqlens=cu, kernel=kern)
    with OpOrder() as bwd:
        out.sum().backward()
    plan = make_plan(get_layout("contiguous"), ra.masks.document(cu) & ra.masks.causal(), w,
                     rank, 64, tile=(4, 4))
    counts = {k.value: n for k, n in plan.counts().items()}
    return kern.calls, counts, "".join(fwd.events), "".join(bwd.events)


@pytest.mark.timeout(60)
def test_general_mask_kernel_calls_and_truncated_ring(clusters):
    """Each FULL block is one unmasked kernel call and each PARTIAL block one masked call,
    forward and backward. Documents that reach one shard back need one K/V hop, no more;
    the dK/dV accumulator then goes straight home. Documents inside shards: no traffic."""
    one_back = [0, 8, 24, 40, 56, 64]
    for rank, (calls, counts, fwd, bwd) in enumerate(
            clusters(WORLD).run(general_mask_traffic, one_back, timeout=45)):
        want = {"fwd-full": counts["full"], "fwd-partial": counts["partial"],
                "bwd-full": counts["full"], "bwd-partial": counts["partial"]}
        assert calls == want, (rank, calls, want)
        assert counts["full"] > 0 and counts["partial"] > 0
        n = counts["full"] + counts["partial"]
        assert fwd.count("S") == 1 and fwd.startswith("SR") and fwd.count("K") == n, (rank, fwd)
        # one K/V hop; dK/dV: on to the next rank, then straight home (3 sends, not 2W-1 = 7)
        assert bwd.count("S") == 3 and bwd.count("K") == n, (rank, bwd)
    inside = [0, 5, 16, 20, 32, 48, 60, 64]
    for rank, (calls, counts, fwd, bwd) in enumerate(
            clusters(WORLD).run(general_mask_traffic, inside, timeout=45)):
        assert "S" not in fwd + bwd and "R" not in fwd + bwd, (rank, fwd, bwd)
        assert calls["fwd-full"] + calls["fwd-partial"] == counts["full"] + counts["partial"]


def overlapping_blocks():
    """The loop itself, on a hand-made plan whose blocks overlap in rows in every way: rows
    first seen by a merge must not be overwritten by a later block's copy."""
    from reference import attention
    from ringattn.comm import RingComm
    from ringattn.masks import Block, BlockKind
    from ringattn.plan import Plan
    from ringattn.strategies.ring import Ring, ring_forward
    from ringattn.spec import AttnSpec

    F = BlockKind.FULL
    blocks = (Block(F, 0, 3, 0, 4), Block(F, 2, 8, 4, 8), Block(F, 4, 8, 0, 4))
    ok = torch.zeros(8, 8, dtype=torch.bool)
    for b in blocks:
        ok[b.q_start:b.q_stop, b.k_start:b.k_stop] = True
    spec = AttnSpec(softmax_scale=0.5, seqlen=8)
    ring = Ring(RingComm(dist.group.WORLD), spec, Plan((blocks,)), get_kernel("sdpa-cpu", torch.device("cpu"), torch.float64), 1)
    q, k, v = (torch.randn(1, 8, 2, 4, dtype=torch.float64) for _ in range(3))
    out, lse = ring_forward(q, k, v, ring)
    ref, ref_lse = attention(q, k, v, ok, 0.5)
    return float((out - ref).abs().max()), float((lse - ref_lse).abs().max())


@pytest.mark.timeout(60)
def test_blocks_overlapping_in_rows_are_merged(clusters):
    (errs,) = clusters(1).run(overlapping_blocks, timeout=45)
    assert max(errs) < 1e-12, errs
