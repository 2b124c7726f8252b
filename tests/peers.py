"""What unmodified peer tools (gpustat, nvitop) show for an NVML environment.

Each view runs the tool's console script from the same virtualenv as the tests, in the given
environment (e.g. ``FakeNode.env()``), and parses its output into::

    {
        "tool": "gpustat" | "nvitop",
        "gpus": [{"index", "uuid" (gpustat only), "name", "memory_total_bytes",
                  "memory_used_bytes"}],        # bytes as the tool shows them, see below
        "processes": {(gpu_index, pid): bytes_as_shown_or_None},
    }

Rounding, so that a comparison allows for exactly what each tool does (``gpustat_shown`` and
``nvitop_shown`` reproduce it: compare a peer's figure with ``*_shown(true_bytes)``):

gpustat 1.1 (``gpustat --json``)
    GPU ``memory.used`` / ``memory.total`` and process ``gpu_memory_usage`` are whole MiB,
    floored: ``bytes // 2**20``. GPU used memory is ``nvmlMemory_v2_t.used`` (reserved memory
    excluded). A process whose NVML figure is NOT_AVAILABLE *or 0* shows ``null``. PIDs psutil
    cannot find (ghost entries) are left out. A PID in both the compute and the graphics list
    appears once. The name is shown in full; UUIDs are shown. A GPU whose handle lookup fails
    with GPU_IS_LOST or UNKNOWN is shown as "((GPU is lost))" / "((Unknown Error))" with "?" for
    memory (None here); any other error there makes gpustat fail as a whole.

nvitop 1.7 (``nvitop -1 --ascii``)
    Sizes are text from ``nvitop.api.utils.bytes2human``: below 1 KiB ``"{b}B"``; below 1 MiB
    ``round(b/KiB)`` KiB; below 100 MiB MiB with 2 decimals; below 1000 MiB MiB with 1 decimal;
    below 20 GiB whole MiB; below 100 GiB GiB with 2 decimals; below 1000 GiB GiB with
    1 decimal; then TiB likewise. Python's ``round`` (half to even, on the float quotient).
    The shown bytes are the shown number times the unit. GPU used memory is
    ``nvmlMemory_v2_t.used``. A NOT_AVAILABLE process figure shows ``N/A`` (None here). Ghost
    PIDs are listed (as "No Such Process"); a PID wider than its 7-character column is elided
    ("999999.") and left out here. Names lose a leading "NVIDIA " and are cut to 19 characters
    as ``".." + last 17``; UUIDs are not shown. A lost GPU shows "ERROR: GPU is Lost" as its
    name and N/A (None here) for memory.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Optional

KiB = 1 << 10
MiB = 1 << 20
GiB = 1 << 30
TiB = 1 << 40
PiB = 1 << 50

_UNITS = {"B": 1, "KiB": KiB, "MiB": MiB, "GiB": GiB, "TiB": TiB, "PiB": PiB}


class PeerError(RuntimeError):
    """A peer tool failed or printed something this module cannot parse."""


def _console_script(name: str) -> str:
    # The tools must come from the environment the tests run in (same pynvml as gpuwatch).
    candidate = Path(sys.executable).parent / name
    if candidate.exists():
        return str(candidate)
    found = shutil.which(name)
    if found is None:
        raise PeerError(f"{name} is not installed")
    return found


def _run(argv: list[str], env: Mapping[str, str], timeout: float) -> str:
    proc = subprocess.run(
        argv, env=dict(env), capture_output=True, text=True, timeout=timeout, check=False
    )
    if proc.returncode != 0:
        raise PeerError(
            f"{' '.join(argv)} exited {proc.returncode}\n"
            f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}"
        )
    return proc.stdout


# ---- gpustat -------------------------------------------------------------------------------------


def gpustat_shown(b: Optional[int]) -> Optional[int]:
    """Bytes as gpustat shows a memory figure of ``b`` bytes (whole MiB, floored)."""
    return None if b is None else b // MiB * MiB


def gpustat_shown_process(b: Optional[int]) -> Optional[int]:
    """As gpustat shows a process's figure: like gpustat_shown, but 0 bytes shows as null."""
    return None if not b else gpustat_shown(b)


def _mib(value: Any) -> Optional[int]:
    # InvalidGPU entries (a lost GPU) carry "?" placeholders.
    return value * MiB if isinstance(value, int) else None


def gpustat_view(env: Mapping[str, str], timeout: float = 60.0) -> dict[str, Any]:
    out = _run([_console_script("gpustat"), "--json"], env, timeout)
    try:
        doc = json.loads(out)
    except ValueError as exc:
        raise PeerError(f"gpustat printed no JSON: {out!r}") from exc
    gpus: list[dict[str, Any]] = []
    processes: dict[tuple[int, int], Optional[int]] = {}
    for gpu in doc["gpus"]:
        index = int(gpu["index"])
        gpus.append(
            {
                "index": index,
                "uuid": gpu.get("uuid") if gpu.get("uuid") != "?" else None,
                "name": gpu.get("name"),
                "memory_total_bytes": _mib(gpu.get("memory.total")),
                "memory_used_bytes": _mib(gpu.get("memory.used")),
            }
        )
        for proc in gpu.get("processes") or []:
            processes[(index, int(proc["pid"]))] = _mib(proc.get("gpu_memory_usage"))
    return {"tool": "gpustat", "gpus": gpus, "processes": processes}


# ---- nvitop --------------------------------------------------------------------------------------


def nvitop_bytes2human(b: int) -> str:
    """nvitop.api.utils.bytes2human (default min_unit), reproduced."""
    if b < KiB:
        return f"{b}B"
    if b < MiB:
        return f"{round(b / KiB)}KiB"
    if b < 100 * MiB:
        return f"{round(b / MiB, 2):.2f}MiB"
    if b < 1000 * MiB:
        return f"{round(b / MiB, 1):.1f}MiB"
    if b < 20 * GiB:
        return f"{round(b / MiB)}MiB"
    if b < 100 * GiB:
        return f"{round(b / GiB, 2):.2f}GiB"
    if b < 1000 * GiB:
        return f"{round(b / GiB, 1):.1f}GiB"
    if b < 100 * TiB:
        return f"{round(b / TiB, 2):.2f}TiB"
    if b < 1000 * TiB:
        return f"{round(b / TiB, 1):.1f}TiB"
    if b < 100 * PiB:
        return f"{round(b / PiB, 2):.2f}PiB"
    return f"{round(b / PiB, 1):.1f}PiB"


def parse_nvitop_size(text: str) -> Optional[int]:
    """Bytes that an nvitop size string stands for ("1536MiB" -> 1610612736); None for N/A."""
    text = text.strip()
    if text in ("N/A", "WDDM:N/A"):
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(B|KiB|MiB|GiB|TiB|PiB)", text)
    if not m:
        raise PeerError(f"not an nvitop size: {text!r}")
    number, unit = m.groups()
    whole, _, frac = number.partition(".")
    # Exact arithmetic: "79.65GiB" is 7965 * GiB / 100, rounded to whole bytes.
    scaled = int(whole + frac) * _UNITS[unit]
    return (scaled * 2 + 10 ** len(frac)) // (2 * 10 ** len(frac))


def nvitop_shown(b: Optional[int]) -> Optional[int]:
    """Bytes as nvitop shows a memory figure of ``b`` bytes."""
    return None if b is None else parse_nvitop_size(nvitop_bytes2human(b))


def nvitop_shown_name(name: str) -> str:
    if name.startswith("NVIDIA "):
        name = name.replace("NVIDIA ", "", 1)
    return name if len(name) <= 19 else ".." + name[-17:]


_SIZE = r"(?:\d+(?:\.\d+)?(?:B|KiB|MiB|GiB|TiB|PiB)|N/A)"
_GPU_LINE1 = re.compile(r"^\s*(\d+)\s+(.*?)\s+(\S+)\s*$")  # index, name, persistence mode
_MEMORY = re.compile(rf"^\s*({_SIZE})\s*/\s*({_SIZE})\s*$")  # used / total
_PROCESS = re.compile(rf"^\|\s*(\d+)(?::\d+)?\s+(\d+)\s+(C\+G|C|G|X)\s+(\S+)\s+({_SIZE})\s")


def nvitop_view(env: Mapping[str, str], timeout: float = 60.0) -> dict[str, Any]:
    run_env = dict(env)
    # Wide enough that nothing is elided; plain text.
    run_env.update({"COLUMNS": "200", "LINES": "60", "TERM": "dumb", "NO_COLOR": "1"})
    run_env.pop("NVITOP_MONITOR_MODE", None)
    out = _run([_console_script("nvitop"), "-1", "--ascii"], run_env, timeout)

    lines = out.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.startswith("| GPU  Name"))
        end = next(i for i in range(start + 1, len(lines)) if lines[i].startswith("+="))
    except StopIteration as exc:
        raise PeerError(f"no device table in nvitop output:\n{out}") from exc

    gpus: list[dict[str, Any]] = []
    pending: Optional[dict[str, Any]] = None
    for line in lines[start:end]:
        cells = line.split("|")
        if len(cells) < 4:
            continue
        if pending is None:
            m = _GPU_LINE1.match(cells[1])
            if m:
                pending = {"index": int(m.group(1)), "name": m.group(2)}
            continue
        mem = _MEMORY.match(cells[2])
        if not mem:
            raise PeerError(f"no memory cell after GPU {pending['index']}: {line!r}")
        pending["memory_used_bytes"] = parse_nvitop_size(mem.group(1))
        pending["memory_total_bytes"] = parse_nvitop_size(mem.group(2))
        gpus.append(pending)
        pending = None

    processes: dict[tuple[int, int], Optional[int]] = {}
    for line in lines[end:]:
        m = _PROCESS.match(line)
        if m:
            processes[(int(m.group(1)), int(m.group(2)))] = parse_nvitop_size(m.group(5))
    return {"tool": "nvitop", "gpus": gpus, "processes": processes}
