"""The DSpark drafter network: paged block forward equals a dense re-derivation; checkpoints."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file

from dspark.attention_metadata import AttentionMetadata, single_prefill_metadata
from dspark.engine.kv_cache import allocate_kv_caches
from dspark.models.drafter_config import DrafterConfig, DrafterMismatchError
from dspark.models.dspark_drafter import DSparkDrafter, target_identity
from dspark.models.llama import build_model
from dspark.models.model_config import ModelConfig
from tests.helpers import chi2_critical_001
from tests.tiny_models import _llama_config, save_random_model

K, PAGE = 4, 4
TAPS = (0, 1)
HASH = "0123456789abcdef"


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    d = tmp_path_factory.mktemp("drafter_target")
    hf = _llama_config(96, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                       intermediate_size=64)  # fmt: skip
    save_random_model(d, hf)
    config = ModelConfig.from_hf_dict(hf.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    return build_model(
        config, load_file(d / "model.safetensors"), torch.float32, torch.device("cpu")
    )


def _drafter(target, markov_rank=8, seed=0):
    config = DrafterConfig(target_identity(target, HASH), draft_len=K, target_layers=TAPS,
                           num_layers=2, markov_rank=markov_rank)  # fmt: skip
    torch.manual_seed(seed)
    drafter = DSparkDrafter(config, target, HASH)
    with torch.no_grad():
        drafter.mask_embedding.normal_()
        for p in drafter.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return drafter.eval()


def _features(target, ids):
    n = len(ids)
    kv = allocate_kv_caches(target.config, 8, PAGE, torch.float32, torch.device("cpu"))
    out = target(torch.tensor(ids), torch.arange(n), single_prefill_metadata(n, PAGE), kv, None,
                 TAPS)  # fmt: skip
    return torch.cat([out.hidden_states[i] for i in TAPS], dim=-1)  # [n, m d]


@torch.no_grad()
def _paged_block(drafter, features, anchor, anchor_pos):
    cfg = drafter.target_config
    kv = allocate_kv_caches(cfg, 8, PAGE, torch.float32, torch.device("cpu"))
    pages = [3, 1, 5, 2, 7, 4]  # shuffled on purpose
    slot = lambda p: pages[p // PAGE] * PAGE + p % PAGE  # noqa: E731
    drafter.append_context(features[:anchor_pos], torch.arange(anchor_pos),
                           torch.tensor([slot(p) for p in range(anchor_pos)]), kv)  # fmt: skip
    block_pos = torch.arange(anchor_pos, anchor_pos + K)
    attn = AttentionMetadata(
        cu_num_tokens=torch.tensor([0, K], dtype=torch.int32),
        seq_lens=torch.tensor([anchor_pos + K], dtype=torch.int32),
        slot_mapping=torch.tensor([slot(int(p)) for p in block_pos]),
        block_table=torch.tensor([pages], dtype=torch.int32),
        cu_num_tokens_cpu=(0, K),
        seq_lens_cpu=(anchor_pos + K,),
        causal=False,
    )
    return drafter.block_hidden(torch.tensor([anchor]), block_pos, attn, kv)[0]  # [K, d]


@torch.no_grad()
def _dense_block(drafter, features, anchor, anchor_pos):
    """The same computation written out densely: context K/V ; block, full attention."""
    cfg = drafter.target_config
    nh, nkv, hd = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    ctx = drafter.context_norm(drafter.fc(features[:anchor_pos]))
    x = drafter.mask_embedding.expand(K, -1).clone()
    x[0] = drafter.target.embed_tokens.weight[anchor]
    ctx_pos, block_pos = torch.arange(anchor_pos), torch.arange(anchor_pos, anchor_pos + K)
    for layer in drafter.layers:
        a = layer.self_attn
        q_w, k_w, v_w = a.qkv_proj.weight.split([a.q_size, a.kv_size, a.kv_size])
        h = layer.input_layernorm(x)
        q = (h @ q_w.T).view(K, nh, hd)
        kb, vb = (h @ k_w.T).view(K, nkv, hd), (h @ v_w.T).view(K, nkv, hd)
        kc, vc = (ctx @ k_w.T).view(-1, nkv, hd), (ctx @ v_w.T).view(-1, nkv, hd)
        q, kb = a.rotary(block_pos, q, kb)
        _, kc = a.rotary(ctx_pos, kc, kc)
        keys = torch.cat([kc, kb]).repeat_interleave(nh // nkv, dim=1)  # [S, nh, hd]
        vals = torch.cat([vc, vb]).repeat_interleave(nh // nkv, dim=1)
        o = F.scaled_dot_product_attention(q.transpose(0, 1), keys.transpose(0, 1),
                                           vals.transpose(0, 1))  # fmt: skip
        x = x + a.o_proj(o.transpose(0, 1).reshape(K, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x)


def test_paged_block_forward_equals_dense(target):
    drafter = _drafter(target)
    ids = [5, 17, 3, 44, 9, 21, 60, 2, 33, 71, 12]
    features = _features(target, ids)
    paged = _paged_block(drafter, features, anchor=ids[10], anchor_pos=10)
    dense = _dense_block(drafter, features, anchor=ids[10], anchor_pos=10)
    torch.testing.assert_close(paged, dense, atol=1e-5, rtol=1e-5)
    logits = drafter.base_logits(paged) + drafter.markov_bias(torch.tensor([ids[10], 1, 2, 3]))
    assert logits.shape == (K, 96)


def test_confidence_sees_the_previous_token_not_the_scored_one(target):
    drafter = _drafter(target)
    h = torch.randn(3, 32)
    prev = torch.tensor([4, 4, 9])
    c = drafter.confidence_logit(h, prev)
    assert c.shape == (3,)
    assert c[0] != drafter.confidence_logit(h[:1], torch.tensor([9]))[0]  # depends on prev
    plain = _drafter(target, markov_rank=0)
    assert plain.markov_bias(prev) == 0.0 and plain.confidence_logit(h, prev).shape == (3,)


def test_checkpoint_round_trip_and_identity_check(target, tmp_path):
    drafter = _drafter(target)
    drafter.save(tmp_path / "drafter")
    loaded = DSparkDrafter.load(tmp_path / "drafter", target, HASH)
    for (n, a), (_, b) in zip(drafter.state_dict().items(), loaded.state_dict().items(),
                              strict=True):  # fmt: skip
        assert torch.equal(a, b), n
    with pytest.raises(DrafterMismatchError, match="weights_hash is '0123456789abcdef'"):
        DSparkDrafter.load(tmp_path / "drafter", target, "ffffffffffffffff")
    with pytest.raises(FileNotFoundError, match="not a DSpark drafter"):
        DSparkDrafter.load(tmp_path, target, HASH)


def test_taps_outside_the_target_are_refused(target):
    config = DrafterConfig(target_identity(target, HASH), target_layers=(0, 7))
    with pytest.raises(ValueError, match="tap layer 7 is outside the target's 0..1"):
        DSparkDrafter(config, target, HASH)


def _st(n, temperature, seeds):
    from dspark.sample.sampler import SamplingTensors

    return SamplingTensors(
        temperature=torch.full((n,), temperature), top_k=torch.full((n,), 96, dtype=torch.int64),
        top_p=torch.ones(n), seeds=seeds, positions=torch.zeros(n, dtype=torch.int64),
        all_greedy=temperature == 0, any_top_k=False, any_top_p=False,
    )  # fmt: skip


def test_draft_block_follows_the_markov_chain(target):
    from dspark.spec.drafting import draft_block

    drafter = _drafter(target)
    n = 4000
    hidden = torch.randn(1, K, 32).expand(n, -1, -1)
    anchors = torch.full((n,), 7)
    with torch.no_grad():
        block = draft_block(drafter, hidden, anchors, torch.full((n,), 20),
                            _st(n, 1.0, torch.arange(n)))  # fmt: skip
        # slot 0's distribution is softmax(U[0] + bias(anchor)); slot 1's depends on slot 0
        expected0 = drafter.base_logits(hidden[0, 0]) + drafter.markov_bias(torch.tensor(7))
        torch.testing.assert_close(block.probs[0, 0], expected0.softmax(-1))
        x0 = block.tokens[0, 0]
        expected1 = drafter.base_logits(hidden[0, 1]) + drafter.markov_bias(x0)
        torch.testing.assert_close(block.probs[0, 1], expected1.softmax(-1))
        # confidence of slot 1 is a function of the slot-0 token, not of the slot-1 token
        torch.testing.assert_close(block.confidence_logits[0, 1],
                                   drafter.confidence_logit(hidden[0, 1], x0))  # fmt: skip
    counts = torch.bincount(block.tokens[:, 0], minlength=96).float()
    p = block.probs[0, 0]
    big = p * n >= 5
    stat = (((counts[big] - n * p[big]) ** 2) / (n * p[big])).sum().item()
    dof = int(big.sum()) - 1
    crit = chi2_critical_001(dof)
    assert stat < crit, (stat, dof, crit)
    greedy = draft_block(drafter, hidden[:2], anchors[:2], torch.full((2,), 20),
                         _st(2, 0.0, torch.arange(2)))  # fmt: skip
    assert greedy.tokens[0, 0] == expected0.argmax()


def test_inverse_cdf_worked_example_never_draws_a_zero_probability_token():
    from dspark.sample.sampler import inverse_cdf as _inverse_cdf

    p = torch.tensor([[0.2, 0.0, 0.5, 0.3]]).expand(4, -1)
    u = torch.tensor([[0.1], [0.2], [0.65], [0.95]])
    assert _inverse_cdf(p, u).tolist() == [0, 2, 2, 3]
    u = torch.linspace(1e-6, 1 - 1e-6, 10001)[:, None]
    drawn = _inverse_cdf(p[:1].expand(len(u), -1), u)
    assert 1 not in drawn.tolist()
    freq = torch.bincount(drawn, minlength=4).float() / len(u)
    torch.testing.assert_close(freq, p[0], atol=1e-3, rtol=0)
