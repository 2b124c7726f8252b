"""The autograd-history leak named: a real torch loop (CPU build) that never imports gpuwatch,
run under `gpuwatch run`, keeps `total_loss += loss` at module level for a loss it never calls
backward() on (an evaluation without torch.no_grad()), so every step's graph and what it saved
for backward stay alive; the agent's discovery finds the tensor's graph growing
and the daemon names it. The same loop with `loss.item()` stays quiet.

The classic loop, `total_loss += loss` after `loss.backward()`, keeps a few kilobytes of graph
nodes a step and never grows RSS enough for a leak of memory: its growing history is the leak,
raised and named within 15 steps of its start; a graph rebuilt every step, one that grows a few
steps and stops, gradient accumulation, `.item()` and `.detach()` stay quiet."""

from __future__ import annotations

import sys
import time
import types
from collections.abc import Iterator
from contextlib import closing
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from tests.daemonproc import running_daemon
from tests.realprocs import GIB
from tests.test_agent_bootstrap import INTERVAL, WAIT, _job_pid, leak_named_within_steps
from tests.test_run import supervised

torch = pytest.importorskip("torch", reason="the autograd history needs torch")

#: argv: PIDFILE MODE SECONDS. Each step trains, then evaluates without torch.no_grad() and
#: accumulates the evaluation's loss: MODE "graph": `total_loss += loss`; "item":
#: `+= loss.item()`; "object": a trainer object's `self.running = self.running + loss`. The
#: evaluation's graph saves about 2 MiB (a 256 x 1024 input, the ReLU's output). Until killed.
ACCUMULATE = """\
import os, sys, time
import torch
pidfile, mode, seconds = sys.argv[1], sys.argv[2], float(sys.argv[3])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
                            torch.nn.Linear(1024, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-6)
class Trainer:
    def __init__(self):
        self.running = 0
trainer = Trainer()
total_loss = 0
with open(pidfile + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(pidfile + ".tmp", pidfile)
while True:
    optimizer.zero_grad()
    model(torch.randn(64, 1024)).mean().backward()
    optimizer.step()
    loss = model(torch.randn(256, 1024)).mean()
    if mode == "graph":
        total_loss += loss
    elif mode == "object":
        trainer.running = trainer.running + loss
    else:
        total_loss += loss.item()
    time.sleep(seconds)
"""


def _until_the_next_poll(_: float) -> None:
    """Between two reads of the daemon's status: half its poll interval, so that every poll's
    findings are read at least once, and no document is asked for again and again before the
    daemon has made the next one (the daemon writes each one it is asked for)."""
    time.sleep(INTERVAL / 2)


def _command(tmp_path: Path, mode: str, seconds: float = 0.3) -> list[str]:
    script = tmp_path / "train.py"
    script.write_text(ACCUMULATE)
    return [sys.executable, "-W", "ignore", str(script), str(tmp_path / "train.pid"), mode,
            str(seconds)]


def test_total_loss_accumulated_without_item_is_named_as_an_autograd_history_within_15_steps(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    finding = leak_named_within_steps(cli_env, tmp_path, fake_node, _command(tmp_path, "graph"),
                                      "__main__.total_loss", found_by="autograd")
    details = finding["details"]
    # The history is raised on its own before RSS has the points to be judged; RSS takes over.
    assert details["series"] in ("autograd history", "RSS"), finding
    # The loop accumulates from its first step; the estimate may be off by a few.
    assert details["history_since_step"] <= 5, finding
    assert details["graph_nodes_per_step"] >= 1, finding
    assert ("`__main__.total_loss` holds the graph of every step since step "
            f"{details['history_since_step']}: use `loss.item()` or `.detach()` (autograd)"
            ) in finding["reason"], finding


def test_a_trainer_objects_running_loss_holding_the_graph_is_named_as_an_autograd_history(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    leak_named_within_steps(cli_env, tmp_path, fake_node, _command(tmp_path, "object"),
                            "__main__.trainer.running", found_by="autograd")


def test_the_same_loop_accumulating_loss_item_stays_quiet(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    from gpuwatch.serve.state_client import STATE_SOCKET_NAME, StateUnavailable, fetch_status

    state = Path(cli_env["GPUWATCH_RUNTIME_DIR"]) / STATE_SOCKET_NAME
    config = "[detectors]\nleak_warmup_steps = 10\n"
    with running_daemon(cli_env, tmp_path / "daemon", config=config,
                        args=("--interval", str(INTERVAL))) as d, \
            supervised(tmp_path, cli_env, _command(tmp_path, "item", 0.1), "--no-cgroup") as run:
        pid = _job_pid(tmp_path / "train.pid", run.proc)
        fake_node.hold(pid, device=0, used=GIB)

        # 120 steps: well past the 15 the leaking loop needs to have its history named.
        def many_steps_without_a_leak() -> Optional[int]:
            try:
                doc = fetch_status(state)
            except StateUnavailable:
                return None
            leaks = [f for f in doc.get("findings", ()) if f["kind"] == "leak"
                     and f["pid"] == pid]
            assert not leaks, leaks
            process = next((p for p in doc["processes"] if p["pid"] == pid), None)
            agent: Any = process["agent"] if process is not None else None
            step = agent.get("step") if agent else None
            return step if step is not None and step >= 120 else None

        wait_for("120 steps of the healthy loop", many_steps_without_a_leak, 4 * WAIT,
                 alive=d.proc, pause=_until_the_next_poll)


def test_discovery_follows_a_tensors_graph_by_its_new_nodes_and_ignores_a_fresh_one() -> None:
    from gpuwatch.agent._discovery import Scanner

    module = types.ModuleType("trainmod")
    model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))
    module.total_loss = 0
    module.good = 0.0
    scanner = Scanner({"trainmod": module}, budget=1.0)
    nodes = []
    for step in range(8):
        loss = model(torch.randn(4, 8)).mean()
        module.total_loss += loss
        module.good += loss.item()
        module.last = loss  # one step's graph, replaced every step
        assert scanner.slice(step)
        nodes.append(scanner.growers().get("trainmod.total_loss:autograd", {}).get("items"))
    growers = scanner.growers()
    assert list(growers) == ["trainmod.total_loss:autograd"], growers
    # The same nodes every step (the Linear, ReLU, Linear and mean, and the add).
    counted = [n for n in nodes if n is not None]
    assert len(counted) >= 4
    assert len({b - a for a, b in zip(counted, counted[1:])}) == 1, nodes
    assert counted[-1] == 8 * (counted[-1] - counted[-2]), nodes


#: argv: PIDFILE MODE SECONDS START. The classic loop: forward, loss, backward(), the optimizer's
#: step; then, from the step the optimizer's count reaches START on, MODE: "graph":
#: `total_loss += loss` (after backward: nodes only, a few KB a step); "few": the same for 5
#: steps only; "item": `+= loss.item()`; "detach": `+= loss.detach()`; "accumulate": gradient
#: accumulation, 4 micro-steps of `(loss / 4).backward()` a step, their sum kept in
#: `window_loss` with its graph until the optimizer's step and reset. Every mode keeps the last
#: loss (a graph rebuilt every step) in the global `loss`. Until killed.
CLASSIC = """\
import os, sys, time
import torch
pidfile, mode, seconds, start = sys.argv[1], sys.argv[2], float(sys.argv[3]), int(sys.argv[4])
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
optimizer = torch.optim.SGD(model.parameters(), lr=1e-3)
total_loss = 0
window_loss = 0
with open(pidfile + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(pidfile + ".tmp", pidfile)
step = 0
while True:
    micro = 4 if mode == "accumulate" else 1
    for _ in range(micro):
        loss = torch.nn.functional.mse_loss(model(torch.randn(32, 64)), torch.randn(32, 1))
        (loss / micro).backward()
        if mode == "accumulate":
            window_loss = window_loss + loss
    optimizer.step()
    optimizer.zero_grad()
    step += 1
    if mode == "accumulate":
        window_loss = 0
    if step >= start:
        if mode == "graph" or (mode == "few" and step < start + 5):
            total_loss += loss
        elif mode == "item":
            total_loss += loss.item()
        elif mode == "detach":
            total_loss += loss.detach()
    time.sleep(seconds)
"""

#: The step the classic loop starts accumulating at: past the agent's first discovery passes.
START = 20
#: The goal: an accumulation named at most this many steps after it began.
NAMED_WITHIN = 15


def _classic(tmp_path: Path, mode: str, seconds: float, start: int = START) -> list[str]:
    script = tmp_path / "train.py"
    script.write_text(CLASSIC)
    return [sys.executable, "-W", "ignore", str(script), str(tmp_path / "train.pid"), mode,
            str(seconds), str(start)]


def _reports(cli_env: dict[str, str], tmp_path: Path, fake_node: FakeNode, command: list[str]
             ) -> Iterator[tuple[Any, int]]:
    """Run `command` under `gpuwatch run` against a daemon; yield (its leak finding or None,
    the step its agent reached), as read off the daemon's state socket, until the caller stops."""
    from gpuwatch.serve.state_client import STATE_SOCKET_NAME, StateUnavailable, fetch_status

    state = Path(cli_env["GPUWATCH_RUNTIME_DIR"]) / STATE_SOCKET_NAME
    config = "[detectors]\nleak_warmup_steps = 10\n"
    with running_daemon(cli_env, tmp_path / "daemon", config=config,
                        args=("--interval", str(INTERVAL))) as d, \
            supervised(tmp_path, cli_env, command, "--no-cgroup") as run:
        pid = _job_pid(tmp_path / "train.pid", run.proc)
        fake_node.hold(pid, device=0, used=GIB)
        while True:
            def read() -> Optional[tuple[Any, int]]:
                try:
                    doc = fetch_status(state)
                except StateUnavailable:
                    return None
                process = next((p for p in doc["processes"] if p["pid"] == pid), None)
                agent: Any = process["agent"] if process is not None else None
                step = agent.get("step") if agent else None
                if step is None:
                    return None
                leak = next((f for f in doc.get("findings", ()) if f["kind"] == "leak"
                             and f["pid"] == pid), None)
                return leak, step
            yield wait_for("a report of the training loop", read, WAIT, alive=d.proc,
                           pause=_until_the_next_poll)
            assert run.proc.poll() is None, "the training loop exited"
            _until_the_next_poll(0)


@pytest.mark.parametrize("seconds,start", [(0.3, START), (2.0, 5)],
                         ids=["0.3s-steps", "2s-steps"])
def test_total_loss_accumulated_after_backward_is_an_autograd_history_leak_within_15_steps(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path, seconds: float,
        start: int) -> None:
    with closing(_reports(cli_env, tmp_path, fake_node,
                          _classic(tmp_path, "graph", seconds, start))) as reports:
        for leak, step in reports:
            assert step <= start + NAMED_WITHIN + 10, f"no leak by step {step}"
            if leak is not None:
                break
    details = leak["details"]
    # Raised on the history alone: the nodes of a step's graph are too few bytes for RSS.
    assert details["series"] == "autograd history", leak
    assert details["culprit"] == "__main__.total_loss", leak
    assert details["found_by"] == "autograd", leak
    assert details["window_steps"][1] - start <= NAMED_WITHIN, leak
    assert leak["severity"] == "warning", leak
    # Placed at the step the agent counted it at (a pass before the report that carries it),
    # not at the report's: its start is found where the loop began accumulating.
    assert start - 1 <= details["history_since_step"] <= start, leak
    assert details["graph_nodes_per_step"] >= 1, leak
    assert ("autograd history grows every step; `__main__.total_loss` holds the graph of every "
            f"step since step {details['history_since_step']}: use `loss.item()` or "
            "`.detach()` (autograd)") == leak["reason"], leak


@pytest.mark.parametrize("mode,seconds", [("item", 0.1), ("detach", 0.1), ("few", 0.3),
                                          ("accumulate", 0.2)])
def test_a_loop_that_keeps_no_growing_history_raises_no_leak(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path, mode: str,
        seconds: float) -> None:
    # A graph rebuilt every step (`loss`) in each; "few" holds a history that grew 5 steps and
    # stopped (at a discovery pass a step, every one of them counted), "accumulate" one that
    # grows over 4 micro-steps and is freed every step.
    with closing(_reports(cli_env, tmp_path, fake_node,
                          _classic(tmp_path, mode, seconds))) as reports:
        for leak, step in reports:
            assert leak is None, leak
            # Well past the steps the leaking loop needs to be named.
            if step >= START + 6 * NAMED_WITHIN:
                break
