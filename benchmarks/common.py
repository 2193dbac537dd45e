"""What the benchmarks share: persistent gloo ranks, timing, memory trackers, inputs, output.

Legend: B batch, S global seq, L local seq, H heads, Hkv kv heads, D head dim, W world size.

* ``Cluster``: W spawned processes joined in one gloo group (file store, no port), each
  with one compute thread, kept alive for many configurations; a task is an importable
  function sent to every rank.
* ``timed``: fwd+bwd times, each iteration the MAX over ranks (barrier before, all-reduce
  MAX after).
* ``TensorBytes``: a TorchDispatchMode that follows the live bytes of tensor storages
  allocated inside it and keeps the high-water mark; with a cap it raises when exceeded.
* ``rss_peak``: the process's resident-set high water over one call (VmHWM after resetting
  it), with freed heap given back to the OS first.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import gc
import json
import os
import platform
import statistics
import subprocess
import sys
import time
import weakref
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_leaves

from ringattn.testing import LocalCluster, RankFailure  # noqa: F401 (re-exported)

REPO = Path(__file__).resolve().parent.parent
RESULTS = Path(__file__).resolve().parent / "results"

MMAP_THRESHOLD = 65536
"""glibc serves allocations at least this large with mmap in memory runs, so freeing a large
tensor gives its pages back to the OS and RSS high water measures the call, not old heap."""

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


# ---------------------------------------------------------------------------- processes


def Cluster(world: int, *, memory: bool = False, timeout_s: float = 1800) -> LocalCluster:
    """W gloo ranks (one compute thread each) kept alive for many configurations.

    ``memory=True`` starts them with ``MALLOC_MMAP_THRESHOLD_`` set (memory runs only: it
    makes every large allocation a fresh mmap, which slows timing runs).
    """
    env = {"MALLOC_MMAP_THRESHOLD_": str(MMAP_THRESHOLD)} if memory else None
    return LocalCluster(world, env=env, timeout_s=timeout_s)


def run_once(world: int, fn, *args, timeout: float = 3600) -> list:
    """``fn(*args)``'s results on every rank of a fresh W-rank ``Cluster``, closed after."""
    cluster = Cluster(world)
    try:
        return cluster.run(fn, *args, timeout=timeout)
    finally:
        cluster.close(force=True)


# ---------------------------------------------------------------------------- timing


def timed(step, *, iters: int, warmup: int, group=None) -> list[float]:
    """Seconds per call of ``step()``, each the max over the group's ranks, after warm-up."""
    group = dist.group.WORLD if group is None else group
    gc.collect()
    times = []
    for i in range(warmup + iters):
        dist.barrier(group=group)
        t0 = time.perf_counter()
        step()
        t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        if i >= warmup:
            times.append(t.item())
    return times


def paired_rounds(steps: dict, rounds: int, group=None) -> dict:
    """{name: [seconds of each round]} of the callables ``steps`` timed in ``rounds`` paired
    rounds after a warm-up round (dropped): each round runs every step once, the order
    reversed every other round; each time the max over the group's ranks."""
    group = dist.group.WORLD if group is None else group
    names = list(steps)
    times = {n: [] for n in names}
    for r in range(rounds + 1):
        for n in (names if r % 2 else names[::-1]):
            dist.barrier(group=group)
            t0 = time.perf_counter()
            steps[n]()
            took = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(took, op=dist.ReduceOp.MAX, group=group)
            if r:
                times[n].append(float(took))
    return times


def step_peaks(step, cases: list, key: str) -> list:
    """[{key, S, peak_mib, loss}] of ``step(S, what)`` for each (what, S) in ``cases``: the
    peak of live tensor bytes (``TensorBytes``) of each step on this rank."""
    out = []
    for what, s in cases:
        gc.collect()
        with TensorBytes() as mode:
            loss = step(s, what)
        out.append({key: what, "S": s, "peak_mib": mode.peak / 2**20, "loss": loss})
    return out


def longest_under_cap(peak_of, cap: float, start: int, unit: int, max_s: int,
                      bisect: int) -> tuple:
    """(longest S whose ``peak_of(S)`` is within ``cap``, first S over it, every probe as
    {"S", "peak_mib"}): S doubles from ``start`` (halves while over the cap) until the cap is
    bracketed or ``max_s`` / ``unit`` is reached, then ``bisect`` bisections; every S a
    multiple of ``unit``. Either bound is None when the search never found it."""
    probes, lo, hi = [], None, None
    s = max(unit, start // unit * unit)
    while lo is None or hi is None:
        peak = peak_of(s)
        probes.append({"S": s, "peak_mib": peak})
        if peak <= cap:
            lo = s
            if hi is None:
                if s >= max_s:
                    break
                s *= 2
        else:
            hi = s
            if lo is None:
                if s <= unit:
                    break
                s = max(unit, s // 2 // unit * unit)
    for _ in range(bisect if lo and hi else 0):
        mid = (lo + hi) // 2 // unit * unit
        if mid in (lo, hi):
            break
        peak = peak_of(mid)
        probes.append({"S": mid, "peak_mib": peak})
        lo, hi = (mid, hi) if peak <= cap else (lo, mid)
    return lo, hi, probes


def summary(times: list[float]) -> dict:
    return {"median_s": statistics.median(times), "min_s": min(times), "max_s": max(times),
            "n": len(times)}


# ---------------------------------------------------------------------------- memory


class TensorMemoryCapExceeded(MemoryError):
    pass


def _owns_storage(t) -> bool:
    # Wrapper subclasses (functional collectives' AsyncCollectiveTensor) have no storage of
    # their own; the plain tensor inside was counted when the op that made it ran.
    return isinstance(t, torch.Tensor) and not is_traceable_wrapper_subclass(t)


class TensorBytes(TorchDispatchMode):
    """Live and peak bytes of tensor storages allocated by ops run inside this mode.

    An op's output storage is counted once (by its data pointer) unless it is one of the
    op's inputs' storages (views, in-place and out= ops allocate nothing); it stops counting
    when the storage is freed (a weakref finalizer on the storage, which torch keeps alive
    exactly as long as some tensor uses it). Not seen: storages made before entering, and
    scratch a kernel allocates internally below the dispatcher (the CPU flash kernel's
    per-thread buffers, gloo's staging copies): RSS sees those.

    Arguments:
        cap: raise ``TensorMemoryCapExceeded`` from the op that takes live bytes above it.
    """

    def __init__(self, cap: int | None = None):
        super().__init__()
        self.cap = cap
        self.live = 0
        self.peak = 0
        self._ptrs: set[int] = set()

    def _free(self, ptr: int, nbytes: int) -> None:
        self._ptrs.discard(ptr)
        self.live -= nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        seen = {t.untyped_storage().data_ptr() for t in tree_leaves((args, kwargs)) if _owns_storage(t)}
        out = func(*args, **kwargs)
        for t in tree_leaves(out):
            if not _owns_storage(t):
                continue
            st = t.untyped_storage()
            ptr, nbytes = st.data_ptr(), st.nbytes()
            if nbytes == 0 or ptr in seen or ptr in self._ptrs:
                continue
            self._ptrs.add(ptr)
            self.live += nbytes
            weakref.finalize(st, self._free, ptr, nbytes)
            if self.live > self.peak:
                self.peak = self.live
            if self.cap is not None and self.live > self.cap:
                raise TensorMemoryCapExceeded(
                    f"{func} took live tensor bytes to {self.live / 2**20:.1f} MiB, over the "
                    f"cap of {self.cap / 2**20:.1f} MiB"
                )
        return out


def _proc_status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(f"/proc/self/status has no {field}")


def rss_peak(fn) -> dict:
    """Run ``fn()``; return RSS before it and the high water during it, in bytes.

    Freed heap goes back to the OS first (``malloc_trim(0)``; with MALLOC_MMAP_THRESHOLD_
    set, large blocks were mmapped and went back when freed), then the kernel's high-water
    mark is reset to the current RSS (``5 > /proc/self/clear_refs``) and read after the call.
    """
    gc.collect()
    ctypes.CDLL("libc.so.6").malloc_trim(0)
    before = _proc_status_kib("VmRSS") * 1024
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    fn()
    hwm = _proc_status_kib("VmHWM") * 1024
    return {"rss_before": before, "vmhwm": hwm, "delta": hwm - before}


# ---------------------------------------------------------------------------- inputs, output


def global_inputs(s: int, h: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0):
    """q, k, v, dout in ringattn's [B=1, S, H(kv), D], the same on every process for a seed."""
    g = torch.Generator().manual_seed(seed)
    shapes = ((1, s, h, d), (1, s, hkv, d), (1, s, hkv, d), (1, s, h, d))
    return tuple(torch.randn(shape, generator=g).to(dtype) for shape in shapes)


def machine_info() -> dict:
    cpu = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), "")
    try:
        commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=REPO,
                                capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        commit = ""
    import ringattn

    return {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
        "torch": torch.__version__,
        "ringattn": ringattn.__version__,
        "git": commit,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "nproc": len(os.sched_getaffinity(0)),
        "mem_total_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30, 1),
    }


def fixed_share_parser(doc: str, quick_help: str, rounds: int = 2):
    """The argument parser of a benchmark at a fixed S / W: ``--per-rank`` (L, default
    1024 and 4096), ``--worlds`` (1, 2, 4), ``--rounds``, ``--quick``, ``--table``."""
    import argparse

    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--per-rank", type=int, nargs="+", default=[1024, 4096])
    ap.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4])
    ap.add_argument("--rounds", type=int, default=rounds)
    ap.add_argument("--quick", action="store_true", help=quick_help)
    ap.add_argument("--table", action="store_true", help="the last run's table and plot")
    return ap


def finish_plot(fig, axes: tuple, xlabel: str, title: str, path: Path) -> None:
    """Label each (axis, y label) of ``axes`` (log y, a small legend), title ``fig`` and
    save it to ``path``."""
    for ax, what in axes:
        ax.set_xlabel(xlabel)
        ax.set_ylabel(what)
        ax.set_yscale("log")
        ax.legend(fontsize=7)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def load_or_run(args, stem: str, run, quick=None) -> tuple[dict, Path]:
    """(data, folder) of a benchmark: ``--table`` reads the last run's ``<stem>.json``;
    otherwise ``quick(args)`` first under ``--quick`` (whose results go to
    ``results/smoke/``), then ``run(args)``, written there."""
    out = RESULTS / "smoke" if args.quick else RESULTS
    if args.table:
        return json.loads((out / f"{stem}.json").read_text()), out
    if args.quick and quick is not None:
        quick(args)
    data = run(args)
    out.mkdir(parents=True, exist_ok=True)
    write_json(out / f"{stem}.json", data)
    return data, out


def write_json(path: Path, data: dict) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(data, indent=1) + "\n")
