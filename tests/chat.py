"""A tiny offline chat tokenizer for the Eagle3 data tests (no downloads): whole words of a
fixed vocabulary, four special tokens, and a chat template with or without generation
blocks."""

WORDS = ["hello", "there", "how", "are", "you", "fine", "thanks", "and", "what", "is", "two",
         "plus", "four", "be", "brief"]
SPECIAL = ["<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
WITH_BLOCKS = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' }} "
               "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} <|end|>"
               "{% endgeneration %}{% else %}{{ m['content'] }} <|end|>{% endif %} {% endfor %}"
               "{% if add_generation_prompt %}<|assistant|> {% endif %}")
PLAIN = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' }} {{ m['content'] }} <|end|> "
         "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")


def chat_tokenizer(template=WITH_BLOCKS):
    """A transformers fast tokenizer over ``WORDS`` (ids 5..) with ``SPECIAL`` (1..4)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", *SPECIAL, *WORDS])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<unk>")
    fast.add_special_tokens({"additional_special_tokens": SPECIAL})
    fast.chat_template = template
    return fast
