"""``kafka-quota-proxy quotas``: describe, set, delete, apply and export the quotas of a running
proxy through its admin API (DescribeClientQuotas / AlterClientQuotas v1, ``quota_admin``).

Quotas are written as the configuration's ``quotas:`` list: entries of ``user`` and/or
``client_id`` (``"<default>"`` for a default entity) with their keys. ``export`` prints a file
that ``apply`` reads back, and ``apply`` reads the ``recommended-quotas.yaml`` that
``kafka-quota-proxy report`` writes. Exit status: 0 when everything succeeded, 1 when the proxy
could not be reached or refused an entry (its message is printed), 2 for bad arguments or an
invalid file.

Connection security, as kafka-configs.sh's ``--command-config``: a Java-style properties file
with ``security.protocol`` (PLAINTEXT, SSL, SASL_PLAINTEXT, SASL_SSL), ``ssl.ca.location`` (or
``ssl.truststore.location`` naming a PEM file), ``ssl.certificate.location`` /
``ssl.key.location``, ``ssl.endpoint.identification.algorithm`` (empty: no host name check),
``sasl.mechanism`` (PLAIN, SCRAM-SHA-256, SCRAM-SHA-512, OAUTHBEARER). PLAIN and SCRAM take
their credentials from Java's ``sasl.jaas.config`` (``PlainLoginModule`` / ``ScramLoginModule``
``username=`` and ``password=``), so the file kafka-configs.sh uses works as it is, or from
librdkafka's ``sasl.username`` / ``sasl.password``; OAUTHBEARER sends the token read from the
file ``sasl.oauthbearer.token.file`` names (the proxy's own key: the CLI fetches no tokens).
"""

from __future__ import annotations

import argparse
import asyncio
import re
import ssl
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from kafka.errors import for_code
from kafka.protocol.admin import AlterClientQuotasRequest, DescribeClientQuotasRequest
from kafka.protocol.metadata import ApiVersionsRequest

from config import ConfigError
from config.loader import parse_quotas, split_host_port
from config.model import UpstreamTlsConfig
from proxy.cluster.dialer import OwnConnection
from proxy.identity.sasl_client import SaslAuthenticationError, SaslCredentials, authenticate
from proxy.identity.tls import client_tls
from quotas.client_quota_admin import CLIENT_ID, MATCH_DEFAULT, MATCH_EXACT, USER
from quotas.common import ALL_KINDS
from quotas.entities import DEFAULT, QuotaRule

VERSION = 1  # of both APIs; every proxy with quota_admin answers v0 and v1
TIMEOUT_S = 30.0
_PROTOCOLS = ("PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL")
_MECHANISMS = ("PLAIN", "SCRAM-SHA-256", "SCRAM-SHA-512", "OAUTHBEARER")
# One option of a JAAS login module entry: key=value or key="quoted value" (JaasConfig's syntax).
_JAAS_OPTION = re.compile(r'([A-Za-z_][\w.]*)\s*=\s*("(?:[^"\\]|\\.)*"|[^\s;"]+)')
# YAML key of an entity type (the config's spelling) and back.
_YAML_KEY = {USER: "user", CLIENT_ID: "client_id"}

Entity = tuple[tuple[str, str | None], ...]  # ((entity type, name or None for the default), ...)


class CliError(Exception):
    """Printed to stderr; ``status`` is the exit status."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


# --- arguments -------------------------------------------------------------------------------


def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="quotas_command", required=True)
    describe = sub.add_parser("describe", help="print the quotas in force (of one entity, or all) as YAML")
    set_ = sub.add_parser("set", help="set quota keys of one entity (like kafka-configs --add-config)")
    delete = sub.add_parser("delete", help="remove quota keys of one entity (like kafka-configs --delete-config)")
    apply = sub.add_parser("apply", help="set every key of every entity of a quotas: YAML file "
                                         "(e.g. report's recommended-quotas.yaml)")
    export = sub.add_parser("export", help="print every entity's quotas as a quotas: YAML that apply reads")
    for p in (describe, set_, delete, apply, export):
        p.add_argument("--bootstrap-server", required=True, help="the proxy's HOST:PORT[,HOST:PORT...]")
        p.add_argument("--command-config", help="properties file: security.protocol, ssl.*, sasl.*")
    for p, required in ((describe, False), (set_, True), (delete, True)):
        _entity_arguments(p, required)
    describe.add_argument("--strict", action="store_true",
                          help="only the entity named, not those that also name the other type")
    set_.add_argument("--add", required=True, metavar="KEY=VALUE[,KEY=VALUE]", help="keys to set")
    delete.add_argument("--keys", required=True, metavar="KEY[,KEY]", help="keys to remove")
    apply.add_argument("file", help="YAML file with a quotas: list (other sections are ignored)")
    apply.add_argument("--dry-run", action="store_true", help="validate only (validate_only): change nothing")


def _entity_arguments(p: argparse.ArgumentParser, required: bool) -> None:
    user = p.add_mutually_exclusive_group()
    user.add_argument("--user", help="a user name")
    user.add_argument("--user-default", action="store_true", help="the default user")
    client = p.add_mutually_exclusive_group()
    client.add_argument("--client-id", help="a client id")
    client.add_argument("--client-id-default", action="store_true", help="the default client id")
    p.set_defaults(entity_required=required)


def _entity(args: argparse.Namespace) -> Entity:
    parts: list[tuple[str, str | None]] = []
    if args.user is not None or args.user_default:
        parts.append((USER, None if args.user_default else _name(args.user, "--user")))
    if args.client_id is not None or args.client_id_default:
        parts.append((CLIENT_ID, None if args.client_id_default else _name(args.client_id, "--client-id")))
    return tuple(parts)


def _name(name: str, option: str) -> str:
    if not name or name == DEFAULT:
        raise CliError(f"{option}: give a name (for the default entity, {option}-default)", 2)
    return name


def _keys(text: str, option: str) -> list[str]:
    keys = [k.strip() for k in text.split(",") if k.strip()]
    if not keys:
        raise CliError(f"{option}: no keys given", 2)
    return keys


def _assignments(text: str) -> list[tuple[str, float]]:
    out = []
    for item in _keys(text, "--add"):
        key, sep, value = item.partition("=")
        try:
            number = float(value)
        except ValueError:
            number = None
        if not sep or not key.strip() or number is None:
            raise CliError(f"--add: expected KEY=VALUE with a number, got {item!r}", 2)
        out.append((key.strip(), number))
    return out


# --- connection ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Security:
    tls: ssl.SSLContext | None = None
    sasl: SaslCredentials | None = None


def read_properties(path: str) -> dict[str, str]:
    """A properties file as ``java.util.Properties.load`` reads it: ``#`` / ``!`` comment lines,
    a line ending in an odd number of backslashes continued on the next, the key ended by the
    first unescaped ``=``, ``:`` or white space, and backslash escapes undone in keys and values."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except OSError as exc:
        raise CliError(f"--command-config: cannot read {path}: {exc.strerror}", 2) from exc
    props: dict[str, str] = {}
    lines = iter(text.splitlines())
    for raw in lines:
        line = raw.lstrip(" \t\f")
        if not line or line[0] in "#!":
            continue
        while _continued(line):
            line = line[:-1] + next(lines, "").lstrip(" \t\f")
        key, value = _split_property(line)
        props[_unescape(key)] = _unescape(value)
    return props


def _continued(line: str) -> bool:
    return (len(line) - len(line.rstrip("\\"))) % 2 == 1


def _split_property(line: str) -> tuple[str, str]:
    i = 0
    while i < len(line) and line[i] not in "=: \t\f":
        i += 2 if line[i] == "\\" else 1
    key, rest = line[:i], line[i:].lstrip(" \t\f")
    if rest[:1] in ("=", ":"):
        rest = rest[1:].lstrip(" \t\f")
    return key, rest


_ESCAPES = {"t": "\t", "n": "\n", "r": "\r", "f": "\f"}


def _unescape(text: str) -> str:
    def one(m: re.Match[str]) -> str:
        c = m.group(1)
        if len(c) == 5:  # \uXXXX
            return chr(int(c[1:], 16))
        return _ESCAPES.get(c, c)
    return re.sub(r"\\(u[0-9a-fA-F]{4}|.)", one, text)


def security(path: str | None) -> Security:
    if path is None:
        return Security()
    props = read_properties(path)
    protocol = props.get("security.protocol", "PLAINTEXT").upper()
    if protocol not in _PROTOCOLS:
        raise CliError(f"{path}: security.protocol must be one of {', '.join(_PROTOCOLS)}, got {protocol!r}", 2)
    tls = None
    if protocol.endswith("SSL"):
        ca = props.get("ssl.ca.location") or props.get("ssl.truststore.location")
        cfg = UpstreamTlsConfig(
            ca=ca or None,
            verify_hostname=props.get("ssl.endpoint.identification.algorithm", "https").lower() == "https",
            certificate=props.get("ssl.certificate.location") or None,
            key=props.get("ssl.key.location") or None,
        )
        if (cfg.certificate is None) != (cfg.key is None):
            raise CliError(f"{path}: ssl.certificate.location and ssl.key.location go together", 2)
        try:
            tls = client_tls(cfg, path)
        except ConfigError as exc:
            raise CliError(str(exc), 2) from exc
    sasl = None
    if protocol.startswith("SASL"):
        mechanism = props.get("sasl.mechanism", "PLAIN").upper()
        if mechanism not in _MECHANISMS:
            raise CliError(f"{path}: sasl.mechanism must be one of {', '.join(_MECHANISMS)}, got {mechanism!r}", 2)
        sasl = _sasl_credentials(path, protocol, mechanism, props)
    return Security(tls, sasl)


def _sasl_credentials(path: str, protocol: str, mechanism: str, props: dict[str, str]) -> SaslCredentials:
    if mechanism == "OAUTHBEARER":
        token_file = props.get("sasl.oauthbearer.token.file")
        if not token_file:
            raise CliError(f"{path}: OAUTHBEARER needs sasl.oauthbearer.token.file (a file holding the token)", 2)
        try:
            token = Path(token_file).read_text(encoding="utf-8").strip()
        except OSError as exc:
            raise CliError(f"{path}: sasl.oauthbearer.token.file: cannot read {token_file}: {exc.strerror}", 2) from exc
        if not token:
            raise CliError(f"{path}: sasl.oauthbearer.token.file: {token_file} is empty", 2)
        return SaslCredentials(mechanism, None, token)
    username, password = props.get("sasl.username"), props.get("sasl.password")
    if "sasl.jaas.config" in props:
        options = jaas_options(props["sasl.jaas.config"])
        username, password = options.get("username", username), options.get("password", password)
    if username is None or password is None:
        raise CliError(f"{path}: {protocol} with {mechanism} needs username and password in sasl.jaas.config "
                       "(or sasl.username and sasl.password)", 2)
    return SaslCredentials(mechanism, username, password)


def jaas_options(entry: str) -> dict[str, str]:
    """The options of one JAAS login module entry, as Kafka's ``JaasConfig`` reads
    ``sasl.jaas.config``: ``<LoginModule class> <flag> key=value key="value" ... ;``."""
    parts = entry.strip().rstrip(";").split(None, 2)
    options: dict[str, str] = {}
    for key, value in _JAAS_OPTION.findall(parts[2] if len(parts) > 2 else ""):
        if value.startswith('"'):
            value = re.sub(r"\\(.)", r"\1", value[1:-1])
        options[key] = value
    return options


async def connect(bootstrap: str, sec: Security) -> OwnConnection:
    """A connection to the first of ``bootstrap``'s addresses that answers (TLS and SASL done)."""
    failures = []
    for server in [s.strip() for s in bootstrap.split(",") if s.strip()]:
        try:
            host, port = split_host_port(server)
        except ConfigError as exc:
            raise CliError(f"--bootstrap-server: {exc}", 2) from exc
        try:
            async with asyncio.timeout(TIMEOUT_S):
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=sec.tls, server_hostname=host if sec.tls is not None else None)
                conn = OwnConnection(reader, writer)
                try:
                    if sec.sasl is not None:
                        versions = await conn.round_trip(ApiVersionsRequest[0]())
                        api_versions = {e.api_key: (e.min_version, e.max_version) for e in versions.api_keys}
                        await authenticate(conn.round_trip, api_versions, sec.sasl)
                except BaseException:
                    conn.close()
                    raise
                return conn
        except SaslAuthenticationError as exc:
            raise CliError(f"{server}: SASL authentication failed: {exc}") from exc
        except (OSError, TimeoutError, asyncio.IncompleteReadError) as exc:
            failures.append(f"{server}: {exc or type(exc).__name__}")
    raise CliError("cannot connect: " + ("; ".join(failures) or "no --bootstrap-server given"))


# --- requests --------------------------------------------------------------------------------


def _error(code: int, message: str | None) -> str:
    name = f"{for_code(code).message} ({code})"
    return f"{name}: {message}" if message else name


def render(entity: Entity) -> str:
    """``user=alice client-id=<default>``: how the proxy's audit log names an entity."""
    return " ".join(f"{t}={DEFAULT if n is None else n}" for t, n in _ordered(entity))


def _ordered(entity: Entity) -> Entity:
    order = {USER: 0, CLIENT_ID: 1}
    return tuple(sorted(entity, key=lambda p: order.get(p[0], 2)))


async def describe(conn: OwnConnection, components: Sequence[tuple[str, int, str | None]] = (),
                   strict: bool = False) -> list[tuple[Entity, dict[str, float]]]:
    R = DescribeClientQuotasRequest[VERSION]
    req = R(components=[R.ComponentData(entity_type=t, match_type=m, match=s) for t, m, s in components],
            strict=strict)
    resp = await conn.round_trip(req)
    if resp.error_code != 0:
        raise CliError(f"describe failed: {_error(resp.error_code, resp.error_message)}")
    return [(tuple((e.entity_type, e.entity_name) for e in x.entity), {v.key: v.value for v in x.values})
            for x in resp.entries or ()]


async def alter(conn: OwnConnection, entries: Sequence[tuple[Entity, Sequence[tuple[str, float, bool]]]],
                validate_only: bool = False) -> list[tuple[Entity, int, str | None]]:
    R = AlterClientQuotasRequest[VERSION]
    E = R.EntryData
    data = [E(entity=[E.EntityData(entity_type=t, entity_name=n) for t, n in entity],
              ops=[E.OpData(key=k, value=v, remove=r) for k, v, r in ops]) for entity, ops in entries]
    resp = await conn.round_trip(R(entries=data, validate_only=validate_only))
    return [(tuple((d.entity_type, d.entity_name) for d in e.entity), e.error_code, e.error_message)
            for e in resp.entries]


# --- YAML ------------------------------------------------------------------------------------


def _number(value: float) -> int | float:
    return int(value) if float(value).is_integer() else value


def quotas_document(described: Sequence[tuple[Entity, dict[str, float]]]) -> str:
    """A ``quotas:`` YAML: entries in a stable order (user, client_id, keys in the config's order)."""
    order = {k: i for i, k in enumerate(ALL_KINDS)}
    entries = []
    for entity, values in described:
        entry: dict[str, Any] = {}
        for entity_type, name in _ordered(entity):
            entry[_YAML_KEY.get(entity_type, entity_type)] = DEFAULT if name is None else name
        for key in sorted(values, key=lambda k: (order.get(k, len(order)), k)):
            entry[key] = _number(values[key])
        entries.append(entry)
    entries.sort(key=lambda e: (str(e.get("user", "")), str(e.get("client_id", "")), "user" in e))
    text: str = yaml.safe_dump({"quotas": entries}, sort_keys=False, default_flow_style=False, allow_unicode=True)
    return text


def read_quotas_file(path: str) -> tuple[QuotaRule, ...]:
    try:
        data = yaml.safe_load(Path(path).read_text(encoding="utf-8"))
    except OSError as exc:
        raise CliError(f"{path}: cannot read: {exc.strerror}", 2) from exc
    except (yaml.YAMLError, UnicodeDecodeError) as exc:
        raise CliError(f"{path}: not valid YAML: {exc}", 2) from exc
    if not isinstance(data, dict) or "quotas" not in data:
        raise CliError(f"{path}: expected a mapping with a quotas: list", 2)
    try:
        rules = parse_quotas(data["quotas"])
    except ConfigError as exc:
        raise CliError(f"{path}: {exc}", 2) from exc
    for i, entry in enumerate(data["quotas"]):
        if "mode" in entry:
            # AlterClientQuotas carries values only: an entity set through it takes the mode its
            # entry in the proxy's file has, else the file's global mode.
            raise CliError(f"{path}: quotas[{i}].mode: the admin API carries quota values only; set mode "
                           "in the proxy's configuration file (the entity's entry there, or the global mode) "
                           "and remove it here", 2)
    if not rules:
        raise CliError(f"{path}: quotas: is empty, nothing to apply", 2)
    return rules


def rule_entity(rule: QuotaRule) -> Entity:
    parts: list[tuple[str, str | None]] = []
    if rule.user is not None:
        parts.append((USER, None if rule.user == DEFAULT else rule.user))
    if rule.client_id is not None:
        parts.append((CLIENT_ID, None if rule.client_id == DEFAULT else rule.client_id))
    return tuple(parts)


# --- commands --------------------------------------------------------------------------------


def main(args: argparse.Namespace) -> int:
    try:
        return asyncio.run(_main(args))
    except CliError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return exc.status


async def _main(args: argparse.Namespace) -> int:
    command = args.quotas_command
    sec = security(args.command_config)
    entity: Entity = ()
    entries: list[tuple[Entity, list[tuple[str, float, bool]]]] = []
    if command in ("describe", "set", "delete"):
        entity = _entity(args)
        if args.entity_required and not entity:
            raise CliError("name the entity: --user/--user-default and/or --client-id/--client-id-default", 2)
    if command == "set":
        entries = [(entity, [(k, v, False) for k, v in _assignments(args.add)])]
    elif command == "delete":
        entries = [(entity, [(k, 0.0, True) for k in _keys(args.keys, "--keys")])]
    elif command == "apply":
        entries = [(rule_entity(r), [(k, v, False) for k, v in r.values.items()])
                   for r in read_quotas_file(args.file)]
    conn = await connect(args.bootstrap_server, sec)
    try:
        async with asyncio.timeout(TIMEOUT_S):
            if command in ("describe", "export"):
                components = [(t, MATCH_EXACT if n is not None else MATCH_DEFAULT, n) for t, n in entity]
                strict = bool(getattr(args, "strict", False))
                print(quotas_document(await describe(conn, components, strict)), end="")
                return 0
            answered = await alter(conn, entries, validate_only=bool(getattr(args, "dry_run", False)))
    except asyncio.IncompleteReadError as exc:
        raise CliError(f"the proxy closed the connection without answering ({args.bootstrap_server}; is "
                       "quota_admin enabled, and does --command-config's security.protocol match the "
                       "listener?)") from exc
    except TimeoutError as exc:
        raise CliError(f"no answer from {args.bootstrap_server} within {TIMEOUT_S:g} s") from exc
    except OSError as exc:
        raise CliError(f"connection to {args.bootstrap_server} failed: {exc}") from exc
    finally:
        conn.close()
    return _report(answered, bool(getattr(args, "dry_run", False)))


def _report(answered: list[tuple[Entity, int, str | None]], dry_run: bool) -> int:
    failed = 0
    for entity, code, message in answered:
        if code == 0:
            print(f"{render(entity)}: {'valid (dry run, nothing changed)' if dry_run else 'ok'}")
        else:
            failed += 1
            print(f"{render(entity)}: {_error(code, message)}")
    if failed:
        print(f"error: {failed} of {len(answered)} entries failed", file=sys.stderr)
        return 1
    return 0
