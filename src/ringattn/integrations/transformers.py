"""transformers integration: ring attention as a registered attention implementation.

``register()`` adds "ringattn" to transformers' ``AttentionInterface`` and a mask function to
``AttentionMaskInterface``, so any model that calls its attention through that interface
runs context-parallel with ``config._attn_implementation = "ringattn"`` (or
``from_pretrained(..., attn_implementation="ringattn")``) and a batch from
``ringattn.shard_batch``:

    from ringattn.integrations import transformers as ra_hf
    ra_hf.register()
    model = LlamaForCausalLM(config)            # config._attn_implementation = "ringattn"
    local = ra_hf.prepare_batch(model, batch, group=cp_group)   # check_model + shard_batch
    out = model(**local)

Nothing is patched: the batch's ``RingContext`` travels through the model's own kwargs.

Exact or refused. Every argument a model gives its attention function is honoured or the
call raises a TypeError naming it; nothing is dropped:

* ``scaling``, ``dropout`` (0 only), ``is_causal``;
* ``sliding_window`` W (Mistral, Qwen2: keys q-W < kv <= q) -> ``window_size=(W - 1, 0)``;
* ``softcap`` (Gemma 2's ``attn_logit_softcapping``) -> ring soft-capping (reference kernel);
* ``s_aux`` (gpt-oss's sinks) -> ring ``sinks`` (differentiable);
* a value head dim different from the query's (MLA: DeepSeek V2/V3) -> native;
* the masks a model asks transformers for: causal, sliding window (also when the model
  expresses its window only through the mask, as Qwen2-MoE and PhiMoE do), bidirectional,
  Llama 4's chunked attention; a mask with a custom overlay, or a dense mask tensor (a
  learned mask, as Doge's), is refused;
* per-call model kwargs that are not attention arguments (``position_ids``,
  ``num_items_in_batch``, ...; ``NOT_ATTENTION_KWARGS``) are ignored.

``prepare_batch`` (``check_attention``, ``check_model``, then ``shard_batch`` with the
position ids the model would compute: OPT-style models count real tokens of a padded row)
is the safe entry. ``shard_batch`` alone then ``model(**local)`` is exact or refused too:
the attention function refuses an OPT-style model on a batch whose positions
``shard_batch`` made where they differ (padding before a real token), and the mask
function refuses, with ``check_model``'s message, configs it refuses and models whose
family computes attention itself (they would use the mask object as a tensor).
``check_model`` refuses what the attention function alone cannot see: model classes that
compute attention themselves (``is_backend_compatible()`` False: bloom, codegen, xglm, ...),
and models whose other sequence layers (state-space, linear attention, convolution) or
losses (router auxiliary losses) would see only the local shard. The attention function
runs the configuration checks too, on every call.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..strategies.auto import attention
from ..batch import shard_batch
from ..layouts import DEFAULT_LAYOUT
from ..masks import and_keys, chunked_key
from ..validate import caller_error
from .state import owner, running_model

__all__ = ["NAME", "ModelMask", "check_attention", "check_model", "prepare_batch", "register",
           "ring_attention_forward"]

NAME = "ringattn"

NOT_ATTENTION_KWARGS = frozenset({
    "position_ids", "cache_position", "use_cache", "num_items_in_batch", "shift_labels",
    "labels", "output_hidden_states", "return_dict", "past_key_values", "layer_idx",
})
"""Model kwargs that reach the attention function but do not change what it computes."""

_ATTENTION_LAYER_TYPES = frozenset({
    "full_attention", "sliding_attention", "chunked_attention", "attention", "global",
    "local", "full", "sliding",
})
"""Entries of a config's per-layer type list that are attention layers."""

_LAYER_TYPE_FIELDS = ("layer_types", "block_types", "layers_block_type", "layer_block_types")

_OWN_MASKS = frozenset({"doge"})
"""Families that compute a mask of their own (Doge's learned dynamic mask) from the one
transformers builds: it cannot be sharded."""

_TOP_K_KEYS = frozenset({"deepseek_v32", "glm_moe_dsa", "axk2", "hy_v4", "dots3_note_text",
                         "deepseek_v4"})
"""Families whose attention keeps, for each query, only the keys an indexer scores highest
among all keys of the sequence (DeepSeek sparse attention): a data-dependent key set per
query, which no ring mask expresses."""

_SEQUENCE_MIXERS = frozenset({
    "jamba", "bamba", "falcon_h1", "falcon_mamba", "mamba", "mamba2", "zamba", "zamba2",
    "recurrent_gemma", "lfm2", "lfm2_moe", "lfm2_vl", "qwen3_next", "minimax",
    "granitemoehybrid", "nemotron_h", "rwkv", "xlstm", "plamo2", "kimi_linear",
})
"""Families with non-attention sequence layers, for configs that list no layer types."""


def _config_problem(config, router: bool = True, mixers: bool = True, model=None) -> str | None:
    """Why ring attention cannot give this model's exact result, or None (``router``,
    ``mixers``: whether an unconverted router auxiliary loss, and unconverted sequence
    mixers of a family ``convert`` serves, count). What ``convert`` did is read from
    ``model``, the instance (None: a model nobody converted), never from the config."""
    from .hybrid import _WHY_NOT  # families convert_mixers refuses, and why

    name = getattr(config, "model_type", type(config).__name__)
    convert = (f" (convert it first: ringattn.integrations.transformers.convert(model))"
               if name in CONVERTIBLE else f"; and {_WHY_NOT[name]}" if name in _WHY_NOT else "")
    done = (model is not None and mixers_converted(model)) or (not mixers and name in CONVERTIBLE)
    if name in _TOP_K_KEYS:
        return (f"{name}'s indexer keeps each query's top {getattr(config, 'index_topk', 'k')} "
                f"keys, scored against every key of the sequence (sparse attention): a key set "
                f"chosen per query from the whole sequence, which ring attention cannot mask")
    for field in _LAYER_TYPE_FIELDS:
        if done:
            break
        kinds = getattr(config, field, None)
        if isinstance(kinds, (list, tuple)):
            other = sorted({str(k) for k in kinds} - _ATTENTION_LAYER_TYPES)
            if other:
                return (f"{name} has {field} {other}: those sequence layers would see only this "
                        f"rank's shard of the sequence, not the whole of it{convert}")
    if name in _OWN_MASKS:
        return (f"{name} computes a dense attention mask of its own (learned from the inputs), "
                f"which cannot be sharded")
    if name in _SEQUENCE_MIXERS and not done:
        return (f"{name} has sequence layers other than attention (state-space, linear "
                f"attention or convolution), which would see only this rank's shard{convert}")
    if (router and getattr(config, "output_router_logits", False)
            and not (model is not None and global_router_loss(model))):
        return (f"{name} adds a router auxiliary loss (output_router_logits=True), which each "
                f"rank would normalise over its own tokens; convert the model "
                f"(ringattn.integrations.transformers.convert) or set output_router_logits=False")
    return None


def _computes_attention_itself(what: str, config=None) -> str:
    """check_model's message for a model that never calls the attention interface (with a
    composite ``config``, one holding a ``text_config``, it says what is served instead)."""
    composite = getattr(config, "text_config", None) is not None
    return (f"{what} computes attention itself instead of calling transformers' attention "
            f"interface, so attn_implementation={NAME!r} would never run and every rank would "
            f"attend over its shard alone" + (
                "; it is a composite model (its config has a text_config): for text "
                "training, build its language model alone (AutoModelForCausalLM on the same "
                "config or checkpoint), which ringattn checks and converts on its own"
                if composite else ""))


def check_model(model, config=None) -> None:
    """Refuse a model that ring attention cannot run exactly on shards.

    Arguments:
        model: a transformers model, or a model CLASS (to check before building it: some
            classes, such as Falcon's and GPT-Neo's, fail inside transformers'
            constructor with a bare KeyError when asked for a registered attention name).
        config: the config to check with a class (a model's own config otherwise). A class
            is not refused for a router auxiliary loss or for sequence mixers that
            ``convert`` makes global after building (``prepare_batch`` checks the built
            model).

    Raises:
        ValueError: the model class computes attention itself (never calls the registered
            function), or has non-attention sequence layers or per-rank losses.
    """
    cls = model if isinstance(model, type) else type(model)
    config = getattr(model, "config", None) if config is None else config
    family = getattr(config, "model_type", None)
    if (isinstance(model, type) and family in BUILT_EAGER
            and getattr(config, "_attn_implementation", None) == NAME):
        raise ValueError(
            f"{cls.__name__} cannot be built with attn_implementation={NAME!r}: transformers "
            f"looks its attention class up in a dict of its own and raises KeyError. Build it "
            f"with attn_implementation='eager', then call "
            f"ringattn.integrations.transformers.convert(model)")
    from .hybrid import _WHY_NOT  # families convert_mixers refuses, and why

    if family in _WHY_NOT or family in _TOP_K_KEYS:  # its own reason before the generic one
        reason = (_config_problem(config) if family in _TOP_K_KEYS
                  else f"{family}: {_WHY_NOT[family]}")
        raise ValueError(f"ring attention cannot run {cls.__name__} exactly: {reason}")
    if (hasattr(cls, "is_backend_compatible") and not cls.is_backend_compatible()
            and family not in CONVERTIBLE and not (
                convertible(family) if isinstance(model, type) else converted(model))):
        raise ValueError(_computes_attention_itself(cls.__name__, config) + (
            "; convert the model first (ringattn.integrations.transformers.convert)"
            if convertible(family) else ""))
    built = not isinstance(model, type)
    problem = None if config is None or isinstance(config, property) else _config_problem(
        config, router=built, mixers=built, model=model if built else None)
    if problem is not None:
        raise ValueError(f"ring attention cannot run {cls.__name__} exactly: {problem}")


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


POSITIONS_FROM_MASK = frozenset({"opt"})
"""Families whose position ids, when not given, count real tokens (``cumsum(mask) * mask
- 1``: a left-padded row starts at 0 on its first real token) instead of slots. (BioGPT's
learned positions count slots since transformers 5.24: its model makes slot position ids
before its embedding could count the mask; the family survey checks it on left padding.)"""


def prepare_batch(model, batch: dict, *, group=None, layout: str = DEFAULT_LAYOUT, **kwargs) -> dict:
    """``check_attention`` and ``check_model``, then ``ringattn.shard_batch``, with the
    position ids this model would compute on the whole batch (``shard_batch`` alone gives
    slot indices 0..S-1, what Llama-style models compute; OPT-style models count real
    tokens from the padding mask, and their attention refuses a left-padded batch from
    ``shard_batch`` alone).

    Arguments:
        model: the transformers model (attn_implementation "ringattn").
        batch, group, layout, kwargs: as for ``ringattn.shard_batch``.

    Returns:
        This rank's shard of the batch, for ``model(**local)``.

    Raises:
        ValueError: from ``check_attention`` (the model's attention is not ring
            attention), ``check_model`` or ``shard_batch``.
    """
    _agree_on_model(model, group)
    keep = batch.get("attention_mask")
    family = getattr(getattr(model, "config", None), "model_type", None)
    if family in POSITIONS_FROM_MASK and keep is not None and batch.get("position_ids") is None:
        keep = keep.long()
        batch = {**batch, "position_ids": keep.cumsum(1) * keep - 1}
    return shard_batch(batch, group=group, layout=layout, **kwargs)


def _model_digest(model) -> int:
    """What the ranks' models must agree on: class, family and what ``convert`` did to
    this instance (its converted layers' classes and its global router loss)."""
    import zlib

    from .state import conversion

    kinds = sorted({type(m).__name__ for m in model.modules()
                    if type(m).__module__.startswith("ringattn.")})
    said = (type(model).__qualname__, getattr(getattr(model, "config", None), "model_type", None),
            sorted((conversion(model) or {}).items()), kinds, global_router_loss(model),
            getattr(getattr(model, "config", None), "_attn_implementation", None))
    return zlib.crc32(repr(said).encode()) & 0x7FFFFFFF


def _agree_on_model(model, group) -> None:
    """``check_attention`` and ``check_model`` on this rank, then one small exchange, so a
    rank whose model is refused (or converted otherwise than its peers') makes every rank
    raise the same error before anything is sharded."""
    from ..comm import agree, resolve_group

    error, digest = None, -1
    try:
        check_attention(model)
        check_model(model)
        digest = _model_digest(model)
    except (TypeError, ValueError) as exc:
        error = exc
    agree(resolve_group(group), {"the model (class, conversion)": digest}, error,
          describe=lambda name, value: f"model digest {value:#010x}",
          what="prepare_batch's model check")


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
    if (base is not None and not base.is_backend_compatible() and family not in CONVERTIBLE
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


def _base_model_class(config):
    """The transformers base model class of ``config``'s family (``AutoModel``'s mapping),
    or None for a config it does not know."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    try:
        return MODEL_MAPPING[type(config)]
    except (KeyError, ValueError):
        return None


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
                           head_mask=None, **kwargs):
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
    try:  # this rank's own refusals travel in the attention's agreement (every rank raises)
        causal, window, mask = _check_call(module, attention_mask, dropout, sliding_window,
                                           is_causal, ring_context, output_attentions,
                                           head_mask, kwargs)
        error = None
    except (TypeError, ValueError) as exc:
        (causal, window, mask), error = (True, (-1, -1), None), exc
    kw = ring_context.attention_kwargs()
    if mask is not None:
        kw["mask"] = and_keys(kw["mask"], mask)
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


from .context import average_gradients, context_parallel  # noqa: E402,F401 (re-exported)
from .hybrid import CONVERTIBLE, convert_mixers, mixers_converted  # noqa: E402,F401 (re-exported)
from .families import BUILT_EAGER, convert, converted, convertible, global_router_loss  # noqa: E402,F401 (re-exported)

if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
