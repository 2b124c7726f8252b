"""The metrics port: `/metrics` over HTTP, or HTTPS with basic authentication (a web config).

Served by a `Listener` (one thread for every connection, bounded in number and time; see
listener.py), not by prometheus-client's server, which spends a thread on each connection and
never times one out. The exposition is gpuwatch.metrics': prometheus-client's text or
OpenMetrics format by the `Accept` header, gzip when asked, `name[]` filters.

Only `/metrics` serves metrics, `/` a page that links to it; anything else is 404. One request
per connection (`Connection: close`), as prometheus-client's server does. With basic auth every
path needs it (401 before 404, so that paths tell nothing).
"""

from __future__ import annotations

import binascii
import socket
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Optional, Union
from urllib.parse import parse_qs, urlsplit

from gpuwatch import __version__
from gpuwatch.metrics import Registry, choose_encoder
from gpuwatch.serve.connections import ConnectionStats
from gpuwatch.serve.exposition import RenderedMetrics, Selection, render
from gpuwatch.serve.listener import (
    MAX_ANSWERING,
    MAX_CONNECTIONS,
    REQUEST_TIMEOUT,
    RESPONSE_TIMEOUT,
    Answer,
    Conn,
    Handler,
    Job,
    Later,
    Listener,
    Outcome,
)

if TYPE_CHECKING:
    from gpuwatch.serve.web_config import WebSettings

MAX_REQUEST = 16 << 10
#: How long a refusal (401, 429) to a peer that failed lately is held back: each of its
#: connections then costs the daemon one TLS handshake every TARPIT seconds, not one a
#: millisecond. A held connection takes no slot or thread, and is the first evicted.
TARPIT = 5.0
_REASONS = {200: "OK", 400: "Bad Request", 401: "Unauthorized", 404: "Not Found",
            405: "Method Not Allowed", 429: "Too Many Requests", 431:
            "Request Header Fields Too Large", 500: "Internal Server Error",
            505: "HTTP Version Not Supported"}
_LANDING = (b"<!DOCTYPE html>\n<html><head><title>gpuwatch</title></head><body>"
            b"<h1>gpuwatch " + __version__.encode() + b"</h1>"
            b'<p><a href="/metrics">Metrics</a></p></body></html>\n')


@dataclass(frozen=True)
class Request:
    method: str
    target: str
    headers: dict[str, str]  # lower-case names


def parse_request(head: bytes) -> Request:
    """The request line and headers; ValueError for anything that is not HTTP/1.x."""
    lines = head.decode("latin-1").split("\n")
    parts = lines[0].rstrip("\r").split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1.") or not parts[0].isalpha():
        raise ValueError("bad request line")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        line = line.rstrip("\r")
        if not line:
            continue
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip():
            raise ValueError("bad header line")
        headers[name.lower()] = value.strip()
    return Request(parts[0], parts[1], headers)


def basic_credentials(header: Optional[str]) -> Optional[tuple[str, bytes]]:
    """(user, password) from an `Authorization: Basic ...` header, or None."""
    if not header:
        return None
    scheme, _, token = header.partition(" ")
    if scheme.lower() != "basic":
        return None
    import base64  # basic auth only (daemon.web_config): not imported otherwise

    try:
        decoded = base64.b64decode(token.strip(), validate=True)
    except (binascii.Error, ValueError):
        return None
    user, sep, password = decoded.partition(b":")
    if not sep:
        return None
    return user.decode("utf-8", "replace"), password


class MetricsHandler(Handler):
    max_request = MAX_REQUEST

    def __init__(self, registry: Registry, stats: ConnectionStats,
                 web: Optional[WebSettings] = None,
                 rendered: Optional[RenderedMetrics] = None) -> None:
        self.registry = registry
        self.stats = stats
        self.web = web
        self.rendered = rendered

    def request_end(self, buf: bytearray) -> int:
        end = buf.find(b"\r\n\r\n")
        if end >= 0:
            return end + 4
        end = buf.find(b"\n\n")
        return end + 2 if end >= 0 else -1

    def after_handshake(self, sock: object) -> Optional[str]:
        return self.web.refuse_peer(sock) if self.web is not None else None  # type: ignore[arg-type]

    def failure(self) -> Answer:
        return self._simple(500)

    def dispatch(self, request: Optional[bytes], conn: Conn) -> Outcome:
        if request is None:
            return self._simple(431)
        try:
            req = parse_request(request)
        except ValueError:
            return self._simple(400)
        web = self.web
        if web is not None:
            web.refresh()  # users and headers too, with or without TLS
            if not web.allow():
                return self._simple(429)
            if web.users:
                creds = basic_credentials(req.headers.get("authorization"))
                peer = _peer_address(conn.peer)
                if creds is None:
                    return self._refuse(web, peer, self._unauthorized())
                verdict = web.known(*creds)
                if verdict is None:
                    # Known-good credentials never come here (answered from memory above); a
                    # check waits on its own thread, outside the line for answering slots, the
                    # peers that failed lately behind the others, and a peer that failed too
                    # often, or a full queue, gets 429 without one.
                    if not web.may_check(peer):
                        return self._refuse(web, peer, self._simple(
                            429, extra=(("Retry-After", "2"),)))

                    def checked() -> Outcome:
                        if web.checked(peer, *creds):
                            return self._route(req)
                        return self._refuse(web, peer, self._unauthorized())
                    return Job("auth", checked, answering=False,
                               priority=1 if web.suspect(peer) else 0)
                if not verdict:
                    web.note_failure(peer)
                    return self._refuse(web, peer, self._unauthorized())
        return self._route(req)

    def _route(self, req: Request) -> Outcome:
        if req.method not in ("GET", "HEAD"):
            return self._response(405, b"Method not allowed: use GET or HEAD.\n",
                                  extra=(("Allow", "GET, HEAD"),))
        target = urlsplit(req.target)
        head = req.method == "HEAD"
        if target.path == "/metrics":
            encoder, content_type = choose_encoder(req.headers.get("accept", ""))
            gzipped = _accepts_gzip(req.headers.get("accept-encoding", ""))
            names = parse_qs(target.query).get("name[]")

            def respond(body: bytes) -> Answer:
                extra = (("Content-Encoding", "gzip"),) if gzipped else ()
                return self._response(200, body, content_type, extra=extra, head=head)

            if self.rendered is not None and not names:
                # Bytes rendered after the last poll are sent from here; only a render takes a
                # worker thread.
                rendered = self.rendered
                kept = rendered.kept(encoder, gzipped)
                if kept is not None:
                    return respond(kept)
                return Job("render", lambda: respond(rendered.body(encoder, gzipped)))
            registry = Selection(self.registry, names) if names else self.registry
            return Job("render", lambda: respond(render(encoder, registry, gzipped)))
        if target.path == "/":
            return self._response(200, _LANDING, "text/html; charset=utf-8", head=head)
        return self._response(404, b"Not found: metrics are at /metrics.\n", head=head)

    @staticmethod
    def _refuse(web: WebSettings, peer: str, answer: Answer) -> Outcome:
        """A refusal, held back (TARPIT) when the peer failed lately."""
        return Later(answer, TARPIT) if web.suspect(peer) else answer

    def _unauthorized(self) -> Answer:
        return self._response(401, b"Unauthorized\n",
                              extra=(("WWW-Authenticate", 'Basic realm="gpuwatch"'),))

    def _simple(self, code: int, extra: tuple[tuple[str, str], ...] = ()) -> Answer:
        return self._response(code, f"{_REASONS[code]}\n".encode(), extra=extra)

    def _response(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8",
                  extra: tuple[tuple[str, str], ...] = (), head: bool = False) -> Answer:
        """The answer (counted): its header, then its body as it is. A /metrics body is the
        render's own bytes, kept for the next scrape: written after the header, never copied
        onto it (half a MiB at 1,024 processes)."""
        self.stats.response(code)
        lines = [f"HTTP/1.1 {code} {_REASONS[code]}", f"Content-Type: {content_type}",
                 f"Content-Length: {len(body)}", "Connection: close", *(
                     f"{k}: {v}" for k, v in extra)]
        if self.web is not None:
            lines.extend(f"{k}: {v}" for k, v in self.web.config.headers)
        head_bytes = ("\r\n".join(lines) + "\r\n\r\n").encode("latin-1")
        return (head_bytes,) if head else (head_bytes, body)


def _peer_address(peer: object) -> str:
    """The client's address without its port (what one attacker holds many of)."""
    if isinstance(peer, tuple) and peer:
        return str(peer[0])
    return str(peer or "local")


def _accepts_gzip(header: str) -> bool:
    for item in header.split(","):
        name, _, params = item.partition(";")
        if name.strip().lower() == "gzip":
            return params.replace(" ", "") not in ("q=0", "q=0.0", "q=0.00", "q=0.000")
    return False


def _host_arg(host: str) -> Union[str, bytes]:
    """An ASCII host as bytes: the socket module encodes a str host with the IDNA codec, whose
    import (with stringprep) a daemon would keep for its whole life."""
    return host.encode("ascii") if host.isascii() else host


def bind_tcp(host: str, port: int, backlog: int = 128) -> socket.socket:
    """A listening socket on HOST:PORT ('' or '0.0.0.0': every IPv4 interface; '::' every
    interface); raises OSError (EADDRINUSE, EACCES, EADDRNOTAVAIL) for the caller to explain."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if host and ":" not in host:
        # A name resolves to its first address, as prometheus-client's server did.
        infos = socket.getaddrinfo(_host_arg(host), port, type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)
        family = infos[0][0]
        host = str(infos[0][4][0])
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((_host_arg(host or "0.0.0.0"), port))
        sock.listen(backlog)
    except BaseException:
        sock.close()
        raise
    return sock


class MetricsServer:
    """/metrics on a bound socket; `web` adds TLS and basic auth; `rendered` serves what was
    rendered after the last poll (the registry is rendered for each scrape without it)."""

    def __init__(self, sock: socket.socket, registry: Registry,
                 stats: Optional[ConnectionStats] = None, web: Optional[WebSettings] = None,
                 *, rendered: Optional[RenderedMetrics] = None,
                 max_connections: int = MAX_CONNECTIONS, max_answering: int = MAX_ANSWERING,
                 request_timeout: float = REQUEST_TIMEOUT,
                 response_timeout: float = RESPONSE_TIMEOUT) -> None:
        self.stats = stats if stats is not None else ConnectionStats()
        self.web = web
        tls: Optional[Callable[[], object]] = None
        if web is not None and web.tls:
            tls = web.tls_context
        self.listener = Listener(
            sock, "metrics", MetricsHandler(registry, self.stats, web, rendered), self.stats,
            tls,  # type: ignore[arg-type]
            max_connections=max_connections, max_answering=max_answering,
            request_timeout=request_timeout, response_timeout=response_timeout)
        self.server_address = sock.getsockname()

    @property
    def port(self) -> int:
        return int(self.server_address[1])

    @property
    def scheme(self) -> str:
        return "https" if self.web is not None and self.web.tls else "http"

    def start(self) -> None:
        self.listener.start()

    def stop(self) -> None:
        self.listener.stop()
