"""Hybrid families converted by ``ra_hf.convert_mixers`` equal one process under context
parallelism.

For each converted family (Gated DeltaNet: Qwen3-Next, Qwen3.5, Qwen3.5-MoE; short
convolution: LFM2, LFM2-MoE;
Mamba2: Granite 4 hybrid, Bamba, Mamba2, Nemotron-H, Falcon-H1 with and without its gated
RMSNorm; Mamba: Jamba, Mamba, FalconMamba; RG-LRU: RecurrentGemma, whose padded batches are
refused; lightning attention: MiniMax; Mamba layers with shared attention blocks: Zamba
(multi-head Mamba), Zamba2 (Mamba2)), batch kind ("plain", "padded": row 1 left-padded by 7,
as in the family survey; "packed": one row of five documents of 1 to 15 tokens, their
positions restarting at 0, compared with one process running each document as its own
sequence; "contiguous": the plain batch on the contiguous layout) and world size W (2, 3; S = 37 divides neither 2W), every rank
runs the one-process reference (transformers' "eager" attention and its own mixers on the
whole batch, with the 2-D attention mask) and the CP run: the model built with
attn_implementation="ringattn", ``convert_mixers``, ``prepare_batch`` (zigzag unless said) and
``model(**local)``. Gathered logits on real tokens, the sum of the ranks' losses and every
parameter gradient summed over the ranks must be within 1e-5 of the reference (the
survey's ``_errors``). All cases of one W run in ONE cluster call.

Also: the converted model without a ring context is transformers' model (one process),
an unconverted hybrid is refused on every rank with a message naming ``convert_mixers``,
a family it does not serve is refused by ``convert_mixers``, and a cache under CP is
refused.
"""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from families import FAMILIES, build
from reference import rel_err
import ringattn as ra
from test_families import GRAD_FLOOR, LAYOUT, SEQLEN, TOL, _errors, _flat_grads
from test_transformers import _batch

pytest.importorskip("transformers")

KINDS = {"plain": "plain", "padded": "left-padding", "packed": "packed",
         "contiguous": "plain"}
"""Our case name -> test_transformers' batch; "contiguous" is the plain batch on the
contiguous layout (every other case: zigzag, per document when packed)."""
WORLDS = (2, 3)
GROUP_TIMEOUT_S = 30.0


def _falcon_h1_norm():
    cfg, cls = FAMILIES["falcon_h1"]()
    cfg.mamba_rms_norm = True  # the gated RMSNorm instead of the SiLU gate
    return cfg, cls


EXTRA = {"falcon_h1_norm": _falcon_h1_norm}
"""Variants the survey (tests/families.py, which builds every other family here) does not
build."""

CONVERTED = ("qwen3_next", "qwen3_5", "qwen3_5_moe", "lfm2", "lfm2_moe", "granitemoehybrid", "bamba", "mamba2",
             "nemotron_h", "falcon_h1", "falcon_h1_norm", "jamba", "mamba", "falcon_mamba",
             "recurrent_gemma", "minimax")
CONVERTED += ("zamba", "zamba2")  # Zamba hybrids (integrations/transformers/mixers/mamba.py)
CONVERTED += ("lfm3", "zaya", "bailing_hybrid")  # more hybrids (integrations/transformers/mixers/ (conv.py, delta.py))
CONVERTED += ("kimi_linear", "olmo_hybrid", "lara_mini")  # delta rules (mixers/delta.py)
CONVERTED += ("rwkv", "xlstm")  # attention-free recurrences (integrations/transformers/mixers/recurrent.py)
CONVERTED += ("inkling_text", "inkling2_text", "inkling2_loop_text")  # short convs (mixers/inkling.py), per-query score bias (families/score_bias.py)

REFUSED = {("recurrent_gemma", "padded"): "reads the padding positions"}
"""Cases refused on every rank (the message's words): RecurrentGemma's recurrent block does
not mask padding, so one process's real tokens read padding positions whose attention
outputs are undefined (test_recurrent_gemma_padding_is_undefined). RWKV and xLSTM mask
nothing either, but their padding positions are a function of the padding ids alone, which
the converted models get back (RingContext.padded_ids): exact."""


def _build(name: str, attn: str):
    if name in FAMILIES:
        return build(name, attn)
    cfg, cls = EXTRA[name]()
    cfg._attn_implementation = attn
    torch.manual_seed(0)
    return cls(cfg).float()


def _cp_run(name: str, batch: dict, group, layout: str = LAYOUT):
    from ringattn.integrations import transformers as ra_hf

    # Inkling's attention (its per-query score bias) is converted by convert, with its mixers
    conversion = ra_hf.convert if name.startswith("inkling") else ra_hf.convert_mixers
    model = conversion(_build(name, "ringattn"))
    local = ra_hf.prepare_batch(model, batch, group=group, layout=layout)
    out = model(**local, use_cache=False)
    local["ring_context"].check_consumed(model)
    out.loss.backward()
    return model, out, local["ring_context"].cu_seqlens


def _own_errors(ref_model, ref, model, out, group, cu, layout=LAYOUT) -> dict:
    """``_errors`` (the survey's) for a batch without padding on any layout, also a packed
    row (whose shards follow its documents)."""
    loss = out.loss.detach().clone()
    logits = ra.unshard(out.logits.detach(), group=group, layout=layout, seqlen=SEQLEN,
                        cu_seqlens=cu)
    grads = _flat_grads(model)
    dist.all_reduce(loss, group=group)
    dist.all_reduce(grads, group=group)
    ref_grads = _flat_grads(ref_model).double()
    diff = (grads.double() - ref_grads)
    floor = GRAD_FLOOR * float(ref_grads.norm())
    worst, start = 0.0, 0
    for p in ref_model.parameters():
        d, r = diff[start:start + p.numel()], ref_grads[start:start + p.numel()]
        start += p.numel()
        err = float(d.norm()) / max(float(r.norm()), floor)
        worst = max(worst, err if err == err else float("inf"))
    return {"logits": rel_err(logits, ref.logits), "loss": rel_err(loss, ref.loss),
            "grads": worst}


def _per_document(name: str, batch: dict):
    """One process on a packed row, as one sequence per document (the state and the
    convolution start afresh in each; transformers' torch mixers would carry them across
    documents of a packed row): (model with gradients, output with logits and loss)."""
    from types import SimpleNamespace

    ids, labels, pos = batch["input_ids"], batch["labels"], batch["position_ids"][0]
    starts = [*torch.nonzero(pos == 0).flatten().tolist(), ids.shape[1]]
    model = _build(name, "eager")
    logits, total, count = [], 0.0, 0
    for a, b in zip(starts[:-1], starts[1:]):
        out = model(input_ids=ids[:, a:b], use_cache=False)
        logits.append(out.logits)
        if b - a > 1:  # targets a+1 .. b-1, predicted from a .. b-2
            ce = torch.nn.functional.cross_entropy(out.logits[0, :-1].float(), labels[0, a + 1:b],
                                                   reduction="sum")
            total, count = total + ce, count + (b - a - 1)
    loss = total / count
    loss.backward()
    return model, SimpleNamespace(logits=torch.cat(logits, dim=1), loss=loss)


def exact_cases(names) -> dict:
    """Rank function: {(family, kind): errors or "Error: message"}."""
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    results = {}
    for kind, batch_kind in KINDS.items():
        batch = _batch(batch_kind, SEQLEN)
        for name in names:
            if kind == "packed":
                ref_model, ref = _per_document(name, batch)
            else:
                ref_model = _build(name, "eager")
                ref = ref_model(**batch, use_cache=False)
                ref.loss.backward()
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=GROUP_TIMEOUT_S))
            try:
                layout = "contiguous" if kind == "contiguous" else LAYOUT
                model, out, cu = _cp_run(name, batch, group, layout)
                if kind in ("packed", "contiguous"):
                    results[(name, kind)] = _own_errors(ref_model, ref, model, out, group, cu,
                                                        layout)
                else:
                    results[(name, kind)] = _errors(batch, ref_model, ref, model, out, group)
            except Exception as exc:  # reported per case by the test
                results[(name, kind)] = f"{type(exc).__name__}: {exc}"
            dist.destroy_process_group(group)
    # the converted model without a ring context is transformers' own (one process)
    batch = _batch("left-padding", SEQLEN)
    for name in names:
        ref = _build(name, "eager")(**batch, use_cache=False)
        mine = ra_hf.convert_mixers(_build(name, "eager"))(**batch, use_cache=False)
        results[(name, "no ring context")] = {"logits": rel_err(mine.logits, ref.logits),
                                              "loss": rel_err(mine.loss, ref.loss)}
    return results


@pytest.fixture(scope="module")
def exact(clusters):
    return clusters.once_per_world(exact_cases, list(CONVERTED), timeout=240)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", [*KINDS, "no ring context"])
@pytest.mark.parametrize("family", CONVERTED)
def test_converted_family_equals_one_process(exact, worst_errors, family, kind, world):
    for rank, results in enumerate(exact(world)):
        errs = results[(family, kind)]
        if (family, kind) in REFUSED:
            assert isinstance(errs, str) and errs.startswith("ValueError"), (family, kind, errs)
            assert REFUSED[(family, kind)] in errs, (family, kind, errs)
            continue
        assert isinstance(errs, dict), f"{family}, {kind}, W={world}, rank {rank}: {errs}"
        for what in ("logits", "loss", "grads"):
            if what in errs:
                assert errs[what] <= TOL, (f"{family}, {kind}, W={world}, rank {rank}: {what} "
                                           f"{errs[what]:.2e} ({errs})")
        assert "grads" in errs or kind == "no ring context"
        if "grads" in errs:
            for what in ("logits", "loss", "grads"):
                key = ("HF hybrids", what)
                worst_errors[key] = max(worst_errors.get(key, (0.0, TOL)), (errs[what], TOL))


def _unknown_layer():
    """A hybrid whose sequence layer convert_mixers does not know: LFM2 with its one
    short-convolution layer replaced by a plain torch module."""
    model = _build("lfm2", "ringattn")
    model.model.layers[0].conv = torch.nn.Identity()
    return model


def refusals() -> list:
    """Rank function: the messages of what must be refused, on this rank."""
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    batch = _batch("plain", SEQLEN)
    said = []
    for attempt in (
        lambda: ra_hf.prepare_batch(_build("qwen3_next", "ringattn"), batch),  # unconverted
        # a class passes (convert fixes it after building); its built model does not
        lambda: ra_hf.check_model(*reversed(FAMILIES["lfm2"]())),
        lambda: ra_hf.check_model(_build("lfm2", "ringattn")),
        lambda: ra_hf.convert_mixers(_unknown_layer()),  # not served
        lambda: ra_hf.convert_mixers(torch.nn.Linear(2, 2)),
    ):
        try:
            attempt()
            said.append(None)
        except (TypeError, ValueError) as exc:
            said.append(f"{type(exc).__name__}: {exc}")
    model = ra_hf.convert_mixers(_build("lfm2", "ringattn"))
    try:  # a cache under CP: every rank refuses (the same call on every rank)
        model(**ra_hf.prepare_batch(model, batch), use_cache=True)
        said.append(None)
    except ValueError as exc:
        said.append(f"ValueError: {exc}")
    return said


@pytest.mark.timeout(120)
def test_refusals_on_every_rank(clusters):
    for rank, said in enumerate(clusters(2).run(refusals, timeout=90)):
        unconverted, cls, built, unserved, linear, cache = said
        assert unconverted and "convert(model)" in unconverted \
            and "linear_attention" in unconverted, (rank, unconverted)
        assert cls is None, (rank, cls)
        assert built and "convert(model)" in built and "conv" in built, (rank, built)
        assert unserved and "found 0 sequence-mixer layers in Lfm2ForCausalLM" in unserved \
            and unserved.startswith("ValueError"), (rank, unserved)
        assert linear and linear.startswith("TypeError") and "Linear" in linear, (rank, linear)
        assert cache and "use_cache=False" in cache, (rank, cache)


def test_recurrent_gemma_padding_is_undefined():
    """Why RecurrentGemma's padded rows are refused rather than matched: with a recurrent
    layer after an attention layer, one process's real tokens depend on the attention
    outputs of padding queries that see no key, and transformers' own eager and sdpa
    attention disagree there (in one process, no ringattn involved)."""
    import transformers as tf

    batch = _batch("left-padding", SEQLEN)
    logits = {}
    for impl in ("eager", "sdpa"):
        cfg = tf.RecurrentGemmaConfig(vocab_size=97, hidden_size=64, intermediate_size=96,
                                      num_hidden_layers=4, num_attention_heads=4,
                                      num_key_value_heads=2, lru_width=64,
                                      attention_window_size=7, pad_token_id=0,
                                      block_types=["recurrent", "attention"] * 2)
        cfg._attn_implementation = impl
        torch.manual_seed(0)
        logits[impl] = tf.RecurrentGemmaForCausalLM(cfg)(**batch, use_cache=False).logits
    real = batch["attention_mask"].bool()
    assert rel_err(logits["sdpa"][real], logits["eager"][real]) > 1e-2  # 1.8e-2 measured
    plain = _batch("plain", SEQLEN)  # without padding the two agree: the gap is the padding
    for impl in ("eager", "sdpa"):
        cfg._attn_implementation = impl
        torch.manual_seed(0)
        logits[impl] = tf.RecurrentGemmaForCausalLM(cfg)(**plain, use_cache=False).logits
    assert rel_err(logits["sdpa"], logits["eager"]) < 1e-5


def test_composite_qwen3_5_points_to_its_language_model():
    """Qwen3.5 checkpoints are vision-language composites (Qwen3_5ForConditionalGeneration,
    config with a text_config): the composite is refused, before and after building, with a
    message naming what is served; AutoModelForCausalLM on the same config builds the text
    model (the survey's qwen3_5), which converts."""
    import transformers as tf

    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    text, _ = FAMILIES["qwen3_5"]()
    config = tf.Qwen3_5Config(text_config=text.to_dict())
    config._attn_implementation = "ringattn"
    for attempt in (lambda: ra_hf.check_model(tf.Qwen3_5ForConditionalGeneration, config),
                    lambda: ra_hf.convert(tf.Qwen3_5ForConditionalGeneration(config))):
        with pytest.raises(ValueError, match="composite model .*AutoModelForCausalLM"):
            attempt()
    model = tf.AutoModelForCausalLM.from_config(config)
    assert type(model).__name__ == "Qwen3_5ForCausalLM"
    assert ra_hf.convert(model) is model and ra_hf.mixers_converted(model)
