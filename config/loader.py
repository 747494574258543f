"""Loads YAML into :class:`config.model.Config`; every error names the YAML path and value, and
every error of a file is reported at once (``config.validation``)."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import MappingProxyType
from typing import Any

import yaml

from quotas.common import ALL_KINDS, ENFORCE, MODES, PRODUCER_IDS_RATE, SHADOW, USER_LEVEL_ONLY_KINDS
from quotas.entities import QuotaRule
from quotas.fleet import MAX_RECORD_ENTRIES
from quotas.limiters import load_limiter_class

from .filters import read_filters
from .model import (
    DEFAULT_RATE_LIMITERS,
    FLEET_AGGREGATIONS,
    FLEET_FALLBACKS,
    HEARTBEAT_INTERVAL_MS,
    MAX_WORKERS,
    QUOTA_ADMIN_DESCRIBE,
    Config,
    ControllerMutation,
    FleetConfig,
    LeaderDiscovery,
    ProducerIdQuota,
    QuotaAdminConfig,
    QuotaEntities,
    QuotaWindows,
    RateLimiterSpec,
    ReloadConfig,
    UsageLogConfig,
    WorkersConfig,
    unenforced_kinds,
)
from .network import NO_UPSTREAM, read_connections, read_listen, read_metrics, read_upstream
from .validation import ConfigError as ConfigError
from .validation import ConfigErrors as ConfigErrors
from .validation import (
    as_int,
    as_number,
    collecting,
    errors_so_far,
    invalid,
    mapping,
    read_bool,
    read_int,
    read_number,
    suggestion,
)
from .validation import split_host_port as split_host_port

_SECTIONS = {
    "upstream", "listen", "metrics", "quota_windows", "quota_entities", "quotas",
    "controller_mutation", "producer_id_quota", "rate_limiters", "leader_discovery",
    "usage_log", "connections", "reload", "quota_admin", "mode", "fleet", "filters",
    "workers",
}


def load_config(file: str | Path, filters: bool = True) -> Config:
    """The configuration in ``file`` (see parse_config)."""
    path = Path(file)
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise ConfigError(str(path), f"cannot read: {exc.strerror}") from exc
    return parse_config(yaml_document(str(path), data), filters)


def yaml_document(path: str, data: bytes) -> Any:
    """``data``, the bytes of the file at ``path``, as YAML loads it; ConfigError naming ``path``
    when it is not UTF-8 or not YAML (an integer too long for Python to read included), its
    line and column marks naming ``path`` too."""
    try:
        return yaml.safe_load(data.decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(path, f"not UTF-8: {exc}") from exc
    except (yaml.YAMLError, ValueError) as exc:
        if isinstance(exc, yaml.MarkedYAMLError):
            # PyYAML names a string's marks "<unicode string>"; a file's would lose the snippet.
            for mark in (exc.context_mark, exc.problem_mark):
                if mark is not None:
                    mark.name = path
        raise ConfigError(path, f"not valid YAML: {exc}") from exc


def parse_config(data: Any, filters: bool = True) -> Config:
    """``data`` (a configuration as YAML loaded it) as a Config. Raises ConfigError naming the YAML
    path and value; with several errors, ConfigErrors holding each (``.errors``), in file order.
    ``filters`` False leaves ``filters:`` unread (no plug-in imported or called): for readers of
    the quotas, such as the pipeline, which must not load the proxy's code."""
    with collecting():
        config = _config(data, filters)
    return config


def _config(data: Any, filters: bool = True) -> Config:
    if data is not None and not isinstance(data, dict):
        return invalid("$", f"must be a mapping, got {data!r}", Config(upstream=NO_UPSTREAM))
    root = mapping(data, "$", _SECTIONS)
    if "upstream" not in root:
        invalid("upstream", "is required", None)
    mode = root.get("mode", ENFORCE)
    if mode not in MODES:
        mode = invalid("mode", f"must be {' or '.join(MODES)}, got {mode!r}", ENFORCE)
    quotas = _quota_rules(root.get("quotas", []), "quotas", mode)
    before = errors_so_far()
    limiters = _rate_limiters(root.get("rate_limiters"), "rate_limiters")
    if errors_so_far() == before:  # which kinds are enforced is known only from a valid list
        _check_limited(quotas, limiters)
    return Config(
        upstream=read_upstream(root["upstream"], "upstream") if "upstream" in root else NO_UPSTREAM,
        listen=read_listen(root.get("listen", {}), "listen"),
        connections=read_connections(root.get("connections", {}), "connections"),
        metrics=read_metrics(root.get("metrics", {}), "metrics"),
        reload=_reload(root.get("reload", {}), "reload"),
        quota_windows=_quota_windows(root.get("quota_windows", {}), "quota_windows"),
        quota_entities=_quota_entities(root.get("quota_entities", {}), "quota_entities"),
        quotas=tuple(rule for _, rule in quotas),
        controller_mutation=_controller_mutation(root.get("controller_mutation", {}), "controller_mutation"),
        producer_id_quota=_producer_id_quota(root.get("producer_id_quota", {}), "producer_id_quota"),
        rate_limiters=limiters,
        filters=read_filters(root.get("filters"), "filters") if filters else (),
        leader_discovery=_leader_discovery(root.get("leader_discovery", {}), "leader_discovery"),
        usage_log=_usage_log(root.get("usage_log", {}), "usage_log"),
        quota_admin=_quota_admin(root.get("quota_admin", {}), "quota_admin"),
        fleet=_fleet(root.get("fleet", {}), "fleet"),
        workers=_workers(root.get("workers", {}), "workers"),
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


def _topic(m: dict[str, Any], key: str, path: str, default: str) -> str:
    topic = m.get(key, default)
    if not isinstance(topic, str) or not _TOPIC_NAME.fullmatch(topic) or topic in (".", ".."):
        return invalid(f"{path}.{key}", "must be a Kafka topic name (1 to 249 of a-z A-Z 0-9 . _ -, "
                                        f"not . or ..), got {topic!r}", default)
    return topic


def _quota_admin(data: Any, path: str) -> QuotaAdminConfig:
    d = QuotaAdminConfig()
    m = mapping(data, path, set(vars(d)))
    raw = m.get("principals", [])
    if not isinstance(raw, list):
        raw = invalid(f"{path}.principals", f"must be a list of principal names, got {raw!r}", [])
    principals: list[str] = []
    for i, name in enumerate(raw):
        plain = name.removeprefix(_USER_PREFIX) if isinstance(name, str) else name
        if not isinstance(plain, str) or not plain:
            invalid(f"{path}.principals[{i}]", f"must be a principal name (alice or User:alice), got {name!r}", None)
            continue
        principals.append(plain)
    describe = m.get("describe", d.describe)
    if describe not in QUOTA_ADMIN_DESCRIBE:
        describe = invalid(f"{path}.describe", f"must be {' or '.join(QUOTA_ADMIN_DESCRIBE)}, got {describe!r}",
                           d.describe)
    topic = _topic(m, "topic", path, d.topic)
    store = m.get("store", d.store)
    if store not in ("topic", "memory"):
        store = invalid(f"{path}.store", f"must be topic or memory, got {store!r}", d.store)
    return QuotaAdminConfig(
        enabled=read_bool(m, "enabled", path, d.enabled),
        store=store,
        principals=tuple(dict.fromkeys(principals)),
        describe=describe,
        topic=topic,
        write_deadline_ms=read_int(m, "write_deadline_ms", path, d.write_deadline_ms, 100, 300_000),
    )


def _workers(data: Any, path: str) -> WorkersConfig:
    d = WorkersConfig()
    # ``workers: 4`` and ``workers: auto`` are short for ``workers: {count: ...}``.
    m = mapping(data if data is None or isinstance(data, dict) else {"count": data}, path, set(vars(d)))
    raw = m.get("count", d.count)
    count = 0 if raw == "auto" else as_int(raw)
    if count is None or (raw != "auto" and not 1 <= count <= MAX_WORKERS):
        where = f"{path}.count" if isinstance(data, dict) else path
        count = invalid(where, f"must be auto or an integer in [1, {MAX_WORKERS}], got {raw!r}", d.count)
    before = errors_so_far()
    sync_interval_ms = read_int(m, "sync_interval_ms", path, d.sync_interval_ms, 10, 10_000)
    heartbeat_timeout_ms = read_int(m, "heartbeat_timeout_ms", path, d.heartbeat_timeout_ms, 1_000, 600_000)
    if errors_so_far() == before and heartbeat_timeout_ms < 2 * HEARTBEAT_INTERVAL_MS:
        invalid(f"{path}.heartbeat_timeout_ms", f"must be at least {2 * HEARTBEAT_INTERVAL_MS}", None)
    return WorkersConfig(
        count=count,
        sync_interval_ms=sync_interval_ms,
        heartbeat_timeout_ms=heartbeat_timeout_ms,
        drain_timeout_ms=read_int(m, "drain_timeout_ms", path, d.drain_timeout_ms, 0, 3_600_000),
    )


def _fleet(data: Any, path: str) -> FleetConfig:
    d = FleetConfig()
    m = mapping(data, path, set(vars(d)))
    topic = _topic(m, "topic", path, d.topic)
    fallback = m.get("fallback", d.fallback)
    if fallback not in FLEET_FALLBACKS:
        fallback = invalid(f"{path}.fallback", f"must be {' or '.join(FLEET_FALLBACKS)}, got {fallback!r}",
                           d.fallback)
    aggregation = m.get("aggregation", d.aggregation)
    if aggregation not in FLEET_AGGREGATIONS:
        aggregation = invalid(f"{path}.aggregation", f"must be {' or '.join(FLEET_AGGREGATIONS)}, got {aggregation!r}",
                              d.aggregation)
    elif aggregation == "owners" and len(topic) > 249 - len("-totals"):
        invalid(f"{path}.topic", f"must leave room for the totals topic's suffix -totals with aggregation owners "
                f"(at most 242 characters), got {len(topic)}", None)
    instance_id = m.get("instance_id")
    if instance_id is not None and (not isinstance(instance_id, str) or not instance_id
                                    or len(instance_id.encode()) > 255):
        instance_id = invalid(f"{path}.instance_id",
                              f"must be a non-empty string of at most 255 bytes, got {instance_id!r}", None)
    before = errors_so_far()
    sync_interval_ms = read_int(m, "sync_interval_ms", path, d.sync_interval_ms, 10, 60_000)
    member_timeout_ms = read_int(m, "member_timeout_ms", path, d.member_timeout_ms, 100, 3_600_000)
    if errors_so_far() == before and member_timeout_ms < 2 * sync_interval_ms:
        invalid(f"{path}.member_timeout_ms", f"must be at least twice sync_interval_ms ({sync_interval_ms}), "
                f"got {member_timeout_ms}: a member would leave between two reports", None)
    report_threshold = read_number(m, "report_threshold", path, d.report_threshold, 0.0)
    if report_threshold > 1:
        report_threshold = invalid(f"{path}.report_threshold", f"must be a number in [0, 1], got {report_threshold!r}",
                                   d.report_threshold)
    return FleetConfig(
        enabled=read_bool(m, "enabled", path, d.enabled),
        topic=topic,
        partitions=read_int(m, "partitions", path, d.partitions, 1, 1000),
        retention_ms=read_int(m, "retention_ms", path, d.retention_ms, 60_000, 7 * 86_400_000),
        sync_interval_ms=sync_interval_ms,
        member_timeout_ms=member_timeout_ms,
        fallback=fallback,
        instance_id=instance_id,
        report_threshold=report_threshold,
        max_remote_entries_per_s=read_int(m, "max_remote_entries_per_s", path, d.max_remote_entries_per_s,
                                          MAX_RECORD_ENTRIES, 100_000_000),
        aggregation=aggregation,
    )


def _usage_log(data: Any, path: str) -> UsageLogConfig:
    d = UsageLogConfig()
    m = mapping(data, path, set(vars(d)))
    directory = m.get("directory")
    if directory is not None and (not isinstance(directory, str) or not directory):
        directory = invalid(f"{path}.directory", f"must be a directory path, got {directory!r}", None)
    name = m.get("proxy_name", "")
    if not isinstance(name, str):
        name = invalid(f"{path}.proxy_name", f"must be a string, got {name!r}", "")
    return UsageLogConfig(
        directory=directory,
        interval_seconds=read_int(m, "interval_seconds", path, d.interval_seconds, 1, 3600),
        max_keys_per_interval=read_int(m, "max_keys_per_interval", path, d.max_keys_per_interval, 1, 10_000_000),
        count_fetch_records=read_bool(m, "count_fetch_records", path, d.count_fetch_records),
        proxy_name=name,
        max_pending_intervals=read_int(m, "max_pending_intervals", path, d.max_pending_intervals, 1, 100_000),
    )


def _leader_discovery(data: Any, path: str) -> LeaderDiscovery:
    d = LeaderDiscovery()
    m = mapping(data, path, set(vars(d)))
    return LeaderDiscovery(
        fill_hints=read_bool(m, "fill_hints", path, d.fill_hints),
        uplift=read_bool(m, "uplift", path, d.uplift),
        expedited_refresh_min_interval_ms=read_int(
            m, "expedited_refresh_min_interval_ms", path, d.expedited_refresh_min_interval_ms, 0, 600_000
        ),
        hint_wait_ms=read_int(m, "hint_wait_ms", path, d.hint_wait_ms, 0, 60_000),
    )


def _producer_id_quota(data: Any, path: str) -> ProducerIdQuota:
    d = ProducerIdQuota()
    m = mapping(data, path, set(vars(d)))
    raw_fpr = m.get("producer_id_quota_false_positive_rate", d.producer_id_quota_false_positive_rate)
    fpr = as_number(raw_fpr)
    if fpr is None or not 0 < fpr < 1:
        fpr = invalid(f"{path}.producer_id_quota_false_positive_rate", f"must be a number in (0, 1), got {raw_fpr!r}",
                      d.producer_id_quota_false_positive_rate)
    reaction = m.get("reaction", d.reaction)
    if reaction not in ("reject", "delay"):
        reaction = invalid(f"{path}.reaction", f"must be reject or delay, got {reaction!r}", d.reaction)
    return ProducerIdQuota(
        # KIP-936 declares an Int; fractions are accepted so short windows can be tried out.
        producer_id_quota_window_size_seconds=read_number(
            m, "producer_id_quota_window_size_seconds", path, d.producer_id_quota_window_size_seconds, 0.001
        ),
        producer_id_quota_window_num=read_int(
            m, "producer_id_quota_window_num", path, d.producer_id_quota_window_num, 1, 1000
        ),
        producer_id_quota_cache_layer_count=read_int(
            m, "producer_id_quota_cache_layer_count", path, d.producer_id_quota_cache_layer_count, 1, 1000
        ),
        producer_id_quota_false_positive_rate=float(fpr),
        producer_id_quota_cache_cleanup_interval_ms=read_int(
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
        return invalid(path, f"must be a list of package.module:ClassName, got {data!r}", DEFAULT_RATE_LIMITERS)
    specs: list[RateLimiterSpec] = []
    for i, entry in enumerate(data):
        spec = _rate_limiter(entry, f"{path}[{i}]", specs)
        if spec is not None:
            specs.append(spec)
    return tuple(specs)


def _rate_limiter(entry: Any, path: str, before: list[RateLimiterSpec]) -> RateLimiterSpec | None:
    """One entry of ``rate_limiters`` (``before``: the valid entries above it), None if invalid."""
    settings: Any = {}
    where = path
    if isinstance(entry, dict):
        m = mapping(entry, path, {"class", "config"})
        if "class" not in m:
            return invalid(f"{path}.class", "is required", None)
        target = m["class"]
        settings = m.get("config") or {}
        if not isinstance(settings, dict):
            invalid(f"{path}.config", f"must be a mapping, got {settings!r}", None)
            settings = None  # the class is still looked up; its own check has nothing to check
        where = f"{path}.class"
    else:
        target = entry
    if not isinstance(target, str):
        return invalid(where, f"must be package.module:ClassName, got {target!r}", None)
    try:
        cls = load_limiter_class(target)
    except ValueError as exc:
        return invalid(where, str(exc), None)
    if any(s.target == target for s in before):
        return invalid(where, f"{target} is listed twice", None)
    if settings is None:
        return None
    try:
        cls.check_settings(MappingProxyType(settings))
    except (ValueError, TypeError) as exc:
        return invalid(f"{path}.config", str(exc), None)
    return RateLimiterSpec(target, cls, MappingProxyType(settings))


def _check_limited(rules: list[tuple[int, QuotaRule]], limiters: tuple[RateLimiterSpec, ...]) -> None:
    """A record or batch quota needs a limiter that enforces it, or it would silently do nothing.
    ``rules``: each valid quota entry with its index in the YAML list."""
    unenforced = unenforced_kinds(limiters)
    for i, rule in rules:
        for kind in sorted(unenforced & rule.values.keys()):
            invalid(
                f"quotas[{i}].{kind}",
                "no configured rate limiter enforces it; add quotas.limiters:RecordRateLimiter "
                "(records) or quotas.limiters:BatchRateLimiter (batches) to rate_limiters",
                None,
            )
            break  # one error per entry, as one limiter added fixes them all


def _controller_mutation(data: Any, path: str) -> ControllerMutation:
    m = mapping(data, path, {"num_partitions_fallback"})
    d = ControllerMutation()
    return ControllerMutation(
        num_partitions_fallback=read_int(m, "num_partitions_fallback", path, d.num_partitions_fallback, 1, 1_000_000)
    )


def _quota_windows(data: Any, path: str) -> QuotaWindows:
    d = QuotaWindows()
    m = mapping(data, path, set(vars(d)))
    return QuotaWindows(**{k: read_int(m, k, path, getattr(d, k), 1, 3600) for k in vars(d)})


def _quota_entities(data: Any, path: str) -> QuotaEntities:
    d = QuotaEntities()
    m = mapping(data, path, {"idle_seconds", "max_live"})
    return QuotaEntities(
        idle_seconds=read_number(m, "idle_seconds", path, d.idle_seconds, 1.0),
        max_live=read_int(m, "max_live", path, d.max_live, 1, 10_000_000),
    )


def parse_quotas(data: Any, path: str = "quotas", mode: str = ENFORCE) -> tuple[QuotaRule, ...]:
    """A configuration's ``quotas:`` list (as YAML loaded it) as rules, an entry without a
    ``mode`` of its own in ``mode``; ConfigError naming the YAML path (``quotas[2].user``)
    otherwise, every error at once. Public for ``kafka-quota-proxy quotas apply``."""
    with collecting():
        rules = _quota_rules(data, path, mode)
    return tuple(rule for _, rule in rules)


_QUOTA_KEYS = frozenset({"user", "client_id", "mode", *ALL_KINDS})


def _quota_rules(data: Any, path: str, mode: str = ENFORCE) -> list[tuple[int, QuotaRule]]:
    """The valid entries of a ``quotas:`` list, each with its index in the list."""
    if data is None:
        return []
    if not isinstance(data, list):
        return invalid(path, f"must be a list of quota entries, got {data!r}", [])
    rules: list[tuple[int, QuotaRule]] = []
    seen: dict[tuple[str | None, str | None], int] = {}
    for i, entry in enumerate(data):
        p = f"{path}[{i}]"
        rule = _quota_rule(entry, p, mode)
        if rule is None:
            continue
        key = (rule.user, rule.client_id)
        if key in seen:
            invalid(p, f"same entity as {path}[{seen[key]}]: merge them", None)
            continue
        seen[key] = i
        rules.append((i, rule))
    return rules


def _quota_rule(entry: Any, p: str, mode: str) -> QuotaRule | None:
    """One entry of ``quotas:`` (at YAML path ``p``), None when it holds an error."""
    before = errors_so_far()
    if not isinstance(entry, dict):
        return invalid(p, f"must be a mapping, got {entry!r}", None)
    m = mapping(entry, p, _QUOTA_KEYS)
    entry_mode = m.get("mode", mode)
    if entry_mode not in MODES:
        invalid(f"{p}.mode", f"must be {' or '.join(MODES)}, got {entry_mode!r}", None)
    entity: dict[str, str] = {}
    for key in ("user", "client_id"):
        if key in m:
            if not isinstance(m[key], str) or not m[key]:
                invalid(f"{p}.{key}", f"must be a name, \"<default>\" or a glob, got {m[key]!r}", None)
            else:
                entity[key] = m[key]
    if "user" not in m and "client_id" not in m:
        invalid(p, "needs user, client_id or both", None)
    values = {}
    for kind in sorted(ALL_KINDS & m.keys()):
        v = m[kind]
        n = as_number(v)
        if n is None or not math.isfinite(n) or n <= 0:
            invalid(f"{p}.{kind}", f"must be a positive number, got {v!r}", None)
        else:
            values[kind] = float(n)
    if values.get(PRODUCER_IDS_RATE, 1) < 1:
        # A token is a whole producer id; a bucket of less than one never admits one.
        invalid(f"{p}.producer_ids_rate",
                f"must be at least 1 (new producer ids per window), got {m[PRODUCER_IDS_RATE]!r}", None)
    misspelt_kind = any(suggestion(k, ALL_KINDS) for k in entry.keys() - _QUOTA_KEYS)
    if not ALL_KINDS & m.keys() and not misspelt_kind:  # a misspelt kind is reported as such
        invalid(p, f"sets no quota (one of: {', '.join(sorted(ALL_KINDS))})", None)
    # KIP-936: producer_ids_rate is a user-level quota only.
    if USER_LEVEL_ONLY_KINDS & values.keys() and "client_id" in entity:
        invalid(f"{p}.producer_ids_rate", "applies to users only; remove client_id", None)
    if "user" in entity and "client_id" not in entity and any(c in entity["user"] for c in "*?["):
        invalid(f"{p}.user", f"globs apply to client ids only, got {entity['user']!r}", None)
    if errors_so_far() > before or not entity or not values:
        return None
    return QuotaRule(entity.get("user"), entity.get("client_id"), values, shadow=entry_mode == SHADOW)


def _reload(data: Any, path: str) -> ReloadConfig:
    d = ReloadConfig()
    m = mapping(data, path, set(vars(d)))
    return ReloadConfig(
        debounce_ms=read_int(m, "debounce_ms", path, d.debounce_ms, 0, 60_000),
        require_atomic_rename=read_bool(m, "require_atomic_rename", path, d.require_atomic_rename),
    )
