"""Eagle3 with an attention-free target: RWKV (RWKV-4, its blocks in ``rwkv.blocks``) and
xLSTM (mLSTM blocks in ``backbone.blocks``), converted by ``ra_hf.convert``, under CP.

On every rank, W = 2 and 3, S = 41 (a multiple of neither W nor 2W), one row right-padded:
``run_target``'s captured auxiliary hidden states (the raw outputs of three of the four
blocks) and logits, gathered over the ranks, equal one process running the same target
unconverted on the whole batch; and the draft's training step on them (every TTT step's
loss and accuracy, every draft gradient) equals the one-process step. fp32, 1e-5 relative.
Unconverted, the target is refused on every rank (no ringattn code runs in its forward:
``check_consumed``)."""

import copy

import pytest
import torch
import torch.distributed as dist

import ringattn as ra
from ringattn.apps.eagle3_train import Eagle3Config, make_batches
from ringattn.eagle3.draft import Eagle3Draft, decoder_layers, eagle3_step, run_target
from families import _xlstm_weights
from reference import rel_err
from test_eagle3_training import step_errors

pytest.importorskip("transformers")

FP32_TOL = 1e-5
TTT = 3
SEQLEN = 41
VOCAB = 40
HIDDEN = 64
FAMILIES = ("rwkv", "xlstm")


def _target(family: str):
    """A tiny 4-block target, the same weights on every call, in eval mode (a frozen
    target), with the weights that make its recurrence matter (tests/families.py's: RWKV's
    keys up to about +-30 and time_first varied per channel; xLSTM's gates varied per token,
    input gate biases -10 to 2 by head, eps 1e-3 so that the stabiliser weighs in)."""
    import transformers as tf

    torch.manual_seed(0)
    if family == "rwkv":  # rescale_every=2: eval mode halves the residual after block 1
        config = tf.RwkvConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=4,
                               attention_hidden_size=HIDDEN, intermediate_size=96,
                               context_length=256, rescale_every=2, pad_token_id=0,
                               bos_token_id=1, eos_token_id=2)
        model = tf.RwkvForCausalLM(config).float()
        g = torch.Generator().manual_seed(2)
        with torch.no_grad():
            for block in model.rwkv.blocks:
                block.attention.key.weight.mul_(10.0)
                block.attention.time_first.copy_(torch.randn(HIDDEN, generator=g))
    else:
        config = tf.xLSTMConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_hidden_layers=4,
                                num_heads=4, eps=1e-3, pad_token_id=0, bos_token_id=1,
                                eos_token_id=2)
        model = tf.xLSTMForCausalLM(config).float()
        _xlstm_weights(model)  # the survey's gates, varied per token and head
    return model.eval().requires_grad_(False)


def _draft(target):
    """A seeded one-layer draft (apps.eagle3_train.build_draft's initialisation) sharing the
    target's token embedding."""
    from transformers import LlamaConfig

    config = LlamaConfig(hidden_size=HIDDEN, intermediate_size=96, num_attention_heads=4,
                         num_key_value_heads=2, head_dim=16, vocab_size=VOCAB,
                         max_position_embeddings=256, num_hidden_layers=1,
                         tie_word_embeddings=False, bos_token_id=None, eos_token_id=None,
                         pad_token_id=None)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        draft = Eagle3Draft(config, HIDDEN, torch.arange(0, VOCAB, 2), (0, 1, 3)).float()
        for name, p in draft.named_parameters():
            if p.dim() == 2 and name != "embed_tokens.weight":
                torch.nn.init.normal_(p, std=0.02)
    draft.embed_tokens.weight.data.copy_(target.get_input_embeddings().weight.float())
    return draft.train()


def _batch():
    cfg = Eagle3Config(seqlen=SEQLEN, batch=2, ttt_steps=TTT, vocab=VOCAB, draft_vocab=20,
                       hidden=HIDDEN, heads=4, kv_heads=2, intermediate=96, target_layers=4,
                       pad=7, steps=1)
    batch = next(make_batches(cfg, replica=None))
    assert batch["attention_mask"].sum() < batch["attention_mask"].numel()  # padded
    return batch


def target_vs_one_process(families, layout: str):
    """Rank side: {family: ({name: relative error}, the unconverted target's refusal)}."""
    from ringattn.integrations import transformers as ra_hf

    ra_hf.register()
    group = dist.group.WORLD
    batch = _batch()
    keep = batch["attention_mask"].bool()
    found = {}
    for family in families:
        cp_target, one_target = ra_hf.convert(_target(family)), _target(family)
        assert len(decoder_layers(cp_target)) == 4
        cp = run_target(cp_target, batch, group=group, layout=layout, aux_layers=(0, 1, 3))
        one = run_target(one_target, batch, aux_layers=(0, 1, 3))
        errs = {}
        # on the real tokens (not right padding); the teacher's input: the final hidden
        # states (the teacher in tiles) or the logits (a head it cannot read)
        for name in ("aux_hidden", "logits" if cp.logits is not None else "final_hidden"):
            got = ra.unshard(getattr(cp, name), group=group, layout=layout, dim=1,
                             seqlen=SEQLEN)
            errs[name] = rel_err(got[keep], getattr(one, name)[keep])
        draft = _draft(one_target)
        draft_one = copy.deepcopy(draft)
        res = eagle3_step(draft, cp, steps=TTT)
        errs.update(step_errors(res, draft, eagle3_step(draft_one, one, steps=TTT), draft_one,
                                TTT))
        try:  # unconverted, its recurrences would see only the shard: refused
            run_target(_target(family), batch, group=group, layout=layout, aux_layers=(0, 1, 3))
            refusal = None
        except ValueError as exc:
            refusal = str(exc)
        found[family] = (errs, refusal)
    return found


@pytest.mark.timeout(400)
@pytest.mark.parametrize("world", [2, 3])
def test_eagle3_rnn_targets_equal_one_process(clusters, worst_errors, world):
    for rank, found in enumerate(clusters(world).run(target_vs_one_process, FAMILIES,
                                                     "zigzag", timeout=380)):
        for family, (errs, refusal) in found.items():
            assert refusal and "convert" in refusal, (family, rank, refusal)
            for name, err in errs.items():
                key = ("float32", f"eagle3 {family} target " + name.split(" ")[0])
                worst_errors[key] = (max(worst_errors.get(key, (0.0, FP32_TOL))[0], err),
                                     FP32_TOL)
            bad = {n: e for n, e in errs.items() if e > FP32_TOL}
            assert not bad, (family, world, rank, bad)


def test_block_lists_are_found_without_a_cluster():
    """``decoder_layers`` finds RWKV's ``rwkv.blocks`` and xLSTM's ``backbone.blocks`` (and
    still refuses a model with no block list, naming where it looked)."""
    for family, owner in (("rwkv", "rwkv"), ("xlstm", "backbone")):
        target = _target(family)
        assert decoder_layers(target) is getattr(target, owner).blocks
    with pytest.raises(ValueError, match="decoder-layer list"):
        decoder_layers(torch.nn.Linear(2, 2))
