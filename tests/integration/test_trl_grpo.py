"""``RingGRPOTrainer`` under torchrun on 2 CPU ranks (the default case on 3 too) logs what
TRL's ``GRPOTrainer`` logs in one process on the same prompts, generates the same
completions, and steps with the same gradients: every logged metric (loss, grad_norm, kl,
entropy, the clip ratios, rewards and their std per function, reward_std,
frac_reward_zero_std, completion lengths, num_tokens) and every parameter's gradient at
every optimizer step, on every rank (fp32, 1e-5 relative, a gradient relative to itself or
to 1e-3 of the whole model's, as test_families.py compares; an exact 0 must be 0).
Refused options raise by name; rewards that differ across the ranks raise on every rank.

One launch per world size runs every case of ``grpo_run.py`` (one process runs TRL's own
trainer; the docs' block runs as printed). Cases: ``grpo`` (TRL's default loss, beta 0.1 with the reference model, gradient
accumulation 2) and ``grpo_iter`` (``num_iterations=2``: the old policy's log-probabilities
and the clipping; ``loss_type="grpo"``, ``epsilon=0.05``, ``mask_truncated_completions``) and ``grpo_hybrid`` (a tiny Qwen3-Next, Gated DeltaNet and
attention layers, converted by ``convert``); prompts left-padded, completions of 1 to 8
tokens.
"""

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("trl")

RUN = Path(__file__).with_name("grpo_run.py")
sys.path.insert(0, str(RUN.parent))
from launches import launch_all  # noqa: E402

WORLDS = (2, 3)
TOL = 1e-5
CASES = ("grpo", "grpo_iter", "grpo_hybrid")
TIMEOUT = 400
GRAD_FLOOR = 1e-3
SKIP = {"train_runtime", "train_samples_per_second", "train_steps_per_second", "step_time",
        "total_flos"}


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("grpo")
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
    cmds = {"ref": [sys.executable, str(RUN), "--ref", "--out", str(out / "ref"),
                    "--cases", ",".join((*CASES, "docs"))]}
    for w in WORLDS:
        # W = 3 runs the default case (the others at W = 2 and dp x cp: the suite's time)
        cases = ",".join((*CASES, "refusals", "docs")) if w == 2 else "grpo"
        cmds[w] = [*torchrun, "--nproc-per-node", str(w), str(RUN), "--out", str(out / f"cp{w}"),
                   "--cases", cases]
    # dp 2 x cp 2 against TRL's own data parallelism on 2 processes
    cmds["refdp2"] = [*torchrun, "--nproc-per-node", "2", str(RUN), "--ref", "--out",
                      str(out / "refdp2"), "--cases", "grpo"]
    cmds["dp2cp2"] = [*torchrun, "--nproc-per-node", "4", str(RUN), "--out",
                      str(out / "dp2cp2"), "--cases", "grpo", "--cp-size", "2"]
    return out, launch_all(cmds, out, TIMEOUT)


def _load(runs, kind, case, rank):
    out, failures = runs
    d = out / (kind if isinstance(kind, str) else f"cp{kind}")
    path = d / f"{case}.{rank}.json"
    if not path.exists():
        pytest.fail(f"{kind} rank {rank} wrote no {case} results:\n{failures[kind]}")
    tensors = d / f"{case}.{rank}.pt"
    return json.loads(path.read_text()), (torch.load(tensors) if tensors.exists() else None)


def _record(worst_errors, key, err):
    worst_errors[key] = (max(worst_errors.get(key, (0.0, TOL))[0], err), TOL)


@pytest.mark.timeout(3 * TIMEOUT)
@pytest.mark.parametrize("case,world", [(c, 2) for c in CASES] + [("grpo", 3)])
def test_grpo_logs_completions_and_gradients_equal_one_process(runs, worst_errors, case,
                                                               world):
    _compare(runs, worst_errors, case, "ref", world, range(world))


@pytest.mark.timeout(3 * TIMEOUT)
def test_grpo_dp2_by_cp2_equals_trl_data_parallel(runs, worst_errors):
    """4 ranks as 2 dp replicas x CP 2 (``cp_size=2``) against TRL's GRPOTrainer on 2
    data-parallel processes without CP: each replica generates what TRL's process of its
    index generates, and every logged metric and gradient are TRL's."""
    _compare(runs, worst_errors, "grpo", "refdp2", "dp2cp2", range(4))


def _compare(runs, worst_errors, case, ref_kind, kind, ranks):
    """Every rank of ``kind``'s run of ``case`` against rank 0 of ``ref_kind``'s (the
    completions: against the reference rank of the same replica)."""
    want_logs, want = _load(runs, ref_kind, case, 0)
    steps = [h for h in want_logs if "loss" in h]
    assert len(steps) == (2 if case == "grpo_hybrid" else 3) and want["grads"]
    # the run is not degenerate: completions of unequal lengths, a KL, a moving loss
    assert any(h["completions/min_length"] < h["completions/max_length"] for h in steps)
    assert any(h["kl"] > 0 for h in steps) and any(h["loss"] != 0 for h in steps)
    if case == "grpo_iter":
        assert any(h.get("clip_ratio/region_mean", 0) > 0 for h in steps), steps
    per_replica = len(ranks) // 2 if ref_kind == "refdp2" else len(ranks)
    for rank in ranks:
        logs, got = _load(runs, kind, case, rank)
        where = f"{case} {kind} rank {rank}"
        rollouts = _load(runs, ref_kind, case, rank // per_replica)[1]["completions"]
        assert got["completions"] == rollouts, where  # the same rollouts
        assert len(logs) == len(want_logs), where
        n = 0
        for i, (g, w) in enumerate(zip(logs, want_logs)):
            assert set(g) == set(w), (where, i, sorted(set(g) ^ set(w)))
            for key in sorted(set(w) - SKIP):
                a, b = g[key], w[key]
                err = abs(a - b) / abs(b) if b != 0 else abs(a)
                _record(worst_errors, ("GRPO", key.split("/")[0]), err)
                assert err <= TOL, f"{where} log {i} {key}: {a} vs one process {b} ({err:.2e})"
                n += 1
        assert n >= 40, n
        assert len(got["grads"]) == len(want["grads"]), where
        for step, (g, w) in enumerate(zip(got["grads"], want["grads"])):
            assert set(g) == set(w), (where, step)
            # relative to the parameter's gradient, or to GRAD_FLOOR of the whole model's
            # where that is larger (test_families.py's rule: a tiny gradient, such as the
            # Gated DeltaNet's dt_bias, is rounding noise of the whole at 1e-5 of itself)
            floor = GRAD_FLOOR * float(torch.cat([r.flatten() for r in w.values()]).norm())
            for name, ref in w.items():
                err = float((g[name] - ref).norm()) / max(float(ref.norm()), floor)
                _record(worst_errors, ("GRPO", "gradient"), err)
                assert err <= TOL, f"{where} step {step} grad {name}: {err:.2e}"


@pytest.mark.timeout(3 * TIMEOUT)
def test_grpo_refusals(runs):
    """Refused by name before training (the same on every rank); rewards that differ across
    the ranks raise on every rank."""
    seen = [_load(runs, 2, "refusals", r)[0] for r in range(2)]
    assert seen[0] == seen[1], seen
    said = seen[0]
    for key, words in {"use_vllm": "use_vllm=True", "scale_rewards": "scale_rewards='batch'",
                       "top_entropy_quantile": "top_entropy_quantile=0.5",
                       "neftune": "neftune_noise_alpha", "eval_dataset": "eval_dataset",
                       "sdpa model": "attention",
                       "rewards differ": "reward functions returned different values"}.items():
        assert said[key] is not None and said[key].startswith("ValueError") and \
            words in said[key], (key, said[key])


@pytest.mark.timeout(3 * TIMEOUT)
def test_docs_grpo_block_runs_as_printed(runs):
    """docs/trainers.md's RingGRPOTrainer block, run as printed on 2 ranks, logs what TRL's
    GRPOTrainer logs in one process on the same names."""
    want = _load(runs, "ref", "docs", 0)[0]["logs"]
    assert sum("loss" in h for h in want) == 2
    for rank in range(2):
        got = _load(runs, 2, "docs", rank)[0]["logs"]
        assert len(got) == len(want)
        for g, w in zip(got, want):
            for key in sorted(set(w) - SKIP):
                err = abs(g[key] - w[key]) / abs(w[key]) if w[key] != 0 else abs(g[key])
                assert err <= TOL, (rank, key, g[key], w[key])
