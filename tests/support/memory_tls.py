"""A TLS handshake between two ``ssl.SSLContext`` over memory buffers (``ssl.MemoryBIO``), no
sockets: what one side presents and what the other makes of it, read from the returned ends."""

from __future__ import annotations

import ssl


def handshake_in_memory(client: ssl.SSLContext, server: ssl.SSLContext,
                        hostname: str) -> tuple[ssl.SSLObject, ssl.SSLObject]:
    """Runs a handshake to its end (``hostname`` is the client's ``server_hostname``); returns
    the client's and the server's ``SSLObject``. AssertionError when it does not finish; a
    refusal raises the ``ssl.SSLError`` of the side that refused."""
    c_in, c_out, s_in, s_out = ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO(), ssl.MemoryBIO()
    c = client.wrap_bio(c_in, c_out, server_hostname=hostname)
    s = server.wrap_bio(s_in, s_out, server_side=True)
    done = {"c": False, "s": False}
    for _ in range(20):
        for name, side in (("c", c), ("s", s)):
            if not done[name]:
                try:
                    side.do_handshake()
                    done[name] = True
                except ssl.SSLWantReadError:
                    pass
        s_in.write(c_out.read())
        c_in.write(s_out.read())
        if all(done.values()):
            return c, s
    raise AssertionError("the in-memory handshake did not finish")
