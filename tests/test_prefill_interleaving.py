"""A long prompt is prefilled in chunks with the running requests' decode rows in every step,
so no running stream waits for a whole prompt's prefill."""

from __future__ import annotations

import pytest

from dspark import LLM, SamplingParams
from tests.tiny_models import make_tiny_llama

BUDGET = 1024  # max_num_batched_tokens: a 4,095-token prompt takes four chunks


@pytest.fixture(scope="module")
def long_llm(tmp_path_factory, smollm_hf_tokenizer):
    directory = tmp_path_factory.mktemp("long_tiny_llama")
    make_tiny_llama(directory, smollm_hf_tokenizer, max_position_embeddings=4096)
    return LLM(str(directory), dtype="float32", device="cpu", max_model_len=4096,
               max_num_batched_tokens=BUDGET, num_kv_pages=600)  # fmt: skip


def test_every_step_gives_every_running_stream_a_token_while_a_prompt_is_chunked(long_llm):
    engine = long_llm.engine
    streamed = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True,
                              output_kind="delta")  # fmt: skip
    streams = {"s0", "s1", "s2"}
    for i, rid in enumerate(sorted(streams)):
        engine.add_request(rid, [100 + i, 200, 300], streamed)
    started: set[str] = set()
    while started != streams:
        started |= {out.request_id for out in engine.step() if out.token_ids}
    engine.add_request("long", list(range(100, 100 + 4095)), SamplingParams(max_tokens=1))
    steps = []  # per step: the streams that got a token
    while not any(r.request_id == "long" for r in engine.scheduler.running) or any(
        r.request_id == "long" and r.is_prefilling for r in engine.scheduler.running
    ):
        outputs = engine.step()
        steps.append({out.request_id for out in outputs if out.token_ids} & streams)
    assert len(steps) >= 4095 // BUDGET, steps  # chunked, not one step
    assert all(got == streams for got in steps), steps
    for rid in [*streams, "long"]:
        engine.abort_request(rid)
    while engine.has_unfinished_requests():
        engine.step()


def test_serving_bounds_a_step_at_2048_tokens_and_offline_keeps_8192():
    from dspark.cli import build_parser
    from dspark.config import EngineConfig
    from dspark.server.cli import build_configs, resolve_options

    engine, _ = build_configs(resolve_options(build_parser().parse_args(["serve"])))
    assert engine.max_num_batched_tokens == 2048
    assert EngineConfig().max_num_batched_tokens == 8192
