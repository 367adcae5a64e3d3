"""The whole target model with every Triton kernel (attention, KV store, norms, rotary, SiLU)
against the same model on the PyTorch reference ops: prefill logits and a decode step."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from dspark.attention_metadata import AttentionMetadata, single_prefill_metadata
from dspark.engine.kv_cache import allocate_kv_caches
from dspark.models.llama import build_model
from dspark.models.model_config import ModelConfig
from tests.tiny_models import _llama_config, save_random_model

ARCHITECTURES = {"llama": "LlamaForCausalLM", "qwen3": "Qwen3ForCausalLM"}


@pytest.mark.parametrize("arch", ["llama", "qwen3"])  # qwen3: q/k norm before every rotation
def test_triton_model_matches_torch_model(tmp_path, device, arch):
    """The decode step rotates q and k inside the paged attention kernel, the prefill in the
    fused rotary launch."""
    hf_config = _llama_config(128, arch, num_attention_heads=6, num_key_value_heads=2,
                              hidden_size=96)  # fmt: skip
    save_random_model(tmp_path, hf_config)
    config = ModelConfig.from_hf_dict(
        hf_config.to_dict() | {"architectures": [ARCHITECTURES[arch]]}
    )
    weights = load_file(tmp_path / "model.safetensors")
    page_size, n = 4, 9
    outputs = {}
    for backend in ("torch", "triton"):
        model = build_model(config, weights, torch.float32, device, backend)
        kv = allocate_kv_caches(config, 8, page_size, torch.float32, device)
        ids = torch.randint(0, 128, (n + 1,), generator=torch.Generator().manual_seed(0)).to(device)
        with torch.inference_mode():
            prefill = model(
                ids[:n],
                torch.arange(n, device=device),
                single_prefill_metadata(n, page_size, device),
                kv,
                None,
                (0,),
            )
            # one decode token at position n, in page 3 (pages 1..3 hold positions 0..11)
            decode_attn = AttentionMetadata(
                cu_num_tokens=torch.tensor([0, 1], dtype=torch.int32, device=device),
                seq_lens=torch.tensor([n + 1], dtype=torch.int32, device=device),
                slot_mapping=torch.tensor([3 * page_size + n % page_size], device=device),
                block_table=torch.tensor([[1, 2, 3]], dtype=torch.int32, device=device),
                cu_num_tokens_cpu=(0, 1),
                seq_lens_cpu=(n + 1,),
            )
            decode = model(ids[n:], torch.tensor([n], device=device), decode_attn, kv)
        outputs[backend] = (prefill.logits, prefill.hidden_states[0], decode.logits)
    for got, want in zip(outputs["triton"], outputs["torch"], strict=True):
        torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)


def test_engine_greedy_triton_backend_equals_torch(tiny_llama_dir, device):
    from dspark import LLM, SamplingParams

    prompts = ["Hello there", "The quick brown fox jumps", "1 2 3"]
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    got = {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_llama_dir), dtype="float32", device=device.type, num_kv_pages=64,
                  attention_backend=backend, use_cuda_graphs=False)  # fmt: skip
        got[backend] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
    assert got["triton"] == got["torch"]


def test_speculative_engine_triton_backend_equals_torch(tiny_vocab_dir, tmp_path, device):
    """The drafter's triton path (its context upkeep folded into one projection and one
    launch, models/folded_context.py) drafts what the torch path drafts: same tokens, same
    acceptance, the same context keys and values."""
    from dspark import LLM, SamplingParams
    from tests.tiny_models import make_tiny_drafter

    drafter = make_tiny_drafter(tiny_vocab_dir, tmp_path / "drafter", taps=(0,))
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    spec = {"model": str(drafter), "num_speculative_tokens": 3}
    got, caches = {}, {}
    for backend in ("torch", "triton"):
        llm = LLM(str(tiny_vocab_dir), dtype="float32", device=device.type, num_kv_pages=64,
                  attention_backend=backend, use_cuda_graphs=False,
                  speculative_config=spec)  # fmt: skip
        outputs = llm.generate([[2, 3, 4], [5, 6, 7, 8, 9]], params, use_tqdm=False)
        metrics = llm.get_metrics()
        got[backend] = ([o.outputs[0].token_ids for o in outputs],
                        metrics["num_accepted_tokens_per_pos"], metrics["num_drafts"])  # fmt: skip
        caches[backend] = [kv.clone() for kv in llm.engine.spec.kv_caches]
    assert got["triton"] == got["torch"] and got["torch"][2] > 0
    for triton_kv, torch_kv in zip(caches["triton"], caches["torch"], strict=True):
        torch.testing.assert_close(triton_kv, torch_kv)  # the drafter's context keys/values


def test_qwen3_deepspec_drafter_triton_backend_equals_torch(tmp_path, device,
                                                             smollm_hf_tokenizer):  # fmt: skip
    """A Qwen3 target with a drafter in DeepSpec's layout: the drafter's context keys are
    k-normed before the triton rotary store (its folded upkeep does not apply), the target's
    q/k before the fused rotary and the decode kernel's rotation; same tokens, same drafts,
    same context caches as the torch path."""
    from dspark import LLM, SamplingParams
    from tests.tiny_models import make_deepspec_drafter, make_tiny_llama

    target = make_tiny_llama(tmp_path / "qwen3", smollm_hf_tokenizer, "qwen3",
                             num_hidden_layers=3)  # fmt: skip
    drafter = make_deepspec_drafter(target, tmp_path / "drafter", (0, 1), block_size=4)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    spec = {"model": str(drafter), "num_speculative_tokens": 3}
    got, caches = {}, {}
    for backend in ("torch", "triton"):
        llm = LLM(str(target), dtype="float32", device=device.type, num_kv_pages=64,
                  attention_backend=backend, use_cuda_graphs=False,
                  speculative_config=spec)  # fmt: skip
        outputs = llm.generate([[2, 3, 4], [5, 6, 7, 8, 9]], params, use_tqdm=False)
        metrics = llm.get_metrics()
        got[backend] = ([o.outputs[0].token_ids for o in outputs],
                        metrics["num_accepted_tokens_per_pos"], metrics["num_drafts"])  # fmt: skip
        caches[backend] = [kv.clone() for kv in llm.engine.spec.kv_caches]
    assert got["triton"] == got["torch"] and got["torch"][2] > 0
    for triton_kv, torch_kv in zip(caches["triton"], caches["torch"], strict=True):
        torch.testing.assert_close(triton_kv, torch_kv, atol=1e-5, rtol=1e-5)
