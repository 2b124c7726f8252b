"""The configuration and web-configuration paths accept only regular files of a bounded size,
are read off the poll loop, and never show a file's content in an error: a FIFO, /dev/zero or
/etc/shadow named by mistake (or by someone hoping the daemon's read access shows it) costs a
clear refusal and nothing else."""

from __future__ import annotations

import os
import resource
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Mapping
from pathlib import Path

import pytest

from gpuwatch.config import EXIT_CONFIG, ConfigError, load_config
from gpuwatch.serve.web_config import load_web_config
from gpuwatch.simulate.fakenvml import FakeNode
from tests.daemonproc import running_daemon, value

SECRET = "s3cr3tC0ntent"


def _limited_gpuwatch(args: list[str], env: Mapping[str, str], timeout: float = 30
                      ) -> subprocess.CompletedProcess[str]:
    """The CLI with its address space capped at 1.5 GiB: a reader that swallows /dev/zero dies
    of MemoryError there instead of taking the machine's memory."""
    def cap() -> None:
        limit = 3 << 29
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))

    return subprocess.run([sys.executable, "-m", "gpuwatch", *args], env=dict(env),
                          capture_output=True, text=True, timeout=timeout, preexec_fn=cap)


@pytest.mark.parametrize("flag", ["--config", "--web-config"])
@pytest.mark.parametrize("kind", ["fifo", "/dev/zero", "directory", "too big"])
def test_a_config_path_that_is_no_small_regular_file_exits_78_at_once(
        cli_env: dict[str, str], tmp_path: Path, flag: str, kind: str) -> None:
    if kind == "fifo":
        path = tmp_path / "config.fifo"
        os.mkfifo(path)  # nobody writes: a blocking open would wait for ever
        said = "a FIFO"
    elif kind == "/dev/zero":
        path, said = Path("/dev/zero"), "a character device"
    elif kind == "directory":
        path, said = tmp_path, "a directory"
    else:
        path = tmp_path / "big.toml"
        path.write_bytes(b"#" * (2 << 20))  # comments only: valid, but bigger than 1 MiB
        said = "more than the"
    started = time.monotonic()
    result = _limited_gpuwatch(["daemon", "--listen", "127.0.0.1:0", flag, str(path)], cli_env)
    assert result.returncode == EXIT_CONFIG, result.stderr
    assert said in result.stderr and str(path) in result.stderr
    assert "Traceback" not in result.stderr
    assert time.monotonic() - started < 25


@pytest.mark.parametrize("text", [
    f"root:$6${SECRET}:19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n",  # /etc/shadow
    f"{SECRET}: 1\n",
    f"tls_server_config:\n  {SECRET}: x\n",
    f"a: b: {SECRET}\n",
    f'"{SECRET}\n',
    f"- {SECRET}: [\n",
    f"tls_server_config:\n  cert_file: a\n  key_file: b\n  client_auth_type: {SECRET}\n",
    f"tls_server_config:\n  cert_file: a\n  key_file: b\n  min_version: {SECRET}\n",
    f"http_server_config:\n  headers:\n    X-Frame-Options: {SECRET}\n",
    f"http_server_config:\n  headers:\n    {SECRET}-Header: x\n",
    f"basic_auth_users:\n  ? [{SECRET}]\n  : x\n",
])
def test_a_web_config_error_never_shows_the_file_s_content(tmp_path: Path, text: str) -> None:
    path = tmp_path / "web.yml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_web_config(path)
    assert SECRET not in str(err.value)
    assert str(path) in str(err.value)


@pytest.mark.parametrize("text", [
    f"root:$6${SECRET}:19000:0:99999:7:::\n",
    f"{SECRET} = 1\n",
    f'[daemon]\ninterval = "{SECRET}"\n',
    f'[daemon]\n"{SECRET} x" = 1\n',
    f'"{SECRET} y" = 1\n',
    f"[daemon]\nlisten = [\"{SECRET}\"]\n",
])
def test_a_config_file_error_never_shows_the_file_s_content(tmp_path: Path, text: str) -> None:
    path = tmp_path / "gpuwatch.toml"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert SECRET not in str(err.value)
    assert str(path) in str(err.value)


def test_a_typo_in_the_config_file_is_still_named(tmp_path: Path) -> None:
    path = tmp_path / "gpuwatch.toml"
    path.write_text("[daemon]\nintervall = 2\n")
    with pytest.raises(ConfigError, match=r"daemon\.intervall: unknown key"):
        load_config(path, environ={})


def test_a_fifo_as_the_config_on_reload_is_refused_and_polls_go_on(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    with running_daemon(cli_env, tmp_path, args=("--interval", "0.2")) as d:
        d.wait_for_metrics("polls", lambda s: (value(s, "gpuwatch_polls_total") or 0) >= 2
                           or None)
        d.config_path.unlink()
        os.mkfifo(d.config_path)  # nobody ever writes
        d.proc.send_signal(signal.SIGHUP)
        d.wait_for_log("configuration reload refused")
        assert "a FIFO" in d.log()
        before = value(d.scrape(), "gpuwatch_polls_total") or 0
        d.wait_for_metrics("ten more polls", lambda s: (
            (value(s, "gpuwatch_polls_total") or 0) >= before + 10) or None)
        assert value(d.scrape(), "gpuwatch_config_reloads_total", result="refused") == 1
        assert d.proc.poll() is None


def test_a_fifo_as_the_web_config_on_reload_is_refused_and_scrapes_go_on(
        fake_node: FakeNode, cli_env: dict[str, str], tmp_path: Path) -> None:
    web = tmp_path / "web.yml"
    web.write_text("http_server_config:\n  headers:\n    X-Content-Type-Options: nosniff\n")
    with running_daemon(cli_env, tmp_path, args=("--interval", "0.2", "--web-config",
                                                 str(web))) as d:
        d.scrape()
        web.unlink()
        os.mkfifo(web)
        deadline = time.monotonic() + 20
        while "web configuration change refused" not in d.log():
            assert time.monotonic() < deadline, d.log()
            with urllib.request.urlopen(d.metrics_url, timeout=5) as response:
                assert response.status == 200
                assert response.headers["X-Content-Type-Options"] == "nosniff"
            time.sleep(0.2)
        assert "a FIFO" in d.log()
