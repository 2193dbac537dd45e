"""What the transformers integration's mask object lets a model do with it: a slice that keeps
every row and column (Gemma 4 before its KV-shared layers, logits_to_keep=0) is the mask
itself; any other use as a tensor is refused with check_model's reason. And a mask function
that unites the requested mask with another (a prefix-LM's blocks) is marked custom, which
the attention function refuses."""

import pytest

pytest.importorskip("transformers")

from ringattn.integrations.transformers import ModelMask  # noqa: E402


def test_a_slice_of_every_row_and_column_is_the_mask():
    mask = ModelMask("sliding", 7, family="gemma4_text")
    assert mask[:, :, slice(0, None), :] is mask  # Gemma 4: slice(-logits_to_keep, None), 0
    assert mask[:, :, :, :] is mask and mask[:] is mask
    assert mask[slice(None, None, 1)] is mask


@pytest.mark.parametrize("index", [
    (slice(None), slice(None), slice(-1, None), slice(None)),  # logits_to_keep=1: last row
    (slice(None), slice(None), slice(0, 5), slice(None)),
    (slice(None), slice(None), slice(None, None, 2), slice(None)),
    (slice(None), 0, slice(None), slice(None)),  # an index, not a slice
    0,
])
def test_any_other_indexing_is_refused(index):
    mask = ModelMask("causal", family="gemma4_text")
    with pytest.raises(ValueError, match="gemma4_text computes attention itself"):
        mask[index]


def test_arithmetic_is_refused():
    mask = ModelMask("causal", family="mpt")
    with pytest.raises(ValueError, match="mpt computes attention itself"):
        mask + 1.0
    with pytest.raises(ValueError, match="mpt computes attention itself"):
        mask * 2.0


def test_a_mask_united_with_another_is_marked_custom():
    """transformers unites a prefix-LM's bidirectional blocks (``block_sequence_ids``) with the
    causal mask without ``use_vmap``: the mask function must notice the union itself."""
    import torch
    from transformers import LlamaConfig
    from transformers import masking_utils as mu

    from ringattn.integrations.transformers.attention import _model_mask

    config = LlamaConfig(vocab_size=97, hidden_size=64, num_hidden_layers=1,
                         num_attention_heads=4)
    ids = torch.tensor([[0, 0, 0, -1, -1]])
    prefix = mu.or_masks(mu.causal_mask_function, mu.blockwise_overlay(ids))
    packed = mu.and_masks(mu.remap_positions_for_packed_sequence(
        mu.causal_mask_function, torch.arange(5)[None]), mu.packed_sequence_mask_function(ids))
    assert _model_mask(mask_function=prefix, config=config).custom
    assert _model_mask(mask_function=mu.and_masks(packed, prefix), config=config).custom
    assert not _model_mask(mask_function=mu.causal_mask_function, config=config).custom
    assert not _model_mask(mask_function=mu.sliding_window_causal_mask_function(7),
                           local_size=7, config=config).custom
    assert not _model_mask(mask_function=packed, config=config).custom  # positions: the ring's
