"""What the integration tests that start a one-process reference and torchrun launches side
by side share: starting them together, and the runners' common steps."""

from __future__ import annotations

import os
import subprocess


def launch_all(cmds: dict, cwd, timeout: float) -> dict:
    """Run the commands at once (the launches mostly wait on imports); {key: None, or the
    end of the failed command's output}. A command past ``timeout`` seconds is killed, with
    the others."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    procs = {k: subprocess.Popen(c, cwd=cwd, env=env, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True) for k, c in cmds.items()}
    failures = {}
    for k, proc in procs.items():
        try:
            output, _ = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            for p in procs.values():
                p.kill()  # torchrun's workers go with their agent
            output, _ = proc.communicate()
            output = f"timed out after {timeout} s: {cmds[k]}\n{output}"
            proc.returncode = -1
        failures[k] = None if proc.returncode == 0 else output[-9000:]
    return failures


def error_text(make) -> str | None:
    """``"ValueError: message"`` of the ValueError ``make()`` raises; None when it raises
    none."""
    try:
        make()
    except ValueError as e:
        return f"{type(e).__name__}: {e}"
    return None


def start_runner(args) -> int:
    """A runner's first steps: ring attention registered (not for the one-process
    reference, ``args.ref``), ``args.out`` made; returns this process's rank."""
    if not args.ref:
        from ringattn.integrations import transformers as ra_hf

        ra_hf.register()
    args.out.mkdir(parents=True, exist_ok=True)
    return int(os.environ.get("RANK", 0))
