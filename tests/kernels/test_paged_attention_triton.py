"""paged_attention_triton against paged_attention_ref over ragged paged batches.

Every batch is built to catch stray reads and writes: pages are shuffled, the KV cache is NaN
everywhere except the live slots of each request (page tails stay NaN), block-table padding
points at an all-NaN page, and the output is NaN-poisoned before the kernel runs. On the CPU
the kernels run in Triton's interpreter (see conftest.py) at tiny shapes; on a GPU the same
tests run at SmolLM2-like shapes (9 heads, 3 kv heads, head_dim 64).
"""

from __future__ import annotations

import dataclasses
import random

import pytest
import torch

from dspark.attention_metadata import AttentionMetadata
from dspark.kernels.paged_attention_ref import paged_attention_ref
from dspark.kernels.paged_attention_triton import launch_config, paged_attention_triton


def _many(num_reqs: int, max_q_len: int, max_context: int, seed: int) -> tuple[list, list]:
    rng = random.Random(seed)
    q_lens = [rng.choice([0, 1, 1, 2, 3, 5, 8, rng.randint(1, max_q_len)]) for _ in range(num_reqs)]
    return q_lens, [q + rng.randint(0, max_context) for q in q_lens]


# name -> (q_lens, seq_lens); the same names on both devices, larger lengths on the GPU
CASES = {
    "cpu": {
        "decode_one": ([1], [1]),
        "decode_page_edges": ([1] * 7, [3, 4, 5, 15, 16, 17, 32]),
        "windows": ([2, 4, 8, 3], [2, 9, 40, 17]),
        "empty_requests": ([0, 3, 0, 1, 0], [6, 3, 2, 17, 16]),
        "prefill_full": ([40], [40]),
        "prefill_chunk": ([37], [70]),
        "mixed": ([33, 1, 5, 0, 1], [48, 33, 16, 4, 64]),
        "long_context": ([1, 3, 8, 1], [300, 200, 257, 129]),  # many KV tiles and splits
        "many": _many(16, 12, 40, seed=0),
    },
    "cuda": {
        "decode_one": ([1], [1]),
        "decode_page_edges": ([1] * 9, [3, 4, 5, 15, 16, 17, 32, 1023, 2048]),
        "windows": ([2, 4, 8, 3, 6], [2, 9, 400, 17, 2000]),
        "empty_requests": ([0, 3, 0, 1, 0], [600, 3, 2, 1700, 16]),
        "prefill_full": ([1000], [1000]),
        "prefill_chunk": ([512], [1537]),
        "mixed": ([300, 1, 5, 0, 1, 8], [480, 33, 16, 4, 2048, 900]),
        "long_context": ([1, 3, 8, 1], [3000, 2000, 2570, 1290]),
        "many": _many(200, 64, 2000, seed=0),
    },
}
HEADS = {  # name -> (num_heads, num_kv_heads, head_dim)
    "cpu": {"mha": (2, 2, 16), "gqa3": (6, 2, 32)},
    "cuda": {"mha": (4, 4, 64), "gqa3": (9, 3, 64)},
}
TOLERANCE = {  # dtype -> (rtol, atol) against the fp32 reference
    torch.float32: (1e-4, 2e-5),
    torch.float16: (3e-3, 3e-3),
    torch.bfloat16: (2e-2, 2e-2),
}


def make_metadata(
    q_lens: list[int], seq_lens: list[int], page_size: int, num_pages: int, device: torch.device
) -> AttentionMetadata:
    """Each request gets shuffled pages; block-table padding (one extra column at least) points
    at page num_pages - 1, which no request owns."""
    need = [-(-s // page_size) for s in seq_lens]
    pages = torch.randperm(num_pages - 1).tolist()
    block_table = torch.full((len(seq_lens), max(need, default=0) + 1), num_pages - 1)
    for r, n in enumerate(need):
        block_table[r, :n] = torch.tensor(pages[sum(need[:r]) : sum(need[: r + 1])])
    cu = [0]
    for q_len in q_lens:
        cu.append(cu[-1] + q_len)
    return AttentionMetadata(
        cu_num_tokens=torch.tensor(cu, dtype=torch.int32, device=device),
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
        slot_mapping=torch.zeros(cu[-1], dtype=torch.int64, device=device),  # unused here
        block_table=block_table.to(torch.int32).to(device),
        cu_num_tokens_cpu=tuple(cu),
        seq_lens_cpu=tuple(seq_lens),
    )


def make_batch(
    q_lens: list[int],
    seq_lens: list[int],
    heads: tuple[int, int, int],
    page_size: int,
    device: torch.device,
) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:  # fp32 q, kv_cache, metadata
    num_heads, num_kv_heads, head_dim = heads
    num_pages = sum(-(-s // page_size) for s in seq_lens) + 1
    attn = make_metadata(q_lens, seq_lens, page_size, num_pages, device)
    shape = (2, num_pages, page_size, num_kv_heads, head_dim)
    kv_cache = torch.full(shape, float("nan"), device=device)
    live = [
        attn.block_table[r, pos // page_size].item() * page_size + pos % page_size
        for r, s in enumerate(seq_lens)
        for pos in range(s)
    ]
    slots = kv_cache.view(2, -1, num_kv_heads, head_dim)  # [2, num_slots, nkv, hd]
    slots[:, live] = torch.randn(2, len(live), num_kv_heads, head_dim, device=device)
    q = torch.randn(attn.num_tokens, num_heads, head_dim, device=device)  # [T, nh, hd]
    return q, kv_cache, attn


def run_and_check(
    q: torch.Tensor,  # [T, nh, hd] fp32
    kv_cache: torch.Tensor,
    attn: AttentionMetadata,
    dtype: torch.dtype = torch.float32,
    num_kv_splits: int | None = None,
) -> None:
    scale = q.shape[2] ** -0.5
    expected = paged_attention_ref(q, kv_cache, attn, scale)  # [T, nh, hd] fp32
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=q.device)
    paged_attention_triton(
        q.to(dtype), kv_cache.to(dtype), attn, scale, out=out, num_kv_splits=num_kv_splits
    )
    assert not out.isnan().any(), "some output element was not written"
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)


def _skip_interpreted_bf16(device: torch.device, dtype: torch.dtype) -> None:
    if device.type == "cpu" and dtype == torch.bfloat16:
        pytest.skip("Triton's interpreter computes tl.dot on bf16 as raw integers")


@pytest.mark.parametrize("heads", ["mha", "gqa3"])
@pytest.mark.parametrize("page_size", [4, 16])
@pytest.mark.parametrize("case", list(CASES["cpu"]))
def test_matches_reference_fp32(device: torch.device, case: str, page_size: int, heads: str):
    q_lens, seq_lens = CASES[device.type][case]
    run_and_check(*make_batch(q_lens, seq_lens, HEADS[device.type][heads], page_size, device))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
@pytest.mark.parametrize("case", ["decode_page_edges", "windows", "mixed"])
def test_matches_reference_half(device: torch.device, case: str, dtype: torch.dtype):
    _skip_interpreted_bf16(device, dtype)
    q_lens, seq_lens = CASES[device.type][case]
    batch = make_batch(q_lens, seq_lens, HEADS[device.type]["gqa3"], 16, device)
    run_and_check(*batch, dtype=dtype)


@pytest.mark.parametrize("num_kv_splits", [2, 5])
@pytest.mark.parametrize("case", ["decode_page_edges", "windows", "empty_requests", "long_context"])
def test_kv_splits_match_reference(device: torch.device, case: str, num_kv_splits: int):
    q_lens, seq_lens = CASES[device.type][case]
    batch = make_batch(q_lens, seq_lens, HEADS[device.type]["gqa3"], 4, device)
    run_and_check(*batch, num_kv_splits=num_kv_splits)


def test_parts_without_keys_are_never_read(device: torch.device, monkeypatch):
    """With BLOCK_N-aligned parts a short context fills only the first few of a 5-way split
    (decode_page_edges: one part each; long_context: several): the others return at once and
    the merge reads only the parts this launch wrote. Their slots here hold NaN, as stale or
    fresh memory may, and no output is NaN."""
    real_empty = torch.empty

    def nan_empty(*args, **kwargs):
        t = real_empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t

    monkeypatch.setattr(torch, "empty", nan_empty)
    for case in ("decode_page_edges", "long_context", "windows"):
        q_lens, seq_lens = CASES[device.type][case]
        batch = make_batch(q_lens, seq_lens, HEADS[device.type]["gqa3"], 4, device)
        run_and_check(*batch, num_kv_splits=5)


def test_split_counters_left_zero_for_the_next_launch(device: torch.device):
    # the part that merges resets its block's counter: launch after launch, every merge is
    # right and the counters end at 0 (a stale count would make a wrong part merge early)
    from dspark.kernels.paged_attention_triton import _split_counters

    q_lens, seq_lens = CASES[device.type]["decode_page_edges"]
    batch = make_batch(q_lens, seq_lens, HEADS[device.type]["gqa3"], 4, device)
    for num_kv_splits in (3, 3, 4, 2):
        run_and_check(*batch, num_kv_splits=num_kv_splits)
    assert int(_split_counters(device, 1).count_nonzero()) == 0


def test_metadata_worked_example(device: torch.device):
    # the example of AttentionMetadata: windows [3, 1, 2], positions [7, 8, 9 | 4 | 0, 1]
    run_and_check(*make_batch([3, 1, 2], [10, 5, 2], (6, 2, 16), 4, device))


def test_non_power_of_two_page_size(device: torch.device):
    run_and_check(*make_batch([5, 1, 0, 2], [23, 10, 5, 5], (6, 2, 16), 5, device))


def test_strided_q_from_fused_qkv(device: torch.device):
    q, kv_cache, attn = make_batch([3, 1, 4], [20, 9, 4], (6, 2, 16), 4, device)
    T, nh, hd = q.shape
    qkv = torch.randn(T, (nh + 4) * hd, device=device)  # [T, (nh + 2 nkv) hd], as qkv_proj gives
    qkv[:, : nh * hd] = q.reshape(T, nh * hd)
    run_and_check(qkv[:, : nh * hd].view(T, nh, hd), kv_cache, attn)


def test_lengths_come_from_device_tensors(device: torch.device):
    """A replayed CUDA graph keeps the host mirrors of its capture: upper bounds only. Rows past
    the real tokens (a padded bucket) must stay untouched."""
    q, kv_cache, attn = make_batch([3, 1, 2], [10, 5, 2], (6, 2, 16), 4, device)
    bucket = AttentionMetadata(
        **{**attn.__dict__, "cu_num_tokens_cpu": (0, 8, 16, 24), "seq_lens_cpu": (64, 64, 64)}
    )
    q_padded = torch.cat([q, torch.randn(4, *q.shape[1:], device=device)])  # [T + 4, nh, hd]
    out = torch.full(q_padded.shape, float("nan"), device=device)
    paged_attention_triton(q_padded, kv_cache, bucket, 0.25, out=out)
    expected = paged_attention_ref(q, kv_cache, attn, 0.25)
    torch.testing.assert_close(out[: attn.num_tokens], expected, rtol=1e-4, atol=2e-5)
    assert out[attn.num_tokens :].isnan().all(), "wrote rows that belong to no request"


def test_no_requests_writes_nothing(device: torch.device):
    q, kv_cache, attn = make_batch([0, 0], [3, 7], (2, 2, 16), 4, device)
    out = torch.full((2, 2, 16), float("nan"), device=device)
    paged_attention_triton(out.clone(), kv_cache, attn, 0.25, out=out)
    assert out.isnan().all()


@pytest.mark.parametrize(
    ("q_lens", "group", "rows"),
    [([1, 1], 3, 16), ([8, 1], 3, 32), ([2048], 3, 128), ([2048], 1, 128), ([1], 16, 16)],
)
def test_launch_config_packs_heads(q_lens: list[int], group: int, rows: int):
    # decode gets the fewest tokens that fill tl.dot's 16 rows; prefill is capped at 128 rows
    attn = make_metadata(q_lens, q_lens, 16, 300, torch.device("cpu"))
    q = torch.empty(sum(q_lens), 2 * group, 64)
    cfg = launch_config(q, 2, attn, num_kv_splits=None)
    assert cfg.block_m * cfg.block_h == rows
    assert cfg.block_h == triton_next_pow2(group)
    assert cfg.num_m_blocks * cfg.block_m >= max(q_lens)
    assert cfg.num_splits == 1  # the CPU never splits by default


def triton_next_pow2(n: int) -> int:
    return 1 << (n - 1).bit_length()


@pytest.mark.parametrize("num_kv_splits", [1, 3])
def test_non_causal_matches_reference(device: torch.device, num_kv_splits: int):
    """A drafter block: K query slots at the end of the request see every key, later slots too."""
    q, kv_cache, attn = make_batch([7, 7, 3], [7, 40, 19], (9, 3, 16), 4, device)
    attn = dataclasses.replace(attn, causal=False)
    run_and_check(q, kv_cache, attn, num_kv_splits=num_kv_splits)


@pytest.mark.parametrize("qk_norm", [False, True], ids=["llama", "qwen3_qk_norm"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("num_kv_splits", [None, 1, 3])
@pytest.mark.parametrize("case", ["decode_one", "decode_page_edges", "long_context_decode"])
def test_decode_rotating_new_kv_equals_rotary_then_attention(
    device: torch.device, case: str, num_kv_splits: int | None, dtype: torch.dtype,
    qk_norm: bool,
):  # fmt: skip
    """new_kv: the launch rotates q and the new key and stores k, v itself. The cache ends
    bit-identical to rotary_qkv's (rotate + store, then attention), the output matches the
    reference, and the fused qkv is left as it was (q is rotated in registers only). With
    Qwen3's q/k norms the launch norms them too, against qk_norm's launch before rotary_qkv:
    the cache within one rounding of the dtype (the sum of squares is taken in two halves)."""
    from dspark.kernels.paged_attention_triton import NewKV
    from dspark.kernels.qk_norm_triton import qk_norm as qk_norm_launch
    from dspark.kernels.rotary_triton import rotary_qkv

    _skip_interpreted_bf16(device, dtype)
    seq_lens = {"decode_one": [1], "decode_page_edges": CASES[device.type]["decode_page_edges"][1],
                "long_context_decode": [300, 1, 129, 64]}[case]  # fmt: skip
    nh, nkv, hd = HEADS[device.type]["gqa3"]
    _, kv_cache, attn = make_batch([1] * len(seq_lens), seq_lens, (nh, nkv, hd), 4, device)
    T, ps = len(seq_lens), kv_cache.shape[2]
    positions = torch.tensor(seq_lens, device=device) - 1
    pages = [attn.block_table[r, p // ps].item() for r, p in enumerate(positions.tolist())]
    slots = torch.tensor(
        [g * ps + p % ps for g, p in zip(pages, positions.tolist(), strict=True)], device=device
    )
    attn = dataclasses.replace(attn, slot_mapping=slots)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, device=device).float() / hd))
    qkv = torch.randn(T, (nh + 2 * nkv) * hd, device=device).to(dtype)
    kv_cache = kv_cache.to(dtype)

    def views(x):  # q, k, v of a fused qkv
        q, k, v = x.split([nh * hd, nkv * hd, nkv * hd], dim=-1)
        return q.unflatten(1, (nh, hd)), k.unflatten(1, (nkv, hd)), v.unflatten(1, (nkv, hd))

    norms, eps = {}, 1e-6
    if qk_norm:
        weights = (1.0 + 0.5 * torch.randn(2, hd, device=device)).to(dtype)
        norms = dict(q_norm=weights[0], k_norm=weights[1], norm_eps=eps)

    expected_cache, rotated = kv_cache.clone(), qkv.clone()
    if qk_norm:
        q, k, _ = views(rotated)
        qk_norm_launch(q, k, weights[0], weights[1], eps)
    rotary_qkv(rotated, positions, inv_freq, nh, nkv, hd, expected_cache, slots)
    q_ref = views(rotated)[0].float()
    expected = paged_attention_ref(q_ref, expected_cache.float(), attn, hd**-0.5)

    fused_qkv, cache = qkv.clone(), kv_cache.clone()
    q, k, v = views(fused_qkv)
    out = torch.full(q.shape, float("nan"), dtype=dtype, device=device)
    paged_attention_triton(q, cache, attn, hd**-0.5, out=out, num_kv_splits=num_kv_splits,
                           new_kv=NewKV(k, v, positions, inv_freq, slots, **norms))  # fmt: skip
    if qk_norm:  # (one rounding of the dtype at the normed values' scale, ~1)
        ulp = {torch.float32: 1e-5, torch.bfloat16: 2e-2}[dtype]
        torch.testing.assert_close(cache, expected_cache, rtol=0, atol=ulp, equal_nan=True)
    else:
        torch.testing.assert_close(cache, expected_cache, rtol=0, atol=0, equal_nan=True)
    assert torch.equal(fused_qkv, qkv)
    rtol, atol = TOLERANCE[dtype]
    torch.testing.assert_close(out.float(), expected, rtol=rtol, atol=atol)
