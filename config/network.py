"""The sections that say where the proxy listens and how it reaches the brokers: ``upstream``
(with its TLS and SASL), ``listen`` (with its TLS), ``metrics`` and ``connections``. Every error
names its YAML path and value (config.validation); no secret may be written inline.
"""

from __future__ import annotations

import ipaddress
from collections.abc import Callable
from types import MappingProxyType
from typing import Any, TypeVar

from .model import (
    SASL_MECHANISMS,
    ConnectionsConfig,
    ListenConfig,
    ListenTlsConfig,
    MetricsConfig,
    UpstreamConfig,
    UpstreamSaslConfig,
    UpstreamTlsConfig,
)
from .validation import (
    host_port,
    invalid,
    mapping,
    port_value,
    read_bool,
    read_int,
    read_number,
    read_optional,
    read_optional_str,
    read_str,
    section,
)

_T = TypeVar("_T")  # what a reader (read_int, read_number) returns
# What an upstream section that is not even a mapping reads as, so that the rest of the file is still read.
NO_UPSTREAM = UpstreamConfig(bootstrap_servers=())


def read_upstream(data: Any, path: str) -> UpstreamConfig:
    m = section(
        data,
        path,
        {"bootstrap_servers", "connect_timeout_s", "connect_attempts", "metadata_refresh_interval_s", "tls", "sasl"},
    )
    if m is None:
        return NO_UPSTREAM
    servers = m.get("bootstrap_servers")
    p = f"{path}.bootstrap_servers"
    if not isinstance(servers, list) or not servers:
        servers = invalid(p, f"must be a non-empty list of host:port, got {servers!r}", [])
    for i, s in enumerate(servers):
        host_port(s, f"{p}[{i}]")
    d = UpstreamConfig(bootstrap_servers=("",))
    return UpstreamConfig(
        bootstrap_servers=tuple(servers),
        connect_timeout_s=read_number(m, "connect_timeout_s", path, d.connect_timeout_s, 0.001),
        connect_attempts=read_int(m, "connect_attempts", path, d.connect_attempts, 1, 100),
        metadata_refresh_interval_s=read_number(
            m, "metadata_refresh_interval_s", path, d.metadata_refresh_interval_s, 0.1
        ),
        tls=_upstream_tls(m["tls"], f"{path}.tls") if m.get("tls") is not None else None,
        sasl=_upstream_sasl(m["sasl"], f"{path}.sasl") if m.get("sasl") is not None else None,
    )


def _upstream_tls(data: Any, path: str) -> UpstreamTlsConfig:
    """Like listen.tls, the files are checked where they are loaded (proxy.identity.tls)."""
    m = mapping(data, path, {"ca", "verify_hostname", "certificate", "key", "key_password_file",
                             "key_password_env", "key_password"})
    _no_inline_secret(m, path, "key_password", "key_password_file or key_password_env")
    for name in ("ca", "certificate", "key"):
        read_optional_str(m, name, path)
    if ("certificate" in m) != ("key" in m):
        missing = "key" if "certificate" in m else "certificate"
        invalid(f"{path}.{missing}", "a client certificate needs both certificate and key", None)
    _one_source(m, path, "key_password_file", "key_password_env")
    for name in ("key_password_file", "key_password_env"):
        read_optional_str(m, name, path)
    return UpstreamTlsConfig(
        ca=m.get("ca"),
        verify_hostname=read_bool(m, "verify_hostname", path, True),
        certificate=m.get("certificate"),
        key=m.get("key"),
        key_password_file=m.get("key_password_file"),
        key_password_env=m.get("key_password_env"),
    )


def _upstream_sasl(data: Any, path: str) -> UpstreamSaslConfig:
    m = section(data, path, {"mechanism", "username", "password_file", "password_env", "token_file",
                              "token_env", "password", "token"})
    if m is None:
        return UpstreamSaslConfig(mechanism="PLAIN")
    _no_inline_secret(m, path, "password", "password_file or password_env")
    _no_inline_secret(m, path, "token", "token_file or token_env")
    mechanism = m.get("mechanism")
    if mechanism not in SASL_MECHANISMS:
        invalid(f"{path}.mechanism", f"must be one of {', '.join(SASL_MECHANISMS)}, got {mechanism!r}", None)
    for name in ("username", "password_file", "password_env", "token_file", "token_env"):
        read_optional_str(m, name, path)
    if mechanism == "OAUTHBEARER":
        for name in ("username", "password_file", "password_env"):
            if name in m:
                invalid(f"{path}.{name}", "OAUTHBEARER takes token_file or token_env, not a password", None)
        _one_source(m, path, "token_file", "token_env", required=True)
    elif mechanism in SASL_MECHANISMS:
        for name in ("token_file", "token_env"):
            if name in m:
                invalid(f"{path}.{name}", f"{mechanism} takes a username and a password, not a token", None)
        if "username" not in m:
            invalid(f"{path}.username", f"{mechanism} needs a username", None)
        _one_source(m, path, "password_file", "password_env", required=True)
    return UpstreamSaslConfig(
        mechanism=mechanism if mechanism in SASL_MECHANISMS else "PLAIN",
        username=m.get("username"),
        password_file=m.get("password_file"),
        password_env=m.get("password_env"),
        token_file=m.get("token_file"),
        token_env=m.get("token_env"),
    )


def _no_inline_secret(m: dict[str, Any], path: str, key: str, instead: str) -> None:
    if key in m:
        invalid(f"{path}.{key}", f"secrets are never inline: use {instead}", None)


def _one_source(m: dict[str, Any], path: str, file_key: str, env_key: str, required: bool = False) -> None:
    if file_key in m and env_key in m:
        invalid(f"{path}.{env_key}", f"give {file_key} or {env_key}, not both", None)
    elif required and file_key not in m and env_key not in m:
        invalid(f"{path}.{file_key}", f"is required (or {env_key})", None)


def read_listen(data: Any, path: str) -> ListenConfig:
    m = mapping(
        data,
        path,
        {"host", "advertised_host", "bootstrap_port", "broker_port_base", "node_ports", "max_frame_bytes", "tls"},
    )
    d = ListenConfig()
    node_ports_raw = m.get("node_ports", {})
    p = f"{path}.node_ports"
    if not isinstance(node_ports_raw, dict):
        node_ports_raw = invalid(p, f"must be a mapping of node id to port, got {node_ports_raw!r}", {})
    node_ports = {}
    for k, v in node_ports_raw.items():
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            invalid(f"{p}.{k}", f"node id must be a non-negative integer, got {k!r}", None)
            continue
        node_ports[k] = port_value(v, f"{p}.{k}")
    return ListenConfig(
        host=read_str(m, "host", path, d.host),
        advertised_host=read_str(m, "advertised_host", path, d.advertised_host),
        bootstrap_port=read_int(m, "bootstrap_port", path, d.bootstrap_port, 0, 65535),
        broker_port_base=read_int(m, "broker_port_base", path, d.broker_port_base, 0, 65535),
        node_ports=MappingProxyType(node_ports),
        max_frame_bytes=read_int(m, "max_frame_bytes", path, d.max_frame_bytes, 1024, 2**31 - 1),
        tls=_listen_tls(m["tls"], f"{path}.tls") if m.get("tls") is not None else None,
    )


_CLIENT_AUTH = ("none", "requested", "required")


def _listen_tls(data: Any, path: str) -> ListenTlsConfig:
    """The files are checked where they are loaded (proxy.identity.tls), so check-config and a start
    report a missing or broken one with this path too."""
    d = ListenTlsConfig(certificate="", key="")
    m = section(data, path, {"certificate", "key", "key_password_file", "key_password_env", "client_auth", "ca",
                              "handshake_timeout_ms", "principal_mapping_rules", "key_password"})
    if m is None:
        return d
    _no_inline_secret(m, path, "key_password", "key_password_file or key_password_env")
    for required in ("certificate", "key"):
        if not isinstance(m.get(required), str) or not m[required]:
            invalid(f"{path}.{required}", f"a PEM file path is required, got {m.get(required)!r}", None)
    client_auth = read_str(m, "client_auth", path, d.client_auth)
    if client_auth not in _CLIENT_AUTH:
        client_auth = invalid(f"{path}.client_auth", f"must be one of {', '.join(_CLIENT_AUTH)}, got {client_auth!r}",
                              d.client_auth)
    ca = m.get("ca")
    if ca is not None and (not isinstance(ca, str) or not ca):
        invalid(f"{path}.ca", f"must be a PEM file path, got {ca!r}", None)
    elif client_auth != "none" and ca is None:
        invalid(f"{path}.ca", f"client_auth {client_auth} needs the CA bundle client certificates chain to", None)
    _one_source(m, path, "key_password_file", "key_password_env")
    for name in ("key_password_file", "key_password_env"):
        read_optional_str(m, name, path)
    return ListenTlsConfig(
        certificate=m.get("certificate", ""),
        key=m.get("key", ""),
        key_password_file=m.get("key_password_file"),
        key_password_env=m.get("key_password_env"),
        client_auth=client_auth,
        ca=ca,
        handshake_timeout_ms=read_int(m, "handshake_timeout_ms", path, d.handshake_timeout_ms, 100, 300_000),
        principal_mapping_rules=read_str(m, "principal_mapping_rules", path, d.principal_mapping_rules),
    )


def read_metrics(data: Any, path: str) -> MetricsConfig:
    d = MetricsConfig()
    m = mapping(data, path, set(vars(d)))
    return MetricsConfig(
        host=read_str(m, "host", path, d.host),
        port=read_int(m, "port", path, d.port, 0, 65535),
        enabled=read_bool(m, "enabled", path, d.enabled),
        max_entity_series=read_int(m, "max_entity_series", path, d.max_entity_series, 1, 1_000_000),
    )


def read_connections(data: Any, path: str) -> ConnectionsConfig:
    d = ConnectionsConfig()
    m = mapping(data, path, set(vars(d)))
    day_ms = 86_400_000
    return ConnectionsConfig(
        connections_max_idle_ms=read_int(m, "connections_max_idle_ms", path, d.connections_max_idle_ms, 1, day_ms),
        partial_request_timeout_ms=read_int(
            m, "partial_request_timeout_ms", path, d.partial_request_timeout_ms, 1, day_ms),
        max_connections=read_optional(m, "max_connections", path, d.max_connections, read_int, 1, 2**31 - 1),
        max_connections_per_ip=read_optional(
            m, "max_connections_per_ip", path, d.max_connections_per_ip, read_int, 0, 2**31 - 1
        ),
        max_connections_per_ip_overrides=_per_ip(m, "max_connections_per_ip_overrides", path, read_int, 0, 2**31 - 1),
        max_connection_creation_rate=read_optional(
            m, "max_connection_creation_rate", path, d.max_connection_creation_rate, read_number, 0.001),
        connection_creation_rate=read_optional(
            m, "connection_creation_rate", path, d.connection_creation_rate, read_number, 0.001),
        connection_creation_rate_overrides=_per_ip(m, "connection_creation_rate_overrides", path, read_number, 0.001),
        queued_max_request_bytes=read_int(
            m, "queued_max_request_bytes", path, d.queued_max_request_bytes, 1024, 2**40),
    )


def _per_ip(
    m: dict[str, Any], key: str, path: str, read: Callable[..., _T], *bounds: float
) -> MappingProxyType[str, _T]:
    """A mapping of IP address to a number (``read`` checks each)."""
    raw = m.get(key) or {}
    p = f"{path}.{key}"
    if not isinstance(raw, dict):
        return invalid(p, f"must be a mapping of IP address to a number, got {raw!r}", MappingProxyType({}))
    out = {}
    for ip, value in raw.items():
        try:
            address = ipaddress.ip_address(str(ip))
        except ValueError:
            invalid(f"{p}.{ip}", f"must be an IP address, got {ip!r}", None)
            continue
        out[str(address)] = read({ip: value}, ip, p, None, *bounds)
    return MappingProxyType(out)
