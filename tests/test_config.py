from __future__ import annotations

from pathlib import Path

import pytest

from gpuwatch.config import DEFAULT_PORT, ConfigError, describe, load_config, split_listen


def test_defaults_match_the_design_paths(tmp_path: Path) -> None:
    cfg = load_config(environ={"GPUWATCH_CONFIG": str(_write(tmp_path, ""))})
    assert cfg.daemon.runtime_dir == Path("/run/gpuwatch")
    assert cfg.daemon.state_dir == Path("/var/lib/gpuwatch")
    assert cfg.daemon.listen == f":{DEFAULT_PORT}"
    assert cfg.daemon.interval == 2.0


def test_flags_beat_variables_beat_the_file_beat_defaults(tmp_path: Path) -> None:
    path = _write(tmp_path, '[daemon]\ninterval = 5\nruntime_dir = "/file/run"\n'
                            'state_dir = "/file/state"\n')
    env = {"GPUWATCH_RUNTIME_DIR": "/env/run", "GPUWATCH_STATE_DIR": "/env/state"}
    cfg = load_config(path, environ=env, overrides={"daemon.state_dir": "/flag/state",
                                                    "daemon.interval": None})
    assert cfg.daemon.interval == 5.0  # the file, since the flag was not given
    assert cfg.daemon.runtime_dir == Path("/env/run")  # the variable beats the file
    assert cfg.daemon.state_dir == Path("/flag/state")  # the flag beats the variable


def test_the_config_variable_names_the_file(tmp_path: Path) -> None:
    path = _write(tmp_path, "[exporter]\nmax_process_series = 7\n")
    assert load_config(environ={"GPUWATCH_CONFIG": str(path)}).exporter.max_process_series == 7


@pytest.mark.parametrize(("text", "named"), [
    ("[daemon]\nintervall = 2\n", "daemon.intervall: unknown key"),
    ("[deamon]\ninterval = 2\n", "deamon: unknown section"),
    ("[daemon]\ninterval = -1\n", 'daemon.interval: expected a duration > 0 (seconds, or "30s", '
                                   '"5m"), got -1'),
    ("[daemon]\ninterval = \"soon\"\n", "daemon.interval: expected a duration (seconds, or"),
    ("[daemon]\nlisten = \"localhost\"\n", "daemon.listen: expected HOST:PORT"),
    ("[daemon]\nlog_format = \"xml\"\n", "daemon.log_format: expected one of text, json"),
    ("[exporter]\nmax_process_series = 0\n", "exporter.max_process_series: expected an integer"),
    ("[history]\nsamples = 2.5\n", "history.samples: expected an integer >= 1"),
    ("daemon = 3\n", "daemon: expected a [daemon] table"),
    ("[daemon\n", "not valid TOML"),
])
def test_a_bad_file_is_an_error_naming_the_key(tmp_path: Path, text: str, named: str) -> None:
    path = _write(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert named in str(err.value)
    if "unknown" in named or "expected" in named:
        assert str(path) in str(err.value)  # and says where the bad value came from


def test_a_misspelt_kind_to_auto_reap_is_refused_naming_every_kind(tmp_path: Path) -> None:
    """"orphans" named no kind, so the daemon reaped nothing on its own and said nothing."""
    path = _write(tmp_path, '[reaper]\nauto = true\nauto_kinds = ["orphans", "leftover"]\n')
    with pytest.raises(ConfigError) as err:
        load_config(path, environ={})
    assert ("reaper.auto_kinds: expected a list of finding kinds, each one of orphan, zombie, "
            "leftover, ghost, leak, stalled, unkillable, unallocated ('orphans' is none)"
            ) in str(err.value)
    assert str(path) in str(err.value)
    good = _write(tmp_path, '[reaper]\nauto_kinds = ["orphan", "leftover"]\n')
    assert load_config(good, environ={}).reaper.auto_kinds == ("orphan", "leftover")


def test_a_bad_variable_is_an_error_naming_it() -> None:
    with pytest.raises(ConfigError, match=r"daemon.interval: .* \(environment GPUWATCH_INTERVAL\)"):
        load_config(environ={"GPUWATCH_INTERVAL": "fast", "GPUWATCH_CONFIG": "/dev/null"})


def test_a_missing_explicit_file_is_an_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.toml", environ={})


@pytest.mark.parametrize(("listen", "expected"), [
    (":9966", ("", 9966)), ("127.0.0.1:0", ("127.0.0.1", 0)), ("[::1]:9966", ("::1", 9966)),
])
def test_listen_addresses_split(listen: str, expected: tuple[str, int]) -> None:
    assert split_listen(listen) == expected


def test_every_setting_is_documented() -> None:
    keys = {key for key, _, help_text, _ in describe() if help_text}
    assert {"daemon.interval", "daemon.listen", "exporter.max_process_series"} <= keys
    assert all(help_text for _, _, help_text, _ in describe())


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gpuwatch.toml"
    path.write_text(text)
    return path


def test_durations_take_units_in_the_file_and_in_variables(tmp_path: Path) -> None:
    path = _write(tmp_path, '[daemon]\ninterval = "500ms"\n[detectors]\nleftover_grace = "2m"\n'
                            '[agent]\ntrace_cooldown = "1h30m"\n')
    cfg = load_config(path, environ={})
    assert (cfg.daemon.interval, cfg.detectors.leftover_grace, cfg.agent.trace_cooldown) == (
        0.5, 120.0, 5400.0)
    assert load_config(path, environ={"GPUWATCH_INTERVAL": "2s"}).daemon.interval == 2.0
    # A ratio is not a duration.
    with pytest.raises(ConfigError, match="leak_min_relative"):
        load_config(_write(tmp_path, '[detectors]\nleak_min_relative = "5m"\n'), environ={})
