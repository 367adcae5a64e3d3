"""Our tokenizer equals Hugging Face's for the same GGUF file."""

from __future__ import annotations

import pytest

from dspark.models.loader import resolve_model
from dspark.models.tokenizer import load_tokenizer

TEXTS = [
    "Hello, world!",
    "  leading spaces and\ttabs\nnew lines",
    "Unicode: café, naïve, 日本語, emoji 🚀",
    "def f(x):\n    return x ** 2  # comment",
    "<|im_start|>user\nhi<|im_end|>",
    "1234567890 3.14159 -42",
]


@pytest.mark.slow
def test_gguf_tokenizer_equals_hf(smollm_hf_tokenizer):
    ours = load_tokenizer(resolve_model("default"))
    for text in TEXTS:
        ids = ours.encode(text)
        assert ids == smollm_hf_tokenizer.encode(text)
        assert ours.decode(ids) == smollm_hf_tokenizer.decode(ids, skip_special_tokens=True)
    conv = [{"role": "user", "content": "What is 2 + 2?"}]
    expected = smollm_hf_tokenizer.apply_chat_template(conv, add_generation_prompt=True)
    if not isinstance(expected, list):  # transformers 5 returns a BatchEncoding
        expected = expected["input_ids"]
    assert ours.apply_chat_template(conv) == expected


@pytest.mark.slow
def test_encode_equals_transformers_with_and_without_special_tokens(smollm_hf_tokenizer):
    """Our encode goes through a private copy of the Rust tokenizer, one text at a time: the
    same ids as transformers' encode, with and without special tokens, and unaffected by
    truncation a transformers call leaves set on the shared backend."""
    ours = load_tokenizer(resolve_model("default"))
    texts = (
        TEXTS
        + ["\n\n".join(TEXTS) * 3]
        + [
            ours._tok.apply_chat_template([{"role": "user", "content": t}], tokenize=False)
            for t in TEXTS
        ]
    )
    for text in texts:
        for special in (True, False):
            expected = smollm_hf_tokenizer.encode(text, add_special_tokens=special)
            assert ours.encode(text, add_special_tokens=special) == expected
    ours._tok("a longer text than five tokens, surely", truncation=True, max_length=5)
    assert len(ours.encode("a longer text than five tokens, surely")) > 5
