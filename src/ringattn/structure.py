"""Plain layers recognised by structure: what a path that reads a module's parameters
instead of calling its forward may accept.

The tiled loss reads an output head's weight and bias; the converted sequence mixers read
their short convolutions' and projections' weights. Each computes what the module's forward
would only when the module is exactly the torch class it stands for. That is decided by the
module's structure, never by a sample of its output: an adapter whose update is zero at the
start (LoRA's B) gives the plain output on every sample, and another gradient.
"""

from __future__ import annotations

import torch

__all__ = ["plain_layer_problem", "plain_weights"]

_HOOK_KINDS = ("_forward_pre_hooks", "_forward_hooks", "_backward_pre_hooks", "_backward_hooks")


def _fsdp_module():
    """FSDP2's module mixin (``fully_shard`` makes a layer's class ``FSDP<Class>``: the mixin
    and the class), or None where torch has no FSDP2."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # a torch built without distributed
        return None
    return FSDPModule


def plain_layer_problem(module, kind: type = torch.nn.Linear) -> str | None:
    """Why ``module``'s forward may not be what ``kind``'s forward computes from its
    ``weight`` and ``bias``, or None (it is).

    Accepted: ``kind`` itself (``type(module) is kind``), or FSDP2's ``fully_shard`` of one
    (its class the FSDP mixin and ``kind``, its hooks FSDP's own, its parameters DTensors),
    with no other hook, child module, parameter or buffer. Not: a subclass (loralib's LoRA
    ``Linear``, a parametrized or quantized layer), a module with hooks (weight norm, PEFT's
    or a user's) or with children or extra parameters (an adapter).
    """
    cls = type(module)
    fsdp = _fsdp_module()
    wrapped = fsdp is not None and cls.__bases__ == (fsdp, kind)
    what = f"{kind.__module__}.{kind.__qualname__}"
    if cls is not kind and not wrapped:
        return (f"it is a {cls.__module__}.{cls.__qualname__}, not exactly a {what} (a "
                f"subclass may compute more than its weight's product: an adapter)")
    extra = sorted(set(dict(module.named_parameters(recurse=False))) - {"weight", "bias"})
    children = [name for name, _ in module.named_children()]
    buffers = [name for name, _ in module.named_buffers(recurse=False)]
    if extra or children or buffers:
        held = "; ".join(f"{label} {names}" for label, names in (
            ("parameters", extra), ("children", children), ("buffers", buffers)) if names)
        return f"it holds {held} besides its weight and bias (an adapter)"
    for hooks in _HOOK_KINDS:
        for hook in getattr(module, hooks, {}).values():
            owner = getattr(hook, "__module__", None) or ""
            if not (wrapped and owner.startswith("torch.distributed.fsdp.")):
                name = getattr(hook, "__qualname__", type(hook).__name__)
                return (f"it has a hook ({hooks.strip('_')}: {name}) that may change its "
                        f"output or its gradient")
    return None


def plain_weights(module, kind: type, what: str):
    """``(module.weight, module.bias)`` of a plain ``kind`` layer, for a path that computes
    its forward from them.

    Raises:
        ValueError: naming ``what`` and the reason (``plain_layer_problem``).
    """
    problem = plain_layer_problem(module, kind)
    if problem is not None:
        raise ValueError(f"ringattn computes {what} from its weights without calling its "
                         f"forward, and {problem}: ringattn cannot compute it exactly")
    return module.weight, module.bias


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
