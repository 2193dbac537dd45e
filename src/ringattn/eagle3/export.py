"""Export a trained Eagle3 draft in the two formats servers load, and load either back.

Legend: h draft hidden size, H_t target hidden size, V target vocabulary, Vd draft vocabulary.

Each format is a directory holding ``config.json`` and ``model.safetensors``
(docs/eagle3_formats.md lists every key and tensor, with the loaders they were checked
against):

* ``"sglang"``: what SpecForge writes and SGLang's ``LlamaForCausalLMEagle3`` loads. A
  one-layer Llama config at the top level (``vocab_size`` = V) with ``draft_vocab_size``,
  ``target_hidden_size`` and ``eagle_config.eagle_aux_hidden_state_layer_ids``: 0-based
  decoder-layer indices whose OUTPUT is read, as ``Eagle3Draft.aux_layers``. The decoder
  layer's tensors are ``midlayer.*``.
* ``"speculators"``: the format of vLLM's speculators project. The layer config sits under
  ``transformer_layer_config``; the auxiliary ids are hidden-states indices (decoder layer
  + 1: vLLM captures the residual stream ENTERING layer i); ``norm_before_residual: false``
  is written out because vLLM's reader defaults it to true; the layer's tensors are
  ``layers.0.*``.

Both hold ``fc.weight`` [h, 3 H_t], ``norm.weight`` [h], ``lm_head.weight`` [Vd, h], ``d2t``
int64 [Vd] (draft id -> target id offset) and ``t2d`` bool [V]; a whole-vocabulary draft
(Vd = V, the identity mapping) has neither, as vLLM expects (it registers
``draft_id_to_target_id`` only when Vd < V) and SGLang and speculators accept. The token embedding
[V, h] is the target's: SpecForge leaves it out and SGLang substitutes the target's, so the
SGLang export omits it unless h != H_t (then SGLang keeps the draft's own); speculators
saves it and vLLM uses it unless it equals the target's, so the speculators export keeps it.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass

import torch

from .draft import Eagle3Draft

__all__ = ["FORMATS", "export_draft", "load_draft"]

FORMATS = ("sglang", "speculators")
SGLANG_ARCHITECTURE = "LlamaForCausalLMEagle3"
SPECULATORS_ARCHITECTURE = "Eagle3Speculator"
SPECULATIVE_TOKENS = 3
"""``speculators_config.proposal_methods[0].speculative_tokens``: the speculators converter's
value; vLLM takes it as ``num_speculative_tokens`` unless its launch names one."""

_ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
"""Our top-level modules that the servers nest under ``self_attn``."""
_LAYER = ("input_layernorm", "hidden_norm", "post_attention_layernorm", "mlp") + _ATTENTION
"""Our top-level modules that form the decoder layer (``midlayer`` / ``layers.0``)."""
_PREFIX = {"sglang": "midlayer.", "speculators": "layers.0."}
_EMBEDDING = "embed_tokens.weight"
_MIDLAYER, _LAYER_ZERO = "midlayer.", "layers.0."
_MAPPING = ("d2t", "t2d")
"""The vocabulary mapping, left out for a whole-vocabulary draft (identity)."""


def export_draft(draft: Eagle3Draft, path: str | os.PathLike, format: str = "sglang", *,
                 target=None) -> None:
    """Write ``draft`` into directory ``path`` (created) as ``config.json`` and
    ``model.safetensors`` in ``format``; every tensor keeps its dtype.

    Arguments:
        draft: the trained draft; its ``aux_layers`` must be known.
        path: the output directory (created if missing; existing files are overwritten).
        format: "sglang" (SpecForge / SGLang ``LlamaForCausalLMEagle3``) or "speculators"
            (vLLM's speculators format).
        target: the target the draft was trained for: a transformers model, its config, or
            its Hub id / path (a local directory is recorded as an absolute path).
            "speculators" records it as ``speculators_config.verifier`` (vLLM serves that
            model when it is given the draft as ``--model``; speculators' ``from_pretrained``
            needs it); given a model, the draft's embedding is checked against the target's
            input embedding, which the servers substitute for it.

    Raises:
        ValueError: an unknown format, a draft without ``aux_layers``, or a draft whose
            token embedding differs from ``target``'s where a server would use the target's.
    """
    if format not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {format!r}")
    if draft.aux_layers is None:
        raise ValueError("the draft does not know its target's auxiliary layers "
                         "(Eagle3Draft(aux_layers=...)); servers need them")
    with_embedding = _writes_embedding(draft, format)
    if not with_embedding:
        _check_embedding(draft, target)
    skip = ({_EMBEDDING} if not with_embedding else set()) | (
        set(_MAPPING) if draft.whole_vocabulary else set())
    tensors = {_file_name(name, format): t.detach().cpu().contiguous()
               for name, t in draft.state_dict().items() if name not in skip}
    config = _sglang_config(draft) if format == "sglang" else _speculators_config(draft, target)
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")


def load_draft(path: str | os.PathLike, *, embed_tokens: torch.Tensor | None = None
               ) -> Eagle3Draft:
    """The ``Eagle3Draft`` stored in directory ``path``, in either format (told apart by its
    config): the same weights, buffers, dtypes, draft vocabulary and auxiliary layers as
    exported, on the CPU.

    Arguments:
        path: a directory written by ``export_draft``, SpecForge or speculators.
        embed_tokens: [V, h] the target's input embedding, used when the file holds none
            (an SGLang-format draft whose width is the target's); cast to the draft's dtype.

    Returns:
        The draft, its embedding frozen as in training.

    Raises:
        ValueError: no config.json, a config of neither format or describing a draft this
            class does not implement, tensors missing, unexpected or misshapen (named),
            ``d2t`` and ``t2d`` disagreeing, or no embedding in the file nor given.
    """
    path = os.fspath(path)
    spec = _read_config(path)
    weights = _with_t2d(_sglang_names(_read_weights(path), spec), spec)
    draft = Eagle3Draft(_llama_config(spec.layer), spec.target_hidden_size,
                        _draft_ids(weights, spec), spec.aux_layers)
    state = _our_state(weights, spec.format, draft, path)
    if _EMBEDDING not in state:
        state[_EMBEDDING] = _given_embedding(embed_tokens, draft, state, path)
    draft = draft.to(state["lm_head.weight"].dtype)  # casts the RoPE buffers as the original
    draft.load_state_dict(state, strict=True, assign=True)  # keeps each tensor's dtype
    return draft


@dataclass(frozen=True)
class _Spec:
    """What a config.json says about the draft."""

    format: str
    layer: dict
    """The decoder layer's Llama config (``vocab_size`` = V)."""
    target_hidden_size: int
    aux_layers: tuple[int, ...] | None
    """0-based decoder-layer indices whose output the draft reads (None: not recorded)."""
    draft_vocab_size: int | None


def _file_name(name: str, format: str) -> str:
    """The file's name for our state-dict entry ``name`` (``q_proj.weight`` ->
    ``midlayer.self_attn.q_proj.weight``; ``fc.weight`` unchanged)."""
    module = name.split(".", 1)[0]
    if module in _ATTENTION:
        return _PREFIX[format] + "self_attn." + name
    if module in _LAYER:
        return _PREFIX[format] + name
    return name


def _writes_embedding(draft: Eagle3Draft, format: str) -> bool:
    """Whether the file carries ``embed_tokens.weight``: speculators' own checkpoints do;
    SpecForge's leave it out (SGLang's ``set_embed`` puts the target's in its place) unless
    the draft is narrower or wider than the target, where SGLang keeps the draft's own."""
    return format == "speculators" or draft.config.hidden_size != draft.target_hidden_size


def _check_embedding(draft: Eagle3Draft, target) -> None:
    """Refuse to drop an embedding that differs from ``target``'s input embedding (servers
    would serve the target's instead). Nothing to compare without a model, or for a
    sharded (DTensor) one, whose gathering would be a collective.

    Raises:
        ValueError: the two embeddings have the same shape but different values.
    """
    get = getattr(target, "get_input_embeddings", None)
    if not callable(get):
        return
    theirs, ours = get().weight, draft.embed_tokens.weight
    if torch.distributed.is_available():
        from torch.distributed.tensor import DTensor

        if isinstance(theirs, DTensor):
            return
    if theirs.shape != ours.shape:
        return
    if not torch.equal(theirs.detach().to(ours.device, ours.dtype), ours.detach()):
        raise ValueError("the draft's embed_tokens differ from the target's input embedding; "
                         "the SGLang format leaves the embedding out and SGLang substitutes "
                         "the target's, so this draft would be served with another embedding")


def _layer_config(draft: Eagle3Draft) -> dict:
    """The decoder layer's Llama config as both formats write it (``vocab_size``: V)."""
    c = draft.config
    return {
        "model_type": "llama",
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_attention_heads": draft.heads,
        "num_key_value_heads": draft.kv_heads,
        "head_dim": draft.head_dim,
        "hidden_act": c.hidden_act,
        "rms_norm_eps": c.rms_norm_eps,
        "vocab_size": c.vocab_size,
        "max_position_embeddings": c.max_position_embeddings,
        **_rope_fields(c),
        "attention_bias": False,  # the draft's q/k/v/o have no bias
        "mlp_bias": bool(getattr(c, "mlp_bias", False)),
        "num_hidden_layers": 1,
        "tie_word_embeddings": False,
        "torch_dtype": _dtype_name(draft),
    }


def _rope_fields(config) -> dict:
    """RoPE as both transformers generations and the servers read it: ``rope_parameters``
    (transformers >= 5), ``rope_theta`` and, for a non-default type, ``rope_scaling`` (what
    transformers 4 and SGLang's ``LlamaDecoderLayer`` read), as SpecForge's export does."""
    params = getattr(config, "rope_parameters", None)  # transformers >= 5 (there
    if params:                                         # rope_scaling aliases it)
        params = dict(params)
    else:  # transformers 4: rope_theta and rope_scaling attributes
        scaling = getattr(config, "rope_scaling", None) or {"rope_type": "default"}
        params = {**scaling, "rope_theta": getattr(config, "rope_theta", 10000.0)}
    out = {"rope_theta": params["rope_theta"], "rope_parameters": params}
    if params.get("rope_type", params.get("type", "default")) != "default":
        out["rope_scaling"] = {k: v for k, v in params.items() if k != "rope_theta"}
    return out


def _dtype_name(draft: Eagle3Draft) -> str:
    """``torch_dtype``: the dtype of the draft's weights (its head's, if they are mixed)."""
    return str(draft.lm_head.weight.dtype).removeprefix("torch.")


def _sglang_config(draft: Eagle3Draft) -> dict:
    """SpecForge's draft config.json, as SGLang's ``LlamaForCausalLMEagle3`` reads it."""
    return {
        "architectures": [SGLANG_ARCHITECTURE],
        **_layer_config(draft),
        "draft_vocab_size": int(draft.d2t.numel()),
        "target_hidden_size": int(draft.target_hidden_size),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(draft.aux_layers),
                         "use_aux_hidden_state": True},
    }


def _speculators_config(draft: Eagle3Draft, target) -> dict:
    """The speculators project's ``Eagle3SpeculatorConfig``, as vLLM's speculators reader
    takes it (it requires ``speculators_config.proposal_methods[0].speculative_tokens``
    and ``speculators_config.verifier.name_or_path``)."""
    return {
        "architectures": [SPECULATORS_ARCHITECTURE],
        "speculators_model_type": "eagle3",
        "transformer_layer_config": _layer_config(draft),
        "draft_vocab_size": int(draft.d2t.numel()),
        "target_hidden_size": int(draft.target_hidden_size),
        "eagle_aux_hidden_state_layer_ids": [i + 1 for i in draft.aux_layers],
        "norm_before_residual": False,  # vLLM's reader defaults it to true
        "norm_before_fc": False,
        "fc_norm": False,
        "norm_output": False,
        "embed_requires_grad": False,
        "speculators_config": {
            "algorithm": "eagle3",
            "proposal_methods": [{"proposal_type": "greedy",
                                  "speculative_tokens": SPECULATIVE_TOKENS,
                                  "verifier_accept_k": 1, "accept_tolerance": 0.0}],
            "default_proposal_method": "greedy",
            "verifier": _verifier(target),
        },
        "torch_dtype": _dtype_name(draft),
    }


def _verifier(target) -> dict:
    """speculators' ``VerifierConfig`` of ``target`` (a model, a config, a Hub id or path,
    or None): its ``name_or_path`` (a local directory made absolute: the draft directory
    is read from anywhere) and ``architectures``."""
    if target is None:
        return {"name_or_path": None, "architectures": []}
    if isinstance(target, (str, os.PathLike)):
        name = os.fspath(target)
        if os.path.isdir(name):
            name = os.path.abspath(name)
        file = os.path.join(name, "config.json")
        arch = []
        if os.path.isfile(file):
            with open(file) as f:
                arch = json.load(f).get("architectures") or []
        return {"name_or_path": name, "architectures": list(arch)}
    config = getattr(target, "config", target)
    name = getattr(config, "_name_or_path", None) or getattr(config, "name_or_path", None)
    arch = getattr(config, "architectures", None) or (
        [type(target).__name__] if config is not target else [])
    if name and os.path.isdir(name):
        name = os.path.abspath(name)
    return {"name_or_path": name or None, "architectures": list(arch)}


def _read_config(path: str) -> _Spec:
    """Parse ``path``/config.json into a ``_Spec``.

    Raises:
        ValueError: no config.json, or a config of neither format, or one describing a
            variant ``Eagle3Draft`` does not implement.
    """
    file = os.path.join(path, "config.json")
    if not os.path.isfile(file):
        raise ValueError(f"{path!r} has no config.json: not an exported Eagle3 draft")
    with open(file) as f:
        config = json.load(f)
    if "speculators_model_type" in config:
        return _speculators_spec(config, file)
    if SGLANG_ARCHITECTURE in (config.get("architectures") or ()):
        return _sglang_spec(config, file)
    raise ValueError(f"{file} is neither an SGLang Eagle3 config (architectures "
                     f"[{SGLANG_ARCHITECTURE!r}]) nor a speculators one "
                     f"(speculators_model_type 'eagle3'); got architectures "
                     f"{config.get('architectures')!r}")


def _sglang_spec(config: dict, file: str) -> _Spec:
    """The SGLang format: the layer config at the top level, aux ids in ``eagle_config``.

    Raises:
        ValueError: more than one layer, no fc (``use_aux_hidden_state`` false), per-input
            fc norms, or no final norm before the head (SpecForge's ``fc_norm`` and
            ``norm_output`` flags).
    """
    eagle = config.get("eagle_config") or {}
    _refuse(file, [("num_hidden_layers", config.get("num_hidden_layers", 1) != 1),
                   ("eagle_config.use_aux_hidden_state",
                    not eagle.get("use_aux_hidden_state", True)),
                   ("fc_norm", bool(config.get("fc_norm", False))),
                   ("norm_output", not config.get("norm_output", True)),
                   # ModelOpt's export writes these (docs/modelopt.md, "Serving")
                   ("eagle_config.use_last_layernorm", not eagle.get("use_last_layernorm", True)),
                   ("eagle_config.use_mtp_layernorm", bool(eagle.get("use_mtp_layernorm", False))),
                   ("eagle_config.parallel_draft_step",
                    eagle.get("parallel_draft_step", 1) != 1)])
    _require(config, file)
    ids = eagle.get("eagle_aux_hidden_state_layer_ids")
    return _Spec("sglang", config, _target_hidden(config, config),
                 None if ids is None else tuple(int(i) for i in ids),
                 config.get("draft_vocab_size"))


def _speculators_spec(config: dict, file: str) -> _Spec:
    """The speculators format: the layer config under ``transformer_layer_config``, aux ids
    in hidden-states indexing (one more than ours).

    Raises:
        ValueError: another algorithm, more than one layer, ``norm_before_residual`` absent
            (vLLM would read true, speculators false) or true, or any of speculators'
            extra norms (``norm_before_fc``, ``fc_norm``, ``norm_output``).
    """
    kind = config["speculators_model_type"]
    if kind != "eagle3":
        raise ValueError(f"{file}: speculators_model_type is {kind!r}, not 'eagle3'")
    layer = config.get("transformer_layer_config")
    if not isinstance(layer, dict):
        raise ValueError(f"{file}: transformer_layer_config is missing or not an object")
    if "norm_before_residual" not in config:
        raise ValueError(f"{file} does not say norm_before_residual (vLLM reads a missing "
                         f"one as true, speculators as false); refusing to guess")
    _refuse(file, [("transformer_layer_config.num_hidden_layers",
                    layer.get("num_hidden_layers", 1) != 1)]
            + [(k, bool(config.get(k, False)))
               for k in ("norm_before_residual", "norm_before_fc", "fc_norm", "norm_output")])
    _require(layer, file)
    ids = config.get("eagle_aux_hidden_state_layer_ids")
    return _Spec("speculators", layer, _target_hidden(config, layer),
                 None if ids is None else tuple(int(i) - 1 for i in ids),
                 config.get("draft_vocab_size"))


def _refuse(file: str, flags: list[tuple[str, bool]]) -> None:
    """Raise for the config keys whose value ``Eagle3Draft`` cannot represent.

    Raises:
        ValueError: naming every such key.
    """
    bad = [key for key, set_ in flags if set_]
    if bad:
        raise ValueError(f"{file} describes a draft that Eagle3Draft does not implement "
                         f"(one Llama layer, fc of three aux states, residual before "
                         f"hidden_norm, norm before lm_head): see {bad}")


def _require(layer: dict, file: str) -> None:
    """Raise unless the layer config has the sizes the draft is built from.

    Raises:
        ValueError: naming the missing keys.
    """
    missing = [k for k in ("hidden_size", "intermediate_size", "num_attention_heads",
                           "vocab_size") if layer.get(k) is None]
    if missing:
        raise ValueError(f"{file}: the layer config lacks {missing}")


def _target_hidden(config: dict, layer: dict) -> int:
    """``target_hidden_size``, defaulting to the draft's width as both servers do."""
    return int(config.get("target_hidden_size") or layer["hidden_size"])


def _llama_config(layer: dict):
    """The draft layer's ``LlamaConfig`` from the file's layer config (RoPE through the
    transformers 4 keys, which transformers 5 converts, plus ``rope_parameters`` verbatim,
    which transformers 5 prefers)."""
    from transformers import LlamaConfig

    keys = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads",
            "head_dim", "hidden_act", "rms_norm_eps", "vocab_size", "max_position_embeddings",
            "mlp_bias")
    kwargs = {k: layer[k] for k in keys if layer.get(k) is not None}
    return LlamaConfig(**kwargs, **_rope_kwargs(layer), num_hidden_layers=1,
                       tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                       pad_token_id=None)


def _rope_kwargs(layer: dict) -> dict:
    """LlamaConfig's RoPE arguments for a layer config written by either transformers
    generation (``rope_parameters``, or ``rope_theta`` + ``rope_scaling``)."""
    params = layer.get("rope_parameters")
    if params:
        scaling = {k: v for k, v in params.items() if k != "rope_theta"}
        default = scaling.get("rope_type", scaling.get("type", "default")) == "default"
        return {"rope_parameters": dict(params), "rope_theta": params["rope_theta"],
                "rope_scaling": None if default else scaling}
    return {"rope_theta": layer.get("rope_theta", 10000.0),
            "rope_scaling": layer.get("rope_scaling")}


def _read_weights(path: str) -> dict[str, torch.Tensor]:
    """The tensors of ``path``/model.safetensors (on the CPU).

    Raises:
        ValueError: no model.safetensors.
    """
    from safetensors.torch import load_file

    file = os.path.join(path, "model.safetensors")
    if not os.path.isfile(file):
        raise ValueError(f"{path!r} has no model.safetensors")
    return load_file(file)


def _sglang_names(weights: dict, spec: _Spec) -> dict:
    """``weights`` of an SGLang-format file with its one layer named "midlayer.": ModelOpt's
    export names it "layers.0." (vLLM renames "midlayer." to that, so both read the same)."""
    if spec.format != "sglang" or any(k.startswith(_MIDLAYER) for k in weights):
        return weights
    return {_MIDLAYER + k[len(_LAYER_ZERO):] if k.startswith(_LAYER_ZERO) else k: t
            for k, t in weights.items()}


def _with_t2d(weights: dict, spec: _Spec) -> dict:
    """``weights`` with ``t2d`` added where the file has ``d2t`` alone (ModelOpt's export):
    the indicator of the target ids ``d2t`` gives (ids outside the vocabulary are left to
    ``_draft_ids`` to name)."""
    d2t = weights.get("d2t")
    if d2t is None or "t2d" in weights or d2t.dtype.is_floating_point or d2t.dim() != 1:
        return weights
    vocab = int(spec.layer["vocab_size"])
    ids = d2t.long() + torch.arange(d2t.numel())
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[ids[(ids >= 0) & (ids < vocab)]] = True
    return {**weights, "t2d": t2d}


def _draft_ids(weights: dict, spec: _Spec) -> torch.Tensor:
    """[Vd] target id of each draft token (``d2t`` + arange), checked against the config
    and against ``t2d``.

    Raises:
        ValueError: ``d2t`` or ``t2d`` missing (both may be, for a whole-vocabulary draft:
            the identity) or not integer / bool vectors, ids outside
            the target vocabulary or repeated, a length other than the config's
            ``draft_vocab_size``, or a ``t2d`` that is not the indicator of these ids.
    """
    d2t, t2d = weights.get("d2t"), weights.get("t2d")
    vocab = int(spec.layer["vocab_size"])
    head = weights.get(_file_name("lm_head.weight", spec.format))
    if d2t is None and t2d is None and spec.draft_vocab_size in (None, vocab) and (
            head is None or head.shape[0] == vocab):
        return torch.arange(vocab)  # a whole-vocabulary draft: the identity mapping
    if d2t is None or t2d is None:
        missing = [n for n, t in (("d2t", d2t), ("t2d", t2d)) if t is None]
        raise ValueError(f"model.safetensors lacks {missing} (the draft vocabulary)")
    if d2t.dim() != 1 or d2t.dtype.is_floating_point or d2t.dtype == torch.bool:
        raise ValueError(f"d2t must be an integer vector, got {d2t.dtype} {tuple(d2t.shape)}")
    if t2d.dtype != torch.bool or tuple(t2d.shape) != (vocab,):
        raise ValueError(f"t2d must be a bool vector of the target vocabulary ({vocab}), got "
                         f"{t2d.dtype} {tuple(t2d.shape)}")
    ids = d2t.long() + torch.arange(d2t.numel())
    if spec.draft_vocab_size is not None and d2t.numel() != spec.draft_vocab_size:
        raise ValueError(f"d2t has {d2t.numel()} entries but draft_vocab_size is "
                         f"{spec.draft_vocab_size}")
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"d2t maps draft ids outside the target vocabulary [0, {vocab})")
    expected = torch.zeros(vocab, dtype=torch.bool)
    expected[ids] = True
    if int(expected.sum()) != ids.numel() or not torch.equal(expected, t2d):
        raise ValueError("t2d is not the indicator of the target ids that d2t gives (or d2t "
                         "repeats an id)")
    return ids


def _our_state(weights: dict, format: str, draft: Eagle3Draft, path: str) -> dict:
    """Our state dict from the file's tensors (``embed_tokens.weight`` only if present).

    Raises:
        ValueError: naming tensors missing, unexpected, or of another shape than the
            config implies.
    """
    ours = draft.state_dict()
    names = {_file_name(k, format): k for k in ours}
    optional = {_EMBEDDING} | (set(_MAPPING) if draft.whole_vocabulary else set())
    missing = sorted(n for n, k in names.items() if n not in weights and k not in optional)
    unexpected = sorted(n for n in weights if n not in names)
    wrong = [f"{n} {tuple(t.shape)} (expected {tuple(ours[names[n]].shape)})"
             for n, t in weights.items()
             if n in names and tuple(t.shape) != tuple(ours[names[n]].shape)]
    problems = ([f"missing {missing}"] if missing else []) + (
        [f"unexpected {unexpected}"] if unexpected else []) + (
        [f"misshapen {wrong}"] if wrong else [])
    if problems:
        raise ValueError(f"{path!r}: model.safetensors does not match its config.json: "
                         + "; ".join(problems))
    state = {names[n]: t for n, t in weights.items()}
    for name in _MAPPING:  # absent for a whole-vocabulary draft: the identity, as built
        state.setdefault(name, ours[name])
    state["d2t"] = state["d2t"].long()
    return state


def _given_embedding(embed_tokens, draft: Eagle3Draft, state: dict, path: str) -> torch.Tensor:
    """``embed_tokens`` checked and cast to the draft's dtype (a copy: the draft does not
    share the target's storage).

    Raises:
        ValueError: none given, or of the wrong shape.
    """
    if embed_tokens is None:
        raise ValueError(f"{path!r} holds no embed_tokens.weight (servers take the target's): "
                         f"pass embed_tokens=target.get_input_embeddings().weight")
    expected = tuple(draft.embed_tokens.weight.shape)
    if tuple(embed_tokens.shape) != expected:
        raise ValueError(f"embed_tokens has shape {tuple(embed_tokens.shape)}, expected "
                         f"{expected} (target vocabulary x draft width)")
    return embed_tokens.detach().to("cpu", state["lm_head.weight"].dtype, copy=True)


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
