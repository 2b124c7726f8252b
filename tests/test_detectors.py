"""Detectors as pure functions, over fixture snapshots: states no test can make for real here
(uninterruptible sleep in a driver) and the rules' edges."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import replace
from types import MappingProxyType
from typing import Any, Optional

from gpuwatch.config import DetectorConfig
from gpuwatch.detectors import DETECTORS, assess, protected_by
from gpuwatch.history import History
from gpuwatch.jobs.tree import is_service, job_roots
from gpuwatch.model import (
    KINDS,
    REAPABLE_KINDS,
    AgentReading,
    Executable,
    GpuDevice,
    GpuProcessUsage,
    HostProcess,
    Job,
    Kind,
    NodeReport,
    NodeSnapshot,
    NvmlCallError,
    NvmlStatus,
    Pod,
)
from tests import emitted_kinds
from tests.emitted_kinds import detectors_report_only_declared_kinds  # noqa: F401 (autouse)

GIB = 1 << 30
CONFIG = DetectorConfig(zombie_grace=5.0, unkillable_after=30.0, min_age=10.0,
                        leftover_grace=20.0)
INIT = HostProcess(pid=1, ppid=0, pgid=1, sid=1, start_time=0.0, name="systemd", state="sleeping")


def proc(pid: int, ppid: int, start: float = 100.0, gpu: Optional[int] = None,
         **kw: Any) -> HostProcess:
    usage = (GpuProcessUsage(0, "GPU-0", pid, gpu),) if gpu is not None else ()
    fields: dict[str, Any] = {"pgid": pid, "sid": pid, "name": "python", "state": "sleeping",
                              "num_threads": 4, "user": "alice"}
    fields.update(kw)
    return HostProcess(pid=pid, ppid=ppid, start_time=start, gpu_usage=usage, **fields)


#: A rank as torchrun's agent starts it: TORCHELASTIC_RUN_ID says a launcher started it.
RANK_0 = MappingProxyType({"LOCAL_RANK": "0", "RANK": "0", "TORCHELASTIC_RUN_ID": "r0"})


def snapshot(t: float, *procs: HostProcess, gpus: tuple[GpuDevice, ...] = (),
             gone_group_leaders: frozenset[int] = frozenset()) -> NodeSnapshot:
    by_pid = {p.pid: p for p in (INIT, *procs)}
    return NodeSnapshot(taken_at=t, hostname="n", nvml=NvmlStatus(available=True), gpus=gpus,
                        processes=MappingProxyType(by_pid),
                        job_roots=MappingProxyType(job_roots(by_pid)),
                        gone_group_leaders=gone_group_leaders)


def run(history: History, snap: NodeSnapshot, config: DetectorConfig = CONFIG) -> NodeReport:
    return assess(snap, history, config)


def kinds(report: NodeReport) -> list[tuple[str, Optional[int]]]:
    return [(f.kind, f.pid) for f in report.findings]


# -- 10: unkillable --------------------------------------------------------------------------------
def test_10_uninterruptible_sleep_over_several_polls_is_unkillable_and_a_blip_is_not() -> None:
    history = History()
    launcher = proc(10, 1, pgid=10)
    stuck = proc(11, 10, gpu=8 * GIB, pgid=10)
    assert kinds(run(history, snapshot(1000.0, launcher, stuck))) == []
    for t in (1002.0, 1010.0, 1020.0):  # in D since 1002, less than 30 s so far
        report = run(history, snapshot(t, launcher, proc(11, 10, gpu=8 * GIB, pgid=10,
                                                         state="disk-sleep")))
        assert kinds(report) == []
    report = run(history, snapshot(1033.0, launcher, proc(11, 10, gpu=8 * GIB, pgid=10,
                                                          state="disk-sleep")))
    (f,) = report.findings
    assert (f.kind, f.pid, f.severity, f.gpu_memory_bytes) == ("unkillable", 11, "critical",
                                                               8 * GIB)
    assert "since 00:16:42Z" in f.reason  # 1002 s after the epoch
    # Back to sleeping for one poll: the clock starts again.
    run(history, snapshot(1034.0, launcher, stuck))
    report = run(history, snapshot(1040.0, launcher, proc(11, 10, gpu=8 * GIB, pgid=10,
                                                          state="disk-sleep")))
    assert kinds(report) == []


def stuck_for_long(history: History, p: HostProcess, launcher: HostProcess) -> NodeReport:
    run(history, snapshot(1000.0, launcher, p))
    return run(history, snapshot(1040.0, launcher, p))


def test_10_stuck_in_the_nvidia_driver_is_critical_even_without_gpu_memory() -> None:
    launcher = proc(10, 1, pgid=10)
    for wchan, stack in (("uvm_va_space_destroy", ()),
                         (None, ("os_acquire_mutex [nvidia]", "rm_free_unused_clients"))):
        stuck = proc(11, 10, pgid=10, state="disk-sleep", wchan=wchan, kernel_stack=stack)
        (f,) = stuck_for_long(History(), stuck, launcher).findings
        assert (f.kind, f.severity) == ("unkillable", "critical")
        assert "waits in the NVIDIA driver (" in f.reason


def test_10_stuck_elsewhere_holding_no_gpu_memory_is_only_a_warning() -> None:
    """A checkpoint write to a hung NFS server: worth knowing, no reason to drain the node."""
    stuck = proc(11, 10, pgid=10, state="disk-sleep", wchan="nfs_wait_bit_killable",
                 kernel_stack=("nfs_wait_bit_killable [nfs]", "__wait_on_bit"))
    (f,) = stuck_for_long(History(), stuck, proc(10, 1, pgid=10)).findings
    assert (f.kind, f.severity) == ("unkillable", "warning")
    assert "waits in nfs_wait_bit_killable, not in the GPU driver, and holds no GPU memory" \
        in f.reason
    holding = replace(stuck, gpu_usage=(GpuProcessUsage(0, "GPU-0", 11, GIB),))
    (f,) = stuck_for_long(History(), holding, proc(10, 1, pgid=10)).findings
    assert f.severity == "critical"
    assert "holds GPU memory while waiting in nfs_wait_bit_killable" in f.reason


def test_a_reason_stays_as_first_given_while_the_finding_is_open() -> None:
    """The launcher is a zombie when the orphan is first seen, and reaped a poll later: the
    evidence read differently then, but the reason people and alerts saw does not change."""
    history = History()
    launcher = proc(10, 1, pgid=10, name="torchrun")
    run(history, snapshot(1.0, launcher, proc(11, 10, gpu=GIB, pgid=10)))
    orphaned = proc(11, 1, gpu=GIB, pgid=10)
    (first,) = run(history, snapshot(2.0, replace(launcher, state="zombie"), orphaned)).findings
    assert first.kind == "orphan" and "(not reaped yet)" in first.reason
    for t in (3.0, 4.0):  # the launcher is gone now
        (f,) = run(history, snapshot(t, orphaned)).findings
        assert (f.reason, f.since) == (first.reason, 2.0)
    # A history that never saw the launcher as a zombie words the same evidence otherwise.
    other = History()
    run(other, snapshot(1.0, launcher, proc(11, 10, gpu=GIB, pgid=10)))
    (fresh,) = run(other, snapshot(4.0, orphaned)).findings
    assert "exited after 00:00:01Z" in fresh.reason and fresh.reason != first.reason


def test_every_finding_and_process_carries_the_job_of_the_tree_it_was_first_seen_in() -> None:
    """The launcher and a helper carry no job variables; the trainer does. When the trainer
    ends, the helper's leftover finding names the job, so `reap --job` finds it."""
    history = History()
    job = Job("e0cc1a2b", "torchelastic")
    launcher = proc(10, 1, pgid=10, name="torchrun")
    trainer = proc(11, 10, gpu=GIB, pgid=10, job=job)
    helper = proc(12, 10, pgid=10, name="redis-server")
    report = run(history, snapshot(1.0, launcher, trainer, helper))
    assert report.job_of(launcher) == job and report.job_of(helper) == job
    run(history, snapshot(2.0, launcher, helper))  # the trainer ended
    (f,) = run(history, snapshot(30.0, launcher, helper)).findings
    assert (f.kind, f.pid, f.job) == ("leftover", 12, job)


def test_pid_reuse_never_inherits_the_old_processes_lineage_or_finding() -> None:
    history = History()
    launcher = proc(10, 1, pgid=10)
    run(history, snapshot(1.0, launcher, proc(11, 10, start=100.0, gpu=GIB, pgid=10)))
    report = run(history, snapshot(2.0, proc(11, 1, start=100.0, gpu=GIB, pgid=10)))
    assert kinds(report) == [("orphan", 11)]
    # PID 11 again, but started later: another process, whose parent (1) is its first parent.
    report = run(history, snapshot(3.0, proc(11, 1, start=150.0, gpu=GIB)))
    assert kinds(report) == []


def test_finding_since_is_kept_while_open_and_reset_once_closed() -> None:
    history = History()
    launcher = proc(10, 1, pgid=10)
    run(history, snapshot(1.0, launcher, proc(11, 10, gpu=GIB, pgid=10)))
    orphaned = proc(11, 1, gpu=GIB, pgid=10)
    assert run(history, snapshot(2.0, orphaned)).findings[0].since == 2.0
    assert run(history, snapshot(3.0, orphaned)).findings[0].since == 2.0
    assert run(history, snapshot(4.0)).findings == ()


def test_without_history_a_ranked_gpu_worker_under_a_subreaper_is_an_orphan_only_if_it_does_not_lead_its_group(  # noqa: E501
        ) -> None:
    env = MappingProxyType({"LOCAL_RANK": "1", "WORLD_SIZE": "2"})
    reaper = proc(50, 1, name="tini")
    adopted = proc(51, 50, gpu=GIB, pgid=40, launch_env=env, start=0.0)
    started_by_it = proc(52, 50, gpu=GIB, pgid=52, launch_env=env, start=0.0)
    report = run(History(), snapshot(100.0, reaper, adopted, started_by_it))
    assert kinds(report) == [("orphan", 51)]
    assert report.findings[0].reason.startswith("reparented to 50 (tini); environment has ")


def test_without_history_a_worker_under_its_namespace_init_is_an_orphan_unless_init_launched_it(
        ) -> None:
    env = MappingProxyType({"LOCAL_RANK": "1", "WORLD_SIZE": "2"})
    elastic = MappingProxyType({**env, "TORCHELASTIC_RUN_ID": "r1"})
    unshare = proc(30, 1, name="unshare")
    script = proc(40, 30, name="bash", pgid=30, namespace_pids=(1,),
                  cmdline=("bash", "-c", "torchrun train.py; cleanup"))

    def worker(pid: int, parent: int, **kw: Any) -> HostProcess:
        fields: dict[str, Any] = {"pgid": 30, "launch_env": elastic,
                                  "namespace_pids": (pid - 30,),
                                  "cmdline": ("python", "-u", "train.py"), "start": 0.0}
        fields.update(kw)
        return proc(pid, parent, gpu=GIB, **fields)

    adopted = worker(41, 40)
    report = run(History(), snapshot(100.0, unshare, script, adopted))
    assert kinds(report) == [("orphan", 41)]
    assert report.findings[0].reason.startswith(
        "reparented to 40 (bash), PID 1 of its PID namespace; environment has LOCAL_RANK=1")
    # Ranks a shell loop started itself, with no launcher's variable: healthy, whatever runs
    # them (`bash -c 'for r in 0 1; do RANK=$r LOCAL_RANK=$r python train.py & done; wait'`).
    assert kinds(run(History(), snapshot(100.0, unshare, script,
                                         worker(41, 40, launch_env=env)))) == []
    # Leading its own group: the container's command, started on purpose by its init, unless
    # a torchrun agent (the only one that sets its run id) started it.
    assert kinds(run(History(), snapshot(100.0, unshare, script,
                                         worker(42, 40, pgid=42, launch_env=env)))) == []
    assert kinds(run(History(), snapshot(100.0, unshare, script,
                                         worker(43, 40, pgid=43, launch_env=elastic)))) == [
        ("orphan", 43)]
    # In a namespace nested deeper, the shell is not its init.
    assert kinds(run(History(), snapshot(100.0, unshare, script,
                                         worker(44, 40, namespace_pids=(9, 3))))) == []

    # Inits that may be the worker's own launcher, alive: `docker run IMAGE torchrun ...`, a
    # rank that starts ranks, a program whose fork or multiprocessing child the worker is.
    for init in (proc(40, 30, name="torchrun", pgid=30, namespace_pids=(1,)),
                 proc(40, 30, name="python", pgid=30, namespace_pids=(1,),
                      cmdline=("python", "-m", "torch.distributed.run", "train.py")),
                 proc(40, 30, name="python", pgid=30, namespace_pids=(1,), gpu=GIB),
                 proc(40, 30, name="python", pgid=30, namespace_pids=(1,),
                      launch_env=MappingProxyType({"MASTER_ADDR": "10.0.0.1"})),
                 proc(40, 30, name="python", pgid=30, namespace_pids=(1,),
                      cmdline=("python", "-u", "train.py"))):
        assert kinds(run(History(), snapshot(100.0, unshare, init, worker(41, 40)))) == [], init
    spawned = worker(41, 40, cmdline=("python", "-c", "from multiprocessing.spawn import "
                                      "spawn_main; spawn_main()", "--multiprocessing-fork"))
    assert kinds(run(History(), snapshot(100.0, unshare, script, spawned))) == []


def test_without_history_a_ranked_worker_whose_group_leader_exited_is_an_orphan_of_any_subreaper(
        ) -> None:
    env = MappingProxyType({"RANK": "0", "TORCHELASTIC_RUN_ID": "r2"})
    entrypoint = proc(60, 1, name="entrypoint-x", cmdline=("python", "/srv/entrypoint-x"))
    adopted = proc(62, 60, gpu=GIB, pgid=61, launch_env=env, start=0.0)
    gone = frozenset({61})
    report = run(History(), snapshot(100.0, entrypoint, adopted, gone_group_leaders=gone))
    assert kinds(report) == [("orphan", 62)]
    assert report.findings[0].reason.startswith(
        "reparented to 60 (entrypoint-x); the leader of its process group, 61, has exited; "
        "environment has RANK=0, TORCHELASTIC_RUN_ID")
    # The leader still runs; or the parent is in that group itself (a launcher daemonized by a
    # double fork: the process that made the group exited, the launcher did not).
    assert kinds(run(History(), snapshot(100.0, entrypoint, adopted))) == []
    daemonized = replace(entrypoint, pgid=61)
    assert kinds(run(History(), snapshot(100.0, daemonized, adopted,
                                         gone_group_leaders=gone))) == []
    # Ranks with no launcher's variable: a script's own, whoever started them.
    scripted = replace(adopted, launch_env=MappingProxyType({"RANK": "0", "WORLD_SIZE": "2"}))
    assert kinds(run(History(), snapshot(100.0, entrypoint, scripted,
                                         gone_group_leaders=gone))) == []
    # A member holding no GPU memory is not judged by its group's leader.
    idle = replace(adopted, gpu_usage=())
    assert kinds(run(History(), snapshot(100.0, entrypoint, idle,
                                         gone_group_leaders=gone))) == []


def test_without_history_a_young_worker_waits_for_min_age_and_a_plain_service_never_counts(
        ) -> None:
    env = MappingProxyType({"RANK": "0", "MASTER_ADDR": "10.0.0.1"})
    young = proc(60, 1, gpu=GIB, launch_env=env, start=95.0)
    service = proc(61, 1, gpu=GIB, start=0.0, name="jupyter-lab")
    assert kinds(run(History(), snapshot(100.0, young, service))) == []
    assert kinds(run(History(), snapshot(106.0, young, service))) == [("orphan", 60)]


# -- protection: from what a user cannot set (docs/security.md, rule 2) ---------------------------
ROOTS_XORG = Executable("/usr/lib/xorg/Xorg", owner_uid=0, root_controlled=True)
WORKER_ENV = MappingProxyType({"LOCAL_RANK": "0"})
PROTECTING = DetectorConfig(min_age=0.0, protected_names=("Xorg", "gpuwatch"),
                            protected_executables=("/opt/vendor/bin/gpu-agent",),
                            protected_units=("nvidia-persistenced.service",),
                            protected_users=("svc",))


def worker(pid: int, **kw: Any) -> HostProcess:
    """An orphaned rank holding GPU memory: an orphan unless something protects it."""
    return proc(pid, 1, gpu=GIB, launch_env=WORKER_ENV, start=0.0, **kw)


def orphans_of(*procs: HostProcess) -> list[Optional[int]]:
    return [pid for kind, pid in kinds(run(History(), snapshot(100.0, *procs), PROTECTING))
            if kind == "orphan"]


def test_a_process_that_names_itself_xorg_or_gpuwatch_is_judged_like_any_other() -> None:
    # comm and argv are the process's own to set (prctl(PR_SET_NAME), a link named Xorg).
    by_comm = worker(70, name="Xorg", cmdline=("Xorg", ":0"),
                     exe=Executable("/usr/bin/python3.11", owner_uid=0, root_controlled=True))
    own_copy = worker(71, name="Xorg",
                      exe=Executable("/home/mallory/Xorg", owner_uid=994, root_controlled=False))
    # A root-owned file named Xorg that root alone does not hold (a hard link left in /tmp).
    linked = worker(72, name="Xorg",
                    exe=Executable("/tmp/x/Xorg", owner_uid=0, root_controlled=False))
    unknown = worker(73, name="gpuwatch", exe=None)
    assert orphans_of(by_comm, own_copy, linked, unknown) == [70, 71, 72, 73]
    for p in (by_comm, own_copy, linked, unknown):
        assert protected_by(p, PROTECTING) is None


def test_a_protected_name_protects_roots_process_running_roots_file_of_that_name() -> None:
    xorg = worker(74, name="Xorg", user="root", uid=0, exe=ROOTS_XORG)
    renamed = worker(75, name="X", user="root", uid=0, exe=ROOTS_XORG)  # comm does not matter
    assert orphans_of(xorg, renamed) == []
    assert protected_by(xorg, PROTECTING) == (
        "it runs /usr/lib/xorg/Xorg, root's Xorg (detectors.protected_names)")


def test_roots_file_run_by_a_user_protects_nothing() -> None:
    # Anyone may run root's Xorg, with code of their own in it (LD_PRELOAD, its modules): a
    # user's process running it is theirs, rootless Xorg on a desktop included.
    users = worker(81, name="Xorg", user="mallory", uid=1001, exe=ROOTS_XORG)
    unknown_uid = worker(82, name="Xorg", user=None, uid=None, exe=ROOTS_XORG)
    assert orphans_of(users, unknown_uid) == [81, 82]


def test_a_protected_executable_is_its_path_and_only_while_root_holds_the_file() -> None:
    agent = Executable("/opt/vendor/bin/gpu-agent", owner_uid=0, root_controlled=True)
    loose = Executable("/opt/vendor/bin/gpu-agent", owner_uid=0, root_controlled=False)
    assert orphans_of(worker(76, uid=0, exe=agent), worker(77, uid=0, exe=loose)) == [77]
    assert protected_by(worker(76, uid=0, exe=agent), PROTECTING) == (
        "it runs /opt/vendor/bin/gpu-agent (detectors.protected_executables)")


def test_a_protected_unit_or_user_protects_whatever_the_process_runs_or_reads() -> None:
    in_unit = worker(78, system_unit="nvidia-persistenced.service")
    by_user = worker(79, user="svc", exe=None)  # its executable unreadable: the uid still counts
    other_unit = worker(80, system_unit="user@994.service", name="nvidia-persistenced")
    assert orphans_of(in_unit, by_user, other_unit) == [80]
    assert protected_by(in_unit, PROTECTING) == (
        "it runs in the system unit nvidia-persistenced.service (detectors.protected_units)")
    assert protected_by(by_user, PROTECTING) == "its user svc is in detectors.protected_users"


def test_by_default_nvidias_node_services_stay_protected_under_accounts_of_their_own() -> None:
    # The persistence daemon drops root (--user nvidia-persistenced): by name it would no longer
    # be protected, by its system unit it is, and a user's own unit of that name is not.
    defaults = DetectorConfig()
    own_account = worker(83, name="nvidia-persiste", user="nvidia-persistenced", uid=998,
                         exe=Executable("/usr/bin/nvidia-persistenced", owner_uid=0,
                                        root_controlled=True),
                         system_unit="nvidia-persistenced.service")
    users_unit = worker(84, name="nvidia-persiste", user="mallory", uid=1001,
                        system_unit="user@1001.service")
    assert protected_by(own_account, defaults) == (
        "it runs in the system unit nvidia-persistenced.service (detectors.protected_units)")
    assert protected_by(users_unit, defaults) is None


def test_a_zombie_is_reported_only_after_its_grace_period() -> None:
    history = History()
    parent = proc(80, 1, gpu=GIB)
    child = proc(81, 80, state="zombie", num_threads=1, pgid=80)
    assert kinds(run(history, snapshot(10.0, parent, child))) == []
    assert kinds(run(history, snapshot(14.0, parent, child))) == []
    assert kinds(run(history, snapshot(15.5, parent, child))) == [("zombie", 81)]


def test_a_member_without_gpu_memory_is_an_orphan_while_its_job_trains_a_leftover_after() -> None:
    history = History()
    launcher = proc(10, 1, pgid=10)
    trainer = proc(11, 10, gpu=GIB, pgid=10, launch_env=RANK_0)
    helper = proc(12, 10, pgid=10, cmdline=("redis-server", "--port", "6380"))
    run(history, snapshot(1.0, launcher, trainer, helper))
    # The launcher dies; the trainer still trains: both it and the helper are orphans.
    report = run(history, snapshot(2.0, proc(11, 1, gpu=GIB, pgid=10, launch_env=RANK_0),
                                   proc(12, 1, pgid=10,
                                        cmdline=("redis-server", "--port", "6380"))))
    assert sorted(kinds(report)) == [("orphan", 11), ("orphan", 12)]
    # The trainer ends: the helper is no orphan any more, and a leftover once the grace is over.
    lone = proc(12, 1, pgid=10, cmdline=("redis-server", "--port", "6380"))
    assert kinds(run(history, snapshot(3.0, lone))) == []
    assert kinds(run(history, snapshot(22.0, lone))) == []
    report = run(history, snapshot(23.5, lone))
    assert kinds(report) == [("leftover", 12)]
    assert report.findings[0].reason.startswith("`redis-server --port 6380` still runs")


def test_trainers_hidden_by_a_driver_fault_keep_their_helpers_from_being_leftovers() -> None:
    """Found by the soak: while NVML or a GPU's process list fails, no process is seen holding
    memory; that is not the trainers ending."""
    history = History()
    launcher = proc(10, 1, pgid=10, name="torchrun")
    trainer = proc(11, 10, gpu=GIB, pgid=10)
    helper = proc(12, 10, pgid=10, cmdline=("redis-server",))
    hidden = proc(11, 10, pgid=10)  # alive, its memory not visible
    gpu = GpuDevice(index=0, memory_used_bytes=GIB)
    unreadable = GpuDevice(index=0, memory_used_bytes=GIB, errors=(NvmlCallError(
        "nvmlDeviceGetComputeRunningProcesses_v3", 10, "Timeout"),))
    driver_gone = replace(snapshot(0.0), nvml=NvmlStatus(available=False, error="Driver gone"))
    run(history, snapshot(1.0, launcher, trainer, helper, gpus=(gpu,)))
    for t in (2.0, 30.0, 60.0):
        assert kinds(run(history, replace(snapshot(t, launcher, hidden, helper),
                                         nvml=driver_gone.nvml))) == []
        assert kinds(run(history, snapshot(t + 1, launcher, hidden, helper,
                                           gpus=(unreadable,)))) == []
    # The lists answer again and the trainer holds nothing: now it has finished, and what of
    # its job still runs is left over once the grace is past.
    free = GpuDevice(index=0, memory_used_bytes=0)
    assert kinds(run(history, snapshot(62.0, launcher, hidden, helper, gpus=(free,)))) == []
    assert kinds(run(history, snapshot(81.0, launcher, hidden, helper, gpus=(free,)))) == []
    assert sorted(kinds(run(history, snapshot(83.0, launcher, hidden, helper, gpus=(free,))))) \
        == [("leftover", 11), ("leftover", 12)]


def test_a_gpu_whose_handle_failed_keeps_its_jobs_trainer_from_being_a_leftover() -> None:
    """A GPU that fell off the bus answers no handle, so no process list is even asked for:
    who holds its memory is as unknown as when the list itself fails, and the trainer last
    seen on it still trains."""
    history = History()
    launcher = proc(10, 1, pgid=10, name="torchrun")
    trainer = proc(11, 10, gpu=GIB, pgid=10)
    helper = proc(12, 10, pgid=10, cmdline=("redis-server",))
    hidden = proc(11, 10, pgid=10)  # alive, its memory not visible
    no_handle = GpuDevice(index=0, errors=(NvmlCallError(
        "nvmlDeviceGetHandleByIndex_v2", 15, "GPU is lost"),))
    assert no_handle.holders_unknown and not no_handle.process_list_unread
    run(history, snapshot(1.0, launcher, trainer, helper, gpus=(GpuDevice(index=0),)))
    for t in (2.0, 30.0, 60.0):
        assert kinds(run(history, snapshot(t, launcher, hidden, helper,
                                           gpus=(no_handle,)))) == []


# -- leftovers need evidence of one finished job ---------------------------------------------------
def ended(history: History, root: HostProcess, trainer: HostProcess,
          *others: HostProcess, observer: Optional[int] = None) -> list[tuple[str, Optional[int]]]:
    """Run the tree with its trainer, then without it past the grace: the findings then."""
    def snap(t: float, *procs: HostProcess) -> NodeSnapshot:
        return replace(snapshot(t, *procs), observer_pid=observer)

    run(history, snap(1.0, root, trainer, *others))
    run(history, snap(2.0, root, *others))
    return kinds(run(history, snap(30.0, root, *others)))


def test_children_of_a_common_parent_with_no_evidence_of_a_job_are_never_leftovers() -> None:
    """A harness, an IDE, a service of any name: a parent whose GPU-holding child ended, with
    other children, is not a launcher whose job finished."""
    parent = proc(10, 1, pgid=10, cmdline=("python", "-m", "pytest"))
    driver = proc(11, 10, gpu=GIB, pgid=10, cmdline=("python", "drive.py"))
    other = proc(12, 10, pgid=10, cmdline=("python", "-m", "http.server"))
    assert ended(History(), parent, driver, other) == []


def test_each_kind_of_evidence_of_a_finished_job_makes_its_helpers_leftovers() -> None:
    helper = proc(12, 10, pgid=10, cmdline=("redis-server",))
    plain = proc(10, 1, pgid=10, cmdline=("python", "launch.py"))
    for root, trainer in (
            (proc(10, 1, pgid=10, name="torchrun"), proc(11, 10, gpu=GIB, pgid=10)),
            (proc(10, 1, pgid=10, cmdline=("python", "-m", "torch.distributed.run")),
             proc(11, 10, gpu=GIB, pgid=10)),
            (plain, proc(11, 10, gpu=GIB, pgid=10, launch_env=RANK_0)),
            (plain, proc(11, 10, gpu=GIB, pgid=10,
                         launch_env=MappingProxyType({"OMPI_COMM_WORLD_RANK": "0"}))),
            (plain, proc(11, 10, gpu=GIB, pgid=10,
                         launch_env=MappingProxyType({"GPUWATCH_RUN_ID": "train-1"})))):
        assert ended(History(), root, trainer, helper) == [("leftover", 12)], (root, trainer)
    # RANK and LOCAL_RANK alone: a script may set them itself, which says no launcher.
    ranked = proc(11, 10, gpu=GIB, pgid=10, launch_env=MappingProxyType({"RANK": "0"}))
    assert ended(History(), plain, ranked, helper) == []


def _told_it_finished() -> tuple[list[HostProcess], Mapping[int, AgentReading]]:
    """`sh -c "train & redis & wait"` whose trainer (11, holding GPU memory) told the agent it
    finished at 1.5, and its helper 12."""
    root = proc(10, 1, pgid=10, sid=5, name="sh")
    trainer = proc(11, 10, gpu=GIB, pgid=10)
    helper = proc(12, 10, pgid=10, cmdline=("redis-server",))
    done = AgentReading(pid=11, uid=1000, first_seen=0.5, last_seen=1.5, step=9,
                        step_changed_at=1.5, finished_at=1.5, exit_report=None, points=(),
                        latest=None)
    return [root, trainer, helper], MappingProxyType({11: done})


def test_a_trainer_that_told_the_agent_it_finished_is_evidence_of_a_finished_job() -> None:
    history = History()
    (root, trainer, helper), agents = _told_it_finished()
    run(history, snapshot(1.0, root, trainer, helper))
    run(history, replace(snapshot(2.0, root, trainer, helper), agents=agents))
    report = run(history, replace(snapshot(30.0, root, trainer, helper), agents=agents))
    assert sorted(kinds(report)) == [("leftover", 11), ("leftover", 12)]


def test_a_trainer_first_seen_after_it_told_the_agent_it_finished_still_finishes_its_job(
        ) -> None:
    """A daemon that starts, or first sees the trainer's GPU memory, only after the trainer's
    finished report: the job still had a trainer, and its helpers are still leftovers."""
    history = History()
    (root, trainer, helper), agents = _told_it_finished()
    run(history, replace(snapshot(2.0, root, trainer, helper), agents=agents))
    report = run(history, replace(snapshot(30.0, root, trainer, helper), agents=agents))
    assert sorted(kinds(report)) == [("leftover", 11), ("leftover", 12)]


def test_a_tree_that_holds_a_service_never_has_leftovers_whatever_its_evidence() -> None:
    """Ray's raylet and its `ray::` workers and agents, a notebook server and its kernels: even
    where the whole tree inherited a launcher's variables (`srun ray start`, PMI_RANK in every
    process), and inside a Slurm job whose step is a launcher."""
    pmi = MappingProxyType({"PMI_RANK": "0"})
    raylet = proc(10, 1, pgid=10, name="raylet", cmdline=("raylet",), launch_env=pmi)
    actor = proc(11, 10, gpu=GIB, name="ray::Actor", cmdline=("ray::Actor",), launch_env=pmi)
    agents = [proc(pid, 10, name=title[:15], cmdline=(title,), launch_env=pmi)
              for pid, title in ((12, "ray::DashboardAgent"), (13, "ray::RuntimeEnvAgent"))]
    assert ended(History(), raylet, actor, *agents) == []

    server = proc(20, 1, name="jupyter-lab",
                  cmdline=("/usr/bin/python3", "/usr/local/bin/jupyter-lab", "--no-browser"))
    kernel = ("python", "-m", "ipykernel_launcher", "-f", "/run/kernel-1.json")
    gpu_kernel = proc(21, 20, gpu=GIB, cmdline=kernel, launch_env=RANK_0)
    kernels = [proc(pid, 20, cmdline=kernel) for pid in (22, 23)]
    assert ended(History(), server, gpu_kernel, *kernels) == []

    job = Job("4242", "slurm")
    stepd = proc(30, 1, name="slurmstepd", job=job)
    script = proc(31, 30, name="bash", sid=31, pgid=31, job=job)
    in_job = proc(32, 31, name="python", job=job,
                  cmdline=("python", "-m", "jupyter_server", "--port", "8888"))
    cell = proc(33, 32, gpu=GIB, job=job, cmdline=kernel)
    redis = proc(34, 31, job=job, cmdline=("redis-server",))
    assert ended(History(), stepd, cell, script, in_job, redis) == []


def test_in_an_interactive_slurm_allocation_only_what_the_launcher_started_is_left_over() -> None:
    """`srun --pty bash`, then torchrun in it: the shell, its editor and torchrun share the
    Slurm job's tree with the workers, but only torchrun's helper was started by the job."""
    job = Job("4242", "slurm")
    stepd = proc(30, 1, name="slurmstepd", job=job)
    shell = proc(31, 30, name="bash", sid=31, pgid=31, job=job)
    editor = proc(32, 31, name="vim", sid=31, pgid=32, job=job, cmdline=("vim", "train.py"))
    torchrun = proc(33, 31, name="torchrun", sid=31, pgid=33, job=job)
    worker = proc(34, 33, gpu=GIB, sid=31, pgid=33, job=job, launch_env=RANK_0)
    helper = proc(35, 33, sid=31, pgid=33, job=job, cmdline=("redis-server",))
    assert ended(History(), stepd, worker, shell, editor, torchrun, helper) == [
        ("leftover", 35)]
    # A trainer run straight from that shell, which told the agent it finished: the shell's
    # other children are still the user's.
    history = History()
    trainer = proc(36, 31, gpu=GIB, sid=31, pgid=36, job=job)
    done = AgentReading(pid=36, uid=1000, first_seen=0.5, last_seen=1.5, step=9,
                        step_changed_at=1.5, finished_at=1.5, exit_report=None, points=(),
                        latest=None)
    lingering = replace(trainer, gpu_usage=())
    run(history, snapshot(1.0, stepd, shell, editor, trainer))
    run(history, replace(snapshot(2.0, stepd, shell, editor, lingering),
                         agents=MappingProxyType({36: done})))
    report = run(history, replace(snapshot(30.0, stepd, shell, editor, lingering),
                                  agents=MappingProxyType({36: done})))
    assert kinds(report) == []


def test_launcher_variables_a_trainer_inherited_from_its_parent_are_no_evidence() -> None:
    """`srun --mpi=pmi2` gives PMI_RANK to the task and all it starts: a service or a script
    under it passes the variable on; only a variable the parent lacks was set by it."""
    pmi = MappingProxyType({"PMI_RANK": "0"})
    server = proc(10, 1, pgid=10, cmdline=("python", "serve.py"), launch_env=pmi)
    worker = proc(11, 10, gpu=GIB, pgid=10, cmdline=("python", "serve.py"), launch_env=pmi)
    other = proc(12, 10, pgid=10, cmdline=("python", "serve.py"), launch_env=pmi)
    assert ended(History(), server, worker, other) == []


def test_the_process_that_took_the_snapshot_is_never_a_leftover() -> None:
    """The daemon started by a harness that also ran a launcher-started driver."""
    harness = proc(10, 1, pgid=10, cmdline=("python", "-m", "pytest"))
    driver = proc(11, 10, gpu=GIB, pgid=10, launch_env=RANK_0)
    daemon = proc(12, 10, pgid=10, cmdline=("python3", "-m", "gpuwatch", "daemon"))
    helper = proc(13, 10, pgid=10, cmdline=("redis-server",))
    assert ended(History(), harness, driver, daemon, helper, observer=12) == [("leftover", 13)]


def test_service_shapes_are_known_by_name_module_title_and_rays_programs() -> None:
    def shaped(name: str, *args: str) -> bool:
        return is_service(proc(5, 1, name=name, cmdline=args))

    assert shaped("raylet", "/x/ray/core/src/ray/raylet/raylet", "--node_ip_address=1.2.3.4")
    assert shaped("gcs_server", "/x/ray/core/src/ray/gcs/gcs_server")
    assert shaped("ray::IDLE", "ray::IDLE")
    assert shaped("python", "python", "/x/site-packages/ray/dashboard/agent.py", "--a=b")
    assert shaped("python", "python", "/x/site-packages/ray/_private/workers/default_worker.py")
    assert shaped("jupyter-lab", "/usr/bin/python3", "/usr/local/bin/jupyter-lab")
    assert shaped("python", "python", "-m", "jupyter_server")
    assert shaped("python", "python", "-m", "ipykernel_launcher", "-f", "/k.json")
    assert not shaped("torchrun", "/usr/bin/python3", "/usr/local/bin/torchrun", "t.py")
    assert not shaped("python", "python", "train.py", "--out", "/data/ray/_private/x.py")
    assert not shaped("python", "python", "-m", "torch.distributed.run", "t.py")


def test_a_login_shell_is_never_a_job_root() -> None:
    shell = proc(20, 1, name="bash", sid=20, pgid=20)
    trainer = proc(21, 20, gpu=GIB, pgid=21, sid=20)
    editor = proc(22, 20, name="vim", pgid=22, sid=20)
    history = History()
    run(history, snapshot(1.0, shell, trainer, editor))
    run(history, snapshot(2.0, shell, editor))  # the training run ends
    assert kinds(run(history, snapshot(60.0, shell, editor))) == []  # vim is no leftover


def test_slurm_jobs_climb_to_the_step_through_ancestors_of_the_same_job() -> None:
    job = Job("41234", "slurm")
    stepd = proc(30, 1, name="slurmstepd", job=job)
    batch = proc(31, 30, name="bash", sid=31, pgid=31, job=job)
    torchrun = proc(32, 31, name="torchrun", sid=31, pgid=31, job=job)
    worker = proc(33, 32, gpu=GIB, sid=31, pgid=31, job=job)
    roots = snapshot(1.0, stepd, batch, torchrun, worker).job_roots
    assert roots[33] == 30


def test_unattributed_memory_below_the_threshold_is_no_ghost() -> None:
    config = DetectorConfig(ghost_min_bytes=GIB, ghost_grace=0.0)
    small = GpuDevice(index=0, memory_used_bytes=GIB // 2)
    large = GpuDevice(index=1, memory_used_bytes=3 * GIB)
    report = run(History(), snapshot(1.0, gpus=(small, large)), config)
    assert [(f.kind, f.pid, f.gpus) for f in report.findings] == [("ghost", None, (1,))]


def test_a_ghost_must_outlast_the_grace_and_a_one_poll_excess_from_churn_never_is_one() -> None:
    """A holder exiting between NVML's memory figure, its process list and /proc leaves, for a
    poll, memory no listed process accounts for and a listed PID /proc lacks."""
    config = DetectorConfig(ghost_min_bytes=GIB, ghost_grace=10.0)
    history = History()
    dead = proc(4000, 1, gpu=2 * GIB, in_procfs=False)
    excess = GpuDevice(index=0, memory_used_bytes=3 * GIB)
    quiet = GpuDevice(index=0, memory_used_bytes=0)
    for t in (0.0, 2.0, 4.0):  # churn: one poll shows it, the next does not
        assert kinds(run(history, snapshot(t, dead, gpus=(excess,)), config)) == []
        assert kinds(run(history, snapshot(t + 1.0, gpus=(quiet,)), config)) == []
    for t in (10.0, 12.0, 16.0, 19.0):  # a dead context: there every poll, still within grace
        assert kinds(run(history, snapshot(t, dead, gpus=(excess,)), config)) == []
    report = run(history, snapshot(20.0, dead, gpus=(excess,)), config)
    assert sorted(kinds(report), key=str) == [("ghost", 4000), ("ghost", None)]
    # One reading below the threshold inside the window is enough to hold the device ghost back.
    dip = GpuDevice(index=0, memory_used_bytes=GIB // 2)
    run(history, snapshot(22.0, dead, gpus=(dip,)), config)
    report = run(history, snapshot(24.0, dead, gpus=(excess,)), config)
    assert kinds(report) == [("ghost", 4000)]


def test_a_process_list_that_failed_leaves_unattributed_memory_unknown() -> None:
    """Found by the soak (bench/soak.py): a TIMEOUT on one GPU's compute-process list made all
    its used memory look unattributed, and a ghost finding appeared for memory its holders
    account for."""
    holder = GpuProcessUsage(0, "GPU-0", 4242, 8 << 30)
    complete = GpuDevice(index=0, memory_used_bytes=20 << 30, processes=(holder,))
    failed = GpuDevice(index=0, memory_used_bytes=20 << 30, errors=(NvmlCallError(
        "nvmlDeviceGetComputeRunningProcesses", 10, "Timeout"),))
    assert complete.unattributed_memory_bytes == 12 << 30
    assert failed.unattributed_memory_bytes is None
    no_grace = DetectorConfig(ghost_min_bytes=GIB, ghost_grace=0.0)
    assert kinds(run(History(), snapshot(1.0, gpus=(complete,)), no_grace)) == [("ghost", None)]
    assert kinds(run(History(), snapshot(1.0, gpus=(failed,)), no_grace)) == []


# -- `gpuwatch run`: a supervisor named in the environment -------------------------------------
RUN_JOB = Job("train-3fa91c", "run")


def supervised(pid: int, ppid: int, supervisor: int = 40, supervisor_start: float = 50.0,
               **kw: Any) -> HostProcess:
    """A process of the job run:train-3fa91c, as `gpuwatch run` (PID `supervisor`) started it."""
    env = MappingProxyType({"GPUWATCH_RUN_ID": RUN_JOB.id,
                            "GPUWATCH_RUN_SUPERVISOR": f"{supervisor}:{supervisor_start!r}"})
    return proc(pid, ppid, job=RUN_JOB, launch_env=env, **kw)


def with_supervisors(snap: NodeSnapshot, **by_pid: Optional[float]) -> NodeSnapshot:
    """The snapshot with what the poll found on each supervisor PID (`pid_40=50.0`)."""
    found = {int(key.removeprefix("pid_")): start for key, start in by_pid.items()}
    return replace(snap, run_supervisors=MappingProxyType(found))


def test_a_supervised_job_under_its_live_supervisor_raises_nothing() -> None:
    supervisor = proc(40, 1, start=50.0, name="gpuwatch")
    launcher = supervised(41, 40, name="torchrun")
    worker = supervised(42, 41, gpu=GIB)
    helper = supervised(43, 41, name="redis-server")
    snap = with_supervisors(snapshot(100.0, supervisor, launcher, worker, helper), pid_40=50.0)
    assert kinds(run(History(), snap)) == []


def test_a_supervisor_found_above_the_process_runs_whatever_its_start_time_reads() -> None:
    """A clock step between the supervisor's read of the boot time and the daemon's moves one
    start time against the other; a new process on a freed PID never becomes an ancestor."""
    supervisor = proc(40, 1, start=53.0, name="gpuwatch")
    worker = supervised(42, 40, gpu=GIB)
    snap = with_supervisors(snapshot(100.0, supervisor, worker), pid_40=53.0)
    assert kinds(run(History(), snap)) == []


def test_a_supervisor_inside_a_container_is_found_by_its_pid_there() -> None:
    """`gpuwatch run` as a container's command wrote its PID in the container's namespace."""
    shim = proc(30, 1, name="containerd-shim")
    supervisor = proc(12040, 30, start=50.0, name="gpuwatch", namespace_pids=(1,))
    worker = supervised(12042, 12040, supervisor=1, gpu=GIB, namespace_pids=(3,))
    snap = with_supervisors(snapshot(100.0, shim, supervisor, worker), pid_1=0.0)
    assert kinds(run(History(), snap)) == []
    inner = proc(12040, 30, start=50.0, name="sh", namespace_pids=(1,))
    supervisor = proc(12041, 12040, start=50.5, name="gpuwatch", namespace_pids=(7,))
    worker = supervised(12042, 12041, supervisor=7, supervisor_start=50.5, gpu=GIB,
                        namespace_pids=(8,))
    snap = with_supervisors(snapshot(100.0, shim, inner, supervisor, worker), pid_7=0.02)
    assert kinds(run(History(), snap)) == []
    # The supervisor killed: its worker goes to the container's init; host PID 7 is a kernel
    # thread that started at boot.
    orphaned = replace(worker, ppid=12040)
    snap = with_supervisors(snapshot(101.0, shim, inner, orphaned), pid_7=0.02)
    report = run(History(), snap)
    assert kinds(report) == [("orphan", 12042)]
    # The host's PID 7 is not the one the container's process meant: no word about it.
    assert report.findings[0].reason.endswith("of job run:train-3fa91c is gone")


def test_when_the_supervisor_is_gone_its_whole_job_is_orphaned_at_the_first_poll() -> None:
    launcher = supervised(41, 1, name="torchrun")
    worker = supervised(42, 41, gpu=GIB)
    helper = supervised(43, 41, name="redis-server", cmdline=("redis-server", "--port", "6380"))
    snap = with_supervisors(snapshot(100.0, launcher, worker, helper), pid_40=None)
    report = run(History(), snap)  # no history: a daemon started after the supervisor died
    found = {f.pid: f for f in report.findings}
    assert sorted(kinds(report)) == [("orphan", 41), ("orphan", 42), ("orphan", 43)]
    assert (found[42].severity, found[42].gpu_memory_bytes) == ("critical", GIB)
    assert found[41].severity == found[43].severity == "warning"
    assert found[43].gpu_memory_bytes is None
    for f in found.values():
        assert f.reason == ("its supervisor `gpuwatch run` (PID 40) of job run:train-3fa91c "
                            "is gone")
        assert f.job == RUN_JOB
    assert report.job_of(helper) == RUN_JOB


def test_a_supervisor_pid_reused_by_another_process_is_a_gone_supervisor() -> None:
    launcher = supervised(41, 1, name="torchrun")
    worker = supervised(42, 41, gpu=GIB)
    for other_start in (50.3, 51.37, 90.0):  # no whole number of seconds off: another process
        snap = with_supervisors(snapshot(100.0, launcher, worker), pid_40=other_start)
        report = run(History(), snap)
        assert sorted(kinds(report)) == [("orphan", 41), ("orphan", 42)]
        assert report.findings[0].reason.endswith(
            "is gone (PID 40 is another process now)")


def test_a_live_supervisor_outside_the_tree_is_read_on_its_pid() -> None:
    """The variables carried outside the supervisor's tree: its PID, with its start time give or
    take the whole seconds a clock step makes, says it still runs."""
    stray = supervised(60, 1, gpu=GIB)
    for start in (50.0, 51.0, 48.0):
        snap = with_supervisors(snapshot(100.0, stray), pid_40=start)
        assert kinds(run(History(), snap)) == []


def test_a_supervisor_started_after_a_clock_step_is_read_with_the_step() -> None:
    """The supervisor read the boot time after the wall clock stepped an hour forward; the
    daemon read it before: their start times differ by the step, which the snapshot knows."""
    stray = supervised(60, 1, gpu=GIB, supervisor_start=3650.0)
    stepped = replace(snapshot(100.0, stray), clock_step=3600.004)
    assert kinds(run(History(), with_supervisors(stepped, pid_40=50.0))) == []
    # Without the step, or with another one, it is another process on that PID.
    for step in (0.0, -3600.0):
        snap = with_supervisors(replace(stepped, clock_step=step), pid_40=50.0)
        assert kinds(run(History(), snap)) == [("orphan", 60)]


def test_nothing_is_concluded_about_a_supervisor_that_could_not_be_read() -> None:
    worker = supervised(42, 1, gpu=GIB)
    assert kinds(run(History(), snapshot(100.0, worker))) == []  # its PID not read
    # An ancestor missing from the snapshot: whether the supervisor is above is not known.
    cut = supervised(43, 41, gpu=GIB)
    assert kinds(run(History(), with_supervisors(snapshot(100.0, cut), pid_40=None))) == []


def test_a_malformed_supervisor_variable_is_no_evidence() -> None:
    for value in ("", "40", "abc:50.0", "40:", "40:nan", "-40:50.0", "0:50.0", "40:50.0:1"):
        env = MappingProxyType({"GPUWATCH_RUN_ID": "x", "GPUWATCH_RUN_SUPERVISOR": value})
        worker = proc(42, 1, gpu=GIB, launch_env=env)
        assert kinds(run(History(), with_supervisors(snapshot(100.0, worker), pid_40=None))) \
            == [], value


def test_under_a_live_supervisor_the_lineage_rules_apply_as_to_any_job() -> None:
    """Its launcher killed, a supervised job's workers are orphans until the supervisor ends
    them; its trainer finished, its helpers are leftovers until the supervisor ends them."""
    supervisor = proc(40, 1, start=50.0, name="gpuwatch")
    launcher = supervised(41, 40, name="torchrun", pgid=41)
    worker = supervised(42, 41, gpu=GIB, pgid=41)
    history = History()
    run(history, with_supervisors(snapshot(1.0, supervisor, launcher, worker), pid_40=50.0))
    adopted = replace(worker, ppid=40)
    report = run(history, with_supervisors(snapshot(2.0, supervisor, adopted), pid_40=50.0))
    assert kinds(report) == [("orphan", 42)]
    assert report.findings[0].reason.startswith("parent 41 (torchrun) exited")

    history = History()
    helper = supervised(43, 41, name="redis-server", pgid=41)
    run(history, with_supervisors(snapshot(1.0, supervisor, launcher, worker, helper),
                                  pid_40=50.0))
    run(history, with_supervisors(snapshot(2.0, supervisor, launcher, helper), pid_40=50.0))
    report = run(history, with_supervisors(snapshot(30.0, supervisor, launcher, helper),
                                           pid_40=50.0))
    assert kinds(report) == [("leftover", 43)]


def test_a_helper_whose_supervisor_is_gone_is_an_orphan_and_never_a_leftover_as_well() -> None:
    history = History()
    supervisor = proc(40, 1, start=50.0, name="gpuwatch")
    launcher = supervised(41, 40, name="torchrun", pgid=41)
    worker = supervised(42, 41, gpu=GIB, pgid=41)
    helper = supervised(43, 41, name="redis-server", pgid=41)
    run(history, with_supervisors(snapshot(1.0, supervisor, launcher, worker, helper),
                                  pid_40=50.0))
    orphaned = replace(launcher, ppid=1)
    for t in (2.0, 30.0, 60.0):  # the trainer ended with the supervisor; grace long past
        report = run(history, with_supervisors(snapshot(t, orphaned, helper), pid_40=None))
        assert sorted(kinds(report)) == [("orphan", 41), ("orphan", 43)]


# -- Kubernetes: a pod's allocation, and a pod gone from the kubelet's list ---------------------
POD_UID = "1843d150-6a2e-4b1f-9c3d-2a7e5f0b8c11"


def in_pod(p: HostProcess, *usage: GpuProcessUsage) -> HostProcess:
    return replace(p, pod_uid=POD_UID, gpu_usage=usage or p.gpu_usage,
                   job=Job(POD_UID, "kubernetes", namespace="ml-team", pod="trainer-0",
                           container="trainer"))


def with_pods(snap: NodeSnapshot, *pods: Pod) -> NodeSnapshot:
    return replace(snap, pods=MappingProxyType({p.uid: p for p in pods}))


def test_a_process_on_a_gpu_its_pod_was_not_allocated_is_unallocated_and_names_the_allocation(
        ) -> None:
    history = History()
    trainer = in_pod(proc(40, 1), GpuProcessUsage(0, "GPU-0", 40, 2 * GIB),
                     GpuProcessUsage(1, "GPU-1", 40, 3 * GIB))
    given = Pod(POD_UID, "ml-team", "trainer-0",
                allocated=MappingProxyType({"trainer": ("GPU-0::2",)}), listed=True)
    report = run(history, with_pods(snapshot(1000.0, trainer), given))
    (found,) = report.findings
    assert (found.kind, found.pid, found.gpus, found.gpu_memory_bytes) == \
        ("unallocated", 40, (1,), 3 * GIB)
    assert "GPU 1 (GPU-1)" in found.reason and "pod ml-team/trainer-0" in found.reason
    assert "given GPU-0" in found.reason and found.job is not None
    assert found.job.pod_name == "ml-team/trainer-0"
    # Given both (by index, as the device plugin's index strategy names them): nothing.
    both = replace(given, allocated=MappingProxyType({"trainer": ("GPU-0", "1")}))
    assert kinds(run(History(), with_pods(snapshot(1000.0, trainer), both))) == []
    # No word from the kubelet, or devices by Dynamic Resource Allocation: nothing to go on.
    for unknown in (replace(given, listed=None), replace(given, dynamic_resources=True)):
        assert kinds(run(History(), with_pods(snapshot(1000.0, trainer), unknown))) == []


def test_a_pod_gone_from_the_kubelets_list_leaves_an_orphan_whose_reason_names_it() -> None:
    history = History()
    trainer = in_pod(proc(40, 1, gpu=4 * GIB))
    live = Pod(POD_UID, "ml-team", "trainer-0", listed=True,
               allocated=MappingProxyType({"trainer": ("GPU-0",)}))
    assert kinds(run(history, with_pods(snapshot(1000.0, trainer), live))) == []
    gone = replace(live, listed=False, gone_since=1001.0)
    report = run(history, with_pods(snapshot(1004.0, trainer), gone))
    assert kinds(report) == [("orphan", 40)]
    (orphan,) = report.findings
    assert orphan.reason.startswith("pod ml-team/trainer-0 (UID 1843d150-") and \
        "gone from the kubelet's pods since" in orphan.reason
    assert "ml-team" not in orphan.summary and POD_UID in orphan.summary
    # Not sure yet (one answer without it): no orphan.
    unsure = replace(live, listed=None)
    assert kinds(run(History(), with_pods(snapshot(1004.0, trainer), unsure))) == []


# -- the kinds: one enumeration, and what each detector reports ----------------------------------
def test_the_kinds_are_exactly_what_the_detectors_declare_each_kind_one_detectors() -> None:
    declared = [kind for module in DETECTORS for kind in module.EMITS]
    assert sorted(declared) == sorted(KINDS), "a kind declared twice, or by no detector"
    assert set(KINDS) == set(Kind) and set(KINDS) >= REAPABLE_KINDS
    # A kind is its name wherever it is written: JSON, metric labels, f-strings, the audit log.
    assert [str(k) for k in KINDS] == [f"{k}" for k in KINDS] == [k.value for k in KINDS]
    assert Kind.ORPHAN == "orphan" and Kind("orphan") is Kind.ORPHAN


def test_every_kind_is_reported_in_some_scenario_by_the_detector_that_declares_it() -> None:
    """Runs scenarios of this module and of test_leak_detection under the fixture above, which
    fails on any finding outside its detector's EMITS; between them, every kind is raised."""
    from tests import test_leak_detection as leaks

    emitted_kinds.EMITTED.clear()
    scenarios = (
        test_10_uninterruptible_sleep_over_several_polls_is_unkillable_and_a_blip_is_not,
        test_a_zombie_is_reported_only_after_its_grace_period,
        test_a_member_without_gpu_memory_is_an_orphan_while_its_job_trains_a_leftover_after,
        test_a_ghost_must_outlast_the_grace_and_a_one_poll_excess_from_churn_never_is_one,
        leaks.test_a_buffer_leaking_4_mib_a_step_is_named_within_10_steps_after_warm_up,
        leaks.test_a_stalled_step_is_flagged_after_the_threshold_and_cleared_when_steps_resume,
        test_a_process_on_a_gpu_its_pod_was_not_allocated_is_unallocated_and_names_the_allocation)
    for scenario in scenarios:
        scenario()
    by_module = {module.__name__: module for module in DETECTORS}
    assert {kind for _, kind in emitted_kinds.EMITTED} == set(KINDS)
    assert all(kind in by_module[name].EMITS for name, kind in emitted_kinds.EMITTED)


# -- summaries: the evidence from identity and figures only (docs/security.md, rule 5) -----------
#: Text a user chose (in a command line, an environment value, a path): never in a summary.
MARK = "s3cr3t-7f0c"
#: A launcher that titled itself: a sentence names it by the program in its command line.
TITLED = dict(name="pt_elastic", cmdline=("python3", f"/opt/{MARK}.py", f"--token={MARK}"),
              launch_env=MappingProxyType({"MASTER_ADDR": MARK}))


def test_an_orphan_s_summary_names_processes_by_pid_and_kernel_name_never_by_command_or_environment(
        ) -> None:
    history = History()
    run(history, snapshot(1.0, proc(10, 1, pgid=10, **TITLED), proc(11, 10, gpu=GIB, pgid=10)))
    (f,) = run(history, snapshot(2.0, proc(11, 1, gpu=GIB, pgid=10))).findings
    assert f.kind == "orphan" and f"{MARK}.py (pt_elastic)" in f.reason
    assert f.summary == "parent 10 (pt_elastic) exited after 00:00:01Z; now under 1 (systemd)"

    env = MappingProxyType({"LOCAL_RANK": MARK, "WORLD_SIZE": "2", "MASTER_PORT": MARK})
    reaper = proc(50, 1, name="tini", cmdline=(f"/{MARK}/tini", "--", MARK))
    adopted = proc(51, 50, gpu=GIB, pgid=40, launch_env=env, start=0.0)
    (f,) = run(History(), snapshot(100.0, reaper, adopted)).findings
    assert f.kind == "orphan" and f"LOCAL_RANK={MARK}" in f.reason
    assert f.summary == "reparented to 50 (tini); environment has LOCAL_RANK, WORLD_SIZE"

    job = Job(MARK, "run")
    supervised_env = MappingProxyType({"GPUWATCH_RUN_ID": MARK,
                                       "GPUWATCH_RUN_SUPERVISOR": "40:50.0"})
    worker = proc(42, 1, gpu=GIB, job=job, launch_env=supervised_env,
                  cmdline=("python", f"{MARK}.py"))
    (f,) = run(History(), with_supervisors(snapshot(100.0, worker), pid_40=None)).findings
    assert f.kind == "orphan" and f"of job run:{MARK}" in f.reason
    # The job id is the finding's job labels' to carry, not the summary's.
    assert f.summary == "its supervisor `gpuwatch run` (PID 40) is gone"


def test_a_leftover_s_summary_names_it_and_its_trainer_by_pid_and_kernel_name_never_by_command(
        ) -> None:
    history = History()
    launcher = proc(10, 1, pgid=10, name="torchrun")
    helper = proc(12, 10, pgid=10, name="redis-server",
                  cmdline=("redis-server", f"/etc/{MARK}.conf"))
    run(history, snapshot(1.0, launcher, proc(11, 10, gpu=GIB, pgid=10, **TITLED), helper))
    run(history, snapshot(2.0, launcher, helper))
    (f,) = run(history, snapshot(30.0, launcher, helper)).findings
    assert f.kind == "leftover" and f"/etc/{MARK}.conf" in f.reason
    assert f"{MARK}.py (pt_elastic)" in f.reason
    assert f.summary == "still runs; its trainer 11 (pt_elastic) ended after 00:00:02Z"


def test_a_zombie_s_summary_names_its_parent_by_pid_and_kernel_name_never_by_command() -> None:
    history = History()
    parent = proc(80, 1, gpu=GIB, **TITLED)
    child = proc(81, 80, state="zombie", num_threads=1, pgid=80, cmdline=(MARK,))
    run(history, snapshot(10.0, parent, child))
    (f,) = run(history, snapshot(15.5, parent, child)).findings
    assert f.kind == "zombie" and f"{MARK}.py (pt_elastic)" in f.reason
    assert f.summary == "defunct; parent 80 (pt_elastic) has not reaped it"
    threaded = proc(81, 80, gpu=GIB, state="zombie", num_threads=3, pgid=80, cmdline=(MARK,))
    (f,) = run(History(), snapshot(10.0, parent, threaded), replace(CONFIG, zombie_grace=0.0)
               ).findings
    assert f.summary == f.reason == ("main thread exited but other threads still run and hold "
                                     "its GPU memory; only killing the process frees it")


def test_an_unkillable_s_summary_names_the_wait_channel_ps_shows_never_a_kernel_stack_frame(
        ) -> None:
    launcher = proc(10, 1, pgid=10, **TITLED)
    stuck = proc(11, 10, pgid=10, state="disk-sleep", cmdline=("python", f"{MARK}.py"),
                 kernel_stack=(f"os_acquire_mutex_{MARK} [nvidia]",),
                 launch_env=MappingProxyType({"RANK": MARK}))
    (f,) = stuck_for_long(History(), stuck, launcher).findings
    assert f"os_acquire_mutex_{MARK} [nvidia]" in f.reason
    assert f.summary == ("in uninterruptible sleep (D) since 00:16:40Z; waits in the NVIDIA "
                         "driver; signals cannot end it")
    waiting = replace(stuck, wchan="nfs_wait_bit_killable", kernel_stack=())
    (f,) = stuck_for_long(History(), waiting, launcher).findings
    assert f.summary == f.reason == (
        "in uninterruptible sleep (D) since 00:16:40Z; waits in nfs_wait_bit_killable, not in "
        "the GPU driver, and holds no GPU memory; signals cannot end it")


def test_a_ghost_s_summary_is_its_reason_which_quotes_nothing_a_process_chose() -> None:
    config = DetectorConfig(ghost_min_bytes=GIB, ghost_grace=0.0)
    history = History()
    dead = proc(4000, 1, gpu=2 * GIB, in_procfs=False)
    excess = GpuDevice(index=0, memory_used_bytes=3 * GIB)
    run(history, snapshot(0.0, dead, gpus=(excess,)), config)
    findings = run(history, snapshot(1.0, dead, gpus=(excess,)), config).findings
    assert len(findings) == 2
    for f in findings:
        assert f.summary == f.reason and f.summary
