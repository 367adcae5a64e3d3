"""The fused greedy Markov slot against PyTorch's: the first maximal token of U[k] + W2 W1[x[k-1]].

CPU (interpreter): V 300 over BLOCK_V 128 (a ragged last slice), rank 16, up to 17 rows (two
row blocks). GPU: SmolLM2's V 49,152 and rank 64, up to 257 rows. Inputs are strided views of a
block, as draft_block passes them: base[:, k], tokens[:, k - 1] in, tokens[:, k] out.
"""

from __future__ import annotations

import pytest
import torch

from dspark.kernels.markov_greedy_triton import (
    BLOCK_V,
    arrival_counters,
    markov_greedy,
    markov_greedy_ref,
)

SHAPES = {"cpu": (300, 16, (1, 3, 17)), "cuda": (49152, 64, (1, 16, 64, 257))}  # V, rank, rows
K = 3


def _block(R: int, V: int, rank: int, dtype: torch.dtype, device: torch.device, seed: int):
    g = torch.Generator(device=device).manual_seed(seed)
    base = torch.randn(R, K, V, generator=g, device=device).to(dtype)  # the LM head's output
    w1 = (torch.randn(V, rank, generator=g, device=device) * 0.5).to(dtype)
    w2 = (torch.randn(V, rank, generator=g, device=device) * rank**-0.5).to(dtype)
    tokens = torch.randint(0, V, (R, K), generator=g, device=device)
    return base, w1, w2, tokens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_slot_is_the_first_maximal_token(device, dtype):
    V, rank, row_counts = SHAPES[device.type]
    for R in row_counts:
        base, w1, w2, tokens = _block(R, V, rank, dtype, device, seed=R)
        for k in range(1, K):  # slot k from the token drafted at k - 1, written in place
            expect = markov_greedy_ref(base[:, k], tokens[:, k - 1], w1, w2)
            markov_greedy(base[:, k], tokens[:, k - 1], w1, w2, out=tokens[:, k])
            got = tokens[:, k]
            if dtype == torch.float32:
                assert torch.equal(got, expect), (R, k)
                continue
            # bf16: the bias's float32 sum may round to the other side of a bf16 step, so a
            # different token is allowed only where its logit is within that step of the max
            logits = base[:, k].float() + torch.nn.functional.linear(
                w1[tokens[:, k - 1]], w2
            ).float()  # fmt: skip
            best = logits.max(dim=-1).values
            chosen = logits.gather(1, got[:, None])[:, 0]
            assert (best - chosen <= 2**-7 * best.abs().clamp(min=1)).all(), (R, k)
            assert (got == expect).float().mean() > 0.9
        assert arrival_counters(device, 1)[0] == 0  # reset for the next launch


def test_ties_go_to_the_first_index_within_and_across_slices(device):
    V, rank, _ = SHAPES[device.type]
    base = torch.zeros(3, V, device=device)
    w1 = torch.randn(V, rank, device=device)
    w2 = torch.zeros(V, rank, device=device)  # no bias: the base logits decide
    base[0, [BLOCK_V + 7, 5]] = 2.0  # across slices: 5 wins
    base[1, [BLOCK_V + 9, BLOCK_V + 3]] = 1.0  # within one slice: the smaller column
    base[2, V - 1] = 0.5  # the ragged last slice's last column
    out = torch.empty(3, dtype=torch.int64, device=device)
    markov_greedy(base, torch.zeros(3, dtype=torch.int64, device=device), w1, w2, out=out)
    assert out.tolist() == [5, BLOCK_V + 3, V - 1]
    assert markov_greedy_ref(base, torch.zeros(3, dtype=torch.int64, device=device), w1,
                             w2).tolist() == [5, BLOCK_V + 3, V - 1]  # fmt: skip


def tiny_rank16_drafter(tmp_path, device: torch.device):
    """The drafter of tests/test_dspark_drafter.py with Markov rank 16 (the kernels' smallest),
    over a random fp32 target of hidden size 32 and vocabulary 96, on `device`."""
    from safetensors.torch import load_file

    from dspark.models.llama import build_model
    from dspark.models.model_config import ModelConfig
    from tests.test_dspark_drafter import _drafter
    from tests.tiny_models import _llama_config, save_random_model

    hf = _llama_config(96, num_attention_heads=4, num_key_value_heads=2, hidden_size=32,
                       intermediate_size=64)  # fmt: skip
    save_random_model(tmp_path, hf)
    config = ModelConfig.from_hf_dict(hf.to_dict() | {"architectures": ["LlamaForCausalLM"]})
    target = build_model(config, load_file(tmp_path / "model.safetensors"), torch.float32,
                         torch.device("cpu"))  # fmt: skip
    drafter = _drafter(target, markov_rank=16)
    target.to(device), drafter.to(device)
    return drafter


def test_draft_block_on_the_triton_backend_equals_the_pytorch_loop(tmp_path, device):
    """A greedy block drafted slot by slot with the fused kernel: the PyTorch loop's tokens and
    confidences (fp32; the drafter of tests/test_dspark_drafter.py with rank 16; on the CPU
    through the interpreter)."""
    from dspark.spec.drafting import draft_block
    from tests.test_dspark_drafter import K as DRAFT_LEN
    from tests.test_dspark_drafter import _st

    drafter = tiny_rank16_drafter(tmp_path, device)
    n = 5
    hidden = torch.randn(n, DRAFT_LEN, 32, device=device)
    anchors = torch.tensor([3, 7, 7, 50, 95], device=device)
    blocks = []
    with torch.no_grad():
        for fused in (False, True):
            drafter.use_triton = fused
            st = _st(n, 0.0, torch.arange(n))
            st = type(st)(**{k: v.to(device) if isinstance(v, torch.Tensor) else v
                             for k, v in st.__dict__.items()})  # fmt: skip
            blocks.append(draft_block(drafter, hidden, anchors,
                                      torch.full((n,), 20, device=device), st))  # fmt: skip
    torch_block, fused_block = blocks
    assert torch.equal(fused_block.tokens, torch_block.tokens)
    assert fused_block.probs is None and torch_block.probs is None
    torch.testing.assert_close(fused_block.confidence_logits, torch_block.confidence_logits)
    # slot 1's confidence is a function of slot 0's token (and h[1]), as the loop computed it
    x0 = torch_block.tokens[:, 0]
    torch.testing.assert_close(torch_block.confidence_logits[:, 1],
                               drafter.confidence_logit(hidden[:, 1], x0))  # fmt: skip
