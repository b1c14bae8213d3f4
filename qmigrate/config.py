"""The topology as validated dataclasses: every setting once, a role's config is its section."""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from .config_rules import ConfigError  # noqa: F401 -- the rest of the package imports it from here
from . import config_rules as rules
from .config_rules import Section
from .wire import protocol as P
from .config_endpoints import SHORT_TMP  # noqa: F401 -- launch.py imports it from here
from .config_endpoints import SERVICES, Endpoint, assign_ports, endpoint
from .config_renamed import log_renamed, rename_worker_keys
from .config_yaml import build_section, check_keys, kind_of, parse_settings, read_settings, read_yaml, write_yaml
from .engine.config import EngineConfig

# A GPU worker of `qmigrate serve` (and the pipeline bench): sequences and new tokens per step
# as a serving engine runs them (vLLM's default max_num_seqs), not the topology's modest defaults.
GPU_SERVE_MAX_NUM_SEQS = 256
GPU_SERVE_MAX_NUM_BATCHED_TOKENS = 16384
# serve on GPUs of LARGE_GPU_BYTES or more (H100, H200): as many sequences as vLLM runs there
LARGE_GPU_SERVE_MAX_NUM_SEQS = 1024
LARGE_GPU_BYTES = 70 << 30
# ingest.http_processes: a front's index is bits 32-38 of its sequence ids (ingest.handoff)
MAX_HTTP_PROCESSES = 128


@dataclass(slots=True)
class ModelConfig(Section):
    path: str | None = rules.setting(None, rules.optional_text)
    dtype: str = rules.setting("auto", rules.one_of("auto", "float32", "bfloat16", "float16"))
    # Off: a checkpoint's own Python code (auto_map) would run in every worker and ingest.
    trust_remote_code: bool = rules.setting(False, rules.boolean)
    # dummy: build the weights on the device from config.json alone (random values, real
    # shapes and dtypes), as vLLM's --load-format dummy; auto: read the checkpoint.
    load_format: str = rules.setting("auto", rules.one_of("auto", "dummy"))

    def dtype_for(self, device: str) -> str:
        if self.dtype != "auto":
            return self.dtype
        return "float32" if device == "cpu" else "bfloat16"


@dataclass(slots=True)
class SamplingDefaults(Section):
    max_new_tokens: int = rules.setting(64, rules.count)
    temperature: float = rules.setting(0.0, rules.number(f"a number from 0 to {P.MAX_TEMPERATURE:g}",
                                                         lambda x: 0 <= x <= P.MAX_TEMPERATURE))
    top_p: float = rules.setting(1.0, rules.number("a number in (0, 1]", lambda x: 0 < x <= 1))
    top_k: int = rules.setting(0, rules.non_negative)
    # a structured output's grammar that does not compile within this is refused (its request only)
    structured_output_compile_timeout_s: float = rules.setting(5.0, rules.positive)


@dataclass(slots=True)
class NodeConfig(Section):
    name: str = rules.setting("", rules.name)
    address: str = rules.setting("127.0.0.1", rules.host)
    bind: str | None = rules.setting(None, rules.optional_host)   # None: the node's own address, not every interface
    monitor: bool = rules.setting(False, rules.boolean)
    public_key: str | None = rules.setting(None, rules.optional_text)  # inline Z85 key, a key file, or a directory
    secret_key: str | None = rules.setting(None, rules.optional_text)  # None: <security.keys_dir>/<name>.key_secret
    # A role that dies is started again, up to max_restarts times within restart_window_s: one
    # that fails now and then always comes back, one that keeps failing stops the node.
    max_restarts: int = rules.setting(3, rules.non_negative)
    restart_window_s: float = rules.setting(600.0, rules.positive)
    # sim and serve start only once every worker of the node has joined the router (loaded
    # its model): after this many seconds without it they stop with an error
    join_timeout_s: float = rules.setting(600.0, rules.positive)

    @property
    def bind_host(self) -> str:
        return self.bind or self.address


@dataclass(slots=True)
class SecurityConfig(Section):
    # auto: on when any tcp address or bind is off loopback; ipc and loopback need no keys.
    enabled: str = rules.setting("auto", rules.one_of("auto", "on", "off"))
    keys_dir: str = rules.setting("keys", rules.text(r".+", "a directory path"))   # relative: to the working directory
    operators: list[str] = rules.setting(None, rules.rule("a list of node names or null", lambda v: v is None or _names_ok(v),
                                          lambda v: list(v or [])))


def _names_ok(v: Any) -> bool:
    return isinstance(v, list) and all(isinstance(x, str) and re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9_.-]*", x)
                                       for x in v)


def _is_loopback(host: str) -> bool:
    host = host.strip("[]")
    return host == "localhost" or host == "::1" or host.startswith("127.")


ROUTER_POLICIES = ("affinity", "pinned", "any")


@dataclass(slots=True)
class RouterConfig(Section):
    node: str = rules.setting("", rules.name)
    port: int = rules.setting(5550, rules.port)
    telemetry_port: int = rules.setting(5551, rules.port)
    max_queued: int = rules.setting(4096, rules.count)
    lease_timeout_s: float = rules.setting(10.0, rules.positive)
    heartbeat_interval_s: float = rules.setting(0.5, rules.positive)
    heartbeat_timeout_s: float = rules.setting(5.0, rules.positive)
    # affinity: a sequence stays where its KV is, unless it moves for load or memory (the two
    # settings below); pinned: it stays on the worker it started on (only a drain or a dead
    # worker moves it; one evicted for room is recomputed there); any: it may run anywhere
    policy: str = rules.setting("affinity", rules.one_of(*ROUTER_POLICIES))
    migrate_on_load: bool = rules.setting(True, rules.boolean)
    migrate_on_memory: bool = rules.setting(True, rules.boolean)
    # KV pressure: an owner whose free KV (as it last reported) would last its sequences fewer
    # than kv_pressure_steps more tokens each gives sequences to a worker that keeps twice that
    # after taking them, before it has to evict (preempt) any; a sequence moved for KV or load
    # stays put for move_cooldown_s
    migrate_on_kv: bool = rules.setting(True, rules.boolean)
    kv_pressure_steps: int = rules.setting(32, rules.count)
    move_cooldown_s: float = rules.setting(2.0, rules.number("a number >= 0", lambda x: x >= 0))
    min_free_vram_fraction: float = rules.setting(0.05, rules.number("a number in [0, 1)", lambda x: 0 <= x < 1))
    # a worker takes no new prefills below this (never below min_free_vram_fraction)
    admit_free_vram_fraction: float = rules.setting(0.07, rules.number("a number in [0, 1)", lambda x: 0 <= x < 1))
    migration: str = rules.setting("auto", rules.one_of("auto", "recompute", "transfer"))
    link_gbps: float = rules.setting(10.0, rules.positive)
    prefill_tflops: float = rules.setting(100.0, rules.positive)
    rebalance_threshold: int = rules.setting(8, rules.count)
    # new prompts are shared among workers with room (by max_num_seqs) before load moves anything
    spread_new_work: bool = rules.setting(True, rules.boolean)
    chain_leases: bool = rules.setting(True, rules.boolean)
    max_lease_steps: int = rules.setting(16, rules.rule("an integer 1..1024", lambda v: rules.is_int(v) and 1 <= v <= 1024))
    metrics_port: int | None = rules.setting(None, rules.metrics_port)  # Prometheus /metrics; 0 or null: none
    journal: str = rules.setting("", rules.rule("a file path, or '' for none", lambda v: isinstance(v, str)))
    # new sequences start where their prefix is cached (workers' reports), load permitting
    prefix_aware: bool = rules.setting(True, rules.boolean)
    # how long a new sequence may wait for a busy worker that holds more of its prefix: a few
    # steps (its next request for work); at 0.5 s the wait was most of a TTFT tail at 32 req/s
    prefix_wait_s: float = rules.setting(0.02, rules.number("a number >= 0", lambda x: x >= 0))
    # a new sequence placed on a worker that lacks the prefix another worker holds (on its GPU
    # or host tier) pulls those blocks over the KV link when that costs less than prefilling
    # them (auto: link_gbps against prefill_tflops), always, or never
    prefix_pull: str = rules.setting("auto", rules.one_of("auto", "always", "never"))

    def validate(self) -> None:
        if self.heartbeat_timeout_s <= self.heartbeat_interval_s:
            raise ConfigError("heartbeat_timeout_s", f"must be greater than heartbeat_interval_s "
                              f"({self.heartbeat_interval_s:g}), got {self.heartbeat_timeout_s:g}")
        self.admit_free_vram_fraction = max(self.admit_free_vram_fraction, self.min_free_vram_fraction)


@dataclass(slots=True)
class IngestConfig(Section):
    node: str = rules.setting("", rules.name)
    port: int = rules.setting(5552, rules.port)
    input: str = rules.setting("text", rules.one_of("text", "jsonl"))
    max_pending: int = rules.setting(4096, rules.count)  # as the router's max_queued: a burst of calls waits, not 429
    chat: bool = rules.setting(False, rules.boolean)             # text input: each line is one user message
    reply_port: int = rules.setting(5554, rules.port)            # the detokenizer's replies to HTTP requests
    http_port: int | None = rules.setting(None, rules.optional_port)   # None: no HTTP server
    http_host: str = rules.setting("127.0.0.1", rules.host)
    api_key: str | None = rules.setting(None, rules.optional_text)  # HTTP requests to /v1 need "Authorization: Bearer KEY"
    max_body_bytes: int = rules.setting(1 << 20, rules.count)
    # connections the kernel holds for the API before it accepts them (capped by
    # net.core.somaxconn); past it a connection attempt is dropped and retried a second later
    http_backlog: int = rules.setting(4096, rules.count)
    http_timeout_s: float = rules.setting(60.0, rules.positive)  # longest wait for a request's next text
    # a connection sends a request's headers within this of opening (or of its last answer;
    # an idle keep-alive connection is closed then too), and its body within this of them
    http_read_timeout_s: float = rules.setting(30.0, rules.positive)
    # open connections one client address may hold to one API process; past it one is closed at once
    http_max_connections_per_client: int = rules.setting(2048, rules.count)
    # processes serving the API on its port (SO_REUSEPORT), each parsing its own calls and
    # writing its own streams in front of this loop; 1: a thread of the ingest process
    http_processes: int = rules.setting(1, rules.rule(f"an integer from 1 to {MAX_HTTP_PROCESSES}",
                                             lambda v: rules.is_int(v) and 1 <= v <= MAX_HTTP_PROCESSES))
    # an HTTP process not heard from for this long (stopped, or wedged) is killed and started again
    http_process_timeout_s: float = rules.setting(10.0, rules.positive)
    model_name: str | None = rules.setting(None, rules.optional_text)  # None: the model directory's name
    # the format of the model's tool calls (ingest/tools.py); auto: the one its chat template writes
    tool_call_parser: str = rules.setting("auto", rules.one_of("auto", "hermes", "llama3_json", "mistral"))


@dataclass(slots=True)
class DetokenizerConfig(Section):
    node: str = rules.setting("", rules.name)
    port: int = rules.setting(5553, rules.port)
    output: str = rules.setting("text", rules.one_of("text", "jsonl"))
    metrics_port: int | None = rules.setting(None, rules.metrics_port)  # latency histograms; 0 or null: none
    journal: str = rules.setting("", rules.rule("a file path, or '' for none", lambda v: isinstance(v, str)))


@dataclass(slots=True)
class MonitorConfig(Section):
    interval_s: float = rules.setting(1.0, rules.positive)


@dataclass(slots=True)
class WorkerConfig(EngineConfig):
    """A worker's section: the engine's settings (engine/config.py, the one place they are
    defined) and where the worker runs and how it takes work."""
    name: str = rules.setting("", rules.name)
    node: str = rules.setting("", rules.name)
    device: str = rules.setting("cpu", rules.device)
    kv_port: int | None = rules.setting(None, rules.optional_port)  # None: Topology picks a free port from 5560 up
    steps_per_dispatch: int = rules.setting(1, rules.count)
    inflight: int = rules.setting(2, rules.count)
    transfer_wait_s: float = rules.setting(2.0, rules.positive)   # a lease waits this long for KV shipments, then recomputes
    # a lone lease on the device waits this long for the next one before it is collected
    chain_wait_s: float = rules.setting(0.002, rules.number("a number >= 0", lambda x: x >= 0))
    # GPUs (processes) one worker spans, from `device` on (cuda:K .. cuda:K+N-1); the model's
    # heads and MLP width must divide by it (checked when the worker loads the model)
    tensor_parallel_size: int = rules.setting(1, rules.count)
    # where structured output's matchers fill a step's masks: a process of their own beside the
    # worker ("process"), or a thread of the worker's ("thread"); "auto": a process on a GPU
    grammar_masks: str = rules.setting("auto", rules.one_of("auto", "process", "thread"))
    # processes the matchers are spread over (by sequence id) where they are in processes
    grammar_mask_processes: int = rules.setting(1, rules.count)

    def engine_config(self) -> EngineConfig:
        """The engine's settings exactly as this section holds them."""
        return EngineConfig(**{f.name: getattr(self, f.name) for f in dataclasses.fields(EngineConfig)})


_SECTIONS = {"model": ModelConfig, "defaults": SamplingDefaults, "security": SecurityConfig, "router": RouterConfig,
             "ingest": IngestConfig, "detokenizer": DetokenizerConfig, "monitor": MonitorConfig}
_LISTS = {"nodes": NodeConfig, "workers": WorkerConfig}


@dataclass(slots=True)
class Topology(Section):
    transport: str = rules.setting("tcp", rules.one_of("tcp", "ipc"))
    ipc_dir: str | None = rules.setting(None, rules.optional_text)
    trace_dir: str | None = rules.setting(None, rules.optional_text)   # a step timeline of router and workers (trace.py)
    model: ModelConfig = field(default_factory=ModelConfig)
    defaults: SamplingDefaults = field(default_factory=SamplingDefaults)
    security: SecurityConfig = field(default_factory=SecurityConfig)
    nodes: list[NodeConfig] = field(default_factory=list)
    router: RouterConfig = field(default_factory=RouterConfig)
    ingest: IngestConfig = field(default_factory=IngestConfig)
    detokenizer: DetokenizerConfig = field(default_factory=DetokenizerConfig)
    monitor: MonitorConfig = field(default_factory=MonitorConfig)
    workers: list[WorkerConfig] = field(default_factory=list)

    def validate(self) -> None:
        for key in ("nodes", "workers"):
            if not getattr(self, key):
                raise ConfigError(key, "at least one entry is required")
            seen: dict[str, int] = {}
            for i, item in enumerate(getattr(self, key)):
                if not item.name:
                    raise ConfigError(f"{key}[{i}].name", "required")
                if item.name in seen:
                    first = f"{key}[{seen[item.name]}]"
                    raise ConfigError(f"{key}[{i}].name", f"duplicate name {item.name!r} (also {first})")
                seen[item.name] = i
        if self.transport == "ipc" and len(self.nodes) > 1:
            raise ConfigError("transport", f"'ipc' works on one machine only, got {len(self.nodes)} nodes (use 'tcp')")
        refs = [(role, getattr(self, role).node) for role in ("router", "ingest", "detokenizer")]
        refs += [(f"workers[{i}]", w.node) for i, w in enumerate(self.workers)]
        names = [n.name for n in self.nodes]
        for where, node in refs:
            if node not in names:
                reason = f"no node named {node!r}" if node else "required"
                raise ConfigError(f"{where}.node", f"{reason} (nodes: {', '.join(names)})")
        self._check_gpus()
        self._check_fp8()
        for i, name in enumerate(self.security.operators):
            if name not in names:
                raise ConfigError(f"security.operators[{i}]", f"no node named {name!r} (nodes: {', '.join(names)})")
        assign_ports(self)

    def _check_gpus(self) -> None:
        """A tensor-parallel worker takes N GPUs from its device on: no other worker of its node
        may use them (workers of one GPU each may still share one, as tests do)."""
        taken: dict[tuple[str, int], str] = {}
        parallel_nodes = {w.node for w in self.workers if w.tensor_parallel_size > 1}
        for i, w in enumerate(self.workers):
            if not w.device.startswith("cuda") or w.node not in parallel_nodes:
                continue
            first = int(w.device.partition(":")[2] or 0)
            for gpu in range(first, first + w.tensor_parallel_size):
                if (w.node, gpu) in taken:
                    raise ConfigError(f"workers[{i}].device", f"cuda:{gpu} on node {w.node!r} is also used by "
                                      f"worker {taken[w.node, gpu]!r} (tensor_parallel_size "
                                      f"{w.tensor_parallel_size} takes cuda:{first}.."
                                      f"cuda:{first + w.tensor_parallel_size - 1})")
                taken[w.node, gpu] = w.name

    def _check_fp8(self) -> None:
        """FP8 runs on CUDA GPUs only (the engine checks the GPU's compute capability)."""
        for i, w in enumerate(self.workers):
            for key, off, need in (("quantization", "none", "9.0"), ("kv_cache_dtype", "auto", "8.9")):
                if getattr(w, key) != off and not w.device.startswith("cuda"):
                    raise ConfigError(f"workers[{i}].{key}", f"{getattr(w, key)} needs a CUDA GPU with FP8 "
                                      f"(compute capability {need} or later); this worker's device is {w.device}")

    @property
    def max_model_len(self) -> int:
        """The longest sequence every worker takes (0: the model's context); ingest refuses longer
        prompts, since any worker may run a sequence's next step."""
        return min((w.max_model_len for w in self.workers if w.max_model_len), default=0)

    @property
    def is_secure(self) -> bool:
        """Whether every link uses CURVE with the nodes' keys."""
        if self.security.enabled != "auto":
            return self.security.enabled == "on"
        return self.transport == "tcp" and not all(_is_loopback(n.address) and _is_loopback(n.bind_host)
                                                   for n in self.nodes)

    def node(self, name: str) -> NodeConfig:
        return _find(self.nodes, name, "node")

    def worker(self, name: str) -> WorkerConfig:
        return _find(self.workers, name, "worker")

    def endpoint(self, kind: str, name: str | None = None) -> Endpoint:
        return endpoint(self, kind, name)

    def check_endpoints(self) -> None:
        """Raise ConfigError for an endpoint that cannot be built (an ipc:// path too long)."""
        for kind in SERVICES:
            self.endpoint(kind)
        for w in self.workers:
            self.endpoint("kv", w.name)

    def roles_on(self, node_name: str) -> list[tuple[str, str]]:
        node = self.node(node_name)
        roles = [(r, r) for r in ("router", "detokenizer", "ingest") if getattr(self, r).node == node_name]
        if node.monitor:
            roles.append(("monitor", node_name))
        return roles + [("worker", w.name) for w in self.workers if w.node == node_name]

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _find(items: list, name: str, what: str) -> Any:
    for item in items:
        if item.name == name:
            return item
    raise ConfigError(None, f"no {what} named {name!r} ({what}s: {', '.join(i.name for i in items)})")


def parse_topology(data: Mapping[str, Any], source: str = "<dict>", *, warn_renamed: bool = True) -> Topology:
    """Validate a topology mapping; errors are prefixed with `source` unless it is "<dict>".
    A worker key under its old name is taken under its new one, with a notice if `warn_renamed`."""
    try:
        if not isinstance(data, Mapping):
            raise ConfigError(None, f"expected a mapping at top level, got {kind_of(data)}")
        check_keys(Topology, data, "at top level")
        kwargs = {k: v for k, v in data.items() if k not in _SECTIONS and k not in _LISTS}
        kwargs.update({k: build_section(cls, data.get(k), k) for k, cls in _SECTIONS.items()})
        renamed: dict[str, list[str]] = {}
        for key, cls in _LISTS.items():
            items = data.get(key) or []
            if not isinstance(items, list):
                raise ConfigError(key, f"expected a list, got {kind_of(items)}")
            if cls is WorkerConfig:
                items = [rename_worker_keys(item, f"{key}[{i}]", renamed) for i, item in enumerate(items)]
            kwargs[key] = [build_section(cls, item, f"{key}[{i}]") for i, item in enumerate(items)]
        topo = Topology(**kwargs)
    except ConfigError as e:
        raise ConfigError(e.field, e.reason, None if source == "<dict>" else source) from None
    if warn_renamed:
        log_renamed(renamed, source)
    return topo


def load_topology(path: str | Path, *, warn_renamed: bool = True) -> Topology:
    return parse_topology(read_yaml(path), source=str(path), warn_renamed=warn_renamed)


def dump_topology(topo: Topology, path: str | Path) -> None:
    write_yaml(topo.to_dict(), path)


def local_topology(num_workers: int = 2, model_path: str | None = None, ipc_dir: str | None = None,
                   device: str = "cpu", input: str = "text", output: str = "text",
                   max_new_tokens: int | None = None) -> Topology:
    """One node "local", ipc transport, workers w1..wN; a VRAM monitor only when the device is CUDA."""
    if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
        raise ConfigError("num_workers", f"expected an integer >= 1, got {num_workers!r}")
    data = {"transport": "ipc", "ipc_dir": ipc_dir, "model": {"path": model_path},
            "nodes": [{"name": "local", "monitor": str(device).startswith("cuda")}],
            "router": {"node": "local"}, "ingest": {"node": "local", "input": input},
            "detokenizer": {"node": "local", "output": output},
            "workers": [{"name": f"w{i}", "node": "local", "device": device} for i in range(1, num_workers + 1)]}
    if max_new_tokens is not None:
        data["defaults"] = {"max_new_tokens": max_new_tokens}
    return parse_topology(data, source="local_topology")


def router_settings(items: list[str]) -> dict[str, Any]:
    """KEY=VALUE texts (VALUE read as a YAML scalar) -> fields of the router section, checked."""
    return parse_settings(RouterConfig, "router", items)


def worker_settings(items: list[str]) -> dict[str, Any]:
    """KEY=VALUE texts -> fields of a worker, checked (as router_settings); an old key comes
    back under its new name."""
    renamed: dict[str, list[str]] = {}
    out = rename_worker_keys(read_settings("workers", items), "workers", renamed)
    build_section(WorkerConfig, out, "workers")
    log_renamed(renamed, "worker settings")
    return out
