"""Other libraries' call sites on ringattn's strategies: change one import line.

* ``ringattn.compat.ring_flash_attn``: ring-flash-attn's functions (ring, zigzag, stripe,
  their varlen forms, llama3's varlen all-gather, the transformers hook).
* ``ringattn.compat.yunchang``: yunchang's ``LongContextAttention``, ``UlyssesAttention``,
  ``SeqAllToAll4D`` and its process-group setup.

Each keeps the peer's signatures, return values and input conventions and computes the
exact answer on CPU or CUDA; what differs is listed in docs/compat.md.
"""
