"""What every converted sequence mixer shares: the ring context of its call, padding, the
``Ring...`` subclass of transformers' layer class, and ``convert_mixers``.

transformers' hybrid decoders mix the sequence in layers that are not attention; on a shard
of the sequence those layers would see only this rank's tokens. ``convert_mixers`` replaces,
on the model instance, each such layer by an instance of a subclass of its own class that
shares its parameters, buffers and hooks (the module's ``__class__`` is set to the subclass:
no parameter is copied, and ``state_dict`` keys do not change); the subclass's forward
computes the same function with ``ringattn.mixers`` on the batch's ``RingContext``, which
reaches the layer in the keyword arguments transformers' decoder layers pass on, or, for
the families whose model or blocks do not pass them on (``checks.KWARGS_STOP``), as the
context of the model forward that runs the layer (``state.bind_context``).

Without a ring context (one process: evaluation, generation) the converted layer runs
transformers' own forward. Under a ring context it refuses a cache (training and prefill of
whole sequences are served; pass ``use_cache=False``). Padding: transformers zeroes the
inputs of these layers at padded positions (``apply_mask_to_padding_states`` with the 2-D
attention mask); the converted layer zeroes the same positions from the ring context's key
padding, so a left-padded batch through ``prepare_batch`` gives one process's result.

The layers themselves live one file per mechanism (``delta``, ``conv``, ``mamba``,
``recurrent``), each registering its rows in ``checks`` (transformers' class name -> mixin,
the families they complete, those whose model drops the ring context).
"""

from __future__ import annotations

import sys

import torch

from ....masks import evaluate
from ....sharding import positions
from ....structure import plain_weights
from ..checks import (_ATTENTION_LAYER_TYPES, _LAYER_TYPE_FIELDS, BLOCK_SPARSE_LAYERS,
                      KWARGS_STOP, MIXER_FAMILIES,
                      MIXER_LAYERS, MIXERS_PER_LAYER, REFUSED, mixers_converted)
from ..state import (MISSING, ConvertedMixer, bind_context, bound_call,
                     hook_restore_padding, missing_error, owner, record, swap_class)

__all__ = ["convert_mixers"]


# -- the ring context and padding ------------------------------------------------------------

def _ring_args(ctx) -> dict:
    """group, layout, seqlen, cu_seqlens of the mixers from a RingContext."""
    return dict(group=ctx.group, layout=ctx.layout, seqlen=ctx.seqlen, cu_seqlens=ctx.cu_seqlens)


def _conv(conv) -> tuple:
    """(weight, bias) of a layer's short convolution, which the converted forward reads
    instead of calling it: exactly a ``torch.nn.Conv1d`` (``structure.plain_weights``; an
    adapter or a hook on it is refused by name, never bypassed)."""
    return plain_weights(conv, torch.nn.Conv1d, f"the short convolution {type(conv).__name__}")


def _keep(ctx, batch: int, device, dtype) -> torch.Tensor | None:
    """[B, L, 1] 1 on this rank's slots that are not padding of their row, 0 on padding (what
    transformers' 2-D attention mask is at those positions); None without padding."""
    if ctx.mask is None:
        return None
    pos = positions(ctx.seqlen, group=ctx.group, layout=ctx.layout, cu_seqlens=ctx.cu_seqlens)
    pos = pos[0] if ctx.cu_seqlens is not None else pos
    seen = evaluate(ctx.mask, ctx.seqlen, torch.zeros(1, dtype=pos.dtype), pos, batch, 1)
    return seen[:, 0, 0, :].expand(batch, -1).to(device=device, dtype=dtype)[..., None]


def _masked(hidden, keep):
    return hidden if keep is None else (hidden * keep).to(hidden.dtype)


def _context(module, kwargs):
    """The ring context of this call, or None (one process); refuses what is not served."""
    ctx = kwargs.get("ring_context")
    if ctx is None:  # layers whose callers drop it: the context of their model's forward
        ctx = bound_call(module).context if bound_call(module) is not None else None
    if ctx is MISSING or (ctx is None and getattr(owner(module), "_ringattn_context_parallel",
                                                  False)):
        raise missing_error(module)
    if ctx is None:
        return None
    cache = next((kwargs[k] for k in ("cache", "cache_params", "past_key_values")
                  if kwargs.get(k) is not None), None)
    if cache is not None or (kwargs.get("use_cache") and getattr(module, "_stateful", False)):
        raise ValueError(f"{type(module).__name__} (converted by convert_mixers) got a cache "
                         f"under context parallelism; call the model with use_cache=False")
    ctx.record_call()
    return ctx


# -- the converted layers ------------------------------------------------------------------

class _RingMixer(ConvertedMixer):
    """Mixin of the converted classes: transformers' forward without a ring context. Under
    one, each chunk of the sequence is scanned by the family's own chunked function where
    its module has one (``_family``: transformers' ``torch_chunk_gated_delta_rule`` or
    ``mamba2_chunk_scan``, which transformers maps to flash-linear-attention's or
    mamba-ssm's kernels where they are installed), else by ringattn.mixers' loop."""

    @property
    def _family(self):
        """transformers' module of the layer's own class (its chunked functions)."""
        return sys.modules[self._swapped_from[1].__module__]

    def forward(self, hidden_states, *args, **kwargs):
        names = ("cache", "attention_mask")
        for name, value in zip(names, args):  # the decoder layers pass keywords; be safe
            kwargs[name] = value
        ctx = _context(self, kwargs)
        if ctx is None:
            return super().forward(hidden_states, **kwargs)
        return self._ring_forward(hidden_states, ctx, **kwargs)


_NOT_MIXERS = frozenset({"mlp", "moe"})
"""Entries of per-layer type lists that mix no sequence (Nemotron-H's feed-forward layers)."""


def _mixer_layers(config) -> int | None:
    """How many layers the config's per-layer types (the fields _config_problem reads; some
    configs hold the same list under two names) say are sequence mixers other than
    attention; None for a config without such a list (Mamba2: every layer is one)."""
    skip = _ATTENTION_LAYER_TYPES | _NOT_MIXERS | set(  # block-sparse attention (families/)
        BLOCK_SPARSE_LAYERS.get(getattr(config, "model_type", None), ()))
    counts = [sum(str(k) not in skip for k in value)
              for value in (getattr(config, field, None) for field in _LAYER_TYPE_FIELDS)
              if isinstance(value, (list, tuple))]
    return max(counts, default=None)


def convert_mixers(model):
    """Make the sequence mixers of a transformers hybrid model exact under ring attention.

    Arguments:
        model: a transformers model of a family in ``CONVERTIBLE`` (built with
            attn_implementation="ringattn").

    Returns:
        ``model`` itself, each of its GatedDeltaNet, short-conv and Mamba2 layers now an
        instance of a ``Ring...`` subclass of its class (same parameters and hooks) that
        runs ``ringattn.mixers`` under a ring context. Converting twice is a no-op.

    Raises:
        TypeError: ``model`` is not a transformers model.
        ValueError: the family has sequence layers ``convert_mixers`` does not serve (named),
            or a layer of a non-attention type was not found.
    """
    config = getattr(model, "config", None)
    if config is None or not isinstance(model, torch.nn.Module):
        raise TypeError(f"convert_mixers takes a transformers model, got {type(model).__name__}")
    family = getattr(config, "model_type", type(config).__name__)
    if mixers_converted(model):
        return model
    if family not in MIXER_FAMILIES:
        raise ValueError(f"convert_mixers does not serve {family}: " + (
            REFUSED[family] if family in REFUSED else
            f"its sequence layers are not among {sorted(MIXER_LAYERS)} "
            f"(families: {sorted(MIXER_FAMILIES)})"))
    done = 0
    for module in model.modules():
        cls = type(module)
        if cls.__name__ in MIXER_LAYERS and cls.__module__.startswith("transformers."):
            module.__class__ = swap_class(MIXER_LAYERS[cls.__name__], cls)
            done += 1
        elif isinstance(module, _RingMixer):
            done += 1
    expected = _mixer_layers(config)
    if expected is not None:  # Inkling: several convolutions in each listed layer
        expected *= MIXERS_PER_LAYER.get(family, 1)
    if done == 0 or done != (done if expected is None else expected):
        raise ValueError(f"convert_mixers found {done} sequence-mixer layers in "
                         f"{type(model).__name__} but its config lists {expected} "
                         f"non-attention layers")
    record(model, mixers=True)
    if family in KWARGS_STOP:  # the CausalLM does not pass ring_context on to its layers
        mixers = [m for m in model.modules() if isinstance(m, _RingMixer)]
        bind_context(model, mixers)
        if any(getattr(m, "_reads_padding", False) for m in mixers):
            hook_restore_padding(model)
    return model


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
