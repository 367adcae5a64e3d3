"""The GPU's clocks, temperature, power and clock-event reasons, read with `nvidia-smi`, so that a
measurement records the state it ran in.

Two hazards motivated it: the speculative
arms' first repeat of a level sometimes ran up to 1.6x slower than the second, and a cost table
profiled right after a quarter of an hour of training read up to 1.7x high from G = 64 up, where
a profile a minute later in a fresh process did not. Both fit clocks that are not at their
steady value (ramping up from idle, or held down by heat or power), and neither can be told
apart from the numbers alone. Nothing here changes a setting: it only reads.

One query, one line of CSV (no header, no units):

  nvidia-smi --query-gpu=clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw,
             clocks_event_reasons.active --format=csv,noheader,nounits -i GPU-8f2c...
  "1980, 1980, 3201, 41, 118.52, 0x0000000000000000"
  -> {"sm_clock_mhz": 1980, "max_sm_clock_mhz": 1980, "mem_clock_mhz": 3201,
      "temperature_c": 41, "power_w": 118.52, "clock_event_reasons": []}

  "1755, 1980, 3201, 83, 689.10, 0x0000000000000024"
  -> {..., "clock_event_reasons": ["sw_power_cap", "sw_thermal_slowdown"]}  (bits 0x4, 0x20)

Without nvidia-smi (the CPU, another vendor) or when it fails, the state is None: a benchmark
records that and goes on.
"""

from __future__ import annotations

import logging
import shutil
import subprocess

import torch

logger = logging.getLogger(__name__)

FIELDS = ("sm_clock_mhz", "max_sm_clock_mhz", "mem_clock_mhz", "temperature_c", "power_w")
QUERY = "clocks.sm,clocks.max.sm,clocks.mem,temperature.gpu,power.draw"
# the reasons field is named clocks_event_reasons since driver 535, clocks_throttle_reasons
# before (newer drivers still accept the old name)
REASON_FIELDS = ("clocks_event_reasons.active", "clocks_throttle_reasons.active")
# nvmlClocksEventReasons bits (NVML's nvml.h)
REASON_BITS = {
    0x1: "gpu_idle",
    0x2: "applications_clocks_setting",
    0x4: "sw_power_cap",
    0x8: "hw_slowdown",
    0x10: "sync_boost",
    0x20: "sw_thermal_slowdown",
    0x40: "hw_thermal_slowdown",
    0x80: "hw_power_brake_slowdown",
    0x100: "display_clock_setting",
}
TIMEOUT_S = 5.0
# (nvidia-smi, device index) -> the (-i, reasons field) that answered
_ANSWERED: dict[tuple[str, int | None], tuple[str, str]] = {}


def parse_query_line(line: str) -> dict:
    """One line of the query's CSV as a dict (worked examples in the module docstring); a field
    nvidia-smi cannot report ("[N/A]", "[Not Supported]") is None."""
    parts = [p.strip() for p in line.strip().split(",")]
    if len(parts) != len(FIELDS) + 1:
        raise ValueError(f"expected {len(FIELDS) + 1} comma-separated fields, got {line!r}")
    state: dict = {}
    for name, text in zip(FIELDS, parts, strict=False):
        try:
            value = float(text)
        except ValueError:
            state[name] = None
            continue
        state[name] = value if name == "power_w" else int(value)
    try:
        bits = int(parts[-1], 16)
    except ValueError:
        state["clock_event_reasons"] = None
    else:
        state["clock_event_reasons"] = [n for b, n in REASON_BITS.items() if bits & b]
        unknown = bits & ~sum(REASON_BITS)
        if unknown:
            state["clock_event_reasons"].append(hex(unknown))
    return state


def _device_ids(device: torch.device) -> list[str]:
    """nvidia-smi's -i for this CUDA device: its UUID (CUDA_VISIBLE_DEVICES may renumber), then
    its index (right when nothing renumbers), for a driver that reads the UUID otherwise."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    ids = []
    uuid = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    if uuid is not None:
        text = str(uuid)
        ids.append(text if text.startswith("GPU-") else f"GPU-{text}")
    return ids + [str(index)]


def read_gpu_state(device: torch.device | str) -> dict | None:
    """The GPU's state now, or None where it cannot be read (logged at debug level)."""
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return None
    smi = shutil.which("nvidia-smi")
    if smi is None:
        return None
    key = (smi, device.index)
    tried = [(gpu, reasons) for gpu in _device_ids(device) for reasons in REASON_FIELDS]
    if key in _ANSWERED:  # the -i and field that answered last time first (a bench reads often)
        tried.insert(0, _ANSWERED[key])
    for gpu, reasons in tried:
        cmd = [smi, f"--query-gpu={QUERY},{reasons}", "--format=csv,noheader,nounits", "-i", gpu]
        try:
            done = subprocess.run(cmd, capture_output=True, text=True, timeout=TIMEOUT_S)
        except (OSError, subprocess.TimeoutExpired) as e:
            logger.debug("gpu state: %s failed: %s", smi, e)
            return None
        if done.returncode == 0 and done.stdout.strip():
            _ANSWERED[key] = (gpu, reasons)
            try:
                return parse_query_line(done.stdout.strip().splitlines()[0])
            except ValueError as e:
                logger.debug("gpu state: %s", e)
                return None
        logger.debug("gpu state: nvidia-smi -i %s answered %s: %s", gpu, done.returncode,
                     done.stderr.strip())  # fmt: skip
    return None


# reasons that hold the clocks below what the GPU would otherwise run at under load (idle,
# application clocks and sync boost are not a measurement's concern)
HELD_DOWN = ("sw_power_cap", "hw_slowdown", "sw_thermal_slowdown", "hw_thermal_slowdown",
             "hw_power_brake_slowdown")  # fmt: skip


def held_down(*states: dict | None) -> list[str]:
    """The reasons in any of `states` (before and after a measurement) that held the clocks
    down, sorted, each once (empty when none or unknown)."""
    reasons = {r for state in states for r in (state or {}).get("clock_event_reasons") or []}
    return sorted(reasons & set(HELD_DOWN))


def describe(state: dict | None) -> str:
    """One line for a log: "SM 1980 / 1980 MHz, 41 C, 118.5 W, reasons: none"."""
    if state is None:
        return "not readable"
    reasons = state.get("clock_event_reasons")
    power = state.get("power_w")
    return (
        f"SM {state.get('sm_clock_mhz')} / {state.get('max_sm_clock_mhz')} MHz, "
        f"{state.get('temperature_c')} C, {'?' if power is None else f'{power:.1f}'} W, "
        f"reasons: {', '.join(reasons) if reasons else 'none'}"
    )
