"""``tiled_lm_loss``: the causal-LM loss from hidden states, in sequence tiles.

Legend: N tokens of this rank (B x L flattened), H hidden size, V vocabulary, T tile.

At long context the logits dominate a training step: [N, V] in fp32 is 19.5 GB at
N = 32k and V = 152k, and their gradient as much again. ``tiled_lm_loss`` never holds the
logits of more than one tile (a few [T, V] buffers: the logits, their softmax, its
gradient): the forward computes each tile's logits, its log-sum-exp
and its loss terms, and keeps nothing of them; the backward recomputes each tile's logits
and turns them into that tile's gradient of the hidden states and of the head at once.
What is computed is exactly transformers' causal-LM loss of the untiled logits (the
logits of ``lm_head`` in its dtype, then in float32 (float64 inputs stay float64), cross-entropy summed and divided by
``num_items_in_batch`` or by the count of targets), with PyTorch's label smoothing and an
optional z-loss; fp32 results equal the untiled computation within rounding.

Under context parallelism it takes this rank's shard of the hidden states and the targets
``ringattn.shard_batch`` gives each local token (``shift_labels``: shifted on the global
sequence, so the target of a shard's last token is the next shard's first token, and
document ends, padding and slots past S are ``ignore_index``) with ``num_items_in_batch``,
the global count: the ranks' losses then sum to the one-process loss, as the model's own
loss does. In one process, pass ``labels[:, 1:]`` beside ``hidden[:, :-1]``.
"""

from __future__ import annotations

import torch

__all__ = ["tiled_lm_loss"]

DEFAULT_TILE = 1024
"""Rows per tile: [1024, 152k] fp32 logits are 0.6 GB, and a larger tile gains little."""


def _logits(h, weight, bias):
    """A tile's logits, upcast to float32 as transformers upcasts them (float64 stays)."""
    logits = torch.nn.functional.linear(h, weight, bias)
    return logits.to(torch.promote_types(logits.dtype, torch.float32))


def _tile_terms(h, weight, bias, target, valid, smoothing, z_coef):
    """One tile's logits, their lse, and the sum of its loss terms over its valid rows."""
    logits = _logits(h, weight, bias)  # [T, V]
    lse = torch.logsumexp(logits, dim=-1)  # [T]
    picked = logits.gather(1, target.clamp(min=0)[:, None])[:, 0]
    terms = (1.0 - smoothing) * (lse - picked)
    if smoothing:
        terms = terms + smoothing * (lse - logits.mean(dim=-1))
    if z_coef:
        terms = terms + z_coef * lse.square()
    return logits, lse, (terms * valid).sum()


class _TiledLoss(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, target, denom, tile, smoothing, z_coef):
        valid = target >= 0
        total = hidden.new_zeros((), dtype=torch.promote_types(hidden.dtype, torch.float32))
        for start in range(0, hidden.shape[0], tile):
            sl = slice(start, start + tile)
            _, _, part = _tile_terms(hidden[sl], weight, bias, target[sl], valid[sl],
                                     smoothing, z_coef)
            total = total + part
        ctx.save_for_backward(hidden, weight, bias, target, denom)
        ctx.tile, ctx.smoothing, ctx.z_coef = tile, smoothing, z_coef
        ctx.has_bias = bias is not None
        return total / denom

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, bias, target, denom = ctx.saved_tensors
        if not ctx.has_bias:
            bias = None
        work = torch.promote_types(hidden.dtype, torch.float32)
        scale = grad.to(work) / denom
        valid = (target >= 0).to(work)
        need_h, need_w, need_b = ctx.needs_input_grad[:3]
        d_hidden = torch.empty_like(hidden) if need_h else None
        d_weight = torch.zeros(weight.shape, dtype=work, device=weight.device) \
            if need_w else None
        d_bias = torch.zeros(bias.shape, dtype=work, device=bias.device) \
            if need_b and bias is not None else None
        vocab = weight.shape[0]
        for start in range(0, hidden.shape[0], ctx.tile):
            sl = slice(start, start + ctx.tile)
            h, t = hidden[sl], target[sl]
            logits = _logits(h, weight, bias)
            lse = torch.logsumexp(logits, dim=-1, keepdim=True)
            probs = torch.exp(logits - lse)  # softmax, in place of the logits' memory
            del logits
            coef = 1.0 + (2.0 * ctx.z_coef * lse if ctx.z_coef else 0.0)  # d(lse + z lse^2)
            g = probs * coef
            g.scatter_add_(1, t.clamp(min=0)[:, None],
                           torch.full_like(lse, -(1.0 - ctx.smoothing)))
            if ctx.smoothing:
                g -= ctx.smoothing / vocab
            g *= (valid[sl] * scale)[:, None]
            g = g.to(weight.dtype)
            if need_h:
                d_hidden[sl] = g @ weight
            if need_w:
                d_weight += (g.t() @ h).to(work)
            if d_bias is not None:
                d_bias += g.to(work).sum(0)
        return (d_hidden, None if d_weight is None else d_weight.to(weight.dtype),
                None if d_bias is None else d_bias.to(bias.dtype), None, None, None, None, None)


def tiled_lm_loss(hidden: torch.Tensor, lm_head, labels: torch.Tensor, *,
                  ignore_index: int = -100, num_items_in_batch=None, tile: int = DEFAULT_TILE,
                  label_smoothing: float = 0.0, z_loss: float = 0.0) -> torch.Tensor:
    """The causal-LM loss of ``lm_head(hidden)`` against ``labels``, one tile of logits at a
    time (forward and backward).

    Arguments:
        hidden: [B, L, H] (or [N, H]) the decoder's last hidden states (after its final norm).
        lm_head: a ``torch.nn.Linear`` (weight [V, H], bias or none) or its weight tensor.
        labels: [B, L] (or [N]) the TARGET of each token, already shifted: the
            ``shift_labels`` of ``ringattn.shard_batch`` under context parallelism; in one
            process ``labels[:, 1:]`` beside ``hidden[:, :-1]``. ``ignore_index``: no target.
        num_items_in_batch: the count to divide by (an int or a 0-d tensor: the GLOBAL
            count under context parallelism, as ``shard_batch`` gives it); None: the count
            of this call's targets (a mean).
        tile: rows of logits computed at once (>= 1).
        label_smoothing: PyTorch's ``cross_entropy(label_smoothing=)``, in [0, 1).
        z_loss: the coefficient of ``logsumexp(logits)^2`` per target (PaLM's z-loss).

    Returns:
        A 0-d tensor (float32; float64 for float64 inputs): the sum of the targets' losses
        divided by the count.

    Raises:
        TypeError: ``lm_head`` is not a Linear or a 2-D weight, or an argument's type.
        ValueError: shapes that do not match, a tile < 1, a label outside [0, V) that is
            not ``ignore_index``, a smoothing outside [0, 1), a negative z-loss, a count <= 0.
    """
    if isinstance(lm_head, torch.nn.Linear):
        weight, bias = lm_head.weight, lm_head.bias
    elif isinstance(lm_head, torch.Tensor) and lm_head.dim() == 2:
        weight, bias = lm_head, None
    else:
        raise TypeError(f"lm_head must be a torch.nn.Linear or its [V, H] weight, got "
                        f"{type(lm_head).__name__} (a head that is not a plain linear map: "
                        f"softcapped or biased otherwise, is not served)")
    if not isinstance(hidden, torch.Tensor) or not isinstance(labels, torch.Tensor):
        raise TypeError("hidden and labels must be tensors")
    if hidden.shape[:-1] != labels.shape or hidden.shape[-1] != weight.shape[1]:
        raise ValueError(f"hidden {tuple(hidden.shape)} must be labels' shape "
                         f"{tuple(labels.shape)} plus the head's input size {weight.shape[1]}")
    if labels.dtype.is_floating_point or labels.dtype == torch.bool:
        raise TypeError(f"labels must be integer token ids, got {labels.dtype}")
    if not isinstance(tile, int) or isinstance(tile, bool) or tile < 1:
        raise ValueError(f"tile must be an int >= 1, got {tile!r}")
    if not 0.0 <= float(label_smoothing) < 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1), got {label_smoothing!r}")
    if float(z_loss) < 0.0 or float(z_loss) != float(z_loss):
        raise ValueError(f"z_loss must be >= 0, got {z_loss!r}")
    vocab = weight.shape[0]
    flat = labels.reshape(-1)
    bad = (flat != ignore_index) & ((flat < 0) | (flat >= vocab))
    if bool(bad.any()):
        raise ValueError(f"labels hold {flat[bad][0].item()}, outside [0, {vocab}) and not "
                         f"ignore_index={ignore_index}")
    target = torch.where(flat == ignore_index, torch.full_like(flat, -1), flat).to(torch.long)
    if num_items_in_batch is None:
        denom = (target >= 0).sum().to(torch.float32)
    else:
        denom = torch.as_tensor(num_items_in_batch, device=hidden.device).reshape(()).to(
            torch.float32)
        if bool(denom <= 0):
            raise ValueError(f"num_items_in_batch must be > 0, got {num_items_in_batch!r}")
    hidden2 = hidden.reshape(-1, hidden.shape[-1])
    return _TiledLoss.apply(hidden2, weight, bias, target.to(hidden.device), denom, tile,
                            float(label_smoothing), float(z_loss))


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
