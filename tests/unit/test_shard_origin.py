"""``layouts.check_origin``, the one check that a shard made by ``ringattn.shard`` is used
over the group and along the dim it was made with (shard/unshard, ring attention, the
mixers, yunchang's modules and varlen_attention call it), without a process group."""

from __future__ import annotations

import pytest
import torch

from ringattn import varlen
from ringattn.layouts import SHARD_TAG, ShardTag, check_origin


def _tagged(shape, dim, members=(0, 1)):
    t = torch.zeros(shape)
    setattr(t, SHARD_TAG, ShardTag("zigzag", 8, -2, dim, len(shape), tuple(members), 0))
    return t


def test_untagged_and_matching_tensors_pass():
    check_origin("q", torch.zeros(2, 3), (0, 1), "attended", 1, 2)
    check_origin("q", _tagged((1, 4, 2, 3), 1), (0, 1), "attended", 1, 4)
    check_origin("q", _tagged((1, 4, 2, 3), 1), [0, 1], "attended")  # a list of members


def test_other_group_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"over the ranks \[0, 1\] but is mixed over the group "
                                         r"of ranks \[2, 3\]: pass the group"):
        check_origin("x", _tagged((1, 4, 2), 1), (2, 3), "mixed", 1, 3)
    with pytest.raises(ValueError, match=r"ranks \[0, 1\]"):  # checked before the dim
        check_origin("x", _tagged((1, 4, 2), 2), (1, 0), "mixed", 1, 3)


def test_other_dim_or_rank_is_refused():
    with pytest.raises(ValueError, match="along dim 2 of a 3-D tensor, not dim 1 of this 3-D one"
                                         " as gathered: see"):
        check_origin("t", _tagged((1, 4, 2), 2), (0, 1), "gathered", 1, 3, ": see")
    with pytest.raises(ValueError, match="along dim 1 of a 3-D tensor, not dim 1 of this 4-D"):
        check_origin("t", _tagged((1, 4, 2), 1), (0, 1), "gathered", 1, 4)
    check_origin("t", _tagged((1, 4, 2), 1), (0, 1), "gathered", 1)  # no ndim: dim only


def test_varlen_takes_packed_shards_along_dim_0():
    with pytest.raises(ValueError, match=r"along dim 1 of a 3-D tensor, not dim 0 .* "
                                         r"varlen_attention \(\[T, heads, D\]"):
        varlen._as_batch("q", _tagged((4, 2, 3), 1))
    batch = varlen._as_batch("q", _tagged((4, 2, 3), 0))
    assert getattr(batch, SHARD_TAG).dim == 1 and getattr(batch, SHARD_TAG).ndim == 4
