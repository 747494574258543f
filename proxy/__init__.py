"""The asyncio side of kafka-quota-proxy: listeners, connections, filters, metrics, CLI."""
