"""A simulated GPU node: the fake NVML driver (fake_nvml.c) and the state file that drives it.

The fake is a real shared library named ``libnvidia-ml.so.1``; unmodified NVML clients (pynvml,
gpustat, nvitop, gpuwatch itself) load it through ``LD_LIBRARY_PATH``. What it reports comes from
a line-based state file named by ``GPUWATCH_FAKE_NVML_STATE``, which :class:`FakeNode` writes::

    node = FakeNode(tmp / "state", build_fake_nvml())
    node.write()
    node.hold(pid=child.pid, device=0, used=2 << 30)
    subprocess.run(["gpustat", "--json"], env=node.env())

The library re-reads the file whenever it changes, so a running client sees every update
without re-initialising. The file format is documented at the top of fake_nvml.c.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shlex
import shutil
import subprocess
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from gpuwatch.nvml_codes import (
    ALREADY_INITIALIZED,
    ARGUMENT_VERSION_MISMATCH,
    DRIVER_NOT_LOADED,
    FUNCTION_NOT_FOUND,
    GPU_IS_LOST,
    INSUFFICIENT_SIZE,
    INVALID_ARGUMENT,
    IRQ_ISSUE,
    LIBRARY_NOT_FOUND,
    NO_PERMISSION,
    NOT_FOUND,
    NOT_SUPPORTED,
    RESET_REQUIRED,
    SUCCESS,
    TIMEOUT,
    UNINITIALIZED,
    UNKNOWN,
)

__all__ = [
    "ALREADY_INITIALIZED",
    "ARGUMENT_VERSION_MISMATCH",
    "CFLAGS",
    "DRIVER_NOT_LOADED",
    "FUNCTION_NOT_FOUND",
    "GPU_IS_LOST",
    "INSUFFICIENT_SIZE",
    "INVALID_ARGUMENT",
    "IRQ_ISSUE",
    "LIBRARY_NOT_FOUND",
    "LIB_NAME",
    "NOT_FOUND",
    "NOT_SUPPORTED",
    "NO_PERMISSION",
    "RESET_REQUIRED",
    "STATE_ENV",
    "SUCCESS",
    "TIMEOUT",
    "UNINITIALIZED",
    "UNKNOWN",
    "VALUE_NOT_AVAILABLE",
    "FakeDevice",
    "FakeFailure",
    "FakeNode",
    "FakeNvmlBuildError",
    "FakeProcess",
    "build_fake_nvml",
]

#: NVML_VALUE_NOT_AVAILABLE as an unsigned long long (what ``used=na`` reports).
VALUE_NOT_AVAILABLE = 0xFFFF_FFFF_FFFF_FFFF
#: Instance id meaning "no MIG instance".
NO_INSTANCE = 0xFFFF_FFFF

LIB_NAME = "libnvidia-ml.so.1"
STATE_ENV = "GPUWATCH_FAKE_NVML_STATE"

_HERE = Path(__file__).resolve().parent
_SOURCE = _HERE / "fake_nvml.c"
_SYMBOLS = _HERE / "fake_nvml_symbols.h"
_HASH_FILE = "fake-nvml.source-sha256"

#: Compiler flags; -Werror is left out so that a newer compiler's new warnings on a user's
#: machine do not stop the demo (the test suite compiles with -Werror).
CFLAGS = ("-O2", "-Wall", "-Wextra", "-shared", "-fPIC", "-pthread", f"-Wl,-soname,{LIB_NAME}")

# PCI bus numbers of the eight GPUs in a DGX H100, so simulated nodes look familiar.
_DGX_BUSES = (0x18, 0x2A, 0x3A, 0x5D, 0x9A, 0xAB, 0xBA, 0xDB)
_UUID_NAMESPACE = uuid.UUID("6f1c3c1e-8a41-4f0b-9a55-2f5b8f0c7d10")


class FakeNvmlBuildError(RuntimeError):
    """The fake NVML library could not be compiled."""


# ---- build ---------------------------------------------------------------------------------------


def _find_compiler() -> list[str]:
    cc = os.environ.get("CC", "").strip()
    if cc:
        argv = shlex.split(cc)
        if shutil.which(argv[0]):
            return argv
    for name in ("cc", "gcc", "clang"):
        path = shutil.which(name)
        if path:
            return [path]
    raise FakeNvmlBuildError(
        "no C compiler found (looked for $CC, cc, gcc, clang); "
        "install gcc to use the simulated node"
    )


def _symbols_header() -> str:
    """The stub list; regenerated from the installed pynvml when the packaged copy is missing."""
    if _SYMBOLS.exists():
        return _SYMBOLS.read_text(encoding="utf-8")
    from gpuwatch.simulate import gen_stub_symbols

    try:
        return gen_stub_symbols.generate()
    except (SystemExit, OSError) as exc:
        raise FakeNvmlBuildError(
            f"{_SYMBOLS.name} is missing and cannot be regenerated: {exc}"
        ) from exc


def _default_cache_root() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpuwatch" / "fake-nvml"


def _compile(compiler: list[str], source: str, header: str, dest: Path, digest: str) -> None:
    with tempfile.TemporaryDirectory(prefix=".fake-nvml-build-", dir=dest) as work:
        work_dir = Path(work)
        (work_dir / _SOURCE.name).write_text(source, encoding="utf-8")
        (work_dir / _SYMBOLS.name).write_text(header, encoding="utf-8")
        out = work_dir / LIB_NAME
        cmd = [*compiler, *CFLAGS, "-o", str(out), str(work_dir / _SOURCE.name)]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, check=False)
        except OSError as exc:
            raise FakeNvmlBuildError(f"cannot run {compiler[0]}: {exc}") from exc
        if proc.returncode != 0:
            raise FakeNvmlBuildError(
                f"compiling the fake NVML library failed ({shlex.join(cmd)}):\n{proc.stderr}"
            )
        # Replacing (not rewriting) the file keeps processes that already mapped an older
        # build working; the stamp goes last so that it never vouches for a missing library.
        os.replace(out, dest / LIB_NAME)
        stamp_tmp = work_dir / _HASH_FILE
        stamp_tmp.write_text(digest + "\n", encoding="utf-8")
        os.replace(stamp_tmp, dest / _HASH_FILE)


def build_fake_nvml(dest_dir: Path | None = None) -> Path:
    """Compile the fake driver and return the DIRECTORY holding ``libnvidia-ml.so.1``.

    The default destination is ``${XDG_CACHE_HOME:-~/.cache}/gpuwatch/fake-nvml/<source-hash>/``.
    A build from the same sources is reused. The library is compiled under a temporary name and
    renamed into place, so concurrent builders never see (or load) a half-written file.
    """
    source = _SOURCE.read_text(encoding="utf-8")
    header = _symbols_header()
    digest = hashlib.sha256(
        "\0".join((source, header, " ".join(CFLAGS))).encode("utf-8")
    ).hexdigest()

    dest = Path(dest_dir) if dest_dir is not None else _default_cache_root() / digest[:16]
    lib = dest / LIB_NAME
    stamp = dest / _HASH_FILE
    try:
        if lib.is_file() and stamp.read_text(encoding="utf-8").strip() == digest:
            return dest
    except OSError:
        pass

    compiler = _find_compiler()
    try:
        dest.mkdir(parents=True, exist_ok=True)
        _compile(compiler, source, header, dest, digest)
    except OSError as exc:
        raise FakeNvmlBuildError(f"cannot build the fake NVML library in {dest}: {exc}") from exc
    # Some loaders ask for the unversioned development name.
    dev_link = dest / "libnvidia-ml.so"
    if not dev_link.exists():
        with contextlib.suppress(OSError):
            dev_link.symlink_to(LIB_NAME)
    return dest


# ---- state ---------------------------------------------------------------------------------------


@dataclass
class FakeDevice:
    index: int
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    total: int = 85520809984
    #: Memory the driver and firmware set aside (nvmlMemory_v2_t.reserved).
    reserved: int = 0
    #: Memory in use that no listed process accounts for.
    unattributed: int = 0
    util_gpu: int = 0
    util_mem: int = 0
    pci_bus_id: str = ""
    #: None: not MIG-capable (nvmlDeviceGetMigMode answers NOT_SUPPORTED).
    mig: bool | None = None


@dataclass
class FakeProcess:
    device: int
    pid: int
    #: Bytes; None is reported as NVML_VALUE_NOT_AVAILABLE.
    used: int | None
    #: "compute", "graphics" or "compute+graphics".
    type: str = "compute"
    #: Listed even though the PID does not exist.
    ghost: bool = False
    gpu_instance_id: int | None = None
    compute_instance_id: int | None = None


@dataclass
class FakeFailure:
    #: An exported NVML symbol, "*" for every call, or "prefix*".
    symbol: str
    error: int
    #: Only calls aimed at this device index fail; None: every call of that symbol.
    device: int | None = None
    #: Only the first N matching calls fail (in each process using the library), later ones
    #: succeed: a transient fault. None: every matching call fails.
    times: int | None = None


_PLAIN = frozenset("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789-_.:+*/")


def _quote(value: object) -> str:
    text = str(value)
    if text and all(ch in _PLAIN for ch in text):
        return text
    if "\n" in text or "\r" in text:
        raise ValueError(f"state values cannot contain line breaks: {text!r}")
    return '"' + text.replace("\\", "\\\\").replace('"', '\\"') + '"'


def default_uuid(index: int) -> str:
    """A stable, realistic-looking GPU UUID for simulated device ``index``."""
    return f"GPU-{uuid.uuid5(_UUID_NAMESPACE, f'gpuwatch-fake-gpu-{index}')}"


def default_pci_bus_id(index: int) -> str:
    bus = _DGX_BUSES[index] if index < len(_DGX_BUSES) else 0xE0 + index - len(_DGX_BUSES)
    return f"00000000:{bus:02X}:00.0"


class FakeNode:
    """The state of a simulated GPU node; write() renders the state file atomically."""

    def __init__(
        self,
        state_path: Path,
        lib_dir: Path,
        gpus: int = 2,
        driver_version: str = "550.54.15",
        nvml_version: str = "12.550.54.15",
        cuda_version: int = 12040,
        name: str = "NVIDIA H100 80GB HBM3",
        total: int = 85520809984,
    ) -> None:
        self.state_path = Path(state_path)
        self.lib_dir = Path(lib_dir)
        self.driver_version = driver_version
        self.nvml_version = nvml_version
        self.cuda_version = cuda_version
        self.devices: list[FakeDevice] = [
            FakeDevice(
                index=i,
                uuid=default_uuid(i),
                name=name,
                total=total,
                pci_bus_id=default_pci_bus_id(i),
            )
            for i in range(gpus)
        ]
        self.processes: list[FakeProcess] = []
        self.failures: list[FakeFailure] = []
        self._last_mtime_ns = 0
        self._writes = 0

    # -- mutation (each writes the file) --

    def hold(
        self,
        pid: int,
        device: int,
        used: int | None,
        type: str = "compute",
        ghost: bool = False,
        *,
        gpu_instance_id: int | None = None,
        compute_instance_id: int | None = None,
    ) -> None:
        """Make ``pid`` hold ``used`` bytes on ``device`` (replacing an earlier entry)."""
        self.processes = [p for p in self.processes if (p.pid, p.device) != (pid, device)]
        self.processes.append(
            FakeProcess(
                device=device,
                pid=pid,
                used=used,
                type=type,
                ghost=ghost,
                gpu_instance_id=gpu_instance_id,
                compute_instance_id=compute_instance_id,
            )
        )
        self.write()

    def release(self, pid: int, device: int | None = None) -> None:
        """Drop ``pid``'s entries (on one device, or on all)."""
        self.processes = [
            p for p in self.processes if not (p.pid == pid and device in (None, p.device))
        ]
        self.write()

    def fail(self, symbol: str, error: int, device: int | None = None,
             times: int | None = None) -> None:
        """Make ``symbol`` (or "*", or "prefix*") return ``error``, optionally on one device.

        With ``times``, only the next ``times`` matching calls fail, then calls succeed again
        (counted in each process that uses the library; later writes of the state file do not
        re-arm it). Without, every matching call fails until ``clear_failures()``.
        """
        if times is not None and times < 1:
            raise ValueError(f"times must be at least 1, not {times}")
        self.failures.append(FakeFailure(symbol=symbol, error=error, device=device, times=times))
        self.write()

    def clear_failures(self) -> None:
        self.failures = []
        self.write()

    # -- rendering --

    def render(self) -> str:
        out = [
            "# gpuwatch fake NVML state; format: see gpuwatch/simulate/fake_nvml.c",
            f"driver_version {_quote(self.driver_version)}",
            f"nvml_version {_quote(self.nvml_version)}",
            f"cuda_version {int(self.cuda_version)}",
        ]
        for d in self.devices:
            fields = [
                f"index={int(d.index)}",
                f"uuid={_quote(d.uuid)}",
                f"name={_quote(d.name)}",
                f"total={int(d.total)}",
                f"reserved={int(d.reserved)}",
                f"unattributed={int(d.unattributed)}",
                f"util_gpu={int(d.util_gpu)}",
                f"util_mem={int(d.util_mem)}",
            ]
            if d.pci_bus_id:
                fields.append(f"pci_bus_id={_quote(d.pci_bus_id)}")
            if d.mig is not None:
                fields.append(f"mig={int(bool(d.mig))}")
            out.append("device " + " ".join(fields))
        for p in self.processes:
            fields = [
                f"device={int(p.device)}",
                f"pid={int(p.pid)}",
                "used=na" if p.used is None else f"used={int(p.used)}",
                f"type={_quote(p.type)}",
            ]
            if p.ghost:
                fields.append("ghost=1")
            if p.gpu_instance_id is not None:
                fields.append(f"gi={int(p.gpu_instance_id)}")
            if p.compute_instance_id is not None:
                fields.append(f"ci={int(p.compute_instance_id)}")
            out.append("process " + " ".join(fields))
        for f in self.failures:
            fields = [f"symbol={_quote(f.symbol)}", f"error={int(f.error)}"]
            if f.device is not None:
                fields.append(f"device={int(f.device)}")
            if f.times is not None:
                fields.append(f"times={int(f.times)}")
            out.append("fail " + " ".join(fields))
        return "\n".join(out) + "\n"

    def write(self) -> None:
        """Replace the state file atomically (temporary file + rename)."""
        text = self.render()
        self.state_path.parent.mkdir(parents=True, exist_ok=True)
        self._writes += 1
        tmp = self.state_path.with_name(f".{self.state_path.name}.{os.getpid()}.{self._writes}.tmp")
        tmp.write_text(text, encoding="utf-8")
        # The library notices changes by (inode, size, mtime, ctime). A freed inode can be reused
        # at once and file times only advance once per kernel tick, so two quick writes of the
        # same size could otherwise look identical: make every write's mtime strictly newer.
        mtime_ns = max(time.time_ns(), self._last_mtime_ns + 1)
        os.utime(tmp, ns=(mtime_ns, mtime_ns))
        self._last_mtime_ns = mtime_ns
        os.replace(tmp, self.state_path)

    def env(self, base: Mapping[str, str] | None = None) -> dict[str, str]:
        """An environment in which NVML clients load the fake and read this node's state."""
        env = dict(os.environ if base is None else base)
        previous = env.get("LD_LIBRARY_PATH")
        env["LD_LIBRARY_PATH"] = f"{self.lib_dir}:{previous}" if previous else str(self.lib_dir)
        env[STATE_ENV] = str(self.state_path)
        return env
