"""Incremental detokenization equals decoding all at once; stop strings cut correctly."""

from __future__ import annotations

import pytest

from dspark.engine.detokenizer import Detokenizer
from dspark.models.loader import resolve_model
from dspark.models.tokenizer import load_tokenizer


@pytest.fixture(scope="module")
def tok():
    return load_tokenizer(resolve_model("default"))


@pytest.mark.slow
@pytest.mark.parametrize(
    "text",
    [
        "Hello, world! How are you?",
        "Unicode: café 日本語 🚀🚀 done",
        "  spaces\n\n\tand tabs  ",
        "<|im_end|> special",
    ],
)
def test_incremental_equals_full_decode(tok, text):
    ids = tok.encode(text)
    d = Detokenizer(tok)
    for t in ids:
        d.add_tokens([t])
    d.flush()
    assert d.text == tok.decode(ids)


@pytest.mark.slow
def test_stop_string_spanning_tokens(tok):
    ids = tok.encode("The answer is 42. The end.")
    d = Detokenizer(tok, stop_strings=("42.", "end"))
    hit = None
    for t in ids:
        hit = d.add_tokens([t])
        if hit:
            break
    # several tokens in one call (a speculative step): the hit names the completing token
    d2 = Detokenizer(tok, stop_strings=("42.",))
    many = d2.add_tokens(ids)
    assert many is not None and tok.decode(ids[: many.num_tokens]).endswith("42.")
    assert hit.stop == "42." and hit.num_tokens == 1 and d.text == "The answer is "


@pytest.mark.slow
@pytest.mark.parametrize("batch", [1, 2, 3, 5])
def test_text_read_every_few_tokens_equals_full_decode(tok, batch):
    """Without stop strings the text is decoded when read: a read after a batch that ends
    inside a character gives nothing new, a later one all of it; the flush, what is left."""
    text = "Unicode: café 日本語テキスト 🚀🎉 done, ok 😀"
    ids = tok.encode(text)
    d = Detokenizer(tok)
    seen = []
    for i in range(0, len(ids), batch):
        d.add_tokens(ids[i : i + batch])
        seen.append(d.text)
        assert tok.decode(ids).startswith(seen[-1])
    if batch == 1:  # some character spans two tokens: a read in its middle adds nothing
        assert any(a == b for a, b in zip(seen, seen[1:], strict=False))
    d.flush()
    assert d.text == tok.decode(ids)
