"""The engine: requests in, one step at a time, outputs out.

step():  plan = scheduler.schedule()      # who runs, how many tokens, which pages
         scheduler.advance(plan)          # count the rows' work; placeholders for new tokens
         sampled = runner.execute(plan)   # one forward + sampling, one host sync
         return self._update(plan, sampled)  # write tokens, detokenize, stop, free

Async scheduling (the default) overlaps the host's work with the GPU's:
step N+1 is scheduled and launched before step N's tokens are read back, its decode rows taking
their input tokens from step N's output on the device; then step N is collected and its tokens
written, detokenized and checked for stops while the GPU runs N+1:

    host:  schedule N+1 | launch N+1 | wait N, update N | schedule N+2 | launch N+2 | wait N+1 ..
    GPU:   .... step N ....| ........ step N+1 ........ | ........ step N+2 ........

A request that stops at step N (EOS, stop string) already has a row in N+1; that row's token
is dropped. Outputs therefore reach the caller one step after their token was computed.

Drafting steps run the same way when their windows are laid
out K + 1 wide (uniform windows: on with speculative CUDA graphs): a drafting step N+1 is
launched behind a drafting step N still in flight. Its rows are windows of two kinds: a
continuation, whose anchor is the last token its request's window in N emits, at position
anchor_pos + num_accepted + 1, both known only on the device (the runner writes them into
N+1's inputs there, runner/continuations.py), or a request whose anchor is on the host.
The host reserves pages for the most N can emit. A drafting step launches behind a plain step
N too: each window's anchor is the token N samples for its request, at a position the host
knows, fed on the device into the target's input and the drafter's anchor (ModelRunner.can_feed
judges the plan; SpecRunner._feed_anchors). Anything the host needs N's count for finishes
N first, the reason counted in runner.stats["spec_steps_not_ahead_<reason>"]: a drafting step
behind a plain one that cannot take its inputs there (after_plain_step), drafting turned off,
plain rows (opted out, min_tokens, a prompt
chunk no window precedes or no captured mixed tail takes; a request's last token is not one: it
is verified as an empty window among the windows),
a waiting request that could be admitted (unless a captured mixed step's tail takes it:
engine/ahead.py), a token budget the windows could exhaust, too few free pages for the
worst case (Scheduler.ahead_blocker). A continuation whose request nears
max_tokens or max_model_len has its window shortened on the device, to the length the
synchronous engine gives it (runner/continuations.py); one whose in-flight window could emit
its last token, or whose drafter block could run past max_model_len, skips one step
(deferred) instead. Every window is the one the synchronous
engine would give its request, so outputs are the same token for token.
A mixed step (windows, then a tail of prefill chunks) may have a step launched behind it; the
requests whose first token its tail samples get their first window one step later. A drafting
step of any other layout (packed windows, plain rows) waits for its own results, and the
in-flight step is finished before it is scheduled.
"""

from __future__ import annotations

import contextlib
import logging
import random
import time
import weakref
from collections.abc import Iterator

from dspark.config import EngineConfig
from dspark.distributed.launch import Workers, join_as_worker, rank_device, start_workers
from dspark.distributed.parallel_state import (
    TensorParallel,
    abort_tensor_parallel,
    destroy_tensor_parallel,
)
from dspark.engine.delta import DeltaCursor
from dspark.engine.detokenizer import Detokenizer
from dspark.engine.kv_cache import PageAllocator, allocate_kv_caches
from dspark.engine.memory import plan_kv
from dspark.engine.prefix_cache import PrefixCache
from dspark.engine.reporting import report
from dspark.engine.scheduler import Scheduler
from dspark.engine.spec_metrics import spec_metrics
from dspark.engine.spec_setup import (
    build_policy,
    build_spec,
    drafter_layers,
    drafts_async,
    resolve_drafter,
    verified_positions,
)
from dspark.engine.startup_profile import measure_at_startup
from dspark.engine.stats_log import StatsLogger
from dspark.engine.tp_steps import PlanDivergedError, TPSteps
from dspark.engine.validation import check_request
from dspark.kernels.compile_watch import WATCH as COMPILE_WATCH
from dspark.models.llama import LlamaForCausalLM, build_model
from dspark.models.loader import ModelSource, checkpoint_hash, load_checkpoint, resolve_model
from dspark.models.sharding import check_tp_size
from dspark.models.tokenizer import Tokenizer, load_tokenizer
from dspark.outputs import DeltaOutput, RequestOutput
from dspark.policy.cost_table import make_fingerprint
from dspark.policy.realised_costs import StepPeriods
from dspark.policy.trace import PolicyTrace
from dspark.request import PENDING_TOKEN, FinishReason, Request, RequestStatus
from dspark.runner.cuda_graph import graph_ladder
from dspark.runner.model_runner import ModelRunner
from dspark.sampling_params import MAX_SEED, SamplingParams
from dspark.spec.config import tail_sizes
from dspark.spec.synthetic import SyntheticAcceptance
from dspark.step_plan import InFlightStep
from dspark.structured.compiler import GrammarCompiler

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        tp: TensorParallel | None = None,
        synthetic: SyntheticAcceptance | None = None,
    ) -> None:
        """`tp`: a worker rank's group (distributed/launch.py builds its engine); rank 0, the
        one the caller builds, starts the workers itself when tensor_parallel_size > 1.
        `synthetic`: a benchmark's synthetic acceptance (spec/synthetic.py), passed only by
        `dspark bench` / `dspark profile`; never a setting (its output is not the model's)."""
        self.config = config
        self.synthetic = synthetic
        source = resolve_model(config.model, config.revision)
        model_config, weights = load_checkpoint(source)
        check_tp_size(model_config, config.tensor_parallel_size)  # (before any process starts)
        self._workers: Workers | None = None
        if tp is None and config.tensor_parallel_size > 1:
            tp, self._workers = start_workers(config, config.torch_device(), run_worker)
            if config.torch_device().type == "cuda":  # (NCCL: distributed/launch.py)
                self._workers.watch(abort_tensor_parallel)
        with _workers_stopped_on_error(self._workers):  # (no rank left running, no group)
            self.tp = tp
            device = config.torch_device()
            self.device = rank_device(device, tp.rank) if tp else device
            self.dtype = config.torch_dtype(self.device)
            self.model_config = model_config
            self.tokenizer: Tokenizer = load_tokenizer(source)
            backend = config.attention_backend_for(self.device)
            self.model: LlamaForCausalLM = build_model(
                model_config, weights, self.dtype, self.device, backend, tp
            )
            del weights
            drafter_dir, target_hash = resolve_drafter(config, source)
            on_cuda = self.device.type == "cuda"
            use_graphs = config.use_cuda_graphs and on_cuda and backend == "triton"
            self.kv_plan = plan_kv(
                config, self.model, self.dtype, self.device, drafter_layers(drafter_dir),
                verified_positions(drafter_dir), spec_graphs=use_graphs and drafter_dir is not None,
                num_tails=len(tail_sizes(config.spec())) if drafter_dir is not None else 1, tp=tp,
            )  # fmt: skip
            self.max_model_len = self.kv_plan.max_model_len
            kv_caches = allocate_kv_caches(  # (this rank's KV heads: the shard's config)
                self.model.config, self.kv_plan.num_pages, config.page_size, self.dtype, self.device
            )
            self.allocator = PageAllocator(self.kv_plan.num_pages)
            # prefix caching: pages keyed by the drafter too, whose context they carry
            # (engine/prefix_cache.py); None: off
            self.prefix_cache = None
            if config.enable_prefix_caching:
                drafter_key = checkpoint_hash(ModelSource(drafter_dir)) if drafter_dir else ""
                self.prefix_cache = PrefixCache(self.allocator, config.page_size, drafter_key)
            self.spec = build_spec(
                config, self.model, self.model.config, self.kv_plan.num_pages, self.dtype,
                self.device, drafter_dir, target_hash, backend, synthetic,
            )  # fmt: skip
            if config.use_cuda_graphs and on_cuda and not use_graphs:
                logger.warning("CUDA graphs need the triton attention backend: running eagerly")
            self.runner = ModelRunner(
                self.model,
                kv_caches,
                config.page_size,
                config.max_num_batched_tokens,
                config.max_num_seqs,
                self.max_model_len,
                self.device,
                graph_ladder(config.max_num_seqs) if use_graphs else None,
                spec=self.spec,
                mixed_tails=tail_sizes(config.spec()) if self.spec else (),
                decode_tail_tokens=config.mixed_prefill_tokens,
                trimmed_widths=config.spec().trimmed_widths if self.spec else (),
            )
            if on_cuda:  # a step's Triton compiles, counted and logged
                COMPILE_WATCH.install()
            spec_runner = self.runner.spec_runner
            self.scheduler = Scheduler(
                self.allocator,
                config.page_size,
                config.max_num_seqs,
                config.max_num_batched_tokens,
                self.max_model_len,
                draft_len=self.spec.draft_len if self.spec else 0,
                max_verify=self.spec.num_verify if self.spec else 0,
                # the captured mixed steps' tails: prefill beside windows or decode rows that
                # keeps the step's graph
                mixed_limits=spec_runner.mixed_limits if spec_runner is not None else None,
                decode_mixed_limits=self.runner.decode_mixed_limits,
                prefix_cache=self.prefix_cache,
            )
            self.drafter_dir, self._target_hash = drafter_dir, target_hash  # (None: no drafter)
            self.stats_log = StatsLogger(config.log_stats_interval_s)
            self.eos_token_id = (
                model_config.eos_token_ids[0]
                if model_config.eos_token_ids
                else self.tokenizer.eos_token_id
            )
            # structured output's grammars, compiled once per constraint for this tokenizer
            eos_ids = model_config.eos_token_ids or (self.eos_token_id,)
            self.grammars = GrammarCompiler(self.tokenizer, model_config.vocab_size,
                                            [t for t in eos_ids if t is not None])  # fmt: skip
            self._seed_rng = random.Random(config.seed)
            self._requests: dict[str, Request] = {}
            self._detokenizers: dict[str, Detokenizer] = {}
            self._cursors: dict[str, DeltaCursor] = {}  # the delta requests' (engine/delta.py)
            self._aborted: list[Request] = []
            self.async_scheduling = config.async_scheduling
            self._in_flight: InFlightStep | None = None
            self._step_periods = StepPeriods()  # which step periods are realised costs
            # tensor parallelism (engine/tp_steps.py): rank 0's changes since the last header, in
            # order: ("add", Request fields) | ("abort", id); a worker follows rank 0's steps
            self._tp_steps = TPSteps(tp) if tp is not None else None
            self._is_follower = tp is not None and not tp.is_driver
            self._tp_changes: list[tuple] = []
            self._stopped = False  # (a worker told to stop)
            if self._workers is not None:
                self._stop_workers = weakref.finalize(self, _stop_workers, self._tp_steps,
                                                      self._workers)  # fmt: skip
            # last: a start-up profile (engine/startup_profile.py) steps this engine, undecided
            self.policy, self.policy_trace = None, None
            self.policy, self.scheduling_status = build_policy(
                config, self.spec, spec_runner, drafter_dir, self.cost_fingerprint,
                measure=lambda: (
                    measure_at_startup(self)
                    if self.tp is None
                    else (None, "not with tensor parallelism (run `dspark profile -tp N`)")
                ),
            )  # fmt: skip
            if self.policy is not None:  # (its survival sum follows the running set)
                self.scheduler.on_running = self.policy.running
            # (DSPARK_POLICY_TRACE)
            self.policy_trace = PolicyTrace.from_env(self.policy, self.runner)
            logger.info(
                "dspark engine: %s on %s (%s), KV cache %d pages x %d tokens, max_model_len %d",
                source.path,
                self.device,
                str(self.dtype).removeprefix("torch."),
                self.kv_plan.num_pages - 1,
                config.page_size,
                self.max_model_len,
            )

    def cost_fingerprint(self) -> dict:
        """What a cost table measured on this engine must record (docs/SPECULATION.md 6)."""
        spec_runner = self.runner.spec_runner
        graphs = spec_runner.graphs
        return make_fingerprint(
            self.device, self._target_hash, checkpoint_hash(ModelSource(self.drafter_dir)),
            self.spec.num_verify, str(self.dtype).removeprefix("torch."),
            graphs.sizes if graphs else [], self.config.page_size, spec_runner.trimmed_widths,
            self.config.tensor_parallel_size,
        )  # fmt: skip

    def forget_profile_steps(self) -> None:
        """Zero the counters a start-up profile's steps moved, so metrics start with the
        user's first request (the profile's requests are gone: cost_profile.drain)."""
        if self.spec is not None:
            self.spec.reset_metrics()
        self.runner.stats.clear()
        if self.prefix_cache is not None:
            self.prefix_cache.reset_counters()

    def get_metrics(self) -> dict:
        """Speculative counters with vLLM's definitions (engine/spec_metrics.py)."""
        metrics = spec_metrics(self.spec, self.policy, self.scheduler, self.runner.stats,
                               self.scheduling_status)  # fmt: skip
        if self.synthetic is not None and self.spec is not None:  # (never unmarked)
            metrics["synthetic"] = self.synthetic.record(self.spec.num_verify)
        if self.grammars.stats:  # (structured output served: dspark/structured/)
            metrics["structured_output"] = self._structured_metrics()
        return metrics

    def _structured_metrics(self) -> dict:
        """Structured output's counters: grammars compiled and found compiled, masks filled
        and the host seconds it took, the speculative steps whose drafts came with the wait
        for the step before and those that waited for them on their own (the one extra host
        sync: docs/SPECULATION.md 4.9), requests ended by a grammar error."""
        stats, filler = self.runner.stats, self.runner.grammar_masks.filler
        return {
            **self.grammars.stats,
            "masks_filled": filler.stats["masks"],
            "mask_fill_s": filler.fill_s,
            "rows_masked": stats["structured_output_rows"],
            "windows_masked": stats["structured_output_windows"],
            "drafts_with_previous_wait": stats["structured_output_steps_behind"],
            "draft_syncs": stats["structured_output_syncs"],
            "grammar_errors": self.scheduler.num_grammar_errors,
        }

    # ---- requests -------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        prompt_text: str | None = None,
        arrival_time: float | None = None,
    ) -> None:
        """Validate first, then enqueue: a rejected request leaves the engine untouched.

        `prompt` is text (encoded here) or token ids; `prompt_text` labels token-id prompts.
        `arrival_time` (the monotonic clock): when the request reached whoever calls, as vLLM's
        (the server passes its handler's time, so the latency metrics include tokenization and
        the pipe); default now.
        """
        params = (params or SamplingParams()).with_eos_ids(self.model_config.eos_token_ids[1:])
        prompt_ids, text = self._prompt_ids(prompt)
        prompt_text = text if text is not None else prompt_text
        self.validate_request(request_id, prompt_ids, params)
        seed = params.seed if params.seed is not None else self._seed_rng.randint(0, MAX_SEED)
        now = time.monotonic()
        arrival_time = now if arrival_time is None else arrival_time
        if self._tp_steps is not None:  # (the workers' copies: engine/tp_steps.py)
            self._tp_changes.append(("add", request_id, prompt_ids, params, seed, arrival_time))
        self._enqueue(request_id, prompt_ids, params, seed, arrival_time, prompt_text, now)

    def _enqueue(
        self,
        request_id: str,
        prompt_ids: list[int],
        params: SamplingParams,
        seed: int,
        arrival_time: float,
        prompt_text: str | None = None,
        added_time: float | None = None,  # None: now (a worker's copy)
    ) -> None:
        req = Request(
            request_id,
            prompt_ids,
            params,
            seed=seed,
            eos_token_id=self.eos_token_id,
            arrival_time=arrival_time,
            prompt=prompt_text,
            added_time=time.monotonic() if added_time is None else added_time,
            bad_words_token_ids=self._bad_words_token_ids(params),
            reads_outputs=params.reads_outputs,
            grammar=(
                self.grammars.matcher(params.structured_outputs)
                if params.structured_outputs is not None
                else None
            ),
        )
        self._requests[request_id] = req
        if not self._is_follower:  # (rank 0 detokenizes and reports)
            self._detokenizers[request_id] = Detokenizer(
                self.tokenizer,
                skip_special_tokens=params.skip_special_tokens,
                stop_strings=params.stop_strings,
                include_stop_str_in_output=params.include_stop_str_in_output,
                incremental=params.output_kind not in ("final_only", "delta_tokens")
                or bool(params.stop_strings),
            )
            if params.output_kind in ("delta", "delta_tokens"):
                self._cursors[request_id] = DeltaCursor(params)
        self.scheduler.add(req)

    def _bad_words_token_ids(self, params: SamplingParams) -> list[list[int]]:
        return params.bad_words_token_ids(
            lambda text: self.tokenizer.encode(text, add_special_tokens=False)
        )

    def _prompt_ids(self, prompt: str | list[int]) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError("prompt is empty: give at least one character or token")
            return self.tokenizer.encode(prompt), prompt
        return list(prompt), None

    def validate_request(
        self, request_id: str, prompt_ids: list[int], params: SamplingParams
    ) -> None:
        """Raise ValueError or TypeError naming what is wrong (engine/validation.py)."""
        if request_id in self._requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        check_request(prompt_ids, params, self.model_config.vocab_size, self.max_model_len)
        if params.structured_outputs is not None:  # (compiled now, found again at _enqueue)
            self.grammars.compile(params.structured_outputs)

    def abort_request(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if self._tp_steps is not None and not self._is_follower:
            self._tp_changes.append(("abort", request_id))
        if req is not None and not req.is_finished:
            self.scheduler.finish(req, FinishReason.ABORT, None)
            self._aborted.append(req)

    def has_unfinished_requests(self) -> bool:
        """Whether step() has more to report (an aborted request's final output included)."""
        return self.scheduler.has_unfinished or self._in_flight is not None or bool(self._aborted)

    # ---- the step -------------------------------------------------------------------------

    def step(self) -> list[RequestOutput | DeltaOutput]:
        # a Triton compile in this step counts on this engine (kernels/compile_watch.py)
        watch = COMPILE_WATCH
        outer, watch.stats = watch.stats, self.runner.stats
        try:
            return self._step()
        except RuntimeError as e:  # (a collective's peer gone: say which rank died)
            if self._workers is not None:
                raise self._workers.error(e) from e
            raise
        finally:
            watch.stats = outer

    def _step(self) -> list[RequestOutput | DeltaOutput]:
        # from survivals at least one step old (docs/SPECULATION.md 5.2); rank 0 decides
        if self.policy is not None and not self._is_follower:
            self._decide_drafting()
        elif self.policy_trace is not None:  # (plain or fixed K: the step, for comparison)
            self.policy_trace.stepped(self.scheduler, self.runner.stats,
                                      self.spec is not None, time.perf_counter())  # fmt: skip
        if self._tp_steps is not None and not self._share_header():
            return []  # (a worker told to stop)
        drafting = self.spec is not None and self.scheduler.drafting
        # (read each step: tests lay windows out uniformly on the CPU after the engine is built)
        spec_runner = self.runner.spec_runner
        if self.async_scheduling and (not drafting or drafts_async(self.config, spec_runner)):
            return self._step_async(drafting)
        # synchronous: the step waits for its own results before the next one is scheduled
        outputs = self._finish(self._in_flight) if self._in_flight is not None else []
        self._in_flight = None
        plan = self.scheduler.schedule()
        if plan.is_empty:
            return outputs + self._collect_aborted()
        self.scheduler.advance(plan)
        step = self._launch(plan)
        if step.awaiting is not None:  # (grammar masks, shaping: filled in, then verified)
            self.runner.verify_awaiting(step)
        return outputs + self._finish(step) + self._collect_aborted()

    def _launch(self, plan):
        if self._tp_steps is not None:  # (every rank's plan is rank 0's, or it stops here)
            self._tp_steps.check_plan(plan)
        return self.runner.launch(plan)

    def _decide_drafting(self) -> None:
        """The drafting policy's choice for the step about to be scheduled; the period since
        the last choice (one step of the pipeline) is the realised cost of that one's cell,
        when the step before it ran the same cell (policy/realised_costs.py, StepPeriods)."""
        now = time.perf_counter()
        reqs = self.scheduler.running
        running = [r.request_id for r in reqs]
        sampled = self.scheduler.num_sampling > 0
        decision = self.policy.decide(running, sampled)
        self.scheduler.drafting = decision.drafting
        self.scheduler.trimmed_cell = decision.trimmed_cell
        # (a step with waiting or prefilling requests is not the steady cell the table prices:
        # it is, and that is what realised costs are for; an idle engine teaches nothing)
        counted = self._step_periods.decided(decision, now, bool(running))
        traced = time.perf_counter()
        if self.policy_trace is not None:  # (before record_step: the prices it decided by)
            self.policy_trace.decided(decision, running, self.scheduler, self.runner.stats,
                                      counted, now)  # fmt: skip
        recorded = time.perf_counter()
        if counted is not None:  # (the period is the previous decision's step)
            # (the decided step: the last schedule(); priced apart: realised_costs.py)
            self.policy.record_step(*counted, arrivals=self.scheduler.prefilled)
        host = self.policy.host_time  # the scheduling overhead, per step in the bench
        host["decide_s"] += (traced - now) + (time.perf_counter() - recorded)
        host["trace_s"] += recorded - traced
        host["decisions"] += 1

    def _step_async(self, drafting: bool) -> list[RequestOutput]:
        """Launch step N+1, then finish step N (see the module docstring)."""
        previous, self._in_flight = self._in_flight, None
        outputs = []
        if previous is not None and (reason := self._ahead_blocker(previous, drafting)):
            self.runner.stats[f"spec_steps_not_ahead_{reason}"] += 1
            outputs, previous = self._finish(previous), None
        behind_plain = previous is not None and not previous.window_rows
        # behind a plain step, a request whose token it samples gets its window now, the
        # anchor taken there on the device (can_feed judges the plan)
        plan = self.scheduler.schedule(anchors_in_flight=behind_plain and drafting)
        if not plan.is_empty:
            if behind_plain:
                windows = drafting and any(r.num_draft for r in plan.rows)
                if not self.runner.can_feed(plan, previous):
                    outputs, previous = self._finish(previous), None
                    if windows:
                        self.runner.stats["spec_steps_not_ahead_after_plain_step"] += 1
                elif windows:
                    self.runner.stats["spec_steps_launched_ahead_after_plain"] += 1
            elif previous is not None:  # behind a step of windows: windows, then admissions
                # the tail: prefill chunks, every input token on the host (a prompt's, or a
                # preempted request's recompute, whose cached pages may leave one token)
                tail = [r for r in plan.rows if not (r.num_draft or r.empty_window)]
                assert all(
                    not r.request.num_windows_in_flight
                    and PENDING_TOKEN not in r.request.token_ids[r.start : r.start + r.num_tokens]
                    for r in tail
                ), "ahead_blocker let a row by whose input is in flight"
                stats = self.runner.stats
                stats["spec_steps_launched_ahead"] += 1
                stats["spec_steps_launched_ahead_admitting"] += bool(tail)
                stats["spec_steps_launched_behind_mixed"] += not previous.is_uniform
            self.scheduler.advance(plan)
            step = self._launch(plan)
            if step.awaiting is not None:  # verified once the host has filled it in
                if previous is not None:
                    # (one wait for previous's results and any drafts a grammar needs; its
                    # update moves the matchers and outputs to where these windows start)
                    self.runner.wait_with(previous, step)
                    outputs, previous = outputs + self._finish(previous), None
                self.runner.verify_awaiting(step)
            behind = step.is_uniform or step.windows_first
            if step.window_rows and not behind:  # nothing launches behind it
                assert previous is None, "a step launched ahead lays its windows out K + 1 wide"
                outputs += self._finish(step)
            else:
                self._in_flight = step
        if previous is not None:
            outputs += self._finish(previous)
        return outputs + self._collect_aborted()

    def _ahead_blocker(self, previous: InFlightStep, drafting: bool) -> str | None:
        """Why the next step may not be scheduled before `previous` is collected (None: it
        may). A plain step may be followed by plain steps (_can_launch_ahead judges the plan);
        a step of windows only by full windows, of the requests whose anchors are known or
        come out of its verification (Scheduler.ahead_blocker)."""
        if not previous.window_rows:
            return None  # (its one token a row is fed on the device: can_feed judges the plan)
        if not drafting:
            return "drafting_off"
        return self.scheduler.ahead_blocker(self.runner.spec_runner.max_uniform_rows)

    def _finish(self, step: InFlightStep) -> list[RequestOutput]:
        sampled = self.runner.collect(step)
        self._record_prompt_logprobs(step)
        return self._update(step.plan, sampled)

    def _record_prompt_logprobs(self, step: InFlightStep) -> None:
        """Each scored prompt token's entry into its request (by index: a prefill recomputed
        after preemption writes the same entries again)."""
        for req, index, entry in self.runner.prompt_logprobs(step):
            req.prompt_logprobs[index] = entry

    def _update(self, plan, sampled) -> list[RequestOutput]:
        emitted = self.scheduler.update(plan, sampled)
        if self._is_follower:
            self._follow_update(emitted)
            return []
        stops: list[tuple[str, int, str | None]] = []  # (id, tokens kept, stop): the workers'
        now = time.monotonic()
        self.stats_log.maybe_log(self)
        outputs = []
        cursors, interval = self._cursors, self.config.stream_interval
        detokenizers, finished = self._detokenizers, RequestStatus.FINISHED
        for req, first, count in emitted:
            if req.first_token_time is None:
                req.first_token_time = now
            else:
                req.inter_token_latencies.append(now - req.last_token_time)
            req.last_token_time = now
            hit = detokenizers[req.request_id].add_tokens(req.token_ids[first : first + count])
            if hit is not None:
                del req.token_ids[first + hit.num_tokens :]  # after the stop (placeholders too)
                del req.logprobs[req.num_output_tokens :]
                if not req.is_finished:
                    self.scheduler.finish(req, FinishReason.STOP, hit.stop)
                stops.append((req.request_id, len(req.token_ids), hit.stop))
            if req.status is finished:
                outputs.append(self._report(req))
            elif (cursor := cursors.get(req.request_id)) is not None:
                cursor.num_unreported += count
                if cursor.num_unreported >= interval or not cursor.num_tokens:
                    outputs.append(self._report(req))
            elif req.sampling_params.output_kind != "final_only":  # cumulative
                outputs.append(self._report(req))
        if self._tp_steps is not None and _has_stop_strings(emitted):
            self._tp_steps.share(stops)
        return outputs

    # ---- tensor parallelism (engine/tp_steps.py) --------------------------------------------

    def _share_header(self) -> bool:
        """Rank 0's changes and drafting choice, sent (rank 0) or applied (workers) before the
        step is scheduled; False: the worker is told to stop."""
        scheduler = self.scheduler
        if not self._is_follower:
            header = (self._tp_changes, scheduler.drafting, scheduler.trimmed_cell)
            self._tp_changes = []
            self._tp_steps.share(header)
            return True
        header = self._tp_steps.share()
        if header is None:
            self._stopped = True
            return False
        changes, scheduler.drafting, scheduler.trimmed_cell = header
        for change in changes:
            if change[0] == "add":
                self._enqueue(*change[1:])
            else:
                self.abort_request(change[1])
                self._requests.pop(change[1], None)
        self._aborted.clear()  # (reported by rank 0)
        return True

    def _follow_update(self, emitted: list) -> None:
        """A worker's update: rank 0's stops applied as rank 0 applied them; finished
        requests forgotten (rank 0 reports them)."""
        if _has_stop_strings(emitted):
            for request_id, num_kept, stop in self._tp_steps.share():
                req = self._requests[request_id]
                del req.token_ids[num_kept:]
                del req.logprobs[req.num_output_tokens :]
                if not req.is_finished:
                    self.scheduler.finish(req, FinishReason.STOP, stop)
        for req, _, _ in emitted:
            if req.is_finished:
                self._requests.pop(req.request_id, None)

    def follow(self) -> None:
        """A worker rank's life: run rank 0's steps until it says stop."""
        while not self._stopped:
            self.step()
        destroy_tensor_parallel()

    def shutdown(self) -> None:
        """Stop the worker ranks (tensor parallelism; idempotent, nothing to do otherwise).
        A dropped engine stops them too (weakref.finalize, set up in __init__)."""
        if self._workers is not None:
            self._workers = None
            self._stop_workers()

    def _collect_aborted(self) -> list[RequestOutput | DeltaOutput]:
        # aborted requests emit nothing more: reported once here, then forgotten
        done, self._aborted = self._aborted, []
        return [self._report(r) for r in done]

    def _report(self, req: Request) -> RequestOutput | DeltaOutput:
        """req's output now (engine/reporting.py); a finished request is forgotten."""
        return report(req, self._requests, self._detokenizers, self._cursors, self.policy,
                      self.spec is not None)  # fmt: skip


def _has_stop_strings(emitted: list) -> bool:
    """Whether an update's requests detokenize for stops (decided alike on every rank)."""
    return any(req.sampling_params.stop_strings for req, _, _ in emitted)


@contextlib.contextmanager
def _workers_stopped_on_error(workers: Workers | None) -> Iterator[None]:
    """Rank 0's construction failed after it started the workers (a drafter for another
    target, no memory for the KV cache): stop them and leave the group, so that the error is
    all that remains and a later engine in this process can start its own."""
    try:
        yield
    except BaseException:
        if workers is not None:
            workers.stop()  # (they fail alike, or are killed after JOIN_TIMEOUT_S)
            destroy_tensor_parallel()
        raise


def _stop_workers(steps: TPSteps, workers: Workers) -> None:
    """Tell the workers to stop (a header of None), reap them, leave the group."""
    workers.unwatch()  # (their exits are no death now)
    try:
        steps.share(None)
    except RuntimeError:
        pass  # (a worker already gone: stop() reaps it)
    workers.stop()
    destroy_tensor_parallel()


def run_worker(config: EngineConfig, rank: int, port: int, parent_pid: int) -> None:
    """A worker rank's process (spawned by rank 0's engine): join, build, follow rank 0.
    Rank 0 gone mid-collective ends it with one line and exit code 1; its own failures
    (PlanDivergedError among them) with their traceback."""
    engine = LLMEngine(config, tp=join_as_worker(config, rank, port, parent_pid))
    try:
        engine.follow()
    except PlanDivergedError:
        raise
    except RuntimeError as e:  # (gloo: "Connection closed by peer")
        logger.error("tensor-parallel rank %d: lost rank 0, exiting (%s)", rank,
                     str(e).splitlines()[0][:200])  # fmt: skip
        raise SystemExit(1) from None
