"""Sampler: masks, determinism, and the empirical distribution against softmax(logits)."""

from __future__ import annotations

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.sample.random import STREAM_DRAFT, STREAM_SAMPLE, uniform
from dspark.sample.sampler import SamplingTensors, apply_top_k_top_p, sample, sampling_probs
from tests.helpers import full_logits

NUM_SAMPLES = 6000
# Chi-square critical values at significance 0.001 by degrees of freedom (the test is
# deterministic, seeds are fixed; the threshold says how unlikely a pass-by-chance mismatch is).
CHI2_CRIT_001 = {
    1: 10.83,
    2: 13.82,
    3: 16.27,
    4: 18.47,
    5: 20.52,
    6: 22.46,
    7: 24.32,
    8: 26.12,
    9: 27.88,
    10: 29.59,
    11: 31.26,
}


def _tensors(n, temperature=1.0, top_k=None, top_p=1.0, vocab=12, seeds=None, positions=None):
    return SamplingTensors(
        temperature=torch.full((n,), temperature),
        top_k=torch.full((n,), top_k or vocab, dtype=torch.int64),
        top_p=torch.full((n,), top_p),
        seeds=torch.arange(n, dtype=torch.int64) if seeds is None else seeds,
        positions=torch.zeros(n, dtype=torch.int64) if positions is None else positions,
        all_greedy=temperature == 0.0,
        any_top_k=top_k is not None,
        any_top_p=top_p < 1.0,
    )


def test_top_k_and_top_p_masks():
    logits = torch.log(torch.tensor([[0.5, 0.2, 0.15, 0.1, 0.05]]))
    k2 = apply_top_k_top_p(logits, torch.tensor([2]), None)
    assert torch.isfinite(k2).tolist() == [[True, True, False, False, False]]
    # nucleus 0.8: 0.5 + 0.2 = 0.7 < 0.8, so the third token is still needed
    p8 = apply_top_k_top_p(logits, None, torch.tensor([0.8]))
    assert torch.isfinite(p8).tolist() == [[True, True, True, False, False]]
    tiny = apply_top_k_top_p(logits, None, torch.tensor([1e-6]))
    assert torch.isfinite(tiny).sum() == 1  # never an empty nucleus


def test_the_top_k_path_keeps_what_the_full_sort_keeps():
    """max_top_k: top-k and top-p over each row's max_top_k largest logits only, the same
    kept logits as sorting the vocabulary (continuous random logits: no ties), and a row of
    top-k 1 keeps its argmax."""
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 500, generator=g) * 3
    top_k = torch.tensor([1, 5, 20, 20, 40, 40])
    for top_p in (None, torch.tensor([1.0, 0.9, 0.8, 0.5, 0.95, 0.3])):
        full = apply_top_k_top_p(logits, top_k, top_p)
        fast = apply_top_k_top_p(logits, top_k, top_p, max_top_k=40)
        assert torch.equal(torch.isfinite(fast), torch.isfinite(full))
        assert torch.equal(fast[torch.isfinite(fast)], full[torch.isfinite(full)])
    assert torch.isfinite(fast[0]).sum() == 1 and torch.isfinite(fast[0, logits[0].argmax()])
    st = _tensors(6, 1.0, 40, 0.8, vocab=500)
    fast_st = SamplingTensors(**{**st.__dict__, "max_top_k": 40})
    torch.testing.assert_close(sampling_probs(logits, fast_st), sampling_probs(logits, st))


def test_uniforms_are_deterministic_open_and_stream_separated():
    seeds, pos = torch.tensor([0, 1, 2**62]), torch.tensor([5, 5, 7])
    u = uniform(seeds, pos, STREAM_SAMPLE, 1000)
    assert torch.equal(u, uniform(seeds, pos, STREAM_SAMPLE, 1000))
    assert (u > 0).all() and (u < 1).all()
    assert not torch.equal(u, uniform(seeds, pos, STREAM_DRAFT, 1000))
    assert abs(u.mean().item() - 0.5) < 0.02
    # a row's numbers do not depend on the other rows
    assert torch.equal(uniform(seeds[1:2], pos[1:2], STREAM_SAMPLE, 1000), u[1:2])


def _chi_square(counts: torch.Tensor, probs: torch.Tensor, n: int) -> tuple[float, int]:
    """Pearson statistic over cells with expected count >= 5 (rare ones pooled)."""
    expected = probs * n
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    return stat, int(keep.sum()) - 1


@pytest.mark.parametrize(
    "temperature,top_k,top_p", [(1.0, None, 1.0), (0.7, None, 1.0), (1.0, 4, 1.0), (1.0, None, 0.8)]
)
def test_sampler_distribution_matches_probs(temperature, top_k, top_p):
    logits = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -2.0, -3.0, 1.2, 0.3, -0.2])
    st = _tensors(NUM_SAMPLES, temperature, top_k, top_p)
    tokens = sample(logits.expand(NUM_SAMPLES, -1).clone(), st)
    counts = torch.bincount(tokens, minlength=12).float()
    probs = sampling_probs(logits[None], _tensors(1, temperature, top_k, top_p))[0]
    assert counts[probs == 0].sum() == 0, "a masked token was sampled"
    stat, dof = _chi_square(counts, probs, NUM_SAMPLES)
    assert stat < CHI2_CRIT_001[dof], f"chi2 {stat:.1f} with {dof} dof"


def test_engine_next_token_distribution_matches_softmax(tiny_vocab_dir):
    """End to end: 6000 seeded requests of one prompt, temperature 1, first token only."""
    llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=2048)
    prompt = [2, 3, 4]
    params = [SamplingParams(temperature=1.0, seed=s, max_tokens=1) for s in range(NUM_SAMPLES)]
    outs = llm.generate([prompt] * NUM_SAMPLES, params, use_tqdm=False)
    tokens = torch.tensor([o.outputs[0].token_ids[0] for o in outs])
    probs = full_logits(llm.engine.model, prompt).logits[-1].softmax(-1)
    counts = torch.bincount(tokens, minlength=probs.numel()).float()
    stat, dof = _chi_square(counts, probs, NUM_SAMPLES)
    assert stat < CHI2_CRIT_001[dof], f"chi2 {stat:.1f} with {dof} dof"
    assert probs.max() > 0.2, "the tiny model's distribution should be far from uniform"


def test_greedy_rows_take_the_argmax_in_a_mixed_batch():
    logits = torch.randn(4, 12)
    st = _tensors(4, 1.0)
    st = SamplingTensors(**{**st.__dict__, "temperature": torch.tensor([0.0, 1.0, 0.0, 1.0])})
    tokens = sample(logits, st)
    assert tokens[0] == logits[0].argmax() and tokens[2] == logits[2].argmax()


def test_sampling_rows_tell_the_largest_top_k_of_the_step():
    """The host knows every row's top-k: max_top_k is their largest (vocab_size when a row has
    none, which keeps the full sort)."""
    import numpy as np

    from dspark.sample.sampling_rows import SamplingRows

    rows = SamplingRows(3, 100)
    rows.top_k[:] = [20, 40, 100]
    positions = np.zeros(3, dtype=np.int64)
    assert rows.stage(np.array([0, 1]), positions[:2]).max_top_k == 40
    assert rows.stage(np.array([0, 2]), positions[:2]).max_top_k == 100


def test_sampling_rows_stage_each_sampled_rows_parameters_in_row_order():
    """stage packs the sampled rows' fields field after field; each tensor is its rows'
    parameters in the order asked, and the token positions as given."""
    import numpy as np

    from dspark.sample.sampling_rows import SamplingRows

    rows = SamplingRows(4, 100)
    rows.temperature[:] = [0.5, 0.0, 1.0, 0.7]
    rows.top_k[:] = [100, 10, 20, 100]
    rows.top_p[:] = [1.0, 0.9, 0.8, 1.0]
    rows.seed[:] = [11, 12, 13, 14]
    st = rows.stage(np.array([2, 0, 3]), np.array([7, 8, 9], dtype=np.int64))
    assert st.temperature.tolist() == [1.0, 0.5, pytest.approx(0.7)]
    assert st.top_k.tolist() == [20, 100, 100]
    assert st.top_p.tolist() == [pytest.approx(0.8), 1.0, 1.0]
    assert st.seeds.tolist() == [13, 11, 14]
    assert st.positions.tolist() == [7, 8, 9]
    assert (st.all_greedy, st.any_top_k, st.any_top_p, st.max_top_k) == (False, True, True, 100)
