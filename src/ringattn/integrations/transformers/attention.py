"""The registered attention function and mask function: ring attention as transformers'
attention implementation "ringattn".

Every argument a model gives its attention function is honoured or the call raises a
TypeError naming it; nothing is dropped (the package's doc lists them). The mask function
describes the mask a model asks for (``ModelMask``) instead of building it; the ring builds
it in global positions from the batch's ``RingContext``. Both refuse what ``checks`` refuses,
reading what ``convert`` did from the model the module belongs to (``state.owner``) or the
converted model whose forward is running (``state.running_model``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...masks import and_keys, chunked_key, mask_key
from ...strategies.auto import attention
from ...validate import caller_error
from .checks import (NAME, NOT_ATTENTION_KWARGS, POSITIONS_FROM_MASK, MIXER_FAMILIES,
                     _base_model_class, _computes_attention_itself, _config_problem, converted,
                     global_router_loss)
from .state import owner, running_model

__all__ = ["ModelMask", "check_attention", "register", "ring_attention_forward"]


def check_attention(model) -> None:
    """Refuse a model whose attention implementation is not ring attention.

    Arguments:
        model: a transformers model.

    Raises:
        ValueError: ``model.config._attn_implementation`` names a function other than the
            one ``register()`` registered (transformers' "eager", "sdpa", ...: every rank
            would attend over its own shard alone, with no error).
    """
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl is None or config is None:
        raise ValueError(f"{type(model).__name__} has no config._attn_implementation; ring "
                         f"attention runs transformers models built with "
                         f"attn_implementation={NAME!r}")
    from transformers import AttentionInterface

    fn = AttentionInterface().get(impl) if isinstance(impl, str) else None
    if fn is not ring_attention_forward:
        raise ValueError(
            f"{type(model).__name__} runs attention implementation {impl!r}, not ring "
            f"attention: every rank would attend over its own shard alone. Call "
            f"ringattn.integrations.transformers.register(), then build the model with "
            f"attn_implementation={NAME!r} (from_pretrained/from_config) or call "
            f"model.set_attn_implementation({NAME!r})"
        )


@dataclass(frozen=True)
class ModelMask:
    """What a model asked transformers' mask creation for, instead of a dense mask.

    The ring builds its masks in global positions from this and the batch's RingContext.
    """

    kind: str
    """"causal", "bidirectional", "sliding", "bidirectional-sliding" or "chunked"."""
    size: int | None = None
    """The window (sliding) or chunk (chunked) length."""
    custom: bool = False
    """The model overlaid a mask function of its own (or_mask/and_mask): not translatable."""
    padded: bool = False
    """A 2-D attention_mask reached the model (padding must go through shard_batch)."""
    family: str = "the model"
    """The config's model_type, for messages."""
    converted: bool = False
    """The model was converted (``convert``): its own attention modules, replaced by ring
    attention, receive this object (MPT casts it with ``.to`` first)."""

    def to(self, *args, **kwargs):
        if not self.converted:
            return self.__getattr__("to")
        return self

    def __getattr__(self, name: str):
        # Only a model that uses the mask object itself (``.to``, ``.dtype``, indexing...)
        # instead of handing it to the attention interface gets here: MPT, which computes
        # attention itself. The error is an AttributeError too, so ``hasattr`` probes still
        # answer False.
        if name.startswith("_"):
            raise AttributeError(name)
        raise _MaskUsed(f"{_computes_attention_itself(self.family)} (it used the attention "
                        f"mask's {name!r}; see integrations.transformers.check_model)")

    def _used_as_tensor(self, *args):
        self.__getattr__("tensor operations")

    __add__ = __radd__ = __mul__ = __rmul__ = _used_as_tensor

    def __getitem__(self, index):
        # Gemma 4 slices its masks to the query rows it keeps (``logits_to_keep``) before its
        # KV-shared layers; 0 keeps them all: a slice of every row and column is this mask
        parts = index if isinstance(index, tuple) else (index,)
        if all(isinstance(p, slice) and p.start in (None, 0) and p.stop is None
               and p.step in (None, 1) for p in parts):
            return self
        # a converted sparse-attention model hands its indexer the mask of head 0
        # (``[:, 0]``): the same mask, which the converted indexer reads as this one
        if (self.converted and len(parts) >= 2 and type(parts[1]) is int and parts[1] == 0
                and all(p == slice(None) for p in parts[:1] + parts[2:])):
            return self
        return self._used_as_tensor()


class _MaskUsed(ValueError, AttributeError):
    """A model used ``ModelMask`` as a tensor: it computes attention itself."""


def _model_mask(*, mask_function=None, local_size=None, config=None, attention_mask=None,
                use_vmap=False, allow_is_bidirectional_skip=None, **kwargs) -> ModelMask:
    """AttentionMaskInterface function: describe the requested mask, build nothing.

    Raises:
        ValueError: a config ``check_model`` refuses (Doge computes a mask of its own from
            this one: refused here, before it uses it).
    """
    family = str(getattr(config, "model_type", None) or "the model")
    model = running_model(config)  # the converted model whose forward asks, if any
    problem = None if config is None else _config_problem(config, model=model)
    if problem is not None:
        raise ValueError(f"ring attention cannot run {family} exactly: {problem}")
    base = _base_model_class(config)
    if (base is not None and not base.is_backend_compatible() and family not in MIXER_FAMILIES
            and not (model is not None and converted(model))):
        raise ValueError(_computes_attention_itself(f"{family} ({base.__name__})"))
    bidirectional = allow_is_bidirectional_skip is not None
    if local_size is None:
        kind = "bidirectional" if bidirectional else "causal"
    elif bidirectional:
        kind = "bidirectional-sliding"
    else:
        chunk = getattr(config, "attention_chunk_size", None)
        window = getattr(config, "sliding_window", None)
        kind = "chunked" if chunk == local_size and window != local_size else "sliding"
        if chunk == local_size and window == local_size:
            kind = "ambiguous"
    # a mask of ones (BioGPT makes one when given none) pads nothing
    padded = attention_mask is not None and not bool(attention_mask.all())
    return ModelMask(kind, local_size, custom=bool(use_vmap) or _united(mask_function),
                     padded=padded, family=family,
                     converted=model is not None and converted(model))


def _united(mask_function, depth: int = 0) -> bool:
    """Whether transformers' ``mask_function`` unites the mask it describes with another one
    (its ``or_masks``: a prefix-LM's bidirectional blocks from ``block_sequence_ids``, which
    transformers adds without ``use_vmap``): keys a ModelMask does not describe."""
    if depth > 8 or not callable(mask_function):
        return False
    if getattr(mask_function, "__qualname__", "") == "or_masks.<locals>.or_mask":
        return True
    if torch.compiler.is_compiling():  # dynamo cannot read closures: the outermost one only
        return False  # (a union under a packed-documents and_mask is not seen there)
    for cell in getattr(mask_function, "__closure__", None) or ():
        try:
            inner = cell.cell_contents
        except ValueError:  # an empty cell
            continue
        if any(_united(f, depth + 1) for f in (inner if isinstance(inner, tuple) else (inner,))):
            return True
    return False


def _ring_arguments(module, attention_mask, sliding_window, is_causal, ring_context):
    """(causal, window_size, key of an extra mask or None) for the ring from what the
    model asked for."""
    causal = bool(getattr(module, "is_causal", True) if is_causal is None else is_causal)
    window = (-1, -1) if not sliding_window else (int(sliding_window) - 1, 0)
    mask = None
    if attention_mask is None:
        return causal, window, mask
    if not isinstance(attention_mask, ModelMask):
        raise TypeError(
            f"ring attention got a dense attention_mask ({type(attention_mask).__name__}) from "
            f"{type(module).__name__}: a mask the model computes itself cannot be sharded; "
            f"padding and documents go through ringattn.shard_batch"
        )
    if attention_mask.custom:
        raise TypeError(f"{type(module).__name__} overlays its own mask function on the "
                        f"{attention_mask.kind} mask; ring attention cannot translate it")
    if attention_mask.padded:
        raise ValueError("the model was given an attention_mask; pass padding through "
                         "ringattn.shard_batch (its ring_context masks padded keys)")
    kind, size = attention_mask.kind, attention_mask.size
    if kind == "ambiguous":
        raise ValueError(f"cannot tell the sliding window from the chunk size ({size})")
    if kind in ("bidirectional", "bidirectional-sliding"):
        causal = False
    if kind == "sliding":
        causal = True
        wanted = (size - 1, 0)
        if window != (-1, -1) and window != wanted:
            raise ValueError(f"{type(module).__name__} passes sliding_window={sliding_window} "
                             f"but its mask has a window of {size}")
        window = wanted
    elif kind == "bidirectional-sliding":
        window = (size, size)
    elif kind == "chunked":
        causal = True
        mask = chunked_key(size, ring_context.left_padding)
    return causal, window, mask


def _check_call(module, attention_mask, dropout, sliding_window, is_causal, ring_context,
                output_attentions, head_mask, kwargs):
    """This rank's refusals of one attention call; (causal, window, mask) otherwise."""
    config = getattr(module, "config", None)
    model = owner(module)  # the converted model this module belongs to, if any
    if kwargs.pop("output_router_logits", None) and not (
            model is not None and global_router_loss(model)):
        raise ValueError("output_router_logits=True: each rank would normalise the router "
                         "auxiliary loss over its own tokens; convert the model "
                         "(ringattn.integrations.transformers.convert) or pass "
                         "output_router_logits=False")
    unknown = sorted(k for k, v in kwargs.items() if k not in NOT_ATTENTION_KWARGS and v is not None)
    if unknown:
        raise TypeError(f"ring attention does not implement the attention argument(s) "
                        f"{unknown} that {type(module).__name__} passes")
    if dropout:
        raise ValueError(f"ring attention has no attention dropout, got dropout={dropout}")
    if output_attentions or head_mask is not None:
        raise TypeError("ring attention returns no attention weights and takes no head_mask")
    problem = _config_problem(config, model=model)
    if problem is not None:
        raise ValueError(f"ring attention cannot run this model exactly: {problem}")
    family = getattr(config, "model_type", None)
    if family in POSITIONS_FROM_MASK and ring_context.slot_positions:
        raise ValueError(
            f"{family} counts its position ids from the attention mask (a left-padded row "
            f"starts at 0 on its first real token), but this batch's position_ids are the slot "
            f"indices ringattn.shard_batch makes: shard it with "
            f"ringattn.integrations.transformers.prepare_batch(model, batch), or give the "
            f"batch position_ids"
        )
    if getattr(module, "attn_temperature_tuning", False) and not getattr(module, "use_rope", True):
        raise ValueError(
            f"{type(module).__name__} scales its queries by position (attn_temperature_tuning) "
            f"from arange(local length), not the global positions; convert the model "
            f"(ringattn.integrations.transformers.convert) or disable it"
        )
    return _ring_arguments(module, attention_mask, sliding_window, is_causal, ring_context)


def ring_attention_forward(module, query, key, value, attention_mask=None, dropout=0.0,
                           scaling=None, sliding_window=None, softcap=None, s_aux=None,
                           is_causal=None, ring_context=None, output_attentions=False,
                           head_mask=None, indices=None, **kwargs):
    """transformers attention function: query [B, H, L, D], key [B, Hkv, L, D], value
    [B, Hkv, L, Dv] -> ([B, L, H, Dv], None).

    Raises:
        TypeError: an argument ring attention does not implement (named), or a mask it
            cannot translate. ValueError: no ring context, dropout, a model that
            ``check_model`` refuses, or an OPT-style model (``POSITIONS_FROM_MASK``) on a
            batch whose slot positions differ from the ones it counts (use
            ``prepare_batch``).
    """
    if ring_context is None:
        raise ValueError(
            f"attn_implementation='ringattn' needs the batch's ring_context, but "
            f"{type(module).__name__} got none: either the model was not called with the dict "
            f"from ringattn.shard_batch / prepare_batch, or it does not pass its keyword "
            f"arguments on to attention (as stablelm and nemotron do), and ring attention "
            f"cannot run it"
        )
    selection = None
    try:  # this rank's own refusals travel in the attention's agreement (every rank raises)
        causal, window, mask = _check_call(module, attention_mask, dropout, sliding_window,
                                           is_causal, ring_context, output_attentions,
                                           head_mask, kwargs)
        if indices is not None:  # a sparse attention's keys per query (DSA indexers)
            selection = getattr(indices, "_ringattn_selection", None)
            if selection is None:
                raise TypeError(f"{type(module).__name__} passes indices= (the keys each "
                                f"query keeps) that no indexer converted by ringattn's "
                                f"convert selected over the whole sequence")
        error = None
    except (TypeError, ValueError) as exc:
        (causal, window, mask), error, selection = (True, (-1, -1), None), exc, None
    kw = ring_context.attention_kwargs()
    if mask is not None:
        kw["mask"] = and_keys(kw["mask"], mask)
    if selection is not None:
        kw["mask"] = and_keys(kw["mask"], mask_key(selection))
    with caller_error(error):
        out = attention(  # the batch's strategy (shard_batch's)
            query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2),
            strategy=ring_context.strategy, causal=causal, window_size=window,
            softmax_scale=scaling, softcap=float(softcap) if softcap else 0.0, sinks=s_aux, **kw,
        )
    ring_context.record_call()
    return out, None


def register(name: str = NAME) -> str:
    """Register ring attention with transformers under ``name``; returns the name."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, ring_attention_forward)
    AttentionMaskInterface.register(name, _model_mask)
    return name


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
