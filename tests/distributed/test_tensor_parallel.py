"""Tensor parallelism on the CPU (gloo, 2 ranks): TP = 2 gives TP = 1's tokens.

Each LLM here is rank 0 in the test's process; its worker is a spawned process."""

from __future__ import annotations

import os
import signal
import socket
import threading
import time
from pathlib import Path

import pytest
import torch.multiprocessing as mp

from dspark import LLM, SamplingParams
from dspark.distributed.launch import WATCHDOG_PERIOD_S, WorkerDiedError, Workers
from dspark.models.drafter_config import DrafterMismatchError
from dspark.policy.cost_table import CostTable
from tests.policy.helpers import by_table
from tests.tiny_models import (
    make_deepspec_drafter,
    make_tiny_drafter,
    make_tiny_llama,
    make_tiny_vocab_tokenizer,
)

KW = dict(dtype="float32", device="cpu", num_kv_pages=128, max_num_seqs=4, max_model_len=256)
PROMPTS = [[2, 3, 4], [5, 6, 7, 8, 9], [9], [4, 4, 4, 4, 10, 11]]


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    """A 2-layer Qwen3 (q/k norm, head_dim 32 x 4 heads != hidden 64) on the 12-word vocab."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_qwen3"), make_tiny_vocab_tokenizer(),
                           arch="qwen3")  # fmt: skip


@pytest.fixture(scope="module")
def drafter(tiny_vocab_dir, tmp_path_factory):
    return make_tiny_drafter(tiny_vocab_dir, tmp_path_factory.mktemp("tp_drafter"), taps=(0,))


def _generate(model, params, tp: int, **kw):
    with LLM(str(model), tensor_parallel_size=tp, **{**KW, **kw}) as llm:
        return llm.generate(PROMPTS, params, use_tqdm=False)


def _tokens(outputs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outputs]


@pytest.mark.parametrize("arch", ["llama", "qwen3"])
def test_greedy_tokens_and_logprobs_equal_one_rank(arch, tiny_vocab_dir, qwen3_dir):
    model = tiny_vocab_dir if arch == "llama" else qwen3_dir
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, logprobs=3)
    one, two = _generate(model, params, 1), _generate(model, params, 2)
    assert _tokens(two) == _tokens(one)
    for a, b in zip(one, two, strict=True):
        for lp_a, lp_b in zip(a.outputs[0].logprobs, b.outputs[0].logprobs, strict=True):
            assert lp_a.keys() == lp_b.keys()
            assert all(abs(lp_a[t] - lp_b[t]) < 1e-4 for t in lp_a), (lp_a, lp_b)


def test_seeded_sampled_requests_are_identical(tiny_vocab_dir):
    params = [SamplingParams(temperature=1.0, top_p=0.9, seed=7 + i, max_tokens=16,
                             ignore_eos=True) for i in range(len(PROMPTS))]  # fmt: skip
    assert _tokens(_generate(tiny_vocab_dir, params, 2)) == _tokens(
        _generate(tiny_vocab_dir, params, 1)
    )


def test_stop_strings_end_requests_alike_on_every_rank(tiny_vocab_dir):
    """Only rank 0 detokenizes: its stops reach the worker, whose later steps still agree."""
    greedy = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    first = _generate(tiny_vocab_dir, greedy, 1)
    stop = first[0].outputs[0].text.split()[3]  # (a word the first request emits)
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, stop=[stop])
    one, two = _generate(tiny_vocab_dir, params, 1), _generate(tiny_vocab_dir, params, 2)
    assert [o.outputs[0].text for o in two] == [o.outputs[0].text for o in one]
    assert _tokens(two) == _tokens(one)


def test_fixed_k_speculation_equals_one_rank_plain(tiny_vocab_dir, drafter):
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = _generate(tiny_vocab_dir, params, 1)
    spec = {"model": str(drafter), "num_speculative_tokens": 3}
    with LLM(str(tiny_vocab_dir), tensor_parallel_size=2, speculative_config=spec, **KW) as llm:
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.get_metrics()["num_drafts"] > 0
    assert _tokens(got) == _tokens(plain)


@pytest.mark.parametrize("markov_rank", [8, 0], ids=["dspark", "dflash"])
def test_a_deepspec_drafter_on_a_sharded_qwen3_equals_one_rank_plain(
    qwen3_dir, tmp_path, markov_rank
):
    """DeepSeek's released layout (Qwen3DSparkModel) for a Qwen3 target, both sharded."""
    d = make_deepspec_drafter(qwen3_dir, tmp_path / "drafter", taps=(0,), block_size=4,
                              markov_rank=markov_rank)  # fmt: skip
    params = SamplingParams(temperature=0, max_tokens=20, ignore_eos=True)
    plain = _generate(qwen3_dir, params, 1)
    spec = {"model": str(d), "num_speculative_tokens": 3, "scheduling": False}
    with LLM(str(qwen3_dir), tensor_parallel_size=2, speculative_config=spec, **KW) as llm:
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        assert llm.get_metrics()["num_drafts"] > 0
    assert _tokens(got) == _tokens(plain)


def test_a_deepspec_drafter_for_another_target_is_refused_on_every_rank(qwen3_dir, tmp_path):
    """Each rank compares its vocabulary rows of the frozen embedding with the target's."""
    d = make_deepspec_drafter(qwen3_dir, tmp_path / "drafter", taps=(0,), block_size=4)
    # the same shapes, other weights
    other = make_tiny_llama(tmp_path / "other", make_tiny_vocab_tokenizer(), arch="qwen3",
                            initializer_range=0.5)  # fmt: skip
    spec = {"model": str(d), "num_speculative_tokens": 3, "scheduling": False}
    with pytest.raises(DrafterMismatchError, match="trained for another target"):
        LLM(str(other), tensor_parallel_size=2, speculative_config=spec, **KW)


def test_seeded_sampled_speculation_is_identical(tiny_vocab_dir, drafter):
    """Acceptance draws its uniforms from (seed, position): both ranks accept alike."""
    spec = {"model": str(drafter), "num_speculative_tokens": 3}
    sampled = [SamplingParams(temperature=0.8, seed=3 + i, max_tokens=16, ignore_eos=True)
               for i in range(len(PROMPTS))]  # fmt: skip
    one = _generate(tiny_vocab_dir, sampled, 1, speculative_config=spec)
    assert _tokens(_generate(tiny_vocab_dir, sampled, 2, speculative_config=spec)) == _tokens(one)


def test_the_policy_decides_once_for_both_ranks(tiny_vocab_dir, drafter, tmp_path):
    """Rank 0's policy chooses drafting or not per step (its cell travels in the header)."""
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True)
    plain = _generate(tiny_vocab_dir, params, 1)
    spec = {"model": str(drafter), "num_speculative_tokens": 3}
    with LLM(str(tiny_vocab_dir), speculative_config=spec, **KW) as probe:
        cells = {g: {g: 1e-3, g * 4: 5e-3} for g in (1, 2, 4)}  # a full block not worth it
        # (a table is measured per size: its fingerprint names it)
        fingerprint = {**probe.engine.cost_fingerprint(), "tensor_parallel_size": 2}
        table = CostTable(fingerprint, cells)
    (tmp_path / "t.json").write_text(table.to_json())
    spec["cost_table"] = str(tmp_path / "t.json")
    with LLM(str(tiny_vocab_dir), tensor_parallel_size=2, speculative_config=spec, **KW) as llm:
        got = by_table(llm).generate(PROMPTS, params, use_tqdm=False)
        counters = llm.get_metrics()["drafting_policy"]
    assert _tokens(got) == _tokens(plain)
    assert counters["steps_not_drafting"] > 0 and counters["steps_drafting"] > 0, counters


def test_a_size_that_does_not_split_the_heads_is_refused(tiny_vocab_dir):
    with pytest.raises(ValueError, match=r"tensor_parallel_size 3 does not split .* allowed: "
                       r"\[1, 2, 4\]"):  # fmt: skip
        LLM(str(tiny_vocab_dir), tensor_parallel_size=3, **KW)


def test_a_port_in_use_is_refused(tiny_vocab_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        with pytest.raises(ValueError, match=f"distributed_port {port} is in use"):
            LLM(str(tiny_vocab_dir), tensor_parallel_size=2, distributed_port=port, **KW)


def test_a_killed_worker_ends_the_job_within_seconds(tiny_vocab_dir):
    assert_a_killed_worker_ends_the_job(LLM(str(tiny_vocab_dir), tensor_parallel_size=2, **KW))


def assert_a_killed_worker_ends_the_job(llm: LLM, within_s: float = 15) -> None:
    """SIGKILL rank 1 while llm generates: WorkerDiedError names it within `within_s`."""
    worker = llm.engine._workers.processes[0]
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    threading.Timer(0.5, os.kill, (worker.pid, signal.SIGKILL)).start()
    start = time.monotonic()
    with pytest.raises(WorkerDiedError, match="rank 1 exited with code -9"):
        for _ in range(1000):  # (long enough to be running when the worker is killed)
            llm.generate(PROMPTS, params, use_tqdm=False)
    assert time.monotonic() - start < within_s
    llm.shutdown()


def test_rank_0s_watchdog_reports_a_worker_that_exits_and_not_one_told_to_stop():
    """Workers.watch (rank 0 over NCCL, where a collective with a peer gone waits instead of
    failing): a worker that exits while the job runs is reported once, with its exit code,
    within the watch period; one that exits after unwatch() (the shutdown's first move) is
    not."""
    ctx = mp.get_context("spawn")
    reported = []
    workers = Workers([ctx.Process(target=os._exit, args=(3,))])
    workers.processes[0].start()
    start = time.monotonic()
    workers.watch(lambda rank, code: reported.append((rank, code, time.monotonic() - start)))
    while not reported and time.monotonic() - start < 15:
        time.sleep(0.05)
    assert [(rank, code) for rank, code, _ in reported] == [(1, 3)]
    workers.stop()
    stopped = Workers([ctx.Process(target=time.sleep, args=(1.0,))])
    stopped.processes[0].start()
    stopped.watch(lambda rank, code: reported.append((rank, code, 0.0)))
    stopped.unwatch()  # (as before the stop header: the worker's exit after 1 s is no death)
    stopped.processes[0].join(15)
    time.sleep(3 * WATCHDOG_PERIOD_S)  # (a watch still running would have seen it by now)
    assert len(reported) == 1 and stopped.processes[0].exitcode == 0
    stopped.stop()


RANK0_SCRIPT = """
import sys
from dspark import LLM, SamplingParams
if __name__ == "__main__":
    llm = LLM(sys.argv[1], tensor_parallel_size=2, dtype="float32", device="cpu", num_kv_pages=64)
    print(llm.engine._workers.processes[0].pid, flush=True)
    params = SamplingParams(temperature=0, max_tokens=10_000, ignore_eos=True)
    while True:
        llm.generate([[2, 3]], params, use_tqdm=False)
"""


def is_running(pid: int) -> bool:
    """Whether the process exists and is not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return False
    return state not in ("Z", "X")


def test_a_killed_rank_0_ends_its_workers_within_seconds(tiny_vocab_dir, tmp_path):
    """Rank 0 gone without a word (SIGKILL): its worker notices (a closed connection, or its
    parent gone) and exits."""
    import subprocess
    import sys

    script = tmp_path / "rank0.py"
    script.write_text(RANK0_SCRIPT)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    rank0 = subprocess.Popen([sys.executable, str(script), str(tiny_vocab_dir)],
                             stdout=subprocess.PIPE, text=True, env=env)  # fmt: skip
    try:
        worker_pid = int(rank0.stdout.readline())
        time.sleep(1.0)  # (decoding)
        rank0.kill()
        deadline = time.monotonic() + 10
        while is_running(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not is_running(worker_pid), "the worker outlived rank 0"
    finally:
        rank0.kill()
        rank0.wait()
