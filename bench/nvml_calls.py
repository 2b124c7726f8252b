"""Every NVML call gpuwatch makes, and what this machine's driver answers to each: run it on a
GPU node and against the fake driver, and compare the two, line by line, to keep the fake honest.

    python bench/nvml_calls.py                 # the driver this process loads
    python bench/nvml_calls.py --fake          # the fake driver, with one process holding 1 GiB
    python bench/nvml_calls.py --hold-mib 1024 # a CUDA process (PyTorch) holds memory meanwhile

It prints one line per call and device: the value, or the NVML error it raised, and for the
process lists every field of every entry. With --hold-mib it also times how long the driver keeps
listing a process after it exited. Exit 3 when NVML does not initialise.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

ROOT = Path(__file__).resolve().parent.parent

HOLDER = """
import sys, time, torch
block = torch.empty(int(sys.argv[1]) << 20, dtype=torch.uint8, device="cuda")
torch.cuda.synchronize()
print("ready", flush=True)
sys.stdin.read()
"""


def answer(call: Callable[[], Any]) -> str:
    import pynvml

    try:
        value = call()
    except pynvml.NVMLError as exc:
        return f"error {exc.value}: {exc}"
    return describe(value)


def describe(value: Any) -> str:
    if isinstance(value, list):
        return "[" + ", ".join(describe(v) for v in value) + "]"
    if hasattr(value, "_fields_"):
        return "{" + ", ".join(f"{name}={getattr(value, name)!r}"
                               for name, *_ in value._fields_) + "}"
    if type(value).__name__ == "nvmlFriendlyObject":
        return "{" + ", ".join(f"{k}={v!r}" for k, v in sorted(vars(value).items())) + "}"
    return repr(value)


def probe(lines: list[str]) -> None:
    import pynvml

    for name, call in (("nvmlSystemGetDriverVersion", pynvml.nvmlSystemGetDriverVersion),
                       ("nvmlSystemGetNVMLVersion", pynvml.nvmlSystemGetNVMLVersion),
                       ("nvmlSystemGetCudaDriverVersion",
                        pynvml.nvmlSystemGetCudaDriverVersion),
                       ("nvmlDeviceGetCount", pynvml.nvmlDeviceGetCount)):
            lines.append(f"{name}: {answer(call)}")
    for index in range(pynvml.nvmlDeviceGetCount()):
        h = pynvml.nvmlDeviceGetHandleByIndex(index)
        calls: dict[str, Callable[[], Any]] = {
            "nvmlDeviceGetName": lambda h=h: pynvml.nvmlDeviceGetName(h),
            "nvmlDeviceGetUUID": lambda h=h: pynvml.nvmlDeviceGetUUID(h),
            "nvmlDeviceGetPciInfo": lambda h=h: pynvml.nvmlDeviceGetPciInfo(h).busId,
            "nvmlDeviceGetMemoryInfo (v1)": lambda h=h: pynvml.nvmlDeviceGetMemoryInfo(h),
            "nvmlDeviceGetMemoryInfo (v2)": lambda h=h: pynvml.nvmlDeviceGetMemoryInfo(
                h, version=pynvml.nvmlMemory_v2),
            "nvmlDeviceGetUtilizationRates":
                lambda h=h: pynvml.nvmlDeviceGetUtilizationRates(h),
            "nvmlDeviceGetMigMode": lambda h=h: pynvml.nvmlDeviceGetMigMode(h),
            "nvmlDeviceGetComputeRunningProcesses":
                lambda h=h: pynvml.nvmlDeviceGetComputeRunningProcesses(h),
            "nvmlDeviceGetGraphicsRunningProcesses":
                lambda h=h: pynvml.nvmlDeviceGetGraphicsRunningProcesses(h),
        }
        for name, call in calls.items():
            lines.append(f"GPU {index} {name}: {answer(call)}")


def listed_after_exit(pid: int, timeout: float = 30.0) -> Optional[float]:
    """Seconds from now until no device lists `pid` (None: still listed at the timeout)."""
    import pynvml

    started = time.monotonic()
    while time.monotonic() - started < timeout:
        pids = {p.pid for i in range(pynvml.nvmlDeviceGetCount())
                for p in pynvml.nvmlDeviceGetComputeRunningProcesses(
                    pynvml.nvmlDeviceGetHandleByIndex(i))}
        if pid not in pids:
            return time.monotonic() - started
        time.sleep(0.005)
    return None


def main(argv: Optional[list[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--fake", action="store_true",
                        help="load the fake driver (built here), one process holding 1 GiB")
    parser.add_argument("--hold-mib", type=int, default=0,
                        help="a PyTorch process holds this much CUDA memory while probing")
    parser.add_argument("--json", type=Path, help="also write the lines here")
    args = parser.parse_args(argv)
    if args.fake and "GPUWATCH_NVML_CALLS_CHILD" not in os.environ:
        from gpuwatch.simulate.fakenvml import FakeNode, build_fake_nvml

        work = Path(tempfile.mkdtemp(prefix="nvml-calls-"))
        node = FakeNode(work / "state", build_fake_nvml(), gpus=1)
        sleeper = subprocess.Popen(["sleep", "600"])
        try:
            node.hold(sleeper.pid, device=0, used=1 << 30)
            env = {**node.env(), "GPUWATCH_NVML_CALLS_CHILD": "1"}
            return subprocess.run([sys.executable, __file__,
                                   *([] if args.json is None else ["--json", str(args.json)])],
                                  env=env).returncode
        finally:
            sleeper.kill()
            sleeper.wait()
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError as exc:
        print(f"NVML does not initialise here: {exc}")
        return 3
    holder = None
    lines: list[str] = []
    try:
        if args.hold_mib:
            holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(args.hold_mib)],
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            assert holder.stdout is not None and holder.stdout.readline().strip() == "ready"
            lines.append(f"holder: PID {holder.pid} holds {args.hold_mib} MiB through PyTorch")
        probe(lines)
        if holder is not None:
            assert holder.stdin is not None
            holder.stdin.close()
            holder.wait()
            gone = listed_after_exit(holder.pid)
            lines.append("listed after exit: " + ("still listed after 30 s" if gone is None
                                                  else f"{gone * 1000:.0f} ms"))
    finally:
        if holder is not None and holder.poll() is None:
            holder.kill()
            holder.wait()
        pynvml.nvmlShutdown()
    print("\n".join(lines))
    if args.json is not None:
        args.json.write_text(json.dumps(lines, indent=1))
    return 0


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    sys.exit(main())
