"""What a real target's checkpoint brings beside its weights: Qwen3's two EOS ids (config and
generation config) and its chat template's variables (`enable_thinking`)."""

from __future__ import annotations

import json

import pytest

from dspark import LLM, SamplingParams
from dspark.models.loader import load_checkpoint, resolve_model
from tests.tiny_models import make_tiny_llama

# Qwen3's switch in miniature: the template writes an empty think block when thinking is off
THINKING_TEMPLATE = (
    "{% for m in messages %}<|{{ m.role }}|>{{ m.content }}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>"
    "{% if enable_thinking is defined and enable_thinking is false %}<think></think>{% endif %}"
    "{% endif %}"
)


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, smollm_hf_tokenizer):
    d = make_tiny_llama(tmp_path_factory.mktemp("qwen3"), smollm_hf_tokenizer, "qwen3")
    (d / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return d


def _set_generation_eos(directory, eos_ids: list[int]) -> None:
    path = directory / "generation_config.json"
    generation = json.loads(path.read_text()) if path.is_file() else {}
    path.write_text(json.dumps(generation | {"eos_token_id": eos_ids}))


def test_generation_config_eos_ids_join_config_eos(tmp_path, smollm_hf_tokenizer):
    d = make_tiny_llama(tmp_path / "q", smollm_hf_tokenizer, "qwen3", eos_token_id=2)
    _set_generation_eos(d, [2, 7])
    config, _ = load_checkpoint(resolve_model(str(d)))
    assert config.eos_token_ids == (2, 7)  # config.json's first: the engine's own EOS id


def test_second_eos_id_ends_the_request(tmp_path, smollm_hf_tokenizer):
    d = make_tiny_llama(tmp_path / "q", smollm_hf_tokenizer, "qwen3", eos_token_id=2)
    prompt = smollm_hf_tokenizer.encode("The quick brown fox")
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    free = LLM(model=str(d), dtype="float32", device="cpu", num_kv_pages=32)
    tokens = free.generate([prompt], params, use_tqdm=False)[0].outputs[0].token_ids
    stop_at = next(i for i, t in enumerate(tokens) if t != 2 and i >= 2)
    _set_generation_eos(d, [2, tokens[stop_at]])
    llm = LLM(model=str(d), dtype="float32", device="cpu", num_kv_pages=32)
    out = llm.generate([prompt], SamplingParams(temperature=0.0, max_tokens=8),
                       use_tqdm=False)[0].outputs[0]  # fmt: skip
    assert out.token_ids == tokens[: stop_at + 1] and out.finish_reason == "stop"
    # ignore_eos runs past both EOS ids
    again = llm.generate([prompt], params, use_tqdm=False)[0].outputs[0]
    assert again.token_ids == tokens


def test_chat_template_kwargs_reach_the_template(qwen3_dir):
    from transformers import AutoTokenizer

    hf_tok = AutoTokenizer.from_pretrained(qwen3_dir)
    llm = LLM(model=str(qwen3_dir), dtype="float32", device="cpu", num_kv_pages=32)
    conv = [{"role": "user", "content": "Hi"}]
    params = SamplingParams(temperature=0.0, max_tokens=1)
    for kwargs in ({"enable_thinking": False}, None):
        out = llm.chat(conv, params, use_tqdm=False, chat_template_kwargs=kwargs)[0]
        want = hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True,
                                          **(kwargs or {}))  # fmt: skip
        assert ("<think></think>" in want) == (kwargs is not None)
        assert out.prompt_token_ids == hf_tok.encode(want, add_special_tokens=False)
