"""``tiled_lm_loss``: the causal-LM loss from hidden states, in sequence tiles.

Legend: N tokens of this rank (B x L flattened), H hidden size, V vocabulary, T tile.

At long context the logits dominate a training step: [N, V] in fp32 is 19.5 GB at
N = 32k and V = 152k, and their gradient as much again. ``tiled_lm_loss`` never holds the
logits of more than one tile (a few [T, V] buffers: the logits, their softmax, its
gradient): the forward computes each tile's logits, its loss terms and, when a gradient
will be asked for, their gradients of the tile's hidden rows and of the head, and keeps
none of the logits; the backward scales those gradients by the loss's (the loss is linear
in it, in place), so nothing is recomputed: three products with the head's weight per
token, as untiled. It holds [N, H] and the head's [V, H] gradient (float32) from the
forward to the backward; one backward per forward (``retain_graph`` raises). What is computed is exactly transformers' causal-LM loss of the untiled logits
(the logits of ``lm_head`` in its dtype, then in float32 (float64 inputs stay float64),
cross-entropy summed and divided by ``num_items_in_batch`` or by the count of targets),
with PyTorch's label smoothing and an optional z-loss; fp32 results equal the untiled
computation within rounding.

Under context parallelism it takes this rank's shard of the hidden states and the targets
``ringattn.shard_batch`` gives each local token (``shift_labels``: shifted on the global
sequence, so the target of a shard's last token is the next shard's first token, and
document ends, padding and slots past S are ``ignore_index``) with ``num_items_in_batch``,
the global count: the ranks' losses then sum to the one-process loss, as the model's own
loss does. In one process, pass the model's unshifted ``labels=`` (shifted as transformers
shifts them), or ``shift_labels=labels[:, 1:]`` beside ``hidden[:, :-1]``.
"""

from __future__ import annotations

import re

import torch

from .layouts import SHARD_TAG
from .structure import plain_layer_problem

__all__ = ["tiled_lm_loss"]

DEFAULT_TILE = "16MiB"
"""The default tile: a budget of one tile's logits in bytes (float32, or float64 for float64
inputs), so the rows follow from the vocabulary: 27 rows at V = 151936, 131 at 32000,
everything at once for a tiny vocabulary. A tile's transient buffers (its logits, their
softmax and its gradient) are a few times the budget; a larger tile gains little speed."""

_UNITS = {"B": 1, "KiB": 1 << 10, "MiB": 1 << 20, "GiB": 1 << 30}
_BUDGET = re.compile(r"^\s*(\d+)\s*(B|KiB|MiB|GiB)\s*$")


def check_tile(tile, name: str = "tile") -> int:
    """``tile`` if it is an int >= 1; else a TypeError or ValueError naming ``name``."""
    if not isinstance(tile, int) or isinstance(tile, bool):
        raise TypeError(f"{name} must be an int >= 1, got {tile!r}")
    if tile < 1:
        raise ValueError(f"{name} must be an int >= 1, got {tile!r}")
    return tile


def check_loss_tile(tile, name: str = "loss_tile"):
    """A loss tile: rows (an int >= 1) or a budget of one tile's logits in bytes (a string
    such as ``"16MiB"``: an integer and one of B, KiB, MiB, GiB), returned as given (a
    budget normalised to ``"<n>B"``); else a TypeError or ValueError naming ``name``."""
    if isinstance(tile, str):
        found = _BUDGET.match(tile)
        if found is None or int(found.group(1)) * _UNITS[found.group(2)] < 1:
            raise ValueError(f"{name} must be rows (an int >= 1) or a byte budget such as "
                             f"'16MiB' (an integer >= 1 and one of {list(_UNITS)}), got {tile!r}")
        return f"{int(found.group(1)) * _UNITS[found.group(2)]}B"
    if not isinstance(tile, int) or isinstance(tile, bool):
        raise TypeError(f"{name} must be rows (an int >= 1) or a byte budget such as '16MiB', "
                        f"got {tile!r}")
    return check_tile(tile, name)


def tile_rows(tile, vocab: int, dtype: torch.dtype, name: str = "loss_tile") -> int:
    """The rows of a loss tile (``check_loss_tile``'s value) for a head of ``vocab`` outputs
    whose logits the loss computes in ``dtype`` (float32, or float64 for float64 inputs):
    a byte budget gives ``budget // (vocab * itemsize)`` rows, at least 1."""
    tile = check_loss_tile(tile, name)
    if isinstance(tile, int):
        return tile
    size = torch.empty((), dtype=torch.promote_types(dtype, torch.float32)).element_size()
    return max(1, int(tile[:-1]) // max(1, vocab * size))


def _logits(h, weight, bias, logits_fn):
    """A tile's logits: the head, the family's transform in the head's dtype (softcap,
    scale), then upcast to float32 as transformers upcasts them (float64 stays)."""
    logits = torch.nn.functional.linear(h, weight, bias)
    if logits_fn is not None:
        logits = logits_fn(logits)
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _tile_loss(h, weight, bias, target, valid, smoothing, z_coef, logits_fn):
    """The sum of one tile's loss terms over its valid rows (float32 or float64): PyTorch's
    fused cross-entropy (label smoothing included; ``target`` -1 where there is none), plus
    the z-loss."""
    logits = _logits(h, weight, bias, logits_fn)  # [T, V]
    total = torch.nn.functional.cross_entropy(logits, target, ignore_index=-1, reduction="sum",
                                              label_smoothing=smoothing)
    if z_coef:
        lse = torch.logsumexp(logits, dim=-1)
        total = total + z_coef * torch.where(valid, lse.square(), torch.zeros_like(lse)).sum()
    return total


class _TiledLoss(torch.autograd.Function):
    """Forward: tile by tile, each tile's logits, its loss terms and (when a gradient will
    be asked for) their gradients of the tile's hidden rows and of the head, at once: one
    tile's graph alive at a time, no logits kept, nothing recomputed. Backward: those
    gradients times the loss's gradient (the loss is linear in it)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, denom, tile, smoothing, z_coef, logits_fn,
                want):
        valid = target >= 0
        work = torch.promote_types(hidden.dtype, torch.float32)
        total = hidden.new_zeros((), dtype=work)
        need_h, need_w = want and hidden.requires_grad, want and weight.requires_grad
        need_b = want and bias is not None and bias.requires_grad
        d_hidden = torch.zeros_like(hidden) if need_h else None
        acc_w = torch.promote_types(weight.dtype, work)
        acc_b = None if bias is None else torch.promote_types(bias.dtype, work)
        d_weight = d_bias = None  # the head's, summed over the tiles
        if need_w and hidden.shape[0] == 0:
            d_weight = torch.zeros(weight.shape, dtype=acc_w, device=weight.device)
        if need_b and hidden.shape[0] == 0:
            d_bias = torch.zeros(bias.shape, dtype=acc_b, device=bias.device)
        w = weight.detach().requires_grad_(need_w)
        b = None if bias is None else bias.detach().requires_grad_(need_b)
        for start in range(0, hidden.shape[0], tile):
            sl = slice(start, start + tile)
            h = hidden[sl].detach().requires_grad_(need_h)
            with torch.enable_grad():
                part = _tile_loss(h, w, b, target[sl], valid[sl], smoothing, z_coef, logits_fn)
                wanted = [x for x, need in ((h, need_h), (w, need_w), (b, need_b)) if need]
                grads = list(torch.autograd.grad(part / denom, wanted)) if wanted else []
            total = total + part.detach()
            if need_h:
                d_hidden[sl] = grads.pop(0)
            if need_w:  # the first tile's gradient is the sum so far (no zeros to add to)
                g = grads.pop(0)
                d_weight = g.to(acc_w) if d_weight is None else d_weight.add_(g)
            if need_b:
                g = grads.pop(0)
                d_bias = g.to(acc_b) if d_bias is None else d_bias.add_(g)
        # held on ctx, not saved: the backward scales them in place and hands them out
        ctx.grads = (d_hidden, d_weight, d_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        return total / denom

    @staticmethod
    def backward(ctx, grad):
        return (*hand_out(ctx, grad, "tiled_lm_loss"), None, None, None, None, None, None,
                None)


def hand_out(ctx, grad, name: str) -> list:
    """The backward of a loss whose gradients the forward computed (``ctx.grads``: hidden,
    weight, bias, each None or a tensor; ``ctx.dtypes``: theirs): each times ``grad``, in
    place (the loss is linear in it), once."""
    if ctx.grads is None:
        raise RuntimeError(f"{name}: its backward already ran (its gradients, computed in "
                           f"the forward, were handed out): a second backward through the "
                           f"same loss (retain_graph) is not supported")
    grads, ctx.grads = ctx.grads, None
    out = []
    for d, dtype in zip(grads, ctx.dtypes):
        if d is not None:
            d = d.mul_(grad.to(d.dtype)).to(dtype)  # in place: no second copy
        out.append(d)
    return out


def _shifted(labels, ignore_index: int) -> torch.Tensor:
    """transformers' shift of unshifted labels: token i's target is ``labels[..., i + 1]``,
    the last token's ``ignore_index``. A shard is refused (its last target is elsewhere)."""
    if not isinstance(labels, torch.Tensor):
        raise TypeError(f"labels must be a tensor, got {type(labels).__name__}")
    tag = getattr(labels, SHARD_TAG, None)
    if tag is not None:
        raise TypeError(f"labels= is a shard ({tag.layout} layout, S={tag.seqlen}): shifting "
                        f"it here would lose the target of its last token, which is the next "
                        f"shard's first label; pass shard_batch's shift_labels= instead")
    pad = torch.full_like(labels[..., :1], ignore_index)
    return torch.cat([labels[..., 1:], pad], dim=-1)


def head_and_targets(name: str, lm_head, shift_labels, labels, ignore_index: int,
                     instead: str):
    """(weight, bias, shifted targets) of a tiled call's ``lm_head`` (a plain Linear or a
    [V, H] weight) and its targets (``shift_labels`` or ``labels``, exactly one).

    Raises:
        TypeError: neither or both targets; a head that is not a plain linear (``instead``
            says what to do) or a 2-D weight; labels that are a shard.
    """
    if (shift_labels is None) == (labels is None):
        raise TypeError(f"{name} takes the targets as shift_labels= (already shifted) or as "
                        "labels= (unshifted, shifted as transformers shifts them), by "
                        f"keyword: got {'both' if labels is not None else 'neither'}")
    if labels is not None:
        shift_labels = _shifted(labels, ignore_index)
    if isinstance(lm_head, torch.nn.Module):
        problem = plain_layer_problem(lm_head)
        if problem is not None:
            raise TypeError(f"{name} computes a plain linear head from its weight, without "
                            f"its forward, and {problem}: {instead}")
        return lm_head.weight, lm_head.bias, shift_labels
    if isinstance(lm_head, torch.Tensor) and lm_head.dim() == 2:
        return lm_head, None, shift_labels
    raise TypeError(f"lm_head must be a torch.nn.Linear or its [V, H] weight, got "
                    f"{type(lm_head).__name__}")


def flat_targets(hidden, weight, labels, ignore_index: int) -> torch.Tensor:
    """[N] long targets of ``labels`` (-1: none) on ``hidden``'s device, checked against
    ``hidden`` [..., H] and the head's ``weight`` [V, H].

    Raises:
        TypeError: a weight that is not [V, H], tensors that are not, labels that are not
            integer ids.
        ValueError: shapes that do not match; a label outside [0, V) that is not
            ``ignore_index``.
    """
    if not isinstance(weight, torch.Tensor) or weight.dim() != 2:
        raise TypeError(f"the head's weight must be a [V, H] tensor, got {type(weight).__name__}")
    if not isinstance(hidden, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError("hidden and labels must be tensors")
    if hidden.shape[:-1] != labels.shape or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be labels' shape "
                         f"{tuple(labels.shape)} plus the head's input size {weight.shape[1]}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"labels must be integer token ids, got {labels.dtype}")
    vocab = weight.shape[0]
    flat = labels.reshape(-1)
    bad = (flat != ignore_index) & ((flat < 0) | (flat >= vocab))
    if bool(bad.any()):
        raise ValueError(f"labels hold {flat[bad][0].item()}, outside [0, {vocab}) and not "
                         f"ignore_index={ignore_index}")
    return torch.where(flat == ignore_index, torch.full_like(flat, -1), flat).to(
        device=hidden.device, dtype=torch.long)


def tiled_lm_loss(hidden: torch.Tensor, lm_head, *, shift_labels: torch.Tensor | None = None,
                  labels: torch.Tensor | None = None, ignore_index: int = -100, num_items_in_batch=None, tile=DEFAULT_TILE,
                  label_smoothing: float = 0.0, z_loss: float = 0.0,
                  logits_fn=None) -> torch.Tensor:
    """The causal-LM loss of ``lm_head(hidden)`` against each token's target, one tile of
    logits at a time (forward and backward). Give the targets as ``shift_labels`` (already
    shifted: what transformers' loss names so) or as ``labels`` (unshifted, shifted here as
    transformers shifts them), never both, by keyword.

    Arguments:
        hidden: [B, L, H] (or [N, H]) the decoder's last hidden states (after its final norm).
        lm_head: a ``torch.nn.Linear`` (weight [V, H], bias or none; exactly that class,
            or FSDP2's ``fully_shard`` of one: see ``structure.plain_layer_problem``) or its weight
            tensor.
        shift_labels: [B, L] (or [N]) the TARGET of each token, already shifted: the
            ``shift_labels`` of ``ringattn.shard_batch`` under context parallelism; in one
            process ``labels[:, 1:]`` beside ``hidden[:, :-1]``. ``ignore_index``: no target.
        labels: [B, L] (or [N]: one sequence) the labels of the tokens, unshifted, as a
            transformers model takes them: token i's target is ``labels[..., i + 1]``, the
            last token has none. One process only: a shard's labels (a tagged shard from
            ``ringattn.shard`` or ``shard_batch``) are refused, since the target of its last
            token lies on another rank; pass ``shard_batch``'s ``shift_labels`` instead.
        num_items_in_batch: the count to divide by (an int or a 0-d tensor: the GLOBAL
            count under context parallelism, as ``shard_batch`` gives it); None: the count
            of this call's targets (a mean).
        tile: how many rows of logits are computed at once: an int >= 1, or a budget of
            one tile's logits in bytes (a string such as ``"16MiB"``, the default: the rows
            follow from V and the logits' dtype, ``tile_rows``).
        label_smoothing: PyTorch's ``cross_entropy(label_smoothing=)``, in [0, 1).
        z_loss: the coefficient of ``logsumexp(logits)^2`` per target (PaLM's z-loss).
        logits_fn: None, or what the model does to the head's output before its loss,
            applied to each tile's logits in the head's dtype (before the float32 upcast),
            e.g. ``lambda x: torch.tanh(x / 30.0) * 30.0`` for a soft cap. It must act on
            each row alone and keep the vocabulary width (it is differentiated per tile).

    Returns:
        A 0-d tensor (float32; float64 for float64 inputs): the sum of the targets' losses
        divided by the count.

    Raises:
        TypeError: ``lm_head`` is not a plain Linear (a subclass, an adapter, a hook:
            ``structure.plain_layer_problem`` names it) or a 2-D weight, or an argument's
            type; neither or both of ``shift_labels`` and ``labels``; ``labels`` that are a
            shard.
        ValueError: shapes that do not match, a tile < 1 or an unreadable budget, a label outside [0, V) that is
            not ``ignore_index``, a smoothing outside [0, 1), a negative z-loss, a count <= 0.
    """
    weight, bias, shift_labels = head_and_targets(
        "tiled_lm_loss", lm_head, shift_labels, labels, ignore_index,
        "compute this head's loss untiled")
    return head_loss(hidden, weight, bias, shift_labels, ignore_index=ignore_index,
                     num_items_in_batch=num_items_in_batch, tile=tile,
                     label_smoothing=label_smoothing, z_loss=z_loss, logits_fn=logits_fn)


def head_loss(hidden, weight, bias, labels, *, ignore_index=-100, num_items_in_batch=None,
              tile=DEFAULT_TILE, label_smoothing=0.0, z_loss=0.0, logits_fn=None):
    """``tiled_lm_loss`` of the head ``(weight, bias)`` (bias None or [V]), for callers
    holding a head's tensors rather than its module (an FSDP head's gathered weight)."""
    target = flat_targets(hidden, weight, labels, ignore_index)
    tile = tile_rows(tile, weight.shape[0], hidden.dtype, "tile")
    if not 0.0 <= float(label_smoothing) < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
    if float(z_loss) < 0.0 or float(z_loss) != float(z_loss):
        raise ValueError(f"z_loss must be >= 0, got {z_loss!r}")
    if num_items_in_batch is None:
        denom = (target >= 0).sum().to(torch.float32)
    else:
        denom = torch.as_tensor(num_items_in_batch, device=hidden.device).reshape(()).to(
            torch.float32)
        if bool(denom <= 0):
            raise ValueError(f"num_items_in_batch must be > 0, got {num_items_in_batch!r}")
    hidden2 = hidden.reshape(-1, hidden.shape[-1])
    if logits_fn is not None and not callable(logits_fn):
        raise TypeError(f"logits_fn must be callable or None, got {type(logits_fn).__name__}")
    want = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    return _TiledLoss.apply(hidden2, weight, bias, target, denom, tile,
                            float(label_smoothing), float(z_loss), logits_fn, want)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
