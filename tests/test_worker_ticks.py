"""A process that never steps is tested for leaks too: a real torch training script that never
imports gpuwatch, run under `gpuwatch run`, reads its batches from a DataLoader whose worker (a
forked multiprocessing child, which never steps) keeps what it loads in a module-level list. The
worker's agent reports on a timer (`tick` reports), the daemon tests its RSS by time and names
the list its discovery found; the same worker returning what it loads stays quiet."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from tests.daemonproc import leak_now, running_daemon
from tests.realprocs import GIB
from tests.test_agent_bootstrap import INTERVAL, WAIT
from tests.test_run import supervised

pytest.importorskip("torch", reason="the DataLoader is torch's")

#: argv: PIDFILE KEEP. Trains from a DataLoader with one worker, 0.2 s a step, until killed; the
#: worker's __getitem__ loads 1 MiB an item and, with KEEP "keep", keeps it in WORKER_CACHE.
#: Writes "<trainer PID> <worker PID>" to PIDFILE once the first batch is in.
LOADER = """\
import os, sys, time
import torch
pidfile, keep = sys.argv[1], sys.argv[2] == "keep"
WORKER_CACHE = []

class Loaded(torch.utils.data.Dataset):
    def __len__(self):
        return 1 << 30
    def __getitem__(self, i):
        item = bytearray(1 << 20)
        if keep:
            WORKER_CACHE.append(item)
        return torch.tensor([float(i), float(os.getpid())])

model = torch.nn.Linear(2, 1)
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
loader = torch.utils.data.DataLoader(Loaded(), batch_size=1, num_workers=1, prefetch_factor=2)
for step, batch in enumerate(loader):
    if step == 0:
        with open(pidfile + ".tmp", "w") as f:
            f.write(f"{os.getpid()} {int(batch[0, 1])}")
        os.rename(pidfile + ".tmp", pidfile)
    optimizer.zero_grad()
    model(batch * 0).sum().backward()
    optimizer.step()
    time.sleep(0.2)
"""

#: The leak test by time over 8 s from the start, for leaks of 1 MiB/s or more: the worker keeps
#: about 5 MiB/s; a steady one's RSS creeps by some 100 KiB/s in its first minute (its imports'
#: caches, the agent's discovery recording torch's modules), which the default 300 s of warm-up
#: leaves out.
CONFIG = ("[detectors]\nleak_warmup_steps = 10\nleak_warmup_seconds = 0\n"
          "leak_min_span_seconds = 8\nleak_min_bytes_per_second = 1048576\n")


def _worker(tmp_path: Path, alive: Any) -> tuple[int, int]:
    """The trainer's PID and its worker's, once the first batch is in."""
    pidfile = tmp_path / "train.pid"

    def written() -> Optional[tuple[int, int]]:
        try:
            trainer, worker = (int(x) for x in pidfile.read_text().split())
        except (OSError, ValueError):
            return None
        return trainer, worker

    trainer, worker = wait_for("the trainer's and its worker's PIDs", written, WAIT,
                               alive=alive)
    assert worker != trainer
    return trainer, worker


def test_a_dataloader_worker_that_never_steps_and_keeps_what_it_loads_has_its_list_named(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(LOADER)
    with running_daemon(cli_env, tmp_path / "daemon", config=CONFIG,
                        args=("--interval", str(INTERVAL))) as d, \
            supervised(tmp_path, cli_env, [sys.executable, "-W", "ignore", str(script),
                                           str(tmp_path / "train.pid"), "keep"],
                       "--no-cgroup") as run:
        trainer, worker = _worker(tmp_path, run.proc)
        fake_node.hold(trainer, device=0, used=GIB)

        def named() -> Optional[dict[str, Any]]:
            found, _ = leak_now(cli_env, worker)
            return found if found is not None and found["details"].get("culprit") else None

        finding = wait_for("the worker's leak naming its list", named, 3 * WAIT, alive=d.proc)
        _, process = leak_now(cli_env, worker)
    details = finding["details"]
    assert details["culprit"] == "__main__.WORKER_CACHE", finding
    assert details["found_by"] == "discovered", finding
    assert details["unit"] == "second", finding
    assert "RSS grows steadily (not stepping)" in finding["reason"], finding
    # Its agent reports, without a step.
    assert process is not None and process["agent"] is not None, process
    assert process["agent"]["step"] is None, process


def test_a_dataloader_worker_that_never_steps_and_keeps_nothing_stays_quiet(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(LOADER)
    with running_daemon(cli_env, tmp_path / "daemon", config=CONFIG,
                        args=("--interval", str(INTERVAL))) as d, \
            supervised(tmp_path, cli_env, [sys.executable, "-W", "ignore", str(script),
                                           str(tmp_path / "train.pid"), "return"],
                       "--no-cgroup") as run:
        trainer, worker = _worker(tmp_path, run.proc)
        fake_node.hold(trainer, device=0, used=GIB)
        reports = 0

        # Its agent reporting all along (each tick refreshes last_seen), for three spans of
        # the leak test: never a leak.
        def long_quiet() -> Optional[bool]:
            nonlocal reports
            found, process = leak_now(cli_env, worker)
            assert found is None, found
            agent = process["agent"] if process is not None else None
            if agent is not None:
                reports += 1
            return True if agent is not None and reports >= 150 else None

        wait_for("the worker reporting quietly for a while", long_quiet, 3 * WAIT,
                 alive=d.proc)
