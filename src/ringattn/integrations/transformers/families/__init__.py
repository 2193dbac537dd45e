"""Model families that need more than the attention function, one file per mechanism:

* ``router``: MoE router auxiliary losses made global;
* ``temperature``: Llama 4's query temperature from global positions;
* ``alibi``: BLOOM's and MPT's ALiBi attention replaced by ring attention;
* ``own_attention``: XGLM, GPT-Neo, Falcon, GPT-NeoX-Japanese, OpenAI GPT's attention
  modules replaced by ring attention;
* ``relay``: StableLM and Nemotron, whose layers drop the ring context;
* ``indexer``: DeepSeek sparse attention's indexers (top-k keys per query) over the whole
  sequence, the selection a key mask of the ring;
* ``score_bias``: Inkling's per-query relative bias and sinks, Doge's per-key bias;
* ``block_indexer``: Qwen4-Exp's and MiniMax-M3's block-sparse indexed attention;
* ``compressed``: DeepSeek-V4's window + compressed-entry attention with sinks.

Each file registers its families in ``checks.ATTENTION_FAMILIES`` (family -> mechanism);
``convert_attention`` runs the mechanism of a model's family. Adding a family that one of
these serves is one row in its file.
"""

from __future__ import annotations

from ..checks import ATTENTION_FAMILIES, register_attention
from .alibi import convert_alibi
from .block_indexer import convert_block_indexer
from .compressed import convert_compressed
from .indexer import convert_indexer
from .own_attention import convert_own_attention
from .relay import convert_relay
from .router import convert_router, router_loss_problem
from .score_bias import convert_score_bias
from .temperature import convert_temperature

__all__ = ["convert_attention", "convert_router", "convert_temperature", "router_loss_problem"]

register_attention("interface", ("biogpt",))
"""BioGPT's attention calls the attention interface with the batch's keyword arguments
although its class does not declare it (``is_backend_compatible()`` False): ``convert``
only records that it was checked."""

_MECHANISMS = {"alibi": convert_alibi, "own attention": convert_own_attention,
               "relay": convert_relay, "interface": lambda model: None,
               "indexer": convert_indexer, "score bias": convert_score_bias,
               "block indexer": convert_block_indexer, "compressed": convert_compressed}
"""checks.ATTENTION_FAMILIES' mechanism names -> the conversion each runs."""


def convert_attention(model) -> None:
    """The attention-side conversion of ``model``'s family (none for most families)."""
    where = ATTENTION_FAMILIES.get(getattr(model.config, "model_type", None))
    if where is not None:
        _MECHANISMS[where](model)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
