"""stalled: an instrumented process that holds on and does not move.

Two ways, one kind:
- its step has not advanced while it holds GPU memory: the trainer starved of data for ten
  minutes, a collective that never returns, a deadlock. Only processes that report steps through
  the agent can be judged, and one that said it finished is not stalled. The finding closes when
  steps resume.
- hung at exit: its interpreter began to exit (the agent's `exit` report, sent from the exit
  hooks) yet the process still runs, held by what the report names: an executor never shut
  down, a non-daemon thread, a torch.distributed process group never destroyed. Nothing the
  program does moves any more; what it holds stays held until something ends it. Reported from
  the first poll that sees the report, critical while it holds GPU memory, and a warning when
  it holds none (its job still waits for it). The finding closes when the process exits.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from gpuwatch.config import DetectorConfig
from gpuwatch.detectors.common import Evidence, by_holding, finding, is_protected
from gpuwatch.evidence import HungAtExit
from gpuwatch.history import History
from gpuwatch.model import Finding, HostProcess, Kind, NodeSnapshot
from gpuwatch.units import clock_time, plural
from gpuwatch.vocabulary import ProcState, Severity

#: The kinds of finding this detector reports (a test runs it over scenarios and checks).
EMITS = frozenset({Kind.STALLED})

# Names a reason gives at most, of threads and of each pool's workers.
_NAMES_SHOWN = 4


def detect(snapshot: NodeSnapshot, history: History, config: DetectorConfig
           ) -> Iterator[Finding]:
    for pid, agent in snapshot.agents.items():
        p = snapshot.processes.get(pid)
        if p is None or not p.in_procfs or is_protected(p, config):
            continue
        if agent.exit_report is not None and p.state != ProcState.ZOMBIE:
            yield _hung_at_exit(p, agent.exit_report)
            continue
        if not p.holds_gpu:
            continue
        if agent.finished_at is not None or agent.step_changed_at is None:
            continue
        if snapshot.taken_at - agent.step_changed_at < config.stall_after:
            continue
        # A step is a figure (the report's integer): the words are public as they are.
        yield finding(Kind.STALLED, Severity.WARNING, p, Evidence.public(
            f"step {agent.step} has not advanced since "
            f"{clock_time(snapshot.wall(agent.step_changed_at))} while holding GPU memory"))


def _hung_at_exit(p: HostProcess, report: Mapping[str, Any]) -> Finding:
    causes = "; ".join(exit_causes(report)) or "something it did not name holds it"
    kinds = "; ".join(exit_cause_kinds(report)) or "something it did not name holds it"
    f = finding(Kind.STALLED, by_holding(p), p,
                Evidence(f"hung at exit: the interpreter began to exit, but {causes}",
                         f"hung at exit: the interpreter began to exit, but {kinds}"))
    return replace(f, details=HungAtExit())


def exit_cause_kinds(report: Mapping[str, Any]) -> list[str]:
    """What holds the exit as exit_causes says it, by kind and count only: "a
    ThreadPoolExecutor was never shut down", "2 non-daemon threads are still running". The
    names the program gave its threads stay out (a summary's words: detectors.common)."""
    causes = []
    pools = len(report.get("thread_pools") or ())
    if pools:
        causes.append("a ThreadPoolExecutor was never shut down" if pools == 1
                      else f"{pools} ThreadPoolExecutors were never shut down")
    executors = _count(report.get("executors"))
    others = executors - pools if pools else executors
    kind = "ProcessPoolExecutor" if pools else "executor"
    if others == 1:
        causes.append(f"a {kind} was never shut down" if pools
                      else "1 executor was never shut down")
    elif others > 1:
        causes.append(f"{others} {kind}s were never shut down")
    threads = len(report.get("threads") or ())
    if threads:
        causes.append("a non-daemon thread is still running" if threads == 1
                      else f"{threads} non-daemon threads are still running")
    if report.get("process_group"):
        causes.append("the torch.distributed process group was never destroyed")
    return causes


def _count(value: Any) -> int:
    """A count from a report (validated as an int when it was read), never its text."""
    return value if type(value) is int and value > 0 else 0


def exit_causes(report: Mapping[str, Any]) -> list[str]:
    """What an agent's exit report says holds the exit, one clause each: "a ThreadPoolExecutor
    with 1 live worker thread ('reward_buffer_0') was never shut down". Names are quoted with
    repr(), so what a program calls its threads cannot break the sentence."""
    causes = []
    pools = report.get("thread_pools") or ()
    for pool in pools:
        workers = pool.get("workers") or 0
        names = _names(pool.get("threads") or (), workers)
        causes.append(f"a ThreadPoolExecutor with {plural(workers, 'live worker thread')}"
                      f"{f' ({names})' if names else ''} was never shut down")
    executors = report.get("executors") or 0
    if pools:
        others = executors - len(pools)
        if others == 1:
            causes.append("a ProcessPoolExecutor was never shut down")
        elif others > 1:
            causes.append(f"{others} ProcessPoolExecutors were never shut down")
    elif executors:
        causes.append(f"{plural(executors, 'executor')} "
                      f"{'was' if executors == 1 else 'were'} never shut down")
    threads = tuple(report.get("threads") or ())
    if threads:
        causes.append(f"non-daemon thread{'s' if len(threads) != 1 else ''} "
                      f"{_names(threads, len(threads))} "
                      f"{'is' if len(threads) == 1 else 'are'} still running")
    if report.get("process_group"):
        causes.append("the torch.distributed process group was never destroyed")
    return causes


def _names(names: tuple[str, ...] | list[str], count: int) -> str:
    shown = ", ".join(repr(name) for name in list(names)[:_NAMES_SHOWN])
    return shown + (", ..." if count > min(len(names), _NAMES_SHOWN) else "")
