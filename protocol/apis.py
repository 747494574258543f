"""The Kafka APIs this proxy can decode, taken from kafka-python's schema-generated classes."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum
from typing import cast

# Importing these modules registers every request/response class kafka-python generates.
import kafka.protocol.admin
import kafka.protocol.consumer
import kafka.protocol.metadata
import kafka.protocol.producer
import kafka.protocol.sasl  # noqa: F401
from kafka.protocol.api_key import ApiKey as _KpApiKey
from kafka.protocol.api_message import ApiMessage

from . import share_messages  # noqa: F401  (ShareFetch / ShareAcknowledge, which kafka-python lacks)


class ApiKey(IntEnum):
    """Kafka API keys the proxy refers to by name."""

    PRODUCE = 0
    FETCH = 1
    METADATA = 3
    FIND_COORDINATOR = 10
    SASL_HANDSHAKE = 17
    API_VERSIONS = 18
    CREATE_TOPICS = 19
    DELETE_TOPICS = 20
    INIT_PRODUCER_ID = 22
    SASL_AUTHENTICATE = 36
    CREATE_PARTITIONS = 37
    DESCRIBE_QUORUM = 55
    DESCRIBE_CLUSTER = 60
    SHARE_GROUP_HEARTBEAT = 76
    SHARE_GROUP_DESCRIBE = 77
    SHARE_FETCH = 78
    SHARE_ACKNOWLEDGE = 79


# APIs a client needs together: offering part of a family leaves a client half-working (a
# KIP-932 share consumer that may join its group but not fetch spins on ShareFetch), so the
# proxy offers a family whole or not at all.
API_FAMILIES: tuple[frozenset[int], ...] = (
    frozenset({ApiKey.SHARE_GROUP_HEARTBEAT, ApiKey.SHARE_GROUP_DESCRIBE, ApiKey.SHARE_FETCH,
               ApiKey.SHARE_ACKNOWLEDGE}),
)


# KIP-599: the first version of each controller-mutation API whose response may say
# THROTTLING_QUOTA_EXCEEDED (strict mode); older versions are answered permissively.
STRICT_SINCE: dict[int, int] = {ApiKey.CREATE_TOPICS: 6, ApiKey.CREATE_PARTITIONS: 3, ApiKey.DELETE_TOPICS: 5}


@dataclass(frozen=True, slots=True)
class ApiSpec:
    """What the proxy knows of one API key: its classes, highest version and flexible range."""

    api_key: int
    name: str
    request: type[ApiMessage]
    response: type[ApiMessage]
    max_version: int
    first_flexible_version: int | None

    def is_flexible(self, version: int) -> bool:
        return self.first_flexible_version is not None and version >= self.first_flexible_version


def _primary_classes() -> dict[tuple[int, str], type[ApiMessage]]:
    found: dict[tuple[int, str], type[ApiMessage]] = {}
    stack = list(ApiMessage.__subclasses__())
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        if getattr(cls, "_class_version", None) is None and getattr(cls, "_json", None):
            found[(cls.API_KEY, cls.type)] = cls
    return found


def _build_registry() -> dict[int, ApiSpec]:
    classes = _primary_classes()
    specs: dict[int, ApiSpec] = {}
    for (api_key, kind), request in classes.items():
        if kind != "request" or (api_key, "response") not in classes:
            continue
        flexible = request._flexible_versions  # (first, last) or None
        first_flexible = flexible[0] if flexible and flexible[0] >= 0 else None
        specs[api_key] = ApiSpec(
            api_key=api_key,
            name=request.__name__.removesuffix("Request"),
            request=request,
            response=classes[(api_key, "response")],
            max_version=request.max_version,
            first_flexible_version=first_flexible,
        )
    return specs


SPECS: dict[int, ApiSpec] = _build_registry()

# The first flexible version of every known API (2**15, above any int16 version, for an API that
# never became flexible): one dict lookup on the request path instead of a spec method call.
FIRST_FLEXIBLE_VERSION: dict[int, int] = {
    key: 2**15 if spec.first_flexible_version is None else spec.first_flexible_version
    for key, spec in SPECS.items()
}


def api_name(api_key: int) -> str:
    """Kafka's name for ``api_key`` ("Produce", "Fetch", ...), or ``"Unknown<key>"``."""
    spec = SPECS.get(api_key)
    if spec is not None:
        return spec.name
    try:
        return cast(str, _KpApiKey(api_key).name)
    except ValueError:
        return f"Unknown{api_key}"
