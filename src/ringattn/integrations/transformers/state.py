"""What ``convert`` did, kept on the model it did it to; the ring context of each forward,
bound to the layers that forward ran.

Conversion state lives on the model instance, never beside it: two models built from one
config object (transformers keeps the config a model is built from, so a DPO policy and its
reference share it) are two models, and converting one says nothing about the other.
``convert`` records itself in the model's ``__dict__`` and tags every submodule with a weak
reference to the model, so the attention function (which sees only the attention module)
finds the model it runs in.

The ring context reaches the layers whose model does not pass keyword arguments on (the
Mamba blocks, RWKV, xLSTM, the attention modules of BLOOM, Falcon, ...) through the forward
that made it, not through "the latest one": a forward pre-hook on the model opens a frame
holding the call's ``ring_context`` (closed by a forward hook that always runs), and a
forward pre-hook on each layer that holds such a module adds the frame's context to the
layer's keyword arguments. transformers' gradient checkpointing (``GradientCheckpointingLayer``)
captures those keyword arguments with the layer's call, so its recomputation in the
backward runs with the context of its own forward, whatever forwards ran in between. The
layer's class becomes a subclass that takes the context (``Bound...``: same parameters,
hooks and ``state_dict`` keys) and hands it to its modules for the duration of the call.

A module that runs under ``context_parallel`` without a context (a hook of the manager ran
after the model's own, or a layer ran outside its model's forward) gets ``MISSING`` and
refuses to run, instead of mixing its shard alone.

Every class a conversion swaps in at run time (``Ring...`` mixers, ``Bound...`` layers,
``Tiled...`` MLPs) is made by ``swap_class`` from a mixin of ringattn's and the module's own
class, and pickles by those two names (``SwapMixin``): ``torch.save(model)`` and
``torch.load``, ``copy.deepcopy`` and a process that has not made the class yet all get a
model of the same classes back.
"""

from __future__ import annotations

import copyreg
import threading

import torch

__all__ = ["MISSING", "ROUTER_MARK", "Call", "ConvertedMixer", "SwapMixin", "bind_context",
           "bound_call", "bound_context", "conversion", "current_call", "missing_error", "owner",
           "record", "require_context", "running_model", "swap_class"]

RECORD = "_ringattn_conversion"
"""Key, in a converted model's ``__dict__``, of what ``convert`` did to it (a dict)."""
_OWNER = "_ringattn_owner"
"""Key, in each submodule's ``__dict__``, of a weak reference to the converted model."""
_CONTEXT = "_ring_context"
"""Key, in a bound module's ``__dict__``, of the context of the call it is running in."""
_TARGETS = "_ringattn_targets"
ROUTER_MARK = "_ringattn_router"
"""Attribute set on ``convert``'s global router loss hook: how checks find it on a model."""


class SwapMixin:
    """Base of the mixins ``swap_class`` joins to a module's own class. The joined class is
    made at run time, so it is no attribute of a module and pickle cannot find it by its
    name; its instances pickle as the names it is made from instead (this mixin's class and
    the module's own class, both module attributes) and their state, and unpickling makes
    the class again with ``swap_class``: the same class in this process, the same
    definition in another one."""

    _swap_prefix = "Ring"
    """The joined class's name is this + the module's class name (``Ring``, ``Bound``,
    ``Tiled``)."""

    def __reduce_ex__(self, protocol):
        reduced = super().__reduce_ex__(protocol)
        made = type(self).__dict__.get("_swapped_from")
        if made is None:  # a subclass of a joined class, defined with a name: pickled by it
            return reduced
        # object's reduction for protocol >= 2 (copyreg.__newobj__, (cls,), state, ...) or
        # below (copyreg._reconstructor, (cls, object, None), state): the class by name
        # becomes the class by its parts, the state and the rest are kept
        if reduced[0] not in (copyreg.__newobj__, copyreg._reconstructor) \
                or reduced[1][0] is not type(self) or reduced[1][1:] not in ((), (object, None)):
            raise TypeError(f"{type(self).__name__} cannot be pickled: its class reduces "
                            f"to {reduced[0].__name__}{reduced[1]!r}")
        return (swapped_instance, made, *reduced[2:])


_SWAPPED: dict[tuple[type, type], type] = {}


def swap_class(mixin: type, base: type) -> type:
    """The class a converted module's ``__class__`` becomes: ``mixin``'s methods over
    ``base``'s (``class <prefix><base>(mixin, base)``), made once per process for the pair,
    that pickles by the names of ``mixin`` and ``base`` (``SwapMixin``).

    Arguments:
        mixin: a subclass of ``SwapMixin`` defined at a module's top level.
        base: the module's own class (transformers', or any importable class).

    Raises:
        TypeError: ``mixin`` is not a ``SwapMixin``.
    """
    key = (mixin, base)
    if key not in _SWAPPED:
        if not (isinstance(mixin, type) and issubclass(mixin, SwapMixin)):
            raise TypeError(f"swap_class takes a SwapMixin subclass, got {mixin!r}")
        name = f"{mixin._swap_prefix}{base.__name__}"
        _SWAPPED[key] = type(name, (mixin, base), {"__module__": mixin.__module__,
                                                   "__qualname__": name, "_swapped_from": key})
    return _SWAPPED[key]


def swapped_instance(mixin: type, base: type):
    """An instance of ``swap_class(mixin, base)`` without state, for pickle to fill."""
    cls = swap_class(mixin, base)
    return cls.__new__(cls)


class ConvertedMixer(SwapMixin):
    """Base of every sequence-mixer class ``convert`` swaps in (``mixers/``): how checks tell
    a converted layer from transformers' own."""
_CP_ACTIVE = "_ringattn_context_parallel"  # set by context_parallel on the models it hooks


class _Missing:
    """The context of a forward run under ``context_parallel`` whose context did not reach
    the layer: a module that gets it raises."""

    def __repr__(self):
        return "MISSING"

    def __bool__(self):
        return False


MISSING = _Missing()

_LOCAL = threading.local()


def _frames() -> list:
    if not hasattr(_LOCAL, "frames"):
        _LOCAL.frames = []
    return _LOCAL.frames


def record(model, **done) -> None:
    """Record on ``model`` what ``convert`` did (merged into an earlier record) and tag its
    submodules with the model, for functions that see only a submodule."""
    model.__dict__.setdefault(RECORD, {}).update(done)
    ref = _Owner(model)
    for module in model.modules():
        module.__dict__[_OWNER] = ref
    if not model.__dict__.get("_ringattn_frames"):
        model.register_forward_pre_hook(_open_frame, with_kwargs=True)
        model.register_forward_hook(_close_frame, with_kwargs=True, always_call=True)
        model.__dict__["_ringattn_frames"] = True


def conversion(model) -> dict | None:
    """What ``convert`` did to this model instance (None: never converted)."""
    if not isinstance(model, torch.nn.Module):
        raise TypeError(
            f"conversion state is read from the model instance, got {type(model).__name__}: "
            f"pass the model (two models built from one config are converted separately)")
    return model.__dict__.get(RECORD)


class _Owner:
    """A submodule's reference to its converted model (a plain reference, so a deep copy of
    the model refers to the copy; not a Module attribute, so not a child module)."""

    __slots__ = ("model",)

    def __init__(self, model):
        self.model = model


def owner(module):
    """The converted model ``module`` belongs to, or None."""
    ref = module.__dict__.get(_OWNER) if module is not None else None
    return None if ref is None else ref.model


class Call:
    """One forward of a converted model, as its layers see it: the ``ring_context`` it was
    called with (None: one process; ``MISSING``) and what the model's pre-hooks did to the
    call (``padding_restored``: the padding's own ids were put back into ``input_ids``)."""

    __slots__ = ("context", "padding_restored")

    def __init__(self, context):
        self.context, self.padding_restored = context, False


def _open_frame(model, args, kwargs):
    ctx = kwargs.get("ring_context")
    if ctx is None and getattr(model, _CP_ACTIVE, False):
        ctx = MISSING  # under context_parallel, but its hook has not given this call one
    _frames().append((model, Call(ctx)))
    return None


def _close_frame(model, args, kwargs, output):
    frames = _frames()
    for i in range(len(frames) - 1, -1, -1):
        if frames[i][0] is model:
            del frames[i]
            break
    return None


def current_call(model) -> Call | None:
    """The innermost running forward of ``model`` (None: it is not running)."""
    for running, call in reversed(_frames()):
        if running is model:
            return call
    return None


def running_model(config):
    """The innermost converted model running a forward now whose config is ``config``."""
    for model, _ in reversed(_frames()):
        if getattr(model, "config", None) is config:
            return model
    return None


def bound_call(module) -> Call | None:
    """The forward ``module`` runs in (None: outside any forward of its model)."""
    return module.__dict__.get(_CONTEXT)


def bound_context(module):
    """The ring context of the forward ``module`` runs in (None: one process, or outside
    its model's forward; ``MISSING``: under context_parallel without one)."""
    call = module.__dict__.get(_CONTEXT)
    return None if call is None else call.context


class _Bound(SwapMixin):
    """Mixin of the ``Bound...`` layer classes: the call's context, captured with the
    call's keyword arguments (and so by gradient checkpointing), handed to the layer's
    modules that need it while the layer runs."""

    _swap_prefix = "Bound"

    def forward(self, *args, _ring_bound=None, **kwargs):
        targets = self.__dict__[_TARGETS]
        saved = [t.__dict__.get(_CONTEXT) for t in targets]
        for t in targets:
            t.__dict__[_CONTEXT] = _ring_bound
        try:
            return super().forward(*args, **kwargs)
        finally:
            for t, before in zip(targets, saved):
                t.__dict__[_CONTEXT] = before


def _layer_pre_hook(layer, args, kwargs):
    return args, {**kwargs, "_ring_bound": current_call(owner(layer))}


def _module_pre_hook(module, args, kwargs):
    module.__dict__[_CONTEXT] = current_call(owner(module))
    return None


def _module_hook(module, args, kwargs, output):
    module.__dict__[_CONTEXT] = None
    return None


def bind_context(model, targets) -> None:
    """Give each module of ``targets`` (modules of ``model`` whose callers drop the
    ``ring_context`` keyword) the context of the model forward that runs it, also when
    gradient checkpointing recomputes it after other forwards. Call after ``record``."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    parents = {}
    for name, module in model.named_modules():
        for child in module.children():
            parents[id(child)] = module
    layers: dict[int, tuple] = {}
    for target in targets:
        unit = parents.get(id(target))
        while unit is not None and not isinstance(unit, GradientCheckpointingLayer):
            unit = parents.get(id(unit))
        if unit is None:  # no layer transformers checkpoints: the module itself, per call
            if not target.__dict__.get("_ringattn_hooked"):
                target.register_forward_pre_hook(_module_pre_hook, with_kwargs=True)
                target.register_forward_hook(_module_hook, with_kwargs=True, always_call=True)
                target.__dict__["_ringattn_hooked"] = True
            continue
        layers.setdefault(id(unit), (unit, []))[1].append(target)
    for unit, found in layers.values():
        if isinstance(unit, _Bound):
            known = unit.__dict__[_TARGETS]
            unit.__dict__[_TARGETS] = known + tuple(t for t in found if t not in known)
            continue
        unit.__class__ = swap_class(_Bound, type(unit))
        unit.__dict__[_TARGETS] = tuple(found)
        unit.register_forward_pre_hook(_layer_pre_hook, with_kwargs=True)


def require_context(module):
    """The ring context of the forward ``module`` runs in, for converted attention modules
    that cannot run without one.

    Raises:
        ValueError: none (the model was not called with shard_batch's dict), or ``MISSING``.
    """
    ctx = bound_context(module)
    if ctx is MISSING:
        raise missing_error(module)
    if ctx is None:
        raise ValueError(
            f"{type(module).__name__} (converted by ringattn's convert) needs the batch's "
            f"ring_context: call the model with the dict from prepare_batch / shard_batch")
    return ctx


def layer_context(module, kwargs: dict, pop: bool = False):
    """The ring context a converted layer's forward got in ``kwargs`` (removed with
    ``pop``), or None: one process, where the layer is transformers' own.

    Raises:
        ValueError: ``missing_error``'s, under context_parallel without one.
    """
    ctx = kwargs.pop("ring_context", None) if pop else kwargs.get("ring_context")
    if ctx is None and getattr(owner(module), "_ringattn_context_parallel", False):
        raise missing_error(module)
    return ctx


def missing_error(module) -> ValueError:
    """The refusal of a module that runs under context_parallel without its context."""
    return ValueError(
        f"{type(module).__name__} runs under context_parallel but its forward got no ring "
        f"context (a forward hook registered before the manager's, or the layer was called "
        f"outside its model's forward): it would mix this rank's shard alone. Call the "
        f"model itself inside the manager")



def restore_padding(model, args, kwargs):
    """Forward pre-hook of a converted model whose layers read the padding positions (RWKV,
    xLSTM, MiniMax-M3's indexer): the padding's own token ids go back into ``input_ids``
    (the ring context keeps them), as one process embeds them."""
    ctx = kwargs.get("ring_context")
    call = current_call(model)
    if (ctx is None or getattr(ctx, "padded_ids", None) is None
            or kwargs.get("input_ids") is None or call is None):
        return None
    call.padding_restored = True
    return args, {**kwargs, "input_ids": ctx.padded_ids}


def hook_restore_padding(model) -> None:
    """Put ``restore_padding`` on ``model`` once."""
    if not model.__dict__.get("_ringattn_padding_hook"):
        model.register_forward_pre_hook(restore_padding, with_kwargs=True)
        model.__dict__["_ringattn_padding_hook"] = True

if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
