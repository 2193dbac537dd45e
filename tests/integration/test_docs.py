"""Every code block of every page in docs/ runs as printed, and so do two README blocks (the
Eagle3 step under CP, on ranks, and the draft built by hand); every README ```python block
is run by some test (``README_BLOCKS`` says which; ``test_every_readme_block_is_covered``).

A block runs verbatim; the names its page says are the reader's (a tokenizer, shards, a
target directory) are made first, small. Blocks that need ranks run in ONE
``torchrun --nproc-per-node 2`` launch (gloo CPU ranks), one after the other; the others run
in this process. Shell blocks are checked by parsing them with the parser of the program
they start. A block without an entry here fails ``test_every_block_is_covered``: a new
block must be given its inputs and run.

This file is also the script the ranks run (``python test_docs.py <workdir>``).
"""

from __future__ import annotations

import json
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
README = ROOT / "README.md"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)

README_BLOCKS = {
    "import torch, torch.distributed as dist": "tests/integration/test_readme.py",
    "ra.masks.from_function(": "tests/integration/test_readme.py",
    "local = ra_hf.prepare_batch(model, batch, group=cp_group)":
        "tests/integration/test_transformers.py",
    'mesh = init_device_mesh(device, (dp, cp), mesh_dim_names=("dp", "cp"))':
        "tests/integration/test_fsdp_cp.py",
    "trainer = RingTrainer(model=model, args=args": "tests/integration/test_trainer.py",
    'mesh = ra.hybrid_mesh(ulysses=int(os.environ["LOCAL_WORLD_SIZE"]))':
        "tests/integration/test_multinode.py",
    "tgt = ra.eagle3.run_target(target, batch, group=cp_group)": "tests/integration/test_docs.py",
    "from vllm import LLM, SamplingParams": "tests/serving/test_vllm.py",
    "draft = build_draft(cfg, target, draft_ids)": "tests/integration/test_docs.py",
}
"""Every README ```python block, by a line only it has: the test that runs it as printed. A
README block without an entry fails ``test_every_readme_block_is_covered``."""
README_HERE = {("README.md", "draft-by-hand"): "draft = build_draft(cfg, target, draft_ids)",
               ("README.md", "eagle3-under-CP"):
                   "tgt = ra.eagle3.run_target(target, batch, group=cp_group)"}
"""The README blocks this file runs, by key: the line that finds each."""


def blocks(page: Path) -> list[tuple[str, str]]:
    """(language, code) of every fenced block of ``page``, in order."""
    return FENCE.findall(page.read_text())


def doc_blocks() -> dict[tuple[str, int], tuple[str, str]]:
    """{(page name, index on the page): (language, code)} over docs/*.md."""
    return {(page.name, i): block for page in sorted(DOCS.glob("*.md"))
            for i, block in enumerate(blocks(page))}


def readme_python() -> list[str]:
    """The code of every ```python block of the README, in order."""
    return [code for lang, code in blocks(README) if lang == "python"]


def readme_block(line: str) -> str:
    """The one README ```python block that holds ``line``."""
    found = [code for code in readme_python() if line in code]
    assert len(found) == 1, (line, len(found))
    return found[0]


def all_blocks() -> dict:
    """``doc_blocks()`` and the README blocks of ``README_HERE``, by key."""
    found = doc_blocks()
    for key, line in README_HERE.items():
        found[key] = ("python", readme_block(line))
    return found


# --------------------------------------------------------------------------- the inputs

SHAPE = dict(S=29, B=2, H=4, Hkv=2, D=8)


def _shards(ns: dict, work: Path | None = None) -> None:
    """q_l, k_l, v_l (README Usage), q, keys, values, valid_len (Eagle3 TTT step 1) and S."""
    import torch
    import torch.distributed as dist

    import ringattn as ra

    S, B, H, Hkv, D = (SHAPE[k] for k in ("S", "B", "H", "Hkv", "D"))
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, S, h, D, generator=g) for h in (H, Hkv, Hkv))
    ns.update(S=S, cp_group=dist.group.WORLD, valid_len=[S, S - 5])
    ns["q_l"], ns["k_l"], ns["v_l"] = (ra.shard(t, layout="zigzag", seqlen=S) for t in (q, k, v))
    ns["q"] = ns["q_l"]
    ns["keys"] = [ra.shard(torch.randn(B, S, Hkv, D, generator=g), seqlen=S) for _ in range(2)]
    ns["values"] = [ra.shard(torch.randn(B, S, Hkv, D, generator=g), seqlen=S) for _ in range(2)]


def _varlen(ns: dict, work: Path | None = None) -> None:
    """compat.md's varlen block: the whole packed sequence and its offsets."""
    import torch

    g = torch.Generator().manual_seed(1)
    ns["cu_seqlens"] = torch.tensor([0, 1, 12, 30], dtype=torch.int32)
    ns["max_seqlen"] = 18
    ns["q"], ns["k"], ns["v"] = (torch.randn(30, h, 8, generator=g) for h in (4, 2, 2))


def _strategies(ns: dict, work: Path) -> None:
    """strategies.md: shards, a batch, and what RingTrainer takes."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, TrainingArguments

    from ringattn.integrations import transformers as ra_hf

    _shards(ns)
    ids = torch.randint(50, (2, SHAPE["S"]), generator=torch.Generator().manual_seed(2))
    ns["batch"] = {"input_ids": ids, "labels": ids}
    ra_hf.register()
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    ns["model"] = AutoModelForCausalLM.from_config(config, attn_implementation="ringattn")
    ns["targs"] = TrainingArguments(output_dir=str(work / "trainer"), use_cpu=True,
                                    report_to=[], per_device_train_batch_size=1)
    ns["ds"] = [{"input_ids": row, "labels": row} for row in ids]


def _eagle3_cp(ns: dict, work: Path) -> None:
    """README's Eagle3-under-CP block: a target with ring attention, a draft, a global batch
    (S=23: not a multiple of 2W; a right-padded row), the CP group; and the same target
    (sdpa) and draft for the one-process step the check compares with."""
    import torch
    import torch.distributed as dist

    import ringattn as ra
    from ringattn.apps.eagle3_train import build_target

    g = torch.Generator().manual_seed(4)
    ids = torch.randint(40, (2, 23), generator=g)
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    loss_mask = mask.clone()
    loss_mask[:, :3] = 0
    target, one = build_target(_target_cfg(), "ringattn"), build_target(_target_cfg(), "sdpa")
    ns.update(ra=ra, target=target, draft=_draft(target), cp_group=dist.group.WORLD,
              batch={"input_ids": ids, "attention_mask": mask, "loss_mask": loss_mask},
              _one=(one, _draft(one)))


def _check_eagle3_cp(ns: dict) -> None:
    """Per-step losses, accuracies and the CP-summed draft gradients equal one process."""
    import torch
    import torch.distributed as dist

    from ringattn.eagle3 import eagle3_step, run_target

    sys.path.insert(0, str(ROOT / "tests"))
    from reference import FP32_TOL, rel_err

    target, draft = ns["_one"]
    one = eagle3_step(draft, run_target(target, ns["batch"]), steps=7)
    one.loss.backward()
    res = ns["res"]
    same = [a == b or (a != a and b != b) for a, b in zip(res.accuracies, one.accuracies)]
    assert len(res.losses) == len(same) == 7 and all(same), (res.accuracies, one.accuracies)
    for a, b in zip(res.losses, one.losses):
        assert abs(a - b) <= FP32_TOL * abs(b), (res.losses, one.losses)
    for (name, p), p1 in zip(ns["draft"].named_parameters(), draft.parameters()):
        if p.requires_grad:
            grad = p.grad.clone()
            dist.all_reduce(grad)
            assert rel_err(grad.double(), p1.grad.double()) <= FP32_TOL, name


def _modelopt(ns: dict, work: Path) -> None:
    """modelopt.md's switch: a tiny Llama target saved in ``target_dir``, ModelOpt's Eagle3
    config (the draft's heads matched to the target, no torch.compile), TrainingArguments
    for one SGD step on the CPU ranks, two rows (one right-padded) and a collator."""
    import copy

    import torch
    import torch.distributed as dist
    from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG
    from transformers import (LlamaConfig, LlamaForCausalLM, TrainingArguments,
                              default_data_collator)

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, pad_token_id=0)
    target_dir = work / "modelopt-target"
    if dist.get_rank() == 0:
        LlamaForCausalLM(config).save_pretrained(target_dir)
    dist.barrier()
    cfg = copy.deepcopy(EAGLE3_DEFAULT_CFG["config"])
    cfg["eagle_use_torch_compile"] = False
    cfg["eagle_architecture_config"].update(num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=8, intermediate_size=64)
    ids = torch.randint(1, 64, (2, 23), generator=torch.Generator().manual_seed(3))
    mask = torch.ones_like(ids)
    mask[1, 17:] = 0
    ids = ids.masked_fill(mask == 0, 0)
    ns.update(target_dir=str(target_dir), eagle_cfg=cfg, collator=default_data_collator,
              ds=[{"input_ids": ids[i], "attention_mask": mask[i], "labels": ids[i]}
                  for i in range(2)],
              args=TrainingArguments(output_dir=str(work / "modelopt-out"), use_cpu=True,
                                     report_to=[], per_device_train_batch_size=2, max_steps=1,
                                     logging_steps=1, optim="sgd", learning_rate=0.1,
                                     save_strategy="no",
                                     train_sampling_strategy="sequential", disable_tqdm=True))


def _check_modelopt(ns: dict) -> None:
    """One step of the Eagle model ModelOpt converted through RingEagleModel, with a finite
    logged loss."""
    import math

    import torch.distributed as dist

    from ringattn.integrations.modelopt import RingEagleModel

    assert isinstance(ns["model"], RingEagleModel), type(ns["model"]).__mro__
    assert ns["trainer"].state.global_step == 1
    losses = [e["loss"] for e in ns["trainer"].state.log_history if "loss" in e]
    assert losses and all(math.isfinite(x) for x in losses), ns["trainer"].state.log_history
    every = [None] * dist.get_world_size()
    dist.all_gather_object(every, losses)
    assert all(x == losses for x in every), every  # the global loss, logged on every rank


def _parallelism(ns: dict, work: Path) -> None:
    """trainers.md's parallelism_config block: a tiny Llama with ring attention (``model``),
    four rows (``ds``) and ``out_dir``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=32,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2)
    ns["model"] = AutoModelForCausalLM.from_config(config, attn_implementation="ringattn")
    ids = torch.randint(50, (4, 29), generator=torch.Generator().manual_seed(2))
    ns["ds"] = [{"input_ids": row, "labels": row} for row in ids]
    ns["out_dir"] = str(work / "parallelism-trainer")


def _check_parallelism(ns: dict) -> None:
    """Three steps ran on the config's mesh, every parameter sharded by FSDP2 (exactness
    against one process: tests/integration/test_trainer_parallelism.py)."""
    trainer = ns["trainer"]
    assert trainer.state.global_step == 3, trainer.state.log_history
    assert trainer.device_mesh["cp"].size() == 2
    assert all(hasattr(p, "full_tensor") for p in trainer.model.parameters())


def _context_parallel(ns: dict, work: Path) -> None:
    """trainers.md's context_parallel blocks: a tiny Llama config (seeded, so the check
    builds the same initial weights), three global batches (left-padded, packed, plain; S
    not a multiple of 2W), the group; for the block without DDP, its model and optimizer."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "distributed")]
    from test_context_parallel import docs_inputs

    docs_inputs(ns)


def _context_parallel_no_ddp(ns: dict, work: Path) -> None:
    import torch
    from transformers import AutoModelForCausalLM

    from ringattn.integrations import transformers as ra_hf

    _context_parallel(ns, work)
    ra_hf.register()
    ns["model"] = AutoModelForCausalLM.from_config(ns["config"], attn_implementation="ringattn")
    ns["optimizer"] = torch.optim.SGD(ns["model"].parameters(), lr=0.1)


def _check_context_parallel(ns: dict) -> None:
    """The weights after the loop equal one process's SGD loop on the same batches."""
    from test_context_parallel import TOL, docs_check

    err = docs_check(ns, steps=1)
    assert err < TOL, err


def _check_varlen(ns: dict) -> None:
    assert ns["out_l"].shape == ns["q_l"].shape and ns["out_l"].isfinite().all()


def _check_ttt(ns: dict) -> None:
    assert ns["out"].shape == ns["q"].shape and ns["out"].isfinite().all()


def _tiny_llama(attn: str):
    """A tiny Llama (seeded: the same weights on every call) with ``attn``."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2)
    return AutoModelForCausalLM.from_config(config, attn_implementation=attn)


def _logprobs(ns: dict, work: Path) -> None:
    """trainers.md's tiled_logprobs block: ``model`` (ring attention), ``ids`` and ``mask``
    (two rows of 21 tokens, one left-padded by 4), ``group``."""
    import torch
    import torch.distributed as dist

    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    ns["model"] = _tiny_llama("ringattn")
    ns["ids"] = torch.randint(50, (2, 21), generator=torch.Generator().manual_seed(3))
    ns["mask"] = torch.ones(2, 21, dtype=torch.long)
    ns["mask"][1, :4] = 0
    ns["group"] = dist.group.WORLD


def _check_logprobs(ns: dict) -> None:
    """The gathered log-probabilities and entropies equal one process's untiled ones (the
    same weights, sdpa) wherever a token has a target."""
    import torch

    import ringattn as ra

    ctx = ns["local"]["ring_context"]

    def whole(x):
        return ra.unshard(x.detach(), group=ctx.group, layout=ctx.layout, dim=1,
                          seqlen=ctx.seqlen)

    lp, ent, target = whole(ns["logprobs"]), whole(ns["entropy"]), whole(
        ns["local"]["shift_labels"])
    ref_model = _tiny_llama("sdpa")
    with torch.no_grad():
        logits = ref_model(input_ids=ns["ids"], attention_mask=ns["mask"]).logits / 0.7
    logp = torch.log_softmax(logits.float(), -1)
    has = target != -100
    want = logp.gather(-1, target.clamp_min(0)[..., None])[..., 0]
    assert has.sum() == 20 + 16, has.sum()
    assert float((lp[has] - want[has]).abs().max()) < 1e-5
    real = ns["mask"].bool()
    want_ent = -(logp.exp() * logp).sum(-1)
    assert float((ent[real] - want_ent[real]).abs().max()) < 1e-5


def _token_loss(ns: dict, work: Path) -> None:
    """trainers.md's tiled_token_loss block: the tiled_logprobs block's inputs, its
    ``local`` and ``hidden`` (this rank's), ``advantages`` of the two rows."""
    import torch

    from ringattn.integrations import transformers as ra_hf

    _logprobs(ns, work)
    model = ns["model"]
    ns["local"] = local = ra_hf.prepare_batch(
        model, {"input_ids": ns["ids"], "attention_mask": ns["mask"], "labels": ns["ids"]},
        group=ns["group"])
    ns["hidden"] = model.model(input_ids=local["input_ids"], position_ids=local["position_ids"],
                               ring_context=local["ring_context"]).last_hidden_state
    ns["advantages"] = torch.tensor([1.0, -0.5])


def _check_token_loss(ns: dict) -> None:
    """The ranks' losses sum to one process's loss, and the head's gradients to its
    gradient (the same weights, sdpa, the untiled logits)."""
    import torch
    import torch.distributed as dist

    total = ns["result"].loss.detach().clone()
    grad = ns["model"].lm_head.weight.grad.clone()
    dist.all_reduce(total)
    dist.all_reduce(grad)
    ref_model = _tiny_llama("sdpa")
    ids, mask = ns["ids"], ns["mask"]
    target = torch.cat([ids[:, 1:], torch.full((2, 1), -100)], 1).masked_fill(mask == 0, -100)
    logp = torch.log_softmax(ref_model(input_ids=ids, attention_mask=mask).logits.float() / 0.7,
                             -1)
    has = target != -100
    lp = logp.gather(-1, target.clamp_min(0)[..., None])[..., 0]
    ratio = torch.exp(lp - lp.detach())
    adv = ns["advantages"][:, None]
    per = -torch.minimum(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
    loss = (per * has).sum() / has.sum()
    loss.backward()
    assert abs(float(total) - float(loss)) < 1e-6
    want = ref_model.lm_head.weight.grad
    assert float((grad - want).norm() / want.norm()) < 1e-5


def _seam(ns: dict, work: Path) -> None:
    """trainers.md's packed-seam block: ``group``, ``world``, ``rank``, three documents of 7,
    9 and 5 tokens packed (``packed_ids``, ``position_ids``, ``cu_seqlens``: 21 tokens, not
    a multiple of 2), ``packed_model`` loaded with the hook's attention."""
    import torch
    import torch.distributed as dist

    from ringattn.compat import ring_flash_attn as rfa

    ns["group"] = dist.group.WORLD
    ns["world"], ns["rank"] = dist.get_world_size(), dist.get_rank()
    lengths = (7, 9, 5)
    g = torch.Generator().manual_seed(4)
    ns["docs"] = [torch.randint(50, (n,), generator=g) for n in lengths]
    ns["packed_ids"] = torch.cat(ns["docs"])[None]
    ns["position_ids"] = torch.cat([torch.arange(n) for n in lengths])[None]
    ns["cu_seqlens"] = torch.tensor([0, 7, 16, 21], dtype=torch.int32)
    ns["packed_model"] = _tiny_llama(rfa.substitute_hf_flash_attn(ns["group"], 1))


def _check_seam(ns: dict) -> None:
    """This rank's log-probabilities equal one process running each document alone."""
    import torch

    ref_model = _tiny_llama("sdpa")
    with torch.no_grad():
        logits = torch.cat([ref_model(input_ids=d[None]).logits[0] for d in ns["docs"]])
    rolled = torch.roll(torch.cat(ns["docs"]), -1)
    want = torch.log_softmax(logits.float(), -1).gather(-1, rolled[:, None])[:, 0]
    mine = torch.chunk(want[None], ns["world"], dim=1)[ns["rank"]][0]
    assert float((ns["logprobs"][0].detach() - mine).abs().max()) < 1e-5


RANKED = {
    ("compat.md", 0): (_varlen, _check_varlen),
    ("compat.md", 1): (None, None),
    ("compat.md", 2): (None, None),
    ("eagle3.md", 0): (_shards, _check_ttt),
    ("strategies.md", 0): (_strategies, None),
    ("README.md", "eagle3-under-CP"): (_eagle3_cp, _check_eagle3_cp),
    ("modelopt.md", 0): (_modelopt, _check_modelopt),
    ("trainers.md", 0): (_parallelism, _check_parallelism),
    ("trainers.md", 4): (_context_parallel, _check_context_parallel),
    ("trainers.md", 5): (_context_parallel_no_ddp, _check_context_parallel),
    ("trainers.md", 6): (_context_parallel_no_ddp, _check_context_parallel),
    ("trainers.md", 8): (_logprobs, _check_logprobs),
    ("trainers.md", 9): (_token_loss, _check_token_loss),
    ("trainers.md", 10): (_seam, _check_seam),
}
"""Blocks run on 2 ranks: (what makes their inputs, what checks their outputs)."""


def _target_cfg():
    from ringattn.apps.eagle3_train import Eagle3Config

    return Eagle3Config(seqlen=24, vocab=40, draft_vocab=20, hidden=16, heads=4, kv_heads=2,
                        intermediate=32, target_layers=4, pad=0)


def _target_dir(work: Path) -> tuple[str, object]:
    """A saved tiny Llama target with a chat tokenizer (``TARGET_DIR``) and the target."""
    sys.path.insert(0, str(ROOT / "tests"))
    from chat import chat_tokenizer
    from ringattn.apps.eagle3_train import build_target
    from ringattn.eagle3.target import load_target

    path = work / "target"
    if not (path / "config.json").is_file():
        build_target(_target_cfg(), "sdpa").save_pretrained(path)
        chat_tokenizer().save_pretrained(path)
    return str(path), load_target(str(path), attn_implementation="sdpa")


def _draft(target):
    import torch

    from ringattn.apps.eagle3_train import Eagle3Config, build_draft

    return build_draft(Eagle3Config(target="unused"), target, torch.arange(0, 40, 2))


def _data(ns: dict, work: Path) -> None:
    """eagle3_data.md: a target tokenizer of V >= 32000 words, and chats.jsonl."""
    sys.path.insert(0, str(ROOT / "tests"))
    from chat import WITH_BLOCKS, WORDS

    from ringattn.apps.eagle3_demo import demo_tokenizer

    tokenizer = demo_tokenizer(WORDS + [f"w{i}" for i in range(32_100)], WITH_BLOCKS)
    ns.update(tokenizer=tokenizer, V=len(tokenizer))
    with open("chats.jsonl", "w") as f:
        f.write(json.dumps({"messages": [{"role": "user", "content": "how are you"},
                                         {"role": "assistant", "content": "fine thanks"}]})
                + "\n\n")
        f.write(json.dumps({"conversations": [{"from": "human", "value": "what is two"},
                                              {"from": "gpt", "value": "four w7 w31999"}]}) + "\n")


def _evaluation(ns: dict, work: Path) -> None:
    """eagle3.md's evaluation block: TARGET_DIR, a prompt, and OUT/draft-speculators."""
    import torch

    from ringattn.eagle3 import export_draft

    target_dir, target = _target_dir(work)
    export_draft(_draft(target), "OUT/draft-speculators", "speculators", target=target_dir)
    ns.update(TARGET_DIR=target_dir, prompt=torch.tensor([5, 9, 11, 6]))


def _sglang_load(ns: dict, work: Path) -> None:
    """eagle3_formats.md's load_draft block: the target and OUT/draft-sglang."""
    from ringattn.eagle3 import export_draft

    _, target = _target_dir(work)
    export_draft(_draft(target), "OUT/draft-sglang", "sglang", target=target)
    ns["target"] = target


def _by_hand(ns: dict, work: Path) -> None:
    """README's draft-by-hand block: TARGET_DIR, two batches, the draft vocabulary."""
    import torch

    target_dir, _ = _target_dir(work)
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(40, (2, 24), generator=g)
    mask = torch.ones_like(ids)
    ns.update(TARGET_DIR=target_dir, draft_ids=torch.arange(0, 40, 2),
              batches=[{"input_ids": ids, "attention_mask": mask, "loss_mask": mask}] * 2)


def _modelopt_export(ns: dict, work: Path) -> None:
    """modelopt.md's serving block: a saved 7-layer target (three distinct default aux
    layers) converted by ModelOpt on ringattn."""
    import copy

    import modelopt.torch.speculative as mtsp
    import torch
    from modelopt.torch.speculative.config import EAGLE3_DEFAULT_CFG
    from transformers import LlamaConfig, LlamaForCausalLM

    from ringattn.integrations import modelopt as ra_mo

    ra_mo.register(LlamaForCausalLM)
    torch.manual_seed(0)
    target_dir = work / "modelopt-served-target"
    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=7, num_attention_heads=4,
                                 num_key_value_heads=2, head_dim=8)).save_pretrained(target_dir)
    model = LlamaForCausalLM.from_pretrained(target_dir, attn_implementation="ringattn")
    cfg = copy.deepcopy(EAGLE3_DEFAULT_CFG["config"])
    cfg["eagle_use_torch_compile"] = False
    cfg["eagle_architecture_config"].update(num_attention_heads=4, num_key_value_heads=2,
                                            head_dim=8, intermediate_size=64)
    mtsp.convert(model, [("eagle", cfg)])
    ns.update(model=model, target_dir=str(target_dir))


def _check_modelopt_export(ns: dict) -> None:
    import torch

    from ringattn.eagle3 import load_draft

    back = load_draft("draft-vllm")
    assert back.aux_layers == ns["served"].aux_layers == (1, 2, 3)
    want = ns["served"].state_dict()
    assert all(torch.equal(t, want[k]) for k, t in back.state_dict().items())


def _check_data(ns: dict) -> None:
    assert len(ns["rows"]) == 1 and ns["draft_ids"].numel() == 32000
    assert ns["t2d"].numel() == ns["V"]


def _check_evaluation(ns: dict) -> None:
    assert len(ns["new_ids"]) == 32 and ns["tokens_per_round"] >= 1


def _check_by_hand(ns: dict) -> None:
    import torch

    want = ns["draft"].state_dict()
    assert all(torch.equal(t, want[k]) for k, t in ns["again"].state_dict().items())


LOCAL = {
    ("eagle3.md", 1): (_evaluation, _check_evaluation),
    ("eagle3_data.md", 0): (_data, _check_data),
    ("eagle3_formats.md", 0): (_sglang_load, None),
    ("modelopt.md", 3): (_modelopt_export, _check_modelopt_export),
    ("README.md", "draft-by-hand"): (_by_hand, _check_by_hand),
}
"""Blocks run in one process: (what makes their inputs, what checks their outputs)."""


def _torchrun_argv(code: str) -> list[list[str]]:
    """The argument lists of the torchrun commands of a shell block (continuation lines
    joined, comments dropped, $VARIABLES given values)."""
    env = {"HEAD_NODE": "node0", "JOB_ID": "1"}
    joined = code.replace("\\\n", " ")
    out = []
    for line in joined.splitlines():
        words = shlex.split(re.sub(r"\$(\w+)", lambda m: env[m.group(1)], line), comments=True)
        if words and words[0] == "torchrun":
            out.append(words[1:])
    return out


SHELL = {("compat.md", 3), ("modelopt.md", 2), ("trainers.md", 1)}
"""Shell blocks: every command in them is a torchrun launch, parsed by torchrun's parser."""
SPECFORGE = {("specforge.md", 0): "json", ("specforge.md", 1): "sh"}
"""specforge.md's draft-config entry and launch line (SpecForge is not in this venv): the
entry is read by ringattn's option check, the launch parsed by torchrun's and the program's
parsers (``test_specforge_blocks_parse``); make test-specforge runs the launcher's code."""


MODELOPT_RECIPE = ("modelopt.md", 1)
"""modelopt.md's recipe launch line: parsed by torchrun's parser, the program's, and
ModelOpt's own recipe loader (``test_modelopt_recipe_block_parses``)."""
ELSEWHERE = {("trainers.md", 2): "tests/integration/test_trl.py",
             ("trainers.md", 3): "tests/integration/test_trl.py",
             ("trainers.md", 7): "tests/integration/test_trl_grpo.py"}
"""Blocks another test runs as printed (TRL's: its launches already hold TRL's names and
its one-process reference)."""


def _run_block(key, code: str, make, check, work: Path) -> None:
    ns: dict = {"__name__": "__doc_block__"}
    if make is not None:
        make(ns, work)
    try:
        exec(compile(code, f"{key[0]} block {key[1]}", "exec"), ns)
    except Exception as exc:
        raise AssertionError(f"{key[0]} block {key[1]} does not run as printed: "
                             f"{type(exc).__name__}: {exc}") from exc
    if check is not None:
        check(ns)


# --------------------------------------------------------------------------- the tests


def test_every_block_is_covered():
    """Each block of docs/ (and of ``README_HERE``) is run here, by language: python on ranks
    or in one process, shell through the launcher's parser; nothing is left out."""
    found = all_blocks()
    covered = (set(RANKED) | set(LOCAL) | SHELL | set(SPECFORGE) | set(ELSEWHERE)
               | {MODELOPT_RECIPE})
    for key, test in ELSEWHERE.items():
        assert (ROOT / test).is_file(), (key, test)
    assert set(found) == covered, (sorted(set(found) - covered), sorted(covered - set(found)))
    for key in set(RANKED) | set(LOCAL):
        assert found[key][0] == "python", key
    for key in SHELL:
        assert found[key][0] in ("sh", "bash"), key


def test_every_readme_block_is_covered():
    """Each ```python block of the README has one entry of ``README_BLOCKS``, naming a test
    that reads the README; a new block without one fails here."""
    code = readme_python()
    for i, block in enumerate(code):
        lines = [line for line in README_BLOCKS if line in block]
        assert len(lines) == 1, (f"README python block {i} (starting {block[:60]!r}) is matched "
                                 f"by {lines}: give it one line in README_BLOCKS and a test "
                                 f"that runs it as printed")
    for line, test in README_BLOCKS.items():
        assert sum(line in block for block in code) == 1, line
        assert "README" in (ROOT / test).read_text(), test
    for key, line in README_HERE.items():
        assert README_BLOCKS[line] == "tests/integration/test_docs.py", key


@pytest.mark.timeout(120)
def test_shell_blocks_parse():
    from torch.distributed.run import get_args_parser

    found = doc_blocks()
    for key in sorted(SHELL):
        commands = _torchrun_argv(found[key][1])
        assert commands, key
        for argv in commands:
            args = get_args_parser().parse_args(argv)
            assert args.training_script == "train.py" and args.nnodes and args.rdzv_id, key


def test_modelopt_recipe_block_parses():
    """The launch line's torchrun arguments, the program's and its recipe with the
    overrides as ModelOpt's loader reads them (ModelOpt's schema: a misspelt key fails)."""
    from modelopt.recipe import load_recipe
    from modelopt.recipe.config import ModelOptEagleRecipe
    from torch.distributed.run import get_args_parser

    from ringattn.apps.modelopt_train import parser

    language, code = doc_blocks()[MODELOPT_RECIPE]
    assert language == "sh"
    (argv,) = _torchrun_argv(code)
    launch = get_args_parser().parse_args(argv)
    assert launch.module and launch.training_script == "ringattn.apps.modelopt_train"
    args = parser().parse_args(launch.training_script_args)
    recipe = load_recipe(args.config, overrides=args.overrides)
    assert isinstance(recipe, ModelOptEagleRecipe)
    assert int(launch.nproc_per_node) % recipe.training.cp_size == 0


def test_specforge_blocks_parse():
    from torch.distributed.run import get_args_parser

    from ringattn.apps.specforge_train import parser
    from ringattn.integrations.specforge import ARCHITECTURE, ring_options

    found = doc_blocks()
    for key, language in SPECFORGE.items():
        assert found[key][0] == language, key
    entry = json.loads(found[("specforge.md", 0)][1])
    assert entry["architectures"] == [ARCHITECTURE]
    assert ring_options(entry) == entry["ringattn"]
    (argv,) = _torchrun_argv(found[("specforge.md", 1)][1])
    launch = get_args_parser().parse_args(argv)
    assert launch.module and launch.training_script == "ringattn.apps.specforge_train"
    args = parser().parse_args(launch.training_script_args)
    assert args.command == "train" and int(launch.nproc_per_node) % args.cp_size == 0


@pytest.mark.timeout(180)
def test_local_blocks_run_as_printed(tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    monkeypatch.chdir(tmp_path)
    found = all_blocks()
    for key, (make, check) in sorted(LOCAL.items()):
        _run_block(key, found[key][1], make, check, tmp_path)


@pytest.mark.timeout(300)
def test_ranked_blocks_run_as_printed_on_two_ranks(tmp_path):
    """One torchrun launch on 2 gloo ranks runs every block that needs ranks."""
    pytest.importorskip("transformers")
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
         __file__, str(tmp_path)], capture_output=True, text=True, timeout=280, cwd=tmp_path,
        env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    ran = sorted(p.name for p in tmp_path.glob("ran.*"))
    assert ran == ["ran.0", "ran.1"], ran
    for name in ran:
        assert (tmp_path / name).read_text().split() == [f"{p}:{i}" for p, i in sorted(RANKED)]


def _rank_main(work: Path) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    os.chdir(work)
    found = all_blocks()
    done = []
    try:
        for key, (make, check) in sorted(RANKED.items()):
            _run_block(key, found[key][1], make, check, work)
            done.append(f"{key[0]}:{key[1]}")
        (work / f"ran.{rank}").write_text("\n".join(done) + "\n")
        dist.barrier()
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    _rank_main(Path(sys.argv[1]))


FOREIGN_PATHS = {"examples/speculative_decoding/main.py"}
"""Paths the pages name as another project's files (ModelOpt's example, said so in the
text), not this repository's."""


def test_docs_index_and_cross_references():
    """docs/README.md lists every page of docs/, and every link or file path the README and
    the pages name (markdown links, `docs/...md`, `tests/...py`, `benchmarks/...`) exists."""
    import re

    index = (ROOT / "docs" / "README.md").read_text()
    pages = sorted(p.name for p in (ROOT / "docs").glob("*.md") if p.name != "README.md")
    missing = [p for p in pages if f"]({p})" not in index]
    assert not missing, f"docs/README.md does not list {missing}"
    broken = []
    for page in [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]:
        text = page.read_text()
        for target in re.findall(r"\]\(([^)\s#]+)(?:#[^)]*)?\)", text):
            if "://" in target:
                continue
            if not (page.parent / target).exists():
                broken.append(f"{page.name}: link {target}")
        for path in re.findall(r"`((?:docs|tests|benchmarks|examples|src)/[\w./-]+\.(?:md|py|json|png))`",
                               text):
            if not (ROOT / path).exists() and path not in FOREIGN_PATHS:
                broken.append(f"{page.name}: path {path}")
    assert not broken, broken


NUMBER_WORDS = {"one": 1, "two": 2, "three": 3, "four": 4, "five": 5, "six": 6, "seven": 7,
                "eight": 8, "nine": 9, "ten": 10}


def _count(text: str, pattern: str) -> tuple:
    """The groups of ``pattern``'s one match in ``text`` (whitespace-normalised), counts as
    ints (digits or a small number word)."""
    found = re.findall(pattern, " ".join(text.split()))
    assert len(found) == 1, (pattern, found)
    groups = found[0] if isinstance(found[0], tuple) else (found[0],)
    return tuple(NUMBER_WORDS.get(g, int(g) if g.isdigit() else g) for g in groups)


def test_family_counts_in_the_pages_are_the_tables():
    """The README said 25 families have mixers ``convert`` serves, docs/models.md 29 (the
    code's ``CONVERTIBLE``): every count of families the pages state is the one of the
    table it counts. The code's: ``CONVERTIBLE`` (README, docs/models.md, whose hybrids row
    names every one of them), the DSA indexer families ``families/indexer.py`` registers;
    the tests': the survey's (test_families.EXPECTED) and the hybrid test's configs
    (test_hybrid_families.CONVERTED, over the families of docs/mixers.md's table)."""
    sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "integration")]
    import test_families
    import test_hybrid_families

    from ringattn.integrations import transformers as ra_hf
    from ringattn.integrations.transformers.families import indexer

    convertible = len(ra_hf.CONVERTIBLE)
    readme, models, mixers = (p.read_text() for p in (README, DOCS / "models.md",
                                                       DOCS / "mixers.md"))
    assert _count(readme, r"\.\.\. (\d+) families: `ringattn\.mixers` across ranks") == (
        convertible,)
    assert _count(models, r"among them the (\d+) hybrid families `convert_mixers` serves") == (
        convertible,)
    row = next(line for line in models.splitlines() if line.startswith("| hybrids ("))
    named = set(re.findall(r"[a-z0-9_]+", row.split(": `ra_hf.CONVERTIBLE`")[0]))
    assert ra_hf.CONVERTIBLE <= named, sorted(ra_hf.CONVERTIBLE - named)
    word, names = _count(models, r"the (\w+) DeepSeek-sparse-attention families `convert` "
                                 r"serves \(([^)]*)\)")
    assert word == len(indexer.FAMILIES) and names.split(", ") == list(indexer.FAMILIES)
    outcomes = [v["plain"] if isinstance(v, dict) else v for v in test_families.EXPECTED.values()]
    assert _count(models, r"Tested on (\d+) families \(tests/integration/test_families\.py\): "
                          r"(\d+) exact,") == (len(outcomes), outcomes.count("exact"))
    assert _count(models, r"and deepseek_v4 \(compressed attention, `convert`\), (\d+) "
                          r"refused") == (outcomes.count("refused"),)
    assert test_families.EXPECTED["deepseek_v4"] == "exact"
    table = set()
    for line in mixers.splitlines():
        first = line.split("|")[1].strip() if line.startswith("| `") else ""
        if re.fullmatch(r"`[a-z0-9_]+`(, `[a-z0-9_]+`)*", first):  # a row of families
            table |= set(re.findall(r"`([a-z0-9_]+)`", first))
    assert table <= ra_hf.CONVERTIBLE, sorted(table - ra_hf.CONVERTIBLE)
    configs, families = _count(mixers, r"(\d+) configs \(the (\d+) families above")
    assert (configs, families) == (len(test_hybrid_families.CONVERTED), len(table))
