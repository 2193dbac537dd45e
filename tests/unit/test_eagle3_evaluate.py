"""Speculative decoding with an Eagle3 draft reproduces the target's greedy generation token
for token (any draft); acceptance is counted right (an oracle draft accepts everything); a
trained draft accepts more tokens per round than an untrained one."""

import pytest
import torch

from ringattn.eagle3 import evaluate
from ringattn.eagle3.evaluate import held_out_accuracy, mean_accepted_length, speculative_generate
from ringattn.eagle3.train import Eagle3Config, _draft_ids, build_draft, build_target, make_batches, train_eagle3

# the demo's target and data; the whole vocabulary as the draft's: greedy generation from
# the random target falls into a few tokens that a half-size frequency vocabulary (built
# on random data) may lack, and a draft can never propose a token outside its vocabulary
CFG = Eagle3Config(steps=100, grad_clip=0.0, min_lr_ratio=1.0, draft_vocab=96)


@pytest.fixture(scope="module")
def models():
    target = build_target(CFG, "sdpa")
    untrained = build_draft(CFG, target, _draft_ids(CFG, target, None))
    trained = train_eagle3(CFG, progress=False, keep_draft=True)["draft"].eval()
    prompts = [torch.randint(CFG.vocab, (n,), generator=torch.Generator().manual_seed(n))
               for n in (5, 11, 17)]
    return target, untrained, trained, prompts


def _greedy(target, prompt, n):
    ids = prompt.reshape(1, -1)
    out = []
    with torch.no_grad():
        for _ in range(n):
            t = int(target(input_ids=ids, use_cache=False).logits[0, -1].argmax())
            out.append(t)
            ids = torch.cat([ids, torch.tensor([[t]])], dim=1)
    return out


@pytest.mark.parametrize("draft_len", [1, 3, 5])
def test_output_is_the_targets_greedy_generation(models, draft_len):
    target, untrained, trained, prompts = models
    for prompt in prompts:
        want = _greedy(target, prompt, 20)
        for draft in (untrained, trained):
            got, rounds = speculative_generate(target, draft, prompt, max_new_tokens=20,
                                               draft_len=draft_len)
            assert got == want
            assert all(1 <= r <= draft_len + 1 for r in rounds)


def test_an_oracle_draft_is_accepted_in_full(models, monkeypatch):
    target, untrained, _, prompts = models

    def oracle(draft, ids, g, aux, k):  # the target's own continuation after ids + [g]
        return _greedy(target, torch.cat([ids[0], torch.tensor([g])]), k)

    monkeypatch.setattr(evaluate, "_propose", oracle)
    got, rounds = speculative_generate(target, untrained, prompts[0], max_new_tokens=25,
                                       draft_len=4)
    assert got == _greedy(target, prompts[0], 25)
    assert rounds == [5] * 5  # every proposal accepted: 4 + the target's token per round


def test_training_raises_acceptance_and_held_out_accuracy(models):
    """One verification round (4 proposals) after each of 16 prompts from the training
    distribution (random tokens): the trained draft's proposals are accepted far more often.
    Longer generations are not used here: the random target's greedy output soon repeats
    one token, a context the draft never saw in training."""
    target, untrained, trained, _ = models
    prompts = [torch.randint(CFG.vocab, (n,), generator=torch.Generator().manual_seed(100 + n))
               for n in range(8, 24)]
    before = mean_accepted_length(target, untrained, prompts, max_new_tokens=5, draft_len=4)
    after = mean_accepted_length(target, trained, prompts, max_new_tokens=5, draft_len=4)
    print(f"mean accepted length per round: untrained {before:.2f}, trained {after:.2f}")
    assert after > before + 0.5, (before, after)
    held_out = list(make_batches(Eagle3Config(**{**CFG.__dict__, "steps": 2, "seed": 9})))
    acc_before = held_out_accuracy(target, untrained, held_out)
    acc_after = held_out_accuracy(target, trained, held_out)
    assert acc_after[0] > acc_before[0] + 0.1, (acc_before, acc_after)
