"""Eagle3 from a target directory and chat data, end to end: conversations rendered with the
target's tokenizer (loss on assistant tokens), padded or packed rows, the draft vocabulary
from the data; training under CP on 2 ranks equals one process step for step; the run ends
with checkpoints and both exported drafts, which load back."""

import json

import pytest
import torch

from chat import WORDS, chat_tokenizer
from ringattn.eagle3 import load_draft
from ringattn.apps.eagle3_train import Eagle3Config, build_target, train_eagle3
from test_eagle3_training import FP32_TOL, small_config


def _setup(tmp_path):
    """A saved tiny target with the chat tokenizer, and 12 random conversations."""
    base = small_config()
    target = build_target(base, "sdpa")
    target.save_pretrained(tmp_path / "target")
    chat_tokenizer().save_pretrained(tmp_path / "target")
    gen = torch.Generator().manual_seed(4)

    def words(n):
        return " ".join(WORDS[i] for i in torch.randint(len(WORDS), (n,), generator=gen))

    with open(tmp_path / "chats.jsonl", "w") as f:
        for c in range(12):
            turns = [{"role": "user", "content": words(3 + c % 4)},
                     {"role": "assistant", "content": words(2 + c % 5)}]
            if c % 3 == 0:
                turns += [{"role": "user", "content": words(2)},
                          {"role": "assistant", "content": words(4)}]
            row = {"messages": turns} if c % 2 else {"conversations": [
                {"from": {"user": "human", "assistant": "gpt"}[t["role"]], "value": t["content"]}
                for t in turns]}
            f.write(json.dumps(row) + "\n")
    return str(tmp_path / "target"), str(tmp_path / "chats.jsonl")


def _config(target, data, pack):
    return Eagle3Config(**{**small_config().__dict__, "target": target, "data": data,
                           "pack": pack, "batch": 1 if pack else 2, "seqlen": 40, "steps": 3,
                           "draft_vocab": 12, "pad": 0})


def run_chat(cfg, out):
    import torch.distributed as dist

    return train_eagle3(cfg, group=dist.group.WORLD, progress=False, out_dir=out)


@pytest.mark.timeout(240)
@pytest.mark.parametrize("pack", [False, True])
def test_chat_training_under_cp_equals_one_process(clusters, tmp_path, pack):
    target, data = _setup(tmp_path)
    cfg = _config(target, data, pack)
    one = train_eagle3(cfg, progress=False)
    for rank, res in enumerate(clusters(2).run(run_chat, cfg, str(tmp_path / "out"), timeout=200)):
        for step, (a, b) in enumerate(zip(res["loss"], one["loss"], strict=True)):
            assert abs(a - b) <= FP32_TOL * abs(b), (rank, step, a, b)
        for j in range(cfg.ttt_steps):
            assert res["step_accuracy"][j] == pytest.approx(one["step_accuracy"][j], abs=1e-9, nan_ok=True)
    assert all(x > 0 for x in one["loss"])
    out = tmp_path / "out"
    assert (out / "checkpoint-last" / "state.pt").is_file()
    emb = build_target(cfg, "sdpa").get_input_embeddings().weight
    for fmt in ("sglang", "speculators"):
        draft = load_draft(str(out / f"draft-{fmt}"), embed_tokens=emb)
        assert draft.d2t.numel() == 12 and draft.aux_layers == (0, 1, 2)


def test_offline_command_writes_the_rendered_conversations(tmp_path):
    """``python -m ringattn.apps.eagle3_target``: the chat data rendered and run through the
    target once, read back with the same ids and loss masks as rendering them directly; by
    default the final hidden states and the head (version 3), no logits."""
    from ringattn.eagle3.data import load_conversations, render
    from ringattn.apps.eagle3_target import main
    from ringattn.eagle3.target import OfflineSamples

    target, data = _setup(tmp_path)
    assert main(["--target", target, "--data", data, "--out", str(tmp_path / "off"),
                 "--dtype", "float32"]) == 0
    stored = OfflineSamples(str(tmp_path / "off"))
    convs = load_conversations(data)
    assert len(stored) == len(convs) == 12
    ids, mask = render(chat_tokenizer(), convs[3])
    batch = stored.batch([3], 64)
    n = ids.numel()
    assert torch.equal(batch["input_ids"][0, :n], ids) and torch.equal(batch["loss_mask"][0, :n].bool(), mask)
    assert batch["attention_mask"][0].sum() == n and batch["aux_hidden"].shape == (1, 64, 3 * 16)
    assert stored.version == 3 and batch["final_hidden"].shape == (1, 64, 16)
    assert "logits" not in batch and batch["head"].weight.shape == (40, 16)


def run_offline_training(cfgs):
    import torch.distributed as dist

    return [train_eagle3(cfg, group=dist.group.WORLD, progress=False) for cfg in cfgs]


@pytest.mark.timeout(300)
def test_offline_training_equals_online(clusters, tmp_path):
    """Training on stored outputs (``--offline``: version 3, the default, and version 2,
    ``--teacher logits``) under CP on 2 ranks gives the losses of online training on the
    same conversations in one process."""
    from ringattn.apps.eagle3_target import main

    target, data = _setup(tmp_path)
    cfgs = []
    for version, teacher in ((3, "auto"), (2, "logits")):
        out = str(tmp_path / f"off-v{version}")
        assert main(["--target", target, "--data", data, "--out", out, "--dtype", "float32",
                     "--teacher", teacher]) == 0
        with open(f"{out}/index.json") as f:
            assert json.load(f)["version"] == version
        cfgs.append(Eagle3Config(**{**_config(target, None, False).__dict__, "offline": out}))
    online = train_eagle3(_config(target, data, False), progress=False)
    for rank, results in enumerate(clusters(2).run(run_offline_training, cfgs, timeout=280)):
        for res in results:
            for step, (a, b) in enumerate(zip(res["loss"], online["loss"], strict=True)):
                assert abs(a - b) <= FP32_TOL * abs(b), (rank, res["config"]["offline"],
                                                         step, a, b)
