"""Small clients of running nodes: the prompt feeder and one-shot control requests."""

from __future__ import annotations

import sys
import time

import zmq

from qmigrate.wire import protocol as P
from qmigrate.wire import transport

FEED_BATCH = 64


def ask(endpoint: str, msg, expect: type, timeout_s: float, what: str):
    """One request to a running role; exits with a message naming the address on timeout."""
    try:
        return transport.request(endpoint, msg, timeout_s=timeout_s, expect=expect)
    except transport.Unreachable:
        hint = "; with security on, a node not allowed this command gets no answer either" \
            if transport.is_secure() else ""
        print(f"error: {what} unreachable at {endpoint} (no answer in {timeout_s:g} s{hint})", file=sys.stderr)
        raise SystemExit(1)


def feed_lines(endpoint: str, stream, timeout_s: float) -> int:
    """Send every line of `stream` to the ingest at `endpoint`, waiting while it is full."""
    sock = transport.socket(zmq.DEALER, connect=endpoint)
    batch: list[str] = []
    sent = 0
    try:
        for line in stream:
            batch.append(line)
            if len(batch) >= FEED_BATCH:
                sent += _send(sock, batch, endpoint, timeout_s)
                batch = []
        while batch:
            taken = _send(sock, batch, endpoint, timeout_s)
            sent += taken
            batch = batch[taken:]
    except TimeoutError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    finally:
        sock.close(linger=0)
    print(f"fed {sent} prompts to {endpoint}", file=sys.stderr)
    return 0


def _send(sock, lines: list[str], endpoint: str, timeout_s: float) -> int:
    """Send until ingest has taken every line; returns how many it took."""
    taken = 0
    while taken < len(lines):
        transport.send(sock, P.FeedLines(lines[taken:]))
        got = transport.recv(sock, timeout_s)
        if got is None:
            raise TimeoutError(f"ingest unreachable at {endpoint} (no answer in {timeout_s:g} s)")
        if isinstance(got[1], P.FeedAck):
            taken += got[1].num_accepted
            if got[1].num_accepted == 0:
                time.sleep(0.05)  # ingest is full: the router is holding as much as it may
    return taken
