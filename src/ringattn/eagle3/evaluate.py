"""Evaluate an Eagle3 draft: greedy chain speculative decoding with it over its target, and
held-out per-TTT-step accuracy.

Legend: S verified tokens (prompt + generated so far), K proposals per round, H draft hidden
size, Hkv draft kv heads, D head dim, X = 3 H_target (the auxiliary hidden states,
concatenated), Vd draft vocab.

The draft runs at inference exactly as ``eagle3_step`` trains it. Training: at TTT step j
the draft at index i reads token i + 1 + j, RoPE position i + j, and learns the target's
distribution at position i + 1 + j (the token after i + 1 + j). So with verified tokens
t_0 .. t_{S-1}, the chain runs at index S - 2::

    step 0:   token t_{S-1} (the newest verified), fc(aux hidden at S - 2),  position S - 2
              -> d_1, the draft's guess of t_S
    step j:   token d_j (its own guess, draft id -> target id through d2t),
              its own output hidden state of step j - 1,                  position S - 2 + j
              -> d_{j+1}

Attention as the TTT mask has it: step 0 is causal over the step-0 keys of indices
0 .. S - 2 (index i reading t_{i+1} and fc(aux at i)); step j's query sees those same keys
plus the chain's own keys of steps 1 .. j. This is SGLang's EAGLE worker with top-k 1: the
draft "extend" shifts the input ids left by one and appends the newest verified token, keeps
the target's positions, and each later draft step feeds the top token (mapped through
``hot_token_id``, our d2t) and the draft's own hidden state with positions + 1.

The target then verifies [t_0 .. t_{S-1}, d_1 .. d_K] in one forward: the longest prefix of
proposals equal to its greedy tokens is accepted and its own next token appended, so a round
adds accepted + 1 tokens, and every token is the target's greedy choice: the output equals
the target's greedy generation, token for token, whatever the draft.

Acceptance against context length: a round's ``position`` is where its speculation starts,
S (the verified tokens before it; d_1 sits at index S). ``acceptance`` reports, besides the
overall numbers, each bucket of positions ``[buckets[i], buckets[i + 1])`` (the last one
open ended): its rounds, mean tokens per round and acceptance rate (``by_position``, a pure
function of the per-round records ``speculation_rounds`` returns).

Correctness over speed: every round runs the target and the draft's step 0 over the whole
sequence again (no KV caches), O(S) work per round; fine for evaluation on CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .attention import dense_ttt_attention
from .draft import Eagle3Draft, aux_layer_ids, capture_aux_hidden, eagle3_step, run_target

__all__ = ["DEFAULT_BUCKETS", "Round", "speculative_generate", "speculation_rounds",
           "by_position", "mean_accepted_length", "acceptance", "draft_chain",
           "held_out_accuracy"]

DEFAULT_BUCKETS = (0, 1024, 4096, 16384, 65536)
"""Lower edges of the context-position buckets: [0, 1k), [1k, 4k), [4k, 16k), [16k, 64k),
[64k, inf) (k = 1024)."""


@dataclass(frozen=True)
class Round:
    """One verification round of speculative decoding."""

    prompt: int
    """Index of its prompt among those evaluated."""
    position: int
    """Where its speculation starts: S, the verified tokens (prompt + generated) before it,
    which is also the index of its first proposal."""
    proposed: int
    """Proposals it made (``draft_len``, fewer when fewer tokens remained)."""
    accepted: int
    """Proposals the target accepted; the round added ``accepted + 1`` tokens."""


def _aux_layers(target, draft: Eagle3Draft) -> tuple[int, ...]:
    """The target layers whose outputs feed the draft's ``fc``: the draft's own
    ``aux_layers`` (what it was trained on), else the target's ``eagle3_aux_layers``, else
    ``aux_layer_ids``."""
    return (draft.aux_layers or getattr(target, "eagle3_aux_layers", None)
            or aux_layer_ids(target.config.num_hidden_layers))


def _eos_ids(target) -> set[int]:
    """The target's end-of-sequence ids (its generation config's, else its config's); empty
    without one."""
    eos = getattr(getattr(target, "generation_config", None), "eos_token_id", None)
    if eos is None:
        eos = getattr(target.config, "eos_token_id", None)
    if eos is None:
        return set()
    return {int(e) for e in (eos if isinstance(eos, (list, tuple)) else [eos])}


def _target_forward(target, ids_1S: torch.Tensor, layers) -> tuple[torch.Tensor, torch.Tensor]:
    """One uncached target forward: (greedy next token after every position [S],
    auxiliary hidden states [1, S, X])."""
    out, aux = capture_aux_hidden(target, layers, input_ids=ids_1S, use_cache=False)
    return out.logits[0].argmax(-1), aux


def _chain_attention(q_11HD, keys, values):
    """The TTT mask's row for the chain's query at the last index, steps >= 1: every
    step-0 key (all of them precede or are the last index) and the chain's own keys, one
    softmax.

    Arguments:
        q_11HD: [1, 1, H, D] this step's query (rotated at its position).
        keys, values: [step-0 [1, S - 1, Hkv, D], then steps 1..j [1, 1, Hkv, D] each].

    Returns:
        [1, 1, H, D] in q's dtype.
    """
    h, d = q_11HD.shape[2:]
    hkv = keys[0].shape[2]
    k = torch.cat(list(keys), dim=1).transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    v = torch.cat(list(values), dim=1).transpose(1, 2).repeat_interleave(h // hkv, dim=1)
    scores = (q_11HD.transpose(1, 2) @ k.transpose(-1, -2)) / math.sqrt(d)
    return (torch.softmax(scores, dim=-1) @ v).transpose(1, 2)


@torch.no_grad()
def draft_chain(draft: Eagle3Draft, ids_1S: torch.Tensor, aux_1SX: torch.Tensor,
                k: int) -> tuple[list[int], torch.Tensor]:
    """Chain ``k`` greedy draft steps after the verified tokens ``ids_1S`` (see the module
    doc for the alignment).

    Arguments:
        ids_1S: [1, S] verified target token ids, S >= 2.
        aux_1SX: [1, >= S - 1, X] the target's auxiliary hidden states over those tokens
            (only positions 0 .. S - 2 are read).
        k: proposals to make, >= 1.

    Returns:
        (k proposed target token ids, the draft logits of each step [k, Vd]).
    """
    dt = draft.fc.weight.dtype
    s = ids_1S.shape[1]
    hidden = draft.fc(aux_1SX[:, :s - 1].to(dt))  # [1, S-1, H]: index i reads t_{i+1}
    embeds = draft.embed_tokens(ids_1S[:, 1:]).to(dt)
    pos = torch.arange(s - 1, device=ids_1S.device)[None]
    cache: tuple[list, list] = ([], [])
    hidden = draft.layer(embeds, hidden, pos, cache, dense_ttt_attention)[:, -1:]  # causal
    tokens, logits = [], []
    for j in range(k):
        if j:
            embeds = draft.embed_tokens(torch.tensor([[tokens[-1]]], device=ids_1S.device))
            hidden = draft.layer(embeds.to(dt), hidden, pos[:, -1:] + j, cache, _chain_attention)
        logits.append(draft.logits(hidden)[0, 0].float())
        tokens.append(int(draft.draft_ids[logits[-1].argmax()]))
    return tokens, torch.stack(logits)


def _propose(draft: Eagle3Draft, ids_1S: torch.Tensor, aux_1SX: torch.Tensor,
             k: int) -> list[int]:
    """The round's ``k`` proposals (target ids) after ``ids_1S`` (tests replace this)."""
    return draft_chain(draft, ids_1S, aux_1SX, k)[0]


def _check_prompt(input_ids, target) -> torch.Tensor:
    """``input_ids`` as a [1, S] long tensor on the target's device.

    Raises:
        ValueError: not [S] or [1, S], empty, or ids outside the target's vocabulary.
    """
    ids = torch.as_tensor(input_ids)
    if ids.dim() == 2 and ids.shape[0] == 1:
        ids = ids[0]
    if ids.dim() != 1 or ids.numel() == 0 or ids.dtype.is_floating_point:
        raise ValueError(f"input_ids must be a non-empty [S] or [1, S] integer prompt, got "
                         f"{ids.dtype} of shape {tuple(ids.shape)}")
    vocab = target.config.vocab_size
    if int(ids.min()) < 0 or int(ids.max()) >= vocab:
        raise ValueError(f"input_ids must lie in [0, {vocab}), got ids from {int(ids.min())} "
                         f"to {int(ids.max())}")
    device = next(target.parameters()).device
    return ids.to(device=device, dtype=torch.long)[None]


def _check_lengths(max_new_tokens, draft_len) -> None:
    """Raises ValueError unless both are ints >= 1."""
    for name, v in (("max_new_tokens", max_new_tokens), ("draft_len", draft_len)):
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise ValueError(f"{name} must be an int >= 1, got {v!r}")


@torch.no_grad()
def speculative_generate(target, draft: Eagle3Draft, input_ids, *, max_new_tokens: int,
                         draft_len: int = 4) -> tuple[list[int], list[int]]:
    """Greedy chain speculative decoding of ``target`` with ``draft`` (one sequence).

    The target's prefill gives the first new token; then every round the draft proposes
    ``draft_len`` tokens (fewer when fewer remain) chained from the last verified position
    as it was trained, the target verifies them in ONE forward, the longest prefix equal to
    its greedy tokens is accepted and the target's own next token appended (see the module
    doc). No KV caches: each round reruns the target and the draft's step 0 over the whole
    sequence, which is correct and fine on CPU, not fast.

    Arguments:
        target: a transformers causal LM (e.g. ``LlamaForCausalLM``), returning
            ``hidden_states`` and ``logits``.
        draft: the Eagle3 draft for that target (same vocabulary; its ``aux_layers``, else
            the target's ``eagle3_aux_layers``, else ``aux_layer_ids``, name the layers
            it reads).
        input_ids: [S] or [1, S] prompt token ids, S >= 1.
        max_new_tokens: tokens to generate, >= 1.
        draft_len: proposals per verification round, >= 1.

    Returns:
        (the new token ids: ``max_new_tokens`` of them, or fewer ending with the target's
        EOS when its config has one, as ``target.generate(do_sample=False)`` gives;
        tokens per verification round: accepted proposals + 1, as verified, including any
        past ``max_new_tokens`` or the EOS that the output leaves out).

    Raises:
        ValueError: a bad prompt, ``max_new_tokens`` or ``draft_len``, or a draft for another
            vocabulary.
    """
    new, rounds = _generate(target, draft, input_ids, max_new_tokens, draft_len)
    return new, [r.accepted + 1 for r in rounds]


@torch.no_grad()
def _generate(target, draft: Eagle3Draft, input_ids, max_new_tokens: int, draft_len: int,
              prompt: int = 0) -> tuple[list[int], list[Round]]:
    """``speculative_generate``, returning each round's record (with prompt index
    ``prompt``)."""
    _check_lengths(max_new_tokens, draft_len)
    ids = _check_prompt(input_ids, target)
    if draft.t2d.numel() != target.config.vocab_size:
        raise ValueError(f"the draft maps a vocabulary of {draft.t2d.numel()} tokens, the "
                         f"target has {target.config.vocab_size}")
    layers, eos = _aux_layers(target, draft), _eos_ids(target)
    greedy, aux = _target_forward(target, ids, layers)  # the prefill
    new, rounds = [int(greedy[-1])], []
    while len(new) < max_new_tokens and new[-1] not in eos:
        seq = torch.cat([ids, torch.tensor([new], device=ids.device)], dim=1)  # verified
        proposals = _propose(draft, seq, aux, min(draft_len, max_new_tokens - len(new)))
        verify = torch.cat([seq, torch.tensor([proposals], device=ids.device)], dim=1)
        greedy, aux = _target_forward(target, verify, layers)
        greedy = greedy[seq.shape[1] - 1:].tolist()  # after t_{S-1}, after each proposal
        accepted = 0
        while accepted < len(proposals) and proposals[accepted] == greedy[accepted]:
            accepted += 1
        rounds.append(Round(prompt=prompt, position=seq.shape[1], proposed=len(proposals),
                            accepted=accepted))
        for t in proposals[:accepted] + [greedy[accepted]]:
            if len(new) == max_new_tokens or new[-1] in eos:
                break
            new.append(t)
    return new, rounds


def speculation_rounds(target, draft: Eagle3Draft, prompts, *, max_new_tokens: int,
                       draft_len: int = 4) -> list[Round]:
    """Every verification round of ``speculative_generate`` over ``prompts``, in order.

    Arguments:
        prompts: an iterable of [S] or [1, S] prompts.
        max_new_tokens, draft_len: as for ``speculative_generate``.

    Returns:
        One ``Round`` per round (prompt index, position, proposed, accepted); empty when no
        round ran.

    Raises:
        ValueError: as ``speculative_generate``.
    """
    rounds: list[Round] = []
    for i, prompt in enumerate(prompts):
        rounds += _generate(target, draft, prompt, max_new_tokens, draft_len, prompt=i)[1]
    return rounds


def _check_buckets(buckets) -> tuple[int, ...]:
    """``buckets`` as a tuple of ints.

    Raises:
        ValueError: empty, not ints, not starting at 0, or not strictly increasing.
    """
    try:
        edges = tuple(buckets)
    except TypeError:
        edges = None
    if (not edges or any(not isinstance(e, int) or isinstance(e, bool) for e in edges)
            or edges[0] != 0 or any(a >= b for a, b in zip(edges, edges[1:]))):
        raise ValueError(f"buckets must be strictly increasing int lower edges starting at 0 "
                         f"(e.g. {DEFAULT_BUCKETS}), got {buckets!r}")
    return edges


def by_position(rounds, buckets=DEFAULT_BUCKETS) -> list[dict]:
    """Acceptance per bucket of speculation start positions (``Round.position``).

    Bucket i holds the rounds with ``buckets[i] <= position < buckets[i + 1]`` (the last:
    ``position >= buckets[-1]``); a position on an edge belongs to the bucket it opens.

    Arguments:
        rounds: ``Round`` records (``speculation_rounds``).
        buckets: strictly increasing lower edges, the first 0: ``(0,)`` is one bucket of
            every round. Default ``DEFAULT_BUCKETS``.

    Returns:
        One dict per bucket, in order: ``start``, ``end`` (None: open ended), ``label``
        (``"[start, end)"``), ``rounds`` (its count), ``mean_accepted_per_round`` (mean
        tokens per round, accepted + 1, as ``mean_accepted_length``) and
        ``acceptance_rate`` (accepted / proposed proposals); both None in a bucket without
        rounds.

    Raises:
        ValueError: bad ``buckets`` (naming them), or a negative position.
    """
    edges = _check_buckets(buckets)
    sums = [[0, 0, 0, 0] for _ in edges]  # rounds, tokens, accepted, proposed
    for r in rounds:
        if r.position < 0:
            raise ValueError(f"a round starts at position {r.position} < 0")
        i = next(i for i in range(len(edges) - 1, -1, -1) if r.position >= edges[i])
        for k, v in enumerate((1, r.accepted + 1, r.accepted, r.proposed)):
            sums[i][k] += v
    out = []
    for i, (n, tokens, accepted, proposed) in enumerate(sums):
        end = edges[i + 1] if i + 1 < len(edges) else None
        out.append({"start": edges[i], "end": end,
                    "label": f"[{edges[i]}, {'inf' if end is None else end})", "rounds": n,
                    "mean_accepted_per_round": tokens / n if n else None,
                    "acceptance_rate": accepted / proposed if proposed else None})
    return out


def acceptance(target, draft: Eagle3Draft, prompts, *, max_new_tokens: int,
               draft_len: int = 3, buckets=DEFAULT_BUCKETS) -> dict:
    """Speculative decoding's acceptance over ``prompts``: what a server reports, overall and
    per bucket of context positions.

    Arguments:
        prompts: an iterable of [S] or [1, S] prompts.
        max_new_tokens, draft_len: as for ``speculative_generate``.
        buckets: lower edges of the position buckets, as for ``by_position`` (checked
            before any round runs).

    Returns:
        ``{"mean_accepted_per_round": tokens per round (accepted + 1), "acceptance_rate":
        accepted / proposed proposals, "per_position": [draft_len] the share of rounds
        proposing draft position p whose position p was accepted, "rounds": rounds,
        "by_position": by_position(the rounds, buckets)}``. The overall numbers are the
        buckets' weighted by their rounds (mean) and their proposals (rate).

    Raises:
        ValueError: no round ran, bad ``buckets``, or as ``speculative_generate``.
    """
    _check_buckets(buckets)
    rounds = speculation_rounds(target, draft, prompts, max_new_tokens=max_new_tokens,
                                draft_len=draft_len)
    if not rounds:
        raise ValueError(f"no verification round ran (prompts empty, or max_new_tokens="
                         f"{max_new_tokens} ended generation at the prefill's token)")
    accepted = [0] * draft_len
    offered = [0] * draft_len
    for r in rounds:
        for p in range(r.proposed):
            offered[p] += 1
            accepted[p] += int(r.accepted > p)
    return {"mean_accepted_per_round": sum(r.accepted + 1 for r in rounds) / len(rounds),
            "acceptance_rate": sum(accepted) / sum(offered),
            "per_position": [a / o if o else float("nan") for a, o in zip(accepted, offered)],
            "rounds": len(rounds), "by_position": by_position(rounds, buckets)}


def mean_accepted_length(target, draft: Eagle3Draft, prompts, *, max_new_tokens: int,
                         draft_len: int = 4) -> float:
    """Mean tokens per verification round (accepted + 1) of ``speculative_generate``, over
    every round of every prompt.

    Arguments:
        prompts: an iterable of [S] or [1, S] prompts.
        max_new_tokens, draft_len: as for ``speculative_generate``.

    Returns:
        The mean: 1.0 when nothing is ever accepted, ``draft_len + 1`` when everything is.

    Raises:
        ValueError: no round ran (no prompts, or ``max_new_tokens`` 1), or as
            ``speculative_generate``.
    """
    rounds: list[int] = []
    for prompt in prompts:
        rounds += speculative_generate(target, draft, prompt, max_new_tokens=max_new_tokens,
                                       draft_len=draft_len)[1]
    if not rounds:
        raise ValueError(f"no verification round ran (prompts empty, or max_new_tokens="
                         f"{max_new_tokens} ended generation at the prefill's token)")
    return sum(rounds) / len(rounds)


@torch.no_grad()
def held_out_accuracy(target, draft: Eagle3Draft, batches, *, steps: int = 7) -> list[float]:
    """Per-TTT-step accuracy of ``draft`` on held-out batches (one process, the training
    alignment of ``eagle3_step``).

    Arguments:
        batches: an iterable of ``run_target`` batches (``input_ids`` [B, S], optional
            ``attention_mask`` and ``loss_mask``).
        steps: TTT steps.

    Returns:
        ``steps`` accuracies: correct / counted over all batches (nan where none counted).

    Raises:
        ValueError: no batch.
    """
    sums = None
    for batch in batches:
        res = eagle3_step(draft, run_target(target, batch), steps=steps)
        sums = res.sums if sums is None else sums + res.sums
    if sums is None:
        raise ValueError("held_out_accuracy needs at least one batch")
    return [float(c / n) if n > 0 else float("nan") for c, n in zip(sums[1], sums[2])]


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
