"""GET /metrics: Prometheus text exposition (format 0.0.4), with vLLM's metric names.

Three sources, each rendered by one function:
- request figures recorded as each request finishes (`RequestMetrics.record`): token counters,
  finished requests by reason, vLLM's latency histograms (`LATENCY_HISTOGRAMS`: time to first
  token, inter-token latency, time per output token, end to end, queue, prefill, decode and
  inference time), and the 503s answered. The
  engine process records them, where every request of every API process ends, and sends a
  snapshot with its stats, so each API process's page is the whole server's;
- the engine's state after its last step (`EngineStats`): running and waiting requests, KV use,
  preemptions, prefix cache queries and hits (tokens);
- the engine's speculative counters (`LLMEngine.get_metrics()`), mapped by the `SPEC_METRICS`
  table. A new engine counter is exposed by adding one row there; a row whose key the engine
  does not report (yet) is simply left out.

Every sample carries model_name, as vLLM's do, so dashboards built for vLLM read dspark.
"""

from __future__ import annotations

import bisect
import math
from collections import Counter
from dataclasses import dataclass

from dspark.outputs import FinalInfo
from dspark.server.wire import EngineState, EngineStats

# vLLM's buckets (vllm/v1/metrics/loggers.py)
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)  # fmt: skip
TOKEN_GAP_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5,
                     5.0, 7.5, 10.0, 20.0, 40.0, 80.0)  # fmt: skip
REQUEST_LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0,
                           50.0, 60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)  # fmt: skip


@dataclass(frozen=True)
class LatencyHistogram:
    """One of vLLM's request latency histograms: its name, buckets and help text."""

    name: str
    buckets: tuple[float, ...]
    help: str


# Each finished request's phases, from its timestamps (the engine's, monotonic, in its final
# output's metrics), as vLLM splits them:
#
#   arrival   added      scheduled          first token           last token   finished
#     |---------|------------|---------------------|--------------------|
#               <-- queue --><----- prefill -------><------ decode ------>
#     <------------- time to first token ---------->
#                            <------------------ inference -------------->
#     <---------------------------------- end to end -------------------------------->
#
# request_time_per_output_token is decode / (output tokens - 1), one sample per request; the
# inter-token latencies are one sample per step that gave the request tokens after its first.
LATENCY_HISTOGRAMS = (
    LatencyHistogram("vllm:time_to_first_token_seconds", TTFT_BUCKETS,
                     "Arrival to the first token."),
    LatencyHistogram("vllm:inter_token_latency_seconds", TOKEN_GAP_BUCKETS,
                     "Time between consecutive steps that gave a request tokens."),
    LatencyHistogram("vllm:request_time_per_output_token_seconds", TOKEN_GAP_BUCKETS,
                     "Per request, decode time over output tokens after the first."),
    LatencyHistogram("vllm:e2e_request_latency_seconds", REQUEST_LATENCY_BUCKETS,
                     "Arrival to finish."),
    LatencyHistogram("vllm:request_queue_time_seconds", REQUEST_LATENCY_BUCKETS,
                     "Time waiting in the engine's queue, added to first scheduled."),
    LatencyHistogram("vllm:request_prefill_time_seconds", REQUEST_LATENCY_BUCKETS,
                     "First scheduled to the first token."),
    LatencyHistogram("vllm:request_decode_time_seconds", REQUEST_LATENCY_BUCKETS,
                     "First token to the last token."),
    LatencyHistogram("vllm:request_inference_time_seconds", REQUEST_LATENCY_BUCKETS,
                     "First scheduled to the last token."),
)  # fmt: skip


def _phases(final: FinalInfo) -> dict[str, list[float]]:
    """A finished request's samples per histogram name (a phase it never reached has none)."""
    m, num_output = final.metrics, final.num_output_tokens
    arrival, added, scheduled = m["arrival_time"], m.get("added_time"), m.get("scheduled_time")
    first, last, end = m.get("first_token_time"), m.get("last_token_time"), m.get("finished_time")
    spans = {
        "vllm:time_to_first_token_seconds": (arrival, first),
        "vllm:e2e_request_latency_seconds": (arrival, end),
        "vllm:request_queue_time_seconds": (added, scheduled),
        "vllm:request_prefill_time_seconds": (scheduled, first),
        "vllm:request_decode_time_seconds": (first, last),
        "vllm:request_inference_time_seconds": (scheduled, last),
    }
    samples = {name: [b - a] for name, (a, b) in spans.items() if a is not None and b is not None}
    if first is not None and last is not None and num_output > 1:
        samples["vllm:request_time_per_output_token_seconds"] = [(last - first) / (num_output - 1)]
    samples["vllm:inter_token_latency_seconds"] = list(m.get("inter_token_latencies", ()))
    return samples


@dataclass(frozen=True)
class SpecMetric:
    """How one key of get_metrics() is exposed.

    kind: "counter" (a number, exposed as NAME_total), "gauge", "per_position" (a list, one
    counter sample per draft position), "by_label" (a {value: count} dict, one counter sample
    per value of `label`), "histogram_of_counts" (a list whose entry i counts observations of
    the value i, exposed as a histogram with a bucket per value).
    """

    key: str
    name: str
    kind: str
    help: str
    label: str | None = None


SPEC_METRICS = (
    SpecMetric("num_drafts", "vllm:spec_decode_num_drafts", "counter",
               "Speculative windows verified (one per request per speculative step)."),
    SpecMetric("num_draft_tokens", "vllm:spec_decode_num_draft_tokens", "counter",
               "Drafted tokens sent to the target for verification."),
    SpecMetric("num_accepted_tokens", "vllm:spec_decode_num_accepted_tokens", "counter",
               "Drafted tokens the target accepted."),
    SpecMetric("num_accepted_tokens_per_pos", "vllm:spec_decode_num_accepted_tokens_per_pos",
               "per_position", "Accepted drafted tokens by draft position.", "position"),
    SpecMetric("mean_acceptance_length", "dspark:spec_decode_mean_acceptance_length", "gauge",
               "Tokens produced per verified window since start (bonus included)."),
    SpecMetric("num_verified_tokens", "dspark:spec_decode_num_verified_tokens", "counter",
               "Tokens in verify batches: anchors plus verified drafts."),
    SpecMetric("verify_budget", "dspark:spec_decode_verify_budget", "gauge",
               "The confidence scheduler's current verify-token budget."),
    SpecMetric("verify_len_counts", "dspark:spec_decode_verify_len", "histogram_of_counts",
               "Drafted positions verified per window."),
    SpecMetric("fallbacks", "dspark:spec_decode_fallbacks", "by_label",
               "Steps that fell back (no graph, no cost table, ...), by reason.", "reason"),
    SpecMetric("drafting", "dspark:spec_decode_drafting", "gauge",
               "1 while steps draft, 0 while the drafting policy has drafting off."),
    SpecMetric("predicted_survival_per_pos", "dspark:spec_decode_predicted_survival_per_pos",
               "per_position", "Calibrated survival predicted, summed over full-block windows.",
               "position"),
    SpecMetric("realised_survival_per_pos", "dspark:spec_decode_realised_survival_per_pos",
               "per_position", "Full-block windows whose drafts 1..position were all accepted.",
               "position"),
)  # fmt: skip


class Histogram:
    def __init__(self, buckets: tuple[float, ...]) -> None:
        self.buckets = buckets
        self.counts = [0] * (len(buckets) + 1)  # the last one is +Inf
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.buckets, value)] += 1
        self.sum += value

    def samples(self, name: str, labels: dict[str, str]) -> list[str]:
        lines, cumulative = [], 0
        for bound, count in zip((*self.buckets, math.inf), self.counts, strict=True):
            cumulative += count
            le = "+Inf" if bound == math.inf else repr(float(bound))
            lines.append(_sample(f"{name}_bucket", {**labels, "le": le}, cumulative))
        lines.append(_sample(f"{name}_sum", labels, self.sum))
        lines.append(_sample(f"{name}_count", labels, cumulative))
        return lines


class RequestMetrics:
    """Figures recorded per finished request (and per 503), kept where they are recorded (the
    engine process) and sent to the API processes as `snapshot()` tuples."""

    def __init__(self) -> None:
        self.prompt_tokens = 0
        self.generation_tokens = 0
        self.finished = Counter()  # finish reason -> requests
        self.rejected = Counter()  # reason -> HTTP requests refused with 503
        self.latencies = {h.name: Histogram(h.buckets) for h in LATENCY_HISTOGRAMS}

    def record(self, final: FinalInfo) -> None:
        """A request's end (its final output's FinalInfo)."""
        self.prompt_tokens += final.num_prompt_tokens
        self.generation_tokens += final.num_output_tokens
        self.finished[final.finish_reason] += 1
        for name, values in _phases(final).items():
            histogram = self.latencies[name]
            for value in values:
                histogram.observe(value)

    def snapshot(self) -> tuple:
        """Plain values, to cross the pipe (pickled in C: no objects of ours)."""
        hists = tuple((tuple(h.counts), h.sum) for h in self.latencies.values())
        return (self.prompt_tokens, self.generation_tokens, dict(self.finished),
                dict(self.rejected), hists)  # fmt: skip

    @classmethod
    def from_snapshot(cls, snapshot: tuple) -> RequestMetrics:
        metrics = cls()
        if not snapshot:  # (no snapshot yet)
            return metrics
        prompt, generation, finished, rejected, hists = snapshot
        metrics.prompt_tokens, metrics.generation_tokens = prompt, generation
        metrics.finished, metrics.rejected = Counter(finished), Counter(rejected)
        for histogram, (counts, total) in zip(metrics.latencies.values(), hists, strict=True):
            histogram.counts, histogram.sum = list(counts), total
        return metrics


class ServerMetrics:
    """The whole /metrics page of one API process: the engine's request figures (from its
    latest stats) plus the 503s this process answered while no engine could count them
    (loading, stopping, dead)."""

    def __init__(self, model_name: str) -> None:
        self.labels = {"model_name": model_name}
        self.rejected_here = Counter()  # reason -> 503s this process answered itself

    def render(self, stats: EngineStats, engine_state: str) -> str:
        """The page; `engine_state`: an EngineState's value (loading, serving, stopping,
        dead)."""
        requests = RequestMetrics.from_snapshot(stats.requests)
        requests.rejected.update(self.rejected_here)
        return "".join(
            _request_families(requests, self.labels)
            + _engine_families(stats, engine_state, self.labels)
            + spec_families(stats.spec, self.labels)
        )  # fmt: skip


def _request_families(m: RequestMetrics, lb: dict[str, str]) -> list[str]:
    reasons = sorted(set(m.finished) | {"stop", "length", "abort", "error"})
    return [
        _family("vllm:prompt_tokens_total", "counter", "Prompt tokens of finished requests.",
                [_sample("vllm:prompt_tokens_total", lb, m.prompt_tokens)]),
        _family("vllm:generation_tokens_total", "counter", "Generated tokens.",
                [_sample("vllm:generation_tokens_total", lb, m.generation_tokens)]),
        _family("vllm:request_success_total", "counter", "Finished requests by reason.",
                [_sample("vllm:request_success_total", {**lb, "finished_reason": r},
                         m.finished[r]) for r in reasons]),
        _family("dspark:requests_rejected_total", "counter",
                "HTTP requests refused with 503, by reason.",
                [_sample("dspark:requests_rejected_total", {**lb, "reason": r}, n)
                 for r, n in sorted(m.rejected.items())]),
    ] + [
        _family(h.name, "histogram", h.help, m.latencies[h.name].samples(h.name, lb))
        for h in LATENCY_HISTOGRAMS
    ]  # fmt: skip


def _engine_families(stats: EngineStats, engine_state: str, lb: dict[str, str]) -> list[str]:
    usage = stats.num_kv_pages_used / stats.num_kv_pages if stats.num_kv_pages else 0.0
    gauges = [
        ("dspark:engine_serving", "1 while the engine serves, 0 while loading or dead.",
         int(engine_state == "serving")),
        ("vllm:num_requests_running", "Requests in the running batch.", stats.num_running),
        ("vllm:num_requests_waiting", "Requests waiting to be scheduled.", stats.num_waiting),
        ("vllm:kv_cache_usage_perc", "Fraction of KV pages in use (0 to 1).", usage),
        ("dspark:kv_cache_pages_used", "KV pages in use.", stats.num_kv_pages_used),
        ("dspark:kv_cache_pages", "Usable KV pages.", stats.num_kv_pages),
    ]  # fmt: skip
    families = [_family(name, "gauge", text, [_sample(name, lb, v)]) for name, text, v in gauges]
    name = "dspark:engine_state"  # one sample per state, 1 for the current one (an enum gauge)
    families.append(
        _family(name, "gauge", "The engine's state: loading, serving, stopping or dead.",
                [_sample(name, {**lb, "state": st}, int(st == engine_state))
                 for st in (state.value for state in EngineState)])
    )  # fmt: skip
    counters = [
        ("vllm:num_preemptions_total", "Preemptions.", stats.num_preemptions),
        ("vllm:prefix_cache_queries_total",
         "Prefix cache queries: tokens of the requests admitted (looked up in the cache).",
         stats.num_prefix_cache_queries),
        ("vllm:prefix_cache_hits_total",
         "Prefix cache hits: tokens of admitted requests found in cached KV pages.",
         stats.num_prefix_cache_hits),
    ]  # fmt: skip
    families += [
        _family(name, "counter", text, [_sample(name, lb, v)]) for name, text, v in counters
    ]
    return families


def spec_families(spec: dict, lb: dict[str, str]) -> list[str]:
    """The SPEC_METRICS rows whose keys the engine reported."""
    families = []
    for row in SPEC_METRICS:
        value = spec.get(row.key)
        if value is None:
            continue
        if row.kind == "gauge":
            families.append(_family(row.name, "gauge", row.help, [_sample(row.name, lb, value)]))
            continue
        if row.kind == "histogram_of_counts":
            families.append(_family(row.name, "histogram", row.help,
                                    _histogram_of_counts(row.name, lb, value)))  # fmt: skip
            continue
        name = f"{row.name}_total"
        if row.kind == "counter":
            samples = [_sample(name, lb, value)]
        elif row.kind == "per_position":
            samples = [_sample(name, {**lb, row.label: str(i)}, v) for i, v in enumerate(value)]
        else:  # by_label
            samples = [_sample(name, {**lb, row.label: str(k)}, v) for k, v in value.items()]
        families.append(_family(name, "counter", row.help, samples))
    return families


def _histogram_of_counts(name: str, labels: dict[str, str], counts: list[int]) -> list[str]:
    """counts[i] observations of value i -> cumulative buckets le="0", "1", ..., "+Inf"."""
    lines, cumulative = [], 0
    for value, count in enumerate(counts):
        cumulative += count
        lines.append(_sample(f"{name}_bucket", {**labels, "le": f"{float(value)}"}, cumulative))
    lines.append(_sample(f"{name}_bucket", {**labels, "le": "+Inf"}, cumulative))
    lines.append(_sample(f"{name}_sum", labels, sum(i * c for i, c in enumerate(counts))))
    lines.append(_sample(f"{name}_count", labels, cumulative))
    return lines


def _family(name: str, kind: str, help_text: str, samples: list[str]) -> str:
    return f"# HELP {name} {help_text}\n# TYPE {name} {kind}\n" + "".join(samples)


def _escape(value: str) -> str:
    return value.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _sample(name: str, labels: dict[str, str], value: float) -> str:
    text = ",".join(f'{k}="{_escape(str(v))}"' for k, v in labels.items())
    return f"{name}{{{text}}} {float(value)!r}\n"
