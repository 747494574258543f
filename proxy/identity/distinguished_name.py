"""A certificate's subject as Java's ``X500Principal.getName()`` (RFC 2253) prints it.

Pure functions, no I/O; the subject that ``ssl.principal.mapping.rules`` (proxy.identity.ssl_principal)
run on.

Guarantees:
- ``distinguished_name`` renders a ``getpeercert()['subject']`` as ``X500Principal.getName()``
  does: RDNs most specific first, ``CN C L ST O OU STREET DC UID`` by keyword and RFC 2253 escaping
  of their values (``, = + < > # ; " \\`` anywhere, NUL as ``\\00``, each leading or trailing space
  or CR), multi-valued RDNs joined by ``+`` in certificate order, and every other attribute as its
  OID with ``#`` and the hex of the value's DER encoding. ``getpeercert`` does not say which ASN.1
  string type a value had, so that hex assumes IA5String for emailAddress, PrintableString for
  serialNumber, dnQualifier and jurisdictionCountryName, and UTF8String otherwise (what OpenSSL
  and ``cryptography`` write); keyword attributes are exact for PrintableString, UTF8String and
  IA5String values (the types RFC 5280 allows), not for BMPString or UniversalString ones.
"""

from __future__ import annotations

import re
import ssl
from collections.abc import Sequence

__all__ = ["distinguished_name"]


# OIDs Java prints by keyword in RFC 2253 (sun.security.x509.AVAKeyword, the RFC 2253 compliant ones).
_RFC2253_KEYWORDS = {
    "2.5.4.3": "CN",
    "2.5.4.6": "C",
    "2.5.4.7": "L",
    "2.5.4.8": "ST",
    "2.5.4.10": "O",
    "2.5.4.11": "OU",
    "2.5.4.9": "STREET",
    "0.9.2342.19200300.100.1.25": "DC",
    "0.9.2342.19200300.100.1.1": "UID",
}
# The names getpeercert() uses (OpenSSL's long names) for the usual subject attributes.
_OIDS = {
    "commonName": "2.5.4.3",
    "countryName": "2.5.4.6",
    "localityName": "2.5.4.7",
    "stateOrProvinceName": "2.5.4.8",
    "organizationName": "2.5.4.10",
    "organizationalUnitName": "2.5.4.11",
    "streetAddress": "2.5.4.9",
    "domainComponent": "0.9.2342.19200300.100.1.25",
    "userId": "0.9.2342.19200300.100.1.1",
    "emailAddress": "1.2.840.113549.1.9.1",
    "serialNumber": "2.5.4.5",
    "dnQualifier": "2.5.4.46",
    "jurisdictionCountryName": "1.3.6.1.4.1.311.60.2.1.3",
}
# The DER tag assumed for a value printed in hex: IA5String, PrintableString, else UTF8String.
_IA5, _PRINTABLE, _UTF8 = 0x16, 0x13, 0x0C
_TAGS = {
    "1.2.840.113549.1.9.1": _IA5,
    "2.5.4.5": _PRINTABLE,
    "2.5.4.46": _PRINTABLE,
    "1.3.6.1.4.1.311.60.2.1.3": _PRINTABLE,
}
_DOTTED = re.compile(r"[0-9]+(?:\.[0-9]+)+")
_ESCAPED = frozenset(',=+<>#;"\\')  # sun.security.x509.AVA.toRFC2253String escapes these anywhere


def distinguished_name(subject: Sequence[Sequence[tuple[str, str]]]) -> str:
    """The RFC 2253 DN Kafka's principal builder sees for ``getpeercert()['subject']`` (Java's
    ``X500Principal.getName()``), e.g. ``CN=alice,O=Acme,C=US``. Raises ValueError for an
    attribute name that is neither a known name nor a dotted OID."""
    # javax.security.auth.x500.X500Principal.getName(): the last RDN of the certificate first.
    return ",".join("+".join(_attribute(name, value) for name, value in rdn) for rdn in reversed(subject))


def _attribute(name: str, value: str) -> str:
    oid = _oid(name)
    keyword = _RFC2253_KEYWORDS.get(oid)
    if keyword is not None:
        return f"{keyword}={_escape(value)}"
    # sun.security.x509.AVA: any other attribute is its OID, '#' and the hex of the value's DER.
    tag = _TAGS.get(oid, _UTF8)
    data = value.encode("utf-8")
    if tag != _UTF8 and not value.isascii():
        tag = _UTF8  # not an IA5String or PrintableString after all
    return f"{oid}=#{tag:02x}{_der_length(len(data)).hex()}{data.hex()}"


def _oid(name: str) -> str:
    if name in _OIDS:
        return _OIDS[name]
    if _DOTTED.fullmatch(name):
        return name
    try:
        return ssl._ASN1Object.fromname(name).oid  # OpenSSL's own table, which named it
    except ValueError:
        raise ValueError(f"unknown certificate subject attribute {name!r}") from None


def _der_length(length: int) -> bytes:
    if length < 0x80:
        return bytes([length])
    octets = length.to_bytes((length.bit_length() + 7) // 8, "big")
    return bytes([0x80 | len(octets)]) + octets


def _escape(value: str) -> str:
    """A value escaped as sun.security.x509.AVA.toRFC2253String does it."""
    units = ["\\" + c if c in _ESCAPED else "\\00" if c == "\x00" else c for c in value]
    lead = 0
    while lead < len(units) and units[lead] in (" ", "\r"):
        lead += 1
    trail = len(units)
    while trail > lead and units[trail - 1] in (" ", "\r"):
        trail -= 1
    return "".join("\\" + u if i < lead or i >= trail else u for i, u in enumerate(units))
