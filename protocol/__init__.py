"""Kafka wire format: framing, headers, API versions and the messages the proxy rewrites.

Nothing in this package performs I/O or imports asyncio.
"""
