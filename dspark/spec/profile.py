"""`dspark profile`: measure the whole-step time of every cell the engine can run and write the
cost table (DSPARK.md 7; the format is in spec/cost_table.py).

For each batch size G: G greedy requests (a fixed synthetic prompt, ignore_eos) are prefilled,
then the engine steps with drafting off (plain decoding, V = G) and on (the full block,
V = G (K + 1)), each `warmup` steps untimed and then `steps` steps timed one by one, for `rounds`
rounds of the two; a cell's value is the lowest of its rounds' medians. One round is not enough
on a shared GPU: on the H200 (2026-12-03) the first cell measured, G = 1's full block, read
3.17 ms against 2.26 ms at G = 2, while the bench's K = 7 arm realised about 2.7 ms per step at
concurrency 1. The lowest median of the rounds is the steady cost, which is what the drafting
policy prices (a one-off slow stretch is not a property of the cell). The step is
`LLMEngine.step()`: drafting, the target, sampling, verification and the host's work, what a
user's step costs. Greedy windows over a fixed prompt keep acceptance (and so KV growth) alike
across cells. The engine runs without a cost table (drafting is set here).

  G 16: plain 1.02 ms, full block 2.41 ms  ->  {"16": {"16": 0.00102, "128": 0.00241}}
"""

from __future__ import annotations

import math
import statistics
import time

from dspark.llm import LLM
from dspark.sampling_params import SamplingParams
from dspark.spec.cost_table import CostTable, full_block_tokens


def _median_step(llm: LLM, steps: int, warmup: int) -> float:
    engine = llm.engine
    for _ in range(warmup):
        engine.step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        engine.step()  # one launched and one collected: in steady state, one step's period
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def _drain(llm: LLM) -> None:
    engine = llm.engine
    for req in list(engine.scheduler.running) + list(engine.scheduler.waiting):
        engine.abort_request(req.request_id)
    while engine.has_unfinished_requests():
        engine.step()
    engine.step()  # reports the aborted requests (and forgets them)


def profile_cost_table(
    llm: LLM, batches: list[int], steps: int = 8, warmup: int = 3, prompt_len: int = 64,
    rounds: int = 2,
) -> CostTable:  # fmt: skip
    """Measure (G, G) and (G, G (K + 1)) for each G in batches on this engine."""
    engine = llm.engine
    if engine.spec is None or engine.policy is not None:
        raise ValueError("profiling needs a speculative engine without a cost table")
    if steps < 5:
        raise ValueError(f"steps must be >= 5 (a median of at least five), got {steps}")
    if rounds < 1:
        raise ValueError(f"rounds must be >= 1, got {rounds}")
    K = engine.spec.num_verify
    # enough room for every timed step to draft a full block without reaching max_tokens
    max_tokens = (2 * rounds * (steps + warmup) + 2) * (K + 1)
    if prompt_len + max_tokens > engine.max_model_len:
        raise ValueError(f"prompt_len {prompt_len} + {max_tokens} tokens exceed max_model_len "
                         f"{engine.max_model_len}")  # fmt: skip
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    prompt = [(7 * j + 11) % engine.model_config.vocab_size for j in range(prompt_len)]
    cells: dict[int, dict[int, float]] = {}
    for g in batches:
        if g > engine.config.max_num_seqs:
            raise ValueError(f"batch {g} exceeds max_num_seqs {engine.config.max_num_seqs}")
        for i in range(g):
            engine.add_request(f"profile-{g}-{i}", prompt, params)
        sched = engine.scheduler
        sched.drafting = False
        while sched.waiting or any(r.num_computed_tokens < r.num_prompt_tokens
                                   for r in sched.running):  # fmt: skip
            engine.step()
        plain = full = math.inf
        for _ in range(rounds):
            sched.drafting = False
            plain = min(plain, _median_step(llm, steps, warmup))
            sched.drafting = True
            full = min(full, _median_step(llm, steps, warmup))
        cells[g] = {g: plain, full_block_tokens(g, K): full}
        _drain(llm)
    return CostTable(engine.cost_fingerprint(), cells)


def format_table(table: CostTable, draft_len: int) -> str:
    rows = ["    G   plain ms   full ms   full / plain"]
    for g, row in sorted(table.cells.items()):
        plain, full = row[g], row[full_block_tokens(g, draft_len)]
        rows.append(f"{g:>5} {plain * 1e3:>10.3f} {full * 1e3:>9.3f} {full / plain:>14.2f}")
    return "\n".join(rows)
