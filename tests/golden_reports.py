"""The node reports the golden-file tests render (tests/test_golden.py): one per shape of node an
operator meets, each made as the daemon makes it, by the real detectors over a few fixed
snapshots (fixed clocks, no host reads), except the catalogue of leak evidence, which spells
out every way a leak's details can read (tests/leakreports.py).

Each builder returns a NodeReport; its name is the folder of its files under tests/golden/.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from types import MappingProxyType

from gpuwatch.config import DetectorConfig
from gpuwatch.detectors import assess
from gpuwatch.history import History
from gpuwatch.jobs.tree import job_roots
from gpuwatch.model import (
    BufferSize,
    GpuDevice,
    GpuProcessUsage,
    HostProcess,
    Job,
    NodeReport,
    NodeSnapshot,
    NvmlStatus,
    Pod,
)
from tests import leakreports

GIB = 1 << 30
MIB = 1 << 20
#: Every snapshot's clock: 2023-11-14 22:13:20Z and on.
T0 = 1_700_000_000.0
NVML = NvmlStatus(True, driver_version="550.54.15", nvml_version="12.550.54.15",
                  cuda_driver_version="12040", device_count=2)
CONFIG = DetectorConfig(zombie_grace=5.0, unkillable_after=30.0, min_age=10.0,
                        leftover_grace=20.0, ghost_min_bytes=GIB, ghost_grace=0.0,
                        host_memory_limit_bytes=0, stall_after=60.0)
INIT = HostProcess(pid=1, ppid=0, pgid=1, sid=1, start_time=T0 - 86400, name="systemd",
                   cmdline=("/sbin/init",), user="root", uid=0, state="sleeping",
                   rss_bytes=12 * MIB, num_threads=1)
SLURM = Job("4242", "slurm")
RANK = MappingProxyType({"LOCAL_RANK": "0", "RANK": "0", "WORLD_SIZE": "2",
                         "TORCHELASTIC_RUN_ID": "4242"})


def proc(pid: int, ppid: int, *, gpu: int | None = None, device: int = 0,
         start: float | None = T0 - 3600, **kw: object) -> HostProcess:
    usage = (GpuProcessUsage(device, f"GPU-{device}", pid, gpu),) if gpu is not None else ()
    fields: dict[str, object] = {
        "pgid": pid, "sid": pid, "name": "python3", "cmdline": ("python3", "train.py"),
        "user": "alice", "uid": 1000, "state": "sleeping", "rss_bytes": 2 * GIB,
        "num_threads": 8}
    fields.update(kw)
    return HostProcess(pid=pid, ppid=ppid, start_time=start, gpu_usage=usage,
                       **fields)  # type: ignore[arg-type]


def gpus(*holders: HostProcess, used: tuple[int, int] | None = None) -> tuple[GpuDevice, ...]:
    """Two 80 GiB GPUs holding what `holders` hold (plus `used` where given)."""
    out = []
    for index in (0, 1):
        usage = tuple(u for p in holders for u in p.gpu_usage if u.gpu_index == index)
        held = sum(u.memory_bytes or 0 for u in usage)
        total_used = used[index] if used is not None else held
        out.append(GpuDevice(index=index, uuid=f"GPU-{index}", name="NVIDIA H100 80GB HBM3",
                             pci_bus_id=f"00000000:{0x18 + index:02X}:00.0",
                             memory_total_bytes=80 * GIB, memory_used_bytes=total_used,
                             memory_free_bytes=80 * GIB - total_used,
                             memory_reserved_bytes=512 * MIB,
                             utilization_gpu_percent=97 if usage else 0,
                             utilization_memory_percent=40 if usage else 0,
                             mig_enabled=False, processes=usage))
    return tuple(out)


def snapshot(t: float, *procs: HostProcess, devices: tuple[GpuDevice, ...] | None = None,
             **kw: object) -> NodeSnapshot:
    by_pid = {p.pid: p for p in (INIT, *procs)}
    return NodeSnapshot(taken_at=t, hostname="gpu-node-07", nvml=NVML,
                        gpus=devices if devices is not None else gpus(*procs),
                        processes=MappingProxyType(by_pid),
                        job_roots=MappingProxyType(job_roots(by_pid)),
                        mem_available_bytes=200 * GIB, poll_duration_seconds=0.0125,
                        **kw)  # type: ignore[arg-type]


def replay(*snapshots: NodeSnapshot, config: DetectorConfig = CONFIG) -> NodeReport:
    """The report of the last snapshot, after the detectors saw each of them in turn."""
    history = History()
    report = None
    for snap in snapshots:
        report = assess(snap, history, config)
    assert report is not None
    return report


def orphan() -> NodeReport:
    """torchrun died: both ranks still hold their GPUs under init, with a Slurm job."""
    launcher = proc(100, 1, name="torchrun", cmdline=("torchrun", "--nproc-per-node=2",
                                                       "train.py"), job=SLURM, pgid=100)

    def rank(pid: int, ppid: int, device: int) -> HostProcess:
        return proc(pid, ppid, gpu=30 * GIB + device * GIB, device=device, pgid=100,
                    launch_env=MappingProxyType({**RANK, "LOCAL_RANK": str(device),
                                                 "RANK": str(device)}),
                    job=SLURM, state="running")

    before = snapshot(T0 - 30, launcher, rank(101, 100, 0), rank(102, 100, 1))
    after = snapshot(T0, rank(101, 1, 0), rank(102, 1, 1))
    return replay(before, after)


def zombie() -> NodeReport:
    """A trainer's child left defunct past the grace, and a zombie whose threads hold memory."""
    parent = proc(200, 1, gpu=20 * GIB, state="running")
    defunct = proc(201, 200, pgid=200, state="zombie", num_threads=1, rss_bytes=0,
                   cmdline=(), name="pt_data_worker")
    threaded = proc(202, 1, gpu=6 * GIB, device=1, state="zombie", num_threads=3,
                    cmdline=(), name="python3")
    return replay(snapshot(T0 - 10, parent, defunct, threaded),
                  snapshot(T0, parent, defunct, threaded))


def leftover() -> NodeReport:
    """The trainer ended; a Redis server its job started still runs past the grace."""
    launcher = proc(300, 1, name="torchrun", cmdline=("torchrun", "train.py"), pgid=300,
                    job=SLURM)
    trainer = proc(301, 300, gpu=40 * GIB, pgid=300, launch_env=RANK, job=SLURM)
    helper = proc(302, 300, pgid=300, name="redis-server", job=SLURM,
                  cmdline=("redis-server", "--port", "6380"), rss_bytes=300 * MIB)
    return replay(snapshot(T0 - 40, launcher, trainer, helper),
                  snapshot(T0 - 39, launcher, helper),
                  snapshot(T0, launcher, helper))


def ghost() -> NodeReport:
    """Memory no listed process accounts for on GPU 1, a PID NVML lists that /proc lacks, and a
    process stuck in the driver."""
    dead = proc(400, 1, gpu=2 * GIB, device=1, in_procfs=False, name=None, cmdline=(),
                user=None, uid=None, state=None, rss_bytes=None, num_threads=None,
                pgid=None, sid=None, start=None)
    stuck = proc(401, 1, gpu=8 * GIB, state="disk-sleep", wchan="uvm_va_space_destroy",
                 kernel_stack=("os_acquire_mutex [nvidia]", "rm_free_unused_clients"))
    live = proc(402, 1, gpu=GIB, device=1, state="running")
    devices = gpus(dead, stuck, live, used=(8 * GIB, 7 * GIB))
    return replay(*(snapshot(t, dead, stuck, live, devices=devices)
                    for t in (T0 - 40, T0 - 20, T0)))


def leak() -> NodeReport:
    """Leaks as the detector names them: a watched buffer explains an instrumented trainer's RSS
    growth against the node's memory; a DataLoader's forked workers copy their parent's pages;
    and a trainer that began to exit but hangs."""
    history = History(sample_spacing=0.0)
    config = replace(CONFIG, leak_warmup_seconds=0, leak_min_span_seconds=20)
    report = None
    from gpuwatch.model import AgentReading, StepPoint

    for step in range(60):
        t = T0 - 59 + step
        rss = 3 * GIB + (step + 1) * 4 * MIB
        point = StepPoint(step, t, rss, None, None, MappingProxyType({
            "fetch_buffer": BufferSize(step + 1, (step + 1) * 4 * MIB)}))
        agent = AgentReading(pid=500, uid=1000, first_seen=T0 - 59, last_seen=t, step=step,
                             step_changed_at=t, finished_at=None, exit_report=None,
                             points=(point,), latest=point, can_reply=True)
        hung = AgentReading(pid=510, uid=1000, first_seen=T0 - 59, last_seen=t, step=7,
                            step_changed_at=T0 - 59, finished_at=None,
                            exit_report=MappingProxyType({"threads": ("heartbeat",),
                                                          "process_group": True}),
                            points=(), latest=None, can_reply=True)
        trainer = proc(500, 1, gpu=10 * GIB, rss_bytes=rss, state="running", job=SLURM)
        argv = ("python3", "loader.py")
        parent = proc(520, 1, gpu=12 * GIB, device=1, cmdline=argv, rss_bytes=3 * GIB,
                      uss_bytes=3 * GIB, state="running")
        workers = [proc(521 + i, 520, cmdline=argv, rss_bytes=400 * MIB, pgid=520,
                        uss_bytes=9 * MIB + step * (i + 1) * MIB)
                   for i in range(2)]
        exiting = proc(510, 1, gpu=3 * GIB, device=1, state="sleeping")
        snap = snapshot(t, trainer, parent, *workers, exiting,
                        agents=MappingProxyType({500: agent, 510: hung}))
        report = assess(snap, history, config)
    assert report is not None
    return report


def leak_evidence() -> NodeReport:
    """Every way a leak's evidence reads: culprits watched, discovered and traced, a trace
    refused, a culprit too long for a label, a leak nothing explains, one without an agent."""
    return leakreports.leak_report((*leakreports.LEAKS, *_MORE_LEAKS))


#: What tests/leakreports.py leaves out: a trace asked for and not answered yet, one that
#: failed, a GPU leak projected against its GPU's free memory, and a tensor holding the autograd
#: history of every step.
_MORE_LEAKS = (
    leakreports.leak(707, "RSS grows every step", growth_bytes_per_step=MIB, culprit=None,
                     found_by=None, trace=MappingProxyType({
                         "status": "requested", "why": "", "steps": 20, "sites": (),
                         "traceback": ()})),
    leakreports.leak(708, "RSS grows every step", growth_bytes_per_step=MIB, culprit=None,
                     found_by=None, trace=MappingProxyType({
                         "status": "failed", "why": "busy", "steps": None, "sites": (),
                         "traceback": ()})),
    leakreports.leak(709, "GPU memory grows every step; runs out against the GPU limit",
                     series="GPU memory", growth_bytes_per_step=64 * MIB, culprit=None,
                     found_by=None, limit_source="GPU", limit_bytes=80 * GIB,
                     available_bytes=8 * GIB, projected_oom_step=202,
                     projected_oom_in_seconds=1280),
    leakreports.leak(710, "RSS grows every step; `__main__.total_loss` holds the graph of every "
                     "step since step 3: use `loss.item()` or `.detach()` (autograd)",
                     growth_bytes_per_step=2 * MIB, culprit="__main__.total_loss",
                     found_by="autograd", history_since_step=3, graph_nodes_per_step=12.0),
)


def kubernetes() -> NodeReport:
    """A Kubernetes node: a training pod given GPU 0 was deleted while its process still holds
    it (an orphan naming the pod), and a notebook pod given no GPU uses GPU 1 (unallocated)."""
    trainer_uid = "1843d150-6a2e-4b1f-9c3d-2a7e5f0b8c11"
    notebook_uid = "5a0e77c2-9b1d-4c3e-8f2a-6d7b8c9d0e1f"

    def in_pod(p: HostProcess, uid: str, namespace: str, name: str, container: str
               ) -> HostProcess:
        return replace(p, pod_uid=uid, container_id=uid[:8] * 8,
                       cgroup=f"/kubepods/burstable/pod{uid}/{uid[:8] * 8}",
                       job=Job(uid, "kubernetes", namespace=namespace, pod=name,
                               container=container))

    trainer = in_pod(proc(300, 1, gpu=22 * GIB, device=0, user="root", uid=0),
                     trainer_uid, "ml-team", "trainer-0", "trainer")
    notebook = in_pod(proc(310, 1, gpu=9 * GIB, device=1, user="root", uid=0,
                           name="jupyter", cmdline=("jupyter", "lab")),
                      notebook_uid, "research", "notebook-7f9c", "notebook")
    listed = {trainer_uid: Pod(trainer_uid, "ml-team", "trainer-0", listed=True,
                               allocated=MappingProxyType({"trainer": ("GPU-0",)})),
              notebook_uid: Pod(notebook_uid, "research", "notebook-7f9c", listed=True,
                                allocated=MappingProxyType({"notebook": ()}))}
    gone = {**listed, trainer_uid: replace(listed[trainer_uid], listed=False,
                                           gone_since=T0 - 5, allocated=MappingProxyType({}))}
    return replay(snapshot(T0 - 30, trainer, notebook, pods=MappingProxyType(listed)),
                  snapshot(T0, trainer, notebook, pods=MappingProxyType(gone)))


def no_nvml() -> NodeReport:
    """A node whose driver is broken: NVML unavailable, the host's view of the workers kept, no
    job manager (no Slurm, no Kubernetes): jobs by launcher alone."""
    launcher = proc(600, 1, name="torchrun", cmdline=("torchrun", "train.py"), pgid=600)
    worker = proc(601, 600, pgid=600, launch_env=RANK, state="running")
    status = NvmlStatus(False, error="Driver/library version mismatch", error_code=18,
                        device_files=2)
    snap = replace(snapshot(T0, launcher, worker, devices=()), nvml=status)
    return replay(snap)


CASES: dict[str, Callable[[], NodeReport]] = {
    "orphan": orphan,
    "zombie": zombie,
    "leftover": leftover,
    "ghost": ghost,
    "leak": leak,
    "leak_evidence": leak_evidence,
    "no_nvml": no_nvml,
    "kubernetes": kubernetes,
}
