"""Job attribution: /proc/PID/cgroup parsing, launch-environment parsing, and the priority rules."""

from __future__ import annotations

import random
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any, Optional

import pytest

from gpuwatch.launch_env import (
    LAUNCH_ENV_KEYS,
    WORKER_MARKER_KEYS,
    SupervisorRef,
    process_title,
    run_supervisor,
)
from gpuwatch.model import Job
from gpuwatch.sources.jobs import (
    CgroupInfo,
    attribute_job,
    parse_cgroup,
    parse_environ,
)

FIXTURES = Path(__file__).parent / "fixtures" / "cgroup"

# Container ids and pod UIDs used in the samples.
K8S_BURSTABLE_CTR = "c949568b709259410c3fbc70f8726e0b1571d703f7f85afd59021a9248855731"
K8S_GUARANTEED_CTR = "639c9521b1b0a1c544892716f294be8e492ea2feaa529b169c1e75b139c86af4"
K8S_CRIO_CTR = "c55437707546d03583e97417bf2cf877ebcbfc94ecedb63386c3cd4ef8543b45"
K8S_DOCKERSHIM_CTR = "bc42920f8b15c61689ccc8a4004ac893c650a231221d53c21c35874b878e6d50"
K8S_CGROUPFS_CTR = "36d540bfaa5fc1ad15cb8b675812bd596120993ae40760257bd6af22554c3179"
K8S_CGROUPFS_V2_CTR = "1b358b66410a34d16f3640aae5bca30a8f722862bc9f6cd4584179e0bb84d602"
K8S_CGROUPFS_CRIO_CTR = "39c8a6e7abd4a6e9d2f83fbcf54bcef0d7469bf28507fac4504429fc3be5b20c"
K8S_STATIC_CTR = "7ec6778739d86bcb261747b34e86f3ca480c9033a6056b9084c2c3f3e1943f11"
K8S_RELATIVE_CTR = "b7ae6f798d40290449d46369681ce6913d9cecab2bcfc9c59593ad18daa877bc"
DOCKER_SYSTEMD_CTR = "a261568664460676b29825138140c58dc73572495953ba6b5f0e3ada2e76e681"
DOCKER_CGROUPFS_CTR = "a8683c7d15bd14427fbba87ec3889aa213ab929143b9f5705f7d4e59d9c05cf6"
DIND_OUTER_CTR = "7c51cf031c36a4c933b440b1bf8c260d75dd6f884bff6a0fd9d87d85000a4482"
DIND_INNER_CTR = "4d381dab9e29df0a79816daf6bd2caa3c997a710267c384b1c85b0ad25f676b7"
PODMAN_ROOTFUL_CTR = "85215b4db3d9022199c3bd9fdfaeb61c59fafc76db447b17ee66a379e34d55ac"
PODMAN_ROOTLESS_CTR = "44b68af3111f9f13a3f774517a86c7457175ba11ec5756fdcc2c6bad0a7179fb"
NERDCTL_CTR = "9b6602e6030a44ba483ef8e39833f1aa4df9528fcb5314041bf2d224170e4823"

BURSTABLE_POD = "8ac2859e-d970-4a12-9031-3a943724e18e"
GUARANTEED_POD = "f2bc12e1-1d99-42cc-b28d-75a71e75b48f"
CRIO_POD = "09abe5d4-6d6c-4a3a-9ea8-0d35112682c4"
DOCKERSHIM_POD = "b686c3d3-dc4e-4b20-bb30-530cb3b55ffb"
CGROUPFS_POD = "23472e36-ffc6-487f-ac02-68c33c6e54d0"
CGROUPFS_V2_POD = "cab540d1-4f10-4f04-95b0-942578043fd1"
CGROUPFS_CRIO_POD = "7d7a1833-aea8-485f-b844-024523da647a"
STATIC_POD = "fbe4f15d0e919765157ec153ec7d9adc"
RELATIVE_POD = "ed76b6c7-3a7f-486b-a3f5-7db14b6a8cb4"

SLURM_V1_TASK = "/slurm/uid_52417/job_8812394/step_0/task_1"
SLURM_V1_MULTI = "/slurm_gpu017/uid_1000/job_1147/step_batch"
SLURM_V1_EXTERN = "/slurm/uid_1000/job_305117/step_extern/task_0"
STEPD_SCOPE = "/system.slice/slurmstepd.scope"
DOCKERSHIM_PATH = ("/kubepods.slice/kubepods-burstable.slice/"
                   f"kubepods-burstable-pod{DOCKERSHIM_POD.replace('-', '_')}.slice/"
                   f"docker-{K8S_DOCKERSHIM_CTR}.scope")


def _pod_slice(qos: Optional[str], uid: str) -> str:
    escaped = uid.replace("-", "_")
    if qos is None:
        return f"/kubepods.slice/kubepods-pod{escaped}.slice"
    return f"/kubepods.slice/kubepods-{qos}.slice/kubepods-{qos}-pod{escaped}.slice"


# file -> (every CgroupInfo field that is not None, the Job attribute_job gives with no env)
EXPECTED: dict[str, tuple[dict[str, Any], Optional[Job]]] = {
    "slurm_v1_task.txt": (
        dict(path=SLURM_V1_TASK, version=1, slurm_job_id="8812394", slurm_step="0",
             slurm_uid=52417, systemd_unit="slurmd.service"),
        Job("8812394", "slurm")),
    "slurm_v1_multiple_slurmd_batch.txt": (
        dict(path=SLURM_V1_MULTI, version=1, slurm_job_id="1147", slurm_step="batch",
             slurm_uid=1000, systemd_unit="session-14.scope"),
        Job("1147", "slurm")),
    "slurm_v1_extern_hybrid.txt": (
        dict(path=SLURM_V1_EXTERN, version=0, slurm_job_id="305117", slurm_step="extern",
             slurm_uid=1000, systemd_unit="ssh.service"),
        Job("305117", "slurm")),
    "slurm_v2_step.txt": (
        dict(path=f"{STEPD_SCOPE}/job_4530470/step_0/user/task_3", version=2,
             slurm_job_id="4530470", slurm_step="0", systemd_unit="slurmstepd.scope"),
        Job("4530470", "slurm")),
    "slurm_v2_batch.txt": (
        dict(path=f"{STEPD_SCOPE}/job_4530471/step_batch/user/task_0", version=2,
             slurm_job_id="4530471", slurm_step="batch", systemd_unit="slurmstepd.scope"),
        Job("4530471", "slurm")),
    "slurm_v2_extern.txt": (
        dict(path=f"{STEPD_SCOPE}/job_4530471/step_extern/user/task_0", version=2,
             slurm_job_id="4530471", slurm_step="extern", systemd_unit="slurmstepd.scope"),
        Job("4530471", "slurm")),
    "slurm_v2_interactive.txt": (
        dict(path=f"{STEPD_SCOPE}/job_4530472/step_interactive/user/task_0", version=2,
             slurm_job_id="4530472", slurm_step="interactive", systemd_unit="slurmstepd.scope"),
        Job("4530472", "slurm")),
    "slurm_v2_task_special.txt": (
        dict(path=f"{STEPD_SCOPE}/job_4530470/step_0/user/task_special", version=2,
             slurm_job_id="4530470", slurm_step="0", systemd_unit="slurmstepd.scope"),
        Job("4530470", "slurm")),
    "slurm_v2_stepd.txt": (
        dict(path=f"{STEPD_SCOPE}/job_4530470/step_0/slurm", version=2, slurm_job_id="4530470",
             slurm_step="0", systemd_unit="slurmstepd.scope"),
        Job("4530470", "slurm")),
    "slurm_v2_infinity.txt": (
        dict(path=f"{STEPD_SCOPE}/system", version=2, systemd_unit="slurmstepd.scope"),
        None),
    "slurm_v2_multiple_slurmd.txt": (
        dict(path="/system.slice/gpu017_slurmstepd.scope/job_77/step_2/user/task_1", version=2,
             slurm_job_id="77", slurm_step="2", systemd_unit="gpu017_slurmstepd.scope"),
        Job("77", "slurm")),
    "k8s_systemd_burstable_containerd.txt": (
        dict(path=f"{_pod_slice('burstable', BURSTABLE_POD)}/cri-containerd-{K8S_BURSTABLE_CTR}"
                  ".scope",
             version=2, pod_uid=BURSTABLE_POD, qos_class="burstable",
             container_id=K8S_BURSTABLE_CTR, container_runtime="containerd",
             systemd_unit=f"cri-containerd-{K8S_BURSTABLE_CTR}.scope"),
        Job(BURSTABLE_POD, "kubernetes")),
    "k8s_systemd_guaranteed_containerd.txt": (
        dict(path=f"{_pod_slice(None, GUARANTEED_POD)}/cri-containerd-{K8S_GUARANTEED_CTR}.scope",
             version=2, pod_uid=GUARANTEED_POD, qos_class="guaranteed",
             container_id=K8S_GUARANTEED_CTR, container_runtime="containerd",
             systemd_unit=f"cri-containerd-{K8S_GUARANTEED_CTR}.scope"),
        Job(GUARANTEED_POD, "kubernetes")),
    "k8s_systemd_besteffort_crio.txt": (
        dict(path=f"{_pod_slice('besteffort', CRIO_POD)}/crio-{K8S_CRIO_CTR}.scope", version=2,
             pod_uid=CRIO_POD, qos_class="besteffort", container_id=K8S_CRIO_CTR,
             container_runtime="cri-o", systemd_unit=f"crio-{K8S_CRIO_CTR}.scope"),
        Job(CRIO_POD, "kubernetes")),
    "k8s_systemd_crio_conmon.txt": (
        dict(path=f"{_pod_slice('besteffort', CRIO_POD)}/crio-conmon-{K8S_CRIO_CTR}.scope",
             version=2, pod_uid=CRIO_POD, qos_class="besteffort",
             systemd_unit=f"crio-conmon-{K8S_CRIO_CTR}.scope"),
        Job(CRIO_POD, "kubernetes")),
    "k8s_systemd_dockershim_hybrid.txt": (
        dict(path=DOCKERSHIM_PATH, version=0, pod_uid=DOCKERSHIM_POD, qos_class="burstable",
             container_id=K8S_DOCKERSHIM_CTR, container_runtime="docker",
             systemd_unit=f"docker-{K8S_DOCKERSHIM_CTR}.scope"),
        Job(DOCKERSHIM_POD, "kubernetes")),
    "k8s_cgroupfs_burstable_v1.txt": (
        dict(path=f"/kubepods/burstable/pod{CGROUPFS_POD}/{K8S_CGROUPFS_CTR}", version=1,
             pod_uid=CGROUPFS_POD, qos_class="burstable", container_id=K8S_CGROUPFS_CTR),
        Job(CGROUPFS_POD, "kubernetes")),
    "k8s_cgroupfs_guaranteed_v2.txt": (
        dict(path=f"/kubepods/pod{CGROUPFS_V2_POD}/{K8S_CGROUPFS_V2_CTR}", version=2,
             pod_uid=CGROUPFS_V2_POD, qos_class="guaranteed", container_id=K8S_CGROUPFS_V2_CTR),
        Job(CGROUPFS_V2_POD, "kubernetes")),
    "k8s_cgroupfs_besteffort_crio_v2.txt": (
        dict(path=f"/kubepods/besteffort/pod{CGROUPFS_CRIO_POD}/crio-{K8S_CGROUPFS_CRIO_CTR}",
             version=2, pod_uid=CGROUPFS_CRIO_POD, qos_class="besteffort",
             container_id=K8S_CGROUPFS_CRIO_CTR, container_runtime="cri-o"),
        Job(CGROUPFS_CRIO_POD, "kubernetes")),
    "k8s_static_pod.txt": (
        dict(path=f"{_pod_slice('burstable', STATIC_POD)}/cri-containerd-{K8S_STATIC_CTR}.scope",
             version=2, pod_uid=STATIC_POD, qos_class="burstable", container_id=K8S_STATIC_CTR,
             container_runtime="containerd", systemd_unit=f"cri-containerd-{K8S_STATIC_CTR}.scope"),
        Job(STATIC_POD, "kubernetes")),
    "k8s_cgroupns_relative.txt": (
        dict(path="/../../../kubepods-besteffort.slice/kubepods-besteffort-pod"
                  f"{RELATIVE_POD.replace('-', '_')}.slice/cri-containerd-{K8S_RELATIVE_CTR}.scope",
             version=2, pod_uid=RELATIVE_POD, qos_class="besteffort",
             container_id=K8S_RELATIVE_CTR, container_runtime="containerd",
             systemd_unit=f"cri-containerd-{K8S_RELATIVE_CTR}.scope"),
        Job(RELATIVE_POD, "kubernetes")),
    "docker_systemd_v2.txt": (
        dict(path=f"/system.slice/docker-{DOCKER_SYSTEMD_CTR}.scope", version=2,
             container_id=DOCKER_SYSTEMD_CTR, container_runtime="docker",
             systemd_unit=f"docker-{DOCKER_SYSTEMD_CTR}.scope"),
        Job(DOCKER_SYSTEMD_CTR[:12], "container")),
    "docker_cgroupfs_v1.txt": (
        dict(path=f"/docker/{DOCKER_CGROUPFS_CTR}", version=1, container_id=DOCKER_CGROUPFS_CTR,
             container_runtime="docker"),
        Job(DOCKER_CGROUPFS_CTR[:12], "container")),
    "docker_in_docker_v2.txt": (
        dict(path=f"/system.slice/docker-{DIND_OUTER_CTR}.scope/docker/{DIND_INNER_CTR}",
             version=2, container_id=DIND_OUTER_CTR, container_runtime="docker",
             systemd_unit=f"docker-{DIND_OUTER_CTR}.scope"),
        Job(DIND_OUTER_CTR[:12], "container")),
    "podman_rootful_v2.txt": (
        dict(path=f"/machine.slice/libpod-{PODMAN_ROOTFUL_CTR}.scope/container", version=2,
             container_id=PODMAN_ROOTFUL_CTR, container_runtime="podman",
             systemd_unit=f"libpod-{PODMAN_ROOTFUL_CTR}.scope"),
        Job(PODMAN_ROOTFUL_CTR[:12], "container")),
    "podman_rootless_v2.txt": (
        dict(path="/user.slice/user-1000.slice/user@1000.service/user.slice/"
                  f"libpod-{PODMAN_ROOTLESS_CTR}.scope/container",
             version=2, container_id=PODMAN_ROOTLESS_CTR, container_runtime="podman",
             systemd_unit=f"libpod-{PODMAN_ROOTLESS_CTR}.scope"),
        Job(PODMAN_ROOTLESS_CTR[:12], "container")),
    "nerdctl_v2.txt": (
        dict(path=f"/system.slice/nerdctl-{NERDCTL_CTR}.scope", version=2,
             container_id=NERDCTL_CTR, container_runtime="containerd",
             systemd_unit=f"nerdctl-{NERDCTL_CTR}.scope"),
        Job(NERDCTL_CTR[:12], "container")),
    "systemd_daemon.txt": (
        dict(path="/system.slice/nvidia-persistenced.service", version=2,
             systemd_unit="nvidia-persistenced.service"),
        None),
    "systemd_run_unit.txt": (
        dict(path="/system.slice/finetune-llama3.service", version=2,
             systemd_unit="finetune-llama3.service"),
        Job("finetune-llama3.service", "systemd")),
    "systemd_run_transient.txt": (
        dict(path="/system.slice/run-u87.service", version=2, systemd_unit="run-u87.service"),
        Job("run-u87.service", "systemd")),
    "user_session_scope.txt": (
        dict(path="/user.slice/user-1000.slice/session-3.scope", version=2,
             systemd_unit="session-3.scope"),
        None),
    "user_app_scope.txt": (
        dict(path="/user.slice/user-1000.slice/user@1000.service/app.slice/"
                  "app-gnome-code-84127.scope",
             version=2, systemd_unit="app-gnome-code-84127.scope"),
        None),
    "user_service.txt": (
        dict(path="/user.slice/user-1000.slice/user@1000.service/app.slice/train.service",
             version=2, systemd_unit="train.service"),
        Job("train.service", "systemd")),
    "user_desktop_shell.txt": (
        dict(path="/user.slice/user-1000.slice/user@1000.service/session.slice/"
                  "org.gnome.Shell@wayland.service",
             version=2, systemd_unit="org.gnome.Shell@wayland.service"),
        None),
    "user_manager.txt": (
        dict(path="/user.slice/user-1000.slice/user@1000.service/init.scope", version=2,
             systemd_unit="init.scope"),
        None),
    "init_scope.txt": (dict(path="/init.scope", version=2, systemd_unit="init.scope"), None),
    "root_v2.txt": (dict(path="/", version=2), None),
    "hybrid_session.txt": (
        dict(path="/user.slice/user-1000.slice/session-3.scope", version=0,
             systemd_unit="session-3.scope"),
        None),
}


def _read(name: str) -> str:
    return (FIXTURES / name).read_text(encoding="utf-8")


def _readme_rows() -> dict[str, str]:
    rows = {}
    for line in (FIXTURES / "README.md").read_text(encoding="utf-8").splitlines():
        match = re.match(r"\| `([^`]+\.txt)` \| .+ \| `?([^`|]+?)`? \|$", line)
        if match:
            rows[match.group(1)] = match.group(2)
    return rows


# -- fixtures --------------------------------------------------------------------------------

def test_every_fixture_has_expectations_and_a_readme_row() -> None:
    on_disk = {p.name for p in FIXTURES.glob("*.txt")}
    assert on_disk == set(EXPECTED)
    assert set(_readme_rows()) == on_disk


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_readme_states_the_attribution_the_code_gives(name: str) -> None:
    job = EXPECTED[name][1]
    assert _readme_rows()[name] == (str(job) if job else "-")


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_parse_cgroup_reads_every_field_of_the_sample(name: str) -> None:
    fields, _ = EXPECTED[name]
    assert parse_cgroup(_read(name)) == CgroupInfo(**fields)


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_attribute_job_from_the_cgroup_alone(name: str) -> None:
    _, job = EXPECTED[name]
    assert attribute_job(parse_cgroup(_read(name)), {}) == job


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_fixture_pod_uids_are_dashed_uuids_or_static_pod_hashes(name: str) -> None:
    uid = parse_cgroup(_read(name)).pod_uid
    if uid is not None:
        assert re.fullmatch(r"[0-9a-f]{8}(-[0-9a-f]{4}){3}-[0-9a-f]{12}|[0-9a-f]{32}", uid)


# -- parse_cgroup edge cases -----------------------------------------------------------------

def test_empty_text_gives_no_path_and_version_zero() -> None:
    assert parse_cgroup("") == CgroupInfo(path=None, version=0)


def test_garbage_lines_are_ignored_and_valid_ones_kept() -> None:
    text = ("hello world\n"
            "::\n"
            "12:memory\n"
            "x:cpu:/docker/abc\n"
            "3:memory:relative/path\n"
            "\n"
            "\x00\xff\ufffd\n"
            f"0::/system.slice/docker-{DOCKER_SYSTEMD_CTR}.scope\n"
            "7:::::\n")
    info = parse_cgroup(text)
    assert info.version == 2
    assert info.container_id == DOCKER_SYSTEMD_CTR
    assert attribute_job(info, {}) == Job(DOCKER_SYSTEMD_CTR[:12], "container")


def test_text_with_only_garbage_is_like_empty_text() -> None:
    assert parse_cgroup("not a cgroup file\nat all\n") == CgroupInfo()


def test_missing_trailing_newline_and_crlf_are_accepted() -> None:
    assert parse_cgroup(f"0::{STEPD_SCOPE}/job_9/step_0/user/task_0").slurm_job_id == "9"
    assert parse_cgroup(f"0::{STEPD_SCOPE}/job_9/step_0/user/task_0\r\n").slurm_step == "0"


def test_deleted_cgroup_suffix_is_dropped_from_the_path() -> None:
    info = parse_cgroup(f"0::{STEPD_SCOPE}/job_12/step_batch/user/task_0 (deleted)\n")
    assert info.path == f"{STEPD_SCOPE}/job_12/step_batch/user/task_0"
    assert (info.slurm_job_id, info.slurm_step) == ("12", "batch")


def test_non_text_input_never_raises() -> None:
    assert parse_cgroup(None) == CgroupInfo()  # type: ignore[arg-type]
    assert parse_cgroup(b"0::/init.scope\n").systemd_unit == "init.scope"  # type: ignore[arg-type]


def test_random_input_never_raises() -> None:
    rng = random.Random(20240611)
    alphabet = "0123456789:/,=_-.abcdefkpsuvxyz \n\t@\x00é"
    pieces = ["0::", "4:memory:", "1:name=systemd:", "/slurm", "/uid_1", "/job_", "step_",
              "kubepods", "-pod", ".slice", ".scope", "docker-", "/..", "\n"]
    for _ in range(3000):
        text = "".join(rng.choice(pieces) if rng.random() < 0.3 else rng.choice(alphabet)
                       for _ in range(rng.randrange(0, 80)))
        info = parse_cgroup(text)
        assert info.version in (0, 1, 2)
        attribute_job(info, {})


def test_unified_path_is_used_on_a_pure_v2_host() -> None:
    assert parse_cgroup("0::/system.slice/sshd.service\n").path == "/system.slice/sshd.service"


def test_hybrid_host_prefers_the_v1_path_that_names_the_job_over_systemd_tracking() -> None:
    info = parse_cgroup(_read("slurm_v1_extern_hybrid.txt"))
    assert info.version == 0
    assert info.path == SLURM_V1_EXTERN
    # The unit still comes from systemd's own tree.
    assert info.systemd_unit == "ssh.service"


def test_v1_prefers_the_memory_controller_path_among_equally_informative_ones() -> None:
    text = ("6:freezer:/slurm/uid_7/job_5/step_0\n"
            "4:memory:/slurm/uid_7/job_5/step_0/task_2\n"
            "2:cpu,cpuacct:/slurm/uid_7/job_5/step_0/task_2\n")
    assert parse_cgroup(text).path == "/slurm/uid_7/job_5/step_0/task_2"


def test_v1_falls_back_to_the_controller_that_has_the_job_when_memory_does_not() -> None:
    # proctrack/cgroup without memory constraints: only freezer knows the job.
    text = ("9:memory:/system.slice/slurmd.service\n"
            "6:freezer:/slurm/uid_7/job_5/step_0\n"
            "1:name=systemd:/system.slice/slurmd.service\n")
    info = parse_cgroup(text)
    assert info.path == "/slurm/uid_7/job_5/step_0"
    assert (info.slurm_job_id, info.slurm_uid) == ("5", 7)


def test_v1_without_any_attribution_reports_the_first_non_root_path() -> None:
    text = "11:pids:/\n9:memory:/\n6:devices:/user.slice\n1:name=systemd:/user.slice\n"
    assert parse_cgroup(text).path == "/user.slice"


def test_v1_root_everywhere_reports_root() -> None:
    assert parse_cgroup("4:memory:/\n1:name=systemd:/\n").path == "/"


def test_a_job_directory_outside_slurms_root_is_not_a_slurm_job() -> None:
    for path in ("/user.slice/job_17/step_0", "/system.slice/myjob_17/step_0",
                 "/slurm/job_x/step_0", "/system.slice/slurmstepd.scope/system"):
        assert parse_cgroup(f"0::{path}\n").slurm_job_id is None, path


def test_pod_uid_is_dashed_whatever_the_driver_wrote() -> None:
    systemd = parse_cgroup(_read("k8s_systemd_burstable_containerd.txt")).pod_uid
    cgroupfs = parse_cgroup(f"0::/kubepods/burstable/pod{BURSTABLE_POD}/{K8S_CGROUPFS_CTR}\n")
    assert systemd == cgroupfs.pod_uid == BURSTABLE_POD


def test_pod_directory_outside_kubepods_is_not_a_pod() -> None:
    assert parse_cgroup(f"0::/system.slice/pod{BURSTABLE_POD}/x\n").pod_uid is None


def test_malformed_pod_uid_is_not_reported() -> None:
    assert parse_cgroup("0::/kubepods.slice/kubepods-pod1234_abcd.slice/x.scope\n").pod_uid is None


def test_a_short_hex_directory_is_not_a_container() -> None:
    assert parse_cgroup("0::/docker/a2615686644\n").container_id is None


# -- parse_environ ---------------------------------------------------------------------------

def _environ(*entries: bytes) -> bytes:
    return b"\0".join(entries) + b"\0"


def test_environ_keeps_only_launch_variables_and_drops_secrets() -> None:
    raw = _environ(b"PATH=/usr/bin", b"HF_TOKEN=hf_AbCdEfGhIjKlMnOpQrStUvWxYz012345",
                   b"WANDB_API_KEY=0123456789abcdef", b"AWS_SECRET_ACCESS_KEY=abc",
                   b"LOCAL_RANK=3", b"RANK=11", b"WORLD_SIZE=16", b"MASTER_ADDR=gpu-node-01",
                   b"MASTER_PORT=29500", b"TORCHELASTIC_RUN_ID=llama-sft-0611",
                   b"CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7", b"HOME=/home/alice")
    assert parse_environ(raw) == {
        "LOCAL_RANK": "3", "RANK": "11", "WORLD_SIZE": "16", "MASTER_ADDR": "gpu-node-01",
        "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "llama-sft-0611",
        "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
    }


def test_environ_of_a_slurm_task() -> None:
    raw = _environ(b"SLURM_JOB_ID=4530470", b"SLURM_JOBID=4530470", b"SLURM_STEP_ID=0",
                   b"SLURM_PROCID=5", b"SLURM_LOCALID=1", b"SLURM_NODEID=1",
                   b"SLURM_JOB_GPUS=2,3", b"SLURM_JOB_ACCOUNT=ml", b"SLURM_JOB_NAME=sft")
    assert parse_environ(raw) == {
        "SLURM_JOB_ID": "4530470", "SLURM_JOBID": "4530470", "SLURM_STEP_ID": "0",
        "SLURM_PROCID": "5", "SLURM_LOCALID": "1", "SLURM_NODEID": "1", "SLURM_JOB_GPUS": "2,3",
    }


def test_environ_empty_or_not_bytes_gives_nothing() -> None:
    assert parse_environ(b"") == {}
    assert parse_environ(b"\0\0\0") == {}
    assert parse_environ(None) == {}  # type: ignore[arg-type]


def test_environ_entries_without_equals_sign_are_skipped() -> None:
    assert parse_environ(_environ(b"RANK", b"LOCAL_RANK=0", b"=orphan", b"")) == {"LOCAL_RANK": "0"}


def test_environ_value_may_contain_equals_signs() -> None:
    assert parse_environ(_environ(b"MASTER_ADDR=a=b")) == {"MASTER_ADDR": "a=b"}


def test_environ_first_duplicate_wins_as_for_getenv() -> None:
    assert parse_environ(_environ(b"RANK=1", b"RANK=2")) == {"RANK": "1"}


def test_environ_tolerates_invalid_utf8() -> None:
    raw = _environ(b"\xff\xfeRANK=9", b"LOCAL_RANK=\xff1", b"RANK=\xc3\xa90", b"WORLD\xff=2")
    assert parse_environ(raw) == {"LOCAL_RANK": "\ufffd1", "RANK": "\u00e90"}


def test_environ_without_final_nul_keeps_its_complete_last_entry() -> None:
    assert parse_environ(b"RANK=0\0WORLD_SIZE=2") == {"RANK": "0", "WORLD_SIZE": "2"}


def test_environ_cut_inside_a_name_loses_only_that_entry() -> None:
    assert parse_environ(b"RANK=0\0WORLD_SI") == {"RANK": "0"}


def test_environ_names_are_case_sensitive() -> None:
    assert parse_environ(_environ(b"rank=0", b"Local_Rank=1")) == {}


def test_environ_values_are_capped() -> None:
    value = parse_environ(_environ(b"CUDA_VISIBLE_DEVICES=" + b"G" * 100_000))
    assert 330 < len(value["CUDA_VISIBLE_DEVICES"]) < 100_000


def test_launch_env_keys_are_unique_env_names() -> None:
    assert len(LAUNCH_ENV_KEYS) == len(set(LAUNCH_ENV_KEYS))
    assert all(re.fullmatch(r"[A-Z][A-Z0-9_]*", key) for key in LAUNCH_ENV_KEYS)


def test_launch_env_keeps_no_credential_named_variable() -> None:
    for key in LAUNCH_ENV_KEYS:
        assert not re.search(r"TOKEN|SECRET|PASSWORD|PASSWD|CREDENTIAL|AUTH|_KEY$", key), key


def test_worker_markers_are_launch_variables() -> None:
    assert set(WORKER_MARKER_KEYS) <= set(LAUNCH_ENV_KEYS)


@pytest.mark.parametrize("key", ["SLURM_JOB_ID", "SLURM_JOBID", "SLURM_NODEID", "RAY_JOB_ID",
                                 "CUDA_VISIBLE_DEVICES", "NVIDIA_VISIBLE_DEVICES", "MASTER_PORT",
                                 "GPUWATCH_RUN_ID", "GPUWATCH_RUN_SUPERVISOR"])
def test_allocation_wide_variables_do_not_mark_a_worker(key: str) -> None:
    assert key not in WORKER_MARKER_KEYS


@pytest.mark.parametrize("key", ["LOCAL_RANK", "RANK", "WORLD_SIZE", "TORCHELASTIC_RUN_ID",
                                 "MASTER_ADDR", "SLURM_PROCID", "OMPI_COMM_WORLD_RANK",
                                 "PMI_RANK", "PMIX_RANK"])
def test_rank_variables_mark_a_worker(key: str) -> None:
    assert key in WORKER_MARKER_KEYS


# -- attribute_job priority ------------------------------------------------------------------

POD_IN_CONTAINER = CgroupInfo(path="/kubepods/x", version=2, pod_uid=BURSTABLE_POD,
                              qos_class="burstable", container_id=K8S_BURSTABLE_CTR,
                              container_runtime="containerd",
                              systemd_unit=f"cri-containerd-{K8S_BURSTABLE_CTR}.scope")
SLURM_CGROUP = CgroupInfo(path=f"{STEPD_SCOPE}/job_42/step_0/user/task_0", version=2,
                          slurm_job_id="42", slurm_step="0", systemd_unit="slurmstepd.scope")


def test_slurm_cgroup_beats_every_other_evidence() -> None:
    env = {"SLURM_JOB_ID": "41", "TORCHELASTIC_RUN_ID": "run-7"}
    both = CgroupInfo(path="/x", version=2, slurm_job_id="42", pod_uid=BURSTABLE_POD,
                      container_id=K8S_BURSTABLE_CTR)
    assert attribute_job(both, env) == Job("42", "slurm")
    assert attribute_job(SLURM_CGROUP, env) == Job("42", "slurm")


def test_slurm_environment_attributes_a_process_that_left_the_jobs_cgroup() -> None:
    session = parse_cgroup(_read("user_session_scope.txt"))
    assert attribute_job(session, {"SLURM_JOB_ID": "4530470"}) == Job("4530470", "slurm")
    assert attribute_job(None, {"SLURM_JOBID": "4530470"}) == Job("4530470", "slurm")


def test_slurm_environment_beats_torchelastic_and_kubernetes() -> None:
    env = {"SLURM_JOB_ID": "77", "TORCHELASTIC_RUN_ID": "run-7"}
    assert attribute_job(POD_IN_CONTAINER, env) == Job("77", "slurm")


def test_malformed_slurm_job_id_in_environment_is_ignored() -> None:
    assert attribute_job(None, {"SLURM_JOB_ID": "", "SLURM_JOBID": "abc"}) is None
    assert attribute_job(None, {"SLURM_JOB_ID": " 12 "}) == Job("12", "slurm")


def test_torchelastic_run_id_beats_the_pod() -> None:
    env = {"TORCHELASTIC_RUN_ID": "8f1c2c1e-llama", "LOCAL_RANK": "0"}
    assert attribute_job(POD_IN_CONTAINER, env) == Job("8f1c2c1e-llama", "torchelastic")


def test_torchelastic_without_a_cgroup_still_attributes() -> None:
    assert attribute_job(None, {"TORCHELASTIC_RUN_ID": "r1"}) == Job("r1", "torchelastic")


def test_torchruns_default_run_id_none_identifies_nothing() -> None:
    env = MappingProxyType({"TORCHELASTIC_RUN_ID": "none", "LOCAL_RANK": "0"})
    assert attribute_job(POD_IN_CONTAINER, env) == Job(BURSTABLE_POD, "kubernetes")
    assert attribute_job(None, env) is None


def test_a_ray_worker_s_job_is_its_ray_job_id() -> None:
    env = MappingProxyType({"RAY_JOB_ID": "01000000", "CUDA_VISIBLE_DEVICES": "0"})
    assert attribute_job(None, env) == Job("01000000", "ray")
    unit = CgroupInfo(path="/system.slice/ray.service", version=2, systemd_unit="ray.service")
    assert attribute_job(unit, env) == Job("01000000", "ray")  # finer than the raylet's unit


def test_a_pod_or_a_slurm_job_beats_the_ray_job_and_a_torchelastic_run_beats_it() -> None:
    env = {"RAY_JOB_ID": "02000000"}
    assert attribute_job(POD_IN_CONTAINER, env) == Job(BURSTABLE_POD, "kubernetes")
    assert attribute_job(None, {**env, "SLURM_JOB_ID": "77"}) == Job("77", "slurm")
    assert attribute_job(None, {**env, "TORCHELASTIC_RUN_ID": "r9"}) == Job("r9", "torchelastic")


@pytest.mark.parametrize("value", ["", "x", "not-hex!", "0" * 65, "01 00", "../etc"])
def test_a_ray_job_id_that_is_not_hex_is_ignored(value: str) -> None:
    assert attribute_job(None, {"RAY_JOB_ID": value}) is None


@pytest.mark.parametrize("value", ["ffffffff", "FFFFFFFF"])
def test_rays_nil_job_id_that_the_raylet_and_its_agents_carry_is_no_job(value: str) -> None:
    assert attribute_job(None, {"RAY_JOB_ID": value}) is None


def test_pod_beats_its_container() -> None:
    assert attribute_job(POD_IN_CONTAINER, {}) == Job(BURSTABLE_POD, "kubernetes")


def test_container_job_id_is_the_short_id() -> None:
    info = parse_cgroup(_read("docker_systemd_v2.txt"))
    job = attribute_job(info, {"RANK": "0", "WORLD_SIZE": "2"})
    assert job == Job("a26156866446", "container")
    assert len(job.id) == 12


def test_container_beats_its_systemd_scope() -> None:
    info = CgroupInfo(path="/x", version=2, container_id=DOCKER_SYSTEMD_CTR,
                      container_runtime="docker", systemd_unit="train.service")
    assert attribute_job(info, {}) == Job(DOCKER_SYSTEMD_CTR[:12], "container")


def test_no_cgroup_and_no_launch_env_gives_no_job() -> None:
    assert attribute_job(None, {}) is None
    assert attribute_job(CgroupInfo(), {}) is None


def test_rank_variables_alone_do_not_make_a_job() -> None:
    assert attribute_job(None, {"RANK": "0", "WORLD_SIZE": "8", "MASTER_ADDR": "n1"}) is None


@pytest.mark.parametrize("unit", [
    "train.service", "run-u87.service", "run-r3f2c1d0b9a8e4f7.scope", "bench@h100.service",
    "train.scope", "jupyter.service",
])
def test_units_someone_started_as_work_are_jobs(unit: str) -> None:
    info = CgroupInfo(path=f"/system.slice/{unit}", version=2, systemd_unit=unit)
    assert attribute_job(info, {}) == Job(unit, "systemd")


@pytest.mark.parametrize("unit", [
    "sshd.service", "ssh.service", "sshd@3-10.0.0.5:22-10.0.0.9:51234.service", "cron.service",
    "gdm.service", "getty@tty1.service", "user@1000.service", "init.scope", "session-c2.scope",
    "slurmd.service", "slurmstepd.scope", "gpu017_slurmstepd.scope", "kubelet.service",
    "containerd.service", "docker.service", "nvidia-persistenced.service",
    "nvidia-fabricmanager.service", "nvidia-dcgm.service", "systemd-logind.service",
    "dbus-:1.2-org.freedesktop.portal.Desktop@0.service", "vte-spawn-5d4e.scope",
    "tmux-spawn-9a1b.scope", "app-org.kde.konsole@5f1e.service", "jupyterhub.service",
    "machine-qemu\\x2d1\\x2dgpuvm.scope", f"docker-{DOCKER_SYSTEMD_CTR}.scope",
])
def test_sessions_daemons_and_launchers_are_not_jobs(unit: str) -> None:
    info = CgroupInfo(path=f"/system.slice/{unit}", version=2, systemd_unit=unit)
    assert attribute_job(info, {}) is None


def test_desktop_session_services_are_not_jobs_but_user_app_services_are() -> None:
    base = "/user.slice/user-1000.slice/user@1000.service"
    session = CgroupInfo(path=f"{base}/session.slice/xdg-compositor.service", version=2,
                         systemd_unit="xdg-compositor.service")
    app = CgroupInfo(path=f"{base}/app.slice/xdg-compositor.service", version=2,
                     systemd_unit="xdg-compositor.service")
    assert attribute_job(session, {}) is None
    assert attribute_job(app, {}) == Job("xdg-compositor.service", "systemd")


def test_launch_env_as_read_only_mapping_is_accepted() -> None:
    env = MappingProxyType(parse_environ(_environ(b"TORCHELASTIC_RUN_ID=abc", b"RANK=0")))
    assert attribute_job(None, env) == Job("abc", "torchelastic")


def test_non_string_env_values_are_ignored() -> None:
    env: dict[str, Any] = {"SLURM_JOB_ID": 12, "TORCHELASTIC_RUN_ID": None}
    assert attribute_job(None, env) is None


# -- `gpuwatch run` ----------------------------------------------------------------------------

RUN_ENV = {"GPUWATCH_RUN_ID": "train-3fa91c", "GPUWATCH_RUN_SUPERVISOR": "4242:1767000000.25"}


def test_environ_keeps_both_gpuwatch_run_variables() -> None:
    raw = _environ(b"GPUWATCH_RUN_ID=train-3fa91c", b"GPUWATCH_RUN_SUPERVISOR=4242:1767000000.25",
                   b"GPUWATCH_RUN_TOKEN=s3cret", b"HOME=/root")
    assert parse_environ(raw) == RUN_ENV


def test_gpuwatch_run_id_names_the_job() -> None:
    assert attribute_job(None, RUN_ENV) == Job("train-3fa91c", "run")
    assert str(attribute_job(None, {"GPUWATCH_RUN_ID": " train-3fa91c\n"})) == "run:train-3fa91c"
    assert attribute_job(None, {"GPUWATCH_RUN_ID": "  "}) is None
    assert attribute_job(None, {"GPUWATCH_RUN_SUPERVISOR": "4242:1767000000.25"}) is None


def test_gpuwatch_run_beats_every_other_environment_variable() -> None:
    """The user put `gpuwatch run` around the command on purpose: it names the whole job, over
    the run id torchrun gives its workers and a Slurm job id inherited in the environment."""
    env = {**RUN_ENV, "SLURM_JOB_ID": "77", "SLURM_JOBID": "77", "TORCHELASTIC_RUN_ID": "run-7",
           "RAY_JOB_ID": "01000000", "LOCAL_RANK": "0"}
    assert attribute_job(None, env) == Job("train-3fa91c", "run")
    session = parse_cgroup(_read("user_session_scope.txt"))
    assert attribute_job(session, env) == Job("train-3fa91c", "run")
    unit = CgroupInfo(path="/system.slice/train.service", version=2,
                      systemd_unit="train.service")
    assert attribute_job(unit, env) == Job("train-3fa91c", "run")


def test_a_schedulers_cgroup_beats_gpuwatch_run() -> None:
    """`srun gpuwatch run -- ...` is Slurm job 42, and the epilog reaps by that id; inside a pod
    or a container, the pod or the container is what is cleaned up."""
    env = {**RUN_ENV, "TORCHELASTIC_RUN_ID": "run-7"}
    assert attribute_job(SLURM_CGROUP, env) == Job("42", "slurm")
    assert attribute_job(POD_IN_CONTAINER, env) == Job(BURSTABLE_POD, "kubernetes")
    docker = parse_cgroup(_read("docker_systemd_v2.txt"))
    assert attribute_job(docker, env) == Job("a26156866446", "container")


@pytest.mark.parametrize("value,expected", [
    ("4242:1767000000.25", SupervisorRef(4242, 1767000000.25)),
    (" 4242:1767000000.0\n", SupervisorRef(4242, 1767000000.0)),
    ("1:1767000000", SupervisorRef(1, 1767000000.0)),
    ("4242", None), ("4242:", None), (":1767000000.25", None), ("0:1767000000.25", None),
    ("-1:1767000000.25", None), ("4242:nan", None), ("4242:inf", None), ("4242:-5", None),
    ("4242:abc", None), ("4242:1:2", None), ("\u0664\u0662:1767000000.25", None), ("", None),
])
def test_the_supervisor_variable_is_a_pid_and_a_start_time(
        value: str, expected: Optional[SupervisorRef]) -> None:
    assert run_supervisor({"GPUWATCH_RUN_SUPERVISOR": value}) == expected


def test_no_supervisor_variable_names_no_supervisor() -> None:
    assert run_supervisor({}) is None
    assert run_supervisor(None) is None  # type: ignore[arg-type]


@pytest.mark.parametrize(("name", "cmdline", "title"), [
    ("pt_elastic", ("/usr/bin/python3", "/usr/local/bin/torchrun", "--nproc-per-node", "8"),
     "torchrun (pt_elastic)"),
    ("pt_elastic", ("python", "/opt/conda/bin/accelerate", "launch", "t.py"),
     "accelerate (pt_elastic)"),
    ("pt_elastic", ("python", "-m", "torch.distributed.run", "t.py"), "torchrun (pt_elastic)"),
    ("pt_elastic", (), "torchrun (pt_elastic)"),
    ("pt_elastic", ("python", "-u", "launch.py"), "launch.py (pt_elastic)"),
    ("pt_elastic", ("python", "-u"), "python (pt_elastic)"),
    ("python", ("python", "train.py"), "python"),
    ("torchrun", ("python3", "/usr/bin/torchrun"), "torchrun"),
    (None, (), None),
])
def test_a_launcher_that_titled_itself_is_named_by_its_program_too(
        name: Optional[str], cmdline: tuple[str, ...], title: Optional[str]) -> None:
    assert process_title(name, cmdline) == title
