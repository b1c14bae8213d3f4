"""Where the roles listen: a service's or a worker's KV port as bind and connect addresses
(tcp, or ipc:// under the topology's ipc_dir), and the ports a topology assigns and checks."""

from __future__ import annotations

from dataclasses import dataclass

from .config_rules import ConfigError

DEFAULT_KV_PORT = 5560
# sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_IPC_PATH = 107
# where sockets go when the temp directory is too long a path for them
SHORT_TMP = "/tmp"


@dataclass(frozen=True, slots=True)
class Endpoint:
    bind: str
    connect: str


SERVICES = {"router": ("router", "port"), "telemetry": ("router", "telemetry_port"),
            "ingest": ("ingest", "port"), "ingest_reply": ("ingest", "reply_port"),
            "detokenizer": ("detokenizer", "port")}


def endpoint(topo, kind: str, name: str | None = None) -> Endpoint:
    """The bind and connect addresses of a service (SERVICES) or of a worker's KV port."""
    if kind == "kv":
        if name is None:
            raise ConfigError(None, "endpoint kind 'kv' needs a worker name")
        worker = topo.worker(name)
        node_name, port, label = worker.node, worker.kv_port, f"kv-{name}"
    elif kind in SERVICES:
        section, attr = SERVICES[kind]
        node_name, port, label = getattr(topo, section).node, getattr(getattr(topo, section), attr), kind
    else:
        raise ConfigError(None, f"unknown endpoint kind {kind!r} (kinds: {', '.join(SERVICES)}, kv)")
    if topo.transport == "ipc":
        if not topo.ipc_dir:
            raise ConfigError("ipc_dir", "required for transport 'ipc' to build endpoints")
        path = f"{topo.ipc_dir}/{label}.sock"
        if len(path.encode()) > MAX_IPC_PATH:
            raise ConfigError("ipc_dir", f"socket path {path!r} is longer than {MAX_IPC_PATH} bytes")
        return Endpoint(f"ipc://{path}", f"ipc://{path}")
    node = topo.node(node_name)
    return Endpoint(f"tcp://{bracket(node.bind_host)}:{port}", f"tcp://{bracket(node.address)}:{port}")


def assign_ports(topo) -> None:
    """Checks that no two services of a node share a port, and gives each worker without a
    kv_port the first free one from DEFAULT_KV_PORT up."""
    used: dict[tuple[str, int], str] = {}
    claims = [(topo.router.node, topo.router.port, "router.port"),
              (topo.router.node, topo.router.telemetry_port, "router.telemetry_port"),
              (topo.ingest.node, topo.ingest.port, "ingest.port"),
              (topo.ingest.node, topo.ingest.reply_port, "ingest.reply_port"),
              (topo.detokenizer.node, topo.detokenizer.port, "detokenizer.port")]
    claims += [(getattr(topo, r).node, getattr(topo, r).metrics_port, f"{r}.metrics_port")
               for r in ("router", "detokenizer") if getattr(topo, r).metrics_port]
    claims += [(w.node, w.kv_port, f"workers[{i}].kv_port")
               for i, w in enumerate(topo.workers) if w.kv_port is not None]
    if topo.ingest.http_port is not None:
        claims.append((topo.ingest.node, topo.ingest.http_port, "ingest.http_port"))
    for node, port, where in claims:
        if (node, port) in used:
            raise ConfigError(where, f"port {port} on node {node!r} is already used by {used[node, port]}")
        used[node, port] = where
    for i, w in enumerate(topo.workers):
        if w.kv_port is None:
            port = DEFAULT_KV_PORT
            while (w.node, port) in used:
                port += 1
            w.kv_port = port
            used[w.node, port] = f"workers[{i}].kv_port"


def bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host
