"""The offline API: LLM(...).generate(prompts, SamplingParams) and .chat(messages), as in vLLM."""

from __future__ import annotations

import gc
import itertools
import logging
import weakref
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

import torch
from tqdm import tqdm

from dspark.config import EngineConfig
from dspark.engine.collector import steady_collector
from dspark.engine.engine import LLMEngine
from dspark.outputs import RequestOutput
from dspark.sampling_params import MAX_SEED, SamplingParams
from dspark.spec.synthetic import SYNTHETIC_REFUSED

logger = logging.getLogger(__name__)


Prompt = str | list[int] | dict[str, Any]


class LLM:
    """An engine for offline batches.

    LLM() and LLM(model="default") load SmolLM2-135M-Instruct. Keyword arguments are
    EngineConfig fields (dtype, max_model_len, max_num_seqs, page_size, ...).
    """

    def __init__(self, model: str = "default", dtype: str = "auto", **kwargs: Any) -> None:
        if "synthetic_acceptance" in kwargs:
            raise ValueError(SYNTHETIC_REFUSED)
        self._engine: LLMEngine | None = LLMEngine(EngineConfig(model=model, dtype=dtype, **kwargs))
        self._ids = itertools.count()

    @classmethod
    def from_engine(cls, engine: LLMEngine) -> LLM:
        """An LLM over an engine built elsewhere (the benchmarks build theirs)."""
        llm = cls.__new__(cls)
        llm._engine, llm._ids = engine, itertools.count()
        return llm

    @property
    def engine(self) -> LLMEngine:
        if self._engine is None:
            raise RuntimeError("this LLM was shut down; build a new one")
        return self._engine

    def shutdown(self) -> None:
        """Free the engine: its weights, KV cache and captured graphs are released now, so a
        second engine in this process finds the memory (idempotent; `with LLM(...) as llm:`
        calls it on leaving, and `del llm` frees the same, the engine holding no reference
        cycle)."""
        if self._engine is None:
            return
        runner = weakref.ref(self._engine.runner)
        self._engine.shutdown()  # (tensor parallelism: the worker ranks stop)
        self._engine = None
        if runner() is not None:  # a reference cycle: freed only by the cyclic collector
            logger.warning("the engine's runner outlived its engine (a reference cycle): "
                           "collecting it now")  # fmt: skip
            gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # (the allocator's cached blocks, back to the device)

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.shutdown()

    def get_tokenizer(self):
        return self.engine.tokenizer

    def get_metrics(self) -> dict:
        """Speculative decoding counters (vLLM's names): num_drafts, num_draft_tokens,
        num_accepted_tokens, num_accepted_tokens_per_pos, mean_acceptance_length."""
        return self.engine.get_metrics()

    def generate(
        self,
        prompts: Prompt | Sequence[Prompt],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        """Run every prompt to completion; outputs come back in prompt order.

        A prompt is text, a list of token ids, or {"prompt": text} / {"prompt_token_ids": ids}.
        All prompts are validated before any is queued, so a bad one loses nothing.

        A prompt whose params have n > 1 runs as n requests with n = 1, sample i seeded
        seed + i when a seed is given (vLLM's children); its RequestOutput holds the n
        completions, index i. They share the prompt's pages only through prefix caching, as
        requests with a common prefix do (SamplingParams' docstring).
        """
        if isinstance(prompts, (str, dict)) or (
            isinstance(prompts, list) and prompts and isinstance(prompts[0], int)
        ):
            prompts = [prompts]
        # offline: one output per request at its end, no per-step outputs or detokenization
        params = [
            replace(p, output_kind="final_only") for p in _per_prompt(sampling_params, len(prompts))
        ]
        encoded = [self._encode(i, p) for i, p in enumerate(prompts)]
        samples = [_samples(sp) for sp in params]
        for i, (ids, _) in enumerate(encoded):
            try:
                self.engine.validate_request(f"__check_{i}", ids, samples[i][0])
            except ValueError as e:
                raise ValueError(f"prompt {i}: {e}") from None
        request_ids = []  # [prompt][sample]
        for (ids, text), children in zip(encoded, samples, strict=True):
            rid = str(next(self._ids))
            child_ids = [rid] if len(children) == 1 else [f"{j}_{rid}" for j in
                                                          range(len(children))]  # fmt: skip
            for child_id, sp in zip(child_ids, children, strict=True):
                self.engine.add_request(child_id, ids, sp, prompt_text=text)
            request_ids.append(child_ids)
        finished = self._run([r for ids in request_ids for r in ids], use_tqdm)
        return [_merge(ids[0].split("_", 1)[-1], [finished[r] for r in ids]) for ids in request_ids]

    def chat(
        self,
        messages: list[dict[str, str]] | list[list[dict[str, str]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        use_tqdm: bool = True,
        add_generation_prompt: bool = True,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        """Apply the checkpoint's chat template to one conversation or a list of them;
        `chat_template_kwargs` are the template's variables (Qwen3: {"enable_thinking": False})."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        tok = self.engine.tokenizer
        prompts = [
            {
                "prompt_token_ids": tok.apply_chat_template(
                    c, add_generation_prompt, chat_template_kwargs
                )
            }
            for c in conversations
        ]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _encode(self, index: int, prompt: Prompt) -> tuple[list[int], str | None]:
        if isinstance(prompt, dict):
            if "prompt_token_ids" in prompt:
                return list(prompt["prompt_token_ids"]), prompt.get("prompt")
            prompt = prompt.get("prompt", "")
        if isinstance(prompt, str):
            if prompt == "":
                raise ValueError(f"prompt {index}: prompt is empty")
            return self.engine.tokenizer.encode(prompt), prompt
        if isinstance(prompt, list):
            return list(prompt), None
        raise TypeError(f"prompt {index}: expected text, token ids or a dict, got {type(prompt)}")

    def _run(self, request_ids: list[str], use_tqdm: bool) -> dict[str, RequestOutput]:
        pending = set(request_ids)
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(total=len(request_ids), desc="generate", disable=not use_tqdm)
        with bar, steady_collector():
            while pending:
                for out in self.engine.step():
                    if out.finished and out.request_id in pending:
                        finished[out.request_id] = out
                        pending.discard(out.request_id)
                        bar.update(1)
            # a step launched ahead may still be in flight for requests that ended in the step
            # before it: collect it, so the engine is idle when generate returns
            engine = self.engine
            while engine.has_unfinished_requests() and not engine.scheduler.has_unfinished:
                engine.step()
        return finished


def _samples(sp: SamplingParams) -> list[SamplingParams]:
    """The n requests of one prompt: n = 1 each, sample i seeded seed + i (vLLM's rule)."""
    if sp.n == 1:
        return [sp]
    return [
        replace(sp, n=1, seed=None if sp.seed is None else (sp.seed + i) % (MAX_SEED + 1))
        for i in range(sp.n)
    ]


def _merge(request_id: str, outs: list[RequestOutput]) -> RequestOutput:
    """One prompt's samples as one RequestOutput, completion i from sample i."""
    if len(outs) == 1:
        return outs[0]
    completions = [replace(o.outputs[0], index=i) for i, o in enumerate(outs)]
    return replace(outs[0], request_id=request_id, outputs=completions)


def _per_prompt(
    params: SamplingParams | Sequence[SamplingParams] | None, n: int
) -> list[SamplingParams]:
    if params is None:
        return [SamplingParams()] * n
    if isinstance(params, SamplingParams):
        return [params] * n
    if len(params) != n:
        raise ValueError(f"got {len(params)} SamplingParams for {n} prompts; give one or {n}")
    return list(params)
