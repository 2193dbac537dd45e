"""Mask keys (what compiled code passes instead of mask objects) and value-keyed masks."""

import pytest
import torch

from ringattn import masks


def test_equal_masks_share_a_key_and_different_ones_do_not():
    real = torch.tensor([[0, 1, 1, 1], [1, 1, 1, 1]], dtype=torch.bool)
    a, b = masks.key_mask(real), masks.key_mask(real.clone())
    assert a is not b and masks.mask_key(a) == masks.mask_key(b)
    other = masks.key_mask(torch.ones(2, 4, dtype=torch.bool))
    assert masks.mask_key(other) != masks.mask_key(a)
    assert masks.mask_key(masks.chunked(8, (0, 3))) == masks.chunked_key(8, (0, 3))
    assert masks.mask_key(None) == -1
    assert masks.and_keys(-1, masks.mask_key(a)) == masks.mask_key(a)


def test_key_mask_and_chunked_evaluate_as_defined():
    real = torch.tensor([[0, 0, 1, 1, 1], [1, 1, 1, 1, 1]], dtype=torch.bool)
    pos = torch.arange(5)
    vis = masks.evaluate(masks.key_mask(real) & masks.chunked(2, (2, 0)), 5, pos, pos, 2, 1)
    q, kv = pos.view(-1, 1), pos.view(1, -1)
    for b, off in enumerate((2, 0)):
        want = real[b][kv] & ((q - off) // 2 == (kv - off) // 2)
        assert torch.equal(vis[b, 0], want.expand(5, 5)), b


def test_forgotten_keys_are_reported_not_reused(monkeypatch):
    monkeypatch.setattr(masks, "MASK_KEYS_KEPT", 2)
    keys = [masks.mask_key(masks.prefix_lm(n)) for n in range(100, 104)]
    assert len(set(keys)) == 4
    assert masks.registered_mask(keys[-1]) == masks.prefix_lm(103)
    with pytest.raises(ValueError, match="no mask has key"):
        masks.registered_mask(keys[0])
