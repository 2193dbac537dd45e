"""Eagle3 pieces that need no process group: the soft cross-entropy's own backward, the
draft vocabulary, the auxiliary layers, padding checks."""

import pytest
import torch

from ringattn.eagle3 import Lookahead, aux_layer_ids, draft_vocabulary, shard_target_outputs
from ringattn.eagle3.draft import _SoftCrossEntropy


def test_soft_cross_entropy_matches_autograd_of_the_formula():
    """The hand-written backward (teacher taken again, logits and lse kept) against autograd
    of scale * sum(active * -(p * log_softmax(z)).sum(-1)), in float64, with shifted and
    filled teacher rows."""
    g = torch.Generator().manual_seed(0)
    b, s, v, k = 2, 9, 7, 3
    teacher = torch.softmax(torch.randn(b, s, v, generator=g, dtype=torch.float64), -1)
    ahead = Lookahead(group=None, layout="contiguous", seqlen=s, width=4)
    ext = ahead.extend(teacher)
    z = torch.randn(b, s, v, generator=g, dtype=torch.float64, requires_grad=True)
    active = torch.rand(b, s, generator=g) < 0.7
    ours = _SoftCrossEntropy.apply(z, active, 0.25, ahead, ext, k)
    (dz,) = torch.autograd.grad(ours, z)
    z2 = z.detach().clone().requires_grad_()
    p = torch.zeros_like(teacher)
    p[:, : s - k] = teacher[:, k:]  # the shift, past the end filled with 0
    plain = 0.25 * (active * -(p * torch.log_softmax(z2, -1)).sum(-1)).sum()
    plain.backward()
    assert torch.allclose(ours, plain, rtol=1e-12, atol=0)
    assert torch.allclose(dz, z2.grad, rtol=1e-10, atol=1e-14)
    assert torch.autograd.gradcheck(
        lambda zz: _SoftCrossEntropy.apply(zz, active, 0.25, ahead, ext, k), (z.detach().requires_grad_(),))


def test_draft_vocabulary_is_the_most_frequent_ids_lower_first_on_ties():
    ids = torch.tensor([5, 5, 5, 2, 2, 9, 9, 1])
    assert draft_vocabulary(ids, 10, 3).tolist() == [2, 5, 9]
    assert draft_vocabulary(ids, 10, 4).tolist() == [1, 2, 5, 9]
    assert draft_vocabulary(ids, 10, 5).tolist() == [0, 1, 2, 5, 9]  # unseen: lowest id first
    with pytest.raises(ValueError, match="draft vocabulary size"):
        draft_vocabulary(ids, 10, 11)


def test_aux_layers_follow_eagle3_and_stay_inside_the_model():
    assert aux_layer_ids(32) == (1, 15, 28)  # SpecForge's default
    assert aux_layer_ids(7) == (1, 2, 3)
    for n in range(3, 40):  # strictly increasing, inside the model, whatever n
        ids = aux_layer_ids(n)
        assert 0 <= ids[0] < ids[1] < ids[2] < n, (n, ids)
    # below 7 layers: distinct, and below the last layer (SGLang's capture loop stops before
    # it) wherever there are enough layers
    assert [aux_layer_ids(n) for n in (3, 4, 5, 6)] == [(0, 1, 2), (0, 1, 2), (0, 2, 3), (0, 2, 4)]
    for n in range(4, 40):
        assert aux_layer_ids(n)[2] <= n - 2, n
    with pytest.raises(ValueError, match="three distinct"):
        aux_layer_ids(2)


def test_left_padding_and_missing_tensors_are_refused():
    ids = torch.zeros(2, 5, dtype=torch.long)
    base = {"input_ids": ids, "aux_hidden": torch.zeros(2, 5, 6), "logits": torch.zeros(2, 5, 4)}
    left = torch.tensor([[1, 1, 1, 1, 1], [0, 0, 1, 1, 1]])
    with pytest.raises(ValueError, match="right padded"):
        shard_target_outputs({**base, "attention_mask": left})
    with pytest.raises(ValueError, match="logits"):
        shard_target_outputs({k: v for k, v in base.items() if k != "logits"})
    with pytest.raises(ValueError, match=r"aux_hidden.*\[B=2, S=5"):
        shard_target_outputs({**base, "aux_hidden": torch.zeros(2, 4, 6)})
    right = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    assert shard_target_outputs({**base, "attention_mask": right}).valid_len == (5, 3)
    assert shard_target_outputs(base).valid_len is None
