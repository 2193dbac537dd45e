"""The causal-LM loss of a transformers model in tiles (``ringattn.tiled_lm_loss``), with
the model's own forward.

Legend: B batch, L local seq, H hidden size, V vocabulary, T tile.

At long context the logits dominate a training step ([L, V] per rank, and their gradient).
``tiled_call`` runs the model as it is (its decoder, its router loss, ``convert``'s hooks)
but asks its head for the logits of ONE position (``logits_to_keep``, a tensor of indices,
which transformers' causal LMs take) with no target there, captures the decoder's last
hidden states with a forward hook on the decoder (removed after the call), and adds
``tiled_lm_loss`` of those hidden states against the batch's targets (``shift_labels``,
shifted on the global sequence by ``shard_batch``) to the model's loss. The model's loss
is then its router loss alone (plus ``convert``'s adjustments), so the sum is exactly the
untiled loss; ``out.logits`` is a ``LogitsNotComputed``, any use of which raises
an error saying how to get the logits.

What the family does to the head's output before its loss is a table row (``TRANSFORMS``:
soft caps, scales, a scaled input), applied with the family's own operations in the head's
dtype. Every call checks it: the model's logits at the kept position must equal, bit for
bit, the head's output there after the row's transform; the first call of a model agrees on
the outcome with every rank of the group, so a family whose head does something else is
refused on every rank, naming it. A family whose head cannot be tiled this way (``UNTILED``,
a forward that is not transformers' own (a subclass's, ModelOpt's Eagle model: its loss
may be another), a forward without ``logits_to_keep``, a head that is not exactly a
``torch.nn.Linear`` (``structure.plain_layer_problem``: a subclass, an adapter, a hook), a loss
other than transformers' causal-LM loss) runs untiled: ``tile_problem`` says why.
"""

from __future__ import annotations

import inspect

import torch

from ...comm import agree, resolve_group
from ...loss import head_loss
from ...structure import plain_layer_problem

__all__ = ["TRANSFORMS", "UNTILED", "LogitsNotComputed", "head_transforms", "teacher_head",
           "tile_problem", "tiled_call"]

_SOFTCAP = (("div", None), ("tanh", None), ("mul", None))
TRANSFORMS: dict = {
    # logits / c, tanh, * c (the config field c; None: no cap)
    **dict.fromkeys(("gemma2", "gemma3", "gemma3_text", "gemma3n", "gemma3n_text", "gemma4",
                     "gemma4_text", "nanochat", "vaultgemma"),
                    ("final_logit_softcapping", _SOFTCAP)),
    "beam": ("final_logit_softcapping", (("float", None), *_SOFTCAP)),  # upcasts first
    "recurrent_gemma": ("logits_soft_cap", _SOFTCAP),
    # logits * s
    **dict.fromkeys(("cohere", "cohere2", "cohere2_moe", "cohere_compass", "cohere_compass_text"),
                    ("logit_scale", (("mul", None),))),
    "hyperclovax": ("logits_scaling", (("mul", None),)),
    "falcon_h1": ("lm_head_multiplier", (("mul", None),)),
    # logits / s
    **dict.fromkeys(("granite", "granite_swa", "granitemoe", "granitemoe_swa",
                     "granitemoehybrid", "granitemoeshared"),
                    ("logits_scaling", (("div", None),))),
    # the head's INPUT / s
    "minicpm3": ("logits_scaling", (("div_input", None),)),
}
"""model_type -> (the config field c, the operations the family applies to the head's
logits with it, in order). Families not listed apply none (checked on every call)."""

UNTILED: dict = {
    "inkling_text": "its head drops the logits past unpadded_vocab_size",
    "inkling2_text": "its head soft-caps the logits with a module of its own",
    "inkling2_loop_text": "its head soft-caps the logits with a module of its own",
    "modernbert-decoder": "its head is a prediction head (dense, activation, norm) before the "
                          "output embeddings",
}
"""model_type -> why its loss is not tiled (computed untiled, as the model computes it)."""

class LogitsNotComputed:
    """What ``out.logits`` holds after a tiled loss: the logits were never computed (one
    tile at a time, none kept). Any use of it (indexing, ``argmax``, a torch function,
    ``len``, truth value, arithmetic) raises a ValueError that says how to get them;
    ``isinstance(out.logits, LogitsNotComputed)`` tests for it. Every rank holds one, so
    every rank raises."""

    __slots__ = ()
    MESSAGE = ("out.logits was not computed: the loss was computed in tiles from the "
               "decoder's hidden states (loss_tile, on by default), one tile of logits at a "
               "time, none kept. For the logits, pass loss_tile=None (this rank's shard, the "
               "model's own untiled loss) or gather_logits=True (the whole sequence's, "
               "O(S V) memory per rank) to context_parallel or RingTrainer")

    def _refuse(self, *args, **kwargs):
        raise ValueError(self.MESSAGE)

    def __getattr__(self, name):
        if name.startswith("__"):  # copy, pickle and the like look dunders up: absent
            raise AttributeError(name)
        raise ValueError(self.MESSAGE)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        raise ValueError(cls.MESSAGE)

    def __repr__(self):
        return "LogitsNotComputed(" + self.MESSAGE.split(":", 1)[0] + ")"

    __getitem__ = __setitem__ = __len__ = __iter__ = __bool__ = __float__ = __int__ = _refuse
    __index__ = __array__ = __contains__ = __call__ = _refuse
    __add__ = __radd__ = __sub__ = __rsub__ = __mul__ = __rmul__ = __truediv__ = _refuse
    __rtruediv__ = __matmul__ = __rmatmul__ = __neg__ = __pow__ = _refuse
    __lt__ = __le__ = __gt__ = __ge__ = _refuse


_RECORD = "_ringattn_head_checked"
"""The model's ``__dict__`` key of the transform its ranks agreed on (first call)."""


def _text_config(model):
    config = model.config
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def _transform(model):
    """(the function applied to the head's output, the one applied to its input, a key
    naming both) of this model's family, read from its config now."""
    family, field, value = _row(model)
    return _ops(family, field, value)


def _row(model):
    """(this model's family, the config field its head table row reads or None, that
    field's value now or None)."""
    config = _text_config(model)
    family = getattr(config, "model_type", None)
    field = TRANSFORMS.get(family, (None, ()))[0]
    return family, field, (getattr(config, field, None) if field else None)


def _ops(family, field, value):
    """``_transform``'s triple of ``family``'s head table row applied with ``value`` (None:
    nothing applied)."""
    if value is None:
        return None, None, ("plain",)
    ops = TRANSFORMS[family][1]
    after = [op for op, _ in ops if op != "div_input"]

    def on_logits(x):
        for op in after:
            if op == "div":
                x = x / value
            elif op == "mul":
                x = x * value
            elif op == "tanh":
                x = torch.tanh(x)
            elif op == "float":
                x = x.float()
        return x

    before = (lambda h: h / value) if any(op == "div_input" for op, _ in ops) else None
    return (on_logits if after else None), before, (field, float(value), tuple(after),
                                                    before is not None)


def head_transforms(family: str, field: str, value):
    """(on_logits, on_input) of ``family``'s head table row with its config field ``field``
    set to ``value``: a stored head's transforms rebuilt without its model (registered with
    ``eagle3.teacher.register_head_transforms`` on import).

    Raises:
        ValueError: the table's row for ``family`` reads another field, or there is none.
    """
    want = TRANSFORMS.get(family, (None, ()))[0]
    if want != field:
        raise ValueError(f"a stored {family} head applies {field}={value!r}, but the head "
                         f"table's row for {family} reads "
                         f"{'no field' if want is None else repr(want)}: it was stored by "
                         f"another version of the table; store it again")
    return _ops(family, field, value)[:2]


def _decoder(model):
    """The module whose output's first element is the hidden states the head reads."""
    decoder = model.get_decoder() if hasattr(model, "get_decoder") else None
    if decoder is None or decoder is model:
        decoder = getattr(model, "model", None)
    return decoder


def tile_problem(model, forward=None) -> str | None:
    """Why ``model``'s causal-LM loss is not computed in tiles, or None (it is).

    ``forward``: the function that runs the model (default ``type(model).forward``; a
    wrapper's subclass that calls its family's forward, as ModelOpt's Eagle model does,
    names that one)."""
    config = _text_config(model)
    family = getattr(config, "model_type", None)
    if family in UNTILED:
        return f"{family}: {UNTILED[family]}"
    forward = type(model).forward if forward is None else forward
    if not getattr(forward, "__module__", "").startswith("transformers."):
        return (f"{type(model).__name__}'s forward is not one of transformers' families' "
                f"({getattr(forward, '__module__', None)}): its loss may be another one")
    if "logits_to_keep" not in inspect.signature(forward).parameters:
        return f"{type(model).__name__}'s forward takes no logits_to_keep"
    head = model.get_output_embeddings()
    problem = "it has none" if head is None else plain_layer_problem(head)
    if problem is not None:
        return f"{type(model).__name__}'s output head is not read as a plain linear: {problem}"
    if _decoder(model) is None:
        return f"{type(model).__name__} has no decoder module ringattn can find"
    from transformers.loss.loss_utils import ForCausalLMLoss

    if getattr(model, "loss_function", None) is not ForCausalLMLoss:
        return f"{type(model).__name__}'s loss is not transformers' causal-LM loss"
    return None


class _Call:
    """One tiled call: the model's arguments to use, then ``finish`` on its output."""

    def __init__(self, model, local: dict, tile: int, ignore_index: int):
        self.model, self.tile, self.ignore_index = model, tile, ignore_index
        self.targets = local["shift_labels"]
        self.count = local.get("num_items_in_batch")
        self.ctx = local["ring_context"]
        B, L = self.targets.shape
        device = self.targets.device
        self.probe = torch.arange(min(L, 1), device=device)  # one kept position (none if L = 0)
        none = torch.full((B, self.probe.numel()), ignore_index, dtype=self.targets.dtype,
                          device=device)
        self.kwargs = {**local, "logits_to_keep": self.probe, "labels": none,
                       "shift_labels": none,
                       # the model's own loss is then its router loss alone; a count keeps
                       # its empty cross-entropy 0, not a mean over no target
                       "num_items_in_batch": 1 if self.count is None else self.count}
        self.hidden, self.autocast = [], None
        self.handles = [_decoder(model).register_forward_hook(self._keep),
                        model.get_output_embeddings().register_forward_pre_hook(self._mode)]

    def _mode(self, module, args):
        """The autocast the head ran under (accelerate's mixed precision wraps the model's
        forward in one): the check and the tiles run under it too."""
        kind = module.weight.device.type
        self.autocast = (kind, torch.is_autocast_enabled(kind), torch.get_autocast_dtype(kind))

    def _keep(self, module, args, output):
        if not self.hidden:
            first = output[0] if isinstance(output, tuple) else getattr(
                output, "last_hidden_state", output)
            self.hidden.append(first)

    def finish(self, output):
        self.abandon()
        if self.autocast is None:
            return self._finish(output)
        kind, enabled, dtype = self.autocast
        with torch.autocast(kind, dtype=dtype, enabled=enabled):
            return self._finish(output)

    def _finish(self, output):
        model = self.model
        on_logits, on_input, key = _transform(model)
        head = model.get_output_embeddings()
        weight, bias = head.weight, head.bias
        if hasattr(weight, "full_tensor"):  # FSDP2: the head's whole weight (differentiable)
            weight = weight.full_tensor()
            bias = None if bias is None else bias.full_tensor()
        error = None
        B, L = self.targets.shape
        hidden = self.hidden[0] if self.hidden else None
        if hidden is None or tuple(hidden.shape[:2]) != (B, L):
            error = ValueError(
                f"{type(model).__name__}: its decoder's output ({None if hidden is None else tuple(hidden.shape)}) "
                f"is not the [B, L, H] hidden states of the batch {(B, L)}; pass loss_tile=None")
        elif L and isinstance(output.logits, torch.Tensor):
            kept = hidden[:, self.probe]
            with torch.no_grad():
                mine = torch.nn.functional.linear(kept if on_input is None else on_input(kept),
                                                  weight, bias)
                mine = mine if on_logits is None else on_logits(mine)
            # equal values; the model's may have been upcast after it (accelerate's mixed
            # precision returns float32 outputs)
            if (mine.shape != output.logits.shape
                    or not torch.equal(mine.to(output.logits.dtype), output.logits)):
                diff = (float((mine.double() - output.logits.double()).abs().max())
                        if mine.shape == output.logits.shape else None)
                error = ValueError(
                    f"{type(model).__name__} ({_text_config(model).model_type}) transforms its "
                    f"head's logits otherwise than ringattn's table says ({key}; largest "
                    f"difference {diff}, {output.logits.dtype} logits, {mine.dtype} from the "
                    f"head): its loss cannot be computed in tiles; pass loss_tile=None")
        if model.__dict__.get(_RECORD) != key:  # the first call: every rank agrees
            agree(resolve_group(self.ctx.group), {"the output head's check": 0}, error,
                  what="the tiled loss's head check")
            model.__dict__[_RECORD] = key
        elif error is not None:
            raise error
        if on_input is not None:
            hidden = on_input(hidden)
        tiled = head_loss(hidden, weight, bias, self.targets, ignore_index=self.ignore_index,
                          num_items_in_batch=self.count, tile=self.tile, logits_fn=on_logits)
        output["loss"] = tiled if output.loss is None else output.loss + tiled
        output["logits"] = _NOT_COMPUTED
        return output

    def abandon(self):
        for handle in self.handles:
            handle.remove()


_NOT_COMPUTED = LogitsNotComputed()


def teacher_head(model, forward=None):
    """(the Eagle3 ``TeacherHead`` of ``model``: its head's weight and bias and the head
    table's transforms; its decoder module): what ``ringattn.eagle3``'s teacher in tiles
    reads (registered with ``eagle3.teacher.register_head_reader`` on import).
    ``forward``: as ``tile_problem``'s.

    Raises:
        ValueError: the model's head cannot be read so (``tile_problem``, named).
    """
    from ...eagle3.teacher import TeacherHead

    problem = tile_problem(model, forward)
    if problem is not None:
        raise ValueError(f"the Eagle3 teacher in tiles cannot read the target's head: "
                         f"{problem}; pass teacher='logits'")
    family, field, value = _row(model)
    on_logits, on_input, _ = _ops(family, field, value)
    head = model.get_output_embeddings()
    weight, bias = head.weight, head.bias
    if hasattr(weight, "full_tensor"):  # FSDP2 (a sharded target): the whole head
        weight = weight.full_tensor()
        bias = None if bias is None else bias.full_tensor()
    row = () if value is None else (field, value)
    family = str(family if family is not None else type(model).__name__)
    return (TeacherHead(weight.detach(), None if bias is None else bias.detach(), on_logits,
                        on_input, family, row), _decoder(model))


def tiled_call(model, local: dict, tile: int | None, ignore_index: int = -100):
    """A ``_Call`` for this forward of ``model`` (the unwrapped causal LM) on the shard
    ``local`` (``shard_batch``'s dict), or None when it runs untiled: no tile, no targets,
    or ``tile_problem``."""
    if not tile or local.get("shift_labels") is None or tile_problem(model) is not None:
        return None
    return _Call(model, local, tile, ignore_index)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
