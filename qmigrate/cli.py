"""The `qmigrate` command. Each command resolves its configuration and calls one function.
The bench and model commands are in cli_bench.py (bench serve in cli_bench_serve.py) and
cli_model.py; what commands share, in cli_common.py."""

from __future__ import annotations

import dataclasses
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from .cli_bench import bench_app
from .cli_common import AsNode, LogLevel, endpoint, fail, find_model, load, secure, warn_if_open
from .cli_model import model_app
from .config import (GPU_SERVE_MAX_NUM_BATCHED_TOKENS, GPU_SERVE_MAX_NUM_SEQS, LARGE_GPU_BYTES,
                     LARGE_GPU_SERVE_MAX_NUM_SEQS)
from .engine.config import EngineConfig

# the engine's defaults, as its settings' one definition gives them (for the help text)
_ENGINE_DEFAULTS = {f.name: f.default for f in dataclasses.fields(EngineConfig)}

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Serve a causal LM from a fleet of GPU workers that trade requests at every step.")
app.add_typer(model_app, name="model")
keys_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, short_help="Make CurveZMQ keys for a node.",
                       help="CurveZMQ keys that authenticate and encrypt the links between nodes.")
app.add_typer(keys_app, name="keys")
app.add_typer(bench_app, name="bench")


def _show_version(value: bool) -> None:
    if value:
        from . import __version__
        print(f"qmigrate {__version__}")
        raise typer.Exit(0)


@app.callback()
def _top(version: Annotated[bool, typer.Option("--version", callback=_show_version, is_eager=True,
                                               help="Print the version and exit.")] = False):
    """Serve a causal LM from a fleet of GPU workers that trade requests at every step."""


class InputMode(str, Enum):
    text = "text"
    jsonl = "jsonl"


class Role(str, Enum):
    router = "router"
    ingest = "ingest"
    worker = "worker"
    detokenizer = "detokenizer"
    monitor = "monitor"


@app.command(short_help="Run every role here on a topology; prompts on stdin.")
def sim(
    config: Annotated[Optional[Path], typer.Argument(
        help="Topology YAML; its roles all run here. Default: 2 CPU workers.")] = None,
    workers: Annotated[Optional[int], typer.Option(
        "--workers", "-w", min=1,
        help="Number of CPU workers (replaces the topology's workers).")] = None,
    model: Annotated[Optional[str], typer.Option(
        "--model", "-m",
        help="HF causal LM: a local directory, a hub name, or smollm2 (fetched and built on first use). "
             "Default: the built-in tiny model.")] = None,
    input: Annotated[Optional[InputMode], typer.Option(
        "--input",
        help="text: one prompt per line; jsonl: one JSON request per line. Default: the topology's (text).")] = None,
    output: Annotated[Optional[InputMode], typer.Option(
        "--output",
        help="text: readable streams; jsonl: one JSON event per line. Default: the topology's (text).")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option(
        "--max-new-tokens", min=1,
        help="Default output length per request.")] = None,
    chat: Annotated[bool, typer.Option(
        "--chat",
        help="Text input: each line is one user message, put through the model's chat template.")] = False,
    http: Annotated[Optional[int], typer.Option(
        "--http", min=1, max=65535, metavar="PORT",
        help="Also serve the OpenAI-compatible HTTP API on this port (127.0.0.1 unless the topology's "
             "ingest.http_host says otherwise); the simulation then runs until interrupted.")] = None,
    metrics_port: Annotated[Optional[int], typer.Option(
        "--metrics-port", min=1, max=65534,
        help="Serve Prometheus metrics: the router's on PORT, the detokenizer's latencies on PORT+1.")] = None,
    load_format: Annotated[Optional[str], typer.Option(
        "--load-format",
        help="auto: read the checkpoint; dummy: make random weights of the model's shapes on the device from "
             "its config.json alone (a directory of `qmigrate model shape`). Default: the topology's (auto).")] = None,
    log_level: LogLevel = "warning",
):
    """Local multi-process simulation: every role a process on this machine, prompts from
    stdin, streaming output on stdout. Exits once stdin closes and every request is done
    (with --http: when interrupted; stdin is still read until it closes).

    Exit status: 0 when every request ran to its end; 3 when any request failed (a bad input
    line, or a worker's error: each is printed as an error record); 1 when a role failed."""
    from .config import ConfigError, parse_topology
    from .launch import run_sim
    topo = load(config)
    data = topo.to_dict()
    if workers is not None:
        template = data["workers"][0]
        data["workers"] = [{**template, "name": f"w{i}", "kv_port": None} for i in range(1, workers + 1)]
    if input is not None:
        data["ingest"]["input"] = input.value
    if output is not None:
        data["detokenizer"]["output"] = output.value
    if max_new_tokens is not None:
        data["defaults"]["max_new_tokens"] = max_new_tokens
    if chat:
        data["ingest"]["chat"] = True
    if http is not None:
        data["ingest"]["http_port"] = http
    if metrics_port is not None:
        data["router"]["metrics_port"], data["detokenizer"]["metrics_port"] = metrics_port, metrics_port + 1
    if load_format is not None:
        data["model"]["load_format"] = load_format
    try:
        topo = parse_topology(data, source="sim options")
    except ConfigError as exc:
        fail(str(exc))
    model_path = find_model(model if model is not None else topo.model.path)
    raise typer.Exit(run_sim(topo, model_path, log_level))


@app.command(short_help="Serve a model over the OpenAI API on this machine's GPUs.")
def serve(
    model: Annotated[Optional[str], typer.Argument(
        help="A model directory, smollm2 (fetched and built on first use), or a hub name. Default: the "
             "--config topology's model.")] = None,
    host: Annotated[str, typer.Option(help="Address the OpenAI API listens on.")] = "127.0.0.1",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Port of the OpenAI API.")] = 8000,
    served_model_name: Annotated[Optional[str], typer.Option(
        "--served-model-name",
        help="Model name in the API (default: the model directory's name).")] = None,
    gpu_memory_utilization: Annotated[Optional[float], typer.Option(
        "--gpu-memory-utilization",
        help="Share of each GPU's memory a worker may fill, weights and KV cache together "
             f"(default {_ENGINE_DEFAULTS['gpu_memory_utilization']}).")] = None,
    max_num_seqs: Annotated[Optional[int], typer.Option(
        "--max-num-seqs",
        help=f"Sequences per step on each worker (default: {LARGE_GPU_SERVE_MAX_NUM_SEQS} on GPUs of "
             f"{LARGE_GPU_BYTES >> 30} GiB or more, {GPU_SERVE_MAX_NUM_SEQS} on smaller ones, "
             f"{_ENGINE_DEFAULTS['max_num_seqs']} on the CPU; with --config, the topology's).")] = None,
    max_num_batched_tokens: Annotated[Optional[int], typer.Option(
        "--max-num-batched-tokens",
        help=f"New tokens per step on each worker (default: {GPU_SERVE_MAX_NUM_BATCHED_TOKENS} on a GPU, "
             f"{_ENGINE_DEFAULTS['max_num_batched_tokens']} on the CPU; with --config, the topology's).")] = None,
    max_model_len: Annotated[Optional[int], typer.Option(
        "--max-model-len",
        help="Longest sequence, prompt and output (default: the model's context).")] = None,
    block_size: Annotated[Optional[int], typer.Option(
        "--block-size", help=f"Tokens per KV block (default {_ENGINE_DEFAULTS['block_size']}).")] = None,
    enable_prefix_caching: Annotated[Optional[bool], typer.Option(
        "--enable-prefix-caching/--no-enable-prefix-caching",
        help="Reuse the KV of cached prompt prefixes (default: on).")] = None,
    enforce_eager: Annotated[Optional[bool], typer.Option(
        "--enforce-eager", help="Run every step eagerly: no CUDA graphs.")] = None,
    kv_offloading_size: Annotated[Optional[float], typer.Option(
        "--kv-offloading-size",
        help="GiB of host memory per worker for KV blocks evicted from the GPU, copied back on a hit instead "
             "of prefilled; -1 sizes it from host memory (default: 0, off).")] = None,
    quantization: Annotated[Optional[str], typer.Option(
        "--quantization", "-q",
        help="fp8: the layers' weights in e4m3, matmuls on the FP8 tensor cores (Hopper or later).")] = None,
    kv_cache_dtype: Annotated[Optional[str], typer.Option(
        "--kv-cache-dtype",
        help="fp8: the KV cache in e4m3, twice the tokens (compute capability 8.9 or later); auto: the model's "
             "dtype.")] = None,
    api_key: Annotated[Optional[str], typer.Option(
        "--api-key",
        help="Requests to /v1 must send 'Authorization: Bearer KEY'.")] = None,
    config: Annotated[Optional[Path], typer.Option(
        "--config",
        help="A topology to run on this machine instead of one worker per GPU (its workers, settings and "
             "model).")] = None,
    cpu_workers: Annotated[int, typer.Option(
        "--cpu-workers", min=1,
        help="Workers on the CPU when no GPU is visible.")] = 2,
    tensor_parallel_size: Annotated[int, typer.Option(
        "--tensor-parallel-size", "-tp", min=1,
        help="GPUs each worker spans (a model larger than one GPU): N visible GPUs make N/TP workers.")] = 1,
    api_server_count: Annotated[Optional[int], typer.Option(
        "--api-server-count", min=1, max=128,
        help="Processes serving the API on its port, each parsing its own requests and writing its own "
             "streams (ingest.http_processes). Default: with GPUs, one per 4 CPU cores and at most 4 per GPU; "
             "without, 1 (a thread of the ingest process).")] = None,
    worker_setting: Annotated[Optional[list[str]], typer.Option(
        "--worker-setting",
        help="KEY=VALUE for every worker (repeatable), e.g. prefill_tokens_per_step=1024.")] = None,
    trace: Annotated[Optional[Path], typer.Option(
        "--trace", help="Write every role's timeline to this folder (the topology's trace_dir); read it with "
                        "python -m qmigrate.ops.trace FOLDER.")] = None,
    load_format: Annotated[Optional[str], typer.Option(
        "--load-format",
        help="auto: read the checkpoint; dummy: make random weights of the model's shapes on the device from "
             "its config.json alone (a directory of `qmigrate model shape`). Default: the topology's (auto).")] = None,
    tool_call_parser: Annotated[Optional[str], typer.Option(
        "--tool-call-parser",
        help="The format of the model's tool calls: hermes (<tool_call> JSON: Hermes, Qwen2.5), llama3_json "
             "(Llama 3.1), mistral ([TOOL_CALLS]) or auto (the one its chat template writes; "
             "ingest.tool_call_parser).")] = None,
    migration_policy: Annotated[Optional[str], typer.Option(
        "--migration-policy",
        help="Where a sequence may run (router.policy): affinity (default: it stays with its KV but moves "
             "for load and memory), pinned (it stays on the worker it started on: only a drain or a dead "
             "worker moves it) or any (any worker at any step).")] = None,
    metrics_port: Annotated[Optional[int], typer.Option(
        "--metrics-port", min=1, max=65534,
        help="Serve Prometheus metrics: the router's on PORT, the detokenizer's latencies on PORT+1.")] = None,
    log_level: LogLevel = "warning",
):
    """Start every role on this machine and serve the OpenAI-compatible API (/v1/completions,
    /v1/chat/completions, /v1/models, /health) until Ctrl-C or SIGTERM: one worker per
    visible GPU (CUDA_VISIBLE_DEVICES applies), CPU workers when there is none, the VRAM
    monitor on a GPU machine. Prints "ready: URL" once a worker can serve."""
    from .config import ConfigError, worker_settings
    from .serve import ServeOptions, port_problem, run_serve, serve_topology, smallest_gpu_bytes, visible_gpus
    if model is None and config is None:
        fail("give a MODEL (a directory, smollm2 or a hub name) or --config TOPOLOGY")
    if (problem := port_problem(host, port)) is not None:
        fail(problem, 1)
    base = load(config) if config is not None else None
    opts = ServeOptions(host, port, served_model_name, gpu_memory_utilization, max_num_seqs, api_key, cpu_workers,
                        tensor_parallel_size)
    flags = {"max_num_batched_tokens": max_num_batched_tokens, "max_model_len": max_model_len,
             "block_size": block_size, "enable_prefix_caching": enable_prefix_caching,
             "enforce_eager": enforce_eager, "kv_offloading_size": kv_offloading_size,
             "quantization": quantization, "kv_cache_dtype": kv_cache_dtype}
    try:
        opts.worker_settings = {**worker_settings(worker_setting or []),
                                **{k: v for k, v in flags.items() if v is not None}}
        opts.api_server_count = api_server_count
        opts.trace_dir = None if trace is None else str(trace.absolute())
        opts.load_format = load_format
        if tool_call_parser is not None and tool_call_parser not in ("auto", "hermes", "llama3_json", "mistral"):
            fail("--tool-call-parser must be auto, hermes, llama3_json or mistral")
        opts.tool_call_parser = tool_call_parser
        opts.router_settings = {} if migration_policy is None else {"policy": migration_policy}
        opts.metrics_port = metrics_port
        num_gpus = 0 if base is not None else visible_gpus()
        topo = serve_topology(opts, base, num_gpus=num_gpus, gpu_bytes=smallest_gpu_bytes() if num_gpus else 0)
    except ConfigError as exc:
        fail(str(exc))
    model_path = find_model(model if model is not None else topo.model.path)
    raise typer.Exit(run_serve(topo, model_path, log_level))


@app.command(short_help="Start and supervise the roles of one node.")
def node(
    config: Annotated[Path, typer.Argument(help="Topology YAML shared by every node.")],
    node: Annotated[str, typer.Option("--node", "-n", help="Which node of the topology this machine is.")],
    stdin: Annotated[bool, typer.Option(
        "--stdin/--no-stdin",
        help="Ingest reads prompts from this command's stdin and the node exits when they are done (only "
             "where ingest runs).")] = False,
    log_level: LogLevel = "warning",
):
    """Start the roles the topology puts on NODE and supervise them (per-node launch). With
    --stdin on the detokenizer's node, it exits once every request is done: 3 when any
    request failed, as sim does."""
    from .config import ConfigError
    from .launch import run_node
    topo = load(config)
    try:
        topo.node(node)
    except ConfigError as exc:
        fail(str(exc))
    find_model(topo.model.path)
    warn_if_open(topo)
    secure(topo, node)
    raise typer.Exit(run_node(topo, config, node, read_stdin=stdin, log_level=log_level))


@app.command(short_help="Send prompts from stdin to a running ingest.")
def feed(
    config: Annotated[Path, typer.Argument(help="Topology YAML; names the ingest node's address.")],
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each answer from ingest.")] = 10.0,
    node: AsNode = None,
):
    """Send prompts from stdin to a running ingest node, one per line (its input format)."""
    from qmigrate.wire.client import feed_lines
    topo = load(config)
    secure(topo, node)
    raise typer.Exit(feed_lines(endpoint(topo, "ingest"), sys.stdin, timeout))


@app.command(short_help="Move a worker's sequences away, then stop it.")
def drain(
    config: Annotated[Path, typer.Argument(help="Topology YAML; names the router's address.")],
    worker: Annotated[str, typer.Option("--worker", help="Worker to drain.")],
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the router.")] = 5.0,
    node: AsNode = None,
):
    """Move a worker's sequences to other workers, then let it exit. Nothing is lost."""
    from qmigrate.wire import protocol as P
    from qmigrate.wire.client import ask
    topo = load(config)
    secure(topo, node)
    reply = ask(endpoint(topo, "router"), P.Drain(worker), P.DrainAck, timeout, "router")
    print(reply.message)
    raise typer.Exit(0 if reply.ok else 1)


@app.command(short_help="Print the router's counters.")
def stats(
    config: Annotated[Path, typer.Argument(help="Topology YAML; names the router's address.")],
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the router.")] = 5.0,
    node: AsNode = None,
):
    """Print the router's counters: queue, leases, migrations by cause and mechanism."""
    from qmigrate.wire import protocol as P
    from qmigrate.wire.client import ask
    topo = load(config)
    secure(topo, node)
    reply = ask(endpoint(topo, "router"), P.StatsRequest(), P.Stats, timeout, "router")
    for key in sorted(reply.counters):
        print(f"{key:32} {reply.counters[key]}")


@app.command(short_help="Show the fleet: workers, GPUs, KV, queue.")
def status(
    config: Annotated[Path, typer.Argument(help="Topology YAML; names the router's address.")],
    once: Annotated[bool, typer.Option("--once", help="Print one snapshot and exit (for scripts).")] = False,
    json_out: Annotated[bool, typer.Option("--json", help="Print one snapshot as JSON and exit.")] = False,
    interval: Annotated[float, typer.Option(min=0.1, help="Seconds between refreshes of the live view.")] = 1.0,
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the router.")] = 5.0,
    node: AsNode = None,
):
    """Show the fleet: nodes, workers and their GPUs with memory, KV use, batch sizes,
    tokens/s, queue depth and migrations; a live table until Ctrl-C."""
    from qmigrate.ops.status import run_status
    topo = load(config)
    secure(topo, node)
    raise typer.Exit(run_status(endpoint(topo, "router"), once=once, as_json=json_out,
                                interval_s=interval, timeout_s=timeout))


@app.command("role", hidden=True)
def role(
    role: Annotated[Role, typer.Argument()],
    name: Annotated[str, typer.Argument()],
    config: Annotated[Path, typer.Option("--config")],
    stdin: Annotated[bool, typer.Option("--stdin")] = False,
    exit_when_done: Annotated[bool, typer.Option("--exit-when-done")] = False,
    wait_for_workers: Annotated[int, typer.Option("--wait-for-workers", min=0, help="Ingest: submit nothing "
                                                  "until this many workers have joined the router.")] = 0,
    log_level: LogLevel = "warning",
    restarted: Annotated[bool, typer.Option("--restarted", hidden=True)] = False,
):
    """Run one role in this process (used by `node` and `sim`)."""
    from .launch import set_title
    from qmigrate.ops.logs import setup
    set_title(role.value, name)
    topo = load(config, warn_renamed=False)   # the node's supervisor has read the same file
    from qmigrate.wire import security
    from .config import ConfigError
    try:
        node = security.node_of(topo, role.value, name)
    except ConfigError as exc:
        fail(str(exc))
    setup(role.value, name, node, log_level)
    import importlib
    module = importlib.import_module(f"{__package__}.{role.value}.loop")  # only this role's imports
    try:
        secure(topo, node)
        if role is Role.ingest:
            code = module.run(topo, name, read_stdin=stdin, exit_when_done=exit_when_done,
                              wait_for_workers=wait_for_workers, restarted=restarted)
        elif role is Role.detokenizer:
            code = module.run(topo, name, exit_when_done=exit_when_done)
        else:
            code = module.run(topo, name)
    except KeyboardInterrupt:
        code = 130  # the node supervisor stops every role; no traceback for Ctrl-C
    except Exception as exc:
        # hub.store is imported only by the roles that load a model, so its error class is
        # looked up rather than imported here.
        models = sys.modules.get(f"{__package__}.hub.store")
        if not isinstance(exc, security.SecurityError) and not (models and isinstance(exc, models.ModelLoadError)):
            raise
        print(f"qmigrate {role.value} {name}: {exc}", file=sys.stderr)
        code = 1
    raise typer.Exit(code)


@keys_app.command("generate")
def keys_generate(
    directory: Annotated[Path, typer.Argument(
        help="Directory to write NODE.key (public) and NODE.key_secret (owner-only) to.")],
    node: Annotated[str, typer.Option("--node", "-n", help="The topology's name of the node these keys are for.")],
    force: Annotated[bool, typer.Option("--force", help="Replace an existing keypair (to rotate it).")] = False,
):
    """Make a CurveZMQ keypair for one node. Keep NODE.key_secret on that node only; give
    NODE.key (or the key it prints) to every node's topology."""
    from qmigrate.wire.security import SecurityError, generate_keys
    try:
        public_path, secret_path = generate_keys(directory, node, force=force)
    except (SecurityError, OSError) as exc:
        fail(str(exc), 1)
    from zmq.auth import load_certificate
    print(f"wrote {secret_path} (secret, mode 600) and {public_path}", file=sys.stderr)
    print(load_certificate(public_path)[0].decode())


def main() -> None:
    app()
