"""Mutual TLS between gateway replicas (``--internal-tls-cert``, ``--internal-tls-key``, ``--internal-tls-ca``).

Twisted side: files are read once, by :meth:`PeerTLS.from_files`, which
raises :class:`~infx.config.ConfigError` naming the option at fault; the
clock is always passed in.

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

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cryptography import x509
from cryptography.hazmat.primitives import serialization
from OpenSSL import SSL, crypto
from twisted.internet.defer import Deferred
from twisted.internet.interfaces import (
    IHandshakeListener,
    IProtocolFactory,
    IReactorTime,
    IStreamClientEndpoint,
)
from twisted.internet.ssl import Certificate, CertificateOptions, trustRootFromCertificates
from twisted.logger import Logger
from twisted.protocols.policies import ProtocolWrapper, WrappingFactory
from twisted.protocols.tls import TLSMemoryBIOFactory
from twisted.python.failure import Failure
from zope.interface import implementer

from infx.config import ConfigError

log = Logger()

#: ALPN protocol of gRPC; a peer that offers no overlap fails the handshake.
ALPN_H2 = b"h2"


def _read(path: str, option: str) -> bytes:
    try:
        return Path(path).read_bytes()
    except OSError as e:
        raise ConfigError(f"{option}: cannot read {path}: {e.strerror}") from None


def _certificates(path: str, option: str) -> list[x509.Certificate]:
    data = _read(path, option)
    try:
        return x509.load_pem_x509_certificates(data)
    except ValueError:
        raise ConfigError(f"{option}: {path} holds no PEM certificate") from None


def _private_key(path: str, option: str) -> Any:
    data = _read(path, option)
    try:
        return serialization.load_pem_private_key(data, password=None)
    except (ValueError, TypeError):
        raise ConfigError(f"{option}: {path} holds no unencrypted PEM private key") from None


@dataclass(frozen=True)
class PeerTLS:
    """This gateway's certificate and key, and the CA its peers' certificates must chain to.

    One :class:`CertificateOptions` serves both directions: as a server it
    requires and verifies a client certificate; as a client it presents the
    same certificate and verifies the server's chain (no name check, see the
    module docstring).
    """

    options: CertificateOptions

    @classmethod
    def from_files(cls, cert: str, key: str, ca: str) -> PeerTLS:
        """Load PEM files: ``cert`` may carry intermediates after the leaf, ``ca`` several
        CA certificates (for rotation). Raises :class:`ConfigError` if a file is unreadable,
        unparseable, or the key does not belong to the certificate."""
        chain = _certificates(cert, "--internal-tls-cert")
        private_key = _private_key(key, "--internal-tls-key")
        authorities = _certificates(ca, "--internal-tls-ca")
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
        return cls(options)

    def server_factory(self, clock: IReactorTime, factory: IProtocolFactory) -> TLSMemoryBIOFactory:
        """``factory`` (the internal gRPC server) behind TLS that requires a peer certificate."""
        return TLSMemoryBIOFactory(self.options, False, HandshakeWatchFactory(factory), clock)

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
        factory = TLSMemoryBIOFactory(self._tls.options, True, protocolFactory, self._clock)
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


__all__ = ["ALPN_H2", "HandshakeWatch", "HandshakeWatchFactory", "PeerTLS"]
