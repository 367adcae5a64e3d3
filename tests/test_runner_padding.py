"""Decode batches padded to graph sizes: pad rows live on the scratch page, results unchanged.

On the CPU the padded layout runs eagerly (capture_graphs=False): exactly the inputs a captured
graph would replay, so the layout is tested here and graph == eager is tested on the GPU.
"""

from __future__ import annotations

import torch

from dspark import LLM, SamplingParams
from dspark.runner.input_buffers import InputBuffers
from dspark.runner.model_runner import ModelRunner
from dspark.step_plan import PAD_SLOT, SCRATCH_PAGE

PROMPTS = ["Hello there", "The quick brown fox", "1 2 3"]


def test_pad_rows_layout_worked_example():
    b = InputBuffers(
        max_num_tokens=8, max_num_rows=4, max_pages_per_row=3, device=torch.device("cpu")
    )
    # windows [3, 1, 2] already staged; one pad row makes G = 4
    b.np("cu_num_tokens")[:4] = [0, 3, 4, 6]
    b.write_pad_rows(start_row=3, start_token=6, num_pad_rows=1)
    assert b.np("cu_num_tokens")[:5].tolist() == [0, 3, 4, 6, 7]
    assert b.np("seq_lens")[3] == 1 and b.np("slot_mapping")[6] == PAD_SLOT
    assert (b.np("block_table")[3] == SCRATCH_PAGE).all()


def _padded_llm(tiny_llama_dir, sizes):
    llm = LLM(str(tiny_llama_dir), dtype="float32", device="cpu", num_kv_pages=64)
    e = llm.engine
    e.runner = ModelRunner(
        e.model,
        e.runner.kv_caches,
        e.config.page_size,
        e.config.max_num_batched_tokens,
        e.config.max_num_seqs,
        e.max_model_len,
        e.device,
        graph_sizes=sizes,
        capture_graphs=False,
    )
    return llm


def test_padded_decode_equals_unpadded_as_the_batch_shrinks(tiny_llama_dir, tiny_llm):
    # different max_tokens make the batch shrink 3 -> 2 -> 1: none of them a graph size but 1
    params = [SamplingParams(temperature=0, max_tokens=n, ignore_eos=True) for n in (5, 9, 13)]
    expected = [o.outputs[0].token_ids for o in tiny_llm.generate(PROMPTS, params, use_tqdm=False)]
    llm = _padded_llm(tiny_llama_dir, [1, 4, 8])
    kv = llm.engine.runner.kv_caches[0]
    got = [o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert got == expected
    stats = llm.engine.runner.stats
    assert stats["eager_steps_not_decode"] >= 1 and stats["eager_steps"] > 3
    assert kv[:, SCRATCH_PAGE].abs().sum() > 0, "pad rows write the scratch page"
    # each request needs at most 2 pages of 16 (<= 8 prompt + 13 new tokens) and the allocator
    # hands out low ids first, so pages 7.. were never live: pad rows must not have touched them
    assert kv[:, 7:].abs().sum() == 0
    e = llm.engine
    assert e.allocator.num_free == e.allocator.num_usable


def test_no_garbage_collection_collects_first_then_holds_the_collector_off():
    """Graph capture runs with Python's cyclic collector off (cuda_graph.no_garbage_collection):
    a dropped engine's cycles are freed before the first capture, never inside one."""
    import gc
    import weakref

    from dspark.runner.cuda_graph import no_garbage_collection

    class Node:
        pass

    a, b = Node(), Node()
    a.other, b.other = b, a  # a cycle: only the collector frees it
    dead = weakref.ref(a)
    del a, b
    assert gc.isenabled()
    with no_garbage_collection():
        assert dead() is None  # collected on the way in
        assert not gc.isenabled()
    assert gc.isenabled()
    gc.disable()
    try:
        with no_garbage_collection():
            pass
        assert not gc.isenabled()  # a caller's choice is left as it was
    finally:
        gc.enable()
