"""The configuration loader, fuzzed: for any file, any GPUWATCH_* variables and any flags, it
returns a configuration or raises ConfigError, nothing else.

That is what the daemon relies on: `gpuwatch daemon` turns a ConfigError into exit 78 (which the
unit does not restart on) and a SIGHUP reload turns it into a refused reload with the running
configuration kept; anything else the loader raises is a traceback at start, or a daemon that dies
on `systemctl reload`. Files are generated as TOML documents (every TOML type, for known and
unknown keys, durations in every spelling) and as arbitrary text and bytes.
"""

from __future__ import annotations

import datetime
import json
import math
import os
import sys
import tempfile
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from gpuwatch.config import Config, ConfigError, describe, load_config

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised on 3.9/3.10 only
    import tomli as tomllib

FUZZ = settings(max_examples=200, deadline=None, database=None, print_blob=True,
                suppress_health_check=[HealthCheck.too_slow])

KEYS: dict[str, list[str]] = {}
ENV_NAMES: list[str] = []
for dotted, _default, _help, env_name in describe():
    section, _, key = dotted.partition(".")
    KEYS.setdefault(section, []).append(key)
    if env_name:
        ENV_NAMES.append(env_name)

# ---- TOML values of every type -------------------------------------------------------------------

DURATIONS = st.from_regex(r"-?[0-9]{0,4}(\.[0-9]{0,3})?(e[+-]?[0-9]{1,3})?"
                          r"(ms|s|m|h|d|us|ns|w|x)?([0-9]{1,3}(s|m))?", fullmatch=True)
WORDS = st.sampled_from(["", "true", "off", "yes", "nan", "inf", "-1", "0", "1e999", "text",
                         "json", "debug", ":9966", "127.0.0.1:0", "[::1]:9966", "host:99999",
                         "a,b,,c", "/run/gpuwatch", "gpuwatch", "\0", "30s", "1h30m", " 5m "])
STRINGS = st.one_of(WORDS, DURATIONS, st.text(max_size=40))
SCALARS = st.one_of(
    st.booleans(), st.integers(min_value=-(2**63), max_value=2**63 - 1),
    st.sampled_from([0, 1, -1, 2**31, 2**63 - 1, -(2**63)]), st.floats(allow_nan=True),
    STRINGS, st.datetimes(), st.datetimes(timezones=st.builds(
        datetime.timezone, st.integers(min_value=-23 * 60, max_value=23 * 60).map(
            lambda minutes: datetime.timedelta(minutes=minutes)))), st.dates(), st.times())
VALUES = st.recursive(
    SCALARS, lambda inner: st.one_of(st.lists(inner, max_size=4),
                                     st.dictionaries(st.text(max_size=8), inner, max_size=3)),
    max_leaves=8)


def toml_value(value: Any) -> str:
    """`value` as TOML (an inline table for a dict)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if math.isnan(value):
            return "nan"
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        return repr(value)
    if isinstance(value, str):
        return toml_string(value)
    if isinstance(value, datetime.datetime):
        return value.isoformat()
    if isinstance(value, (datetime.date, datetime.time)):
        return value.isoformat()
    if isinstance(value, list):
        return "[" + ", ".join(toml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{toml_string(k)} = {toml_value(v)}"
                               for k, v in value.items()) + "}"
    raise TypeError(type(value))


def toml_string(text: str) -> str:
    """A TOML basic string: JSON's escapes are TOML's, but for DEL, which TOML forbids raw."""
    return json.dumps(text, ensure_ascii=False).replace("\x7f", "\\u007f")


@st.composite
def toml_documents(draw: st.DrawFn) -> str:
    """A TOML document of sections and keys, mostly gpuwatch's own, with values of any type."""
    lines = []
    sections = draw(st.lists(st.one_of(st.sampled_from(sorted(KEYS)), st.text(max_size=8)),
                             max_size=4, unique=True))
    if draw(st.integers(min_value=0, max_value=9)) == 0:  # a key outside any table
        top = draw(st.sampled_from([*KEYS, "x"]).filter(lambda k: k not in sections))
        lines.append(f"{toml_string(top)} = {toml_value(draw(VALUES))}")
    for section in sections:
        lines.append(f"[{toml_string(section)}]")
        known = KEYS.get(section, [])
        keys = draw(st.lists(st.one_of(st.sampled_from(known), st.text(max_size=8))
                             if known else st.text(max_size=8), max_size=6, unique=True))
        for key in keys:
            lines.append(f"{toml_string(key)} = {toml_value(draw(VALUES))}")
    return "\n".join(lines) + "\n"


def load(content: bytes, environ: dict[str, str] | None = None) -> Config | None:
    """load_config() on a file holding `content`; None where it raised ConfigError."""
    fd, name = tempfile.mkstemp(prefix="gpuwatch-fuzz-", suffix=".toml")
    try:
        os.write(fd, content)
        os.close(fd)
        try:
            return load_config(Path(name), environ=environ or {})
        except ConfigError:
            return None
    finally:
        os.unlink(name)


def check_sane(config: Config | None) -> None:
    """What a configuration that loads may hold: positive, finite durations and sizes."""
    if config is None:
        return
    assert config.daemon.interval > 0 and math.isfinite(config.daemon.interval)
    assert config.daemon.nvml_retry_max > 0 and math.isfinite(config.daemon.nvml_retry_max)
    assert config.reaper.grace >= 0 and math.isfinite(config.reaper.grace)
    assert config.exporter.max_process_series >= 1
    assert config.history.samples >= 1


# ---- the properties ------------------------------------------------------------------------------


@FUZZ
@given(document=toml_documents())
def test_any_toml_document_loads_or_raises_config_error(document: str) -> None:
    tomllib.loads(document)  # the generator writes valid TOML: what is fuzzed is its meaning
    check_sane(load(document.encode()))


@FUZZ
@given(key=st.sampled_from([(s, k) for s, keys in KEYS.items() for k in keys]), value=VALUES)
def test_every_known_key_takes_any_value_or_raises_config_error(
        key: tuple[str, str], value: Any) -> None:
    section, name = key
    check_sane(load(f"[{section}]\n{name} = {toml_value(value)}\n".encode()))


@FUZZ
@given(text=st.text(max_size=400))
def test_any_text_loads_or_raises_config_error(text: str) -> None:
    check_sane(load(text.encode("utf-8", "surrogatepass")))


@FUZZ
@given(data=st.binary(max_size=400))
def test_any_bytes_load_or_raise_config_error(data: bytes) -> None:
    """A file that is not UTF-8 (a binary given as --config, a file in another encoding) is a
    bad configuration too, not a crash."""
    check_sane(load(data))


@FUZZ
@given(environ=st.dictionaries(st.sampled_from(ENV_NAMES), STRINGS, max_size=4),
       overrides=st.dictionaries(st.one_of(st.sampled_from([f"{s}.{k}" for s, keys in
                                                            KEYS.items() for k in keys]),
                                           st.text(max_size=12)),
                                 # What flags carry: text, numbers, switches.
                                 st.one_of(STRINGS, st.integers(), st.floats(), st.booleans(),
                                           st.none()), max_size=3))
def test_any_variables_and_flags_load_or_raise_config_error(
        environ: dict[str, str], overrides: dict[str, Any]) -> None:
    try:
        config = load_config(Path("/dev/null"), environ=environ, overrides=overrides)
    except ConfigError:
        return
    check_sane(config)
