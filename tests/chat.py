"""A tiny offline chat tokenizer for the Eagle3 data tests (no downloads): whole words of a
fixed vocabulary, the demo's four special tokens, and a chat template with or without generation
blocks."""

WORDS = ["hello", "there", "how", "are", "you", "fine", "thanks", "and", "what", "is", "two",
         "plus", "four", "be", "brief"]
WITH_BLOCKS = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' }} "
               "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }} <|end|>"
               "{% endgeneration %}{% else %}{{ m['content'] }} <|end|>{% endif %} {% endfor %}"
               "{% if add_generation_prompt %}<|assistant|> {% endif %}")
PLAIN = ("{% for m in messages %}{{ '<|' + m['role'] + '|>' }} {{ m['content'] }} <|end|> "
         "{% endfor %}{% if add_generation_prompt %}<|assistant|> {% endif %}")


def chat_tokenizer(template=WITH_BLOCKS):
    """A fast tokenizer over ``WORDS`` (ids 5..) and the demo's special tokens (1..4)."""
    from ringattn.apps.eagle3_demo import demo_tokenizer

    return demo_tokenizer(WORDS, template)
