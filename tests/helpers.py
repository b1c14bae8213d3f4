"""Helpers for tests that run real `qmigrate node` processes: start them, read the router's
counters, feed prompts, find a role's process, and pause or drain a worker on purpose."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import warm
from qmigrate.wire import protocol as P
from qmigrate.wire import transport


class Nodes:
    """`qmigrate node` processes of one topology, each in a session of its own; `stop_all`
    ends them and everything they started."""

    def __init__(self, out_dir: Path):
        self.out_dir = out_dir
        self.procs: list[subprocess.Popen] = []

    def start(self, path, node: str, stdin_text: str | None = None, *, keep_stdin: bool = False,
              cold: bool = False) -> subprocess.Popen:
        """Start `node` of the topology at `path`. With stdin_text (or keep_stdin) its ingest
        reads this command's stdin; keep_stdin leaves the pipe open for the test to write.
        Started warm (tests/warm.py) unless `cold`: then a process of its own, as a user's."""
        args = ["node", str(path), "--node", node]
        if stdin_text is not None or keep_stdin:
            args.append("--stdin")
        # Files, not pipes: a pipe nobody reads while the test polls would stall the node.
        # Append mode: the node shares these files' offset, and the test's seek(0) before a
        # read must not move where the node writes (it overwrote output mid-run in "w+").
        out = open(self.out_dir / f"{node}.out", "a+")
        err = open(self.out_dir / f"{node}.err", "a+")
        proc = warm.popen(args, stdin=subprocess.PIPE, stdout=out, stderr=err, text=True, start_new_session=True,
                          cold=cold)
        if stdin_text is not None:
            proc.stdin.write(stdin_text)
        if not keep_stdin:
            proc.stdin.close()
            proc.stdin = None
        proc.out, proc.err = out, err
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        from conftest import stop_group
        for proc in self.procs:
            if proc.stdin is not None and not proc.stdin.closed:
                proc.stdin.close()
            for pid in roles_of(proc).values():  # a paused role would ignore SIGTERM
                _signal(pid, signal.SIGCONT)
            stop_group(proc)
            proc.out.close()
            proc.err.close()


def stats(router: str) -> dict:
    """The router's counters, or {} when it does not answer within a second."""
    try:
        return transport.request(router, P.StatsRequest(), timeout_s=1.0, expect=P.Stats).counters
    except transport.Unreachable:
        return {}


def wait_for(what: str, predicate, router: str, timeout: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = stats(router)
        if got and predicate(got):
            return got
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}; last stats {stats(router)}")


def prompts(seed: int = 11, prefix: str = "q", n: int = 16, new_tokens: int = 200) -> list[dict]:
    r = random.Random(seed)
    return [{"id": f"{prefix}{i}", "prompt_ids": [1] + [r.randint(3, 1400) for _ in range(r.randint(2, 30))],
             "max_new_tokens": new_tokens} for i in range(n)]


def jsonl(rows: list[dict]) -> str:
    return "".join(json.dumps(p) + "\n" for p in rows)


def feed(path, rows) -> None:
    fed = subprocess.run([sys.executable, "-m", "qmigrate", "feed", str(path)], text=True, timeout=60,
                         input=jsonl(rows), capture_output=True)
    assert fed.returncode == 0, fed.stderr
    assert f"fed {len(rows)} prompts" in fed.stderr


def feed_here(path, rows) -> None:
    """As `feed`, from this process: no new interpreter to wait for while a worker is paused."""
    from qmigrate.config import load_topology
    from qmigrate.wire.client import feed_lines
    endpoint = load_topology(path).endpoint("ingest").connect
    assert feed_lines(endpoint, jsonl(rows).splitlines(keepends=True), 30.0) == 0


def wait_for_output(proc, num_requests: int, timeout: float = 180.0) -> str:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        proc.out.seek(0)
        text = proc.out.read()
        if text.count('"done": true') >= num_requests:
            return text
        assert proc.poll() is None, "the head node died"
        time.sleep(0.2)
    finished = text.count('"done": true')
    pytest.fail(f"only {finished} of {num_requests} requests finished")


def finish(proc: subprocess.Popen, router: str, timeout: float = 120.0) -> tuple[str, str]:
    """Wait for a node started with its prompts on stdin to exit; its (stdout, stderr)."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.err.seek(0)
        pytest.fail(f"the node did not finish; router stats {stats(router)}\n{proc.err.read()[-3000:]}")
    proc.out.seek(0)
    proc.err.seek(0)
    return proc.out.read(), proc.err.read()


def roles_of(node: subprocess.Popen) -> dict[str, int]:
    """Process title -> pid of the processes in the node's own session (the node was started
    in a new session, and its roles inherit it): never another test's or user's processes."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                session = int(f.read().rsplit(")", 1)[1].split()[3])
            with open(f"/proc/{entry}/cmdline", "rb") as f:
                title = f.read().replace(b"\0", b" ").decode(errors="replace").strip()
        except (OSError, ValueError, IndexError):
            continue
        if session == node.pid:
            found[title] = int(entry)
    return found


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _title(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return ""


def parent_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, ValueError, IndexError):
        return None


def pid_of(node: subprocess.Popen, title: str) -> int | None:
    """The pid of the node's role whose process title is `title` (a running one), or None."""
    for name, pid in roles_of(node).items():
        if (name == title or name.startswith(title + " ")) and _state(pid) not in ("", "Z"):
            return pid
    return None


def _signal(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def pause(pid: int, timeout: float = 10.0) -> None:
    """Stop a role the test started (SIGSTOP) and wait until it is stopped: from then on it
    runs no step and sends nothing until `resume`."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while _state(pid) != "T":
        assert time.monotonic() < deadline, f"process {pid} did not stop"
        time.sleep(0.005)


def resume(pid: int) -> None:
    _signal(pid, signal.SIGCONT)


def drain(router: str, worker: str) -> None:
    reply = transport.request(router, P.Drain(worker), timeout_s=10.0, expect=P.DrainAck)
    assert reply.ok, reply.message


def hold_work(node: subprocess.Popen, router: str, worker: str, write) -> int:
    """Make `worker` hold sequences it cannot have run yet: pause it once it has asked for
    work (and before `write()` sends the prompts), then wait until the router has leased some
    of them to it. Returns its pid, still paused: the caller drains or kills it, then resumes."""
    wait_for(f"{worker} to ask for work", lambda s: s.get(f"asking_{worker}", 0) > 0, router)
    pid = pid_of(node, f"qmigrate worker {worker}")
    assert pid, roles_of(node)
    pause(pid)
    try:
        write()
        wait_for(f"a lease to {worker}", lambda s: s.get(f"leased_{worker}", 0) > 0, router)
    except BaseException:
        resume(pid)
        raise
    return pid


def migrate_by_drain(node: subprocess.Popen, router: str, worker: str, write) -> None:
    """Sequences leased to `worker` before it ran them, then a drain: it runs their lease and
    returns them unfinished (the caller makes sure each needs more tokens than a lease gives),
    and a draining worker keeps none, so every one of them moves."""
    pid = hold_work(node, router, worker, write)
    try:
        drain(router, worker)
    finally:
        resume(pid)


def fleet_topology(path: Path, model_dir, num_workers: int, ports: list[int] | None = None,
                   ipc_dir: Path | None = None, *, router: dict | None = None, worker: dict | None = None,
                   ingest: dict | None = None, detokenizer: dict | None = None, late: int = 0) -> str:
    """A topology file: a "head" node with the router, ingest, detokenizer and its workers;
    the last `late` workers on a node "late". Over tcp on reserved `ports` (5 + one per
    worker), or over ipc:// in `ipc_dir`. Returns the router's address."""
    if ports is not None:
        assert len(ports) >= 5 + num_workers
        transport_part = {"transport": "tcp"}
        nodes = [{"name": n, "address": "127.0.0.1", "bind": "127.0.0.1"} for n in ("head", "late")]
        router_ports = {"port": ports[0], "telemetry_port": ports[1]}
        ingest_ports = {"port": ports[2], "reply_port": ports[4]}
        detok_ports = {"port": ports[3]}
        kv_ports = ports[5:]
        address = f"tcp://127.0.0.1:{ports[0]}"
    else:
        transport_part = {"transport": "ipc", "ipc_dir": str(ipc_dir)}
        nodes = [{"name": "head"}, {"name": "late"}]
        router_ports = ingest_ports = detok_ports = {}
        kv_ports = [None] * num_workers
        address = None
    data = {
        **transport_part,
        "model": {"path": str(model_dir)},
        "nodes": nodes[:2 if late else 1],
        "router": {"node": "head", **router_ports, **(router or {})},
        "ingest": {"node": "head", "input": "jsonl", **ingest_ports, **(ingest or {})},
        "detokenizer": {"node": "head", "output": "jsonl", **detok_ports, **(detokenizer or {})},
        "workers": [{"name": f"w{i}", "node": "head" if i <= num_workers - late else "late", "device": "cpu",
                     **({"kv_port": kv_ports[i - 1]} if kv_ports[i - 1] else {}), **(worker or {})}
                    for i in range(1, num_workers + 1)],
    }
    import yaml
    path.write_text(yaml.safe_dump(data))
    if address is None:
        from qmigrate.config import load_topology
        address = load_topology(path).endpoint("router").connect
    return address


def free_port() -> int:
    """A port for a server a test starts (conftest.reserve_ports): below the kernel's ephemeral
    range, so that no outgoing connection of another test takes it as its source port before
    the server binds it or while the server restarts, and held for this run alone."""
    from conftest import reserve_ports
    return reserve_ports(1)[0]


class HttpNode:
    """A `qmigrate node` of every role with the HTTP API (model name "tiny") and one CPU worker,
    its output in files: shared by the tests that talk to a live node over HTTP."""

    def __init__(self, tmp: Path, model_dir, ingest: dict | None = None, trace_dir: Path | None = None):
        """`ingest`: settings of the ingest section besides the defaults here; `trace_dir`: the
        topology's (every role keeps a timeline there)."""
        import openai
        import yaml
        self.ipc = tmp / "s"
        self.port = free_port()
        topo = {
            "transport": "ipc", "ipc_dir": str(self.ipc), "model": {"path": str(model_dir)},
            "defaults": {"max_new_tokens": 8}, "nodes": [{"name": "local"}],
            "router": {"node": "local"}, "detokenizer": {"node": "local", "output": "jsonl"},
            "ingest": {"node": "local", "input": "jsonl", "http_port": self.port, "model_name": "tiny",
                       **(ingest or {})},
            "workers": [{"name": "w1", "node": "local", "cpu_kvcache_space_bytes": 1 << 28}],
        }
        if trace_dir is not None:
            topo["trace_dir"] = str(trace_dir)
        self.config = tmp / "topology.yaml"
        self.config.write_text(yaml.safe_dump(topo))
        self.stdout = tmp / "stdout.jsonl"
        self.stderr = tmp / "stderr.txt"
        with open(self.stdout, "w") as out, open(self.stderr, "w") as err:
            self.proc = warm.popen(["node", str(self.config), "--node", "local"],
                                   stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        self.url = f"http://127.0.0.1:{self.port}"
        self.router = f"ipc://{self.ipc}/router.sock"
        self.client = openai.OpenAI(base_url=f"{self.url}/v1", api_key="none", max_retries=0, timeout=60)

    def wait_ready(self, timeout_s: float = 90) -> None:
        import openai
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.proc.poll() is None, self.stderr.read_text()[-3000:]
            try:
                if self.stats(timeout_s=0.5).get("workers", 0) >= 1:
                    self.client.models.list()
                    return
            except (transport.Unreachable, openai.APIConnectionError):
                pass
            time.sleep(0.2)
        pytest.fail(f"node not ready in {timeout_s} s:\n{self.stderr.read_text()[-3000:]}")

    def stats(self, timeout_s: float = 5.0) -> dict:
        return transport.request(self.router, P.StatsRequest(), timeout_s=timeout_s,
                                 expect=P.Stats).counters

    def feed(self, *lines: str) -> None:
        ack = transport.request(f"ipc://{self.ipc}/ingest.sock", P.FeedLines(list(lines)), expect=P.FeedAck)
        assert ack.num_accepted == len(lines)

    def records(self, done_ids: set[str], timeout_s: float = 30) -> list[dict]:
        """Printed records, once every id in done_ids has a final record."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            records = [json.loads(line) for line in self.stdout.read_text().splitlines() if line.strip()]
            if done_ids <= {r["id"] for r in records if r.get("done")}:
                return records
            time.sleep(0.05)
        pytest.fail(f"no final records for {done_ids}:\n{self.stdout.read_text()[-2000:]}")

    def stop(self) -> None:
        from conftest import stop_group
        stop_group(self.proc, grace_s=15)
