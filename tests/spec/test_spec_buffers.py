"""SpecBuffers: the worked example of its docstring, and pad windows on the scratch page."""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch

from dspark.spec.spec_buffers import FILTERED, GREEDY, SamplingMode, SpecBuffers, WindowRow
from dspark.step_plan import SCRATCH_PAGE

PAGE = 4


def _row(anchor, pos, verify_len, offset, row, temperature=0.0, top_k=100, top_p=1.0, seed=0):
    return WindowRow(anchor, pos, verify_len, offset, row, temperature, top_k, top_p, seed)


def _table(*pages: list[int], width: int = 8) -> np.ndarray:
    """A host block table whose row i holds pages[i] (the rest: the scratch page)."""
    table = np.full((len(pages), width), SCRATCH_PAGE, dtype=np.int32)
    for i, p in enumerate(pages):
        table[i, : len(p)] = p
    return table


def test_docstring_example_and_pad_rows():
    b = SpecBuffers(max_rows=4, draft_len=3, page_size=PAGE, device=torch.device("cpu"))
    rows = [_row(11, 9, 2, 0, 0, temperature=0.7, seed=3), _row(22, 4, 3, 3, 1)]
    # two pad rows after them: windows of 1 + 3 tokens from token 7 on
    b.write(rows, num_rows=4, pad_token_offset=7, pad_verify_len=3,
            block_table=_table([5, 6, 7], [8, 9]))  # fmt: skip
    assert b.anchors[:4].tolist() == [11, 22, 0, 0]
    assert b.anchor_pos[:4].tolist() == [9, 4, 0, 0]
    assert b.block_positions[:12].tolist() == [9, 10, 11, 4, 5, 6, 0, 1, 2, 0, 1, 2]
    # position p of a row lives at pages[p // 4] * 4 + p % 4; pad rows on the scratch page
    assert b.block_slots[:6].tolist() == [7 * 4 + 1, 7 * 4 + 2, 7 * 4 + 3, 9 * 4 + 0, 9 * 4 + 1,
                                          9 * 4 + 2]  # fmt: skip
    assert set(b.block_slots[6:12].tolist()) == {SCRATCH_PAGE * PAGE}
    assert b.block_seq_lens[:4].tolist() == [12, 7, 3, 3]
    # draft k < verify_len goes to its window token, the rest rewrite the anchor's own token
    assert b.draft_dst[:4].tolist() == [[1, 2, 0], [4, 5, 6], [8, 9, 10], [12, 13, 14]]
    assert b.verify_len[:4].tolist() == [2, 3, 3, 3]
    st = b.sampling(4, FILTERED)
    assert st.temperature.tolist() == pytest.approx([0.7, 0.0, 0.0, 0.0])
    assert st.seeds.tolist() == [3, 0, 0, 0]
    assert st.top_k.tolist() == [100, 100, 1, 1]  # pad rows: a dummy greedy identity
    meta = b.block_metadata(2, torch.zeros(2, 3, dtype=torch.int32))
    assert meta.cu_num_tokens.tolist() == [0, 3, 6] and not meta.causal
    assert meta.seq_lens_cpu == (12, 7)


def test_empty_window_owns_its_anchor_slot_alone():
    """An empty window (verify_len 0, a request's last token at position 7 = the end of page
    5): its drafter block writes the anchor's slot, the rest on the scratch page (its request
    owns no page past the anchor); every draft rewrites the anchor token."""
    b = SpecBuffers(max_rows=2, draft_len=3, page_size=PAGE, device=torch.device("cpu"))
    b.write([_row(11, 7, 0, 0, 0)], num_rows=1, pad_token_offset=4, pad_verify_len=3,
            window_width=4, block_table=_table([4, 5]))  # fmt: skip
    assert b.block_slots[:3].tolist() == [5 * 4 + 3, SCRATCH_PAGE * PAGE, SCRATCH_PAGE * PAGE]
    assert b.draft_dst[:1].tolist() == [[0, 0, 0]]
    assert b.window_len[:1].tolist() == [4]


def test_sampling_mode_of_a_batch():
    vocab = 100
    greedy = [_row(1, 1, 1, 0, 0), _row(1, 1, 1, 2, [1])]
    assert SamplingMode.of(greedy, vocab) == GREEDY
    mixed = greedy + [_row(1, 1, 1, 4, 0, temperature=1.0)]
    assert SamplingMode.of(mixed, vocab) == SamplingMode(False, False, False)
    filtered = mixed + [_row(1, 1, 1, 6, 0, temperature=1.0, top_p=0.9)]
    assert SamplingMode.of(filtered, vocab) == SamplingMode(False, False, True)


def test_the_captured_step_function_runs_eagerly_on_pad_windows(tiny_vocab_dir, tmp_path):
    # what SpecGraphs captures on a GPU: prepare G pad windows, then one SpecDecoder.step over
    # them; here eagerly on the CPU, so its code path is exercised without CUDA
    from dspark import LLM
    from tests.spec.test_spec_engine import K as DRAFT_LEN
    from tests.tiny_models import make_tiny_drafter

    drafter = make_tiny_drafter(tiny_vocab_dir, tmp_path / "drafter", taps=(0,))
    llm = LLM(str(tiny_vocab_dir), dtype="float32", device="cpu", num_kv_pages=32,
              max_num_seqs=4, speculative_config={"model": str(drafter)})  # fmt: skip
    runner = llm.engine.runner
    caches = runner.kv_caches + runner.spec.kv_caches  # [2, pages, page_size, nkv, hd] each
    before = [kv[:, 1:].clone() for kv in caches]  # every page but the scratch page
    shared = torch.empty(4 * (DRAFT_LEN + 1), runner.vocab_size)  # the set's logits on a GPU
    cases = itertools.product((GREEDY, FILTERED), (None, 4 * 2), (None, shared))
    for mode, trimmed, logits in cases:
        runner.spec_runner.graph_logits = logits
        runner.spec_runner._prepare_graph(4)
        out, scored = runner.spec_runner._graph_step(4, 0, trimmed, mode)
        assert scored.logits is out.logits  # (the half a grammar step verifies again)
        assert out.logits.shape[0] == (trimmed or 4 * (DRAFT_LEN + 1))
        assert (out.logits.data_ptr() == shared.data_ptr()) == (logits is not None)
        assert out.tokens.shape == (4, DRAFT_LEN + 1) and out.num_accepted.shape == (4,)
        assert ((0 <= out.num_accepted) & (out.num_accepted <= DRAFT_LEN)).all()
        if trimmed:  # a trimmed cell of pad windows: no candidate, every row verifies none
            assert out.verify_len.tolist() == [0, 0, 0, 0]
            assert out.num_accepted.tolist() == [0, 0, 0, 0]
    # pad windows wrote only the scratch page (page 0): no other page changed
    for kv, old in zip(caches, before, strict=True):
        assert torch.equal(kv[:, 1:], old)
    assert any(kv[:, 0].abs().sum() > 0 for kv in caches)  # ... and they did write there
