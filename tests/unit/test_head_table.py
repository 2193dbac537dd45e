"""The tiled loss's table of what each family does to its head's output
(``integrations.transformers.head``): for every family in the survey that the table names,
and for every family whose config sets such a field, the model's own logits at a kept
position equal, bit for bit, the head's output there after the table's transform (the
check the tiled loss makes on every call), also with the transform rebuilt from the row
stored as data (the Eagle3 offline format's head); and the families the table keeps
untiled say why."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip("transformers")

from families import FAMILIES, build  # noqa: E402

from ringattn.eagle3.teacher import TeacherHead, rebuild_transforms  # noqa: E402
from ringattn.integrations.transformers import head, tile_problem  # noqa: E402

FIELDS = {field for field, _ in head.TRANSFORMS.values()}


def _named(name: str) -> bool:
    config, _ = FAMILIES[name]()
    text = config.get_text_config()
    return (text.model_type in head.TRANSFORMS or text.model_type in head.UNTILED
            or any(getattr(text, f, None) not in (None, 1.0) for f in FIELDS))


NAMED = [name for name in FAMILIES if _named(name)]


def test_the_table_is_exercised():
    kinds = {head.TRANSFORMS[FAMILIES[n]()[0].get_text_config().model_type][1]
             for n in NAMED if FAMILIES[n]()[0].get_text_config().model_type in head.TRANSFORMS}
    assert len(kinds) >= 4, kinds  # soft cap, upcast soft cap or not, scale, divide, input
    assert len(NAMED) >= 15, NAMED


@pytest.mark.parametrize("name", NAMED)
def test_the_table_says_what_the_family_does(name):
    model = build(name, "eager")
    problem = tile_problem(model)
    family = model.config.get_text_config().model_type
    if family in head.UNTILED:
        assert problem is not None and family in problem
        return
    assert problem is None, problem
    on_logits, on_input, key = head._transform(model)
    assert key != ("plain",) or family not in head.TRANSFORMS or getattr(
        model.config.get_text_config(), head.TRANSFORMS[family][0], None) is None
    seen = []
    hook = head._decoder(model).register_forward_hook(
        lambda module, args, out: seen.append(out[0] if isinstance(out, tuple)
                                              else out.last_hidden_state))
    ids = torch.randint(3, 90, (2, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        out = model(input_ids=ids, logits_to_keep=torch.tensor([5]), use_cache=False)
    hook.remove()
    kept = seen[0][:, torch.tensor([5])]
    with torch.no_grad():
        mine = model.get_output_embeddings()(kept if on_input is None else on_input(kept))
        mine = mine if on_logits is None else on_logits(mine)
    assert torch.equal(mine, out.logits)
    # the Eagle3 teacher's head, stored as data (offline outputs' index.json) and rebuilt
    # without the model, gives the same logits
    teacher, _ = head.teacher_head(model)
    row = json.loads(json.dumps(list(teacher.row)))
    rebuilt = TeacherHead(teacher.weight, teacher.bias, *rebuild_transforms(teacher.family, row),
                          teacher.family, tuple(row))
    assert torch.equal(rebuilt.logits(seen[0][:, torch.tensor([5])]), out.logits)
    if key != ("plain",) and key[1] != 1.0:  # the transform matters in this config
        plain = model.get_output_embeddings()(kept)
        assert not torch.equal(plain, out.logits)


def test_the_transforms_matter_in_the_survey_configs():
    """A soft cap, a scale, a divisor and a scaled input each have a value that changes the
    logits in some survey config, so the check above (its last assertion) can fail."""
    for name in ("gemma2", "cohere", "granite", "minicpm3"):
        config, _ = FAMILIES[name]()
        field = head.TRANSFORMS[config.model_type][0]
        assert name in NAMED and getattr(config, field) not in (None, 1.0), name
