"""Loads YAML into :class:`config.model.Config`; every error names the YAML path and value."""

from __future__ import annotations

import ipaddress
import math
import re
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType
from typing import Any, TypeVar

import yaml

from quotas.common import ALL_KINDS, ENFORCE, MODES, PRODUCER_IDS_RATE, SHADOW, USER_LEVEL_ONLY_KINDS
from quotas.entities import QuotaRule
from quotas.limiters import load_limiter_class

from .model import (
    DEFAULT_RATE_LIMITERS,
    FLEET_FALLBACKS,
    QUOTA_ADMIN_DESCRIBE,
    SASL_MECHANISMS,
    Config,
    ConnectionsConfig,
    ControllerMutation,
    FleetConfig,
    LeaderDiscovery,
    ListenConfig,
    ListenTlsConfig,
    MetricsConfig,
    ProducerIdQuota,
    QuotaAdminConfig,
    QuotaEntities,
    QuotaWindows,
    RateLimiterSpec,
    ReloadConfig,
    UpstreamConfig,
    UpstreamSaslConfig,
    UpstreamTlsConfig,
    UsageLogConfig,
    unenforced_kinds,
)

_T = TypeVar("_T")  # what a reader (_int, _number) returns

_SECTIONS = {
    "upstream", "listen", "metrics", "quota_windows", "quota_entities", "quotas",
    "controller_mutation", "producer_id_quota", "rate_limiters", "leader_discovery",
    "usage_log", "connections", "reload", "quota_admin", "mode", "fleet",
}


class ConfigError(ValueError):
    """An invalid configuration. ``str()`` names the YAML path and the offending value."""

    def __init__(self, path: str, message: str) -> None:
        super().__init__(f"{path}: {message}")
        self.path = path


def load_config(file: str | Path) -> Config:
    path = Path(file)
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read: {exc.strerror}") from exc
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(str(path), f"not valid YAML: {exc}") from exc
    return parse_config(data)


def parse_config(data: Any) -> Config:
    root = _mapping(data, "$", _SECTIONS)
    if "upstream" not in root:
        raise ConfigError("upstream", "is required")
    mode = root.get("mode", ENFORCE)
    if mode not in MODES:
        raise ConfigError("mode", f"must be {' or '.join(MODES)}, got {mode!r}")
    quotas = _quotas(root.get("quotas", []), "quotas", mode)
    limiters = _rate_limiters(root.get("rate_limiters"), "rate_limiters")
    _check_limited(quotas, limiters)
    return Config(
        upstream=_upstream(root["upstream"], "upstream"),
        listen=_listen(root.get("listen", {}), "listen"),
        connections=_connections(root.get("connections", {}), "connections"),
        metrics=_metrics(root.get("metrics", {}), "metrics"),
        reload=_reload(root.get("reload", {}), "reload"),
        quota_windows=_quota_windows(root.get("quota_windows", {}), "quota_windows"),
        quota_entities=_quota_entities(root.get("quota_entities", {}), "quota_entities"),
        quotas=quotas,
        controller_mutation=_controller_mutation(root.get("controller_mutation", {}), "controller_mutation"),
        producer_id_quota=_producer_id_quota(root.get("producer_id_quota", {}), "producer_id_quota"),
        rate_limiters=limiters,
        leader_discovery=_leader_discovery(root.get("leader_discovery", {}), "leader_discovery"),
        usage_log=_usage_log(root.get("usage_log", {}), "usage_log"),
        quota_admin=_quota_admin(root.get("quota_admin", {}), "quota_admin"),
        fleet=_fleet(root.get("fleet", {}), "fleet"),
        mode=mode,
    )


def written_sections(data: Any) -> frozenset[str]:
    """The top-level keys of a configuration (as YAML loaded it) that hold a value. A key with
    nothing under it (``quotas:`` alone, YAML's null) is left out: it parses as the section's
    default, exactly as an absent key does, and it is what a file cut just after the key looks
    like. An explicit empty value (``quotas: []``, ``producer_id_quota: {}``) is written."""
    if not isinstance(data, dict):
        return frozenset()
    return frozenset(str(key) for key, value in data.items() if value is not None)


# Kafka's Topic.validate: legal characters and the longest name.
_TOPIC_NAME = re.compile(r"[a-zA-Z0-9._-]{1,249}")
_USER_PREFIX = "User:"  # Kafka's KafkaPrincipal.USER_TYPE, as ACLs and kafka-acls.sh write it


def _quota_admin(data: Any, path: str) -> QuotaAdminConfig:
    d = QuotaAdminConfig()
    m = _mapping(data, path, set(vars(d)))
    raw = m.get("principals", [])
    if not isinstance(raw, list):
        raise ConfigError(f"{path}.principals", f"must be a list of principal names, got {raw!r}")
    principals: list[str] = []
    for i, name in enumerate(raw):
        plain = name.removeprefix(_USER_PREFIX) if isinstance(name, str) else name
        if not isinstance(plain, str) or not plain:
            raise ConfigError(f"{path}.principals[{i}]",
                              f"must be a principal name (alice or User:alice), got {name!r}")
        principals.append(plain)
    describe = m.get("describe", d.describe)
    if describe not in QUOTA_ADMIN_DESCRIBE:
        raise ConfigError(f"{path}.describe", f"must be {' or '.join(QUOTA_ADMIN_DESCRIBE)}, got {describe!r}")
    topic = m.get("topic", d.topic)
    if not isinstance(topic, str) or not _TOPIC_NAME.fullmatch(topic) or topic in (".", ".."):
        raise ConfigError(f"{path}.topic", "must be a Kafka topic name (1 to 249 of a-z A-Z 0-9 . _ -, "
                                           f"not . or ..), got {topic!r}")
    store = m.get("store", d.store)
    if store not in ("topic", "memory"):
        raise ConfigError(f"{path}.store", f"must be topic or memory, got {store!r}")
    return QuotaAdminConfig(
        enabled=_bool(m, "enabled", path, d.enabled),
        store=store,
        principals=tuple(dict.fromkeys(principals)),
        describe=describe,
        topic=topic,
        write_deadline_ms=_int(m, "write_deadline_ms", path, d.write_deadline_ms, 100, 300_000),
    )


def _fleet(data: Any, path: str) -> FleetConfig:
    d = FleetConfig()
    m = _mapping(data, path, set(vars(d)))
    topic = m.get("topic", d.topic)
    if not isinstance(topic, str) or not _TOPIC_NAME.fullmatch(topic) or topic in (".", ".."):
        raise ConfigError(f"{path}.topic", "must be a Kafka topic name (1 to 249 of a-z A-Z 0-9 . _ -, "
                                           f"not . or ..), got {topic!r}")
    fallback = m.get("fallback", d.fallback)
    if fallback not in FLEET_FALLBACKS:
        raise ConfigError(f"{path}.fallback", f"must be {' or '.join(FLEET_FALLBACKS)}, got {fallback!r}")
    instance_id = m.get("instance_id")
    if instance_id is not None and (not isinstance(instance_id, str) or not instance_id
                                    or len(instance_id.encode()) > 255):
        raise ConfigError(f"{path}.instance_id",
                          f"must be a non-empty string of at most 255 bytes, got {instance_id!r}")
    sync_interval_ms = _int(m, "sync_interval_ms", path, d.sync_interval_ms, 10, 60_000)
    member_timeout_ms = _int(m, "member_timeout_ms", path, d.member_timeout_ms, 100, 3_600_000)
    if member_timeout_ms < 2 * sync_interval_ms:
        raise ConfigError(f"{path}.member_timeout_ms", f"must be at least twice sync_interval_ms "
                          f"({sync_interval_ms}), got {member_timeout_ms}: a member would leave between two reports")
    return FleetConfig(
        enabled=_bool(m, "enabled", path, d.enabled),
        topic=topic,
        partitions=_int(m, "partitions", path, d.partitions, 1, 1000),
        retention_ms=_int(m, "retention_ms", path, d.retention_ms, 60_000, 7 * 86_400_000),
        sync_interval_ms=sync_interval_ms,
        member_timeout_ms=member_timeout_ms,
        fallback=fallback,
        instance_id=instance_id,
    )


def _usage_log(data: Any, path: str) -> UsageLogConfig:
    d = UsageLogConfig()
    m = _mapping(data, path, set(vars(d)))
    directory = m.get("directory")
    if directory is not None and (not isinstance(directory, str) or not directory):
        raise ConfigError(f"{path}.directory", f"must be a directory path, got {directory!r}")
    name = m.get("proxy_name", "")
    if not isinstance(name, str):
        raise ConfigError(f"{path}.proxy_name", f"must be a string, got {name!r}")
    return UsageLogConfig(
        directory=directory,
        interval_seconds=_int(m, "interval_seconds", path, d.interval_seconds, 1, 3600),
        max_keys_per_interval=_int(m, "max_keys_per_interval", path, d.max_keys_per_interval, 1, 10_000_000),
        count_fetch_records=_bool(m, "count_fetch_records", path, d.count_fetch_records),
        proxy_name=name,
        max_pending_intervals=_int(m, "max_pending_intervals", path, d.max_pending_intervals, 1, 100_000),
    )


def _leader_discovery(data: Any, path: str) -> LeaderDiscovery:
    d = LeaderDiscovery()
    m = _mapping(data, path, set(vars(d)))
    return LeaderDiscovery(
        fill_hints=_bool(m, "fill_hints", path, d.fill_hints),
        uplift=_bool(m, "uplift", path, d.uplift),
        expedited_refresh_min_interval_ms=_int(
            m, "expedited_refresh_min_interval_ms", path, d.expedited_refresh_min_interval_ms, 0, 600_000
        ),
        hint_wait_ms=_int(m, "hint_wait_ms", path, d.hint_wait_ms, 0, 60_000),
    )


def _producer_id_quota(data: Any, path: str) -> ProducerIdQuota:
    d = ProducerIdQuota()
    m = _mapping(data, path, set(vars(d)))
    fpr = m.get("producer_id_quota_false_positive_rate", d.producer_id_quota_false_positive_rate)
    if not isinstance(fpr, (int, float)) or isinstance(fpr, bool) or not 0 < fpr < 1:
        raise ConfigError(f"{path}.producer_id_quota_false_positive_rate", f"must be a number in (0, 1), got {fpr!r}")
    reaction = m.get("reaction", d.reaction)
    if reaction not in ("reject", "delay"):
        raise ConfigError(f"{path}.reaction", f"must be reject or delay, got {reaction!r}")
    return ProducerIdQuota(
        # KIP-936 declares an Int; fractions are accepted so short windows can be tried out.
        producer_id_quota_window_size_seconds=_number(
            m, "producer_id_quota_window_size_seconds", path, d.producer_id_quota_window_size_seconds, 0.001
        ),
        producer_id_quota_window_num=_int(
            m, "producer_id_quota_window_num", path, d.producer_id_quota_window_num, 1, 1000
        ),
        producer_id_quota_cache_layer_count=_int(
            m, "producer_id_quota_cache_layer_count", path, d.producer_id_quota_cache_layer_count, 1, 1000
        ),
        producer_id_quota_false_positive_rate=float(fpr),
        producer_id_quota_cache_cleanup_interval_ms=_int(
            m, "producer_id_quota_cache_cleanup_interval_ms", path, d.producer_id_quota_cache_cleanup_interval_ms,
            1, 3_600_000
        ),
        reaction=reaction,
    )


def _rate_limiters(data: Any, path: str) -> tuple[RateLimiterSpec, ...]:
    """A list of ``package.module:ClassName``, or of ``{class: ..., config: {...}}``."""
    if data is None:
        return DEFAULT_RATE_LIMITERS
    if not isinstance(data, list):
        raise ConfigError(path, f"must be a list of package.module:ClassName, got {data!r}")
    specs: list[RateLimiterSpec] = []
    for i, entry in enumerate(data):
        p = f"{path}[{i}]"
        settings: dict[str, Any] = {}
        if isinstance(entry, dict):
            m = _mapping(entry, p, {"class", "config"})
            if "class" not in m:
                raise ConfigError(f"{p}.class", "is required")
            target = m["class"]
            settings = m.get("config") or {}
            if not isinstance(settings, dict):
                raise ConfigError(f"{p}.config", f"must be a mapping, got {settings!r}")
            p = f"{p}.class"
        else:
            target = entry
        if not isinstance(target, str):
            raise ConfigError(p, f"must be package.module:ClassName, got {target!r}")
        try:
            cls = load_limiter_class(target)
        except ValueError as exc:
            raise ConfigError(p, str(exc)) from exc
        if any(s.target == target for s in specs):
            raise ConfigError(p, f"{target} is listed twice")
        try:
            cls.check_settings(MappingProxyType(settings))
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{path}[{i}].config", str(exc)) from exc
        specs.append(RateLimiterSpec(target, cls, MappingProxyType(settings)))
    return tuple(specs)


def _check_limited(rules: tuple[QuotaRule, ...], limiters: tuple[RateLimiterSpec, ...]) -> None:
    """A record or batch quota needs a limiter that enforces it, or it would silently do nothing."""
    unenforced = unenforced_kinds(limiters)
    for i, rule in enumerate(rules):
        for kind in sorted(unenforced & rule.values.keys()):
            raise ConfigError(
                f"quotas[{i}].{kind}",
                "no configured rate limiter enforces it; add quotas.limiters:RecordRateLimiter "
                "(records) or quotas.limiters:BatchRateLimiter (batches) to rate_limiters",
            )


def _controller_mutation(data: Any, path: str) -> ControllerMutation:
    m = _mapping(data, path, {"num_partitions_fallback"})
    d = ControllerMutation()
    return ControllerMutation(
        num_partitions_fallback=_int(m, "num_partitions_fallback", path, d.num_partitions_fallback, 1, 1_000_000)
    )


def _quota_windows(data: Any, path: str) -> QuotaWindows:
    d = QuotaWindows()
    m = _mapping(data, path, set(vars(d)))
    return QuotaWindows(**{k: _int(m, k, path, getattr(d, k), 1, 3600) for k in vars(d)})


def _quota_entities(data: Any, path: str) -> QuotaEntities:
    d = QuotaEntities()
    m = _mapping(data, path, {"idle_seconds", "max_live"})
    return QuotaEntities(
        idle_seconds=_number(m, "idle_seconds", path, d.idle_seconds, 1.0),
        max_live=_int(m, "max_live", path, d.max_live, 1, 10_000_000),
    )


def parse_quotas(data: Any, path: str = "quotas", mode: str = ENFORCE) -> tuple[QuotaRule, ...]:
    """A configuration's ``quotas:`` list (as YAML loaded it) as rules, an entry without a
    ``mode`` of its own in ``mode``; ConfigError naming the YAML path (``quotas[2].user``)
    otherwise. Public for ``kafka-quota-proxy quotas apply``."""
    return _quotas(data, path, mode)


def _quotas(data: Any, path: str, mode: str = ENFORCE) -> tuple[QuotaRule, ...]:
    if data is None:
        return ()
    if not isinstance(data, list):
        raise ConfigError(path, f"must be a list of quota entries, got {data!r}")
    rules: list[QuotaRule] = []
    seen: dict[tuple[str | None, str | None], int] = {}
    key: str | tuple[str | None, str | None]  # a YAML key in the entity loop, then the (user, client_id) pair
    for i, entry in enumerate(data):
        p = f"{path}[{i}]"
        m = _mapping(entry, p, {"user", "client_id", "mode", *ALL_KINDS})
        entry_mode = m.get("mode", mode)
        if entry_mode not in MODES:
            raise ConfigError(f"{p}.mode", f"must be {' or '.join(MODES)}, got {entry_mode!r}")
        entity = {}
        for key in ("user", "client_id"):
            if key in m:
                if not isinstance(m[key], str) or not m[key]:
                    raise ConfigError(f"{p}.{key}", f"must be a name, \"<default>\" or a glob, got {m[key]!r}")
                entity[key] = m[key]
        if not entity:
            raise ConfigError(p, "needs user, client_id or both")
        values = {}
        for kind in sorted(ALL_KINDS & m.keys()):
            v = m[kind]
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v <= 0:
                raise ConfigError(f"{p}.{kind}", f"must be a positive number, got {v!r}")
            values[kind] = float(v)
        if values.get(PRODUCER_IDS_RATE, 1) < 1:
            # A token is a whole producer id; a bucket of less than one never admits one.
            raise ConfigError(f"{p}.producer_ids_rate",
                              f"must be at least 1 (new producer ids per window), got {m[PRODUCER_IDS_RATE]!r}")
        if not values:
            raise ConfigError(p, f"sets no quota (one of: {', '.join(sorted(ALL_KINDS))})")
        # KIP-936: producer_ids_rate is a user-level quota only.
        if USER_LEVEL_ONLY_KINDS & values.keys() and "client_id" in entity:
            raise ConfigError(f"{p}.producer_ids_rate", "applies to users only; remove client_id")
        if "user" in entity and "client_id" not in entity and any(c in entity["user"] for c in "*?["):
            raise ConfigError(f"{p}.user", f"globs apply to client ids only, got {entity['user']!r}")
        key = (entity.get("user"), entity.get("client_id"))
        if key in seen:
            raise ConfigError(p, f"same entity as {path}[{seen[key]}]: merge them")
        seen[key] = i
        rules.append(QuotaRule(entity.get("user"), entity.get("client_id"), values, shadow=entry_mode == SHADOW))
    return tuple(rules)


def _upstream(data: Any, path: str) -> UpstreamConfig:
    m = _mapping(
        data,
        path,
        {"bootstrap_servers", "connect_timeout_s", "connect_attempts", "metadata_refresh_interval_s", "tls", "sasl"},
    )
    servers = m.get("bootstrap_servers")
    p = f"{path}.bootstrap_servers"
    if not isinstance(servers, list) or not servers:
        raise ConfigError(p, f"must be a non-empty list of host:port, got {servers!r}")
    for i, s in enumerate(servers):
        _host_port(s, f"{p}[{i}]")
    d = UpstreamConfig(bootstrap_servers=("",))
    return UpstreamConfig(
        bootstrap_servers=tuple(servers),
        connect_timeout_s=_number(m, "connect_timeout_s", path, d.connect_timeout_s, 0.001),
        connect_attempts=_int(m, "connect_attempts", path, d.connect_attempts, 1, 100),
        metadata_refresh_interval_s=_number(
            m, "metadata_refresh_interval_s", path, d.metadata_refresh_interval_s, 0.1
        ),
        tls=_upstream_tls(m["tls"], f"{path}.tls") if m.get("tls") is not None else None,
        sasl=_upstream_sasl(m["sasl"], f"{path}.sasl") if m.get("sasl") is not None else None,
    )


def _upstream_tls(data: Any, path: str) -> UpstreamTlsConfig:
    """Like listen.tls, the files are checked where they are loaded (proxy.tls)."""
    m = _mapping(data, path, {"ca", "verify_hostname", "certificate", "key", "key_password_file",
                              "key_password_env", "key_password"})
    _no_inline_secret(m, path, "key_password", "key_password_file or key_password_env")
    for name in ("ca", "certificate", "key"):
        _optional_str(m, name, path)
    if ("certificate" in m) != ("key" in m):
        missing = "key" if "certificate" in m else "certificate"
        raise ConfigError(f"{path}.{missing}", "a client certificate needs both certificate and key")
    _one_source(m, path, "key_password_file", "key_password_env")
    for name in ("key_password_file", "key_password_env"):
        _optional_str(m, name, path)
    return UpstreamTlsConfig(
        ca=m.get("ca"),
        verify_hostname=_bool(m, "verify_hostname", path, True),
        certificate=m.get("certificate"),
        key=m.get("key"),
        key_password_file=m.get("key_password_file"),
        key_password_env=m.get("key_password_env"),
    )


def _upstream_sasl(data: Any, path: str) -> UpstreamSaslConfig:
    m = _mapping(data, path, {"mechanism", "username", "password_file", "password_env", "token_file",
                              "token_env", "password", "token"})
    _no_inline_secret(m, path, "password", "password_file or password_env")
    _no_inline_secret(m, path, "token", "token_file or token_env")
    mechanism = m.get("mechanism")
    if mechanism not in SASL_MECHANISMS:
        raise ConfigError(f"{path}.mechanism", f"must be one of {', '.join(SASL_MECHANISMS)}, got {mechanism!r}")
    for name in ("username", "password_file", "password_env", "token_file", "token_env"):
        _optional_str(m, name, path)
    if mechanism == "OAUTHBEARER":
        for name in ("username", "password_file", "password_env"):
            if name in m:
                raise ConfigError(f"{path}.{name}", "OAUTHBEARER takes token_file or token_env, not a password")
        _one_source(m, path, "token_file", "token_env", required=True)
    else:
        for name in ("token_file", "token_env"):
            if name in m:
                raise ConfigError(f"{path}.{name}", f"{mechanism} takes a username and a password, not a token")
        if "username" not in m:
            raise ConfigError(f"{path}.username", f"{mechanism} needs a username")
        _one_source(m, path, "password_file", "password_env", required=True)
    return UpstreamSaslConfig(
        mechanism=mechanism,
        username=m.get("username"),
        password_file=m.get("password_file"),
        password_env=m.get("password_env"),
        token_file=m.get("token_file"),
        token_env=m.get("token_env"),
    )


def _no_inline_secret(m: dict[str, Any], path: str, key: str, instead: str) -> None:
    if key in m:
        raise ConfigError(f"{path}.{key}", f"secrets are never inline: use {instead}")


def _optional_str(m: dict[str, Any], key: str, path: str) -> None:
    if key in m and (not isinstance(m[key], str) or not m[key]):
        raise ConfigError(f"{path}.{key}", f"must be a non-empty string, got {m[key]!r}")


def _one_source(m: dict[str, Any], path: str, file_key: str, env_key: str, required: bool = False) -> None:
    if file_key in m and env_key in m:
        raise ConfigError(f"{path}.{env_key}", f"give {file_key} or {env_key}, not both")
    if required and file_key not in m and env_key not in m:
        raise ConfigError(f"{path}.{file_key}", f"is required (or {env_key})")


def _listen(data: Any, path: str) -> ListenConfig:
    m = _mapping(
        data,
        path,
        {"host", "advertised_host", "bootstrap_port", "broker_port_base", "node_ports", "max_frame_bytes", "tls"},
    )
    d = ListenConfig()
    node_ports_raw = m.get("node_ports", {})
    p = f"{path}.node_ports"
    if not isinstance(node_ports_raw, dict):
        raise ConfigError(p, f"must be a mapping of node id to port, got {node_ports_raw!r}")
    node_ports = {}
    for k, v in node_ports_raw.items():
        if not isinstance(k, int) or isinstance(k, bool) or k < 0:
            raise ConfigError(f"{p}.{k}", f"node id must be a non-negative integer, got {k!r}")
        node_ports[k] = _port_value(v, f"{p}.{k}")
    return ListenConfig(
        host=_str(m, "host", path, d.host),
        advertised_host=_str(m, "advertised_host", path, d.advertised_host),
        bootstrap_port=_int(m, "bootstrap_port", path, d.bootstrap_port, 0, 65535),
        broker_port_base=_int(m, "broker_port_base", path, d.broker_port_base, 0, 65535),
        node_ports=MappingProxyType(node_ports),
        max_frame_bytes=_int(m, "max_frame_bytes", path, d.max_frame_bytes, 1024, 2**31 - 1),
        tls=_listen_tls(m["tls"], f"{path}.tls") if m.get("tls") is not None else None,
    )


_CLIENT_AUTH = ("none", "requested", "required")


def _listen_tls(data: Any, path: str) -> ListenTlsConfig:
    """The files are checked where they are loaded (proxy.tls), so check-config and a start
    report a missing or broken one with this path too."""
    m = _mapping(data, path, {"certificate", "key", "key_password_file", "key_password_env", "client_auth", "ca",
                              "handshake_timeout_ms", "principal_mapping_rules", "key_password"})
    _no_inline_secret(m, path, "key_password", "key_password_file or key_password_env")
    for required in ("certificate", "key"):
        if not isinstance(m.get(required), str) or not m[required]:
            raise ConfigError(f"{path}.{required}", f"a PEM file path is required, got {m.get(required)!r}")
    d = ListenTlsConfig(certificate="", key="")
    client_auth = _str(m, "client_auth", path, d.client_auth)
    if client_auth not in _CLIENT_AUTH:
        raise ConfigError(f"{path}.client_auth", f"must be one of {', '.join(_CLIENT_AUTH)}, got {client_auth!r}")
    ca = m.get("ca")
    if ca is not None and (not isinstance(ca, str) or not ca):
        raise ConfigError(f"{path}.ca", f"must be a PEM file path, got {ca!r}")
    if client_auth != "none" and ca is None:
        raise ConfigError(f"{path}.ca", f"client_auth {client_auth} needs the CA bundle client certificates chain to")
    _one_source(m, path, "key_password_file", "key_password_env")
    for name in ("key_password_file", "key_password_env"):
        _optional_str(m, name, path)
    return ListenTlsConfig(
        certificate=m["certificate"],
        key=m["key"],
        key_password_file=m.get("key_password_file"),
        key_password_env=m.get("key_password_env"),
        client_auth=client_auth,
        ca=ca,
        handshake_timeout_ms=_int(m, "handshake_timeout_ms", path, d.handshake_timeout_ms, 100, 300_000),
        principal_mapping_rules=_str(m, "principal_mapping_rules", path, d.principal_mapping_rules),
    )


def _metrics(data: Any, path: str) -> MetricsConfig:
    d = MetricsConfig()
    m = _mapping(data, path, set(vars(d)))
    return MetricsConfig(
        host=_str(m, "host", path, d.host),
        port=_int(m, "port", path, d.port, 0, 65535),
        enabled=_bool(m, "enabled", path, d.enabled),
        max_entity_series=_int(m, "max_entity_series", path, d.max_entity_series, 1, 1_000_000),
    )


def _connections(data: Any, path: str) -> ConnectionsConfig:
    d = ConnectionsConfig()
    m = _mapping(data, path, set(vars(d)))
    day_ms = 86_400_000
    return ConnectionsConfig(
        connections_max_idle_ms=_int(m, "connections_max_idle_ms", path, d.connections_max_idle_ms, 1, day_ms),
        partial_request_timeout_ms=_int(m, "partial_request_timeout_ms", path, d.partial_request_timeout_ms, 1, day_ms),
        max_connections=_optional(m, "max_connections", path, d.max_connections, _int, 1, 2**31 - 1),
        max_connections_per_ip=_optional(
            m, "max_connections_per_ip", path, d.max_connections_per_ip, _int, 0, 2**31 - 1
        ),
        max_connections_per_ip_overrides=_per_ip(m, "max_connections_per_ip_overrides", path, _int, 0, 2**31 - 1),
        max_connection_creation_rate=_optional(
            m, "max_connection_creation_rate", path, d.max_connection_creation_rate, _number, 0.001),
        connection_creation_rate=_optional(
            m, "connection_creation_rate", path, d.connection_creation_rate, _number, 0.001),
        connection_creation_rate_overrides=_per_ip(m, "connection_creation_rate_overrides", path, _number, 0.001),
        queued_max_request_bytes=_int(m, "queued_max_request_bytes", path, d.queued_max_request_bytes, 1024, 2**40),
    )


def _optional(
    m: dict[str, Any], key: str, path: str, default: _T | None, read: Callable[..., _T], *bounds: float
) -> _T | None:
    """``read(m, key, path, default, *bounds)``, or None when the key is null (no limit)."""
    if m.get(key, default) is None:
        return None
    return read(m, key, path, default, *bounds)


def _per_ip(
    m: dict[str, Any], key: str, path: str, read: Callable[..., _T], *bounds: float
) -> MappingProxyType[str, _T]:
    """A mapping of IP address to a number (``read`` checks each)."""
    raw = m.get(key) or {}
    p = f"{path}.{key}"
    if not isinstance(raw, dict):
        raise ConfigError(p, f"must be a mapping of IP address to a number, got {raw!r}")
    out = {}
    for ip, value in raw.items():
        try:
            address = ipaddress.ip_address(str(ip))
        except ValueError:
            raise ConfigError(f"{p}.{ip}", f"must be an IP address, got {ip!r}") from None
        out[str(address)] = read({ip: value}, ip, p, None, *bounds)
    return MappingProxyType(out)


def _reload(data: Any, path: str) -> ReloadConfig:
    d = ReloadConfig()
    m = _mapping(data, path, set(vars(d)))
    return ReloadConfig(
        debounce_ms=_int(m, "debounce_ms", path, d.debounce_ms, 0, 60_000),
        require_atomic_rename=_bool(m, "require_atomic_rename", path, d.require_atomic_rename),
    )


def _mapping(data: Any, path: str, allowed: set[str]) -> dict[str, Any]:
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(path, f"must be a mapping, got {data!r}")
    for key in data:
        if key not in allowed:
            where = key if path == "$" else f"{path}.{key}"
            raise ConfigError(where, f"unknown key (allowed: {', '.join(sorted(allowed))})")
    return data


def _str(m: dict[str, Any], key: str, path: str, default: str) -> str:
    v = m.get(key, default)
    if not isinstance(v, str) or not v:
        raise ConfigError(f"{path}.{key}", f"must be a non-empty string, got {v!r}")
    return v


def _bool(m: dict[str, Any], key: str, path: str, default: bool) -> bool:
    v = m.get(key, default)
    if not isinstance(v, bool):
        raise ConfigError(f"{path}.{key}", f"must be true or false, got {v!r}")
    return v


def _int(m: dict[str, Any], key: str, path: str, default: int, lo: int, hi: int) -> int:
    v = m.get(key, default)
    if not isinstance(v, int) or isinstance(v, bool) or not lo <= v <= hi:
        raise ConfigError(f"{path}.{key}", f"must be an integer in [{lo}, {hi}], got {v!r}")
    return v


def _number(m: dict[str, Any], key: str, path: str, default: float, lo: float) -> float:
    v = m.get(key, default)
    if not isinstance(v, (int, float)) or isinstance(v, bool) or not math.isfinite(v) or v < lo:
        raise ConfigError(f"{path}.{key}", f"must be a finite number >= {lo}, got {v!r}")
    return float(v)


def _port_value(v: Any, path: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not 0 <= v <= 65535:
        raise ConfigError(path, f"must be a port in [0, 65535], got {v!r}")
    return v


def _host_port(s: Any, path: str) -> tuple[str, int]:
    if not isinstance(s, str) or ":" not in s:
        raise ConfigError(path, f"must be host:port, got {s!r}")
    host, _, port = s.rpartition(":")
    host = host.strip("[]")
    if not host or not port.isdigit() or not 0 < int(port) <= 65535:
        raise ConfigError(path, f"must be host:port, got {s!r}")
    return host, int(port)


def split_host_port(s: str) -> tuple[str, int]:
    """Splits a validated ``host:port`` (IPv6 in brackets allowed)."""
    return _host_port(s, "host:port")
