"""StableLM and Nemotron, whose decoder layers do not pass the batch's keyword arguments on
to their attention: ``convert`` hands their attention modules the ``ring_context`` of the
forward that runs them (``state.bind_context``), and a pre-hook on each attention module
puts it back into the module's keyword arguments.
"""

from __future__ import annotations

from ..checks import register_attention
from ..state import MISSING, bind_context, bound_context, missing_error

__all__ = ["convert_relay"]

_RELAY = {"stablelm": "StableLmAttention", "nemotron": "NemotronAttention"}
"""model_type -> the attention class whose decoder layer drops ring_context."""
register_attention("relay", _RELAY)


def _relay_pre_hook(module, args, kwargs):
    """The ring_context the model was called with, for an attention module whose decoder
    layer dropped it."""
    if kwargs.get("ring_context") is None:
        ctx = bound_context(module)
        if ctx is MISSING:
            raise missing_error(module)
        kwargs = {**kwargs, "ring_context": ctx}
    return args, kwargs


def convert_relay(model) -> None:
    """Pass the batch's ring_context to the attention modules of a ``_RELAY`` family."""
    name = _RELAY[model.config.model_type]
    found = tuple(m for m in model.modules() if type(m).__name__ == name)
    if not found:
        raise ValueError(f"{type(model).__name__} has no {name} to convert")
    for module in found:
        module.register_forward_pre_hook(_relay_pre_hook, with_kwargs=True)
    bind_context(model, found)

if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
