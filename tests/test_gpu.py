"""The same code on a CUDA device: greedy output equals the CPU's token for token (fp32)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from dspark import LLM, SamplingParams
from dspark.runner import model_runner
from dspark.runner.input_buffers import host_to_device

pytestmark = pytest.mark.gpu

PROMPTS = ["Hello", "The quick brown fox jumps over the lazy dog", "1 2 3 4 5 6 7"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


def _run(model: str, device: str, dtype: str = "float32", **kw):
    llm = LLM(model, dtype=dtype, device=device, num_kv_pages=256, **kw)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outs], llm


@pytest.mark.parametrize("as_array", [False, True])
def test_host_to_device_takes_lists_and_numpy_arrays(as_array):
    # torch.tensor(ndarray, pin_memory=True) raises on CUDA; continuations pass an ndarray
    values = [[1, 2, 3], [4, 5, 6]]
    staged = host_to_device(
        np.array(values) if as_array else values, torch.int64, torch.device("cuda")
    )
    assert staged.device.type == "cuda" and staged.tolist() == values


def test_tiny_model_greedy_cuda_equals_cpu(tiny_llama_dir):
    cpu, _ = _run(str(tiny_llama_dir), "cpu")
    cuda, llm = _run(str(tiny_llama_dir), "cuda")
    assert cuda == cpu
    assert llm.engine.allocator.num_free == llm.engine.allocator.num_usable


def test_seeded_sampling_cuda_equals_cpu(tiny_llama_dir):
    params = [
        SamplingParams(temperature=0.9, top_p=0.95, seed=i, max_tokens=16, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    got = {}
    for device in ("cpu", "cuda"):
        llm = LLM(str(tiny_llama_dir), dtype="float32", device=device, num_kv_pages=256)
        got[device] = [
            o.outputs[0].token_ids for o in llm.generate(PROMPTS, params, use_tqdm=False)
        ]
    assert got["cuda"] == got["cpu"]


def test_sampled_decode_graphs_draw_the_eager_samplings_tokens(tiny_llama_dir, monkeypatch):
    """With the sampling of plain decode steps captured (the default; off, the eager sampling
    draws them), seeded requests give the eager sampling's
    tokens (a greedy row among sampled ones, three rows in a graph of four), and the sampling
    graphs drew them."""
    params = [
        SamplingParams(temperature=0.0 if i == 0 else 0.8, seed=i, max_tokens=24, ignore_eos=True)
        for i in range(len(PROMPTS))
    ]
    got = {}
    for flag in ("0", "1"):
        monkeypatch.setattr(model_runner, "sampled_decode_graphs_enabled", lambda f=flag: f == "1")
        llm = LLM(str(tiny_llama_dir), dtype="float32", device="cuda", num_kv_pages=256)
        outs = llm.generate(PROMPTS, params, use_tqdm=False)
        got[flag] = [o.outputs[0].token_ids for o in outs]
        assert (llm.engine.runner.stats["sampled_graph_steps"] > 0) == (flag == "1")
    assert got["1"] == got["0"]


@pytest.mark.slow
def test_smollm2_greedy_cuda_equals_cpu():
    cpu, _ = _run("default", "cpu")
    cuda, _ = _run("default", "cuda")
    assert cuda == cpu


def test_graph_replay_equals_eager(tiny_llama_dir):
    """Captured decode graphs give the same tokens as eager steps on the same inputs."""
    prompts = PROMPTS * 3  # 9 requests: pads to the 16-row graph
    params = [
        SamplingParams(temperature=0.0, max_tokens=8 + 3 * i, ignore_eos=True)
        for i in range(len(prompts))
    ]  # the batch shrinks as requests finish
    got = {}
    for graphs in (True, False):
        llm = LLM(
            str(tiny_llama_dir),
            dtype="bfloat16",
            device="cuda",
            num_kv_pages=256,
            use_cuda_graphs=graphs,
            max_num_seqs=16,
        )
        got[graphs] = [
            o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)
        ]
        if graphs:
            assert llm.engine.runner.stats["graph_steps"] > 0
    assert got[True] == got[False]


def test_triton_backend_equals_torch_backend(tiny_llama_dir):
    got = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(tiny_llama_dir),
            dtype="float32",
            device="cuda",
            num_kv_pages=256,
            attention_backend=backend,
            use_cuda_graphs=False,
        )
        got[backend] = [
            o.outputs[0].token_ids for o in llm.generate(PROMPTS, GREEDY, use_tqdm=False)
        ]
    assert got["triton"] == got["torch"]
