"""``eagle3.target.load_target`` with ring attention converts what ``convert`` makes exact
(a hybrid target's sequence mixers), so an online Eagle3 target may be a hybrid, also an
attention-free one (RWKV): its aux layers come from its own block list."""

from __future__ import annotations

import pytest

import torch

from families import FAMILIES

pytest.importorskip("transformers")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", ["mamba", "rwkv"])
def test_load_target_converts_a_hybrid(tmp_path, family):
    from ringattn.eagle3.draft import decoder_layers
    from ringattn.eagle3.target import load_target
    from ringattn.integrations import transformers as ra_hf

    config, cls = FAMILIES[family]()
    config.num_hidden_layers = 4  # Eagle3 reads three distinct layers
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path)
    model = load_target(str(tmp_path))
    assert ra_hf.mixers_converted(model) and ra_hf.converted(model), family
    ra_hf.check_model(model)
    n = len(decoder_layers(model))
    assert max(model.eagle3_aux_layers) < n and len(model.eagle3_aux_layers) == 3
    one = load_target(str(tmp_path), attn_implementation="eager")  # one process: untouched
    assert not ra_hf.mixers_converted(one)


def test_ring_targets_load_through_the_integration(tmp_path, monkeypatch):
    """eagle3 imports no integration: the transformers integration, once imported, hands
    ``load_target`` its loader of "ringattn" targets; without it, "ringattn" is refused by
    name and a one-process implementation still loads."""
    from ringattn.eagle3 import target
    from ringattn.integrations import transformers as ra_hf

    assert target.RING == ra_hf.NAME and target._LOADERS[ra_hf.NAME] is ra_hf.load_pretrained
    config, cls = FAMILIES["llama"]()
    config.num_hidden_layers = 3
    torch.manual_seed(0)
    cls(config).save_pretrained(tmp_path)
    monkeypatch.setattr(target, "_LOADERS", {})
    with pytest.raises(ValueError, match="through the transformers integration: import it"):
        target.load_target(str(tmp_path))
    assert not ra_hf.converted(target.load_target(str(tmp_path), attn_implementation="eager"))
