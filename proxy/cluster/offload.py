"""Decoding and encoding big message bodies off the event loop.

kafka-python decodes a message into objects at 10-25 µs a struct: a CreateTopics of 50,000
topics, or a FindCoordinator answer of 50,000 groups, is most of a second of Python. Done on
the event loop, that second is every other client's of the process. A body longer than
:data:`OFFLOAD_BYTES` is decoded (and its rewrite encoded) in one thread of its own instead; the
filter that needs it returns ``Defer`` or ``Hold``, so the connection's requests and responses
keep their order. The loop still shares the interpreter with that thread, but never waits for
it longer than the interpreter's switch interval (set to 0.5 ms) at a time, nor for a full pass
of the cyclic garbage collector over what it decodes (off while it decodes).

What stays on the loop is the filter's own work on the decoded message (a few µs a topic) and
what only the loop may touch (quota engines, caches, listeners).
"""

from __future__ import annotations

import asyncio
import gc
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kafka.protocol.api_message import ApiMessage

from protocol.frames import Buffer
from protocol.messages import decode_request, decode_response, encode_body

# Bodies up to this size are decoded on the loop: about 2-4 ms of it at worst.
OFFLOAD_BYTES = 64 << 10

SWITCH_INTERVAL_S = 0.0005
T = TypeVar("T")
_pool: ThreadPoolExecutor | None = None


def is_big(body: Buffer) -> bool:
    """Whether ``body`` is decoded off the loop."""
    return len(body) > OFFLOAD_BYTES


async def off_loop(fn: Callable[..., T], *args: object) -> T:
    """``fn(*args)`` in the decode thread. One thread: big bodies are decoded one at a time,
    in the order they came, so a client sending many costs the others no more than one."""
    global _pool
    if _pool is None:
        # The loop gives up the interpreter at every system call and must then wait for the
        # decode thread to give it back: at most the switch interval, 5 ms by default, for
        # every read and write of every connection while a big body is decoded. 0.5 ms.
        sys.setswitchinterval(SWITCH_INTERVAL_S)
        _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kqp-decode")
    return await asyncio.get_running_loop().run_in_executor(_pool, _uncollected, fn, args)


def _uncollected(fn: Callable[..., T], args: tuple[object, ...]) -> T:
    """``fn(*args)`` with the cyclic garbage collector off. A big body decodes into hundreds of
    thousands of objects; each full collection the growth triggers scans all of them, holding
    the interpreter, so the loop too, for as long (a 50,000-entry AlterClientQuotas: pauses of
    40-75 ms, 23 ms at most without them). Messages are trees: reference counting frees them."""
    if not gc.isenabled():  # off for the whole process: left as it is
        return fn(*args)
    gc.disable()
    try:
        return fn(*args)
    finally:
        gc.enable()


async def decode_request_off_loop(api_key: int, api_version: int, body: Buffer) -> ApiMessage:
    return await off_loop(decode_request, api_key, api_version, body)


async def decode_response_off_loop(api_key: int, api_version: int, body: Buffer) -> ApiMessage:
    return await off_loop(decode_response, api_key, api_version, body)


async def encode_off_loop(message: ApiMessage) -> bytes:
    return await off_loop(encode_body, message)

