"""The model-family survey: for every family in ``families.FAMILIES``, context parallelism
equals the same model in one process, or refuses with a clear error; never a wrong answer.

For each family, batch kind ("plain": two full rows; "padded": row 1 left-padded by 7 with
the padding id 0, as in test_transformers), world size W (2, 3; S = 37 divides neither) and
public path, every rank runs the single-process reference (transformers' "eager" attention
on the whole batch) and the CP run: the model built with attn_implementation="ringattn"
and called on this rank's shard, taken through one of the two public paths:

* "prepare": ``ra_hf.prepare_batch(model, batch, layout="zigzag")`` (``check_attention``,
  ``check_model`` + ``ra.shard_batch``, the documented safe entry; ``check_model`` on the
  class before building, ``check_consumed`` after the forward);
* "shard": ``ra.shard_batch(batch, layout="zigzag")`` then ``model(**local)``, nothing
  else (the README's lower path): whatever that path cannot do must be refused by the
  attention function or the mask function on their own.

The CP run's outcome is

* "exact": gathered logits on real tokens, the sum of the ranks' losses, and every
  parameter gradient summed over the ranks are within TOL of the reference;
* "refused": the CP run raised TypeError or ValueError from ringattn's own code (a
  deliberate refusal; the message is kept);
* "unconsumed" (the "shard" path only: an attention-free model, unconverted, ran its
  forward without any ringattn call, so nothing could refuse during it; the batch's
  ``RingContext`` counted no call and ``check_consumed``, the lower path's guard after the
  forward, refuses it; declared in EXPECTED_SHARD);
* "unbuildable" (transformers raised while building the model with "ringattn", before any
  ringattn code ran: acceptable only on the "shard" path, where nothing of ringattn's runs
  before building, for the families EXPECTED_SHARD declares so);
* "WRONG" (finished, but beyond TOL or NaN), "crash" (any other exception), "hang" (a
  collective of the family's group timed out: ranks disagreed about what to run).

Each family runs on a fresh process group with a short collective timeout, and every
exception is caught per family, so one family's failure (even a hang) does not take the
others down; the library promises that errors are raised on every rank, so a "hang" is a
bug. All families of one (W, kind) run in ONE cluster call, both paths sharing one
reference; the tests then assert, on every rank, that each outcome equals the outcome
declared in EXPECTED (EXPECTED_SHARD where the "shard" path differs), so a family that
regresses from exact to refused fails too.

Legend: B batch (2), S global seq (37), V vocabulary.
"""

from __future__ import annotations

import os
import traceback
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

import ringattn as ra
from families import FAMILIES, build
from reference import rel_err
from test_transformers import _batch

pytest.importorskip("transformers")

TOL = 1e-5
"""fp32 model against the same fp32 model in one process; test_transformers measures
about 1e-7, and 1e-5 leaves room for the longer reductions of the bigger families."""
GRAD_TOL = {"deepseek_v4": 5e-5}
"""Families whose fp32 gradients are more sensitive to rounding than TOL allows, with the
bound their own measurement gives. DeepSeek-V4: multiplying one process's own attention
outputs by (1 + 2.6e-7 x noise), the size of fp32 rounding that separates any two attention
algorithms (CP's here), moves the gradient of its final hyper-connection head
(``hc_head.hc_fn``) by 8-10e-6 relative (``test_compressed_attention.py::
test_fp32_gradients_are_that_sensitive`` measures it); its attention outputs in float64 equal
one process's within 1e-12 there (its float64 logits within 1e-7: the model keeps its
RMSNorms in float32)."""
GRAD_FLOOR = 1e-3
"""A parameter's gradient error is relative to its reference gradient, or to GRAD_FLOOR
times the whole model's gradient where that is larger: some gradients are analytically
zero (OPT's key bias: softmax ignores a shift shared by a row's scores) and are rounding
noise of about 1e-10 of the whole, which no relative error can compare."""
SEQLEN = 37  # divides none of 2, 3, 4, 6: every shard is padded
LAYOUT = "zigzag"
WORLDS = (2, 3)
KINDS = {"plain": "plain", "padded": "left-padding"}  # our name -> test_transformers' batch
BATCHES = {**KINDS, "right": "right-padding"}
"""Every batch ``survey`` takes: KINDS (the survey's matrix) and right padding (row 1's last
6 tokens; one test below)."""
GROUP_TIMEOUT_S = 30.0
"""Collective timeout of each family's group: a family whose ranks disagree fails as
"hang" after this long instead of holding the cluster until its own timeout."""

SELECTED = [f for f in FAMILIES
            if f in os.environ.get("SURVEY_FAMILIES", ",".join(FAMILIES)).split(",")]
"""The families surveyed: all of them, or those named in SURVEY_FAMILIES (comma-separated,
for working on a few: ``SURVEY_FAMILIES=mixtral,llama4 pytest tests/integration/
test_families.py``)."""

PATHS = ("prepare", "shard")
EXACT, REFUSED, UNBUILDABLE, UNCONSUMED = "exact", "refused", "unbuildable", "unconsumed"
ACCEPTABLE = {"prepare": (EXACT, REFUSED), "shard": (EXACT, REFUSED, UNBUILDABLE, UNCONSUMED)}

# What the library must do with each family (see docs/models.md); a dict gives the outcome
# per batch kind.
EXPECTED = {
    # plain decoders: every attention layer goes through AttentionInterface, a window (if
    # any) as the sliding_window kwarg and in the mask
    "llama": EXACT,
    "mistral": EXACT,
    "qwen2": EXACT,
    "qwen3": EXACT,
    "gemma": EXACT,
    "gemma3": EXACT,
    "phi3": EXACT,
    "olmo2": EXACT,
    "cohere": EXACT,
    "cohere2": EXACT,
    "starcoder2": EXACT,
    "granite": EXACT,
    "glm4": EXACT,
    "smollm3": EXACT,
    "exaone4": EXACT,
    "olmo3": EXACT,
    "phi": EXACT,
    "gpt_neox": EXACT,
    "gpt2": EXACT,
    "helium": EXACT,
    "ministral": EXACT,
    "seed_oss": EXACT,
    "olmo": EXACT,
    "glm": EXACT,
    "apertus": EXACT,
    "persimmon": EXACT,
    # score modifications passed to the attention function: softcap=, s_aux= (sinks)
    "gemma2": EXACT,
    "gpt_oss": EXACT,
    # MLA: value head dim 12, query/key head dim 24
    "deepseek_v3": EXACT,
    "deepseek_v2": EXACT,
    # the window exists only in the mask the model asks for (no sliding_window kwarg)
    "qwen2_moe": EXACT,
    "phimoe": EXACT,
    # chunked attention exists only in the mask (and counts from each row's first token)
    "llama4_chunked": EXACT,
    # learned positions counted from the attention mask (prepare_batch gives them)
    "opt": EXACT,
    # AltUp, LAuReL, per-layer inputs are per token; KV sharing reuses the local K/V shards
    "gemma3n": EXACT,
    # router aux loss over the global token set (ra_hf.convert: all-reduced expert sums)
    "mixtral": EXACT,
    "qwen3_moe": EXACT,
    "olmoe": EXACT,
    "granitemoe": EXACT,
    "flex_olmo": EXACT,
    # NoPE layers scale queries by position (ra_hf.convert: global positions, not local)
    "llama4": EXACT,
    # a dynamic, value-dependent mask passed as attention_mask: ra_hf.convert carries it as a
    # per-key score bias (one more head-dim channel); rows with more keys than
    # keep_window_size (its top-k) are refused (tests/distributed/test_score_bias_families.py)
    "doge": EXACT,
    # never call AttentionInterface: their own attention would ignore the ring context
    "bloom": EXACT,  # ALiBi: ra_hf.convert puts ring attention (alibi_slopes) in its module
    "codegen": EXACT,  # transformers >= 5.24 calls the attention interface
    "xglm": EXACT,  # ra_hf.convert puts ring attention in its module
    "biogpt": EXACT,  # calls the interface, but its class says it does not (ra_hf.convert)
    "mpt": EXACT,  # ALiBi: ra_hf.convert puts ring attention (alibi_slopes) in its module
    # the decoder layer does not pass **kwargs to self_attn (ra_hf.convert hands its
    # attention the ring_context); stablelm's class also says it computes attention itself
    "stablelm": EXACT,
    # look their attention class up by attn_implementation in a dict of their own (building
    # them with "ringattn" raises KeyError inside transformers): check_model(cls, config),
    # called before building, refuses them
    "falcon": EXACT,  # built eager, ra_hf.convert puts ring attention in its module
    "gptj": EXACT,  # transformers >= 5.24 calls the attention interface
    "gpt_neo": EXACT,  # built eager, ra_hf.convert puts ring attention in its module
    "nemotron": EXACT,
    # hybrids: ra_hf.convert runs their recurrent / convolutional / state-space layers across
    # ranks (convert_mixers; tests/integration/test_hybrid_families.py has more of them)
    "qwen3_next": EXACT,
    "lfm2": EXACT,
    "jamba": EXACT,
    "falcon_h1": EXACT,
    "granitemoehybrid": EXACT,
    # its recurrent block reads the padding positions (transformers masks nothing there),
    # whose attention outputs are undefined after an attention layer: left padding is refused
    "recurrent_gemma": {"plain": EXACT, "padded": REFUSED},
    "minimax": EXACT,
    # attention families, part 1
    "afmoe": EXACT,
    "arcee": EXACT,
    "bitnet": EXACT,
    "cohere2_moe": EXACT,
    "cwm": EXACT,
    "dbrx": EXACT,
    # DeepSeek sparse attention: each query's top-k keys, scored against the whole sequence
    # (ra_hf.convert: the indexer over every rank's keys, the selection a key mask of the ring)
    "deepseek_v32": EXACT,
    "diffllama": EXACT,
    "dots1": EXACT,
    "ernie4_5": EXACT,
    "ernie4_5_moe": EXACT,
    "exaone_moe": EXACT,
    "glm4_moe": EXACT,
    "glm4_moe_lite": EXACT,
    "glm_moe_dsa": EXACT,  # as deepseek_v32; layer 1 reuses layer 0's selection
    "gpt_bigcode": EXACT,
    "granitemoeshared": EXACT,
    "granite_swa": EXACT,
    "granitemoe_swa": EXACT,
    "hunyuan_v1_dense": EXACT,
    "hunyuan_v1_moe": EXACT,
    "hyperclovax": EXACT,
    "jais2": EXACT,
    "jetmoe": EXACT,
    # hybrids (test_hybrid_families.py runs them packed and contiguous too)
    "qwen3_5": EXACT,
    "qwen3_5_moe": EXACT,
    "lfm2_moe": EXACT,
    "bamba": EXACT,
    "mamba2": EXACT,
    "nemotron_h": EXACT,
    "mamba": EXACT,
    "falcon_mamba": EXACT,
    # more attention families (second block)
    "ministral3": EXACT,
    "nanochat": EXACT,
    "vaultgemma": EXACT,
    "minicpm3": EXACT,
    "youtu": EXACT,
    "axk1": EXACT,
    "longcat_flash": EXACT,
    "mimo_v2_flash": EXACT,
    # minimax_m2, mellum, flint: router aux loss over the global token set (ra_hf.convert)
    "minimax_m2": EXACT,
    "solar_open": EXACT,
    "mellum": EXACT,
    "kolibri1": EXACT,
    "laguna": EXACT,
    "flint": EXACT,
    "beam": EXACT,
    "hy_v3": EXACT,
    "dory": EXACT,
    "apertus1p5_text": EXACT,
    "cohere_compass_text": EXACT,
    # KV sharing slices its masks by logits_to_keep (0: every row; ModelMask allows that);
    # unscaled scores (scaling 1.0 after q/k norms) make it the most sensitive family: worst
    # gradient 8.6e-6, where eager and sdpa in one process already differ by 6e-6
    "gemma4_text": EXACT,
    "hrm_text": EXACT,
    "modernbert-decoder": EXACT,
    "emu3": EXACT,
    "ctrl": EXACT,
    # computes attention in its own modules: ra_hf.convert puts ring attention in them; on
    # the shard_batch-only path (unconverted) check_consumed refuses it after the forward
    "openai-gpt": EXACT,
    # computes attention itself (its class says so): ra_hf.convert puts ring attention in its
    # module
    "gpt_neox_japanese": EXACT,
    # a learned indexer keeps each query's top-k keys over the whole sequence (sparse
    # attention: ra_hf.convert, as deepseek_v32)
    "axk2": EXACT,
    "hy_v4": EXACT,
    "dots3_note_text": EXACT,
    # window keys + entries compressed over blocks of slots (an indexer keeps each query's
    # top-k of them in the CSA layers) + sinks: ra_hf.convert (families/compressed.py)
    "deepseek_v4": EXACT,
    # more hybrids (integrations/transformers/mixers/ (conv.py, delta.py)): LFM3's short convolution, ZAYA's CCA
    # projection (q/k convolutions, delayed values) converted by convert_mixers
    "lfm3": EXACT,
    "zaya": EXACT,
    "bailing_hybrid": EXACT,  # Kimi Delta Attention (per-channel decay) converted
    # block-sparse attention picked by an indexer: ra_hf.convert selects the key blocks over
    # the whole sequence (families/block_indexer.py), the ring runs with them as a key mask
    "minimax_m3_vl_text": EXACT,
    # a relative position bias computed per query (and per-query sinks): ra_hf.convert hands
    # it to the ring's kernel as a score modification; short convolutions across ranks
    "inkling_text": EXACT,
    "inkling2_text": EXACT,
    "inkling2_loop_text": EXACT,
}


# Where ``ra.shard_batch`` alone (no prepare_batch) ends otherwise than prepare_batch.
EXPECTED_SHARD = {
    # OPT counts positions from the padding mask; shard_batch alone gives slot indices,
    # which the attention function refuses for OPT when a row is left-padded
    "opt": {"plain": EXACT, "padded": REFUSED},
    # transformers' constructor raises KeyError for a registered attention name (a dict of
    # their own), before any ringattn code; prepare_batch's callers check the class first
    "falcon": UNBUILDABLE,
    "gpt_neo": UNBUILDABLE,
    # what ra_hf.convert makes exact, unconverted: each rank would compute it from its
    # shard alone, so the attention function refuses it
    "mixtral": REFUSED,
    "qwen3_moe": REFUSED,
    "olmoe": REFUSED,
    "granitemoe": REFUSED,
    "flex_olmo": REFUSED,
    "llama4": REFUSED,
    "bloom": REFUSED,
    "mpt": REFUSED,
    "stablelm": REFUSED,
    "nemotron": REFUSED,
    "xglm": REFUSED,
    "biogpt": REFUSED,
    # unconverted hybrids: their sequence layers would see only the shard
    "qwen3_next": REFUSED,
    "lfm2": REFUSED,
    "jamba": REFUSED,
    "falcon_h1": REFUSED,
    "granitemoehybrid": REFUSED,
    "recurrent_gemma": REFUSED,
    "minimax": REFUSED,
    # router aux loss, unconverted (attention families, part 1)
    "dbrx": REFUSED,
    "ernie4_5_moe": REFUSED,
    "granitemoeshared": REFUSED,
    "granitemoe_swa": REFUSED,
    "jetmoe": REFUSED,
    # unconverted hybrids (test_hybrid_families.py runs these too; mamba, mamba2 and
    # falcon_mamba: UNCONSUMED, below)
    "qwen3_5": REFUSED,
    "qwen3_5_moe": REFUSED,
    "lfm2_moe": REFUSED,
    "bamba": REFUSED,
    "nemotron_h": REFUSED,
    # more hybrids, unconverted (integrations/transformers/mixers/ (conv.py, delta.py))
    "lfm3": REFUSED,
    "zaya": REFUSED,
    "bailing_hybrid": REFUSED,
    # more attention families (second block): router aux loss unconverted
    "minimax_m2": REFUSED,
    "mellum": REFUSED,
    "flint": REFUSED,
    "gpt_neox_japanese": REFUSED,  # unconverted: the mask function refuses it
    # DeepSeek sparse attention, unconverted: the mask function refuses it
    "deepseek_v32": REFUSED,
    "glm_moe_dsa": REFUSED,
    "axk2": REFUSED,
    "hy_v4": REFUSED,
    "dots3_note_text": REFUSED,
    "deepseek_v4": REFUSED,
}

# delta-rule hybrids (convert_mixers, integrations/transformers/mixers/delta.py): converted exact, their
# unconverted linear layers refused; Qwen4-Exp's indexed attention picks key blocks per query
# from every earlier key's content (its QSA indexer): ra_hf.convert selects them over the
# whole sequence (families/block_indexer.py); unconverted, both are refused
EXPECTED.update({"kimi_linear": EXACT, "olmo_hybrid": EXACT, "lara_mini": EXACT,
                 "qwen4_exp": EXACT})
EXPECTED_SHARD.update({"kimi_linear": REFUSED, "olmo_hybrid": REFUSED, "lara_mini": REFUSED,
                       "qwen4_exp": REFUSED, "minimax_m3_vl_text": REFUSED})

# Zamba hybrids (convert_mixers, integrations/transformers/mixers/mamba.py): Zamba's multi-head Mamba and
# Zamba2's Mamba2 layers across ranks, their shared attention blocks through the interface
EXPECTED.update({"zamba": EXACT, "zamba2": EXACT})
EXPECTED_SHARD.update({"zamba": REFUSED, "zamba2": REFUSED})

# score biases (ra_hf.convert, integrations/transformers/families/score_bias.py), unconverted:
# the mask function refuses Inkling's short convolutions and Doge's own mask
EXPECTED_SHARD.update(dict.fromkeys(("inkling_text", "inkling2_text", "inkling2_loop_text",
                                     "doge"), REFUSED))

EXPECTED_SHARD.update({name: UNCONSUMED for name in ("mamba", "mamba2", "falcon_mamba")})
"""Attention-free families: without ``prepare_batch`` and ``convert`` no ringattn code runs
in their forward (no attention call, no mask), so nothing refuses during it, and each
rank's scan sees only its shard; the batch's ``RingContext`` then counts no call, which
``check_consumed`` (the lower path's guard after the forward) refuses: "unconsumed".
``prepare_batch`` (``check_model``) refuses them unconverted; converted they are exact."""


def expected(family: str, kind: str, path: str = "prepare") -> str:
    """The declared outcome of ``family`` on batch ``kind`` through ``path``."""
    e = EXPECTED_SHARD.get(family, EXPECTED[family]) if path == "shard" else EXPECTED[family]
    return e[kind] if isinstance(e, dict) else e


_RINGATTN_DIR = os.path.dirname(os.path.abspath(ra.__file__)) + os.sep


class _Unconsumed(Exception):
    """The "shard" path's forward finished without any ringattn call (an attention-free
    model, unconverted): ``RingContext.check_consumed`` refused it afterwards."""


class _Unbuildable(Exception):
    """transformers itself failed to build the model with attn_implementation="ringattn"
    (falcon, gptj, gpt_neo look their attention class up in a dict of their own), before
    any ringattn code ran."""


def _raised_in_ringattn(exc: BaseException) -> bool:
    frames = traceback.extract_tb(exc.__traceback__)
    return bool(frames) and os.path.abspath(frames[-1].filename).startswith(_RINGATTN_DIR)


def _failure(exc: BaseException) -> tuple[str, str]:
    """(outcome, message) of an exception raised by a CP run."""
    frames = traceback.extract_tb(exc.__traceback__)
    msg = f"{type(exc).__name__}: {exc}".strip().splitlines()[0][:300]
    if isinstance(exc, _Unconsumed):
        return UNCONSUMED, str(exc).splitlines()[0][:300]
    if isinstance(exc, _Unbuildable):
        return "unbuildable", str(exc).splitlines()[0][:300]
    if isinstance(exc, (TypeError, ValueError)) and _raised_in_ringattn(exc):
        return REFUSED, msg
    if isinstance(exc, RuntimeError) and "timed out" in str(exc).lower():
        return "hang", msg
    where = f" (at {os.path.basename(frames[-1].filename)}:{frames[-1].lineno})" if frames else ""
    return "crash", msg + where


def _flat_grads(model) -> torch.Tensor:
    """Every parameter's gradient (zeros where None), as one vector."""
    return torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).flatten()
                      for p in model.parameters()])


def _reference(name: str, batch: dict):
    """The family on the whole batch in this process: (model with gradients, output)."""
    model = build(name, "eager")
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return model, out


def _context_parallel(name: str, batch: dict, group, path: str, layout: str = LAYOUT):
    """The family under ring attention on this rank's shard, through ``path``: "prepare"
    (the documented safe path: ``check_model`` on the class, ``prepare_batch``,
    ``check_consumed`` after the forward) or "shard" (``ra.shard_batch`` and the model,
    nothing else): (model with gradients, output)."""
    from ringattn.integrations import transformers as ra_hf

    config, cls = FAMILIES[name]()
    if path == "prepare":
        ra_hf.check_model(cls, config)  # before building: some classes fail in the constructor
    try:  # the prepare path builds BUILT_EAGER families as check_model says: eager, converted
        eager = path == "prepare" and config.model_type in ra_hf.BUILT_EAGER
        model = build(name, "eager" if eager else "ringattn")
    except Exception as exc:
        if _raised_in_ringattn(exc):
            raise
        raise _Unbuildable(f"{type(exc).__name__}: {exc}") from exc
    if path == "prepare":
        model = ra_hf.convert(model)  # global router loss, Llama 4's global temperature
        local = ra_hf.prepare_batch(model, batch, group=group, layout=layout)
    else:
        local = ra.shard_batch(batch, group=group, layout=layout)
    out = model(**local, use_cache=False)
    if path == "prepare":
        local["ring_context"].check_consumed(model)
    elif local["ring_context"].calls == 0:  # what check_consumed refuses, told apart
        try:
            local["ring_context"].check_consumed(model)
        except ValueError as exc:
            raise _Unconsumed(str(exc)) from exc
    out.loss.backward()
    return model, out


def _errors(batch: dict, ref_model, ref, model, out, group, layout: str = LAYOUT,
            cu=None) -> dict:
    """Relative errors of the CP run (gathered logits, summed loss and gradients); ``cu``:
    the documents of a packed row."""
    loss = out.loss.detach().clone()
    logits_BSV = ra.unshard(out.logits.detach(), group=group, layout=layout,
                            seqlen=batch["input_ids"].shape[1], cu_seqlens=cu)
    grads = _flat_grads(model)
    dist.all_reduce(loss, group=group)
    dist.all_reduce(grads, group=group)
    real_BS = batch.get("attention_mask", torch.ones_like(batch["input_ids"])).bool()
    errs = {"logits": rel_err(logits_BSV[real_BS], ref.logits[real_BS]),
            "loss": rel_err(loss, ref.loss)}
    ref_grads = _flat_grads(ref_model).double()
    floor = GRAD_FLOOR * float(ref_grads.norm())
    worst, worst_name, start = 0.0, "", 0
    for pname, p in ref_model.named_parameters():
        g_ref = ref_grads[start:start + p.numel()]
        diff = float((grads[start:start + p.numel()].double() - g_ref).norm())
        start += p.numel()
        err = diff / max(float(g_ref.norm()), floor)
        err = err if err == err else float("inf")  # NaN: worse than anything
        if err > worst or not worst_name:
            worst, worst_name = err, pname
    errs["grads"], errs["worst_grad"] = worst, worst_name
    return errs


def _one_path(name: str, batch: dict, group, path: str, ref_model, ref,
              layout: str = LAYOUT) -> tuple[str, object]:
    """(outcome, detail) of one family through one path on this rank; never raises."""
    try:
        model, out = _context_parallel(name, batch, group, path, layout)
    except Exception as exc:  # one family's failure is its outcome, not the run's
        return _failure(exc)
    try:
        errs = _errors(batch, ref_model, ref, model, out, group, layout)
    except Exception as exc:  # e.g. another rank failed and left this one in a collective
        outcome, msg = _failure(exc)
        return (outcome if outcome == "hang" else "crash"), f"comparing: {msg}"
    ok = all(errs[t] <= (GRAD_TOL.get(name, TOL) if t == "grads" else TOL)
             for t in ("logits", "loss", "grads"))  # False for NaN
    return (EXACT if ok else "WRONG"), errs


def survey(names, kind: str, group_timeout_s: float = GROUP_TIMEOUT_S, layout: str = LAYOUT,
           paths=PATHS) -> dict:
    """Rank function: ``{(family, path): (outcome, detail)}`` for the families ``names`` on
    batch ``kind`` through both PATHS; ``detail`` holds the errors (exact, WRONG) or the
    message (the others). Each run gets a fresh group, so a collective left pending by a
    failed run never meets the next one's."""
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    batch = _batch(BATCHES[kind], SEQLEN)
    results = {}
    for name in names:
        try:
            ref_model, ref = _reference(name, batch)
        except Exception as exc:  # a broken config, not a CP outcome
            for path in paths:
                results[(name, path)] = ("crash", f"reference: {_failure(exc)[1]}")
            continue
        for path in paths:
            group = dist.new_group(backend="gloo", timeout=timedelta(seconds=group_timeout_s))
            results[(name, path)] = _one_path(name, batch, group, path, ref_model, ref, layout)
            if results[(name, path)][0] != "hang":  # a timed-out group may hold a pending op
                dist.destroy_process_group(group)
    return results


@pytest.fixture(scope="module")
def surveyed(clusters):
    """``surveyed(W, kind)``: every rank's survey of all families, run once per (W, kind)."""
    done: dict = {}

    def get(world: int, kind: str) -> list[dict]:
        if (world, kind) not in done:
            try:
                done[(world, kind)] = clusters(world).run(survey, SELECTED, kind,
                                                          timeout=480)
            except (AssertionError, TimeoutError) as exc:  # RankFailure or a hung rank
                done[(world, kind)] = exc
        result = done[(world, kind)]
        if isinstance(result, BaseException):
            pytest.fail(f"the survey of W={world}, {kind} did not finish: {result}")
        return result

    return get


def test_every_family_has_an_expected_outcome():
    assert sorted(EXPECTED) == sorted(FAMILIES)
    assert set(EXPECTED_SHARD) <= set(FAMILIES)


@pytest.mark.timeout(600)
@pytest.mark.parametrize("path", PATHS)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("family", SELECTED)
def test_family_is_exact_or_refuses(surveyed, worst_errors, family, kind, world, path):
    want = expected(family, kind, path)
    for rank, results in enumerate(surveyed(world, kind)):
        outcome, detail = results[(family, path)]
        assert outcome in ACCEPTABLE[path], (
            f"{family}, W={world}, {kind}, {path}, rank {rank}: {outcome}: {detail}")
        assert outcome == want, (f"{family}, W={world}, {kind}, {path}, rank {rank}: {outcome} "
                                 f"(expected {want}): {detail}")
        if outcome == EXACT:
            for name in ("logits", "loss", "grads"):
                bound = GRAD_TOL.get(family, TOL) if name == "grads" else TOL
                key = ("HF families" if bound == TOL else f"HF {family}", name)  # the
                # summary of worst errors make test prints
                worst_errors[key] = (max(worst_errors.get(key, (0.0, bound))[0], detail[name]),
                                     bound)


def test_convert_refuses_what_it_cannot_make_exact():
    """convert raises a ValueError for what it does not serve (a hybrid with a sequence layer
    convert_mixers does not know, a learned dense mask), convert_mixers for a family without
    its layers; converting twice is a no-op (one hook)."""
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    with pytest.raises(ValueError, match="mask of its own"):  # doge unconverted
        ra_hf.check_model(build("doge", "ringattn"))
    lfm2 = build("lfm2", "ringattn")  # its one short-conv layer made a module it does not know
    lfm2.model.layers[0].conv = torch.nn.Identity()
    with pytest.raises(ValueError, match="found 0 sequence-mixer layers in Lfm2ForCausalLM"):
        ra_hf.convert(lfm2)
    with pytest.raises(ValueError, match="convert_mixers does not serve llama"):
        ra_hf.convert_mixers(build("llama", "ringattn"))
    model = build("mixtral", "ringattn")
    assert ra_hf.convert(ra_hf.convert(model)) is model
    hooks = [h.__name__ for h in model._forward_hooks.values()]
    assert hooks.count("_router_hook") == 1 and ra_hf.global_router_loss(model)
    with pytest.raises(ValueError, match="router auxiliary loss"):
        ra_hf.check_model(build("qwen3_moe", "ringattn"))  # unconverted
    config, cls = FAMILIES["falcon"]()
    config.alibi = True  # its bias is rounded to bfloat16: not converted
    with pytest.raises(ValueError, match="ALiBi"):
        ra_hf.convert(cls(config))
    for name in ("gpt_neo", "falcon"):  # their constructors raise KeyError for "ringattn"
        config, cls = FAMILIES[name]()
        config._attn_implementation = "ringattn"
        with pytest.raises(ValueError, match="Build it with attn_implementation='eager'"):
            ra_hf.check_model(cls, config)
    for name in ("deepseek_v32", "glm_moe_dsa"):  # sparse attention: top-k keys per query
        ra_hf.check_model(*reversed(FAMILIES[name]()))  # the class: convert serves it
        with pytest.raises(ValueError, match="indexer keeps each query's top 8 keys.*convert"):
            ra_hf.check_model(build(name, "ringattn"))  # built, not converted
        ra_hf.check_model(ra_hf.convert(build(name, "ringattn")))
    model = build("jetmoe", "ringattn")  # its router loss coefficient is aux_loss_coef
    assert ra_hf.convert(model) is model and ra_hf.global_router_loss(model)


CONVERTED = ("mixtral", "llama4", "bloom", "falcon", "gpt_neo", "stablelm")
"""One family of each kind of conversion ``ra_hf.convert`` makes."""


@pytest.mark.timeout(600)
@pytest.mark.parametrize("layout", ["contiguous", "striped"])
def test_converted_families_are_exact_in_other_layouts(clusters, layout):
    """The conversions take positions from the batch's layout: the router's real tokens,
    Llama 4's temperature, ALiBi's and the windows' global positions (W 2, left-padded)."""
    _assert_exact(clusters(2), CONVERTED, "padded", layout)


def _assert_exact(cluster, families, kind: str, layout: str) -> None:
    """Survey the SELECTED ones of ``families`` on ``cluster`` (prepare path) and assert each
    is exact on every rank."""
    names = [n for n in families if n in SELECTED]
    results = cluster.run(survey, names, kind, GROUP_TIMEOUT_S, layout, ("prepare",),
                          timeout=240)
    for rank, res in enumerate(results):
        for name in names:
            outcome, detail = res[(name, "prepare")]
            assert outcome == EXACT, (f"{name}, {kind}, {layout}, rank {rank}: {outcome}: "
                                      f"{detail}")


# attention-free recurrences (convert_mixers, integrations/transformers/mixers/recurrent.py): RWKV-4's token
# shift and WKV, xLSTM's mLSTM across ranks; neither masks padding (a left-padded row's real
# tokens read its padding tokens, which shard_batch replaces: the converted model's pre-hook
# gives them back from RingContext.padded_ids). No ringattn code runs in their forward
# without prepare_batch and convert: UNCONSUMED
EXPECTED.update({"rwkv": EXACT, "xlstm": EXACT})
EXPECTED_SHARD.update({"rwkv": UNCONSUMED, "xlstm": UNCONSUMED})
EXPECTED_SHARD["openai-gpt"] = UNCONSUMED  # computes attention itself until converted


READ_PADDING = ("rwkv", "xlstm", "recurrent_gemma", "mamba", "zamba2", "openai-gpt")
"""Families whose layers read or mask padding themselves (RWKV, xLSTM and RecurrentGemma mask
nothing; Mamba and Zamba2 zero padded inputs; OpenAI GPT adds its own padding mask)."""


@pytest.mark.timeout(300)
def test_right_padded_rows_are_exact(clusters):
    """Right padding comes after every real token of its row: nothing real reads it, so it is
    exact even for the families that mask nothing (W 3, prepare path)."""
    _assert_exact(clusters(3), READ_PADDING, "right", LAYOUT)
