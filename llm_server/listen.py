"""The TCP socket every server here listens on."""

from __future__ import annotations

import socket


def tcp_socket(family: socket.AddressFamily = socket.AF_INET) -> socket.socket:
    """A TCP socket to bind and hand to uvicorn (`serve(sockets=[...])`).

    asyncio turns Nagle's algorithm off (TCP_NODELAY) only on connections whose socket says
    IPPROTO_TCP, and `socket.socket(family, SOCK_STREAM)` says 0, as do the sockets `accept`
    makes from it. Left on, a response written in two parts (uvicorn's h11: the headers, then
    the body) held its second part until the client acknowledged the first, which a client on
    a kept-alive connection delays ~40 ms: every request after a connection's first took 40 ms
    more (GET /health 3 ms -> 44 ms)."""
    return socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
