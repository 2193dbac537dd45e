"""Runs for tests/specforge/test_specforge.py, each in fresh processes (SpecForge's process
groups and registries are global): ``fixture DIR``, ``reference DIR OUT`` (SpecForge's own
trainer, one gloo rank), ``ring DIR OUT --world W [--layout L]`` (the same run through
``ringattn.integrations.specforge`` on W gloo ranks), ``refusals DIR OUT --world W``.

The one substitution, on the reference side only and only without CUDA: SpecForge's Triton
loss (``LogSoftmaxLoss``, which needs a GPU driver) is replaced by SpecForge's own torch
reference of the same loss, ``specforge.core.loss._compute_loss``."""

from __future__ import annotations

import argparse
import ast
import contextlib
import io
import json
import os
import socket
import sys
import traceback
import types

import torch
import torch.multiprocessing as mp

LENGTHS = (37, 29, 45, 23, 41, 33, 50, 27)
"""Offline samples: batches of 2 right-padded rows, no longest one a multiple of 2W."""


def fixture(work: str) -> None:
    """A tiny random Llama target saved with a safetensors index (SpecForge's TargetHead and
    embedding loader read one), a one-layer draft config (draft vocabulary half the
    target's), and offline features in SpecForge's format (the final hidden state bf16, as
    its TargetHead computes in bf16)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    target = LlamaForCausalLM(LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        tie_word_embeddings=False, rms_norm_eps=1e-6)).eval()
    target.save_pretrained(os.path.join(work, "target"), max_shard_size="40KB")
    draft = {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
        "num_key_value_heads": 2, "num_hidden_layers": 1, "vocab_size": 128,
        "draft_vocab_size": 64, "max_position_embeddings": 256, "rms_norm_eps": 1e-6,
        "hidden_act": "silu", "rope_theta": 10000.0, "pretraining_tp": 1,
        "tie_word_embeddings": False, "target_hidden_size": 64,
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]},
    }
    with open(os.path.join(work, "draft_config.json"), "w") as f:
        json.dump(draft, f, indent=1)
    features = os.path.join(work, "features")
    os.makedirs(features, exist_ok=True)
    g = torch.Generator().manual_seed(1)
    for n, s in enumerate(LENGTHS):
        ids = torch.randint(0, 128, (s,), generator=g)
        loss_mask = torch.ones(s, dtype=torch.long)
        loss_mask[: s // 4] = 0  # a prompt without loss
        with torch.no_grad():
            hs = target(ids[None], output_hidden_states=True).hidden_states
        torch.save({"input_ids": ids, "loss_mask": loss_mask,
                    "hidden_state": hs[-1].to(torch.bfloat16),
                    "aux_hidden_state": torch.cat([hs[1], hs[2], hs[3]], -1).float()},
                   os.path.join(features, f"data_{n:04d}.ckpt"))


def write_run(work: str, name: str, *, architecture: str, ringattn: dict | None = None,
              steps: int = 6, ttt: int = 3, backend: str = "sdpa",
              compact: bool = False) -> str:
    """A SpecForge run YAML (and its draft config) under ``work/name``."""
    run = os.path.join(work, name)
    os.makedirs(run, exist_ok=True)
    with open(os.path.join(work, "draft_config.json")) as f:
        draft = json.load(f)
    draft["architectures"] = [architecture]
    if ringattn is not None:
        draft["ringattn"] = ringattn
    with open(os.path.join(run, "draft_config.json"), "w") as f:
        json.dump(draft, f, indent=1)
    text = f"""run_id: {name}
output_dir: {run}/out
model:
  target_model_path: {work}/target
  draft_model_config: {run}/draft_config.json
  torch_dtype: float32
data:
  hidden_states_path: {work}/features
  max_length: 64
  dataloader_num_workers: 0
  cache_dir: {run}/cache
training:
  strategy: eagle3
  attention_backend: {backend}
  batch_size: 2
  num_epochs: 3
  max_steps: {steps}
  learning_rate: 1.0e-4
  ttt_length: {ttt}
  fsdp_sharding: NO_SHARD
  lr_scheduler: constant
  warmup_ratio: 0.0
  log_interval: 1
  save_interval: 0
  seed: 0
"""
    if compact:  # SpecForge's teacher from the target's hidden states, in vocabulary chunks
        text += "  compact_teacher: true\n  compact_teacher_chunk_size: 5\n"
    path = os.path.join(run, "run.yaml")
    with open(path, "w") as f:
        f.write(text)
    return path


def _env(rank: int, world: int, port: int) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))


def _record(run, out: str | None) -> None:
    """Run SpecForge's trainer; save its logged metrics, every step's gradients (before
    clipping, after DDP's reduction) and the final weights."""
    trainer = run.trainer
    opt = trainer.backend.optimizer
    names = [n for n, p in trainer.backend.module.module.draft_model.named_parameters()
             if p.requires_grad]
    grads = []
    opt.optimizer.register_step_pre_hook(lambda *_: grads.append(
        {n: p.grad.detach().clone() for n, p in zip(names, opt.model_params)}))
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        run.run()
    logs = [ast.literal_eval(line.split(": ", 1)[1]) for line in buf.getvalue().splitlines()
            if line.startswith("step ")]
    final = {n: p.detach().clone() for n, p in zip(names, opt.model_params)}
    if out:
        torch.save({"logs": logs, "grads": grads, "final": final}, out)


def reference(work: str, out: str, world: int = 1, compact: bool = False) -> None:
    """SpecForge's own ``specforge train`` worker path on one gloo rank (no CP), or on
    ``world`` ranks of SpecForge's own data parallelism (no CP)."""
    if world == 1:
        _reference_worker(0, 1, _port(), work, out, compact)
    else:
        _spawn(_reference_worker, world, work, out, compact)


def _reference_worker(rank, world, port, work, out, compact=False):
    from accelerate.utils import set_seed
    from specforge.application import build_application_run, resolve_run
    from specforge.config import load_config
    from specforge.distributed import destroy_distributed, init_distributed

    if not torch.cuda.is_available():
        import specforge.algorithms.eagle3.model as model
        from specforge.core.loss import _compute_loss

        model.LogSoftmaxLoss = types.SimpleNamespace(apply=_compute_loss)
    name = ("reference" if world == 1 else f"reference-dp{world}") + ("-compact" if compact
                                                                      else "")
    cfg = load_config(write_run(work, name, architecture="LlamaForCausalLMEagle3",
                                compact=compact))
    resolved = resolve_run(cfg)
    os.environ["FSDP_SHARDING"] = cfg.training.fsdp_sharding
    set_seed(cfg.training.seed)
    _env(rank, world, port)
    init_distributed(timeout=cfg.training.dist_timeout, tp_size=1)
    try:
        _record(build_application_run(resolved), out if rank == 0 else None)
    finally:
        destroy_distributed()


def _ring_worker(rank, world, port, yaml, out, cp_size):
    _env(rank, world, port)
    from specforge.distributed import destroy_distributed

    from ringattn.integrations.specforge import build

    run = build(yaml, cp_size=cp_size)
    try:
        _record(run, out if rank == 0 else None)
    finally:
        destroy_distributed()


def _refusal_worker(rank, world, port, work, out):
    """Each refusal, on this rank: the exception's type and message (or None)."""
    _env(rank, world, port)
    from ringattn.integrations.specforge import build
    from specforge.distributed import destroy_distributed

    seen = {}
    cases = {
        "flex_attention backend": dict(backend="flex_attention"),
        "striped layout": dict(ringattn={"layout": "striped"}),
        "stock architecture": dict(architecture="LlamaForCausalLMEagle3"),
    }
    for name, kw in cases.items():
        kw.setdefault("architecture", "RingLlamaForCausalLMEagle3")
        yaml = write_run(work, f"refuse-{rank}-{len(seen)}", **kw)
        try:
            build(yaml, cp_size=world)
            destroy_distributed()
            seen[name] = None
        except Exception as exc:
            seen[name] = f"{type(exc).__name__}: {exc}"
    yaml = write_run(work, f"refuse-{rank}-cp", architecture="RingLlamaForCausalLMEagle3")
    try:
        build(yaml, cp_size=world + 1)
        destroy_distributed()
        seen["cp size not dividing the world"] = None
    except Exception as exc:
        seen["cp size not dividing the world"] = f"{type(exc).__name__}: {exc}"
    # a left-padded row reaching the draft's attention, inside a built run
    run = build(yaml, cp_size=world)
    try:
        draft = run.trainer.backend.module.module.draft_model
        attn = draft.midlayer.self_attn
        n = 5
        mask = torch.ones(2, 2 * world * n, dtype=torch.long)
        mask[1, :3] = 0
        h = torch.randn(2, n, 2 * draft.config.hidden_size)
        try:
            attn(h, cache_hidden=[[], []], attention_mask=mask,
                 position_ids=torch.arange(n)[None].expand(2, -1))
            seen["left padding"] = None
        except Exception as exc:
            seen["left padding"] = f"{type(exc).__name__}: {exc}"
    finally:
        destroy_distributed()
    # (each rank wrote its configs under its own folder: name it alike for the comparison)
    seen = {k: v if v is None else v.replace(f"refuse-{rank}-", "refuse-R-")
            for k, v in seen.items()}
    torch.save(seen, f"{out}.{rank}")


def _port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _spawn(target, world, *args) -> None:
    ctx = mp.get_context("spawn")
    procs = [ctx.Process(target=target, args=(r, world, _port_once(), *args))
             for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    codes = [p.exitcode for p in procs]
    if any(codes):
        raise SystemExit(f"ranks exited with {codes}")


_PORT = []


def _port_once() -> int:
    if not _PORT:
        _PORT.append(_port())
    return _PORT[0]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("mode", choices=("fixture", "reference", "ring", "refusals"))
    ap.add_argument("work")
    ap.add_argument("out", nargs="?")
    ap.add_argument("--world", type=int, default=None, help="default: 1 for reference, else 2")
    ap.add_argument("--layout", default="zigzag")
    ap.add_argument("--strategy", default="ring")
    ap.add_argument("--cp-size", type=int, default=None, help="default: the world")
    ap.add_argument("--compact", action="store_true", help="training.compact_teacher: true")
    a = ap.parse_args()
    a.world = a.world or (1 if a.mode == "reference" else 2)
    if a.mode == "fixture":
        fixture(a.work)
    elif a.mode == "reference":
        reference(a.work, a.out, a.world, a.compact)
    elif a.mode == "ring":
        cp = a.cp_size or a.world
        name = f"ring-w{a.world}-{a.layout}-{a.strategy}" + ("" if cp == a.world else f"-cp{cp}")
        name += "-compact" if a.compact else ""
        yaml = write_run(a.work, name, architecture="RingLlamaForCausalLMEagle3",
                         ringattn={"layout": a.layout, "strategy": a.strategy},
                         compact=a.compact)
        _spawn(_ring_worker, a.world, yaml, a.out, cp)
    else:
        _spawn(_refusal_worker, a.world, a.work, a.out)


if __name__ == "__main__":
    try:
        main()
    except SystemExit:
        raise
    except BaseException:
        traceback.print_exc()
        sys.exit(1)
