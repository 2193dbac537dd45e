"""The package's programs as users start them: a library module run with ``python -m``
refuses and names the programs; every ``python -m`` the docs print is a program; argument
and path errors are one line with status 2 before any rank starts; a missing extra is one
line; ``ringattn --help`` lists every program; the progress bars advance every step; the
Eagle3 run checkpoints its last step and evaluates on conversations it did not train on."""

from __future__ import annotations

import json
import pkgutil
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ringattn
from ringattn._program import PROGRAMS

ROOT = Path(__file__).resolve().parents[2]
PROGRAM_MODULES = {"ringattn.apps.cli", "ringattn.apps.train", "ringattn.apps.eagle3_train",
                   "ringattn.apps.eagle3_target", "ringattn.apps.specforge_train",
                   "ringattn.apps.modelopt_train"}
"""The modules ``python -m`` runs as programs (``ringattn`` is ``ringattn.apps.cli``)."""


def library_modules() -> list[str]:
    return sorted(m.name for m in pkgutil.walk_packages(ringattn.__path__, "ringattn.")
                  if not m.ispkg and m.name not in PROGRAM_MODULES)


# --------------------------------------------------------------------------- python -m

_RUN_ALL = """
import contextlib, io, json, runpy, sys, warnings
warnings.simplefilter("ignore")  # runpy: the module is already imported (by its package)
out = {}
for name in sys.argv[1:]:
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            runpy.run_module(name, run_name="__main__")
        out[name] = ["returned", err.getvalue()]
    except SystemExit as exc:
        out[name] = [exc.code, err.getvalue()]
    except BaseException as exc:
        out[name] = [repr(exc), err.getvalue()]
print(json.dumps(out))
"""


@pytest.mark.timeout(180)
def test_every_library_module_refuses_to_run_as_a_program():
    """Every module but the programs, run as ``__main__`` (as ``python -m`` runs it; in one
    separate process, since running a module again redefines its classes): status 2 and
    one line naming it and every program."""
    names = library_modules()
    assert "ringattn.eagle3.target" in names and "ringattn._program" in names
    proc = subprocess.run([sys.executable, "-c", _RUN_ALL, *names], capture_output=True,
                          text=True, timeout=170)
    assert proc.returncode == 0, proc.stderr[-3000:]
    results = json.loads(proc.stdout.strip().splitlines()[-1])
    for name in names:
        code, err = results[name]
        assert code == 2, (name, code, err)
        lines = err.strip().splitlines()
        assert len(lines) == 1 and lines[0].startswith(f"{name} is a library module, not a "
                                                       f"program; the programs are: "), (name, err)
        assert all(command in lines[0] for command, _ in PROGRAMS), (name, err)


@pytest.mark.timeout(60)
def test_python_m_of_the_old_target_module_fails_loudly(tmp_path):
    """``python -m ringattn.eagle3.target`` (what the docs printed) once exited 0 silently."""
    proc = subprocess.run([sys.executable, "-m", "ringattn.eagle3.target", "--target", "x",
                           "--data", "y", "--out", str(tmp_path / "out")],
                          capture_output=True, text=True, timeout=50, cwd=tmp_path)
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip().splitlines() == [
        "ringattn.eagle3.target is a library module, not a program; the programs are: "
        + ", ".join(command for command, _ in PROGRAMS)]
    assert "python -m ringattn.apps.eagle3_target" in proc.stderr
    assert not (tmp_path / "out").exists()


def test_programs_are_what_runs():
    """Each listed ``python -m`` program is a module with a ``__main__`` block calling its
    ``main``; ``ringattn``'s listed commands are its subcommands; and nothing else in the
    package has a ``__main__`` block but the refusal."""
    from ringattn.apps import cli

    for command, _ in PROGRAMS:
        if command.startswith("python -m "):
            module = command.split()[2]
            assert module in PROGRAM_MODULES, command
            source = Path(__import__(module, fromlist=["main"]).__file__).read_text()
            assert re.search(r'if __name__ == "__main__":\n    (raise SystemExit\()?main\(\)',
                             source), module
        else:
            assert command.split()[0] == "ringattn", command
            with pytest.raises(SystemExit) as exc:
                cli.main([command.split()[1], "--help"])
            assert exc.value.code == 0
    for name in library_modules():
        source = Path(__import__(name, fromlist=["x"]).__file__).read_text()
        assert source.rstrip().endswith("not_a_program(__spec__)"), name


def _printed_modules(text: str) -> set[str]:
    return set(re.findall(r"-m\s+(ringattn(?:\.\w+)+)", text.replace("``", "`")))


def test_docs_print_only_programs():
    """Every ``python -m ringattn...`` / ``torchrun ... -m ringattn...`` in the README, docs/,
    the Makefile and the package's docstrings names a program."""
    texts = [ROOT / "README.md", ROOT / "Makefile", *sorted((ROOT / "docs").glob("*.md")),
             *sorted((ROOT / "src" / "ringattn").rglob("*.py"))]
    printed = {}
    for path in texts:
        for module in _printed_modules(path.read_text()):
            printed.setdefault(module, []).append(path.name)
    assert "ringattn.apps.eagle3_target" in printed
    bad = {m: where for m, where in printed.items() if m not in PROGRAM_MODULES}
    assert not bad, bad
    assert _printed_modules("python -m\n  ringattn.eagle3.target --out D") == {
        "ringattn.eagle3.target"}


def test_ringattn_help_is_plain_text_and_lists_every_program(capsys):
    from ringattn.apps import cli

    with pytest.raises(SystemExit) as exc:
        cli.main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    assert "``" not in out and "`" not in out
    for command, what in PROGRAMS:
        assert command in out
    assert "python -m ringattn.apps.eagle3_train" in out
    assert "python -m ringattn.apps.eagle3_target" in out
    from ringattn.apps import eagle3_target, eagle3_train, train

    for main, argv in ((cli.main, ["demo", "--help"]), (cli.main, ["train", "--help"]),
                       (train.main, ["--help"]), (eagle3_train.main, ["--help"]),
                       (eagle3_target.main, ["--help"])):
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 0
        out = capsys.readouterr().out
        assert out.startswith("usage: ") and "`" not in out, (argv, out)


# --------------------------------------------------------------------------- one-line errors


def _one_line_exit(capsys, fn, argv) -> str:
    with pytest.raises(SystemExit) as exc:
        fn(argv)
    assert exc.value.code == 2
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1, captured.err
    return lines[0]


@pytest.mark.parametrize("argv,named", [
    (["--world", "3", "--dp", "2"], "does not split into dp=2"),
    (["--strategy", "hybrid"], "invalid choice: 'hybrid'"),
    (["--steps", "x"], "--steps: invalid int value"),
    (["--resume", "/nowhere/checkpoint-3"], "no Eagle3 checkpoint at '/nowhere/checkpoint-3'"),
    (["--target", "/nowhere"], "target '/nowhere' is not a local transformers model directory"),
    (["--target", "/nowhere", "--offline", "/nowhere/off"], "target '/nowhere' is not"),
    (["--eval-prompts", "-1"], "argument --eval-prompts: must be an int >= 0, got -1"),
])
def test_eagle3_train_argument_errors_are_one_line(no_ranks, capsys, argv, named):
    from ringattn.apps import eagle3_train

    line = _one_line_exit(capsys, eagle3_train.main, argv)
    assert line.startswith("python -m ringattn.apps.eagle3_train: ") and named in line, line


def test_train_and_target_argument_errors_are_one_line(no_ranks, capsys):
    from ringattn.apps import cli, eagle3_target

    assert "unrecognized arguments: --bogus" in _one_line_exit(capsys, cli.main,
                                                               ["train", "--bogus"])
    line = _one_line_exit(capsys, eagle3_target.main, ["--target", "/nowhere", "--data", "x",
                                                       "--out", "o"])
    assert line == ("python -m ringattn.apps.eagle3_target: --target '/nowhere' is not a "
                    "local transformers model directory (no config.json)")


MODEL_PATH_ARGV = {
    "ringattn demo": None,  # builds its own tiny models: no model path
    "ringattn train": ("cli", ["train", "--model", "{path}"], "ringattn train: model={path!r} "
                       "does not exist (a model directory, or a config.json)"),
    "python -m ringattn.apps.train": ("train", ["--model", "{path}"],
                                      "ringattn train: model={path!r} does not exist (a model "
                                      "directory, or a config.json)"),
    "python -m ringattn.apps.eagle3_train": (
        "eagle3_train", ["--target", "{path}"], "python -m ringattn.apps.eagle3_train: target "
        "{path!r} is not a local transformers model directory (no config.json)"),
    "python -m ringattn.apps.eagle3_target": (
        "eagle3_target", ["--target", "{path}", "--data", "d", "--out", "o"],
        "python -m ringattn.apps.eagle3_target: --target {path!r} is not a local transformers "
        "model directory (no config.json)"),
    # its model paths are in its run config, read by SpecForge: the config itself is checked
    "python -m ringattn.apps.specforge_train": (
        "specforge_train", ["train", "-c", "{path}"], "python -m ringattn.apps.specforge_train: "
        "-c {path!r} is not a file (SpecForge's run config)"),
    "python -m ringattn.apps.modelopt_train": (
        "modelopt_train", ["--config", "general/speculative_decoding/eagle3",
                           "model.model_name_or_path={path}", "data.data_path=chats.jsonl"],
        "python -m ringattn.apps.modelopt_train: general/speculative_decoding/eagle3: "
        "model.model_name_or_path {path!r} is not a local transformers model directory (no "
        "config.json)"),
}
"""Per program: (its module under ringattn.apps, its arguments with a model path, the line
it must print for a missing one), or None for a program that reads no model path."""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("path", ["/nowhere/model", "meta-llama/Llama-3.2-1B-Instruct"])
def test_every_program_refuses_a_model_path_that_is_not_local_in_one_line(no_ranks, capsys,
                                                                           path):
    """A missing model path, and a hub name (the programs read models from disk only): one
    line naming the path, status 2, before any rank starts, from every program that reads
    one (``modelopt_train`` once ended in transformers' traceback). The hub name's line also
    says how to download it."""
    import importlib
    import importlib.util

    assert set(MODEL_PATH_ARGV) == {command for command, _ in PROGRAMS}
    hub = path.count("/") == 1
    for command, case in MODEL_PATH_ARGV.items():
        if case is None:
            continue
        module, argv, want = case
        if module == "modelopt_train" and importlib.util.find_spec("modelopt") is None:
            continue  # needs ringattn[modelopt]; it says so in one line (tested elsewhere)
        main = importlib.import_module(f"ringattn.apps.{module}").main
        capsys.readouterr()
        line = _one_line_exit(capsys, main, [a.format(path=path) for a in argv])
        assert line.startswith(want.format(path=path)), (command, line)
        if hub and module != "specforge_train":
            assert line.endswith(f"download it first (hf download {path} --local-dir DIR) "
                                 f"and pass DIR"), (command, line)


@pytest.mark.parametrize("missing", ["transformers", "tqdm"])
def test_eagle3_target_names_a_missing_extra(monkeypatch, capsys, missing):
    """Without transformers or tqdm: the one line the other programs give, not a raw
    ModuleNotFoundError."""
    from ringattn.apps import eagle3_target

    monkeypatch.setitem(sys.modules, missing, None)  # find_spec: None; import: fails
    line = _one_line_exit(capsys, eagle3_target.main, ["--target", "t", "--data", "d",
                                                       "--out", "o"])
    assert line == (f"python -m ringattn.apps.eagle3_target needs {missing}: "
                    f"pip install 'ringattn[demo]'")


# --------------------------------------------------------------------------- Eagle3 paths

TINY = dict(vocab=40, draft_vocab=20, hidden=16, heads=4, kv_heads=2, intermediate=32,
            target_layers=4)


def _target_dir(path: Path, **kw) -> str:
    from chat import chat_tokenizer
    from ringattn.apps.eagle3_train import Eagle3Config, build_target

    build_target(Eagle3Config(**{**TINY, **kw}), "sdpa").save_pretrained(path)
    chat_tokenizer().save_pretrained(path)
    return str(path)


def _chats(path: Path, n: int) -> str:
    from chat import WORDS

    with open(path, "w") as f:
        for c in range(n):
            words = [WORDS[(c * 7 + i) % len(WORDS)] for i in range(6)]
            f.write(json.dumps({"messages": [
                {"role": "user", "content": " ".join(words[:3])},
                {"role": "assistant", "content": " ".join(words[3:])}]}) + "\n")
    return str(path)


@pytest.mark.timeout(120)
def test_eagle3_resume_of_another_seqlen_is_refused_before_spawning(tmp_path, monkeypatch,
                                                                    capsys):
    """A checkpoint written at --seqlen 32, resumed at --seqlen 40: one line naming the
    difference, before any rank starts; with the same arguments the check passes."""
    from ringattn.apps import eagle3_train

    cfg = eagle3_train.Eagle3Config(steps=1, seqlen=32, pad=8)  # the command line's defaults
    eagle3_train.train_eagle3(cfg, progress=False, out_dir=str(tmp_path))
    checkpoint = str(tmp_path / "checkpoint-last")

    spawned = []

    class Spawned(Exception):
        pass

    def spawn(cfg, **kw):
        spawned.append(kw)
        raise Spawned

    monkeypatch.setattr(eagle3_train, "spawn_eagle3", spawn)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    capsys.readouterr()
    line = _one_line_exit(capsys, eagle3_train.main,
                          ["--resume", checkpoint, "--seqlen", "40", "--steps", "2"])
    assert "was written with another configuration: pad=8 (now 37), seqlen=32 (now 40)" in line
    assert spawned == []
    with pytest.raises(Spawned):  # the same arguments pass the check and spawn
        eagle3_train.main(["--resume", checkpoint, "--seqlen", "32", "--steps", "2"])
    assert spawned and spawned[0]["resume"] == checkpoint


@pytest.mark.timeout(120)
def test_eagle3_offline_of_another_target_is_refused_before_spawning(tmp_path, no_ranks,
                                                                     capsys):
    from ringattn.apps import eagle3_target, eagle3_train

    small = _target_dir(tmp_path / "small")
    wide = _target_dir(tmp_path / "wide", hidden=32)
    data = _chats(tmp_path / "chats.jsonl", 3)
    assert eagle3_target.main(["--target", small, "--data", data, "--out",
                               str(tmp_path / "off"), "--dtype", "float32"]) == 0
    capsys.readouterr()
    line = _one_line_exit(capsys, eagle3_train.main, ["--target", wide, "--offline",
                                                      str(tmp_path / "off"), "--eval-prompts",
                                                      "1"])
    assert f"offline '{tmp_path / 'off'}' was not stored for target '{wide}': " \
           f"target_hidden_size 16 (target 32)" in line, line
    line = _one_line_exit(capsys, eagle3_train.main, ["--target", small, "--offline",
                                                      str(tmp_path / "nowhere")])
    assert "holds no readable offline index" in line, line
    line = _one_line_exit(capsys, eagle3_train.main, ["--target", small, "--offline",
                                                      str(tmp_path / "off")])  # 8 of 3
    assert "holds 3 conversations: holding out held_out=8" in line, line


# --------------------------------------------------------------------------- Eagle3 runs


@pytest.mark.timeout(120)
def test_eagle3_held_out_conversations_are_not_trained_on(tmp_path, monkeypatch):
    """With --data, the closing evaluation's prompts are the last --eval-prompts
    conversations, each up to its first trained token, and training never sees them."""
    from chat import chat_tokenizer
    from ringattn.apps import eagle3_train
    from ringattn.eagle3.data import load_conversations, render

    target = _target_dir(tmp_path / "target")
    data = _chats(tmp_path / "chats.jsonl", 7)
    seen = {}
    monkeypatch.setattr(eagle3_train, "spawn_eagle3", lambda cfg, **kw: seen.update(cfg=cfg))
    monkeypatch.setattr(eagle3_train, "report_run", lambda cfg, out, prompts: None)
    monkeypatch.delenv("LOCAL_RANK", raising=False)
    assert eagle3_train.main(["--target", target, "--data", data, "--seqlen", "40",
                              "--eval-prompts", "3"]) == 0
    cfg = seen["cfg"]
    assert cfg.held_out == 3
    rendered = [render(chat_tokenizer(), c, max_len=40) for c in load_conversations(data)]
    rows, samples = eagle3_train.chat_rows(cfg)
    assert len(samples) == len(rows) == 4
    for (ids, _), (want, _) in zip(samples, rendered[:4], strict=True):
        assert torch.equal(ids, want)
    prompts = eagle3_train._eval_prompts(cfg, 3)
    for prompt, (ids, mask) in zip(prompts, rendered[4:], strict=True):
        first = int(mask.nonzero()[0, 0])
        assert first > 0 and torch.equal(prompt, ids[:first])  # up to the assistant's reply
    trained = {tuple(r["input_ids"][0].tolist()) for r in rows}
    assert not any(tuple(ids.tolist()) in {t[:len(ids)] for t in trained}
                   for ids, _ in rendered[4:])


@pytest.mark.timeout(120)
def test_eagle3_last_step_is_checkpointed_when_save_every_divides_it(tmp_path):
    from ringattn.apps.eagle3_train import CHECKPOINT, Eagle3Config, train_eagle3

    cfg = Eagle3Config(**TINY, seqlen=16, pad=4, batch=1, steps=4, save_every=2)
    train_eagle3(cfg, progress=False, out_dir=str(tmp_path / "a"))
    names = sorted(p.name for p in (tmp_path / "a").glob("checkpoint-*"))
    assert names == ["checkpoint-2", "checkpoint-4", "checkpoint-last"]
    step = [torch.load(tmp_path / "a" / n / CHECKPOINT, weights_only=False)["step"]
            for n in names]
    assert step == [2, 4, 4]
    train_eagle3(Eagle3Config(**{**cfg.__dict__, "steps": 3}), progress=False,
                 out_dir=str(tmp_path / "b"))
    assert sorted(p.name for p in (tmp_path / "b").glob("checkpoint-*")) == [
        "checkpoint-2", "checkpoint-last"]


def _postfix_counts(err: str, total: int) -> list[int]:
    """The counts the redraws that show a loss display, in order, repeats collapsed."""
    counts = [int(n) for n in re.findall(rf"(\d+)/{total} [^\r\n]*loss=", err)]
    return [n for i, n in enumerate(counts) if i == 0 or n != counts[i - 1]]


@pytest.mark.timeout(120)
def test_progress_bars_advance_every_step(capsys):
    """The bar shows step k's count with step k's loss (a bar wrapped around the batches
    showed 0/N with every loss on fast steps)."""
    from ringattn.apps.eagle3_train import Eagle3Config, train_eagle3
    from ringattn.apps.train import TrainConfig, train

    train(TrainConfig(steps=6, seqlen=16, batch=1, hidden=32, intermediate=32, layers=1,
                      log_every=0), progress=True)
    assert _postfix_counts(capsys.readouterr().err, 6) == [1, 2, 3, 4, 5, 6]
    train_eagle3(Eagle3Config(**TINY, seqlen=16, pad=4, batch=1, steps=5), progress=True,
                 log_every=0)
    assert _postfix_counts(capsys.readouterr().err, 5) == [1, 2, 3, 4, 5]
