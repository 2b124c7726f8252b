"""The pod source: the kubelet's PodResources v1 answer read by gpuwatch's own decoder from a
stand-in kubelet that serves the real protocol (the upstream api.proto, compiled here), the
node's records that join a pod UID to its names, and the refresher that keeps all of it off the
poll loop."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from gpuwatch.simulate.demo import wait_for
from gpuwatch.sources.podresources import (
    MAX_NAME_BYTES,
    DecodeError,
    PodResourcesClient,
    Unavailable,
    decode_list_response,
)
from gpuwatch.sources.pods import (
    PodSource,
    read_container_record,
    read_pod_log_dirs,
)
from tests.standin_kubelet import (
    FakePod,
    compiled,
    hung_kubelet,
    standin_kubelet,
    write_container_log_link,
    write_containerd_record,
    write_pod_logs,
)

UID = "1843d150-6a2e-4b1f-9c3d-2a7e5f0b8c11"
OTHER_UID = "77aa1c2e-0d5b-4f6e-8a9b-3c4d5e6f7a8b"
CTR = "a" * 64
GPU0 = "GPU-5b7e2c1a-0000-4000-8000-000000000000"
GPU1 = "GPU-5b7e2c1a-0000-4000-8000-000000000001"
TRAINER = FakePod("ml-team", "trainer-0", UID, {"trainer": [GPU0]})


def _short_socket(tmp_path: Path, name: str) -> Path:
    # A Unix socket's path is at most 107 bytes; pytest's tmp_path can be longer.
    path = tmp_path / name
    if len(str(path)) < 100:
        return path
    base = Path(tempfile.mkdtemp(prefix="gw-kubelet-"))
    (tmp_path / "short").symlink_to(base)
    return base / name


# ---- the decoder, against messages the upstream .proto's generated code writes -------------

def test_the_decoder_reads_what_the_upstream_generated_code_writes(tmp_path: Path) -> None:
    pb2, _ = compiled(tmp_path)
    answer = pb2.ListPodResourcesResponse(pod_resources=[
        pb2.PodResources(name="trainer-0", namespace="ml-team", containers=[
            pb2.ContainerResources(
                name="trainer", cpu_ids=[4, 5],
                devices=[pb2.ContainerDevices(resource_name="nvidia.com/gpu",
                                              device_ids=[GPU0, GPU1],
                                              topology=pb2.TopologyInfo(
                                                  nodes=[pb2.NUMANode(ID=0)])),
                         pb2.ContainerDevices(resource_name="example.com/nic",
                                              device_ids=["eth1"])],
                memory=[pb2.ContainerMemory(memory_type="hugepages-2Mi", size=1 << 30)]),
            pb2.ContainerResources(name="sidecar")]),
        pb2.PodResources(name="web", namespace="default")])
    decoded = decode_list_response(answer.SerializeToString())
    trainer = decoded.pods[("ml-team", "trainer-0")]
    assert dict(trainer.containers) == {"trainer": (GPU0, GPU1), "sidecar": ()}
    assert dict(decoded.pods[("default", "web")].containers) == {}


def test_a_pod_given_devices_by_dynamic_resource_allocation_is_marked_so(tmp_path: Path) -> None:
    """DRA names devices by claim, not by GPU: the pod is marked, and its GPUs are not judged."""
    pb2, _ = compiled(tmp_path)
    answer = pb2.ListPodResourcesResponse(pod_resources=[
        pb2.PodResources(name="dra-0", namespace="ml-team", containers=[
            pb2.ContainerResources(name="trainer", dynamic_resources=[pb2.DynamicResource(
                claim_name="single-gpu", claim_namespace="ml-team",
                claim_resources=[pb2.ClaimResource(driver_name="gpu.nvidia.com",
                                                   pool_name="node-1", device_name="gpu-0")])])]),
        pb2.PodResources(name="plain", namespace="ml-team", containers=[
            pb2.ContainerResources(name="trainer", devices=[pb2.ContainerDevices(
                resource_name="nvidia.com/gpu", device_ids=[GPU0])])])])
    decoded = decode_list_response(answer.SerializeToString())
    assert decoded.pods[("ml-team", "dra-0")].dynamic_resources is True
    assert dict(decoded.pods[("ml-team", "dra-0")].containers) == {"trainer": ()}
    assert decoded.pods[("ml-team", "plain")].dynamic_resources is False


def test_the_decoder_refuses_bytes_that_are_not_protobuf_and_bounds_what_it_keeps(
        tmp_path: Path) -> None:
    pb2, _ = compiled(tmp_path)
    for garbage in (b"\xff", b"\x0a\x05ab", b"\x0b\x00"):
        with pytest.raises(DecodeError):
            decode_list_response(garbage)
    long_name = "x" * (MAX_NAME_BYTES + 1)
    answer = pb2.ListPodResourcesResponse(pod_resources=[
        pb2.PodResources(name=long_name, namespace="default")])
    decoded = decode_list_response(answer.SerializeToString())
    assert decoded.pods == {} and decoded.cut == {"names": 1}


# ---- the call, to a stand-in kubelet -------------------------------------------------------

def test_the_client_lists_the_stand_in_kubelets_pods_over_its_unix_socket(
        tmp_path: Path) -> None:
    path = _short_socket(tmp_path, "kubelet.sock")
    with standin_kubelet(path, tmp_path) as kubelet:
        kubelet.set_pods(TRAINER)
        client = PodResourcesClient(str(path), timeout=5)
        answer = client.list()
        client.close()
    assert dict(answer.pods[("ml-team", "trainer-0")].containers) == {"trainer": (GPU0,)}


def test_a_hung_kubelet_costs_the_client_its_deadline_and_no_more(tmp_path: Path) -> None:
    path = _short_socket(tmp_path, "hung.sock")
    with hung_kubelet(path):
        client = PodResourcesClient(str(path), timeout=0.5)
        started = time.monotonic()
        with pytest.raises(Unavailable, match=r"DEADLINE_EXCEEDED|UNAVAILABLE"):
            client.list()
        assert time.monotonic() - started < 5
        client.close()


def test_no_socket_is_said_without_asking(tmp_path: Path) -> None:
    with pytest.raises(Unavailable, match="no socket"):
        PodResourcesClient(str(tmp_path / "absent.sock")).list()


# ---- the node's records ------------------------------------------------------------------

def test_pod_log_directories_join_a_uid_to_its_namespace_name_and_containers(
        tmp_path: Path) -> None:
    root = tmp_path / "pods"
    write_pod_logs(root, TRAINER)
    (root / "not_a_pod").mkdir()
    (root / f"evil_link_{OTHER_UID}").symlink_to(tmp_path)
    found = read_pod_log_dirs(str(root))
    assert set(found) == {UID}
    assert (found[UID].namespace, found[UID].name, found[UID].containers) == \
        ("ml-team", "trainer-0", frozenset({"trainer"}))


def test_the_runtime_record_names_the_container_and_a_link_is_never_followed(
        tmp_path: Path) -> None:
    root = tmp_path / "k8s.io"
    write_containerd_record(root, CTR, TRAINER, "trainer")
    record = read_container_record([str(root)], CTR)
    assert record is not None
    assert (record.pod_uid, record.namespace, record.pod, record.container, record.runtime) == \
        (UID, "ml-team", "trainer-0", "trainer", "containerd")
    # A task directory that is a link to elsewhere (or a config.json that is one) is not read.
    elsewhere = tmp_path / "elsewhere"
    write_containerd_record(elsewhere, "b" * 64, TRAINER, "trainer")
    (root / ("b" * 64)).symlink_to(elsewhere / ("b" * 64))
    assert read_container_record([str(root)], "b" * 64) is None
    (root / ("c" * 64)).mkdir()
    (root / ("c" * 64) / "config.json").symlink_to(elsewhere / ("b" * 64) / "config.json")
    assert read_container_record([str(root)], "c" * 64) is None


# ---- the source ----------------------------------------------------------------------------

def test_a_pod_unknown_at_one_lookup_is_named_at_the_next_and_allocations_come_along(
        tmp_path: Path) -> None:
    path = _short_socket(tmp_path, "kubelet.sock")
    logs = tmp_path / "pods"
    with standin_kubelet(path, tmp_path) as kubelet:
        source = PodSource(str(path), str(logs), (str(tmp_path / "k8s.io"),), refresh=60)
        source.start()
        try:
            wait_for("a first refresh", lambda: source.status().refreshes or None, 30)
            # The pod is created (the kubelet lists it, its records are written), then its
            # first process is seen: not named yet, the records were read before they existed.
            kubelet.set_pods(TRAINER)
            write_pod_logs(logs, TRAINER)
            write_containerd_record(tmp_path / "k8s.io", CTR, TRAINER, "trainer")
            pods, _ = source.lookup({UID: {CTR}})
            assert pods == {}
            # The lookup woke the refresher (the next refresh is a minute away): the next
            # lookup has the names.
            pods, containers = wait_for(
                "the pod's names", lambda: (r if (r := source.lookup({UID: {CTR}}))[0]
                                            else None), 30)
            pod = pods[UID]
            assert (pod.namespace, pod.name, pod.listed, pod.source) == \
                ("ml-team", "trainer-0", True, "kubelet")
            assert dict(pod.allocated) == {"trainer": (GPU0,)}
            assert containers == {CTR: "trainer"}
            assert source.status().answered_by == "kubelet"
        finally:
            source.stop()


def test_a_pod_the_kubelet_stops_listing_is_gone_after_two_answers(tmp_path: Path) -> None:
    path = _short_socket(tmp_path, "kubelet.sock")
    logs = tmp_path / "pods"
    write_pod_logs(logs, TRAINER)
    with standin_kubelet(path, tmp_path) as kubelet:
        kubelet.set_pods(TRAINER)
        source = PodSource(str(path), str(logs), (), refresh=60)
        source.lookup({UID: ()})  # not started: the first look is made at once
        assert source.lookup({UID: ()})[0][UID].listed is True
        kubelet.set_pods()
        source.refresh_once()
        assert source.lookup({UID: ()})[0][UID].listed is None  # one answer: not sure yet
        source.refresh_once()
        pod = source.lookup({UID: ()})[0][UID]
        assert pod.listed is False and pod.gone_since is not None
        assert (pod.namespace, pod.name) == ("ml-team", "trainer-0")
        source.stop()


def test_without_the_socket_the_runtime_records_name_the_pod_and_doctor_hears_which(
        tmp_path: Path) -> None:
    write_containerd_record(tmp_path / "k8s.io", CTR, TRAINER, "trainer")
    source = PodSource(str(tmp_path / "absent.sock"), str(tmp_path / "no-logs"),
                       (str(tmp_path / "k8s.io"),), refresh=60)
    pods, containers = source.lookup({UID: {CTR}})
    source.stop()
    assert (pods[UID].namespace, pods[UID].name, pods[UID].listed, pods[UID].source) == \
        ("ml-team", "trainer-0", None, "containerd")
    assert containers == {CTR: "trainer"}
    status = source.status()
    assert status.answered_by == "containerd" and "no socket" in (status.kubelet_error or "")


def test_in_a_pod_of_two_containers_the_container_log_links_name_each_process_container(
        tmp_path: Path) -> None:
    # No kubelet and no runtime records mounted (the DaemonSet's way): the pod log directories
    # say the pod has two containers, and only the container log links say which is which.
    pod = FakePod("ml-team", "trainer-0", UID, {"trainer": [GPU0], "sidecar": []})
    logs = tmp_path / "log" / "pods"
    write_pod_logs(logs, pod)
    sidecar, trainer, stranger = "b" * 64, "c" * 64, "d" * 64
    links = tmp_path / "log" / "containers"
    write_container_log_link(links, pod, "sidecar", sidecar)
    write_container_log_link(links, pod, "trainer", trainer)
    # Another pod's link (a pod the pod log directories do not show) names nothing.
    write_container_log_link(links, FakePod("x", "y", OTHER_UID, {}), "z", stranger)
    source = PodSource(str(tmp_path / "absent.sock"), str(logs), (), refresh=60)
    try:
        pods, containers = source.lookup({UID: {sidecar, trainer}})
        assert (pods[UID].namespace, pods[UID].name) == ("ml-team", "trainer-0")
        assert containers == {sidecar: "sidecar", trainer: "trainer"}
        _, containers = source.lookup({UID: {stranger}})
        assert containers == {}
    finally:
        source.stop()


def test_a_hung_kubelet_never_delays_a_lookup(tmp_path: Path) -> None:
    path = _short_socket(tmp_path, "hung.sock")
    logs = tmp_path / "pods"
    write_pod_logs(logs, TRAINER)
    with hung_kubelet(path):
        source = PodSource(str(path), str(logs), (), refresh=0.1, timeout=3)
        source.start()
        try:
            longest = 0.0
            for _ in range(50):
                started = time.perf_counter()
                source.lookup({UID: ()})
                longest = max(longest, time.perf_counter() - started)
                time.sleep(0.02)
            assert longest < 0.5, longest
            pods = wait_for("the names from the pod logs",
                            lambda: source.lookup({UID: ()})[0] or None, 30)
            assert pods[UID].name == "trainer-0" and pods[UID].listed is None
        finally:
            source.stop()


def test_without_grpcio_the_pod_logs_still_name_pods_and_doctor_says_what_to_install(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """grpcio is the kubernetes extra: where it is missing, the kubelet is not asked, the pod
    log directories name the pods, and `gpuwatch doctor` says so and what to install."""
    path = _short_socket(tmp_path, "kubelet.sock")
    logs = tmp_path / "pods"
    write_pod_logs(logs, TRAINER)
    with standin_kubelet(path, tmp_path) as kubelet:
        kubelet.set_pods(TRAINER)
        monkeypatch.setitem(sys.modules, "grpc", None)  # `import grpc` raises ImportError
        source = PodSource(str(path), str(logs), (), refresh=60)
        pods, _ = source.lookup({UID: ()})
        source.stop()
        assert (pods[UID].name, pods[UID].listed, pods[UID].source) == \
            ("trainer-0", None, "pod-logs")
        assert "grpcio is not installed" in (source.status().kubelet_error or "")
        assert kubelet.calls == 0
        monkeypatch.delitem(sys.modules, "grpc")
        # The CLI, in an interpreter whose `import grpc` fails as it does without the extra.
        blocker = tmp_path / "no-grpc"
        (blocker / "grpc").mkdir(parents=True)
        (blocker / "grpc" / "__init__.py").write_text(
            "raise ImportError('No module named grpc')\n")
        config = tmp_path / "gpuwatch.toml"
        config.write_text(f'[kubernetes]\npod_resources_socket = "{path}"\n'
                          f'pod_logs_dir = "{logs}"\n')
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(blocker), os.environ.get("PYTHONPATH", "")]), "GPUWATCH_CONFIG": str(config)}
        done = subprocess.run([sys.executable, "-m", "gpuwatch", "doctor", "--check",
                               "kubernetes"], env=env, capture_output=True, text=True,
                              timeout=120)
    assert "warn  kubernetes" in done.stdout, done.stdout + done.stderr
    assert "grpcio is not installed" in done.stdout, done.stdout
    assert "pip install 'gpuwatch[kubernetes]'" in done.stdout, done.stdout
    assert "the pod log directories" in done.stdout, done.stdout
