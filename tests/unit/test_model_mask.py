"""What the transformers integration's mask object lets a model do with it: a slice that keeps
every row and column (Gemma 4 before its KV-shared layers, logits_to_keep=0) is the mask
itself; any other use as a tensor is refused with check_model's reason."""

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
