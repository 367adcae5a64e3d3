"""Triton ragged paged attention: the fast twin of `paged_attention_ref`.

One launch serves a whole step: prefill chunks, decode tokens and verify windows side by side.
Lengths come only from the device tensors `attn.cu_num_tokens` and `attn.seq_lens`, so a CUDA
graph can replay it with new lengths; the host mirrors only size the grid (upper bounds).

Grid: (request, query block of BLOCK_M tokens, kv head [x KV split]). A program loads the queries
of all GROUP query heads that share its kv head (GQA packing: BLOCK_M * BLOCK_H rows, BLOCK_H =
GROUP rounded up to a power of two), so each K/V tile is read once per group. It walks the
request's KV in BLOCK_N-key tiles, looking each key's page up in the block table, with an online
softmax in fp32 (exp2 with log2(e) folded into the scale).

When the grid is too small to fill the GPU (small decode batches), the KV range of each block is
cut into NUM_SPLITS parts (flash-decoding); every part writes a normalised partial output and its
log2-sum-exp, and the part that finishes last merges them, in the same launch: each part counts
itself in by an atomic on its block's counter, and the one that brings the count to NUM_SPLITS
reads every part back, writes the output and resets the counter to 0 for the next launch. (A
second merge kernel cost a dependent launch per layer: 4.8 us of a ~32 us layer at batch 1 on
the H200.) The parts are BLOCK_N-aligned, so a short context fills only the first few: the
others return at once and the count is of the parts that hold keys (`_kv_range`), and a block
whose keys fit one part writes its output directly, with no partials and no merge. The
counters are one persistent buffer per device: launches that split must be stream-ordered
(every caller is).

A decode step (one causal query token per request) may pass its unrotated k and v (`NewKV`):
each program then rotates its queries as it loads them, and the part whose KV range holds the
new token's position rotates that token's key and stores k and v in the cache before it reads
any key, so the step needs no rotary + KV-store launch before attention (2.4 us a layer at
batch 1 on the H200). The rotation rounds exactly as rotary_triton's kernel does. With Qwen3's
per-head norms (NewKV.q_norm, k_norm) the heads come unnormed too and are normed as they are
loaded, so the step also needs no qk_norm launch (one less dependent launch a layer); the norm
rounds as qk_norm_triton's does, its sum of squares taken in two halves.

Under TRITON_INTERPRET=1 (CPU tensors) the kernels run in Triton's interpreter; the variable is
read when the kernels below are decorated, so it must be set before this module is imported.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from dspark.attention_metadata import AttentionMetadata
from dspark.kernels.pdl import gdc_enter, pdl_options
from dspark.kernels.rotary_triton import rotated_rows

LOG2_E = 1.4426950408889634
MIN_DOT_ROWS = 16  # tl.dot needs at least 16 rows
MAX_ROWS = 128  # packed query rows (tokens x heads) per program in a prefill chunk
MAX_KV_SPLITS = 16


@triton.jit
def _query_rows(cu_ptr, seq_lens_ptr, req, m_block, kv_head, GROUP, BLOCK_M, BLOCK_H):
    # Row i of a program is token i // BLOCK_H of its block, head i % BLOCK_H of its group.
    # GROUP 3 (BLOCK_H 4), BLOCK_M 2, kv_head 1, m_block 0, q_len 2, seq_len 10:
    #   row:    [0, 1, 2, 3, 4, 5, 6, 7]
    #   tok:    [0, 0, 0, 0, 1, 1, 1, 1]
    #   head:   [3, 4, 5, 6, 3, 4, 5, 6]
    #   valid:  [1, 1, 1, 0, 1, 1, 1, 0]   (head slot 3 is padding: GROUP < BLOCK_H)
    #   q_pos:  [8, 8, 8, 8, 9, 9, 9, 9]   (seq_len - q_len + tok)
    q_start = tl.load(cu_ptr + req)
    q_len = tl.load(cu_ptr + req + 1) - q_start
    seq_len = tl.load(seq_lens_ptr + req)
    rows = tl.arange(0, BLOCK_M * BLOCK_H)
    tok = m_block * BLOCK_M + rows // BLOCK_H
    head = kv_head * GROUP + rows % BLOCK_H
    valid = (tok < q_len) & (rows % BLOCK_H < GROUP)
    q_pos = seq_len - q_len + tok
    return q_len, seq_len, (q_start + tok).to(tl.int64), head, valid, q_pos


@triton.jit
def _kv_range(q_len, seq_len, m_block, split, BLOCK_M, BLOCK_N, NUM_SPLITS, CAUSAL):
    # The block's last query sees keys 0 .. kv_end - 1; split s takes one BLOCK_N-aligned chunk,
    # and the first `parts` splits hold keys (at least 1, so a block without keys has a part).
    # seq_len 100, q_len 1, BLOCK_N 16, NUM_SPLITS 3: kv_end 100, chunk 48, parts 3,
    #   splits [0, 48) [48, 96) [96, 100)
    # seq_len 150, q_len 1, BLOCK_N 64, NUM_SPLITS 16: chunk 64, parts 3,
    #   splits [0, 64) [64, 128) [128, 150), splits 3..15 empty
    # Non-causal (a drafter block attending to itself both ways): every query sees all keys.
    if CAUSAL:
        kv_end = seq_len - q_len + tl.minimum((m_block + 1) * BLOCK_M, q_len)
    else:
        kv_end = seq_len
    chunk = tl.cdiv(tl.cdiv(kv_end, NUM_SPLITS), BLOCK_N) * BLOCK_N
    parts = tl.maximum(tl.cdiv(kv_end, tl.maximum(chunk, 1)), 1)
    lo = split * chunk
    return lo, tl.minimum(lo + chunk, kv_end), parts


@triton.jit
def _kv_offsets(block_table_ptr, req, stride_bt, key_pos, key_valid, kv_head, s_kp, s_ks, s_kh,
                PAGE_SIZE):  # fmt: skip
    # key position -> (page = block_table[req, pos // PAGE_SIZE], slot = pos % PAGE_SIZE).
    # PAGE_SIZE 4, block_table[req] = [7, 2, ...]: keys [0..7] -> pages [7,7,7,7,2,2,2,2],
    # slots [0,1,2,3,0,1,2,3]. Masked keys never read the table (its tail may be padding).
    page = tl.load(
        block_table_ptr + req * stride_bt + key_pos // PAGE_SIZE, mask=key_valid, other=0
    )
    return page.to(tl.int64) * s_kp + (key_pos % PAGE_SIZE) * s_ks + kv_head * s_kh


@triton.jit
def _attend(q, q_pos, k_ptr, v_ptr, block_table_ptr, req, stride_bt, kv_head, lo, hi, qk_scale,
            s_kp, s_ks, s_kh, PAGE_SIZE, HEAD_DIM, BLOCK_N, DOT_PRECISION):  # fmt: skip
    """Online softmax of q (log2 domain) over keys lo .. hi-1: (unnormalised acc, max, sum)."""
    dims = tl.arange(0, HEAD_DIM)
    acc = tl.zeros([q.shape[0], HEAD_DIM], dtype=tl.float32)
    m_i = tl.full([q.shape[0]], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([q.shape[0]], dtype=tl.float32)
    for start in range(lo, hi, BLOCK_N):
        key_pos = start + tl.arange(0, BLOCK_N)  # [BLOCK_N]
        key_valid = key_pos < hi
        kv_off = _kv_offsets(
            block_table_ptr, req, stride_bt, key_pos, key_valid, kv_head, s_kp, s_ks, s_kh,
            PAGE_SIZE,
        )  # fmt: skip
        kv_idx = kv_off[:, None] + dims[None, :]  # [BLOCK_N, HEAD_DIM]
        k = tl.load(k_ptr + kv_idx, mask=key_valid[:, None], other=0.0)
        s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * qk_scale  # [rows, BLOCK_N]
        visible = key_valid[None, :] & (key_pos[None, :] <= q_pos[:, None])
        s = tl.where(visible, s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        # a row that has seen no visible key yet keeps m = -inf; shift by 0 to avoid inf - inf
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])  # [rows, BLOCK_N]
        alpha = tl.exp2(m_i - m_safe)
        v = tl.load(v_ptr + kv_idx, mask=key_valid[:, None], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
        l_i = l_i * alpha + tl.sum(p, axis=1)
        m_i = m_new
    return acc, m_i, l_i


@triton.jit
def _store_new_kv(new_k_ptr, new_v_ptr, s_nt, s_nh, positions_ptr, inv_freq_ptr, slot_ptr,
                  k_ptr, v_ptr, s_kp, s_ks, s_kh, token, kv_head, k_norm_ptr, eps,
                  HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
                  QK_NORM: tl.constexpr):  # fmt: skip
    """A decode token's kv_head: k (normed with QK_NORM) rotated at its position, and v, into
    the cache at its slot (slot = page * PAGE_SIZE + offset), as qk_norm + rotary_qkv + the KV
    store would write them."""
    token = token.to(tl.int64)
    one = tl.zeros([1], dtype=tl.int64)  # [1]: rotated_rows works on rows
    dims = tl.arange(0, HEAD_DIM)
    src = token * s_nt + kv_head * s_nh
    pos = tl.load(positions_ptr + token + one)
    k = rotated_rows(new_k_ptr, src + one, one == 0, pos, inv_freq_ptr, k_norm_ptr, eps,
                     HEAD_DIM // 2, HEAD_DIM, QK_NORM)  # fmt: skip
    slot = tl.load(slot_ptr + token)
    dst = (slot // PAGE_SIZE) * s_kp + (slot % PAGE_SIZE) * s_ks + kv_head * s_kh
    tl.store(k_ptr + dst + dims[None, :], k)
    tl.store(v_ptr + dst + dims, tl.load(new_v_ptr + src + dims))


@triton.jit
def _paged_attention_kernel(
    q_ptr, k_ptr, v_ptr, out_ptr, part_out_ptr, part_lse_ptr, counter_ptr,
    cu_ptr, seq_lens_ptr, block_table_ptr, qk_scale, num_heads,
    s_qt, s_qh, s_ot, s_oh, s_kp, s_ks, s_kh, stride_bt,
    new_k_ptr, new_v_ptr, s_nt, s_nh, positions_ptr, inv_freq_ptr, slot_ptr,
    q_norm_ptr, k_norm_ptr, norm_eps,
    GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, PAGE_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    NUM_SPLITS: tl.constexpr, SPLITS_P2: tl.constexpr, DOT_PRECISION: tl.constexpr,
    CAUSAL: tl.constexpr, ROTARY: tl.constexpr, QK_NORM: tl.constexpr, PDL: tl.constexpr,
):  # fmt: skip
    gdc_enter(PDL)  # before any load: q, the new k and v and the cache come from earlier kernels
    # causal blocks late in a chunk see the most keys: schedule them first (shorter tail)
    req, m_block = tl.program_id(0), tl.num_programs(1) - 1 - tl.program_id(1)
    kv_head, split = tl.program_id(2) // NUM_SPLITS, tl.program_id(2) % NUM_SPLITS
    q_len, seq_len, token, head, valid, q_pos = _query_rows(
        cu_ptr, seq_lens_ptr, req, m_block, kv_head, GROUP, BLOCK_M, BLOCK_H
    )
    if m_block * BLOCK_M >= q_len:  # the grid is sized for the longest request
        return
    if not CAUSAL:  # every query may see every key of its request
        q_pos = tl.zeros_like(q_pos) + seq_len - 1
    dims = tl.arange(0, HEAD_DIM)
    lo, hi, parts = _kv_range(q_len, seq_len, m_block, split, BLOCK_M, BLOCK_N, NUM_SPLITS,
                              CAUSAL)  # fmt: skip
    if split >= parts:  # no keys here: the block's parts neither wait for nor read this one
        return
    if ROTARY:  # decode: rotate q here, and the part holding the new key stores it first
        pos = tl.load(positions_ptr + token, mask=valid, other=0)
        q_off = token * s_qt + head * s_qh  # [rows]
        q = rotated_rows(q_ptr, q_off, valid, pos, inv_freq_ptr, q_norm_ptr, norm_eps,
                         HEAD_DIM // 2, HEAD_DIM, QK_NORM)  # fmt: skip
        if (seq_len - 1 >= lo) & (seq_len - 1 < hi):
            _store_new_kv(new_k_ptr, new_v_ptr, s_nt, s_nh, positions_ptr, inv_freq_ptr,
                          slot_ptr, k_ptr, v_ptr, s_kp, s_ks, s_kh, tl.load(cu_ptr + req),
                          kv_head, k_norm_ptr, norm_eps, HEAD_DIM, PAGE_SIZE,
                          QK_NORM)  # fmt: skip
            tl.debug_barrier()  # the stores land before this program's threads read keys
    else:
        q_idx = token[:, None] * s_qt + head[:, None] * s_qh + dims[None, :]  # [rows, HEAD_DIM]
        q = tl.load(q_ptr + q_idx, mask=valid[:, None], other=0.0)
    acc, m_i, l_i = _attend(
        q, q_pos, k_ptr, v_ptr, block_table_ptr, req, stride_bt, kv_head, lo, hi, qk_scale,
        s_kp, s_ks, s_kh, PAGE_SIZE, HEAD_DIM, BLOCK_N, DOT_PRECISION,
    )  # fmt: skip
    has_keys = l_i > 0.0  # every valid row sees key 0, so only an empty split has none
    l_safe = tl.where(has_keys, l_i, 1.0)
    o = acc / l_safe[:, None]
    out_idx = token[:, None] * s_ot + head[:, None] * s_oh + dims[None, :]
    if NUM_SPLITS == 1:
        tl.store(out_ptr + out_idx, o.to(out_ptr.dtype.element_ty), mask=valid[:, None])
    elif parts == 1:  # all the block's keys in this part: its output is final
        tl.store(out_ptr + out_idx, o.to(out_ptr.dtype.element_ty), mask=valid[:, None])
    else:
        part = (token * num_heads + head) * NUM_SPLITS + split  # [rows] into [T, nh, NUM_SPLITS]
        lse = tl.where(has_keys, m_i + tl.log2(l_safe), float("-inf"))
        tl.store(part_lse_ptr + part, lse, mask=valid)
        tl.store(part_out_ptr + part[:, None] * HEAD_DIM + dims[None, :], o, mask=valid[:, None])
        # Count this part in; the last of the block's `parts` parts merges. The barrier puts
        # every thread's stores before the atomic, whose release publishes them device-wide.
        # Counter of block (req, m_block, kv_head), in launch-grid order:
        #   (req * num_m_blocks + program_id(1)) * num_kv_heads + kv_head
        num_kv_heads = tl.num_programs(2) // NUM_SPLITS
        counter = counter_ptr + (req * tl.num_programs(1) + tl.program_id(1)) * num_kv_heads
        tl.debug_barrier()
        arrived = tl.atomic_add(counter + kv_head, 1, sem="acq_rel", scope="gpu")
        if arrived == parts - 1:
            tl.store(counter + kv_head, 0)  # ready for the next launch (stream-ordered)
            _merge_splits(
                out_ptr, part_out_ptr, part_lse_ptr, token, head, valid, num_heads, s_ot, s_oh,
                parts, HEAD_DIM, NUM_SPLITS, SPLITS_P2,
            )  # fmt: skip


@triton.jit
def _merge_splits(out_ptr, part_out_ptr, part_lse_ptr, token, head, valid, num_heads, s_ot, s_oh,
                  parts, HEAD_DIM, NUM_SPLITS, SPLITS_P2):  # fmt: skip
    """out = sum_s 2^lse_s o_s / sum_s 2^lse_s over the block's first `parts` splits (the ones
    this launch wrote: the others' slots hold an earlier launch's values, or none).

    All log-sum-exps are loaded in one [rows, splits] tile and the split loop is unrolled, so
    the partial-output loads are independent and issue together. The loads bypass L1 (".cg"):
    the other parts wrote them from other SMs.
    """
    dims = tl.arange(0, HEAD_DIM)
    splits = tl.arange(0, SPLITS_P2)
    part0 = (token * num_heads + head) * NUM_SPLITS  # [R]
    lse_mask = valid[:, None] & (splits[None, :] < parts)
    lse = tl.load(part_lse_ptr + part0[:, None] + splits[None, :], mask=lse_mask,
                  other=float("-inf"), cache_modifier=".cg")  # [R, S]  # fmt: skip
    m = tl.max(lse, axis=1)
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    weight = tl.exp2(lse - m_safe[:, None])  # [R, S]; empty splits weigh 0
    den = tl.sum(weight, axis=1)
    acc = tl.zeros([token.shape[0], HEAD_DIM], dtype=tl.float32)
    for split in tl.static_range(NUM_SPLITS):
        w = tl.sum(tl.where(splits[None, :] == split, weight, 0.0), axis=1)  # column `split`
        o = tl.load(
            part_out_ptr + (part0 + split)[:, None] * HEAD_DIM + dims[None, :],
            mask=valid[:, None] & (split < parts),  # unwritten slots may hold NaN
            other=0.0,
            cache_modifier=".cg",
        )
        acc += o * w[:, None]
    o = acc / tl.where(den > 0.0, den, 1.0)[:, None]
    out_idx = token[:, None] * s_ot + head[:, None] * s_oh + dims[None, :]
    tl.store(out_ptr + out_idx, o.to(out_ptr.dtype.element_ty), mask=valid[:, None])


@dataclass(frozen=True)
class LaunchConfig:
    block_m: int  # query tokens per program
    block_h: int  # query heads per program: the GQA group rounded up to a power of two
    block_n: int  # keys per tile
    num_m_blocks: int
    num_splits: int
    num_warps: int


@functools.cache
def _num_sms(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def launch_config(
    q: torch.Tensor,  # [T, nh, hd]
    num_kv_heads: int,
    attn: AttentionMetadata,
    num_kv_splits: int | None,
) -> LaunchConfig:
    """Tile sizes from host-side upper bounds only (the longest query run, the request count)."""
    group = q.shape[1] // num_kv_heads
    block_h = triton.next_power_of_2(group)
    max_q_len = _max_q_len(attn.cu_num_tokens_cpu)
    # decode / short windows: the fewest tokens that give tl.dot its 16 rows; prefill: MAX_ROWS
    min_block_m = max(1, MIN_DOT_ROWS // block_h)
    max_block_m = max(min_block_m, MAX_ROWS // block_h)
    block_m = min(max(triton.next_power_of_2(max(max_q_len, 1)), min_block_m), max_block_m)
    num_m_blocks = triton.cdiv(max_q_len, block_m)
    if num_kv_splits is None:  # only pure decode splits: eager prefill shapes stay few
        programs = attn.num_reqs * num_m_blocks * num_kv_heads
        num_kv_splits = _default_splits(q.device, programs) if max_q_len == 1 else 1
    assert 1 <= num_kv_splits <= MAX_KV_SPLITS, (
        f"num_kv_splits {num_kv_splits} not in [1, {MAX_KV_SPLITS}]"
    )
    rows = block_m * block_h
    return LaunchConfig(
        block_m=block_m,
        block_h=block_h,
        block_n=64 if q.shape[2] <= 64 else 32,
        num_m_blocks=num_m_blocks,
        num_splits=num_kv_splits,
        num_warps=4 if rows <= 64 else 8,
    )


@functools.lru_cache(maxsize=16)
def _max_q_len(cu_num_tokens: tuple[int, ...]) -> int:
    # called once per layer with the same step metadata: the cache turns that into one scan
    return max((b - a for a, b in zip(cu_num_tokens, cu_num_tokens[1:], strict=False)), default=0)


def _default_splits(device: torch.device, num_programs: int) -> int:
    # Split the KV walk only when the grid is smaller than the GPU; the CPU never splits.
    if device.type != "cuda" or num_programs == 0:
        return 1
    splits = max(1, min(MAX_KV_SPLITS, _num_sms(device) // num_programs))
    return 1 << (splits.bit_length() - 1)  # a power of two: few compiled variants


def paged_attention_triton(
    q: torch.Tensor,  # [T, nh, hd]
    kv_cache: torch.Tensor,  # [2, num_pages, page_size, nkv, hd]
    attn: AttentionMetadata,
    scale: float,
    *,
    out: torch.Tensor | None = None,  # [T, nh, hd]; rows of no request are left untouched
    num_kv_splits: int | None = None,  # None: split the KV walk only when the grid is small
    new_kv: NewKV | None = None,  # decode only: q is unrotated; rotate q, k and store k, v here
) -> torch.Tensor:  # [T, nh, hd]
    T, num_heads, head_dim = q.shape
    page_size, num_kv_heads = kv_cache.shape[2], kv_cache.shape[3]
    assert num_heads % num_kv_heads == 0, f"{num_heads} heads over {num_kv_heads} kv heads"
    assert head_dim == triton.next_power_of_2(head_dim) and head_dim >= 16, head_dim
    assert q.stride(2) == 1 and kv_cache.stride(4) == 1, "head_dim must be contiguous"
    assert attn.block_table.stride(1) == 1, "block_table rows must be contiguous"
    if out is None:
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    assert out.shape == q.shape and out.stride(2) == 1, (out.shape, q.shape)
    cfg = launch_config(q, num_kv_heads, attn, num_kv_splits)
    if cfg.num_m_blocks == 0:
        return out
    if new_kv is not None:
        _check_new_kv(new_kv, q, kv_cache, attn)
    nk = new_kv or NewKV(q, q, attn.seq_lens, attn.seq_lens, attn.seq_lens)  # unused pointers
    part_shape = (T, num_heads, cfg.num_splits)
    part_lse = torch.empty(part_shape if cfg.num_splits > 1 else (1,), device=q.device)
    part_out = torch.empty((*part_shape, head_dim) if cfg.num_splits > 1 else (1,), device=q.device)
    grid = (attn.num_reqs, cfg.num_m_blocks, num_kv_heads * cfg.num_splits)
    num_blocks = attn.num_reqs * cfg.num_m_blocks * num_kv_heads
    counters = _split_counters(q.device, num_blocks) if cfg.num_splits > 1 else part_lse
    _paged_attention_kernel[grid](
        q, kv_cache[0], kv_cache[1], out, part_out, part_lse, counters,
        attn.cu_num_tokens, attn.seq_lens, attn.block_table, scale * LOG2_E, num_heads,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        kv_cache.stride(1), kv_cache.stride(2), kv_cache.stride(3), attn.block_table.stride(0),
        nk.k, nk.v, nk.k.stride(0), nk.k.stride(1), nk.positions, nk.inv_freq, nk.slot_mapping,
        q if nk.q_norm is None else nk.q_norm, q if nk.k_norm is None else nk.k_norm,
        nk.norm_eps,
        GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim, PAGE_SIZE=page_size,
        BLOCK_M=cfg.block_m, BLOCK_H=cfg.block_h, BLOCK_N=cfg.block_n,
        NUM_SPLITS=cfg.num_splits, SPLITS_P2=triton.next_power_of_2(cfg.num_splits),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32", CAUSAL=attn.causal,
        ROTARY=new_kv is not None, QK_NORM=nk.q_norm is not None, num_warps=cfg.num_warps,
        # rotary_triton's rounding needs it (no product contracted into the add after it)
        enable_fp_fusion=new_kv is None, **pdl_options(q.device),
    )  # fmt: skip
    return out


@dataclass(frozen=True)
class NewKV:
    """A decode step's unrotated k and v (views of the fused qkv projection) for the attention
    launch to rotate and store itself, in place of rotary_qkv's launch before it."""

    k: torch.Tensor  # [T, nkv, hd]
    v: torch.Tensor  # [T, nkv, hd], the same strides as k
    positions: torch.Tensor  # [T]
    inv_freq: torch.Tensor  # [hd/2] float32
    slot_mapping: torch.Tensor  # [T] int64
    # Qwen3's per-head norms [hd] (layers/attention.py q_norm, k_norm): q and k come unnormed
    # too, and the launch norms them as it loads them, in place of qk_norm's launch
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    norm_eps: float = 0.0


def is_decode(attn: AttentionMetadata) -> bool:
    """Every request runs at most one causal query token (from the host mirrors, no sync)."""
    return attn.causal and _max_q_len(attn.cu_num_tokens_cpu) <= 1


def _check_new_kv(new_kv: NewKV, q: torch.Tensor, kv_cache: torch.Tensor, attn) -> None:
    assert is_decode(attn), "new_kv: only decode steps (one causal query token per request)"
    k, v = new_kv.k, new_kv.v
    assert k.shape == v.shape == (q.shape[0], kv_cache.shape[3], q.shape[2]), (k.shape, v.shape)
    assert k.stride() == v.stride() and k.stride(2) == 1, (k.stride(), v.stride())
    assert k.dtype == q.dtype == kv_cache.dtype and new_kv.inv_freq.dtype == torch.float32


_COUNTERS: dict[torch.device, torch.Tensor] = {}
MIN_COUNTERS = 4096


def _split_counters(device: torch.device, needed: int) -> torch.Tensor:
    """The device's zeroed arrival counters, one per (request, query block, kv head).

    Every launch leaves them at 0. Allocated (or grown) only outside CUDA-graph capture: the
    runner's eager warm-up before every capture is the first call at each shape.
    """
    counters = _COUNTERS.get(device)
    if counters is None or counters.numel() < needed:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError(
                f"paged attention needs {needed} split counters but only "
                f"{0 if counters is None else counters.numel()} exist: run the shape eagerly "
                "once before capturing it"
            )
        counters = torch.zeros(max(needed, MIN_COUNTERS), dtype=torch.int32, device=device)
        _COUNTERS[device] = counters
    return counters
