"""``ringattn.tiled_logprobs``: per-token log-probabilities and entropies from hidden states
in tiles, against the untiled computation (the logits, ``/ temperature``, log-softmax and
the entropy, by autograd): values and the gradients of a weighted sum (hidden states, head
weight and bias), float64 within 1e-12 and float32 within 1e-6, for tiles of 1, 4 rows and
the default budget, temperatures 1 and 0.6, a soft cap, positions without a target. Under
CP (W = 2, 3; S = 29 divides neither 2W; plain, left-padded and packed rows) each rank's
values on its shard, gathered, and the ranks' gradients (hidden gathered, head summed)
equal one process's. Bad input is refused by name."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

import ringattn as ra
from ringattn.logprobs import head_logprobs

S, H, V = 29, 8, 23


def _softcap(z):
    return torch.tanh(z / 3.0) * 3.0


def _untiled(hidden, weight, bias, shifted, temperature, logits_fn, ignore=-100):
    """The untiled computation: (log-probabilities, entropies), differentiable."""
    z = torch.nn.functional.linear(hidden, weight, bias)
    if logits_fn is not None:
        z = logits_fn(z)
    z = z.to(torch.promote_types(z.dtype, torch.float32)) / temperature
    logp = torch.log_softmax(z, dim=-1)
    has = shifted != ignore
    picked = logp.gather(-1, shifted.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    lp = torch.where(has, picked, torch.zeros_like(picked))
    ent = -(logp.exp() * logp).sum(-1)
    return lp, ent


def _rel(a, b) -> float:
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _compare_one(dtype, tile, temperature, logits_fn, bias: bool, flat: bool):
    g = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(H, V, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(V, H, generator=g, dtype=dtype))
        if bias:
            head.bias.copy_(torch.randn(V, generator=g, dtype=dtype))
    hidden = torch.randn(2, S, H, generator=g, dtype=dtype)
    ids = torch.randint(0, V, (2, S), generator=g)
    ids[1, :4] = -100  # positions whose target is masked (a prompt)
    shifted = torch.full_like(ids, -100)
    shifted[:, :-1] = ids[:, 1:]
    w_lp = torch.randn(2, S, generator=g, dtype=torch.float64)
    w_ent = torch.randn(2, S, generator=g, dtype=torch.float64)
    if flat:
        hidden, shifted, w_lp, w_ent = (hidden.reshape(2 * S, H), shifted.reshape(-1),
                                        w_lp.reshape(-1), w_ent.reshape(-1))
    out = {}
    for name, tiled in (("tiled", True), ("untiled", False)):
        head.zero_grad()
        h = hidden.clone().requires_grad_()
        if tiled:
            lp, ent = ra.tiled_logprobs(h, head, shift_labels=shifted, temperature=temperature,
                                        entropy=True, tile=tile, logits_fn=logits_fn)
        else:
            lp, ent = _untiled(h, head.weight, head.bias, shifted, temperature, logits_fn)
        ((lp * w_lp.to(lp.dtype)).sum() + (ent * w_ent.to(ent.dtype)).sum()).backward()
        out[name] = [lp.detach(), ent.detach(), h.grad, head.weight.grad] + (
            [head.bias.grad] if bias else [])
    return max(_rel(a, b) for a, b in zip(out["tiled"], out["untiled"])), out


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("tile", [1, 4, "16MiB"])
def test_tiled_logprobs_equal_the_untiled_computation(dtype, tol, tile):
    for temperature, logits_fn, bias, flat in ((1.0, None, True, False),
                                               (0.6, _softcap, False, False),
                                               (0.6, None, True, True)):
        err, out = _compare_one(dtype, tile, temperature, logits_fn, bias, flat)
        assert err <= tol, (dtype, tile, temperature, err)
        lp = out["tiled"][0].reshape(2, S)
        assert (lp[:, -1] == 0).all() and (lp[1, :3] == 0).all()  # no target: 0
        assert (lp[0, :-1] < 0).all()


def test_logprobs_without_entropy_and_with_labels():
    """``entropy=False`` gives None and the same log-probabilities; ``labels=`` is shifted as
    transformers shifts them; only the log-probabilities carry a gradient then."""
    g = torch.Generator().manual_seed(5)
    head = torch.nn.Linear(H, V).double()
    hidden = torch.randn(1, S, H, generator=g, dtype=torch.float64, requires_grad=True)
    ids = torch.randint(0, V, (1, S), generator=g)
    shifted = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
    a = ra.tiled_logprobs(hidden, head, labels=ids, tile=5)
    b = ra.tiled_logprobs(hidden, head, shift_labels=shifted, entropy=True, tile=7)
    assert a.entropy is None and _rel(a.logprobs, b.logprobs) < 1e-14
    a.logprobs.sum().backward()
    ref = hidden.detach().clone().requires_grad_()
    _untiled(ref, head.weight, head.bias, shifted, 1.0, None)[0].sum().backward()
    assert _rel(hidden.grad, ref.grad) < 1e-12


def test_refusals_name_the_value():
    head = torch.nn.Linear(H, V)
    hidden = torch.randn(1, 5, H)
    ids = torch.randint(0, V, (1, 5))
    for temperature in (0.0, -1.0, math.nan, math.inf):
        with pytest.raises(ValueError, match="temperature must be a finite float > 0"):
            ra.tiled_logprobs(hidden, head, labels=ids, temperature=temperature)
    for temperature in (True, "1.0", None):
        with pytest.raises(TypeError, match="temperature"):
            ra.tiled_logprobs(hidden, head, labels=ids, temperature=temperature)
    with pytest.raises(TypeError, match="neither"):
        ra.tiled_logprobs(hidden, head)
    with pytest.raises(TypeError, match="both"):
        ra.tiled_logprobs(hidden, head, labels=ids, shift_labels=ids)
    with pytest.raises(ValueError, match=f"outside \\[0, {V}\\)"):
        ra.tiled_logprobs(hidden, head, shift_labels=ids.masked_fill(ids == ids[0, 0], V))
    with pytest.raises(ValueError, match="must be labels' shape"):
        ra.tiled_logprobs(hidden, head, shift_labels=ids[:, :4])
    with pytest.raises(ValueError, match="tile"):
        ra.tiled_logprobs(hidden, head, labels=ids, tile=0)
    with pytest.raises(TypeError, match="entropy must be a bool"):
        ra.tiled_logprobs(hidden, head, labels=ids, entropy=1)
    with pytest.raises(TypeError, match="integer token ids"):
        ra.tiled_logprobs(hidden, head, shift_labels=ids.float())
    head.register_forward_hook(lambda m, a, o: o * 2)
    with pytest.raises(TypeError, match="plain linear head"):
        ra.tiled_logprobs(hidden, head, labels=ids)
    with pytest.raises(TypeError, match="the head's weight must be a \\[V, H\\] tensor"):
        head_logprobs(hidden, head.weight[0], None, ids)


def _batches():
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(1, V, (2, S), generator=g)
    plain = dict(input_ids=ids, labels=ids.clone())
    keep = torch.ones(2, S, dtype=torch.long)
    keep[1, :5] = 0  # left padding
    padded = dict(input_ids=ids, labels=ids.masked_fill(keep == 0, -100), attention_mask=keep)
    padded["labels"][1, 5] = -100
    pos = torch.cat([torch.arange(n) for n in (7, 1, 12, 9)])[None]
    packed_labels = ids[:1].clone()
    packed_labels[0, [0, 7, 8, 20]] = -100
    packed = dict(input_ids=ids[:1], labels=packed_labels, position_ids=pos)
    return {"plain": plain, "padded": padded, "packed": packed}


def cp_cases():
    """{batch: (worst relative error of values and gradients, W)} on this rank."""
    world = dist.get_world_size()
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(1)  # the same head on every rank
    head = torch.nn.Linear(H, V).double()
    hidden_all = torch.randn(2, S, H, generator=g, dtype=torch.float64)
    w_all = torch.randn(2, S, 2, generator=g, dtype=torch.float64)
    results = {}
    for name, batch in _batches().items():
        rows = batch["input_ids"].shape[0]
        shifted = torch.full_like(batch["labels"], -100)
        shifted[:, :-1] = batch["labels"][:, 1:]
        full = hidden_all[:rows].clone().requires_grad_()
        head.zero_grad()
        lp, ent = _untiled(full, head.weight, head.bias, shifted, 0.7, None)
        w = w_all[:rows]
        ((lp * w[..., 0]).sum() + (ent * w[..., 1]).sum()).backward()
        ref = [lp.detach(), ent.detach(), full.grad, head.weight.grad.clone(),
               head.bias.grad.clone()]
        head.zero_grad()
        local = ra.shard_batch(batch)
        cu = local["ring_context"].cu_seqlens

        def mine_of(x):
            return ra.shard(x, seqlen=S, cu_seqlens=cu)

        def back(x):
            return ra.unshard(x, seqlen=S, cu_seqlens=cu)

        mine = mine_of(hidden_all[:rows]).detach().requires_grad_()
        got = ra.tiled_logprobs(mine, head, shift_labels=local["shift_labels"],
                                temperature=0.7, entropy=True, tile=3)
        wl = mine_of(w)
        ((got.logprobs * wl[..., 0]).sum() + (got.entropy * wl[..., 1]).sum()).backward()
        d_w, d_b = head.weight.grad.clone(), head.bias.grad.clone()
        dist.all_reduce(d_w)
        dist.all_reduce(d_b)
        both = back(torch.stack([got.logprobs, got.entropy], -1).detach())
        mine_vals = [both[..., 0], both[..., 1], back(mine.grad), d_w, d_b]
        results[name] = (max(_rel(a, b) for a, b in zip(mine_vals, ref)), world)
    return results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_tiled_logprobs_under_cp_equal_one_process(clusters, world):
    for rank, results in enumerate(clusters(world).run(cp_cases, timeout=150)):
        for name, (err, w) in results.items():
            assert w == world
            assert err < 1e-12, (name, rank, err)
