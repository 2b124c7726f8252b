"""The autograd-history leak named: a real torch loop (CPU build) that never imports gpuwatch,
run under `gpuwatch run`, keeps `total_loss += loss` at module level for a loss it never calls
backward() on (an evaluation without torch.no_grad()), so every step's graph and what it saved
for backward stay alive; the agent's discovery finds the tensor's graph growing
and the daemon names it. The same loop with `loss.item()` stays quiet."""

from __future__ import annotations

import sys
import types
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
    assert details["series"] == "RSS", finding
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
                 alive=d.proc)


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
