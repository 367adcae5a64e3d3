"""Count the kernels of one speculative engine's steps, on the CPU (no GPU needed).

    python bench/step_op_counts.py [--taps 1,2,3] [--draft-len 7]

A captured step's GPU time at a small batch is mostly a chain of small launches, so the number
of launches is a figure a CPU-only session can compare before and after a change. This runs a
tiny random Llama (4 layers) and a random DSpark drafter greedily on the triton backend, with
Triton's interpreter, and counts per phase of the first drafting step and of a plain step:

  aten ops        every PyTorch op dispatched outside a Triton kernel, views and allocations
                  left out (each is about one CUDA kernel on the GPU)
  Triton launches by kernel

The CPU path differs from the CUDA one where code branches on the device (the Markov head's
fused greedy slot, the fused greedy verification and the GEMV run only on CUDA), so those
phases count their PyTorch fallbacks here; see docs/PERFORMANCE.md for the CUDA counts.
"""

from __future__ import annotations

import argparse
import collections
import os
import tempfile
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

NOT_KERNELS = {
    "view", "_unsafe_view", "reshape", "expand", "slice", "select", "unsqueeze", "squeeze",
    "t", "transpose", "permute", "as_strided", "alias", "detach", "split", "unbind",
    "split_with_sizes", "narrow", "lift_fresh", "empty", "empty_strided", "new_empty",
    "unflatten", "view_as", "_reshape_alias", "diagonal", "promote_types",
}  # fmt: skip


class Counts:
    """Nested phases: an op or launch counts in every phase open around it."""

    def __init__(self) -> None:
        self.open: list[tuple[collections.Counter, collections.Counter]] = []
        self.in_kernel = 0  # the interpreter's own tensor ops are not the program's

    def op(self, name: str) -> None:
        if name not in NOT_KERNELS and not self.in_kernel:
            for ops, _ in self.open:
                ops[name] += 1

    def launch(self, name: str) -> None:
        for _, launches in self.open:
            launches[name] += 1


class _Dispatch(TorchDispatchMode):
    def __init__(self, counts: Counts) -> None:
        super().__init__()
        self.counts = counts

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts.op(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def _count_launches(counts: Counts) -> None:
    import triton.runtime.interpreter as interpreter

    run = interpreter.GridExecutor.__call__

    def counted(self, *args, **kwargs):
        counts.launch(self.fn.__name__)
        counts.in_kernel += 1
        try:
            return run(self, *args, **kwargs)
        finally:
            counts.in_kernel -= 1

    interpreter.GridExecutor.__call__ = counted


def _phase(cls, name: str, label: str, counts: Counts, results: dict) -> None:
    """Count the first call of cls.name as `label`."""
    fn = getattr(cls, name)

    def counted(*args, **kwargs):
        entry = (collections.Counter(), collections.Counter())
        counts.open.append(entry)
        mode = _Dispatch(counts) if len(counts.open) == 1 else None
        if mode:
            mode.__enter__()
        try:
            return fn(*args, **kwargs)
        finally:
            if mode:
                mode.__exit__(None, None, None)
            counts.open.pop()
            results.setdefault(label, entry)

    setattr(cls, name, counted)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--taps", default="0,1,2", help="the drafter's tap layers of the 4")
    ap.add_argument("--draft-len", type=int, default=7)
    args = ap.parse_args()

    from dspark import LLM, SamplingParams
    from dspark.runner.model_runner import ModelRunner
    from dspark.spec.spec_decoder import SpecDecoder
    from tests.tiny_models import (
        _llama_config,
        make_tiny_drafter,
        make_tiny_vocab_tokenizer,
        save_random_model,
    )

    counts, results = Counts(), {}
    _count_launches(counts)
    for cls, name, label in (
        (SpecDecoder, "step", "drafting step (draft, target, context, verify)"),
        (SpecDecoder, "draft", "  draft"),
        (SpecDecoder, "append_context", "  context upkeep"),
        (SpecDecoder, "verify", "  verify"),
        (ModelRunner, "_forward", "plain step of the speculative engine"),
    ):
        _phase(cls, name, label, counts, results)
    d = Path(tempfile.mkdtemp())
    tok = make_tiny_vocab_tokenizer()
    config = _llama_config(
        len(tok), num_hidden_layers=4, eos_token_id=1, bos_token_id=None,
        num_attention_heads=4, num_key_value_heads=2, hidden_size=64,
    )  # fmt: skip
    save_random_model(d / "target", config, seed=1)
    tok.save_pretrained(d / "target")
    taps = tuple(int(t) for t in args.taps.split(","))
    make_tiny_drafter(d / "target", d / "drafter", taps=taps, draft_len=args.draft_len)
    llm = LLM(str(d / "target"), dtype="float32", device="cpu", attention_backend="triton",
              use_cuda_graphs=False,
              speculative_config={"model": str(d / "drafter"), "scheduling": False})  # fmt: skip
    llm.generate([[2, 3, 4, 5]], SamplingParams(temperature=0, max_tokens=12, ignore_eos=True),
                 use_tqdm=False)  # fmt: skip
    for label in results:
        ops, launches = results[label]
        print(f"{label}: {sum(ops.values())} aten ops, {sum(launches.values())} Triton launches")
        print(f"    aten: {dict(ops.most_common())}")
        print(f"    Triton: {dict(launches.most_common())}")


if __name__ == "__main__":
    main()
