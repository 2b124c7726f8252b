"""What naming Kubernetes pods costs a poll, with the kubelet answering, absent, and hung.

A node of N pods (one process each, in its pod's cgroup, named in the pod log directories),
the pod source's refresher asking the kubelet as often as it can (every 50 ms, far more than the
daemon's 5 s), and the poll's share of the naming (gpuwatch.poll.Poller._with_pod_names: the
pod source's lookup and the records it makes) timed on the caller's thread, N polls in a row:

(a) the kubelet answers: a stand-in serving the real PodResources v1 protocol (tests/
    standin_kubelet.py, the upstream api.proto compiled with grpcio-tools), in a process of
    its own;
(b) no kubelet socket: the pod log directories alone;
(c) a socket that accepts and never answers: every call of the refresher waits out its timeout.

The poll's share should be the same in all three: the refresher's calls never run on the poll.

    python bench/pod_source.py [--pods 110] [--polls 2000] [--timeout 1.0]
"""

from __future__ import annotations

import contextlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

from cmdline import arguments, columns, write_figures

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from gpuwatch.model import HostProcess, Job  # noqa: E402
from gpuwatch.poll import Poller  # noqa: E402
from gpuwatch.sources.pods import PodSource  # noqa: E402
from tests.standin_kubelet import FakePod, hung_kubelet, write_pod_logs  # noqa: E402


def node(root: Path, pods: int) -> tuple[list[FakePod], dict[int, HostProcess]]:
    fake, processes = [], {}
    for i in range(pods):
        uid = str(uuid.uuid5(uuid.NAMESPACE_URL, f"pod-{i}"))
        pod = FakePod(f"team-{i % 7}", f"trainer-{i}", uid, {"trainer": [f"GPU-{i}"]})
        write_pod_logs(root / "pods", pod)
        fake.append(pod)
        pid = 10_000 + i
        processes[pid] = HostProcess(
            pid=pid, ppid=1, start_time=100.0, name="python",
            cgroup=f"/kubepods/burstable/pod{uid}/{i:064x}", pod_uid=uid,
            container_id=f"{i:064x}",
            job=Job(uid, "kubernetes"))
    return fake, processes


@contextlib.contextmanager
def kubelet(mode: str, path: Path, root: Path, pods: list[FakePod]) -> Iterator[None]:
    if mode == "answering":
        # In a process of its own, as the kubelet is: its serialising takes no time of ours.
        script = (f"import sys, json; sys.path.insert(0, {str(ROOT)!r})\n"
                  "from pathlib import Path\n"
                  "from tests.standin_kubelet import FakePod, standin_kubelet\n"
                  "pods = [FakePod(**p) for p in json.loads(sys.argv[3])]\n"
                  "with standin_kubelet(Path(sys.argv[1]), Path(sys.argv[2])) as k:\n"
                  "    k.set_pods(*pods); print('ready', flush=True); sys.stdin.read()\n")
        listed = json.dumps([{"namespace": p.namespace, "name": p.name, "uid": p.uid,
                              "containers": dict(p.containers)} for p in pods])
        proc = subprocess.Popen([sys.executable, "-c", script, str(path), str(root), listed],
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
            yield
        finally:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(30)
    elif mode == "hung":
        with hung_kubelet(path):
            yield
    else:
        yield


def measure(mode: str, pods: int, polls: int, timeout: float) -> dict[str, float]:
    with tempfile.TemporaryDirectory(prefix="gw-bench-pods-") as d:
        root = Path(d)
        fake, processes = node(root, pods)
        sock = root / "kubelet.sock"
        with kubelet(mode, sock, root, fake):
            source = PodSource(str(sock), str(root / "pods"), (), refresh=0.05, timeout=timeout)
            poller = Poller.__new__(Poller)  # only its pod naming is measured
            poller.pods = source
            poller._named_jobs = {}
            source.start()
            try:
                deadline = time.monotonic() + 30
                while not source.lookup({p.uid: () for p in fake})[0]:
                    if time.monotonic() > deadline:
                        raise SystemExit(f"{mode}: the pods were never named")
                    time.sleep(0.05)
                walls = []
                for _ in range(polls):
                    t0 = time.perf_counter()
                    named, _ = Poller._with_pod_names(poller, processes)
                    walls.append(time.perf_counter() - t0)
                    time.sleep(0.001)
                status = source.status()
            finally:
                source.stop()
        walls.sort()
        return {"p50_ms": statistics.median(walls) * 1e3,
                "p99_ms": walls[int(len(walls) * 0.99) - 1] * 1e3,
                "max_ms": walls[-1] * 1e3,
                "named": sum(1 for p in named.values() if p.job and p.job.pod),
                "answered": status.calls_answered, "failed": status.calls_failed}


def main() -> None:
    args = arguments(__doc__, quick={"polls": 300}, smoke={"polls": 50, "pods": 8},
                     pods=110, polls=2000, timeout=(1.0, "the kubelet's call timeout"))
    rows = [("kubelet", "pods named", "poll's share p50", "p99", "max", "calls answered",
             "failed")]
    figures = {}
    for mode in ("answering", "absent", "hung"):
        r = measure(mode, args.pods, args.polls, args.timeout)
        figures[mode] = r
        rows.append((mode, f"{r['named']:.0f}/{args.pods}", f"{r['p50_ms']:.3f} ms",
                     f"{r['p99_ms']:.3f} ms", f"{r['max_ms']:.3f} ms", f"{r['answered']:.0f}",
                     f"{r['failed']:.0f}"))
    print(f"Naming {args.pods} pods, {args.polls} polls, refresher every 50 ms, "
          f"kubelet timeout {args.timeout:g} s:")
    print(columns(rows, rule=True))
    write_figures(args.figures, figures)


if __name__ == "__main__":
    main()
