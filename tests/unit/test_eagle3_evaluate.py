"""Speculative decoding with an Eagle3 draft: the output is the target's greedy generation
token for token (any draft); the draft's chain at inference computes what ``eagle3_step``
computes in training at the same index; acceptance is counted right (oracle proposers); a
trained draft accepts clearly more tokens per round than an untrained one; acceptance per
bucket of context positions is the per-round records bucketed.

Target: train.py's tiny random Llama with Eagle3Config's defaults, eager attention. Its
next token is almost always the current one (tied, scaled embeddings), so its greedy
output repeats the prompt's last token, and a draft that learned to copy its input token
is accepted in full."""

import json

import pytest
import torch

from ringattn.eagle3 import evaluate
from ringattn.eagle3.draft import capture_aux_hidden, eagle3_step, run_target
from ringattn.eagle3.evaluate import (Round, acceptance, by_position, draft_chain,
                                      mean_accepted_length, speculation_rounds,
                                      speculative_generate)
from ringattn.apps.eagle3_train import Eagle3Config, build_draft, build_target, train_eagle3

TARGET = Eagle3Config()
"""The target: Eagle3Config's defaults."""
TRAIN = Eagle3Config(seqlen=24, batch=8, pad=4, steps=100, lr=1e-2, grad_clip=0.0,
                     min_lr_ratio=1.0, draft_vocab=TARGET.vocab)
"""The draft's training (the same target: seqlen only sets its RoPE table's length). Short
rows: the untrained draft's near-uniform causal attention already gives the token it must
copy a large share, so copying is learnt in 60-100 steps (about 2 s); at S = 250 it takes
minutes. The whole vocabulary is the draft's: with half of it, the greedy output's one
repeated token is outside the draft vocabulary for half the prompts, and a draft can never
propose a token outside it."""
NEW = 24
"""Tokens generated per prompt."""


@pytest.fixture(scope="module")
def models():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: extra threads only contend on a busy machine
    try:
        target = build_target(TARGET, "eager")
        trained_target = build_target(TRAIN, "eager")
        for (name, a), b in zip(target.state_dict().items(), trained_target.state_dict().values()):
            assert torch.equal(a, b), f"the training run's target differs in {name}"
        untrained = build_draft(TRAIN, target, torch.arange(TARGET.vocab)).eval()
        trained = train_eagle3(TRAIN, progress=False, keep_draft=True)["draft"].eval()
        prompts = [torch.randint(TARGET.vocab, (n,), generator=torch.Generator().manual_seed(n))
                   for n in (1, 5, 11, 17)]
        wants = [_generate(target, p, NEW + 6) for p in prompts]
        yield target, {"untrained": untrained, "trained": trained}, prompts, wants
    finally:
        torch.set_num_threads(threads)


def _generate(target, prompt, n, **kw):
    """The reference: transformers' own greedy generation (with its KV cache)."""
    out = target.generate(prompt[None], max_new_tokens=n, do_sample=False, pad_token_id=0, **kw)
    return out[0, prompt.numel():].tolist()


@pytest.mark.parametrize("draft_len", [1, 3, 5])
@pytest.mark.parametrize("which", ["untrained", "trained"])
def test_output_is_the_targets_greedy_generation(models, which, draft_len):
    target, drafts, prompts, wants = models
    for prompt, want in zip(prompts, wants):
        got, rounds = speculative_generate(target, drafts[which], prompt, max_new_tokens=NEW,
                                           draft_len=draft_len)
        assert got == want[:NEW], (prompt.tolist(), got, want[:NEW])
        assert all(1 <= r <= draft_len + 1 for r in rounds), rounds
        # the prefill gives one token, each round accepted + 1 (the last round may overshoot)
        assert 1 + sum(rounds) >= NEW > 1 + sum(rounds[:-1]), rounds


def test_the_chain_is_the_training_step_at_the_last_index(models):
    """At inference the draft chains from index S - 2 of the verified tokens; its step-j
    logits must be those ``eagle3_step`` computes at index S - 2 and TTT step j on the
    verified tokens followed by the chain's own proposals (training reads token i + 1 + j
    at RoPE position i + j): same inputs, positions, hidden states and attention mask."""
    target, drafts, prompts, wants = models
    k = 5
    for draft in drafts.values():
        for prompt, want, done in zip(prompts, wants, (1, 4, 2, 7)):
            seq = torch.cat([prompt, torch.tensor(want[:done])])[None]  # S verified tokens
            s = seq.shape[1]
            with torch.no_grad():
                _, aux = capture_aux_hidden(target, draft.aux_layers, input_ids=seq,
                                            use_cache=False)
            proposals, logits = draft_chain(draft, seq, aux, k)
            # training on [verified tokens, d_1 .. d_{k-1}]: index S-2 reads t_{S-1}, d_1, ...
            batch = {"input_ids": torch.cat([seq, torch.tensor([proposals[:-1]])], dim=1)}
            seen = []
            original = draft.logits
            draft.logits = lambda hidden: seen.append(original(hidden)) or seen[-1]
            try:
                with torch.no_grad():
                    # the untiled teacher: its step runs draft.logits on every index
                    # (the tiled one, equal within 4.3e-7, applies the head in tiles)
                    eagle3_step(draft, run_target(target, batch, teacher="logits"), steps=k)
            finally:
                del draft.logits
            want_logits = torch.stack([step[0, s - 2] for step in seen]).float()
            # fp32 both ways; they differ only in summation order (prefix lengths, the
            # chain's one-row attention against the written-out TTT mask): about 1e-6 of
            # the logits' scale measured, a misaligned position or input is off by > 1e-2
            err = (logits - want_logits).abs().max().item()
            assert err <= 1e-4 * max(want_logits.abs().max().item(), 1.0), (s, err)
            assert proposals == draft.draft_ids[want_logits.argmax(-1)].tolist()


def _oracle(prompt, want, right):
    """A proposer that knows the target's greedy continuation ``want`` and gets the first
    ``right`` proposals of every round right, the rest wrong."""
    def propose(draft, ids, aux, k):
        start = ids.shape[1] - prompt.numel()  # new tokens verified so far
        truth = want[start:start + k]
        return truth[:right] + [(t + 1) % TARGET.vocab for t in truth[right:]]
    return propose


def _expected_rounds(new, draft_len, right):
    """The rounds of a proposer right on its first ``right`` proposals of every round."""
    rounds, done = [], 1  # the prefill's token
    while done < new:
        k = min(draft_len, new - done)
        rounds.append(min(right, k) + 1)
        done += rounds[-1]
    return rounds


@pytest.mark.parametrize("right", [0, 2, 4])
def test_acceptance_is_counted_right(models, monkeypatch, right):
    """An oracle proposer is accepted in full (draft_len + 1 tokens every round); one right
    on its first ``right`` proposals gets exactly ``right`` + 1; the output never changes."""
    target, drafts, prompts, wants = models
    for prompt, want in zip(prompts, wants):
        monkeypatch.setattr(evaluate, "_propose", _oracle(prompt, want, right))
        got, rounds = speculative_generate(target, drafts["untrained"], prompt,
                                           max_new_tokens=NEW, draft_len=4)
        assert got == want[:NEW]
        assert rounds == _expected_rounds(NEW, 4, right), rounds
    if right == 4:
        assert rounds[:-1] == [5] * (len(rounds) - 1)


def test_generation_stops_at_the_targets_eos(models, monkeypatch):
    """With an EOS id in the target's generation config the output ends with it, as
    ``generate`` does, also when a round accepted proposals past it."""
    _, drafts, _, _ = models
    target = build_target(Eagle3Config(target_embed_scale=1.0), "eager")  # output changes token
    prompt = torch.randint(TARGET.vocab, (11,), generator=torch.Generator().manual_seed(11))
    free = _generate(target, prompt, NEW)
    eos = next(t for t in free if t != free[0])  # the first token it changes to
    want = _generate(target, prompt, NEW, eos_token_id=eos)
    assert want[-1] == eos and len(want) < NEW
    monkeypatch.setattr(target.generation_config, "eos_token_id", eos)
    got, _ = speculative_generate(target, drafts["untrained"], prompt, max_new_tokens=NEW)
    assert got == want
    monkeypatch.setattr(evaluate, "_propose", _oracle(prompt, free, 5))  # runs past the EOS
    got, rounds = speculative_generate(target, drafts["untrained"], prompt,
                                       max_new_tokens=NEW, draft_len=5)
    assert got == want and len(rounds) == 1 and rounds[0] == 6, rounds


def test_training_raises_the_accepted_length(models):
    """Mean tokens per round (accepted + 1) over 16 prompts, 24 new tokens each, 4
    proposals per round: an untrained draft proposes noise (1.0), the trained one copies
    its input token as the target does (measured 4.65 of at most 5)."""
    target, drafts, _, _ = models
    prompts = [torch.randint(TARGET.vocab, (n,), generator=torch.Generator().manual_seed(100 + n))
               for n in range(4, 20)]
    before, after = (mean_accepted_length(target, drafts[w], prompts, max_new_tokens=NEW,
                                          draft_len=4) for w in ("untrained", "trained"))
    print(f"mean accepted length per round (draft_len 4): untrained {before:.2f}, trained "
          f"{after:.2f} after {TRAIN.steps} training steps")
    assert after > before + 2.0 and after > 3.5, (before, after)


def test_bad_arguments_are_named(models):
    target, drafts, prompts, _ = models
    with pytest.raises(ValueError, match="draft_len"):
        speculative_generate(target, drafts["trained"], prompts[1], max_new_tokens=4, draft_len=0)
    with pytest.raises(ValueError, match="max_new_tokens"):
        speculative_generate(target, drafts["trained"], prompts[1], max_new_tokens=0)
    with pytest.raises(ValueError, match="input_ids"):
        speculative_generate(target, drafts["trained"], torch.zeros(2, 3, dtype=torch.long),
                             max_new_tokens=4)
    with pytest.raises(ValueError, match="no verification round"):
        mean_accepted_length(target, drafts["trained"], prompts, max_new_tokens=1)


def _bucketed(rounds, edges):
    """The reference for ``by_position``: each bucket's rounds picked by a plain comparison
    with its two edges, then (count, tokens per round, accepted / proposed)."""
    out = []
    for i, start in enumerate(edges):
        end = edges[i + 1] if i + 1 < len(edges) else float("inf")
        inside = [r for r in rounds if start <= r.position < end]
        proposed = sum(r.proposed for r in inside)
        out.append((len(inside),
                    sum(r.accepted + 1 for r in inside) / len(inside) if inside else None,
                    sum(r.accepted for r in inside) / proposed if proposed else None))
    return out


def _by_start(prompts, wants):
    """A proposer that knows every prompt's greedy continuation and gets the first
    ``position % (k + 1)`` of its ``k`` proposals right: acceptance that varies with the
    position, so that the buckets differ."""
    def propose(draft, ids, aux, k):
        s = ids.shape[1]
        for prompt, want in zip(prompts, wants):
            n = prompt.numel()
            if ids[0, :n].tolist() == prompt.tolist() and ids[0, n:].tolist() == want[:s - n]:
                truth, right = want[s - n:s - n + k], s % (k + 1)
                return truth[:right] + [(t + 1) % TARGET.vocab for t in truth[right:]]
        raise AssertionError("verified tokens of no prompt")
    return propose


@pytest.mark.parametrize("proposer", ["trained", "by_start"])
def test_acceptance_by_position_is_the_rounds_bucketed(models, monkeypatch, proposer):
    """``acceptance``'s buckets against a recomputation from ``speculation_rounds``'
    records: the records are the rounds ``speculative_generate`` runs (positions: prompt +
    1 + the tokens of the rounds before), every bucket's count, mean and rate are the
    reference's exactly (the same integer sums divided once), a round starting exactly on
    an edge is counted in the bucket that edge opens, a bucket without rounds reports None
    (JSON null, not NaN), and the overall numbers are the buckets' weighted means. The
    trained draft is accepted in full; the second proposer's acceptance varies with the
    position."""
    target, drafts, prompts, wants = models
    draft = drafts["trained"]
    if proposer == "by_start":
        monkeypatch.setattr(evaluate, "_propose", _by_start(prompts, wants))
    rounds = speculation_rounds(target, draft, prompts, max_new_tokens=NEW, draft_len=3)
    for i, prompt in enumerate(prompts):
        _, per_round = speculative_generate(target, draft, prompt, max_new_tokens=NEW,
                                            draft_len=3)
        mine = [r for r in rounds if r.prompt == i]
        assert [r.accepted + 1 for r in mine] == per_round
        starts = [prompt.numel() + 1 + sum(per_round[:k]) for k in range(len(per_round))]
        assert [r.position for r in mine] == starts
    if proposer == "by_start":
        assert [r.accepted for r in rounds] == [r.position % (r.proposed + 1) for r in rounds]
    on_edge = rounds[1].position  # a position some round starts at, made an edge
    assert on_edge < max(r.position for r in rounds)
    edges = (0, on_edge, on_edge + 1, 10_000)  # [10k, inf) holds no round
    res = acceptance(target, draft, prompts, max_new_tokens=NEW, draft_len=3, buckets=edges)
    got = res["by_position"]
    assert [(b["start"], b["end"]) for b in got] == list(zip(edges, [*edges[1:], None]))
    assert [(b["rounds"], b["mean_accepted_per_round"], b["acceptance_rate"])
            for b in got] == _bucketed(rounds, edges)
    assert got[1]["rounds"] == sum(r.position == on_edge for r in rounds) >= 1
    assert got[-1] == {"start": 10_000, "end": None, "label": "[10000, inf)", "rounds": 0,
                       "mean_accepted_per_round": None, "acceptance_rate": None}
    assert "NaN" not in json.dumps(got)
    full = [b for b in got if b["rounds"]]
    assert res["rounds"] == len(rounds) == sum(b["rounds"] for b in got)
    # weighted means of per-bucket quotients: equal up to float rounding of the quotients
    mean = sum(b["rounds"] * b["mean_accepted_per_round"] for b in full) / res["rounds"]
    assert abs(mean - res["mean_accepted_per_round"]) <= 1e-12
    proposed = [sum(r.proposed for r in rounds if b["start"] <= r.position
                    < (b["end"] or float("inf"))) for b in full]
    rate = sum(p * b["acceptance_rate"] for p, b in zip(proposed, full)) / sum(proposed)
    assert abs(rate - res["acceptance_rate"]) <= 1e-12
    one = acceptance(target, draft, prompts, max_new_tokens=NEW, draft_len=3, buckets=(0,))
    assert one["by_position"] == [{
        "start": 0, "end": None, "label": "[0, inf)", "rounds": len(rounds),
        "mean_accepted_per_round": one["mean_accepted_per_round"],
        "acceptance_rate": one["acceptance_rate"]}]
    default = acceptance(target, draft, prompts, max_new_tokens=NEW, draft_len=3)
    assert [b["rounds"] for b in default["by_position"]] == [len(rounds), 0, 0, 0, 0]


def test_by_position_edges():
    """Hand-made records: positions on edges open their bucket, empty buckets are None, one
    bucket is everything; bad edges are named."""
    rounds = [Round(prompt=0, position=p, proposed=k, accepted=a)
              for p, k, a in ((0, 4, 4), (3, 4, 0), (4, 4, 2), (7, 2, 1), (100, 4, 3))]
    got = by_position(rounds, [0, 4, 8, 100, 200])
    assert [b["rounds"] for b in got] == [2, 2, 0, 1, 0]
    assert got[0]["mean_accepted_per_round"] == (5 + 1) / 2
    assert got[0]["acceptance_rate"] == 4 / 8
    assert got[1]["mean_accepted_per_round"] == (3 + 2) / 2
    assert got[1]["acceptance_rate"] == 3 / 6
    assert got[2]["mean_accepted_per_round"] is None and got[2]["acceptance_rate"] is None
    assert got[3]["mean_accepted_per_round"] == 4.0 and got[3]["acceptance_rate"] == 3 / 4
    assert [b["label"] for b in got] == ["[0, 4)", "[4, 8)", "[8, 100)", "[100, 200)",
                                         "[200, inf)"]
    assert by_position(rounds, (0,))[0]["rounds"] == 5
    assert [b["rounds"] for b in by_position([], (0, 10))] == [0, 0]
    for bad in ((), (1, 2), (0, 5, 5), (0, 8, 4), (0, 2.5), (0, True), None, 7):
        with pytest.raises(ValueError, match="buckets must be"):
            by_position(rounds, bad)


def test_acceptance_checks_buckets_before_decoding(models, monkeypatch):
    target, drafts, prompts, _ = models

    def fail(*args):
        raise AssertionError("decoded before checking the buckets")
    monkeypatch.setattr(evaluate, "_generate", fail)
    with pytest.raises(ValueError, match=r"buckets must be .* got \(0, 0\)"):
        acceptance(target, drafts["trained"], prompts, max_new_tokens=NEW, buckets=(0, 0))
