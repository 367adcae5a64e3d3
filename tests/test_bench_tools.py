"""bench/'s scripts stay runnable: every command parses its documented flags, and the ones that
run in seconds on the CPU run (the kernel benchmarks on the interpreter, the policy's host
cost, the cost tables side by side, the random checkpoints). Their measurements are not
checked; the tools behind them are tested where their modules are."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests.helpers import bench_module

BENCH = Path(__file__).resolve().parents[1] / "bench"
COMMANDS = {
    "kernel_timing": [["attention"], ["fused-ops"], ["gemv"], ["gemv-configs"]],
    "step_profile": [["plain"], ["spec"]],
    "policy": [["trace"], ["replay"], ["host-cost"]],
    "random_models": [["smollm2"], ["drafter"], ["qwen3"]],
    "results": [["cost-tables"], ["merge-sweeps"]],
    "serving": [["phases"], ["sender-cost"]],
    "latency": [["prefill-silence"], ["prefix-caching"]],
    "startup_time": [[]],
    "structured_output": [[]],
    "shaped_drafts": [[]],
    "host_loop": [[]],
    "real_target_shapes": [[]],
    "tensor_parallel": [[]],
}


def test_the_readme_lists_every_script():
    scripts = {p.stem for p in BENCH.glob("*.py")}
    assert scripts == set(COMMANDS)
    readme = (BENCH / "README.md").read_text()
    for name in [*scripts, "device_setup"]:
        assert f"`{name}." in readme, name


@pytest.mark.parametrize("script", sorted(COMMANDS))
def test_every_command_parses_its_help(script, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(BENCH))  # (scripts import their neighbours)
    module = bench_module(script)
    for command in COMMANDS[script]:
        argv = ["--help"] if script == "kernel_timing" else [*command, "--help"]  # (one parser)
        monkeypatch.setattr(sys, "argv", [f"{script}.py", *argv])
        with pytest.raises(SystemExit) as exit_:
            module.main()
        assert exit_.value.code == 0, (script, command)
        assert "usage:" in capsys.readouterr().out


@pytest.mark.parametrize("which", ["attention", "fused-ops", "gemv", "gemv-configs"])
def test_kernel_benchmarks_run_on_the_interpreter(which, tmp_path):
    """In a process of its own: --smoke sets TRITON_INTERPRET before the kernels are imported."""
    out = tmp_path / "smoke.json"
    done = subprocess.run([sys.executable, str(BENCH / "kernel_timing.py"), which, "--smoke",
                           "--out", str(out)], capture_output=True, text=True,
                          cwd=BENCH.parent, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr
    result = json.loads(out.read_text())
    assert result["smoke"] and result["rows"]
    assert all(row["max_abs_err"] < 1e-3 for row in result["rows"])


def test_policy_host_cost_runs(tmp_path, capsys):
    out = tmp_path / "host_cost.json"
    policy = bench_module("policy")
    assert policy.main(["host-cost", "--batch", "1,4", "--steps", "5", "--out", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [r["batch"] for r in rows] == [1, 4]
    assert all(r["decide_us"] > 0 and r["trace_line_us"] > 0 for r in rows)


def test_host_loop_times_the_policy_beside_fixed_k(tmp_path):
    """The policy under the always-drafting table runs K = 7's steps (the same windows and
    synthetic draws), so the two arms differ only by the policy's host work, which it reports."""
    out = tmp_path / "host_loop.json"
    host_loop = bench_module("host_loop")
    assert (
        host_loop.main(
            [
                "--concurrency",
                "2",
                "--arms",
                "k7,policy",
                "--repeats",
                "1",
                "--num-requests",
                "3",
                "--output-len",
                "12",
                "--out",
                str(out),
            ]
        )
        == 0
    )
    result = json.loads(out.read_text())
    k7, policy = result["levels"]
    assert (k7["arm"], policy["arm"]) == ("k7", "policy")
    assert k7["steps"] == policy["steps"] and k7["acceptance_length"] > 1
    assert policy["parts_us_per_step"]["policy decide"] > 0
    assert policy["parts_us_per_step"]["policy observe"] > 0
    assert all(level["host_us"]["median"] > 0 for level in result["levels"])
    assert result["synthetic"].startswith("acceptance by the smollm2 profile")


def test_cost_tables_side_by_side(capsys):
    tables = sorted((BENCH.parent / "dspark/drafters").glob("*/cost_tables/*.json"))
    bench_module("results").main(["cost-tables", *(f"{p.stem}={p}" for p in tables[:2])])
    out = capsys.readouterr().out
    assert out.startswith(f"cells (ms): G | {tables[0].stem} plain, full")
    assert "\n   1 | " in out


def test_random_models_write_a_target_and_drafters_for_it(tmp_path):
    from dspark.models.drafter_config import DrafterConfig

    random_models = bench_module("random_models")
    random_models.main(["qwen3", "--shapes", "tiny", "--out", str(tmp_path / "q")])
    target = tmp_path / "q" / "target"
    config = json.loads((target / "config.json").read_text())
    assert config["num_hidden_layers"] == random_models.SHAPES["tiny"]["num_hidden_layers"]
    assert len(list(target.glob("model-*-of-*.safetensors"))) > 1  # sharded, with its index
    assert (tmp_path / "q" / "drafter" / "model.safetensors").is_file()
    random_models.main(["drafter", "--target", str(target), "--out", str(tmp_path / "d")])
    config = DrafterConfig.from_dict(json.loads((tmp_path / "d" / "config.json").read_text()))
    assert config.draft_len == 7 and config.target_layers == (1, 3)  # taps within 4 layers


def test_prefix_caching_ttft_counts_equal_replies_and_fails_on_a_difference_in_float32(
    tiny_llama_dir, tmp_path, monkeypatch
):
    latency = bench_module("latency")
    out = tmp_path / "ttft.json"
    argv = ["prefix-caching", "--model", str(tiny_llama_dir), "--device", "cpu", "--turns", "3",
            "--user-words", "20", "--max-tokens", "6", "--repeats", "2", "--max-model-len", "512",
            "--out", str(out)]  # fmt: skip
    latency.main(argv)
    result = json.loads(out.read_text())
    assert result["equal_replies"] == result["replies"] == 6
    assert result["on"]["prompt_tokens"] == result["off"]["prompt_tokens"]
    assert result["on"]["prefix_cache_hits"] > 0
    run_arm = latency.run_arm

    def one_reply_differs(args, caching, history=None):  # (as half precision may do)
        arm = run_arm(args, caching, history)
        if caching:
            arm["replies"][1][0][2] += 1
        return arm

    monkeypatch.setattr(latency, "run_arm", one_reply_differs)
    with pytest.raises(SystemExit, match="1 of 6 replies differ with caching on"):
        latency.main(argv)  # float32 on the CPU: outputs must be equal
    result = json.loads(out.read_text())  # written before failing
    assert result["equal_replies"] == 5
    diffs = [row["first_difference"] for row in result["turns"]]
    assert diffs == [[None, None], [2, None], [None, None]]
    # the conversations continued on the caching-off arm's replies: the same prompts
    assert result["on"]["prompt_tokens"] == result["off"]["prompt_tokens"]
    latency.main([*argv, "--no-require-equal"])
