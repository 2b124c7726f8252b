"""deploy/kubernetes: every manifest valid against the Kubernetes API schemas offline, the
Prometheus Operator objects of the right shape and built from the same source as the rule file and
the dashboards, and the DaemonSet saying what the systemd unit says (capabilities, limits,
directories, stop timeout, probes), so that the two cannot drift.

What is not checked here: a real cluster (no kubelet, container runtime or API server runs in the
suite). The DaemonSet's security context is exercised on this machine instead: the daemon run as
UID 0 with only the three capabilities and no_new_privs, and the probes' commands run against it.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from gpuwatch.agent._transport import DEFAULT_RUNTIME_DIR, SOCKET_NAME
from gpuwatch.config import DEFAULT_CONFIG_PATH, load_config
from gpuwatch.doctor import CHECK_NAMES, STALE_POLL_SECONDS
from gpuwatch.simulate.fakenvml import FakeNode
from tests.daemonproc import running_daemon, setpriv_or_skip
from tests.test_systemd_unit import UNIT, _directives

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy" / "kubernetes"
EXAMPLES = DEPLOY / "examples"
#: Custom resources: kubernetes-validate bundles the core API's schemas only.
OPERATOR_KINDS = {"ServiceMonitor", "PrometheusRule"}
CAPABILITIES = ("SYS_PTRACE", "DAC_READ_SEARCH", "KILL")


def documents(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d is not None]


def manifests() -> dict[str, dict[str, Any]]:
    """kind/name -> object, over the kustomization's resources."""
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    out = {}
    for name in kustomization["resources"]:
        for doc in documents(DEPLOY / name):
            out[f"{doc['kind']}/{doc['metadata']['name']}"] = doc
    return out


def daemonset() -> dict[str, Any]:
    return manifests()["DaemonSet/gpuwatch"]


def container() -> dict[str, Any]:
    (only,) = daemonset()["spec"]["template"]["spec"]["containers"]
    return dict(only)


def unit() -> dict[str, list[str]]:
    return _directives(UNIT.read_text())


def validator() -> str:
    exe = Path(sys.executable).with_name("kubernetes-validate")
    found = str(exe) if exe.exists() else shutil.which("kubernetes-validate")
    if found is None:
        pytest.skip("kubernetes-validate not installed (the test extra has it)")
    return found


#: The oldest Kubernetes the manifests are checked against, besides the tool's newest.
OLDEST_KUBERNETES = "1.28.0"


def validate(*paths: Path, version: str | None = None) -> subprocess.CompletedProcess[str]:
    pinned = ["--kubernetes-version", version] if version else []
    return subprocess.run([validator(), "--strict", *pinned, *map(str, paths)],
                          capture_output=True, text=True, timeout=300)


# -- the files: a kustomization that names them all, valid against the API's schemas ----------

def test_the_kustomization_names_every_manifest_in_the_folder_and_puts_them_in_one_namespace(
        ) -> None:
    kustomization = yaml.safe_load((DEPLOY / "kustomization.yaml").read_text())
    on_disk = {p.name for p in DEPLOY.glob("*.yaml")} - {"kustomization.yaml"}
    assert set(kustomization["resources"]) == on_disk
    assert kustomization["namespace"] == "gpuwatch"
    assert manifests()["Namespace/gpuwatch"]["metadata"]["labels"][
        "pod-security.kubernetes.io/enforce"] == "privileged"
    (image,) = kustomization["images"]
    assert container()["image"].split(":")[0] == image["name"]


@pytest.mark.parametrize("version", [None, OLDEST_KUBERNETES], ids=["newest", "oldest"])
def test_every_core_manifest_validates_strictly_against_the_kubernetes_schemas(
        version: str | None) -> None:
    files = sorted(DEPLOY.glob("*.yaml")) + sorted(EXAMPLES.glob("*.yaml"))
    done = validate(*files, version=version)
    assert done.returncode == 0, done.stdout + done.stderr
    output = done.stdout + done.stderr
    # The only files without a schema are the kustomization and the operator's custom kinds,
    # checked below; every other resource passed.
    unchecked = set(re.findall(r"Couldn't find schema for kind (\w+)", output))
    assert unchecked == OPERATOR_KINDS | {"Kustomization"}, output
    core = [d for f in files if f.name != "kustomization.yaml" for d in documents(f)
            if d["kind"] not in OPERATOR_KINDS]
    assert output.count(" passed for resource ") == len(core), output


def test_the_objects_in_the_walkthrough_validate_too(tmp_path: Path) -> None:
    """docs/kubernetes.md's YAML that a user applies (the drill pod) is valid as written."""
    text = (ROOT / "docs" / "kubernetes.md").read_text()
    blocks = [b for b in re.findall(r"```yaml\n(.*?)```", text, re.S)
              if re.search(r"^kind: ", b, re.M)]
    assert blocks, "no Kubernetes object in docs/kubernetes.md"
    for i, block in enumerate(blocks):
        (tmp_path / f"block{i}.yaml").write_text(block)
    done = validate(*sorted(tmp_path.glob("block*.yaml")))
    assert done.returncode == 0, done.stdout + done.stderr
    assert (done.stdout + done.stderr).count(" passed for resource ") == len(blocks)


def test_strict_validation_rejects_a_misspelt_field(tmp_path: Path) -> None:
    # Guards the test above: were --strict to stop rejecting unknown fields, it would pass anyway.
    broken = tmp_path / "daemonset.yaml"
    broken.write_text((DEPLOY / "daemonset.yaml").read_text().replace(
        "readOnlyRootFilesystem:", "readOnlyRootFileSystem:"))
    done = validate(broken)
    assert done.returncode != 0
    assert "readOnlyRootFileSystem" in done.stdout + done.stderr


# The Prometheus Operator's objects: its CRD schemas are not bundled with kubernetes-validate
# nor on PyPI, so their shape is checked here, field by field, against the operator's
# documented API (monitoring.coreos.com/v1): unknown fields are errors, as with --strict.
_STRING = {"type": "string"}
_METADATA = {"type": "object", "required": ["name"], "properties": {
    "name": _STRING, "labels": {"type": "object", "additionalProperties": _STRING},
    "annotations": {"type": "object", "additionalProperties": _STRING}},
    "additionalProperties": False}
_DURATION = {"type": "string", "pattern": r"^(0|(([0-9]+)y)?(([0-9]+)w)?(([0-9]+)d)?(([0-9]+)h)?"
                                          r"(([0-9]+)m)?(([0-9]+)s)?(([0-9]+)ms)?)$"}
SERVICE_MONITOR = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False, "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "ServiceMonitor"},
        "metadata": _METADATA,
        "spec": {"type": "object", "required": ["selector", "endpoints"],
                 "additionalProperties": False, "properties": {
                     "selector": {"type": "object", "additionalProperties": False,
                                  "properties": {"matchLabels": {
                                      "type": "object", "additionalProperties": _STRING}}},
                     "endpoints": {"type": "array", "minItems": 1, "items": {
                         "type": "object", "additionalProperties": False, "properties": {
                             "port": _STRING, "path": _STRING, "interval": _DURATION,
                             "scrapeTimeout": _DURATION}}}}}}}
PROMETHEUS_RULE = {
    "type": "object", "required": ["apiVersion", "kind", "metadata", "spec"],
    "additionalProperties": False, "properties": {
        "apiVersion": {"const": "monitoring.coreos.com/v1"}, "kind": {"const": "PrometheusRule"},
        "metadata": _METADATA,
        "spec": {"type": "object", "required": ["groups"], "additionalProperties": False,
                 "properties": {"groups": {"type": "array", "items": {
                     "type": "object", "required": ["name", "rules"],
                     "additionalProperties": False, "properties": {
                         "name": _STRING, "rules": {"type": "array", "items": {
                             "type": "object", "required": ["alert", "expr"],
                             "additionalProperties": False, "properties": {
                                 "alert": _STRING, "expr": _STRING, "for": _DURATION,
                                 "labels": {"type": "object",
                                            "additionalProperties": _STRING},
                                 "annotations": {"type": "object",
                                                 "additionalProperties": _STRING}}}}}}}}}}}


@pytest.mark.parametrize(("key", "schema"), [("ServiceMonitor/gpuwatch", SERVICE_MONITOR),
                                             ("PrometheusRule/gpuwatch", PROMETHEUS_RULE)])
def test_the_operator_objects_have_the_operators_shape(key: str, schema: dict[str, Any]) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    obj = manifests()[key]
    jsonschema.validate(obj, schema)
    broken = json.loads(json.dumps(obj))
    broken["spec"]["endpointz" if "endpoints" in obj["spec"] else "groupz"] = []
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate(broken, schema)


def test_the_service_monitor_scrapes_the_daemons_port_as_the_job_the_rules_select() -> None:
    objects = manifests()
    service, monitor = objects["Service/gpuwatch"], objects["ServiceMonitor/gpuwatch"]
    pod_labels = daemonset()["spec"]["template"]["metadata"]["labels"]
    assert service["spec"]["selector"].items() <= pod_labels.items()
    assert monitor["spec"]["selector"]["matchLabels"].items() <= service["metadata"][
        "labels"].items()
    (endpoint,) = monitor["spec"]["endpoints"]
    (port,) = service["spec"]["ports"]
    (container_port,) = container()["ports"]
    assert endpoint["port"] == port["name"] and port["targetPort"] == container_port["name"]
    assert container_port["containerPort"] == 9966 == int(
        load_config(environ={}).daemon.listen.rsplit(":", 1)[1])
    # The operator names the job after the Service: what the shipped rules select.
    assert 'job="gpuwatch"' in objects["PrometheusRule/gpuwatch"]["spec"]["groups"][0][
        "rules"][0]["expr"]
    assert service["metadata"]["name"] == "gpuwatch"


def test_the_prometheus_rule_and_dashboards_configmap_carry_the_built_files() -> None:
    # build.py --check (tests/test_dashboards.py) pins them to their source; this, that each
    # says what the plain files say.
    objects = manifests()
    rule_file = yaml.safe_load((ROOT / "dashboards" / "gpuwatch-alerts.yml").read_text())
    assert objects["PrometheusRule/gpuwatch"]["spec"]["groups"] == rule_file["groups"]
    boards = objects["ConfigMap/gpuwatch-dashboards"]
    assert boards["metadata"]["labels"]["grafana_dashboard"] == "1"
    assert {name: json.loads(text) for name, text in boards["data"].items()} == {
        name: json.loads((ROOT / "dashboards" / name).read_text())
        for name in ("gpuwatch-node.json", "gpuwatch-fleet.json")}


def test_every_object_fits_kubectl_apply_s_annotation_and_the_configmap_limit() -> None:
    """Client-side `kubectl apply` keeps the whole object in an annotation, and annotations
    have 256 KiB in all; a ConfigMap holds at most 1 MiB. The dashboards ConfigMap is the one
    that grows."""
    for key, obj in manifests().items():
        assert len(json.dumps(obj, separators=(",", ":"))) < 256 * 1024 * 0.8, key
        if obj["kind"] == "ConfigMap":
            assert sum(len(v) for v in obj.get("data", {}).values()) < 1024 * 1024, key


# -- the DaemonSet says what the systemd unit says ---------------------------------------------

def _bytes(quantity: str) -> int:
    units = {"K": 1024, "M": 1024**2, "G": 1024**3, "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3}
    match = re.fullmatch(r"(\d+)([KMG]i?)", quantity)
    assert match, quantity
    return int(match.group(1)) * units[match.group(2)]


def test_the_daemonset_has_the_units_capabilities_and_no_more() -> None:
    (bounding,) = unit()["CapabilityBoundingSet"]
    (ambient,) = unit()["AmbientCapabilities"]
    assert bounding == ambient
    in_unit = {c.removeprefix("CAP_") for c in bounding.split()}
    context = container()["securityContext"]
    assert context["capabilities"]["drop"] == ["ALL"]
    assert set(context["capabilities"]["add"]) == in_unit == set(CAPABILITIES)
    assert context["privileged"] is False
    # NoNewPrivileges=yes and ProtectSystem=strict.
    assert unit()["NoNewPrivileges"] == ["yes"] and context["allowPrivilegeEscalation"] is False
    assert unit()["ProtectSystem"] == ["strict"] and context["readOnlyRootFilesystem"] is True
    pod = daemonset()["spec"]["template"]["spec"]
    assert pod["securityContext"]["seccompProfile"]["type"] == "RuntimeDefault"


def test_the_daemonset_has_the_units_limits_and_stop_timeout() -> None:
    resources = container()["resources"]
    (memory_max,) = unit()["MemoryMax"]
    assert _bytes(resources["limits"]["memory"]) == _bytes(memory_max)
    (quota,) = unit()["CPUQuota"]
    assert float(resources["limits"]["cpu"]) == int(quota.rstrip("%")) / 100
    # Requests below the limits: a Burstable pod, killed before the jobs' Guaranteed ones
    # under memory pressure, as OOMScoreAdjust=500 makes the unit.
    assert int(unit()["OOMScoreAdjust"][0]) > 0
    assert _bytes(resources["requests"]["memory"]) < _bytes(resources["limits"]["memory"])
    (stop,) = unit()["TimeoutStopSec"]
    assert daemonset()["spec"]["template"]["spec"]["terminationGracePeriodSeconds"] == int(stop)


def test_the_daemonset_runs_the_units_command_with_its_directories(tmp_path: Path) -> None:
    (exec_start,) = unit()["ExecStart"]
    c = container()
    assert c["command"] == ["gpuwatch", *exec_start.split()[1:]]
    pod = daemonset()["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in c["volumeMounts"]}
    config = load_config(environ={"GPUWATCH_CONFIG": "/dev/null"})
    for directive, path in (("RuntimeDirectory", config.daemon.runtime_dir),
                            ("StateDirectory", config.daemon.state_dir)):
        (name,) = unit()[directive]
        assert Path("/run" if directive == "RuntimeDirectory" else "/var/lib") / name == path
        # On the node itself, so training pods (agent.sock) and the node's root (state.sock,
        # the audit log) reach them, and they outlive the pod.
        assert volumes[mounts[str(path)]["name"]]["hostPath"]["path"] == str(path)
        assert not mounts[str(path)].get("readOnly", False)
    (name,) = unit()["ConfigurationDirectory"]
    config_mount = mounts[str(DEFAULT_CONFIG_PATH.parent)]
    assert DEFAULT_CONFIG_PATH.parent.name == name and config_mount["readOnly"] is True
    config_map = manifests()["ConfigMap/" + volumes[config_mount["name"]]["configMap"]["name"]]
    assert set(config_map["data"]) == {DEFAULT_CONFIG_PATH.name}
    # The shipped configuration loads (it is all comments: every key at its default).
    shipped = tmp_path / DEFAULT_CONFIG_PATH.name
    shipped.write_text(config_map["data"][shipped.name])
    assert load_config(path=shipped,
                       environ={}) == load_config(environ={"GPUWATCH_CONFIG": "/dev/null"})
    assert unit()["PrivateTmp"] == ["yes"] and "emptyDir" in volumes[mounts["/tmp"]["name"]]


def test_the_daemonset_reads_the_kubelets_pod_records_read_only_where_the_defaults_look() -> None:
    """The PodResources socket's directory and the pod log directories, each mounted read-only
    from the node at the path kubernetes.pod_resources_socket and kubernetes.pod_logs_dir name
    by default; nothing of the container runtime (its sockets would give the node)."""
    pod = daemonset()["spec"]["template"]["spec"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    mounts = {m["mountPath"]: m for m in container()["volumeMounts"]}
    k = load_config(environ={"GPUWATCH_CONFIG": "/dev/null"}).kubernetes
    for path in (str(Path(k.pod_resources_socket).parent), k.pod_logs_dir):
        mount = mounts[path]
        assert mount["readOnly"] is True, mount
        assert volumes[mount["name"]]["hostPath"] == {"path": path, "type": "Directory"}
    assert not any("containerd" in m or "crio" in m or "docker" in m for m in mounts)


def test_the_daemonset_sees_the_nodes_processes_and_names_the_node() -> None:
    pod = daemonset()["spec"]["template"]["spec"]
    assert pod["hostPID"] is True
    env = {e["name"]: e for e in container()["env"]}
    assert env["GPUWATCH_NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    # ... and the daemon reads that variable.
    assert load_config(environ={"GPUWATCH_CONFIG": "/dev/null",
                                "GPUWATCH_NODE_NAME": "gpu-node-07"}).daemon.node_name == \
        "gpu-node-07"


def test_the_daemonset_lands_on_gpu_nodes_and_sees_their_gpus_without_taking_one() -> None:
    pod = daemonset()["spec"]["template"]["spec"]
    terms = pod["affinity"]["nodeAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"][
        "nodeSelectorTerms"]
    keys = {e["key"] for t in terms for e in t["matchExpressions"]}
    assert keys == {"nvidia.com/gpu.present", "feature.node.kubernetes.io/pci-10de.present"}
    assert {"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"} in \
        pod["tolerations"]
    env = {e["name"]: e.get("value") for e in container()["env"]}
    assert env["NVIDIA_VISIBLE_DEVICES"] == "all"
    assert env["NVIDIA_DRIVER_CAPABILITIES"] == "utility"
    resources = container()["resources"]
    assert not any("nvidia.com" in k for part in resources.values() for k in part)


def test_the_probes_are_doctor_checks_that_catch_a_stuck_poll_loop() -> None:
    c = container()
    known = set(CHECK_NAMES)  # the checks `doctor --check` accepts
    for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
        command = c[probe]["exec"]["command"]
        assert command[:2] == ["gpuwatch", "doctor"], probe
        checks = command[3::2]
        assert command[2::2] == ["--check"] * len(checks) and set(checks) <= known, probe
        assert c[probe]["timeoutSeconds"] >= 5, probe
    assert c["livenessProbe"]["exec"]["command"] == ["gpuwatch", "doctor", "--check", "daemon"]
    # The unit's watchdog restarts a poll loop stuck for WatchdogSec; doctor calls a loop stuck
    # after STALE_POLL_SECONDS, and the kubelet restarts after failureThreshold failed probes:
    # within 3 watchdog periods.
    (watchdog,) = unit()["WatchdogSec"]
    live = c["livenessProbe"]
    bound = STALE_POLL_SECONDS + live["periodSeconds"] * live["failureThreshold"]
    assert bound <= 4 * int(watchdog)
    start = c["startupProbe"]
    assert start["periodSeconds"] * start["failureThreshold"] >= 60


# -- the training pod's snippet ----------------------------------------------------------------

def test_the_training_pod_mounts_the_runtime_dir_where_the_agent_looks_without_host_pid() -> None:
    (pod,) = documents(EXAMPLES / "training-pod.yaml")
    spec = pod["spec"]
    assert not spec.get("hostPID", False)
    (trainer,) = spec["containers"]
    (mount,) = trainer["volumeMounts"]
    (volume,) = spec["volumes"]
    daemon_runtime = next(v for v in daemonset()["spec"]["template"]["spec"]["volumes"]
                          if v["name"] == "runtime")
    assert volume["hostPath"]["path"] == daemon_runtime["hostPath"]["path"]
    assert mount["mountPath"] == DEFAULT_RUNTIME_DIR and mount["readOnly"] is True
    assert (Path(mount["mountPath"]) / SOCKET_NAME).name == "agent.sock"


def test_an_agent_reports_through_a_read_only_bind_mount_of_the_runtime_dir(
        tmp_path: Path) -> None:
    """The snippet mounts the socket's directory read-only: sending to a socket on it must work."""
    import os
    import socket

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("needs root and unshare(1) for a private read-only bind mount")
    runtime, view = tmp_path / "runtime", tmp_path / "view"
    runtime.mkdir()
    view.mkdir()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    server.bind(str(runtime / SOCKET_NAME))
    server.settimeout(30)
    try:
        script = (f"mount --bind {runtime} {view} && mount -o remount,bind,ro {view} && "
                  f"touch {view}/x 2>/dev/null && exit 9; "
                  f"{sys.executable} -c 'import socket; s = socket.socket(socket.AF_UNIX, "
                  f"socket.SOCK_DGRAM); s.sendto(b\"step\", \"{view}/{SOCKET_NAME}\")'")
        done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c",
                               script], capture_output=True, text=True, timeout=60)
        if "mount" in done.stderr and done.returncode not in (0, 9):
            pytest.skip(f"cannot bind-mount here: {done.stderr.strip()}")
        assert done.returncode == 0, done.stderr  # 9: the mount was writable after all
        assert server.recv(64) == b"step"
    finally:
        server.close()


# -- the DaemonSet's security context, on this machine -----------------------------------------

def test_the_daemon_runs_and_answers_its_probes_as_root_with_only_the_three_capabilities(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    """UID 0, bounding set of the three capabilities, no_new_privs, one supplementary group:
    the container's context. The daemon serves, gives state.sock to that group (without
    CAP_CHOWN: it is a member), and the probes' commands, run in that same context, pass."""
    import grp

    setpriv = setpriv_or_skip()
    group = grp.getgrgid(65534).gr_name  # the DaemonSet's 10001 is the image's gpuwatch group
    caps = ",".join(f"+{c.lower()}" for c in CAPABILITIES)
    prefix = (setpriv, "--reuid", "0", "--regid", "0", "--groups", "65534", "--no-new-privs",
              "--bounding-set", f"-all,{caps}", "--inh-caps", "-all")
    with running_daemon(cli_env, tmp_path / "daemon", prefix=prefix,
                        config=f'[daemon]\nstate_socket_group = "{group}"\n') as daemon:
        assert (daemon.runtime_dir / "state.sock").stat().st_gid == 65534
        status = Path(f"/proc/{daemon.proc.pid}/status").read_text()
        effective = int(re.search(r"CapEff:\s+([0-9a-f]+)", status).group(1), 16)
        # CAP_KILL 5, CAP_DAC_READ_SEARCH 2, CAP_SYS_PTRACE 19.
        assert effective == (1 << 5) | (1 << 2) | (1 << 19), hex(effective)
        assert re.search(r"NoNewPrivs:\s+1", status)
        env = {**cli_env, "GPUWATCH_CONFIG": str(daemon.config_path)}
        for probe in ("startupProbe", "livenessProbe", "readinessProbe"):
            command = container()[probe]["exec"]["command"]
            done = subprocess.run([*prefix, sys.executable, "-m", "gpuwatch", *command[1:]],
                                  env=env, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, f"{probe}: {done.stdout}{done.stderr}"
    # With the daemon gone, the liveness probe fails.
    command = container()["livenessProbe"]["exec"]["command"]
    done = subprocess.run([sys.executable, "-m", "gpuwatch", *command[1:]], env=cli_env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode != 0


# -- the image ---------------------------------------------------------------------------------

def test_the_dockerfile_copies_only_what_the_build_context_lets_through() -> None:
    """Without docker: every COPY source exists and .dockerignore does not exclude it, the image
    installs the wheel it built and ends as the non-root user the DaemonSet's group matches."""
    text = (ROOT / "Dockerfile").read_text()
    allowed = [line[1:].rstrip("/") for line in (ROOT / ".dockerignore").read_text().splitlines()
               if line.startswith("!")]
    sources = [src for line in text.splitlines() if line.startswith("COPY ")
               and "--from=" not in line for src in line.split()[1:-1]]
    assert sources
    for src in sources:
        assert (ROOT / src).exists(), src
        assert src.rstrip("/") in allowed, f"{src} is excluded by .dockerignore"
    assert re.search(r"pip install .*/tmp/dist/gpuwatch-\*\.whl", text)
    (user,) = re.findall(r"^USER (\d+):(\d+)$", text, re.M)
    assert user[0] != "0" and int(user[1]) in daemonset()["spec"]["template"]["spec"][
        "securityContext"]["supplementalGroups"]


def test_the_dockerfile_builds_an_image_whose_gpuwatch_runs_as_its_own_user(
        tmp_path: Path) -> None:
    docker = shutil.which("docker")
    if docker is None:
        pytest.skip("docker not installed")
    if subprocess.run([docker, "info"], capture_output=True, timeout=60).returncode != 0:
        pytest.skip("no docker daemon answers")
    base = re.search(r"^ARG BASE=(\S+)", (ROOT / "Dockerfile").read_text(), re.M)
    assert base is not None
    if subprocess.run([docker, "image", "inspect", base.group(1)], capture_output=True,
                      timeout=60).returncode != 0:
        pytest.skip(f"base image {base.group(1)} not present (no registry to pull it from)")
    tag = "gpuwatch-test:latest"
    done = subprocess.run([docker, "build", "--pull=false", "-t", tag, str(ROOT)],
                          capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    try:
        who = subprocess.run([docker, "run", "--rm", tag, "sh", "-c", "id -u; id -g"],
                             capture_output=True, text=True, timeout=120)
        assert who.stdout.split() == ["10001", "10001"]
        version = subprocess.run([docker, "run", "--rm", tag, "gpuwatch", "--version"],
                                 capture_output=True, text=True, timeout=120)
        assert version.returncode == 0, version.stderr
    finally:
        subprocess.run([docker, "image", "rm", "-f", tag], capture_output=True, timeout=120)
