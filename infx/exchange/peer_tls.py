"""Mutual TLS between gateway replicas (``--internal-tls-cert``, ``--internal-tls-key``, ``--internal-tls-ca``).

Twisted side: the files are loaded at start by
:meth:`PeerCredentials.from_files`, which raises
:class:`~infx.config.ConfigError` naming the option at fault, and read again
by :class:`PeerTLS` as connections come, at most every
:data:`CHECK_INTERVAL` seconds, so that a certificate or CA rotated on disk
(cert-manager, a Secret update) serves new connections without a restart;
the clock is always passed in.

Trust model: every gateway presents a certificate signed by the internal CA
and accepts a peer (as client or as server) only if the peer's certificate
chains to that CA. The peer's host name or IP address is *not* checked
against the certificate: peers are dialled at pod IPs that change with every
restart, so the usual deployment mounts one certificate, issued by a CA kept
for this purpose alone, into every replica. Holding a certificate from that
CA is what makes a pod a peer; keep the CA dedicated to the gateways.

The internal server refuses a client without such a certificate during the
TLS handshake, before any HTTP/2 byte reaches the gRPC server, and logs the
refusal (:class:`HandshakeWatch`); other peers' connections are unaffected.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from OpenSSL import SSL, crypto
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import (
    IHandshakeListener,
    IOpenSSLClientConnectionCreator,
    IOpenSSLServerConnectionCreator,
    IProtocolFactory,
    IReactorTime,
    IStreamClientEndpoint,
)
from twisted.internet.ssl import Certificate, CertificateOptions, trustRootFromCertificates
from twisted.logger import Logger
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.protocols.tls import TLSMemoryBIOFactory, TLSMemoryBIOProtocol
from twisted.python.failure import Failure
from zope.interface import implementer

from infx.config import ConfigError

log = Logger(namespace="infx.peer_tls")

#: ALPN protocol of gRPC; a peer that offers no overlap fails the handshake.
ALPN_H2 = b"h2"


#: Seconds between checks of the three files for a rotation, on the clock passed in.
CHECK_INTERVAL = 30.0

_OPTIONS = ("--internal-tls-cert", "--internal-tls-key", "--internal-tls-ca")


def _read(path: str, option: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{option}: cannot read {path}: {e.strerror}") from None


def _read_all(files: tuple[str, str, str]) -> tuple[bytes, ...]:
    return tuple(_read(path, option) for path, option in zip(files, _OPTIONS))


def _digests(pems: tuple[bytes, ...]) -> tuple[bytes, ...]:
    return tuple(hashlib.sha256(pem).digest() for pem in pems)


def _certificates(data: bytes, path: str, option: str) -> list[x509.Certificate]:
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError:
        raise ConfigError(f"{option}: {path} holds no PEM certificate") from None


def _private_key(data: bytes, path: str, option: str) -> Any:
    try:
        return serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise ConfigError(f"{option}: {path} holds no unencrypted PEM private key") from None


@dataclass(frozen=True)
class PeerCredentials:
    """One loading of the files: this gateway's certificate and key, and the CA its peers'
    certificates must chain to.

    One :class:`CertificateOptions` serves both directions: as a server it
    requires and verifies a client certificate; as a client it presents the
    same certificate and verifies the server's chain (no name check, see the
    module docstring).
    """

    #: The cert, key and CA paths, read again by :class:`PeerTLS` to notice a rotation.
    files: tuple[str, str, str]
    options: CertificateOptions
    leaf: x509.Certificate
    authorities: int
    #: SHA-256 of each file as loaded: a check compares contents, which a ``..data`` swap
    #: or an in-place rewrite both change, whatever the mtime granularity or inode reuse.
    digests: tuple[bytes, ...]

    @classmethod
    def from_files(cls, cert: str, key: str, ca: str) -> PeerCredentials:
        """Load PEM files: ``cert`` may carry intermediates after the leaf, ``ca`` several
        CA certificates (for rotation). Raises :class:`ConfigError` if a file is unreadable,
        unparseable, or the key does not belong to the certificate."""
        files = (cert, key, ca)
        return cls._from_pem(files, _read_all(files))

    @classmethod
    def _from_pem(cls, files: tuple[str, str, str], pems: tuple[bytes, ...]) -> PeerCredentials:
        cert, key, ca = files
        chain = _certificates(pems[0], cert, "--internal-tls-cert")
        private_key = _private_key(pems[1], key, "--internal-tls-key")
        authorities = _certificates(pems[2], ca, "--internal-tls-ca")
        # pyOpenSSL takes cryptography's objects for our own certificate and key (and
        # deprecates its own), but its trust store still wants its own X509. A trustRoot
        # makes CertificateOptions verify the peer and require its certificate.
        trust = trustRootFromCertificates([Certificate(crypto.X509.from_cryptography(c)) for c in authorities])
        options = CertificateOptions(
            privateKey=private_key, certificate=chain[0], extraCertChain=chain[1:],
            trustRoot=trust, acceptableProtocols=[ALPN_H2],
        )
        try:
            options.getContext()  # builds (and caches) the context: checks the key matches
        except SSL.Error:
            raise ConfigError(
                f"--internal-tls-key: {key} is not the private key of the certificate in {cert}") from None
        return cls(files, options, chain[0], len(authorities), _digests(pems))


@implementer(IOpenSSLServerConnectionCreator, IOpenSSLClientConnectionCreator)
class PeerTLS:
    """Hands every new connection, in either direction, the current :class:`PeerCredentials`.

    cert-manager or a Secret update rewrites the mounted files while the gateway runs. On
    a new connection, at most once every ``check_interval`` seconds of ``clock``, the files
    are read again and, if they changed, loaded with the checks of
    :meth:`PeerCredentials.from_files`. Open connections keep the credentials of their
    handshake. Files that fail the checks (a rotation caught half-way: a new certificate
    beside the old key) leave the current credentials in place, are logged once per
    distinct error, and are tried again at the next check.
    """

    def __init__(self, clock: IReactorTime, credentials: PeerCredentials,
                 check_interval: float = CHECK_INTERVAL) -> None:
        self.credentials = credentials
        self._clock = clock
        self._check_interval = check_interval
        self._next_check = clock.seconds() + check_interval
        self._failure: str | None = None

    def serverConnectionForTLS(self, tlsProtocol: TLSMemoryBIOProtocol) -> SSL.Connection:
        # What Twisted does with a CertificateOptions, with the options of the moment.
        return SSL.Connection(self._current().getContext(), None)

    # The same options serve both directions.
    clientConnectionForTLS = serverConnectionForTLS

    def _current(self) -> CertificateOptions:
        now = self._clock.seconds()
        if now >= self._next_check:
            self._next_check = now + self._check_interval
            self._check()
        return self.credentials.options

    def _check(self) -> None:
        files = self.credentials.files
        try:
            pems = _read_all(files)
            if _digests(pems) == self.credentials.digests:
                self._failure = None
                return
            self.credentials = PeerCredentials._from_pem(files, pems)
        except ConfigError as e:
            if str(e) != self._failure:
                self._failure = str(e)
                log.warn("internal TLS: keeping the current certificate, the changed files do not load: {error}; "
                         "trying again in {interval:g} s", error=self._failure, interval=self._check_interval)
            return
        self._failure = None
        leaf = self.credentials.leaf
        log.info("internal TLS: loaded {subject} (serial {serial}, valid until {not_after}) "
                 "and {authorities} CA certificate(s) from {cert}",
                 subject=leaf.subject.rfc4514_string(), serial=f"{leaf.serial_number:x}",
                 not_after=leaf.not_valid_after_utc.isoformat(), authorities=self.credentials.authorities,
                 cert=files[0])

    def server_factory(self, clock: IReactorTime, factory: IProtocolFactory) -> TLSMemoryBIOFactory:
        """``factory`` (the internal gRPC server) behind TLS that requires a peer certificate;
        ``clock`` is the TLS layer's, for its write flushes."""
        return TLSMemoryBIOFactory(self, False, HandshakeWatchFactory(factory), clock)

    def client_endpoint(self, clock: IReactorTime, endpoint: IStreamClientEndpoint) -> IStreamClientEndpoint:
        """``endpoint`` (a TCP connection to a peer) wrapped in TLS presenting our certificate."""
        return _TLSClientEndpoint(self, clock, endpoint)


@implementer(IStreamClientEndpoint)
class _TLSClientEndpoint:
    """What ``wrapClientTLS`` does, with the clock passed in rather than the global reactor."""

    def __init__(self, tls: PeerTLS, clock: IReactorTime, endpoint: IStreamClientEndpoint) -> None:
        self._tls = tls
        self._clock = clock
        self._endpoint = endpoint

    def connect(self, protocolFactory: IProtocolFactory) -> Deferred[Any]:
        factory = TLSMemoryBIOFactory(self._tls, True, protocolFactory, self._clock)
        connected: Deferred[Any] = self._endpoint.connect(factory)
        return connected.addCallback(lambda protocol: protocol.wrappedProtocol)


@implementer(IHandshakeListener)
class HandshakeWatch(ProtocolWrapper):
    """Logs a connection that ends before its TLS handshake completed: a peer
    without a certificate from the internal CA (or not speaking TLS at all)."""

    handshake_done = False

    def handshakeCompleted(self) -> None:
        self.handshake_done = True
        # ProtocolWrapper does not forward this hook; the gRPC protocol may want it.
        if IHandshakeListener.providedBy(self.wrappedProtocol):
            self.wrappedProtocol.handshakeCompleted()

    def connectionLost(self, reason: Failure) -> None:  # type: ignore[override]
        if not self.handshake_done:
            address = self.getPeer()
            log.warn("refused peer {peer} at the TLS handshake: {reason}",
                     peer=f"{getattr(address, 'host', address)}:{getattr(address, 'port', '')}",
                     reason=_describe(reason))
        ProtocolWrapper.connectionLost(self, reason)


def _describe(reason: Failure) -> str:
    """OpenSSL's reasons (``certificate verify failed``), else the failure's message."""
    error = reason.value
    if isinstance(error, SSL.Error) and error.args and isinstance(error.args[0], list) and error.args[0]:
        return "; ".join(str(entry[-1]) for entry in error.args[0])
    return reason.getErrorMessage()


class HandshakeWatchFactory(WrappingFactory):
    """Wraps each protocol of ``wrappedFactory`` in a :class:`HandshakeWatch`."""

    protocol = HandshakeWatch
    noisy = False


__all__ = ["ALPN_H2", "CHECK_INTERVAL", "HandshakeWatch", "HandshakeWatchFactory", "PeerCredentials", "PeerTLS"]
