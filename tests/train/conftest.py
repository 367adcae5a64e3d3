"""The tiny target, its hash and four chat sequences, shared by the training tests."""

from __future__ import annotations

import pytest
import torch

from dspark.models.llama import build_model
from dspark.models.loader import checkpoint_hash, load_checkpoint, resolve_model
from dspark.models.tokenizer import load_tokenizer
from dspark.train.anchors import Sequence

TEXTS = [
    ("What is 12 plus 30?", "12 plus 30 is 42. First add the tens, then the ones."),
    ("Name a primary colour.", "Red is a primary colour, and so are blue and yellow."),
    ("Write hello in Python.", "```python\nprint('hello')\n```\nThis prints hello."),
    ("Say something kind.", "You are doing great, and every step you take counts."),
]


@pytest.fixture(scope="module")
def tiny(tiny_llama_dir):
    source = resolve_model(str(tiny_llama_dir))
    config, weights = load_checkpoint(source)
    target = build_model(config, weights, torch.float32, torch.device("cpu"))
    tok = load_tokenizer(source)
    seqs = []
    for prompt, answer in TEXTS:
        ids = tok.apply_chat_template([{"role": "user", "content": prompt}])
        seqs.append(Sequence(ids + tok.encode(answer, add_special_tokens=False), len(ids)))
    return target, checkpoint_hash(source), seqs
