"""``ra_hf.tile_mlp``: each decoder layer's per-token MLP in sequence tiles, recomputed in
the backward; the model's output and every gradient equal the untiled model's (float64,
1e-12), in training and in evaluation, with tiles of 1, 4 and more than the sequence, with
the model's own gradient checkpointing, after a deep copy and after torch.save / torch.load
(the ``Tiled...`` class pickles by name: equal bit for bit); a mixture of experts is left as
it is and named; bad arguments are refused by name."""

from __future__ import annotations

import copy
import io

import pytest
import torch

pytest.importorskip("transformers")

from families import build  # noqa: E402

from ringattn.integrations import transformers as ra_hf  # noqa: E402


def _run(model, ids):
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    return out.logits.detach(), out.loss.detach(), grads


def _close(a, b, tol=1e-12):
    return float((a - b).norm()) <= tol * max(float(b.norm()), 1e-30)


@pytest.mark.parametrize("name,tile,checkpointing", [
    ("llama", 1, False), ("llama", 4, True), ("llama", 1000, False), ("gemma2", 3, False),
    ("qwen3", 5, True), ("deepseek_v3", 4, False)])
def test_tiled_mlp_equals_the_untiled_model(name, tile, checkpointing):
    ref = build(name, "eager")
    ref.config._experts_implementation = "eager"  # experts as a loop: grouped_mm takes no float64
    ref = ref.double()
    model = copy.deepcopy(ref)
    report = ra_hf.tile_mlp(model, tile=tile)
    if name == "deepseek_v3":  # a dense layer, then a mixture of experts: left, named
        assert len(report["tiled"]) == 1 and len(report["left"]) == 1
        assert "routes tokens" in next(iter(report["left"].values()))
    else:
        assert len(report["tiled"]) == model.config.num_hidden_layers and not report["left"]
    assert ra_hf.tiled_mlps(model) == tile and ra_hf.tiled_mlps(ref) is None
    if checkpointing:
        for m in (ref, model):
            m.gradient_checkpointing_enable({"use_reentrant": False})
    ids = torch.randint(3, 90, (2, 13), generator=torch.Generator().manual_seed(1))
    want, got = _run(ref, ids), _run(model, ids)
    assert _close(got[0], want[0]) and _close(got[1], want[1])
    assert all(_close(a, b) for a, b in zip(got[2], want[2]))
    with torch.no_grad():
        assert _close(model(input_ids=ids).logits, ref(input_ids=ids).logits)
    again = copy.deepcopy(model)  # the conversion travels with the instance
    assert type(again.model.layers[0].mlp).__name__.startswith("Tiled")
    assert _close(_run(again, ids)[1], want[1])
    if checkpointing:  # transformers' checkpointing hooks a local function: no pickle
        return
    saved = io.BytesIO()  # a saved model (torch.save pickles the Tiled... class by name)
    torch.save(model, saved)
    saved.seek(0)
    loaded = torch.load(saved, weights_only=False)
    assert [type(m) for m in loaded.modules()] == [type(m) for m in model.modules()]
    assert ra_hf.tiled_mlps(loaded) == tile
    mine, theirs = _run(model, ids), _run(loaded, ids)
    assert all(torch.equal(a, b) for a, b in zip((*mine[:2], *mine[2]), (*theirs[:2], *theirs[2])))


def test_experts_only_is_left_and_named():
    """A model whose every MLP routes tokens (Mixtral) is left as it is, each block named
    with why, as the docs say (it once raised); a model with no MLP at all is refused."""
    model = build("mixtral", "eager")
    report = ra_hf.tile_mlp(model, tile=4)
    assert report["tiled"] == [] and len(report["left"]) == model.config.num_hidden_layers
    assert all("routes tokens" in why for why in report["left"].values()), report
    assert ra_hf.tiled_mlps(model) is None
    assert not any(type(m).__name__.startswith("Tiled") for m in model.modules())
    with pytest.raises(ValueError, match="has no per-token MLP to tile .no module named mlp"):
        ra_hf.tile_mlp(torch.nn.Sequential(torch.nn.Linear(2, 2)), tile=4)


def test_bad_arguments():
    model = build("llama", "eager")
    with pytest.raises(ValueError, match="tile must be an int >= 1, got 0"):
        ra_hf.tile_mlp(model, tile=0)
    with pytest.raises(TypeError, match="tile must be an int"):
        ra_hf.tile_mlp(model, tile=2.0)
    with pytest.raises(TypeError, match="tile_mlp takes a torch.nn.Module"):
        ra_hf.tile_mlp(model.config)
