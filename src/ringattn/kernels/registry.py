"""Choose a block kernel by device and dtype, or by name.

The ring loop needs only this protocol:

* ``forward(q, k, v, scale, band) -> (out, lse)``: q [B, Sq, H, D], k/v [B, Sk, Hkv, D];
  out [B, Sq, H, D] (any float dtype), lse [B, H, Sq] (float32, float64 for float64 inputs).
  Every row passed in sees at least one key.
* ``backward(dout, q, k, v, out, lse, scale, band) -> (dq, dk, dv)`` against the FINAL out
  and lse of the rows (not this block's), so per-block gradients add up exactly.
* ``supports(device, dtype) -> bool``, a ``name``, and ``features``: the set of extras it
  computes exactly, from ``FEATURES`` ("softcap": ``softcap`` > 0 is passed to forward and
  backward; "alibi": ``alibi=(slopes [H], q_pos [Sq], kv_pos [Sk])`` global positions;
  "value_dim": v's head dim may differ from q's and k's, as in MLA).

``mask`` is None for an unmasked block, a ``masks.Band`` or a ``masks.BlockMask`` (a block
of a general mask). ``tile`` says how the plan cuts general masks for this kernel: (rows,
cols) of the tiles it classifies, or None for one block per ring step (kernels that skip
empty tiles themselves, like flex).
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .flex import FlexKernel
from .reference import ReferenceKernel
from .sdpa import SdpaKernel

__all__ = ["Kernel", "available_kernels", "get_kernel"]


@runtime_checkable
class Kernel(Protocol):
    name: str
    tile: tuple[int, int] | None
    # optional ``features: frozenset`` (empty when absent)

    def supports(self, device: torch.device, dtype: torch.dtype) -> bool: ...

    def forward(self, q, k, v, scale, mask, softcap=0.0, alibi=None): ...

    def backward(self, dout, q, k, v, out, lse, scale, mask, softcap=0.0, alibi=None): ...


FEATURES = ("softcap", "alibi", "value_dim", "rel_bias")
"""Extras a kernel may support beyond plain masked attention (see the module docstring)."""


_KERNELS: dict[str, Kernel] = {
    k.name: k for k in (SdpaKernel("cpu"), SdpaKernel("cuda"), FlexKernel(), ReferenceKernel())
}
# Fused kernels first: the reference kernel is the fallback for what they do not support.
# Bands (causal, windows) run fastest on the SDPA ops (native causal, few tiles); general
# masks on CUDA go to flex, whose block mask skips empty tiles inside one call.
_PREFERENCE = ("sdpa-cpu", "sdpa-cuda", "reference")
_PREFERENCE_GENERAL = ("sdpa-cpu", "flex", "sdpa-cuda", "reference")


def available_kernels() -> list[str]:
    """Names accepted by ``get_kernel`` (and by ``ring_attention(kernel=...)``)."""
    return ["auto", *_KERNELS]


def get_kernel(name: str | Kernel | None, device: torch.device, dtype: torch.dtype,
               general: bool = False, needs: frozenset = frozenset()) -> Kernel:
    """Return the kernel to use on ``device`` for ``dtype``.

    Arguments:
        name: None or "auto" (the fastest exact kernel that supports the device and dtype),
            a registered name (see ``available_kernels``), or a ``Kernel`` object.
        general: the mask is not a band (picks flex over the SDPA op on CUDA).
        needs: names from ``FEATURES`` the call uses (auto picks a kernel that has them).

    Raises:
        ValueError: unknown name, or a named kernel that does not support device/dtype or
            lacks a needed feature.
        TypeError: an object that is neither a name nor a ``Kernel``.
    """
    if name is None or name == "auto":
        for n in _PREFERENCE_GENERAL if general else _PREFERENCE:
            if _KERNELS[n].supports(device, dtype) and needs <= _KERNELS[n].features:
                return _KERNELS[n]
        raise ValueError(f"no kernel supports {dtype} on {device} with {sorted(needs)}")
    if isinstance(name, str):
        if name not in _KERNELS:
            raise ValueError(f"unknown kernel {name!r}; choose one of {available_kernels()}")
        kernel = _KERNELS[name]
    elif isinstance(name, Kernel):
        kernel = name
    else:
        raise TypeError(f"kernel must be a name or a Kernel object, got {type(name).__name__}")
    if not kernel.supports(device, dtype):
        here = [n for n, k in _KERNELS.items() if k.supports(device, dtype)]
        dtypes = (torch.float32, torch.bfloat16, torch.float16, torch.float64)
        if not any(kernel.supports(device, d) for d in dtypes):
            where = [t for t in ("cpu", "cuda")
                     if any(kernel.supports(torch.device(t), d) for d in dtypes)]
            raise ValueError(
                f"kernel {kernel.name!r} runs on {' and '.join(where) or 'no device here'} "
                f"only, not on {device.type}; for {dtype} on {device.type} use one of "
                f"{['auto', *here]}")
        raise ValueError(f"kernel {kernel.name!r} does not support {dtype} on {device}; for "
                         f"{dtype} there use one of {['auto', *here]}")
    missing = needs - frozenset(getattr(kernel, "features", ()))
    if missing:
        raise ValueError(f"kernel {kernel.name!r} cannot compute {sorted(missing)}; "
                         f"leave kernel=None to pick one that can")
    return kernel


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
