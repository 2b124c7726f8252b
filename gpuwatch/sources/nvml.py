"""NVML source: devices, their memory, and which PIDs hold how much of it.

Initialises NVML once and reuses it. Every NVML error becomes data: NVML being unavailable is a
status with a readable reason, one device failing marks that device and the others are still read.

A failing device count is the library failing, whatever the code (a transient UNKNOWN or TIMEOUT
as much as DRIVER_NOT_LOADED): NVML is shut down and initialised again, at once the first time,
then with backoff, and the first good read after it reports NVML up again. A process list that
cannot be read is not an empty one: the holders of the last good read are kept, with their
figures unknown (see `NvmlSource.carried`).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import time
from dataclasses import replace
from typing import Any, Callable, Optional

from gpuwatch.model import (
    COMPUTE,
    GRAPHICS,
    GpuDevice,
    GpuProcessUsage,
    NvmlCallError,
    NvmlReading,
    NvmlStatus,
    SourceError,
)
from gpuwatch.nvml_codes import FUNCTION_NOT_FOUND

# NVML reports "no MIG instance" as an all-ones 32-bit id.
_NO_INSTANCE = 0xFFFFFFFF
# NVML_VALUE_NOT_AVAILABLE as an unsigned long long: a memory figure NVML cannot give.
_NOT_AVAILABLE = 0xFFFFFFFFFFFFFFFF
# One character device per GPU; nvidiactl, nvidia-uvm and nvidia-caps are not GPUs.
_GPU_DEVICE_FILE = re.compile(r"nvidia[0-9]+")


def count_nvidia_device_files(dev_dir: str = "/dev") -> int:
    """The /dev/nvidiaN files: present on a GPU node even when its driver does not answer."""
    try:
        with os.scandir(dev_dir) as entries:
            return sum(1 for e in entries if _GPU_DEVICE_FILE.fullmatch(e.name))
    except OSError:
        return 0


def _load_pynvml() -> Any:
    import pynvml

    return pynvml


class _StaticInfo:
    """What does not change while a device stays healthy: read once, dropped on any error."""

    __slots__ = ("handle", "mig_enabled", "name", "pci_bus_id", "uuid")

    def __init__(self, handle: Any, uuid: Optional[str], name: Optional[str],
                 pci_bus_id: Optional[str], mig_enabled: Optional[bool]) -> None:
        self.handle = handle
        self.uuid = uuid
        self.name = name
        self.pci_bus_id = pci_bus_id
        self.mig_enabled = mig_enabled


class Backoff:
    """When to try again after failures in a row: `initial` seconds after the first, doubling
    after each next one up to `maximum`; a success starts it over."""

    __slots__ = ("failures", "initial", "maximum", "next_try")

    def __init__(self, initial: float, maximum: float) -> None:
        self.initial = initial
        self.maximum = maximum
        self.failures = 0
        #: No try before this (the clock's seconds).
        self.next_try = 0.0

    def failed(self, now: float) -> None:
        self.next_try = now + min(self.maximum, self.initial * 2 ** min(self.failures, 30))
        self.failures += 1

    def succeeded(self) -> None:
        self.failures = 0
        self.next_try = 0.0


class NvmlSource:
    """Reads NVML through nvidia-ml-py.

    After a failed initialisation, or a failed device count (NVML shut down to be initialised
    again), the next attempts back off exponentially from `retry_initial` to `retry_max` seconds,
    so a node without a driver is not hammered; the first `read()` always tries, the first count
    failure after a good read is retried at once (a transient fault then costs no poll), and a
    good read resets the backoff.
    """

    def __init__(self, retry_initial: float = 0.0, retry_max: float = 60.0,
                 nvml: Optional[Any] = None, clock: Callable[[], float] = time.monotonic,
                 dev_dir: str = "/dev") -> None:
        self._nvml = nvml
        self.dev_dir = dev_dir
        self.backoff = Backoff(retry_initial, retry_max)
        self._clock = clock
        self._initialised = False
        self._status = NvmlStatus(available=False, error="not initialised yet")
        self._static: dict[int, _StaticInfo] = {}
        #: Each GPU's holders at its last good read of both process lists, by index, with the
        #: GPU's UUID: what a later read that cannot list them carries over.
        self._holders: dict[int, tuple[Optional[str], tuple[GpuProcessUsage, ...]]] = {}
        #: Each GPU's last process lists as NVML gave them, and what was made of them: lists
        #: that did not change since give the same (immutable) usage records.
        self._listed: dict[int, tuple[object, tuple[GpuProcessUsage, ...]]] = {}
        #: Per GPU and kind of list, the array the last call filled: its size is the last count
        #: and some, so that one call usually does where pynvml makes two.
        self._buffers: dict[tuple[int, str], Any] = {}
        self._entry: Optional[type[ctypes.Structure]] = None
        #: PIDs the last read carried over on each GPU whose process lists could not be read:
        #: listed at its last good read, not listed now because nothing could be. Their figures
        #: on that GPU are None (unknown).
        self.carried: dict[int, frozenset[int]] = {}

    # -- lifecycle -------------------------------------------------------------------------
    def _init(self) -> NvmlStatus:
        if self._nvml is None:
            try:
                self._nvml = _load_pynvml()
            except ImportError as exc:  # a broken install, not a missing driver
                return NvmlStatus(available=False, error=f"nvidia-ml-py is not importable: {exc}")
        nv = self._nvml
        try:
            nv.nvmlInit()
        except nv.NVMLError as exc:
            return NvmlStatus(available=False, error=_message(nv, exc), error_code=_code(exc))
        except OSError as exc:  # ctypes failing below pynvml's own checks
            return NvmlStatus(available=False, error=str(exc))
        self._initialised = True
        self._static.clear()
        return NvmlStatus(
            available=True,
            driver_version=_optional(nv, nv.nvmlSystemGetDriverVersion),
            nvml_version=_optional(nv, nv.nvmlSystemGetNVMLVersion),
            cuda_driver_version=_cuda_version(_optional(nv, nv.nvmlSystemGetCudaDriverVersion)),
        )

    def close(self) -> None:
        if self._initialised and self._nvml is not None:
            with contextlib.suppress(self._nvml.NVMLError):
                self._nvml.nvmlShutdown()
        self._initialised = False
        self._static.clear()

    @property
    def status(self) -> NvmlStatus:
        return self._status

    # -- one poll --------------------------------------------------------------------------
    def read(self) -> NvmlReading:
        self.carried = {}
        now = self._clock()
        if not self._initialised and now < self.backoff.next_try:
            return NvmlReading(status=self._status)
        errors: list[SourceError] = []
        # A second attempt only after the first count failure since a good read: initialising
        # again at once turns a transient fault into one error, not a poll without NVML.
        for retry in (False, True):
            if not self._initialised:
                self._status = self._init()
                if not self._initialised:
                    self._status = self._with_device_files(self._status)
                    errors.append(SourceError("nvml", self._status.message))
                    self.backoff.failed(now)
                    return NvmlReading(status=self._status, errors=tuple(errors))
            nv = self._nvml
            try:
                count = nv.nvmlDeviceGetCount()
            except nv.NVMLError as exc:
                errors.append(self._lost_library(exc))
                if not retry and self.backoff.failures == 0:
                    continue
                self.backoff.failed(now)
                return NvmlReading(status=self._status, errors=tuple(errors))
            break
        self.backoff.succeeded()
        gpus = tuple(self._read_device(i) for i in range(count))
        for index in [i for i in self._holders if i >= count]:
            del self._holders[index]
        self._status = _with_count(self._status, count)
        errors += [SourceError("nvml", f"GPU {g.index}: {e}") for g in gpus for e in g.errors]
        return NvmlReading(status=self._status, gpus=gpus, errors=tuple(errors))

    def _lost_library(self, exc: Exception) -> SourceError:
        """The device count failed: whatever the code, the library is suspect. It is shut down,
        so that the next attempt initialises it again, and NVML is unavailable until then."""
        nv = self._nvml
        self._status = self._with_device_files(
            NvmlStatus(available=False, error=_message(nv, exc), error_code=_code(exc)))
        self.close()
        return SourceError("nvml", f"nvmlDeviceGetCount: {self._status.error} "
                                   "(NVML shut down to be initialised again)")

    def _with_device_files(self, status: NvmlStatus) -> NvmlStatus:
        return replace(status, device_files=count_nvidia_device_files(self.dev_dir))

    def _static_info(self, index: int, errors: list[NvmlCallError]) -> Optional[_StaticInfo]:
        info = self._static.get(index)
        if info is not None:
            return info
        nv = self._nvml
        try:
            handle = nv.nvmlDeviceGetHandleByIndex(index)
        except nv.NVMLError as exc:
            errors.append(_call_error(nv, "nvmlDeviceGetHandleByIndex", exc))
            return None
        calls: list[NvmlCallError] = []
        uuid = _call(nv, calls, "nvmlDeviceGetUUID", nv.nvmlDeviceGetUUID, handle)
        name = _call(nv, calls, "nvmlDeviceGetName", nv.nvmlDeviceGetName, handle)
        pci = _call(nv, calls, "nvmlDeviceGetPciInfo", nv.nvmlDeviceGetPciInfo, handle)
        mig = _optional(nv, nv.nvmlDeviceGetMigMode, handle)
        info = _StaticInfo(
            handle=handle,
            uuid=uuid,
            name=name,
            pci_bus_id=_text(pci.busId) if pci is not None else None,
            mig_enabled=bool(mig[0]) if mig is not None else None,
        )
        errors.extend(calls)
        if not calls:  # cache only a complete read, so a flaky device is asked again
            self._static[index] = info
        return info

    def _read_device(self, index: int) -> GpuDevice:
        nv = self._nvml
        errors: list[NvmlCallError] = []
        info = self._static_info(index, errors)
        if info is None:
            # No handle, so no process list either: its last holders are carried, unknown.
            processes = self._carry(index, None, {}, frozenset({COMPUTE, GRAPHICS}))
            return GpuDevice(index=index, processes=processes, errors=tuple(errors),
                             lost=_is_lost(nv, errors))
        handle = info.handle
        memory = self._memory(handle, errors)
        util = _call(nv, errors, "nvmlDeviceGetUtilizationRates",
                     nv.nvmlDeviceGetUtilizationRates, handle)
        processes = self._processes(index, info.uuid, handle, errors)
        if errors:
            self._static.pop(index, None)
        total, used, free, reserved = memory if memory is not None else (None,) * 4
        return GpuDevice(
            index=index,
            uuid=info.uuid,
            name=info.name,
            pci_bus_id=info.pci_bus_id,
            memory_total_bytes=total,
            memory_used_bytes=used,
            memory_free_bytes=free,
            memory_reserved_bytes=reserved,
            utilization_gpu_percent=util.gpu if util is not None else None,
            utilization_memory_percent=util.memory if util is not None else None,
            mig_enabled=info.mig_enabled,
            processes=processes,
            errors=tuple(errors),
            lost=_is_lost(nv, errors),
        )

    def _memory(self, handle: Any, errors: list[NvmlCallError]
                ) -> Optional[tuple[int, int, int, Optional[int]]]:
        """(total, used, free, reserved); v2 separates driver reservations from used memory."""
        nv = self._nvml
        version = getattr(nv, "nvmlMemory_v2", None)
        if version is not None:
            try:
                m = nv.nvmlDeviceGetMemoryInfo(handle, version=version)
                return int(m.total), int(m.used), int(m.free), int(m.reserved)
            except nv.NVMLError as exc:
                # Drivers before R510 lack the v2 call; anything else is a real failure.
                if _code(exc) not in (nv.NVML_ERROR_FUNCTION_NOT_FOUND, nv.NVML_ERROR_NOT_SUPPORTED,
                                      getattr(nv, "NVML_ERROR_ARGUMENT_VERSION_MISMATCH", -1)):
                    errors.append(_call_error(nv, "nvmlDeviceGetMemoryInfo_v2", exc))
                    return None
        m = _call(nv, errors, "nvmlDeviceGetMemoryInfo", nv.nvmlDeviceGetMemoryInfo, handle)
        if m is None:
            return None
        return int(m.total), int(m.used), int(m.free), None

    def _processes(self, index: int, uuid: Optional[str], handle: Any,
                   errors: list[NvmlCallError]) -> tuple[GpuProcessUsage, ...]:
        """Compute and graphics lists merged: a PID in both appears once, with both kinds.

        When a list cannot be read, the holders of that kind at the GPU's last good read are
        carried over with unknown figures: an unreadable list says nothing about who holds
        memory, and must not read as "nobody".
        """
        nv = self._nvml
        merged: dict[tuple[int, Optional[int], Optional[int]], GpuProcessUsage] = {}
        unread: set[str] = set()
        lists: list[tuple[str, list[tuple[int, Optional[int], Any, Any]]]] = []
        for kind, fn_name in ((COMPUTE, "nvmlDeviceGetComputeRunningProcesses"),
                              (GRAPHICS, "nvmlDeviceGetGraphicsRunningProcesses")):
            try:
                lists.append((kind, self._list(index, kind, fn_name, handle)))
            except _errors(nv) as exc:
                errors.append(_call_error(nv, fn_name, exc))
                unread.add(kind)
        answer = (uuid, lists)
        if not unread:
            last = self._listed.get(index)
            if last is not None and last[0] == answer:
                self._holders[index] = (uuid, last[1])
                return last[1]
        for kind, listed in lists:
            for pid, used, gi_raw, ci_raw in listed:
                gi = _instance(gi_raw)
                ci = _instance(ci_raw)
                key = (pid, gi, ci)
                seen = merged.get(key)
                if seen is not None:
                    # The two lists report the same per-process figure; keep a known one.
                    memory = seen.memory_bytes if seen.memory_bytes is not None else used
                    merged[key] = GpuProcessUsage(index, uuid, key[0], memory,
                                                  seen.kinds | {kind}, gi, ci)
                else:
                    merged[key] = GpuProcessUsage(index, uuid, key[0],
                                                  int(used) if used is not None else None,
                                                  frozenset({kind}), gi, ci)
        if unread:
            self._listed.pop(index, None)
            return self._carry(index, uuid, merged, frozenset(unread))
        found = tuple(sorted(merged.values(), key=lambda u: (u.pid, u.gpu_instance_id or 0)))
        self._holders[index] = (uuid, found)
        self._listed[index] = (answer, found)
        return found

    def _list(self, index: int, kind: str, fn_name: str, handle: Any
              ) -> list[tuple[int, Optional[int], Any, Any]]:
        """One process list: (PID, used memory or None, GPU instance, compute instance) each.

        With nvidia-ml-py, its own entry point and entry layout, called into an array kept from
        the last call: pynvml asks for the count first, then turns every entry into an object
        attribute by attribute, which costs a poll more than NVML's answer does. Any other
        bindings (or an NVML without the entry point) are called as they are, errors and all.
        """
        nv = self._nvml
        entry = self._entry_type(nv)
        fn = None
        if entry is not None:
            try:
                fn = nv._nvmlGetFunctionPointer(fn_name + "_v3")
            except nv.NVMLError:
                fn = None  # the bindings' own call raises what this NVML raises for it
        if fn is None:
            return [(int(p.pid), p.usedGpuMemory, getattr(p, "gpuInstanceId", None),
                     getattr(p, "computeInstanceId", None))
                    for p in getattr(nv, fn_name)(handle) or ()]
        buffer = self._buffers.get((index, kind))
        count = ctypes.c_uint(len(buffer) if buffer is not None else 0)
        for _ in range(4):
            ret = fn(handle, ctypes.byref(count), buffer)
            if ret == nv.NVML_SUCCESS:
                break
            if ret != nv.NVML_ERROR_INSUFFICIENT_SIZE:
                raise nv.NVMLError(ret)
            # Room for more than asked, as pynvml leaves: processes start between two calls.
            buffer = (entry * (count.value * 2 + 5))()
            self._buffers[(index, kind)] = buffer
            count.value = len(buffer)
        else:
            raise nv.NVMLError(nv.NVML_ERROR_INSUFFICIENT_SIZE)
        if buffer is None or not count.value:
            return []
        na = _NOT_AVAILABLE
        return [(e.pid, None if e.usedGpuMemory == na else e.usedGpuMemory,
                 e.gpuInstanceId, e.computeInstanceId)
                for e in buffer[:count.value]]

    def _entry_type(self, nv: Any) -> Optional[type[ctypes.Structure]]:
        """pynvml's process entry layout, as a plain structure (pynvml's own class converts
        every field it is asked for); None for bindings that are not nvidia-ml-py."""
        if self._entry is None:
            layout = getattr(nv, "c_nvmlProcessInfo_v3_t", None)
            if layout is None or not hasattr(nv, "_nvmlGetFunctionPointer"):
                return None
            self._entry = type("ProcessInfo", (ctypes.Structure,),
                               {"_fields_": list(layout._fields_)})
        return self._entry

    def _carry(self, index: int, uuid: Optional[str],
               merged: dict[tuple[int, Optional[int], Optional[int]], GpuProcessUsage],
               unread: frozenset[str]) -> tuple[GpuProcessUsage, ...]:
        """What was listed (`merged`) and, for the kinds of list in `unread`, the holders of the
        GPU's last good read that are not listed, with unknown figures. Not when the GPU is
        another one now (its UUID changed): those holders were another GPU's."""
        last_uuid, last = self._holders.get(index, (None, ()))
        if uuid is not None and last_uuid is not None and uuid != last_uuid:
            self._holders.pop(index, None)
            last = ()
        carried = set()
        for u in last:
            key = (u.pid, u.gpu_instance_id, u.compute_instance_id)
            if key in merged or not (u.kinds & unread):
                continue
            merged[key] = replace(u, memory_bytes=None)
            carried.add(u.pid)
        if carried:
            self.carried[index] = frozenset(carried)
        return tuple(sorted(merged.values(), key=lambda u: (u.pid, u.gpu_instance_id or 0)))


# -- helpers ---------------------------------------------------------------------------------
def _errors(nv: Any) -> tuple[type[Exception], ...]:
    """What a call of the bindings raises when NVML fails it. For an unversioned process-list
    call that the library lacks, pynvml raises NVMLLibraryMismatchError, not an NVMLError (an
    older driver, or NVML_ERROR_FUNCTION_NOT_FOUND): a failed call all the same."""
    mismatch = getattr(nv, "NVMLLibraryMismatchError", None)
    return (nv.NVMLError, mismatch) if isinstance(mismatch, type) else (nv.NVMLError,)


def _code(exc: Exception) -> int:
    if type(exc).__name__ == "NVMLLibraryMismatchError":
        return FUNCTION_NOT_FOUND  # which pynvml turned into this exception
    return int(getattr(exc, "value", -1))


def _message(nv: Any, exc: Exception) -> str:
    try:
        return str(nv.nvmlErrorString(_code(exc)))
    except Exception:  # the library itself may be what failed
        return str(exc)


def _call_error(nv: Any, call: str, exc: Exception) -> NvmlCallError:
    return NvmlCallError(call=call, code=_code(exc), message=_message(nv, exc))


def _call(nv: Any, errors: list[NvmlCallError], name: str, fn: Callable[..., Any], *args: Any
          ) -> Any:
    try:
        return fn(*args)
    except _errors(nv) as exc:
        errors.append(_call_error(nv, name, exc))
        return None


def _optional(nv: Any, fn: Callable[..., Any], *args: Any) -> Any:
    """A call whose absence is normal on some GPUs or drivers: failures are not errors."""
    try:
        value = fn(*args)
    except nv.NVMLError:
        return None
    return _text(value) if isinstance(value, bytes) else value


def _text(value: Any) -> str:
    return value.decode(errors="replace") if isinstance(value, bytes) else str(value)


def _cuda_version(raw: Optional[int]) -> Optional[str]:
    if not raw:
        return None
    return f"{raw // 1000}.{(raw % 1000) // 10}"


def _instance(value: Optional[int]) -> Optional[int]:
    if value is None or value == _NO_INSTANCE:
        return None
    return int(value)


def _is_lost(nv: Any, errors: list[NvmlCallError]) -> bool:
    """GPU_IS_LOST or RESET_REQUIRED: the device needs a reset; nothing it says is trustworthy."""
    lost_codes = {nv.NVML_ERROR_GPU_IS_LOST, getattr(nv, "NVML_ERROR_RESET_REQUIRED", -1)}
    return any(e.code in lost_codes for e in errors)


def _with_count(status: NvmlStatus, count: int) -> NvmlStatus:
    return status if status.device_count == count else replace(status, device_count=count)
