"""Numerically stable merge of partial attention results by their log-sum-exp.

Legend: B batch, S rows (queries), H heads, D head dim.

Two softmax-attention results over disjoint key sets, (o_a, lse_a) and (o_b, lse_b), combine
into the result over the union of the keys:

    lse = log(exp(lse_a) + exp(lse_b))
    o   = o_a * exp(lse_a - lse) + o_b * exp(lse_b - lse)

because each o_x is sum_j p_j v_j / exp(lse_x) over its keys. The weights exp(lse_x - lse)
are sigmoid(lse_a - lse_b) and sigmoid(lse_b - lse_a), always in [0, 1], and are computed
in that form (as ring-flash-attn and PyTorch's ring do): the difference of the two lse is
exact where they are close, whereas exp(lse_a - lse) would carry the rounding of the merged
lse, |lse| * 2^-24 relative (3e-5 at lse = 500: large logits), into every output.

A row that saw no key in either part keeps lse = -inf and o = 0, and gets zero gradients:
the formulas run on 0 in place of the -infs there (exp(-inf + inf) would be NaN, and so
would a gradient through any masked-out branch), then the results are masked.
"""

from __future__ import annotations

import torch

from .spec import accumulator_dtype

__all__ = ["merge", "merge_", "merge_weights"]


def merge_weights(lse_a_BHS, lse_b_BHS):
    """(merged lse [B, H, S], w_a, w_b as [B, S, H, 1] factors for the outputs), finite
    gradients everywhere (zero on rows where both lse are -inf)."""
    seen = (lse_a_BHS > float("-inf")) | (lse_b_BHS > float("-inf"))
    a = torch.where(seen, lse_a_BHS, 0.0)
    b = torch.where(seen, lse_b_BHS, 0.0)
    diff = a - b  # +-inf where one side saw nothing: weights 1 and 0
    w_a = torch.where(seen, torch.sigmoid(diff), 0.0)
    w_b = torch.where(seen, torch.sigmoid(-diff), 0.0)
    new_BHS = torch.where(seen, torch.logaddexp(a, b), float("-inf"))
    return new_BHS, w_a.transpose(1, 2).unsqueeze(-1), w_b.transpose(1, 2).unsqueeze(-1)


def merge_(
    out_BSHD: torch.Tensor, lse_BHS: torch.Tensor, out_b_BSHD: torch.Tensor, lse_b_BHS: torch.Tensor
) -> None:
    """Fold (out_b, lse_b) into the accumulators (out, lse) in place (no autograd).

    ``out_BSHD`` and ``lse_BHS`` are float32 (float64) accumulators; the block result may be
    any floating dtype. Slices of larger accumulators are fine.
    """
    new_BHS, w_a, w_b = merge_weights(lse_BHS, lse_b_BHS)
    out_BSHD.mul_(w_a).add_(out_b_BSHD * w_b)
    lse_BHS.copy_(new_BHS)


def merge(
    out_a: torch.Tensor, lse_a: torch.Tensor, out_b: torch.Tensor, lse_b: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge two attention results over disjoint key sets into the result over both.

    Arguments:
        out_a, out_b: [B, S, H, D] attention outputs for the same queries.
        lse_a, lse_b: [B, H, S] their log-sum-exp of scaled scores (-inf: no key seen).

    Returns:
        (out, lse): out [B, S, H, D] in out_a's dtype, lse [B, H, S] in float32 (float64 for
        float64 inputs). Differentiable in all four inputs.

    Raises:
        ValueError: if the shapes do not match.
    """
    if out_a.shape != out_b.shape or lse_a.shape != lse_b.shape:
        raise ValueError(
            f"cannot merge out {tuple(out_a.shape)} / lse {tuple(lse_a.shape)} with "
            f"out {tuple(out_b.shape)} / lse {tuple(lse_b.shape)}"
        )
    b, s, h, _ = out_a.shape
    if tuple(lse_a.shape) != (b, h, s):
        raise ValueError(f"lse has shape {tuple(lse_a.shape)}, expected {(b, h, s)} for out {tuple(out_a.shape)}")
    acc = accumulator_dtype(out_a.dtype)
    lse, w_a, w_b = merge_weights(lse_a.to(acc), lse_b.to(acc))
    out = out_a.to(acc) * w_a + out_b.to(acc) * w_b
    return out.to(out_a.dtype), lse


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
