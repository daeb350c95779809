"""The router's HTTP connections, bounded before any request exists: uvicorn's httptools protocol
with a deadline for each request's headers and a cap on open connections.

As shipped, uvicorn arms no timer on a new connection and cancels its keep-alive timer at the
first byte: a client that connects and sends nothing, or trickles its headers a byte at a time,
holds a connection (a file descriptor, a parser) for as long as it likes, and enough of them
exhaust the process's descriptors. Here each request's headers must be complete within
`header_timeout_s` of the connection opening (the first request) or of the previous response
ending (the next ones on a keep-alive connection); past it the connection is closed. A
connection past `max_connections` open is closed at once. Both are counted with the 401s
(`pdc_refused_total{instance="router",plane="http"}`). The body has its own deadline
(router/http_app.py, router.body_timeout_s).
"""

from __future__ import annotations

import asyncio
import resource
from collections.abc import Callable

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

FD_HEADROOM = 128  # descriptors left for the router's own sockets (request channels, KV events, files)


def connection_cap(wanted: int) -> int:
    """`wanted`, or fewer when this process may not open that many descriptors."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    return wanted if soft == resource.RLIM_INFINITY else max(1, min(wanted, soft - FD_HEADROOM))


def bounded_http(header_timeout_s: float, max_connections: int, refused: Callable[[], None]) -> type:
    """An httptools protocol class for uvicorn.Config(http=...)."""

    class BoundedHttpProtocol(HttpToolsProtocol):
        _header_deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:
            super().connection_made(transport)
            if len(self.connections) > max_connections:
                refused()
                transport.close()
                return
            self._arm()

        def _arm(self) -> None:
            self._disarm()
            self._header_deadline = self.loop.call_later(header_timeout_s, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_deadline is not None:
                self._header_deadline.cancel()
                self._header_deadline = None

        def _headers_too_slow(self) -> None:
            self._header_deadline = None
            if not self.transport.is_closing():
                refused()
                self.transport.close()

        def on_headers_complete(self) -> None:
            self._disarm()
            super().on_headers_complete()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            # Nothing pipelined (uvicorn then arms its keep-alive timer): the next request's
            # headers get the same deadline. A pipelined one already has its headers.
            if self.timeout_keep_alive_task is not None:
                self._arm()

        def connection_lost(self, exc: Exception | None) -> None:
            self._disarm()
            super().connection_lost(exc)

    return BoundedHttpProtocol
