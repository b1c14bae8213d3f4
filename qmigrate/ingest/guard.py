"""What one HTTP client can hold of the API: its connections are counted by address and one
past `max_per_client` is closed as soon as it opens. (Time limits are aiohttp's keep-alive
timeout, which also ends a connection that never finishes its headers, and the body read's.)"""

from __future__ import annotations

from collections import Counter

from qmigrate.ops import logs


def _host(transport) -> str:
    peer = transport.get_extra_info("peername")
    return str(peer[0]) if isinstance(peer, tuple) and peer else str(peer)


class ClientLimit:
    """Hooks aiohttp's low-level Server (`runner.server`), whose connection_made and
    connection_lost see every connection of the site."""

    def __init__(self, max_per_client: int) -> None:
        self.max_per_client = max_per_client
        self.open: Counter[str] = Counter()
        self.host_of: dict[object, str] = {}   # handler -> its client's address, while open
        self.num_refused = 0

    def install(self, server) -> None:
        made, lost = server.connection_made, server.connection_lost

        def connection_made(handler, transport) -> None:
            made(handler, transport)
            host = _host(transport)
            if self.open[host] >= self.max_per_client:
                self.num_refused += 1
                logs.dropped.warning("closed a connection from %s: it holds %d open already", host,
                                     self.max_per_client)
                handler.force_close()
                return
            self.open[host] += 1
            self.host_of[handler] = host

        def connection_lost(handler, exc=None) -> None:
            host = self.host_of.pop(handler, None)
            if host is not None:
                self.open[host] -= 1
                if not self.open[host]:
                    del self.open[host]
            lost(handler, exc)

        server.connection_made, server.connection_lost = connection_made, connection_lost
