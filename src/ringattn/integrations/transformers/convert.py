"""``convert(model)``: the one entry point that makes a transformers model exact under ring
attention where registering the attention function is not enough (a hybrid's sequence
mixers, a router loss, Llama 4's query temperature, families that compute attention
themselves or drop the ring context). Nothing of transformers is patched: ``convert``
registers torch hooks on the model's own modules, swaps the class of module instances, and
records what it did on the model instance (``state.record``), never in a registry keyed by
its config, which other models may share.
"""

from __future__ import annotations

import torch

from .attention import register
from .checks import (MIXER_FAMILIES, NAME, _computes_attention_itself, _config_problem,
                     check_model, converted, convertible)
from .families import convert_attention, convert_router, convert_temperature, router_loss_problem
from .mixers import convert_mixers
from .state import record

__all__ = ["convert", "load_pretrained"]


def convert(model):
    """Make ``model`` exact under ring attention where registering it is not enough.

    Arguments:
        model: a transformers model (built with attn_implementation="ringattn").

    Returns:
        ``model`` itself, with hooks on its own modules: a global router auxiliary loss
        (MoE families with ``output_router_logits``), Llama 4's query temperature from
        global positions; ring attention inside the attention modules of families that
        compute attention themselves; and, for hybrid families (``CONVERTIBLE``), their
        sequence mixers across ranks. A model that needs none of these comes back
        unchanged. Converting twice is a no-op.

    Raises:
        TypeError: not a transformers model.
        ValueError: ``check_model`` refuses the model for something else (a family that
            computes attention itself, non-attention sequence layers), or its router loss
            is not one ``convert`` knows; the model is inside ``context_parallel``.
    """
    config = getattr(model, "config", None)
    if config is None or not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert takes a transformers model, got {type(model).__name__}")
    if converted(model):
        return model
    if getattr(model, "_ringattn_context_parallel", False):
        raise ValueError(f"convert {type(model).__name__} before entering context_parallel: "
                         f"the manager's hooks must see the converted model's")
    family = getattr(config, "model_type", None)
    if family in MIXER_FAMILIES:  # hybrid: its sequence mixers
        convert_mixers(model)
    record(model)  # the model, on its own modules, for functions that see only those
    problem = _config_problem(config, router=False, model=model)  # what convert leaves
    if problem is not None:
        raise ValueError(f"ring attention cannot run {type(model).__name__} exactly: {problem}")
    own = hasattr(model, "is_backend_compatible") and not model.is_backend_compatible()
    # hybrids whose classes say so still call the interface (test_hybrid_families.py)
    if own and not convertible(family) and family not in MIXER_FAMILIES:
        raise ValueError(_computes_attention_itself(type(model).__name__, config))
    problem = router_loss_problem(model)
    if getattr(config, "output_router_logits", False) and problem is not None:
        raise ValueError(f"ringattn cannot make this router loss global: {problem}")
    convert_router(model)  # also serves output_router_logits=True passed to forward later
    convert_temperature(model)
    convert_attention(model)
    record(model, converted=True)
    check_model(model)
    return model


def load_pretrained(path: str, dtype=None):
    """A causal LM from a local transformers directory that runs ring attention: "ringattn"
    registered (``register``), ``from_pretrained(path, attn_implementation="ringattn",
    local_files_only=True)``, then ``convert``-ed (a hybrid's sequence mixers run across
    ranks, a router loss is global). ``ringattn.eagle3.target.load_target`` loads its
    "ringattn" targets with it.

    Arguments:
        path: a directory with ``config.json`` and the weights (no download is tried).
        dtype: a torch dtype, or None (transformers' default).

    Raises:
        ValueError: a model ring attention cannot run exactly (``check_model``'s reason,
            also for classes that compute attention themselves and fail in their
            constructor when asked for a registered name: Falcon's and GPT-Neo's bare
            KeyError), or ``convert``'s refusal.
    """
    import transformers

    register()
    try:
        model = transformers.AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=NAME, local_files_only=True)
    except (KeyError, ValueError, TypeError, AttributeError):
        # say why, if check_model knows; else transformers' own error
        config = transformers.AutoConfig.from_pretrained(path, local_files_only=True)
        for name in config.architectures or ():
            if hasattr(transformers, name):
                check_model(getattr(transformers, name), config)
        raise
    return convert(model)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
