"""The daemon process's own command line, as exec_daemon writes it (gpuwatch.daemon)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from gpuwatch.daemon import parse_daemon_args


def test_the_daemon_reads_config_and_set_in_both_spellings() -> None:
    assert parse_daemon_args([]) == (None, {})
    assert parse_daemon_args(["--config", "/etc/g.toml", "--set=daemon.interval=1",
                              "--set", "daemon.listen=127.0.0.1:9=9"]) == (
        Path("/etc/g.toml"), {"daemon.interval": "1", "daemon.listen": "127.0.0.1:9=9"})
    assert parse_daemon_args(["--config=/c.toml"]) == (Path("/c.toml"), {})


@pytest.mark.parametrize("argv, words", [
    (["--set", "no-equals"], "expected SECTION.KEY=VALUE"),
    (["--config"], "--config: expected a value"),
    (["--listen", "x"], "unrecognised argument '--listen'"),
])
def test_a_bad_daemon_command_line_is_refused_with_its_reason(argv: list[str], words: str
                                                               ) -> None:
    with pytest.raises(ValueError, match=words):
        parse_daemon_args(argv)


def test_the_daemon_process_exits_2_with_usage_on_a_bad_argument() -> None:
    result = subprocess.run([sys.executable, "-m", "gpuwatch.daemon", "--bogus"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2
    assert result.stderr.startswith("usage: gpuwatch daemon [--config PATH]")
    assert "unrecognised argument '--bogus'" in result.stderr
