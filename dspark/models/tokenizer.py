"""The checkpoint's tokenizer and chat template, through transformers (so it equals HF's exactly).

For a GGUF file transformers rebuilds a fast tokenizer from the embedded vocabulary (seconds);
the result is cached under ~/.cache/dspark/tokenizers, keyed by the file's path, size and mtime.
"""

from __future__ import annotations

import logging
from typing import Any

from dspark.models.file_cache import cache_entry
from dspark.models.loader import ModelSource

logger = logging.getLogger(__name__)


class Tokenizer:
    def __init__(self, hf_tokenizer) -> None:
        self._tok = hf_tokenizer
        # text -> ids through a private copy of the Rust tokenizer, one text per call: the
        # same ids as transformers' encode (tests/test_tokenizer.py), without its Python
        # wrapping, and without encode_batch, which transformers routes even one text through
        # and which hands it to a thread pool (on the H200's 16-core host 0.24 ms of a served
        # request's event-loop time went to it). The copy
        # never truncates or pads, whatever a transformers call sets on the shared one.
        self._encoder = _plain_copy(hf_tokenizer.backend_tokenizer)

    @property
    def eos_token_id(self) -> int | None:
        return self._tok.eos_token_id

    @property
    def backend(self):
        """The Rust `tokenizers.Tokenizer` (for streaming decode)."""
        return self._tok.backend_tokenizer

    @property
    def vocab_size(self) -> int:
        return len(self._tok)

    def backend_json(self) -> str:
        """The Rust tokenizer serialised, without truncation or padding (the grammar engine
        builds its own tokenizer from it: dspark/structured/compiler.py)."""
        return self._encoder.to_str()

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self._encoder.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(token_ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self,
        messages: list[dict[str, str]],
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
        add_special_tokens: bool = False,
    ) -> list[int]:
        """The template's token ids; `chat_template_kwargs` are the template's own variables
        (Qwen3's `enable_thinking`), as vLLM passes them. The template already writes any
        BOS/system tokens it wants, so the tokenizer adds none unless `add_special_tokens`
        (vLLM's /tokenize option)."""
        if not self._tok.chat_template:
            raise ValueError("this checkpoint has no chat template; use generate() with raw text")
        text = self._tok.apply_chat_template(
            messages,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            **(chat_template_kwargs or {}),
        )
        return self.encode(text, add_special_tokens=add_special_tokens)

    def token_to_text(self, token_ids: list[int]) -> list[str]:
        return self._tok.convert_ids_to_tokens(token_ids)


def _plain_copy(backend):
    """An independent copy of a `tokenizers.Tokenizer`, without truncation or padding."""
    from tokenizers import Tokenizer as RustTokenizer

    copy = RustTokenizer.from_str(backend.to_str())
    copy.no_truncation()
    copy.no_padding()
    return copy


def import_backend() -> None:
    """Import transformers' fast tokenizer, which unpickling a Tokenizer needs. A server's API
    process receives its Tokenizer pickled, in the engine's READY message, and unpickles it on
    its event loop; the import is most of that (0.44 s of 0.57 on the development CPU, the
    parse itself 0.13 s), so the API process does it while the engine still loads."""
    from transformers import PreTrainedTokenizerFast  # noqa: F401


def load_tokenizer(source: ModelSource) -> Tokenizer:
    from transformers import AutoTokenizer

    if not source.gguf_file:
        return Tokenizer(AutoTokenizer.from_pretrained(source.directory))
    cached = cache_entry("tokenizers", source.path)
    if (cached / "tokenizer.json").is_file():
        return Tokenizer(AutoTokenizer.from_pretrained(cached))
    logger.info("building the tokenizer from %s (cached at %s)", source.path, cached)
    tok = AutoTokenizer.from_pretrained(source.directory, gguf_file=source.gguf_file)
    try:
        tok.save_pretrained(cached)
    except OSError as e:  # a read-only home still works, just slower next time
        logger.warning("could not cache the tokenizer at %s: %s", cached, e)
    return Tokenizer(tok)
