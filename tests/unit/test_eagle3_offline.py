"""Offline Eagle3 outputs (``ringattn.eagle3.target``'s format), in one process: version 3
stores the target's final hidden states and its head (once) in place of its logits and
trains as the online target does; version 2 (the logits) still reads and trains; a
directory whose files disagree with its index (mixed versions, a head of another
vocabulary) and a batch with both or neither teacher are refused by name; in bf16 a token
takes at most 4 H x 2 bytes of hidden states. (Under CP: tests/distributed/
test_eagle3_training.py's and test_eagle3_target.py's offline tests.)"""

import copy
import json
import os
import shutil
import struct
from dataclasses import replace

import pytest
import torch

pytest.importorskip("transformers")

import ringattn.integrations.transformers  # noqa: E402,F401 (the head's reader and table)
from ringattn.apps.eagle3_train import Eagle3Config, build_draft, build_target  # noqa: E402
from ringattn.eagle3.draft import eagle3_step, run_target, shard_target_outputs  # noqa: E402
from ringattn.eagle3.target import OfflineSamples, precompute  # noqa: E402
from ringattn.eagle3.teacher import rebuild_transforms  # noqa: E402
from reference import rel_err  # noqa: E402

CFG = Eagle3Config(seqlen=24, batch=2, ttt_steps=4, vocab=40, draft_vocab=20, hidden=16,
                   heads=4, kv_heads=2, intermediate=32, target_layers=4, pad=0, steps=1)
TOL = 1e-6
"""Offline against online, fp32: the same target outputs (each sample run alone, against
the batch's padded rows), so within a few float32 roundings."""
LENGTHS = (24, 17)


def _samples():
    gen = torch.Generator().manual_seed(3)
    return [{"input_ids": torch.randint(CFG.vocab, (n,), generator=gen),
             "loss_mask": (torch.arange(n) >= 3).long()} for n in LENGTHS]


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """{"v3": a version 3 directory, "v2": a version 2 one} of the same samples (copy one
    to change it)."""
    root, target = tmp_path_factory.mktemp("offline"), build_target(CFG, "sdpa")
    for name, teacher in (("v3", "auto"), ("v2", "logits")):
        precompute(target, _samples(), str(root / name), dtype="float32", teacher=teacher)
    return {"v3": str(root / "v3"), "v2": str(root / "v2")}


def _copy(stored, version, tmp_path, name):
    return shutil.copytree(stored[version], str(tmp_path / name))


def _errors(a, b) -> dict:
    """{name: relative error} of step ``a`` (its draft's gradients) against ``b``."""
    (res, draft), (ref, draft_ref) = a, b
    errs = {"loss": rel_err(res.loss.detach().double(), ref.loss.detach().double())}
    for j in range(CFG.ttt_steps):
        errs[f"loss step {j}"] = abs(res.losses[j] - ref.losses[j]) / abs(ref.losses[j])
        errs[f"accuracy step {j}"] = abs(res.accuracies[j] - ref.accuracies[j])
    for (n, p), q in zip(draft.named_parameters(), draft_ref.parameters()):
        if p.requires_grad:
            errs["grad " + n] = rel_err(p.grad.double(), q.grad.double())
    return errs


def _step(draft, tgt):
    draft = copy.deepcopy(draft)
    res = eagle3_step(draft, tgt, steps=CFG.ttt_steps)
    res.loss.backward()
    return res, draft


def test_offline_outputs_train_like_the_online_target(stored):
    """Version 3 (the default) and version 2 read back from disk give the online step's
    losses, accuracies and gradients (the online teacher in tiles, and from the logits)."""
    target = build_target(CFG, "sdpa")
    draft = build_draft(CFG, target, torch.arange(0, CFG.vocab, 2)[:CFG.draft_vocab])
    bad = {}
    for version, teacher in ((3, "tiled"), (2, "logits")):
        samples = OfflineSamples(stored[f"v{version}"])
        assert samples.version == samples.index["version"] == version
        files = set(os.listdir(stored[f"v{version}"]))
        assert ("head.safetensors" in files) == (version == 3)
        batch = samples.batch([0, 1], CFG.seqlen)
        if version == 3:
            assert "logits" not in batch and batch["head"] is samples.head
            assert samples.head.weight.shape == (CFG.vocab, CFG.hidden)
            assert samples.index["head"] == {"file": "head.safetensors", "family": "llama",
                                             "row": [], "bias": False}
        else:
            assert "final_hidden" not in batch and samples.head is None
        offline = shard_target_outputs(batch)
        assert (offline.logits is None) == (version == 3)
        online = run_target(target, {k: batch[k] for k in ("input_ids", "attention_mask",
                                                             "loss_mask")}, teacher=teacher)
        errs = _errors(_step(draft, offline), _step(draft, online))
        bad.update({f"v{version} {k}": v for k, v in errs.items() if not v <= TOL})
    assert not bad, bad


def test_batches_hold_either_teacher_with_its_head(stored):
    batch = OfflineSamples(stored["v3"]).batch([0, 1], CFG.seqlen)
    head = batch.pop("head")
    logits = torch.zeros(2, CFG.seqlen, CFG.vocab)
    with pytest.raises(ValueError, match="not 'final_hidden' and 'logits'"):
        shard_target_outputs({**batch, "logits": logits}, head=head)
    with pytest.raises(ValueError, match="not neither"):
        shard_target_outputs({k: v for k, v in batch.items() if k != "final_hidden"})
    with pytest.raises(ValueError, match=r"batch\['final_hidden'\] needs the target's head"):
        shard_target_outputs(batch)
    with pytest.raises(ValueError, match="a head goes with 'final_hidden' only"):
        shard_target_outputs({**{k: v for k, v in batch.items() if k != "final_hidden"},
                              "logits": logits}, head=head)
    with pytest.raises(ValueError, match="two heads"):
        shard_target_outputs({**batch, "head": head}, head=replace(head))
    narrow = replace(head, weight=head.weight[:, :8])
    with pytest.raises(ValueError, match=r"weight \(40, 8\) does not read .* 16 features"):
        shard_target_outputs(batch, head=narrow)
    assert shard_target_outputs(batch, head=head).head is head


def test_a_mixed_directory_is_refused_by_name(stored, tmp_path):
    v3, v2 = _copy(stored, "v3", tmp_path, "v3"), _copy(stored, "v2", tmp_path, "v2")
    shutil.copy(os.path.join(v2, "sample-000001.safetensors"), v3)  # a version 2 sample
    with pytest.raises(ValueError, match=r"v3/sample-000001.safetensors holds 'logits', "
                                         r"which a version 3 directory's sample files do not "
                                         r"\(a version 2 sample: mixed versions"):
        OfflineSamples(v3)
    shutil.copy(os.path.join(stored["v3"], "head.safetensors"), v2)
    with pytest.raises(ValueError, match=r"v2/head.safetensors lies in a version 2 directory"):
        OfflineSamples(v2)

    def edited(name, **change):
        path = _copy(stored, "v3", tmp_path, name)
        with open(os.path.join(path, "index.json")) as f:
            index = json.load(f)
        index.update(change)
        with open(os.path.join(path, "index.json"), "w") as f:
            json.dump(index, f)
        return path

    with pytest.raises(ValueError, match=r"sample-000000.safetensors: 'aux_hidden' is F32 "
                                         r"\[24, 48\], but index.json says BF16 \[24, 48\]"):
        OfflineSamples(edited("dtype", dtype="bfloat16"))
    samples = [{"file": "sample-000000.safetensors", "length": 23}]
    with pytest.raises(ValueError, match=r"sample-000000.safetensors: 'input_ids' is I64 "
                                         r"\[24\], but index.json says I64 \[23\]"):
        OfflineSamples(edited("length", samples=samples))
    with pytest.raises(ValueError, match="is version 1, which stored the last layer after "
                                         "the final norm"):
        OfflineSamples(edited("v1", version=1))
    with pytest.raises(ValueError, match=r"is version 4; this library reads versions \(2, 3\)"):
        OfflineSamples(edited("v4", version=4))


def test_a_head_of_another_vocabulary_is_refused(stored, tmp_path):
    from safetensors.torch import load_file, save_file

    path = _copy(stored, "v3", tmp_path, "off")
    head = load_file(os.path.join(path, "head.safetensors"))["weight"]
    save_file({"weight": torch.cat([head, head[:1]])}, os.path.join(path, "head.safetensors"))
    with pytest.raises(ValueError, match=r"head.safetensors: 'weight' is F32 \[41, 16\], but "
                                         r"index.json says F32 \[40, 16\] \(\[vocab_size=40"):
        OfflineSamples(path)
    save_file({"weight": head, "bias": head[:, 0].clone()}, os.path.join(path, "head.safetensors"))
    with pytest.raises(ValueError, match="head.safetensors holds 'bias', which a version 3 "
                                         "directory's head files do not"):
        OfflineSamples(path)
    # a draft of another target vocabulary, trained on this head: refused by eagle3_step
    wide = build_target(replace(CFG, vocab=48), "sdpa")
    draft = build_draft(CFG, wide, torch.arange(20))
    with pytest.raises(ValueError, match="maps a target vocabulary of 48 tokens .* gives 40"):
        eagle3_step(draft, shard_target_outputs(OfflineSamples(stored["v3"]).batch(
            [0], CFG.seqlen)), steps=2)
    # a stored row the head table does not hold for the family
    with pytest.raises(ValueError, match="a stored llama head applies logit_scale=2.0, but "
                                         "the head table's row for llama reads no field"):
        rebuild_transforms("llama", ["logit_scale", 2.0])


def _header_bytes(path: str) -> int:
    """A safetensors file's header: its 8-byte length and the JSON it gives."""
    with open(path, "rb") as f:
        return 8 + struct.unpack("<Q", f.read(8))[0]


def test_bf16_disk_per_token_is_four_hidden_states(tmp_path):
    """Each sample file holds, past its header and 9 bytes of ids and loss mask per token,
    at most 4 H x 2 bytes per token (3H auxiliary + H final hidden states in bf16); the
    head is stored once, however many samples."""
    gen = torch.Generator().manual_seed(5)
    lengths = (24, 19, 7)
    samples = [{"input_ids": torch.randint(CFG.vocab, (n,), generator=gen),
                "loss_mask": torch.ones(n)} for n in lengths]
    path = str(tmp_path / "bf16")
    precompute(build_target(CFG, "sdpa"), samples, path, dtype="bfloat16")
    index = json.load(open(os.path.join(path, "index.json")))
    h = index["target_hidden_size"]
    hidden = 0
    for entry in index["samples"]:
        file = os.path.join(path, entry["file"])
        hidden += os.path.getsize(file) - _header_bytes(file) - 9 * entry["length"]
    per_token = hidden / sum(lengths)
    assert per_token <= 4 * h * 2, (per_token, 4 * h * 2)
    head = os.path.join(path, "head.safetensors")
    assert os.path.getsize(head) - _header_bytes(head) == CFG.vocab * h * 2
    assert sorted(os.listdir(path)) == ["head.safetensors", "index.json",
                                        *[e["file"] for e in index["samples"]]]
