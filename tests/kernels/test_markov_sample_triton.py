"""The fused sampled Markov slot against PyTorch's: p = softmax((U[k] + W2 W1[x[k-1]]) / T)
written for verification, x[k] drawn from p by inversion with the row's uniform, greedy rows
the first maximal token.

CPU (interpreter): V 300 over BLOCK_V 128 (a ragged last slice), rank 16, up to 17 rows (two
row blocks). GPU: SmolLM2's V 49,152 and rank 64, up to 257 rows. Inputs are strided views of a
block, as draft_block passes them.
"""

from __future__ import annotations

import math

import pytest
import torch

from dspark.kernels.markov_greedy_triton import BLOCK_V
from dspark.kernels.markov_sample_triton import markov_sample, markov_sample_ref
from tests.kernels.test_markov_greedy_triton import SHAPES, _block, tiny_rank16_drafter

K = 3


def _temperatures(R: int, device: torch.device) -> torch.Tensor:
    """Rows cycling through T = 1, greedy, 0.7 and 1.5."""
    return torch.tensor([1.0, 0.0, 0.7, 1.5], device=device).repeat(R)[:R].contiguous()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_each_slot_draws_the_reference_token_and_writes_its_distribution(device, dtype):
    V, rank, row_counts = SHAPES[device.type]
    for R in row_counts:
        base, w1, w2, tokens = _block(R, V, rank, dtype, device, seed=R)
        temperature = _temperatures(R, device)
        probs = torch.zeros(R, K, V, device=device)
        g = torch.Generator(device=device).manual_seed(R)
        for k in range(1, K):
            u = torch.rand(R, 1, generator=g, device=device)
            expect, expect_probs = markov_sample_ref(base[:, k], tokens[:, k - 1], w1, w2,
                                                     temperature, u)  # fmt: skip
            markov_sample(base[:, k], tokens[:, k - 1], w1, w2, temperature, u,
                          out=tokens[:, k], probs=probs[:, k])  # fmt: skip
            if dtype == torch.float32:
                assert torch.equal(tokens[:, k], expect), (R, k)
                torch.testing.assert_close(probs[:, k], expect_probs, rtol=1e-5, atol=1e-7)
            else:  # the bias's bf16 rounding may differ by a step (markov_greedy's test)
                torch.testing.assert_close(probs[:, k], expect_probs, rtol=0.05, atol=5e-3)
                assert (tokens[:, k] == expect).float().mean() > 0.9
            assert torch.allclose(probs[:, k].sum(dim=-1), torch.ones(R, device=device))


def test_the_docstring_example_and_the_inversion_over_a_grid_of_uniforms(device):
    """p = [1 1 2 1 1 1] / 7 (no bias): u = 0.5 draws column 2, and over a grid of uniforms
    every draw is the reference's, so each token is drawn on its share of (0, 1)."""
    V, rank, _ = SHAPES[device.type]
    n = 257
    base = torch.zeros(n, V, device=device)
    base[:, 2] = math.log(2.0)
    base[:, 6:] = -1e4  # (tokens past the example's six: probability 0)
    w1 = torch.randn(V, rank, device=device)
    w2 = torch.zeros(V, rank, device=device)
    prev = torch.zeros(n, dtype=torch.int64, device=device)
    temperature = torch.ones(n, device=device)
    u = ((torch.arange(n, device=device) + 0.5) / n)[:, None]
    u[0] = 0.5
    out = torch.empty(n, dtype=torch.int64, device=device)
    probs = torch.empty(n, V, device=device)
    markov_sample(base, prev, w1, w2, temperature, u, out=out, probs=probs)
    assert out[0].item() == 2
    torch.testing.assert_close(probs[0, :6], torch.tensor([1, 1, 2, 1, 1, 1.0], device=device) / 7)
    expect, _ = markov_sample_ref(base, prev, w1, w2, temperature, u)
    assert torch.equal(out, expect)
    counts = torch.bincount(out[1:], minlength=6)[:6].float() / (n - 1)
    torch.testing.assert_close(counts, probs[0, :6], atol=2 / n, rtol=0)


def test_greedy_rows_take_the_first_maximal_token_across_slices(device):
    V, rank, _ = SHAPES[device.type]
    base = torch.zeros(2, V, device=device)
    base[0, [BLOCK_V + 7, 5]] = 2.0  # across slices: 5 wins
    base[1, [BLOCK_V + 9, BLOCK_V + 3]] = 1.0  # within one slice: the smaller column
    w1 = torch.randn(V, rank, device=device)
    w2 = torch.zeros(V, rank, device=device)
    out = torch.empty(2, dtype=torch.int64, device=device)
    probs = torch.empty(2, V, device=device)
    markov_sample(base, torch.zeros(2, dtype=torch.int64, device=device), w1, w2,
                  torch.zeros(2, device=device), torch.full((2, 1), 0.99, device=device),
                  out=out, probs=probs)  # fmt: skip
    assert out.tolist() == [5, BLOCK_V + 3]
    torch.testing.assert_close(probs, base.softmax(dim=-1))  # T = 1's, never read


def test_draft_block_with_the_fused_sampled_slot_equals_the_pytorch_loop(
    tmp_path, device, monkeypatch
):
    """A sampled block (temperatures 1, 0.7 and greedy rows) drafted with the fused slot: the
    PyTorch loop's tokens and distributions (fp32; on the CPU through the interpreter)."""
    from dspark.spec import drafting
    from tests.test_dspark_drafter import K as DRAFT_LEN
    from tests.test_dspark_drafter import _st

    drafter = tiny_rank16_drafter(tmp_path, device)
    n = 5
    hidden = torch.randn(n, DRAFT_LEN, 32, device=device)
    anchors = torch.tensor([3, 7, 7, 50, 95], device=device)
    positions = torch.full((n,), 20, device=device)
    st = _st(n, 1.0, torch.arange(n))
    st = type(st)(**{k: v.to(device) if isinstance(v, torch.Tensor) else v
                     for k, v in st.__dict__.items()})  # fmt: skip
    st.temperature[1], st.temperature[3] = 0.0, 0.7
    from dspark.kernels import markov_sample_triton

    calls = []
    kernel = markov_sample_triton.markov_sample
    monkeypatch.setattr(markov_sample_triton, "markov_sample",
                        lambda *a, **kw: calls.append(1) or kernel(*a, **kw))  # fmt: skip
    blocks = []
    with torch.no_grad():
        for fused in (False, True):
            drafter.use_triton = fused
            monkeypatch.setattr(drafting, "FUSED_SAMPLED", fused)
            blocks.append(drafting.draft_block(drafter, hidden, anchors, positions, st))
    assert len(calls) == DRAFT_LEN  # one fused slot a position, in the second block only
    torch_block, fused_block = blocks
    assert torch.equal(fused_block.tokens, torch_block.tokens)
    torch.testing.assert_close(fused_block.probs, torch_block.probs, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(fused_block.confidence_logits, torch_block.confidence_logits)


def test_plain_rows_draw_the_samplers_tokens(device, monkeypatch):
    """sample_rows (no Markov bias, no distribution kept) draws `sample`'s tokens: greedy rows
    their argmax, the others by inversion with their (seed, position) uniform (fp32)."""
    from dspark.kernels.markov_sample_triton import sample_rows
    from dspark.sample import sampler
    from dspark.sample.random import STREAM_SAMPLE, uniform

    V = SHAPES[device.type][0]
    for n in (1, 5, 17):
        g = torch.Generator(device=device).manual_seed(n)
        logits = torch.randn(n, V, generator=g, device=device) * 3
        temperature = _temperatures(n, device)
        st = sampler.SamplingTensors(
            temperature, torch.full((n,), V, device=device), torch.ones(n, device=device),
            torch.arange(n, device=device) * 7919, torch.arange(n, device=device) + 100,
            all_greedy=False, any_top_k=False, any_top_p=False,
        )  # fmt: skip
        monkeypatch.setattr(sampler, "FUSED_SAMPLE", False)
        expect = sampler.sample(logits, st)  # the PyTorch path
        out = torch.empty(n, dtype=torch.int64, device=device)
        u = uniform(st.seeds, st.positions, STREAM_SAMPLE)
        assert torch.equal(sample_rows(logits, temperature, u, out), expect), n
        if device.type == "cuda":  # sample() takes it with the flag on
            monkeypatch.setattr(sampler, "FUSED_SAMPLE", True)
            assert torch.equal(sampler.sample(logits, st), expect)


def test_plain_rows_draw_the_same_tokens_with_pad_rows_after_them(device):
    """What a captured sampling graph relies on (runner/sampled_decode_graphs.py): sampling a
    graph's G rows gives its first B rows the tokens sampling those B rows alone gives, whatever
    the pad rows after them hold."""
    from dspark.kernels.markov_sample_triton import sample_rows
    from dspark.sample.random import STREAM_SAMPLE, uniform

    V = SHAPES[device.type][0]
    B, G = 3, 8
    g = torch.Generator(device=device).manual_seed(0)
    logits = torch.randn(G, V, generator=g, device=device) * 3
    logits[B:] *= 40  # pad rows: other logits, temperatures, seeds and positions
    temperature = torch.tensor([1.0, 0.0, 0.7, 0.0, 2.0, 1.0, 0.5, 1.0], device=device)
    seeds = torch.arange(G, device=device) * 7919 - 5
    positions = torch.arange(G, device=device) + 100
    u = uniform(seeds, positions, STREAM_SAMPLE)
    alone = sample_rows(logits[:B], temperature[:B].contiguous(), u[:B],
                        torch.empty(B, dtype=torch.int64, device=device))  # fmt: skip
    padded = sample_rows(logits, temperature, u, torch.empty(G, dtype=torch.int64, device=device))
    assert torch.equal(padded[:B], alone)
