"""CurveZMQ keys, the ZAP allow-list of every bound socket, and which role may send what.

Each node has one keypair. A bound socket is a CURVE server in a ZAP domain named after
its service; the authenticator admits a client only if its key belongs to a node that runs
a role allowed to talk to that service, and names the connection after that node (ZAP
User-Id). A receiving role then checks each message against `SENDERS` with `Guard`.
"""

from __future__ import annotations

import datetime
import logging
import os
import stat
import time
from dataclasses import dataclass, field
from pathlib import Path

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from qmigrate.wire import protocol as P

log = logging.getLogger("qmigrate.security")

PUBLIC_SUFFIX = ".key"
SECRET_SUFFIX = ".key_secret"
KEY_LEN = 40  # a 32-byte key in Z85
MAX_LOGGED_REFUSALS = 4096
ZAP_REBIND_S = 2.0  # how long a new ZAP handler waits for the old one's address

# Receiving service -> message type -> roles whose nodes may send it. A message type that is
# not listed for a service is refused from every node while security is on.
SENDERS: dict[str, dict[type, tuple[str, ...]]] = {
    "router": {P.Hello: ("worker", "ingest"), P.Heartbeat: ("worker",), P.Pulse: ("worker",),
               P.WorkRequest: ("worker",), P.StepResult: ("worker",), P.Tokens: ("worker",), P.Submit: ("ingest",),
               P.Drain: ("operator",), P.StatsRequest: ("operator", "ingest"), P.Cancel: ("ingest",),
               P.Resync: ("detokenizer",), P.Printed: ("detokenizer",)},
    # Everything for the detokenizer comes through the router (see router/loop.py).
    "detokenizer": {P.Tokens: ("router",), P.RequestMeta: ("router",), P.RequestError: ("router",),
                    P.InputClosed: ("router",), P.Cancel: ("router",)},
    "ingest": {P.FeedLines: ("operator",)},
    "ingest_reply": {P.Replies: ("detokenizer",)},
    "telemetry": {P.VramReport: ("monitor",)},
    "kv": {P.KVHeader: ("worker",)},
}
_WORKER_ONLY = tuple(t for t, roles in SENDERS["router"].items() if roles == ("worker",))


class SecurityError(RuntimeError):
    """A node cannot secure its links (a key file missing, unreadable or too open): one line."""


# --- key files ---------------------------------------------------------------------------

def _command(directory: str | os.PathLike, node: str) -> str:
    return f"qmigrate keys generate {directory} --node {node}"


def generate_keys(directory: str | os.PathLike, node: str, *, force: bool = False) -> tuple[Path, Path]:
    """Write NODE.key (public) and NODE.key_secret (owner-only) in the ZeroMQ certificate format."""
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    public_path, secret_path = out / f"{node}{PUBLIC_SUFFIX}", out / f"{node}{SECRET_SUFFIX}"
    if not force and (public_path.exists() or secret_path.exists()):
        raise SecurityError(f"{secret_path} or {public_path} already exists; pass --force to replace "
                            "the keypair (every node must then be given the new public key)")
    public, secret = zmq.curve_keypair()
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    head = f"#   qmigrate CURVE key of node {node}, made {stamp}\n"
    body = f'metadata\ncurve\n    public-key = "{public.decode()}"\n'
    _write(secret_path, head + "#   SECRET: keep on this node, readable by its owner only.\n"
           + body + f'    secret-key = "{secret.decode()}"\n', 0o600)
    _write(public_path, head + body, 0o644)
    return public_path, secret_path


def _write(path: Path, text: str, mode: int) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.unlink(missing_ok=True)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    os.chmod(tmp, mode)  # the umask may have narrowed it; never widened past `mode`
    os.replace(tmp, path)


def looks_like_key(text: str) -> bool:
    """A 40-character Z85 key given inline, rather than a path to one."""
    if len(text) != KEY_LEN or os.path.exists(text):
        return False
    try:
        return len(z85.decode(text)) == 32
    except (ValueError, KeyError, IndexError):
        return False


def _load(path: Path, node: str, what: str, keys_dir: str) -> tuple[bytes, bytes | None]:
    if not path.is_file():
        hint = "make it there" if what == "secret" else "copy it from that node, or make the pair"
        raise SecurityError(f"node {node}: {what} key file {path} is missing; {hint} with: "
                            f"{_command(keys_dir, node)}")
    if what == "secret" and path.stat().st_mode & (stat.S_IRWXG | stat.S_IRWXO):
        raise SecurityError(f"node {node}: secret key file {path} is readable by others "
                            f"(mode {stat.S_IMODE(path.stat().st_mode):o}); run: chmod 600 {path}")
    try:
        public, secret = zmq.auth.load_certificate(path)
        if len(public) != KEY_LEN or (secret is not None and len(secret) != KEY_LEN):
            raise ValueError("a key is not 40 Z85 characters")
    except (OSError, ValueError) as exc:
        raise SecurityError(f"node {node}: cannot read {what} key file {path}: {exc}") from None
    if what == "secret" and secret is None:
        raise SecurityError(f"node {node}: {path} holds no secret key (is it the public {PUBLIC_SUFFIX} file?)")
    return public, secret


def public_key(topo, node: str) -> bytes:
    """The node's public key: inline, a key file, or NODE.key in a directory (default keys_dir)."""
    spec = topo.node(node).public_key
    keys_dir = topo.security.keys_dir
    if spec and looks_like_key(spec):
        return spec.encode()
    path = Path(spec or keys_dir)
    if path.is_dir() or not spec:
        path = path / f"{node}{PUBLIC_SUFFIX}"
    return _load(path, node, "public", str(path.parent))[0]


def secret_key_path(topo, node: str) -> Path:
    spec = topo.node(node).secret_key
    return Path(spec) if spec else Path(topo.security.keys_dir) / f"{node}{SECRET_SUFFIX}"


def open_warning(topo) -> str | None:
    """What a node says at every start while security is turned off by hand."""
    if topo.security.enabled != "off" or topo.transport != "tcp":
        return None
    return ("security.enabled is off: this node's tcp links accept anyone who reaches them "
            "and travel unencrypted (docs/security.md)")


# --- who runs what -----------------------------------------------------------------------

def node_of(topo, role: str, name: str) -> str:
    if role == "worker":
        return topo.worker(name).node
    if role == "monitor":
        return name
    return getattr(topo, role).node


def operator_nodes(topo) -> list[str]:
    return list(topo.security.operators) or list(dict.fromkeys([topo.router.node, topo.ingest.node]))


def node_roles(topo) -> dict[str, frozenset[str]]:
    roles: dict[str, set[str]] = {n.name: {r for r, _ in topo.roles_on(n.name)} for n in topo.nodes}
    for name in operator_nodes(topo):
        roles[name].add("operator")
    return {name: frozenset(r) for name, r in roles.items()}


class Guard:
    """Whether a message may come from a node, by the role table; refusals logged once each."""

    def __init__(self, service: str, roles: dict[str, frozenset[str]] | None, worker_nodes: dict[str, str]):
        self.service, self.roles, self.worker_nodes = service, roles, worker_nodes
        self.allowed = SENDERS[service]
        self.logged: set[tuple[str, str]] = set()

    @classmethod
    def for_topology(cls, topo, service: str) -> Guard:
        roles = node_roles(topo) if topo.is_secure else None
        return cls(service, roles, {w.name: w.node for w in topo.workers})

    def refusal(self, peer: str, msg, identity: bytes = b"") -> str | None:
        """None if `peer` (a node name from ZAP) may send `msg` here, else why not."""
        if self.roles is None:
            return None  # security off: no peer identities to check
        kind = type(msg).__name__
        senders = self.allowed.get(type(msg))
        if senders is None:
            return f"{kind} is not accepted by the {self.service}"
        roles = self.roles.get(peer, frozenset())
        if not roles.intersection(senders):
            return f"{kind} is sent by {' or '.join(senders)} nodes; node {peer or '?'} runs {', '.join(sorted(roles)) or 'nothing'}"
        if isinstance(msg, P.Hello):
            if msg.role not in senders or msg.role not in roles:
                return f"node {peer} does not run the {msg.role} role"
            if msg.role == "worker" and self.worker_nodes.get(msg.name) != peer:
                return f"worker {msg.name!r} does not run on node {peer}"
        if isinstance(msg, P.Pulse) and self.worker_nodes.get(msg.name) != peer:
            return f"worker {msg.name!r} does not run on node {peer}"  # it names the worker it keeps alive
        name = identity.decode(errors="replace")
        if isinstance(msg, _WORKER_ONLY) and self.worker_nodes.get(name, peer) != peer:
            return f"worker {name!r} does not run on node {peer}"  # an identity the router knows as a worker
        return None

    def check(self, peer: str, msg, identity: bytes = b"") -> str | None:
        reason = self.refusal(peer, msg, identity)
        if reason is not None and (peer, type(msg).__name__) not in self.logged:
            self.logged.add((peer, type(msg).__name__))
            log.warning("refused a %s from node %s: %s", type(msg).__name__, peer or "?", reason)
        return reason


# --- the keyring a process secures its sockets with --------------------------------------

@dataclass(slots=True)
class Keyring:
    node: str
    public: bytes
    secret: bytes
    server_keys: dict[str, bytes] = field(default_factory=dict)   # connect endpoint -> server key
    domains: dict[str, str] = field(default_factory=dict)         # bind endpoint -> ZAP domain
    clients: dict[str, dict[bytes, str]] = field(default_factory=dict)  # domain -> key -> node

    def apply(self, sock: zmq.Socket, bind: str | None, connect: list[str]) -> None:
        sock.curve_publickey, sock.curve_secretkey = self.public, self.secret
        if bind:
            domain = self.domains.get(bind)
            if domain is None:
                raise SecurityError(f"{bind} is not an endpoint of the topology; no allow-list for it")
            sock.curve_server = True
            sock.zap_domain = domain.encode()
            sock.setsockopt(zmq.ZAP_ENFORCE_DOMAIN, 1)  # no authenticator: refuse, never admit
        keys = {self.server_keys.get(e) for e in connect}
        if None in keys:
            unknown = next(e for e in connect if e not in self.server_keys)
            raise SecurityError(f"{unknown} is not an endpoint of the topology; its key is unknown")
        if len(keys) > 1:
            raise SecurityError("one socket cannot connect to servers with different keys")
        if keys:
            sock.curve_serverkey = keys.pop()

    def start(self, context: zmq.Context) -> ThreadAuthenticator:
        # A handler stopped just before (a keyring replaced in this process) closes its socket
        # in zmq's background thread: its inproc address is free a moment later, not at once.
        deadline = time.monotonic() + ZAP_REBIND_S
        while True:
            auth = _Authenticator(context, self.clients)
            try:
                auth.start()
                break
            except zmq.ZMQError as e:
                auth.stop()
                if e.errno != zmq.EADDRINUSE or time.monotonic() > deadline:
                    raise
                time.sleep(0.01)
        for domain in self.clients:
            auth.configure_curve_callback(domain, auth)
        return auth


def keyring(topo, node: str) -> Keyring | None:
    """The keys `node` secures its links with; None when the topology's security is off."""
    if not topo.is_secure:
        return None
    path = secret_key_path(topo, node)
    public, secret = _load(path, node, "secret", str(path.parent))
    keys = {n.name: public_key(topo, n.name) for n in topo.nodes}
    if keys[node] != public:
        raise SecurityError(f"node {node}: the secret key in {path} does not match the node's public key "
                            "in the topology")
    ring = Keyring(node, public, secret)
    roles = node_roles(topo)
    owners = {"router": topo.router.node, "telemetry": topo.router.node, "ingest": topo.ingest.node,
              "ingest_reply": topo.ingest.node, "detokenizer": topo.detokenizer.node}
    services = [(s, topo.endpoint(s), owner) for s, owner in owners.items()]
    services += [("kv", topo.endpoint("kv", w.name), w.node) for w in topo.workers]
    for service, endpoint, owner in services:
        ring.server_keys[endpoint.connect] = keys[owner]
        ring.domains[endpoint.bind] = service
        senders = {r for roles_ in SENDERS[service].values() for r in roles_}
        ring.clients[service] = {keys[n]: n for n, r in roles.items() if r & senders}
    return ring


class _Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP handler with a per-domain allow-list; the User-Id of a connection is its node."""

    def __init__(self, context: zmq.Context, clients: dict[str, dict[bytes, str]]):
        super().__init__(context, log=logging.getLogger("qmigrate.zap"))
        self.clients = clients
        self.names = {key: name for allowed in clients.values() for key, name in allowed.items()}
        self.address = ""
        self.refused: set[tuple[str, bytes]] = set()

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        if len(msg) > 3:  # RFC 27: version, request id, domain, address, ...
            self.address = msg[3].decode(errors="replace")
        await super().handle_zap_message(msg)

    def callback(self, domain: str, key: bytes) -> bool:
        if key in self.clients.get(domain, {}):
            return True
        if (self.address, key) not in self.refused:
            if len(self.refused) >= MAX_LOGGED_REFUSALS:
                self.refused.clear()  # bounded memory against a peer that cycles keys
            self.refused.add((self.address, key))
            who = f"node {self.names[key]}" if key in self.names else "an unlisted key"
            log.warning("refused a connection to the %s from %s at %s (key %s)", domain, who,
                        self.address, key.decode(errors="replace"))
        return False

    def curve_user_id(self, client_public_key: bytes) -> str:
        return self.names.get(z85.encode(client_public_key), "")
