"""Eagle3 with a hybrid target: the draft's training step under CP, its online target a tiny
Qwen3.5 (gated delta net + full attention layers) converted by ``ra_hf.convert``, equals
the same step in one process (the target unconverted, eager): every TTT step's loss and
accuracy and every draft gradient, on every rank, W = 2 and 3, S = 41 (a multiple of
neither W nor 2W), one row right-padded. fp32, tolerance 1e-5 relative. Unconverted, the
target is refused on every rank."""

import copy

import pytest
import torch
import torch.distributed as dist

from ringattn.apps.eagle3_train import Eagle3Config, build_draft, make_batches
from ringattn.eagle3.draft import eagle3_step, run_target
from test_eagle3_training import step_errors

FP32_TOL = 1e-5
TTT = 3


def _target(attn: str):
    import transformers as tf

    config = tf.Qwen3_5TextConfig(
        vocab_size=40, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=256,
        linear_conv_kernel_dim=4, linear_key_head_dim=8, linear_value_head_dim=8,
        linear_num_key_heads=2, linear_num_value_heads=4,
        layer_types=["linear_attention", "full_attention"] * 2)
    config._attn_implementation = attn
    torch.manual_seed(0)
    return tf.Qwen3_5ForCausalLM(config).float().eval()


def step_vs_one_process(layout: str):
    """Rank side: {name: relative error} of the CP step against one process."""
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    cfg = Eagle3Config(seqlen=41, batch=2, ttt_steps=TTT, vocab=40, draft_vocab=20, hidden=32,
                       heads=4, kv_heads=2, intermediate=64, target_layers=4, pad=7, steps=1,
                       layout=layout)
    cp_target = ra_hf.convert(_target("ringattn"))
    one_target = _target("eager")
    draft = build_draft(cfg, cp_target, torch.arange(0, 40, 2))
    draft_one = copy.deepcopy(draft)
    batch = next(make_batches(cfg, replica=None))
    assert batch["attention_mask"].sum() < batch["attention_mask"].numel()  # padded
    res = eagle3_step(draft, run_target(cp_target, batch, group=dist.group.WORLD,
                                        layout=layout), steps=TTT)
    one = eagle3_step(draft_one, run_target(one_target, batch), steps=TTT)
    errs = step_errors(res, draft, one, draft_one, TTT)
    try:  # unconverted, its gated delta nets would see only the shard: refused
        run_target(_target("ringattn"), batch, group=dist.group.WORLD, layout=layout)
        refusal = None
    except ValueError as exc:
        refusal = str(exc)
    return errs, refusal


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_eagle3_step_with_a_hybrid_target_equals_one_process(clusters, worst_errors, world):
    for rank, (errs, refusal) in enumerate(clusters(world).run(step_vs_one_process, "zigzag",
                                                               timeout=280)):
        assert refusal and "convert" in refusal and "linear_attention" in refusal, (rank, refusal)
        for name, err in errs.items():
            key = ("float32", "eagle3 hybrid target " + name.split(" ")[0])
            worst_errors[key] = (max(worst_errors.get(key, (0.0, FP32_TOL))[0], err), FP32_TOL)
        bad = {n: e for n, e in errs.items() if e > FP32_TOL}
        assert not bad, (world, rank, bad)
