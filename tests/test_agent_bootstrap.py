"""The agent without a line in the program: the bootstrap directory (gpuwatch/agent/bootstrap)
that `gpuwatch run` puts first on its job's PYTHONPATH, and the optimizer hook that counts steps.
Real torch training scripts that never import gpuwatch, run under `gpuwatch run` against a real
daemon, or under the bootstrap alone."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any, Optional

import pytest

from gpuwatch.launch_env import AGENT_BOOTSTRAP_DIR
from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from tests.daemonproc import running_daemon
from tests.realprocs import GIB, status_json
from tests.test_run import supervised

pytest.importorskip("torch", reason="the optimizer hook needs torch")

WAIT = 90.0
INTERVAL = 0.2

#: A training loop that knows nothing of gpuwatch. argv: PIDFILE LEAK_MIB STEPS [SECONDS].
#: Writes its PID to PIDFILE, then trains STEPS steps (0: until killed), SECONDS each (0.2 s),
#: keeping LEAK_MIB MiB a step in a module-level dict (a cache that is never evicted).
TRAIN = """\
import os, sys, time
import torch
pidfile, leak_mib, steps = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
seconds = float(sys.argv[4]) if len(sys.argv) > 4 else 0.2
CACHE = {}
model = torch.nn.Linear(16, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
with open(pidfile + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(pidfile + ".tmp", pidfile)
i = 0
while steps == 0 or i < steps:
    optimizer.zero_grad()
    model(torch.randn(8, 16)).sum().backward()
    optimizer.step()
    if leak_mib:
        CACHE[i] = bytearray(leak_mib << 20)
    i += 1
    time.sleep(seconds)
"""

#: The same loop driven by accelerate (Accelerator().prepare, accelerator.backward), knowing
#: nothing of gpuwatch. argv: PIDFILE LEAK_MIB SECONDS; trains until killed.
ACCELERATE_TRAIN = """\
import os, sys, time
import torch
from accelerate import Accelerator
pidfile, leak_mib, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
CACHE = {}
accelerator = Accelerator(cpu=True)
model = torch.nn.Linear(16, 4)
optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
data = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.randn(64, 16)),
                                   batch_size=8)
model, optimizer, data = accelerator.prepare(model, optimizer, data)
with open(pidfile + ".tmp", "w") as f:
    f.write(str(os.getpid()))
os.rename(pidfile + ".tmp", pidfile)
i = 0
while True:
    for (batch,) in data:
        optimizer.zero_grad()
        accelerator.backward(model(batch).sum())
        optimizer.step()
        CACHE[i] = bytearray(leak_mib << 20)
        i += 1
        time.sleep(seconds)
"""

#: Two optimizers a step (a GAN's discriminator, then its generator), ITERATIONS steps; then,
#: with "explicit", the program's own agent.step(1000 + i) for three more steps. Prints the
#: step the agent last recorded.
TWO_OPTIMIZERS = """\
import sys
import torch
iterations, explicit = int(sys.argv[1]), sys.argv[2] == "explicit"
d, g = torch.nn.Linear(4, 1), torch.nn.Linear(4, 4)
opt_d = torch.optim.Adam(d.parameters())
opt_g = torch.optim.Adam(g.parameters())
def train_step():
    for opt in (opt_d, opt_g):
        opt.zero_grad()
        d(g(torch.randn(2, 4))).sum().backward()
        opt.step()
for _ in range(iterations):
    train_step()
import gpuwatch.agent as agent
if explicit:
    for i in range(3):
        agent.step(1000 + i)
        train_step()
print(agent._st.last[0])
"""


def _bootstrap_env(tmp_path: Path, *pythonpath: str, **extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "GPUWATCH_AGENT")}
    env["PYTHONPATH"] = os.pathsep.join([AGENT_BOOTSTRAP_DIR, *pythonpath, os.getcwd()])
    env["GPUWATCH_RUNTIME_DIR"] = str(tmp_path / "no-daemon")
    env.update(extra)
    return env


def _python(tmp_path: Path, source: str, *args: str, env: dict[str, str]
            ) -> subprocess.CompletedProcess[str]:
    script = tmp_path / f"script-{abs(hash(source))}.py"
    script.write_text(source)
    return subprocess.run([sys.executable, "-W", "ignore", str(script), *args], env=env,
                          capture_output=True, text=True, timeout=WAIT)


def _agent_of(env: dict[str, str], pid: int, now: bool = False) -> Optional[dict[str, Any]]:
    """The agent part of the process's entry in `gpuwatch status --json`; with `now`, read off
    the daemon's state socket in this process instead (a test waiting reads it poll after poll,
    and the command is a Python started each time)."""
    if now:
        from gpuwatch.serve.state_client import STATE_SOCKET_NAME, StateUnavailable, fetch_status

        try:
            doc = fetch_status(Path(env["GPUWATCH_RUNTIME_DIR"]) / STATE_SOCKET_NAME)
        except StateUnavailable:
            return None
    else:
        _, doc = status_json(env)
    if doc["source"] != "daemon":
        return None
    process = next((p for p in doc["processes"] if p["pid"] == pid), None)
    return process["agent"] if process is not None else None


def _job_pid(pidfile: Path, alive: Any) -> int:
    def written() -> Optional[int]:
        try:
            return int(pidfile.read_text())
        except (OSError, ValueError):
            return None
    return wait_for("the training script's PID", written, WAIT, alive=alive)


def test_a_torch_script_that_never_imports_gpuwatch_reports_its_optimizer_steps_under_run(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    pidfile = tmp_path / "train.pid"
    with running_daemon(cli_env, tmp_path / "daemon", args=("--interval", str(INTERVAL))) as d, \
            supervised(tmp_path, cli_env, [sys.executable, "-W", "ignore", str(script),
                                           str(pidfile), "0", "0"], "--no-cgroup") as run:
        pid = _job_pid(pidfile, run.proc)
        fake_node.hold(pid, device=0, used=GIB)
        def step_at_least(least: int, now: bool = True) -> Optional[int]:
            agent = _agent_of(cli_env, pid, now)
            step = agent.get("step") if agent is not None else None
            return step if step is not None and step >= least else None

        first = wait_for("an agent step", lambda: step_at_least(0), WAIT, alive=d.proc)
        later = wait_for("the agent's step advancing", lambda: step_at_least(first + 3), WAIT,
                         alive=d.proc)
        assert later > first >= 1
        # And `gpuwatch status --json` shows the step.
        assert step_at_least(later, now=False) is not None


#: Steps from a leak raised to its culprit named, at most (the goal in docs/agent.md).
NAMED_WITHIN_STEPS = 15


def leak_named_within_steps(cli_env: dict[str, str], tmp_path: Path, fake_node: FakeNode,
                            command: list[str], expected: str, found_by: str = "discovered"
                            ) -> dict[str, Any]:
    """Run `command` (a leaking training script that writes its PID to tmp_path/train.pid) under
    `gpuwatch run` against a daemon; wait for its leak finding to name `expected`, and check
    that it did so at most NAMED_WITHIN_STEPS steps after the leak was first shown. Each step
    is the one the finding's test window ends at, read off the daemon's state socket."""
    from gpuwatch.serve.state_client import STATE_SOCKET_NAME, StateUnavailable, fetch_status

    state = Path(cli_env["GPUWATCH_RUNTIME_DIR"]) / STATE_SOCKET_NAME
    config = "[detectors]\nleak_warmup_steps = 10\n"
    raised: Optional[int] = None
    with running_daemon(cli_env, tmp_path / "daemon", config=config,
                        args=("--interval", str(INTERVAL))) as d, \
            supervised(tmp_path, cli_env, command, "--no-cgroup") as run:
        pid = _job_pid(tmp_path / "train.pid", run.proc)
        fake_node.hold(pid, device=0, used=GIB)

        def named() -> Optional[dict[str, Any]]:
            nonlocal raised
            try:
                doc = fetch_status(state)
            except StateUnavailable:
                return None
            found = next((f for f in doc.get("findings", ()) if f["kind"] == "leak"
                          and f["pid"] == pid), None)
            if found is None:
                return None
            if raised is None:
                raised = found["details"]["window_steps"][1]
            return found if found["details"].get("culprit") else None

        finding = wait_for("the leak finding naming its culprit", named, 4 * WAIT,
                           alive=d.proc)
    details = finding["details"]
    assert details["culprit"] == expected, finding
    assert details["found_by"] == found_by, finding
    assert raised is not None
    assert details["window_steps"][1] - raised <= NAMED_WITHIN_STEPS, (raised, finding)
    return finding


def assert_about_8_mib_a_step(finding: dict[str, Any]) -> None:
    """The growth the finding says is the script's 8 MiB a step, within a quarter: the slope
    runs between the medians of a few points each, and on a loaded machine a point's RSS can be
    read a step late (measured once: 6.7 MiB), where a wrong series (GPU memory: 0, or the
    dict's items: 1) would be far off either way."""
    assert 6 * 2**20 <= finding["details"]["growth_bytes_per_step"] <= 10 * 2**20, finding


@pytest.mark.parametrize("seconds", [0.3, 2.0], ids=["0.3s-steps", "2s-steps"])
def test_a_torch_script_leaking_8_mib_a_step_into_a_dict_has_it_named_within_15_steps_under_run(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path, seconds: float) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    # The agent's discovery names the dict the script never told it of.
    finding = leak_named_within_steps(
        cli_env, tmp_path, fake_node,
        [sys.executable, "-W", "ignore", str(script), str(tmp_path / "train.pid"), "8", "0",
         str(seconds)], "__main__.CACHE")
    assert_about_8_mib_a_step(finding)


def test_an_accelerate_loop_leaking_8_mib_a_step_has_it_named_within_15_steps_under_run(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    pytest.importorskip("accelerate", reason="accelerate is not installed here (make test "
                        "installs it beside torch)")
    script = tmp_path / "train.py"
    script.write_text(ACCELERATE_TRAIN)
    finding = leak_named_within_steps(
        cli_env, tmp_path, fake_node,
        [sys.executable, "-W", "ignore", str(script), str(tmp_path / "train.pid"), "8", "0.3"],
        "__main__.CACHE")
    assert_about_8_mib_a_step(finding)


def test_with_no_agent_the_jobs_python_makes_no_agent_report(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    pidfile = tmp_path / "train.pid"
    with running_daemon(cli_env, tmp_path / "daemon", args=("--interval", str(INTERVAL))) as d, \
            supervised(tmp_path, cli_env, [sys.executable, "-W", "ignore", str(script),
                                           str(pidfile), "0", "0"], "--no-cgroup",
                       "--no-agent") as run:
        pid = _job_pid(pidfile, run.proc)
        fake_node.hold(pid, device=0, used=GIB)
        # Long enough for many steps: seen holding memory for 3 s, never with an agent.
        seen = 0

        def three_seconds_seen() -> Optional[bool]:
            nonlocal seen
            _, doc = status_json(cli_env)
            process = next((p for p in doc["processes"] if p["pid"] == pid), None)
            if doc["source"] != "daemon" or process is None:
                return None
            assert process["agent"] is None
            seen += 1
            return True if seen >= 8 else None

        wait_for("the job seen for a while", three_seconds_seen, WAIT, alive=d.proc)


def test_an_existing_sitecustomize_on_pythonpath_still_runs_under_the_bootstrap(
        tmp_path: Path) -> None:
    other = tmp_path / "site"
    other.mkdir()
    marker = tmp_path / "marker"
    (other / "sitecustomize.py").write_text(f"open({str(marker)!r}, 'w').write('ran')\n")
    for mode in ("auto", "0"):
        marker.unlink(missing_ok=True)
        result = _python(tmp_path, "import sys; print(sys.modules['sitecustomize'].__file__)",
                         env=_bootstrap_env(tmp_path, str(other), GPUWATCH_AGENT=mode))
        assert result.returncode == 0, result.stderr
        assert result.stderr == ""
        assert marker.read_text() == "ran"


def test_a_bootstrap_that_fails_prints_one_line_and_the_program_runs(tmp_path: Path) -> None:
    # A torch whose optimizer module has no step hooks (as before 2.0): installing fails.
    fake = tmp_path / "fake"
    (fake / "torch" / "optim").mkdir(parents=True)
    (fake / "torch" / "__init__.py").write_text("")
    (fake / "torch" / "optim" / "__init__.py").write_text("from torch.optim import optimizer\n")
    (fake / "torch" / "optim" / "optimizer.py").write_text("")
    unreadable = tmp_path / "unreadable"
    unreadable.mkdir(mode=0)
    result = _python(tmp_path, "import torch.optim\nprint('trained')\n",
                     env=_bootstrap_env(tmp_path, str(fake), GPUWATCH_AGENT="auto",
                                        GPUWATCH_RUNTIME_DIR=str(unreadable)))
    assert result.returncode == 0
    assert result.stdout == "trained\n"
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("gpuwatch: agent bootstrap: could not count optimizer steps")
    assert lines[0].endswith("the program runs without the agent")


def test_the_bootstrap_loads_nothing_of_gpuwatch_until_torch_optim_is_imported(
        tmp_path: Path) -> None:
    source = ("import sys\nprint(sorted(m for m in sys.modules if m.startswith('gpuwatch')))\n"
              "import torch.optim\nprint('gpuwatch.agent._auto' in sys.modules)\n")
    on = _python(tmp_path, source, env=_bootstrap_env(tmp_path, GPUWATCH_AGENT="auto"))
    assert on.returncode == 0, on.stderr
    assert on.stdout.splitlines() == ["[]", "True"]
    off = _python(tmp_path, source, env=_bootstrap_env(tmp_path, GPUWATCH_AGENT="0"))
    assert off.stdout.splitlines() == ["[]", "False"]


def test_two_optimizers_a_step_count_one_step_per_iteration(tmp_path: Path) -> None:
    result = _python(tmp_path, TWO_OPTIMIZERS, "7", "hook",
                     env=_bootstrap_env(tmp_path, GPUWATCH_AGENT="auto"))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["7"]


def test_an_explicit_agent_step_wins_over_the_optimizer_hook(tmp_path: Path) -> None:
    result = _python(tmp_path, TWO_OPTIMIZERS, "5", "explicit",
                     env=_bootstrap_env(tmp_path, GPUWATCH_AGENT="auto"))
    assert result.returncode == 0, result.stderr
    # The optimizer steps after the program's own step(1002) do not move it.
    assert result.stdout.split() == ["1002"]


def test_gpuwatch_run_puts_the_bootstrap_first_on_the_jobs_pythonpath(tmp_path: Path) -> None:
    from gpuwatch.actions.supervisor import agent_environment

    env = {"PYTHONPATH": os.pathsep.join(["/a", AGENT_BOOTSTRAP_DIR, "/b"])}
    agent_environment(env, True)
    assert env == {"PYTHONPATH": os.pathsep.join([AGENT_BOOTSTRAP_DIR, "/a", "/b"]),
                   "GPUWATCH_AGENT": "auto"}
    env = {"GPUWATCH_AGENT": "0"}
    agent_environment(env, True)
    assert env == {"GPUWATCH_AGENT": "0", "PYTHONPATH": AGENT_BOOTSTRAP_DIR}
    env = {"GPUWATCH_AGENT": "auto", "PYTHONPATH": "/a"}
    agent_environment(env, False)
    assert env == {"GPUWATCH_AGENT": "0", "PYTHONPATH": "/a"}
    assert subprocess.run([sys.executable, "-m", "gpuwatch", "agent-path"], capture_output=True,
                          text=True, check=True).stdout == AGENT_BOOTSTRAP_DIR + "\n"
