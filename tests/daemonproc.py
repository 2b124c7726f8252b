"""A real `gpuwatch daemon` process for tests, and reading what it serves."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
import urllib.request
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional, TypeVar

from prometheus_client.parser import text_string_to_metric_families

from gpuwatch.simulate.demo import read_json, wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from tests.realprocs import gpuwatch, status_json, terminate

T = TypeVar("T")
#: How long a test waits for what a daemon polling every 0.2 s shows within a few polls when the
#: machine is idle: a deadline for a loaded machine (a full suite beside a CPU hog), never a speed
#: the test asserts. A test that passes returns as soon as it is seen.
WAIT = 60.0
Samples = dict[tuple[str, tuple[tuple[str, str], ...]], float]


@dataclass
class RunningDaemon:
    proc: subprocess.Popen[bytes]
    runtime_dir: Path
    metrics_url: str
    log_path: Path
    config_path: Path

    def scrape_text(self) -> str:
        with urllib.request.urlopen(self.metrics_url, timeout=10) as r:
            return str(r.read().decode())

    def scrape(self) -> Samples:
        """{(name, sorted labels): value} of every sample /metrics serves."""
        out: Samples = {}
        for family in text_string_to_metric_families(self.scrape_text()):
            for s in family.samples:
                out[(s.name, tuple(sorted(s.labels.items())))] = s.value
        return out

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_for_metrics(self, what: str, probe: Callable[[Samples], Optional[T]],
                         timeout: float = WAIT) -> T:
        return wait_for(what, lambda: probe(self.scrape()), timeout, alive=self.proc)

    def wait_for_log(self, text: str, timeout: float = WAIT) -> None:
        wait_for(f"log line {text!r}", lambda: True if text in self.log() else None, timeout)


def value(samples: Samples, name: str, **labels: str) -> Optional[float]:
    """The value of the one sample with `name` whose labels include `labels`."""
    found = [v for (n, ls), v in samples.items()
             if n == name and all(dict(ls).get(k) == want for k, want in labels.items())]
    assert len(found) <= 1, f"{name} {labels} matches {len(found)} samples"
    return found[0] if found else None


def pids_with_series(samples: Samples, name: str) -> set[int]:
    return {int(dict(ls)["pid"]) for (n, ls), _ in samples.items() if n == name}


@contextlib.contextmanager
def running_daemon(env: Mapping[str, str], tmp_path: Path, config: str = "",
                   args: tuple[str, ...] = ("--interval", "0.2"),
                   prefix: Sequence[str] = ()) -> Iterator[RunningDaemon]:
    """Start the daemon on 127.0.0.1 (a free port), wait until it serves, stop it after.
    `prefix` runs it through another program (setpriv: another user, other capabilities); it
    then starts in `tmp_path`, whose files are made readable for that user."""
    runtime = Path(env.get("GPUWATCH_RUNTIME_DIR", tmp_path / "run"))
    tmp_path.mkdir(parents=True, exist_ok=True)
    config_path = tmp_path / "gpuwatch.toml"
    config_path.write_text(config)
    if prefix:
        tmp_path.chmod(0o755)
        config_path.chmod(0o644)
    log_path = tmp_path / "daemon.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*prefix, sys.executable, "-m", "gpuwatch", "daemon", "--listen", "127.0.0.1:0",
             "--config", str(config_path), "--runtime-dir", str(runtime), *args],
            env={**env, "PYTHONUNBUFFERED": "1"}, stdout=log, stderr=subprocess.STDOUT,
            cwd=tmp_path if prefix else None)
    def own_info() -> Optional[dict[str, Any]]:
        # Not a daemon.json left by an earlier daemon that was killed: this one's.
        info = read_json(runtime / "daemon.json")
        return info if info is not None and info.get("pid") == proc.pid else None

    try:
        info = wait_for("daemon.json naming this daemon", own_info, WAIT, alive=proc)
        wait_first_poll(runtime, proc)
        yield RunningDaemon(proc, runtime, info["metrics_url"], log_path, config_path)
    finally:
        terminate(proc)


def wait_first_poll(runtime: Path, proc: subprocess.Popen[bytes], timeout: float = WAIT
                    ) -> dict[str, Any]:
    """Wait until the daemon of `runtime` has finished its first poll, and return its first
    document. The daemon writes daemon.json and opens its sockets before it polls: until the
    first poll is done, its state socket answers "has not finished its first poll" and its
    /metrics has no GPU or process yet. Every test helper that starts a daemon waits here."""
    from gpuwatch.serve.state_client import StateUnavailable, fetch_status

    def first_document() -> Optional[dict[str, Any]]:
        try:
            return fetch_status(runtime / "state.sock")
        except StateUnavailable:
            return None

    return wait_for("the daemon's first poll", first_document, timeout, alive=proc)


def status_now(env: Mapping[str, str]) -> dict[str, Any]:
    """The status document of the daemon of `env`'s GPUWATCH_RUNTIME_DIR, read off its state
    socket in this process: what a test reads poll after poll while it waits (a `gpuwatch
    status --json` a read is a Python started each time). One with no finding and no process
    while the daemon is between two answers."""
    from gpuwatch.serve.state_client import STATE_SOCKET_NAME, StateUnavailable, fetch_status

    try:
        return fetch_status(Path(env["GPUWATCH_RUNTIME_DIR"]) / STATE_SOCKET_NAME)
    except StateUnavailable:
        return {"findings": [], "processes": []}


def leak_now(env: Mapping[str, str], pid: int) -> tuple[Optional[dict[str, Any]], Any]:
    """The leak finding of `pid` (or None) and its process in the daemon's document now
    (`status_now`): None and None while the daemon is between two answers."""
    doc = status_now(env)
    found = next((f for f in doc.get("findings", ()) if f["kind"] == "leak"
                  and f["pid"] == pid), None)
    process = next((p for p in doc["processes"] if p["pid"] == pid), None)
    return found, process


def by_pid(doc: dict[str, Any], kind: str) -> dict[int, dict[str, Any]]:
    """The document's findings of `kind`, by PID."""
    return {f["pid"]: f for f in doc["findings"] if f["kind"] == kind}


class DaemonReader:
    """How tests read a running daemon's findings, as an SRE does (`gpuwatch status` asking the
    daemon): for classes with `env` (the CLI's environment) and `daemon`."""

    env: dict[str, str]
    daemon: RunningDaemon

    def doc(self) -> dict[str, Any]:
        _, doc = status_json(self.env)
        assert doc["source"] == "daemon", doc.get("source_detail")
        return doc

    def doc_when(self, what: str, predicate: Callable[[dict[str, Any]], bool],
                 timeout: float = WAIT) -> dict[str, Any]:
        def probe() -> Optional[dict[str, Any]]:
            _, doc = status_json(self.env)
            # A daemon too slow to answer its state socket in time (a loaded machine) makes
            # `status` poll locally: asked again, not taken for the daemon's view.
            if doc["source"] != "daemon":
                return None
            return doc if predicate(doc) else None
        return wait_for(what, probe, timeout, alive=self.daemon.proc)

    def holding(self, *pids: int) -> dict[str, Any]:
        """The daemon's view once it sees every one of `pids` holding GPU memory."""
        return self.doc_when(f"{pids} seen holding GPU memory", lambda d: set(pids) <= {
            p["pid"] for p in d["processes"] if p["holds_gpu"]})

    def findings_of(self, kind: str, pids: Iterable[int], timeout: float = WAIT
                    ) -> dict[int, dict[str, Any]]:
        """Wait until the daemon has a `kind` finding for each of `pids`; {pid: finding}."""
        wanted = set(pids)
        doc = self.doc_when(f"{kind} findings for {sorted(wanted)}",
                            lambda d: wanted <= set(by_pid(d, kind)), timeout)
        return {pid: by_pid(doc, kind)[pid] for pid in wanted}


@dataclass
class WatchedNode(DaemonReader):
    """A fake node, the CLI's environment for it, and a daemon watching it."""

    node: FakeNode
    env: dict[str, str]
    daemon: RunningDaemon

    def orphan(self, job: Any, used: int) -> tuple[int, dict[str, Any]]:
        """Let the daemon see the job's single worker hold `used` bytes, kill its launcher, and
        return the worker's PID and the first document that names it an orphan."""
        from tests.scenarios import sigkill_launcher

        (worker,) = job.workers
        self.node.hold(worker, device=0, used=used)
        self.holding(worker)
        sigkill_launcher(job)
        return worker, self.doc_when("the orphan", lambda d: worker in by_pid(d, "orphan"))

    def status_text(self) -> str:
        result = gpuwatch(["status"], self.env)
        assert "from the running daemon" in result.stdout
        return result.stdout


def setpriv_or_skip() -> str:
    """setpriv(1), to run a program as uid 65534 or with other capabilities; skips the test
    where that cannot be done."""
    import os
    import pwd
    import shutil

    import pytest

    if os.geteuid() != 0:
        pytest.skip("needs root to run processes as other users and with other capabilities")
    setpriv = shutil.which("setpriv")
    if setpriv is None:
        pytest.skip("no setpriv(1) (util-linux)")
    try:
        pwd.getpwuid(65534)
    except KeyError:
        pytest.skip("no user with uid 65534")
    return setpriv


@contextlib.contextmanager
def shared_node(fake_nvml_lib: Path, runtime_owner: int, state_owner: int
                ) -> Iterator[tuple[FakeNode, dict[str, str]]]:
    """A fake node with its runtime and state directories (owned as given) in a directory any
    user can reach (pytest's tmp_path is root's alone), for a daemon or a caller of another
    uid. Yields the node and the environment; the directory is its HOME."""
    shared = Path(tempfile.mkdtemp(prefix="gpuwatch-reap-"))
    try:
        shared.chmod(0o755)
        node = FakeNode(shared / "fake-nvml.state", shutil.copytree(fake_nvml_lib, shared / "lib"))
        node.write()
        for directory, owner in ((shared / "run", runtime_owner), (shared / "state", state_owner)):
            directory.mkdir(mode=0o755)
            os.chown(directory, owner, owner)
        env = node.env()
        env.update({"GPUWATCH_RUNTIME_DIR": str(shared / "run"),
                    "GPUWATCH_STATE_DIR": str(shared / "state"), "GPUWATCH_CONFIG": "/dev/null",
                    "HOME": str(shared)})
        env.pop("NOTIFY_SOCKET", None)
        yield node, env
    finally:
        shutil.rmtree(shared, ignore_errors=True)

