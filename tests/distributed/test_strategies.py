"""The strategies beside the ring: Ulysses (``ra.ulysses_attention``) and all-gather KV
(``ra.allgather_attention``, all kv heads at once and one at a time). Exact on every rank
against the float64 oracle, with the cases of test_exact.py (causal, full, windows,
documents, prefix-LM, dilated with head offsets, a head-dependent custom mask; MHA, GQA,
MQA; W > Hkv and H = 4 not divisible by W = 3; H < W; S divisible by nothing) and of
test_features.py (soft-capping, sinks, ALiBi, MLA); the collectives each makes; Ulysses'
head split."""

import pytest
import torch
import torch.distributed as dist

import ringattn as ra
from ringattn.testing import count_collectives
from ringattn.strategies.ulysses import head_split
from test_exact import LAYOUTS, cases, check, mask_cases, run_cases
from test_features import cases as feature_cases
from test_features import run_cases as run_feature_cases


STRATEGIES = {  # name: (function, keyword options)
    "ulysses": ("ulysses_attention", {}),
    "allgather": ("allgather_attention", {}),
    "allgather-stride1": ("allgather_attention", {"heads_k_stride": 1}),
}


@pytest.mark.timeout(240)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_fp32_exact(clusters, worst_errors, strategy, world, layout):
    picked = cases(world) + mask_cases(world)
    per_rank = clusters(world).run(run_cases, layout, picked, "float32", *STRATEGIES[strategy],
                                   timeout=200)
    check(per_rank, "float32", worst_errors)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,layout", [(2, "zigzag"), (3, "striped")])
@pytest.mark.parametrize("strategy", ["ulysses", "allgather"])
def test_bf16_within_twice_plain_sdpa(clusters, worst_errors, strategy, world, layout):
    wanted = ("causal-gqa-odd-S-B2", "window-two-sided", "docs-causal", "dilated-head-offsets")
    picked = [c for c in cases(world) + mask_cases(world) if c.name in wanted]
    per_rank = clusters(world).run(run_cases, layout, picked, "bfloat16", *STRATEGIES[strategy],
                                   timeout=200)
    check(per_rank, "bfloat16", worst_errors)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world,layout", [(2, "zigzag"), (3, "contiguous"), (4, "striped")])
@pytest.mark.parametrize("strategy", list(STRATEGIES))
def test_features_exact(clusters, worst_errors, strategy, world, layout):
    per_rank = clusters(world).run(run_feature_cases, layout, feature_cases(world), "float32",
                                   *STRATEGIES[strategy], timeout=200)
    check(per_rank, "float32", worst_errors)


def test_head_split_covers_every_head_once_and_reads_the_right_kv_heads():
    for h, hkv, w in [(8, 8, 4), (8, 2, 4), (8, 2, 3), (4, 1, 3), (4, 4, 6), (12, 4, 8), (6, 3, 4)]:
        split = head_split(h, hkv, w)
        assert sorted(x for qs in split.q_heads for x in qs) == list(range(h))
        for qs, kvs in zip(split.q_heads, split.kv_heads):
            if not qs:
                assert not kvs
                continue
            per = len(qs) // len(kvs)
            assert per * len(kvs) == len(qs)
            # local query head j reads local kv head j // per: that must be its global one
            assert [kvs[j // per] for j in range(len(qs))] == [x // (h // hkv) for x in qs]
    assert head_split(8, 2, 4).kv_heads == ((0,), (0,), (1,), (1,))  # W > Hkv: each once
    assert head_split(8, 8, 4).kv_heads == ((0, 1), (2, 3), (4, 5), (6, 7))


def count_ulysses_collectives(return_lse):
    """Rank side: collectives of one forward and one backward."""
    g = torch.Generator().manual_seed(0)
    s = 4 * dist.get_world_size() + 1
    q, k, v = (torch.randn(1, s, hh, 8, generator=g) for hh in (4, 2, 2))
    leaves = [ra.shard(t, seqlen=s).detach().requires_grad_() for t in (q, k, v)]
    with count_collectives() as fwd:
        res = ra.ulysses_attention(*leaves, causal=True, seqlen=s, return_lse=return_lse)
    out = res[0] if return_lse else res
    with count_collectives() as bwd:
        out.square().sum().backward()
    local_kv_bytes = leaves[1].numel() * leaves[1].element_size()
    return fwd, bwd, local_kv_bytes


@pytest.mark.timeout(120)
@pytest.mark.parametrize("return_lse", [False, True])
def test_ulysses_collectives(clusters, return_lse):
    """Forward: the agreement, then one all-to-all each for q, k, v and out (and
    lse); backward: their reverses, nothing else. With H=4, Hkv=2 on 2 ranks each rank
    needs one kv head: K and V travel unexpanded (each all-to-all sends a local k's bytes)."""
    n_out = 2 if return_lse else 1
    for rank, (fwd, bwd, kv_bytes) in enumerate(
            clusters(2).run(count_ulysses_collectives, return_lse, timeout=100)):
        names = [n for n, _ in fwd]
        assert names == ["agreement"] + ["all_to_all_single"] * (3 + n_out), (rank, fwd)
        assert fwd[2][1] == fwd[3][1] == kv_bytes, (rank, fwd, kv_bytes)
        assert [n for n, _ in bwd] == ["all_to_all_single"] * (3 + n_out), (rank, bwd)


def count_allgather_collectives(stride):
    """Rank side: collectives of one all-gather forward and backward."""
    g = torch.Generator().manual_seed(0)
    s = 4 * dist.get_world_size() + 1
    q, k, v = (torch.randn(1, s, hh, 8, generator=g) for hh in (4, 2, 2))
    leaves = [ra.shard(t, seqlen=s).detach().requires_grad_() for t in (q, k, v)]
    with count_collectives() as fwd:
        out = ra.allgather_attention(*leaves, causal=True, seqlen=s, heads_k_stride=stride)
    with count_collectives() as bwd:
        out.square().sum().backward()
    return fwd, bwd, leaves[1].numel() * leaves[1].element_size()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("stride", [None, 1])
def test_allgather_collectives(clusters, stride):
    """Forward: the agreement, then one all-gather of K and V (unexpanded: a local k's and
    v's bytes) per group of kv heads; backward: per group, the same all-gather again and one
    reduce-scatter of dK and dV (an all-to-all on gloo), nothing else."""
    groups = 2 if stride == 1 else 1
    for rank, (fwd, bwd, kv_bytes) in enumerate(
            clusters(2).run(count_allgather_collectives, stride, timeout=100)):
        assert [n for n, _ in fwd] == ["agreement"] + ["all_gather_single"] * groups, (rank, fwd)
        assert sum(b for _, b in fwd[1:]) == 2 * kv_bytes, (rank, fwd, kv_bytes)
        # on gloo the reduce-scatter travels as an all-to-all (ringattn.comm: gloo's own
        # reduce-scatter cannot be bounded by ringattn's timeout); NCCL uses its own
        assert [n for n, _ in bwd] == ["all_gather_single", "all_to_all_single"] * groups, (
            rank, bwd)


def largest_tensor(strategy, seqlen, stride):
    """Rank side: the largest tensor (elements) any op creates in one fwd+bwd, and the
    sizes the contracts allow: a local q of all heads (Ulysses: the whole sequence for
    H / W heads), and S_pad x stride kv heads x (D + Dv) (all-gather's K/V in flight)."""
    from test_ring_properties import Peak

    w = dist.get_world_size()
    b, h, hkv, d = 1, 8, 4, 32
    n = seqlen // w
    q = torch.randn(b, n, h, d, requires_grad=True)
    k = torch.randn(b, n, hkv, d, requires_grad=True)
    v = torch.randn(b, n, hkv, d, requires_grad=True)
    opts = {"heads_k_stride": stride} if strategy == "allgather_attention" else {}
    with Peak() as peak:
        out = getattr(ra, strategy)(q, k, v, causal=True, seqlen=seqlen, **opts)
        out.backward(torch.ones_like(out))
    return peak.largest, b * n * h * d, b * seqlen * (stride or hkv) * 2 * d


@pytest.mark.timeout(120)
@pytest.mark.parametrize("strategy,stride", [("ulysses_attention", None),
                                             ("allgather_attention", None),
                                             ("allgather_attention", 1)])
def test_memory_contracts(clusters, strategy, stride):
    """Ulysses: no tensor larger than a local q of all heads (its whole-sequence q, k, v, out
    hold H / W heads). All-gather: none larger than the full-S K/V of the kv heads in flight
    (heads_k_stride of them), which is below the global q for stride 1."""
    seqlen = 2048
    for rank, (largest, local_q, kv_in_flight) in enumerate(
            clusters(4).run(largest_tensor, strategy, seqlen, stride, timeout=100)):
        if strategy == "ulysses_attention":
            assert largest <= local_q, (rank, largest, local_q)
        else:
            assert largest <= kv_in_flight, (rank, largest, kv_in_flight)
