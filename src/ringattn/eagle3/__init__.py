"""Eagle3 speculative-decoding draft training under context parallelism.

* ``ttt_attention``: the draft's test-time-training attention, exact on shards.
* ``dense_ttt_attention``, ``ttt_mask``, ``modelopt_ttt_mask``: the single-device
  formulation (the mask written out) and ModelOpt's token-aligned version of it.
"""

from .attention import dense_ttt_attention, modelopt_ttt_mask, ttt_attention, ttt_mask

__all__ = ["dense_ttt_attention", "modelopt_ttt_mask", "ttt_attention", "ttt_mask"]
