"""Rejection sampling is lossless: emitted tokens follow the target, whatever the drafter."""

from __future__ import annotations

import pytest
import torch

from dspark.spec.verifier import VerifyInput, verify

V, K, N = 4, 2, 20000
# chi-square critical value, 15 degrees of freedom, significance 0.001 (deterministic seeds)
CHI2_CRIT_15 = 37.70


def _tables(seed: int):
    g = torch.Generator().manual_seed(seed)
    p1 = torch.rand(V, generator=g).softmax(0)  # target p(x1)
    p2 = (2 * torch.rand(V, V, generator=g)).softmax(1)  # target p(x2 | x1)
    return p1, p2, g


def _run(p1, p2, q1, q2, g, verify_len=K, greedy=False):
    """N one-step trials of [anchor, x1, x2]; returns the first two emitted tokens per trial.

    When the step emits only one token, the second comes from the target given the first
    (what the next step would do), with independent randomness.
    """
    x1 = torch.multinomial(q1, N, replacement=True, generator=g)  # [N]
    x2 = torch.multinomial(q2[x1], 1, generator=g)[:, 0]  # [N]
    target_rows = torch.stack([p1.expand(N, V), p2[x1], torch.full((N, V), 1.0 / V)], dim=1)
    out = verify(VerifyInput(
        target_probs=target_rows[:, : verify_len + 1].reshape(-1, V),
        draft_probs=torch.stack([q1.expand(N, V), q2[x1]], dim=1),
        draft_tokens=torch.stack([x1, x2], dim=1),
        verify_len=torch.full((N,), verify_len),
        cu_num_tokens=torch.arange(N + 1) * (verify_len + 1),
        anchor_positions=torch.full((N,), 10),
        seeds=torch.arange(N),
        is_greedy=torch.full((N,), greedy),
    ))  # fmt: skip
    first = out.tokens[:, 0]
    second = torch.where(out.num_accepted >= 1, out.tokens[:, 1],
                         torch.multinomial(p2[first], 1, generator=g)[:, 0])  # fmt: skip
    return first, second, out, x1


def _assert_joint_is_target(first, second, p1, p2):
    counts = torch.bincount(first * V + second, minlength=V * V).float()
    expected = (p1[:, None] * p2).reshape(-1) * N
    stat = ((counts - expected) ** 2 / expected).sum().item()
    assert stat < CHI2_CRIT_15, f"chi2 {stat:.1f}"


@pytest.mark.parametrize("seed", [0, 1])
def test_random_drafter_gives_the_target_joint(seed):
    p1, p2, g = _tables(seed)
    q1 = torch.rand(V, generator=g).softmax(0)
    q2 = torch.rand(V, V, generator=g).softmax(1)
    first, second, out, _ = _run(p1, p2, q1, q2, g)
    _assert_joint_is_target(first, second, p1, p2)
    assert 0 < out.num_accepted.float().mean() < K


def test_oracle_drafter_accepts_everything():
    p1, p2, g = _tables(2)
    first, second, out, _ = _run(p1, p2, p1, p2, g)
    assert (out.num_accepted == K).all()
    _assert_joint_is_target(first, second, p1, p2)


def test_adversarial_drafter_still_gives_the_target():
    p1, p2, g = _tables(3)
    worst1 = torch.full((V,), 1e-4).scatter(0, p1.argmin()[None], 1.0)
    worst1 /= worst1.sum()
    worst2 = torch.full((V, V), 1e-4).scatter(1, p2.argmin(1, keepdim=True), 1.0)
    worst2 /= worst2.sum(1, keepdim=True)
    first, second, out, _ = _run(p1, p2, worst1, worst2, g)
    _assert_joint_is_target(first, second, p1, p2)


def test_verify_len_zero_emits_one_target_sample():
    p1, p2, g = _tables(4)
    first, second, out, _ = _run(p1, p2, p2[0], p2, g, verify_len=0)
    assert (out.num_accepted == 0).all()
    _assert_joint_is_target(first, second, p1, p2)


def test_greedy_is_exact_match_with_the_argmax():
    p1, p2, g = _tables(5)
    q1 = torch.rand(V, generator=g).softmax(0)
    first, second, out, x1 = _run(p1, p2, q1, p2, g, greedy=True)
    assert (first == p1.argmax()).all()  # accepted or recovered, it is the argmax
    assert torch.equal(out.num_accepted >= 1, x1 == p1.argmax())  # kept iff it is the argmax


def test_ragged_layout_worked_example():
    # windows [3, 1, 2] (verify_len [2, 0, 1]); target rows 0..5; each request's drafts agree
    # with a one-hot target, so request 0 accepts 2 then takes the bonus from row 2, request 1
    # takes its bonus from row 3, request 2 accepts 1 and takes the bonus from row 5
    rows = torch.tensor([1, 2, 3, 0, 1, 2])  # argmax token of each target row
    target = torch.nn.functional.one_hot(rows, V).float()
    out = verify(VerifyInput(
        target_probs=target,
        draft_probs=torch.full((3, K, V), 1.0 / V),
        draft_tokens=torch.tensor([[1, 2], [3, 3], [1, 0]]),
        verify_len=torch.tensor([2, 0, 1]),
        cu_num_tokens=torch.tensor([0, 3, 4, 6]),
        anchor_positions=torch.tensor([5, 9, 0]),
        seeds=torch.tensor([0, 1, 2]),
        is_greedy=torch.tensor([False, False, True]),
    ))  # fmt: skip
    assert out.num_accepted.tolist() == [2, 0, 1]
    assert [out.tokens[r, : n + 1].tolist() for r, n in enumerate(out.num_accepted.tolist())] == [
        [1, 2, 3], [0], [1, 2]]  # fmt: skip


def test_greedy_fast_path_equals_general_verification_of_greedy_rows():
    # verify_greedy (argmax of logits, no distributions) must emit what verify() emits for rows
    # that are all greedy; random float logits have no ties, so the argmaxes agree
    from dspark.spec.verifier import verify_greedy

    g = torch.Generator().manual_seed(3)
    R, K, V = 5, 4, 11
    verify_len = torch.tensor([4, 0, 2, 4, 1])
    cu = torch.zeros(R + 1, dtype=torch.int64)
    cu[1:] = (verify_len + 1).cumsum(0)
    logits = torch.randn(int(cu[-1]), V, generator=g)
    drafts = torch.randint(0, V, (R, K), generator=g)
    target_argmax = logits.argmax(-1)
    drafts[0] = target_argmax[cu[0] : cu[0] + K]  # row 0: every draft is the argmax
    drafts[3, :2] = target_argmax[cu[3] : cu[3] + 2]  # row 3: two kept, then likely a miss
    fast = verify_greedy(logits, drafts, verify_len, cu)
    general = verify(
        VerifyInput(
            target_probs=logits.softmax(-1), draft_probs=torch.full((R, K, V), 1.0 / V),
            draft_tokens=drafts, verify_len=verify_len, cu_num_tokens=cu,
            anchor_positions=torch.arange(R) * 10, seeds=torch.arange(R),
            is_greedy=torch.ones(R, dtype=torch.bool),
        )
    )  # fmt: skip
    assert fast.num_accepted.tolist() == general.num_accepted.tolist()
    assert fast.num_accepted[0] == 4 and fast.num_accepted[1] == 0
    for r in range(R):
        n = int(fast.num_accepted[r]) + 1
        assert fast.tokens[r, :n].tolist() == general.tokens[r, :n].tolist()


def test_accepted_prefixes_follow_each_drafts_own_target_row():
    # A ragged batch, greedy and sampled rows mixed, against a per-(row, slot) loop: a sampled
    # draft is kept iff u < p_t / p_d at its window row, a greedy one iff it is that row's
    # argmax, left to right within verify_len. Wrong target rows or wrong draft columns (the
    # indexing verify() does without a [R, K, V] copy) change the prefixes.
    from dspark.sample.random import STREAM_ACCEPT, uniform

    g = torch.Generator().manual_seed(5)
    R, K, V = 6, 3, 7
    verify_len = torch.tensor([3, 0, 2, 3, 1, 3])
    cu = torch.zeros(R + 1, dtype=torch.int64)
    cu[1:] = (verify_len + 1).cumsum(0)
    target = torch.rand(int(cu[-1]), V, generator=g).pow(4).softmax(-1)
    draft_probs = torch.rand(R, K, V, generator=g).softmax(-1)
    drafts = torch.randint(0, V, (R, K), generator=g)
    drafts[3] = target[cu[3] : cu[3] + K].argmax(-1)  # a greedy row whose drafts all match
    is_greedy = torch.tensor([False, False, True, True, False, False])
    positions, seeds = torch.arange(R) * 10, torch.arange(R) + 100
    out = verify(VerifyInput(target, draft_probs, drafts, verify_len, cu, positions, seeds,
                             is_greedy))  # fmt: skip
    for r in range(R):
        kept = 0
        for k in range(int(verify_len[r])):
            row, x = int(cu[r]) + k, int(drafts[r, k])
            if is_greedy[r]:
                ok = x == int(target[row].argmax())
            else:
                u = uniform(seeds[r : r + 1], positions[r : r + 1] + 1 + k, STREAM_ACCEPT)
                ok = float(u) * float(draft_probs[r, k, x]) < float(target[row, x])
            if not ok:
                break
            kept += 1
        assert int(out.num_accepted[r]) == kept, r
        assert out.tokens[r, :kept].tolist() == drafts[r, :kept].tolist()
    assert int(out.num_accepted[3]) == 3 and int(out.num_accepted[1]) == 0
