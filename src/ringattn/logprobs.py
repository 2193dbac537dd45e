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

``tiled_token_loss`` is for a loss that is a sum over positions of a function of each
position's log-probability and entropy (GRPO's, PPO's, a KL penalty, an entropy bonus):
given that function, the forward computes each tile's values, the function's derivatives
and the tile's gradients at once, and the backward only scales them (as ``tiled_lm_loss``
does): three products per token, the untiled count.

Under context parallelism it takes this rank's shard of the hidden states and
``ringattn.shard_batch``'s ``shift_labels`` (each local token's target, shifted on the
global sequence: a shard's last token's target is the next shard's first token); its
results are this rank's positions, in the shard's order. In one process, pass the model's
unshifted ``labels=`` (for RL: the ``input_ids``; token i's target is token i + 1).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from .loss import DEFAULT_TILE, flat_targets, hand_out, head_and_targets, tile_rows

__all__ = ["LogProbs", "TokenLoss", "tiled_logprobs", "tiled_token_loss", "head_logprobs"]


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


def _tile_logp(h, w, b, temperature):
    """A tile's log-probabilities [R, V] (float32; float64 stays) of a head without a
    transform, by hand: ``log_softmax(head(h) / temperature)`` in the logits' buffer."""
    z = torch.nn.functional.linear(h, w, b)
    work = torch.promote_types(z.dtype, torch.float32)
    logp = z.to(work) if z.dtype != work else z
    if temperature != 1.0:
        logp.div_(temperature)
    return logp.sub_(torch.logsumexp(logp, dim=-1, keepdim=True))


def _entropy(p, logp):
    """Each row's entropy [R] from its probabilities and log-probabilities [R, V]."""
    return -torch.bmm(p.unsqueeze(1), logp.unsqueeze(2)).view(-1)


def _logp_grad(logp, p, target, g_lp, g_ent, temperature, dtype, ent=None):
    """d(g_lp . lp + g_ent . ent) / d(head output) of one tile, in ``dtype``, from its
    log-probabilities and probabilities [R, V] (both consumed: the gradient is built in
    their buffers): with logp = log_softmax(z / T) and p = exp(logp),
    d lp / d z = (onehot(target) - p) / T and d ent / d z = -p (logp + ent) / T."""
    work = logp.dtype
    has = target >= 0
    g_lp = torch.where(has, g_lp.to(work), torch.zeros((), dtype=work, device=logp.device))
    coef = g_lp.unsqueeze(-1)  # [R, 1]: a position without a target has lp = 0
    if g_ent is not None:  # logp + ent, times g_ent, plus g_lp: in logp's buffer
        ent = _entropy(p, logp) if ent is None else ent.to(work)
        coef = logp.add_(ent.unsqueeze(-1)).mul_(g_ent.to(work).unsqueeze(-1)).add_(coef)
    dz = p.mul_(coef).neg_()
    # + g_lp at each target (g_lp is 0 where there is none): no host sync on the rows
    dz.scatter_add_(-1, target.clamp_min(0).unsqueeze(-1), g_lp.unsqueeze(-1))
    if temperature != 1.0:
        dz.div_(temperature)
    return dz if dz.dtype == dtype else dz.to(dtype)


def _add_head_grad(d_weight, dz, h) -> None:
    """d_weight += dz^T h in place: one ``addmm_`` when the dtypes agree (no [V, H]
    temporary per tile); a bf16 or fp16 head's dz and rows are summed into the float32
    accumulator through the product in their dtype."""
    if dz.dtype == d_weight.dtype:
        d_weight.addmm_(dz.t(), h.to(dz.dtype))
    else:
        d_weight.add_(dz.t() @ h.to(dz.dtype))


def _hand_tile(acc, sl, dz, w, h) -> None:
    """Add a tile's gradients from its logits' gradient ``dz`` [R, V] to ``acc`` (hidden,
    weight, bias: each None when not wanted): the hidden rows' (``dz @ w``), the head's."""
    d_hidden, d_weight, d_bias = acc
    if d_hidden is not None:
        d_hidden[sl] = (dz @ w).to(d_hidden.dtype)
    if d_weight is not None:
        _add_head_grad(d_weight, dz, h)
    if d_bias is not None:
        d_bias.add_(dz.sum(0))


def _graph_tile(acc, sl, lp, ent, g_lp, g_ent, leaves) -> None:
    """Add to ``acc`` the gradients of ``g_lp . lp + g_ent . ent`` (a tile's values, on the
    graph of its logits) with respect to ``leaves`` (hidden rows, weight, bias: None where
    not wanted), by autograd."""
    total = (lp * g_lp.to(lp.dtype)).sum() if g_lp is not None else None
    if g_ent is not None:
        part = (ent * g_ent.to(ent.dtype)).sum()
        total = part if total is None else total + part
    wanted = [x for x in leaves if x is not None]
    if total is None or not wanted:
        return
    grads = list(torch.autograd.grad(total, wanted))
    d_hidden, d_weight, d_bias = acc
    if leaves[0] is not None:
        d_hidden[sl] = grads.pop(0)
    if leaves[1] is not None:
        d_weight.add_(grads.pop(0))
    if leaves[2] is not None:
        d_bias.add_(grads.pop(0))


def _tile_grad(h, w, b, target, g_lp, g_ent, temperature):
    """``_logp_grad`` of a tile's hidden rows: its logits computed again (two [R, V]
    buffers)."""
    logp = _tile_logp(h, w, b, temperature)
    return _logp_grad(logp, logp.exp(), target, g_lp, g_ent, temperature, w.dtype)


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
                _hand_tile((d_hidden, d_weight, d_bias), sl, dz, w, h)
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
                _graph_tile((d_hidden, d_weight, d_bias), sl, lp, ent,
                            None if g_lp is None else g_lp[sl],
                            g_ent[sl] if use_ent else None,
                            (h if need_h else None, w if need_w else None,
                             b if need_b else None))
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


def _checked(hidden, weight, temperature, entropy, logits_fn, tile) -> int:
    """The rows of a tile, once the options shared by the tiled log-probability functions
    are checked (TypeError or ValueError naming the value)."""
    if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
        raise TypeError(f"temperature must be a float > 0, got {temperature!r}")
    if not 0.0 < float(temperature) < float("inf"):
        raise ValueError(f"temperature must be a finite float > 0, got {temperature!r}")
    if not isinstance(entropy, bool):
        raise TypeError(f"entropy must be a bool, got {entropy!r}")
    if logits_fn is not None and not callable(logits_fn):
        raise TypeError(f"logits_fn must be callable or None, got {type(logits_fn).__name__}")
    return tile_rows(tile, weight.shape[0], hidden.dtype, "tile")


def head_logprobs(hidden, weight, bias, shift_labels, *, ignore_index=-100, temperature=1.0,
                  entropy=False, tile=DEFAULT_TILE, logits_fn=None) -> LogProbs:
    """``tiled_logprobs`` of the head ``(weight, bias)`` (bias None or [V]), for callers
    holding a head's tensors rather than its module."""
    target = flat_targets(hidden, weight, shift_labels, ignore_index)
    rows = _checked(hidden, weight, temperature, entropy, logits_fn, tile)
    shape = shift_labels.shape
    lp, ent = _TiledLogProbs.apply(hidden.reshape(-1, hidden.shape[-1]), weight, bias, target,
                                   rows, logits_fn, float(temperature), entropy)
    return LogProbs(lp.view(shape), ent.view(shape) if entropy else None)


class TokenLoss(NamedTuple):
    """``tiled_token_loss``'s result."""

    loss: torch.Tensor
    """0-d, differentiable: the sum over the positions of ``token_loss``'s values (float32;
    float64 for float64 inputs)."""
    logprobs: torch.Tensor
    """[B, L] (or [N]) each position's log-probability, as ``tiled_logprobs`` gives it, with
    no gradient (for the metrics a trainer logs)."""
    entropy: torch.Tensor | None
    """[B, L] (or [N]) each position's entropy, with no gradient; None unless asked for."""


def _per_token(token_loss, names, lp, ent, cols, want: bool):
    """(values [R], d value / d lp [R] or None, d value / d ent [R] or None) of
    ``token_loss`` on each position of a tile, one position at a time (``torch.func.vmap``
    over the rows: what it computes for a position sees only that position's values)."""
    from torch.func import grad_and_value, vmap

    def one(a, e, *c):
        value = token_loss(a, e, **dict(zip(names, c)))
        if not isinstance(value, torch.Tensor) or value.dim() != 0:
            got = (tuple(value.shape) if isinstance(value, torch.Tensor)
                   else type(value).__name__)
            raise TypeError(f"token_loss must return one position's loss, a 0-d tensor, got "
                            f"{got}")
        return value

    if not want:
        return vmap(one, in_dims=(0, None if ent is None else 0) + (0,) * len(cols))(
            lp, ent, *cols), None, None
    if ent is None:
        g, value = vmap(grad_and_value(lambda a, *c: one(a, None, *c)))(lp, *cols)
        return value, g, None
    (g, g_e), value = vmap(grad_and_value(one, argnums=(0, 1)))(lp, ent, *cols)
    return value, g, g_e


class _TiledTokenLoss(torch.autograd.Function):
    """Forward: each tile's logits, its log-probabilities and entropies, ``token_loss`` of
    each position and its derivatives, then (when a gradient will be asked for) the
    gradients of the tile's hidden rows and of the head, at once: nothing recomputed, three
    products with the head's weight per token, as untiled. Backward: those gradients times
    the loss's (``loss.hand_out``)."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, target, rows, logits_fn, temperature, entropy,
                token_loss, names, want, *cols):
        work = torch.promote_types(hidden.dtype, torch.float32)
        n = hidden.shape[0]
        need_h, need_w = want and hidden.requires_grad, want and weight.requires_grad
        need_b = want and bias is not None and bias.requires_grad
        need = need_h or need_w or need_b
        lp_all = torch.zeros(n, dtype=work, device=hidden.device)
        ent_all = torch.zeros(n, dtype=work, device=hidden.device) if entropy else None
        total = torch.zeros((), dtype=work, device=hidden.device)
        d_hidden = torch.zeros_like(hidden) if need_h else None
        d_weight = (torch.zeros(weight.shape, dtype=torch.promote_types(weight.dtype, work),
                                device=weight.device) if need_w else None)
        d_bias = (torch.zeros(bias.shape, dtype=torch.promote_types(bias.dtype, work),
                              device=bias.device) if need_b else None)
        w = weight.detach()
        b = None if bias is None else bias.detach()
        for start in range(0, n, rows):
            sl = slice(start, start + rows)
            h, t = hidden[sl].detach(), target[sl]
            if logits_fn is None:  # by hand: two [R, V] buffers
                with torch.no_grad():
                    logp = _tile_logp(h, w, b, temperature)
                    p = logp.exp()
                    has = t >= 0
                    picked = logp.gather(-1, t.clamp_min(0).unsqueeze(-1)).squeeze(-1)
                    lp = torch.where(has, picked, torch.zeros_like(picked))
                    ent = _entropy(p, logp) if entropy else None
            else:  # the family's transform: the tile's graph, differentiated by autograd
                hh = h.requires_grad_(need_h)
                ww = w.requires_grad_(need_w)
                bb = None if b is None else b.requires_grad_(need_b)
                with torch.enable_grad():
                    z = _tile_logits(hh, ww, bb, logits_fn, temperature)
                    lp_g, ent_g = _tile_values(z, t, entropy)
                lp, ent = lp_g.detach(), None if ent_g is None else ent_g.detach()
            with torch.no_grad():
                value, g_lp, g_ent = _per_token(token_loss, names, lp, ent,
                                                [c[sl] for c in cols], need)
            total += value.sum().to(work)
            lp_all[sl] = lp
            if entropy:
                ent_all[sl] = ent
            if not need:
                continue
            if logits_fn is None:
                with torch.no_grad():
                    dz = _logp_grad(logp, p, t, g_lp, g_ent, temperature, w.dtype, ent)
                    _hand_tile((d_hidden, d_weight, d_bias), sl, dz, w, h)
                continue
            with torch.enable_grad():
                _graph_tile((d_hidden, d_weight, d_bias), sl, lp_g, ent_g, g_lp, g_ent,
                            (hh if need_h else None, ww if need_w else None,
                             bb if need_b else None))
        ctx.grads = (d_hidden, d_weight, d_bias)
        ctx.dtypes = (hidden.dtype, weight.dtype, None if bias is None else bias.dtype)
        ctx.n_cols = len(cols)
        ctx.mark_non_differentiable(lp_all, *(() if ent_all is None else (ent_all,)))
        return total, lp_all, lp_all.new_zeros(0) if ent_all is None else ent_all

    @staticmethod
    def backward(ctx, grad, _g_lp, _g_ent):
        return (*hand_out(ctx, grad, "tiled_token_loss"), None, None, None, None, None, None,
                None, None, *([None] * ctx.n_cols))


def tiled_token_loss(hidden: torch.Tensor, lm_head, token_loss, *,
                     shift_labels: torch.Tensor | None = None,
                     labels: torch.Tensor | None = None, inputs: dict | None = None,
                     ignore_index: int = -100, temperature: float = 1.0, entropy: bool = False,
                     tile=DEFAULT_TILE, logits_fn=None) -> TokenLoss:
    """A loss that is a sum over positions of a function of each position's
    log-probability (and entropy), one tile of logits at a time, its gradients computed in
    the forward: a policy loss (GRPO's, PPO's clipped ratio, a KL to a reference, an
    entropy bonus) at the cost of the untiled computation (three products with the head's
    weight per token; ``tiled_logprobs``, whose loss is not known in its forward, computes
    each tile's logits again in the backward: four).

    ``token_loss(logprob, entropy, **inputs)`` is ONE position's loss: it is called on each
    position alone (``torch.func.vmap`` over the rows, so it cannot mix positions), with
    that position's 0-d log-probability (0 where the position has no target), its entropy
    (None unless ``entropy=True``) and its entry of each tensor of ``inputs`` (0-d, or the
    trailing shape). Normalisations (a mean over a sequence's tokens, over the batch's, a
    gradient-accumulation factor) are weights in ``inputs``: under context parallelism use
    the global counts, and the ranks' losses sum to the one-process loss. Write it with
    torch operations (``torch.where``, ``torch.minimum``, ``torch.clamp``), not Python
    branches on values.

    Arguments:
        hidden, lm_head, shift_labels, labels, ignore_index, temperature, entropy, tile,
        logits_fn: as ``tiled_logprobs``.
        token_loss: the per-position loss, as above.
        inputs: {name: tensor of the targets' shape [B, L] (or [N]), with optional trailing
            dimensions}, each position's values of what the loss needs (advantages, the old
            policy's and the reference's log-probabilities, weights); constants (a tensor
            that requires a gradient is refused: its gradient would not be computed).

    Returns:
        ``TokenLoss(loss, logprobs, entropy)``: the 0-d loss (differentiable: its gradient
        reaches ``hidden`` and the head; one backward per forward) and each position's
        log-probability and entropy, without a gradient.

    Raises:
        TypeError: as ``tiled_logprobs``; ``token_loss`` not callable, or not returning a
            0-d tensor; ``inputs`` not a dict of tensors, or holding one that requires a
            gradient.
        ValueError: as ``tiled_logprobs``; an input whose leading shape is not the
            targets'.
    """
    weight, bias, shift_labels = head_and_targets(
        "tiled_token_loss", lm_head, shift_labels, labels, ignore_index,
        "compute its log-probabilities from its logits")
    if not callable(token_loss):
        raise TypeError(f"token_loss must be callable, got {type(token_loss).__name__}")
    inputs = {} if inputs is None else inputs
    if not isinstance(inputs, dict):
        raise TypeError(f"inputs must be a dict of tensors, got {type(inputs).__name__}")
    lead = tuple(shift_labels.shape)
    cols = []
    for key, value in inputs.items():
        if not isinstance(key, str) or not key.isidentifier():
            raise TypeError(f"inputs' keys must be argument names, got {key!r}")
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"inputs[{key!r}] must be a tensor, got {type(value).__name__}")
        if value.requires_grad:
            raise TypeError(f"inputs[{key!r}] requires a gradient, which tiled_token_loss "
                            f"would not compute (its inputs are constants): detach it, or "
                            f"use tiled_logprobs and a loss of your own")
        if tuple(value.shape[:len(lead)]) != lead:
            raise ValueError(f"inputs[{key!r}] has shape {tuple(value.shape)}: its leading "
                             f"dimensions must be the targets' {lead}")
        cols.append(value.to(hidden.device).reshape(-1, *value.shape[len(lead):]))
    target = flat_targets(hidden, weight, shift_labels, ignore_index)
    rows = _checked(hidden, weight, temperature, entropy, logits_fn, tile)
    want = torch.is_grad_enabled() and any(
        t is not None and t.requires_grad for t in (hidden, weight, bias))
    loss, lp, ent = _TiledTokenLoss.apply(
        hidden.reshape(-1, hidden.shape[-1]), weight, bias, target, rows, logits_fn,
        float(temperature), entropy, token_loss, tuple(inputs), want, *cols)
    return TokenLoss(loss, lp.view(lead), ent.view(lead) if entropy else None)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
