"""systemd/gpuwatch.service: systemd's own checker accepts it, and its hardening holds.

The unit is checked as shipped; the only substitution is the executable, since
`systemd-analyze verify` refuses an ExecStart= binary that does not exist on this machine.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
UNIT = REPO / "systemd" / "gpuwatch.service"
SYSUSERS = REPO / "systemd" / "gpuwatch.sysusers.conf"
TMPFILES = REPO / "systemd" / "gpuwatch.tmpfiles.conf"
INSTALLED_EXECUTABLE = "/usr/local/bin/gpuwatch"
#: node_exporter's hardened unit, the bar for a daemon that must see the whole host.
NODE_EXPORTER_EXPOSURE = 3.3
#: `security --offline=` arrived in systemd 250.
OFFLINE_SECURITY_SINCE = 250

SYSTEMD_ANALYZE = shutil.which("systemd-analyze")
needs_analyze = pytest.mark.skipif(SYSTEMD_ANALYZE is None,
                                   reason="systemd-analyze not installed (Debian: systemd)")
_EXPOSURE = re.compile(r"Overall exposure level for \S+: (\d+(?:\.\d+)?)")


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    assert SYSTEMD_ANALYZE is not None
    env = {**os.environ, "SYSTEMD_LOG_COLOR": "0", "SYSTEMD_COLORS": "0", "SYSTEMD_PAGER": "",
           "SYSTEMD_LOG_LEVEL": "info"}
    return subprocess.run([SYSTEMD_ANALYZE, *args], capture_output=True, text=True,
                          encoding="utf-8", errors="replace", env=env, timeout=120, check=False)


def _analyze_version() -> int:
    first = _run("--version").stdout.split()
    return int(first[1]) if len(first) > 1 and first[1].isdigit() else 0


def _directives(text: str) -> dict[str, list[str]]:
    """Key -> values in order, as systemd reads them (comments dropped, repeats kept)."""
    found: dict[str, list[str]] = defaultdict(list)
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line[0] in "#;[":
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not a directive: {raw!r}"
        found[key.strip()].append(value.strip())
    return found


def _installable_copy(directory: Path, text: str | None = None) -> Path:
    """The unit text under its own name, ExecStart= pointing at a real executable in `directory`."""
    text = UNIT.read_text() if text is None else text
    exe = directory / "gpuwatch"
    exe.write_text("#!/bin/sh\nexit 0\n")
    exe.chmod(0o755)
    unit = directory / UNIT.name
    unit.write_text(text.replace(f"ExecStart={INSTALLED_EXECUTABLE} ", f"ExecStart={exe} ", 1))
    return unit


def _complaints(unit: Path) -> tuple[int, list[str]]:
    result = _run("verify", str(unit))
    # verify exits 0 on unknown keys and unparsable values: every line about the unit counts.
    mentions = (unit.name, str(unit.parent))
    lines = [line for line in (result.stdout + result.stderr).splitlines()
             if any(m in line for m in mentions)]
    return result.returncode, lines


def _exposure(unit: Path) -> float:
    result = _run("security", "--offline=yes", "--no-pager", str(unit))
    match = _EXPOSURE.search(result.stdout + result.stderr)
    assert match, f"no exposure line in:\n{result.stdout}\n{result.stderr}"
    return float(match.group(1))


# -- systemd's own verdict --------------------------------------------------------------------

def test_execstart_is_the_one_line_naming_the_installed_executable() -> None:
    text = UNIT.read_text()
    assert _directives(text)["ExecStart"] == [f"{INSTALLED_EXECUTABLE} daemon"]
    assert text.count(INSTALLED_EXECUTABLE) == 1


@needs_analyze
def test_unit_passes_systemd_analyze_verify_without_a_warning(tmp_path: Path) -> None:
    rc, complaints = _complaints(_installable_copy(tmp_path))
    assert complaints == []
    assert rc == 0


@needs_analyze
def test_verify_check_reports_a_misspelt_directive(tmp_path: Path) -> None:
    # Guards the check above: were the output format to change, it would pass vacuously.
    broken = UNIT.read_text().replace("ProtectSystem=strict", "ProtectSystem=stritc")
    _, complaints = _complaints(_installable_copy(tmp_path, broken))
    assert any("stritc" in line for line in complaints), complaints


@needs_analyze
def test_exposure_level_is_below_node_exporters(tmp_path: Path) -> None:
    if _analyze_version() < OFFLINE_SECURITY_SINCE:
        pytest.skip(f"systemd-analyze older than {OFFLINE_SECURITY_SINCE} has no --offline")
    exposure = _exposure(_installable_copy(tmp_path))
    assert exposure < NODE_EXPORTER_EXPOSURE


@needs_analyze
def test_exposure_parser_rates_an_unhardened_unit_as_exposed(tmp_path: Path) -> None:
    if _analyze_version() < OFFLINE_SECURITY_SINCE:
        pytest.skip(f"systemd-analyze older than {OFFLINE_SECURITY_SINCE} has no --offline")
    bare = f"[Service]\nExecStart={INSTALLED_EXECUTABLE} daemon\n"
    assert _exposure(_installable_copy(tmp_path, bare)) > 9.0


@needs_analyze
def test_sysusers_creates_the_account_and_group_the_unit_runs_as(tmp_path: Path) -> None:
    sysusers = Path(SYSTEMD_ANALYZE or "").with_name("systemd-sysusers")
    if not sysusers.exists():
        pytest.skip("systemd-sysusers not installed next to systemd-analyze")
    unit = _directives(UNIT.read_text())
    result = subprocess.run([str(sysusers), "--dry-run", f"--root={tmp_path}", "-"],
                            input=SYSUSERS.read_text(), capture_output=True, text=True,
                            timeout=60, check=False)
    assert result.returncode == 0, result.stderr
    output = result.stdout + result.stderr
    created = re.search(r"Creating user '(\w+)' .* with UID (\d+) and GID (\d+)", output)
    assert created, output
    group = re.search(r"Creating group '(\w+)' with GID (\d+)", output)
    assert group, output
    assert unit["User"] == [created.group(1)]
    # The primary group is the one named by Group= (and owns state.sock).
    assert unit["Group"] == [group.group(1)]
    assert created.group(3) == group.group(2)


@needs_analyze
def test_tmpfiles_keeps_the_configuration_directory_root_owned(tmp_path: Path) -> None:
    tmpfiles = Path(SYSTEMD_ANALYZE or "").with_name("systemd-tmpfiles")
    if not tmpfiles.exists():
        pytest.skip("systemd-tmpfiles not installed next to systemd-analyze")
    unit = _directives(UNIT.read_text())
    assert unit["ConfigurationDirectory"] == ["gpuwatch"]
    result = subprocess.run([str(tmpfiles), "--create", f"--root={tmp_path}", "-"],
                            input=TMPFILES.read_text(), capture_output=True, text=True,
                            timeout=60, check=False)
    made = tmp_path / "etc" / "gpuwatch"
    assert made.is_dir(), result.stderr
    assert made.stat().st_mode & 0o7777 == 0o755
    if os.geteuid() == 0:
        assert result.returncode == 0, result.stderr
        assert (made.stat().st_uid, made.stat().st_gid) == (0, 0)
    else:  # only root can hand the directory to root; everything else must have worked
        assert all("chown" in line for line in result.stderr.splitlines()), result.stderr


# -- the hardening choices that must not be "improved" away -----------------------------------

def test_daemon_runs_as_a_non_root_user_with_exactly_three_capabilities() -> None:
    unit = _directives(UNIT.read_text())
    wanted = {"CAP_SYS_PTRACE", "CAP_DAC_READ_SEARCH", "CAP_KILL"}
    assert unit["User"] == ["gpuwatch"]
    assert [set(v.split()) for v in unit["CapabilityBoundingSet"]] == [wanted]
    assert [set(v.split()) for v in unit["AmbientCapabilities"]] == [wanted]
    assert unit["NoNewPrivileges"] == ["yes"]


def test_unit_leaves_every_process_and_the_nvidia_devices_visible() -> None:
    unit = _directives(UNIT.read_text())
    # Each of these would hide other users' processes, their identities or /dev/nvidia*.
    for key in ("ProtectProc", "ProcSubset", "PrivateUsers", "PrivateNetwork", "DynamicUser"):
        assert unit.get(key, ["no"])[-1] in ("no", "default", "all"), key
    assert unit["PrivateDevices"] == ["no"]
    assert unit["DevicePolicy"] == ["closed"]
    assert sorted(unit["DeviceAllow"]) == ["char-nvidia-caps r", "char-nvidia-frontend rw"]


def test_unit_is_notify_type_with_watchdog_and_reload() -> None:
    unit = _directives(UNIT.read_text())
    assert unit["Type"] == ["notify"]
    assert unit["NotifyAccess"] == ["main"]
    assert int(unit["WatchdogSec"][0]) >= 10  # several 2 s polls, so one slow poll is no crash
    assert unit["ExecReload"] == ["/bin/kill -HUP $MAINPID"]
    assert unit["RuntimeDirectory"] == ["gpuwatch"]
    assert unit["RuntimeDirectoryMode"] == ["0755"]  # agent.sock is for every local user
