"""What the commands' options share: durations with units, defaults said once in the help (from
the setting an option overrides), `--config` and `--runtime-dir`, the configuration loaded
typed, and how a human view fits where it is written."""

from __future__ import annotations

import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Optional, TypeVar

import click

from gpuwatch.commands.exit_codes import CommandError, ExitCode
from gpuwatch.config import DEFAULT_CONFIG_PATH, setting_default, setting_env

if TYPE_CHECKING:
    from gpuwatch.config import Config

F = TypeVar("F", bound=Callable[..., Any])


class _Duration(click.ParamType):
    """A command-line duration: `30`, `30s`, `5m`, `1h30m` (gpuwatch.units.parse_duration)."""

    name = "duration"

    def convert(self, value: Any, param: Optional[click.Parameter],
                ctx: Optional[click.Context]) -> float:
        from gpuwatch.units import parse_duration

        if isinstance(value, (int, float)):  # a default given as a number
            return float(value)
        try:
            return parse_duration(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)


DURATION = _Duration()
PATH = click.Path(path_type=Path)


def shown(value: Any, duration: bool) -> str:
    """A default as help shows it: a duration with its unit, anything else as written."""
    if duration and isinstance(value, (int, float)) and not isinstance(value, bool):
        return f"{value:g}s"
    if isinstance(value, (tuple, list, frozenset)):
        return ", ".join(sorted(map(str, value)))
    return str(value)


class Option(click.Option):
    """An option whose help ends with its default, taken from the one place that sets it: the
    setting it overrides (`setting`, whose default is gpuwatch.config's, and which a GPUWATCH_*
    variable and the config file set too), or the option's own `default` (or `shown_default`,
    for one that is not a click default). `when_unset` words a default that is no value."""

    def __init__(self, *args: Any, setting: Optional[str] = None,
                 shown_default: Any = None, env: Optional[str] = None,
                 when_unset: Optional[str] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.setting = setting
        own = self.default if isinstance(self.default, (int, float, str, Path)) else None
        self.shown_default = (setting_default(setting) if setting is not None
                              else shown_default if shown_default is not None
                              else None if self.is_flag else own)
        self.env = setting_env(setting) if setting is not None else env
        if self.shown_default in (None, ""):
            said = when_unset
        else:
            said = shown(self.shown_default, isinstance(self.type, _Duration))
        if said is None:
            return
        more = "".join([f", or ${self.env}" if self.env else "",
                        f", or {setting} in the config file" if setting else ""])
        text = (self.help or "").rstrip(".")
        self.help = f"{text} (default {said}{more})."


def config_option(f: F) -> F:
    return click.option(
        "--config", cls=Option, type=PATH, metavar="FILE", shown_default=DEFAULT_CONFIG_PATH,
        env="GPUWATCH_CONFIG", help="Config file.")(f)


def runtime_option(f: F) -> F:
    return click.option(
        "--runtime-dir", cls=Option, setting="daemon.runtime_dir", type=PATH, metavar="DIR",
        help="Where agent.sock and state.sock live.")(f)


def refresh_option(help: str) -> Callable[[F], F]:
    """`--interval`/`-n`: the time between two refreshes of a view (checked by at_least_100ms
    where the command is ready to say so)."""
    return click.option("--interval", "-n", cls=Option, type=DURATION, default=2.0,
                        metavar="DURATION", help=help)


def at_least_100ms(value: float, option: str) -> None:
    if value < 0.1:
        raise click.BadParameter("at least 100ms", param_hint=f"'{option}'")


def load_config(config: Optional[Path], overrides: Mapping[str, Any]) -> Config:
    """The configuration `config` (or the default file) with the command line's `overrides`;
    a bad one ends the command with ExitCode.CONFIG, naming the key."""
    from gpuwatch.config import ConfigError
    from gpuwatch.config import load_config as load

    try:
        return load(config, overrides=overrides)
    except ConfigError as exc:
        raise CommandError(f"gpuwatch: bad configuration: {exc}", ExitCode.CONFIG) from None


def fitted() -> dict[str, Any]:
    """How a human view fits where it is written: a terminal's width and glyphs; piped, every
    line in full."""
    import shutil

    from gpuwatch.sinks.text import glyphs_for

    tty = sys.stdout.isatty()
    return {"width": shutil.get_terminal_size().columns if tty else 0,
            "glyphs": glyphs_for(sys.stdout.encoding)}
