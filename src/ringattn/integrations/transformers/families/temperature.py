"""Llama 4's query temperature tuning on its NoPE layers (``attn_temperature_tuning``), from
global positions.

transformers scales each query by ``1 + attn_scale * log1p(floor((p + 1) / floor_scale))``
with ``p = arange(local length)``. ``convert`` switches the module's own scaling off and
scales the output of its ``q_proj`` (a forward hook) by the same function of each local
slot's GLOBAL position (from the batch's ``RingContext``: layout, S, documents), which is
what one process computes; without a ring context, by the positions transformers uses.
"""

from __future__ import annotations

import torch

from .router import _local_positions

__all__ = ["convert_temperature"]


def _temperature_pre_hook(module, args, kwargs):
    """Llama 4 NoPE attention: the per-token query scale, from global positions."""
    hidden = kwargs.get("hidden_states", args[0] if args else None)
    ctx = kwargs.get("ring_context")
    if ctx is not None:
        pos = _local_positions(ctx).to(hidden.device)
    else:  # as transformers counts: after the cached tokens
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        seen = cache.get_seq_length(module.layer_idx) if cache is not None else 0
        pos = torch.arange(hidden.shape[1], device=hidden.device) + seen
    scale = torch.log1p(torch.floor((pos.float() + 1.0) / module.floor_scale))
    module.q_proj._ring_query_scale = scale * module.attn_scale + 1.0
    return None


def _temperature_q_hook(q_proj, args, output):
    scale = q_proj.__dict__.pop("_ring_query_scale", None)
    if scale is None:
        raise ValueError("a converted Llama 4 q_proj ran outside its attention module")
    return (output * scale.view(1, -1, 1)).to(output.dtype)


def convert_temperature(model) -> int:
    """Move Llama 4's query temperature to global positions; the number of layers."""
    done = 0
    for module in model.modules():
        if (getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True)
                and hasattr(module, "q_proj") and hasattr(module, "floor_scale")):
            module.attn_temperature_tuning = False  # transformers' local-position scaling off
            module.register_forward_pre_hook(_temperature_pre_hook, with_kwargs=True)
            module.q_proj.register_forward_hook(_temperature_q_hook)
            done += 1
    return done

if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
