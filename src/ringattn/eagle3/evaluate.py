"""Evaluate an Eagle3 draft: speculative decoding with it over its target, and held-out
per-TTT-step accuracy.

Legend: n verified tokens, k draft tokens per round, h draft hidden size.

``speculative_generate`` is greedy chain speculative decoding in transformers, with the
draft fed exactly as it was trained (``eagle3_step``'s alignment): with verified tokens
t_0..t_{n-1} and the target's next token g, the draft at index n-1 reads g and fc of the
target's auxiliary hidden states at n-1 (RoPE position n-1) and proposes d_1; step j reads
its own d_j and its previous output at that index (position n-1+j) and proposes d_{j+1};
its attention sees the step-0 keys of every index (each index i reading token t_{i+1}) and
the chain's own keys, as the TTT mask has it. One target forward over the sequence plus
[g, d_1..d_k] verifies every proposal: the longest prefix equal to the target's greedy
tokens is accepted, g and it are appended, and the target's token after them becomes the
next g. Every appended token is the target's own greedy choice, so the output equals the
target's greedy generation token for token, whatever the draft.

Correctness over speed: every round runs the target and the draft's step 0 over the whole
sequence again (no KV caches), which is fine for evaluation on CPU.
"""

from __future__ import annotations

import torch

from .attention import dense_ttt_attention
from .draft import Eagle3Draft, aux_layer_ids, eagle3_step, run_target

__all__ = ["speculative_generate", "mean_accepted_length", "held_out_accuracy"]


def _aux(target, out) -> torch.Tensor:
    layers = getattr(target, "eagle3_aux_layers", None) or aux_layer_ids(
        target.config.num_hidden_layers)
    return torch.cat([out.hidden_states[i + 1] for i in layers], dim=-1)


@torch.no_grad()
def _propose(draft: Eagle3Draft, ids: torch.Tensor, g: int, aux: torch.Tensor, k: int) -> list[int]:
    """k draft tokens after ids + [g] (target ids), from the draft's TTT chain at the last index."""
    n = ids.shape[1]
    dt = draft.fc.weight.dtype
    hidden = draft.fc(aux[:, :n].to(dt))
    pos = torch.arange(n, device=ids.device)[None]
    tokens = torch.cat([ids[:, 1:], torch.tensor([[g]], device=ids.device)], dim=1)
    cache: tuple[list, list] = ([], [])
    proposals = []
    for j in range(k):
        embeds = draft.embed_tokens(tokens).to(dt)
        hidden = draft.layer(embeds, hidden, pos + j, cache, dense_ttt_attention)
        best = int(draft.logits(hidden[:, -1]).argmax(-1))
        proposals.append(int(draft.draft_ids[best]))
        tokens = torch.full_like(tokens, proposals[-1])  # only the last index is read
    return proposals


@torch.no_grad()
def speculative_generate(target, draft: Eagle3Draft, input_ids, *, max_new_tokens: int,
                         draft_len: int = 4) -> tuple[list[int], list[int]]:
    """Greedy chain speculative decoding of ``max_new_tokens`` after ``input_ids`` [S] or
    [1, S] (see the module doc).

    Returns:
        (the new tokens, the tokens added by each verification round: accepted + 1).

    Raises:
        ValueError: ``max_new_tokens`` or ``draft_len`` < 1.
    """
    if max_new_tokens < 1 or draft_len < 1:
        raise ValueError(f"max_new_tokens and draft_len must be >= 1, got {max_new_tokens}, "
                         f"{draft_len}")
    ids = torch.as_tensor(input_ids).reshape(1, -1)
    out = target(input_ids=ids, output_hidden_states=True, use_cache=False)
    g = int(out.logits[0, -1].argmax())  # the prefill's token
    aux = _aux(target, out)
    new, per_round = [], []
    while len(new) + 1 < max_new_tokens:
        proposals = _propose(draft, ids, g, aux, min(draft_len, max_new_tokens - len(new) - 1))
        seq = torch.cat([ids, torch.tensor([[g, *proposals]], device=ids.device)], dim=1)
        out = target(input_ids=seq, output_hidden_states=True, use_cache=False)
        greedy = out.logits[0, ids.shape[1]:].argmax(-1).tolist()  # after g, after each d
        m = 0
        while m < len(proposals) and proposals[m] == greedy[m]:
            m += 1
        added = [g, *proposals[:m]]
        new += added
        per_round.append(len(added))
        ids = torch.cat([ids, torch.tensor([added], device=ids.device)], dim=1)
        g = greedy[m]
        aux = _aux(target, out)
    new.append(g)
    return new[:max_new_tokens], per_round


def mean_accepted_length(target, draft: Eagle3Draft, prompts, *, max_new_tokens: int,
                         draft_len: int = 4) -> float:
    """Tokens added per verification round (accepted + 1), over all rounds of all prompts."""
    rounds = []
    for prompt in prompts:
        rounds += speculative_generate(target, draft, prompt, max_new_tokens=max_new_tokens,
                                       draft_len=draft_len)[1]
    return sum(rounds) / max(len(rounds), 1)


@torch.no_grad()
def held_out_accuracy(target, draft: Eagle3Draft, batches, *, steps: int = 7) -> list[float]:
    """Per-TTT-step accuracy of ``draft`` on held-out batches (one process, the training
    alignment of ``eagle3_step``): correct / counted over all batches."""
    sums = None
    for batch in batches:
        res = eagle3_step(draft, run_target(target, batch), steps=steps)
        sums = res.sums if sums is None else sums + res.sums
    return [float(c / n) if n > 0 else float("nan") for c, n in zip(sums[1], sums[2])]
