"""Local block attention kernels: (q, k, v, band) -> (out, lse), and their backward.

Every kernel implements the ``Kernel`` protocol of ``kernels.registry``; the ring loop only
ever talks to that protocol.
"""

from .registry import Kernel, available_kernels, get_kernel

__all__ = ["Kernel", "available_kernels", "get_kernel"]
