"""`qmigrate bench curve`, the link alone: round trips over loopback tcp with and without CURVE.

A DEALER asks, a ROUTER answers the same bytes back, as a worker and the router do each
step. The time of a round trip, plain against CURVE, isolates what encryption and
authentication add per message from everything else a pipeline run measures.
"""

from __future__ import annotations

import tempfile
import time

import zmq

SIZES = (256, 4096, 65536)  # a diff lease, a batch of new tokens, a batch of full prompts


def round_trip_us(size: int, num_trips: int, curve: bool) -> float:
    """Median microseconds per round trip of a `size`-byte message."""
    from qmigrate.wire import security, transport
    from qmigrate.config import parse_topology
    with tempfile.TemporaryDirectory(prefix="qm-link-") as tmp:
        topo = parse_topology({
            "security": {"enabled": "on" if curve else "off", "keys_dir": tmp},
            "nodes": [{"name": "local"}], "router": {"node": "local", "port": _free_port()},
            "ingest": {"node": "local"}, "detokenizer": {"node": "local"},
            "workers": [{"name": "w1", "node": "local"}]}, source="bench link")
        if curve:
            security.generate_keys(tmp, "local")
        transport.secure(security.keyring(topo, "local"))
        endpoint = topo.endpoint("router")
        server = transport.socket(zmq.ROUTER, bind=endpoint.bind)
        client = transport.socket(zmq.DEALER, connect=endpoint.connect, identity="w1")
        try:
            payload = b"x" * size
            times = []
            for i in range(num_trips + 10):  # the first trips include the handshake
                t0 = time.perf_counter()
                client.send(payload)
                peer, data = server.recv_multipart()
                server.send_multipart([peer, data])
                client.recv()
                if i >= 10:
                    times.append(time.perf_counter() - t0)
            times.sort()
            return times[len(times) // 2] * 1e6
        finally:
            client.close(linger=0)
            server.close(linger=0)
            transport.secure(None)


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def link_table(num_trips: int = 2000) -> tuple[str, list[dict]]:
    rows = []
    for size in SIZES:
        plain = round_trip_us(size, num_trips, curve=False)
        curve = round_trip_us(size, num_trips, curve=True)
        rows.append({"bytes": size, "plain_us": plain, "curve_us": curve})
    lines = [f"{'message':>10} {'plain tcp us':>13} {'CURVE us':>9} {'added us':>9}   (round trip, median of {num_trips})"]
    lines += [f"{r['bytes']:>9}B {r['plain_us']:13.1f} {r['curve_us']:9.1f} {r['curve_us'] - r['plain_us']:9.1f}"
              for r in rows]
    return "\n".join(lines), rows
