"""The one-process simulation of a W-rank ring (``ringattn.simulate``): the real ring loops
with hops as copies between threads. Its results must be every rank's exact shard of
attention over the whole sequence (fp32 against float64, 1e-5), forward and backward, or
its kernel timings would measure something else than a real ring."""

import pytest
import torch

from reference import reference, rel_err, visible
from ringattn.simulate import local_positions_of, simulate

CASES = [  # (world, layout, causal, window, documents)
    (1, "zigzag", True, (-1, -1), None),
    (2, "zigzag", True, (-1, -1), None),
    (3, "striped", False, (4, 2), None),
    (4, "contiguous", True, (5, -1), None),
    (4, "zigzag", True, (-1, -1), [0, 5, 6, 20, 37]),
    (8, "zigzag", False, (-1, -1), None),
]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,layout,causal,window,cu", CASES)
def test_simulated_ring_is_exact_on_every_rank(world, layout, causal, window, cu):
    s = 37
    g = torch.Generator().manual_seed(world)
    q = torch.randn(2, s, 4, 16, generator=g)
    k, v = (torch.randn(2, s, 2, 16, generator=g) for _ in range(2))
    dout = torch.randn(2, s, 4, 16, generator=g)
    ok = visible(s, causal, window)
    if cu is not None:
        doc = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.tensor(cu).diff())
        ok = ok & (doc[:, None] == doc[None, :])
    refs = reference(q, k, v, dout, ok)
    sim = simulate(q, k, v, dout, world=world, causal=causal, window_size=window,
                   layout=layout, cu_seqlens=cu)
    assert sim.steps >= 1 and len(sim.ranks) == world
    for r, res in enumerate(sim.ranks):
        pos = local_positions_of(sim, r, layout, s, cu)
        real = pos < s
        idx = pos[real]
        got = [res.out[:, real], res.lse[:, :, real], res.grads[0][:, real],
               res.grads[1][:, real], res.grads[2][:, real]]
        want = [refs[0][:, idx], refs[1][:, :, idx], refs[2][:, idx], refs[3][:, idx],
                refs[4][:, idx]]
        for name, x, y in zip(("out", "lse", "dq", "dk", "dv"), got, want):
            err = rel_err(x, y, floor=1.0 if name == "lse" else 0.0)
            assert err < 1e-5, (r, name, err)
        assert torch.all(res.out[:, ~real] == 0)
        assert res.calls["forward"] >= 1 and res.seconds["forward"] > 0
        assert res.calls["backward"] >= 1 and res.seconds["backward"] > 0
    assert all(t > 0 for t in sim.kernel_seconds())


class _Broken:
    """A kernel that fails: what a bug in a block kernel looks like to the simulation."""

    name, tile, features = "broken", (256, 128), frozenset()

    def supports(self, device, dtype):
        return True

    def forward(self, *args, **kwargs):
        raise RuntimeError("kernel bug")

    backward = forward


def test_bad_input_and_failing_ranks_are_reported():
    """Shapes are checked before any rank starts; a rank whose kernel fails raises, naming
    it, instead of leaving the others waiting."""
    q, k = torch.randn(1, 16, 3, 8), torch.randn(1, 16, 2, 8)
    with pytest.raises(ValueError, match="3 heads, not a multiple of k's 2"):
        simulate(q, k, k, world=2)
    with pytest.raises(RuntimeError, match=r"simulated rank \d of 2 failed: kernel bug"):
        simulate(k, k, k, world=2, kernel=_Broken(), timeout_s=5)
