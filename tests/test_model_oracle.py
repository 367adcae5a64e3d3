"""The project's model against Hugging Face transformers, the oracle for the target's logits."""

from __future__ import annotations

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.attention_metadata import single_prefill_metadata
from dspark.engine.kv_cache import allocate_kv_caches
from dspark.models.llama import build_model
from dspark.models.loader import load_checkpoint, resolve_model
from tests.helpers import full_logits
from tests.tiny_models import make_tiny_llama

HIDDEN = 64  # the tiny models' hidden size (tests/tiny_models.py)

# fp32 on both sides; the two differ only in summation order (SDPA vs our paged path).
LOGITS_ATOL = 1e-3

CHAT_PROMPTS = [
    "What is the capital of France?",
    "Write a haiku about the sea.",
    "Explain what a hash table is in two sentences.",
    "List three prime numbers greater than 50.",
    "How do I reverse a list in Python?",
]


def _ours(source_arg: str):
    config, weights = load_checkpoint(resolve_model(source_arg))
    return build_model(config, weights, torch.float32, torch.device("cpu"))


def _hf(path, gguf_file=None):
    from transformers import AutoModelForCausalLM

    kwargs = {"gguf_file": gguf_file} if gguf_file else {}
    return AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, **kwargs).eval()


@pytest.mark.parametrize("arch", ["llama", "qwen2", "qwen3"])
def test_tiny_hf_checkpoint_logits_and_hidden_states(tmp_path, smollm_hf_tokenizer, arch):
    # qwen2 has q/k/v biases, qwen3 q/k norms and heads x head_dim != hidden; all are untied
    # here to cover a separate lm_head
    d = make_tiny_llama(tmp_path / arch, smollm_hf_tokenizer, arch, tie_word_embeddings=False)
    ours, hf = _ours(str(d)), _hf(d)
    ids = smollm_hf_tokenizer.encode("The quick brown fox jumps over the lazy dog.")
    # taps in the order asked: the last layer's (its own add) before the first's (written by
    # layer 1's input norm)
    out = full_logits(ours, ids, page_size=4, hidden_layers=(1, 0))
    with torch.no_grad():
        ref = hf(torch.tensor([ids]), output_hidden_states=True)
        last = ours.norm(out.features[:, :HIDDEN])
    torch.testing.assert_close(out.logits, ref.logits[0], atol=1e-4, rtol=1e-4)
    # HF hidden_states[i + 1] is the output of decoder layer i (the last one after the norm)
    torch.testing.assert_close(out.features[:, HIDDEN:], ref.hidden_states[1][0], atol=1e-4,
                               rtol=1e-4)  # fmt: skip
    torch.testing.assert_close(last, ref.hidden_states[2][0], atol=1e-4, rtol=1e-4)
    assert out.hidden_states[0].data_ptr() == out.features[:, HIDDEN:].data_ptr()


def test_logits_go_into_a_given_buffer(tmp_path, smollm_hf_tokenizer):
    # a captured graph set's shared logits (runner/cuda_graph.graph_logits): a bfloat16 model
    # writes float32 logits into the buffer's first rows, the same values as its own tensor
    d = make_tiny_llama(tmp_path / "llama", smollm_hf_tokenizer, "llama")
    config, weights = load_checkpoint(resolve_model(str(d)))
    model = build_model(config, weights, torch.bfloat16, torch.device("cpu"))
    ids = smollm_hf_tokenizer.encode("The quick brown fox")
    own = full_logits(model, ids, page_size=4).logits
    buffer = torch.full((len(ids) + 3, config.vocab_size), float("nan"))
    kv = allocate_kv_caches(config, 3, 4, torch.bfloat16, torch.device("cpu"))
    attn = single_prefill_metadata(len(ids), 4, torch.device("cpu"))
    with torch.no_grad():
        out = model(torch.tensor(ids), torch.arange(len(ids)), attn, kv, logits_out=buffer)
    assert own.dtype == out.logits.dtype == torch.float32
    assert out.logits.data_ptr() == buffer.data_ptr()
    torch.testing.assert_close(buffer[: len(ids)], own, atol=0, rtol=0)
    assert buffer[len(ids) :].isnan().all()  # (the rows past the step's are not written)


@pytest.fixture(scope="module")
def real_models(default_gguf):
    return _ours("default"), _hf(default_gguf.parent, default_gguf.name)


@pytest.mark.slow
def test_smollm2_logits_match_hf(real_models, smollm_hf_tokenizer):
    ours, hf = real_models
    for text in ["Hello, world!", "def fib(n):\n    return", CHAT_PROMPTS[2] * 3]:
        ids = smollm_hf_tokenizer.encode(text)
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0]
        got = full_logits(ours, ids).logits
        assert (got - ref).abs().max().item() < LOGITS_ATOL
        assert torch.equal(got.argmax(-1), ref.argmax(-1))


@pytest.mark.slow
def test_smollm2_greedy_matches_hf_for_64_tokens(real_models, smollm_hf_tokenizer):
    _, hf = real_models
    llm = LLM(model="default", dtype="float32", device="cpu")
    tok = llm.get_tokenizer()
    convs = [[{"role": "user", "content": p}] for p in CHAT_PROMPTS]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    outputs = llm.chat(convs, params, use_tqdm=False)
    want = _hf_greedy([tok.apply_chat_template(conv) for conv in convs], hf, 64)
    assert [out.outputs[0].token_ids for out in outputs] == want


@torch.no_grad()
def _hf_greedy(prompts: list[list[int]], hf, num_tokens: int) -> list[list[int]]:
    """Plain greedy decoding with HF's KV cache, never stopping at EOS (like ignore_eos), the
    prompts batched and left-padded under HF's attention mask and position ids: on this CPU
    ~2.4x faster than one prompt at a time (a 135M model's step reads every weight whatever
    the batch), with the same tokens for these prompts.

      prompts [a b c], [d e]  ->  ids [[a b c], [0 d e]], mask [[1 1 1], [0 1 1]],
                                  positions [[0 1 2], [0 0 1]]
    """
    width = max(map(len, prompts))
    ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    out = hf(ids, attention_mask=mask, position_ids=positions, use_cache=True)
    tokens = []
    for _ in range(num_tokens):
        tokens.append(out.logits[:, -1].argmax(-1))
        mask = torch.cat([mask, torch.ones_like(mask[:, :1])], dim=1)
        positions = positions[:, -1:] + 1
        out = hf(tokens[-1][:, None], attention_mask=mask, position_ids=positions,
                 past_key_values=out.past_key_values, use_cache=True)  # fmt: skip
    return torch.stack(tokens, dim=1).tolist()


@pytest.mark.parametrize(
    "rope_scaling",
    [
        {"rope_type": "linear", "factor": 2.0},
        {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 64,
        },
    ],
)
def test_rope_scaling_matches_hf(tmp_path, smollm_hf_tokenizer, rope_scaling):
    d = make_tiny_llama(
        tmp_path / rope_scaling["rope_type"], smollm_hf_tokenizer, rope_scaling=rope_scaling
    )
    ours, hf = _ours(str(d)), _hf(d)
    assert ours.config.rope_type == rope_scaling["rope_type"]
    ids = smollm_hf_tokenizer.encode("A long enough prompt to reach positions past the band. " * 4)
    with torch.no_grad():
        ref = hf(torch.tensor([ids])).logits[0]
    torch.testing.assert_close(full_logits(ours, ids).logits, ref, atol=1e-4, rtol=1e-4)


# Llama 3.x's rope: llama3 scaling over theta 500000, untied head (Llama 3.2 1B ties it)
LLAMA3 = {
    "rope_theta": 500000.0,
    "rope_scaling": {
        "rope_type": "llama3",
        "factor": 32.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64,
    },
}


@pytest.mark.parametrize(
    "arch, overrides",
    [("qwen3", {}), ("qwen3", {"tie_word_embeddings": False}), ("llama", LLAMA3)],
    ids=["qwen3-tied", "qwen3-untied", "llama3"],
)
def test_real_target_families_greedy_equal_hf(tmp_path, smollm_hf_tokenizer, arch, overrides):
    """The engine's greedy tokens (prefill, then decode steps over the paged cache) equal HF's
    for the two families of real targets, float32 on both sides."""
    d = make_tiny_llama(tmp_path / arch, smollm_hf_tokenizer, arch, **overrides)
    prompts = [smollm_hf_tokenizer.encode(t) for t in CHAT_PROMPTS[:3]]
    llm = LLM(model=str(d), dtype="float32", device="cpu", num_kv_pages=64)
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    got = [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]
    assert got == _hf_greedy(prompts, _hf(d), 12)
