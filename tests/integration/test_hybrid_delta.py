"""The delta-rule hybrids' conversion (integrations/transformers/mixers/delta.py), in one process: which
layers ``convert_mixers`` replaces, that ``check_model`` refuses them unconverted and accepts
them converted, and that Qwen4-Exp needs ``convert`` for its indexed attention. Exactness under context
parallelism is in test_families.py (the survey), test_hybrid_families.py (packed rows,
contiguous layout) and tests/distributed/test_block_indexer.py (Qwen4-Exp)."""

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
def test_qwen4_exp_needs_convert_for_its_indexed_attention():
    """Qwen4-Exp's Gated DeltaNet converts like Qwen3.5's; its indexed attention layers need
    ``convert`` (families/block_indexer.py), which check_model names when it is missing."""
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    model = build("qwen4_exp", "ringattn")
    with pytest.raises(ValueError, match=r"indexed_attention.*convert it first"):
        ra_hf.check_model(model)
    ra_hf.convert(model)
    ra_hf.check_model(model)
    converted = sorted(type(m).__name__ for m in model.modules()
                       if type(m).__name__.startswith("Ring"))
    assert converted == ["RingQwen4ExpTextAttention", "RingQwen4ExpTextGatedDeltaNet"]
