"""Eagle3 draft export in SGLang's and speculators' formats: names, shapes, dtypes and
config keys as the servers read them (docs/eagle3_formats.md), a bit-for-bit round trip
through load_draft, and the errors."""

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from ringattn.eagle3 import Eagle3Draft, dense_ttt_attention, export_draft, load_draft
from ringattn.apps.eagle3_train import Eagle3Config, build_draft, build_target, draft_config, train_eagle3

CFG = Eagle3Config(vocab=96, draft_vocab=48, hidden=64, heads=4, kv_heads=2, intermediate=128,
                   target_layers=4)
DRAFT_IDS = torch.arange(0, 96, 2)
LAYER = {  # our name -> (the servers' name inside the decoder layer, shape)
    "input_layernorm.weight": ("input_layernorm.weight", (64,)),
    "hidden_norm.weight": ("hidden_norm.weight", (64,)),
    "post_attention_layernorm.weight": ("post_attention_layernorm.weight", (64,)),
    "q_proj.weight": ("self_attn.q_proj.weight", (64, 128)),  # input [embed; hidden]
    "k_proj.weight": ("self_attn.k_proj.weight", (32, 128)),
    "v_proj.weight": ("self_attn.v_proj.weight", (32, 128)),
    "o_proj.weight": ("self_attn.o_proj.weight", (64, 64)),
    "mlp.gate_proj.weight": ("mlp.gate_proj.weight", (128, 64)),
    "mlp.up_proj.weight": ("mlp.up_proj.weight", (128, 64)),
    "mlp.down_proj.weight": ("mlp.down_proj.weight", (64, 128)),
}
TOP = {"fc.weight": (64, 192), "norm.weight": (64,), "lm_head.weight": (48, 64),
       "d2t": (48,), "t2d": (96,)}
LAYER_KEYS = {"model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
              "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
              "hidden_act": "silu", "vocab_size": 96, "num_hidden_layers": 1,
              "tie_word_embeddings": False, "rope_theta": 10000.0,
              "rope_parameters": {"rope_theta": 10000.0, "rope_type": "default"}}


@pytest.fixture(scope="module")
def target():
    return build_target(CFG, "sdpa")


def _draft(target, dtype):
    """A draft with random weights and the target's embedding (as training leaves it)."""
    draft = build_draft(CFG, target, DRAFT_IDS)
    with torch.no_grad():
        for name, p in draft.named_parameters():
            if name != "embed_tokens.weight":
                p.normal_(generator=torch.Generator().manual_seed(p.numel()))
    return draft.to(dtype)


def _expected_names(prefix):
    return {prefix + theirs: shape for theirs, shape in LAYER.values()} | TOP


def _check_tensors(path, prefix, dtype, extra=()):
    w = load_file(path / "model.safetensors")
    expected = _expected_names(prefix) | dict(extra)
    assert sorted(w) == sorted(expected)
    for name, shape in expected.items():
        assert tuple(w[name].shape) == shape, name
        want = {"d2t": torch.int64, "t2d": torch.bool}.get(name, dtype)
        assert w[name].dtype == want, name
    assert torch.equal(w["d2t"] + torch.arange(48), DRAFT_IDS)
    assert torch.equal(w["t2d"].nonzero().flatten(), DRAFT_IDS)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sglang_format(tmp_path, target, dtype):
    draft = _draft(target, dtype)
    export_draft(draft, tmp_path, "sglang", target=target)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert {k: config[k] for k in LAYER_KEYS} == LAYER_KEYS
    assert "rope_scaling" not in config  # default RoPE: transformers 4 reads rope_theta alone
    assert config["rms_norm_eps"] == draft.config.rms_norm_eps
    assert config["max_position_embeddings"] == draft.config.max_position_embeddings
    assert config["draft_vocab_size"] == 48 and config["target_hidden_size"] == 64
    assert config["torch_dtype"] == str(dtype).removeprefix("torch.")
    # decoder-layer indices whose outputs are read (aux_layer_ids(4))
    assert config["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [0, 1, 2],
                                      "use_aux_hidden_state": True}
    _check_tensors(tmp_path, "midlayer.", dtype)  # no embedding: SGLang uses the target's
    _round_trip(draft, load_draft(tmp_path, embed_tokens=target.get_input_embeddings().weight))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculators_format(tmp_path, target, dtype):
    draft = _draft(target, dtype)
    export_draft(draft, tmp_path, "speculators", target=target)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["Eagle3Speculator"]
    assert config["speculators_model_type"] == "eagle3"
    assert config["norm_before_residual"] is False  # written out: vLLM defaults to true
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 2, 3]  # hidden-states indices
    layer = config["transformer_layer_config"]
    assert {k: layer[k] for k in LAYER_KEYS} == LAYER_KEYS
    assert config["draft_vocab_size"] == 48 and config["target_hidden_size"] == 64
    spec = config["speculators_config"]
    assert spec["algorithm"] == "eagle3" and spec["default_proposal_method"] == "greedy"
    assert spec["proposal_methods"][0]["speculative_tokens"] >= 1  # vLLM requires it
    assert spec["verifier"] == {"name_or_path": None, "architectures": ["LlamaForCausalLM"]}
    _check_tensors(tmp_path, "layers.0.", dtype, {"embed_tokens.weight": (96, 64)})
    _round_trip(draft, load_draft(tmp_path))


def test_speculators_verifier_by_name(tmp_path, target):
    export_draft(_draft(target, torch.float32), tmp_path, "speculators", target="org/model")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_config"]["verifier"] == {"name_or_path": "org/model",
                                                        "architectures": []}


def test_sglang_keeps_the_embedding_of_a_draft_of_another_width(tmp_path, target):
    """SGLang substitutes the target's embedding only when the widths agree."""
    narrow = draft_config(target.config)
    narrow.hidden_size, narrow.head_dim = 32, 8
    draft = Eagle3Draft(narrow, 64, DRAFT_IDS, (0, 2, 3))
    export_draft(draft, tmp_path, "sglang")
    w = load_file(tmp_path / "model.safetensors")
    assert w["embed_tokens.weight"].shape == (96, 32) and w["fc.weight"].shape == (32, 192)
    _round_trip(draft, load_draft(tmp_path))


def _round_trip(draft, back):
    """Every parameter and buffer (RoPE's included) equal with its dtype, the same
    vocabulary and aux layers, and the same logits on one input."""
    for kind in ("named_parameters", "named_buffers"):
        ours, theirs = dict(getattr(draft, kind)()), dict(getattr(back, kind)())
        assert sorted(ours) == sorted(theirs)
        for name, t in ours.items():
            assert t.dtype == theirs[name].dtype and torch.equal(t, theirs[name]), name
    assert back.aux_layers == draft.aux_layers
    assert back.target_hidden_size == draft.target_hidden_size
    assert not back.embed_tokens.weight.requires_grad
    assert torch.equal(_logits(draft), _logits(back))


@torch.no_grad()
def _logits(draft):
    g = torch.Generator().manual_seed(3)
    dtype, h = draft.lm_head.weight.dtype, draft.config.hidden_size
    embeds = torch.randn(2, 9, h, generator=g).to(dtype)
    aux = torch.randn(2, 9, 3 * draft.target_hidden_size, generator=g).to(dtype)
    pos = torch.arange(9).expand(2, 9)
    return draft.logits(draft.layer(embeds, draft.fc(aux), pos, ([], []), dense_ttt_attention))


def _edit_config(path, **changes):
    config = json.loads((path / "config.json").read_text())
    for key, value in changes.items():
        if value is None:
            config.pop(key, None)
        else:
            config[key] = value
    (path / "config.json").write_text(json.dumps(config))


def _edit_tensors(path, drop=(), **changes):
    w = load_file(path / "model.safetensors")
    w = {k: v for k, v in w.items() if k not in drop} | changes
    save_file(w, path / "model.safetensors")


def test_export_errors(tmp_path, target):
    draft = _draft(target, torch.float32)
    with pytest.raises(ValueError, match="format must be one of"):
        export_draft(draft, tmp_path, "onnx")
    with pytest.raises(ValueError, match="auxiliary layers"):
        export_draft(Eagle3Draft(draft.config, 64, DRAFT_IDS), tmp_path, "sglang")
    with torch.no_grad():
        draft.embed_tokens.weight.add_(1.0)
    with pytest.raises(ValueError, match="differ from the target's input embedding"):
        export_draft(draft, tmp_path, "sglang", target=target)
    export_draft(draft, tmp_path, "speculators", target=target)  # keeps its own: fine


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_load_errors_name_the_tensors(tmp_path, target, fmt):
    prefix = "midlayer." if fmt == "sglang" else "layers.0."
    export_draft(_draft(target, torch.float32), tmp_path, fmt)
    emb = target.get_input_embeddings().weight
    _edit_tensors(tmp_path, drop=[prefix + "mlp.up_proj.weight"],
                  **{"fc.weight": torch.zeros(64, 190), "extra.weight": torch.zeros(2)})
    with pytest.raises(ValueError) as err:
        load_draft(tmp_path, embed_tokens=emb)
    for name in (prefix + "mlp.up_proj.weight", "fc.weight (64, 190)", "extra.weight"):
        assert name in str(err.value)


def test_load_errors(tmp_path, target):
    with pytest.raises(ValueError, match="no config.json"):
        load_draft(tmp_path / "none")
    draft = _draft(target, torch.float32)
    export_draft(draft, tmp_path, "sglang")
    with pytest.raises(ValueError, match="holds no embed_tokens"):
        load_draft(tmp_path)
    with pytest.raises(ValueError, match="embed_tokens has shape"):
        load_draft(tmp_path, embed_tokens=torch.zeros(96, 32))
    t2d = draft.t2d.clone()
    t2d[1] = True
    _edit_tensors(tmp_path, t2d=t2d)
    with pytest.raises(ValueError, match="t2d is not the indicator"):
        load_draft(tmp_path, embed_tokens=draft.embed_tokens.weight)
    _edit_config(tmp_path, architectures=["LlamaForCausalLM"])
    with pytest.raises(ValueError, match="neither an SGLang Eagle3 config"):
        load_draft(tmp_path)
    export_draft(draft, tmp_path, "speculators")
    _edit_config(tmp_path, norm_before_residual=None)
    with pytest.raises(ValueError, match="refusing to guess"):
        load_draft(tmp_path)
    _edit_config(tmp_path, norm_before_residual=True)
    with pytest.raises(ValueError, match="norm_before_residual"):
        load_draft(tmp_path)
    _edit_config(tmp_path, speculators_model_type="dflash")
    with pytest.raises(ValueError, match="not 'eagle3'"):
        load_draft(tmp_path)


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_scaled_rope(tmp_path, target, fmt):
    """A non-default RoPE is written three ways and read back exactly."""
    config = draft_config(target.config)
    config.rope_parameters = {"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5}
    draft = Eagle3Draft(config, 64, DRAFT_IDS, (0, 2, 3))
    export_draft(draft, tmp_path, fmt)
    written = json.loads((tmp_path / "config.json").read_text())
    layer = written if fmt == "sglang" else written["transformer_layer_config"]
    assert layer["rope_theta"] == 5e5 and layer["rope_parameters"] == config.rope_parameters
    assert layer["rope_scaling"] == {"rope_type": "linear", "factor": 2.0}
    back = load_draft(tmp_path, embed_tokens=draft.embed_tokens.weight)
    assert back.config.rope_parameters == config.rope_parameters
    _round_trip(draft, back)


def test_load_reads_transformers_4_rope_keys(tmp_path, target):
    """A config with only rope_theta / rope_scaling (SpecForge under transformers 4)."""
    draft = _draft(target, torch.float32)
    export_draft(draft, tmp_path, "sglang")
    _edit_config(tmp_path, rope_parameters=None, rope_theta=10000.0)
    _round_trip(draft, load_draft(tmp_path, embed_tokens=draft.embed_tokens.weight))


@pytest.mark.parametrize("fmt", ["sglang", "speculators"])
def test_whole_vocabulary_exports_without_a_mapping(tmp_path, target, fmt):
    """Vd = V is the identity: no d2t / t2d in the file (vLLM registers
    draft_id_to_target_id only when Vd < V and refuses a tensor it has no parameter for);
    load_draft reads it back as the identity, and still reads a file that has them."""
    draft = build_draft(CFG, target, torch.arange(96))
    assert draft.whole_vocabulary
    export_draft(draft, tmp_path / "plain", fmt, target=target)
    w = load_file(tmp_path / "plain" / "model.safetensors")
    assert "d2t" not in w and "t2d" not in w and w["lm_head.weight"].shape == (96, 64)
    config = json.loads((tmp_path / "plain" / "config.json").read_text())
    assert config["draft_vocab_size"] == 96
    embed = target.get_input_embeddings().weight
    back = load_draft(tmp_path / "plain", embed_tokens=embed)
    _round_trip(draft, back)
    assert torch.equal(back.draft_ids, torch.arange(96))
    # a file that carries the identity mapping anyway (older exports) loads the same
    w["d2t"], w["t2d"] = torch.zeros(96, dtype=torch.long), torch.ones(96, dtype=torch.bool)
    save_file(w, tmp_path / "plain" / "model.safetensors")
    _round_trip(draft, load_draft(tmp_path / "plain", embed_tokens=embed))
    # d2t alone (ModelOpt's exports; vLLM ignores t2d) implies t2d and loads the same
    t2d = w.pop("t2d")
    save_file(w, tmp_path / "plain" / "model.safetensors")
    _round_trip(draft, load_draft(tmp_path / "plain", embed_tokens=embed))
    # ... but not when d2t repeats an id (nothing to check it against but itself)
    w["d2t"] = torch.zeros(96, dtype=torch.long)
    w["d2t"][1] = -1  # draft ids 0 and 1 both map to target id 0
    save_file(w, tmp_path / "plain" / "model.safetensors")
    with pytest.raises(ValueError, match="repeats an id"):
        load_draft(tmp_path / "plain", embed_tokens=embed)
    # t2d alone does not order the draft ids: a broken file
    w["t2d"] = t2d
    del w["d2t"]
    save_file(w, tmp_path / "plain" / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks \['d2t'\]"):
        load_draft(tmp_path / "plain", embed_tokens=embed)


def test_a_reduced_vocabulary_without_its_mapping_is_refused(tmp_path, target):
    export_draft(_draft(target, torch.float32), tmp_path, "speculators", target=target)
    w = load_file(tmp_path / "model.safetensors")
    del w["d2t"], w["t2d"]
    save_file(w, tmp_path / "model.safetensors")
    with pytest.raises(ValueError, match=r"lacks \['d2t', 't2d'\]"):
        load_draft(tmp_path)


def test_the_verifier_is_an_absolute_path(tmp_path, target, monkeypatch):
    """A relative target directory is recorded absolute (the draft is read from anywhere);
    so is a model loaded from a relative directory."""
    target.save_pretrained(tmp_path / "tgt")
    monkeypatch.chdir(tmp_path)
    draft = _draft(target, torch.float32)
    for i, given in enumerate(["tgt", "./tgt/"]):
        export_draft(draft, f"out{i}", "speculators", target=given)
        verifier = json.loads((tmp_path / f"out{i}" / "config.json").read_text())[
            "speculators_config"]["verifier"]
        assert verifier == {"name_or_path": str(tmp_path / "tgt"),
                            "architectures": ["LlamaForCausalLM"]}
    from transformers import AutoModelForCausalLM

    loaded = AutoModelForCausalLM.from_pretrained("tgt", local_files_only=True)
    export_draft(draft, "out2", "speculators", target=loaded)
    verifier = json.loads((tmp_path / "out2" / "config.json").read_text())[
        "speculators_config"]["verifier"]
    assert verifier["name_or_path"] == str(tmp_path / "tgt")


def test_draft_ids_must_ascend(target):
    config = draft_config(target.config)
    for ids, match in (([3, 1, 5], "id 1 at index 1 follows 3"),
                       ([1, 1, 5], "id 1 at index 1 follows 1"),
                       ([0, 96], r"lie in \[0, 96\)"), ([], "empty")):
        with pytest.raises(ValueError, match=match):
            Eagle3Draft(config, 64, torch.tensor(ids, dtype=torch.long), (0, 1, 2))
    with pytest.raises(ValueError, match="strictly ascending decoder-layer"):
        Eagle3Draft(config, 64, DRAFT_IDS, (2, 1, 3))


def test_the_training_run_exports_with_its_target_recorded(tmp_path, monkeypatch):
    """The training run's speculators export names a verifier that exists: the given target
    directory made absolute, or the tiny random target saved beside the drafts."""
    monkeypatch.chdir(tmp_path)
    cfg = Eagle3Config(seqlen=20, batch=1, pad=2, vocab=40, draft_vocab=20, hidden=16,
                       heads=4, kv_heads=2, intermediate=32, target_layers=4, steps=1)
    train_eagle3(cfg, progress=False, out_dir="run")
    verifier = json.loads((tmp_path / "run" / "draft-speculators" / "config.json").read_text())[
        "speculators_config"]["verifier"]
    assert verifier == {"name_or_path": str(tmp_path / "run" / "target"),
                        "architectures": ["LlamaForCausalLM"]}
    from ringattn.eagle3.target import load_target

    saved = load_target(verifier["name_or_path"], attn_implementation="sdpa")
    built = build_target(cfg, "sdpa")
    for (name, a), b in zip(saved.state_dict().items(), built.state_dict().values()):
        assert torch.equal(a, b), name
    # a given target directory, relative, recorded absolute
    train_eagle3(Eagle3Config(**{**cfg.__dict__, "target": "run/target"}), progress=False,
                 out_dir="again")
    verifier = json.loads((tmp_path / "again" / "draft-speculators" / "config.json")
                          .read_text())["speculators_config"]["verifier"]
    assert verifier["name_or_path"] == str(tmp_path / "run" / "target")
