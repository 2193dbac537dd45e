"""LongNet's mixture of dilated attentions = ring attention per dilation + ``ra.merge``.

Runs examples/longnet_mixture.py's ``dilated_mixture`` on gloo ranks and compares out and
the gradients of q, k, v (which flow through the merge weights, i.e. through lse) with the
same mixture computed densely in float64 in one process, on every rank.
"""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

import ringattn as ra
from reference import rel_err

_EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "longnet_mixture.py"


def _example():
    spec = importlib.util.spec_from_file_location("longnet_mixture", _EXAMPLE)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def mixture_errors(layout, seqlen, configs):
    ex = _example()
    g = torch.Generator().manual_seed(dist.get_world_size())
    q, k, v, do = (torch.randn(1, seqlen, 4, 16, generator=g) for _ in range(4))
    k, v = k[:, :, :2].contiguous(), v[:, :, :2].contiguous()  # GQA
    qx, kx, vx = (t.clone().requires_grad_() for t in (q, k, v))
    kw = dict(layout=layout, seqlen=seqlen)
    out_l, _ = ex.dilated_mixture(*(ra.shard(t, **kw) for t in (qx, kx, vx)), configs, **kw)
    ra.unshard(out_l, **kw).backward(do)
    q64, k64, v64 = (t.double().requires_grad_() for t in (q, k, v))
    ref, _ = ex.dense_mixture(q64, k64, v64, configs)
    ref.backward(do.double())
    pos = ra.positions(seqlen, layout=layout)
    real = pos < seqlen
    return {"out": rel_err(out_l[:, real], ref.detach()[:, pos[real]]),
            "dq": rel_err(qx.grad, q64.grad), "dk": rel_err(kx.grad, k64.grad),
            "dv": rel_err(vx.grad, v64.grad)}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world,layout", [(2, "zigzag"), (3, "contiguous"), (3, "striped")])
def test_longnet_mixture_is_an_lse_merge(clusters, world, layout):
    configs = ((8, 1), (16, 2), (32, 4))
    for rank, errs in enumerate(clusters(world).run(mixture_errors, layout, 101, configs, timeout=90)):
        for name, err in errs.items():
            assert err < 1e-5, (rank, name, err)
