"""Eagle3 draft export in SGLang's and speculators' formats: names, shapes, dtypes and
config keys as the servers read them, and a bit-for-bit round trip through load_draft."""

import json

import pytest
import torch
from safetensors.torch import load_file

from ringattn.eagle3 import dense_ttt_attention
from ringattn.eagle3.export import export_draft, load_draft
from ringattn.eagle3.train import Eagle3Config, build_draft, build_target

LAYER = ["input_layernorm.weight", "hidden_norm.weight", "post_attention_layernorm.weight",
         "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
         "self_attn.o_proj.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
         "mlp.down_proj.weight"]


def _draft(dtype):
    cfg = Eagle3Config(vocab=96, draft_vocab=48, hidden=64, heads=4, kv_heads=2,
                       intermediate=128, target_layers=4)
    target = build_target(cfg, "sdpa")
    draft = build_draft(cfg, target, torch.arange(0, 96, 2))
    with torch.no_grad():
        for p in draft.parameters():
            p.normal_(generator=torch.Generator().manual_seed(p.numel()))
    return draft.to(dtype), target


def _outputs(draft):
    g = torch.Generator().manual_seed(3)
    b, s = 2, 9
    dt = draft.lm_head.weight.dtype
    embeds = torch.randn(b, s, 64, generator=g).to(dt)
    hidden = torch.randn(b, s, 64, generator=g).to(dt)
    pos = torch.arange(s).expand(b, s)
    out = draft.layer(embeds, hidden, pos, ([], []), dense_ttt_attention)
    return draft.logits(out)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sglang_format(tmp_path, dtype):
    draft, target = _draft(dtype)
    export_draft(draft, tmp_path, "sglang")
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLMEagle3"]
    assert config["draft_vocab_size"] == 48 and config["target_hidden_size"] == 64
    assert config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] == [0, 2, 3]
    assert config["tie_word_embeddings"] is False and config["num_hidden_layers"] == 1
    assert config["rope_theta"] == 10000.0 and config["vocab_size"] == 96
    w = load_file(tmp_path / "model.safetensors")
    assert sorted(w) == sorted(["midlayer." + n for n in LAYER]
                               + ["fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"])
    assert w["d2t"].dtype == torch.int64 and w["t2d"].dtype == torch.bool
    assert w["fc.weight"].shape == (64, 3 * 64) and w["lm_head.weight"].shape == (48, 64)
    assert w["midlayer.self_attn.q_proj.weight"].shape == (64, 128)  # input [embed; hidden]
    assert torch.equal(w["d2t"] + torch.arange(48), torch.arange(0, 96, 2))
    assert int(w["t2d"].sum()) == 48 and w["midlayer.mlp.up_proj.weight"].dtype == dtype
    _round_trip(draft, tmp_path, target)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_speculators_format(tmp_path, dtype):
    draft, target = _draft(dtype)
    export_draft(draft, tmp_path, "speculators", include_embedding=True)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["speculators_model_type"] == "eagle3"
    assert config["norm_before_residual"] is False  # written out: vLLM defaults to true
    assert config["eagle_aux_hidden_state_layer_ids"] == [1, 3, 4]  # hidden-states indexing
    assert config["transformer_layer_config"]["hidden_size"] == 64
    assert config["draft_vocab_size"] == 48 and config["target_hidden_size"] == 64
    w = load_file(tmp_path / "model.safetensors")
    assert "layers.0.self_attn.o_proj.weight" in w and "midlayer.hidden_norm.weight" not in w
    assert w["embed_tokens.weight"].shape == (96, 64)
    _round_trip(draft, tmp_path, None)


def _round_trip(draft, path, target):
    emb = None if target is None else draft.embed_tokens.weight
    back = load_draft(str(path), embed_tokens=emb)
    ours, theirs = draft.state_dict(), back.state_dict()
    assert sorted(ours) == sorted(theirs)
    for name in ours:
        assert ours[name].dtype == theirs[name].dtype and torch.equal(ours[name], theirs[name]), name
    assert back.aux_layers == draft.aux_layers and back.target_hidden_size == 64
    with torch.no_grad():
        assert torch.equal(_outputs(draft), _outputs(back))


def test_errors(tmp_path):
    draft, _ = _draft(torch.float32)
    with pytest.raises(ValueError, match="format must be one of"):
        export_draft(draft, tmp_path, "onnx")
    with pytest.raises(ValueError, match="no config.json"):
        load_draft(str(tmp_path / "none"))
    export_draft(draft, tmp_path, "sglang")
    with pytest.raises(ValueError, match="holds no embed_tokens"):
        load_draft(str(tmp_path))
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"]}))
    with pytest.raises(ValueError, match="neither an SGLang Eagle3 config"):
        load_draft(str(tmp_path))
