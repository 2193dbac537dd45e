"""``tile_mlp``: each decoder layer's MLP run in sequence tiles, its activations
recomputed in the backward (an instance-level conversion, like ``convert``).

Legend: N tokens of the call (B x L), H hidden size, I the MLP's intermediate size, T tile.

An MLP holds [N, I] activations for its backward (I is 3-8 x H: the up and gate
projections and their product), the largest thing a layer keeps after the logits. A tiled
MLP runs its own forward on T tokens at a time under non-reentrant activation
checkpointing: the forward keeps only its input, the backward recomputes one tile at a time,
so at most [T, I] of them is alive. An MLP acts on each token alone, so the result and the
gradients are the untiled ones (to rounding: the matrix products run on fewer rows).

Only per-token MLPs are tiled: a module a decoder layer holds as ``mlp`` (or
``feed_forward``) whose forward takes the hidden states alone and that routes nothing
(no experts, no router: a mixture of experts counts its routing over the whole call, and
transformers records its router logits per call). Those are left as they are and named.
"""

from __future__ import annotations

import inspect

import torch
from torch.utils.checkpoint import checkpoint

from ...loss import check_tile
from .state import SwapMixin, swap_class

__all__ = ["tile_mlp", "tiled_mlps"]

_NAMES = ("mlp", "feed_forward")
_RECORD = "_ringattn_tiled_mlp"


class TiledMLP(SwapMixin):
    """The mixin of a tiled MLP's class (``Tiled`` + the MLP's class: ``swap_class``)."""

    _swap_prefix = "Tiled"
    _ringattn_tile: int

    def forward(self, hidden_states):
        tile = self._ringattn_tile
        rows = hidden_states.shape[-2] if hidden_states.dim() >= 2 else 0
        if rows <= tile:
            return super().forward(hidden_states)
        parts = hidden_states.split(tile, dim=-2)
        run = super().forward
        if not torch.is_grad_enabled():
            return torch.cat([run(p) for p in parts], dim=-2)
        return torch.cat([checkpoint(run, p, use_reentrant=False) for p in parts], dim=-2)


def _routes(module) -> bool:
    """Whether the module (or one inside it) routes tokens: experts, a router."""
    for name, sub in module.named_modules():
        leaf = name.rsplit(".", 1)[-1].lower()
        if "expert" in leaf or "router" in leaf or "moe" in type(sub).__name__.lower():
            return True
    return False


def _per_token(module) -> str | None:
    """Why ``module`` is not tiled, or None."""
    cls = type(module)
    if isinstance(module, TiledMLP):
        return None
    params = [p for p in inspect.signature(cls.forward).parameters.values()
              if p.kind not in (p.VAR_KEYWORD,)][1:]
    if len(params) != 1 or params[0].kind is params[0].VAR_POSITIONAL:
        return f"{cls.__name__}'s forward takes {len(params)} arguments, not the hidden states alone"
    if _routes(module):
        return f"{cls.__name__} routes tokens (experts or a router): not per token"
    return None


def tile_mlp(model, tile: int = 1024) -> dict:
    """Run each decoder layer's per-token MLP of ``model`` in tiles of ``tile`` tokens,
    recomputing its activations in the backward.

    Arguments:
        model: a transformers model (converted or not, ring attention or not).
        tile: tokens per tile (an int >= 1); the same call again changes it.

    Returns:
        {"tiled": [module names], "left": {module name: why not}}: a routing block (a
        mixture of experts) is left as it is and named, also when every block is one
        (``tiled`` is then empty and ``tiled_mlps(model)`` None).

    Raises:
        TypeError: ``model`` is not a torch module; ``tile`` not an int.
        ValueError: ``tile`` < 1; the model has no module named ``mlp`` or
            ``feed_forward`` at all.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"tile_mlp takes a torch.nn.Module, got {type(model).__name__}")
    tile = check_tile(tile)
    tiled, left = [], {}
    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] not in _NAMES:
            continue
        problem = _per_token(module)
        if problem is not None:
            left[name] = problem
            continue
        if not isinstance(module, TiledMLP):
            module.__class__ = swap_class(TiledMLP, type(module))
        module._ringattn_tile = tile
        tiled.append(name)
    if not tiled and not left:
        raise ValueError(f"tile_mlp: {type(model).__name__} has no per-token MLP to tile (no "
                         f"module named {' or '.join(_NAMES)})")
    if tiled:
        model.__dict__[_RECORD] = tile
    return {"tiled": tiled, "left": left}


def tiled_mlps(model) -> int | None:
    """The tile ``tile_mlp`` gave this model instance, or None."""
    return model.__dict__.get(_RECORD)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
