"""The command line as someone used to nvidia-smi, htop, kubectl and `watch` tries it: `-h`
everywhere, help without type placeholders, durations with units, output that a pipe gets in full
and a terminal gets fitted and coloured, `status --watch`, shell completion, and a daemon that
says which address is taken."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import re
import select
import signal
import socket
import struct
import subprocess
import sys
import termios
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path

import pytest

from gpuwatch.simulate.demo import wait_for
from gpuwatch.simulate.fakenvml import FakeNode
from tests.realprocs import GIB, gpuwatch, killed_after
from tests.scenarios import orphaned_worker_under_pid1

COMMANDS = ["status", "daemon", "reap", "top", "doctor", "demo", "run", "agent-path"]
ANSI = "\033["


# ---- a real terminal: a pseudo-terminal of a chosen size ---------------------------------------


class TerminalOutput:
    """What a program wrote to its terminal, read as it comes."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        self.text = ""
        self.closed = False

    def _read(self, timeout: float) -> None:
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return
        try:
            chunk = os.read(self.fd, 1 << 16)
        except OSError:  # EIO: every writer has closed the terminal
            chunk = b""
        if not chunk:
            self.closed = True
        self.text += chunk.decode(errors="replace").replace("\r\n", "\n")

    def read_until(self, what: str, predicate: Callable[[str], bool], timeout: float = 30
                   ) -> str:
        deadline = time.monotonic() + timeout
        while not predicate(self.text):
            left = deadline - time.monotonic()
            if left <= 0 or self.closed:
                raise AssertionError(f"no {what} on the terminal, which shows:\n"
                                     f"{self.text[-3000:]}")
            self._read(min(left, 0.5))
        return self.text

    def read_to_end(self, timeout: float = 60) -> str:
        return self.read_until("end of output", lambda _: self.closed, timeout)


@contextlib.contextmanager
def in_terminal(argv: Sequence[str], env: Mapping[str, str], columns: int = 100,
                rows: int = 40) -> Iterator[tuple[subprocess.Popen[bytes], TerminalOutput]]:
    """`argv` with a pseudo-terminal of `columns` x `rows` as stdin, stdout and stderr."""
    master, slave = os.openpty()
    fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", rows, columns, 0, 0))
    # COLUMNS and LINES would win over the terminal's own size.
    clean = {k: v for k, v in env.items() if k not in ("COLUMNS", "LINES")}
    proc = subprocess.Popen(list(argv), env=clean, stdin=slave, stdout=slave, stderr=slave)
    os.close(slave)
    try:
        yield proc, TerminalOutput(master)
    finally:
        proc.kill()
        proc.wait()
        os.close(master)


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "gpuwatch", *args]


# ---- help ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_dash_h_prints_the_help_of_every_command(command: str) -> None:
    result = gpuwatch([command, "-h"] if command else ["-h"], os.environ)
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout.lower()
    assert result.stdout == gpuwatch([command, "--help"] if command else ["--help"],
                                     os.environ).stdout


@pytest.mark.parametrize("command", ["", *COMMANDS])
def test_help_names_values_and_shows_no_type_placeholders(command: str) -> None:
    text = gpuwatch([command, "-h"] if command else ["-h"], os.environ).stdout
    # What some Typer releases render for an option's Python type, and escaped brackets.
    assert not re.findall(r"<[a-z][\w\[\], ]*>", text), text
    assert "\\[" not in text, text
    assert not re.findall(r"\b(?:BOOLEAN|FLOAT RANGE|INTEGER|TEXT)\b", text), text


def _applied_default(command: str, option: str) -> object:
    """What applies when `gpuwatch COMMAND` is run without `option`, from where the program
    takes it: a fresh Config for the flags that override a setting, the supervisor's own
    default for `run --grace`, the reaper's kinds for `reap --kind`, the click default else."""
    import inspect

    from gpuwatch.actions.reap_plan import REAPABLE_KINDS
    from gpuwatch.actions.supervisor import Supervisor
    from gpuwatch.cli import app
    from gpuwatch.config import DEFAULT_CONFIG_PATH, Config

    config = Config()
    from_config = {"--listen": config.daemon.listen, "--interval": config.daemon.interval,
                   "--web-config": config.daemon.web_config,
                   "--runtime-dir": config.daemon.runtime_dir,
                   "--state-dir": config.daemon.state_dir,
                   "--log-format": config.daemon.log_format,
                   "--log-level": config.daemon.log_level}
    if option == "--config":
        return DEFAULT_CONFIG_PATH
    if command == "daemon" and option in from_config:
        return from_config[option]
    if option == "--runtime-dir":
        return config.daemon.runtime_dir
    if command == "reap" and option == "--grace":
        return config.reaper.grace
    if command == "reap" and option == "--kind":
        return tuple(REAPABLE_KINDS)
    if command == "run" and option == "--grace":
        return inspect.signature(Supervisor).parameters["grace"].default
    param = next(p for p in app.commands[command].params if option in p.opts)
    return param.default if isinstance(param.default, (int, float, str, Path)) else None


@pytest.mark.parametrize("command", COMMANDS)
def test_every_default_help_shows_is_the_one_that_applies(command: str) -> None:
    """Each option's default is said once, in one form, and it is what the command does without
    the option: `daemon -h` once said 1s while the daemon polled every 2s."""
    import click

    from gpuwatch.cli import Option, app, shown

    text = " ".join(gpuwatch([command, "-h"], os.environ).stdout.split())
    said = 0
    for param in app.commands[command].params:
        if not isinstance(param, click.Option) or param.name == "help":
            continue
        if param.is_flag:
            continue
        if not isinstance(param, Option):  # says no default: it has none
            assert "default" not in (param.help or ""), f"{command} {param.opts[0]}"
            assert param.default in (None, ()) or not isinstance(
                param.default, (int, float, str, Path)), f"{command} {param.opts[0]}"
            continue
        option = param.opts[-1] if param.opts[-1].startswith("--") else param.opts[0]
        applied = _applied_default(command, option)
        if applied in (None, ""):
            said += f"{param.opts[-1]} {param.metavar}" in text and "(default " in (param.help
                                                                                  or "")
            continue
        want = shown(applied, param.type.name == "duration")
        assert f"(default {want}" in text, f"{command} {option}: {want} not in\n{text}"
        said += 1
    assert text.count("(default ") == said, text
    assert "[default:" not in text and "default:" not in text.replace("(default: the", ""), text


def test_every_root_command_is_listed_with_a_whole_summary() -> None:
    text = gpuwatch(["-h"], os.environ).stdout
    listed = re.findall(r"^  ([\w-]+)\s{2,}(.+)$", text.split("Commands:")[1], re.M)
    assert {name for name, _ in listed} == set(COMMANDS)
    assert not [line for _, line in listed if line.endswith("...")], listed


def test_shell_completion_can_be_installed_and_completes_commands_and_options() -> None:
    script = gpuwatch(["--show-completion", "bash"], os.environ)
    assert script.returncode == 0 and "_GPUWATCH_COMPLETE" in script.stdout, script.stderr
    for words, cword, expect in (("gpuwatch sta", "1", "status"),
                                 ("gpuwatch reap --old", "2", "--older-than")):
        done = subprocess.run([sys.executable, "-m", "gpuwatch"], capture_output=True,
                              text=True, timeout=60,
                              env={**os.environ, "_GPUWATCH_COMPLETE": "complete_bash",
                                   "COMP_WORDS": words, "COMP_CWORD": cword})
        assert done.stdout.split() == [expect], (words, done.stdout, done.stderr)
    assert "--install-completion" in gpuwatch(["-h"], os.environ).stdout


# ---- durations ----------------------------------------------------------------------------------


def test_durations_take_units_and_a_bad_one_names_the_option(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with orphaned_worker_under_pid1(tmp_path) as worker:
        fake_node.hold(worker, device=0, used=GIB)
        young = gpuwatch(["reap", "--dry-run", "--json", "--older-than", "5m", "--grace", "30s"],
                         cli_env)
        assert young.returncode == 3, young.stderr  # nothing five minutes old yet
        now = gpuwatch(["reap", "--dry-run", "--json", "--older-than", "0s", "--grace", "1m30s"],
                       cli_env)
        assert now.returncode == 0, now.stderr
        (action,) = json.loads(now.stdout)["actions"]
        assert action["pid"] == worker
    for args, option in ((["reap", "--dry-run", "--older-than", "5x"], "--older-than"),
                         (["reap", "--dry-run", "--grace", "soon"], "--grace"),
                         (["status", "--watch", "--interval", "-1"], "--interval")):
        bad = gpuwatch(args, cli_env)
        assert bad.returncode == 2, bad
        assert option in bad.stderr and "not a duration" in bad.stderr, bad.stderr


# ---- output: in full when piped, fitted and coloured on a terminal ------------------------------


LONG_TAIL = "--note=" + "x" * 220 + "-END-OF-COMMAND"


@pytest.fixture
def long_command_holder(fake_node: FakeNode) -> Iterator[int]:
    """A process with a command line far wider than any terminal, holding GPU memory."""
    with killed_after([sys.executable, "-c", "import time; time.sleep(600)", LONG_TAIL],
                      os.environ) as proc:
        wait_for("the holder's command line", lambda: LONG_TAIL.encode() in Path(
            f"/proc/{proc.pid}/cmdline").read_bytes() or None, 10)
        fake_node.hold(proc.pid, device=0, used=2 * GIB)
        yield proc.pid


def test_piped_status_writes_every_line_in_full_without_colour(
        long_command_holder: int, cli_env: dict[str, str]) -> None:
    # COLUMNS as a terminal would leave it set: a pipe is not that terminal.
    result = gpuwatch(["status"], {**cli_env, "COLUMNS": "80"})
    assert result.returncode == 0, result.stderr
    (row,) = _rows_of(result.stdout, long_command_holder)
    assert row.endswith("-END-OF-COMMAND"), row
    assert ANSI not in result.stdout


def test_status_on_a_terminal_fits_its_width(long_command_holder: int,
                                             cli_env: dict[str, str]) -> None:
    with in_terminal(cli("status"), cli_env, columns=90) as (proc, screen):
        text = screen.read_to_end()
        assert proc.wait(30) == 0, text
    assert _rows_of(text, long_command_holder), text
    assert max(map(len, text.splitlines())) <= 90, text
    assert "-END-OF-COMMAND" not in text


def test_reap_with_nothing_to_do_on_a_terminal_fits_its_width(cli_env: dict[str, str]) -> None:
    """Its first line (node, time, source, dry run) is wrapped as with a plan to show."""
    with in_terminal(cli("reap", "--dry-run"), cli_env, columns=60) as (proc, screen):
        text = screen.read_to_end()
        assert proc.wait(30) == 3, text
    assert "nothing to do" in text and "dry run" in text, text
    assert max(map(len, text.splitlines())) <= 60, text


def _rows_of(text: str, pid: int) -> list[str]:
    """The process-table rows of `pid` (a tree's branches come before the PID)."""
    return [line for line in text.splitlines() if re.match(rf"^[\s│├└─]*{pid}\s", line)]


@pytest.fixture
def critical_orphan(fake_node: FakeNode, tmp_path: Path) -> Iterator[int]:
    with orphaned_worker_under_pid1(tmp_path) as worker:
        fake_node.hold(worker, device=0, used=GIB)
        yield worker


def test_severities_are_coloured_on_a_terminal_unless_no_color(
        critical_orphan: int, cli_env: dict[str, str]) -> None:
    with in_terminal(cli("status"), cli_env, columns=200) as (proc, screen):
        coloured = screen.read_to_end()
        proc.wait(30)
    assert "\033[1;31mcritical\033[0m" in coloured, coloured
    assert "\033[1;31m[orphan]\033[0m" in coloured, coloured
    with in_terminal(cli("status"), {**cli_env, "NO_COLOR": "1"}, columns=200) as (proc, screen):
        plain = screen.read_to_end()
        proc.wait(30)
    assert "critical" in plain and "[orphan]" in plain and ANSI not in plain, plain
    # Uncoloured, the terminal gets the same characters: the two runs are two polls, so a
    # figure (a process's RSS), a process's state and their columns' widths may differ, and
    # nothing else.
    def shape(text: str) -> list[str]:
        return [re.sub(r" +", " ", re.sub(r"\b(running|sleeping|disk-sleep|idle)\b", "STATE",
                                          re.sub(r"\d+(\.\d+)?", "#", line)))
                for line in text.splitlines()[2:]]

    assert shape(re.sub(r"\033\[[\d;]*m", "", coloured)) == shape(plain)


# ---- status --watch -----------------------------------------------------------------------------


def test_status_watch_piped_as_json_writes_one_document_a_line_until_stopped(
        cli_env: dict[str, str]) -> None:
    with killed_after(cli("status", "--watch", "--json", "-n", "200ms"), cli_env,
                      stdout=subprocess.PIPE) as proc:
        assert proc.stdout is not None
        first, second = (json.loads(proc.stdout.readline()) for _ in range(2))
        assert first["schema"] == second["schema"]
        assert second["taken_at"] > first["taken_at"]
        proc.terminate()
        assert proc.wait(20) == -signal.SIGTERM


def test_status_watch_into_a_pipe_closed_by_its_reader_ends_quietly(
        cli_env: dict[str, str]) -> None:
    with killed_after(cli("status", "--watch", "-n", "100ms"), cli_env, stdout=subprocess.PIPE,
                      stderr=subprocess.PIPE) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        assert proc.stdout.readline().startswith(b"node ")
        proc.stdout.close()  # what `| head -1` does once it has its line
        proc.wait(20)
        errors = proc.stderr.read().decode()
    assert proc.returncode in (0, 1) and "Traceback" not in errors, errors


@pytest.mark.sigint
def test_status_watch_redraws_the_terminal_and_ctrl_c_ends_it_with_0(
        cli_env: dict[str, str]) -> None:
    with in_terminal(cli("status", "--watch", "--interval", "0.2s"), cli_env) as (proc, screen):
        screen.read_until("three redraws", lambda text: text.count("\033[H\033[2J") >= 3)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(20) == 0


# ---- the daemon's address -----------------------------------------------------------------------


def test_an_address_in_use_is_named_with_what_to_do(cli_env: dict[str, str],
                                                    tmp_path: Path) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        result = gpuwatch(["daemon", "--listen", f"127.0.0.1:{port}",
                           "--runtime-dir", str(tmp_path / "run"),
                           "--state-dir", str(tmp_path / "state")], cli_env)
    assert result.returncode == 1
    assert f"127.0.0.1:{port}" in result.stderr and "already in use" in result.stderr
    assert "--listen" in result.stderr
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("argv", [
    ["--", "true"], ["true", "--grace", "5"],
    ["--grace", "1m", "--keep-helpers", "python", "-c", "x"],
    ["--grace=30s", "--job-name", "train-1", "--json", "out.json", "--no-cgroup", "--", "-x"],
    ["--no-agent", "--", "python", "train.py"],
    ["--job-name=a:b@c", "sh"], ["--json=", "true"],
])
def test_run_reads_its_command_line_as_click_does_without_click(argv: list[str]) -> None:
    """`gpuwatch run` reads its options without click for speed: what it reads is what the
    click command (which -h and errors go to) would read."""
    from gpuwatch.app.run import RunArgs, parse_fast
    from gpuwatch.cli import app

    ctx = app.commands["run"].make_context("run", list(argv))
    assert parse_fast(argv) == RunArgs(**ctx.params)


_MODULES_AT_EXIT = ("import atexit, sys\n"
                    "atexit.register(lambda: sys.stderr.write('MODULES ' + ' '.join(sorted(\n"
                    "    m for m in sys.modules if m.split('.')[0] in ('click', 'gpuwatch')))))\n"
                    "sys.argv[0] = 'gpuwatch'\n"
                    "from gpuwatch.entry import main\n"
                    "main()\n")


def _entry(argv: Sequence[str], env: Mapping[str, str]) -> tuple[subprocess.CompletedProcess[str],
                                                                 set[str]]:
    """`gpuwatch ARGV` through the entry point, and the click and gpuwatch modules it imported."""
    result = subprocess.run([sys.executable, "-c", _MODULES_AT_EXIT, *argv], env=dict(env),
                            capture_output=True, text=True, timeout=60)
    _, _, modules = result.stderr.rpartition("MODULES ")
    return result, set(modules.split())


@pytest.mark.parametrize("argv", [["--json"], ["--json", "--poll"], ["--poll", "--json"]])
def test_status_json_is_answered_without_click_as_click_answers_it(
        argv: list[str], cli_env: dict[str, str]) -> None:
    """Scripts run `gpuwatch status --json` every few seconds: it starts without click and the
    other commands, and prints what click's `status --json` prints, with its exit code."""
    fast, modules = _entry(["status", *argv], cli_env)
    assert "click" not in modules and "gpuwatch.cli" not in modules, sorted(modules)
    assert "gpuwatch.commands.status_json" in modules
    slow = gpuwatch(["status", "--json", "--verbose", *argv[1:]], cli_env)  # click's path
    assert fast.returncode == slow.returncode == 0, (fast.stderr, slow.stderr)
    ours, theirs = json.loads(fast.stdout), json.loads(slow.stdout)
    assert fast.stdout.startswith('{\n  "') and fast.stdout.endswith("}\n")
    assert ours.keys() == theirs.keys() and ours["source"] == theirs["source"] == "poll"
    assert [g["index"] for g in ours["gpus"]] == [g["index"] for g in theirs["gpus"]]


@pytest.mark.parametrize("argv", [["-h"], ["--json", "-v"], ["--json", "--watch"], ["--poll"],
                                  ["--json", "--runtime-dir", "/nonexistent"], ["--jsn"],
                                  ["--json", "--json=1"]])
def test_status_hands_every_other_command_line_to_click(argv: list[str],
                                                        cli_env: dict[str, str]) -> None:
    from gpuwatch.commands.status_json import main as status_json

    assert status_json(argv) is None
    if argv == ["--json", "--watch"]:
        return  # it would not end; that click reads it is what is pinned
    result, modules = _entry(["status", *argv], cli_env)
    assert "click" in modules, sorted(modules)
    assert "Traceback" not in result.stderr, result.stderr


@pytest.mark.parametrize("argv", [["--json"], ["--json", "--verbose"]])
def test_status_json_into_a_pipe_nobody_reads_ends_quietly_as_click_ends_it(
        argv: list[str], cli_env: dict[str, str]) -> None:
    """`gpuwatch status --json | head -1`: the reader is gone before the document is written.
    Without click (`--json`) as with it (`--verbose`): exit 1, and no traceback."""
    read_end, write_end = os.pipe()
    os.close(read_end)  # every write into the pipe fails: EPIPE
    try:
        result = subprocess.run([sys.executable, "-m", "gpuwatch", "status", *argv],
                                env=cli_env, stdout=write_end, stderr=subprocess.PIPE,
                                text=True, timeout=60)
    finally:
        os.close(write_end)
    assert result.returncode == 1, result.stderr
    assert "Traceback" not in result.stderr and "Broken pipe" not in result.stderr, result.stderr


def test_a_bad_configuration_under_status_json_is_said_as_click_says_it(
        tmp_path: Path, cli_env: dict[str, str]) -> None:
    bad = tmp_path / "gpuwatch.toml"
    bad.write_text("[daemon]\ninterval = -1\n")
    env = {**cli_env, "GPUWATCH_CONFIG": str(bad)}
    result, modules = _entry(["status", "--json"], env)
    assert result.returncode == 78 and "click" in modules
    assert result.stderr.startswith("gpuwatch: bad configuration: daemon.interval"), result.stderr
    assert result.stdout == ""


@pytest.mark.parametrize("argv", [[], ["-h"], ["--grace"], ["--grace", "soon", "true"],
                                  ["--job-name", "a b", "true"], ["--gracee", "1", "true"],
                                  ["--keep-helpers=yes", "true"]])
def test_run_hands_help_and_bad_command_lines_to_click(argv: list[str]) -> None:
    from gpuwatch.app.run import parse_fast

    assert parse_fast(argv) is None
    result = gpuwatch(["run", *argv], os.environ)
    assert result.returncode == (0 if argv == ["-h"] else 2), result.stderr
    if argv == ["-h"]:
        assert result.stdout.startswith("Usage: gpuwatch run [OPTIONS] COMMAND..."), result.stdout
    else:  # click's message, as every other command's
        assert "Error: " in result.stderr and "Traceback" not in result.stderr, result.stderr
