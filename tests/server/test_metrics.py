"""The /metrics renderer: histograms, and every kind of speculative row in SPEC_METRICS."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("fastapi")
from dspark.outputs import FinalInfo  # noqa: E402
from dspark.server.metrics import (  # noqa: E402
    Histogram,
    RequestMetrics,
    ServerMetrics,
    spec_families,
)
from dspark.server.wire import EngineStats  # noqa: E402

LABELS = {"model_name": "m"}


def test_histogram_buckets_are_cumulative_with_inf():
    h = Histogram((0.1, 1.0))
    for value in (0.05, 0.1, 0.5, 3.0):  # 0.1 lands in le="0.1" (Prometheus buckets are <=)
        h.observe(value)
    lines = h.samples("x", LABELS)
    assert lines == [
        'x_bucket{model_name="m",le="0.1"} 2.0\n',
        'x_bucket{model_name="m",le="1.0"} 3.0\n',
        'x_bucket{model_name="m",le="+Inf"} 4.0\n',
        'x_sum{model_name="m"} 3.65\n',
        'x_count{model_name="m"} 4.0\n',
    ]


def test_every_spec_row_kind_renders_and_missing_keys_are_left_out():
    spec = {
        "num_drafts": 10,
        "num_accepted_tokens_per_pos": [7, 3],
        "mean_acceptance_length": 2.0,
        "verify_len_counts": [1, 0, 4],  # one window verified 0 drafts, four verified 2
        "fallbacks": {"no_cost_table": 2},
    }
    text = "".join(spec_families(spec, LABELS))
    assert 'vllm:spec_decode_num_drafts_total{model_name="m"} 10.0' in text
    assert "# TYPE vllm:spec_decode_num_drafts_total counter" in text
    assert (
        'vllm:spec_decode_num_accepted_tokens_per_pos_total{model_name="m",position="1"} 3.0'
        in text
    )
    assert 'dspark:spec_decode_mean_acceptance_length{model_name="m"} 2.0' in text
    assert 'dspark:spec_decode_verify_len_bucket{model_name="m",le="1.0"} 1.0' in text
    assert 'dspark:spec_decode_verify_len_bucket{model_name="m",le="+Inf"} 5.0' in text
    assert 'dspark:spec_decode_verify_len_sum{model_name="m"} 8.0' in text
    assert 'dspark:spec_decode_fallbacks_total{model_name="m",reason="no_cost_table"} 2.0' in text
    assert "num_draft_tokens" not in text and "verify_budget" not in text  # not reported


def test_server_metrics_record_finished_requests():
    """Recorded in the engine process, sent as a snapshot, rendered by an API process (with
    the 503s it answered itself added to the engine's count)."""
    requests = RequestMetrics()
    # arrival 10, added 10.25, scheduled 10.375, tokens at 10.5 (the first), 11.0 and 11.5
    times = {"arrival_time": 10.0, "added_time": 10.25, "scheduled_time": 10.375,
             "first_token_time": 10.5, "last_token_time": 11.5, "finished_time": 11.5,
             "inter_token_latencies": [0.5, 0.5]}  # fmt: skip
    requests.record(FinalInfo("length", None, 2, 3, None, times))
    requests.rejected["queue_full"] += 2
    metrics = ServerMetrics('a "quoted" name')
    metrics.rejected_here["loading"] += 1
    stats = EngineStats(num_running=1, num_kv_pages_used=3, num_kv_pages=12,
                        requests=requests.snapshot())  # fmt: skip
    text = metrics.render(stats, "serving")
    labels = 'model_name="a \\"quoted\\" name"'
    assert f"vllm:prompt_tokens_total{{{labels}}} 2.0" in text
    assert f"vllm:generation_tokens_total{{{labels}}} 3.0" in text
    assert f'vllm:request_success_total{{{labels},finished_reason="length"}} 1.0' in text
    expected_sums = {
        "time_to_first_token": 0.5,  # arrival -> first token
        "request_queue_time": 0.125,  # added -> scheduled
        "request_prefill_time": 0.125,  # scheduled -> first token
        "request_decode_time": 1.0,  # first -> last token
        "request_inference_time": 1.125,  # scheduled -> last token
        "e2e_request_latency": 1.5,
        "request_time_per_output_token": 0.5,  # 1 s of decode / 2 tokens after the first
        "inter_token_latency": 1.0,  # two gaps of 0.5 s
    }
    for name, total in expected_sums.items():
        assert f"vllm:{name}_seconds_sum{{{labels}}} {total!r}" in text, name
    assert f"vllm:inter_token_latency_seconds_count{{{labels}}} 2.0" in text
    assert f'vllm:inter_token_latency_seconds_bucket{{{labels},le="0.5"}} 2.0' in text
    assert f'vllm:inter_token_latency_seconds_bucket{{{labels},le="0.4"}} 0.0' in text
    assert "vllm:time_per_output_token_seconds" not in text  # (vLLM's old name of the ITL)
    assert f"vllm:kv_cache_usage_perc{{{labels}}} 0.25" in text
    assert f'dspark:requests_rejected_total{{{labels},reason="queue_full"}} 2.0' in text
    assert f'dspark:requests_rejected_total{{{labels},reason="loading"}} 1.0' in text
    # every line is a comment or `name{labels} value`
    sample = re.compile(r'^[a-z0-9_:]+\{([a-z_]+="([^"\\]|\\.)*",?)*\} -?[0-9.e+-]+$')
    for line in text.splitlines():
        assert line.startswith("# ") or sample.match(line), line
