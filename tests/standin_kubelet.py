"""A stand-in kubelet: the real PodResources v1 service (tests/fixtures/podresources/api.proto,
the upstream file, compiled here with grpcio-tools) on a Unix socket, serving the pods a test
sets; and a socket that accepts and never answers (a hung kubelet).

Also the node records the kubelet and the runtime keep, made under a test's directory: the pod
log directories (NAMESPACE_NAME_UID/CONTAINER/) and containerd's OCI config.json per container.
"""

from __future__ import annotations

import contextlib
import importlib
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator, Mapping, Sequence
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from gpuwatch.simulate.demo import wait_for
from tests.scenarios import GONE_TIMEOUT

PROTO = Path(__file__).parent / "fixtures" / "podresources" / "api.proto"
_compiled: dict[str, tuple[ModuleType, ModuleType]] = {}


def compiled(tmp_root: Path) -> tuple[ModuleType, ModuleType]:
    """api_pb2 and api_pb2_grpc, generated from the upstream .proto once per session."""
    if "api" in _compiled:
        return _compiled["api"]
    pytest.importorskip("grpc_tools", reason="the stand-in kubelet needs grpcio-tools")
    out = tmp_root / "podresources_v1"
    out.mkdir(parents=True, exist_ok=True)
    done = subprocess.run(
        [sys.executable, "-m", "grpc_tools.protoc", f"-I{PROTO.parent}", f"--python_out={out}",
         f"--grpc_python_out={out}", str(PROTO)], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    (out / "__init__.py").write_text("")
    # The generated service module imports its messages as a top-level `api_pb2`.
    sys.path.insert(0, str(out))
    try:
        pb2 = importlib.import_module("api_pb2")
        pb2_grpc = importlib.import_module("api_pb2_grpc")
    finally:
        sys.path.remove(str(out))
    _compiled["api"] = (pb2, pb2_grpc)
    return pb2, pb2_grpc


@dataclass
class FakePod:
    namespace: str
    name: str
    uid: str
    #: container name -> GPU device ids the device plugin gave it.
    containers: Mapping[str, Sequence[str]] = field(default_factory=dict)


class StandinKubelet:
    """PodResourcesLister on `path`, listing `pods` (set them at any time)."""

    def __init__(self, path: Path, tmp_root: Path) -> None:
        import grpc

        pb2, pb2_grpc = compiled(tmp_root)
        self.path = path
        self.pods: list[FakePod] = []
        self.calls = 0
        self._lock = threading.Lock()
        kubelet = self

        class Lister(pb2_grpc.PodResourcesListerServicer):  # type: ignore[name-defined,misc]
            def List(self, request: Any, context: Any) -> Any:
                with kubelet._lock:
                    kubelet.calls += 1
                    pods = list(kubelet.pods)
                return pb2.ListPodResourcesResponse(pod_resources=[
                    pb2.PodResources(name=p.name, namespace=p.namespace, containers=[
                        pb2.ContainerResources(name=c, devices=[pb2.ContainerDevices(
                            resource_name="nvidia.com/gpu", device_ids=list(ids))] if ids else [],
                            cpu_ids=[2, 3])
                        for c, ids in p.containers.items()])
                    for p in pods])

        self.server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
        pb2_grpc.add_PodResourcesListerServicer_to_server(Lister(), self.server)
        self.server.add_insecure_port(f"unix:{path}")

    def set_pods(self, *pods: FakePod) -> None:
        with self._lock:
            self.pods = list(pods)

    def start(self) -> StandinKubelet:
        self.server.start()
        return self

    def stop(self) -> None:
        self.server.stop(grace=None).wait(5)


@contextlib.contextmanager
def standin_kubelet(path: Path, tmp_root: Path) -> Iterator[StandinKubelet]:
    pytest.importorskip("grpc", reason="the stand-in kubelet needs grpcio")
    kubelet = StandinKubelet(path, tmp_root).start()
    try:
        yield kubelet
    finally:
        kubelet.stop()


@contextlib.contextmanager
def hung_kubelet(path: Path) -> Iterator[list[socket.socket]]:
    """A socket at `path` that accepts every connection and never reads or answers."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(path))
    listener.listen(16)
    accepted: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        listener.settimeout(0.2)
        while not stop.is_set():
            try:
                conn, _ = listener.accept()
            except OSError:
                continue
            accepted.append(conn)

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield accepted
    finally:
        stop.set()
        thread.join(5)
        for conn in accepted:
            conn.close()
        listener.close()


# ---- the node's records --------------------------------------------------------------------

def write_pod_logs(root: Path, pod: FakePod) -> Path:
    """/var/log/pods/NAMESPACE_NAME_UID/CONTAINER/0.log, as the kubelet makes them."""
    pod_dir = root / f"{pod.namespace}_{pod.name}_{pod.uid}"
    for container in pod.containers or {"main": ()}:
        (pod_dir / container).mkdir(parents=True, exist_ok=True)
        (pod_dir / container / "0.log").write_text("")
    return pod_dir


def write_container_log_link(root: Path, pod: FakePod, container: str, container_id: str
                             ) -> Path:
    """/var/log/containers/POD_NAMESPACE_CONTAINER-ID.log, the kubelet's link to the
    container's log under /var/log/pods."""
    root.mkdir(parents=True, exist_ok=True)
    link = root / f"{pod.name}_{pod.namespace}_{container}-{container_id}.log"
    link.symlink_to(f"/var/log/pods/{pod.namespace}_{pod.name}_{pod.uid}/{container}/0.log")
    return link


def write_containerd_record(root: Path, container_id: str, pod: FakePod, container: str) -> Path:
    """containerd's task directory for a CRI container: ID/config.json with its annotations."""
    task = root / container_id
    task.mkdir(parents=True, exist_ok=True)
    spec = {"ociVersion": "1.1.0", "process": {"args": ["python", "train.py"]},
            "annotations": {
                "io.kubernetes.cri.container-type": "container",
                "io.kubernetes.cri.container-name": container,
                "io.kubernetes.cri.sandbox-namespace": pod.namespace,
                "io.kubernetes.cri.sandbox-name": pod.name,
                "io.kubernetes.cri.sandbox-uid": pod.uid,
                "io.kubernetes.cri.sandbox-id": "f" * 64}}
    (task / "config.json").write_text(json.dumps(spec))
    return task / "config.json"


@contextlib.contextmanager
def pod_cgroup(uid: str, container_id: str) -> Iterator[Path]:
    """A real cgroup where the kubelet's cgroupfs driver puts a burstable pod's container
    (`/kubepods/burstable/pod<UID>/<CONTAINER ID>` in the v1 pids hierarchy). Skips where this
    process may not create cgroups."""
    root = Path("/sys/fs/cgroup/pids")
    if os.geteuid() != 0 or not os.access(root, os.W_OK) or not (root / "cgroup.procs").exists():
        pytest.skip("cannot create a pod-like cgroup here (needs root and cgroup v1's pids "
                    "hierarchy writable)")
    shared = [root / "kubepods", root / "kubepods" / "burstable"]
    own = [shared[-1] / f"pod{uid}", shared[-1] / f"pod{uid}" / container_id]
    for p in shared:
        with contextlib.suppress(FileExistsError):
            p.mkdir()
    for p in own:
        p.mkdir()  # the caller's own pod: one left by another would be a name clash, and fails
    try:
        yield own[-1]
    finally:
        def removed() -> bool | None:
            for p in reversed(own):
                with contextlib.suppress(FileNotFoundError):
                    try:
                        p.rmdir()
                    except OSError:
                        return None  # its process is still leaving
            return True

        wait_for("the pod's cgroup to empty", removed, GONE_TIMEOUT)
        # The parents go too unless another test's pod (another worker's, a second suite's) is
        # still in them.
        for p in reversed(shared):
            with contextlib.suppress(OSError):
                p.rmdir()
