"""Kafka error codes the proxy produces or reacts to (org.apache.kafka.common.protocol.Errors)."""

NONE = 0
CORRUPT_MESSAGE = 2
NOT_LEADER_OR_FOLLOWER = 6
UNSUPPORTED_VERSION = 35
FENCED_LEADER_EPOCH = 74
THROTTLING_QUOTA_EXCEEDED = 89
