"""The fake NVML driver, exercised through the real pynvml (and the real peers) in subprocesses."""

from __future__ import annotations

import contextlib
import json
import os
import selectors
import shutil
import subprocess
import sys
import textwrap
from collections.abc import Iterator
from pathlib import Path
from typing import Any, Callable

import pytest

from gpuwatch.simulate import fakenvml, gen_stub_symbols
from gpuwatch.simulate.demo import wait_for as poll_until
from gpuwatch.simulate.fakenvml import (
    ARGUMENT_VERSION_MISMATCH,
    DRIVER_NOT_LOADED,
    GPU_IS_LOST,
    INSUFFICIENT_SIZE,
    INVALID_ARGUMENT,
    NOT_FOUND,
    NOT_SUPPORTED,
    TIMEOUT,
    UNINITIALIZED,
    UNKNOWN,
    FakeNode,
    build_fake_nvml,
)
from tests import peers

MiB = 1 << 20
GiB = 1 << 30
NO_INSTANCE = 0xFFFFFFFF

# Shared by every probe: the child prints `out` as JSON on its last line.
PRELUDE = '''
import ctypes, json, sys
import pynvml as N

def code(fn, *args):
    """0 if the call succeeds, else its NVML error number."""
    try:
        fn(*args)
    except N.NVMLError as exc:
        return exc.value
    return 0

def procs(items):
    return [[p.pid, p.usedGpuMemory, p.gpuInstanceId, p.computeInstanceId] for p in items]

out = {}
'''


def run_probe(env: dict[str, str], body: str) -> subprocess.CompletedProcess[str]:
    script = PRELUDE + textwrap.dedent(body) + "\nprint(json.dumps(out))\n"
    return subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=60
    )


def probe(node: FakeNode, body: str) -> dict[str, Any]:
    proc = run_probe(node.env(), body)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.splitlines()[-1])


def wait_for(predicate: Callable[[], Any], what: str, timeout: float = 10.0) -> Any:
    """The project's poll-with-deadline, for predicates that answer truthy or falsy."""
    return poll_until(what, lambda: predicate() or None, timeout)


def proc_state(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0]
    except OSError:
        return None


@contextlib.contextmanager
def sleeper() -> Iterator[subprocess.Popen[str]]:
    """A live process that can be made to hold GPU memory; exits when its stdin closes."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE, text=True
    )
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait()


def unused_pid() -> int:
    """A PID that cannot exist: above the kernel's pid_max."""
    with open("/proc/sys/kernel/pid_max") as f:
        return int(f.read()) + 1000


# ---- the library itself --------------------------------------------------------------------------


def test_build_is_reused(fake_nvml_lib: Path) -> None:
    lib = fake_nvml_lib / fakenvml.LIB_NAME
    before = lib.stat().st_ino
    assert build_fake_nvml(fake_nvml_lib) == fake_nvml_lib
    assert lib.stat().st_ino == before  # reused, not rebuilt


def test_pynvml_loads_the_fake_and_finds_every_symbol_it_knows(fake_node: FakeNode) -> None:
    # Checked in a child: loading the fake into the test process would make any later in-process
    # pynvml use pick it up too (the loader matches libnvidia-ml.so.1 by soname).
    pynvml_path, _ = gen_stub_symbols.installed_pynvml()
    names = gen_stub_symbols.looked_up_symbols(pynvml_path.read_text(encoding="utf-8"))
    assert len(names) > 300
    out = probe(
        fake_node,
        f"""
        N._LoadNvmlLibrary()
        missing = []
        for name in {names!r}:
            try:
                N._nvmlGetFunctionPointer(name)
            except N.NVMLError_FunctionNotFound:
                missing.append(name)
        out["missing"] = missing
        with open("/proc/self/maps") as maps:
            out["mapped"] = sorted({{line.split()[-1] for line in maps if "libnvidia-ml" in line}})
        """,
    )
    assert out["missing"] == []
    assert out["mapped"] == [str(fake_node.lib_dir / fakenvml.LIB_NAME)]


def test_default_build_goes_to_the_cache_keyed_by_source(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    built = build_fake_nvml()
    assert built.parent == tmp_path / "gpuwatch" / "fake-nvml"
    assert (built / fakenvml.LIB_NAME).is_file()
    assert build_fake_nvml() == built


def test_missing_compiler_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    monkeypatch.delenv("CC", raising=False)
    with pytest.raises(fakenvml.FakeNvmlBuildError, match="no C compiler found"):
        build_fake_nvml(tmp_path / "lib")


def test_source_compiles_without_warnings(tmp_path: Path) -> None:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    src = Path(fakenvml.__file__).with_name("fake_nvml.c")
    proc = subprocess.run(
        [cc, *fakenvml.CFLAGS, "-Werror", "-o", str(tmp_path / "lib.so"), str(src)],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""


def test_stub_list_is_current() -> None:
    assert gen_stub_symbols.main(["--check"]) == 0


# ---- identity, memory, utilisation ---------------------------------------------------------------


def test_devices_as_pynvml_sees_them(fake_node: FakeNode) -> None:
    dev0, dev1 = fake_node.devices
    dev0.reserved = 512 * MiB
    dev0.unattributed = 3 * GiB
    dev0.util_gpu, dev0.util_mem = 87, 41
    dev1.mig = True
    fake_node.write()

    out = probe(
        fake_node,
        """
        N.nvmlInit()
        out["driver"] = N.nvmlSystemGetDriverVersion()
        out["nvml"] = N.nvmlSystemGetNVMLVersion()
        out["cuda"] = [N.nvmlSystemGetCudaDriverVersion(), N.nvmlSystemGetCudaDriverVersion_v2()]
        out["count"] = N.nvmlDeviceGetCount()
        out["devices"] = []
        for i in range(out["count"]):
            h = N.nvmlDeviceGetHandleByIndex(i)
            pci = N.nvmlDeviceGetPciInfo_v3(h)
            m1 = N.nvmlDeviceGetMemoryInfo(h)
            m2 = N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2)
            util = N.nvmlDeviceGetUtilizationRates(h)
            uuid = N.nvmlDeviceGetUUID(h)
            out["devices"].append({
                "name": N.nvmlDeviceGetName(h),
                "uuid": uuid,
                "index": N.nvmlDeviceGetIndex(h),
                "minor": N.nvmlDeviceGetMinorNumber(h),
                "pci": [pci.busId, pci.busIdLegacy, pci.domain, pci.bus, pci.device,
                        pci.pciDeviceId],
                "by_uuid": N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByUUID(uuid)),
                "by_pci": N.nvmlDeviceGetIndex(N.nvmlDeviceGetHandleByPciBusId(pci.busId)),
                "by_pci_lower": N.nvmlDeviceGetIndex(
                    N.nvmlDeviceGetHandleByPciBusId(pci.busIdLegacy.lower())),
                "mem_v1": [m1.total, m1.free, m1.used],
                "mem_v2": [m2.version, m2.total, m2.reserved, m2.free, m2.used],
                "util": [util.gpu, util.memory],
                "cc": list(N.nvmlDeviceGetCudaComputeCapability(h)),
                "brand": N.nvmlDeviceGetBrand(h),
                "mig": code(N.nvmlDeviceGetMigMode, h) or N.nvmlDeviceGetMigMode(h),
            })
        h0 = N.nvmlDeviceGetHandleByIndex(0)
        bad = N.c_nvmlMemory_v2_t()
        bad.version = N.nvmlMemory_v2 - 1
        fn = N._nvmlGetFunctionPointer("nvmlDeviceGetMemoryInfo_v2")
        out["wrong_version"] = fn(h0, ctypes.byref(bad))
        out["bad_index"] = code(N.nvmlDeviceGetHandleByIndex, 7)
        out["bad_uuid"] = code(N.nvmlDeviceGetHandleByUUID, "GPU-nope")
        out["bad_pci"] = code(N.nvmlDeviceGetHandleByPciBusId, "00000000:77:00.0")
        small = ctypes.create_string_buffer(8)
        fn = N._nvmlGetFunctionPointer("nvmlDeviceGetName")
        out["small_buffer"] = fn(h0, small, ctypes.c_uint(8))
        legacy = N.nvmlPciInfo_v2_t()
        fn = N._nvmlGetFunctionPointer("nvmlDeviceGetPciInfo")
        out["legacy_pci"] = [fn(h0, ctypes.byref(legacy)), legacy.busId, legacy.bus]
        """,
    )
    assert out["driver"] == "550.54.15"
    assert out["nvml"] == "12.550.54.15"
    assert out["cuda"] == [12040, 12040]
    assert out["count"] == 2
    d0, d1 = out["devices"]
    total = 85520809984
    assert d0["name"] == "NVIDIA H100 80GB HBM3"
    assert [d0["uuid"], d1["uuid"]] == [dev0.uuid, dev1.uuid]
    assert d0["uuid"].startswith("GPU-") and d0["uuid"] != d1["uuid"]
    assert [d0["index"], d0["minor"], d1["index"], d1["minor"]] == [0, 0, 1, 1]
    assert d0["pci"] == ["00000000:18:00.0", "0000:18:00.0", 0, 0x18, 0, 0x233010DE]
    assert d1["pci"][0] == "00000000:2A:00.0"
    for i, d in enumerate(out["devices"]):
        assert d["by_uuid"] == d["by_pci"] == d["by_pci_lower"] == i
    used = 3 * GiB  # unattributed: no processes yet
    assert d0["mem_v2"] == [0x02000028, total, 512 * MiB, total - 512 * MiB - used, used]
    assert d0["mem_v1"] == [total, total - 512 * MiB - used, used + 512 * MiB]
    assert d1["mem_v2"] == [0x02000028, total, 0, total, 0]
    assert d0["util"] == [87, 41] and d1["util"] == [0, 0]
    assert d0["cc"] == [9, 0] and d0["brand"] == 14
    assert d0["mig"] == NOT_SUPPORTED  # no mig key: not MIG-capable
    assert d1["mig"] == [1, 1]
    assert out["wrong_version"] == ARGUMENT_VERSION_MISMATCH
    assert out["bad_index"] == INVALID_ARGUMENT
    assert out["bad_uuid"] == NOT_FOUND
    assert out["bad_pci"] == NOT_FOUND
    assert out["small_buffer"] == INSUFFICIENT_SIZE
    assert out["legacy_pci"] == [0, "0000:18:00.0", 0x18]


# ---- process lists -------------------------------------------------------------------------------


def test_process_lists_count_then_fill(fake_node: FakeNode) -> None:
    me = os.getpid()
    gone = unused_pid()
    # device 0: one process; device 1: many, of every kind.
    fake_node.hold(me, 0, 1536 * MiB)
    fake_node.hold(me, 1, 2 * GiB, type="compute+graphics")
    for k in range(6):
        fake_node.hold(gone + k, 1, (k + 1) * GiB, ghost=True)
    fake_node.hold(gone + 10, 1, None, ghost=True)
    fake_node.hold(gone + 11, 1, 5 * GiB, type="graphics", ghost=True)
    fake_node.hold(gone + 12, 1, 7 * MiB, ghost=True, gpu_instance_id=1, compute_instance_id=0)
    fake_node.devices[1].unattributed = 100 * MiB
    fake_node.write()

    out = probe(
        fake_node,
        """
        from ctypes import byref, c_uint
        N.nvmlInit()
        out["compute"], out["graphics"], out["mps"], out["raw"], out["used"] = [], [], [], [], []
        for i in range(2):
            h = N.nvmlDeviceGetHandleByIndex(i)
            out["compute"].append(procs(N.nvmlDeviceGetComputeRunningProcesses(h)))
            out["graphics"].append(procs(N.nvmlDeviceGetGraphicsRunningProcesses(h)))
            out["mps"].append(procs(N.nvmlDeviceGetMPSComputeRunningProcesses(h)))
            out["used"].append(N.nvmlDeviceGetMemoryInfo(h, version=N.nvmlMemory_v2).used)
            fn = N._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses_v3")
            count = c_uint(0)
            first = fn(h, byref(count), None)
            needed = count.value
            count = c_uint(1)
            one = (N.c_nvmlProcessInfo_v3_t * 1)()
            short = fn(h, byref(count), one)
            out["raw"].append([first, needed, short, count.value])
        h = N.nvmlDeviceGetHandleByIndex(0)
        out["v2"] = procs(N.nvmlDeviceGetComputeRunningProcesses_v2(h))

        class V1(ctypes.Structure):
            _fields_ = [("pid", ctypes.c_uint), ("usedGpuMemory", ctypes.c_ulonglong)]
        arr = (V1 * 4)()
        count = c_uint(4)
        fn = N._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses")
        ret = fn(h, byref(count), arr)
        out["v1"] = [ret, count.value, arr[0].pid, arr[0].usedGpuMemory]

        mps = N._nvmlGetFunctionPointer("nvmlDeviceGetMPSComputeRunningProcesses_v3")
        count = c_uint(0)
        out["empty"] = [mps(h, byref(count), None), count.value]
        """,
    )
    n = NO_INSTANCE
    assert out["compute"][0] == [[me, 1536 * MiB, n, n]]
    assert out["graphics"][0] == []
    assert out["v2"] == out["compute"][0]
    assert out["v1"] == [0, 1, me, 1536 * MiB]
    assert out["used"][0] == 1536 * MiB

    compute1 = {p[0]: p for p in out["compute"][1]}
    assert set(compute1) == {me, *range(gone, gone + 6), gone + 10, gone + 12}
    assert compute1[gone + 3][1] == 4 * GiB
    assert compute1[gone + 10][1] is None  # used=na -> pynvml's None
    assert compute1[gone + 12][2:] == [1, 0]
    assert {p[0] for p in out["graphics"][1]} == {me, gone + 11}
    # Known figures add up, "na" adds nothing; a compute+graphics process counts once.
    assert out["used"][1] == (2 + 21 + 5) * GiB + 7 * MiB + 100 * MiB
    assert out["mps"] == [[], []]
    assert out["empty"] == [0, 0]
    # NULL array -> INSUFFICIENT_SIZE and the count; a too-small array -> the same.
    assert out["raw"][0] == [INSUFFICIENT_SIZE, 1, 0, 1]
    assert out["raw"][1] == [INSUFFICIENT_SIZE, 9, INSUFFICIENT_SIZE, 9]


def test_no_processes_is_success_with_zero(fake_node: FakeNode) -> None:
    out = probe(
        fake_node,
        """
        from ctypes import byref, c_uint
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        fn = N._nvmlGetFunctionPointer("nvmlDeviceGetComputeRunningProcesses_v3")
        count = c_uint(5)
        out["raw"] = [fn(h, byref(count), None), count.value]
        out["list"] = procs(N.nvmlDeviceGetComputeRunningProcesses(h))
        """,
    )
    assert out == {"raw": [0, 0], "list": []}


LIST_PIDS = """
N.nvmlInit()
out["pids"] = [
    [p.pid for p in N.nvmlDeviceGetComputeRunningProcesses(N.nvmlDeviceGetHandleByIndex(i))]
    for i in range(2)
]
out["used"] = [
    N.nvmlDeviceGetMemoryInfo(N.nvmlDeviceGetHandleByIndex(i), version=N.nvmlMemory_v2).used
    for i in range(2)
]
"""


def test_an_exited_process_drops_out_and_a_ghost_stays(fake_node: FakeNode) -> None:
    gone = unused_pid()
    fake_node.hold(gone, 1, 3 * GiB, ghost=True)
    fake_node.hold(gone + 1, 1, 1 * GiB)  # not a ghost, and the PID does not exist
    with sleeper() as holder:
        fake_node.hold(holder.pid, 0, 2 * GiB)
        assert probe(fake_node, LIST_PIDS) == {
            "pids": [[holder.pid], [gone]],
            "used": [2 * GiB, 3 * GiB],
        }

        assert holder.stdin is not None
        holder.stdin.close()  # the holder exits by itself
        holder.wait(timeout=30)
        wait_for(
            lambda: probe(fake_node, LIST_PIDS) == {"pids": [[], [gone]], "used": [0, 3 * GiB]},
            "the exited holder to drop out",
        )


def test_a_zombie_drops_out(fake_node: FakeNode) -> None:
    child = subprocess.Popen([sys.executable, "-c", "pass"])
    try:
        fake_node.hold(child.pid, 0, 2 * GiB)
        # Not reaped (no wait/poll): it stays a zombie until we reap it.
        wait_for(lambda: proc_state(child.pid) == "Z", "the child to become a zombie")
        assert probe(fake_node, LIST_PIDS)["pids"] == [[], []]
        assert probe(fake_node, LIST_PIDS)["used"] == [0, 0]
    finally:
        child.wait()


ZOMBIE_LEADER_C = r"""
#include <pthread.h>
#include <unistd.h>
static void *linger(void *arg) { (void)arg; for (;;) pause(); return 0; }
int main(void) {
    pthread_t t;
    pthread_create(&t, 0, linger, 0);
    pthread_exit(0); /* the leader exits; the other thread keeps the process (and GPU) alive */
}
"""


def test_a_zombie_leader_with_live_threads_keeps_its_memory(
    fake_node: FakeNode, tmp_path: Path
) -> None:
    cc = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if cc is None:
        pytest.skip("no C compiler")
    src = tmp_path / "zombie_leader.c"
    src.write_text(ZOMBIE_LEADER_C)
    exe = tmp_path / "zombie_leader"
    subprocess.run([cc, "-pthread", "-o", str(exe), str(src)], check=True)

    child = subprocess.Popen([str(exe)])
    try:
        fake_node.hold(child.pid, 0, 4 * GiB)

        def leader_is_zombie_with_a_live_thread() -> bool:
            tasks = os.listdir(f"/proc/{child.pid}/task")
            return proc_state(child.pid) == "Z" and len(tasks) == 2

        wait_for(leader_is_zombie_with_a_live_thread, "the leader to exit, leaving its thread")
        assert probe(fake_node, LIST_PIDS) == {"pids": [[child.pid], []], "used": [4 * GiB, 0]}

        child.kill()  # the whole group dies; unreaped, it is a plain zombie
        wait_for(
            lambda: probe(fake_node, LIST_PIDS) == {"pids": [[], []], "used": [0, 0]},
            "the killed process to drop out",
        )
    finally:
        child.kill()
        child.wait()


# For a probe: how many pidfds the probe's process holds.
PIDFDS = """
import os

def pidfds():
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += "pidfd" in os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return n
"""


def test_exits_show_alike_through_pidfds_and_through_proc_when_descriptors_run_short(
    fake_node: FakeNode,
) -> None:
    """The driver asks a pidfd per listed process, but takes at most a quarter of the caller's
    descriptor limit: the rest are read from /proc. Both ways see an exit."""
    script = PRELUDE + PIDFDS + textwrap.dedent(
        """
        import resource
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (64, hard))

        N.nvmlInit()
        for _ in sys.stdin:
            h = N.nvmlDeviceGetHandleByIndex(0)
            answer = {"pids": sorted(p.pid for p in N.nvmlDeviceGetComputeRunningProcesses(h)),
                      "used": N.nvmlDeviceGetMemoryInfo(h).used, "pidfds": pidfds()}
            print(json.dumps(answer), flush=True)
        """
    )
    holders = [subprocess.Popen(["sleep", "600"]) for _ in range(30)]
    try:
        for p in holders:
            fake_node.hold(p.pid, 0, MiB)
        pids = sorted(p.pid for p in holders)
        with asking_client(script, fake_node) as ask:
            first = ask()
            assert first["pids"] == pids and first["used"] == 30 * MiB
            assert 0 < first["pidfds"] <= 64 // 4  # the rest read from /proc
            # Every other holder exits: some asked by pidfd, some by /proc.
            gone = holders[::2]
            for p in gone:
                p.kill()
                p.wait()
            left = sorted(p.pid for p in holders[1::2])
            wait_for(lambda: ask()["pids"] == left, "the exited holders to drop out")
            assert ask()["used"] == 15 * MiB
    finally:
        for p in holders:
            p.kill()
            p.wait()


def test_a_pidfd_the_caller_closed_and_reused_does_not_hide_a_live_holder(
    fake_node: FakeNode,
) -> None:
    """A caller that closes the library's descriptor and opens a file on the same number (always
    readable, as an exited process's pidfd is): /proc, asked to confirm the exit, keeps the
    holder listed."""
    with sleeper() as holder:
        fake_node.hold(holder.pid, 0, GiB)
        out = probe(fake_node, PIDFDS + textwrap.dedent("""
            import time
            N.nvmlInit()
            h = N.nvmlDeviceGetHandleByIndex(0)
            out["before"] = [p.pid for p in N.nvmlDeviceGetComputeRunningProcesses(h)]
            for fd in os.listdir("/proc/self/fd"):
                try:
                    if "pidfd" in os.readlink(f"/proc/self/fd/{fd}"):
                        os.close(int(fd))
                        assert os.open("/dev/null", os.O_RDONLY) == int(fd)
                except OSError:
                    pass
            time.sleep(0.05)  # past the driver's 20 ms
            out["after"] = [p.pid for p in N.nvmlDeviceGetComputeRunningProcesses(h)]
            out["used"] = N.nvmlDeviceGetMemoryInfo(h).used
        """))
        assert out == {"before": [holder.pid], "after": [holder.pid], "used": GiB}


def test_shutting_the_library_down_closes_its_pidfds(fake_node: FakeNode) -> None:
    with sleeper() as holder:
        fake_node.hold(holder.pid, 0, GiB)
        out = probe(fake_node, PIDFDS + textwrap.dedent("""
            N.nvmlInit()
            out["pids"] = [p.pid for p in N.nvmlDeviceGetComputeRunningProcesses(
                N.nvmlDeviceGetHandleByIndex(0))]
            out["held"] = pidfds()
            N.nvmlShutdown()
            out["after"] = pidfds()
        """))
        assert out == {"pids": [holder.pid], "held": 1, "after": 0}


# ---- changes while a client runs -----------------------------------------------------------------


@contextlib.contextmanager
def asking_client(script: str, node: FakeNode) -> Iterator[Callable[[], dict[str, Any]]]:
    """A long-lived NVML client (`script`) that prints one JSON line per line it reads; yields
    `ask()`, which asks once and returns its answer."""
    child = subprocess.Popen([sys.executable, "-c", script], env=node.env(),
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert child.stdin is not None and child.stdout is not None
    stdin, stdout = child.stdin, child.stdout
    sel = selectors.DefaultSelector()
    sel.register(stdout, selectors.EVENT_READ)

    def ask() -> dict[str, Any]:
        stdin.write("\n")
        stdin.flush()
        assert sel.select(timeout=30), "the client did not answer"
        return dict(json.loads(stdout.readline()))

    try:
        yield ask
    finally:
        stdin.close()
        child.wait(timeout=30)
        sel.close()


def test_state_changes_are_seen_without_reinit(fake_node: FakeNode) -> None:
    script = PRELUDE + textwrap.dedent(
        """
        N.nvmlInit()
        for _ in sys.stdin:
            h = N.nvmlDeviceGetHandleByIndex(0)
            print(json.dumps({
                "count": N.nvmlDeviceGetCount(),
                "util": N.nvmlDeviceGetUtilizationRates(h).gpu,
                "pids": [p.pid for p in N.nvmlDeviceGetComputeRunningProcesses(h)],
                "mem": code(N.nvmlDeviceGetMemoryInfo, h),
            }), flush=True)
        """
    )
    with asking_client(script, fake_node) as ask:
        me = os.getpid()
        assert ask() == {"count": 2, "util": 0, "pids": [], "mem": 0}
        fake_node.hold(me, 0, GiB)
        assert ask()["pids"] == [me]
        # Two quick same-size rewrites: both must be noticed.
        fake_node.devices[0].util_gpu = 11
        fake_node.write()
        fake_node.devices[0].util_gpu = 22
        fake_node.write()
        assert ask()["util"] == 22
        fake_node.fail("nvmlDeviceGetMemoryInfo", GPU_IS_LOST, device=0)
        assert ask()["mem"] == GPU_IS_LOST
        fake_node.clear_failures()
        fake_node.devices.append(fakenvml.FakeDevice(index=2, uuid="GPU-third"))
        fake_node.release(me)
        assert ask() == {"count": 3, "util": 22, "pids": [], "mem": 0}
        # A vanished state file leaves the last state in force.
        fake_node.state_path.unlink()
        assert ask()["count"] == 3


# ---- failures ------------------------------------------------------------------------------------


def test_init_fails_without_a_state_file(tmp_path: Path, fake_nvml_lib: Path) -> None:
    node = FakeNode(tmp_path / "never-written", fake_nvml_lib)
    out = probe(node, 'out["init"] = code(N.nvmlInit)')
    assert out == {"init": DRIVER_NOT_LOADED}
    env = node.env()
    del env[fakenvml.STATE_ENV]
    proc = run_probe(env, 'out["init"] = code(N.nvmlInit)')
    assert json.loads(proc.stdout.splitlines()[-1]) == {"init": DRIVER_NOT_LOADED}


def test_injected_init_failure(fake_node: FakeNode) -> None:
    fake_node.fail("nvmlInitWithFlags", DRIVER_NOT_LOADED)
    out = probe(
        fake_node,
        """
        out["init"] = code(N.nvmlInit)
        out["count"] = code(N.nvmlDeviceGetCount)
        # Only the named entry point fails: nvmlInit_v2 still initialises.
        out["v2"] = N._nvmlGetFunctionPointer("nvmlInit_v2")()
        out["count_after_v2"] = code(N.nvmlDeviceGetCount)
        """,
    )
    assert out == {"init": DRIVER_NOT_LOADED, "count": UNINITIALIZED, "v2": 0, "count_after_v2": 0}

    fake_node.clear_failures()
    fake_node.fail("nvmlInit*", TIMEOUT)
    out = probe(
        fake_node,
        """
        out["init"] = code(N.nvmlInit)
        out["v2"] = N._nvmlGetFunctionPointer("nvmlInit_v2")()
        """,
    )
    assert out == {"init": TIMEOUT, "v2": TIMEOUT}


DEVICE_CALLS = """
N.nvmlInit()
out["count"] = N.nvmlDeviceGetCount()
out["driver"] = N.nvmlSystemGetDriverVersion()
out["devices"] = []
for i in range(2):
    r = {"handle": code(N.nvmlDeviceGetHandleByIndex, i)}
    if not r["handle"]:
        h = N.nvmlDeviceGetHandleByIndex(i)
        r["name"] = code(N.nvmlDeviceGetName, h)
        r["mem_v1"] = code(N.nvmlDeviceGetMemoryInfo, h)
        r["mem_v2"] = code(N.nvmlDeviceGetMemoryInfo, h, N.nvmlMemory_v2)
        r["procs"] = code(N.nvmlDeviceGetComputeRunningProcesses, h)
        r["temp"] = code(N.nvmlDeviceGetTemperature, h, 0)
    out["devices"].append(r)
"""


def test_one_lost_gpu_while_the_other_works(fake_node: FakeNode) -> None:
    fake_node.hold(os.getpid(), 0, GiB)
    fake_node.fail("*", GPU_IS_LOST, device=1)
    out = probe(fake_node, DEVICE_CALLS)
    assert out["count"] == 2
    assert out["driver"] == "550.54.15"
    ok = {"handle": 0, "name": 0, "mem_v1": 0, "mem_v2": 0, "procs": 0, "temp": NOT_SUPPORTED}
    assert out["devices"] == [ok, {"handle": GPU_IS_LOST}]


def test_one_call_failing_on_one_device(fake_node: FakeNode) -> None:
    fake_node.fail("nvmlDeviceGetMemoryInfo_v2", TIMEOUT, device=1)
    fake_node.fail("nvmlDeviceGetTemperature", UNKNOWN, device=0)  # a stub
    out = probe(fake_node, DEVICE_CALLS)
    assert out["devices"] == [
        {"handle": 0, "name": 0, "mem_v1": 0, "mem_v2": 0, "procs": 0, "temp": UNKNOWN},
        {"handle": 0, "name": 0, "mem_v1": 0, "mem_v2": TIMEOUT, "procs": 0, "temp": NOT_SUPPORTED},
    ]


def test_a_counted_failure_fails_only_its_first_calls_and_a_rewrite_does_not_rearm_it(
        fake_node: FakeNode) -> None:
    script = PRELUDE + textwrap.dedent(
        """
        N.nvmlInit()
        for _ in sys.stdin:
            h = N.nvmlDeviceGetHandleByIndex(0)
            print(json.dumps({
                "count": [code(N.nvmlDeviceGetCount) for _ in range(3)],
                "procs": [code(N.nvmlDeviceGetComputeRunningProcesses, h) for _ in range(2)],
            }), flush=True)
        """
    )
    with asking_client(script, fake_node) as ask:
        assert ask() == {"count": [0, 0, 0], "procs": [0, 0]}
        fake_node.fail("nvmlDeviceGetCount*", UNKNOWN, times=2)
        fake_node.fail("nvmlDeviceGetComputeRunningProcesses*", TIMEOUT, device=0, times=1)
        assert ask() == {"count": [UNKNOWN, UNKNOWN, 0], "procs": [TIMEOUT, 0]}
        fake_node.hold(os.getpid(), 0, GiB)  # the file is rewritten: spent faults stay spent
        assert ask() == {"count": [0, 0, 0], "procs": [0, 0]}
        fake_node.fail("nvmlDeviceGetCount*", GPU_IS_LOST, times=1)  # a second, fresh one
        assert ask() == {"count": [GPU_IS_LOST, 0, 0], "procs": [0, 0]}
        fake_node.clear_failures()
        fake_node.fail("nvmlDeviceGetCount*", UNKNOWN, times=1)  # removed and added: armed
        assert ask()["count"] == [UNKNOWN, 0, 0]
    assert "times=1" in fake_node.render()
    with pytest.raises(ValueError):
        fake_node.fail("nvmlDeviceGetCount", UNKNOWN, times=0)


def test_lookups_by_key_resolve_the_device_for_failures(fake_node: FakeNode) -> None:
    fake_node.fail("nvmlDeviceGetHandleByUUID", GPU_IS_LOST, device=1)
    uuids = [d.uuid for d in fake_node.devices]
    out = probe(
        fake_node,
        f"""
        N.nvmlInit()
        out["by_uuid"] = [code(N.nvmlDeviceGetHandleByUUID, u) for u in {uuids!r}]
        """,
    )
    assert out == {"by_uuid": [0, GPU_IS_LOST]}


# ---- stubs, init/shutdown, strings, bad lines ----------------------------------------------------


def test_stubs_init_refcount_and_error_strings(fake_node: FakeNode) -> None:
    out = probe(
        fake_node,
        """
        N._LoadNvmlLibrary()  # loaded, never initialised
        out["before"] = [code(N.nvmlDeviceGetCount),
                         N._nvmlGetFunctionPointer("nvmlDeviceGetPowerUsage")(None, None)]
        N.nvmlInit()
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(0)
        out["stubs"] = [code(N.nvmlDeviceGetPowerUsage, h), code(N.nvmlDeviceGetTemperature, h, 0),
                        code(N.nvmlDeviceGetFanSpeed, h), code(N.nvmlSystemGetProcessName, 1)]
        N.nvmlShutdown()
        out["after_one_shutdown"] = code(N.nvmlDeviceGetName, h)
        N.nvmlShutdown()
        out["after_two"] = [code(N.nvmlDeviceGetName, h), code(N.nvmlDeviceGetCount),
                            code(N.nvmlShutdown)]
        out["strings"] = {str(c): N.nvmlErrorString(c) for c in (0, 1, 2, 3, 9, 15, 25, 999, 12345)}
        """,
    )
    assert out["before"] == [UNINITIALIZED, UNINITIALIZED]
    assert out["stubs"] == [NOT_SUPPORTED] * 4
    assert out["after_one_shutdown"] == 0
    assert out["after_two"] == [UNINITIALIZED] * 3
    assert out["strings"] == {
        "0": "Success",
        "1": "Uninitialized",
        "2": "Invalid Argument",
        "3": "Not Supported",
        "9": "Driver Not Loaded",
        "15": "GPU is lost",
        "25": "Argument version mismatch",
        "999": "Unknown Error",
        "12345": "Unknown Error",
    }


def test_unreadable_lines_are_skipped_with_one_note(fake_node: FakeNode) -> None:
    good = fake_node.render()
    fake_node.state_path.write_text(
        good
        + "device index=5 bogus=1\n"  # unknown key: the whole record is skipped
        + "process device=0 pid=notanumber used=1\n"
        + 'device index=6 name="unterminated\n'
        + "frobnicate all the things\n"
        + f"process device=0 pid={os.getpid()} used=1048576 # trailing comment\n"
    )
    proc = run_probe(fake_node.env(), LIST_PIDS)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.splitlines()[-1])["pids"] == [[os.getpid()], []]
    notes = [line for line in proc.stderr.splitlines() if line.startswith("fake-nvml:")]
    assert len(notes) == 1
    assert "unknown device key" in notes[0] and "4 unreadable line(s)" in notes[0]


def test_quoted_values_round_trip(fake_node: FakeNode) -> None:
    fake_node.devices[0].name = 'Tesla "Quoted" \\ GPU #1'
    fake_node.write()
    out = probe(
        fake_node,
        'N.nvmlInit(); out["name"] = N.nvmlDeviceGetName(N.nvmlDeviceGetHandleByIndex(0))',
    )
    assert out == {"name": 'Tesla "Quoted" \\ GPU #1'}


# ---- peers ---------------------------------------------------------------------------------------


def test_nvitop_picks_the_standard_v3_process_layout(fake_node: FakeNode) -> None:
    fake_node.hold(os.getpid(), 1, 3 * GiB + 5)
    out = probe(
        fake_node,
        """
        from nvitop.api import libnvml
        N.nvmlInit()
        h = N.nvmlDeviceGetHandleByIndex(1)
        ps = libnvml.nvmlDeviceGetComputeRunningProcesses(h)
        out["fields"] = [f[0] for f in libnvml.c_nvmlProcessInfo_t._fields_]
        out["procs"] = [[p.pid, p.usedGpuMemory] for p in ps]
        out["mem"] = libnvml.nvmlDeviceGetMemoryInfo(h).used
        """,
    )
    assert out["fields"] == ["pid", "usedGpuMemory", "gpuInstanceId", "computeInstanceId"]
    assert out["procs"] == [[os.getpid(), 3 * GiB + 5]]
    assert out["mem"] == 3 * GiB + 5


@pytest.mark.parametrize(
    "b",
    [
        0,
        1,
        1023,
        1024,
        1536,
        MiB - 1,
        MiB,
        99 * MiB + 12345,
        100 * MiB,
        999 * MiB + 7,
        1000 * MiB,
        20 * GiB - 1,
        20 * GiB,
        85520809984,
        100 * GiB,
        1000 * GiB,
        3 * (1 << 40),
    ],
)
def test_nvitop_rounding_is_reproduced(b: int) -> None:
    from nvitop.api.utils import bytes2human

    assert peers.nvitop_bytes2human(b) == bytes2human(b)
    shown = peers.nvitop_shown(b)
    assert shown is not None
    assert peers.parse_nvitop_size(bytes2human(shown)) == shown  # stable once rounded


def test_peers_see_the_same_node(fake_node: FakeNode) -> None:
    fake_node.devices[0].reserved = 542 * MiB
    fake_node.devices[1].unattributed = 77 * MiB + 3
    fake_node.write()
    holders = [
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]) for _ in range(3)
    ]
    try:
        a, b, c = (p.pid for p in holders)
        sizes = {
            (0, a): 1536 * MiB + 12345,
            (0, b): 700 * MiB + 3,
            (1, b): 5 * GiB,
            (1, c): 21 * GiB + 1234567,  # above 20 GiB: nvitop switches to GiB
        }
        for (gpu, pid), used in sizes.items():
            fake_node.hold(pid, gpu, used)
        truth_used = [
            sum(v for (g, _), v in sizes.items() if g == i) + d.unattributed
            for i, d in enumerate(fake_node.devices)
        ]
        env = fake_node.env()
        gpustat = peers.gpustat_view(env)
        nvitop = peers.nvitop_view(env)
    finally:
        for p in holders:
            p.kill()
            p.wait()

    for view, shown, shown_process in (
        (gpustat, peers.gpustat_shown, peers.gpustat_shown_process),
        (nvitop, peers.nvitop_shown, peers.nvitop_shown),
    ):
        assert [g["index"] for g in view["gpus"]] == [0, 1], view["tool"]
        for g, d, used in zip(view["gpus"], fake_node.devices, truth_used):
            assert g["memory_total_bytes"] == shown(d.total), view["tool"]
            assert g["memory_used_bytes"] == shown(used), view["tool"]
        assert view["processes"] == {k: shown_process(v) for k, v in sizes.items()}, view["tool"]

    assert [g["uuid"] for g in gpustat["gpus"]] == [d.uuid for d in fake_node.devices]
    assert [g["name"] for g in gpustat["gpus"]] == [d.name for d in fake_node.devices]
    assert [g["name"] for g in nvitop["gpus"]] == [
        peers.nvitop_shown_name(d.name) for d in fake_node.devices
    ]
    # And so the two agree with each other to within one unit of the coarser rounding.
    assert gpustat["processes"].keys() == nvitop["processes"].keys()
    for key, shown_by_gpustat in gpustat["processes"].items():
        assert abs(shown_by_gpustat - nvitop["processes"][key]) < 0.01 * GiB
