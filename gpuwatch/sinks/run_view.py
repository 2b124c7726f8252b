"""The human view of a `gpuwatch run`: how the job ended, what had to be ended and how, and
whether its GPU memory was released (gpuwatch.run_result.RunResult)."""

from __future__ import annotations

import signal
from collections.abc import Sequence

from gpuwatch.run_result import RunResult
from gpuwatch.sinks.text import clean, columns
from gpuwatch.units import human_bytes, human_duration


def render_run(result: RunResult) -> str:
    """The summary people read at the end of a run."""
    status = result.command_status
    if result.ended_by != "exit":
        how = f"stopped by {result.ended_by}"
    elif status is not None and status < 0:
        how = f"its command was ended by {signal.Signals(-status).name}"
    else:
        how = f"its command exited with {status}"
    lines = [f"gpuwatch run: job run:{clean(result.job_id)} ran "
             f"{human_duration(result.ended_at - result.started_at)}; {how}; "
             f"exit {result.exit_code}",
             "  cgroup: " + clean(result.cgroup or f"none ({result.cgroup_reason}); "
                                                      "the process tree alone")]
    if result.members:
        rows: list[Sequence[str]] = [("PID", "GPU MEMORY", "SENT", "ENDED", "COMMAND")]
        for m in result.members:
            gpu = (",".join(map(str, m.gpus)) + ":" + human_bytes(m.gpu_memory_bytes)
                   if m.gpus else "-")
            rows.append((str(m.ref.pid), gpu, ",".join(m.signals) or "-",
                         (m.ended or "still running") + (" (leftover)" if m.leftover else ""),
                         clean(m.command)))
        lines += ["  " + line for line in columns(rows)]
    g = result.gpu
    if not g.nvml:
        lines.append(f"  GPU memory: {g.detail}")
    elif g.released:
        lines.append(f"  GPU memory: {human_bytes(g.held_bytes)} held by the job, released "
                     "(NVML lists none of its processes)")
    else:
        for pid, mem in sorted(g.still_held.items()):
            lines.append(f"  GPU memory NOT released: PID {pid} still listed by NVML "
                         f"({human_bytes(mem)})")
        for index, grown in sorted(g.unattributed_growth.items()):
            lines.append(f"  GPU memory NOT released: GPU {index} has {human_bytes(grown)} more "
                         "unattributed memory than before the job")
    return "\n".join(lines) + "\n"
