"""`qmigrate serve MODEL`: the OpenAI-compatible server on this machine, in one command.

Every role runs here, started and supervised by the same launcher as `sim` and `node`: the
router, ingest with the HTTP API, the detokenizer, one worker per visible GPU (CPU workers
where there is none) and, on a GPU machine, the VRAM monitor. The topology is built in
memory from the flags (or taken from --config and put on this one machine), written to a
private temporary directory with the ipc:// sockets, and removed on exit.
"""

from __future__ import annotations

import http.client
import os
import socket
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .config import (GPU_SERVE_MAX_NUM_BATCHED_TOKENS, GPU_SERVE_MAX_NUM_SEQS, LARGE_GPU_BYTES,
                     LARGE_GPU_SERVE_MAX_NUM_SEQS, MAX_HTTP_PROCESSES, ConfigError, Topology, local_topology,
                     parse_topology)
from .launch import run_local, run_node

READY_POLL_S = 0.5


@dataclass(slots=True)
class ServeOptions:
    """The flags of `qmigrate serve`; None leaves the topology's (or the default) setting."""

    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None
    gpu_memory_utilization: float | None = None
    max_num_seqs: int | None = None
    api_key: str | None = None
    cpu_workers: int = 2
    tensor_parallel_size: int = 1   # GPUs (processes) per worker
    worker_settings: dict | None = None   # fields set on every worker (config.worker_settings)
    api_server_count: int | None = None   # ingest.http_processes
    trace_dir: str | None = None          # the topology's trace_dir: every role's timeline (ops/trace.py)
    load_format: str | None = None        # model.load_format: auto or dummy
    router_settings: dict | None = None   # fields set on the router (e.g. policy)
    metrics_port: int | None = None       # Prometheus: the router's on it, the detokenizer's on it + 1
    tool_call_parser: str | None = None   # ingest.tool_call_parser


def visible_gpus() -> int:
    """CUDA devices this process may use (CUDA_VISIBLE_DEVICES applies)."""
    try:
        import torch
    except ImportError:
        return 0
    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def smallest_gpu_bytes() -> int:
    """Memory of the machine's smallest GPU, from NVML (which, unlike asking CUDA, leaves this
    process free to fork the workers); 0 where NVML cannot tell."""
    try:
        import pynvml
        pynvml.nvmlInit()
        try:
            count = pynvml.nvmlDeviceGetCount()
            return min((pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)).total
                        for i in range(count)), default=0)
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # no driver, no library: the smaller default
        return 0


def serve_max_num_seqs(gpu_bytes: int) -> int:
    """Sequences a step of the default topology's GPU workers: vLLM's default for the GPU."""
    return LARGE_GPU_SERVE_MAX_NUM_SEQS if gpu_bytes >= LARGE_GPU_BYTES else GPU_SERVE_MAX_NUM_SEQS


def default_api_servers(num_gpus: int, cpu_count: int | None = None) -> int:
    """HTTP processes of the default topology: one per 4 CPU cores, at most 4 per GPU; 1 without
    a GPU, where CPU workers need the cores (docs/benchmarks-history.md, "Several HTTP processes")."""
    cores = cpu_count if cpu_count is not None else os.cpu_count() or 1
    return max(1, min(4 * num_gpus, cores // 4, MAX_HTTP_PROCESSES)) if num_gpus else 1


def serve_topology(opts: ServeOptions, base: Topology | None = None, num_gpus: int = 0,
                   gpu_bytes: int = 0) -> Topology:
    """The topology `serve` runs: `base` (a --config) or a default one with a worker per GPU
    (`cpu_workers` CPU workers if num_gpus is 0), the HTTP API on host:port, and the flags'
    settings on every worker. The default topology's GPU workers run serve_max_num_seqs(gpu_bytes)
    sequences and GPU_SERVE_MAX_NUM_BATCHED_TOKENS new tokens a step; a --config keeps its own."""
    tp = opts.tensor_parallel_size
    if base is None:
        device = "cuda" if num_gpus else "cpu"
        if num_gpus and (tp > num_gpus or num_gpus % tp):
            raise ConfigError("tensor_parallel_size", f"{tp} does not divide the {num_gpus} visible GPUs "
                              "(set CUDA_VISIBLE_DEVICES to a multiple of it)")
        base = local_topology(num_gpus // tp if num_gpus else opts.cpu_workers, device=device)
        data = base.to_dict()
        if num_gpus:
            for i, w in enumerate(data["workers"]):
                w["name"], w["device"] = f"gpu{i * tp}", f"cuda:{i * tp}"
                w["max_num_seqs"] = serve_max_num_seqs(gpu_bytes)
                w["max_num_batched_tokens"] = GPU_SERVE_MAX_NUM_BATCHED_TOKENS
    else:
        data = base.to_dict()
    if opts.trace_dir is not None:
        data["trace_dir"] = opts.trace_dir
    if opts.load_format is not None:
        data["model"]["load_format"] = opts.load_format
    data["router"].update(opts.router_settings or {})
    if opts.metrics_port is not None:
        data["router"]["metrics_port"], data["detokenizer"]["metrics_port"] = opts.metrics_port, opts.metrics_port + 1
    ingest = data["ingest"]
    ingest["http_host"], ingest["http_port"] = opts.host, opts.port
    if opts.served_model_name is not None:
        ingest["model_name"] = opts.served_model_name
    if opts.api_key is not None:
        ingest["api_key"] = opts.api_key
    if opts.tool_call_parser is not None:
        ingest["tool_call_parser"] = opts.tool_call_parser
    if opts.api_server_count is not None:
        ingest["http_processes"] = opts.api_server_count
    elif num_gpus:
        ingest["http_processes"] = default_api_servers(num_gpus)
    for w in data["workers"]:
        w.update(opts.worker_settings or {})
        if opts.gpu_memory_utilization is not None:
            w["gpu_memory_utilization"] = opts.gpu_memory_utilization
        if opts.max_num_seqs is not None:
            w["max_num_seqs"] = opts.max_num_seqs
        if tp > 1:
            w["tensor_parallel_size"] = tp
    return parse_topology(data, source="serve options")


def _loopback(host: str) -> str:
    """Where this machine reaches a server that listens on host (a wildcard: the loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "": "127.0.0.1"}.get(host, host)


def local_url(host: str, port: int) -> str:
    host = _loopback(host)
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


class ReadyNotice:
    """Polls /health from the supervisor's loop; prints the URL once it answers 200 and every
    Prometheus endpoint in `metrics` ((host, port) pairs) answers too, so that a script which
    waits for "ready:" may scrape at once."""

    def __init__(self, host: str, port: int, out=None, metrics: tuple[tuple[str, int], ...] = ()):
        self.host, self.port, self.url = _loopback(host), port, local_url(host, port)
        self.metrics = [(_loopback(h), p) for h, p in metrics]
        self.out = out or sys.stdout
        self.is_ready = False
        self.checked_at = 0.0

    def __call__(self) -> None:
        if self.is_ready or (now := time.monotonic()) - self.checked_at < READY_POLL_S:
            return
        self.checked_at = now
        if health_status(self.host, self.port) == 200 and \
                all(health_status(h, p, path="/metrics") == 200 for h, p in self.metrics):
            self.is_ready = True
            print(f"ready: {self.url} (OpenAI API at {self.url}/v1)", file=self.out, flush=True)


def port_problem(host: str, port: int) -> str | None:
    """Why the API could not listen on host:port (taken, or no such address); None if it can.
    Checked before any role starts, so a taken port costs no model load."""
    why = bind_problem(host, port)
    return None if why is None else f"cannot serve on {host}:{port}: {why}"


def bind_problem(host: str, port: int) -> str | None:
    """Why a socket without SO_REUSEPORT cannot bind host:port; None if it can. Ingest asks
    before its HTTP processes bind with SO_REUSEPORT, which would share a port that another
    server's processes hold that way."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as the server sets it
            probe.bind(address)
    except OSError as exc:
        return str(exc.strerror or exc)
    return None


def health_status(host: str, port: int, timeout_s: float = 0.3, path: str = "/health") -> int | None:
    conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    try:
        conn.request("GET", path)
        return conn.getresponse().status
    except (OSError, http.client.HTTPException):
        return None
    finally:
        conn.close()


def run_serve(topo: Topology, model_path: str, log_level: str = "warning") -> int:
    """Serve until SIGINT or SIGTERM; every role stops with it."""
    def start(local: Topology, path: Path) -> int:
        devices = sorted({w.device for w in local.workers})
        print(f"qmigrate: serving {model_path} with {len(local.workers)} worker"
              f"{'s' if len(local.workers) != 1 else ''} ({', '.join(devices)}); live view: "
              f"qmigrate status {path}", file=sys.stderr, flush=True)
        from qmigrate.ops.metrics import listen_address
        metrics = tuple((listen_address(local.node(getattr(local, r).node).bind_host), getattr(local, r).metrics_port)
                        for r in ("router", "detokenizer") if getattr(local, r).metrics_port)
        notice = ReadyNotice(local.ingest.http_host, local.ingest.http_port, metrics=metrics)
        # ready (as vLLM's): every worker started here has joined the router, within the
        # node's join_timeout_s, before /health answers 200 and "ready:" prints
        return run_node(local, path, "local", read_stdin=False, log_level=log_level, wait_for_workers=True,
                        tick=notice)

    return run_local(topo, model_path, start, prefix="qm-serve-")
