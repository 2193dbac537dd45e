"""Conversion state lives on the model instance; a ring context is bound to its forward.

Two models built from ONE config object (transformers keeps the config a model is built
from: DPO's policy and reference are built so) are two models: converting one converts
neither the other's layers nor its checks. An unconverted model beside a converted one is
refused on every rank by ``check_model``, ``prepare_batch``, and the attention function
(``shard_batch`` alone); converted, it equals one process. A deep copy of a converted model
is converted; a config edited after conversion does not change what the model computes.

Gradient checkpointing recomputes a layer in the backward: a second CP batch's forward
before the first batch's backward must not hand the first batch's recomputation the second
batch's context (same S with the second row packed; another S), for the families whose
layers get the context from their model's forward (Jamba's Mamba layers, BLOOM's attention
modules), with torch's reentrant and non-reentrant checkpointing. A converted mixer run
under ``context_parallel`` without its context refuses.

A converted model pickles (its swapped classes are made from names: ``state.swap_class``):
``torch.save`` / ``torch.load``, ``copy.deepcopy`` and a process that has not imported
ringattn give back the same classes, whose step equals the original's bit for bit, in one
process and under CP.

Every CP case runs on W=2 gloo ranks (one cluster call) and asserts on every rank.
"""

from __future__ import annotations

import copy
import io
import subprocess
import sys
from datetime import timedelta

import pytest
import torch
import torch.distributed as dist

from families import build
from reference import rel_err
import ringattn as ra
from test_families import SEQLEN, TOL, _flat_grads
from test_families import _errors as _survey_errors
from test_hybrid_families import _per_document
from test_transformers import _batch

pytest.importorskip("transformers")

WORLD = 2


def _same_config(model):
    """A second model built from ``model``'s own config object, with build()'s weights."""
    torch.manual_seed(0)
    return type(model)(model.config).float()


def _errors(ref_model, ref, model, out, group, batch, cu=None) -> dict:
    """The survey's relative errors of a CP run against one process (any S, packed too)."""
    errs = _survey_errors(batch, ref_model, ref, model, out, group, cu=cu)
    errs.pop("worst_grad")
    return errs


def _reference(name, batch, **config):
    if "position_ids" in batch and batch["input_ids"].shape[0] == 1:  # packed: per document
        return _per_document(name, batch)
    model = build(name, "eager")
    for key, value in config.items():
        setattr(model.config, key, value)
    out = model(**batch, use_cache=False)
    out.loss.backward()
    return model, out


def _outcome(fn):
    try:
        return fn()
    except Exception as exc:  # the case's outcome, reported per rank
        return f"{type(exc).__name__}: {exc}"


def _new_group():
    return dist.new_group(backend="gloo", timeout=timedelta(seconds=30))


def _run_cp(model, batch, group):
    from ringattn.integrations import transformers as ra_hf

    local = ra_hf.prepare_batch(model, batch, group=group)
    out = model(**local, use_cache=False)
    out.loss.backward()
    return out, local["ring_context"].cu_seqlens


def state_cases() -> dict:
    """Rank function: {case: errors dict or "Error: message"}."""
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    results = {}
    plain = _batch("plain", SEQLEN)

    # 1. two models, one config: converting the first leaves the second unconverted
    for name in ("qwen3_next", "jamba"):
        first = ra_hf.convert(build(name, "ringattn"))
        second = _same_config(first)
        assert second.config is first.config
        results[(name, "second: mixers_converted")] = ra_hf.mixers_converted(second)
        results[(name, "second: check_model")] = _outcome(lambda: ra_hf.check_model(second))
        group = _new_group()
        results[(name, "second: prepare_batch")] = _outcome(
            lambda: ra_hf.prepare_batch(second, plain, group=group))
        local = ra.shard_batch(plain, group=group)
        results[(name, "second: shard_batch alone")] = _outcome(
            lambda: second(**local, use_cache=False))
        ref_model, ref = _reference(name, plain)
        ra_hf.convert(second)

        def exact():
            out, cu = _run_cp(second, plain, group)
            return _errors(ref_model, ref, second, out, group, plain, cu)

        results[(name, "second converted")] = _outcome(exact)
        dist.destroy_process_group(group)

    # a Mixtral built from a converted Mixtral's config keeps a per-rank router loss
    first = build("mixtral", "ringattn")
    first.config.output_router_logits = True
    ra_hf.convert(first)
    second = _same_config(first)
    results[("mixtral", "second: global_router_loss")] = ra_hf.global_router_loss(second)
    results[("mixtral", "second: check_model")] = _outcome(lambda: ra_hf.check_model(second))
    group = _new_group()
    local = ra.shard_batch(plain, group=group)
    results[("mixtral", "second: shard_batch alone")] = _outcome(lambda: second(**local))
    dist.destroy_process_group(group)

    # a config edited after conversion: the router loss asked for later is still global
    model = ra_hf.convert(build("mixtral", "ringattn"))
    model.config.output_router_logits = True
    ref_model, ref = _reference("mixtral", plain, output_router_logits=True)
    group = _new_group()

    def edited():
        out, cu = _run_cp(model, plain, group)
        return _errors(ref_model, ref, model, out, group, plain, cu)

    results[("mixtral", "config edited after convert")] = _outcome(edited)
    dist.destroy_process_group(group)

    # a deep copy of a converted model is converted, and its layers bind its own forwards;
    # a saved and loaded one (torch.save / torch.load) steps as the deep copy, bit for bit
    for name in ("jamba", "bloom"):
        original = ra_hf.convert(build(name, "ringattn"))
        twin = copy.deepcopy(original)
        results[(name, "deepcopy converted")] = ra_hf.converted(twin)
        ref_model, ref = _reference(name, plain)
        group = _new_group()
        steps = {}

        def copied():
            out, cu = _run_cp(twin, plain, group)
            steps["deepcopy"] = (out.loss.detach(), out.logits.detach(), _flat_grads(twin))
            return _errors(ref_model, ref, twin, out, group, plain, cu)

        results[(name, "deepcopy exact")] = _outcome(copied)

        def reloaded():
            saved = io.BytesIO()
            torch.save(original, saved)
            saved.seek(0)
            loaded = torch.load(saved, weights_only=False)
            out, _ = _run_cp(loaded, plain, group)
            got = (out.loss.detach(), out.logits.detach(), _flat_grads(loaded))
            return all(torch.equal(a, b) for a, b in zip(got, steps["deepcopy"]))

        results[(name, "torch.load steps as the deepcopy")] = _outcome(reloaded)
        dist.destroy_process_group(group)

    # the state functions take the model, not its config
    results["config refused"] = _outcome(lambda: ra_hf.converted(first.config))

    # one rank converted, the other not: the same error on every rank, before sharding
    model = build("jamba", "ringattn")
    if dist.get_rank() == 0:
        ra_hf.convert(model)
    group = _new_group()
    results["one rank unconverted"] = _outcome(lambda: ra_hf.prepare_batch(model, plain,
                                                                           group=group))
    dist.destroy_process_group(group)
    return results


def _step(model, ids) -> tuple:
    """(logits, loss, every gradient) of one training step of ``model`` in one process."""
    out = model(input_ids=ids, labels=ids, use_cache=False)
    out.loss.backward()
    grads = _flat_grads(model)
    model.zero_grad(set_to_none=True)
    return out.logits.detach(), out.loss.detach(), grads


def _swapped(model) -> list:
    """The name and module of each class a conversion swapped in, in module order."""
    return [(type(m).__qualname__, type(m).__module__) for m in model.modules()
            if type(m).__module__.startswith("ringattn.")]


_FRESH = """
import sys, torch
torch.set_num_threads(1)
assert not [m for m in sys.modules if m.startswith("ringattn")], "ringattn imported"
saved = torch.load(sys.argv[1], weights_only=False)
for name, model in saved["models"].items():
    with torch.no_grad():
        logits = model(input_ids=saved["ids"], use_cache=False).logits
    assert torch.equal(logits, saved["logits"][name]), name
    swapped = [(type(m).__qualname__, type(m).__module__) for m in model.modules()
               if type(m).__module__.startswith("ringattn.")]
    assert swapped == saved["swapped"][name], (name, swapped)
from ringattn.integrations import transformers as ra_hf
assert all(ra_hf.converted(m) for m in saved["models"].values())
assert ra_hf.tiled_mlps(saved["models"]["jamba"]) == 4
"""


@pytest.mark.timeout(120)
def test_a_converted_model_pickles(tmp_path):
    """One process: converted hybrids (Jamba: its Mamba layers ``Ring...``, their decoder
    layers ``Bound...``, an MLP ``Tiled...``; Bamba; Qwen3-Next) through torch.save /
    torch.load, copy.deepcopy, and torch.load in a fresh process that has not imported
    ringattn: the same classes and state, and a training step equal to the original's bit
    for bit (without a ring context a converted mixer runs transformers' forward; the
    loaded model's ring forward is checked under CP in state_cases)."""
    from ringattn.integrations import transformers as ra_hf

    models = {name: ra_hf.convert(build(name, "eager"))  # attention runs in one process
              for name in ("jamba", "bamba", "qwen3_next")}
    ra_hf.tile_mlp(models["jamba"], tile=4)
    kinds = {name.split("Jamba")[0] for name, _ in _swapped(models["jamba"])}
    assert kinds == {"Ring", "Bound", "Tiled"}, _swapped(models["jamba"])
    ids = torch.randint(3, 90, (2, 13), generator=torch.Generator().manual_seed(1))
    saved = io.BytesIO()
    torch.save(models, saved)
    saved.seek(0)
    copies = {"torch.load": torch.load(saved, weights_only=False),
              "deepcopy": copy.deepcopy(models)}
    for name, model in models.items():
        want = _step(model, ids)
        for how, again in copies.items():
            other = again[name]
            assert [type(m) for m in other.modules()] == [type(m) for m in model.modules()], \
                (name, how)
            assert ra_hf.converted(other) and ra_hf.mixers_converted(other), (name, how)
            state = other.state_dict()
            assert all(torch.equal(t, state[k]) for k, t in model.state_dict().items())
            got = _step(other, ids)
            assert all(torch.equal(a, b) for a, b in zip(got, want)), (name, how)
    assert ra_hf.tiled_mlps(copies["torch.load"]["jamba"]) == 4

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the fresh process computes with one thread: the same sums
    try:
        with torch.no_grad():
            logits = {name: m(input_ids=ids, use_cache=False).logits
                      for name, m in models.items()}
    finally:
        torch.set_num_threads(threads)
    path = tmp_path / "models.pt"
    torch.save({"models": models, "ids": ids, "logits": logits,
                "swapped": {name: _swapped(m) for name, m in models.items()}}, path)
    run = subprocess.run([sys.executable, "-c", _FRESH, str(path)], capture_output=True,
                         text=True, timeout=100, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]


def checkpoint_cases() -> dict:
    """Rank function: interleaved CP forwards under gradient checkpointing, and a mixer
    under context_parallel without its context. {case: errors or "Error: message"}."""
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    results = {}
    packed = _batch("packed", SEQLEN)
    for name in ("jamba", "bloom"):
        for second_batch, label in ((packed, "same S, packed"), (_batch("plain", 29), "other S")):
            first_batch = _batch("plain", SEQLEN)
            ref1 = _reference(name, first_batch)
            ref2 = _reference(name, second_batch)
            model = ra_hf.convert(build(name, "ringattn"))
            reentrant = label == "other S"  # torch's two checkpoint implementations
            model.activation_checkpointing_enable({"use_reentrant": reentrant})
            model.train()
            group = _new_group()

            def interleaved():
                local1 = ra_hf.prepare_batch(model, first_batch, group=group)
                local2 = ra_hf.prepare_batch(model, second_batch, group=group)
                out1 = model(**local1, use_cache=False)
                out2 = model(**local2, use_cache=False)  # before the first one's backward
                out1.loss.backward()
                errs1 = _errors(*ref1, model, out1, group, first_batch,
                                local1["ring_context"].cu_seqlens)
                model.zero_grad(set_to_none=True)
                out2.loss.backward()
                errs2 = _errors(*ref2, model, out2, group, second_batch,
                                local2["ring_context"].cu_seqlens)
                return {k: max(errs1[k], errs2[k]) for k in errs1}

            results[(name, label)] = _outcome(interleaved)
            dist.destroy_process_group(group)

    # context_parallel on a converted Jamba without a DDP wrapper: exact
    batch = _batch("plain", SEQLEN)
    ref_model, ref = _reference("jamba", batch)
    model = ra_hf.convert(build("jamba", "ringattn"))
    group = _new_group()

    def managed():
        with ra_hf.context_parallel(model, group):
            out = model(**batch)
            out.loss.backward()
        ra_hf.average_gradients(model, group)
        loss = out.loss.detach()
        grads, ref_grads = _flat_grads(model).double(), _flat_grads(ref_model).double()
        return {"loss": rel_err(loss, ref.loss),
                "grads": float((grads - ref_grads).norm() / ref_grads.norm())}

    results["context_parallel jamba"] = _outcome(managed)

    # a mixer run under the manager outside its model's forward refuses
    model = ra_hf.convert(build("jamba", "ringattn"))
    mamba = next(layer for layer in model.model.layers if hasattr(layer, "mamba"))
    hidden = torch.randn(2, 8, model.config.hidden_size)

    def direct():
        with ra_hf.context_parallel(model, group):
            mamba(hidden)
        return "ran"

    results["mixer outside its forward"] = _outcome(direct)
    dist.destroy_process_group(group)
    return results


def _exact(errs, case, rank):
    assert isinstance(errs, dict), f"{case}, rank {rank}: {errs}"
    for key, value in errs.items():
        assert value <= TOL, f"{case}, rank {rank}: {key} error {value:.2e} > {TOL:.0e}"


@pytest.mark.timeout(400)
def test_conversion_state_is_the_models(clusters):
    for rank, res in enumerate(clusters(WORLD).run(state_cases, timeout=360)):
        for name in ("qwen3_next", "jamba"):
            assert res[(name, "second: mixers_converted")] is False, rank
            for case in ("check_model", "prepare_batch", "shard_batch alone"):
                said = res[(name, f"second: {case}")]
                assert isinstance(said, str) and said.startswith("ValueError") \
                    and "convert" in said, (name, case, rank, said)
            _exact(res[(name, "second converted")], (name, "second converted"), rank)
        assert res[("mixtral", "second: global_router_loss")] is False, rank
        for case in ("check_model", "shard_batch alone"):
            said = res[("mixtral", f"second: {case}")]
            assert isinstance(said, str) and said.startswith("ValueError") \
                and "router" in said, (case, rank, said)
        _exact(res[("mixtral", "config edited after convert")], "edited config", rank)
        for name in ("jamba", "bloom"):
            assert res[(name, "deepcopy converted")] is True, (name, rank)
            _exact(res[(name, "deepcopy exact")], (name, "deepcopy"), rank)
            assert res[(name, "torch.load steps as the deepcopy")] is True, (name, rank)
        said = res["config refused"]
        assert said.startswith("TypeError") and "model instance" in said, (rank, said)
        said = res["one rank unconverted"]
        assert said.startswith("ValueError") and "rank 1" in said and "convert" in said, \
            (rank, said)


@pytest.mark.timeout(400)
def test_context_bound_to_its_forward(clusters):
    for rank, res in enumerate(clusters(WORLD).run(checkpoint_cases, timeout=360)):
        for name in ("jamba", "bloom"):
            for label in ("same S, packed", "other S"):
                _exact(res[(name, label)], (name, label), rank)
        _exact(res["context_parallel jamba"], "context_parallel jamba", rank)
        said = res["mixer outside its forward"]
        assert said.startswith("ValueError") and "context_parallel" in said \
            and "ring context" in said, (rank, said)


def empty_rank_cases() -> dict:
    """Rank function (W=3): converted hybrids under context_parallel on a sequence shorter
    than W (a rank with no tokens), without DDP: the loss and, after average_gradients,
    every gradient (the mixers' replicated parameters included) equal one process's."""
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    results = {}
    group = _new_group()
    for name in ("bamba", "rwkv"):
        for seqlen in (2,):  # S=1 has no target: one process's loss is 0/0 too
            torch.manual_seed(seqlen)
            ids = torch.randint(1, 97, (1, seqlen))
            batch = dict(input_ids=ids, labels=ids.clone())
            ref_model = build(name, "eager")
            ref = ref_model(**batch, use_cache=False)
            ref.loss.backward()
            model = ra_hf.convert(build(name, "ringattn"))

            def managed():
                with ra_hf.context_parallel(model, group):
                    out = model(**batch)
                    out.loss.backward()
                ra_hf.average_gradients(model, group)
                missing = [n for n, p in model.named_parameters()
                           if (p.grad is None) != (dict(ref_model.named_parameters())[n].grad is None)]
                grads, ref_grads = _flat_grads(model).double(), _flat_grads(ref_model).double()
                return {"loss": rel_err(out.loss.detach(), ref.loss),
                        "grads": float((grads - ref_grads).norm() / ref_grads.norm()),
                        "missing": float(len(missing))}

            results[(name, seqlen)] = _outcome(managed)
    dist.destroy_process_group(group)
    return results


@pytest.mark.timeout(300)
def test_a_rank_with_no_tokens_under_context_parallel(clusters):
    for rank, res in enumerate(clusters(3).run(empty_rank_cases, timeout=240)):
        for case, errs in res.items():
            assert isinstance(errs, dict), (case, rank, errs)
            assert errs.pop("missing") == 0, (case, rank)
            _exact(errs, case, rank)
