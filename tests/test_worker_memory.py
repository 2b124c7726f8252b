"""The memory of a GPU job's workers that hold no GPU memory (a data loader's, forked from the
trainer): real processes under a real daemon polling every 0.2 s. A worker whose RSS climbs is a
leak; workers whose private memory climbs while their RSS stays flat are copy-on-write after the
fork, and the finding says so; `status` lists them under their trainer."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwatch.simulate.fakenvml import FakeNode
from tests.daemonproc import WatchedNode, by_pid, running_daemon
from tests.scenarios import clean_env, wait_not_running

GIB = 1 << 30
MIB = 1 << 20
INTERVAL = 0.2
#: Short windows: no warm-up, a few seconds of growth make a leak.
DETECTORS = """
[detectors]
leak_warmup_seconds = 0
leak_min_span_seconds = 3
leftover_grace = 600
"""

#: A trainer that forks two data workers, as a DataLoader with the fork start method does, and
#: prints its PID and theirs. "leak": worker 1 appends 4 MiB a second to a list (worker 0
#: idles). "cow": the trainer first builds a 192 MiB dataset (touched once), then each worker
#: writes a byte in every one of its pages, 4 MiB of them a second: the pages are copied, so
#: their private memory grows while their RSS (shared pages counted) stays where it was.
TRAINER = r"""
import os, sys, time
mode = sys.argv[1]
data = bytearray(b"\x01") * (192 << 20) if mode == "cow" else bytearray()
workers = []
for i in range(2):
    pid = os.fork()
    if pid == 0:
        end = time.monotonic() + 120
        if mode == "leak" and i == 1:
            kept = []
            while time.monotonic() < end:
                kept.append(b"x" * (1 << 20))
                time.sleep(0.25)
        elif mode == "cow":
            chunk = 1 << 20
            for start in range(0, len(data), chunk):
                for offset in range(start, start + chunk, 4096):
                    data[offset] = 2
                time.sleep(0.25)
        time.sleep(600)
        os._exit(0)
    workers.append(pid)
print(os.getpid(), *workers, flush=True)
time.sleep(600)
"""

#: A real PyTorch DataLoader (the fork start method, 2 workers) over a Dataset that is a list of a
#: million small Python objects built in the trainer: each item a worker reads has its reference
#: count written, so its page is copied for that worker. Paced, so that an epoch lasts minutes.
TORCH_TRAINER = r"""
import os, time
import torch
from torch.utils.data import DataLoader, Dataset

class Touched(Dataset):
    def __init__(self):
        self.items = [b"%0100d" % i for i in range(1_000_000)]
    def __len__(self):
        return len(self.items)
    def __getitem__(self, i):
        return len(self.items[i])

loader = DataLoader(Touched(), batch_size=64, num_workers=2, multiprocessing_context="fork")
batches = iter(loader)
next(batches)
print(os.getpid(), *sorted(w.pid for w in batches._workers), flush=True)
for batch in batches:
    time.sleep(0.01)
time.sleep(600)
"""

#: The job's launcher: the trainer's parent, so that the job's tree is the launcher's.
LAUNCHER = r"""
import subprocess, sys, time
trainer = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]])
trainer.wait()
"""


@contextlib.contextmanager
def data_loader_job(mode: str, trainer: str = TRAINER) -> Iterator[tuple[int, int, int]]:
    """(trainer, worker 0, worker 1) of a running job; everything ended after."""
    read, write = os.pipe()
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, trainer, mode], stdout=write, env=clean_env(),
        start_new_session=True)
    os.close(write)
    pids: list[int] = []
    try:
        with os.fdopen(read) as out:
            line = out.readline()
        pids = [int(p) for p in line.split()]
        assert len(pids) == 3, f"the job printed {line!r}"
        yield pids[0], pids[1], pids[2]
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        wait_not_running(pids)


#: TRAINER, but it holds its GPU memory before it forks: it prints its PID, waits for SIGUSR1,
#: then forks its workers and prints their PIDs, as a script that moves its model to the GPU
#: before it iterates its DataLoader does.
TRAINER_FORKING_WHEN_TOLD = TRAINER.replace("workers = []\n", """\
import signal
signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
print(os.getpid(), flush=True)
signal.sigwait({signal.SIGUSR1})
workers = []
""").replace("print(os.getpid(), *workers, flush=True)", "print(*workers, flush=True)")


@pytest.fixture
def watched(fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path
            ) -> Iterator[WatchedNode]:
    with running_daemon(cli_env, tmp_path, config=DETECTORS,
                        args=("--interval", str(INTERVAL))) as daemon:
        yield WatchedNode(fake_node, cli_env, daemon)


def test_a_data_worker_whose_rss_climbs_steadily_is_a_leak_though_it_holds_no_gpu_memory(
        watched: WatchedNode) -> None:
    with data_loader_job("leak") as (trainer, idle, leaking):
        watched.node.hold(trainer, device=0, used=2 * GIB)
        watched.holding(trainer)
        found = watched.findings_of("leak", [leaking])[leaking]
        assert found["reason"].startswith("RSS grows steadily (no agent)"), found
        assert found["details"]["growth_bytes_per_second"] > MIB, found
        doc = watched.doc()
        assert not {idle, trainer} & set(by_pid(doc, "leak")), doc["findings"]




def test_forked_workers_copying_their_trainers_pages_are_explained_as_copy_on_write(
        watched: WatchedNode) -> None:
    from gpuwatch.sinks.document import from_json
    from gpuwatch.sinks.status_view import render_status

    with data_loader_job("cow") as (trainer, first, second):
        watched.node.hold(trainer, device=0, used=2 * GIB)
        watched.holding(trainer)
        doc = watched.doc_when("the copy-on-write finding on the trainer", lambda d: (
            by_pid(d, "leak").get(trainer, {}).get("details", {}).get("workers") == 2))
        found = by_pid(doc, "leak")[trainer]
        assert found["reason"] == (
            "private memory of 2 forked workers grows while their RSS stays flat: "
            "copy-on-write after fork: touch-once data in a Dataset; workers' private memory "
            "grows as they touch the parent's pages"), found
        details = found["details"]
        assert details["cause"] == "copy-on-write" and details["worker_pids"] == [first, second]
        assert details["private_growth_bytes"] >= 4 * MIB, details
        # Neither worker is a leak of its own: their RSS holds the trainer's pages already.
        assert not {first, second} & set(by_pid(doc, "leak")), doc["findings"]
        processes = {p["pid"]: p for p in doc["processes"]}
        for pid in (first, second):
            assert processes[pid]["rss_bytes"] > 192 * MIB  # the shared pages count in RSS
            assert processes[pid]["uss_bytes"] < processes[pid]["rss_bytes"]
            assert processes[pid]["pss_bytes"] is not None
        # `status` says it in words, with the node's growth across the workers (rendered from
        # this document: the finding closes once the workers have copied everything).
        text = " ".join(render_status(from_json(doc)).split())
        assert "copy-on-write after fork" in text and "across 2 workers" in text, text


def test_status_lists_a_jobs_workers_without_gpu_memory_under_their_trainer(
        watched: WatchedNode) -> None:
    from gpuwatch.sinks.document import from_json
    from gpuwatch.sinks.status_view import render_status

    with data_loader_job("idle") as (trainer, first, second):
        watched.node.hold(trainer, device=0, used=2 * GIB)
        doc = watched.holding(trainer)
        assert {first, second} <= {p["pid"] for p in doc["processes"]}  # the document has them
        rows = watched.status_text().splitlines()
        at = next(i for i, r in enumerate(rows) if f" {trainer} " in f" {r} ")
        below = rows[at + 1:at + 3]
        assert [r.split()[:2] for r in below] == [["├─", str(first)], ["└─", str(second)]], rows
        # A narrow terminal keeps them, each with its program's name.
        for width in (40, 60):
            lines = render_status(from_json(doc), width=width).splitlines()
            assert all(len(line) <= width for line in lines), lines
            for pid in (first, second):
                (row,) = [r for r in lines if f"─ {pid}" in r or f"─{pid}" in r]
                assert "python" in row, lines


def test_a_real_torch_data_loaders_workers_copying_a_list_dataset_are_copy_on_write(
        watched: WatchedNode) -> None:
    pytest.importorskip("torch")
    with data_loader_job("torch", TORCH_TRAINER) as (trainer, first, second):
        watched.node.hold(trainer, device=0, used=2 * GIB)
        watched.holding(trainer)
        doc = watched.doc_when("the copy-on-write finding on the trainer", lambda d: (
            by_pid(d, "leak").get(trainer, {}).get("details", {}).get("cause")
            == "copy-on-write"))
        found = by_pid(doc, "leak")[trainer]
        assert "copy-on-write after fork" in found["reason"], found
        assert set(found["details"]["worker_pids"]) <= {first, second}, found
        assert not {first, second} & set(by_pid(doc, "leak")), doc["findings"]


@pytest.mark.parametrize("parent", ["launcher", "wrapper script"])
def test_a_data_worker_forked_after_its_trainer_was_seen_holding_is_judged_with_its_job(
        watched: WatchedNode, tmp_path: Path, parent: str) -> None:
    """The trainer, under a parent that is no launcher (a Python launcher, `bash run.sh`), is
    seen holding GPU memory before it forks: the worker whose RSS climbs is a leak all the
    same."""
    read, write = os.pipe()
    if parent == "launcher":
        argv = [sys.executable, "-c", LAUNCHER, TRAINER_FORKING_WHEN_TOLD, "leak"]
    else:
        script = tmp_path / "run.sh"
        # Two commands: bash does not exec the last one in its own place.
        script.write_text(f'{sys.executable} -c "$1" leak\nexit $?\n')
        argv = ["bash", str(script), TRAINER_FORKING_WHEN_TOLD]
    # A group of its own (for the kill), in this session: a shell leading a session is a login
    # shell, a boundary of jobs, and its child the root of a job of its own.
    launcher = subprocess.Popen(argv, stdout=write, env=clean_env(), process_group=0)
    os.close(write)
    pids: list[int] = []
    try:
        with os.fdopen(read) as out:
            trainer = int(out.readline())
            pids.append(trainer)
            watched.node.hold(trainer, device=0, used=2 * GIB)
            watched.holding(trainer)
            os.kill(trainer, signal.SIGUSR1)
            idle, leaking = (int(p) for p in out.readline().split())
        pids += [idle, leaking]
        found = watched.findings_of("leak", [leaking])[leaking]
        assert found["reason"].startswith("RSS grows steadily (no agent)"), found
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()
        wait_not_running(pids)
