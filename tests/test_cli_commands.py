"""The command line's parts: one module per command under gpuwatch.commands, each meaning of an
exit code named once (ExitCode) and listed in docs/cli.md's one table, daemon.json read through
one type (DaemonInfo), `doctor --check`'s help taken from the doctor's registry, and the command
line's import loading none of the commands' work."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path

from gpuwatch.commands.exit_codes import ExitCode
from gpuwatch.daemon_info import DaemonInfo
from tests.realprocs import gpuwatch

ROOT = Path(__file__).resolve().parent.parent


def test_every_command_is_defined_in_a_module_of_its_own() -> None:
    from gpuwatch.cli import app

    where = {name: command.callback.__module__ for name, command in app.commands.items()
             if command.callback is not None}
    assert where == {name: f"gpuwatch.commands.{name.replace('-', '_')}" for name in app.commands}


def test_each_meaning_of_an_exit_code_has_a_name_and_a_row_in_the_one_table() -> None:
    # 3 is three things to three commands: three members, one number.
    three = [ExitCode.NVML_UNAVAILABLE, ExitCode.NOTHING_TO_DO, ExitCode.DOCTOR_WARNINGS]
    assert all(code == 3 for code in three) and len({code.name for code in three}) == 3
    text = (ROOT / "docs" / "cli.md").read_text()
    table = text.split("## Exit codes", 1)[1].split("\n\n")[2]
    rows = re.findall(r"^\| (\d+) \| `(\w+)` \|", table, re.M)
    assert sorted(rows) == sorted((str(int(code)), code.name) for code in ExitCode), table


def test_a_command_that_cannot_go_on_says_why_and_exits_with_its_named_code() -> None:
    result = gpuwatch(["doctor", "--check", "no-such-check"], os.environ)
    assert result.returncode == ExitCode.USAGE == 2
    assert result.stderr.startswith("gpuwatch doctor: unknown check no-such-check; checks: ")
    assert "Traceback" not in result.stderr


def test_doctor_check_help_lists_every_check_of_the_registry() -> None:
    import click

    from gpuwatch.cli import app
    from gpuwatch.doctor import CHECK_NAMES

    command = app.commands["doctor"]
    (check,) = [p for p in command.params if "--check" in p.opts]
    record = check.get_help_record(click.Context(command))
    assert record is not None
    assert record[1] == f"Run only this check (repeatable): {', '.join(CHECK_NAMES)}."
    text = gpuwatch(["doctor", "-h"], os.environ).stdout
    assert "proc-children" in text and "systemd." in text, text


def test_daemon_json_reads_back_what_was_written_and_a_field_of_another_type_as_none() -> None:
    info = DaemonInfo(pid=4242, version="1.2.3", metrics_url="http://127.0.0.1:9966/metrics",
                      port=9966, state_socket="/run/gpuwatch/state.sock")
    assert DaemonInfo.from_json(json.loads(info.to_json())) == info
    assert DaemonInfo.from_json({"pid": "4242", "metrics_url": 5, "port": True,
                                 "state_socket": None}) == DaemonInfo(pid=None)


def test_no_module_but_daemon_info_reads_a_daemon_json_field_by_its_key() -> None:
    keys = {"metrics_url", "state_socket"}
    readers = []
    for path in sorted((ROOT / "gpuwatch").rglob("*.py")):
        if path.name == "daemon_info.py":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            read = (isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant)
                    and node.slice.value in keys) or (
                isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
                and node.func.attr == "get" and node.args
                and isinstance(node.args[0], ast.Constant) and node.args[0].value in keys)
            if read:
                readers.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert readers == []


def test_importing_the_command_line_loads_none_of_the_commands_work() -> None:
    """`gpuwatch status` with a daemon running is a socket read and a render: the command line
    itself loads click and the commands' options, never what a command does when it runs."""
    probe = ("import json, sys\nimport gpuwatch.cli\n"
             "print(json.dumps(sorted(sys.modules)))")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            timeout=60, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert result.returncode == 0, result.stderr
    loaded = json.loads(result.stdout)
    work = ("gpuwatch.doctor", "gpuwatch.daemon", "gpuwatch.simulate", "gpuwatch.completion",
            "gpuwatch.sinks", "gpuwatch.serve", "gpuwatch.actions", "gpuwatch.poll",
            "gpuwatch.sources", "gpuwatch.detectors", "gpuwatch.history", "gpuwatch.model",
            "prometheus_client", "yaml", "curses")
    assert [m for m in loaded if m in work or m.startswith(tuple(w + "." for w in work))] == []
    assert "gpuwatch.commands.status" in loaded
