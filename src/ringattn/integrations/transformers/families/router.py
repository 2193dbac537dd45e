"""MoE router auxiliary losses made global: the load-balancing loss over every rank's tokens.

transformers' ``load_balancing_loss_func`` averages the router's top-k counts and
probabilities over the tokens it sees. ``convert`` adds a forward hook to the model that
replaces the per-rank value by the global one: the per-expert sums over this rank's real
tokens are all-reduced over the context-parallel group (with autograd: the backward
all-reduces their gradients), and each rank's loss carries ``1/W`` of
``router_aux_loss_coef * aux``, so the ranks' losses sum to one process's loss and their
gradients to its gradients. ``output.aux_loss`` is the global value on every rank.
Families: every one whose ``load_balancing_loss_func`` is Mixtral's (Mixtral, Qwen2-MoE,
Qwen3-MoE, PhiMoE, OLMoE, GraniteMoE, gpt-oss, JetMoe with ``aux_loss_coef``, ...).
"""

from __future__ import annotations

import importlib
import inspect

import torch
import torch.distributed as dist

from ....masks import evaluate
from ....sharding import positions
from ..state import ROUTER_MARK

__all__ = ["convert_router", "router_loss_problem"]


_REFERENCE_LOSS = ("transformers.models.mixtral.modeling_mixtral", "load_balancing_loss_func")
"""The router loss ``_global_router_loss`` computes globally. A family is converted only if
its module's ``load_balancing_loss_func`` has the same source and its CausalLM calls it with
``(router_logits, self.num_experts, self.num_experts_per_tok, attention_mask)``."""

_CALL = ("load_balancing_loss_func(", "outputs.router_logits,", "self.num_experts,",
         "self.num_experts_per_tok,", "attention_mask,")

_COEFFICIENTS = ("router_aux_loss_coef", "aux_loss_coef")
"""The CausalLM attribute that weighs the router loss (JetMoe names it ``aux_loss_coef``);
its forward must add ``self.<attribute> * aux_loss`` to the loss."""


def _router_coef(model) -> str | None:
    """The name of ``model``'s router loss coefficient attribute, or None."""
    return next((a for a in _COEFFICIENTS if isinstance(getattr(model, a, None), (int, float))),
                None)


class _AllReduceSum(torch.autograd.Function):
    """Sum over the group; the backward sums the gradients (each rank's output is used by
    that rank's loss only, and every rank's input feeds every rank's output)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        grad = grad.clone()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _local_positions(ring_context) -> torch.Tensor:
    """[L] global position of each local slot (>= S on the slots that pad S up)."""
    pos = positions(ring_context.seqlen, group=ring_context.group, layout=ring_context.layout,
                    cu_seqlens=ring_context.cu_seqlens)
    return pos[0] if ring_context.cu_seqlens is not None else pos


def _local_real(ring_context, batch: int, device) -> torch.Tensor:
    """[B, L] float: 1 on this rank's real tokens (not padding, not a slot padding S up)."""
    pos = _local_positions(ring_context)
    real = (pos < ring_context.seqlen).view(1, -1).expand(batch, -1)
    if ring_context.mask is not None:  # key padding of the batch rows, in global positions
        seen = evaluate(ring_context.mask, ring_context.seqlen, pos[:1].clamp(max=0), pos,
                        batch, 1)  # [B or 1, 1, 1, L]
        real = real & seen[:, 0, 0, :].expand(batch, -1)
    return real.to(device=device, dtype=torch.float32)


def _global_router_loss(router_logits, num_experts: int, top_k: int, real_BL, group):
    """transformers' load-balancing loss over the tokens of every rank of ``group``:
    ``num_experts * sum_e f_e * P_e`` with f_e the fraction of top-k assignments to expert e
    and P_e its mean router probability, both over the real tokens of all layers."""
    flat = real_BL.reshape(-1)
    counts = torch.zeros(num_experts, dtype=torch.float32, device=flat.device)
    probs = torch.zeros(num_experts, dtype=torch.float32, device=flat.device)
    rows = torch.zeros((), dtype=torch.float32, device=flat.device)
    for logits in router_logits:
        weights = torch.softmax(logits.to(flat.device), dim=-1)
        _, chosen = torch.topk(weights, top_k, dim=-1)
        counts = counts.scatter_add(0, chosen.reshape(-1), flat.repeat_interleave(top_k))
        probs = probs + (weights.float() * flat.unsqueeze(-1)).sum(0)
        rows = rows + flat.sum()
    counts = counts.clone()
    dist.all_reduce(counts, group=group)  # no gradient: top-k is piecewise constant
    rows = rows.clone()
    dist.all_reduce(rows, group=group)
    probs = _AllReduceSum.apply(probs, group)
    return torch.sum((counts / rows) * (probs / rows)) * num_experts


def _router_loss_problem(model) -> str | None:
    """Why ``convert`` cannot make this model's router loss global, or None."""
    family = type(model).__module__
    try:
        own = importlib.import_module(family).load_balancing_loss_func
        ref = getattr(importlib.import_module(_REFERENCE_LOSS[0]), _REFERENCE_LOSS[1])
        same = inspect.getsource(own) == inspect.getsource(ref)
        source = inspect.getsource(type(model).forward)
    except (AttributeError, ImportError, OSError, TypeError):
        return f"{type(model).__name__} has no load_balancing_loss_func that ringattn knows"
    calls = "".join(source.split())
    coef = _router_coef(model)
    if not same or "".join(_CALL) not in calls or (
            coef is not None and f"loss+=self.{coef}*aux_loss" not in calls):
        return (f"{type(model).__name__}'s router auxiliary loss is not the one ringattn makes "
                f"global (Mixtral's load_balancing_loss_func on the router logits)")
    for attr in ("num_experts", "num_experts_per_tok"):
        if not isinstance(getattr(model, attr, None), (int, float)):
            return f"{type(model).__name__} has no {attr}"
    if coef is None:
        return f"{type(model).__name__} has no router_aux_loss_coef"
    return None


def _router_hook(model, args, kwargs, output):
    """Forward hook: the global router loss in place of this rank's."""
    ctx = kwargs.get("ring_context")
    aux = getattr(output, "aux_loss", None)
    if ctx is None or aux is None or not isinstance(aux, torch.Tensor):
        return None  # one process, or no router loss asked for: transformers' value
    logits = getattr(output, "router_logits", None)
    ids = kwargs.get("input_ids", args[0] if args else None)
    shape = ids.shape if ids is not None else kwargs["inputs_embeds"].shape[:2]
    real = _local_real(ctx, shape[0], aux.device)
    world = dist.get_world_size(ctx.group)
    glob = _global_router_loss(logits, model.num_experts, model.num_experts_per_tok, real,
                               ctx.group)
    coef = getattr(model, _router_coef(model))
    if output.loss is not None:  # this rank's value out, its 1/W share of the global one in
        output.loss = output.loss - coef * aux.to(output.loss.device) + (coef / world) * glob
    output.aux_loss = glob
    return output
setattr(_router_hook, ROUTER_MARK, True)  # how checks.global_router_loss finds it


def router_loss_problem(model) -> str | None:
    """Why ``convert`` cannot make this model's router loss global, or None."""
    if _router_coef(model) is None:
        return f"{type(model).__name__} has no router_aux_loss_coef"
    return _router_loss_problem(model)


def convert_router(model) -> bool:
    """Put the global router loss hook on ``model`` where its loss is one ``convert``
    knows; whether it did."""
    if router_loss_problem(model) is not None:
        return False
    model.register_forward_hook(_router_hook, with_kwargs=True)
    return True


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
