"""Eagle3 speculative-decoding draft training under context parallelism.

* ``ttt_attention``: the draft's test-time-training attention on shards (step-0 keys on a
  causal ring, the keys cached by later steps rank-local, merged by log-sum-exp).
* ``dense_ttt_attention``, ``ttt_mask``, ``modelopt_ttt_mask``: the one-device formulation
  (the mask written out) and ModelOpt's token-aligned version of it.
* ``Lookahead``: rows a few positions ahead, read across shard boundaries.
* ``Eagle3Draft``, ``run_target``, ``shard_target_outputs``, ``eagle3_step``: the draft,
  the target under CP (or precomputed target outputs sharded, for offline training), one
  TTT unroll with global per-step losses and accuracies (``ringattn.apps.eagle3_train`` has the
  DP x CP training loop, ``ringattn.apps.eagle3_demo`` the demo). See docs/eagle3.md.
"""

from .attention import dense_ttt_attention, modelopt_ttt_mask, ttt_attention, ttt_mask
from .draft import (Eagle3Draft, StepResult, TargetOutputs, aux_layer_ids, draft_vocabulary,
                    eagle3_step, run_target, shard_target_outputs)
from .export import export_draft, load_draft
from .shift import Lookahead

__all__ = [
    "Eagle3Draft",
    "Lookahead",
    "StepResult",
    "TargetOutputs",
    "aux_layer_ids",
    "dense_ttt_attention",
    "draft_vocabulary",
    "eagle3_step",
    "export_draft",
    "load_draft",
    "modelopt_ttt_mask",
    "run_target",
    "shard_target_outputs",
    "ttt_attention",
    "ttt_mask",
]
