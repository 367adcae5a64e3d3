"""Small helpers shared by tests: run the model once over a prompt with a fresh KV cache; load
a script of bench/ as a module; the captured decode graphs' layouts run eagerly on the CPU."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from dspark.attention_metadata import single_prefill_metadata
from dspark.engine.kv_cache import allocate_kv_caches
from dspark.runner.mixed_layout import graph_tail_rows
from dspark.step_plan import pages_for


@torch.no_grad()
def full_logits(model, token_ids: list[int], page_size: int = 16, hidden_layers=()):
    """Logits [T, V] of every position (and optional hidden states) of one prompt."""
    cfg = model.config
    device = model.embed_tokens.weight.device
    dtype = model.embed_tokens.weight.dtype
    num_pages = pages_for(len(token_ids), page_size) + 1
    kv = allocate_kv_caches(cfg, num_pages, page_size, dtype, device)
    attn = single_prefill_metadata(len(token_ids), page_size, device)
    ids = torch.tensor(token_ids, device=device)
    positions = torch.arange(len(token_ids), device=device)
    return model(ids, positions, attn, kv, None, hidden_layers)


def chi2_critical_001(dof: int) -> float:
    """Chi-square critical value at significance 0.001 (Wilson-Hilferty, z = 3.09)."""
    return dof * (1 - 2 / (9 * dof) + 3.09 * (2 / (9 * dof)) ** 0.5) ** 3


def assert_matches_distribution(counts, expected) -> None:
    """Chi-square goodness of fit at the 0.1% level: observed counts [N] against expected counts
    [N] (same total). Outcomes the law forbids must never occur; cells expected below 5 are
    pooled into one."""
    assert counts[expected == 0].sum() == 0, "an outcome of probability 0 occurred"
    big = expected >= 5
    obs = torch.cat([counts[big], counts[~big].sum(0, keepdim=True)])
    exp = torch.cat([expected[big], expected[~big].sum(0, keepdim=True)])
    keep = exp > 0
    stat = ((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum().item()
    dof = int(keep.sum()) - 1
    crit = chi2_critical_001(dof)
    assert stat < crit, (stat, dof, crit)


def assert_same_logprobs(got, expected):
    """Same tokens and alternatives per emitted token; values to fp32 noise (other batch
    shapes round otherwise)."""
    for g, e in zip(got, expected, strict=True):
        assert (g.outputs[0].logprobs is None) == (e.outputs[0].logprobs is None)
        for lg, le in zip(g.outputs[0].logprobs or [], e.outputs[0].logprobs or [], strict=True):
            assert lg.keys() == le.keys()
            assert list(lg.values()) == pytest.approx(list(le.values()), abs=1e-4)


def assert_same_windows(got, expected):
    """Request by request the same windows: drafts, drafted tokens and accepted tokens."""
    counts = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")
    assert [[o.metrics[k] for k in counts] for o in got] == [
        [o.metrics[k] for k in counts] for o in expected
    ]


def assert_same_finished(got: dict, expected: dict) -> None:
    """Finished outputs by request id, each (token ids, text, finish reason, logprobs, ...):
    every field equal, the logprobs to fp32 noise."""
    assert got.keys() == expected.keys()
    for rid in expected:
        g, e = got[rid], expected[rid]
        assert g[:3] + g[4:] == e[:3] + e[4:], rid
        assert (g[3] is None) == (e[3] is None)
        for lg, le in zip(g[3] or [], e[3] or [], strict=True):
            assert lg.keys() == le.keys()
            assert list(lg.values()) == pytest.approx(list(le.values()), abs=1e-4)


def assert_same_run(got, expected, seen):
    """An engine's outputs equal a reference engine's: what `seen` reads of them, then their
    logprobs and their windows."""
    assert seen(got) == seen(expected)
    assert_same_logprobs(got, expected)
    assert_same_windows(got, expected)


def bench_module(name: str) -> ModuleType:
    """bench/<name>.py (a script, not a package module) loaded as a module, for its functions."""
    path = Path(__file__).resolve().parents[1] / "bench" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"bench_{name}", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # (dataclasses look their module up while it runs)
    spec.loader.exec_module(module)
    return module


class EagerDecodeGraphs:
    """DecodeGraphs without capture: replay runs the forward a graph captures on the buffers
    as staged (the padded layout), so graph steps' layouts run on the CPU."""

    def __init__(self, runner, sizes: list[int], tail_tokens: int) -> None:
        self.runner, self.sizes, self.tail_tokens = runner, sorted(sizes), tail_tokens
        self.layout = None
        self.replays = {"decode": 0, "mixed": 0}
        upload = runner.buffers.upload

        def keep_layout(layout):
            self.layout = layout
            return upload(layout)

        runner.buffers.upload = keep_layout

    def replay(self, size: int, tail: int = 0):
        layout = self.layout
        assert layout.num_rows == size + (graph_tail_rows(tail) if tail else 0), layout
        assert layout.num_tokens == size + tail
        self.replays["mixed" if tail else "decode"] += 1
        return self.runner._forward(layout)
