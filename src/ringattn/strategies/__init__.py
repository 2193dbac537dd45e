"""The strategies: one file each, every one a communication pattern with its own forward
and backward, sharing validation (``ringattn.validate``), plans, kernels and the merge.

* ``ring``: the p2p ring (and the ring loop the others run);
* ``ulysses``: all-to-all heads <-> sequence (and the head-splitting machinery the hybrid
  shares);
* ``allgather``: all-gather K/V, reduce-scatter dK/dV;
* ``hybrid``: Ulysses within one mesh dimension, the ring across the other;
* ``auto``: ``ringattn.attention`` and the cost model that picks one.

A new strategy is one new file here plus its entry in ``auto.STRATEGIES``.
"""
