"""The `qmigrate` command. Each command resolves its configuration and calls one function."""

from __future__ import annotations

import dataclasses
import logging
import sys
from enum import Enum
from pathlib import Path
from typing import Annotated, Optional

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, pretty_exceptions_enable=False,
                  help="Serve a causal LM from a fleet of GPU workers that trade requests at every step.")
model_app = typer.Typer(no_args_is_help=True, help="Build the built-in models offline.")
app.add_typer(model_app, name="model")


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


def _resolve_model(path: str | None) -> str:
    from .engine.models import ModelNotFound, resolve_model
    try:
        return resolve_model(path)
    except ModelNotFound as exc:
        _fail(str(exc))


LogLevel = Annotated[str, typer.Option("--log-level", help="Log level of every role: debug, info, warning, error.")]


@app.command()
def sim(
    config: Annotated[Optional[Path], typer.Argument(help="Topology YAML; its roles all run here. Default: 2 CPU workers.")] = None,
    workers: Annotated[Optional[int], typer.Option("--workers", "-w", min=1, help="Number of CPU workers (replaces the topology's workers).")] = None,
    model: Annotated[Optional[str], typer.Option("--model", "-m", help="HF causal LM: a local directory or a hub name. Default: the built-in tiny model.")] = None,
    input: Annotated[Optional[InputMode], typer.Option("--input", help="text: one prompt per line; jsonl: one JSON request per line. Default: the topology's (text).")] = None,
    output: Annotated[Optional[InputMode], typer.Option("--output", help="text: readable streams; jsonl: one JSON event per line. Default: the topology's (text).")] = None,
    max_new_tokens: Annotated[Optional[int], typer.Option("--max-new-tokens", min=1, help="Default output length per request.")] = None,
    log_level: LogLevel = "warning",
):
    """Local multi-process simulation: every role a process on this machine, prompts from
    stdin, streaming output on stdout. Exits once stdin closes and every request is done."""
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
    try:
        topo = parse_topology(data, source="sim options")
    except ConfigError as exc:
        _fail(str(exc))
    model_path = _resolve_model(model if model is not None else topo.model.path)
    raise typer.Exit(run_sim(topo, model_path, log_level))


@app.command()
def node(
    config: Annotated[Path, typer.Argument(help="Topology YAML shared by every node.")],
    node: Annotated[str, typer.Option("--node", "-n", help="Which node of the topology this machine is.")],
    stdin: Annotated[bool, typer.Option("--stdin/--no-stdin", help="Ingest reads prompts from this command's stdin and the node exits when they are done (only where ingest runs).")] = False,
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
    raise typer.Exit(run_node(topo, config, node, read_stdin=stdin, log_level=log_level))


@app.command()
def feed(
    config: Annotated[Path, typer.Argument(help="Topology YAML; names the ingest node's address.")],
    timeout: Annotated[float, typer.Option(help="Seconds to wait for each answer from ingest.")] = 10.0,
):
    """Send prompts from stdin to a running ingest node, one per line (its input format)."""
    from .client import feed_lines
    topo = _load(config)
    raise typer.Exit(feed_lines(topo.endpoint("ingest").connect, sys.stdin, timeout))


@app.command()
def drain(
    config: Annotated[Path, typer.Argument(help="Topology YAML; names the router's address.")],
    worker: Annotated[str, typer.Option("--worker", help="Worker to drain.")],
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the router.")] = 5.0,
):
    """Move a worker's sequences to other workers, then let it exit. Nothing is lost."""
    from . import protocol as P
    from .client import ask
    topo = _load(config)
    reply = ask(topo.endpoint("router").connect, P.Drain(worker), P.DrainAck, timeout, "router")
    print(reply.message)
    raise typer.Exit(0 if reply.ok else 1)


@app.command()
def stats(
    config: Annotated[Path, typer.Argument(help="Topology YAML; names the router's address.")],
    timeout: Annotated[float, typer.Option(help="Seconds to wait for the router.")] = 5.0,
):
    """Print the router's counters: queue, leases, migrations by cause and mechanism."""
    from . import protocol as P
    from .client import ask
    topo = _load(config)
    reply = ask(topo.endpoint("router").connect, P.StatsRequest(), P.Stats, timeout, "router")
    for key in sorted(reply.counters):
        print(f"{key:32} {reply.counters[key]}")


@model_app.command("tiny")
def model_tiny(out_dir: Annotated[Path, typer.Argument(help="Directory to write the model and tokenizer to.")]):
    """Write the built-in tiny random-weight Llama model and its tokenizer to OUT_DIR."""
    from .engine.models import build_tiny_model
    print(build_tiny_model(out_dir))


@model_app.command("bench")
def model_bench(out_dir: Annotated[Path, typer.Argument(help="Directory to write the model to.")]):
    """Write the benchmark model (TinyLlama-1.1B's shape, random bf16 weights) to OUT_DIR."""
    from .engine.models import build_bench_model
    print(build_bench_model(out_dir))


@app.command("role", hidden=True)
def role(
    role: Annotated[Role, typer.Argument()],
    name: Annotated[str, typer.Argument()],
    config: Annotated[Path, typer.Option("--config")],
    stdin: Annotated[bool, typer.Option("--stdin")] = False,
    exit_when_done: Annotated[bool, typer.Option("--exit-when-done")] = False,
    log_level: LogLevel = "warning",
):
    """Run one role in this process (used by `node` and `sim`)."""
    from .launch import set_title
    set_title(role.value, name)
    logging.basicConfig(level=log_level.upper(), stream=sys.stderr,
                        format=f"qmigrate {role.value} {name}: %(levelname)s %(message)s")
    topo = _load(config)
    from .roles import detokenizer, ingest, monitor, router, worker
    try:
        if role is Role.ingest:
            code = ingest.run(topo, name, read_stdin=stdin, exit_when_done=exit_when_done)
        elif role is Role.detokenizer:
            code = detokenizer.run(topo, name, exit_when_done=exit_when_done)
        else:
            code = {Role.router: router, Role.worker: worker, Role.monitor: monitor}[role].run(topo, name)
    except KeyboardInterrupt:
        code = 130  # the node supervisor stops every role; no traceback for Ctrl-C
    raise typer.Exit(code)


def main() -> None:
    app()
