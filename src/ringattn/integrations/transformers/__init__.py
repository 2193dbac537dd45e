"""transformers integration: ring attention as a registered attention implementation.

``register()`` adds "ringattn" to transformers' ``AttentionInterface`` and a mask function to
``AttentionMaskInterface``, so any model that calls its attention through that interface
runs context-parallel with ``config._attn_implementation = "ringattn"`` (or
``from_pretrained(..., attn_implementation="ringattn")``) and a batch from
``ringattn.shard_batch``:

    from ringattn.integrations import transformers as ra_hf
    ra_hf.register()
    model = LlamaForCausalLM(config)            # config._attn_implementation = "ringattn"
    local = ra_hf.prepare_batch(model, batch, group=cp_group)   # check_model + shard_batch
    out = model(**local)

Nothing is patched: the batch's ``RingContext`` travels through the model's own kwargs.

Exact or refused. Every argument a model gives its attention function is honoured or the
call raises a TypeError naming it; nothing is dropped:

* ``scaling``, ``dropout`` (0 only), ``is_causal``;
* ``sliding_window`` W (Mistral, Qwen2: keys q-W < kv <= q) -> ``window_size=(W - 1, 0)``;
* ``softcap`` (Gemma 2's ``attn_logit_softcapping``) -> ring soft-capping (reference kernel);
* ``s_aux`` (gpt-oss's sinks) -> ring ``sinks`` (differentiable);
* a value head dim different from the query's (MLA: DeepSeek V2/V3) -> native;
* the masks a model asks transformers for: causal, sliding window (also when the model
  expresses its window only through the mask, as Qwen2-MoE and PhiMoE do), bidirectional,
  Llama 4's chunked attention; a mask with a custom overlay, or a dense mask tensor (a
  learned mask, as Doge's), is refused;
* per-call model kwargs that are not attention arguments (``position_ids``,
  ``num_items_in_batch``, ...; ``NOT_ATTENTION_KWARGS``) are ignored.

``prepare_batch`` (``check_attention``, ``check_model``, then ``shard_batch`` with the
position ids the model would compute: OPT-style models count real tokens of a padded row)
is the safe entry. ``shard_batch`` alone then ``model(**local)`` is exact or refused too:
the attention function refuses an OPT-style model on a batch whose positions
``shard_batch`` made where they differ (padding before a real token), and the mask
function refuses, with ``check_model``'s message, configs it refuses and models whose
family computes attention itself (they would use the mask object as a tensor).
``check_model`` refuses what the attention function alone cannot see: model classes that
compute attention themselves (``is_backend_compatible()`` False: bloom, codegen, xglm, ...),
and models whose other sequence layers (state-space, linear attention, convolution) or
losses (router auxiliary losses) would see only the local shard. The attention function
runs the configuration checks too, on every call.
"""

from __future__ import annotations

from .attention import ModelMask, check_attention, register, ring_attention_forward
from .batch import prepare_batch
from .checks import (BUILT_EAGER, MIXER_FAMILIES, NAME, NOT_ATTENTION_KWARGS, POSITIONS_FROM_MASK,
                     check_model, converted, convertible, global_router_loss, mixers_converted)
from ...eagle3.target import register_loader
from ...eagle3.teacher import register_head_reader, register_head_transforms
from .context import average_gradients, context_parallel
from .convert import convert, load_pretrained
from .head import head_transforms, teacher_head, tile_problem, tiled_call
from .mixers import convert_mixers
from .tiled_mlp import tile_mlp, tiled_mlps
from .families.indexer import indexer_ties

__all__ = ["average_gradients", "check_consumed", "check_model", "context_parallel", "convert",
           "prepare_batch", "register", "tile_mlp"]
_DOCUMENTED = (BUILT_EAGER, NAME, NOT_ATTENTION_KWARGS, POSITIONS_FROM_MASK, ModelMask,
               check_attention, converted, convertible, convert_mixers, global_router_loss,
               mixers_converted, ring_attention_forward, tile_problem, tiled_call, tiled_mlps,
               load_pretrained, indexer_ties)
"""The face. Also importable, as documented: ``NAME``, ``CONVERTIBLE``, ``BUILT_EAGER``,
``check_attention``, ``converted``, ``global_router_loss``, ``mixers_converted``,
``convertible``, ``convert_mixers`` (the mixer half of ``convert``), ``indexer_ties`` (how
a converted DSA model's indexers break ties at the k-th score), ``load_pretrained``
(a local model directory with ring attention, converted), ``ModelMask``,
``ring_attention_forward``, ``NOT_ATTENTION_KWARGS``, ``POSITIONS_FROM_MASK``,
``tile_problem`` (why a model's loss runs untiled) and ``tiled_call`` (the tiled loss of
one forward, for a trainer of one's own), ``tiled_mlps`` (the tile ``tile_mlp`` gave a
model)."""

CONVERTIBLE = frozenset(MIXER_FAMILIES)
"""model_type of the hybrid families whose sequence mixers ``convert`` serves (the rows of
the ``mixers/`` files)."""

# the Eagle3 library loads "ringattn" targets through this integration, which it does not
# import (eagle3/ sits above integrations/: tests/unit/test_house.py)
register_loader(NAME, load_pretrained)
register_head_reader(teacher_head)  # its teacher in tiles reads a target's head by the table
register_head_transforms(head_transforms)  # and rebuilds a stored head's row of it


def check_consumed(ring_context, model=None) -> None:
    """Raise if no attention layer or converted mixer of ``model`` ran with this batch's
    ``ring_context`` (the model computed its sequence mixing on its shard alone)."""
    ring_context.check_consumed(model)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
