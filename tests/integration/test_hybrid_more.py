"""The families of ``integrations/transformers/mixers/ (conv.py, delta.py)`` beyond the survey and the hybrid test.

* ZAYA with other convolution widths (cca_time0 = 3, cca_time1 = 2: each q/k reads the
  three tokens before it) equals one process at W = 2 and 3, plain, left-padded, packed and
  contiguous, as test_hybrid_families.py compares its survey config (2, 2).
* The converted ones (lfm3, zaya, bailing_hybrid, inkling_text, inkling2_text, inkling2_loop_text) are
  refused by ``check_model`` unconverted, naming ``convert``, and accepted converted.
"""

from __future__ import annotations

import pytest

from families import FAMILIES, build
from test_families import TOL

pytest.importorskip("transformers")

CONVERTED = ("lfm3", "zaya", "bailing_hybrid", "inkling_text", "inkling2_text",
             "inkling2_loop_text")


def _zaya_wide():
    config, cls = FAMILIES["zaya"]()
    config.cca_time0 = 3
    return config, cls


def _wide_cases() -> dict:
    """Rank function: test_hybrid_families' cases for ZAYA with cca_time0 = 3."""
    import test_hybrid_families as hybrid

    hybrid.EXTRA["zaya_wide"] = _zaya_wide
    return hybrid.exact_cases(["zaya_wide"])


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", (2, 3))
def test_zaya_with_wider_convolutions_equals_one_process(clusters, worst_errors, world):
    for rank, results in enumerate(clusters(world).run(_wide_cases, timeout=240)):
        assert set(k for _, k in results) == {"plain", "padded", "packed", "contiguous",
                                              "no ring context"}
        for (_, kind), errs in results.items():
            assert isinstance(errs, dict), f"{kind}, W={world}, rank {rank}: {errs}"
            assert "grads" in errs or kind == "no ring context"
            for what, err in errs.items():
                if what != "worst_grad":
                    assert err <= TOL, f"{kind}, W={world}, rank {rank}: {what} {err:.2e} {errs}"
            if "grads" in errs:
                for what in ("logits", "loss", "grads"):
                    key = ("HF hybrids", what)
                    worst_errors[key] = max(worst_errors.get(key, (0.0, TOL)), (errs[what], TOL))


@pytest.mark.parametrize("family", CONVERTED)
def test_converted_families_are_checked(family):
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    model = build(family, "ringattn")
    with pytest.raises(ValueError, match=r"convert\(model\)"):
        ra_hf.check_model(model)
    ra_hf.check_model(*reversed(FAMILIES[family]()))  # a class: convert fixes it after building
    ra_hf.convert(model)
    ra_hf.check_model(model)
    assert ra_hf.mixers_converted(model)
