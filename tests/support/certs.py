"""Certificates made for a test (trustme): a CA, a server certificate for 127.0.0.1, client
certificates with chosen subjects, an expired one, and one from another CA, as PEM files."""

from __future__ import annotations

import datetime
import os
import ssl
from dataclasses import dataclass
from pathlib import Path

import trustme


def chain_pem(leaf: trustme.LeafCert) -> bytes:
    """``leaf``'s certificate chain as one PEM file's content, leaf first."""
    return b"".join(blob.bytes() for blob in leaf.cert_chain_pems)


def leaf_der(leaf: trustme.LeafCert) -> bytes:
    """``leaf``'s own certificate as DER, as ``getpeercert(binary_form=True)`` gives it."""
    return ssl.PEM_cert_to_DER_cert(leaf.cert_chain_pems[0].bytes().decode())


def replace_file(path: Path, data: bytes) -> None:
    """Puts ``data`` at ``path`` as a tool would: written aside, renamed into place (a new inode)."""
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_bytes(data)
    os.replace(tmp, path)


@dataclass(frozen=True)
class Pem:
    cert: str  # the certificate chain, leaf first
    key: str


class TestPki:
    """Writes everything under ``directory``; ``ca_file`` is what clients and the proxy trust."""

    __test__ = False  # not a pytest test class

    def __init__(self, directory: Path) -> None:
        self.directory = Path(directory)
        self.ca = trustme.CA(organization_name="kqp test CA")
        self.other_ca = trustme.CA(organization_name="another CA")
        self.ca_file = str(self._write("ca.pem", self.ca.cert_pem.bytes()))
        self.server = self._pem("server", self.ca.issue_cert("127.0.0.1", "localhost", common_name="proxy"))

    def client(self, name: str, common_name: str, organization_unit: str | None = None, expired: bool = False,
               other_ca: bool = False) -> Pem:
        ca = self.other_ca if other_ca else self.ca
        kwargs = {}
        if expired:
            now = datetime.datetime.now(datetime.UTC)
            kwargs = {"not_before": now - datetime.timedelta(days=30), "not_after": now - datetime.timedelta(days=1)}
        cert = ca.issue_cert(f"{name}.clients.test", common_name=common_name, organization_name="Acme",
                             organization_unit_name=organization_unit, **kwargs)
        return self._pem(name, cert)

    def client_context(self, cert: Pem | None = None) -> ssl.SSLContext:
        """A client's TLS context: trusts ``ca_file``, checks the hostname, presents ``cert``
        when given."""
        ctx = ssl.create_default_context(cafile=self.ca_file)
        if cert is not None:
            ctx.load_cert_chain(cert.cert, cert.key)
        return ctx

    def _pem(self, name: str, cert: trustme.LeafCert) -> Pem:
        key = self._write(f"{name}.key", cert.private_key_pem.bytes())
        return Pem(str(self._write(f"{name}.pem", chain_pem(cert))), str(key))

    def _write(self, name: str, data: bytes) -> Path:
        path = self.directory / name
        path.write_bytes(data)
        return path
