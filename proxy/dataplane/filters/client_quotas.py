"""DescribeClientQuotas (API 48) and AlterClientQuotas (API 49), answered by the proxy.

With ``quota_admin.enabled`` (otherwise the filter is idle, and both APIs reach the broker as
the client sent them):

- every version kafka-python has a schema for (v0 and v1) is answered by the proxy and never
  reaches the broker; ApiVersions offers exactly those versions (:attr:`offered`), whatever the
  broker supports. A version the proxy cannot read closes the connection (ProtocolError).
- Describe shows the quotas in force: the file's ``quotas:`` with the store's overlay on top
  (proxy.control.quota_store), selected as Kafka's ClientQuotasImage.describe selects them.
- Authorization is by principal name (the proxy's ``Session.principal``): a principal not in
  ``quota_admin.principals`` is answered CLUSTER_AUTHORIZATION_FAILED: for Describe (unless
  ``describe: anyone``) the whole request, for Alter every entry, and nothing changes.
- Alter validates each entry on its own (quotas.client_quota_admin.alter); ``validate_only``
  changes nothing. Otherwise the valid entries' changes are in force for every connection and
  recorded by the store before the answer is sent, and each change is logged as one INFO line
  on the ``proxy.audit`` logger. Alters are carried out one at a time, proxy-wide, each over
  the quotas the one before left; an Alter that changes nothing is answered the same way. An
  Alter is carried out whole even when its client goes away before the answer.
- A failure after validation changes nothing: a rate limiter refusing the new quotas answers
  the valid entries POLICY_VIOLATION; a store that cannot record them now (StoreUnavailable:
  the quota topic unreachable or refusing) REQUEST_TIMED_OUT, retriable, with the store's
  reason as the message (what a KRaft controller answers when its write times out), or
  UNKNOWN_SERVER_ERROR with the reason when the store says retrying would not help (the
  proxy's own principal not authorized, say); any other store failure UNKNOWN_SERVER_ERROR.
- Every Alter has a deadline, ``quota_admin.write_deadline_ms`` from its arrival, inside the
  30 s an admin client waits (``request.timeout.ms``), that covers its wait for the Alters
  before it and its store's write (which retries what Kafka's producer retries). Once it
  passes, the Alter is answered REQUEST_TIMED_OUT at once, naming what the store is retrying
  (:meth:`proxy.control.quota_store.QuotaStore.write_trouble`), and changes nothing: a flood of Alters
  while the store retries is answered within its deadline, never one deadline after another.
  At most :attr:`ClientQuotasFilter.max_waiting_alters` Alters wait at once (each holds its
  decoded entries, and an Alter outlives its connection): the next is answered at once, the
  same way. Memory is bounded by that, time by the deadline.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Iterable, Sequence
from dataclasses import replace
from typing import Any, NamedTuple, Protocol

from config import ConfigError
from config.model import Config, QuotaAdminConfig, unenforced_kinds
from protocol.apis import SPECS
from protocol.frames import Buffer
from protocol.headers import RequestHeader, encode_response_header, response_header_is_flexible
from protocol.messages import decode_request, encode_body
from proxy.cluster.offload import is_big, off_loop
from proxy.control.quota_store import QuotaStore, StoreUnavailable
from proxy.dataplane.filters.api import Answer, Defer, FilterContext, FilterSpec, Frame
from proxy.dataplane.inflight import InFlight
from proxy.observability.logs import LogLimiter
from quotas.client_quota_admin import (
    CLIENT_ID,
    CLUSTER_AUTHORIZATION_FAILED,
    NONE,
    POLICY_VIOLATION,
    REQUEST_TIMED_OUT,
    UNKNOWN_SERVER_ERROR,
    USER,
    AlterResult,
    DescribeResult,
    EntityParts,
    EntryResult,
    QuotaChange,
    QuotaEntity,
    alter,
    alter_error,
    describe,
    describe_error,
    rules_from_quotas,
)
from quotas.entities import DEFAULT, QuotaRule

log = logging.getLogger(__name__)
audit = logging.getLogger("proxy.audit")
_refusals = LogLimiter(log)  # a client can send refused requests at will

DESCRIBE_CLIENT_QUOTAS = 48
ALTER_CLIENT_QUOTAS = 49
_KEYS = frozenset({DESCRIBE_CLIENT_QUOTAS, ALTER_CLIENT_QUOTAS})
_MAX_WAITING_ALTERS = 64
# A Describe or Alter of more entries (or a Describe over more entities) than this has its
# selection or validation and its answer computed in the decode thread (proxy.cluster.offload):
# about 10 µs an entry each, 0.3 s for the 10,000 entries Kafka allows in one Alter.
BIG_ENTRIES = 256

Ops = Sequence[tuple[str, float, bool]]


class QuotaHost(Protocol):
    """What the filter needs of the proxy (proxy.app.server.ProxyServer)."""

    @property
    def config(self) -> Config: ...

    @property
    def rules_in_force(self) -> tuple[QuotaRule, ...]: ...

    def quota_rules_over(self, base: tuple[QuotaRule, ...]) -> tuple[QuotaRule, ...]: ...

    def apply_quota_rules(self, rules: tuple[QuotaRule, ...]) -> None: ...


class ClientQuotasFilter:
    """Answers DescribeClientQuotas and AlterClientQuotas (see the module docstring). One
    instance serves every connection; it holds the lock that puts Alters in order."""

    def __init__(self, admin: QuotaAdminConfig, store: QuotaStore, host: QuotaHost) -> None:
        self.admin = admin
        self.store = store
        self.host = host
        self.spec = FilterSpec(request_keys=_KEYS, idle=not admin.enabled)
        # {api key: (min, max)} for ApiVersions: what kafka-python can read, answered here.
        self.offered: dict[int, tuple[int, int]] = (
            {key: (SPECS[key].request.min_version, SPECS[key].max_version) for key in sorted(_KEYS)}
            if admin.enabled else {}
        )
        self._alters = asyncio.Lock()
        self.max_waiting_alters = _MAX_WAITING_ALTERS
        self._waiting = 0  # Alters waiting for the lock

    def on_request(self, ctx: FilterContext, header: RequestHeader, frame: Frame,
                   entry: InFlight) -> Answer | Defer:
        body = memoryview(frame)[header.body_offset :]
        if is_big(body):  # thousands of entries: decoded and read off the loop (proxy.cluster.offload)
            return Defer(self._read_off_loop(ctx, header, body))
        return self._on_read(ctx, header, _read(header.api_key, header.api_version, body))

    async def _read_off_loop(self, ctx: FilterContext, header: RequestHeader, body: memoryview) -> Answer | Defer:
        return self._on_read(ctx, header, await off_loop(_read, header.api_key, header.api_version, body))

    def _on_read(self, ctx: FilterContext, header: RequestHeader, req: _Request) -> Answer | Defer:
        key = header.api_key
        principal = ctx.session.principal
        if key == DESCRIBE_CLIENT_QUOTAS:
            components = req.items
            if not self.admin.may_describe(principal):
                self._refused(ctx, "DescribeClientQuotas", principal)
                # KafkaApis.handleDescribeClientQuotasRequest: DESCRIBE_CONFIGS on the cluster.
                return Answer(_describe_response(header, describe_error(CLUSTER_AUTHORIZATION_FAILED)))
            in_force = self._in_force()  # a copy of its own: the decode thread may read it
            if len(in_force) > BIG_ENTRIES or len(components) > BIG_ENTRIES:
                return Defer(_answer_off_loop(_describe_answer, header, in_force, components, req.flag))
            return Answer(_describe_answer(header, in_force, components, req.flag))
        entries = req.items
        if not self.admin.may_alter(principal):
            self._refused(ctx, "AlterClientQuotas", principal)
            # ControllerApis.handleAlterClientQuotas: ALTER_CONFIGS on the cluster, every entry refused.
            return Answer(_alter_response(header, alter_error({}, entries, CLUSTER_AUTHORIZATION_FAILED)))
        if req.flag:  # validate_only
            if len(entries) > BIG_ENTRIES:
                return Defer(self._validated_off_loop(header, entries))
            return Answer(_alter_response(header, self._alter_now(entries, validate_only=True)))
        # Nothing of ``frame`` is kept: the coroutine holds the decoded entries only.
        deadline_at = asyncio.get_running_loop().time() + self.admin.write_deadline_ms / 1000
        return Defer(self._whole(ctx.label, principal, header, entries, deadline_at))

    def _in_force(self) -> dict[QuotaEntity, dict[str, float]]:
        return self.store.merged(self.host.config.quotas)

    def _alter_now(self, entries: Sequence[tuple[EntityParts, Ops]], validate_only: bool) -> AlterResult:
        return alter(self._in_force(), entries, validate_only, unenforced_kinds(self.host.config.rate_limiters))

    async def _alter(self, entries: Sequence[tuple[EntityParts, Ops]], validate_only: bool) -> AlterResult:
        """Validates ``entries`` over the quotas in force now; many of them in the decode thread,
        over a copy of those quotas taken now."""
        if len(entries) <= BIG_ENTRIES:
            return self._alter_now(entries, validate_only)
        return await off_loop(_alter_with_rules, self._in_force(), entries, validate_only,
                              unenforced_kinds(self.host.config.rate_limiters))

    async def _validated_off_loop(self, header: RequestHeader, entries: Sequence[tuple[EntityParts, Ops]]) -> Answer:
        result = await self._alter(entries, validate_only=True)
        return await _answer_off_loop(_alter_response, header, result)

    async def _whole(self, client: str, principal: str, header: RequestHeader,
                     entries: Sequence[tuple[EntityParts, Ops]], deadline_at: float) -> Answer:
        # A connection that closes cancels its deferred decision: an Alter, once started, is
        # carried out whole all the same (in force, recorded, audited), as Kafka's controller
        # completes a write whose client went away; only the answer is lost.
        return await asyncio.shield(self._commit(client, principal, header, entries, deadline_at))

    async def _commit(self, client: str, principal: str, header: RequestHeader,
                      entries: Sequence[tuple[EntityParts, Ops]], deadline_at: float) -> Answer:
        if self._waiting >= self.max_waiting_alters:
            return await self._not_now(client, header, entries,
                                       f"{self._waiting} quota changes are already waiting for the quota store "
                                       f"({self._trouble()}); nothing changed, retry later")
        self._waiting += 1
        try:
            async with asyncio.timeout_at(deadline_at):
                await self._alters.acquire()  # each Alter sees the quotas the one before left
        except TimeoutError:
            return await self._not_now(client, header, entries,
                                       f"not recorded within {self._deadline_s():g} s: an earlier quota change is "
                                       f"still being written ({self._trouble()}); nothing changed, retry later")
        finally:
            self._waiting -= 1
        try:
            base, before = self.host.config.quotas, self.host.rules_in_force
            result = await self._alter(entries, validate_only=False)
            if result.changes:
                # Other rules put in force while the decode thread validated (a reload, another
                # instance's change): these changes did not see them.
                result = await self._put_in_force(result, deadline_at, base, self.host.rules_in_force is not before)
            for n, change in enumerate(result.changes, 1):
                audit.info("quota change by principal=%s client=%s: %s", _safe(principal), client,
                           describe_change(change))
                if n % BIG_ENTRIES == 0:
                    await asyncio.sleep(0)  # 10,000 lines written: other clients go on between
        finally:
            self._alters.release()
        if len(entries) > BIG_ENTRIES:
            return await _answer_off_loop(_alter_response, header, result)
        return Answer(_alter_response(header, result))

    async def _not_now(self, client: str, header: RequestHeader, entries: Sequence[tuple[EntityParts, Ops]],
                       message: str) -> Answer:
        """The answer to an Alter not carried out for want of time: each valid entry
        REQUEST_TIMED_OUT with ``message``, an invalid one its own error. Nothing changes."""
        _refusals.log(logging.WARNING, "AlterClientQuotas from %s not carried out: %s", client, message)
        result = _failed(await self._alter(entries, validate_only=True), REQUEST_TIMED_OUT, message)
        if len(entries) > BIG_ENTRIES:
            return await _answer_off_loop(_alter_response, header, result)
        return Answer(_alter_response(header, result))

    def _trouble(self) -> str:
        return self.store.write_trouble() or "no answer from the store yet"

    def _deadline_s(self) -> float:
        return self.admin.write_deadline_ms / 1000

    async def _put_in_force(self, result: AlterResult, deadline_at: float, base: tuple[QuotaRule, ...],
                            missed: bool) -> AlterResult:
        """In force first (a rate limiter may refuse), then recorded by ``deadline_at`` (the
        store may fail, and the quotas without the changes are put back): either way, on
        failure nothing changes. ``base``: the file's quotas the result was computed over;
        ``missed``: other rules were put in force since. The result to answer."""
        try:
            rules = result.rules if result.rules is not None else rules_from_quotas(result.new_quotas)
            self.host.apply_quota_rules(rules)
        except ConfigError as exc:
            log.error("AlterClientQuotas not applied, the quotas before stay in force: %s", exc)
            return _failed(result, POLICY_VIOLATION, f"A rate limiter refused the new quotas: {exc}")
        try:
            async with asyncio.timeout_at(deadline_at):
                await self.store.commit(result.changes)
        except StoreUnavailable as exc:
            log.error("AlterClientQuotas not recorded, the quotas before are put back in force: %s", exc)
            self._resync()
            return _failed(result, REQUEST_TIMED_OUT if exc.retriable else UNKNOWN_SERVER_ERROR, str(exc))
        except TimeoutError:
            message = f"not recorded within {self._deadline_s():g} s ({self._trouble()}); nothing changed, retry later"
            log.error("AlterClientQuotas not recorded, the quotas before are put back in force: %s", message)
            self._resync()
            return _failed(result, REQUEST_TIMED_OUT, message)
        except Exception as exc:
            log.error("AlterClientQuotas not recorded, the quotas before are put back in force: %r", exc)
            self._resync()
            return _failed(result, UNKNOWN_SERVER_ERROR, None)
        if self.host.config.quotas is not base or missed:
            # A reload, or (while the decode thread validated) another instance's change, put in
            # force quotas that these changes did not see: the store's over the file's, as now.
            self._resync()
        return result

    def _resync(self) -> None:
        """Puts in force the store's quotas over the file's, as they are now."""
        try:
            self.host.apply_quota_rules(self.host.quota_rules_over(self.host.config.quotas))
        except ConfigError as exc:
            log.error("the quotas in force could not be brought in line with the quota store: %s", exc)

    def _refused(self, ctx: FilterContext, api: str, principal: str) -> None:
        _refusals.log(logging.WARNING, "refused %s from %s: principal=%s is not in quota_admin.principals",
                      api, ctx.label, _safe(principal))


def describe_change(change: QuotaChange) -> str:
    """``user=bob client-id=<default> producer_byte_rate 1048576 -> 2097152`` ((none): unset)."""
    entries = change.entity.entries
    entity = " ".join(f"{t}={DEFAULT if entries[t] is None else _safe(str(entries[t]))}"
                      for t in (USER, CLIENT_ID) if t in entries)
    return f"{entity} {_safe(change.key)} {_value(change.old)} -> {_value(change.new)}"


def _value(value: float | None) -> str:
    return "(none)" if value is None else f"{value:.15g}"


def _safe(text: str) -> str:
    """A client's string in a log line: control characters escaped, so one change is one line."""
    return text if text.isprintable() else text.encode("unicode_escape").decode("ascii")


def _failed(result: AlterResult, error_code: int, message: str | None) -> AlterResult:
    """``result``'s answer with its valid entries failed instead; no changes (``new_quotas``
    is left as computed: only the answer and the changes are read from here on)."""
    results = tuple(r if r.error_code != NONE else EntryResult(r.entity, error_code, message)
                    for r in result.results)
    return AlterResult(result.new_quotas, results, ())


class _Request(NamedTuple):
    """What the filter reads of a request: a Describe's components and ``strict``, or an
    Alter's entries and ``validate_only``."""

    items: list[Any]
    flag: bool


def _read(api_key: int, api_version: int, body: Buffer) -> _Request:
    req: Any = decode_request(api_key, api_version, body)
    if api_key == DESCRIBE_CLIENT_QUOTAS:
        return _Request([(c.entity_type, c.match_type, c.match) for c in req.components], bool(req.strict))
    return _Request([(tuple((e.entity_type, e.entity_name) for e in x.entity),
                      tuple((op.key, op.value, op.remove) for op in x.ops)) for x in req.entries],
                    bool(req.validate_only))


def _alter_with_rules(quotas: dict[QuotaEntity, dict[str, float]], entries: Sequence[tuple[EntityParts, Ops]],
                      validate_only: bool, unenforced: frozenset[str]) -> AlterResult:
    """alter(), with the rules of its new quotas made too when it changes any (both in the
    decode thread)."""
    result = alter(quotas, entries, validate_only, unenforced)
    return replace(result, rules=rules_from_quotas(result.new_quotas)) if result.changes else result


async def _answer_off_loop(build: Callable[..., bytes], header: RequestHeader, *args: Any) -> Answer:
    return Answer(await off_loop(build, header, *args))


def _describe_answer(header: RequestHeader, in_force: dict[QuotaEntity, dict[str, float]],
                     components: Sequence[tuple[str, int, str | None]], strict: bool) -> bytes:
    return _describe_response(header, describe(in_force, components, strict))


def _describe_response(header: RequestHeader, result: DescribeResult) -> bytes:
    version = header.api_version
    cls: Any = SPECS[DESCRIBE_CLIENT_QUOTAS].response[version]
    entries = None
    if result.entries is not None:
        entries = [cls.EntryData(
            entity=[cls.EntryData.EntityData(entity_type=t, entity_name=n) for t, n in e.entity.parts],
            values=[cls.EntryData.ValueData(key=k, value=float(v)) for k, v in sorted(e.values.items())],
        ) for e in result.entries]
    # The connection writes the throttle of every quota into the answer (KIP-219).
    resp = cls(throttle_time_ms=0, error_code=result.error_code, error_message=result.error_message,
               entries=entries)
    return _head(header, DESCRIBE_CLIENT_QUOTAS) + encode_body(resp)


def _alter_response(header: RequestHeader, result: AlterResult) -> bytes:
    cls: Any = SPECS[ALTER_CLIENT_QUOTAS].response[header.api_version]
    entries = [cls.EntryData(error_code=r.error_code, error_message=r.error_message,
                             entity=_entity_data(cls.EntryData.EntityData, r.entity))
               for r in result.response_entries()]
    return _head(header, ALTER_CLIENT_QUOTAS) + encode_body(cls(throttle_time_ms=0, entries=entries))


def _entity_data(cls: Any, parts: Iterable[tuple[str, str | None]]) -> list[Any]:
    return [cls(entity_type=t, entity_name=n) for t, n in parts]


def _head(header: RequestHeader, api_key: int) -> bytes:
    return encode_response_header(header.correlation_id, response_header_is_flexible(api_key, header.api_version))
