"""Host work of one decode step of the real engine at a large batch, phase by phase (CPU).

    PYTHONPATH=. python bench/host_step_phases.py --batch 256 --steps 100 [--temperature 0.8]

Runs the engine (async scheduling, eager CPU path laid out for the graph ladder, as on the GPU:
pad rows included) on a tiny random Llama (1 layer) with SmolLM2's tokenizer and a 64-token
vocabulary (so the argmax over it is cheap, as on the GPU),
so the forward is cheap and the host work shows. `batch` requests decode with ignore_eos to a
fixed length; once all decode, `--steps` engine steps are timed, each phase with
time.perf_counter_ns around the engine's own functions, and the medians printed in
microseconds:

  schedule   Scheduler.schedule + advance
  stage      StepStager.stage (positions, slots, block tables, seq lens, padding) + upload
  sample     the sampling set-up around the forward's logits (stop-token bans, greedy check,
             sampling tensors), argmax / sampling included
  forward    the model (not host work; on the GPU a graph replay)
  feed_check whether the step may launch before the previous one is read back
  launch_rest  the rest of ModelRunner.launch (feeding pending tokens, result copies)
  read_back  ModelRunner.collect (results to Python, SampledTokens per row)
  update     Scheduler.update (tokens written, stops)
  outputs    the rest of the engine's _update (detokenize, outputs)
  other      the rest of the engine's step
  host       the step's wall time minus forward

`--no-forward` replaces the model's forward by zero logits (every row samples token 0): what the
host does around a GPU step, whose forward (a graph replay) neither takes host time nor evicts
the host's caches the way the CPU forward does; the default runs the real forward.
`--profile` also prints the top functions by own time under cProfile, the forward left out
(the profiler is off inside it): the host work alone.

`--drafting` times the speculative engine's drafting steps instead (a random drafter, fixed
K = --k, windows laid out K + 1 wide and launched ahead as with speculative graphs), with
these phases in place of sample:

  feed_check    the engine's ahead check (Scheduler.ahead_blocker: may step N+1 launch?)
  forward       SpecDecoder.step: drafting, verification, acceptance (a graph replay on the GPU)
  continuations SpecRunner._feed_continuations (anchors from the step in flight; a Triton
                launch on the GPU, torch ops here)
  queue         SpecRunner.queue_results (host copies of the windows' results)
  read_back     ModelRunner.collect less assign; assign: SpecRunner.assign (verified tokens
                per row, the confidences' sinks)

(With random weights nearly every draft is rejected, so a window emits one or two tokens;
the per-row work does not depend on how many.)

`--arrivals` times a closed loop instead, plain decoding: `batch` requests in flight whose
lengths are drawn from --output-len x [0.5, 1.5] (as `dspark bench --output-len-spread 0.5`),
each replaced by a new request of --prompt-len tokens when it ends, with the captured mixed
decode steps' layout (a tail of up to --tail-tokens prefill tokens beside the decode rows,
tests/helpers.py EagerDecodeGraphs) and the burst rule as on the GPU. After the loop reached
its steady mix (--warmup steps), the steps that admitted (a prefill scheduled in the call) and
the steady ones are timed separately: on the H100 at 256 requests the arrivals cost ~0.8 ms
more host work than a steady step (2.1-2.3 against 1.4-1.5 ms) in 42% of a closed loop's
steps, with the GPU waiting (docs/PERFORMANCE.md, twenty-eighth look: the K = 7 and plain trace of
`bench/results/session24/h100/host_cut/`).
"""

from __future__ import annotations

import argparse
import cProfile
import gc
import pstats
import random
import statistics
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import torch

from dspark import LLM, SamplingParams
from dspark.engine.collector import steady_collector
from dspark.runner.cuda_graph import graph_ladder
from dspark.runner.model_runner import ModelRunner

PHASES = (
    "schedule",
    "feed_check",
    "stage",
    "sample",
    "launch_rest",
    "forward",
    "read_back",
    "update",
    "outputs",
    "other",
    "host",
)
DRAFTING_PHASES = (
    "schedule", "feed_check", "stage", "continuations", "launch_rest", "forward", "queue",
    "read_back", "assign", "update", "outputs", "other", "host",
)  # fmt: skip


def _tiny_model(directory: Path, vocab_size: int, num_layers: int) -> Path:
    from transformers import AutoTokenizer

    from dspark.models.loader import default_model_path
    from tests.tiny_models import _llama_config, save_random_model

    gguf = default_model_path()
    tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # (the tokenizer decodes any id below its own size, so a smaller model vocabulary works)
    save_random_model(directory, _llama_config(vocab_size, num_hidden_layers=num_layers))
    tok.save_pretrained(directory)
    return directory


def _build(
    model_dir: Path,
    batch: int,
    drafter: Path | None = None,
    drafting: bool = False,
    k: int = 7,
    tail_tokens: int = 0,  # the mixed decode steps' (--arrivals): buffers sized for their tail
) -> LLM:
    spec = None if drafter is None else {"model": str(drafter), "scheduling": False,
                                         "num_speculative_tokens": k}  # fmt: skip
    llm = LLM(str(model_dir), dtype="float32", device="cpu", num_kv_pages=64 * batch,
              max_num_seqs=batch, max_num_batched_tokens=max(2048, batch * (k + 1)),
              speculative_config=spec)  # fmt: skip
    e = llm.engine
    e.runner = ModelRunner(  # the GPU's layout: batches padded to the graph ladder, run eagerly
        e.model, e.runner.kv_caches, e.config.page_size, e.config.max_num_batched_tokens,
        e.config.max_num_seqs, e.max_model_len, e.device, graph_sizes=graph_ladder(batch),
        capture_graphs=False, spec=e.runner.spec, decode_tail_tokens=tail_tokens,
    )  # fmt: skip
    if drafting:  # windows K + 1 wide, launched ahead: the layout of the speculative graphs
        e.runner.spec_runner.uniform_windows = True
    elif drafter is not None:
        e.scheduler.drafting = False  # the speculative engine's plain steps (drafting off)
    return llm


class PhaseTimer:
    """Wraps functions in place; each call adds its duration to the current step's phase."""

    def __init__(self) -> None:
        self.step: dict[str, int] = defaultdict(int)

    def wrap(self, owner: object, name: str, phase: str, minus: tuple[str, ...] = ()) -> None:
        fn = getattr(owner, name)

        def timed(*args, **kwargs):
            inner = {m: self.step[m] for m in minus}
            t0 = time.perf_counter_ns()
            out = fn(*args, **kwargs)
            elapsed = time.perf_counter_ns() - t0
            self.step[phase] += elapsed - sum(self.step[m] - inner[m] for m in minus)
            return out

        setattr(owner, name, timed)


def _instrument_drafting(llm: LLM, timer: PhaseTimer) -> None:
    e, r = llm.engine, llm.engine.runner
    sr = r.spec_runner
    timer.wrap(e.scheduler, "schedule", "schedule")
    timer.wrap(e.scheduler, "advance", "schedule")
    timer.wrap(e, "_ahead_blocker", "feed_check")
    timer.wrap(r.stager, "stage", "stage")
    timer.wrap(r.buffers, "upload", "stage")
    timer.wrap(sr, "_feed_continuations", "continuations")
    timer.wrap(sr.spec, "step", "forward")
    timer.wrap(sr, "queue_results", "queue")
    timer.wrap(r, "launch", "launch_rest", minus=("stage", "continuations", "forward", "queue"))
    timer.wrap(sr, "assign", "assign")
    timer.wrap(r, "collect", "read_back", minus=("assign",))
    timer.wrap(e.scheduler, "update", "update")
    timer.wrap(e, "_update", "outputs", minus=("update",))


def _instrument(llm: LLM, timer: PhaseTimer) -> None:
    e, r = llm.engine, llm.engine.runner
    timer.wrap(e.scheduler, "schedule", "schedule")
    timer.wrap(e.scheduler, "advance", "schedule")
    timer.wrap(r.stager, "stage", "stage")
    timer.wrap(r.buffers, "upload", "stage")
    timer.wrap(r, "launch", "launch_rest", minus=("stage", "sample", "forward"))
    if hasattr(r, "can_feed"):
        timer.wrap(r, "can_feed", "feed_check")
    else:  # (before the persistent batch: the engine's own check)
        timer.wrap(e, "_can_launch_ahead", "feed_check")
    timer.wrap(r, "_forward", "forward")
    timer.wrap(r, "_sample", "sample")
    timer.wrap(r, "collect", "read_back")
    timer.wrap(e.scheduler, "update", "update")
    timer.wrap(e, "_update", "outputs", minus=("update",))


def _unprofiled_forward(llm: LLM, profiler: cProfile.Profile, drafting: bool) -> None:
    """Turn the profiler off inside the forward (CPU math, a graph replay on the GPU)."""
    r = llm.engine.runner
    owner, name = (r.spec_runner.spec, "step") if drafting else (r, "_forward")
    fn = getattr(owner, name)

    def forward(*args, **kwargs):
        profiler.disable()
        try:
            return fn(*args, **kwargs)
        finally:
            profiler.enable()

    setattr(owner, name, forward)


class ClosedLoop:
    """`batch` requests in flight, each replaced when it ends (--arrivals)."""

    def __init__(
        self, llm: LLM, batch: int, prompt_len: int, output_len: int, output_kind: str
    ) -> None:
        self.engine, self.prompt_len, self.output_len = llm.engine, prompt_len, output_len
        self.output_kind = output_kind
        self.rng = random.Random(0)
        self.num_added = 0
        for _ in range(batch):
            self.add()

    def add(self) -> None:
        vocab, i = self.engine.model_config.vocab_size, self.num_added
        length = self.rng.randint(self.output_len // 2, self.output_len * 3 // 2)
        params = SamplingParams(temperature=0, max_tokens=length, ignore_eos=True,
                                output_kind=self.output_kind)  # fmt: skip
        prompt = [(i * 7 + j) % vocab for j in range(self.prompt_len)]
        self.engine.add_request(f"r{i}", prompt, params)
        self.num_added += 1

    def step(self) -> bool:
        """One engine step, the ended requests replaced; whether it scheduled a prefill."""
        before = self.engine.scheduler.num_prompt_tokens_computed
        for output in self.engine.step():
            if output.finished:
                self.add()
        return self.engine.scheduler.num_prompt_tokens_computed > before


def _with_mixed_decode_steps(llm: LLM, tail_tokens: int) -> None:
    """The captured mixed decode steps' layout, run eagerly (tests/helpers.py)."""
    from tests.helpers import EagerDecodeGraphs

    runner = llm.engine.runner
    runner.stager.graphs = EagerDecodeGraphs(runner, runner.stager.graph_sizes, tail_tokens)
    llm.engine.scheduler.decode_mixed_limits = runner.decode_mixed_limits


def _start(llm: LLM, batch: int, prompt_len: int, params: SamplingParams) -> None:
    e = llm.engine
    vocab = e.model_config.vocab_size
    for i in range(batch):
        e.add_request(f"r{i}", [(i * 7 + j) % vocab for j in range(prompt_len)], params)
    while e.scheduler.waiting or any(
        r.num_computed_tokens < r.num_prompt_tokens for r in e.scheduler.running
    ):
        e.step()
    for _ in range(3):
        e.step()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=256)
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--prompt-len", type=int, default=100)
    parser.add_argument("--vocab", type=int, default=64)
    parser.add_argument("--layers", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--output-kind", default="final_only", choices=["final_only", "cumulative"])
    parser.add_argument("--no-forward", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument(
        "--spec",
        action="store_true",
        help="the speculative engine (a random drafter) with drafting off",
    )
    parser.add_argument("--drafting", action="store_true",
                        help="the speculative engine's drafting steps, launched ahead")  # fmt: skip
    parser.add_argument("--k", type=int, default=7, help="with --drafting: drafts per window")
    parser.add_argument(
        "--arrivals",
        action="store_true",
        help="a closed loop of plain decoding: steps that admit, and the rest",
    )
    parser.add_argument("--output-len", type=int, default=128, help="with --arrivals")
    parser.add_argument("--tail-tokens", type=int, default=256, help="with --arrivals")
    parser.add_argument("--warmup", type=int, default=300, help="with --arrivals: steps")
    args = parser.parse_args()
    if args.drafting and (args.no_forward or args.temperature):
        parser.error("--drafting runs the real forward, greedy")
    if args.arrivals and (args.drafting or args.spec or args.no_forward or args.temperature):
        parser.error("--arrivals runs plain decoding's real forward, greedy")
    phases = DRAFTING_PHASES if args.drafting else PHASES
    torch.set_num_threads(1)  # (the host of a GPU step does no tensor math on the CPU)
    with tempfile.TemporaryDirectory() as tmp:
        model = _tiny_model(Path(tmp) / "model", args.vocab, args.layers)
        drafter = None
        if args.spec or args.drafting:
            from tests.tiny_models import make_tiny_drafter

            drafter = make_tiny_drafter(model, Path(tmp) / "drafter", (0,), draft_len=args.k)
        tail = args.tail_tokens if args.arrivals else 0
        llm = _build(model, args.batch, drafter, args.drafting, args.k, tail)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.steps + 200,
                            ignore_eos=True, seed=1, output_kind=args.output_kind)  # fmt: skip
    loop = None
    if args.arrivals:
        _with_mixed_decode_steps(llm, args.tail_tokens)
        loop = ClosedLoop(llm, args.batch, args.prompt_len, args.output_len, args.output_kind)
        for _ in range(args.warmup):
            loop.step()
    else:
        _start(llm, args.batch, args.prompt_len, params)
    if args.no_forward:
        runner = llm.engine.runner
        runner._forward = lambda layout: torch.zeros(layout.num_logits, runner.vocab_size)
    timer = PhaseTimer()
    (_instrument_drafting if args.drafting else _instrument)(llm, timer)
    per_phase: dict[str, list[int]] = defaultdict(list)
    admitted: list[bool] = []  # (--arrivals) per timed step: did it schedule a prefill
    profiler = cProfile.Profile() if args.profile else None
    if profiler:
        _unprofiled_forward(llm, profiler, args.drafting)
    collections_before = [g["collections"] for g in gc.get_stats()]
    # the collector as LLM.generate's loop runs it (DSPARK_STEADY_GC)
    with steady_collector():
        for _ in range(args.steps):
            timer.step.clear()
            if profiler:
                profiler.enable()
            t0 = time.perf_counter_ns()
            if loop is not None:
                admitted.append(loop.step())
            else:
                llm.engine.step()
            wall = time.perf_counter_ns() - t0
            if profiler:
                profiler.disable()
            timer.step["host"] = wall - timer.step["forward"]
            timer.step["other"] = timer.step["host"] - sum(
                timer.step[p] for p in phases if p not in ("forward", "host", "other")
            )
            for phase in phases:
                per_phase[phase].append(timer.step[phase])
    collections = [g["collections"] - c for g, c in zip(gc.get_stats(), collections_before,
                                                          strict=True)]  # fmt: skip
    if loop is not None:
        _print_arrivals(per_phase, admitted, phases, llm, loop)
        return
    assert len(llm.engine.scheduler.running) == args.batch, "every request decodes throughout"
    print(f"batch {args.batch}, {args.steps} steps, temperature {args.temperature}, "
          f"{args.output_kind} outputs (median us per step):")  # fmt: skip
    if args.drafting:
        stats = llm.engine.runner.stats
        print(f"drafting steps launched ahead: {stats['spec_steps_launched_ahead']}, "
              f"continuation windows: {stats['continuation_windows']}")  # fmt: skip
    for phase in phases:
        print(f"  {phase:>13}: {statistics.median(per_phase[phase]) / 1e3:7.0f}")
    print(f"  host, mean (the collector's pauses in it): "
          f"{statistics.fmean(per_phase['host']) / 1e3:7.0f}")  # fmt: skip
    print(f"  runner stats: {dict(llm.engine.runner.stats)}")
    print(f"  the cyclic collector's collections in the timed steps, by generation: {collections}")
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(40)


def _print_arrivals(per_phase, admitted: list[bool], phases, llm: LLM, loop: ClosedLoop) -> None:
    kinds = {"steady": [not a for a in admitted], "arrivals": admitted}
    counts = {k: sum(v) for k, v in kinds.items()}
    print(f"closed loop of {len(llm.engine.scheduler.running)} running, {len(admitted)} steps: "
          f"{counts['arrivals']} scheduled a prefill, {counts['steady']} did not "
          f"(median us per step; {loop.num_added} requests added in all)")  # fmt: skip
    print(f"  {'phase':>13}  {'steady':>8}  {'arrivals':>8}")
    for phase in phases:
        medians = [statistics.median([t for t, keep in zip(per_phase[phase], mask, strict=True)
                                      if keep] or [0]) / 1e3
                   for mask in kinds.values()]  # fmt: skip
        print(f"  {phase:>13}  {medians[0]:8.0f}  {medians[1]:8.0f}")
    print(f"  runner stats: {dict(llm.engine.runner.stats)}")


if __name__ == "__main__":
    main()
