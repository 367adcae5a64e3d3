"""The engine's periodic log line: load, KV use, throughput, acceptance and the drafting mode.

  dspark stats: running 64, waiting 12, KV 41.3% used, prompt 1,820 tok/s, generation
  35,114 tok/s, 3,301 steps (12% eager), prefix cache hit rate 62.5%, acceptance length 2.07,
  drafting off

The drafting mode is the budget of the step about to run: "drafting off", "drafting on, full
block" or "drafting on, trimmed cell G=64 V=128".

Rates are over the interval since the previous line, from the scheduler's token totals; the
acceptance length is over that interval's verified windows, the prefix cache's hit rate over the
tokens of the requests it admitted (left out when none was admitted or caching is off). Steps
are the runner's, captured and eager (prefill chunks, and what no graph covers, run eagerly; on
the GPU an eager step costs several captured ones). One line at most every
`interval_s` seconds, from step(), only while there is work (an idle engine logs nothing).
"""

from __future__ import annotations

import logging
import time

logger = logging.getLogger("dspark.engine.stats")


class StatsLogger:
    def __init__(self, interval_s: float) -> None:
        self.interval_s = interval_s
        self._last = time.monotonic()
        # the counters' values at the last line
        self._prompt_tokens = self._generated_tokens = self._windows = self._emitted = 0
        self._steps = self._eager_steps = 0
        self._cache_queries = self._cache_hits = 0

    def maybe_log(self, engine) -> None:
        now = time.monotonic()
        elapsed = now - self._last
        if self.interval_s <= 0 or elapsed < self.interval_s:
            return
        sched, alloc = engine.scheduler, engine.allocator
        kv_used = 1 - alloc.num_free / alloc.num_usable
        prompt = sched.num_prompt_tokens_computed - self._prompt_tokens
        generated = sched.num_generated_tokens - self._generated_tokens
        parts = [
            f"running {len(sched.running)}", f"waiting {len(sched.waiting)}",
            f"KV {100 * kv_used:.1f}% used", f"prompt {prompt / elapsed:,.0f} tok/s",
            f"generation {generated / elapsed:,.0f} tok/s",
        ]  # fmt: skip
        stats = engine.runner.stats
        eager_total = stats["eager_steps"] + stats["eager_spec_steps"]
        steps_total = eager_total + stats["graph_steps"] + stats["spec_graph_steps"]
        steps, eager = steps_total - self._steps, eager_total - self._eager_steps
        if steps:
            parts.append(f"{steps:,} steps ({100 * eager / steps:.0f}% eager)")
        self._steps, self._eager_steps = steps_total, eager_total
        cache = engine.prefix_cache
        if cache is not None and cache.num_queries > self._cache_queries:
            queries = cache.num_queries - self._cache_queries
            hits = cache.num_hits - self._cache_hits  # (tokens of the requests admitted since)
            parts.append(f"prefix cache hit rate {100 * hits / queries:.1f}%")
            self._cache_queries, self._cache_hits = cache.num_queries, cache.num_hits
        if engine.spec is not None:
            m = engine.spec.metrics
            windows, emitted = m["num_drafts"], m["num_drafts"] + m["num_accepted_tokens"]
            if windows > self._windows:
                rate = (emitted - self._emitted) / (windows - self._windows)
                parts.append(f"acceptance length {rate:.2f}")
            if not sched.drafting:
                parts.append("drafting off")
            elif sched.trimmed_cell is not None:  # the budget: tokens per row of the cell
                g, v = sched.trimmed_cell
                parts.append(f"drafting on, trimmed cell G={g} V={v}")
            else:
                parts.append("drafting on, full block")
            self._windows, self._emitted = windows, emitted
        logger.info("dspark stats: %s", ", ".join(parts))
        self._last = now
        self._prompt_tokens = sched.num_prompt_tokens_computed
        self._generated_tokens = sched.num_generated_tokens
