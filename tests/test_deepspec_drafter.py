"""DeepSeek's drafter layout (DeepSpec's Qwen3DSparkModel checkpoints): the block's logits
against a re-derivation written from DeepSpec's forward over the raw tensors, lossless
speculative greedy decoding with a Markov drafter and a DFlash one (rank 0), a drafter named on
the Hub, and the refusals the format calls for."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

from dspark import LLM, SamplingParams
from dspark.models.deepspec_format import DeepSpecFormatError
from dspark.models.drafter_config import DrafterMismatchError
from dspark.models.dspark_drafter import DSparkDrafter
from dspark.models.llama import build_model
from dspark.models.loader import load_checkpoint, resolve_model
from tests.helpers import full_logits
from tests.test_dspark_drafter import K, _paged_block
from tests.test_hub import MAIN, lay_hub_cache, offline_cache  # noqa: F401 - a fixture
from tests.tiny_models import make_deepspec_drafter, make_tiny_llama

TAPS = (0, 1)  # of the 3-layer target: the last layer (2) is not a tap DeepSpec's format allows


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory, smollm_hf_tokenizer):
    return make_tiny_llama(tmp_path_factory.mktemp("qwen3_target"), smollm_hf_tokenizer, "qwen3",
                           num_hidden_layers=3, tie_word_embeddings=False)  # fmt: skip


@pytest.fixture(scope="module")
def target(qwen3_dir):
    config, weights = load_checkpoint(resolve_model(str(qwen3_dir)))
    return build_model(config, weights, torch.float32, torch.device("cpu"))


def _rms(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    return w * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def _rope(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    hd = x.shape[-1]  # x [T, heads, hd]
    inv_freq = 1.0 / theta ** (torch.arange(0, hd, 2).float() / hd)
    angles = positions.float()[:, None] * inv_freq  # [T, hd/2]
    cos, sin = angles.cos().repeat(1, 2)[:, None], angles.sin().repeat(1, 2)[:, None]
    rotated = torch.cat([-x[..., hd // 2 :], x[..., : hd // 2]], dim=-1)
    return x * cos + rotated * sin


def _deepspec_block_logits(directory, features, anchor, prev) -> torch.Tensor:
    """DeepSpec's block forward over its own tensors: context = hidden_norm(fc(features)) gives
    k-normed keys and values at positions 0..L-1; the block [anchor, MASK...] at L..L+K-1
    attends to all of them and to itself both ways; logits = lm_head(norm(h)) + W2 W1[prev]."""
    t, hf = (
        load_file(directory / "model.safetensors"),
        json.loads((directory / "config.json").read_text()),
    )
    eps, theta = hf["rms_norm_eps"], hf["rope_parameters"]["rope_theta"]
    nh, nkv, hd = hf["num_attention_heads"], hf["num_key_value_heads"], hf["head_dim"]
    L = features.shape[0]
    ctx = _rms(features @ t["fc.weight"].T, t["hidden_norm.weight"], eps)  # [L, H]
    x = t["embed_tokens.weight"][[anchor] + [hf["mask_token_id"]] * (K - 1)]  # [K, H]
    positions = torch.arange(L + K)
    for i in range(hf["num_hidden_layers"]):
        w = {
            n.removeprefix(f"layers.{i}."): v for n, v in t.items() if n.startswith(f"layers.{i}.")
        }
        h = _rms(x, w["input_layernorm.weight"], eps)
        q = _rms(
            (h @ w["self_attn.q_proj.weight"].T).view(K, nh, hd), w["self_attn.q_norm.weight"], eps
        )
        both = torch.cat([ctx, h])  # [L + K, H]: context keys first, as DeepSpec concatenates
        k = _rms((both @ w["self_attn.k_proj.weight"].T).view(L + K, nkv, hd),
                 w["self_attn.k_norm.weight"], eps)  # fmt: skip
        v = (both @ w["self_attn.v_proj.weight"].T).view(L + K, nkv, hd)
        q, k = _rope(q, positions[L:], theta), _rope(k, positions, theta)
        k, v = k.repeat_interleave(nh // nkv, 1), v.repeat_interleave(nh // nkv, 1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(hd)
        o = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(K, nh * hd)
        x = x + o @ w["self_attn.o_proj.weight"].T
        h = _rms(x, w["post_attention_layernorm.weight"], eps)
        gate, up = h @ w["mlp.gate_proj.weight"].T, h @ w["mlp.up_proj.weight"].T
        x = x + (F.silu(gate) * up) @ w["mlp.down_proj.weight"].T
    logits = _rms(x, t["norm.weight"], eps) @ t["lm_head.weight"].T  # [K, V]
    if hf["markov_rank"]:
        logits = (
            logits + t["markov_head.markov_w1.weight"][prev] @ t["markov_head.markov_w2.weight"].T
        )
    return logits


@pytest.mark.parametrize("markov_rank", [8, 0])
def test_block_logits_equal_deepspecs_forward(tmp_path, qwen3_dir, target, markov_rank):
    # 3 layers: as many as the target, whose shape _paged_block allocates the cache in
    d = make_deepspec_drafter(qwen3_dir, tmp_path / "drafter", TAPS, K, markov_rank, num_layers=3)
    drafter = DSparkDrafter.load(d, target, "unused")
    assert (drafter.markov_in is None) == (markov_rank == 0)
    assert (drafter.confidence is None) == (markov_rank == 0)
    ids = [5, 17, 3, 44, 9, 21, 60, 2, 33, 71, 12]
    L = 10  # the anchor ids[10] at position 10 sees the context 0..9
    features = full_logits(target, ids, page_size=4, hidden_layers=TAPS).features  # [11, 2 H]
    prev = torch.tensor([ids[L], 7, 8, 9])  # anchor, then the drafted tokens before each slot
    with torch.no_grad():
        hidden = drafter.forward_train(features[None], torch.tensor([[ids[L]]]),
                                       torch.tensor([[L]]))[0, 0]  # fmt: skip
        got = drafter.base_logits(hidden) + drafter.markov_bias(prev)
    want = _deepspec_block_logits(d, features[:L], ids[L], prev)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # the paged inference path (k-normed context keys in the cache) drafts the same block
    paged = _paged_block(drafter, features, anchor=ids[L], anchor_pos=L)
    torch.testing.assert_close(paged, hidden, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("markov_rank", [8, 0], ids=["dspark", "dflash"])
def test_speculative_greedy_equals_plain(tmp_path, qwen3_dir, markov_rank, offline_cache):  # noqa: F811
    d = make_deepspec_drafter(qwen3_dir, tmp_path / "drafter", TAPS, K, markov_rank)
    lay_hub_cache(offline_cache, "tiny-org/drafter", MAIN, d)  # and named on the Hub
    prompts = [[5, 17, 3, 44, 9], [21, 60, 2, 33, 71, 12, 8]]
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    kwargs = dict(dtype="float32", device="cpu", num_kv_pages=64)
    plain = LLM(model=str(qwen3_dir), **kwargs).generate(prompts, params, use_tqdm=False)
    spec = {"model": "tiny-org/drafter", "num_speculative_tokens": 3}
    llm = LLM(model=str(qwen3_dir), speculative_config=spec, **kwargs)
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in plain]
    assert llm.get_metrics()["num_drafts"] > 0


@pytest.mark.parametrize(
    "overrides, match",
    [
        ({"markov_head_type": "gated"}, "markov_head_type 'gated'"),
        ({"target_layer_ids": [0, 2]}, r"target_layer_ids \[0, 2\]: allowed 0..1"),
        ({"target_layer_ids": [-1, 1]}, "the embeddings"),
        ({"hidden_size": 32}, "hidden_size is 32"),
        ({"num_target_layers": 4}, "num_target_layers is 4"),
    ],
)
def test_refuses_what_the_format_does_not_describe(tmp_path, qwen3_dir, target, overrides, match):
    d = make_deepspec_drafter(qwen3_dir, tmp_path / "drafter", TAPS, K, 8, **overrides)
    with pytest.raises(DeepSpecFormatError, match=match):
        DSparkDrafter.load(d, target, "unused")


def test_another_targets_embedding_is_refused(tmp_path, qwen3_dir, target):
    d = make_deepspec_drafter(qwen3_dir, tmp_path / "drafter", TAPS, K, 8)
    tensors = load_file(d / "model.safetensors")
    tensors["embed_tokens.weight"] = tensors["embed_tokens.weight"] + 1e-3
    save_file(tensors, d / "model.safetensors")
    with pytest.raises(DrafterMismatchError, match="frozen embed_tokens"):
        DSparkDrafter.load(d, target, "unused")
