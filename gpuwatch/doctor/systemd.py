"""The systemd check: the unit's state, from `systemctl show`."""

from __future__ import annotations

import shutil
import subprocess

from gpuwatch.doctor.base import FAIL, OK, SKIP, WARN, Check, Context

_UNIT_PROPERTIES = ("LoadState", "ActiveState", "SubState", "UnitFileState", "Result")


def check_systemd(ctx: Context) -> list[Check]:
    if not ctx.run_systemd.is_dir():
        return [Check("systemd", SKIP, f"skipped: systemd is not running here (no "
                                       f"{ctx.run_systemd})")]
    exe = shutil.which(ctx.systemctl)
    if exe is None:
        return [Check("systemd", WARN, f"systemd runs, but {ctx.systemctl} is not on PATH",
                      fix=f"run `systemctl status {ctx.unit}` where it is")]
    # `show` rather than is-active/is-enabled: one call, output meant for programs, and an
    # unknown unit is LoadState=not-found instead of an error whose wording varies by version.
    argv = [exe, "show", ctx.unit, "--no-pager",
            *(f"--property={p}" for p in _UNIT_PROPERTIES)]
    try:
        done = subprocess.run(argv, capture_output=True, text=True, timeout=ctx.timeout,
                              check=False)
    except subprocess.TimeoutExpired:
        return [Check("systemd", WARN, f"systemctl did not answer within {ctx.timeout:g} s",
                      fix="systemd itself is busy or stuck: `systemctl status` may hang too")]
    if done.returncode != 0:
        why = (done.stderr.strip() or f"exit {done.returncode}").splitlines()[0]
        return [Check("systemd", WARN, f"systemctl show {ctx.unit} failed: {why}",
                      fix=f"run `systemctl status {ctx.unit}` as root")]
    unit: dict[str, str] = {}
    for line in done.stdout.splitlines():
        key, _, value = line.partition("=")
        unit[key] = value.strip()
    load, active = unit.get("LoadState", ""), unit.get("ActiveState", "")
    sub, enabled = unit.get("SubState", ""), unit.get("UnitFileState", "") or "?"
    state = f"{ctx.unit} {active}" + (f" ({sub})" if sub else "") + f", {enabled}"
    if load == "not-found":
        return [Check("systemd", WARN, f"{ctx.unit} is not installed",
                      fix="install it (docs/systemd.md), unless the daemon runs another way "
                          "(a container, a Kubernetes DaemonSet)")]
    if load == "masked":
        return [Check("systemd", FAIL, f"{ctx.unit} is masked: it cannot be started",
                      fix=f"`systemctl unmask {ctx.unit}`, then `systemctl enable --now "
                          f"{ctx.unit}`")]
    if active == "failed":
        return [Check("systemd", FAIL, f"{state}, result {unit.get('Result') or '?'}",
                      fix=f"`journalctl -u {ctx.unit} -n 50` says why (a bad configuration "
                          "exits 78 and is not restarted: fix it first); then `systemctl "
                          f"restart {ctx.unit}`")]
    if active == "inactive":
        start = "start" if enabled.startswith("enabled") else "enable --now"
        return [Check("systemd", FAIL, state, fix=f"`systemctl {start} {ctx.unit}`")]
    if active != "active":
        return [Check("systemd", WARN, state,
                      fix=f"check again in a moment; `journalctl -u {ctx.unit}` shows progress")]
    if enabled not in ("enabled", "enabled-runtime", "static", "indirect", "generated",
                       "linked", "linked-runtime"):
        return [Check("systemd", WARN, f"{state}: it will not start at boot",
                      fix=f"`systemctl enable {ctx.unit}`")]
    return [Check("systemd", OK, state)]
