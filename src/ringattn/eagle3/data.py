"""Chat data for Eagle3 draft training: conversations, loss masks, packing, the draft vocabulary.

Legend: S sequence length (of a row), N tokens of one rendered conversation, B rows of a
batch, V target vocabulary, Vd draft vocabulary.

* ``load_conversations``: JSON lines, each ``{"messages": [{"role", "content"}, ...]}`` or
  ShareGPT's ``{"conversations": [{"from", "value"}, ...]}`` (human -> user, gpt ->
  assistant, system -> system).
* ``render``: the tokenizer's chat template; loss only on the assistant's tokens. A template
  with ``{% generation %}`` blocks marks them itself (``return_assistant_tokens_mask``).
  Otherwise the prefix rule: an assistant message's loss tokens are those its render adds
  after its header (the header being what ``add_generation_prompt=True`` renders): its text
  and whatever the template closes the turn with (its end-of-turn token), never the role
  header. A template whose render of a conversation's prefix is not a token prefix of the
  whole render is refused.
* ``pack``: rows of length S, several conversations per row (greedy, in order) with
  flash-attn's ``cu_seqlens``, the row's padding a last document of its own; or one
  conversation per row, right padded, B rows per batch.
* ``frequency_vocabulary`` and ``vocabulary_maps``: the Vd most frequent target ids among
  the loss tokens, and the ``d2t``/``t2d`` maps of ``Eagle3Draft`` built from them.

docs/eagle3_data.md has the rules and what SpecForge and ModelOpt do differently.
"""

from __future__ import annotations

import json
import re

import torch

from .draft import top_ids

__all__ = ["load_conversations", "render", "has_generation_blocks", "prefix_rule_mask", "pack",
           "make_rows", "frequency_vocabulary", "vocabulary_maps"]

ROLES = ("system", "user", "assistant", "tool")
"""The roles a ``messages`` line may use."""
SHAREGPT_ROLES = {"human": "user", "gpt": "assistant", "system": "system"}
"""ShareGPT's ``from`` values and the roles they become."""
_GENERATION_BLOCK = re.compile(r"\{%-?\s*generation\s*-?%\}")


def load_conversations(path: str) -> list[list[dict]]:
    """Every conversation of a JSON-lines file, in file order; blank lines are skipped.

    Arguments:
        path: a file whose lines are ``{"messages": [{"role": r, "content": c}, ...]}``
            (r in ``ROLES``) or ShareGPT's ``{"conversations": [{"from": f, "value": c},
            ...]}`` (f in ``SHAREGPT_ROLES``); other keys of a line are ignored.

    Returns:
        list of conversations, each a list of ``{"role", "content"}`` dicts (the ShareGPT
        roles mapped), ready for ``render``.

    Raises:
        ValueError: a line that is not JSON, has neither key, has a message with an unknown
            role or without string content, or has no messages; the message names the file
            and the 1-based line number.
    """
    out = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, start=1):
            if line.strip():
                out.append(_parse_line(line, f"{path}, line {number}"))
    return out


def _parse_line(line: str, where: str) -> list[dict]:
    """One JSON line as a list of ``{"role", "content"}``; ``where`` prefixes every error."""
    try:
        row = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON ({exc})") from exc
    if isinstance(row, dict) and isinstance(row.get("messages"), list):
        turns, role_key, text_key, roles = row["messages"], "role", "content", {r: r for r in ROLES}
    elif isinstance(row, dict) and isinstance(row.get("conversations"), list):
        turns, role_key, text_key, roles = row["conversations"], "from", "value", SHAREGPT_ROLES
    else:
        raise ValueError(f"{where}: expected an object with a 'messages' or a 'conversations' "
                         f"list, got {line.strip()[:80]!r}")
    if not turns:
        raise ValueError(f"{where}: an empty conversation")
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or turn.get(role_key) not in roles:
            got = turn.get(role_key) if isinstance(turn, dict) else turn
            raise ValueError(f"{where}: message {i} has {role_key}={got!r}, not one of "
                             f"{sorted(roles)}")
        if not isinstance(turn.get(text_key), str):
            raise ValueError(f"{where}: message {i} has no string {text_key!r} "
                             f"(got {turn.get(text_key)!r})")
        messages.append({"role": roles[turn[role_key]], "content": turn[text_key]})
    return messages


def has_generation_blocks(tokenizer) -> bool:
    """Whether the tokenizer's chat template marks assistant text with ``{% generation %}``."""
    return bool(_GENERATION_BLOCK.search(tokenizer.get_chat_template()))


def render(tokenizer, messages: list[dict], max_len: int | None = None, *,
           template_kwargs: dict | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """A conversation rendered with the tokenizer's chat template, loss on assistant tokens.

    With ``{% generation %}`` blocks in the template the mask is the template's
    (``apply_chat_template(return_assistant_tokens_mask=True)``); else ``prefix_rule_mask``.

    Arguments:
        tokenizer: a transformers tokenizer with a chat template (fast, for generation
            blocks).
        messages: ``{"role", "content"}`` dicts (``load_conversations``' items).
        max_len: keep the first ``max_len`` tokens (None: all).
        template_kwargs: extra variables for the template (e.g. ``enable_thinking``),
            passed to every render.

    Returns:
        (input_ids [N] int64, loss_mask [N] bool), N <= ``max_len``.

    Raises:
        ValueError: ``max_len`` < 1; a template without generation blocks that the prefix
            rule cannot read (see ``prefix_rule_mask``).
    """
    if max_len is not None and (not isinstance(max_len, int) or max_len < 1):
        raise ValueError(f"max_len must be a positive int or None, got {max_len!r}")
    kwargs = template_kwargs or {}
    if has_generation_blocks(tokenizer):
        out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                            return_assistant_tokens_mask=True, **kwargs)
        ids, mask = list(out["input_ids"]), list(out["assistant_masks"])
    else:
        ids = _render_ids(tokenizer, messages, False, kwargs)
        mask = prefix_rule_mask(tokenizer, messages, ids, template_kwargs=kwargs)
    return (torch.tensor(ids[:max_len], dtype=torch.long),
            torch.tensor(mask[:max_len], dtype=torch.bool))


def prefix_rule_mask(tokenizer, messages: list[dict], ids: list[int], *,
                     template_kwargs: dict | None = None) -> list[int]:
    """The loss mask of a template without generation blocks, from renders of prefixes.

    For every assistant message i, with ``before`` = the render of ``messages[:i]``,
    ``header`` = that render with ``add_generation_prompt=True`` and ``through`` = the
    render of ``messages[:i + 1]``: the loss tokens are ``through``'s tokens past its common
    prefix with ``header`` (and past ``before``). So the role header is not trained, and
    the message's text and the tokens closing its turn (end-of-turn token, and any
    separator the template writes inside the message) are; where a generation prompt
    renders more than the stored turn does (a ``<think>`` opener, say), only the shared
    part counts as header. Only the prefixes ending at or just before an assistant message
    are rendered.

    Arguments:
        ids: the render of the whole conversation (token ids).

    Returns:
        list[int] of 0/1, one per token of ``ids``.

    Raises:
        ValueError: a prefix's render is not a token prefix of ``ids`` (the template is not
            prefix-stable: it rewrites earlier turns, e.g. drops old reasoning, or the
            tokenizer merges across the boundary), or the conversation opens with an
            assistant message (no earlier message to render its header from).
    """
    kwargs = template_kwargs or {}
    mask = [0] * len(ids)
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        if i == 0:
            raise ValueError("the conversation opens with an assistant message: the prefix rule "
                             "renders each assistant header from the messages before it; start "
                             "with a system or user message, or give the chat template "
                             "{% generation %} blocks")
        before = _render_ids(tokenizer, messages[:i], False, kwargs)
        header = _render_ids(tokenizer, messages[:i], True, kwargs)
        through = _render_ids(tokenizer, messages[:i + 1], False, kwargs)
        for part, n in ((before, i), (through, i + 1)):
            if part != ids[:len(part)]:
                raise ValueError(
                    f"the chat template is not prefix-stable: the render of the first {n} "
                    f"messages is not a token prefix of the whole conversation's, so the "
                    f"assistant tokens cannot be found from renders of prefixes; give the "
                    f"template {{% generation %}} blocks around assistant text instead")
        start = max(len(before), _common_prefix(header, through))
        mask[start:len(through)] = [1] * (len(through) - start)
    return mask


def _render_ids(tokenizer, messages: list[dict], header: bool, kwargs: dict) -> list[int]:
    """Token ids of ``messages`` rendered with the chat template (``header``: with the
    generation prompt)."""
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        add_generation_prompt=header, **kwargs)
    return list(out["input_ids"])


def _common_prefix(a: list[int], b: list[int]) -> int:
    """The length of the longest common prefix of ``a`` and ``b``."""
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def pack(samples, seqlen: int, pad_id: int = 0, *, packing: bool = True,
         batch_size: int = 1) -> list[dict]:
    """Training rows of length S from rendered ``(input_ids [N], loss_mask [N])`` samples.

    A sample longer than S is cut to its first S tokens. With ``packing``, samples fill
    rows greedily in order (next fit: a sample that does not fit in the current row starts
    the next one), and each row's ``cu_seqlens`` are flash-attn's offsets
    ``[0, end_0, ..., end_k]`` of its conversations followed by S when the row has padding:
    the padding is a last document of its own (no loss, attention mask 0), so offsets
    always end at S, as ``ringattn``'s packed masks require. Without ``packing``, each
    conversation is its own row and ``batch_size`` consecutive rows form one batch (the
    last batch may be smaller); there are no ``cu_seqlens``.

    Arguments:
        samples: ``render``'s outputs (any integer / bool-like 1-D tensors of equal length).
        seqlen: S, the row length.
        pad_id: the token id of padding.
        packing: several conversations per row (B = 1) or one per row.
        batch_size: rows per batch without packing (must be 1 with packing).

    Returns:
        list of dicts, in sample order: ``input_ids`` [B, S] int64 (``pad_id`` after the real
        tokens), ``loss_mask`` [B, S] int64 (0 on padding), ``attention_mask`` [B, S] int64
        (ones, then zeros: right padding only) and, with ``packing``, ``cu_seqlens``
        (list[int]; ``torch.tensor(cu, dtype=torch.int32)`` for flash-attn's varlen).

    Raises:
        ValueError: S < 1, ``batch_size`` < 1 or > 1 with packing, a sample that is empty,
            not 1-D, or whose mask length differs from its ids'.
    """
    if not isinstance(seqlen, int) or seqlen < 1:
        raise ValueError(f"seqlen must be a positive int, got {seqlen!r}")
    if not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be a positive int, got {batch_size!r}")
    if packing and batch_size != 1:
        raise ValueError(f"packed rows are batches of one row (cu_seqlens describe one row); "
                         f"got batch_size={batch_size}")
    cut = [_checked(i, x, m, seqlen) for i, (x, m) in enumerate(samples)]
    if packing:
        return [_packed_row(group, seqlen, pad_id) for group in _next_fit(cut, seqlen)]
    return [_padded_rows(cut[i:i + batch_size], seqlen, pad_id)
            for i in range(0, len(cut), batch_size)]


def make_rows(samples, seqlen: int, *, pad_id: int = 0, pack: bool = False) -> list[dict]:
    """``pack(samples, seqlen, pad_id, packing=pack)`` (one row per batch): the spelling the
    training loop (``train.chat_rows``) uses."""
    return _rows(samples, seqlen, pad_id, packing=pack)


_rows = pack  # make_rows' ``pack`` argument hides the function of that name


def _checked(index: int, ids, mask, seqlen: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Sample ``index`` as (ids int64, mask int64), cut to ``seqlen``."""
    ids, mask = torch.as_tensor(ids), torch.as_tensor(mask)
    if ids.dim() != 1 or ids.shape != mask.shape or ids.numel() == 0:
        raise ValueError(f"sample {index}: expected non-empty 1-D input_ids and loss_mask of "
                         f"one length, got shapes {tuple(ids.shape)} and {tuple(mask.shape)}")
    return ids[:seqlen].long(), mask[:seqlen].long()


def _next_fit(samples: list, seqlen: int) -> list[list]:
    """Consecutive runs of samples whose lengths sum to at most ``seqlen``, greedily."""
    groups, used = [], seqlen
    for sample in samples:
        if used + len(sample[0]) > seqlen:
            groups.append([])
            used = 0
        groups[-1].append(sample)
        used += len(sample[0])
    return groups


def _empty_rows(b: int, seqlen: int, pad_id: int) -> dict:
    return {"input_ids": torch.full((b, seqlen), pad_id, dtype=torch.long),
            "loss_mask": torch.zeros(b, seqlen, dtype=torch.long),
            "attention_mask": torch.zeros(b, seqlen, dtype=torch.long)}


def _packed_row(group: list, seqlen: int, pad_id: int) -> dict:
    """One [1, S] row of the samples in ``group``, with their ``cu_seqlens``."""
    row, cu = _empty_rows(1, seqlen, pad_id), [0]
    for ids, mask in group:
        a, b = cu[-1], cu[-1] + len(ids)
        row["input_ids"][0, a:b], row["loss_mask"][0, a:b] = ids, mask
        row["attention_mask"][0, a:b] = 1
        cu.append(b)
    row["cu_seqlens"] = cu if cu[-1] == seqlen else [*cu, seqlen]
    return row


def _padded_rows(group: list, seqlen: int, pad_id: int) -> dict:
    """[B, S] rows, one sample each, right padded."""
    rows = _empty_rows(len(group), seqlen, pad_id)
    for r, (ids, mask) in enumerate(group):
        n = len(ids)
        rows["input_ids"][r, :n], rows["loss_mask"][r, :n] = ids, mask
        rows["attention_mask"][r, :n] = 1
    return rows


def frequency_vocabulary(samples, target_vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """The draft vocabulary: the Vd most frequent target ids among the samples' LOSS tokens.

    Ranking: by count among loss tokens, equal counts lower id first (``draft.top_ids``'s
    rule). If fewer than Vd ids occur as loss tokens, the rest are the ids that do not,
    by their count among all tokens of the samples, then lower id first.

    Arguments:
        samples: ``(input_ids [N], loss_mask [N])`` pairs (``render``'s outputs).
        target_vocab_size: V.
        draft_vocab_size: Vd, in [1, V].

    Returns:
        [Vd] int64 target ids, sorted ascending: ``Eagle3Draft``'s ``draft_ids``
        (``vocabulary_maps`` turns them into its ``d2t`` and ``t2d``).

    Raises:
        ValueError: Vd outside [1, V], or a token id outside [0, V).
    """
    if not isinstance(draft_vocab_size, int) or not 1 <= draft_vocab_size <= target_vocab_size:
        raise ValueError(f"draft_vocab_size must lie in [1, {target_vocab_size}], got "
                         f"{draft_vocab_size!r}")
    loss = torch.zeros(target_vocab_size, dtype=torch.long)
    every = torch.zeros(target_vocab_size, dtype=torch.long)
    for i, (ids, mask) in enumerate(samples):
        ids = torch.as_tensor(ids).long().flatten()
        if ids.numel() and not (0 <= int(ids.min()) and int(ids.max()) < target_vocab_size):
            bad = ids[(ids < 0) | (ids >= target_vocab_size)][0]
            raise ValueError(f"sample {i} has token id {int(bad)}, outside "
                             f"[0, {target_vocab_size})")
        every += torch.bincount(ids, minlength=target_vocab_size)
        loss += torch.bincount(ids[torch.as_tensor(mask).flatten().bool()],
                               minlength=target_vocab_size)
    if int((loss > 0).sum()) >= draft_vocab_size:
        return top_ids(loss, draft_vocab_size)
    # fill: ids with no loss count rank after every loss token, by their count among all
    # tokens (stable sorts: the later key decides, ties keep the earlier order, lower id last)
    order = torch.argsort(-torch.where(loss > 0, 0, every), stable=True)
    order = order[torch.argsort(-loss[order], stable=True)]
    return torch.sort(order[:draft_vocab_size]).values


def vocabulary_maps(draft_ids: torch.Tensor,
                    target_vocab_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``Eagle3Draft``'s (and SpecForge's / EAGLE's checkpoints') maps of a draft vocabulary.

    Arguments:
        draft_ids: [Vd] target ids, strictly increasing (``frequency_vocabulary``).
        target_vocab_size: V.

    Returns:
        (d2t [Vd] int64, t2d [V] bool): the target id of draft id i is ``i + d2t[i]``;
        ``t2d[t]`` says whether target id t is in the draft vocabulary.

    Raises:
        ValueError: ids not strictly increasing or outside [0, V).
    """
    draft_ids = torch.as_tensor(draft_ids).long().flatten()
    if draft_ids.numel() == 0 or bool((draft_ids[1:] <= draft_ids[:-1]).any()) or \
            int(draft_ids[0]) < 0 or int(draft_ids[-1]) >= target_vocab_size:
        raise ValueError(f"draft_ids must be non-empty, strictly increasing and in "
                         f"[0, {target_vocab_size}), got {draft_ids.tolist()[:8]}...")
    t2d = torch.zeros(target_vocab_size, dtype=torch.bool)
    t2d[draft_ids] = True
    return draft_ids - torch.arange(draft_ids.numel()), t2d


if __name__ == "__main__":  # a library module: name the programs, do not exit 0
    from ringattn._program import not_a_program
    not_a_program(__spec__)
