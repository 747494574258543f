"""Benchmarks for kafka-quota-proxy (never timed assertions inside tests).

``python -m bench.run`` compares four ways of reaching one Tansu broker: directly, through a
plain asyncio byte pump (``bench.byte_pump``, the ceiling for any Python proxy), through this
proxy, and through Tansu's own Rust proxy. See ``bench/README.md``.
"""
