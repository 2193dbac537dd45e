"""Export a trained Eagle3 draft in the formats servers load, and load it back.

Legend: h draft hidden size, H_t target hidden size, V target vocabulary, Vd draft vocabulary.

Two formats, each a directory with ``config.json`` and ``model.safetensors``:

* ``"sglang"``: what SpecForge writes and SGLang's ``LlamaForCausalLMEagle3`` loads. Config:
  a one-layer Llama config with ``architectures: ["LlamaForCausalLMEagle3"]``,
  ``draft_vocab_size``, ``target_hidden_size``, ``tie_word_embeddings: false`` and
  ``eagle_config: {"eagle_aux_hidden_state_layer_ids": [...], "use_aux_hidden_state":
  true}`` (decoder-layer indices whose outputs are read, as ``Eagle3Draft.aux_layers``).
  Tensors: ``midlayer.{input_layernorm, hidden_norm, post_attention_layernorm}.weight``,
  ``midlayer.self_attn.{q,k,v,o}_proj.weight``, ``midlayer.mlp.{gate,up,down}_proj.weight``,
  ``fc.weight`` [h, 3 H_t], ``norm.weight``, ``lm_head.weight`` [Vd, h], ``d2t`` int64 [Vd]
  (draft id -> target id offset), ``t2d`` bool [V].
* ``"speculators"``: the format of vLLM's speculators project: ``speculators_model_type:
  "eagle3"``, ``architectures: ["Eagle3Speculator"]``, the layer's Llama config under
  ``transformer_layer_config``, ``draft_vocab_size``, ``target_hidden_size``,
  ``norm_before_residual: false`` written out (vLLM's default is true, which is not this
  draft), and the auxiliary layers in hidden-states indexing (``eagle_aux_hidden_state_
  layer_ids``: decoder-layer index + 1, the index into ``output_hidden_states``). Tensors:
  the layer under ``layers.0.*`` instead of ``midlayer.*``, the rest as above.

The token embedding is the target's (frozen): servers take it from the target, so it is
written only with ``include_embedding=True``; ``load_draft`` then takes it from the file or
from ``embed_tokens=`` (the target's input embedding).
"""

from __future__ import annotations

import json
import os

import torch

from .draft import Eagle3Draft

__all__ = ["FORMATS", "export_draft", "load_draft"]

FORMATS = ("sglang", "speculators")

_LAYER = ("input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
          "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
          "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
          "mlp.down_proj.weight")
_OURS = {"self_attn.q_proj.weight": "q_proj.weight", "self_attn.k_proj.weight": "k_proj.weight",
         "self_attn.v_proj.weight": "v_proj.weight", "self_attn.o_proj.weight": "o_proj.weight"}
_TOP = ("fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d")


def _prefix(fmt: str) -> str:
    return "midlayer." if fmt == "sglang" else "layers.0."


def _layer_config(draft: Eagle3Draft) -> dict:
    c = draft.config
    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "rms_norm_eps", "vocab_size", "max_position_embeddings", "hidden_act",
            "rope_parameters", "initializer_range", "attention_bias", "mlp_bias")
    out = {k: getattr(c, k) for k in keys if hasattr(c, k)}
    out["head_dim"] = draft.head_dim
    rope = dict(out.get("rope_parameters") or {})
    if "rope_theta" in rope:  # the pre-5 spelling servers read, beside transformers 5's
        out["rope_theta"] = rope["rope_theta"]
        if rope.get("rope_type", "default") != "default":
            out["rope_scaling"] = {k: v for k, v in rope.items() if k != "rope_theta"}
    out.update(model_type="llama", num_hidden_layers=1, tie_word_embeddings=False,
               architectures=["LlamaForCausalLM"])
    return out


def export_draft(draft: Eagle3Draft, path: str, format: str = "sglang", *,
                 include_embedding: bool = False) -> None:
    """Write ``draft`` to directory ``path`` (created) as ``config.json`` and
    ``model.safetensors`` in ``format`` ("sglang" or "speculators"; see the module doc).

    Raises:
        ValueError: an unknown format, or a draft without ``aux_layers``.
    """
    from safetensors.torch import save_file

    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if draft.aux_layers is None:
        raise ValueError("the draft does not know its target's auxiliary layers "
                         "(Eagle3Draft(aux_layers=...)); servers need them")
    state = draft.state_dict()
    tensors = {}
    for name in _LAYER:
        tensors[_prefix(format) + name] = state[_OURS.get(name, name)]
    for name in _TOP:
        tensors[name] = state[name]
    if include_embedding:
        tensors["embed_tokens.weight"] = state["embed_tokens.weight"]
    layer = _layer_config(draft)
    dtype = str(draft.lm_head.weight.dtype).removeprefix("torch.")
    common = {"draft_vocab_size": int(draft.d2t.numel()),
              "target_hidden_size": int(draft.target_hidden_size), "torch_dtype": dtype}
    if format == "sglang":
        config = {**layer, **common, "architectures": ["LlamaForCausalLMEagle3"],
                  "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(draft.aux_layers),
                                   "use_aux_hidden_state": True}}
    else:
        config = {"architectures": ["Eagle3Speculator"], "speculators_model_type": "eagle3",
                  "transformer_layer_config": layer, **common,
                  "norm_before_residual": False,
                  "eagle_aux_hidden_state_layer_ids": [i + 1 for i in draft.aux_layers],
                  "speculators_config": {"algorithm": "eagle3"}}
    os.makedirs(path, exist_ok=True)
    save_file({k: v.detach().contiguous() for k, v in tensors.items()},
              os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=1)


def load_draft(path: str, *, embed_tokens: torch.Tensor | None = None) -> Eagle3Draft:
    """The ``Eagle3Draft`` in directory ``path`` (either format, detected from its config):
    the same weights, buffers, dtypes, vocabulary and auxiliary layers as exported.

    Arguments:
        embed_tokens: the target's input embedding [V, h], used when the file has none.

    Raises:
        ValueError: no config.json, a config of neither format, missing or misshapen
            tensors (named), or no embedding anywhere.
    """
    from safetensors.torch import load_file
    from transformers import LlamaConfig

    file = os.path.join(str(path), "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"{path!r} has no config.json: not an exported Eagle3 draft")
    with open(file) as f:
        config = json.load(f)
    if config.get("speculators_model_type") == "eagle3":
        fmt, layer = "speculators", dict(config["transformer_layer_config"])
        aux = [i - 1 for i in config["eagle_aux_hidden_state_layer_ids"]]
    elif "LlamaForCausalLMEagle3" in config.get("architectures", ()):
        fmt, layer = "sglang", dict(config)
        aux = list(config["eagle_config"]["eagle_aux_hidden_state_layer_ids"])
    else:
        raise ValueError(f"{file} is neither an SGLang Eagle3 config (architectures "
                         f"LlamaForCausalLMEagle3) nor a speculators one "
                         f"(speculators_model_type 'eagle3')")
    weights = load_file(os.path.join(str(path), "model.safetensors"))
    missing = [n for n in [_prefix(fmt) + x for x in _LAYER] + list(_TOP) if n not in weights]
    if missing:
        raise ValueError(f"{path!r} lacks tensors {missing}")
    keep = {k: layer[k] for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                                  "num_key_value_heads", "head_dim", "rms_norm_eps", "vocab_size",
                                  "max_position_embeddings", "hidden_act", "rope_parameters",
                                  "initializer_range", "attention_bias", "mlp_bias") if k in layer}
    llama = LlamaConfig(**keep, num_hidden_layers=1, tie_word_embeddings=False,
                        bos_token_id=None, eos_token_id=None, pad_token_id=None)
    d2t = weights["d2t"]
    draft_ids = d2t + torch.arange(d2t.numel())
    draft = Eagle3Draft(llama, config["target_hidden_size"], draft_ids, aux)
    state = {name: weights[_prefix(fmt) + name] for name in _LAYER}
    state = {_OURS.get(k, k): v for k, v in state.items()}
    state.update({k: weights[k] for k in _TOP})
    emb = weights.get("embed_tokens.weight", embed_tokens)
    if emb is None:
        raise ValueError(f"{path!r} holds no embed_tokens (servers take the target's): pass "
                         f"embed_tokens=target.get_input_embeddings().weight")
    state["embed_tokens.weight"] = emb
    ours = draft.state_dict()
    wrong = [f"{k} {tuple(v.shape)} (expected {tuple(ours[k].shape)})"
             for k, v in state.items() if k in ours and tuple(v.shape) != tuple(ours[k].shape)]
    if wrong:
        raise ValueError(f"{path!r} has tensors of the wrong shape: {wrong}")
    draft = draft.to(state["lm_head.weight"].dtype)
    draft.load_state_dict(state, strict=True)
    return draft
