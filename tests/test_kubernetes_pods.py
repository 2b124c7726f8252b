"""On a simulated Kubernetes node: a stand-in kubelet serving the real PodResources v1 protocol,
the kubelet's pod log directories and containerd's records under the test's directory, and real
processes in pod-shaped cgroups holding GPU memory of the fake driver. The daemon names each
process's namespace, pod and container within a poll of the pod appearing, says which GPUs the
pod was given, makes an orphan of a pod deleted while its process holds GPU memory, and keeps
polling on time with the kubelet's socket hung."""

from __future__ import annotations

import contextlib
import json
import re
import secrets
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode, default_uuid
from tests.alertmanager import WebhookReceiver, alertmanager_binary, alertmanager_routing_to
from tests.daemonproc import WatchedNode, running_daemon
from tests.promserver import built_rules, prometheus_scraping
from tests.realprocs import gpuwatch
from tests.scenarios import GONE_TIMEOUT
from tests.standin_kubelet import (
    FakePod,
    hung_kubelet,
    pod_cgroup,
    standin_kubelet,
    write_containerd_record,
    write_pod_logs,
)

GIB = 1 << 30
# A pod and a container of this process's own: the cgroups they name are the host's, shared by
# every worker of this suite and by a second suite running beside it.
UID = str(uuid.uuid4())
CTR = secrets.token_hex(32)
INTERVAL = 0.25


@contextlib.contextmanager
def short_dir() -> Iterator[Path]:
    # A Unix socket's path is at most 107 bytes: pytest's tmp_path may be longer.
    with tempfile.TemporaryDirectory(prefix="gw-k8s-") as d:
        yield Path(d)


def config(socket: Path, tmp_path: Path, refresh: str = "1s", timeout: str = "2s") -> str:
    return f"""
[detectors]
min_age = 0
[kubernetes]
pod_resources_socket = "{socket}"
pod_logs_dir = "{tmp_path / 'pods'}"
runtime_dirs = ["{tmp_path / 'k8s.io'}"]
refresh = "{refresh}"
timeout = "{timeout}"
"""


@contextlib.contextmanager
def process_in(cgroup: Path) -> Iterator[subprocess.Popen[bytes]]:
    """A process started in `cgroup` (as the runtime starts a container's first process)."""
    proc = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"],
        preexec_fn=lambda: (cgroup / "cgroup.procs").write_text("0"), start_new_session=True)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(GONE_TIMEOUT)


def _job(doc: dict[str, Any], pid: int) -> dict[str, Any] | None:
    return next((p["job"] for p in doc["processes"] if p["pid"] == pid), None)


def test_a_process_in_a_pod_is_named_by_namespace_pod_and_container_within_a_poll(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    pod = FakePod("ml-team", "trainer-0", UID, {"trainer": [default_uuid(0)]})
    with short_dir() as short, standin_kubelet(short / "kubelet.sock", tmp_path) as kubelet, \
            pod_cgroup(UID, CTR) as cgroup, process_in(cgroup) as proc, \
            running_daemon(cli_env, tmp_path, config=config(short / "kubelet.sock", tmp_path),
                           args=("--interval", str(INTERVAL))) as daemon:
        watched = WatchedNode(fake_node, cli_env, daemon)
        fake_node.hold(proc.pid, device=0, used=4 * GIB)
        doc = watched.holding(proc.pid)
        assert _job(doc, proc.pid) == {"id": UID, "source": "kubernetes"}
        # The pod appears: the kubelet lists it, its log directory and container record exist.
        kubelet.set_pods(pod)
        write_pod_logs(tmp_path / "pods", pod)
        write_containerd_record(tmp_path / "k8s.io", CTR, pod, "trainer")
        appeared = time.monotonic()
        doc = watched.doc_when("the pod's names", lambda d: (_job(d, proc.pid) or {}).get("pod")
                               is not None)
        # The poll that first saw it woke the refresher; the one after has the names.
        assert time.monotonic() - appeared < 30
        assert _job(doc, proc.pid) == {"id": UID, "source": "kubernetes",
                                       "namespace": "ml-team", "pod": "trainer-0",
                                       "container": "trainer"}
        text = watched.status_text()
        assert "ml-team/trainer-0/trainer" in text, text
        metrics = urllib.request.urlopen(daemon.metrics_url, timeout=30).read().decode()
        assert "gpuwatch_kubelet_up 1.0" in metrics
        assert 'pod_namespace="ml-team"' in metrics and 'pod_container="trainer"' in metrics

        # Deleted: the kubelet stops listing it while its process still holds GPU memory.
        kubelet.set_pods()
        orphan = watched.findings_of("orphan", [proc.pid])[proc.pid]
        assert "pod ml-team/trainer-0" in orphan["reason"], orphan
        assert "gone from the kubelet's pods" in orphan["reason"], orphan
        # Said on the wall clock, as every time of a reason is: a minute or so ago at most.
        since = re.search(r"since (\d\d):(\d\d):(\d\d)Z", orphan["reason"])
        assert since is not None, orphan
        now = time.gmtime()
        ago = ((now.tm_hour * 3600 + now.tm_min * 60 + now.tm_sec)
               - (int(since[1]) * 3600 + int(since[2]) * 60 + int(since[3]))) % 86400
        assert ago < 120, orphan["reason"]
        assert orphan["job"]["pod"] == "trainer-0"
        plan = gpuwatch(["reap", "--dry-run", "--pod", "ml-team/trainer-0", "--json"], cli_env)
        assert plan.returncode == 0, plan.stdout + plan.stderr
        assert [a["pid"] for a in json.loads(plan.stdout)["actions"]] == [proc.pid]


def test_a_process_on_a_gpu_its_pod_was_not_allocated_is_a_finding_with_that_evidence(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    """NVIDIA_VISIBLE_DEVICES=all in a pod given GPU 0: its process holds memory on GPU 1."""
    pod = FakePod("ml-team", "trainer-0", UID, {"trainer": [default_uuid(0)]})
    with short_dir() as short, standin_kubelet(short / "kubelet.sock", tmp_path) as kubelet, \
            pod_cgroup(UID, CTR) as cgroup, process_in(cgroup) as proc, \
            running_daemon(cli_env, tmp_path, config=config(short / "kubelet.sock", tmp_path),
                           args=("--interval", str(INTERVAL))) as daemon:
        kubelet.set_pods(pod)
        write_pod_logs(tmp_path / "pods", pod)
        watched = WatchedNode(fake_node, cli_env, daemon)
        fake_node.hold(proc.pid, device=0, used=2 * GIB)
        watched.doc_when("the pod's names", lambda d: (_job(d, proc.pid) or {}).get("pod")
                         is not None)
        assert "unallocated" not in {f["kind"] for f in watched.doc()["findings"]}
        fake_node.hold(proc.pid, device=1, used=3 * GIB)
        found = watched.findings_of("unallocated", [proc.pid])[proc.pid]
        assert found["gpus"] == [1], found
        assert default_uuid(1) in found["reason"] and default_uuid(0) in found["reason"], found
        assert "ml-team/trainer-0" in found["reason"]


def test_a_hung_kubelet_delays_no_poll(fake_node: FakeNode, cli_env: dict[str, str],
                                       tmp_path: Path) -> None:
    """The socket accepts and never answers: each call waits out its deadline on the pod
    source's thread, while polls keep their interval and the pod log directories still name
    the pod."""
    pod = FakePod("ml-team", "trainer-0", UID, {"trainer": [default_uuid(0)]})
    write_pod_logs(tmp_path / "pods", pod)
    with short_dir() as short, hung_kubelet(short / "kubelet.sock") as accepted, \
            pod_cgroup(UID, CTR) as cgroup, process_in(cgroup) as proc, \
            running_daemon(cli_env, tmp_path,
                           config=config(short / "kubelet.sock", tmp_path, refresh="0.1s",
                                         timeout="5s"),
                           args=("--interval", str(INTERVAL))) as daemon:
        watched = WatchedNode(fake_node, cli_env, daemon)
        fake_node.hold(proc.pid, device=0, used=GIB)
        doc = watched.doc_when("the pod's names", lambda d: (_job(d, proc.pid) or {}).get("pod")
                               is not None)
        assert _job(doc, proc.pid)["namespace"] == "ml-team"  # type: ignore[index]
        assert accepted, "the daemon never connected to the kubelet's socket"
        # Every poll's duration, as the daemon measures it, over several hung calls.
        durations = []
        deadline = time.monotonic() + 12
        while time.monotonic() < deadline:
            durations.append(watched.doc()["poll_duration_seconds"])
            time.sleep(0.5)
        assert max(durations) < 1.0, durations
        # Counted: the calls that got no answer, and the kubelet down.
        metrics = urllib.request.urlopen(daemon.metrics_url, timeout=30).read().decode()
        assert "gpuwatch_kubelet_up 0.0" in metrics, metrics
        failed = re.search(r'^gpuwatch_kubelet_calls_total\{result="failed"\} (\S+)$', metrics,
                           re.M)
        assert failed is not None and float(failed[1]) >= 1, metrics
        doctor = gpuwatch(["doctor"], {**cli_env, "GPUWATCH_CONFIG": str(daemon.config_path)})
        assert "pod log directories" in doctor.stdout and "did not answer" in doctor.stdout, \
            doctor.stdout


def test_an_alert_about_a_deleted_pod_pages_its_namespace_through_an_alertmanager_route(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    """The orphan of a deleted pod, scraped as the Prometheus Operator scrapes (every series gets
    gpuwatch's own `namespace`), fires GpuwatchOrphansHoldGpuMemory with the pod's namespace,
    and Alertmanager's route on `namespace` sends it to that namespace's receiver alone."""
    if alertmanager_binary() is None or shutil.which("prometheus") is None:
        pytest.skip("needs prometheus and alertmanager (make test installs them)")
    pod = FakePod("ml-team", "trainer-0", UID, {"trainer": [default_uuid(0)]})
    ml_team, research, on_call = WebhookReceiver(), WebhookReceiver(), WebhookReceiver()
    operator_like = ("relabel_configs:\n  - target_label: namespace\n"
                     "    replacement: gpuwatch\n")
    try:
        with short_dir() as short, standin_kubelet(short / "kubelet.sock", tmp_path) as kubelet, \
                pod_cgroup(UID, CTR) as cgroup, process_in(cgroup) as proc, \
                running_daemon(cli_env, tmp_path,
                               config=config(short / "kubelet.sock", tmp_path),
                               args=("--interval", str(INTERVAL))) as daemon, \
                alertmanager_routing_to(on_call, tmp_path,
                                        routes={'namespace="ml-team"': ml_team,
                                                'namespace="research"': research},
                                        group_by="alertname, namespace, node, job_id") as am, \
                prometheus_scraping(daemon.metrics_url.split("//", 1)[1].split("/", 1)[0],
                                    tmp_path, [built_rules(tmp_path / "rules")], am,
                                    job_options=operator_like):
            kubelet.set_pods(pod)
            write_pod_logs(tmp_path / "pods", pod)
            watched = WatchedNode(fake_node, cli_env, daemon)
            fake_node.hold(proc.pid, device=0, used=4 * GIB)
            watched.doc_when("the pod's names",
                             lambda d: (_job(d, proc.pid) or {}).get("pod") is not None)
            kubelet.set_pods()
            watched.findings_of("orphan", [proc.pid])
            page = wait_for("the orphan's page", lambda: next(
                (n for n in ml_team.notifications for a in n.alerts
                 if a["labels"]["alertname"] == "GpuwatchOrphansHoldGpuMemory"), None), 90)
            (alert,) = page.alerts
            labels = alert["labels"]
            assert labels["namespace"] == "ml-team" and labels["pod_name"] == "trainer-0", labels
            assert labels["pod_namespace"] == "ml-team" and labels["job_id"] == UID, labels
            assert page.group_labels["namespace"] == "ml-team"
            assert alert["annotations"]["description"].startswith(
                "1 process of pod ml-team/trainer-0 on "), alert["annotations"]
            assert not [n for n in research.notifications + on_call.notifications
                        for a in n.alerts
                        if a["labels"]["alertname"] == "GpuwatchOrphansHoldGpuMemory"]
    finally:
        for receiver in (ml_team, research, on_call):
            receiver.close()


def _polls(metrics_url: str) -> float:
    text = urllib.request.urlopen(metrics_url, timeout=30).read().decode()
    found = re.search(r"^gpuwatch_polls_total (\S+)$", text, re.M)
    assert found is not None, text
    return float(found[1])


def test_a_new_pod_is_named_by_the_poll_after_the_one_that_first_sees_its_process(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    """As the kubelet does it: the pod is admitted (listed, its log directory made) before its
    container's process starts. The poll that first sees the process wakes the pod source, whose
    next regular read is a minute away; the poll after has the names."""
    pod = FakePod("ml-team", "trainer-0", UID, {"trainer": [default_uuid(0)]})
    with short_dir() as short, standin_kubelet(short / "kubelet.sock", tmp_path) as kubelet, \
            running_daemon(cli_env, tmp_path,
                           config=config(short / "kubelet.sock", tmp_path, refresh="60s"),
                           args=("--interval", "1")) as daemon:
        kubelet.set_pods(pod)
        write_pod_logs(tmp_path / "pods", pod)
        write_containerd_record(tmp_path / "k8s.io", CTR, pod, "trainer")
        watched = WatchedNode(fake_node, cli_env, daemon)
        with pod_cgroup(UID, CTR) as cgroup, process_in(cgroup) as proc:
            fake_node.hold(proc.pid, device=0, used=GIB)
            first = watched.holding(proc.pid)
            seen_at = _polls(daemon.metrics_url)
            named = (first if (_job(first, proc.pid) or {}).get("pod") else
                     watched.doc_when("the pod's names",
                                      lambda d: (_job(d, proc.pid) or {}).get("pod") is not None))
            named_at = _polls(daemon.metrics_url)
            assert _job(named, proc.pid) == {"id": UID, "source": "kubernetes",
                                             "namespace": "ml-team", "pod": "trainer-0",
                                             "container": "trainer"}
            # The poll that saw it, and the one after (a scrape may lag the document by one).
            assert named_at - seen_at <= 2, (seen_at, named_at)
