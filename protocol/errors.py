"""Kafka error codes the proxy produces or reacts to (org.apache.kafka.common.protocol.Errors),
and the one exception type the protocol package raises for input that breaks the protocol."""

NONE = 0
CORRUPT_MESSAGE = 2
NOT_LEADER_OR_FOLLOWER = 6
UNSUPPORTED_VERSION = 35
INVALID_REQUEST = 42
POLICY_VIOLATION = 44
FENCED_LEADER_EPOCH = 74
THROTTLING_QUOTA_EXCEEDED = 89


class ProtocolError(ValueError):
    """A frame or body that does not follow the Kafka protocol; the connection it came from is
    closed.

    Every function in ``protocol`` that reads a request or response body raises this (through
    a subclass naming what was being read: FrameError for the byte stream's own framing,
    HeaderError, DecodeError, ScanError, RecordsError) and nothing else, whatever the bytes; a
    filter lets it through, and the connection closes cleanly, with one log line and a counter.
    """
