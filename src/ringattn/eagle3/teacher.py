"""The Eagle3 teacher and the TTT loss in tiles: no [L, V] or [L, Vd] tensor for a shard.

Legend: B batch, L local seq, N = B x L rows, H target hidden size, Hd draft hidden size,
V target vocabulary, Vd draft vocabulary, T TTT steps, R rows of a tile.

The target's teacher at a position is ``softmax(logits[draft_ids])`` of its logits there,
and whether its top token (the argmax over all V) lies in the draft vocabulary. Both come
from the target's final hidden state (after its final norm) through its head, so a
``TeacherHead`` (the head's weight and bias, and what the family does to the head's input
and output: the head table of ``ringattn.integrations.transformers.head``) computes them
one tile of rows at a time: ``marks`` gives every position's two [B, L] results from
[R, V] logits, and ``tiled_ttt_loss`` the soft cross-entropy of every TTT step's draft
logits against the teacher rows of the positions it reads, the teacher's [R, Vd]
probabilities recomputed per tile from the final hidden states (which the step shift moves
across shard boundaries instead of probabilities). Each tile's gradients (of the draft's
normed hidden states and of its head) are computed in the forward, as ``tiled_lm_loss``
does, so nothing of a tile is kept: the backward scales them.

The Eagle3 library imports no integration: the transformers integration hands the reader
of a target's head to ``register_head_reader`` when imported, and the builder of a head
table row's transforms (for a head stored on disk, ``rebuild_transforms``) to
``register_head_transforms``.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, replace
from typing import Callable

import torch
import torch.nn.functional as F

from ..comm import agree, resolve_group
from ..loss import tile_rows
from ..structure import plain_weights

__all__ = ["TeacherHead", "check_kept_logits", "keep_final_hidden", "marks",
           "rebuild_transforms", "register_head_reader", "register_head_transforms",
           "teacher_head", "tiled_ttt_loss"]

_READERS: list = []
"""Functions ``read(model) -> (TeacherHead, decoder module)`` (raising ValueError for a
target whose head they cannot read), registered by integrations."""
_BUILDERS: list = []
"""Functions ``build(family, field, value) -> (on_logits, on_input)`` (raising ValueError
for a row the head table does not hold), registered by integrations."""


@dataclass(frozen=True)
class TeacherHead:
    """A target's output head as the teacher reads it."""

    weight: torch.Tensor
    """[V, H] (or [Vd, H] once ``restricted``), detached."""
    bias: torch.Tensor | None
    on_logits: Callable | None
    """What the family does to the head's output before its loss (soft cap, scale), in the
    head's dtype; None: nothing."""
    on_input: Callable | None
    """What it does to the head's input (MiniCPM3 divides it); None: nothing."""
    family: str
    """The target's model_type, for messages."""
    row: tuple = ()
    """The head table's row this head applies, as data that rebuilds ``on_logits`` and
    ``on_input`` without the model (``rebuild_transforms``): (the config field, its value); ():
    the family applies nothing."""

    autocast: torch.dtype | None = None
    """The autocast dtype the target's head ran under (``run_target`` called inside an
    autocast region), or None: the teacher's products run as the head ran, whatever
    autocast the draft's step runs under."""

    def logits(self, h_RH: torch.Tensor) -> torch.Tensor:
        """[R, V] the target's logits of these rows, in the head's dtype (as the model
        returns them: under the autocast it ran under, ``autocast``, and no other)."""
        with torch.autocast(h_RH.device.type, dtype=self.autocast,
                            enabled=self.autocast is not None):
            x = h_RH if self.on_input is None else self.on_input(h_RH)
            z = F.linear(x.to(self.weight.dtype), self.weight, self.bias)
            return z if self.on_logits is None else self.on_logits(z)

    def restricted(self, rows: torch.Tensor) -> "TeacherHead":
        """The head of the logits ``rows`` only (the draft vocabulary): one [Vd, H] copy."""
        rows = rows.to(self.weight.device)
        return replace(self, weight=self.weight.index_select(0, rows),
                       bias=None if self.bias is None else self.bias.index_select(0, rows))


def register_head_reader(read) -> None:
    """Read a target's head with ``read(model) -> (TeacherHead, decoder)`` (the module
    whose output's first element is the final hidden states): how an integration gives the
    Eagle3 library the head table of its family. The transformers integration registers
    one when imported."""
    if read not in _READERS:
        _READERS.append(read)


def register_head_transforms(build) -> None:
    """Rebuild a head table row's transforms with ``build(family, field, value) ->
    (on_logits, on_input)``: how an integration lets ``rebuild_transforms`` rebuild a head
    stored without its model. The transformers integration registers one when imported."""
    if build not in _BUILDERS:
        _BUILDERS.append(build)


def rebuild_transforms(family: str, row=()) -> tuple:
    """(on_logits, on_input) of a head stored without its model (offline outputs), from
    its ``TeacherHead.row``: (the config field, its value), or () (the family applies
    nothing to the head's input or output: (None, None)).

    Raises:
        ValueError: a row and no builder registered (import
            ``ringattn.integrations.transformers``), or a row the head table does not hold
            for ``family`` (named by the builder).
    """
    row = tuple(row)
    if not row:
        return None, None
    if not _BUILDERS:
        raise ValueError(f"the stored {family} head applies {row[0]}={row[1]!r}, which the "
                         f"head table of the transformers integration rebuilds: import "
                         f"ringattn.integrations.transformers first")
    return tuple(_BUILDERS[-1](family, row[0], row[1]))


def teacher_head(model):
    """(the ``TeacherHead`` of ``model``, its decoder module).

    Raises:
        ValueError: no reader registered (import ``ringattn.integrations.transformers``),
            or the target's head is not a plain linear map of its final hidden state and a
            row of the head table (named).
    """
    if not _READERS:
        raise ValueError("the Eagle3 teacher in tiles reads the target's head through the "
                         "transformers integration: import ringattn.integrations.transformers "
                         "first, or pass teacher='logits'")
    return _READERS[-1](model)


def marks(head: TeacherHead, draft_head: TeacherHead, t2d: torch.Tensor,
          hidden_BLH: torch.Tensor, tile, targets_only: bool = False):
    """Per position, from [R, V] logits a tile at a time: (the target's top token, argmax
    over all V as ``torch.argmax`` breaks ties; whether it is in the draft vocabulary,
    ``t2d`` of it; the teacher's top DRAFT token, the argmax of its probabilities over the
    draft vocabulary), each [B, L]; with ``targets_only``, (the top token, None, None)."""
    b, n = hidden_BLH.shape[:2]
    flat = hidden_BLH.reshape(b * n, -1)
    rows = tile_rows(tile, head.weight.shape[0], torch.float32, "tile")
    top = torch.empty(b * n, dtype=torch.long, device=flat.device)
    top_d = None if targets_only else torch.empty(b * n, dtype=torch.long, device=flat.device)
    with torch.no_grad():
        for start in range(0, b * n, rows):
            sl = slice(start, start + rows)
            top[sl] = head.logits(flat[sl]).argmax(-1)
            if not targets_only:
                top_d[sl] = torch.softmax(draft_head.logits(flat[sl]).float(), -1).argmax(-1)
    top = top.view(b, n)
    if targets_only:
        return top, None, None
    return top, t2d.to(top.device)[top], top_d.view(b, n)


@contextlib.contextmanager
def keep_final_hidden(decoder, length: int):
    """While a target runs: (the keyword arguments that make it compute its head on ONE
    position, ``logits_to_keep`` [0] (none on a rank without tokens), and a list that
    receives its decoder's output, the final hidden states [B, L, H]). With ``decoder``
    None, ({}, []): the model runs as it is."""
    if decoder is None:
        yield {}, []
        return
    seen: list = []

    def hook(module, args, output):
        if not seen:
            seen.append(output[0] if isinstance(output, tuple)
                        else getattr(output, "last_hidden_state", output))

    handle = decoder.register_forward_hook(hook)
    try:
        yield {"logits_to_keep": torch.arange(min(length, 1))}, seen
    finally:
        handle.remove()


_CHECKED = "_ringattn_teacher_checked"


def check_kept_logits(target, head: TeacherHead, hidden, logits, group) -> None:
    """The target's logits at the kept position must equal, bit for bit, ``head``'s output
    on its final hidden state there (the head table's transform included): else the teacher
    in tiles would be another one. Under CP the first call agrees on the outcome with every
    rank of ``group``.

    Raises:
        ValueError: naming the family and the largest difference (on every rank)."""
    error = None
    if hidden is None or logits is None or hidden.shape[:1] != logits.shape[:1]:
        error = ValueError(f"{type(target).__name__}: its decoder's output was not captured "
                           f"beside its logits; pass teacher='logits'")
    elif logits.shape[1]:
        with torch.no_grad():
            mine = head.logits(hidden[:, torch.arange(logits.shape[1], device=hidden.device)])
        if mine.shape != logits.shape or not torch.equal(mine.to(logits.dtype), logits):
            diff = (float((mine.double() - logits.double()).abs().max())
                    if mine.shape == logits.shape else None)
            error = ValueError(
                f"{type(target).__name__} ({head.family}) computes its logits otherwise than "
                f"its head's weight and the head table say (largest difference {diff}): its "
                f"teacher cannot be computed in tiles; pass teacher='logits'")
    if group is not None and not target.__dict__.get(_CHECKED):
        agree(resolve_group(group), {"the target's head check": 0}, error,
              what="the Eagle3 teacher's head check")
        target.__dict__[_CHECKED] = True
    elif error is not None:
        raise error


class _TiledTTT(torch.autograd.Function):
    """Every TTT step's soft cross-entropy, weighed and summed, tile by tile: forward
    computes each tile's loss, hits and gradients (by hand, in place: a tile holds its
    draft logits, then their gradient in the same buffer, and the teacher's
    probabilities); backward scales the gradients.

    Under autocast the head's product runs as autocast runs it (inputs cast to its dtype,
    the logits upcast to float32) and so do the gradients (cast to its dtype for the
    products, then to the parameter's and the input's dtypes), as autograd would."""

    @staticmethod
    def forward(ctx, weight, bias, spec, *normed):
        (teacher, rows, ahead, ext_hidden, actives, scale, decays, want, top_of) = spec
        steps = len(normed)
        dev = weight.device.type
        cast = torch.get_autocast_dtype(dev) if torch.is_autocast_enabled(dev) else None
        need_w = want and weight.requires_grad
        need_b = want and bias is not None and bias.requires_grad
        with torch.no_grad(), torch.autocast(dev, enabled=False):
            wc = weight.detach() if cast is None else weight.detach().to(cast)
            bc = None if bias is None else (bias.detach() if cast is None
                                            else bias.detach().to(cast))
            d_weight = (torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
                        if need_w else None)
            d_bias = (torch.zeros(bias.shape, dtype=torch.float32, device=bias.device)
                      if need_b else None)
            d_normed = []
            losses = torch.zeros(steps, dtype=torch.float64, device=weight.device)
            hits = torch.zeros(steps, dtype=torch.float64, device=weight.device)
            for j, x in enumerate(normed):
                need_x = want and x.requires_grad
                b_, n = x.shape[:2]
                flat = x.detach().reshape(b_ * n, -1)
                active = actives[j].reshape(-1)
                t_rows = ahead.take(ext_hidden, 1 + j).reshape(b_ * n, -1)  # teacher rows
                dx = torch.empty_like(flat) if need_x else None
                for start in range(0, b_ * n, rows):
                    sl = slice(start, start + rows)
                    zt = teacher.logits(t_rows[sl])
                    p = torch.softmax(zt.float(), dim=-1)  # [R, Vd]
                    top = (p if top_of == "probs" else zt).argmax(-1)
                    del zt
                    h = flat[sl] if cast is None else flat[sl].to(cast)
                    z = F.linear(h, wc, bc).float()  # [R, Vd]
                    lse = torch.logsumexp(z, dim=-1)
                    mass = p.sum(-1)
                    ce = lse * mass - torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).view(-1)
                    act = active[sl]
                    losses[j] += ((ce * act).sum() * scale).double()
                    hits[j] += ((z.argmax(-1) == top) & act.bool()).sum().double()
                    if not (need_x or need_w or need_b):
                        continue
                    coef = act.to(torch.float32) * (scale * decays[j])
                    # d loss / d z = (softmax(z) * sum(p) - p) * coef, in z's buffer
                    dz = z.sub_(lse.unsqueeze(-1)).exp_().mul_(mass.unsqueeze(-1)).sub_(p)
                    dz = dz.mul_(coef.unsqueeze(-1))
                    dzc = dz if cast is None else dz.to(cast)
                    if need_x:
                        dx[sl] = (dzc @ wc).to(dx.dtype)
                    if need_w:
                        d_weight.add_(dzc.t() @ h)
                    if need_b:
                        d_bias.add_(dzc.sum(0))
                d_normed.append(None if dx is None else dx.view_as(x))
        ctx.grads = (d_weight, d_bias, d_normed)
        ctx.dtypes = (weight.dtype, None if bias is None else bias.dtype)
        total = (losses * torch.tensor(decays, dtype=torch.float64, device=losses.device)).sum()
        ctx.mark_non_differentiable(losses, hits)
        return total.to(torch.float32), losses, hits

    @staticmethod
    def backward(ctx, grad, _losses, _hits):
        if ctx.grads is None:
            raise RuntimeError("the tiled Eagle3 loss's backward already ran (its gradients, "
                               "computed in the forward, were handed out): a second backward "
                               "(retain_graph) is not supported")
        (d_weight, d_bias, d_normed), ctx.grads = ctx.grads, None
        g = grad.to(torch.float32)
        out_w = None if d_weight is None else d_weight.mul_(g).to(ctx.dtypes[0])
        out_b = None if d_bias is None else d_bias.mul_(g).to(ctx.dtypes[1])
        return (out_w, out_b, None, *[None if d is None else d.mul_(g.to(d.dtype))
                                      for d in d_normed])


def tiled_ttt_loss(draft_head, normed: list, teacher: TeacherHead, ahead, ext_hidden,
                   actives: list, scale: float, decays: list, tile, *, top_of: str = "probs"):
    """The sum over TTT steps j of ``decays[j]`` x loss j, loss j being ``scale`` x the soft
    cross-entropy, summed over the ``actives[j]`` rows, of the draft's logits
    ``draft_head(normed[j])`` against
    the teacher at position i + 1 + j (its final hidden rows read through ``ahead`` from
    ``ext_hidden``, through ``teacher``, the target's head restricted to the draft
    vocabulary), one tile of rows at a time. ``actives[j]``: bool, or float weights (a row
    counts in the accuracy where its weight is not 0). ``top_of``: the teacher's top draft
    token is the argmax of its "probs" (``eagle3_step``'s rule) or of its "logits"
    (ModelOpt's; they differ where two logits round to one probability).

    Returns:
        (the total, a 0-d float32 tensor to backward; [T] float64 losses j (this rank's
        shares, not weighed by ``decays``); [T] float64 per-step counts of active rows whose draft
        argmax is the teacher's top draft token), this rank's shares.

    Raises:
        ValueError: the draft's head is not a plain ``torch.nn.Linear`` (its weight is read
            without its forward).
    """
    weight, bias = plain_weights(draft_head, torch.nn.Linear, "the draft's head")
    rows = tile_rows(tile, weight.shape[0], torch.float32, "tile")
    want = torch.is_grad_enabled() and (weight.requires_grad or any(x.requires_grad
                                                                    for x in normed))
    if top_of not in ("probs", "logits"):
        raise ValueError(f"top_of must be 'probs' or 'logits', got {top_of!r}")
    spec = (teacher, rows, ahead, ext_hidden, actives, float(scale), [float(d) for d in decays],
            want, top_of)
    return _TiledTTT.apply(weight, bias, spec, *normed)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
