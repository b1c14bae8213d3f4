"""ZeroMQ plumbing: sockets with safe options, timed receives, one-shot requests."""

from __future__ import annotations

import logging
import os
import time

import zmq

from qmigrate.ops import logs
from qmigrate.wire import protocol
from qmigrate.wire import codec
from qmigrate.wire.protocol import ProtocolError

log = logging.getLogger(__name__)
dropped_log = logs.dropped  # malformed messages: a peer can send them as fast as it likes

KV_MAX_MESSAGE_BYTES = 4 << 30


class Unreachable(RuntimeError):
    pass


_context: zmq.Context | None = None
_keyring = None         # security.Keyring: every socket made here uses CURVE with it
_authenticator = None   # the ZAP handler of this process's context while a keyring is set


def _forget_in_child() -> None:
    """A forked child starts with none of these: a context's I/O threads, and the
    authenticator's, do not survive a fork, and a child secures its own sockets if it is to."""
    global _context, _keyring, _authenticator
    _context = _keyring = _authenticator = None


os.register_at_fork(after_in_child=_forget_in_child)


def context() -> zmq.Context:
    global _context
    if _context is None or _context.closed:
        _context = zmq.Context()
    return _context


def secure(keyring) -> None:
    """Secure every socket made from now on with `keyring` (None: plain sockets again)."""
    global _keyring, _authenticator
    if _authenticator is not None:
        _authenticator.stop()
        _authenticator = None
    _keyring = keyring
    if keyring is not None:
        _authenticator = keyring.start(context())


def end() -> None:
    """Deliver what this process's closed sockets still queue, each within the linger it was
    closed with, then end its context: for a role leaving on purpose, once it has closed its
    sockets. A process that ends without this loses what they hold (os._exit takes zmq's I/O
    thread along, and a socket connected just before, as a KV shipment's to a new peer is, has
    usually sent nothing yet). A socket still open is closed at once, its messages dropped."""
    global _context, _authenticator
    if _authenticator is not None:
        _authenticator.stop()
        _authenticator = None
    if _context is not None:
        _context.destroy(linger=0)   # sockets closed before keep their own linger
        _context = None


def is_secure() -> bool:
    return _keyring is not None


def _prepare_ipc(endpoint: str) -> None:
    if endpoint.startswith("ipc://"):
        os.makedirs(os.path.dirname(endpoint[len("ipc://"):]) or ".", exist_ok=True)


def _in_process(bind: str | None, endpoints: list[str]) -> bool:
    """An inproc:// socket never leaves this process: no keys, at either end (a CURVE end
    cannot talk to a plain one, so the connecting side must be exempt as the binding one is)."""
    names = ([bind] if bind else []) + endpoints
    return bool(names) and all(name.startswith("inproc://") for name in names)


def socket(kind: int, *, bind: str | None = None, connect: str | list[str] | None = None,
           identity: str | None = None, max_bytes: int = protocol.MAX_MESSAGE_BYTES,
           hwm: int = 10_000, curve: bool = True) -> zmq.Socket:
    """`curve` False: no CURVE even in a secured process, for a socket that only this
    machine's own processes reach (an ipc:// path in a private directory)."""
    sock = context().socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    # A peer sending more than this is disconnected instead of exhausting our memory.
    sock.setsockopt(zmq.MAXMSGSIZE, max_bytes)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.RCVHWM, hwm)
    if kind == zmq.ROUTER:
        # Without this a reply to a peer that went away vanishes silently.
        sock.setsockopt(zmq.ROUTER_MANDATORY, 1)
    if identity is not None:
        sock.setsockopt(zmq.IDENTITY, identity.encode())
    endpoints = [connect] if isinstance(connect, str) else list(connect or [])
    if _keyring is not None and curve and not _in_process(bind, endpoints):
        try:
            _keyring.apply(sock, bind, endpoints)
        except Exception:
            sock.close(linger=0)
            raise
    if bind:
        _prepare_ipc(bind)
        sock.bind(bind)
    for endpoint in endpoints:
        sock.connect(endpoint)
    return sock


num_dropped = 0  # sends refused because the peer's queue was full (or no peer)


def send(sock: zmq.Socket, msg, *, to: bytes | None = None, flags: int = zmq.NOBLOCK) -> bool:
    """Send one message; to a ROUTER peer when `to` is given. False if it could not go.

    Never blocks by default: a peer that stops reading fills its queue up to the high-water
    mark, and from then on what is sent to it is dropped (and counted) until it reads again.
    Each caller's rule for a dropped message: a reply or heartbeat is simply lost, a request
    is sent again on its own timeout."""
    return send_frame(sock, codec.encode(msg), to=to, flags=flags, what=type(msg).__name__)


def send_frame(sock: zmq.Socket, frame: bytes, *, to: bytes | None = None, flags: int = zmq.NOBLOCK,
               what: str = "message") -> bool:
    global num_dropped
    frames = [frame] if to is None else [to, frame]
    try:
        sock.send_multipart(frames, flags=flags, copy=False)
        return True
    except zmq.Again:
        num_dropped += 1
        if num_dropped & (num_dropped - 1) == 0:  # 1, 2, 4, ...: a log line, not a flood
            log.warning("a peer is not reading: dropped a %s (%d dropped so far)", what, num_dropped)
        return False
    except zmq.ZMQError as exc:
        if exc.errno == zmq.EHOSTUNREACH:
            log.warning("peer %r is gone; dropped a %s", to, what)
            return False
        raise


def parse(frame: bytes, origin: str):
    """Decode one frame, logging and returning None when it is malformed."""
    try:
        return codec.decode(frame)
    except ProtocolError as exc:
        dropped_log.warning("dropped malformed message from %s: %s", origin[:64], exc)
        return None


def recv_frames(sock: zmq.Socket, flags: int = 0) -> tuple[list[bytes], str]:
    """One multipart message, and the node that sent it as ZAP named it ("" when not secured)."""
    if _keyring is None:
        return sock.recv_multipart(flags, copy=True), ""
    frames = sock.recv_multipart(flags, copy=False)
    try:
        peer = frames[-1].get("User-Id")
    except zmq.ZMQError:  # a connection without ZAP metadata
        peer = ""
    return [f.bytes for f in frames], peer


def recv(sock: zmq.Socket, timeout_s: float, guard=None):
    """Receive one message within timeout_s: (sender identity or None, message) or None.
    A message that `guard` (a security.Guard) refuses comes back as None, like a malformed one."""
    if not sock.poll(int(timeout_s * 1000)):
        return None
    frames, peer = recv_frames(sock)
    sender = frames[0] if sock.type == zmq.ROUTER and len(frames) > 1 else None
    msg = parse(frames[-1], sender.decode(errors="replace") if sender else "peer")
    if msg is not None and guard is not None and guard.check(peer, msg, sender or b"") is not None:
        msg = None
    return sender, msg


def request(endpoint: str, msg, *, timeout_s: float = 5.0, expect: type | tuple = ()):
    """One request, one reply, on a fresh DEALER socket. Raises Unreachable on timeout."""
    sock = socket(zmq.DEALER, connect=endpoint)
    try:
        send(sock, msg)
        deadline = time.monotonic() + timeout_s
        while (left := deadline - time.monotonic()) > 0:
            got = recv(sock, left)
            if got is None:
                break
            reply = got[1]
            if reply is not None and (not expect or isinstance(reply, expect)):
                return reply
        raise Unreachable(f"no answer from {endpoint} within {timeout_s:g} s")
    finally:
        sock.close(linger=0)
