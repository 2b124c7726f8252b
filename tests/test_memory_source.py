"""Memory limits from cgroup files and /proc/meminfo: what a leak's out-of-memory point is
measured against."""

from __future__ import annotations

from pathlib import Path

from gpuwatch.sources.memory import CgroupMemory, read_mem_available


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
