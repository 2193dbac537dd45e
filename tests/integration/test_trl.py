"""TRL recipes: ``RingSFTTrainer`` and ``RingDPOTrainer`` under torchrun on 2 and 3 CPU ranks
log what TRL's ``SFTTrainer`` / ``DPOTrainer`` log in one process on the same data, and
step with the same gradients: every logged value (loss, grad_norm, entropy,
mean_token_accuracy, num_tokens; DPO's rewards/*, logps/*, logits/*; the eval metrics) and
every parameter's gradient at every optimizer step, on every rank.

One launch per world size runs every case of ``trl_run.py`` (one process runs TRL's plain
trainers). fp32 tolerance: 1e-5 relative (the sums over ranks and ring steps reorder float32
additions). A gradient is compared by its norm-relative error ||g - g_ref|| / ||g_ref|| per
parameter tensor; a logged value by |a - b| / |b| (an exact 0 must be 0).
"""

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("trl")

RUN = Path(__file__).with_name("trl_run.py")
sys.path.insert(0, str(RUN.parent))
from launches import launch_all  # noqa: E402
from trl_run import DEFAULT as DEFAULT_CASES  # noqa: E402
WORLDS = (2, 3)
TOL = 1e-5
CASES = ("sft_packed", "sft_padded", "dpo", "dpo_mix")
TIMEOUT = 400


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """(directory, {"ref": failure or None, 2: ..., 3: ...}): the one-process run of every
    case and one torchrun launch per world size, started together."""
    out = tmp_path_factory.mktemp("trl")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    with_docs = ["--cases", ",".join((*DEFAULT_CASES, "docs"))]  # docs/trainers.md's blocks
    cmds = {"ref": [sys.executable, str(RUN), "--ref", "--out", str(out / "ref"), *with_docs]}
    for w in WORLDS:
        cmds[w] = [*torchrun, "--nproc-per-node", str(w), str(RUN), "--out", str(out / f"cp{w}"),
                   *(with_docs if w == 2 else [])]
    return out, launch_all(cmds, out, TIMEOUT)


def _load(runs, kind, case, rank):
    out, failures = runs
    d = out / ("ref" if kind == "ref" else f"cp{kind}")
    path = d / f"{case}.{rank}.json"
    if not path.exists():
        pytest.fail(f"{kind} rank {rank} wrote no {case} results:\n{failures[kind]}")
    grads = d / f"{case}.{rank}.pt"
    return json.loads(path.read_text()), (torch.load(grads) if grads.exists() else None)


def _record(worst_errors, key, err, tol):
    worst_errors[key] = (max(worst_errors.get(key, (0.0, tol))[0], err), tol)


# wall-clock timings, and Trainer's FLOPs estimate (a count of the local input's tokens
# times the parameters, not a property of training)
SKIP = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "eval_runtime",
        "eval_samples_per_second", "eval_steps_per_second", "total_flos"}
BETA = 0.5  # trl_run.py's DPO beta
LOGIT = 1e-2  # below the tiny Llama's logit magnitude (RMS about 0.16)


def scale(key, entry):
    """What the rounding of ``entry[key]`` is relative to: the value itself, or for values
    that cancel by construction the magnitude of what they are computed from: a reward is
    beta times a difference of two sequence log-probabilities (policy minus reference, equal
    at step 0), a margin the difference of two rewards, ``logits/*`` a mean over vocabulary
    and tokens of logits of both signs."""
    pre = "eval_" if key.startswith("eval_") else ""
    base = key[len(pre):]
    chosen, rejected = (abs(entry.get(pre + f"logps/{s}", 0.0)) for s in ("chosen", "rejected"))
    floor = {"rewards/chosen": BETA * chosen, "rewards/rejected": BETA * rejected,
             "rewards/margins": BETA * (chosen + rejected),
             "logits/chosen": LOGIT, "logits/rejected": LOGIT}.get(base, 0.0)
    return max(abs(entry[key]), floor)


def compare_logs(worst_errors, case, got, want, where):
    """Every logged value of one process (except timings) logged alike by ``got``; returns
    how many were compared."""
    assert len(got) == len(want), f"{case} {where}: {len(got)} log entries, one process {len(want)}"
    n = 0
    for i, (g, w) in enumerate(zip(got, want)):
        assert set(g) == set(w), f"{case} {where} log {i}: keys {sorted(g)} vs {sorted(w)}"
        for key in sorted(set(w) - SKIP):
            a, b, s = g[key], w[key], scale(key, w)
            err = abs(a - b) / s if s != 0 else abs(a)
            _record(worst_errors, ("TRL", key.removeprefix("eval_").split("/")[0]), err, TOL)
            assert err <= TOL, (f"{case} {where} log {i} {key}: {a} vs one process {b} "
                                f"(error {err:.2e} of {s:.3g} > {TOL:.0e})")
            n += 1
    return n


def compare_grads(worst_errors, case, got, want, where):
    """Every parameter's gradient at every optimizer step."""
    assert len(got) == len(want) > 0, f"{case} {where}: {len(got)} steps, one process {len(want)}"
    for step, (g, w) in enumerate(zip(got, want)):
        assert set(g) == set(w), f"{case} {where} step {step}: parameters differ"
        for name, ref in w.items():
            err = float((g[name] - ref).norm() / ref.norm())
            _record(worst_errors, ("TRL", "gradient"), err, TOL)
            assert err <= TOL, (f"{case} {where} step {step} grad {name}: relative error "
                                f"{err:.2e} > {TOL:.0e}")


@pytest.mark.timeout(3 * TIMEOUT)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", CASES)
def test_trl_trainer_logs_and_gradients_equal_one_process(runs, worst_errors, case, world):
    """sft_packed: padding-free packed rows (position ids restarting per document), the
    completion-only loss, gradient accumulation 2; sft_padded: padded rows of different
    lengths, through a user's SFTTrainer subclass; dpo: sigmoid loss, chosen/rejected
    padded to one S; dpo_mix: ipo + sft losses with ld_alpha and gradient accumulation.
    Three steps each (and evaluate): every logged value and every parameter gradient equal
    one process on every rank."""
    want_logs, want_grads = _load(runs, "ref", case, 0)
    assert any("loss" in h for h in want_logs) and want_grads
    for rank in range(world):
        logs, grads = _load(runs, world, case, rank)
        where = f"W={world} rank {rank}"
        assert compare_logs(worst_errors, case, logs, want_logs, where) >= 10
        if case == "sft_padded":  # the user's subclass's log ran (one process logs it too)
            assert sum("loss_bits" in h for h in logs) == 3, logs
        compare_grads(worst_errors, case, grads, want_grads, where)
    out, _ = runs
    lengths = json.loads((out / f"cp{world}" / f"{case}.0.lengths.json").read_text())
    assert any(s % (2 * world) for s in lengths), (case, world, lengths)  # uneven shards


@pytest.mark.timeout(3 * TIMEOUT)
def test_docs_trl_blocks_run_as_printed(runs, worst_errors):
    """docs/trainers.md's RingSFTTrainer and RingDPOTrainer blocks, run as printed on 2
    ranks with the names the page says are the reader's, log what TRL's own trainers log in
    one process on the same data."""
    want = _load(runs, "ref", "docs", 0)[0]
    for rank in range(2):
        got = _load(runs, 2, "docs", rank)[0]
        for key in ("sft", "dpo"):
            assert any("loss" in h for h in want[key]), key
            assert compare_logs(worst_errors, f"docs {key}", got[key], want[key],
                                f"W=2 rank {rank}") >= 5


@pytest.mark.timeout(3 * TIMEOUT)
@pytest.mark.parametrize("world", WORLDS)
@pytest.mark.parametrize("case", ("sft_packed", "sft_padded", "dpo"))
def test_predict_returns_the_whole_sequences_logits(runs, worst_errors, case, world):
    """``predict`` after training: every rank returns the one-process loss and the logits
    of the whole sequences ([rows, S, V]; DPO: chosen then rejected rows)."""
    out, _ = runs
    want = torch.load(out / "ref" / f"{case}.0.predict.pt")
    assert want["logits"].dim() == 3 and want["logits"].shape[-1] == 97
    for rank in range(world):
        got = torch.load(out / f"cp{world}" / f"{case}.{rank}.predict.pt")
        assert got["logits"].shape == want["logits"].shape, (rank, got["logits"].shape)
        err = float((got["logits"] - want["logits"]).norm() / want["logits"].norm())
        loss_err = abs(got["loss"] - want["loss"]) / abs(want["loss"])
        _record(worst_errors, ("TRL", "predict logits"), err, TOL)
        _record(worst_errors, ("TRL", "predict loss"), loss_err, TOL)
        assert err <= TOL and loss_err <= TOL, (case, world, rank, err, loss_err)


@pytest.mark.timeout(3 * TIMEOUT)
@pytest.mark.parametrize("world", WORLDS)
def test_refusals_name_the_option_on_every_rank(runs, world):
    """NEFTune noise and Liger kernels (SFT and DPO), cp_size=1 (dp x cp), a missing or eager
    reference model and precomputed reference log-probabilities are refused with a
    ValueError naming them, on every rank."""
    expect = {"sft_neftune": "neftune_noise_alpha", "dpo_neftune": "neftune_noise_alpha",
              "sft_liger": "use_liger_kernel", "dpo_liger": "use_liger_kernel",
              "sft_dp_cp": "(dp x cp) is not supported",
              "dpo_no_ref": "needs a ref_model", "dpo_eager_ref": "'eager'",
              "dpo_precompute": "precompute_ref_log_probs"}
    for rank in range(world):
        got, _ = _load(runs, world, "refusals", rank)
        for key, words in expect.items():
            assert got[key] is not None and words in got[key], (world, rank, key, got[key])
