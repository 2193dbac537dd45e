"""Eagle3's target from a local directory and its offline (precomputed) outputs: the loaded
target equals the saved one; a CP step on outputs read back from disk (version 3: final
hidden states and head; version 2: logits) equals the online step in one process."""

import pytest
import torch
import torch.distributed as dist

from ringattn.eagle3.draft import eagle3_step, run_target, shard_target_outputs
from ringattn.eagle3.target import OfflineSamples, load_target, precompute
from ringattn.apps.eagle3_train import build_draft, build_target
from reference import rel_err
from test_eagle3_training import FP32_TOL, small_config


def _saved_target(tmp_path):
    cfg = small_config()
    target = build_target(cfg, "sdpa")
    target.save_pretrained(tmp_path / "target")
    return cfg, target, str(tmp_path / "target")


def test_load_target_equals_the_saved_model(tmp_path):
    cfg, target, path = _saved_target(tmp_path)
    loaded = load_target(path, attn_implementation="sdpa")
    ids = torch.randint(cfg.vocab, (2, 20), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded(input_ids=ids).logits, target(input_ids=ids).logits)
    assert not any(p.requires_grad for p in loaded.parameters()) and not loaded.training
    assert loaded.eagle3_aux_layers == (0, 1, 2)
    assert load_target(path).config._attn_implementation == "ringattn"  # the default, checked
    with pytest.raises(ValueError, match="no config.json"):
        load_target(str(tmp_path / "nowhere"))


def run_offline(path, offline_dirs):
    """Rank side: {version: per-step losses' and the summed gradients' relative errors} of
    the CP step on outputs read from disk, against the online one-process step."""
    cfg = small_config(seqlen=40)
    target = load_target(path, attn_implementation="sdpa")
    draft_ids = torch.arange(0, cfg.vocab, 2)[: cfg.draft_vocab]
    out = {}
    for offline in offline_dirs:
        draft = build_draft(cfg, target, draft_ids)
        draft_one = build_draft(cfg, target, draft_ids)
        samples = OfflineSamples(offline)
        batch = samples.batch([0, 1], cfg.seqlen)
        res = eagle3_step(draft, shard_target_outputs(batch, group=dist.group.WORLD,
                                                      layout="striped"), steps=cfg.ttt_steps)
        res.loss.backward()
        online = {k: batch[k] for k in ("input_ids", "attention_mask", "loss_mask")}
        one = eagle3_step(draft_one, run_target(target, online), steps=cfg.ttt_steps)
        one.loss.backward()
        errs = {f"loss {j}": abs(a - b) / abs(b)
                for j, (a, b) in enumerate(zip(res.losses, one.losses))}
        for (n, p), p1 in zip(draft.named_parameters(), draft_one.parameters()):
            if p.requires_grad:
                g = p.grad.clone()
                dist.all_reduce(g)
                errs[n] = rel_err(g.double(), p1.grad.double())
        out[samples.version] = errs
    return out


@pytest.mark.timeout(200)
def test_offline_outputs_train_like_the_online_target(clusters, tmp_path):
    cfg, target, path = _saved_target(tmp_path)
    gen = torch.Generator().manual_seed(1)
    samples = [{"input_ids": torch.randint(cfg.vocab, (n,), generator=gen),
                "loss_mask": (torch.arange(n) >= 3).long()} for n in (40, 33)]
    dirs = []
    for version, teacher in ((3, "auto"), (2, "logits")):
        dirs.append(str(tmp_path / f"offline-v{version}"))
        index = precompute(load_target(path, attn_implementation="sdpa"), samples, dirs[-1],
                           dtype="float32", teacher=teacher)
        assert [e["length"] for e in index["samples"]] == [40, 33]
        assert index["aux_layers"] == [0, 1, 2] and index["version"] == version
    for rank, by_version in enumerate(clusters(2).run(run_offline, path, dirs, timeout=180)):
        assert sorted(by_version) == [2, 3]
        for version, errs in by_version.items():
            bad = {k: v for k, v in errs.items() if not v <= FP32_TOL}
            assert not bad, (rank, version, bad)
