"""Chat data for Eagle3 draft training: conversations, loss masks, packing, the draft vocabulary.

Legend: S sequence length, V target vocabulary, Vd draft vocabulary.

* ``load_conversations``: JSON lines, each ``{"messages": [{"role", "content"}, ...]}`` or
  ShareGPT's ``{"conversations": [{"from", "value"}, ...]}`` (human -> user, gpt ->
  assistant, system -> system).
* ``render``: the tokenizer's chat template; loss only on the assistant's tokens. Templates
  with ``{% generation %}`` blocks give the mask themselves
  (``return_assistant_tokens_mask``). Otherwise the rule is: render the conversation up to
  each message; the tokens an assistant message adds after its header (what the template
  renders for ``add_generation_prompt=True``) are its loss tokens: its text and whatever
  the template closes it with (e.g. an end-of-turn token), not the role header. A template
  whose renders of shorter conversations are not token prefixes of the longer ones is
  refused.
* ``make_rows``: one conversation per row (right padded) or several packed per row with
  ``cu_seqlens`` (the padding of a packed row is a last document of its own, so offsets end
  at S; it has no loss and no attention mask).
* ``frequency_vocabulary``: the Vd most frequent target tokens among the loss tokens (as
  SpecForge and ModelOpt build ``d2t``/``t2d``).
"""

from __future__ import annotations

import json

import torch

from .draft import top_ids

__all__ = ["load_conversations", "render", "make_rows", "frequency_vocabulary"]

_SHAREGPT_ROLES = {"human": "user", "user": "user", "gpt": "assistant",
                   "assistant": "assistant", "system": "system"}
_ROLES = ("system", "user", "assistant", "tool")


def load_conversations(path: str) -> list[list[dict]]:
    """Every conversation of a JSON-lines file, as lists of ``{"role", "content"}``.

    Raises:
        ValueError: a malformed line, an unknown role or an empty conversation, naming the
            file and line.
    """
    out = []
    with open(path) as f:
        for number, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}, line {number}"
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                raise ValueError(f"{where}: not JSON ({exc})") from exc
            if isinstance(row, dict) and isinstance(row.get("messages"), list):
                msgs = [(m.get("role"), m.get("content")) for m in row["messages"]
                        if isinstance(m, dict)]
                if len(msgs) != len(row["messages"]) or any(r not in _ROLES for r, _ in msgs):
                    raise ValueError(f"{where}: every message needs a role in {_ROLES}")
            elif isinstance(row, dict) and isinstance(row.get("conversations"), list):
                turns = row["conversations"]
                if not all(isinstance(t, dict) and t.get("from") in _SHAREGPT_ROLES for t in turns):
                    raise ValueError(f"{where}: every turn needs 'from' in {sorted(_SHAREGPT_ROLES)}")
                msgs = [(_SHAREGPT_ROLES[t["from"]], t.get("value")) for t in turns]
            else:
                raise ValueError(f"{where}: expected {{'messages': [...]}} or "
                                 f"{{'conversations': [...]}}")
            if not msgs or any(not isinstance(c, str) for _, c in msgs):
                raise ValueError(f"{where}: an empty conversation or a message without text")
            out.append([{"role": r, "content": c} for r, c in msgs])
    return out


def _ids(tokenizer, messages, header: bool = False) -> list[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                        add_generation_prompt=header)
    return list(out["input_ids"])


def render(tokenizer, messages: list[dict], max_len: int | None = None):
    """(input_ids [S] int64, loss_mask [S] bool) of a conversation; loss on the assistant's
    tokens only (see the module doc); cut to ``max_len``.

    Raises:
        ValueError: a template without generation blocks whose renders are not prefixes
            of each other.
    """
    blocks = "generation" in (getattr(tokenizer, "chat_template", None) or "")
    full = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                         return_assistant_tokens_mask=blocks)
    ids = list(full["input_ids"])
    mask = list(full.get("assistant_masks") or [])
    has_assistant = any(m["role"] == "assistant" for m in messages)
    if not (mask and any(mask)) and has_assistant:  # no generation blocks: the prefix rule
        mask = [0] * len(ids)
        start = 0
        for i, m in enumerate(messages):
            upto = _ids(tokenizer, messages[:i + 1])
            if upto != ids[:len(upto)]:
                raise ValueError(
                    "the chat template is not prefix-stable (a shorter conversation does not "
                    "render as a prefix of the longer one): give it {% generation %} blocks "
                    "so that assistant tokens can be marked")
            if m["role"] == "assistant":  # after its header (the generation prompt)
                header = _ids(tokenizer, messages[:i], header=True)
                if header == ids[:len(header)] and start <= len(header) <= len(upto):
                    start = len(header)
                mask[start:len(upto)] = [1] * (len(upto) - start)
            start = len(upto)
    ids_t = torch.tensor(ids[:max_len], dtype=torch.long)
    mask_t = torch.tensor((mask or [0] * len(ids))[:max_len], dtype=torch.bool)
    return ids_t, mask_t


def make_rows(samples, seqlen: int, *, pad_id: int = 0, pack: bool = False) -> list[dict]:
    """Training rows from rendered ``(input_ids, loss_mask)`` samples, in order.

    Without ``pack`` each sample is one row [1, S] (cut to S, right padded); with ``pack``
    consecutive samples fill rows greedily (a sample that does not fit starts the next
    row), each row with ``cu_seqlens`` (its documents, then its padding as a last one).

    Returns:
        dicts with ``input_ids``, ``loss_mask``, ``attention_mask`` [1, S] and, packed,
        ``cu_seqlens``.
    """
    rows, current = [], []

    def flush():
        if not current:
            return
        ids = torch.full((1, seqlen), pad_id, dtype=torch.long)
        loss = torch.zeros(1, seqlen, dtype=torch.long)
        keep = torch.zeros(1, seqlen, dtype=torch.long)
        cu, at = [0], 0
        for x, m in current:
            ids[0, at:at + len(x)], loss[0, at:at + len(x)], keep[0, at:at + len(x)] = x, m.long(), 1
            at += len(x)
            cu.append(at)
        row = {"input_ids": ids, "loss_mask": loss, "attention_mask": keep}
        if pack:
            row["cu_seqlens"] = cu if at == seqlen else [*cu, seqlen]
        rows.append(row)
        current.clear()

    for x, m in samples:
        x, m = x[:seqlen], m[:seqlen]
        if not pack or sum(len(c[0]) for c in current) + len(x) > seqlen:
            flush()
        current.append((x, m))
        if not pack:
            flush()
    flush()
    return rows


def frequency_vocabulary(samples, vocab_size: int, draft_vocab_size: int) -> torch.Tensor:
    """The draft vocabulary: the ``draft_vocab_size`` most frequent target ids among the
    samples' loss tokens (ties, and ids that are no loss token: by their count among all
    tokens, then lower id first), sorted ([Vd] int64, the ``draft_ids`` of
    ``Eagle3Draft``: d2t = draft_ids - arange, t2d = membership)."""
    empty = torch.zeros(0, dtype=torch.long)
    loss = torch.cat([x[m] for x, m in samples]) if samples else empty
    every = torch.cat([x for x, _ in samples]) if samples else empty
    counts = torch.bincount(loss, minlength=vocab_size).double() * (every.numel() + 1)
    counts += torch.bincount(every, minlength=vocab_size).double()  # exact in float64
    return top_ids(counts, draft_vocab_size)
