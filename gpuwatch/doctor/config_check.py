"""The config check: the configuration as every other command loads it."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from gpuwatch.config import DEFAULT_CONFIG_PATH, Config, ConfigError, describe, load_config
from gpuwatch.doctor.base import FAIL, OK, Check, Context


@dataclass(frozen=True)
class ConfigLoad:
    config: Config
    #: What was loaded, for the ok line.
    source: str
    #: ConfigError's message (it names the key and where the value came from).
    error: Optional[str] = None


def load_config_for_doctor(path: Optional[Path], runtime_dir: Optional[Path] = None,
                           environ: Optional[Mapping[str, str]] = None) -> ConfigLoad:
    """The configuration as every other command loads it; when it is invalid, the error and a
    fallback (the environment and flags without the file, else the defaults) for the rest."""
    env = os.environ if environ is None else environ
    overrides = {"daemon.runtime_dir": runtime_dir}
    if path is not None:
        source = f"{path} (--config): valid"
    elif "GPUWATCH_CONFIG" in env:
        source = f"{env['GPUWATCH_CONFIG']} (GPUWATCH_CONFIG): valid"
    elif DEFAULT_CONFIG_PATH.exists():
        source = f"{DEFAULT_CONFIG_PATH}: valid"
    else:
        source = f"no config file ({DEFAULT_CONFIG_PATH} does not exist): the defaults"
    variables = sorted(v for _, _, _, v in describe() if v and v in env)
    if variables:
        source += "; " + ", ".join(variables) + " set"
    try:
        return ConfigLoad(load_config(path, environ=env, overrides=overrides), source)
    except ConfigError as exc:
        error = str(exc)
    for fallback_env in (env, {}):
        with contextlib.suppress(ConfigError):
            return ConfigLoad(load_config(Path(os.devnull), environ=fallback_env,
                                          overrides=overrides), source, error)
    return ConfigLoad(Config(), source, error)


def check_config(ctx: Context) -> list[Check]:
    if ctx.config_error is not None:
        return [Check("config", FAIL, f"invalid: {ctx.config_error}",
                      fix="correct the key the message names (docs/config.md lists every key); "
                          "the daemon will not start with this configuration (exit 78), and a "
                          "running one refuses it on reload; the other checks ran with the "
                          "defaults instead")]
    return [Check("config", OK, ctx.config_source,
                  detail=f"runtime directory {ctx.runtime_dir}, "
                         f"metrics on {ctx.config.daemon.listen}")]
