"""The delta-rule hybrids' conversion (integrations/transformers/mixers/delta.py), in one process: which
layers ``convert_mixers`` replaces, that ``check_model`` refuses them unconverted and accepts
them converted, and that Qwen4-Exp is refused with its reason. Exactness under context
parallelism is in test_families.py (the survey) and test_hybrid_families.py (packed rows,
contiguous layout)."""

from __future__ import annotations

import pytest

from families import build

pytest.importorskip("transformers")

LAYERS = {"kimi_linear": "RingKimiLinearDeltaAttention",
          "olmo_hybrid": "RingOlmoHybridGatedDeltaNet",
          "lara_mini": "RingLaraMiniGatedDeltaNet"}


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family", sorted(LAYERS))
def test_converted_layers_and_check_model(family):
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    model = build(family, "ringattn")
    with pytest.raises(ValueError, match=r"convert it first"):
        ra_hf.check_model(model)
    before = {k: v.data_ptr() for k, v in model.state_dict().items()}
    assert ra_hf.convert(model) is model
    ra_hf.check_model(model)
    converted = [type(m).__name__ for m in model.modules() if type(m).__name__.startswith("Ring")]
    assert converted == [LAYERS[family]], converted
    after = {k: v.data_ptr() for k, v in model.state_dict().items()}
    assert after == before  # the same tensors under the same keys


@pytest.mark.timeout(120)
def test_qwen4_exp_is_refused_with_its_reason():
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    model = build("qwen4_exp", "ringattn")
    with pytest.raises(ValueError, match=r"qwen4_exp_text: .*QSA indexer"):
        ra_hf.convert_mixers(model)
    with pytest.raises(ValueError, match=r"Qwen4ExpForCausalLM"):  # unconverted: refused too
        ra_hf.check_model(model)
