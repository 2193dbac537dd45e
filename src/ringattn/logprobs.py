"""``tiled_logprobs``: each token's log-probability (and its distribution's entropy) from
hidden states, in sequence tiles: what an RL loss (GRPO, PPO, DPO's scores) needs of the
logits, without the logits.

Legend: N tokens of this rank (B x L flattened), H hidden size, V vocabulary, T tile rows.

Per-token log-probabilities need the log-softmax over all V of every position: [N, V] in
float32 is 19.5 GB at N = 32k and V = 152k, before its gradient. ``tiled_logprobs`` never
holds more than one tile of logits: the forward computes each tile's logits (the head in
its dtype, the family's transform (``logits_fn``), the float32 upcast, then ``/
temperature``, as TRL and verl compute them), takes the target's log-probability and the
entropy, and keeps nothing of the tile; the backward computes each tile's logits again and
their gradient for the incoming weights of the log-probabilities and entropies (any
weighted sum of them: a policy loss, a KL penalty, an entropy bonus), by hand in two
[tile, V] buffers (by autograd through ``logits_fn`` when there is one). Four products with
the head's weight per token (the recomputation is one), against three untiled.

Under context parallelism it takes this rank's shard of the hidden states and
``ringattn.shard_batch``'s ``shift_labels`` (each local token's target, shifted on the
global sequence: a shard's last token's target is the next shard's first token); its
results are this rank's positions, in the shard's order. In one process, pass the model's
unshifted ``labels=`` (for RL: the ``input_ids``; token i's target is token i + 1).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .loss import DEFAULT_TILE, flat_targets, head_and_targets, tile_rows

__all__ = ["LogProbs", "tiled_logprobs", "head_logprobs"]


class LogProbs(NamedTuple):
    """``tiled_logprobs``'s result: [B, L] (or [N]) tensors in float32 (float64 for
    float64 inputs)."""

    logprobs: torch.Tensor
    """log p(target | position) at ``temperature``; 0 where the position has no target."""
    entropy: torch.Tensor | None
    """The entropy of each position's distribution at ``temperature`` (every position,
    with a target or not); None unless asked for."""


def _tile_logits(h, weight, bias, logits_fn, temperature):
    """A tile's logits as the model's loss sees them, then divided by ``temperature``."""
    z = torch.nn.functional.linear(h, weight, bias)
    if logits_fn is not None:
        z = logits_fn(z)
    z = z.to(torch.promote_types(z.dtype, torch.float32))
    return z if temperature == 1.0 else z / temperature


def _tile_values(z, target, entropy: bool):
    """(log-probabilities [T] (0 without a target), entropies [T] or None) of logits z."""
    lse = torch.logsumexp(z, dim=-1)
    has = target >= 0
    picked = z.gather(-1, target.clamp_min(0).unsqueeze(-1)).squeeze(-1)
    lp = torch.where(has, picked - lse, torch.zeros_like(lse))
    if not entropy:
        return lp, None
    p = torch.softmax(z, dim=-1)
    return lp, lse - torch.bmm(p.unsqueeze(1), z.unsqueeze(2)).view(-1)


def _tile_grad(h, w, b, target, g_lp, g_ent, temperature):
    """d(g_lp . lp + g_ent . ent) / d(head output) of one tile, in the head's dtype, for a
    head without a transform: with logp = log_softmax(z / T) and p = exp(logp),
    d lp / d z = (onehot(target) - p) / T and d ent / d z = -p (logp + ent) / T."""
    z = torch.nn.functional.linear(h, w, b)
    work = torch.promote_types(z.dtype, torch.float32)
    logp = z.to(work) if z.dtype != work else z  # [R, V], then log-probabilities in place
    if temperature != 1.0:
        logp.div_(temperature)
    logp.sub_(torch.logsumexp(logp, dim=-1, keepdim=True))
    dz = logp.exp()  # p, then the gradient in place
    has = target >= 0
    g_lp = torch.where(has, g_lp.to(work), torch.zeros((), dtype=work, device=z.device))
    coef = g_lp.unsqueeze(-1)  # [R, 1]: a position without a target has lp = 0
    if g_ent is not None:  # logp + ent, times g_ent, plus g_lp: in logp's buffer
        ent = -torch.bmm(dz.unsqueeze(1), logp.unsqueeze(2)).view(-1, 1)
        coef = logp.add_(ent).mul_(g_ent.to(work).unsqueeze(-1)).add_(coef)
    dz.mul_(coef).neg_()
    rows = has.nonzero().squeeze(-1)
    dz[rows, target[rows]] += g_lp[rows]
    if temperature != 1.0:
        dz.div_(temperature)
    return dz if dz.dtype == w.dtype else dz.to(w.dtype)


class _TiledLogProbs(torch.autograd.Function):
    """Forward: each tile's log-probabilities and entropies, nothing kept. Backward: each
    tile's logits again, and the gradients of (g_lp . lp + g_ent . ent) for that tile."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, rows, logits_fn, temperature, entropy):
        work = torch.promote_types(hidden.dtype, torch.float32)
        n = hidden.shape[0]
        lp = torch.zeros(n, dtype=work, device=hidden.device)
        ent = torch.zeros(n, dtype=work, device=hidden.device) if entropy else None
        with torch.no_grad():
            for start in range(0, n, rows):
                sl = slice(start, start + rows)
                z = _tile_logits(hidden[sl], weight, bias, logits_fn, temperature)
                a, b = _tile_values(z, target[sl], entropy)
                lp[sl] = a
                if entropy:
                    ent[sl] = b
        ctx.save_for_backward(hidden, weight, bias, target)
        ctx.opts = (rows, logits_fn, temperature, entropy)
        if ent is None:
            return lp, lp.new_zeros(0)
        return lp, ent

    @staticmethod
    def backward(ctx, g_lp, g_ent):
        hidden, weight, bias, target = ctx.saved_tensors
        rows, logits_fn, temperature, entropy = ctx.opts
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        d_hidden = torch.zeros_like(hidden) if need_h else None
        d_weight = (torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype,
                                                                         torch.float32),
                                device=weight.device) if need_w else None)
        d_bias = (torch.zeros(bias.shape, dtype=torch.promote_types(bias.dtype, torch.float32),
                              device=bias.device) if need_b else None)
        use_ent = entropy and g_ent is not None and g_ent.numel() > 0
        if logits_fn is None:  # by hand: two [R, V] buffers per tile, no graph
            w, b = weight.detach(), None if bias is None else bias.detach()
            for start in range(0, hidden.shape[0], rows):
                sl = slice(start, start + rows)
                h = hidden[sl].detach()
                dz = _tile_grad(h, w, b, target[sl], g_lp[sl],
                                g_ent[sl] if use_ent else None, temperature)
                if need_h:
                    d_hidden[sl] = (dz @ w).to(hidden.dtype)
                if need_w:
                    d_weight.add_(dz.t() @ h.to(dz.dtype))
                if need_b:
                    d_bias.add_(dz.sum(0))
            return (d_hidden, None if d_weight is None else d_weight.to(weight.dtype),
                    None if d_bias is None else d_bias.to(bias.dtype), None, None, None, None,
                    None)
        w = weight.detach().requires_grad_(need_w)
        b = None if bias is None else bias.detach().requires_grad_(need_b)
        for start in range(0, hidden.shape[0], rows):
            sl = slice(start, start + rows)
            h = hidden[sl].detach().requires_grad_(need_h)
            with torch.enable_grad():
                z = _tile_logits(h, w, b, logits_fn, temperature)
                lp, ent = _tile_values(z, target[sl], use_ent)
                total = (lp * g_lp[sl].to(lp.dtype)).sum() if g_lp is not None else 0.0
                if use_ent:
                    total = total + (ent * g_ent[sl].to(ent.dtype)).sum()
                wanted = [x for x, need in ((h, need_h), (w, need_w), (b, need_b)) if need]
                if not wanted or not isinstance(total, torch.Tensor):
                    continue
                grads = list(torch.autograd.grad(total, wanted))
            if need_h:
                d_hidden[sl] = grads.pop(0)
            if need_w:
                d_weight.add_(grads.pop(0))
            if need_b:
                d_bias.add_(grads.pop(0))
        return (d_hidden, None if d_weight is None else d_weight.to(weight.dtype),
                None if d_bias is None else d_bias.to(bias.dtype), None, None, None, None,
                None)


def tiled_logprobs(hidden: torch.Tensor, lm_head, *, shift_labels: torch.Tensor | None = None,
                   labels: torch.Tensor | None = None, ignore_index: int = -100,
                   temperature: float = 1.0, entropy: bool = False, tile=DEFAULT_TILE,
                   logits_fn=None) -> LogProbs:
    """Each token's log-probability of its target under ``lm_head(hidden) / temperature``,
    and optionally its distribution's entropy, one tile of logits at a time (forward and
    backward). Give the targets as ``shift_labels`` (already shifted) or as ``labels``
    (unshifted: token i's target is ``labels[..., i + 1]``), never both, by keyword.

    Arguments:
        hidden: [B, L, H] (or [N, H]) the decoder's last hidden states (after its final norm).
        lm_head: a ``torch.nn.Linear`` (exactly that class, or FSDP2's ``fully_shard`` of
            one: ``structure.plain_layer_problem``) or its [V, H] weight tensor.
        shift_labels: [B, L] (or [N]) each token's target, already shifted (under CP,
            ``shard_batch``'s ``shift_labels``); ``ignore_index``: none (log-probability 0).
        labels: [B, L] (or [N]) unshifted token ids, one process only (a shard is refused:
            its last token's target lies on another rank).
        temperature: a float > 0; the logits (after ``logits_fn`` and the float32 upcast)
            are divided by it, as TRL's GRPO and verl divide them.
        entropy: also return each position's entropy.
        tile: rows of logits at once (an int >= 1), or a byte budget of one tile's logits
            ("16MiB", the default: the rows follow from V).
        logits_fn: None, or what the model does to the head's output (a soft cap, a scale),
            in the head's dtype, per row (``tiled_lm_loss``'s; the head table of
            ``ringattn.integrations.transformers`` gives a family's).

    Returns:
        ``LogProbs(logprobs, entropy)``: [B, L] (or [N]) float32 (float64 for float64
        inputs); differentiable: the gradient of any weighted sum reaches ``hidden`` and the
        head's weight and bias.

    Raises:
        TypeError: ``lm_head`` not a plain Linear or a 2-D weight (named); neither or both
            of ``shift_labels`` and ``labels``; ``labels`` that are a shard; an argument's
            type.
        ValueError: a temperature that is not a finite float > 0, shapes that do not match,
            a bad tile, a target outside [0, V) that is not ``ignore_index``.
    """
    weight, bias, shift_labels = head_and_targets(
        "tiled_logprobs", lm_head, shift_labels, labels, ignore_index,
        "compute this head's log-probabilities from its logits")
    return head_logprobs(hidden, weight, bias, shift_labels, ignore_index=ignore_index,
                         temperature=temperature, entropy=entropy, tile=tile,
                         logits_fn=logits_fn)


def head_logprobs(hidden, weight, bias, shift_labels, *, ignore_index=-100, temperature=1.0,
                  entropy=False, tile=DEFAULT_TILE, logits_fn=None) -> LogProbs:
    """``tiled_logprobs`` of the head ``(weight, bias)`` (bias None or [V]), for callers
    holding a head's tensors rather than its module."""
    target = flat_targets(hidden, weight, shift_labels, ignore_index)
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float > 0, got {temperature!r}")
    if not 0.0 < float(temperature) < float("inf"):
        raise ValueError(f"temperature must be a finite float > 0, got {temperature!r}")
    if not isinstance(entropy, bool):
        raise TypeError(f"entropy must be a bool, got {entropy!r}")
    if logits_fn is not None and not callable(logits_fn):
        raise TypeError(f"logits_fn must be callable or None, got {type(logits_fn).__name__}")
    rows = tile_rows(tile, weight.shape[0], hidden.dtype, "tile")
    shape = shift_labels.shape
    lp, ent = _TiledLogProbs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, target,
                                   rows, logits_fn, float(temperature), entropy)
    return LogProbs(lp.view(shape), ent.view(shape) if entropy else None)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
