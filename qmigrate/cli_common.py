"""What the `qmigrate` commands share: an error as one line, the topology and model they
name, secured sockets, unwinding on a signal, and the options several of them take."""

from __future__ import annotations

import contextlib
import signal
import sys
from pathlib import Path
from typing import Annotated, Optional

import typer


def fail(message: str, code: int = 2):
    print(f"error: {message}", file=sys.stderr)
    raise typer.Exit(code)


def load(config: Path | None, warn_renamed: bool = True):
    """The topology at `config` (default: the local simulation's). `warn_renamed`: log a notice
    for each old setting name (a role started by a supervisor leaves that to the supervisor)."""
    from .config import ConfigError, load_topology, local_topology
    try:
        return load_topology(config, warn_renamed=warn_renamed) if config is not None else local_topology()
    except ConfigError as exc:
        fail(str(exc))


def endpoint(topo, kind: str) -> str:
    from .config import ConfigError
    try:
        return topo.endpoint(kind).connect
    except ConfigError as exc:
        fail(str(exc))


def find_model(path: str | None) -> str:
    from qmigrate.hub.loading import ModelLoadError, ModelNotFound, fetch_hub_model, resolve_model
    try:
        resolved = resolve_model(path)
        return resolved if Path(resolved).is_dir() else fetch_hub_model(resolved)
    except (ModelNotFound, ModelLoadError) as exc:
        fail(str(exc))


def secure(topo, node: str | None) -> None:
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
        fail(str(exc))
    except security.SecurityError as exc:
        fail(str(exc), 1)


def warn_if_open(topo) -> None:
    from qmigrate.wire.security import open_warning
    if (text := open_warning(topo)) is not None:
        print(f"warning: {text}", file=sys.stderr)


AsNode = Annotated[Optional[str], typer.Option(
    "--as-node",
    help="With security on: the operator node whose keys this command uses (default: the first of "
         "security.operators).")]


@contextlib.contextmanager
def interruptible():
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
        fail(str(exc))
    return value


LogLevel = Annotated[str, typer.Option("--log-level", callback=_check_level,
                                       help="Log level of every role: debug, info, warning, error.")]
