"""The README's ```python blocks, verbatim, for the tests that run them as printed."""

from pathlib import Path

README = Path(__file__).resolve().parents[1] / "README.md"


def readme_block(line: str) -> str:
    """The one README ```python block that holds ``line`` (a line of it and of no other)."""
    text = README.read_text()
    found = []
    for part in text.split("```python\n")[1:]:
        code = part[:part.index("```")]
        if line in code:
            found.append(code)
    assert len(found) == 1, f"{len(found)} README python blocks hold {line!r}"
    return found[0]
