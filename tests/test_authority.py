"""What a process's user cannot set, as the process source reads it (gpuwatch.sources.authority):
the file it runs, whether only root could have put that file where it is, and the system unit it
was started in. Real processes; the detectors' use of these facts is in tests/test_detectors.py."""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Optional

import pytest

from gpuwatch.model import Executable
from gpuwatch.simulate.demo import wait_for
from gpuwatch.sources.authority import RootDirectories, system_unit
from gpuwatch.sources.processes import ProcessSource
from tests.localusers import LocalUser, local_user
from tests.protected import exe_setter, roots_own_program, users_directory
from tests.scenarios import START_TIMEOUT, wait_not_running


@pytest.fixture
def mallory() -> LocalUser:
    return local_user("mallory")


def exe_of(pid: int) -> Optional[Executable]:
    return ProcessSource().read([pid]).processes[pid].exe


@contextlib.contextmanager
def started(argv: Sequence[str], program: str, user: Optional[LocalUser] = None
            ) -> Iterator[int]:
    """`argv` running (as `user`), once it has executed `program`; killed after."""
    kwargs = user.popen_kwargs() if user is not None else {}
    proc = subprocess.Popen(list(argv), cwd="/", **kwargs)
    try:
        def executed() -> Optional[bool]:
            with contextlib.suppress(OSError):
                if os.readlink(f"/proc/{proc.pid}/exe") == program:
                    return True
            return None

        wait_for(f"{argv[0]} to run {program}", executed, START_TIMEOUT, alive=proc)
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()
        wait_not_running([proc.pid])


def test_a_program_only_root_could_have_put_there_is_roots_and_the_same_file_in_tmp_is_not(
        tmp_path: Path) -> None:
    with roots_own_program("gpu-agent") as program, started([str(program), "600"],
                                                            str(program)) as pid:
        assert exe_of(pid) == Executable(str(program), owner_uid=0, root_controlled=True)
    # Root's file, but /tmp above it is writable by everyone: no proof of who put it there.
    loose = tmp_path / "gpu-agent"
    shutil.copyfile(os.path.realpath("/bin/sleep"), loose)
    loose.chmod(0o755)
    with started([str(loose), "600"], str(loose)) as pid:
        assert exe_of(pid) == Executable(str(loose), owner_uid=0, root_controlled=False)


def test_a_directorys_verdict_is_kept_for_one_read_and_made_again_at_the_next() -> None:
    """The processes a poll sees first share a few directories: each is looked at once a read
    of the process source. A directory a root made writable by others is judged again at the
    next read, and what is below it with it."""
    directories = RootDirectories()
    with roots_own_program("gpu-agent") as program:
        directory, inner = os.fsencode(program.parent), os.fsencode(program.parent / "lib")
        os.mkdir(inner, 0o755)
        assert directories.root_only(inner) and directories.root_only(directory)
        os.chmod(directory, 0o777)
        assert directories.root_only(inner), "kept until forgotten"
        directories.forget()
        assert not directories.root_only(inner) and not directories.root_only(directory)
        os.chmod(directory, 0o755)
        assert not directories.root_only(directory), "kept until forgotten, that way too"
        directories.forget()
        assert directories.root_only(inner) and directories.root_only(b"/")
    assert not RootDirectories().root_only(b"/tmp")  # writable by all, however sticky


def test_the_process_source_judges_a_directory_again_at_each_read() -> None:
    """A root's chmod shows at the next poll, as it did before directories were remembered."""
    with roots_own_program("gpu-agent") as program, started([str(program), "600"],
                                                            str(program)) as pid:
        source = ProcessSource()
        assert source.read([pid]).processes[pid].exe == Executable(
            str(program), owner_uid=0, root_controlled=True)
        os.chmod(program.parent, 0o777)
        try:
            fresh = ProcessSource()  # what never changes is kept per process: a new source
            fresh._statics.root_directories = source._statics.root_directories
            exe = fresh.read([pid]).processes[pid].exe
        finally:
            os.chmod(program.parent, 0o755)
        assert exe == Executable(str(program), owner_uid=0, root_controlled=False)


def test_a_link_set_by_prctl_in_a_user_namespace_is_not_roots_even_for_a_root_process(
        tmp_path: Path) -> None:
    # prctl(PR_SET_MM_MAP) points /proc/PID/exe at any file, given CAP_CHECKPOINT_RESTORE in
    # the caller's user namespace: here root's own `sleep`, from a namespace mapping root to
    # root, points it at root's gpu-agent. The link names root's file in root's directory; the
    # process is not in gpuwatch's user namespace, so nothing is proven by it.
    library = exe_setter(tmp_path)
    with roots_own_program("gpu-agent") as program:
        proc = subprocess.Popen(["/bin/sleep", "600"], cwd="/", env={
            "PATH": "/usr/bin:/bin", "LD_PRELOAD": str(library), "GWTEST_EXE": str(program)})
        try:
            wait_for("sleep to point its link at gpu-agent", lambda: True if os.readlink(
                f"/proc/{proc.pid}/exe") == str(program) else None, START_TIMEOUT, alive=proc)
            assert exe_of(proc.pid) == Executable(str(program), owner_uid=0,
                                                  root_controlled=False)
        finally:
            proc.kill()
            proc.wait()


def test_a_users_own_copy_named_xorg_is_theirs_and_a_link_named_xorg_is_the_file_it_names(
        mallory: LocalUser) -> None:
    sleep = os.path.realpath("/bin/sleep")
    with users_directory(mallory) as home:
        made = mallory.run(["sh", "-c", f"cp {sleep} {home}/Xorg && ln -s {sleep} {home}/X"],
                           cwd="/")
        assert made.returncode == 0, made.stderr
        with started([f"{home}/Xorg", "600"], f"{home}/Xorg", mallory) as pid:
            assert exe_of(pid) == Executable(f"{home}/Xorg", owner_uid=mallory.uid,
                                             root_controlled=False)
        with started([f"{home}/X", "600"], sleep, mallory) as pid:
            exe = exe_of(pid)
            assert exe is not None and exe.path == sleep and exe.root_controlled


def test_roots_file_bind_mounted_over_a_protected_path_in_another_mount_namespace_is_not_it(
        ) -> None:
    # What a user with unprivileged user namespaces can do: /proc/PID/exe then names the
    # protected path, and the file behind it is root's, but not the file at that path here.
    if shutil.which("unshare") is None:
        pytest.skip("no unshare(1)")
    sleep = os.path.realpath("/bin/sleep")
    with roots_own_program("Xorg", source="/bin/true") as program:
        probe = subprocess.run(["unshare", "-m", "true"], capture_output=True, text=True)
        if probe.returncode != 0:
            pytest.skip(f"cannot make a mount namespace here: {probe.stderr.strip()}")
        argv = ["unshare", "-m", "sh", "-c",
                f"mount --bind {sleep} {program} && exec {program} 600"]
        with started(argv, str(program)) as pid:
            exe = exe_of(pid)
            assert exe is not None and exe.path == str(program) and exe.owner_uid == 0
            assert not exe.root_controlled


@pytest.mark.parametrize(("cgroup", "unit"), [
    (b"0::/system.slice/nvidia-persistenced.service\n", "nvidia-persistenced.service"),
    (b"0::/system.slice/system-getty.slice/getty@tty1.service\n", "getty@tty1.service"),
    (b"0::/user.slice/user-1000.slice/session-3.scope\n", "session-3.scope"),
    # A user's own units, whatever they are called: below their manager's unit.
    (b"0::/user.slice/user-994.slice/user@994.service/app.slice/"
     b"nvidia-persistenced.service\n", "user@994.service"),
    # Names made inside a delegated subtree (a Slurm job's) never come first.
    (b"0::/system.slice/slurmstepd.scope/job_7/step_0/user/nvidia-persistenced.service\n",
     "slurmstepd.scope"),
    (b"0::/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod1.slice/"
     b"cri-containerd-0123.scope\n", "cri-containerd-0123.scope"),
    (b"0::/../../system.slice/dcgm.service\n", "dcgm.service"),  # gpuwatch in a cgroupns
    (b"0::/\n", None),
    (b"0::/slurm/uid_1000/job_7/step_0\n", None),
    # v1: the name=systemd line; hybrid: the unified line, systemd's own.
    (b"4:memory:/slurm/uid_1/job_7\n1:name=systemd:/system.slice/nv-hostengine.service\n",
     "nv-hostengine.service"),
    (b"4:memory:/\n1:name=systemd:/user.slice\n0::/system.slice/dcgm.service\n",
     "dcgm.service"),
    (b"garbage\n", None),
])
def test_the_system_unit_is_the_first_unit_below_slices_only(cgroup: bytes,
                                                              unit: Optional[str]) -> None:
    assert system_unit(cgroup) == unit
