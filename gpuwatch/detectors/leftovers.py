"""leftover: a job member still running after the job's last trainer ended.

The trainers of a job are its members that held GPU memory; when the last of them has exited, or
told the agent it finished, the job is over, and what is still alive after the grace period (the
redis, the actor, the preprocessor) is a leftover, named by its command. The launcher itself is
not reported: it is typically waiting for those very helpers, and ends with them. A member whose
`gpuwatch run` supervisor is gone is an orphan instead, from the first poll that sees it, and is
not reported twice.
"""

from __future__ import annotations

from collections.abc import Iterator

from gpuwatch.config import DetectorConfig
from gpuwatch.detectors.common import command, finding, is_protected, named, supervisor_gone
from gpuwatch.history import History
from gpuwatch.model import Finding, Kind, NodeSnapshot
from gpuwatch.units import clock_time

#: The kinds of finding this detector reports (a test runs it over scenarios and checks).
EMITS = frozenset({Kind.LEFTOVER})


def detect(snapshot: NodeSnapshot, history: History, config: DetectorConfig
           ) -> Iterator[Finding]:
    for job in history.jobs():
        if job.finished_at is None or snapshot.taken_at - job.finished_at < config.leftover_grace:
            continue
        trainer_pid, trainer_name = job.last_trainer or (None, None)
        for identity in sorted(job.members, key=lambda i: i[0]):
            p = snapshot.processes.get(identity[0])
            if p is None or p.identity != identity or p.pid == job.root_pid:
                continue
            if p.state == "zombie" or is_protected(p, config):
                continue  # a zombie is reported as one, whatever its job
            if supervisor_gone(p, snapshot) is not None:
                continue  # an orphan already, since its supervisor went
            label = f" of job {job.label}" if job.label else ""
            if p.pid == trainer_pid:
                reason = (f"`{command(p)}`{label} told the agent it finished after "
                          f"{clock_time(snapshot.wall(job.finished_at))} but still runs")
            else:
                reason = (f"`{command(p)}`{label} still runs; its trainer "
                          f"{named(trainer_pid, trainer_name)} ended after "
                          f"{clock_time(snapshot.wall(job.finished_at))}")
            yield finding(Kind.LEFTOVER, "warning", p, reason)
