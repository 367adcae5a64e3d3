"""What the engine reports for a request: its output (vLLM's RequestOutput, or a DeltaOutput for
delta requests, engine/delta.py) and its metrics, each time a step changes it (engine.py).
"""

from __future__ import annotations

from dspark.engine.delta import DeltaCursor
from dspark.engine.detokenizer import Detokenizer
from dspark.outputs import CompletionOutput, DeltaOutput, FinalInfo, RequestOutput
from dspark.policy.policy import DraftingPolicy
from dspark.request import Request


def report(
    req: Request,
    requests: dict[str, Request],
    detokenizers: dict[str, Detokenizer],
    cursors: dict[str, DeltaCursor],
    policy: DraftingPolicy | None,
    has_spec: bool,
) -> RequestOutput | DeltaOutput:
    """req's output as its output_kind asks: cumulative (or final), or what it gained since its
    last delta; a finished request is forgotten here, in the engine's maps and the policy."""
    detok = detokenizers[req.request_id]
    if req.is_finished:
        if req.sampling_params.output_kind != "delta_tokens":  # (that text is never read)
            detok.flush()
        if policy is not None:
            policy.forget(req.request_id)
        requests.pop(req.request_id, None)
        detokenizers.pop(req.request_id, None)
    cursor = cursors.get(req.request_id)
    if cursor is None:
        return request_output(req, detok, has_spec)
    final = None
    if req.is_finished:
        del cursors[req.request_id]
        cumulative = None
        if req.sampling_params.logprobs is not None:
            cumulative = sum(lp.logprob for lp in req.logprobs)
        num_output = len(req.output_token_ids)
        final = FinalInfo(req.finish_reason.value, req.stop_reason, req.num_prompt_tokens,
                          num_output, cumulative, request_metrics(req, has_spec))  # fmt: skip
    return cursor.advance(req, detok, final)


def request_output(req: Request, detok: Detokenizer, has_spec: bool) -> RequestOutput:
    logprobs = None
    cumulative = None
    if req.sampling_params.logprobs is not None:
        logprobs = [{**lp.top, lp.token_id: lp.logprob} for lp in req.logprobs]
        cumulative = sum(lp.logprob for lp in req.logprobs)
    completion = CompletionOutput(
        index=0,
        text=detok.text,
        token_ids=req.output_token_ids,
        cumulative_logprob=cumulative,
        logprobs=logprobs,
        finish_reason=req.finish_reason.value if req.finish_reason else None,
        stop_reason=req.stop_reason,
    )
    return RequestOutput(req.request_id, req.prompt, req.prompt_token_ids, [completion],
                         req.is_finished, request_metrics(req, has_spec),
                         req.prompt_logprobs)  # fmt: skip


def request_metrics(req: Request, has_spec: bool) -> dict[str, float]:
    metrics = {"arrival_time": req.arrival_time, "added_time": req.added_time,
               "num_preemptions": req.num_preemptions}  # fmt: skip
    if has_spec:
        metrics["num_drafts"] = req.num_drafts
        metrics["num_draft_tokens"] = req.num_draft_tokens
        metrics["num_accepted_tokens"] = req.num_accepted_tokens
    for name in ("scheduled_time", "first_token_time", "last_token_time", "finished_time"):
        if (value := getattr(req, name)) is not None:
            metrics[name] = value
    if req.is_finished:  # (once, in the final output)
        metrics["inter_token_latencies"] = req.inter_token_latencies
    return metrics
