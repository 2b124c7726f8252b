"""The web configuration file: TLS and basic authentication for /metrics.

The format is the one of Prometheus's exporter-toolkit, which node_exporter and the other
official exporters read with `--web.config.file`, so one file can serve every exporter on a
node:

    tls_server_config:
      cert_file: server.crt          # relative paths are relative to this file
      key_file: server.key
      client_ca_file: clients-ca.crt # with client_auth_type: RequireAndVerifyClientCert
    basic_auth_users:
      prometheus: $2y$10$...         # bcrypt hashes (htpasswd -nBC 10 "" | tr -d ':\\n')

`tls_server_config` takes the toolkit's `min_version`, `max_version`, `cipher_suites`,
`curve_preferences` and `prefer_server_cipher_suites`, with Go's names (crypto/tls), which are
mapped to OpenSSL's. Without `cipher_suites`, TLS 1.2 offers ECDHE with AEAD ciphers only (forward
secrecy, no CBC or SHA-1); TLS 1.3's suites are all of that kind and are not configurable, in Go
as here.

Unknown keys and names are errors, as there. The file, and the certificate, key and CA files it
names, are re-read when they change (checked at most once a second, when a connection arrives),
so renewed certificates are picked up without a restart; a changed file with an error is refused
with a log line and the running settings kept. PyYAML and bcrypt are imported only when a file
is given.
"""

from __future__ import annotations

import collections
import difflib
import hashlib
import logging
import re
import ssl
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

from gpuwatch.config import ConfigError, read_config_file
from gpuwatch.forwarded import Forwarded
from gpuwatch.serve.tls import (
    CIPHER_SUITES,
    CLIENT_AUTH,
    CURVES,
    INSECURE_CIPHER_SUITES,
    TLS13_CIPHER_SUITES,
    TLS_VERSIONS,
    UNVERIFIED_CLIENT_AUTH,
    TlsSettings,
    normal_san,
    ssl_context,
)
from gpuwatch.units import parse_duration

log = logging.getLogger(__name__)

#: The response headers the file may set, with the values allowed where the toolkit limits them.
HEADERS: dict[str, tuple[str, ...]] = {
    "Strict-Transport-Security": (),
    "X-Content-Type-Options": ("nosniff",),
    "X-Frame-Options": ("deny", "sameorigin"),
    "X-XSS-Protection": (),
    "Content-Security-Policy": (),
}
_TLS_KEYS = ("cert_file", "key_file", "client_ca_file", "client_ca", "client_auth_type",
             "client_allowed_sans", "min_version", "max_version", "prefer_server_cipher_suites",
             "cert", "key", "cipher_suites", "curve_preferences")
_BCRYPT = re.compile(r"\$2[aby]?\$(\d\d)\$[./A-Za-z0-9]{53}")
#: Compared against when the user is unknown, so that timing does not tell which users exist.
_DECOY_HASH = b"$2b$10$rxLw5QyE9ktJuecC2GwUdOnKvu4/g0ZuKdNrb07CfWew5nNGdc//e"
_CHECK_EVERY = 1.0
_CACHE_GOOD = 16
_CACHE_BAD = 256
#: Password checks one peer (an IP address) may have the daemon make without a success: a burst,
#: refilled at a rate. A scraper with the right password fails none; one with a wrong one fails
#: once a scrape, far below the rate. Beyond it, that peer's unknown credentials are answered 429
#: without a check (known-good ones still pass: they cost no check).
FAILED_CHECKS_BURST = 8
FAILED_CHECKS_PER_SECOND = 0.5
#: Password checks queued at once, all peers together: beyond it 429, without a check. At ~60 ms
#: a check, the last of them is decided within about 2 s.
MAX_PENDING_CHECKS = 32
_PEERS_KEPT = 4096


@dataclass(frozen=True)
class WebConfig:
    path: Path
    tls: Optional[TlsSettings] = None
    users: Mapping[str, bytes] = field(default_factory=dict)
    headers: tuple[tuple[str, str], ...] = ()
    #: (seconds between requests, burst), or None
    rate_limit: Optional[tuple[float, int]] = None

    def files(self) -> tuple[Path, ...]:
        """The file itself and the files it names: a change to any is a reload."""
        named = () if self.tls is None else tuple(
            p for p in (self.tls.cert_file, self.tls.key_file, self.tls.client_ca_file)
            if p is not None)
        return (self.path, *named)


def load_web_config(path: Path) -> WebConfig:
    """Read and check the file; raises ConfigError naming the key."""
    where = f"daemon.web_config {path}"
    try:  # the `web` extra; bcrypt is checked here too, not at the first scrape
        import bcrypt  # noqa: F401
        import yaml
    except ImportError as exc:
        raise ConfigError(f"{where}: a web config needs the `web` extra, and {exc.name} is not "
                          "installed: pip install 'gpuwatch[web]'") from None
    raw_bytes = read_config_file(path, "daemon.web_config")
    try:
        text = raw_bytes.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ConfigError(f"{where}: not UTF-8 text (byte {exc.start})") from None
    try:
        raw = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{where}: not valid YAML: {_yaml_problem(exc)}") from None
    if raw is None:
        raw = {}
    doc = _mapping(raw, where, "the file")
    _known(doc, ("tls_server_config", "http_server_config", "basic_auth_users", "rate_limit"),
           where, "")
    base = path.parent
    tls = _tls(doc.get("tls_server_config"), base, where)
    users: dict[str, bytes] = {}
    for name, hashed in _mapping(doc.get("basic_auth_users") or {}, where,
                                 "basic_auth_users").items():
        key = f"basic_auth_users.{name if isinstance(name, str) and len(name) <= 64 else '?'}"
        if not isinstance(name, str) or not name:
            raise ConfigError(f"{where}: basic_auth_users: user names must be strings, "
                              f"got a {type(name).__name__}")
        if not isinstance(hashed, str) or not _BCRYPT.fullmatch(hashed) or \
                not 4 <= int(hashed.split("$")[2]) <= 31:
            raise ConfigError(f"{where}: {key}: expected a bcrypt hash ($2y$10$ and 53 more "
                              "characters: htpasswd -nBC 10 \"\" | tr -d ':\\n'), not a "
                              "password")
        users[name] = hashed.encode()
    headers = []
    http = _mapping(doc.get("http_server_config") or {}, where, "http_server_config")
    _known(http, ("http2", "headers"), where, "http_server_config.")
    if not isinstance(http.get("http2", True), bool):
        raise ConfigError(f"{where}: http_server_config.http2: expected true or false")
    for name, value in _mapping(http.get("headers") or {}, where,
                                "http_server_config.headers").items():
        if name not in HEADERS:
            raise ConfigError(f"{where}: http_server_config.headers: a header that cannot be "
                              "set; the ones that can: " + ", ".join(HEADERS))
        key = f"http_server_config.headers.{name}"
        if not isinstance(value, str) or "\n" in value or "\r" in value:
            raise ConfigError(f"{where}: {key}: expected a one-line string")
        if HEADERS[name] and value not in HEADERS[name]:
            raise ConfigError(f"{where}: {key}: expected one of {', '.join(HEADERS[name])}")
        if value:
            headers.append((name, value))
    return WebConfig(path=path, tls=tls, users=users, headers=tuple(headers),
                     rate_limit=_rate_limit(doc.get("rate_limit"), where))


def _yaml_problem(exc: Exception) -> str:
    """What is wrong and where, without the text there (PyYAML quotes the offending line, and
    the file may be one the daemon can read and its reader cannot)."""
    problem = getattr(exc, "problem", None) or "a syntax error"
    problem = re.sub(r"'[^']*'|\"[^\"]*\"", "a character", str(problem))
    mark = getattr(exc, "problem_mark", None)
    if mark is None:
        return problem
    return f"{problem} (line {mark.line + 1}, column {mark.column + 1})"


def _mapping(value: Any, where: str, key: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise ConfigError(f"{where}: {key}: expected a mapping of keys to values")
    return value


def _known(doc: Mapping[Any, Any], keys: tuple[str, ...], where: str, prefix: str) -> None:
    """Unknown keys are errors; the message suggests the known key it is closest to, and does
    not repeat the unknown one (a file named by mistake, /etc/shadow, is all "keys")."""
    for key in doc:
        if key not in keys:
            close = difflib.get_close_matches(str(key)[:64], keys, n=1, cutoff=0.6)
            hint = f" (did you mean {prefix}{close[0]}?)" if close else ""
            raise ConfigError(f"{where}: {prefix.rstrip('.') or 'the file'}: an unknown key"
                              f"{hint}; known: " + ", ".join(keys))


def _tls(raw: Any, base: Path, where: str) -> Optional[TlsSettings]:
    if raw is None:
        return None
    doc = _mapping(raw, where, "tls_server_config")
    _known(doc, _TLS_KEYS, where, "tls_server_config.")
    if not doc:
        return None

    def key(k: str) -> str:
        return f"{where}: tls_server_config.{k}"

    for inline in ("cert", "key"):
        if inline in doc:
            raise ConfigError(f"{key(inline)}: inline certificates and keys are not supported; "
                              f"name a file with {inline}_file")

    def path(k: str) -> Optional[Path]:
        v = doc.get(k)
        if v is None or v == "":
            return None
        if not isinstance(v, str):
            raise ConfigError(f"{key(k)}: expected a file name")
        return base / v  # an absolute path stays as it is

    cert, private = path("cert_file"), path("key_file")
    if cert is None or private is None:
        raise ConfigError(f"{key('cert_file' if cert is None else 'key_file')}: required "
                          "(with cert_file or key_file, both are)")
    auth = doc.get("client_auth_type") or "NoClientCert"
    if not isinstance(auth, str):
        raise ConfigError(f"{key('client_auth_type')}: expected one of {', '.join(CLIENT_AUTH)}")
    if auth in UNVERIFIED_CLIENT_AUTH:  # one of a few known names: safe to show
        raise ConfigError(f"{key('client_auth_type')}: {auth} accepts client certificates "
                          "nobody verified and is not supported; use "
                          "RequireAndVerifyClientCert with client_ca_file")
    if auth not in CLIENT_AUTH:
        raise ConfigError(f"{key('client_auth_type')}: expected one of "
                          f"{', '.join(CLIENT_AUTH)}")
    ca_file, ca_text = path("client_ca_file"), doc.get("client_ca")
    if ca_text is not None and not isinstance(ca_text, str):
        raise ConfigError(f"{key('client_ca')}: expected PEM text")
    has_ca = ca_file is not None or bool(ca_text)
    if has_ca and auth == "NoClientCert":
        raise ConfigError(f"{key('client_ca_file')}: a client CA without a client_auth_type "
                          "(RequireAndVerifyClientCert, or VerifyClientCertIfGiven)")
    if not has_ca and auth != "NoClientCert":
        raise ConfigError(f"{key('client_auth_type')}: {auth} needs client_ca_file, the CA "
                          "that signs client certificates")
    sans = doc.get("client_allowed_sans") or []
    if not isinstance(sans, list) or not all(isinstance(s, str) for s in sans):
        raise ConfigError(f"{key('client_allowed_sans')}: expected a list of names")
    if sans and auth != "RequireAndVerifyClientCert":
        raise ConfigError(f"{key('client_allowed_sans')}: needs client_auth_type "
                          "RequireAndVerifyClientCert")
    versions = {}
    for k, default in (("min_version", "TLS12"), ("max_version", "TLS13")):
        v = doc.get(k) or default
        if v not in TLS_VERSIONS:
            raise ConfigError(f"{key(k)}: expected one of {', '.join(TLS_VERSIONS)}")
        versions[k] = v
    if TLS_VERSIONS[versions["min_version"]] > TLS_VERSIONS[versions["max_version"]]:
        raise ConfigError(f"{key('min_version')}: above max_version")
    prefer = doc.get("prefer_server_cipher_suites", True)
    if not isinstance(prefer, bool):
        raise ConfigError(f"{key('prefer_server_cipher_suites')}: expected true or false")
    suites = _names(doc.get("cipher_suites"), (*CIPHER_SUITES, *TLS13_CIPHER_SUITES),
                    key("cipher_suites"), "a cipher suite's Go name, as "
                    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256")
    if suites and not any(s in CIPHER_SUITES for s in suites) \
            and TLS_VERSIONS[versions["min_version"]] < ssl.TLSVersion.TLSv1_3:
        raise ConfigError(f"{key('cipher_suites')}: names TLS 1.3 suites only, which cannot be "
                          "chosen: TLS 1.2 would have no suite; name a TLS 1.2 one, or set "
                          "min_version: TLS13")
    curves = _names(doc.get("curve_preferences"), tuple(CURVES), key("curve_preferences"),
                    "one of " + ", ".join(CURVES))
    return TlsSettings(cert_file=cert, key_file=private, client_auth_type=auth,
                       client_ca_file=ca_file, client_ca=ca_text or None,
                       client_allowed_sans=tuple(normal_san(s) for s in sans),
                       min_version=versions["min_version"],
                       max_version=versions["max_version"],
                       prefer_server_cipher_suites=prefer, cipher_suites=suites,
                       curve_preferences=curves)


def _names(raw: Any, known: tuple[str, ...], where: str, what: str) -> tuple[str, ...]:
    """A list of names from `known`; a ConfigError naming the key (and the name, when it is
    short enough to be one) otherwise."""
    if raw is None:
        return ()
    if not isinstance(raw, list) or not all(isinstance(v, str) for v in raw):
        raise ConfigError(f"{where}: expected a list of names ({what})")
    for name in raw:
        if name in INSECURE_CIPHER_SUITES:
            raise ConfigError(f"{where}: {name} is one of Go's insecure suites (RC4, 3DES, CBC "
                              "with SHA-256), which the exporter toolkit refuses too")
        if name not in known:
            shown = repr(name) if len(name) <= 64 and name.isprintable() else "a name"
            close = difflib.get_close_matches(name[:64], known, n=1, cutoff=0.8)
            hint = f" (did you mean {close[0]}?)" if close else ""
            raise ConfigError(f"{where}: {shown} is not {what}{hint}")
    return tuple(dict.fromkeys(raw))


def _rate_limit(raw: Any, where: str) -> Optional[tuple[float, int]]:
    if raw is None:
        return None
    doc = _mapping(raw, where, "rate_limit")
    _known(doc, ("interval", "burst"), where, "rate_limit.")
    interval = doc.get("interval", 0)
    try:
        seconds = parse_duration(interval) if isinstance(interval, str) else float(interval)
    except (TypeError, ValueError):
        seconds = -1.0
    if isinstance(interval, bool) or not 0 <= seconds < float("inf"):
        raise ConfigError(f"{where}: rate_limit.interval: expected a duration (\"1s\", "
                          "\"100ms\"; 0 turns the limit off)")
    burst = doc.get("burst", 0)
    if seconds > 0 and (isinstance(burst, bool) or not isinstance(burst, int) or burst < 1):
        raise ConfigError(f"{where}: rate_limit.burst: expected an integer >= 1 (with 0, "
                          "every request would be refused)")
    return (seconds, burst) if seconds > 0 else None


class WebSettings:
    """The web configuration in force for one listener: TLS context, users, headers, rate."""

    def __init__(self, path: Path) -> None:
        path = path.absolute()  # what the log names, and what a reload reads, whatever the cwd
        self.path = path
        self.config = load_web_config(path)
        self._context = ssl_context(self.config.tls) if self.config.tls else None
        self._signature = _signature(self.config.files())
        self._checked = time.monotonic()
        self._refused: Optional[tuple[Any, ...]] = None
        self._lock = threading.Lock()
        self._good: collections.OrderedDict[bytes, bool] = collections.OrderedDict()
        self._bad: collections.OrderedDict[bytes, bool] = collections.OrderedDict()
        self._bcrypt = threading.Lock()
        #: peer -> (failed checks it may still make, when that was computed)
        self._peers: collections.OrderedDict[str, tuple[float, float]] = \
            collections.OrderedDict()
        self._pending = 0
        self._tokens = 0.0
        self._filled = time.monotonic()
        if self.config.rate_limit is not None:
            self._tokens = float(self.config.rate_limit[1])

    @property
    def tls(self) -> bool:
        """Fixed for the listener's life: switching between http and https takes a restart."""
        return self._context is not None

    # -- reloading ---------------------------------------------------------------------------
    def refresh(self) -> None:
        """Re-read the file if it or a file it names changed (at most once a second)."""
        now = time.monotonic()
        if now - self._checked < _CHECK_EVERY:
            return
        self._checked = now
        signature = _signature(self.config.files())
        if signature == self._signature or signature == self._refused:
            return
        try:
            config = load_web_config(self.path)
            context = ssl_context(config.tls) if config.tls else None
            if (context is None) != (self._context is None):
                raise ConfigError(f"daemon.web_config {self.path}: tls_server_config was "
                                  f"{'removed' if self._context else 'added'}; switching "
                                  "between http and https takes a restart")
        except ConfigError as exc:
            if signature != self._refused:
                log.error("web configuration change refused, keeping the running one: %s", exc)
            self._refused = signature
            return
        with self._lock:
            # The verdicts stay: each is keyed by the user's hash as well as the password, so a
            # changed or removed user's no longer match, and a renewed certificate or an edit of
            # anything else keeps the scraper's good credentials answered from memory.
            self.config, self._context = config, context
        # What the new file names may differ: compare against its own files from now on.
        self._signature = _signature(config.files())
        self._refused = None
        log.info("web configuration reloaded from %s", self.path)

    def tls_context(self) -> Optional[ssl.SSLContext]:
        self.refresh()
        return self._context

    # -- TLS peers ---------------------------------------------------------------------------
    def refuse_peer(self, sock: ssl.SSLSocket) -> Optional[str]:
        """Why the client certificate is not accepted (client_allowed_sans), or None."""
        tls = self.config.tls
        if tls is None or not tls.client_allowed_sans:
            return None
        cert = sock.getpeercert() or {}
        names = {normal_san(str(v)) for _, v in cert.get("subjectAltName", ())}
        if names & set(tls.client_allowed_sans):
            return None
        return f"client certificate names none of client_allowed_sans ({sorted(names)})"

    # -- basic auth --------------------------------------------------------------------------
    users = Forwarded[Mapping[str, bytes]]("config")

    def _key(self, user: str, password: bytes) -> tuple[bytes, bytes]:
        hashed = self.config.users.get(user, _DECOY_HASH)
        key = hashlib.sha256(b"\0".join((user.encode(), hashed, password))).digest()
        return key, hashed

    def known(self, user: str, password: bytes) -> Optional[bool]:
        """The cached verdict for these credentials, or None if bcrypt must decide."""
        key, _ = self._key(user, password)
        with self._lock:
            if key in self._good:
                self._good.move_to_end(key)
                return True
            if key in self._bad:
                return False
        return None

    def may_check(self, peer: str) -> bool:
        """Whether a password check for `peer` may be queued now; takes one of its failed
        checks (given back if the password is right) and a place in the queue."""
        now = time.monotonic()
        with self._lock:
            if self._pending >= MAX_PENDING_CHECKS:
                return False
            left, then = self._peers.pop(peer, (float(FAILED_CHECKS_BURST), now))
            left = min(float(FAILED_CHECKS_BURST),
                       left + (now - then) * FAILED_CHECKS_PER_SECOND)
            allowed = left >= 1
            self._peers[peer] = (left - 1 if allowed else left, now)
            while len(self._peers) > _PEERS_KEPT:
                self._peers.popitem(last=False)
            if allowed:
                self._pending += 1
            return allowed

    def note_failure(self, peer: str) -> None:
        """A failure decided without a check (a known-bad password): it counts all the same."""
        now = time.monotonic()
        with self._lock:
            left, then = self._peers.pop(peer, (float(FAILED_CHECKS_BURST), now))
            left = min(float(FAILED_CHECKS_BURST),
                       left + (now - then) * FAILED_CHECKS_PER_SECOND)
            self._peers[peer] = (max(0.0, left - 1), now)
            while len(self._peers) > _PEERS_KEPT:
                self._peers.popitem(last=False)

    def suspect(self, peer: str) -> bool:
        """Whether `peer` failed a check lately: its checks then wait behind everyone else's."""
        with self._lock:
            entry = self._peers.get(peer)
        if entry is None:
            return False
        left = entry[0] + (time.monotonic() - entry[1]) * FAILED_CHECKS_PER_SECOND
        return left < FAILED_CHECKS_BURST - 1

    def checked(self, peer: str, user: str, password: bytes) -> bool:
        """check(), for a check may_check() let through."""
        try:
            good = self.check(user, password)
        finally:
            with self._lock:
                self._pending -= 1
        if good:
            with self._lock:
                left, then = self._peers.get(peer, (0.0, time.monotonic()))
                self._peers[peer] = (min(float(FAILED_CHECKS_BURST), left + 1), then)
        return good

    def check(self, user: str, password: bytes) -> bool:
        """bcrypt decides, one check at a time (tens of ms of CPU each); the verdict is cached.

        Failures have their own cache: a flood of wrong passwords evicts only other wrong
        passwords, never the scraper's good one."""
        import bcrypt

        key, hashed = self._key(user, password)
        with self._bcrypt:
            try:
                good = bcrypt.checkpw(password, hashed) and user in self.config.users
            except ValueError:
                good = False
        with self._lock:
            cache, size = (self._good, _CACHE_GOOD) if good else (self._bad, _CACHE_BAD)
            cache[key] = good
            while len(cache) > size:
                cache.popitem(last=False)
        return good

    # -- rate limit --------------------------------------------------------------------------
    def allow(self) -> bool:
        """A token bucket, as the toolkit's `rate_limit` (interval between requests, burst)."""
        limit = self.config.rate_limit
        if limit is None:
            return True
        interval, burst = limit
        now = time.monotonic()
        self._tokens = min(float(burst), self._tokens + (now - self._filled) / interval)
        self._filled = now
        if self._tokens >= 1:
            self._tokens -= 1
            return True
        return False


def _signature(files: tuple[Path, ...]) -> tuple[Any, ...]:
    out: list[Any] = []
    for path in files:
        try:
            st = path.stat()
            out.append((str(path), st.st_ino, st.st_size, st.st_mtime_ns))
        except OSError as exc:
            out.append((str(path), exc.errno))
    return tuple(out)
