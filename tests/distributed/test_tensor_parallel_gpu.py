"""The tensor-parallel layers on one GPU: a group of one rank (NCCL) runs every collective the
sharded model issues (the all-reduces after o and down, the embedding's, the head's all-gather)
inside the captured decode and speculative graphs, and must give the plain engine's tokens. On
two GPUs: a killed worker ends an NCCL job within seconds."""

from __future__ import annotations

import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.config import EngineConfig
from dspark.distributed.launch import pick_port
from dspark.distributed.parallel_state import destroy_tensor_parallel, init_tensor_parallel
from dspark.engine.engine import LLMEngine
from tests.distributed.test_tensor_parallel import assert_a_killed_worker_ends_the_job
from tests.tiny_models import make_tiny_drafter

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(),
                                                  reason="needs CUDA")]  # fmt: skip
PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9], [9], [4, 4, 4, 4, 10, 11]]


def _tokens(engine: LLMEngine) -> list[list[int]]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    for i, prompt in enumerate(PROMPTS):
        engine.add_request(str(i), prompt, params)
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o.outputs[0].token_ids for o in engine.step() if o.finished}
    return [done[str(i)] for i in range(len(PROMPTS))]


@pytest.mark.parametrize("speculative", [False, True])
def test_collectives_captured_in_graphs_keep_the_tokens(tiny_vocab_dir, tmp_path, speculative):
    spec = None
    if speculative:
        drafter = make_tiny_drafter(tiny_vocab_dir, tmp_path / "drafter", taps=(0,))
        spec = {"model": str(drafter), "num_speculative_tokens": 3}
    config = EngineConfig(model=str(tiny_vocab_dir), dtype="float32", max_num_seqs=4,
                          num_kv_pages=256, speculative_config=spec)  # fmt: skip
    plain = _tokens(LLMEngine(config))
    tp = init_tensor_parallel(0, 1, pick_port(None), torch.device("cuda", 0))
    try:
        engine = LLMEngine(config, tp=tp)
        assert engine.runner.stager.graphs is not None  # (the graphs hold the collectives)
        assert _tokens(engine) == plain
        assert (
            engine.runner.stats["graph_steps"] + engine.runner.stats.get("spec_graph_steps", 0) > 0
        ), engine.runner.stats
    finally:
        destroy_tensor_parallel()


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_killed_worker_ends_an_nccl_job_within_seconds(tiny_vocab_dir):
    """Over NCCL a collective with a peer gone waits (for COLLECTIVE_TIMEOUT) instead of failing
    as gloo's does: rank 0's watchdog (distributed/launch.py Workers.watch) aborts the
    communicators, so the job still ends within seconds, naming the rank."""
    llm = LLM(str(tiny_vocab_dir), tensor_parallel_size=2, dtype="float32", device="cuda",
              num_kv_pages=128, max_num_seqs=4, max_model_len=256)  # fmt: skip
    assert_a_killed_worker_ends_the_job(llm, within_s=30)
