"""``ringattn.tiled_logprobs``: per-token log-probabilities and entropies from hidden states
in tiles, against the untiled computation (the logits, ``/ temperature``, log-softmax and
the entropy, by autograd): values and the gradients of a weighted sum (hidden states, head
weight and bias), float64 within 1e-12 and float32 within 1e-6, for tiles of 1, 4 rows and
the default budget, temperatures 1 and 0.6, a soft cap, positions without a target. Under
CP (W = 2, 3; S = 29 divides neither 2W; plain, left-padded and packed rows) each rank's
values on its shard, gathered, and the ranks' gradients (hidden gathered, head summed)
equal one process's. Bad input is refused by name.

``ringattn.tiled_token_loss`` (a per-position loss of the log-probabilities and entropies,
its gradients computed in the forward): the loss, values and gradients against the untiled
loss, alike, and under CP the ranks' losses summed against one process's."""

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
    a, b = a.detach(), b.detach()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _problem(seed: int, dtype, bias: bool):
    """(generator, a head with random weights, hidden [2, S, H], shifted targets [2, S]:
    row 1's first 4 targets masked, as a prompt, and each row's last)."""
    g = torch.Generator().manual_seed(seed)
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
    return g, head, hidden, shifted


def _compare_one(dtype, tile, temperature, logits_fn, bias: bool, flat: bool):
    g, head, hidden, shifted = _problem(3, dtype, bias)
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
        # tiled_token_loss on the shards: the ranks' losses sum to one process's loss
        inputs = _token_inputs(torch.Generator().manual_seed(4), (rows, S), torch.float64)
        full = hidden_all[:rows].clone().requires_grad_()
        head.zero_grad()
        loss, _, _ = _token_untiled(full, head.weight, head.bias, shifted, 0.7, None, inputs,
                                    True)
        loss.backward()
        ref = [loss.detach(), full.grad, head.weight.grad.clone(), head.bias.grad.clone()]
        head.zero_grad()
        mine = mine_of(hidden_all[:rows]).detach().requires_grad_()
        got = ra.tiled_token_loss(mine, head, _grpo_token, shift_labels=local["shift_labels"],
                                  inputs={k: mine_of(v) for k, v in inputs.items()},
                                  temperature=0.7, entropy=True, tile=3)
        got.loss.backward()
        parts = torch.cat([got.loss.detach().view(1), head.weight.grad.reshape(-1),
                           head.bias.grad])
        dist.all_reduce(parts)
        mine_vals = [parts[0], back(mine.grad), parts[1:1 + V * H].view(V, H), parts[1 + V * H:]]
        results[name + " token loss"] = (max(_rel(a, b) for a, b in zip(mine_vals, ref)), world)
    return results


@pytest.mark.timeout(180)
@pytest.mark.parametrize("world", [2, 3])
def test_tiled_logprobs_under_cp_equal_one_process(clusters, world):
    for rank, results in enumerate(clusters(world).run(cp_cases, timeout=150)):
        for name, (err, w) in results.items():
            assert w == world
            assert err < 1e-12, (name, rank, err)


# ---------------------------------------------------------------- tiled_token_loss


def _grpo_token(lp, ent, adv, ref, weight, ent_weight):
    """One position's GRPO-style loss: the clipped ratio to the policy's own detached value
    (one iteration), a k3 KL to a reference, an entropy bonus; weights are normalisers."""
    ratio = torch.exp(lp - lp.detach())
    clipped = torch.clamp(ratio, 0.8, 1.2)
    kl = torch.exp(ref - lp) - (ref - lp) - 1
    return ((-torch.minimum(ratio * adv, clipped * adv) + 0.04 * kl) * weight
            - (0.0 if ent is None else ent * ent_weight))


def _token_inputs(g, shape, dtype):
    adv = torch.randn(shape, generator=g, dtype=dtype)
    ref = -torch.rand(shape, generator=g, dtype=dtype) * 4
    weight = torch.rand(shape, generator=g, dtype=dtype)
    ent_weight = 0.01 * torch.rand(shape, generator=g, dtype=dtype)
    return dict(adv=adv, ref=ref, weight=weight, ent_weight=ent_weight)


def _token_untiled(hidden, weight, bias, shifted, temperature, logits_fn, inputs, entropy):
    lp, ent = _untiled(hidden, weight, bias, shifted, temperature, logits_fn)
    return _grpo_token(lp, ent if entropy else None, **inputs).sum(), lp, ent


def _compare_token(dtype, tile, temperature, logits_fn, bias, flat, entropy):
    g, head, hidden, shifted = _problem(7, dtype, bias)
    inputs = _token_inputs(g, (2, S), dtype)
    if flat:
        hidden, shifted = hidden.reshape(2 * S, H), shifted.reshape(-1)
        inputs = {k: v.reshape(-1) for k, v in inputs.items()}
    out = {}
    for name in ("tiled", "untiled"):
        head.zero_grad()
        h = hidden.clone().requires_grad_()
        if name == "tiled":
            got = ra.tiled_token_loss(h, head, _grpo_token, shift_labels=shifted, inputs=inputs,
                                      temperature=temperature, entropy=entropy, tile=tile,
                                      logits_fn=logits_fn)
            loss, lp, ent = got
            assert not lp.requires_grad and (ent is None) == (not entropy)
        else:
            loss, lp, ent = _token_untiled(h, head.weight, head.bias, shifted, temperature,
                                           logits_fn, inputs, entropy)
        loss.backward()
        out[name] = ([lp.detach()] + ([ent.detach()] if entropy else []),
                     [loss.detach(), h.grad, head.weight.grad] + ([head.bias.grad] if bias
                                                                   else []))
    return tuple(max(_rel(a, b) for a, b in zip(mine, theirs))
                 for mine, theirs in zip(out["tiled"], out["untiled"]))


@pytest.mark.parametrize("dtype,tol,loss_tol", [(torch.float64, 1e-12, 1e-12),
                                                (torch.float32, 1e-6, 1e-5)])
@pytest.mark.parametrize("tile", [1, 4, "16MiB"])
def test_tiled_token_loss_equals_the_untiled_loss(dtype, tol, loss_tol, tile):
    """The log-probabilities and entropies (float64 within 1e-12, fp32 1e-6), the loss and
    the gradients of hidden states, head weight and bias (fp32: 1e-5, sums of terms of both
    signs; ``test_tiled_token_loss_fp32_against_float64`` bounds them against float64) equal
    the untiled computation's, with and without entropy, a soft cap (autograd per tile) and
    without (by hand), flat or [B, L]."""
    for temperature, logits_fn, bias, flat, entropy in ((1.0, None, True, False, True),
                                                        (0.6, _softcap, False, False, True),
                                                        (0.6, None, True, True, False),
                                                        (0.8, _softcap, True, True, False)):
        err, err_loss = _compare_token(dtype, tile, temperature, logits_fn, bias, flat, entropy)
        assert err <= tol and err_loss <= loss_tol, (dtype, tile, temperature, logits_fn,
                                                     entropy, err, err_loss)


def test_tiled_token_loss_fp32_against_float64():
    """fp32 inputs against the float64 computation of the same values: within fp32
    rounding."""
    g = torch.Generator().manual_seed(11)
    head = torch.nn.Linear(H, V)
    hidden = torch.randn(1, S, H, generator=g)
    ids = torch.randint(0, V, (1, S), generator=g)
    inputs = _token_inputs(g, (1, S), torch.float32)
    h = hidden.clone().requires_grad_()
    loss = ra.tiled_token_loss(h, head, _grpo_token, labels=ids, inputs=inputs, entropy=True,
                               temperature=0.7, tile=5).loss
    loss.backward()
    head64 = torch.nn.Linear(H, V).double()
    head64.load_state_dict(head.state_dict())
    h64 = hidden.double().requires_grad_()
    shifted = torch.cat([ids[:, 1:], torch.full((1, 1), -100)], 1)
    ref, _, _ = _token_untiled(h64, head64.weight, head64.bias, shifted, 0.7, None,
                               {k: v.double() for k, v in inputs.items()}, True)
    ref.backward()
    assert abs(float(loss.detach()) - float(ref.detach())) <= 1e-5 * max(1.0, abs(float(ref)))
    for a, b in ((h.grad, h64.grad), (head.weight.grad, head64.weight.grad),
                 (head.bias.grad, head64.bias.grad)):
        assert _rel(a.double(), b) < 1e-5


def test_tiled_token_loss_edges():
    """A position's loss sees only that position; inputs with trailing dimensions; the head
    alone trainable; no gradient wanted (no_grad); a rank with no tokens; one backward."""
    g = torch.Generator().manual_seed(2)
    head = torch.nn.Linear(H, V).double()
    hidden = torch.randn(1, S, H, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (1, S), generator=g)
    pair = torch.randn(1, S, 2, generator=g, dtype=torch.float64)

    def fn(lp, ent, pair):  # a trailing dimension: each position's [2]
        assert lp.dim() == 0 and pair.shape == (2,)
        return pair[0] * lp + pair[1] * lp.square()

    got = ra.tiled_token_loss(hidden, head, fn, labels=ids, inputs={"pair": pair}, tile=3)
    got.loss.backward()  # hidden needs no gradient: the head's alone
    lp = ra.tiled_logprobs(hidden, head, labels=ids).logprobs
    assert _rel(got.logprobs, lp.detach()) < 1e-14
    w_grad = head.weight.grad.clone()
    head.zero_grad()
    (pair[..., 0] * lp + pair[..., 1] * lp.square()).sum().backward()
    assert _rel(w_grad, head.weight.grad) < 1e-12
    with torch.no_grad():
        again = ra.tiled_token_loss(hidden, head, fn, labels=ids, inputs={"pair": pair})
    assert not again.loss.requires_grad and _rel(again.loss, got.loss.detach()) < 1e-12
    # a rank with nothing to do: 0 tokens, loss 0, zero gradients of the head
    head.zero_grad()
    empty = hidden[:, :0].clone().requires_grad_()
    none = ra.tiled_token_loss(empty, head, fn, shift_labels=ids[:, :0],
                               inputs={"pair": pair[:, :0]})
    none.loss.backward()
    assert float(none.loss) == 0.0 and empty.grad.shape == (1, 0, H)
    assert not head.weight.grad.any()
    h = hidden.clone().requires_grad_()
    loss = ra.tiled_token_loss(h, head, fn, labels=ids, inputs={"pair": pair}).loss
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="backward already ran"):
        loss.backward()


def test_tiled_token_loss_refusals_name_the_value():
    head = torch.nn.Linear(H, V)
    hidden = torch.randn(1, 5, H)
    ids = torch.randint(0, V, (1, 5))
    adv = torch.randn(1, 5)

    def fn(lp, ent, adv):
        return lp * adv

    with pytest.raises(TypeError, match="token_loss must be callable"):
        ra.tiled_token_loss(hidden, head, None, labels=ids)
    with pytest.raises(TypeError, match="inputs must be a dict"):
        ra.tiled_token_loss(hidden, head, fn, labels=ids, inputs=[adv])
    with pytest.raises(TypeError, match=r"inputs\['adv'\] must be a tensor"):
        ra.tiled_token_loss(hidden, head, fn, labels=ids, inputs={"adv": 1.0})
    with pytest.raises(TypeError, match=r"inputs\['adv'\] requires a gradient"):
        ra.tiled_token_loss(hidden, head, fn, labels=ids,
                            inputs={"adv": adv.clone().requires_grad_()})
    with pytest.raises(ValueError, match=r"inputs\['adv'\] has shape \(5,\)"):
        ra.tiled_token_loss(hidden, head, fn, labels=ids, inputs={"adv": adv[0]})
    with pytest.raises(TypeError, match="argument names"):
        ra.tiled_token_loss(hidden, head, fn, labels=ids, inputs={"a b": adv})
    with pytest.raises(TypeError, match="one position's loss, a 0-d tensor"):
        ra.tiled_token_loss(hidden, head, lambda lp, ent, adv: torch.stack([lp, adv]),
                            labels=ids, inputs={"adv": adv})
    with pytest.raises(ValueError, match="temperature must be a finite float > 0"):
        ra.tiled_token_loss(hidden, head, fn, labels=ids, inputs={"adv": adv}, temperature=0.0)
    with pytest.raises(TypeError, match="neither"):
        ra.tiled_token_loss(hidden, head, fn, inputs={"adv": adv})
    # a Python branch on a value cannot see one position: torch refuses it, nothing is summed
    with pytest.raises(RuntimeError):
        ra.tiled_token_loss(hidden, head, lambda lp, ent, adv: lp if adv > 0 else -lp,
                            labels=ids, inputs={"adv": adv})


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_heads_against_float64(dtype):
    """A bf16 / fp16 head and hidden states: ``tiled_logprobs`` (gradients in its backward)
    and ``tiled_token_loss`` (in its forward) give the float64 computation's values and
    gradients within that dtype's rounding, and the head's gradient in its dtype."""
    g = torch.Generator().manual_seed(13)
    head64 = torch.nn.Linear(H, V).double()
    hidden64 = torch.randn(2, S, H, generator=g, dtype=torch.float64)
    ids = torch.randint(0, V, (2, S), generator=g)
    shifted = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1)
    inputs = _token_inputs(g, (2, S), torch.float64)
    h64 = hidden64.clone().requires_grad_()
    ref, _, _ = _token_untiled(h64, head64.weight, head64.bias, shifted, 0.8, None, inputs, True)
    ref.backward()
    for how in ("logprobs", "token loss"):
        head = torch.nn.Linear(H, V).to(dtype)
        head.load_state_dict({k: v.to(dtype) for k, v in head64.state_dict().items()})
        h = hidden64.to(dtype).requires_grad_()
        if how == "logprobs":
            lp, ent = ra.tiled_logprobs(h, head, shift_labels=shifted, temperature=0.8,
                                        entropy=True, tile=5)
            loss = _grpo_token(lp, ent, **{k: v.float() for k, v in inputs.items()}).sum()
        else:
            loss = ra.tiled_token_loss(h, head, _grpo_token, shift_labels=shifted,
                                       inputs={k: v.float() for k, v in inputs.items()},
                                       temperature=0.8, entropy=True, tile=5).loss
        loss.backward()
        assert head.weight.grad.dtype == dtype and h.grad.dtype == dtype
        assert abs(float(loss.detach()) - float(ref.detach())) < 0.05 * abs(float(ref))
        for a, b in ((h.grad, h64.grad), (head.weight.grad, head64.weight.grad)):
            assert _rel(a.double(), b) < 0.05, (how, dtype, _rel(a.double(), b))
