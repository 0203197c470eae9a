"""Connections to every server here have Nagle's algorithm off (llm_server.listen.tcp_socket).

With it on, uvicorn's two writes of a response (headers, then body) waited for the client's
delayed ACK: ~40 ms on every request after a kept-alive connection's first."""

from __future__ import annotations

import argparse
import asyncio
import socket

import httpx
import pytest

from llm_server.cli import _bind
from llm_server.testing.live import serving


def _accepted_nodelay(sock: socket.socket) -> int:
    """TCP_NODELAY of a connection an asyncio server on `sock` accepts (as uvicorn serves)."""
    got: list[int] = []

    class Probe(asyncio.Protocol):
        def connection_made(self, transport) -> None:
            conn = transport.get_extra_info("socket")
            got.append(conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
            transport.close()

    async def main() -> None:
        sock.listen()
        server = await asyncio.get_running_loop().create_server(Probe, sock=sock)
        _, writer = await asyncio.open_connection(*sock.getsockname()[:2])
        for _ in range(500):
            if got:
                break
            await asyncio.sleep(0.01)
        writer.close()
        server.close()
        await server.wait_closed()

    asyncio.run(main())
    return got[0]


def test_the_servers_socket_turns_nagle_off_on_its_connections():
    sock, url = _bind(argparse.Namespace(uds=None, host="127.0.0.1", port=0))
    assert url.startswith("http://127.0.0.1:")
    assert _accepted_nodelay(sock) != 0
    plain = socket.socket(socket.AF_INET, socket.SOCK_STREAM)  # the cause: asyncio skips it
    plain.bind(("127.0.0.1", 0))
    assert _accepted_nodelay(plain) == 0


@pytest.mark.timeout(120)
def test_the_test_servers_listen_the_same_way(tiny_model_path):
    """The live server the API tests use (and the agents' proxy, the managed server)."""
    with serving(tiny_model_path) as srv, httpx.Client(base_url=srv.url, timeout=30) as c:
        assert srv._sock.proto == socket.IPPROTO_TCP
        assert c.get("/health").json()["ready"]
