"""TLS for the metrics port: the exporter-toolkit's names (Go's crypto/tls) for versions, cipher
suites, curves and client authentication mapped to OpenSSL's, the settings a web configuration
file gives (gpuwatch.serve.web_config reads and checks it), and the server-side SSL context made
from them. The certificate, key and CA are loaded from their bytes, read once, through a memfd:
what is checked is what is served.
"""

from __future__ import annotations

import contextlib
import ctypes
import ipaddress
import logging
import os
import ssl
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from gpuwatch.config import ConfigError, read_config_file

# The web configuration's lines, under the name they have always had.
log = logging.getLogger("gpuwatch.serve.web_config")

#: exporter-toolkit's names for Go's client authentication policies, and Python's equivalents.
#: Go's RequestClientCert and RequireAnyClientCert accept certificates nobody verified; OpenSSL
#: as Python drives it cannot, and a certificate nobody checks proves nothing.
CLIENT_AUTH = {
    "NoClientCert": ssl.CERT_NONE,
    "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
    "RequireAndVerifyClientCert": ssl.CERT_REQUIRED,
}
UNVERIFIED_CLIENT_AUTH = ("RequestClientCert", "RequireAnyClientCert", "RequireClientCert")
TLS_VERSIONS = {
    "TLS10": ssl.TLSVersion.TLSv1,
    "TLS11": ssl.TLSVersion.TLSv1_1,
    "TLS12": ssl.TLSVersion.TLSv1_2,
    "TLS13": ssl.TLSVersion.TLSv1_3,
}
#: Go's names (crypto/tls, the ones tls.CipherSuites() lists: what the exporter toolkit accepts)
#: for the TLS 1.2 suites, and OpenSSL's. Go's "insecure" list (RC4, 3DES, CBC with SHA-256) is
#: refused by the toolkit, and here.
CIPHER_SUITES = {
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256": "ECDHE-ECDSA-AES128-GCM-SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256": "ECDHE-RSA-AES128-GCM-SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384": "ECDHE-ECDSA-AES256-GCM-SHA384",
    "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384": "ECDHE-RSA-AES256-GCM-SHA384",
    "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-ECDSA-CHACHA20-POLY1305",
    "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256": "ECDHE-RSA-CHACHA20-POLY1305",
    "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA": "ECDHE-ECDSA-AES128-SHA",
    "TLS_ECDHE_ECDSA_WITH_AES_256_CBC_SHA": "ECDHE-ECDSA-AES256-SHA",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA": "ECDHE-RSA-AES128-SHA",
    "TLS_ECDHE_RSA_WITH_AES_256_CBC_SHA": "ECDHE-RSA-AES256-SHA",
    "TLS_RSA_WITH_AES_128_GCM_SHA256": "AES128-GCM-SHA256",
    "TLS_RSA_WITH_AES_256_GCM_SHA384": "AES256-GCM-SHA384",
    "TLS_RSA_WITH_AES_128_CBC_SHA": "AES128-SHA",
    "TLS_RSA_WITH_AES_256_CBC_SHA": "AES256-SHA",
}
#: Go's insecure suites (tls.InsecureCipherSuites()), which the toolkit refuses.
INSECURE_CIPHER_SUITES = (
    "TLS_RSA_WITH_RC4_128_SHA", "TLS_RSA_WITH_3DES_EDE_CBC_SHA", "TLS_RSA_WITH_AES_128_CBC_SHA256",
    "TLS_ECDHE_ECDSA_WITH_RC4_128_SHA", "TLS_ECDHE_RSA_WITH_RC4_128_SHA",
    "TLS_ECDHE_RSA_WITH_3DES_EDE_CBC_SHA", "TLS_ECDHE_ECDSA_WITH_AES_128_CBC_SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_CBC_SHA256")
#: TLS 1.3's suites: Go accepts their names in cipher_suites and does not let them be chosen;
#: neither does Python's ssl. Accepted, and they change nothing.
TLS13_CIPHER_SUITES = ("TLS_AES_128_GCM_SHA256", "TLS_AES_256_GCM_SHA384",
                       "TLS_CHACHA20_POLY1305_SHA256")
#: The TLS 1.2 suites offered without `cipher_suites`: ECDHE (forward secrecy) with an AEAD
#: cipher, in the order Go prefers them.
DEFAULT_CIPHER_SUITES = (
    "TLS_ECDHE_ECDSA_WITH_AES_128_GCM_SHA256", "TLS_ECDHE_ECDSA_WITH_CHACHA20_POLY1305_SHA256",
    "TLS_ECDHE_RSA_WITH_AES_128_GCM_SHA256", "TLS_ECDHE_RSA_WITH_CHACHA20_POLY1305_SHA256",
    "TLS_ECDHE_ECDSA_WITH_AES_256_GCM_SHA384", "TLS_ECDHE_RSA_WITH_AES_256_GCM_SHA384",
)
#: Go's names for the key exchange groups (tls.CurveID), and OpenSSL's.
CURVES = {"CurveP256": "P-256", "CurveP384": "P-384", "CurveP521": "P-521", "X25519": "X25519"}
#: The same, as Python's ssl.SSLContext.set_ecdh_curve names them (one group only).
_ECDH_CURVE = {"CurveP256": "prime256v1", "CurveP384": "secp384r1", "CurveP521": "secp521r1",
               "X25519": "X25519"}

@dataclass(frozen=True)
class TlsSettings:
    cert_file: Path
    key_file: Path
    client_auth_type: str = "NoClientCert"
    client_ca_file: Optional[Path] = None
    client_ca: Optional[str] = None
    client_allowed_sans: tuple[str, ...] = ()
    min_version: str = "TLS12"
    max_version: str = "TLS13"
    prefer_server_cipher_suites: bool = True
    #: Go's names, in order (empty: DEFAULT_CIPHER_SUITES).
    cipher_suites: tuple[str, ...] = ()
    #: Go's names, in order (empty: OpenSSL's default groups).
    curve_preferences: tuple[str, ...] = ()


def ssl_context(tls: TlsSettings, where: str = "daemon.web_config") -> ssl.SSLContext:
    """A server-side context for `tls`; raises ConfigError when a file will not load."""
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = TLS_VERSIONS[tls.min_version]
    ctx.maximum_version = TLS_VERSIONS[tls.max_version]
    if not tls.prefer_server_cipher_suites:
        ctx.options &= ~ssl.OP_CIPHER_SERVER_PREFERENCE
    suites = [CIPHER_SUITES[s] for s in tls.cipher_suites or DEFAULT_CIPHER_SUITES
              if s in CIPHER_SUITES]
    try:
        # TLS 1.3's suites are not set by this: all of them have forward secrecy and AEAD.
        ctx.set_ciphers(":".join(suites) if suites else "ECDHE+AESGCM")
    except ssl.SSLError as exc:
        raise ConfigError(f"{where}: tls_server_config.cipher_suites: this OpenSSL "
                          f"({ssl.OPENSSL_VERSION}) supports none of them: {_reason(exc)}"
                          ) from None
    if tls.curve_preferences:
        _set_groups(ctx, tls.curve_preferences, where)
    # HTTP/1.1 only: a client offering HTTP/2 (Go's, Prometheus's) settles on 1.1.
    ctx.set_alpn_protocols(["http/1.1"])
    cert = read_config_file(tls.cert_file, f"{where}: tls_server_config.cert_file")
    private = read_config_file(tls.key_file, f"{where}: tls_server_config.key_file")
    try:
        # OpenSSL opens files by name, and a name can become a FIFO between a check and the
        # open: it is given the bytes already read and checked, through anonymous memory files.
        with _memory_file(cert) as cert_path, _memory_file(private) as key_path:
            ctx.load_cert_chain(cert_path, key_path)
    except (OSError, ssl.SSLError) as exc:
        raise ConfigError(f"{where}: tls_server_config: cannot load cert_file {tls.cert_file} "
                          f"with key_file {tls.key_file}: {_reason(exc)}") from None
    if tls.client_ca_file is not None or tls.client_ca:
        ca = None if tls.client_ca_file is None else read_config_file(
            tls.client_ca_file, f"{where}: tls_server_config.client_ca_file")
        try:
            if ca is not None:
                with _memory_file(ca) as ca_path:
                    ctx.load_verify_locations(cafile=ca_path)
            if tls.client_ca:
                ctx.load_verify_locations(cadata=tls.client_ca)
        except (OSError, ssl.SSLError) as exc:
            raise ConfigError(f"{where}: tls_server_config: cannot load the client CA: "
                              f"{_reason(exc)}") from None
    ctx.verify_mode = CLIENT_AUTH[tls.client_auth_type]
    return ctx


def _set_groups(ctx: ssl.SSLContext, curves: tuple[str, ...], where: str) -> None:
    """Offer exactly `curves` (Go's names), in that order, for the key exchange.

    Python's ssl sets one group (set_ecdh_curve); OpenSSL takes a list (SSL_CTX_set1_groups_list),
    which is called here on the context's SSL_CTX, in the libssl this process already loaded, after
    checking that the pointer read is that SSL_CTX (its options read through OpenSSL match
    Python's). Where any of that cannot be done, the first curve alone is set, and a log line says
    so."""
    groups = ":".join(CURVES[c] for c in curves)
    if len(curves) > 1:
        if _set1_groups_list(ctx, groups.encode()):
            return
        log.warning("%s: tls_server_config.curve_preferences: this Python can set one curve "
                    "only; offering %s alone", where, curves[0])
    try:
        ctx.set_ecdh_curve(_ECDH_CURVE[curves[0]])
    except (ValueError, ssl.SSLError) as exc:
        raise ConfigError(f"{where}: tls_server_config.curve_preferences: this OpenSSL "
                          f"({ssl.OPENSSL_VERSION}) cannot use {curves[0]}: {exc}") from None


def _set1_groups_list(ctx: ssl.SSLContext, groups: bytes) -> bool:
    """SSL_CTX_set1_groups_list(ctx, groups) through ctypes; False where it cannot be done
    safely (no libssl found, a pointer that is not the context's, OpenSSL refusing)."""
    import sys

    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps
                     if "/libssl.so" in line and line.rstrip().endswith(tuple("0123456789"))}
        if len(paths) != 1 or sys.implementation.name != "cpython":
            return False
        lib = ctypes.CDLL(paths.pop())
        get_options = lib.SSL_CTX_get_options
        get_options.restype, get_options.argtypes = ctypes.c_uint64, [ctypes.c_void_p]
        control = lib.SSL_CTX_ctrl
        control.restype = ctypes.c_long
        control.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_long, ctypes.c_void_p]
        # CPython's context object: its SSL_CTX pointer is the first field after the header.
        pointer = ctypes.c_void_p.from_address(id(ctx) + object.__basicsize__).value
        if not pointer or get_options(pointer) != int(ctx.options):
            return False
        return bool(control(pointer, _SSL_CTRL_SET_GROUPS_LIST, 0, groups))
    except (OSError, AttributeError, ValueError):
        return False


#: From OpenSSL's ssl.h (stable since 1.1.0).
_SSL_CTRL_SET_GROUPS_LIST = 92


@contextlib.contextmanager
def _memory_file(data: bytes) -> Iterator[str]:
    """A path OpenSSL can open that reads `data`: a memfd, seen through /proc/self/fd."""
    fd = os.memfd_create("gpuwatch-web-config", os.MFD_CLOEXEC)
    try:
        os.write(fd, data)
        yield f"/proc/self/fd/{fd}"
    finally:
        os.close(fd)


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ssl.SSLError):
        return exc.reason or str(exc)
    return getattr(exc, "strerror", None) or str(exc)


def normal_san(value: str) -> str:
    with contextlib.suppress(ValueError):
        return str(ipaddress.ip_address(value))
    return value
