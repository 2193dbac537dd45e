"""The table of terms a family's forward adds to its causal-LM loss
(``integrations.transformers.checks.LOSS_TERMS``), kept complete against the family survey:
every statement that changes a survey family's loss after ``self.loss_function`` is a row,
read from the family's own forward by structure; a statement the table does not know, and
a z-loss with a coefficient, are refused by ``check_model``, naming them."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("transformers")

from families import FAMILIES  # noqa: E402

from ringattn.integrations.transformers import check_model  # noqa: E402
from ringattn.integrations.transformers.checks import LOSS_TERMS, loss_terms  # noqa: E402


def _classes():
    for name, make in FAMILIES.items():
        config, cls = make()
        yield name, config, cls


def test_every_term_of_every_survey_family_is_a_row():
    found, unknown = {}, {}
    for name, _, cls in _classes():
        for code in loss_terms(cls):
            (found if code in LOSS_TERMS else unknown).setdefault(code, []).append(name)
    assert not unknown, unknown
    assert set(found) == set(LOSS_TERMS), set(LOSS_TERMS) - set(found)  # no stale row
    assert len(found["loss+=self.router_aux_loss_coef*aux_loss.to(loss.device)"]) >= 20
    assert found["loss=loss+self.z_loss_coefficient*z_loss"] == ["bamba"]


def test_the_reader_sees_what_it_must():
    """The statements are read from the source, whitespace and comments removed; the
    one-process loss itself, its initialisation and the output's field are not terms."""
    from transformers import BambaForCausalLM, LlamaForCausalLM, MixtralForCausalLM

    assert loss_terms(LlamaForCausalLM) == ()
    assert loss_terms(BambaForCausalLM) == ("loss=loss+self.z_loss_coefficient*z_loss",)
    assert loss_terms(MixtralForCausalLM) == (
        "loss+=self.router_aux_loss_coef*aux_loss.to(loss.device)",)

    class Own(LlamaForCausalLM):  # not a transformers family's forward: not read
        def forward(self, *args, **kwargs):
            out = super().forward(*args, **kwargs)
            loss = out.loss + 1.0  # noqa: F841
            return out

    assert loss_terms(Own) == ()


def test_a_z_loss_is_refused_by_name_and_an_unknown_term_too(monkeypatch):
    from families import build

    model = build("bamba", "eager")
    model.config._attn_implementation = "ringattn"
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    ra_hf.convert(model)
    check_model(model)  # z_loss_coefficient 0: nothing added
    for value in (0.1, 1e-9, torch.tensor(0.1).item()):
        model.z_loss_coefficient = value
        with pytest.raises(ValueError, match=f"bamba adds a z-loss .z_loss_coefficient={value}"):
            check_model(model)
    model.z_loss_coefficient = 0.0
    config, cls = FAMILIES["bamba"]()
    config.z_loss_coefficient = 0.05  # a class is checked with its config
    with pytest.raises(ValueError, match="z_loss_coefficient=0.05"):
        check_model(cls, config)
    # a statement the table does not know: refused, quoting it
    monkeypatch.delitem(LOSS_TERMS, "loss=loss+self.z_loss_coefficient*z_loss")
    with pytest.raises(ValueError, match="adds a term to its loss that ringattn does not know "
                                         "..loss=loss\\+self.z_loss_coefficient\\*z_loss"):
        check_model(model)
