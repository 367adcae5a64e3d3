"""Greedy verification's bookkeeping in one launch: `verify_greedy` (spec/verifier.py) after the
target's argmax.

Given the target's token at every window row, each request keeps its drafts up to the first one
that differs from the target's (or up to verify_len), then emits the target's token at the row
after its last kept draft. Written in PyTorch that is about fifteen small kernels (gather, eq,
lt, and, not, cumsum, eq, sum, gather, where, zeros, cat, scatter); each is a launch of a few
microseconds in every greedy speculative step. Here one program takes one request's window:

    window r: rows cu[r] .. cu[r] + verify_len[r] of target_tokens (the anchor's row first)
    slot k (0 .. K - 1) accepts iff k < verify_len[r] and draft[r, k] == target_tokens[cu[r] + k]
    num_accepted = the first slot that does not accept (K + 1 slots are looked at, and slot K
                   never accepts, so it is at most verify_len[r])
    tokens[r]    = [draft[r, 0 .. n - 1], target_tokens[cu[r] + n], 0, ...]     n = num_accepted

    Worked example (K = 3): cu [0, 4, 5], verify_len [3, 0], target_tokens [7 8 2 5 | 9],
    drafts [[7 8 4], [1 1 1]]: row 0 keeps 7, 8 and rejects 4 at slot 2, so n = 2 and it emits
    [7 8 2 0]; row 1 verifies nothing, n = 0, and emits [9 0 0 0].

The results equal verify_greedy's exactly (integers). Under TRITON_INTERPRET=1 (CPU tensors) it
runs in Triton's interpreter; set the variable before this module is imported.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from dspark.kernels.pdl import gdc_enter, pdl_options


@triton.jit
def _verify_greedy_kernel(
    target_tokens_ptr, draft_ptr, verify_len_ptr, cu_ptr, tokens_ptr, num_accepted_ptr,
    num_target_rows, s_draft, s_draft_k, s_tokens,
    K: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    r = tl.program_id(0).to(tl.int64)
    k = tl.arange(0, BLOCK)  # slots 0 .. K (K: the bonus slot), padded to a power of two
    gdc_enter(PDL)
    start = tl.load(cu_ptr + r).to(tl.int64)
    verify_len = tl.load(verify_len_ptr + r)
    rows = tl.minimum(start + k, num_target_rows - 1)  # rows past the window: never used
    target = tl.load(target_tokens_ptr + rows, mask=k <= K, other=0).to(tl.int64)
    draft = tl.load(draft_ptr + r * s_draft + k * s_draft_k, mask=k < K, other=-1).to(tl.int64)
    accept = (draft == target) & (k < verify_len)
    n = tl.min(tl.where(accept, BLOCK, k), axis=0)  # the first slot that does not accept
    final = tl.sum(tl.where(k == n, target, 0), axis=0)
    out = tl.where(k < n, draft, tl.where(k == n, final, 0))
    tl.store(tokens_ptr + r * s_tokens + k, out, mask=k <= K)
    tl.store(num_accepted_ptr + r, n.to(tl.int64))


def verify_greedy_triton(
    target_tokens: torch.Tensor,  # [T] the target's argmax at every window row
    draft_tokens: torch.Tensor,  # [R, K]
    verify_len: torch.Tensor,  # [R]
    cu_num_tokens: torch.Tensor,  # [R + 1] window starts
) -> tuple[torch.Tensor, torch.Tensor]:  # tokens [R, K + 1] int64, num_accepted [R] int64
    R, K = draft_tokens.shape
    assert target_tokens.dim() == 1 and verify_len.shape == (R,), (target_tokens.shape, R)
    assert cu_num_tokens.shape == (R + 1,), cu_num_tokens.shape
    tokens = torch.empty(R, K + 1, dtype=torch.int64, device=draft_tokens.device)
    num_accepted = torch.empty(R, dtype=torch.int64, device=draft_tokens.device)
    if R == 0:
        return tokens, num_accepted
    _verify_greedy_kernel[(R,)](
        target_tokens, draft_tokens, verify_len, cu_num_tokens, tokens, num_accepted,
        target_tokens.shape[0], *draft_tokens.stride(), tokens.stride(0),
        K=K, BLOCK=triton.next_power_of_2(K + 1), num_warps=1,
        **pdl_options(draft_tokens.device),
    )  # fmt: skip
    return tokens, num_accepted
