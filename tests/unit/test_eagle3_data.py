"""Eagle3 chat data: conversations from both JSON-lines styles, assistant-only loss masks
(templates with generation blocks and without, which must agree, against a token-by-token
reading of the render), packing and its cu_seqlens, and the frequency vocabulary against a
direct count."""

import json
from collections import Counter

import pytest
import torch

from chat import PLAIN, WITH_BLOCKS, chat_tokenizer
from ringattn.eagle3.data import (frequency_vocabulary, has_generation_blocks,
                                  load_conversations, make_rows, pack, render, vocabulary_maps)
from ringattn.eagle3.draft import draft_vocabulary
from ringattn.masks import check_cu_seqlens

CONVERSATION = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "hello there how are you"},
                {"role": "assistant", "content": "fine thanks and you"},
                {"role": "user", "content": "what is two plus two"},
                {"role": "assistant", "content": "four"}]
ASSISTANT_TOKENS = ["fine", "thanks", "and", "you", "<|end|>", "four", "<|end|>"]

# A Llama-3-like pair: a BOS, a three-token header "<|start|> role <|sep|>", and a generation
# prompt that opens a reasoning block the stored turns do not have (as DeepSeek-R1's does).
_HEADER = "<|start|> {{ m['role'] }} <|sep|> "
_PROMPT = "{% if add_generation_prompt %}<|start|> assistant <|sep|> <think> {% endif %}"
HEADED_BLOCKS = ("<s> {% for m in messages %}" + _HEADER + "{% if m['role'] == 'assistant' %}"
                 "{% generation %}{{ m['content'] }} <|end|>{% endgeneration %}"
                 "{% else %}{{ m['content'] }} <|end|>{% endif %} {% endfor %}" + _PROMPT)
HEADED_PLAIN = ("<s> {% for m in messages %}" + _HEADER + "{{ m['content'] }} <|end|> {% endfor %}"
                + _PROMPT)


def _tokenizer(template):
    """chat.py's word-level tokenizer plus the headed templates' tokens."""
    tok = chat_tokenizer(template)
    tok.add_special_tokens({"additional_special_tokens":
                            ["<s>", "<|start|>", "<|sep|>", "<think>"]})
    tok.add_tokens(["system", "user", "assistant"])
    return tok


def _expected_mask(tokens):
    """The loss mask read off the rendered tokens: 1 on an assistant message's text and its
    closing <|end|>, 0 on headers (<|role|>, or <|start|> role <|sep|>) and everything else."""
    mask, role, body = [], None, False
    for k, t in enumerate(tokens):
        if t in ("<|system|>", "<|user|>", "<|assistant|>"):
            role, body = t[2:-2], True
        elif t == "<|start|>":
            role, body = tokens[k + 1], False
        elif t == "<|sep|>":
            body = True
        mask.append(int(body and role == "assistant" and t not in ("<|assistant|>", "<|sep|>")))
        if t == "<|end|>":
            body = False
    return mask


@pytest.mark.parametrize("pair", [(WITH_BLOCKS, PLAIN), (HEADED_BLOCKS, HEADED_PLAIN)],
                         ids=["role-token", "headed"])
def test_assistant_tokens_only_with_either_template(pair):
    rendered = []
    for template, blocks in zip(pair, (True, False)):
        tok = _tokenizer(template)
        assert has_generation_blocks(tok) == blocks
        ids, mask = render(tok, CONVERSATION)
        assert ids.dtype == torch.long and mask.dtype == torch.bool and ids.shape == mask.shape
        words = tok.convert_ids_to_tokens(ids.tolist())
        assert "<unk>" not in words
        assert mask.long().tolist() == _expected_mask(words), (template, words, mask)
        assert [w for w, m in zip(words, mask.tolist()) if m] == ASSISTANT_TOKENS
        rendered.append((ids, mask))
        cut_ids, cut_mask = render(tok, CONVERSATION, max_len=9)
        assert torch.equal(cut_ids, ids[:9]) and torch.equal(cut_mask, mask[:9])
    (ids_a, mask_a), (ids_b, mask_b) = rendered
    assert torch.equal(ids_a, ids_b) and torch.equal(mask_a, mask_b)  # the two paths agree


def test_a_conversation_without_assistant_has_no_loss():
    for template in (WITH_BLOCKS, PLAIN):
        ids, mask = render(_tokenizer(template), CONVERSATION[:2])
        assert len(ids) > 0 and not mask.any()


def test_the_prefix_rule_refuses_what_it_cannot_read():
    # like Qwen3's template: earlier assistant turns render differently from the last one
    rewrites = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' }} {% if m['role'] == "
                "'assistant' and not loop.last %}brief{% else %}{{ m['content'] }}{% endif %} "
                "<|end|> {% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")
    with pytest.raises(ValueError, match=r"not prefix-stable.*\{% generation %\}"):
        render(_tokenizer(rewrites), CONVERSATION)
    with pytest.raises(ValueError, match="opens with an assistant message"):
        render(_tokenizer(PLAIN), CONVERSATION[2:])
    with pytest.raises(ValueError, match="max_len"):
        render(_tokenizer(PLAIN), CONVERSATION, max_len=0)


def test_sharegpt_and_messages_files_give_the_same_samples(tmp_path):
    names = {"system": "system", "user": "human", "assistant": "gpt"}
    sharegpt = {"id": "x", "conversations": [{"from": names[m["role"]], "value": m["content"]}
                                             for m in CONVERSATION]}
    (tmp_path / "messages.jsonl").write_text(json.dumps({"messages": CONVERSATION}) + "\n\n"
                                             + json.dumps({"messages": CONVERSATION[:2]}) + "\n")
    (tmp_path / "sharegpt.jsonl").write_text(json.dumps(sharegpt) + "\n" + json.dumps(
        {"conversations": sharegpt["conversations"][:2]}) + "\n")
    a = load_conversations(str(tmp_path / "messages.jsonl"))
    b = load_conversations(str(tmp_path / "sharegpt.jsonl"))
    assert a == b == [CONVERSATION, CONVERSATION[:2]]
    tok = _tokenizer(PLAIN)
    for x, y in zip(a, b):
        for got, want in zip(render(tok, x), render(tok, y)):
            assert torch.equal(got, want)


@pytest.mark.parametrize("bad, words", [
    ("{not json", "not JSON"),
    ('{"text": "x"}', "expected an object with a 'messages' or a 'conversations'"),
    ('[{"role": "user", "content": "x"}]', "expected an object"),
    ('{"messages": []}', "an empty conversation"),
    ('{"conversations": []}', "an empty conversation"),
    ('{"messages": [{"role": "robot", "content": "x"}]}', "message 0 has role='robot'"),
    ('{"conversations": [{"from": "human", "value": "x"}, {"from": "alien", "value": "y"}]}',
     "message 1 has from='alien'"),
    ('{"messages": [{"role": "user", "content": 3}]}', "message 0 has no string 'content'"),
    ('{"conversations": [{"from": "gpt"}]}', "message 0 has no string 'value'"),
])
def test_malformed_lines_are_named_with_their_number(tmp_path, bad, words):
    path = tmp_path / "chats.jsonl"
    good = json.dumps({"messages": CONVERSATION})
    path.write_text(f"{good}\n\n{bad}\n{good}\n")  # the blank line counts: the bad one is line 3
    with pytest.raises(ValueError, match=f"chats.jsonl, line 3: {words}"):
        load_conversations(str(path))


def _samples(lengths, seed=0):
    gen = torch.Generator().manual_seed(seed)
    return [(torch.randint(5, 20, (n,), generator=gen), torch.rand(n, generator=gen) > 0.5)
            for n in lengths]


def test_packing_keeps_every_conversation_and_its_mask():
    seqlen, pad = 16, 3
    samples = _samples((7, 5, 9, 3, 12, 16, 20, 1))
    rows = pack(samples, seqlen, pad)
    cut = [(x[:seqlen], m[:seqlen]) for x, m in samples]  # 20 tokens: its first 16 are kept
    got = []
    for row in rows:
        ids, loss, keep, cu = (row["input_ids"], row["loss_mask"], row["attention_mask"],
                               row["cu_seqlens"])
        assert ids.shape == loss.shape == keep.shape == (1, seqlen)
        assert check_cu_seqlens(cu, seqlen) == tuple(cu)  # starts at 0, increases, ends at S
        real = int(keep.sum())
        assert keep[0].tolist() == [1] * real + [0] * (seqlen - real)  # right padding only
        assert real in cu and cu[-2:] == ([real, seqlen] if real < seqlen else cu[-2:])
        assert (ids[0, real:] == pad).all() and not loss[0, real:].any()
        docs = [(ids[0, a:b], loss[0, a:b].bool()) for a, b in zip(cu, cu[1:]) if a < real]
        got += docs
    assert len(got) == len(samples)
    for (x, m), (y, n) in zip(got, cut):
        assert torch.equal(x, y) and torch.equal(m, n)
    # greedy next fit: each row's first conversation did not fit in the row before it
    for before, row in zip(rows, rows[1:]):
        first = row["cu_seqlens"][1]
        assert int(before["attention_mask"].sum()) + first > seqlen
    same = make_rows(samples, seqlen, pad_id=pad, pack=True)  # the training loop's spelling
    assert len(same) == len(rows) and all(
        a["cu_seqlens"] == b["cu_seqlens"] and torch.equal(a["input_ids"], b["input_ids"])
        for a, b in zip(same, rows))


def test_one_conversation_per_row_right_padded_and_batched():
    samples = _samples((7, 5, 9, 3, 12))
    batches = pack(samples, 8, 0, packing=False, batch_size=2)
    assert [b["input_ids"].shape for b in batches] == [(2, 8), (2, 8), (1, 8)]
    rows = [(b["input_ids"][r], b["loss_mask"][r], b["attention_mask"][r])
            for b in batches for r in range(len(b["input_ids"]))]
    for (ids, loss, keep), (x, m) in zip(rows, samples):
        n = min(len(x), 8)
        assert torch.equal(ids[:n], x[:n]) and torch.equal(loss[:n].bool(), m[:n])
        assert keep.tolist() == [1] * n + [0] * (8 - n) and not ids[n:].any() and not loss[n:].any()
    assert all("cu_seqlens" not in b for b in batches)
    single = make_rows(samples, 8)
    assert len(single) == 5 and all(torch.equal(s["input_ids"][0], r[0])
                                    for s, r in zip(single, rows))


def test_packing_rejects_bad_arguments():
    with pytest.raises(ValueError, match="batch_size=2"):
        pack(_samples((3,)), 8, packing=True, batch_size=2)
    with pytest.raises(ValueError, match="sample 1"):
        empty = (torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.bool))
        pack([*_samples((3,)), empty], 8)
    with pytest.raises(ValueError, match="sample 0"):
        pack([(torch.ones(4, dtype=torch.long), torch.ones(3, dtype=torch.bool))], 8)
    with pytest.raises(ValueError, match="seqlen"):
        pack(_samples((3,)), 0)


def _ranked_by_hand(samples, vocab):
    """Loss counts first (ties: lower id), then ids without loss by overall count, then id."""
    loss, every = Counter(), Counter()
    for ids, mask in samples:
        for t, m in zip(ids.tolist(), mask.tolist()):
            every[t] += 1
            loss[t] += int(m)
    return sorted(range(vocab), key=lambda t: (-loss[t], -every[t] if loss[t] == 0 else 0, t))


def test_frequency_vocabulary_is_a_count_over_loss_tokens():
    gen = torch.Generator().manual_seed(1)
    vocab = 50
    # ids 0..29, loss on a third of them: many equal counts, and fewer than 50 distinct
    samples = [(torch.randint(0, 30, (40,), generator=gen), torch.rand(40, generator=gen) > 0.7)
               for _ in range(6)]
    ranked = _ranked_by_hand(samples, vocab)
    distinct = len({t for x, m in samples for t in x[m].tolist()})
    assert 5 < distinct < 30
    for size in (1, 5, distinct, distinct + 3, 40, vocab):
        got = frequency_vocabulary(samples, vocab, size)
        assert got.dtype == torch.long and got.tolist() == sorted(ranked[:size]), size
    loss_tokens = torch.cat([x[m] for x, m in samples])
    assert torch.equal(frequency_vocabulary(samples, vocab, 5),
                       draft_vocabulary(loss_tokens, vocab, 5))  # the same rule as draft.py's
    with pytest.raises(ValueError, match="token id 60"):
        frequency_vocabulary([(torch.tensor([1, 60]), torch.tensor([True, True]))], vocab, 5)
    with pytest.raises(ValueError, match="draft_vocab_size"):
        frequency_vocabulary(samples, vocab, vocab + 1)


def test_vocabulary_maps_are_the_drafts_buffers():
    from transformers import LlamaConfig

    from ringattn.eagle3.draft import Eagle3Draft

    vocab = 50
    draft_ids = frequency_vocabulary(_samples((30, 20)), vocab, 12)
    d2t, t2d = vocabulary_maps(draft_ids, vocab)
    assert d2t.dtype == torch.long and d2t.shape == (12,) and t2d.dtype == torch.bool
    assert torch.equal(d2t + torch.arange(12), draft_ids)  # target id of draft id i: i + d2t[i]
    assert t2d.nonzero().flatten().tolist() == draft_ids.tolist()
    config = LlamaConfig(hidden_size=8, intermediate_size=16, num_attention_heads=2,
                         num_key_value_heads=1, head_dim=4, vocab_size=vocab, num_hidden_layers=1)
    draft = Eagle3Draft(config, 8, draft_ids)
    assert torch.equal(draft.d2t, d2t) and torch.equal(draft.t2d, t2d)
    with pytest.raises(ValueError, match="strictly increasing"):
        vocabulary_maps(torch.tensor([3, 3, 4]), vocab)
