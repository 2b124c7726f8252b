"""A wall clock that steps for chosen processes only (clockjump.c), and the offset that steps it.

For tests and bench/chaos.py: an NTP step or `date -s` would move the clock of every process on
the machine. Processes started with `ClockJump.env()` see their wall clock moved by `set(seconds)`
at once; their monotonic and boot-time clocks, and everybody else's clocks, do not move.
"""

from __future__ import annotations

import contextlib
import ctypes
import mmap
import os
import struct
import subprocess
from pathlib import Path
from types import TracebackType
from typing import Optional

from gpuwatch.simulate.fakenvml import FakeNvmlBuildError, _find_compiler

_SOURCE = Path(__file__).with_name("clockjump.c")
LIB_NAME = "libclockjump.so"
OFFSET_ENV = "GPUWATCH_CLOCK_OFFSET_FILE"


def build_clockjump(dest_dir: Path) -> Path:
    """Compile the library into `dest_dir` and return its path."""
    lib = dest_dir / LIB_NAME
    cmd = [*_find_compiler(), "-O2", "-Wall", "-shared", "-fPIC", "-o", str(lib), str(_SOURCE),
           "-ldl"]
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, check=False, timeout=120)
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise FakeNvmlBuildError(f"cannot run {cmd[0]}: {exc}") from exc
    if proc.returncode != 0:
        raise FakeNvmlBuildError(f"compiling {_SOURCE.name} failed:\n{proc.stderr}")
    return lib


class ClockJump:
    """The library and its offset file in `work_dir`; a context manager that unmaps the file."""

    def __init__(self, work_dir: Path) -> None:
        self.library = build_clockjump(work_dir)
        self.offset_file = work_dir / "clock-offset"
        self.offset_file.write_bytes(struct.pack("=q", 0))
        fd = os.open(self.offset_file, os.O_RDWR)
        try:
            self._map: Optional[mmap.mmap] = mmap.mmap(fd, 8)
        finally:
            os.close(fd)
        # One aligned 8-byte store: the library reads the new offset whole, never half of it.
        self._offset: Optional[ctypes.c_int64] = ctypes.c_int64.from_buffer(self._map)

    def env(self) -> dict[str, str]:
        """What to add to a process's environment for its clock to follow `set`."""
        return {"LD_PRELOAD": str(self.library), OFFSET_ENV: str(self.offset_file)}

    def set(self, seconds: float) -> None:
        """Move those processes' wall clock `seconds` from the real one (0: back to it)."""
        if self._offset is None:
            raise ValueError("the clock offset file is closed")
        self._offset.value = int(seconds * 1e9)

    def close(self) -> None:
        self._offset = None
        if self._map is not None:
            with contextlib.suppress(BufferError):
                self._map.close()
            self._map = None

    def __enter__(self) -> ClockJump:
        return self

    def __exit__(self, exc_type: Optional[type[BaseException]],
                 exc: Optional[BaseException], tb: Optional[TracebackType]) -> None:
        self.close()
