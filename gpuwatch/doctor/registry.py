"""The checks in the order they run (`CHECKS`: each a `Spec`, a name and a function of a
`Context` with a deadline), and running them: each in a thread of its own with a deadline, so
that a check that hangs or raises costs only its own line."""

from __future__ import annotations

import threading
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from typing import Any, Callable, Optional

from gpuwatch.doctor.base import FAIL, OK, WARN, Check, Context
from gpuwatch.doctor.cgroups import check_cgroups
from gpuwatch.doctor.config_check import check_config
from gpuwatch.doctor.daemon import check_agent_socket, check_daemon, check_directories
from gpuwatch.doctor.kubernetes import check_kubernetes
from gpuwatch.doctor.metrics import check_metrics
from gpuwatch.doctor.nvml import check_nvml
from gpuwatch.doctor.privileges import check_executables, check_privileges
from gpuwatch.doctor.proc import check_pid_namespace, check_proc_children, check_proc_mount
from gpuwatch.doctor.systemd import check_systemd
from gpuwatch.threads import start_without_signals

#: NVML's first initialisation without persistence mode takes seconds per GPU; beyond this the
#: driver is stuck, not slow.
NVML_DEADLINE = 30.0


@dataclass(frozen=True)
class Spec:
    name: str
    run: Callable[[Context], list[Check]]
    #: Seconds before the check is abandoned; None: 10 s plus three times the context's timeout.
    deadline: Optional[float] = None
    #: What to do when it is abandoned.
    on_hang: str = "something it reads is blocked; run it alone with `--check NAME` to see"


CHECKS: tuple[Spec, ...] = (
    Spec("config", check_config),
    Spec("nvml", check_nvml, NVML_DEADLINE,
         on_hang="NVML is blocked in the driver: a GPU may have fallen off the bus (`dmesg | "
                 "grep -i xid`); `nvidia-smi` probably hangs too"),
    Spec("privileges", check_privileges),
    Spec("executables", check_executables),
    Spec("proc-mount", check_proc_mount),
    Spec("pid-namespace", check_pid_namespace),
    Spec("proc-children", check_proc_children),
    Spec("cgroups", check_cgroups),
    Spec("kubernetes", check_kubernetes),
    Spec("directories", check_directories),
    Spec("daemon", check_daemon),
    Spec("agent-socket", check_agent_socket),
    Spec("metrics", check_metrics),
    Spec("systemd", check_systemd),
)
CHECK_NAMES: tuple[str, ...] = tuple(s.name for s in CHECKS)


def run_checks(ctx: Context, only: Collection[str] = (),
               specs: Sequence[Spec] = CHECKS) -> list[Check]:
    """Every check in order (or those named in `only`); never raises for a check's sake."""
    results: list[Check] = []
    for spec in specs:
        if not only or spec.name in only:
            results += run_one(ctx, spec)
    return results


def run_one(ctx: Context, spec: Spec) -> list[Check]:
    deadline = spec.deadline if spec.deadline is not None else 10.0 + 3 * ctx.timeout
    outcome: list[Any] = []

    def target() -> None:
        try:
            outcome.append(spec.run(ctx))
        except Exception as exc:
            outcome.append(exc)

    # A daemon thread: one stuck in the driver must not keep the command from exiting.
    thread = threading.Thread(target=target, name=f"doctor-{spec.name}", daemon=True)
    start_without_signals(thread)
    thread.join(deadline)
    if not outcome:
        return [Check(spec.name, FAIL, f"this check did not finish within {deadline:g} s",
                      fix=spec.on_hang.replace("NAME", spec.name))]
    result = outcome[0]
    if isinstance(result, Exception):
        return [Check(spec.name, FAIL,
                      f"this check failed: {type(result).__name__}: {result}",
                      fix="an unexpected state of the node, or a bug in gpuwatch doctor: report "
                          "this line with the node's details")]
    return list(result)


def exit_status(checks: Sequence[Check]) -> str:
    """The worst status: fail, else warn, else ok (skips count as ok)."""
    statuses = {c.status for c in checks}
    return FAIL if FAIL in statuses else WARN if WARN in statuses else OK
