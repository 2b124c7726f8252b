"""`gpuwatch doctor`: everything gpuwatch depends on, checked, each with what to do about it.

A source like the others: it reads the node (NVML, /proc, /sys/fs/cgroup, the runtime directory,
the daemon's sockets and /metrics, systemd) and produces `Check` results, which
gpuwatch/sinks/doctor_view.py renders and the CLI turns into an exit code. Every path a check
reads is a field of `Context`, so that tests point the checks at fixture trees.

One module per group of checks, each a function of a `Context` returning its `Check` lines
(config_check, nvml, privileges, proc, cgroups, daemon, metrics: the HTTP scrape of /metrics,
systemd), what they share in base, and the registry (`CHECKS`, in the order they run) with
what runs them: each check in a thread of its own with a deadline, since NVML can block for ever
on a GPU that fell off the bus, and a check that hangs or raises must cost only its own line,
never the others'. docs/doctor.md says what each check looks at and why.
"""

from gpuwatch.doctor.base import (
    FAIL,
    OK,
    SKIP,
    STATUSES,
    WARN,
    Check,
    Context,
    Identity,
    read_daemon_info,
    read_identity,
)
from gpuwatch.doctor.cgroups import cgroup_layout, check_cgroups
from gpuwatch.doctor.config_check import ConfigLoad, check_config, load_config_for_doctor
from gpuwatch.doctor.daemon import (
    STALE_POLL_SECONDS,
    check_agent_socket,
    check_daemon,
    check_directories,
)
from gpuwatch.doctor.metrics import check_metrics, served_by
from gpuwatch.doctor.nvml import check_nvml
from gpuwatch.doctor.privileges import (
    check_executables,
    check_privileges,
    count_unreadable_environ,
    count_unreadable_executables,
)
from gpuwatch.doctor.proc import (
    INIT_PID_NS_INODE,
    check_pid_namespace,
    check_proc_children,
    check_proc_mount,
    proc_mount_options,
)
from gpuwatch.doctor.registry import (
    CHECK_NAMES,
    CHECKS,
    NVML_DEADLINE,
    Spec,
    exit_status,
    run_checks,
    run_one,
)
from gpuwatch.doctor.systemd import check_systemd

__all__ = [
    "CHECKS", "CHECK_NAMES", "FAIL", "INIT_PID_NS_INODE", "NVML_DEADLINE", "OK", "SKIP",
    "STALE_POLL_SECONDS", "STATUSES", "WARN", "Check", "ConfigLoad", "Context", "Identity", "Spec",
    "cgroup_layout", "check_agent_socket", "check_cgroups", "check_config", "check_daemon",
    "check_directories", "check_executables", "check_metrics", "check_nvml", "check_pid_namespace",
    "check_privileges", "check_proc_children", "check_proc_mount", "check_systemd",
    "count_unreadable_environ", "count_unreadable_executables", "exit_status",
    "load_config_for_doctor", "proc_mount_options", "read_daemon_info", "read_identity",
    "run_checks", "run_one", "served_by",
]
