"""The usage log's contract: what ``proxy`` writes and ``pipeline`` reads (``usage.schema``).

Owned by neither side, so the PySpark jobs never import the asyncio proxy to learn a column
name. Imports nothing of this project's.
"""
