"""The NVML check: the library, its version and the driver's; then one line per GPU."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from gpuwatch.doctor.base import FAIL, OK, WARN, Check, Context
from gpuwatch.model import GpuDevice
from gpuwatch.nvml_codes import (
    DRIVER_NOT_LOADED,
    LIB_RM_VERSION_MISMATCH,
    LIBRARY_NOT_FOUND,
    NO_PERMISSION,
)
from gpuwatch.sources.nvml import NvmlSource
from gpuwatch.units import human_bytes, plural

_NVML_FIXES = {
    NO_PERMISSION:
        "no access to /dev/nvidiactl or /dev/nvidiaN: run as a user who may open them; in a "
        "container use the NVIDIA container runtime; under systemd see DeviceAllow= in "
        "docs/systemd.md",
    DRIVER_NOT_LOADED:
        "the kernel module is not loaded: `modprobe nvidia` or reinstall the driver "
        "(`nvidia-smi` fails the same way; `dmesg | grep -i nvrm` says why)",
    LIB_RM_VERSION_MISMATCH:
        "libnvidia-ml and the loaded kernel module are different versions (a driver upgrade "
        "without a reboot): reboot, or unload and reload the nvidia modules",
}
_NVML_DEFAULT_FIX = ("`nvidia-smi` shows whether the driver answers at all; "
                     "`dmesg | grep -i -e nvrm -e xid` says why not")


def check_nvml(ctx: Context) -> list[Check]:
    """The library, its version and the driver's; then one line per GPU."""
    source = NvmlSource(dev_dir=str(ctx.dev_dir))
    try:
        reading = source.read()
    finally:
        source.close()
    ctx.nvml = reading
    status = reading.status
    if not status.available:
        return [_nvml_unavailable(status.error or "unknown reason", status.error_code,
                                  status.device_files or 0, ctx.dev_dir)]
    versions = status.message + (f", CUDA {status.cuda_driver_version}"
                                 if status.cuda_driver_version else "")
    if not reading.gpus:
        return [Check("nvml", WARN, f"{versions}, but NVML lists no GPU",
                      fix="`nvidia-smi -L` lists the GPUs the driver sees; in a container, "
                          "NVIDIA_VISIBLE_DEVICES or the device plugin gave it none")]
    count = len(reading.gpus)
    return [Check("nvml", OK, f"{versions}, {plural(count, 'GPU')}"),
            *(_gpu_check(g) for g in reading.gpus)]


def _nvml_unavailable(error: str, code: Optional[int], device_files: int,
                      dev_dir: Path) -> Check:
    if code == LIBRARY_NOT_FOUND:
        if device_files:
            return Check(
                "nvml", FAIL,
                f"no NVML library (libnvidia-ml.so.1: {error}), yet {dev_dir} has "
                f"{plural(device_files, 'nvidiaN device file')}: a GPU "
                "node without its driver's user-space libraries",
                fix="install the driver's user-space part (the package with libnvidia-ml.so.1) "
                    "or put its directory on the loader path (ldconfig); in a container, run it "
                    "with the NVIDIA container runtime")
        return Check(
            "nvml", WARN,
            f"no NVML library (libnvidia-ml.so.1: {error}) and no GPU device files: gpuwatch "
            "monitors host processes only, without GPU memory figures",
            fix="nothing to do on a node without GPUs; on a GPU node, install the NVIDIA driver")
    if code is None:  # no NVML error code: gpuwatch's own install is broken
        return Check("nvml", FAIL, f"NVML cannot be used: {error}",
                     fix="reinstall gpuwatch with its dependencies (nvidia-ml-py)")
    return Check("nvml", FAIL,
                 f"libnvidia-ml.so.1 found, but NVML initialisation failed: {error} (NVML error "
                 f"{code})", fix=_NVML_FIXES.get(code, _NVML_DEFAULT_FIX))


def _gpu_check(g: GpuDevice) -> Check:
    name = f"gpu{g.index}"
    what = " ".join(p for p in (g.name, g.pci_bus_id) if p) or f"GPU {g.index}"
    if g.errors:
        failed = "; ".join(str(e) for e in g.errors)
        if g.lost:
            return Check(name, FAIL, f"{what}: lost, needs a reset ({failed})", detail=g.uuid,
                         fix="stop the processes using it, then `nvidia-smi -r -i "
                             f"{g.index}`, or reboot the node; `dmesg | grep -i xid` says "
                             "what happened")
        unknown = " (who holds its memory is unknown)" if g.holders_unknown else ""
        return Check(name, FAIL, f"{what}: {failed}{unknown}", detail=g.uuid,
                     fix=f"`nvidia-smi -q -i {g.index}` shows what the driver says about it; "
                         "`dmesg | grep -i xid` whether it faulted")
    memory = (f"{human_bytes(g.memory_used_bytes)} of {human_bytes(g.memory_total_bytes)} used"
              if g.memory_total_bytes is not None else "memory unknown")
    count = len(g.processes)
    mig = ", MIG on" if g.mig_enabled else ""
    return Check(name, OK, f"{what}: {memory}, {plural(count, 'process')}{mig}",
                 detail=g.uuid)
