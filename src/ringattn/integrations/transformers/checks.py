"""What ring attention runs exactly, what it refuses, and why: data and the checks that
read it (the bottom of the transformers integration: it imports nothing above it).

The tables below are filled by the files that implement each mechanism (``families/`` and
``mixers/``, one file per mechanism, each registering its rows when the package is
imported): adding a family that an existing mechanism serves is one row there. What
``convert`` did to a model is read from the model instance (``state``): its modules'
classes and its hooks, never its config, which other models may share.
"""

from __future__ import annotations

import functools
import inspect
import re
import zlib

from . import state

__all__ = ["ATTENTION_FAMILIES", "BLOCK_SPARSE_LAYERS", "BUILT_EAGER", "KWARGS_STOP", "LOSS_TERMS",
           "MIXER_FAMILIES", "MIXER_LAYERS",
           "NAME", "NOT_ATTENTION_KWARGS", "POSITIONS_FROM_MASK", "REFUSED", "check_model",
           "converted", "convertible", "global_router_loss", "loss_terms", "mixers_converted",
           "pinned_problem", "source_digest"]

NAME = "ringattn"

# -- the tables the mechanism files fill ------------------------------------------------------

MIXER_LAYERS: dict = {}
"""transformers' sequence-mixer class name -> the mixin of its converted class (``mixers/``)."""
MIXER_FAMILIES: dict = {}
"""model_type -> the ``mixers/`` file whose layers ``convert`` converts for it."""
MIXERS_PER_LAYER: dict = {}
"""Mixer families whose every listed non-attention layer holds several mixer modules
(Inkling: four short convolutions per layer): model_type -> how many."""
KWARGS_STOP: set = set()
"""Mixer families whose model or blocks do not pass ``ring_context`` on to their mixers:
their layers get the context of their model's forward (``state.bind_context``)."""
ATTENTION_FAMILIES: dict = {}
"""model_type -> the ``families/`` file that converts its attention (a family that computes
attention itself, or whose layers drop the ring context)."""
BLOCK_SPARSE_LAYERS: dict = {}
"""model_type -> its per-layer types whose attention ``convert`` replaces (``families/``:
block-sparse layers whose indexer picks key blocks per query); not sequence mixers."""
REFUSED: dict = {
}
"""model_type -> why ``convert`` refuses the family: a sequence layer or an attention that
ring attention does not compute (their other layers alone would convert)."""

BUILT_EAGER = frozenset({"gpt_neo", "falcon"})
"""Families whose constructor looks its attention class up by attn_implementation in a dict
of its own (a bare KeyError for "ringattn"): built with "eager", then converted (``convert``
replaces the attention modules and sets the config's attention implementation)."""


def register_mixers(where: str, layers: dict, families, kwargs_stop=(), per_layer=None) -> None:
    """Rows of a ``mixers/`` file: its layer classes, the families they complete, those
    whose model drops ``ring_context``, and ``per_layer`` (family -> mixer modules per
    listed layer, where not one)."""
    MIXER_LAYERS.update(layers)
    MIXER_FAMILIES.update(dict.fromkeys(families, where))
    KWARGS_STOP.update(kwargs_stop)
    MIXERS_PER_LAYER.update(per_layer or {})


def register_attention(where: str, families, layer_types=None) -> None:
    """Rows of a ``families/`` file: the families whose attention it converts (and
    ``layer_types``: family -> the layer types of its own that this conversion serves)."""
    ATTENTION_FAMILIES.update(dict.fromkeys(families, where))
    BLOCK_SPARSE_LAYERS.update(layer_types or {})


# -- what convert did to THIS model -----------------------------------------------------------

def converted(model) -> bool:
    """Whether ``convert`` ran on this model instance (its record is on the model; another
    model built from the same config is not converted)."""
    done = state.conversion(model)  # raises TypeError for a config
    return bool(done and done.get("converted"))


def global_router_loss(model) -> bool:
    """Whether this model instance computes its router auxiliary loss globally (``convert``
    put the global router loss hook on it), so ``output_router_logits=True`` is exact."""
    state.conversion(model)  # raises TypeError for a config
    return any(getattr(hook, state.ROUTER_MARK, False) for hook in model._forward_hooks.values())


def mixers_converted(model) -> bool:
    """Whether every sequence mixer of this model instance runs ringattn.mixers: it holds
    converted layers and none of transformers' own (read from its modules' classes, not
    from its config, which other models may share)."""
    if state.conversion(model) is None:  # raises TypeError for a config
        return False
    found = False
    for module in model.modules():
        if isinstance(module, state.ConvertedMixer):
            found = True
        elif (type(module).__name__ in MIXER_LAYERS
              and type(module).__module__.startswith("transformers.")):
            return False
    return found


def convertible(model_type) -> bool:
    """Whether ``convert`` replaces the attention of this family (which computes attention
    itself: ``check_model`` on its class accepts it, on an unconverted model refuses it)."""
    return model_type in ATTENTION_FAMILIES


# -- the data ---------------------------------------------------------------------------------

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
transformers builds: it cannot be sharded unless ``convert`` replaced their attention
(``families/score_bias.py`` carries it as a per-key score bias)."""

_TOP_K_KEYS = frozenset({"deepseek_v32", "glm_moe_dsa", "axk2", "hy_v4", "dots3_note_text",
                         "deepseek_v4"})
"""Families whose attention keeps, for each query, only the keys an indexer scores highest
among all keys of the sequence (DeepSeek sparse attention): a data-dependent key set per
query. Those that ``families/indexer.py`` registers are served once converted (the
selection over the whole sequence, then the ring with it as a key mask), and deepseek_v4,
whose indexer keeps entries compressed over blocks of slots, once ``families/compressed.py``
converted it; any other is refused."""

_INDEXED_LAYER_TYPES = frozenset({"indexed_attention"})
"""Layer types of the _TOP_K_KEYS families that are attention with an indexer (dots3-note):
attention layers once ``convert`` converted their indexers."""

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
    name = getattr(config, "model_type", type(config).__name__)
    convert = (" (convert it first: ringattn.integrations.transformers.convert(model))"
               if name in MIXER_FAMILIES else f"; and {REFUSED[name]}" if name in REFUSED else "")
    seen = []  # whether the mixers are converted: read from the model once, when asked

    def done() -> bool:
        if not seen:
            seen.append((not mixers and name in MIXER_FAMILIES)
                        or (model is not None and mixers_converted(model)))
        return seen[0]

    indexed = name in _TOP_K_KEYS and name in ATTENTION_FAMILIES  # served by convert
    if name in _TOP_K_KEYS and not (indexed and (
            not mixers or (model is not None and state.conversion(model) is not None))):
        return (f"{name}'s indexer keeps each query's top {getattr(config, 'index_topk', 'k')} "
                f"keys, scored against every key of the sequence (sparse attention): a key set "
                f"chosen per query from the whole sequence, which ring attention "
                + ("selects only in a converted model (convert it first: "
                   "ringattn.integrations.transformers.convert(model))" if indexed else
                   "does not compute"))
    sparse = set(BLOCK_SPARSE_LAYERS.get(name, ()))
    for field in _LAYER_TYPE_FIELDS:
        kinds = getattr(config, field, None)
        if isinstance(kinds, (list, tuple)):
            found = sorted(sparse & {str(k) for k in kinds})
            if found and mixers and (model is None or state.conversion(model) is None):
                return (f"{name} has {field} {found}: their indexer picks each query's key "
                        f"blocks from the whole sequence, which its attention modules would "
                        f"compute from this rank's shard alone (convert it first: "
                        f"ringattn.integrations.transformers.convert(model))")
            kinds = [k for k in kinds if str(k) not in sparse]
            other = sorted({str(k) for k in kinds} - _ATTENTION_LAYER_TYPES
                           - (_INDEXED_LAYER_TYPES if indexed else frozenset()))
            if other and not done():
                return (f"{name} has {field} {other}: those sequence layers would see only this "
                        f"rank's shard of the sequence, not the whole of it{convert}")
    if name in _OWN_MASKS and not (convertible(name) and (  # convert serves it
            not mixers or (model is not None and state.conversion(model) is not None))):
        return (f"{name} computes a dense attention mask of its own (learned from the inputs), "
                f"which cannot be sharded")
    if name in _SEQUENCE_MIXERS and not done():
        return (f"{name} has sequence layers other than attention (state-space, linear "
                f"attention or convolution), which would see only this rank's shard{convert}")
    if (router and getattr(config, "output_router_logits", False)
            and not (model is not None and global_router_loss(model))):
        return (f"{name} adds a router auxiliary loss (output_router_logits=True), which each "
                f"rank would normalise over its own tokens; convert the model "
                f"(ringattn.integrations.transformers.convert) or set output_router_logits=False")
    return None


LOSS_TERMS: dict = {
    "loss+=self.router_aux_loss_coef*aux_loss.to(loss.device)":
        ("router", "router_aux_loss_coef", "output_router_logits"),
    "loss+=self.aux_loss_coef*aux_loss.to(loss.device)":  # JetMoe's name
        ("router", "aux_loss_coef", "output_router_logits"),
    "loss=loss+self.z_loss_coefficient*z_loss":  # Bamba: logsumexp(logits)^2, mean over B x S
        ("z_loss", "z_loss_coefficient", None),
}
"""Every statement by which a transformers family's causal-LM forward adds a term to the loss
of ``self.loss_function`` (whitespace and comments removed) -> (the term, the model attribute
weighing it, the config flag that turns it on, if any). Read from the forward's source, by
structure: a statement not listed makes ``check_model`` refuse the family, naming it. A
``router`` term is exact once ``convert`` made it global (``families/router.py``); a
``z_loss`` term (a mean over every position's logits, which no rank holds) is refused
while its coefficient is not 0. ``tests/unit/test_loss_terms.py`` keeps the table complete
against the family survey."""

def source_digest(obj) -> int | None:
    """A number for the code of ``obj`` (a function), its docstrings, comments and
    whitespace left out; None when its source cannot be read. What a conversion that
    re-derives a transformers function's arithmetic pins: another version of the function
    gives another number."""
    try:
        source = inspect.getsource(obj)
    except (OSError, TypeError):
        return None
    source = re.sub(r'"""[\s\S]*?"""|\'\'\'[\s\S]*?\'\'\'', "", source)
    source = re.sub(r"#[^\n]*", "", source)
    return zlib.crc32("".join(source.split()).encode()) & 0x7FFFFFFF


def pinned_problem(module, pins: dict) -> str | None:
    """Which of ``pins`` ({"Class.method" or "function" of ``module``: source_digest}) the
    installed transformers writes otherwise (or lacks), or None."""
    changed = []
    for name, want in pins.items():
        obj = module
        for part in name.split("."):
            obj = getattr(obj, part, None)
        if obj is None or source_digest(obj) != want:
            changed.append(name)
    if not changed:
        return None
    import transformers

    return (f"transformers {transformers.__version__} writes {', '.join(changed)} otherwise "
            f"than the code ringattn reproduces")


_LOSS_START = re.compile(r"^loss\s*(\+=|-=|\*=|/=|=)")


@functools.lru_cache(maxsize=None)
def loss_terms(cls: type) -> tuple:
    """The statements of ``cls.forward`` that change its loss after ``self.loss_function``
    computed it (normalised as ``LOSS_TERMS``'s keys); () for a forward that is not a
    transformers family's own or whose source cannot be read."""
    forward = getattr(cls, "forward", None)
    if not getattr(forward, "__module__", "").startswith("transformers."):
        return ()
    try:
        source = inspect.getsource(forward)
    except (OSError, TypeError):
        return ()
    found = []
    for line in source.splitlines():
        code = "".join(line.split("#", 1)[0].split())
        if (_LOSS_START.match(code) and "self.loss_function(" not in code
                and code != "loss=None" and not code.startswith("loss=loss,")):
            found.append(code)
    return tuple(found)


def _loss_term_problem(cls: type, name: str, weight) -> str | None:
    """Why a term ``cls``'s forward adds to its loss is not exact under CP, or None;
    ``weight(attribute)`` reads a term's coefficient (the model's attribute, or for a class
    its config's field). Router terms are checked in ``_config_problem``."""
    for code in loss_terms(cls):
        row = LOSS_TERMS.get(code)
        if row is None:
            return (f"{name}'s forward adds a term to its loss that ringattn does not know "
                    f"({code!r}): each rank would compute it over its own shard")
        term, attribute, _ = row
        value = weight(attribute)
        if term == "z_loss" and value not in (None, 0, 0.0):
            return (f"{name} adds a z-loss ({attribute}={value}): the mean of every "
                    f"position's logsumexp(logits)^2, which no rank holds under context "
                    f"parallelism (each rank would average its own shard); set "
                    f"{attribute}=0 (model.{attribute} and its config)")
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
    top_k = None
    if family in _TOP_K_KEYS:  # served by convert: a class, or a converted model
        built = not isinstance(model, type)
        top_k = _config_problem(config, router=False, mixers=built,
                                model=model if built else None)
    if family in REFUSED or top_k is not None:  # its own reason before the generic one
        reason = top_k if family in _TOP_K_KEYS else f"{family}: {REFUSED[family]}"
        raise ValueError(f"ring attention cannot run {cls.__name__} exactly: {reason}")
    if (hasattr(cls, "is_backend_compatible") and not cls.is_backend_compatible()
            and family not in MIXER_FAMILIES and not (
                convertible(family) if isinstance(model, type) else converted(model))):
        raise ValueError(_computes_attention_itself(cls.__name__, config) + (
            "; convert the model first (ringattn.integrations.transformers.convert)"
            if convertible(family) else ""))
    built = not isinstance(model, type)
    problem = None if config is None or isinstance(config, property) else _config_problem(
        config, router=built, mixers=built, model=model if built else None)
    if problem is None:  # a built model's own coefficients; a class's config fields
        problem = _loss_term_problem(
            cls, family or cls.__name__,
            (lambda a: getattr(model, a, None)) if built else (lambda a: getattr(config, a, None)))
    if problem is not None:
        raise ValueError(f"ring attention cannot run {cls.__name__} exactly: {problem}")


POSITIONS_FROM_MASK = frozenset({"opt"})
"""Families whose position ids, when not given, count real tokens (``cumsum(mask) * mask
- 1``: a left-padded row starts at 0 on its first real token) instead of slots. (BioGPT's
learned positions count slots since transformers 5.24: its model makes slot position ids
before its embedding could count the mask; the family survey checks it on left padding.)"""


def _base_model_class(config):
    """The transformers base model class of ``config``'s family (``AutoModel``'s mapping),
    or None for a config it does not know."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING

    try:
        return MODEL_MAPPING[type(config)]
    except (KeyError, ValueError):
        return None



if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
