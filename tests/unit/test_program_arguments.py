"""The programs' arguments, checked before any rank starts: every numeric option through
one helper (``ringattn.apps.Number``: argparse's one-line error and status 2, naming the
option and its range; ``ringattn demo --steps 0`` once ran the default 100 steps), the
demo's shortest S (``--seqlen 9`` once ended in a ZeroDivisionError), a ``--model`` config
with attention dropout (once 163 lines of tracebacks from the ranks), an Eagle3 resume at
the last step (once a FileNotFoundError after training nothing), the ``demo`` extra (it
lacked accelerate, which transformers' Trainer imports), and the progress bar naming the
CP strategy (it said "ring attention" under ulysses and auto)."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _one_line_exit(capsys, fn, argv) -> str:
    capsys.readouterr()
    with pytest.raises(SystemExit) as exc:
        fn(argv)
    captured = capsys.readouterr()
    assert exc.value.code == 2, captured.err
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


def _main(program: str):
    import importlib

    return importlib.import_module(f"ringattn.apps.{program}").main


# --------------------------------------------------------------------------- numeric options

RANGE = [
    # ringattn demo: --steps 0 / --seqlen 0 once ran the defaults (args.steps or 100)
    ("cli", ["demo", "--steps", "0"], "ringattn demo", "--steps", "an int >= 1, got 0"),
    ("cli", ["demo", "--target", "lm", "--steps", "0"], "ringattn demo", "--steps",
     "an int >= 1, got 0"),
    ("cli", ["demo", "--target", "lm", "--seqlen", "0"], "ringattn demo", "--seqlen",
     "an int >= 4 with --target lm, got 0"),
    ("cli", ["demo", "--world", "0"], "ringattn demo", "--world", "an int >= 1, got 0"),
    ("cli", ["train", "--steps", "0"], "ringattn train", "--steps", "an int >= 1, got 0"),
    ("cli", ["train", "--seqlen", "3"], "ringattn train", "--seqlen", "an int >= 4, got 3"),
    ("cli", ["train", "--copy-vocab", "1"], "ringattn train", "--copy-vocab",
     "an int >= 2, got 1"),
    ("cli", ["train", "--lr", "nan"], "ringattn train", "--lr", "a finite float > 0, got nan"),
    ("cli", ["train", "--init-std", "0"], "ringattn train", "--init-std",
     "a finite float > 0, got 0.0"),
    # a negative seed reached numpy's seeding on every rank
    ("cli", ["train", "--seed", "-1"], "ringattn train", "--seed",
     "an int in [0, 4294967295], got -1"),
    ("cli", ["train", "--log-every", "-1"], "ringattn train", "--log-every",
     "an int >= 0, got -1"),
    ("cli", ["train", "--strategy", "hybrid", "--ulysses", "0"], "ringattn train",
     "--ulysses", "an int >= 1, got 0"),
    ("train", ["--batch", "0"], "python -m ringattn.apps.train", "--batch",
     "an int >= 1, got 0"),
    ("eagle3_train", ["--steps", "0"], "python -m ringattn.apps.eagle3_train", "--steps",
     "an int >= 1, got 0"),
    # Eagle3's --lr had no check at all
    ("eagle3_train", ["--lr", "-0.1"], "python -m ringattn.apps.eagle3_train", "--lr",
     "a finite float > 0, got -0.1"),
    ("eagle3_train", ["--grad-clip", "inf"], "python -m ringattn.apps.eagle3_train",
     "--grad-clip", "a finite float >= 0, got inf"),
    ("eagle3_train", ["--accumulate", "0"], "python -m ringattn.apps.eagle3_train",
     "--accumulate", "an int >= 1, got 0"),
    ("eagle3_train", ["--pad", "-1"], "python -m ringattn.apps.eagle3_train", "--pad",
     "an int >= 0, got -1"),
    ("eagle3_train", ["--eval-prompts", "-1"], "python -m ringattn.apps.eagle3_train",
     "--eval-prompts", "an int >= 0, got -1"),
    ("eagle3_target", ["--target", "t", "--data", "d", "--out", "o", "--seqlen", "0"],
     "python -m ringattn.apps.eagle3_target", "--seqlen", "an int >= 1, got 0"),
    ("specforge_train", ["train", "-c", "run.yaml", "--cp-size", "0"],
     "python -m ringattn.apps.specforge_train train", "--cp-size", "an int >= 1, got 0"),
]


@pytest.mark.parametrize("program,argv,prog,option,allowed", RANGE,
                         ids=[" ".join(c[1]) for c in RANGE])
def test_numeric_options_out_of_range_are_argparse_errors(no_ranks, capsys, program, argv,
                                                          prog, option, allowed):
    line = _one_line_exit(capsys, _main(program), argv)
    assert line == f"{prog}: argument {option}: must be {allowed} (--help lists the options)"


def test_text_that_is_no_number_keeps_argparse_message(no_ranks, capsys):
    line = _one_line_exit(capsys, _main("cli"), ["demo", "--steps", "x"])
    assert line == "ringattn demo: argument --steps: invalid int value: 'x' (--help lists " \
                   "the options)"


def test_every_numeric_option_goes_through_the_helper():
    """No program declares ``type=int`` or ``type=float`` (which takes any number)."""
    for path in sorted((ROOT / "src" / "ringattn" / "apps").glob("*.py")):
        found = re.findall(r"type=(?:int|float)\b", path.read_text())
        assert not found, (path.name, found)


def test_number_helper():
    from ringattn.apps import Number

    assert Number(int, 1)("3") == 3 and Number(float, above=0)("1e-3") == 1e-3
    assert Number(int, 0, 10).problem(11) == "must be an int in [0, 10], got 11"
    assert Number(int, 1).problem(True) is not None
    assert Number(float, 0).problem(float("-inf")) == "must be a finite float >= 0, got -inf"
    assert Number(int).problem(-5) is None
    with pytest.raises(ValueError):  # argparse's "invalid int value"
        Number(int, 1)("1.5")


# --------------------------------------------------------------------------- --world

WORLD_ARGV = [("cli", ["demo"], "ringattn demo"), ("cli", ["demo", "--target", "lm"], "ringattn demo"),
              ("cli", ["train"], "ringattn train"), ("train", [], "python -m ringattn.apps.train"),
              ("eagle3_train", [], "python -m ringattn.apps.eagle3_train")]
"""Every program with --world (it spawns that many ranks here)."""


@pytest.mark.parametrize("program,argv,prog", WORLD_ARGV, ids=[" ".join(c[1]) or c[0]
                                                                for c in WORLD_ARGV])
def test_a_world_beyond_the_machine_is_refused_before_spawning(no_ranks, capsys, program,
                                                                argv, prog):
    """``--world 1000`` on 2 cores once started spawning 1000 ranks: refused in argparse,
    naming the value and the limit (the machine's cores, at least 8)."""
    from ringattn.apps import WORLD_FLOOR, cores, world_limit

    limit = world_limit()
    assert limit == max(WORLD_FLOOR, cores()) >= 8
    line = _one_line_exit(capsys, _main(program), [*argv, "--world", str(limit + 1)])
    assert line == (f"{prog}: argument --world: must be at most {limit} on this machine "
                    f"(spawned ranks share its {cores()} cores: at most max(cores, 8) of them), "
                    f"got {limit + 1} (--help lists the options)")


def test_the_world_limit_itself_is_accepted_and_spawn_refuses_beyond_it(no_ranks):
    """The limit parses (one step below the refusal); ``spawn`` from Python refuses one rank
    more with the same words, before starting any."""
    from ringattn.apps import World, cli, world_limit
    from ringattn.apps.train import TrainConfig, spawn

    limit = world_limit()
    assert World()(str(limit)) == limit
    assert cli._parser().parse_args(["demo", "--world", str(limit)]).world == limit
    with pytest.raises(ValueError, match=f"world must be at most {limit} on this machine.*"
                                         f"got {limit + 1}"):
        spawn(TrainConfig(steps=1), world=limit + 1)


# --------------------------------------------------------------------------- the demo's S


@pytest.mark.parametrize("seqlen", ["2", "5", "9", "15"])
def test_eagle3_demo_refuses_a_sequence_too_short_to_train(no_ranks, capsys, seqlen):
    """S=9 (also 5, 2) ended in a ZeroDivisionError: every loss was 0."""
    line = _one_line_exit(capsys, _main("cli"), ["demo", "--seqlen", seqlen])
    assert line == (f"ringattn demo: argument --seqlen: must be an int >= 16 with --target "
                    f"eagle3 (8 prompt tokens, then one for each of the 7 TTT steps), got "
                    f"{seqlen} (--help lists the options)")
    line = _one_line_exit(capsys, _main("eagle3_train"), ["--seqlen", seqlen])
    assert "argument --seqlen: must be an int >= 16 on the synthetic data" in line


def test_demo_minimum_seqlen_is_accepted(monkeypatch, no_ranks):
    """S=16 (Eagle3) and S=4 (lm) pass the checks and reach the ranks."""
    import torch.multiprocessing as mp

    from ringattn.apps import cli, eagle3_demo

    class Spawned(Exception):
        pass

    def spawn(*args, **kwargs):
        raise Spawned

    monkeypatch.setattr(mp, "spawn", spawn)
    for argv in (["demo", "--seqlen", "16", "--steps", "1"],
                 ["demo", "--target", "lm", "--seqlen", "4", "--steps", "1"]):
        with pytest.raises(Spawned):
            cli.main(argv)
    with pytest.raises(ValueError, match="seqlen must be an int >= 16"):
        eagle3_demo.run_eagle3_demo(seqlen=15, steps=1, verbose=False)
    assert eagle3_demo._rel(0.0, 0.0) == 0.0 and eagle3_demo._rel(1.0, 0.0) == float("inf")


def test_sixteen_is_the_shortest_row_where_every_ttt_step_trains():
    """TTT step j counts position i when i is trained (not the prompt, not padding) and
    token i + 1 + j is real: at S=16 each of the 7 steps has a position, at S=15 the last
    has none (and below S=10 no step has one: every loss 0)."""
    from ringattn.apps.eagle3_train import (SYNTHETIC_MIN_SEQLEN, Eagle3Config,
                                            make_batches)

    def counted(seqlen):
        cfg = Eagle3Config(steps=1, seqlen=seqlen, pad=min(Eagle3Config.pad, seqlen // 4))
        batch = next(make_batches(cfg, replica=None))
        loss, real = batch["loss_mask"].bool(), batch["attention_mask"].bool()
        return [int((loss[:, :seqlen - 1 - j] & real[:, 1 + j:]).sum())
                for j in range(cfg.ttt_steps)]

    assert SYNTHETIC_MIN_SEQLEN == 16
    assert min(counted(16)) >= 1
    assert counted(15)[-1] == 0
    assert counted(9) == [0] * 7


# --------------------------------------------------------------------------- --model configs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("family,field", [("gpt2", "attn_pdrop"),
                                          ("bert", "attention_probs_dropout_prob")])
def test_train_refuses_attention_dropout_before_ranks(tmp_path, no_ranks, capsys, family,
                                                      field):
    """GPT-2's and BERT's default configs: one line naming the field and the value to set
    (the ranks once printed ~163 lines of "no attention dropout" tracebacks); with the field
    at 0 the config passes."""
    from transformers import AutoConfig

    from ringattn.apps.train import TrainConfig

    AutoConfig.for_model(family).save_pretrained(tmp_path / family)
    model = str(tmp_path / family)
    line = _one_line_exit(capsys, _main("cli"), ["train", "--model", model, "--steps", "1"])
    assert line == (f"ringattn train: model={model!r}: its config sets {field}=0.1, and ring "
                    f"attention has no attention dropout: set {field} to 0 in its config.json")
    config = json.loads((tmp_path / family / "config.json").read_text())
    config[field] = 0
    (tmp_path / family / "config.json").write_text(json.dumps(config))
    TrainConfig(model=model, steps=1).check_world(2)  # nothing left to refuse


def test_train_converts_a_router_loss_before_the_ranks_start(tmp_path):
    """A router auxiliary loss (``output_router_logits=True``) was refused of the built model;
    ``ringattn train`` now converts the model (the loss made global), and the check before
    the ranks start converts the meta-built model the same way: it passes."""
    from transformers import AutoConfig, MixtralConfig

    from ringattn.apps.train import check_cp_model

    MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                  num_attention_heads=4, num_key_value_heads=2, num_local_experts=2,
                  output_router_logits=True).save_pretrained(tmp_path / "moe")
    assert check_cp_model(AutoConfig.from_pretrained(tmp_path / "moe")) is None


@pytest.mark.parametrize("family", ["falcon", "gpt_neo"])
def test_train_builds_falcon_and_gpt_neo_eager_and_converts_them(tmp_path, family):
    """Falcon and GPT-Neo were refused before the ranks started, with advice to call
    ``ra_hf.convert`` (a Python function) that a command-line user cannot follow: the
    program builds them "eager" and converts them itself (tests/integration/test_train.py
    trains both against one process)."""
    from families import FAMILIES

    from ringattn.apps.train import TrainConfig, build_model
    from ringattn.integrations import transformers as ra_hf

    config, _ = FAMILIES[family]()
    config.save_pretrained(tmp_path / family)
    cfg = TrainConfig(model=str(tmp_path / family), steps=1)
    cfg.check_world(2)
    model = build_model(cfg, ra_hf.NAME)
    assert ra_hf.converted(model) and model.config._attn_implementation == ra_hf.NAME
    ra_hf.check_attention(model)
    assert build_model(cfg, "eager").config._attn_implementation == "eager"


# --------------------------------------------------------------------------- Eagle3 resume


@pytest.mark.timeout(120)
def test_eagle3_resume_at_the_last_step_is_refused(tmp_path, no_ranks, capsys):
    """It trained and exported nothing, then failed on a missing draft-speculators/config.json
    in the new --output; now one line before any rank starts, as ``ringattn train`` says."""
    from ringattn.apps.eagle3_train import Eagle3Config, train_eagle3

    cfg = Eagle3Config(steps=1, seqlen=16, pad=4)  # what the command line makes of these
    train_eagle3(cfg, progress=False, out_dir=str(tmp_path / "first"))
    checkpoint = str(tmp_path / "first" / "checkpoint-last")
    line = _one_line_exit(capsys, _main("eagle3_train"),
                          ["--resume", checkpoint, "--steps", "1", "--seqlen", "16",
                           "--output", str(tmp_path / "second")])
    assert line == (f"python -m ringattn.apps.eagle3_train: resume {checkpoint!r} is at step "
                    f"1, not before the last of steps=1: nothing to train or export (raise "
                    f"--steps to train on from it)")
    assert not (tmp_path / "second").exists()
    with pytest.raises(ValueError, match="is at step 1, not before the last of steps=1"):
        train_eagle3(cfg, progress=False, resume=checkpoint)


# --------------------------------------------------------------------------- the demo extra


def test_demo_extra_holds_what_the_programs_check(monkeypatch, no_ranks, capsys):
    """pyproject's extras hold every package the programs check for (the demo extra lacked
    accelerate: ringattn train died with transformers' ImportError); without accelerate
    the programs that run Trainer stop with one line naming the install."""
    tomllib = pytest.importorskip("tomllib")
    from ringattn.apps import EXTRAS

    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]
    for extra, packages in EXTRAS.items():
        names = {re.split(r"[<>=!~\[; ]", r, maxsplit=1)[0].lower() for r in extras[extra]}
        for package in packages:
            assert package in names or f"nvidia-{package}" in names, (extra, package, names)
    assert "accelerate" in EXTRAS["demo"]

    monkeypatch.setitem(sys.modules, "accelerate", None)  # find_spec: None
    for argv in (["train"], ["demo", "--target", "lm"]):
        line = _one_line_exit(capsys, _main("cli"), argv)
        assert line == (f"ringattn {argv[0]} needs accelerate: pip install "
                        f"'ringattn[demo]'"), line


# --------------------------------------------------------------------------- the bar's name


def test_cp_label_names_the_strategy():
    from ringattn.apps.train import cp_label

    assert cp_label("ring", 2) == "ring attention, W=2"
    assert cp_label("ulysses", 4) == "Ulysses attention, W=4"
    assert cp_label("hybrid", 4, 2) == "hybrid attention (Ulysses 2 x ring 2), W=4"
    assert cp_label("auto", 2) == "auto, W=2"
    assert cp_label("auto", 2, chosen=["allgather"]) == "auto: all-gather attention, W=2"


_BARS = """
import json, os, sys, tempfile
import torch.distributed as dist
from ringattn.apps.train import TrainConfig, train
dist.init_process_group("gloo", init_method="file://" + os.path.join(tempfile.mkdtemp(), "s"),
                        rank=0, world_size=1)
chosen = {}
for strategy in ("ulysses", "auto"):
    cfg = TrainConfig(steps=2, seqlen=16, batch=1, hidden=32, intermediate=32, layers=1,
                      log_every=1, strategy=strategy)
    chosen[strategy] = train(cfg, group=dist.group.WORLD, progress=True)["strategy_chosen"]
dist.destroy_process_group()
print(json.dumps(chosen))
"""


@pytest.mark.timeout(150)
def test_progress_bar_names_the_strategy_and_what_auto_chose(tmp_path):
    """Under --strategy ulysses the bar said "ring attention"; under auto too, and never
    what auto picked (ringattn.strategies.auto's choice, here on one CP rank)."""
    proc = subprocess.run([sys.executable, "-c", _BARS], capture_output=True, text=True,
                          timeout=140, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    chosen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert chosen["ulysses"] == ["ulysses"] and len(chosen["auto"]) == 1
    err = (proc.stderr + proc.stdout).replace("\r", "\n")  # the bar; its log lines
    assert "[Ulysses attention, W=1] step 1/2" in err
    words = {"ring": "ring attention", "ulysses": "Ulysses attention",
             "allgather": "all-gather attention"}[chosen["auto"][0]]
    assert f"strategy 'auto' chose {chosen['auto'][0]} (W=1)" in err
    assert f"[auto: {words}, W=1] step 1/2" in err
    assert re.search(rf"auto: {words}, W=1: +100%", err)
    assert "ring attention, W=1" not in err.replace(f"auto: {words}", "")
