"""Configuration: defaults < the TOML file < GPUWATCH_* variables < command-line flags.

Every key lives in a section (`[daemon] interval = 2`) and is named `section.key` in messages.
Unknown keys and bad values are errors that name the key and where the value came from, so a typo
fails at start (or is refused on SIGHUP) instead of being silently ignored.
"""

from __future__ import annotations

import os
import re
import stat
import sys
from collections.abc import Mapping, Sequence
from dataclasses import field, fields, replace
from pathlib import Path
from typing import Any, Callable, Optional

from gpuwatch.bounded_read import read_at_most
from gpuwatch.config_values import (
    absolute_paths,
    boolean,
    int_between,
    kinds,
    names,
    non_negative_float,
    non_negative_int,
    non_negative_seconds,
    one_of,
    path,
    positive_float,
    positive_int,
    positive_seconds,
    unit_names,
)
from gpuwatch.frozen import frozen_dataclass
from gpuwatch.protocol import (
    DEFAULT_RUNTIME_DIR,
    MAX_SEARCH_SECONDS,
    MAX_TRACE_STEPS,
    RUNTIME_DIR_VARIABLE,
    SOCKET_NAME,
)
from gpuwatch.vocabulary import Kind

DEFAULT_CONFIG_PATH = Path("/etc/gpuwatch/gpuwatch.toml")
#: Chosen to clash with none of node_exporter (9100), dcgm-exporter (9400), process-exporter
#: (9256), nvidia_gpu_exporter (9835) or nvitop-exporter (5050), which share GPU nodes with us.
DEFAULT_PORT = 9966


#: sysexits' EX_CONFIG: the exit code for a bad configuration. The systemd unit does not restart
#: on it (RestartPreventExitStatus): a typo will not fix itself.
EXIT_CONFIG = 78


class ConfigError(ValueError):
    """A configuration problem; the message names the key and the source of the bad value."""


#: The largest configuration file read (the config, the web config, the certificate, key and CA
#: files it names). A real one is a few KiB; /dev/zero or a log named by mistake is refused
#: before it costs memory.
MAX_CONFIG_BYTES = 1 << 20

_DEV_NULL = os.makedev(1, 3)
_FILE_TYPES = ((stat.S_ISFIFO, "a FIFO"), (stat.S_ISCHR, "a character device"),
               (stat.S_ISBLK, "a block device"), (stat.S_ISSOCK, "a socket"),
               (stat.S_ISDIR, "a directory"))


def read_config_file(path: Path, what: str, limit: int = MAX_CONFIG_BYTES) -> bytes:
    """The bytes of `path`, a regular file of at most `limit` bytes; else ConfigError.

    Opened without blocking (a FIFO would wait for a writer, forever) and checked on the open
    descriptor (no window between the check and the read); at most `limit` + 1 bytes are read,
    so a file that grows meanwhile costs no more. Error messages name the path and the reason,
    never a byte of the content: the daemon may read files its caller could not.
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    except FileNotFoundError:
        raise ConfigError(f"{what} {path} does not exist") from None
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read it: {exc.strerror}") from None
    try:
        st = os.fstat(fd)
        if stat.S_ISCHR(st.st_mode) and st.st_rdev == _DEV_NULL:
            return b""  # `--config /dev/null`: the usual way to say "no file, defaults"
        if not stat.S_ISREG(st.st_mode):
            kind = next((name for test, name in _FILE_TYPES if test(st.st_mode)),
                        "not a regular file")
            raise ConfigError(f"{what} {path}: is {kind}; expected a regular file")
        if st.st_size > limit:
            raise ConfigError(f"{what} {path}: {st.st_size} bytes, more than the "
                              f"{limit} a configuration file may have")
        data = read_at_most(fd, limit)
        if len(data) > limit:
            raise ConfigError(f"{what} {path}: more than the {limit} bytes a configuration "
                              "file may have")
        return data
    except OSError as exc:
        raise ConfigError(f"{what} {path}: cannot read it: {exc.strerror}") from None
    finally:
        os.close(fd)


def _setting(default: Any, check: Callable[[Any], Any], help: str, env: Optional[str] = None
             ) -> Any:
    return field(default=default, metadata={"check": check, "help": help, "env": env})


def split_listen(value: str) -> tuple[str, int]:
    """'HOST:PORT', '[::1]:PORT' or ':PORT' (all interfaces) -> (host, port)."""
    host, sep, port = value.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError("HOST:PORT with a port from 0 to 65535")
    return host.strip("[]"), int(port)


def _listen(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError("HOST:PORT")
    split_listen(v)
    return v



@frozen_dataclass
class DaemonConfig:
    listen: str = _setting(f":{DEFAULT_PORT}", _listen,
                           "address for /metrics; ':PORT' listens on all interfaces",
                           env="GPUWATCH_LISTEN")
    interval: float = _setting(2.0, positive_seconds, "seconds between polls",
                               env="GPUWATCH_INTERVAL")
    runtime_dir: Path = _setting(Path(DEFAULT_RUNTIME_DIR), path,
                                 f"{SOCKET_NAME} and state.sock live here",
                                 env=RUNTIME_DIR_VARIABLE)
    state_dir: Path = _setting(Path("/var/lib/gpuwatch"), path,
                               "the reaper's audit log lives here", env="GPUWATCH_STATE_DIR")
    log_format: str = _setting("text", one_of("text", "json"), "text or json",
                               env="GPUWATCH_LOG_FORMAT")
    log_level: str = _setting("info", one_of("debug", "info", "warning", "error"),
                              "log threshold", env="GPUWATCH_LOG_LEVEL")
    nvml_retry_max: float = _setting(60.0, positive_seconds,
                                     "longest wait between NVML re-initialisation attempts")
    state_socket_group: str = _setting("gpuwatch", str,
                                       "group allowed to read state.sock besides root")
    node_name: str = _setting(
        "", str, "the node's name in metrics (gpuwatch_node_info), alerts and `status`; empty: "
        "the hostname (on Kubernetes, set it from the downward API's spec.nodeName)",
        env="GPUWATCH_NODE_NAME")
    web_config: str = _setting(
        "", str, "web configuration file (exporter-toolkit format: TLS, basic auth) for "
        "/metrics; empty: plain HTTP, no authentication", env="GPUWATCH_WEB_CONFIG")


@frozen_dataclass
class ExporterConfig:
    max_process_series: int = _setting(
        1000, positive_int,
        "most processes with per-process series; the rest are dropped and counted")


@frozen_dataclass
class HistoryConfig:
    samples: int = _setting(
        300, positive_int, "samples kept per process, spread over 1.5 x "
        "detectors.leak_min_span_seconds whatever the interval (every poll's where that is "
        "longer)")
    max_processes: int = _setting(
        4096, positive_int, "processes with history, shared by user (max-min fair); within a "
        "user's share its GPU holders are kept first, then the most recently seen")


@frozen_dataclass
class DetectorConfig:
    leftover_grace: float = _setting(
        60.0, non_negative_seconds,
        "seconds a job member may outlive the job's last trainer before it is a leftover")
    zombie_grace: float = _setting(
        10.0, non_negative_seconds, "seconds a process may stay defunct before it is a zombie")
    unkillable_after: float = _setting(
        60.0, positive_seconds,
        "seconds in uninterruptible sleep (D) before a process is unkillable")
    min_age: float = _setting(
        10.0, non_negative_seconds,
        "a process younger than this is never an orphan from environment evidence alone")
    ghost_min_bytes: int = _setting(
        1 << 30, positive_int,
        "used GPU memory no process accounts for, above which a GPU has a ghost finding")
    ghost_grace: float = _setting(
        10.0, non_negative_seconds,
        "seconds GPU memory must stay unaccounted for (or a PID listed by NVML stay absent "
        "from /proc) before it is a ghost: a process exiting mid-poll leaves one for a poll")
    protected_names: tuple[str, ...] = _setting(
        ("nvidia-persistenced", "nv-hostengine", "nvidia-fabricmanager", "dcgm-exporter",
         "Xorg", "Xwayland", "gnome-shell", "gpuwatch"), names,
        "file names of programs never reported (nor reaped): a process of root's is protected "
        "when the file it runs (/proc/PID/exe) has this name and is root's (it and every "
        "directory above it owned by root, writable by no one else); its comm and command line "
        "never count")
    protected_executables: tuple[str, ...] = _setting(
        (), absolute_paths,
        "absolute paths of programs never reported (nor reaped): a process of root's is "
        "protected when it runs the file at this path and that file is root's (as for "
        "protected_names)")
    protected_units: tuple[str, ...] = _setting(
        ("nvidia-persistenced.service", "nvidia-fabricmanager.service", "nvidia-dcgm.service",
         "dcgm.service", "dcgm-exporter.service", "display-manager.service", "gdm.service",
         "gpuwatch.service"), unit_names,
        "systemd system units whose processes are never reported (nor reaped), from their "
        "cgroup (\"nvidia-persistenced.service\"); a user's own units never count")
    protected_users: tuple[str, ...] = _setting(
        (), names, "users whose processes are never reported (nor reaped), by real uid")
    stall_after: float = _setting(
        600.0, positive_seconds,
        "seconds an instrumented process holding GPU memory may stay on one step")
    leak_warmup_steps: int = _setting(
        10, non_negative_int, "steps ignored at the start of a run (allocations, caches, CoW)")
    leak_window: int = _setting(64, positive_int, "newest step reports the leak test looks at")
    leak_min_points: int = _setting(
        8, positive_int, "step reports after warm-up needed before a leak can be called")
    leak_min_bytes_per_step: int = _setting(
        1 << 20, positive_int, "growth per step below which nothing is a leak")
    leak_min_relative: float = _setting(
        0.001, non_negative_float,
        "growth per step below this share of the current size is no leak")
    leak_warmup_seconds: float = _setting(
        300.0, non_negative_seconds,
        "without an agent: seconds of a process's life ignored by the leak test")
    leak_min_bytes_per_second: float = _setting(
        64 << 10, positive_float, "without an agent: growth per second below which no leak")
    leak_min_span_seconds: float = _setting(
        600.0, positive_seconds, "without an agent: shortest stretch of time to call a leak on")
    host_memory_limit_bytes: int = _setting(
        0, non_negative_int,
        "a host-memory limit per process to project leaks against when no cgroup sets one "
        "(0: the node's MemAvailable)")

    def for_single_poll(self) -> DetectorConfig:
        """One look at the node (a one-shot `status`): report what is seen, with no duration
        to wait for; what needs time (leftovers, unkillable) cannot show in one poll anyway."""
        return replace(self, zombie_grace=0.0, min_age=0.0, ghost_grace=0.0)


@frozen_dataclass
class ReaperConfig:
    grace: float = _setting(10.0, non_negative_seconds,
                            "seconds between SIGTERM and SIGKILL")
    allow_other_users: bool = _setting(
        True, boolean, "with CAP_KILL (root, or the unit's gpuwatch account), signal other users' "
        "processes (without CAP_KILL the reaper never does)")
    auto: bool = _setting(False, boolean, "the daemon reaps on its own (off by default)")
    auto_kinds: tuple[Kind, ...] = _setting((Kind.ORPHAN,), kinds,
                                           "finding kinds the daemon may reap on its own")
    auto_after: float = _setting(
        300.0, non_negative_seconds,
        "seconds a finding must stay open before the daemon reaps it on its own")
    auto_max_per_minute: int = _setting(10, positive_int,
                                        "most processes the daemon reaps on its own a minute")


@frozen_dataclass
class AgentConfig:
    tracing: bool = _setting(
        True, boolean, "ask instrumented processes whose leak has no culprit to trace their "
        "allocations (tracemalloc, for agent.trace_steps steps)", env="GPUWATCH_AGENT_TRACING")
    trace_after: float = _setting(
        0.0, non_negative_seconds,
        "seconds a leak must stay without a watched or discovered culprit before its process is "
        "asked to trace (0: as soon as the leak is raised)")
    search_seconds: int = _setting(
        60, int_between(0, MAX_SEARCH_SECONDS),
        "seconds an instrumented process whose leak has no culprit is asked to search for "
        "growing containers at a higher share of its time (0: never asked)")
    trace_steps: int = _setting(10, int_between(1, MAX_TRACE_STEPS),
                                "training steps a process is asked to trace, 1 to 100")
    trace_cooldown: float = _setting(
        900.0, non_negative_seconds,
        "seconds before the same process is asked to trace again; also how long a request "
        "may go unanswered")
    trace_max_pending: int = _setting(
        4, positive_int, "most trace requests awaiting an answer on the node at once")
    max_processes: int = _setting(
        1024, positive_int,
        "most reporting processes the daemon keeps state for; when all slots are taken, a "
        "user holding fewer than max_processes / users takes one from the user holding most")
    memory_budget: int = _setting(
        64 << 20, positive_int,
        "bytes of state that agent reports may make the daemon keep (receiver, pending points, "
        "step history), shared by the users holding some: past it, a user at its share is "
        "refused and those above their share give back")
    max_reports_per_second: int = _setting(
        20_000, positive_int,
        "agent reports a second the daemon accepts, shared by the users sending; a process "
        "may always send 50")
    max_series_per_user: int = _setting(
        2000, positive_int,
        "most /metrics series that instrumented processes of one user get (agent step and "
        "buffer series, and the process series of those that matter only as reporters)")


@frozen_dataclass
class KubernetesConfig:
    pod_resources_socket: str = _setting(
        "/var/lib/kubelet/pod-resources/kubelet.sock", str,
        "the kubelet's PodResources socket: the pods of the node and the GPUs each container "
        "was allocated (needs grpcio: the kubernetes extra); empty: not asked",
        env="GPUWATCH_POD_RESOURCES_SOCKET")
    pod_logs_dir: str = _setting(
        "/var/log/pods", str, "the kubelet's pod log directories (NAMESPACE_NAME_UID): which "
        "pod a UID is; empty: not read")
    runtime_dirs: tuple[str, ...] = _setting(
        ("/run/containerd/io.containerd.runtime.v2.task/k8s.io",
         "/run/containers/storage/overlay-containers"), absolute_paths,
        "where the container runtimes keep each container's OCI config.json (containerd, "
        "CRI-O), whose annotations name its pod and container")
    refresh: float = _setting(
        5.0, positive_seconds, "seconds between two reads of the pods (a pod not known yet "
        "is looked for at once, off the poll loop)")
    timeout: float = _setting(
        2.0, positive_seconds, "seconds the kubelet has to answer one call")


@frozen_dataclass
class Config:
    daemon: DaemonConfig = field(default_factory=DaemonConfig)
    exporter: ExporterConfig = field(default_factory=ExporterConfig)
    history: HistoryConfig = field(default_factory=HistoryConfig)
    detectors: DetectorConfig = field(default_factory=DetectorConfig)
    reaper: ReaperConfig = field(default_factory=ReaperConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)


#: The samples history keeps of a process span this many times detectors.leak_min_span_seconds,
#: so that the time-based leak test has its span with room for a window that slides.
SPAN_COVER = 1.5


def sample_spacing(config: Config) -> float:
    """The least seconds between two samples history keeps of a process: history.samples of
    them span SPAN_COVER x detectors.leak_min_span_seconds, whatever daemon.interval is. At an
    interval longer than this, every poll's sample is kept (and they span more); at a shorter
    one, some polls' are not (the leak test reads a window of leak_window points spread over
    them anyway). Without it, 300 samples at a 1 s interval would span 299 s, and a leak
    needing 600 s could never be called."""
    return (config.detectors.leak_min_span_seconds * SPAN_COVER
            / max(1, config.history.samples - 1))


def _sections() -> dict[str, type]:
    return {f.name: f.default_factory for f in fields(Config)}  # type: ignore[misc]


def _apply(config: Config, section: str, key: str, value: Any, origin: str,
           from_file: bool = False) -> Config:
    """`from_file`: the names are shown only when they are setting names, and values never (a
    file given by mistake may hold what its reader must not show)."""
    sections = _sections()
    if section not in sections:
        shown = f"{shown_name(section, from_file, list(sections))}: unknown section"
        raise ConfigError(f"{shown} ({origin}); known: " + ", ".join(sorted(sections)))
    part = getattr(config, section)
    by_name = {f.name: f for f in fields(part)}
    if key not in by_name:
        shown = f"{section}.{shown_name(key, from_file, list(by_name))}: unknown key"
        raise ConfigError(f"{shown} ({origin}); known in [{section}]: "
                          + ", ".join(sorted(by_name)))
    try:
        normalised = by_name[key].metadata["check"](value)
    except ValueError as exc:
        got = _shown_value(value) if from_file else repr(value)
        raise ConfigError(f"{section}.{key}: expected {exc}, got {got} ({origin})") from None
    return replace(config, **{section: replace(part, **{key: normalised})})


def load_config(path: Optional[Path] = None,
                environ: Optional[Mapping[str, str]] = None,
                overrides: Optional[Mapping[str, Any]] = None) -> Config:
    """Build the configuration.

    `path` is the --config flag; without it GPUWATCH_CONFIG, then the default path if it exists.
    `overrides` are command-line flags as {"daemon.interval": 5}; None values are ignored.
    """
    env = os.environ if environ is None else environ
    config = Config()
    explicit = path is not None or "GPUWATCH_CONFIG" in env
    file_path = path or Path(env.get("GPUWATCH_CONFIG", DEFAULT_CONFIG_PATH))
    if explicit or file_path.exists():
        config = _apply_file(config, file_path)
    for section, cls in _sections().items():
        for f in fields(cls):
            name = f.metadata.get("env")
            if name and name in env:
                config = _apply(config, section, f.name, env[name], f"environment {name}")
    for dotted, value in (overrides or {}).items():
        if value is not None:
            section, _, key = dotted.partition(".")
            config = _apply(config, section, key, value, "command line")
    return config


_BARE_NAME = re.compile(r"[A-Za-z0-9_\-]{1,40}")


def shown_name(name: Any, from_file: bool = False, known: Sequence[str] = ()) -> str:
    """A key as an error shows it. From a file, only a typo of one of the `known` names is
    repeated (what the reader looks for); any other key is not, as a file named by mistake is
    all keys (/etc/shadow)."""
    bare = isinstance(name, str) and _BARE_NAME.fullmatch(name)
    if bare and from_file:
        import difflib  # an error's path only: the daemon does not keep it imported

        bare = bool(difflib.get_close_matches(name, known, n=1, cutoff=0.6))
    if bare:
        return str(name)
    return "(a key that is no setting name)" if from_file else repr(str(name)[:64])


def _shown_value(value: Any) -> str:
    """A value from a file as an error shows it: numbers and booleans, not text."""
    if isinstance(value, (bool, int, float)):
        return repr(value)
    if isinstance(value, str):
        return f"a string of {len(value)} characters"
    return f"a {type(value).__name__}"


def _apply_file(config: Config, path: Path) -> Config:
    # Imported where a file is read: a node without one never pays for the parser.
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover - exercised on 3.9/3.10 only
        import tomli as tomllib

    raw = read_config_file(path, "config file")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except tomllib.TOMLDecodeError as exc:
        # tomllib's messages name the problem and its line and column, not the text there.
        raise ConfigError(f"config file {path}: not valid TOML: {exc}") from None
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path}: not UTF-8 text (byte {exc.start}): TOML files "
                          "are UTF-8") from None
    for section, table in data.items():
        if not isinstance(table, dict):
            name = shown_name(section, True, list(_sections()))
            raise ConfigError(f"{name}: expected a [{name}] table, got {_shown_value(table)} "
                              f"({path})")
        for key, value in table.items():
            config = _apply(config, section, key, value, str(path), from_file=True)
    return config


def describe() -> list[tuple[str, Any, str, Optional[str]]]:
    """(key, default, help, environment variable) for every setting, for docs and --help."""
    out = []
    for section, cls in _sections().items():
        for f in fields(cls):
            out.append((f"{section}.{f.name}", f.default, f.metadata["help"],
                        f.metadata.get("env")))
    return out


def _field(key: str) -> Any:
    section, _, name = key.partition(".")
    for f in fields(_sections()[section]):
        if f.name == name:
            return f
    raise KeyError(key)


def setting_default(key: str) -> Any:
    """The default of setting `key` ("daemon.interval"): what --help shows for the flag that
    overrides it."""
    return _field(key).default


def setting_env(key: str) -> Optional[str]:
    """The GPUWATCH_* variable that sets `key`, if any."""
    env = _field(key).metadata.get("env")
    return env if isinstance(env, str) else None
