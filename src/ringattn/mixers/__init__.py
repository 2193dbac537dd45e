"""Exact context parallelism for sequence mixers that are not attention: linear recurrences
(Mamba2's SSD, the gated delta rule, RG-LRU's diagonal scan, linear attention, RWKV's WKV
and xLSTM's mLSTM, whose states are kept on a running maximum's log scale) and causal
convolutions, on the layouts of ``ringattn`` (contiguous, zigzag, per-document zigzag and
doc_contiguous; striped is refused).

One mechanism serves them all (``core``): each rank computes the affine map
S_out = M S_in + C of each of its chunks, one all-gather hands every rank every chunk's map,
and each rank composes those before its chunks, in global order, into their true entering
states; a causal convolution's halo (the k-1 inputs before a chunk) travels the same way.
Packed documents (cu_seqlens) reset the state and stop the halo.

Every public function agrees on its whole call before any exchange (``core.agreed``): each
option, and each tensor argument's dtype, shape (a shard's sequence dim aside),
requires_grad and presence; ranks that differ in one raise the same ValueError naming it.
Every tensor argument that requires grad gets a gradient on every rank, zeros on a rank
with no token, never None (so an all-reduce of gradients makes the same collectives on
every rank).
"""

from .core import causal_conv1d, linear_recurrence
from .families import diagonal_recurrence, gated_delta_rule, mamba2_ssd
from .rnn import mlstm, wkv

__all__ = ["causal_conv1d", "diagonal_recurrence", "gated_delta_rule", "linear_recurrence",
           "mamba2_ssd", "mlstm", "wkv"]
