"""``RingTrainer`` with ``TrainingArguments(parallelism_config=ParallelismConfig(
dp_shard_size=D, cp_size=C))`` on gloo CPU ranks: FSDP2 over the config's flattened
dp_shard x cp mesh dimension, ring attention over cp, each dp replica reading its rows.
Every rank must log the losses, gradient norms, train_loss and eval loss, hold every
parameter's gradient at every optimizer step (FSDP2's sharded gradients gathered) and the
weights after training, of a plain transformers ``Trainer`` in one process reading the rows
of all D replicas per step; and ``save_model`` writes those weights.

Launches (all at once, one per world size, see ``parallelism_run.py``): one process (the
references), torchrun with 4 ranks (D=2 x C=2, without and with gradient accumulation 2
and clipping; the refusals), torchrun with 3 ranks (C=3, D=1). S=37 (not a multiple of
2C), padded rows. fp32 tolerance 1e-5 relative (per tensor, in norm, for gradients and
weights): the float32 bound of DESIGN.md.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from launches import launch_all  # noqa: E402

pytest.importorskip("transformers")
pytest.importorskip("accelerate")

RUN = Path(__file__).with_name("parallelism_run.py")
TOL = 1e-5
LIMIT_S = 420
WORLD = {"dp2_cp2": 4, "dp2_cp2_accum": 4, "cp3": 3, "refusals4": 4}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(directory, {launch: failure text or None}) of the three launches."""
    out = tmp_path_factory.mktemp("parallelism")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone",
                "--nproc-per-node"]
    cmds = {
        "ref": [sys.executable, str(RUN), "--ref", "--out", str(out / "ref"),
                "--cases", "dp2_cp2,dp2_cp2_accum,cp3"],
        "w4": [*torchrun, "4", str(RUN), "--out", str(out / "w4"),
               "--cases", "dp2_cp2,dp2_cp2_accum,refusals4"],
        "w3": [*torchrun, "3", str(RUN), "--out", str(out / "w3"), "--cases", "cp3"],
    }
    failures = launch_all(cmds, out, LIMIT_S)
    return out, failures


def _load(runs, kind, case, rank):
    out, failures = runs
    path = out / kind / f"{case}.{rank}.json"
    if not path.exists():
        pytest.fail(f"{kind} rank {rank} wrote no {case} results:\n{failures[kind]}")
    tensors = out / kind / f"{case}.{rank}.pt"
    return json.loads(path.read_text()), (torch.load(tensors) if tensors.exists() else None)


def _record(worst_errors, key, err):
    worst_errors[("Trainer", key)] = (max(worst_errors.get(("Trainer", key), (0.0,))[0], err),
                                      TOL)


def _rel(a, b):
    return float((a - b).norm() / b.norm())


def _check_case(runs, worst_errors, case, mesh, steps):
    """Every rank of ``case`` against the one-process reference (see module doc)."""
    ref, ref_t = _load(runs, "ref", case, 0)
    assert len(ref["loss"]) == steps and len(ref_t["grads"]) == steps, ref
    assert ref["loss"][0] != ref["loss"][-1]  # it trains: a wrong gradient moves the losses
    kind = "w4" if WORLD[case] == 4 else "w3"
    for rank in range(WORLD[case]):
        got, got_t = _load(runs, kind, case, rank)
        assert got["mesh"] == mesh, got["mesh"]
        # every gradient is FSDP2's, sharded over all W ranks (dp_shard x cp flattened)
        assert got["grad_meshes"] == [[WORLD[case]]] * steps, got["grad_meshes"]
        first = ["eval_loss_first"] if case == "cp3" else []
        for key in ["loss", "grad_norm", "train_loss", "eval_loss", *first]:
            a, b = (x if isinstance(x, list) else [x] for x in (got[key], ref[key]))
            assert len(a) == len(b), (key, rank, a, b)
            for step, (x, y) in enumerate(zip(a, b)):
                err = abs(x - y) / abs(y)
                _record(worst_errors, f"pc {key}", err)
                assert err <= TOL, (f"{case} {key}[{step}] on rank {rank}: {x} vs one process "
                                    f"{y} (relative error {err:.2e})")
        assert len(got_t["grads"]) == steps
        for step, (g, want) in enumerate(zip(got_t["grads"], ref_t["grads"])):
            assert g.keys() == want.keys()
            for name, w in want.items():
                err = _rel(g[name], w)
                _record(worst_errors, "pc grads", err)
                assert err <= TOL, (f"{case} step {step} gradient of {name} on rank {rank}: "
                                    f"relative error {err:.2e}")
        for name, w in ref_t["weights"].items():
            err = _rel(got_t["weights"][name], w)
            _record(worst_errors, "pc weights", err)
            assert err <= TOL, f"{case} {name} after training on rank {rank}: {err:.2e}"
        if case == "cp3":
            assert got_t["logits"].shape == ref_t["logits"].shape == (5, 37, 97)
            err = _rel(got_t["logits"], ref_t["logits"])
            _record(worst_errors, "pc logits", err)
            assert err <= TOL, f"{case} predict logits on rank {rank}: {err:.2e}"
    return ref_t["weights"]


@pytest.mark.timeout(LIMIT_S + 60)
def test_dp_shard_2_x_cp_2_trains_like_one_process(runs, worst_errors):
    """D=2 x C=2 on 4 ranks, 2 rows per replica, three steps: one process reading 4 rows;
    ``save_model`` and the ``save_only_model`` checkpoint of step 3 hold the one-process
    weights."""
    from safetensors.torch import load_file

    weights = _check_case(runs, worst_errors, "dp2_cp2", ["dp_shard", "cp"], 3)
    out, _ = runs
    for saved in ("saved", "checkpoint-3"):
        state = load_file(out / "w4" / "dp2_cp2" / saved / "model.safetensors")
        assert state.keys() == weights.keys(), saved
        for name, w in weights.items():
            assert _rel(state[name], w) <= TOL, (saved, name)


@pytest.mark.timeout(LIMIT_S + 60)
def test_dp_shard_2_x_cp_2_with_gradient_accumulation_and_clipping(runs, worst_errors):
    """The same mesh accumulating 2 micro-batches of different target counts per step
    (the loss is the mean over every target of both), gradients clipped at 1.0."""
    _check_case(runs, worst_errors, "dp2_cp2_accum", ["dp_shard", "cp"], 3)


@pytest.mark.timeout(LIMIT_S + 60)
def test_cp_3_trains_like_one_process(runs, worst_errors):
    """C=3, D=1 on 3 ranks (an odd ring; S=37): evaluate before training (the FSDP2 root
    stays unsharded after a forward), four steps clipped at 1.0, evaluate and predict."""
    _check_case(runs, worst_errors, "cp3", ["cp"], 4)


@pytest.mark.timeout(LIMIT_S + 60)
def test_unsupported_parallelism_configs_are_refused_on_every_rank(runs):
    """tp, dp_replicate (and cp_size 1), a cp_size argument that contradicts the config, a
    config smaller than the world, checkpoints with the sharded optimizer state,
    TrainingArguments(fsdp=...) besides the config: each a
    ValueError naming the values, on every rank (the same cp_size both ways, and
    save_only_model checkpoints, are accepted)."""
    for rank in range(4):
        got, _ = _load(runs, "w4", "refusals4", rank)
        assert "tp_size=2 (RingTrainer supports 1)" in (got["tp"] or ""), got
        assert "dp_replicate_size=2 (RingTrainer supports 1)" in (got["dp_replicate"] or ""), got
        assert "cp_size=1 (RingTrainer needs" in (got["dp_replicate"] or ""), got
        assert "RingTrainer(cp_size=4) differs from parallelism_config cp_size=2" in (
            got["cp_conflict"] or ""), got
        assert "total size 2 is not the world size 4" in (got["total"] or ""), got
        assert "save_strategy='steps' without save_only_model=True" in (got["save"] or ""), got
        assert "TrainingArguments(fsdp=" in (got["fsdp"] or ""), got
        # accepted: RingTrainer(cp_size=2) with the config's cp_size 2; weights-only saves
        assert got["cp_same"] is None and got["save_only_model"] is None, got
