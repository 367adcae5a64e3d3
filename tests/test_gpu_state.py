"""The GPU-state reader (benchmarks/gpu_state.py): nvidia-smi's CSV parsed as its docstring's
worked examples say, nothing read where there is no GPU, and a cost table keeping the record."""

from __future__ import annotations

import pytest
import torch

from dspark.benchmarks.gpu_state import describe, held_down, parse_query_line, read_gpu_state
from dspark.policy.cost_table import CostTable, parse_table


def test_a_steady_gpu_line():
    state = parse_query_line("1980, 1980, 3201, 41, 118.52, 0x0000000000000000\n")
    assert state == {"sm_clock_mhz": 1980, "max_sm_clock_mhz": 1980, "mem_clock_mhz": 3201,
                     "temperature_c": 41, "power_w": 118.52, "clock_event_reasons": []}  # fmt: skip
    assert describe(state) == "SM 1980 / 1980 MHz, 41 C, 118.5 W, reasons: none"


def test_a_held_down_gpu_names_its_reasons():
    state = parse_query_line("1755, 1980, 3201, 83, 689.10, 0x0000000000000024")
    assert state["clock_event_reasons"] == ["sw_power_cap", "sw_thermal_slowdown"]
    assert describe(state).endswith("reasons: sw_power_cap, sw_thermal_slowdown")
    assert held_down(state) == ["sw_power_cap", "sw_thermal_slowdown"]
    assert held_down(parse_query_line("210, 1980, 3201, 30, 70, 0x1")) == []  # idle is not
    assert held_down(None) == []
    # a bit NVML did not define when this was written is kept, in hex
    assert parse_query_line("1, 2, 3, 4, 5, 0x1001")["clock_event_reasons"] == [
        "gpu_idle", "0x1000"
    ]  # fmt: skip


def test_fields_nvidia_smi_cannot_report_are_none():
    state = parse_query_line("1980, 1980, 3201, 41, [N/A], [Not Supported]")
    assert state["power_w"] is None and state["clock_event_reasons"] is None
    assert "? W" in describe(state)


def test_a_line_of_the_wrong_shape_is_refused():
    with pytest.raises(ValueError, match="expected 6 comma-separated fields, got '1980, 41'"):
        parse_query_line("1980, 41")


def test_nothing_is_read_without_a_cuda_device():
    assert read_gpu_state("cpu") is None
    assert describe(None) == "not readable"


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_gpu_state_is_read_on_cuda():
    state = read_gpu_state("cuda")
    assert state is not None and state["sm_clock_mhz"] > 0 and state["max_sm_clock_mhz"] > 0


def test_a_cost_table_keeps_how_it_was_measured():
    fingerprint = {"gpu": "x"}
    measured = {"gpu_state_before": parse_query_line("1980, 1980, 3201, 41, 118.5, 0x0"),
                "gpu_state_after": None}  # fmt: skip
    table = CostTable(fingerprint, {1: {1: 1e-3, 8: 2e-3}}, measured=measured)
    again = parse_table(table.to_json())
    assert again == table and again.measured == measured
    assert "measured" not in CostTable(fingerprint, {1: {1: 1e-3}}).to_json()


def test_nvidia_smi_is_asked_by_uuid_then_index_and_either_reasons_field(tmp_path, monkeypatch):
    """The reader's fallbacks, against a stand-in nvidia-smi on PATH that knows the GPU only by
    index and only the reasons field's older name (what an older driver answers)."""
    import types

    calls = tmp_path / "calls.txt"
    smi = tmp_path / "nvidia-smi"
    smi.write_text(f"""#!/bin/sh
echo "$1 $4" >> {calls}
[ "$4" = "0" ] || {{ echo "No devices were found" >&2; exit 6; }}
case "$1" in *clocks_event_reasons*) echo "Field is not a valid field" >&2; exit 2;; esac
echo "1755, 1980, 3201, 83, 689.10, 0x0000000000000024"
""")
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:/usr/bin:/bin")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties",
                        lambda i: types.SimpleNamespace(uuid="8f2c-11"))  # fmt: skip
    state = read_gpu_state("cuda")
    assert state["sm_clock_mhz"] == 1755 and state["temperature_c"] == 83
    asked = [line.split() for line in calls.read_text().splitlines()]
    assert [(q.rsplit(",", 1)[1], i) for q, i in asked] == [
        ("clocks_event_reasons.active", "GPU-8f2c-11"),
        ("clocks_throttle_reasons.active", "GPU-8f2c-11"),
        ("clocks_event_reasons.active", "0"),
        ("clocks_throttle_reasons.active", "0"),
    ]  # fmt: skip
