"""Memory limits from cgroup files and /proc/meminfo: what a leak's out-of-memory point is
measured against."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path

import pytest

from gpuwatch.sources.memory import (
    KEPT_CGROUP_FILES,
    CgroupMemory,
    NodeMemory,
    read_mem_available,
)


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_v2_limit_and_usage_are_read_and_max_means_no_limit(tmp_path: Path) -> None:
    _write(tmp_path / "job.slice/a/memory.max", "8589934592\n")
    _write(tmp_path / "job.slice/a/memory.current", "1048576\n")
    _write(tmp_path / "job.slice/b/memory.max", "max\n")
    _write(tmp_path / "job.slice/b/memory.current", "4096\n")
    found = CgroupMemory(str(tmp_path)).read(["/job.slice/a", "/job.slice/b"])
    assert found == {"/job.slice/a": (8 << 30, 1 << 20), "/job.slice/b": (None, 4096)}


def test_v1_memory_controller_is_the_fallback_and_its_huge_limit_means_none(
        tmp_path: Path) -> None:
    _write(tmp_path / "memory/docker/c1/memory.usage_in_bytes", "2048\n")
    _write(tmp_path / "memory/docker/c1/memory.limit_in_bytes", "9223372036854771712\n")
    _write(tmp_path / "memory/docker/c2/memory.usage_in_bytes", "4096\n")
    _write(tmp_path / "memory/docker/c2/memory.limit_in_bytes", "1073741824\n")
    found = CgroupMemory(str(tmp_path) + "/").read(["/docker/c1", "/docker/c2"])
    assert found == {"/docker/c1": (None, 2048), "/docker/c2": (1 << 30, 4096)}


def test_a_cgroup_without_readable_figures_is_left_out(tmp_path: Path) -> None:
    _write(tmp_path / "gone/memory.max", "max\n")  # no memory.current: controller not enabled
    _write(tmp_path / "garbled/memory.current", "lots\n")
    assert CgroupMemory(str(tmp_path)).read(["/gone", "/garbled", "/never"]) == {}


def test_mem_available_is_read_wherever_its_line_is(tmp_path: Path) -> None:
    _write(tmp_path / "meminfo",
           "MemTotal:       32768000 kB\nMemFree:  100 kB\nMemAvailable:   24366828 kB\n")
    assert read_mem_available(str(tmp_path)) == 24366828 * 1024
    _write(tmp_path / "meminfo", "MemAvailable: 5 kB\nMemTotal: 10 kB\n")
    assert read_mem_available(str(tmp_path)) == 5 * 1024


def test_mem_available_is_none_on_an_old_kernel_or_a_hidden_meminfo(tmp_path: Path) -> None:
    _write(tmp_path / "meminfo", "MemTotal: 10 kB\nMemFree: 5 kB\nMemAvailableX: 3 kB\n")
    assert read_mem_available(str(tmp_path)) is None
    assert read_mem_available(str(tmp_path / "absent")) is None


def test_this_machines_figures_are_positive() -> None:
    available = read_mem_available()
    assert available is not None and available > 0


def _open_under(directory: Path) -> list[str]:
    """The files under `directory` this process has open."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            target = os.readlink(f"/proc/self/fd/{fd}")
            if target.startswith(f"{directory}/"):
                found.append(target)
    return found


def test_a_cgroups_figures_are_read_afresh_and_its_files_closed_once_it_is_not_asked_for(
        tmp_path: Path) -> None:
    _write(tmp_path / "job.slice/a/memory.max", "max\n")
    _write(tmp_path / "job.slice/a/memory.current", "4096\n")
    cgroups = CgroupMemory(str(tmp_path))
    assert cgroups.read(["/job.slice/a"]) == {"/job.slice/a": (None, 4096)}
    assert len(_open_under(tmp_path)) == 2  # kept for the next poll
    (tmp_path / "job.slice/a/memory.current").write_text("8192\n")
    (tmp_path / "job.slice/a/memory.max").write_text("65536\n")
    assert cgroups.read(["/job.slice/a"]) == {"/job.slice/a": (65536, 8192)}
    assert cgroups.read([]) == {}
    assert _open_under(tmp_path) == []
    cgroups.close()


def test_no_more_cgroup_files_are_kept_open_than_the_bound(tmp_path: Path) -> None:
    paths = [f"/c{i}" for i in range(KEPT_CGROUP_FILES)]  # two files each: twice the bound
    for path in paths:
        _write(tmp_path / path.lstrip("/") / "memory.max", "max\n")
        _write(tmp_path / path.lstrip("/") / "memory.current", f"{len(path)}\n")
    cgroups = CgroupMemory(str(tmp_path))
    for _ in range(2):
        found = cgroups.read(paths)
        assert found == {path: (None, len(path)) for path in paths}
        assert len(_open_under(tmp_path)) == KEPT_CGROUP_FILES
    cgroups.close()
    assert _open_under(tmp_path) == []


_V1_MEMORY = Path("/sys/fs/cgroup/memory")


@pytest.mark.skipif(not os.access(_V1_MEMORY, os.W_OK),
                    reason="needs cgroup v1's memory controller, writable (root)")
def test_a_real_cgroup_removed_and_made_again_under_its_path_is_read_afresh() -> None:
    """The kernel answers a descriptor kept on a removed cgroup's file with ENODEV: the path is
    opened again, and the new cgroup's figures read, not the old one's."""
    name = f"gpuwatch-test-{os.getpid()}"
    directory = _V1_MEMORY / name
    directory.mkdir()
    cgroups = CgroupMemory()
    try:
        limit, usage = cgroups.read([f"/{name}"])[f"/{name}"]
        assert limit is None and usage >= 0
        directory.rmdir()
        directory.mkdir()
        (directory / "memory.limit_in_bytes").write_text(str(256 << 20))
        assert cgroups.read([f"/{name}"])[f"/{name}"][0] == 256 << 20
    finally:
        cgroups.close()
        with contextlib.suppress(OSError):
            directory.rmdir()


def test_mem_available_is_read_again_through_the_kept_file(tmp_path: Path) -> None:
    _write(tmp_path / "meminfo", "MemTotal: 10 kB\nMemAvailable: 5 kB\n")
    node = NodeMemory(str(tmp_path))
    assert node.available() == 5 * 1024
    (tmp_path / "meminfo").write_text("MemTotal: 10 kB\nMemAvailable: 7 kB\n")
    assert node.available() == 7 * 1024
    node.close()
    assert _open_under(tmp_path) == []
    assert NodeMemory(str(tmp_path / "absent")).available() is None
