"""/metrics over TLS with basic authentication, from a web config file in exporter-toolkit's
format: the file's checks, the server in process, and a real Prometheus scraping a real daemon.

Certificates come from the `openssl` command (a test CA, a server certificate for 127.0.0.1 and
localhost, a client certificate); without it these tests skip.
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import json
import logging
import os
import re
import shutil
import socket
import ssl
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import bcrypt
import pytest
from prometheus_client import CollectorRegistry, Counter

from gpuwatch.config import EXIT_CONFIG, ConfigError
from gpuwatch.serve.http_server import MetricsServer, bind_tcp
from gpuwatch.serve.listener import ConnectionStats
from gpuwatch.serve.web_config import WebSettings, load_web_config
from gpuwatch.simulate.demo import wait_for
from tests.daemonproc import running_daemon
from tests.promserver import api, needs_prometheus, prometheus_scraping
from tests.realprocs import gpuwatch

needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None,
                                   reason="the openssl command makes the test certificates")
PASSWORD = "correct horse battery staple"
#: Cost 4, the lowest bcrypt takes: the tests check the logic, not the cost.
HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(4)).decode()


@dataclass
class Pki:
    dir: Path
    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    subprocess.run(["openssl", *args], cwd=cwd, check=True, capture_output=True)


def issue(dir: Path, name: str, subject: str, ext: str, serial: int) -> None:
    """`name`.key and `name`.crt signed by the CA in `dir`."""
    _openssl("req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", subject, cwd=dir)
    (dir / f"{name}.ext").write_text(ext)
    _openssl("x509", "-req", "-in", f"{name}.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
             "-set_serial", str(serial), "-days", "2", "-out", f"{name}.crt",
             "-extfile", f"{name}.ext", cwd=dir)


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    if shutil.which("openssl") is None:
        pytest.skip("the openssl command makes the test certificates")
    d = tmp_path_factory.mktemp("pki")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
             "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=gpuwatch test CA",
             "-addext", "basicConstraints=critical,CA:TRUE",
             "-addext", "keyUsage=critical,keyCertSign", cwd=d)
    issue(d, "server", "/CN=localhost",
          "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n", 1)
    issue(d, "client", "/CN=prometheus",
          "subjectAltName=DNS:prometheus.example\nextendedKeyUsage=clientAuth\n", 2)
    return Pki(d, d / "ca.crt", d / "server.crt", d / "server.key", d / "client.crt",
               d / "client.key")


def web_file(dir: Path, text: str, name: str = "web.yml") -> Path:
    path = dir / name
    path.write_text(text)
    return path


def tls_and_auth(pki: Pki, extra_tls: str = "") -> str:
    return (f"tls_server_config:\n  cert_file: {pki.server_cert}\n  key_file: {pki.server_key}\n"
            f"{extra_tls}basic_auth_users:\n  prometheus: {HASH}\n")


# -- the file ------------------------------------------------------------------------------------
@needs_openssl
@pytest.mark.parametrize(("text", "names"), [
    ("tls_server_config:\n  cert_file: s.crt\n  key_file: s.key\n  cipher: x\n",
     "tls_server_config: an unknown key"),
    ("tls_config:\n  cert_file: s.crt\n",
     "the file: an unknown key (did you mean tls_server_config?)"),
    ("tls_server_config:\n  cert_file: s.crt\n", "tls_server_config.key_file: required"),
    ("tls_server_config:\n  cert_file: s.crt\n  key_file: s.key\n  client_auth_type: Maybe\n",
     "client_auth_type: expected one of NoClientCert"),
    ("tls_server_config:\n  cert_file: s.crt\n  key_file: s.key\n"
     "  client_auth_type: RequireAnyClientCert\n  client_ca_file: ca.crt\n",
     "RequireAnyClientCert accepts client certificates nobody verified"),
    ("tls_server_config:\n  cert_file: s.crt\n  key_file: s.key\n  client_ca_file: ca.crt\n",
     "client_ca_file: a client CA without a client_auth_type"),
    ("tls_server_config:\n  cert_file: s.crt\n  key_file: s.key\n"
     "  client_auth_type: RequireAndVerifyClientCert\n",
     "RequireAndVerifyClientCert needs client_ca_file"),
    ("tls_server_config:\n  cert_file: s.crt\n  key_file: s.key\n  min_version: TLS14\n",
     "min_version: expected one of TLS10"),
    ("tls_server_config:\n  cert: '-----BEGIN CERTIFICATE-----'\n  key_file: s.key\n",
     "tls_server_config.cert: inline certificates"),
    ("basic_auth_users:\n  alice: hunter2\n", "basic_auth_users.alice: expected a bcrypt hash"),
    ("http_server_config:\n  headers:\n    Server: x\n",
     "http_server_config.headers: a header that cannot be set"),
    ("http_server_config:\n  headers:\n    X-Frame-Options: allow\n",
     "X-Frame-Options: expected one of deny, sameorigin"),
    ("rate_limit:\n  interval: 1s\n  burst: 0\n", "rate_limit.burst: expected an integer >= 1"),
    ("basic_auth_users: [alice]\n", "basic_auth_users: expected a mapping"),
    ("tls_server_config: {cert_file: [\n", "not valid YAML"),
])
def test_a_bad_web_config_is_refused_naming_the_key(tmp_path: Path, text: str,
                                                      names: str) -> None:
    path = web_file(tmp_path, text)
    with pytest.raises(ConfigError) as err:
        load_web_config(path)
    assert names in str(err.value)
    assert str(path) in str(err.value)


def test_an_empty_web_config_means_plain_http_and_relative_paths_follow_the_file(
        tmp_path: Path) -> None:
    assert load_web_config(web_file(tmp_path, "")).tls is None
    cfg = load_web_config(web_file(tmp_path, "tls_server_config:\n  cert_file: certs/s.crt\n"
                                   "  key_file: /abs/s.key\n"))
    assert cfg.tls is not None
    assert cfg.tls.cert_file == tmp_path / "certs/s.crt"
    assert cfg.tls.key_file == Path("/abs/s.key")
    assert cfg.tls.min_version == "TLS12"


def test_the_documented_example_is_a_valid_web_config(tmp_path: Path) -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "web.md").read_text()
    example = doc.split("```yaml\n# /etc/gpuwatch/web.yml\n", 1)[1].split("```", 1)[0]
    cfg = load_web_config(web_file(tmp_path, example))
    assert cfg.tls is not None and cfg.tls.cert_file == Path("/etc/gpuwatch/tls/node.crt")
    assert list(cfg.users) == ["prometheus"]


@needs_openssl
def test_a_key_that_does_not_load_is_refused(pki: Pki, tmp_path: Path) -> None:
    path = web_file(tmp_path, f"tls_server_config:\n  cert_file: {pki.server_cert}\n"
                              f"  key_file: {pki.client_key}\n")
    with pytest.raises(ConfigError, match="cannot load cert_file"):
        WebSettings(path)


# -- the server in process -----------------------------------------------------------------------
@contextlib.contextmanager
def serving(web: WebSettings, **limits: Any) -> Iterator[MetricsServer]:
    registry = CollectorRegistry()
    Counter("tls_test_scrapes", "A counter for the test.", registry=registry).inc()
    server = MetricsServer(bind_tcp("127.0.0.1", 0), registry, ConnectionStats(), web, **limits)
    server.start()
    try:
        yield server
    finally:
        server.stop()


def client_context(pki: Pki, cert: bool = False) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=str(pki.ca))
    if cert:
        ctx.load_cert_chain(str(pki.client_cert), str(pki.client_key))
    return ctx


def get(url: str, ctx: Optional[ssl.SSLContext] = None, user: Optional[str] = None,
        password: str = PASSWORD) -> tuple[int, dict[str, str], bytes]:
    """(status, headers, body) of a GET, an HTTP error answer included."""
    request = urllib.request.Request(url)
    if user is not None:
        token = base64.b64encode(f"{user}:{password}".encode()).decode()
        request.add_header("Authorization", f"Basic {token}")
    try:
        with urllib.request.urlopen(request, timeout=10, context=ctx) as r:
            return r.status, dict(r.headers), r.read()
    except urllib.error.HTTPError as exc:
        return exc.code, dict(exc.headers), exc.read()


@needs_openssl
def test_https_with_basic_auth_serves_only_who_knows_the_password(pki: Pki,
                                                                  tmp_path: Path) -> None:
    web = WebSettings(web_file(tmp_path, tls_and_auth(pki)))
    with serving(web) as server:
        base = f"https://localhost:{server.port}"
        ctx = client_context(pki)
        code, _, body = get(f"{base}/metrics", ctx, "prometheus")
        assert code == 200 and b"tls_test_scrapes_total 1.0" in body
        code, headers, body = get(f"{base}/metrics", ctx)
        assert code == 401 and headers["WWW-Authenticate"].startswith("Basic")
        assert b"tls_test" not in body
        assert get(f"{base}/metrics", ctx, "prometheus", "wrong")[0] == 401
        assert get(f"{base}/metrics", ctx, "mallory", PASSWORD)[0] == 401
        # Paths tell nothing before authentication; after it, only / and /metrics answer.
        assert get(f"{base}/secret", ctx)[0] == 401
        assert get(f"{base}/secret", ctx, "prometheus")[0] == 404
        assert get(f"{base}/", ctx, "prometheus")[0] == 200
        # The good password is checked by bcrypt once, then from the cache.
        assert web.known("prometheus", PASSWORD.encode()) is True
        assert get(f"{base}/metrics", ctx, "prometheus")[0] == 200

        # Plain HTTP on the TLS port: no answer, and certainly no metrics.
        with pytest.raises((http.client.HTTPException, urllib.error.URLError, OSError)):
            get(f"http://127.0.0.1:{server.port}/metrics", user="prometheus")
        # A client that does not trust the CA refuses the server.
        with pytest.raises(urllib.error.URLError, match="CERTIFICATE_VERIFY_FAILED"):
            get(f"{base}/metrics", ssl.create_default_context(), "prometheus")
        stats = server.stats
        assert stats.responses["200"] >= 3 and stats.responses["401"] >= 4
        wait_for("the refused connections counted",
                 lambda: stats.result("metrics", "failed") >= 2 or None, 5)


def test_without_tls_the_file_still_sets_users_headers_and_a_rate_and_reloads(
        tmp_path: Path) -> None:
    other = bcrypt.hashpw(b"second password", bcrypt.gensalt(4)).decode()
    path = web_file(tmp_path, f"basic_auth_users:\n  prometheus: {HASH}\n"
                              "http_server_config:\n  headers:\n    X-Frame-Options: deny\n"
                              "rate_limit:\n  interval: 10s\n  burst: 3\n")
    web = WebSettings(path)
    with serving(web) as server:
        url = f"http://127.0.0.1:{server.port}/metrics"
        code, headers, _ = get(url, user="prometheus")
        assert code == 200 and headers["X-Frame-Options"] == "deny"
        assert get(url)[0] == 401
        assert get(url, user="prometheus")[0] == 200
        assert get(url, user="prometheus")[0] == 429  # the burst of 3 is spent

        path.write_text(f"basic_auth_users:\n  prometheus: {other}\n")
        os.utime(path, (time.time() + 5, time.time() + 5))  # a change within the same second
        time.sleep(1.1)  # the file is looked at no more than once a second
        assert get(url, user="prometheus")[0] == 401
        assert get(url, user="prometheus", password="second password")[0] == 200
        assert "X-Frame-Options" not in get(url, user="prometheus")[1]


@needs_openssl
def test_client_certificates_are_required_and_their_names_checked(pki: Pki,
                                                                  tmp_path: Path) -> None:
    extra = (f"  client_ca_file: {pki.ca}\n  client_auth_type: RequireAndVerifyClientCert\n"
             "  client_allowed_sans: [prometheus.example]\n")
    text = (f"tls_server_config:\n  cert_file: {pki.server_cert}\n"
            f"  key_file: {pki.server_key}\n{extra}")
    web = WebSettings(web_file(tmp_path, text))
    with serving(web) as server:
        url = f"https://localhost:{server.port}/metrics"
        assert get(url, client_context(pki, cert=True))[0] == 200
        with pytest.raises((urllib.error.URLError, ConnectionError, ssl.SSLError)):
            get(url, client_context(pki))  # no client certificate
    # The same certificate, but a name the file does not list: refused after the handshake.
    web = WebSettings(web_file(tmp_path, text.replace("prometheus.example", "other.example")))
    with serving(web) as server:
        url = f"https://localhost:{server.port}/metrics"
        with pytest.raises((urllib.error.URLError, http.client.HTTPException, OSError)):
            get(url, client_context(pki, cert=True))


@needs_openssl
def test_a_renewed_certificate_is_served_without_a_restart_and_a_broken_one_is_refused(
        pki: Pki, tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="gpuwatch.serve.web_config")
    d = tmp_path / "certs"
    shutil.copytree(pki.dir, d)
    web = WebSettings(web_file(tmp_path, "tls_server_config:\n  cert_file: certs/server.crt\n"
                                         "  key_file: certs/server.key\n"))

    def serial(port: int) -> int:
        ctx = client_context(pki)
        with socket.create_connection(("127.0.0.1", port), timeout=5) as raw, \
                ctx.wrap_socket(raw, server_hostname="localhost") as s:
            cert = s.getpeercert()
        assert cert is not None
        return int(str(cert["serialNumber"]), 16)

    with serving(web) as server:
        assert serial(server.port) == 1
        issue(d, "server", "/CN=localhost",
              "subjectAltName=IP:127.0.0.1,DNS:localhost\nextendedKeyUsage=serverAuth\n", 99)
        wait_for("the renewed certificate", lambda: serial(server.port) == 99 or None, 10)
        assert "web configuration reloaded" in caplog.text

        (d / "server.key").write_text("not a key\n")
        # Checked when a connection arrives: each probe is one, served with what loaded last.
        wait_for("the broken key refused", lambda: (serial(server.port) == 99 and
                 "web configuration change refused" in caplog.text) or None, 10)
        assert caplog.text.count("web configuration change refused") == 1  # once per change


# -- the daemon ----------------------------------------------------------------------------------
def test_the_daemon_exits_78_on_a_bad_web_config(cli_env: dict[str, str],
                                                 tmp_path: Path) -> None:
    path = web_file(tmp_path, "basic_auth_users:\n  alice: hunter2\n")
    result = subprocess.run(
        [sys.executable, "-m", "gpuwatch", "daemon", "--listen", "127.0.0.1:0",
         "--web-config", str(path), "--runtime-dir", str(tmp_path / "run")],
        env=cli_env, capture_output=True, text=True, timeout=60)
    assert result.returncode == EXIT_CONFIG, result.stderr
    assert "basic_auth_users.alice: expected a bcrypt hash" in result.stderr
    assert "Traceback" not in result.stderr


@needs_openssl
@needs_prometheus
def test_prometheus_scrapes_over_tls_with_basic_auth_and_without_them_gets_nothing(
        pki: Pki, cli_env: dict[str, str], tmp_path: Path) -> None:
    path = web_file(tmp_path, tls_and_auth(pki))
    with running_daemon(cli_env, tmp_path / "daemon",
                        args=("--interval", "0.5", "--web-config", str(path))) as d:
        assert d.metrics_url.startswith("https://127.0.0.1:")
        info = json.loads((d.runtime_dir / "daemon.json").read_text())
        assert info["metrics_url"] == d.metrics_url
        target = d.metrics_url.split("//", 1)[1].split("/", 1)[0]
        ctx = client_context(pki)
        https = f"https://{target}/metrics"
        assert get(https, ctx, "prometheus")[0] == 200
        assert get(https, ctx)[0] == 401
        with pytest.raises((http.client.HTTPException, urllib.error.URLError, OSError)):
            get(f"http://{target}/metrics", user="prometheus")
        # `gpuwatch doctor` finds it answering, though it can neither verify nor log in.
        doctor = gpuwatch(["doctor", "--check", "metrics", "--runtime-dir", str(d.runtime_dir)],
                          cli_env)
        assert doctor.returncode == 0, doctor.stdout + doctor.stderr
        assert "answers, behind basic auth" in doctor.stdout

        secure = (f"scheme: https\ntls_config:\n  ca_file: {pki.ca}\n"
                  f"  server_name: localhost\n")
        job = secure + f"basic_auth:\n  username: prometheus\n  password: {PASSWORD}\n"
        others = (f"  - job_name: no-auth\n    scheme: https\n    tls_config:\n"
                  f"      ca_file: {pki.ca}\n    static_configs:\n"
                  f"      - targets: [\"{target}\"]\n"
                  f"  - job_name: no-tls\n    basic_auth:\n      username: prometheus\n"
                  f"      password: {PASSWORD}\n    static_configs:\n"
                  f"      - targets: [\"{target}\"]\n")
        with prometheus_scraping(target, tmp_path, job_options=job,
                                 extra_jobs=others) as prom:
            def health() -> Optional[dict[str, dict[str, Any]]]:
                targets = {t["labels"]["job"]: t for t in api(prom, "targets")["activeTargets"]}
                if len(targets) == 3 and all(t["health"] != "unknown" for t in targets.values()) \
                        and targets["gpuwatch"]["health"] == "up":
                    return targets
                return None

            targets = wait_for("Prometheus to scrape all three jobs", health, 60)
            assert targets["gpuwatch"]["lastError"] == ""
            assert targets["no-auth"]["health"] == "down"
            assert "401" in targets["no-auth"]["lastError"]
            assert targets["no-tls"]["health"] == "down"
            rows = api(prom, "query", query='gpuwatch_polls_total{job="gpuwatch"}')["result"]
            assert rows and float(rows[0]["value"][1]) > 0
            assert not api(prom, "query", query='gpuwatch_polls_total{job!="gpuwatch"}')[
                "result"]
        scraped = get(https, ctx, "prometheus")[2].decode()
        refused = re.search(r'^gpuwatch_http_responses_total\{code="401"\} (\S+)$', scraped, re.M)
        assert refused and float(refused.group(1)) >= 2
        assert "Traceback" not in d.log()


# -- wrong-password floods ----------------------------------------------------------------------
#: bcrypt at the cost people use (htpasswd -B's default): each check ~60 ms of CPU.
REAL_COST_HASH = bcrypt.hashpw(PASSWORD.encode(), bcrypt.gensalt(10)).decode()


def wrong_password_flood(port: int, connections: int, stop: Any, source: str = "127.0.0.1",
                         ) -> list[Any]:
    """`connections` clients that each send a fresh wrong password, read the answer, and send
    the next, until `stop` is set: a brute-force attempt, or a scraper misconfigured many
    times over. Returns the threads."""
    import threading

    def attack(n: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            token = base64.b64encode(f"prometheus:wrong-{n}-{i}".encode()).decode()
            with contextlib.suppress(OSError), socket.create_connection(
                    ("127.0.0.1", port), timeout=15, source_address=(source, 0)) as s:
                s.sendall(f"GET /metrics HTTP/1.1\r\nHost: x\r\nAuthorization: Basic "
                          f"{token}\r\n\r\n".encode())
                while s.recv(65536):
                    pass
            stop.wait(0.02)

    threads = [threading.Thread(target=attack, args=(n,), daemon=True)
               for n in range(connections)]
    for t in threads:
        t.start()
    return threads


def timed_get(url: str, user: str, password: str = PASSWORD) -> tuple[int, float]:
    started = time.monotonic()
    code = get(url, user=user, password=password)[0]
    return code, time.monotonic() - started


def test_a_wrong_password_flood_never_delays_the_authenticated_scraper_even_after_a_reload(
        tmp_path: Path) -> None:
    import threading

    path = web_file(tmp_path, f"basic_auth_users:\n  prometheus: {REAL_COST_HASH}\n")
    web = WebSettings(path)
    stop = threading.Event()
    with serving(web) as server:
        url = f"http://127.0.0.1:{server.port}/metrics"
        assert get(url, user="prometheus")[0] == 200  # its verdict is now kept
        threads = wrong_password_flood(server.port, 100, stop)
        try:
            wait_for("the flood to be refused in numbers", lambda: (
                server.stats.responses.get("401", 0) + server.stats.responses.get("429", 0)
                >= 20) or None, 30)
            # 100 unknown passwords queued cost 6 s of bcrypt; the scraper waits behind none (a
            # loaded machine may still keep it a second or two).
            scrapes = [timed_get(url, "prometheus") for _ in range(5)]
            assert all(code == 200 for code, _ in scrapes), scrapes
            assert max(took for _, took in scrapes) < 4.0, scrapes

            # A reload (a renewed certificate, a new header) keeps the known-good verdicts.
            config = web.config
            path.write_text(f"basic_auth_users:\n  prometheus: {REAL_COST_HASH}\n"
                            "http_server_config:\n  headers:\n    X-Frame-Options: deny\n")
            os.utime(path, (time.time() + 5, time.time() + 5))
            wait_for("the reload", lambda: (get(url)[0] and web.config is not config) or None,
                     10)
            scrapes = [timed_get(url, "prometheus") for _ in range(5)]
            assert all(code == 200 for code, _ in scrapes), scrapes
            assert max(took for _, took in scrapes) < 4.0, scrapes
            # The peer that keeps failing is turned away without a check.
            assert server.stats.responses.get("429", 0) > 0
        finally:
            stop.set()
            for t in threads:
                t.join(20)


def test_a_peer_that_keeps_failing_is_refused_checks_and_others_are_checked_first(
        tmp_path: Path) -> None:
    from gpuwatch.serve.web_config import FAILED_CHECKS_BURST

    web = WebSettings(web_file(tmp_path, f"basic_auth_users:\n  prometheus: {HASH}\n"))
    allowed = 0
    while web.may_check("192.0.2.1"):
        assert not web.checked("192.0.2.1", "prometheus", b"wrong")
        allowed += 1
    assert allowed == FAILED_CHECKS_BURST
    assert web.suspect("192.0.2.1") and not web.suspect("192.0.2.2")
    # Another peer is not affected; a success gives its check back.
    assert web.may_check("192.0.2.2") and web.checked("192.0.2.2", "prometheus",
                                                      PASSWORD.encode())
    assert not web.suspect("192.0.2.2")
    # Known-good credentials need no check at all, whoever sends them.
    assert web.known("prometheus", PASSWORD.encode()) is True
