"""``ringattn.validate.option_text``: the one text by which every agreement of options
compares an option's value (the mixers' arguments, ``context_parallel``'s keyword
arguments): equal exactly when the values are, whatever their spelling. No process group."""

import math
import struct

import pytest
import torch

from ringattn.mixers.core import _encode
from ringattn.validate import option_text


def _negative_nan() -> float:
    return struct.unpack("<d", struct.pack("<Q", 0xFFF8000000000001))[0]


SAME = {  # each group: one value, spelled otherwise
    "one": [1, 1.0, 1 + 0j, torch.tensor(1.0), torch.tensor(1, dtype=torch.int8),
            torch.tensor(1.0, dtype=torch.bfloat16)],
    "zero": [0, 0.0, -0.0, torch.tensor(-0.0)],
    "nan": [math.nan, _negative_nan(), torch.tensor(math.nan), torch.tensor(_negative_nan())],
    "-inf": [-math.inf, torch.tensor(-math.inf, dtype=torch.float16)],
    "2**60": [2 ** 60, 2.0 ** 60],
    "pair": [(0.0, 0.5), [0, 0.5], (torch.tensor(0), torch.tensor(0.5))],
    "a vector": [torch.tensor([0.5, -0.0, math.nan]),
                 torch.tensor([0.5, 0.0, _negative_nan()], dtype=torch.float64)],
    "a large vector": [torch.cat([torch.arange(-10.0, 0.0), torch.tensor([-0.0]),
                                  torch.arange(1.0, 10.0)]),
                       torch.arange(-10, 10, dtype=torch.int64)],
    "a device": [torch.device("cuda", 0), torch.device("cuda", 1)],
}

DIFFERENT = [  # pairs that are not the same option
    (True, 1), (torch.tensor(True), 1), (0.1, torch.tensor(0.1)),  # float32's 0.1
    (0.5, torch.tensor(0.5, requires_grad=True)), ((0.5,), 0.5), ((0.0, 0.5), torch.tensor([0.0, 0.5])),
    (torch.tensor([0.5]), torch.tensor(0.5)), (math.inf, -math.inf), (math.nan, 0.0),
    (torch.arange(20.0), torch.arange(20.0).flip(0)),
    (torch.arange(20.0), torch.arange(20.0).reshape(4, 5)),
    (torch.full((20,), 2.0 ** 60, dtype=torch.int64), torch.full((20,), 2.0 ** 60 + 2 ** 8,
                                                                 dtype=torch.float64)),
    (torch.float32, torch.float64), (1 + 2j, 1), ("1", 1), (None, 0),
]


@pytest.mark.parametrize("group", sorted(SAME))
def test_equal_values_are_one_option(group):
    texts = {option_text(v) for v in SAME[group]}
    assert len(texts) == 1, (group, texts)
    codes = {_encode(v, False) for v in SAME[group]}
    assert len(codes) == 1, (group, codes)


@pytest.mark.parametrize("a,b", DIFFERENT, ids=[f"{a!r}-{b!r}"[:40] for a, b in DIFFERENT])
def test_other_values_are_other_options(a, b):
    assert option_text(a) != option_text(b)
    assert _encode(a, False) != _encode(b, False)


def test_grad_mode_and_unreadable_tensors():
    t = torch.tensor(0.5, requires_grad=True)
    with torch.no_grad():  # no gradient will be taken: the value alone
        assert option_text(t) == option_text(0.5)
    assert "values unread" in option_text(torch.empty(3, device="meta"))
    assert option_text(torch.empty(3, device="meta")) != option_text(torch.zeros(3))
