"""ShareFetch (78) and ShareAcknowledge (79), KIP-932's share-group data APIs, which
kafka-python 3.0.12 has no classes for.

The definitions (protocol/schemas/*.json) follow Kafka's message definitions: v0 as Kafka 4.0
shipped it (early access), v1 as Kafka 4.1+ and librdkafka 2.16 speak it (ShareFetchRequest adds
MaxRecords and BatchSize and drops PartitionMaxBytes; ShareFetchResponse adds
AcquisitionLockTimeoutMs), v2 as Kafka 4.2 defines it (ShareFetchRequest adds ShareAcquireMode,
KIP-1206, and IsRenewAck, KIP-1222; ShareAcknowledgeRequest adds IsRenewAck and its response
AcquisitionLockTimeoutMs, KIP-1222; ShareFetchResponse v2 is v1). Both APIs are flexible from v0; ``CurrentLeader`` and
``NodeEndpoints`` are ordinary fields here, not tagged ones as in Fetch (KIP-951). Importing this
module registers the classes with kafka-python, so protocol.apis knows them as it knows the rest.
"""

from __future__ import annotations

from kafka.protocol.api_message import ApiMessage

from . import schemas

# kafka-python ships no type information: its ApiMessage is Any to mypy, and the metaclass
# keyword load_json (where to read the definition from) unknown to it.


class ShareFetchRequest(ApiMessage, load_json=schemas):  # type: ignore[misc,call-arg]
    pass


class ShareFetchResponse(ApiMessage, load_json=schemas):  # type: ignore[misc,call-arg]
    pass


class ShareAcknowledgeRequest(ApiMessage, load_json=schemas):  # type: ignore[misc,call-arg]
    pass


class ShareAcknowledgeResponse(ApiMessage, load_json=schemas):  # type: ignore[misc,call-arg]
    pass
