#!/usr/bin/env python
"""Writes the interop tools' TEST-ONLY TLS credentials: ca.pem, server.pem and server.key.

    .venv/bin/python tools/interop_testdata/make_certs.py [DIRECTORY]

The server's private key is committed next to the certificates, so never
trust ``ca.pem`` anywhere but in tests. They stand in for grpc/grpc's own test
CA and server1 certificate, which infx does not copy: the server certificate
names what grpc's interop tests reach a server under with
``--server_host_override`` (``foo.test.google.fr`` and the rest) plus
``localhost``, 127.0.0.1 and 192.168.1.3, and is valid for ten years. The CA's
key is thrown away, so rerun this script (it writes into its own directory by
default) to replace all three files at once.
"""

from __future__ import annotations

import datetime
import ipaddress
import sys
from pathlib import Path

from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

DNS_NAMES = ["*.test.google.fr", "waterzooi.test.google.be", "*.test.youtube.com", "foo.test.google.fr", "localhost"]
IP_ADDRESSES = ["127.0.0.1", "192.168.1.3"]
VALIDITY = datetime.timedelta(days=3650)


def _key() -> rsa.RSAPrivateKey:
    """RSA 2048, as grpc's own test keys, so that any gRPC implementation's interop client accepts it."""
    return rsa.generate_private_key(public_exponent=65537, key_size=2048)


def _name(common_name: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.ORGANIZATION_NAME, "infx interop tests"),
                      x509.NameAttribute(NameOID.COMMON_NAME, common_name)])


def make_certs(directory: Path) -> None:
    now = datetime.datetime.now(datetime.timezone.utc)
    start, end = now - datetime.timedelta(days=1), now + VALIDITY  # a day back for skewed clocks
    ca_key, server_key = _key(), _key()
    ca_name = _name("infx interop test CA (test only)")
    ca = (
        x509.CertificateBuilder()
        .subject_name(ca_name).issuer_name(ca_name).public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=False, content_commitment=False, key_encipherment=False, data_encipherment=False,
            key_agreement=False, key_cert_sign=True, crl_sign=True, encipher_only=False, decipher_only=False,
        ), critical=True)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    server = (
        x509.CertificateBuilder()
        .subject_name(_name(DNS_NAMES[0])).issuer_name(ca_name).public_key(server_key.public_key())
        .serial_number(x509.random_serial_number()).not_valid_before(start).not_valid_after(end)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.KeyUsage(
            digital_signature=True, content_commitment=False, key_encipherment=True, data_encipherment=False,
            key_agreement=False, key_cert_sign=False, crl_sign=False, encipher_only=False, decipher_only=False,
        ), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(x509.SubjectAlternativeName(
            [x509.DNSName(name) for name in DNS_NAMES]
            + [x509.IPAddress(ipaddress.ip_address(address)) for address in IP_ADDRESSES]
        ), critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(server_key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "ca.pem").write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    (directory / "server.pem").write_bytes(server.public_bytes(serialization.Encoding.PEM))
    (directory / "server.key").write_bytes(server_key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()))


if __name__ == "__main__":
    make_certs(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).resolve().parent)
