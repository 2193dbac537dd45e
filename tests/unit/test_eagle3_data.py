"""Eagle3 chat data: conversations from both JSON-lines styles, assistant-only loss masks
(a template with generation blocks and one without, which must agree), packing, and the
frequency vocabulary against a direct count."""

import json

import pytest
import torch

from chat import PLAIN, WITH_BLOCKS, chat_tokenizer as _tokenizer
from ringattn.eagle3.data import frequency_vocabulary, load_conversations, make_rows, render

CONVERSATION = [{"role": "system", "content": "be brief"},
                {"role": "user", "content": "hello there how are you"},
                {"role": "assistant", "content": "fine thanks and you"},
                {"role": "user", "content": "what is two plus two"},
                {"role": "assistant", "content": "four"}]


def test_assistant_tokens_only_with_either_template():
    masks = []
    for template in (WITH_BLOCKS, PLAIN):
        tok = _tokenizer(template)
        ids, mask = render(tok, CONVERSATION)
        words = tok.convert_ids_to_tokens(ids.tolist())
        trained = [w for w, m in zip(words, mask.tolist()) if m]
        # the assistant's words and the end of its turn; never the role markers or users
        assert trained == ["fine", "thanks", "and", "you", "<|end|>", "four", "<|end|>"], (
            template, trained)
        masks.append((ids, mask))
    assert torch.equal(masks[0][0], masks[1][0]) and torch.equal(masks[0][1], masks[1][1])
    ids, mask = render(_tokenizer(PLAIN), CONVERSATION, max_len=10)
    assert ids.shape == mask.shape == (10,)


def test_a_template_that_is_not_prefix_stable_is_refused():
    tok = _tokenizer("{% if messages | length > 4 %}brief {% endif %}" + PLAIN)  # long ones differ
    with pytest.raises(ValueError, match="not prefix-stable"):
        render(tok, CONVERSATION)


def test_both_file_styles_and_their_errors(tmp_path):
    sharegpt = {"conversations": [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]),
                                   "value": m["content"]} for m in CONVERSATION]}
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": CONVERSATION}) + "\n\n" + json.dumps(sharegpt) + "\n")
    a, b = load_conversations(str(path))
    assert a == b == CONVERSATION
    for bad, words in [("{not json", "line 1: not JSON"),
                       (json.dumps({"messages": [{"role": "robot", "content": "x"}]}), "line 1: every message"),
                       (json.dumps({"conversations": [{"from": "alien", "value": "x"}]}), "line 1: every turn"),
                       (json.dumps({"messages": []}), "line 1: an empty conversation"),
                       (json.dumps({"text": "x"}), "line 1: expected")]:
        path.write_text(bad + "\n")
        with pytest.raises(ValueError, match=words):
            load_conversations(str(path))


def test_packing_keeps_every_conversation_and_its_mask():
    gen = torch.Generator().manual_seed(0)
    samples = [(torch.randint(5, 20, (n,), generator=gen), torch.rand(n, generator=gen) > 0.5)
               for n in (7, 5, 9, 3, 12)]
    rows = make_rows(samples, 16, pack=True)
    got = []
    for row in rows:
        cu = row["cu_seqlens"]
        assert cu[0] == 0 and cu[-1] == 16 and row["input_ids"].shape == (1, 16)
        real = int(row["attention_mask"].sum())
        for a, b in zip(cu[:-1], cu[1:]):
            if a < real:
                got.append((row["input_ids"][0, a:b], row["loss_mask"][0, a:b].bool()))
        assert not row["loss_mask"][0, real:].any()
    assert len(got) == len(samples)
    for (x, m), (y, n) in zip(got, samples):
        assert torch.equal(x, y) and torch.equal(m, n)
    plain = make_rows(samples, 8)
    assert len(plain) == 5 and "cu_seqlens" not in plain[0]
    assert torch.equal(plain[4]["input_ids"][0], samples[4][0][:8])  # cut to S


def test_frequency_vocabulary_is_a_count_over_loss_tokens():
    gen = torch.Generator().manual_seed(1)
    samples = [(torch.randint(0, 30, (40,), generator=gen), torch.rand(40, generator=gen) > 0.7)
               for _ in range(6)]
    counted = {}
    for x, m in samples:
        for t in x[m].tolist():
            counted[t] = counted.get(t, 0) + 1
    every = {}
    for x, _ in samples:
        for t in x.tolist():
            every[t] = every.get(t, 0) + 1
    ranked = sorted(range(50), key=lambda t: (-counted.get(t, 0), -every.get(t, 0), t))
    for size in (5, 20, 50):
        assert frequency_vocabulary(samples, 50, size).tolist() == sorted(ranked[:size])
