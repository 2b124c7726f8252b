"""The human view of a status document: GPUs, then GPU holders as process trees.

A tree is rooted at the holder's launcher: its parent, climbed further while the ancestors belong
to the same job (so a Slurm step shows slurmstepd -> torchrun -> workers), never at PID 1.
"""

from __future__ import annotations

import datetime as _dt
from collections.abc import Collection, Iterable, Sequence
from typing import Any, Optional

from gpuwatch.sources.jobs import WORKER_MARKER_KEYS

_UNITS = ("B", "KiB", "MiB", "GiB", "TiB", "PiB")


def human_bytes(n: Optional[int]) -> str:
    if n is None:
        return "?"
    value = float(n)
    for unit in _UNITS:
        if abs(value) < 1024 or unit == _UNITS[-1]:
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def render_status(doc: dict[str, Any], width: int = 120) -> str:
    lines = [_header(doc), ""]
    lines += _gpu_table(doc)
    lines.append("")
    lines += _process_table(doc, width)
    return "\n".join(lines).rstrip() + "\n"


def _header(doc: dict[str, Any]) -> str:
    when = _dt.datetime.fromtimestamp(doc["taken_at"], tz=_dt.timezone.utc)
    via = "from the running daemon" if doc["source"] == "daemon" else "one poll"
    if doc.get("source_detail"):
        via += f" ({doc['source_detail']})"
    nvml = doc["nvml"]
    if nvml["available"]:
        driver = f"NVML {nvml['nvml_version'] or '?'} · driver {nvml['driver_version'] or '?'}"
        if nvml.get("cuda_driver_version"):
            driver += f" · CUDA {nvml['cuda_driver_version']}"
    else:
        driver = (f"NVML unavailable: {nvml['error']} - showing host processes that look like "
                  "GPU work")
    return f"node {doc['node']} · {when:%Y-%m-%d %H:%M:%S}Z · {via}\n{driver}"


def _gpu_table(doc: dict[str, Any]) -> list[str]:
    gpus = doc["gpus"]
    if not gpus:
        return ["no GPUs" if doc["nvml"]["available"] else "no GPU information"]
    rows = [("GPU", "NAME", "MEMORY USED / TOTAL", "UNATTRIBUTED", "UTIL", "PROCS", "")]
    for g in gpus:
        note = ""
        if g["lost"]:
            note = "LOST (needs a reset): "
        if g["errors"]:
            note += "; ".join(f"{e['call']}: {e['message']}" for e in g["errors"])
        rows.append((
            str(g["index"]),
            g["name"] or "?",
            _memory_cell(g["memory_used_bytes"], g["memory_total_bytes"]),
            human_bytes(g["unattributed_memory_bytes"]),
            f"{g['utilization_gpu_percent']}%" if g["utilization_gpu_percent"] is not None else "?",
            str(g["process_count"]),
            note,
        ))
    return _columns(rows, right={0, 3, 4, 5})


def _memory_cell(used: Optional[int], total: Optional[int]) -> str:
    if used is None or total is None:
        return f"{human_bytes(used)} / {human_bytes(total)}"
    share = 100 * used / total if total else 0
    return f"{human_bytes(used)} / {human_bytes(total)} ({share:.0f}%)"


def _process_table(doc: dict[str, Any], width: int) -> list[str]:
    procs = {p["pid"]: p for p in doc["processes"]}
    shown = _shown_pids(procs, nvml_available=doc["nvml"]["available"])
    if not shown:
        return ["no process holds GPU memory" if doc["nvml"]["available"]
                else "no process looks like GPU work (no /dev/nvidia* holder, no rank variables)"]
    rows: list[Sequence[str]] = [("PID", "USER", "JOB", "STATE", "RSS", "GPU MEMORY", "COMMAND")]
    for depth_prefix, p in _walk_trees(procs, shown):
        rows.append((
            depth_prefix + str(p["pid"]),
            p["user"] or "?",
            _job_cell(p["job"]),
            p["state"] or "-",
            human_bytes(p["rss_bytes"]) if p["rss_bytes"] is not None else "-",
            _gpu_cell(p),
            _command_cell(p, procs, shown),
        ))
    return [line[:width] if width > 0 else line for line in _columns(rows)]


def _shown_pids(procs: dict[int, dict[str, Any]], nvml_available: bool) -> set[int]:
    """Each GPU holder with its launcher chain (see the module docstring).

    Without NVML the document holds look-alike GPU workers instead of holders: processes whose
    environment carries distributed-worker variables.
    """
    shown: set[int] = set()
    for p in procs.values():
        seed = (p["holds_gpu"] or not p["in_procfs"]) if nvml_available else (
            not WORKER_MARKER_KEYS.isdisjoint(p["launch_env"]))
        if not seed:
            continue
        shown.add(p["pid"])
        job = p["job"]
        parent = procs.get(p["ppid"]) if p["ppid"] else None
        if parent is None or parent["pid"] == 1:
            continue
        shown.add(parent["pid"])
        up = procs.get(parent["ppid"]) if parent["ppid"] else None
        while job is not None and up is not None and up["pid"] != 1 and up["job"] == job:
            shown.add(up["pid"])
            up = procs.get(up["ppid"]) if up["ppid"] else None
    return shown


def _walk_trees(procs: dict[int, dict[str, Any]], shown: set[int]
                ) -> Iterable[tuple[str, dict[str, Any]]]:
    children: dict[int, list[int]] = {}
    for pid in shown:
        children.setdefault(procs[pid]["ppid"] or 0, []).append(pid)
    roots = sorted(pid for pid in shown if procs[pid]["ppid"] not in shown)

    def walk(pid: int, prefix: str, is_last: bool, is_root: bool
             ) -> Iterable[tuple[str, dict[str, Any]]]:
        branch = "" if is_root else ("└─ " if is_last else "├─ ")
        yield prefix + branch, procs[pid]
        kids = sorted(children.get(pid, ()))
        below = prefix + ("" if is_root else ("   " if is_last else "│  "))
        for i, kid in enumerate(kids):
            yield from walk(kid, below, i == len(kids) - 1, False)

    for root in roots:
        yield from walk(root, "", True, True)


def _job_cell(job: Optional[dict[str, Any]]) -> str:
    return f"{job['source']}:{job['id']}" if job else "-"


def _gpu_cell(p: dict[str, Any]) -> str:
    if not p["gpus"]:
        return "-"
    return " ".join(f"{u['index']}:{human_bytes(u['memory_bytes'])}" for u in p["gpus"])


def _command_cell(p: dict[str, Any], procs: dict[int, dict[str, Any]], shown: set[int]) -> str:
    if not p["in_procfs"]:
        return "(not in /proc: exited, or another PID namespace)"
    command = " ".join(p["cmdline"]) or f"[{p['name'] or '?'}]"
    ppid = p["ppid"]
    if ppid and ppid not in shown:
        parent = procs.get(ppid)
        command += f"  (parent {ppid} {parent['name'] if parent else '?'})"
    return command


def _columns(rows: Sequence[Sequence[str]], right: Collection[int] = ()
             ) -> list[str]:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    out = []
    for r in rows:
        cells = [c.rjust(widths[i]) if i in right else c.ljust(widths[i]) for i, c in enumerate(r)]
        out.append("  ".join(cells).rstrip())
    return out
