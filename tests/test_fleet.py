"""A running fleet changes under load: a worker joins, one is drained, one is killed.

Real `qmigrate node` processes on loopback TCP; nothing may be lost or printed twice."""

from __future__ import annotations

import json
import os
import random
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from typer.testing import CliRunner

from qmigrate.wire import protocol as P
from qmigrate.wire import transport
from qmigrate.cli import app
from conftest import check_outputs, free_ports, stop_group

pytestmark = pytest.mark.timeout(300)

NUM_PROMPTS = 16
NEW_TOKENS = 200


@pytest.fixture
def fleet(tmp_path, tiny_model_dir):
    ports = free_ports(7)
    data = {
        "transport": "tcp",
        "model": {"path": str(tiny_model_dir)},
        "nodes": [{"name": "head", "address": "127.0.0.1", "bind": "127.0.0.1"},
                  {"name": "late", "address": "127.0.0.1", "bind": "127.0.0.1"}],
        "router": {"node": "head", "port": ports[0], "telemetry_port": ports[1],
                   "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 3.0, "lease_timeout_s": 5.0,
                   # One-step leases: with one row a worker, a multi-step lease would run each
                   # sequence to its end, and a worker would never hold several for the drain.
                   "rebalance_threshold": 2, "max_lease_steps": 1},
        "ingest": {"node": "head", "port": ports[2], "input": "jsonl"},
        "detokenizer": {"node": "head", "port": ports[3], "output": "jsonl"},
        "workers": [{"name": f"w{i}", "node": "head" if i < 3 else "late", "device": "cpu",
                     "kv_port": ports[3 + i], "max_seqs": 1} for i in (1, 2, 3)],
    }
    path = tmp_path / "fleet.yaml"
    path.write_text(yaml.safe_dump(data))
    procs: list[subprocess.Popen] = []

    def start(node: str, stdin_text: str | None = None) -> subprocess.Popen:
        args = [sys.executable, "-m", "qmigrate", "node", str(path), "--node", node]
        if stdin_text is not None:
            args.append("--stdin")
        # Files, not pipes: a pipe nobody reads while the test polls would stall the node.
        # Append mode: the node shares these files' offset, and the test's seek(0) before a
        # read must not move where the node writes (it overwrote output mid-run in "w+").
        out = open(tmp_path / f"{node}.out", "a+")
        err = open(tmp_path / f"{node}.err", "a+")
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=out, stderr=err, text=True,
                                start_new_session=True)
        if stdin_text is not None:
            proc.stdin.write(stdin_text)
        proc.stdin.close()
        proc.stdin = None
        proc.out, proc.err = out, err
        procs.append(proc)
        return proc

    router = f"tcp://127.0.0.1:{ports[0]}"
    yield path, start, router
    for proc in procs:
        stop_group(proc)


def _stats(router: str) -> dict:
    try:
        return transport.request(router, P.StatsRequest(), timeout_s=1.0, expect=P.Stats).counters
    except transport.Unreachable:
        return {}


def _wait_for(what: str, predicate, router: str, timeout: float = 90.0) -> dict:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = _stats(router)
        if stats and predicate(stats):
            return stats
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}; last stats {_stats(router)}")


def _prompts(seed: int = 11, prefix: str = "q", n: int = NUM_PROMPTS, new_tokens: int = NEW_TOKENS):
    r = random.Random(seed)
    return [{"id": f"{prefix}{i}", "prompt_ids": [1] + [r.randint(3, 1400) for _ in range(r.randint(2, 30))],
             "max_new_tokens": new_tokens} for i in range(n)]


def _feed(path, prompts) -> None:
    fed = subprocess.run([sys.executable, "-m", "qmigrate", "feed", str(path)], text=True, timeout=60,
                         input="".join(json.dumps(p) + "\n" for p in prompts), capture_output=True)
    assert fed.returncode == 0, fed.stderr
    assert f"fed {len(prompts)} prompts" in fed.stderr


def _wait_for_output(proc, num_requests: int, timeout: float = 180.0) -> str:
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


def _finish(proc: subprocess.Popen, router: str) -> tuple[str, str]:
    try:
        proc.wait(timeout=120)
    except subprocess.TimeoutExpired:
        proc.err.seek(0)
        pytest.fail(f"the head node did not finish; router stats {_stats(router)}\n{proc.err.read()[-3000:]}")
    proc.out.seek(0)
    proc.err.seek(0)
    return proc.out.read(), proc.err.read()


def _roles_of(node: subprocess.Popen) -> dict[str, int]:
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


def _pid_of(node: subprocess.Popen, title: str) -> int | None:
    """The pid of the node's role whose process title is `title` (a running one), or None."""
    for name, pid in _roles_of(node).items():
        if name == title or name.startswith(title + " "):
            try:
                with open(f"/proc/{pid}/stat") as f:
                    if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                        continue  # exited, not yet reaped
            except OSError:
                continue
            return pid
    return None


def _keep_busy_until_w3_joins(path, router, timeout: float = 120.0) -> list[dict]:
    """Feed waves of long requests so the fleet is working when w3 joins, however slowly
    it starts; returns every prompt fed."""
    fed: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = _stats(router)
        if stats.get("workers") == 3:
            assert stats.get("live", 0) > 0, f"w3 joined an idle fleet: {stats}"
            return fed
        if stats and stats.get("live", 0) < 8:
            wave = _prompts(100 + len(fed), f"a{len(fed)}-", n=8, new_tokens=120)
            _feed(path, wave)
            fed += wave
        time.sleep(0.1)
    pytest.fail(f"w3 did not join within {timeout:g} s; last stats {_stats(router)}")


def test_join_and_drain_under_load_lose_nothing(fleet, tiny_model_dir):
    """The head runs as a service (no --stdin): prompts arrive by `qmigrate feed`."""
    path, start, router = fleet
    second = _prompts(12, "b", n=8, new_tokens=80)
    head = start("head")
    _wait_for("the first two workers", lambda s: s.get("workers") == 2, router)
    late = start("late")  # loads its model while the fleet works
    first = _keep_busy_until_w3_joins(path, router)
    for node, title in ((head, "qmigrate router"), (head, "qmigrate worker w1"), (head, "qmigrate worker w2"),
                        (head, "qmigrate ingest"), (head, "qmigrate detokenizer"), (late, "qmigrate worker w3")):
        assert _pid_of(node, title), (title, _roles_of(node))
    _feed(path, second)
    _wait_for("w3 to own sequences", lambda s: s.get("owned_w3", 0) > 0, router)
    # Then fresh long requests alone: while all 8 are live, whatever w1 holds is far from
    # done, so the drain must move it. Their greedy outputs all run the full 200 tokens (with
    # seed 13 one met EOS after 3, and "all 8 live" lasted a few steps). With older requests
    # still live, one run had w1 own 2 or more when the drain was sent and yet nothing moved,
    # most likely because they were near their end.
    _wait_for("the requests so far to finish", lambda s: s.get("live", 1) == 0, router)
    third = _prompts(24, "c", n=8, new_tokens=200)
    _feed(path, third)
    _wait_for("w1 to hold unfinished sequences",
              lambda s: s.get("owned_w1", 0) >= 1 and s.get("live", 0) >= 8, router)

    # The CLI in this process: a new interpreter would start too slowly on a busy machine,
    # and w1 could finish what it holds before the drain arrived, leaving nothing to move.
    drain = CliRunner().invoke(app, ["drain", str(path), "--worker", "w1"])
    assert drain.exit_code == 0 and "draining w1" in drain.output, drain.output
    _wait_for("w1 to be drained and released", lambda s: s.get("workers") == 2 and s.get("owned_w1", 1) == 0,
              router)
    deadline = time.monotonic() + 30
    while _pid_of(head, "qmigrate worker w1") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not _pid_of(head, "qmigrate worker w1"), "the drained worker did not exit"

    out = _wait_for_output(head, len(first) + len(second) + len(third))
    stats = _stats(router)
    moves = {k: v for k, v in stats.items() if k.startswith(("migrations", "owned")) or k in ("finished", "live")}
    assert stats.get("migrations_drain", 0) > 0, f"the drain moved nothing: {moves}"
    check_outputs(out, first + second + third, tiny_model_dir)


def test_a_killed_worker_loses_nothing(fleet, tiny_model_dir):
    path, start, router = fleet
    # 120 tokens each, 1,920 in all: the kill lands within the first tokens, and when the
    # router notices it 3 s later work is still live (checked below).
    prompts = _prompts(new_tokens=120)
    head = start("head", "".join(json.dumps(p) + "\n" for p in prompts))
    _wait_for("both workers to own sequences",
              lambda s: s.get("owned_w1", 0) > 0 and s.get("owned_w2", 0) > 0, router)
    victim = _pid_of(head, "qmigrate worker w2")
    assert victim, _roles_of(head)
    os.kill(victim, signal.SIGKILL)
    stats = _wait_for("the router to notice", lambda s: s.get("workers_lost", 0) >= 1, router)
    assert stats.get("live", 0) > 0, "the run ended before the kill; the test proves nothing"
    out, err = _finish(head, router)
    assert head.returncode == 0, err[-3000:]
    assert "w2 exited" in err  # the node says which role died, then carries on
    moves = dict(re.findall(r"(\w+) (\d+)", re.search(r"migrations: (.*)", err).group(1)))
    assert int(moves.get("dead", 0)) > 0, err[-2000:]
    check_outputs(out, prompts, tiny_model_dir)
