"""``ringattn.tiled_lm_loss`` equals the untiled causal-LM loss (transformers' recipe: the
head's logits upcast to float32, cross-entropy summed over targets and divided by the count)
and its gradients, for every tile size, with and without a bias, label smoothing, a z-loss,
ignored targets and a given count; float64 to rounding, float32 within 1e-6. Bad input is
refused by name."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ringattn as ra


def _reference(hidden, weight, bias, labels, *, count=None, smoothing=0.0, z=0.0):
    logits = F.linear(hidden, weight, bias)
    logits = logits.to(torch.promote_types(logits.dtype, torch.float32)).reshape(-1, weight.shape[0])
    flat = labels.reshape(-1)
    total = F.cross_entropy(logits, flat, ignore_index=-100, reduction="sum",
                            label_smoothing=smoothing)
    if z:
        valid = flat != -100
        total = total + z * torch.logsumexp(logits, -1)[valid].square().sum()
    denom = (flat != -100).sum() if count is None else count
    return total / denom


def _case(dtype, bias=True, seed=0):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 13, 16, generator=g, dtype=dtype).requires_grad_()
    head = torch.nn.Linear(16, 37, bias=bias).to(dtype)
    with torch.no_grad():
        head.weight.copy_(torch.randn(37, 16, generator=g) * 0.5)
        if bias:
            head.bias.copy_(torch.randn(37, generator=g))
    labels = torch.randint(0, 37, (2, 13), generator=g)
    labels[0, :3] = -100
    labels[1, -1] = -100
    return hidden, head, labels


def _grads(loss, *tensors):
    return torch.autograd.grad(loss, [t for t in tensors if t is not None])


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("tile", [1, 5, 26, 1000])
@pytest.mark.parametrize("options", [{}, {"bias": False}, {"smoothing": 0.1}, {"z": 1e-3},
                                     {"count": 40}, {"smoothing": 0.2, "z": 1e-2, "count": 7}])
def test_equals_the_untiled_loss_and_gradients(dtype, tol, tile, options):
    hidden, head, labels = _case(dtype, bias=options.get("bias", True))
    kw = {k: v for k, v in options.items() if k != "bias"}
    want = _reference(hidden, head.weight, head.bias, labels, **kw)
    got = ra.tiled_lm_loss(hidden, head, shift_labels=labels, tile=tile, num_items_in_batch=kw.get("count"),
                           label_smoothing=kw.get("smoothing", 0.0), z_loss=kw.get("z", 0.0))
    assert got.dtype == torch.promote_types(dtype, torch.float32) and got.dim() == 0
    assert abs(float(got) - float(want)) <= tol * abs(float(want)), (float(got), float(want))
    w_grads = _grads(want, hidden, head.weight, head.bias)
    g_grads = _grads(got, hidden, head.weight, head.bias)
    for a, b in zip(g_grads, w_grads):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert float((a.double() - b.double()).norm()) <= tol * 10 * float(b.double().norm())


def test_a_weight_tensor_a_flat_batch_and_a_scaled_gradient():
    hidden, head, labels = _case(torch.float64)
    weight = head.weight.detach().requires_grad_()
    flat_h, flat_l = hidden.reshape(-1, 16), labels.reshape(-1)
    want = _reference(flat_h, weight, None, flat_l)
    got = ra.tiled_lm_loss(flat_h, weight, shift_labels=flat_l, tile=4)
    assert torch.allclose(got.double(), want.double(), rtol=1e-12)
    (3.0 * got).backward()
    (gw,) = torch.autograd.grad(3.0 * want, weight)
    assert torch.allclose(weight.grad, gw, rtol=1e-10, atol=1e-14)


def test_bad_input_is_refused_by_name():
    hidden, head, labels = _case(torch.float32)
    with pytest.raises(TypeError, match="Sequential, not exactly a torch.nn.modules.linear"):
        ra.tiled_lm_loss(hidden, torch.nn.Sequential(head), shift_labels=labels)
    with pytest.raises(TypeError, match="lm_head must be a torch.nn.Linear or its"):
        ra.tiled_lm_loss(hidden, head.weight[0], shift_labels=labels)
    with pytest.raises(TypeError, match="got neither"):
        ra.tiled_lm_loss(hidden, head)
    with pytest.raises(TypeError, match="got both"):
        ra.tiled_lm_loss(hidden, head, shift_labels=labels, labels=labels)
    with pytest.raises(TypeError):  # the targets only by keyword: which ones is said
        ra.tiled_lm_loss(hidden, head, labels)
    with pytest.raises(ValueError, match="byte budget such as '16MiB'"):
        ra.tiled_lm_loss(hidden, head, shift_labels=labels, tile="64 MB")
    with pytest.raises(ValueError, match="byte budget"):
        ra.tiled_lm_loss(hidden, head, shift_labels=labels, tile="0MiB")
    with pytest.raises(ValueError, match="outside \\[0, 37\\)"):
        ra.tiled_lm_loss(hidden, head, shift_labels=labels.masked_fill(labels == labels[0, 5], 37))
    with pytest.raises(ValueError, match="outside"):
        ra.tiled_lm_loss(hidden, head, shift_labels=labels.masked_fill(labels == -100, -1))
    with pytest.raises(ValueError, match="tile must be an int >= 1"):
        ra.tiled_lm_loss(hidden, head, shift_labels=labels, tile=0)
    with pytest.raises(ValueError, match="label_smoothing"):
        ra.tiled_lm_loss(hidden, head, shift_labels=labels, label_smoothing=1.0)
    with pytest.raises(ValueError, match="z_loss"):
        ra.tiled_lm_loss(hidden, head, shift_labels=labels, z_loss=float("nan"))
    with pytest.raises(ValueError, match="num_items_in_batch must be > 0"):
        ra.tiled_lm_loss(hidden, head, shift_labels=labels, num_items_in_batch=0)
    with pytest.raises(ValueError, match="labels' shape"):
        ra.tiled_lm_loss(hidden[:, :-1], head, shift_labels=labels)
    with pytest.raises(TypeError, match="integer token ids"):
        ra.tiled_lm_loss(hidden, head, shift_labels=labels.float())
    with pytest.raises(TypeError, match="tile must be rows .an int >= 1. or a byte budget"):
        ra.tiled_lm_loss(hidden, head, shift_labels=labels, tile=1.5)
    with pytest.raises(TypeError, match="logits_fn must be callable"):
        ra.tiled_lm_loss(hidden, head, shift_labels=labels, logits_fn=30.0)


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
@pytest.mark.parametrize("fn", [lambda x: torch.tanh(x / 3.0) * 3.0, lambda x: x * 0.0625,
                                lambda x: x / 4.0])
def test_a_transform_of_the_logits_is_followed(dtype, tol, fn):
    """A soft cap or a scale on the head's output (Gemma 2, Cohere, Granite): the loss of
    the transformed logits, and its gradients through the transform."""
    hidden, head, labels = _case(dtype)
    logits = fn(F.linear(hidden, head.weight, head.bias)).reshape(-1, 37)
    want = F.cross_entropy(logits.to(torch.promote_types(dtype, torch.float32)),
                           labels.reshape(-1), ignore_index=-100)
    got = ra.tiled_lm_loss(hidden, head, shift_labels=labels, tile=4, logits_fn=fn)
    assert abs(float(got) - float(want)) <= tol * abs(float(want))
    for a, b in zip(_grads(got, hidden, head.weight, head.bias),
                    _grads(want, hidden, head.weight, head.bias)):
        assert float((a.double() - b.double()).norm()) <= tol * 10 * float(b.double().norm())
    plain = ra.tiled_lm_loss(hidden, head, shift_labels=labels, tile=4)
    assert abs(float(plain) - float(want)) > 1e3 * tol * abs(float(want))  # it matters here


def test_bfloat16_autocast_is_recomputed_as_in_the_forward():
    """Under autocast the backward recomputes each tile in the forward's dtype: with one
    tile, loss and gradients equal the untiled ones under the same autocast bit for bit
    (a float32 recompute would differ by about 4e-3); with tiles, the hidden states'
    gradient still does, and the head's differs only by summing bfloat16 tile products."""
    hidden, head, labels = _case(torch.float32)

    def run(fn):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = fn()
        return loss, _grads(loss, hidden, head.weight, head.bias)

    want, w_grads = run(lambda: F.cross_entropy(
        F.linear(hidden, head.weight, head.bias).float().reshape(-1, 37), labels.reshape(-1),
        ignore_index=-100))
    one, one_grads = run(lambda: ra.tiled_lm_loss(hidden, head, shift_labels=labels, tile=1000))
    assert torch.equal(one, want) and all(torch.equal(a, b) for a, b in zip(one_grads, w_grads))
    got, g_grads = run(lambda: ra.tiled_lm_loss(hidden, head, shift_labels=labels, tile=3))
    assert abs(float(got) - float(want)) <= 1e-5 * abs(float(want))
    assert torch.equal(g_grads[0], w_grads[0])
    for a, b in zip(g_grads[1:], w_grads[1:]):
        assert float((a - b).norm()) <= 1e-2 * float(b.norm())


def test_a_second_backward_is_refused_not_doubled():
    hidden, head, labels = _case(torch.float64)
    loss = ra.tiled_lm_loss(hidden, head, shift_labels=labels, tile=4)
    (g,) = torch.autograd.grad(2.0 * loss, hidden, retain_graph=True)
    with pytest.raises(RuntimeError, match="second backward"):
        torch.autograd.grad(loss, hidden)
    want = _reference(hidden, head.weight, head.bias, labels)
    (w,) = torch.autograd.grad(2.0 * want, hidden)
    assert torch.allclose(g, w, rtol=1e-12, atol=1e-15)
    with torch.no_grad():  # no gradient asked for: none computed, the same loss
        assert torch.allclose(ra.tiled_lm_loss(hidden, head, shift_labels=labels, tile=4), want.detach(),
                              rtol=1e-12)


class LoRALinear(torch.nn.Linear):
    """A LoRA head as loralib writes it: ``x W^T + b + (x A^T) B^T s``, B zero at the start
    (so its output equals the plain head's on every input until B trains)."""

    def __init__(self, base: torch.nn.Linear, rank: int = 2, scale: float = 0.5):
        super().__init__(base.in_features, base.out_features, bias=base.bias is not None,
                         dtype=base.weight.dtype)
        self.load_state_dict(base.state_dict())
        g = torch.Generator().manual_seed(7)
        self.lora_A = torch.nn.Parameter(torch.randn(rank, base.in_features, generator=g,
                                                     dtype=base.weight.dtype))
        self.lora_B = torch.nn.Parameter(torch.zeros(base.out_features, rank,
                                                     dtype=base.weight.dtype))
        self.scale = scale

    def forward(self, x):
        return super().forward(x) + (x @ self.lora_A.t()) @ self.lora_B.t() * self.scale


def test_only_a_plain_linear_is_read_by_its_weight():
    """Structure, not samples: a LoRA head (output equal to the plain one while B is zero,
    B's gradient not zero), a Linear with a forward hook, with an extra parameter, with a
    child, a parametrized one: each refused by name; a plain Linear, its weight tensor and
    FSDP2's class of a Linear are accepted."""
    from ringattn.structure import plain_layer_problem

    hidden, head, labels = _case(torch.float64)
    lora = LoRALinear(head)
    assert torch.equal(lora(hidden), head(hidden))  # a sample cannot tell them apart
    with pytest.raises(TypeError, match="LoRALinear, not exactly a torch.nn.modules.linear"):
        ra.tiled_lm_loss(hidden, lora, shift_labels=labels)
    hooked = torch.nn.Linear(16, 37, dtype=torch.float64)
    hooked.register_forward_hook(lambda m, a, out: out * 2)
    assert "hook (forward_hooks" in plain_layer_problem(hooked)
    extra = torch.nn.Linear(16, 37)
    extra.register_parameter("lora_A", torch.nn.Parameter(torch.zeros(2, 16)))
    assert "parameters ['lora_A']" in plain_layer_problem(extra)
    child = torch.nn.Linear(16, 37)
    child.adapter = torch.nn.Linear(16, 37)
    assert "children ['adapter']" in plain_layer_problem(child)
    param = torch.nn.Linear(16, 37)
    torch.nn.utils.parametrize.register_parametrization(param, "weight", torch.nn.Identity())
    assert "not exactly" in plain_layer_problem(param)
    conv = torch.nn.Conv1d(4, 4, 3)
    assert plain_layer_problem(conv, torch.nn.Conv1d) is None
    assert "not exactly a torch.nn.modules.conv.Conv1d" in plain_layer_problem(head, torch.nn.Conv1d)
    assert plain_layer_problem(head) is None
    from torch.distributed.fsdp import FSDPModule

    fsdp_linear = type("FSDPLinear", (FSDPModule, torch.nn.Linear), {})
    assert plain_layer_problem(fsdp_linear(16, 37)) is None
    fsdp_lora = type("FSDPLoRALinear", (FSDPModule, LoRALinear), {})
    assert "not exactly" in plain_layer_problem(fsdp_lora(head))
    # the gradient the weight path would have missed: B's is not zero
    loss = torch.nn.functional.cross_entropy(lora(hidden).reshape(-1, 37), labels.reshape(-1))
    (g_b,) = torch.autograd.grad(loss, lora.lora_B)
    assert float(g_b.abs().max()) > 1e-3


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-12), (torch.float32, 1e-6)])
def test_unshifted_labels_are_shifted_as_transformers_shifts_them(dtype, tol):
    """``labels=`` (unshifted) gives transformers' causal-LM loss of the untiled logits
    (ForCausalLMLoss, its own shift); ``shift_labels=labels[:, 1:]`` beside the hidden
    states but the last the same; a shard's labels are refused by name."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    hidden, head, labels = _case(dtype)
    logits = F.linear(hidden, head.weight, head.bias)
    # transformers' shift (its loss upcasts to float32 only: the float64 reference is ours)
    want = F.cross_entropy(logits[:, :-1].reshape(-1, 37), labels[:, 1:].reshape(-1))
    hf = ForCausalLMLoss(logits, labels, vocab_size=37)
    assert abs(float(hf) - float(want)) <= 1e-6 * abs(float(want))
    got = ra.tiled_lm_loss(hidden, head, labels=labels, tile=3)
    assert abs(float(got) - float(want)) <= tol * abs(float(want))
    again = ra.tiled_lm_loss(hidden[:, :-1], head, shift_labels=labels[:, 1:], tile=3)
    assert abs(float(again) - float(want)) <= tol * abs(float(want))
    wrong = ra.tiled_lm_loss(hidden, head, shift_labels=labels, tile=3)  # unshifted as targets
    assert abs(float(wrong) - float(want)) > 1e-3 * abs(float(want))  # the case that matters
    flat = ra.tiled_lm_loss(hidden[0], head, labels=labels[0], tile=3)  # one sequence, [N]
    want0 = F.cross_entropy(logits[0, :-1], labels[0, 1:])
    assert abs(float(flat) - float(want0)) <= tol * abs(float(want0))
    minus_one = ra.tiled_lm_loss(hidden, head, labels=labels.masked_fill(labels == -100, -1),
                                 ignore_index=-1, tile=3)
    assert abs(float(minus_one) - float(want)) <= tol * abs(float(want))
    from ringattn.layouts import SHARD_TAG, ShardTag

    tagged = labels.clone()
    setattr(tagged, SHARD_TAG, ShardTag("zigzag", 24, -2, 1, 2, (0, 1), 0))
    with pytest.raises(TypeError, match="labels= is a shard .*shift_labels= instead"):
        ra.tiled_lm_loss(hidden, head, labels=tagged)


@pytest.mark.parametrize("vocab,dtype,rows", [(151936, torch.float32, 27),
                                               (151936, torch.bfloat16, 27),
                                               (151936, torch.float64, 13), (32000, torch.float32, 131),
                                               (97, torch.float32, 43240), (10 ** 9, torch.float32, 1)])
def test_the_default_tile_is_a_byte_budget(vocab, dtype, rows):
    """The default tile is 16 MiB of float32 logits (float64 for float64 inputs): the rows
    follow from V; an int stays rows; a budget smaller than one row gives one row."""
    from ringattn.loss import DEFAULT_TILE, check_loss_tile, tile_rows

    assert DEFAULT_TILE == "16MiB" and check_loss_tile(DEFAULT_TILE) == f"{16 << 20}B"
    assert tile_rows(DEFAULT_TILE, vocab, dtype) == rows
    assert tile_rows(7, vocab, dtype) == 7 and tile_rows("1KiB", 10, torch.float32) == 25
    assert tile_rows("2GiB", 1, torch.float32) == 1 << 29
    assert check_loss_tile(" 3 KiB ") == "3072B"
