"""The persistent batch: rows kept from step to step and updated by their changes must equal a
straightforward rebuild of every row from the requests, whatever the batch does (rows added,
finished and preempted in one step, shrinking and growing across graph sizes, pages added)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.request import Request
from dspark.runner.input_buffers import NO_OWNER, InputBuffers
from dspark.runner.model_runner import ModelRunner
from dspark.runner.persistent_batch import NOT_FOUND, PersistentBatch, index_of
from dspark.runner.staging import StepStager
from dspark.sample.sampling_rows import SamplingRows
from dspark.step_plan import SCRATCH_PAGE

VOCAB = 50
FIELDS = ("temperature", "top_k", "top_p", "seed", "min_tokens_end", "logprobs")


def test_index_of_worked_example():
    got = index_of(np.array([7, -1, 3, 9]), np.array([9, 3, 5]))
    assert got.tolist() == [3, 2, NOT_FOUND]


def _request(i: int, rng: random.Random) -> Request:
    params = SamplingParams(temperature=rng.choice([0.0, 0.7]), top_k=rng.choice([0, 5]),
                            top_p=rng.choice([1.0, 0.9]), min_tokens=rng.choice([0, 3]),
                            logprobs=rng.choice([None, 2]), max_tokens=50)  # fmt: skip
    req = Request(f"r{i}", [1] * rng.randrange(1, 9), params, seed=i, eos_token_id=2,
                  arrival_time=0.0)  # fmt: skip
    req.page_ids = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 4))]
    return req


def _rebuilt(reqs: list[Request], max_pages: int) -> tuple[np.ndarray, dict]:
    """Every row written from its request: the block table and the sampling fields."""
    table = np.full((len(reqs), max_pages), SCRATCH_PAGE, dtype=np.int32)
    sampling = SamplingRows(len(reqs), VOCAB)
    for i, req in enumerate(reqs):
        table[i, : len(req.page_ids)] = req.page_ids
        sampling.write(i, req)
    return table, {f: getattr(sampling, f) for f in FIELDS}


def _change(batch: list[Request], rng: random.Random, serial: list[int]) -> list[Request]:
    """One step's changes: some rows finish, some are preempted (pages rebuilt), some grow a
    page, a few are admitted at the end."""
    kept = []
    for req in batch:
        roll = rng.random()
        if roll < 0.15:
            continue  # finished
        if roll < 0.25:  # preempted and re-admitted at once (at the end: FIFO front)
            req.num_preemptions += 1
            req.page_ids = [rng.randrange(1, 1000) for _ in range(rng.randrange(1, 3))]
        elif roll < 0.45 and len(req.page_ids) < 7:
            req.page_ids.append(rng.randrange(1, 1000))
        kept.append(req)
    for _ in range(rng.randrange(0, 5)):
        serial[0] += 1
        kept.append(_request(serial[0], rng))
    return kept[:12]


@pytest.mark.parametrize("seed", range(4))
def test_sync_equals_a_rebuild_of_every_row(seed):
    rng = random.Random(seed)
    buffers = InputBuffers(64, 12, 8, torch.device("cpu"))
    batch = PersistentBatch(buffers, SamplingRows(12, VOCAB))
    serial = [0]
    reqs = [_request(i, rng) for i in range(6)]
    for step in range(60):
        serials = batch.sync(reqs)
        n = len(reqs)
        assert serials.tolist() == [r.serial for r in reqs]
        table, fields = _rebuilt(reqs, 8)
        assert (buffers.np("block_table")[:n] == table).all(), f"step {step}"
        for f in FIELDS:
            assert (getattr(batch.sampling, f)[:n] == fields[f]).all(), (step, f)
        if rng.random() < 0.2:  # a smaller graph size: rows past the batch become pad rows
            buffers.write_pad_rows(n, n, 12 - n)
        reqs = _change(reqs, rng, serial) or [_request(999 + step, rng)]
    counts = batch.counts
    assert counts["rows_moved"] and counts["rows_written"] and counts["rows_grown"]


def test_a_row_moving_up_is_copied_not_rewritten():
    rng = random.Random(0)
    buffers = InputBuffers(16, 4, 4, torch.device("cpu"))
    batch = PersistentBatch(buffers, SamplingRows(4, VOCAB))
    reqs = [_request(i, rng) for i in range(4)]
    batch.sync(reqs)
    written = batch.counts["rows_written"]
    batch.sync([reqs[0], reqs[2], reqs[3]])  # request 1 finished: rows 2, 3 move up
    assert batch.counts["rows_moved"] == 2 and batch.counts["rows_written"] == written
    assert buffers.block_row_owner[:3].tolist() == [reqs[0].serial, reqs[2].serial,
                                                     reqs[3].serial]  # fmt: skip
    buffers.write_pad_rows(3, 3, 1)
    assert buffers.block_row_owner[3] == NO_OWNER


class CheckedStager(StepStager):
    """Stages every step twice: as the engine does (persistent rows by their changes, decode
    steps by numpy), then every row rebuilt from the requests by the row-by-row path, and
    asserts the two wrote the same inputs."""

    num_checked = 0

    def stage(self, plan):
        staged = super().stage(plan)
        got = self._snapshot(staged)
        self.batch.invalidate()  # the reference: every block-table and sampling row rewritten
        ref = self._stage_rows(plan, staged.reqs, self.batch.sync(staged.reqs))
        want = self._snapshot(ref)
        assert got.keys() == want.keys()
        for key in got:
            assert np.array_equal(got[key], want[key]), key
        assert staged.layout == ref.layout and staged.graph_size == ref.graph_size
        CheckedStager.num_checked += plan.is_decode
        return staged

    def _snapshot(self, staged) -> dict:
        b, lay = self.buffers, staged.layout
        t, r = lay.num_tokens, lay.num_rows
        out = {name: b.np(name)[:used].copy() for name, used in (
            ("input_ids", t), ("positions", t), ("slot_mapping", t), ("cu_num_tokens", r + 1),
            ("seq_lens", r), ("block_table", r), ("logits_indices", lay.num_logits),
            ("feed_dst", lay.num_fed), ("feed_src", lay.num_fed))}  # fmt: skip
        rows = staged.sampled_rows
        out |= {f: getattr(self.batch.sampling, f)[rows].copy() for f in FIELDS}
        out |= {"sampled_rows": rows, "sampled_ends": staged.sampled_ends}
        return out


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_engine_staging_equals_the_row_by_row_rebuild(tiny_llama_dir, tiny_llm, async_scheduling):
    """Varied lengths on a tight KV cache: admissions, finishes and preemptions in the same
    steps, the batch crossing graph sizes 8 -> 4 -> 2 -> 1 and back, pages added mid-decode;
    outputs equal the unchecked engine's token for token."""
    rng = random.Random(1)
    prompts = [[rng.randrange(3, 500) for _ in range(rng.randrange(2, 30))] for _ in range(14)]
    params = [SamplingParams(temperature=rng.choice([0.0, 0.0, 0.8]), seed=i, ignore_eos=True,
                             max_tokens=rng.randrange(2, 40), min_tokens=rng.choice([0, 2]),
                             stop_token_ids=rng.choice([[], [rng.randrange(3, 500)]]),
                             logprobs=rng.choice([None, None, 1]))
              for i in range(14)]  # fmt: skip
    kw = dict(dtype="float32", device="cpu", num_kv_pages=9, max_model_len=128, max_num_seqs=6,
              max_num_batched_tokens=64, async_scheduling=async_scheduling)  # fmt: skip
    want = LLM(str(tiny_llama_dir), **kw).generate(prompts, params, use_tqdm=False)
    llm = LLM(str(tiny_llama_dir), **kw)
    e = llm.engine
    e.runner = r = ModelRunner(e.model, e.runner.kv_caches, e.config.page_size,
                               e.config.max_num_batched_tokens, e.config.max_num_seqs,
                               e.max_model_len, e.device, graph_sizes=[1, 2, 4, 6],
                               capture_graphs=False)  # fmt: skip
    # (no captured graphs, no speculation: the runner's stager holds nothing more)
    r.stager = CheckedStager(r.buffers, r.batch, r.page_size, r.stats, r.stager.graph_sizes)
    CheckedStager.num_checked = 0
    got = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == [o.outputs[0].token_ids for o in want]
    assert e.scheduler.num_preemptions > 0
    assert CheckedStager.num_checked > 20
    counts = e.runner.batch.counts
    assert counts["rows_moved"] and counts["rows_written"] and counts["rows_grown"]
