"""Start the roles of a node as child processes, watch them, stop them cleanly.

Each role runs as `python -m qmigrate role ROLE NAME --config FILE`, re-reading the same
resolved topology file, so a role started here behaves exactly like one started by hand
on another machine. On a node with CPU workers some roles run that same command in a child
forked from the node's zygote (ops/zygote.py), which has done their imports once.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .config import SHORT_TMP, ConfigError, Topology, dump_topology, parse_topology
from .detokenizer import EXIT_REQUESTS_FAILED
from .ops.process import die_with, holds_role_imports
from .ops.zygote import Forked, Zygote

log = logging.getLogger("qmigrate.launch")

CORE_ROLES = ("router", "ingest", "detokenizer")


@dataclasses.dataclass(slots=True)
class Child:
    role: str
    name: str
    proc: subprocess.Popen | Forked | None
    cmd: list[str] = dataclasses.field(default_factory=list)
    stdin: object = None
    zygote: Zygote | None = None   # forked from the node's zygote (ops/zygote.py), not exec'd
    restarted_at: list[float] = dataclasses.field(default_factory=list)   # monotonic times
    exited: bool = False

    @property
    def label(self) -> str:
        return f"{self.role} {self.name}" if self.name != self.role else self.role

    @property
    def may_restart(self) -> bool:
        """Any role but an ingest that reads this process's stdin (the input is gone with it):
        an ingest that serves HTTP starts again, and the router cancels what its clients
        asked of the one before."""
        return not (self.role == "ingest" and self.stdin is None)


class Interrupted(Exception):
    """SIGINT or SIGTERM reached the supervisor: stop every role and report it."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)


def _interrupt(signum, frame):
    raise Interrupted(signum)


def catch_signals():
    """From here on SIGINT and SIGTERM unwind the supervisor, so its `finally` blocks stop
    the roles and remove the temp directory. Returns the old handlers."""
    return {s: signal.signal(s, _interrupt) for s in STOP_SIGNALS}


def ignore_signals() -> None:
    """While stopping: a second signal must not cut the clean-up short."""
    for s in STOP_SIGNALS:
        signal.signal(s, signal.SIG_IGN)


def _die_with(parent: int, mask=None):
    """Run in the child before exec: SIGTERM it when the supervisor dies, even by SIGKILL.
    SIGINT is ignored from the start (an ignored signal stays ignored across exec, and Python
    then installs no KeyboardInterrupt handler): Ctrl-C at a terminal reaches every process of
    the group, and a role still importing would print a traceback. The supervisor takes the
    Ctrl-C and stops each role with SIGTERM. `mask`: the signal mask to restore once the
    child's handlers are set (the spawner blocks the stop signals across the fork)."""
    def prepare():
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_DFL)   # not the supervisor's handler
        die_with(parent)
        if mask is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    return prepare


def role_command(config_path: Path, role: str, name: str, *extra: str) -> list[str]:
    return [sys.executable, "-m", "qmigrate", "role", role, name, "--config", str(config_path), *extra]


def _spawn(cmd: list[str], stdin, **popen) -> subprocess.Popen:
    # A Ctrl-C between the fork and the child's own handlers would run the supervisor's
    # handler in the child (inside the interpreter's after-fork hooks) and print a traceback:
    # the stop signals stay blocked across the fork; the parent takes any that came after.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    try:
        return subprocess.Popen(cmd, stdin=stdin, start_new_session=False,
                                preexec_fn=_die_with(os.getpid(), mask), **popen)
    finally:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)


def _start(c: Child, *, restarted: bool = False) -> subprocess.Popen | Forked:
    """`restarted`: the role is told that the process before it died, whose own children (an
    ingest's HTTP processes) may still be ending and holding what the new one needs."""
    cmd = c.cmd + ["--restarted"] if restarted else c.cmd
    if c.zygote is not None and (forked := c.zygote.fork(cmd[3:], stdin=c.stdin is None)) is not None:
        return forked
    return _spawn(cmd, c.stdin)


def start_roles(topo: Topology, config_path: Path, roles: list[tuple[str, str]], *,
                read_stdin: bool, log_level: str, wait_for_workers: int = 0) -> list[Child]:
    """The roles' processes. On a node with CPU workers, one zygote imports torch and
    transformers once, and the workers are forked from it, with the detokenizer and an ingest
    that reads no stdin (they import transformers' tokenizers); the roles it does not fork
    start first, while it imports: the router at once, as ingest and workers give up on a
    router that does not answer at startup. A node whose own process holds those imports
    (forked from one that made them) forks its zygote from itself, ready at once, and that
    zygote forks the router and every ingest too. GPU workers and the monitor always start as
    processes of their own."""
    children = []
    serving = is_serving(topo)
    zygote = None
    if holds_role_imports() or any(role == "worker" and topo.worker(name).device == "cpu" for role, name in roles):
        zygote = Zygote(_spawn)
        zygote.start()
    for role, name in roles:
        extra = ["--log-level", log_level]
        stdin = subprocess.DEVNULL
        if read_stdin and role == "ingest":
            extra += ["--stdin"] + ([] if serving else ["--exit-when-done"])
            stdin = None  # the ingest process reads this process's stdin
        if role == "ingest" and wait_for_workers:
            extra += ["--wait-for-workers", str(wait_for_workers)]
        if read_stdin and role == "detokenizer" and not serving:
            extra.append("--exit-when-done")
        cmd = role_command(config_path, role, name, *extra)
        if role == "worker":
            forkable = topo.worker(name).device == "cpu"
        elif zygote is not None and zygote.forks_every_role:
            forkable = role in CORE_ROLES
        else:
            forkable = role in ("ingest", "detokenizer") and stdin is subprocess.DEVNULL
        children.append(Child(role, name, None, cmd, stdin, zygote=zygote if forkable else None))
    try:
        for c in sorted(children, key=lambda c: c.zygote is not None):
            c.proc = _start(c)
    except BaseException:   # a signal while the zygote imports: stop what has started
        stop(children)
        raise
    return children


def is_serving(topo: Topology) -> bool:
    """With an HTTP API the node serves until it is stopped, whether or not stdin has ended."""
    return topo.ingest.http_port is not None


def stop(children: list[Child], grace_s: float = 5.0) -> None:
    for c in children:
        if c.proc is not None and c.proc.poll() is None:
            c.proc.terminate()
    deadline = time.monotonic() + grace_s
    for c in children:
        if c.proc is None:
            continue
        try:
            c.proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            c.proc.kill()
            c.proc.wait()
    for zygote in {id(c.zygote): c.zygote for c in children if c.zygote is not None}.values():
        zygote.close()


def supervise(children: list[Child], *, until_done: bool, max_restarts: int = 0, restart_window_s: float = 600.0,
              tick=None) -> int:
    """Wait until the detokenizer finishes (until_done), or forever as a service. A role that
    dies is started again, unless it has been max_restarts times within the last
    restart_window_s; 1 if a role failed for good. `tick`, when given, is called on every
    round (the progress line)."""
    while True:
        for c in children:
            if c.exited or (rc := c.proc.poll()) is None:
                continue
            if rc in (0, EXIT_REQUESTS_FAILED) and c.role == "detokenizer" and until_done:
                return rc
            if rc == 0 and c.role in ("ingest", "worker", "monitor"):
                c.exited = True  # done reading, drained, or no NVML here: not a failure
                continue
            now = time.monotonic()
            c.restarted_at = [t for t in c.restarted_at if now - t < restart_window_s]
            if c.may_restart and len(c.restarted_at) < max_restarts:
                c.restarted_at.append(now)
                print(f"qmigrate: {c.label} exited with status {rc}; starting it again "
                      f"({len(c.restarted_at)} of {max_restarts} in {restart_window_s:g} s)", file=sys.stderr)
                c.proc = _start(c, restarted=True)
                continue
            if c.role in CORE_ROLES:
                return _failed(c, rc)
            log.warning("%s exited with status %d", c.label, rc)
            print(f"qmigrate: {c.label} exited with status {rc}", file=sys.stderr)
            c.exited = True
        workers = [c for c in children if c.role == "worker"]
        if until_done and workers and all(c.exited for c in workers):
            print("qmigrate: every worker has exited; stopping", file=sys.stderr)
            return 1
        if tick is not None:
            tick()
        time.sleep(0.1)


def _failed(c: Child, rc: int) -> int:
    print(f"qmigrate: {c.label} exited with status {rc}; stopping the node", file=sys.stderr)
    return 1


def device_problem(topo: Topology, node: str) -> str | None:
    """Why a worker of this node cannot have its device, naming the field; None if all can."""
    wanted = [(i, w) for i, w in enumerate(topo.workers) if w.node == node and w.device.startswith("cuda")]
    if not wanted:
        return None
    import torch
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    for i, w in wanted:
        index = int(w.device.partition(":")[2] or 0)
        if index >= count:
            have = f"{count} CUDA device{'s' if count != 1 else ''}" if count else "no CUDA"
            return f"workers[{i}].device: {w.device!r} (worker {w.name}), but this machine has {have}"
    return None


def run_node(topo: Topology, config_path: Path, node: str, *, read_stdin: bool,
             log_level: str = "warning", wait_for_workers: bool = False, tick=None) -> int:
    """`tick`, when given, is called on every round of supervision (unless a progress line is)."""
    if (problem := device_problem(topo, node)) is not None:
        print(f"error: {problem}", file=sys.stderr)
        return 2
    if wait_for_workers:
        # imported before any role starts: a Ctrl-C that lands mid-import is turned into an
        # ImportError by zmq's backend loader, and would print a traceback instead of stopping
        from qmigrate.wire import transport  # noqa: F401
    old = catch_signals()
    children: list[Child] = []
    try:
        roles = topo.roles_on(node)
        has_detok = any(role == "detokenizer" for role, _ in roles)
        # With wait_for_workers, ingest submits nothing until every worker has joined the router,
        # so a short run is spread over the whole fleet instead of the first worker up. It
        # starts with the others all the same, and loads its tokenizer while they load the model.
        num_workers = len(topo.workers) if wait_for_workers else 0
        children += start_roles(topo, config_path, roles, read_stdin=read_stdin, log_level=log_level,
                                wait_for_workers=num_workers)
        if num_workers and not wait_for_fleet(topo, children, num_workers, topo.node(node).join_timeout_s):
            return 1
        has_router = any(role == "router" for role, _ in roles)
        progress = RouterProgress(topo) if read_stdin and has_router else None
        try:
            rc = supervise(children, until_done=read_stdin and has_detok and not is_serving(topo),
                           max_restarts=topo.node(node).max_restarts,
                           restart_window_s=topo.node(node).restart_window_s,
                           tick=progress.tick if progress and progress.line.enabled else tick)
        finally:
            if progress is not None:
                progress.line.clear()
        if rc in (0, EXIT_REQUESTS_FAILED) and read_stdin and any(role == "router" for role, _ in roles):
            print_summary(topo)
        return rc
    except Interrupted as exc:
        # whatever was still running is unfinished, so never report success
        print(f"qmigrate: stopped by signal {exc.signum}", file=sys.stderr)
        return 128 + exc.signum
    finally:
        ignore_signals()
        stop(children)
        for s, h in old.items():
            signal.signal(s, h)  # in a simulation: its handler, until the temp directory is gone


def wait_for_fleet(topo: Topology, children: list[Child], num_workers: int, timeout_s: float = 120.0,
                   notice_s: float = 10.0) -> bool:
    from qmigrate.wire import protocol as P
    from qmigrate.wire import transport
    start = time.monotonic()
    deadline, joined, told = start + timeout_s, 0, False
    while time.monotonic() < deadline:
        if not told and time.monotonic() - start > notice_s:
            print(f"qmigrate: waiting for workers: {joined} of {num_workers} joined after {notice_s:g} s "
                  f"(loading the model; a worker that fails says why)", file=sys.stderr)
            told = True
        for c in children:
            if (rc := c.proc.poll()) is not None:
                if rc in (0, EXIT_REQUESTS_FAILED) and c.role in ("ingest", "detokenizer"):
                    return True  # the input ended with nothing to run: supervise() sees the end
                _failed(c, rc)
                return False
        try:
            stats = transport.request(topo.endpoint("router").connect, P.StatsRequest(),
                                      timeout_s=1.0, expect=P.Stats).counters
            joined = stats.get("workers", 0)
            if joined >= num_workers:
                return True
        except transport.Unreachable:
            pass
        time.sleep(0.2)
    print(f"qmigrate: only {joined} of {num_workers} workers joined the router within {timeout_s:g} s "
          f"(nodes[].join_timeout_s): stopping", file=sys.stderr)
    return False


class RouterProgress:
    """The progress line of a run: requests done, tokens/s and queue, as the router counts them."""

    def __init__(self, topo: Topology):
        from qmigrate.ops.observe import WORKER_COLUMNS
        from qmigrate.ops.progress import ProgressLine, TokenRate
        self.tokens_col = WORKER_COLUMNS.index("tokens_total")
        self.endpoint = topo.endpoint("router").connect
        self.line = ProgressLine("qmigrate")
        self.rate = TokenRate()

    def tick(self) -> None:
        from qmigrate.wire import protocol as P
        from qmigrate.wire import transport
        if not self.line.due():
            return
        try:
            stats = transport.request(self.endpoint, P.StatsRequest(), timeout_s=0.3, expect=P.Stats)
        except transport.Unreachable:
            return
        c = stats.counters
        col = self.tokens_col
        total = sum(row[col] for row in stats.workers if len(row) > col and type(row[col]) is int)
        rate = self.rate.add(time.monotonic(), total)
        self.line.show(c.get("finished", 0), None, rate, c.get("queued", 0),
                       max(0, c.get("live", 0) - c.get("queued", 0)))


def print_summary(topo: Topology) -> None:
    """One line on stderr: what the router counted, migrations by cause and mechanism."""
    from qmigrate.wire import protocol as P
    from qmigrate.wire import transport
    try:
        stats = transport.request(topo.endpoint("router").connect, P.StatsRequest(),
                                  timeout_s=2.0, expect=P.Stats).counters
    except transport.Unreachable:
        return
    moves = {k.removeprefix("migrations_"): v for k, v in sorted(stats.items())
             if k.startswith("migrations_") and v}
    detail = ", ".join(f"{k} {v}" for k, v in moves.items()) or "none"
    print(f"qmigrate: {stats.get('finished', 0)} sequences finished in {stats.get('leases', 0)} "
          f"batches, {stats.get('kv_imported', 0)} resumed from shipped KV; migrations: {detail}; "
          f"evictions {stats.get('evictions', 0)}, resends {stats.get('resends', 0)}", file=sys.stderr)


def single_node(topo: Topology, ipc_dir: str, model_path: str) -> Topology:
    """The same topology with every role on one node "local", over ipc:// sockets."""
    data = topo.to_dict()
    data["transport"], data["ipc_dir"] = "ipc", ipc_dir
    data["security"]["enabled"] = "auto"  # one node over ipc: no keys, whatever the fleet uses
    data["model"]["path"] = model_path
    data["nodes"] = [{"name": "local", "monitor": any(w["device"].startswith("cuda") for w in data["workers"]),
                      "max_restarts": data["nodes"][0]["max_restarts"],
                      "restart_window_s": data["nodes"][0]["restart_window_s"],
                      "join_timeout_s": data["nodes"][0]["join_timeout_s"]}]
    # Journals in the run's own directory: a role the supervisor starts again loses nothing.
    data["router"]["journal"] = data["router"]["journal"] or f"{ipc_dir}/router.journal"
    data["detokenizer"]["journal"] = data["detokenizer"]["journal"] or f"{ipc_dir}/detokenizer.journal"
    for section in ("router", "ingest", "detokenizer"):
        data[section]["node"] = "local"
    for w in data["workers"]:
        w["node"], w["kv_port"] = "local", None
    return parse_topology(data, source="simulation")


def run_local(topo: Topology, model_path: str, start, prefix: str = "qm-") -> int:
    """Run `topo` as one node in a temp directory of its own: `start(local, path)` runs it
    (the single-node topology and the file it is written to). Signals stop it with status
    128 + the signal, and the directory goes whatever happens."""
    old = catch_signals()  # before the temp directory exists, so a signal never leaves it behind
    tmp = None
    try:
        tmp = tempfile.mkdtemp(prefix=prefix)
        local = single_node(topo, tmp, model_path)
        try:
            local.check_endpoints()
        except ConfigError:
            if tempfile.gettempdir() == SHORT_TMP or not os.path.isdir(SHORT_TMP):
                raise
            # a long TMPDIR: an ipc:// socket's path has room for 107 bytes, so they go in /tmp
            shutil.rmtree(tmp, ignore_errors=True)
            tmp = None
            tmp = tempfile.mkdtemp(prefix=prefix, dir=SHORT_TMP)
            local = single_node(topo, tmp, model_path)
            local.check_endpoints()
        path = Path(tmp) / "topology.yaml"
        dump_topology(local, path)
        return start(local, path)
    except Interrupted as exc:
        print(f"qmigrate: stopped by signal {exc.signum}", file=sys.stderr)
        return 128 + exc.signum
    except ConfigError as exc:   # e.g. a worker name too long for an ipc:// path even in /tmp
        print(f"qmigrate: {exc}", file=sys.stderr)
        return 2
    finally:
        ignore_signals()
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
        for s, h in old.items():
            signal.signal(s, h)


def run_sim(topo: Topology, model_path: str, log_level: str = "warning") -> int:
    def start(local: Topology, path: Path) -> int:
        if sys.stderr.isatty():  # an operator at a terminal may want to look inside
            print(f"qmigrate: live view: qmigrate status {path}", file=sys.stderr)
        return run_node(local, path, "local", read_stdin=True, log_level=log_level, wait_for_workers=True)

    return run_local(topo, model_path, start)


def set_title(role: str, name: str) -> None:
    title = f"qmigrate {role} {name}" if name != role else f"qmigrate {role}"
    try:
        import setproctitle
        setproctitle.setproctitle(title)
    except ImportError:  # ps then shows the python command line, which names the role too
        pass
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
