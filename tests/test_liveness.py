"""A worker is alive while its process is, however long one step takes; a stopped worker, or
one whose loop is stuck in a step past the lease timeout, is still lost and its work moves.

The head node (router, ingest, detokenizer) is a real `qmigrate node` on loopback TCP;
worker w1, on node "late", is started by the test as `qmigrate role worker` in a process whose step can be held
on purpose: when the file `hold` exists, the next lease's first step sleeps that many seconds,
or until the file `release` appears (as a host thread blocked on a long step does, off the
interpreter's lock).

The run mostly waits out a held step and two timeouts: it runs in a thread beside the
in-process tests of test_families (conftest's `early` marker), and this test checks it."""

from __future__ import annotations

import subprocess
import time

import pytest

import helpers as H
import warm
from conftest import check_outputs, reserve_ports, stop_group

pytestmark = [pytest.mark.slow, pytest.mark.timeout(240)]

HEARTBEAT_TIMEOUT_S = 3.0   # pulses every 0.2 s: a live worker is never this silent, even on a loaded machine
LEASE_TIMEOUT_S = 8.0

_WORKER = """
import sys, time
from pathlib import Path
from qmigrate.worker import core
from qmigrate.cli import app

hold, release = Path(sys.argv[2]), Path(sys.argv[3])
start = core.WorkerCore.start

def held_start(self, lease, **kw):
    if hold.exists():
        seconds = float(hold.read_text())
        hold.unlink()
        print(f"holding a step for {seconds:g} s", file=sys.stderr, flush=True)
        end = time.monotonic() + seconds
        while time.monotonic() < end and not release.exists():
            time.sleep(0.05)
        release.unlink(missing_ok=True)
        print("held step over", file=sys.stderr, flush=True)
    return start(self, lease, **kw)

core.WorkerCore.start = held_start
app(["role", "worker", "w1", "--config", sys.argv[1]], prog_name="qmigrate")
"""


def _log(f) -> str:
    f.seek(0)
    return f.read()


def _wait_log(what: str, f, text: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while text not in _log(f):
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}\n{_log(f)[-3000:]}")
        time.sleep(0.05)


def _long_step_stopped_and_stuck(tmp_path, tiny_model_dir) -> tuple[str, list[dict]]:
    """The run (it mostly waits out timeouts): the head's output and every prompt fed, for the
    test to check against generate()."""
    path = tmp_path / "fleet.yaml"
    router = H.fleet_topology(path, tiny_model_dir, 1, reserve_ports(6), late=1, router={
        "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": HEARTBEAT_TIMEOUT_S,
        "lease_timeout_s": LEASE_TIMEOUT_S})
    nodes = H.Nodes(tmp_path)
    worker_err = open(tmp_path / "w1.err", "a+")
    worker = warm.popen_python(["-c", _WORKER, str(path), str(tmp_path / "hold"), str(tmp_path / "release")],
                               stdin=subprocess.DEVNULL, stdout=worker_err, stderr=worker_err, text=True,
                               start_new_session=True)
    try:
        head = nodes.start(path, "head")
        H.wait_for("w1 to join", lambda s: s.get("workers") == 1, router)

        # 1. A step twice the heartbeat timeout: w1 stays alive and its request never moves.
        (tmp_path / "hold").write_text(str(2 * HEARTBEAT_TIMEOUT_S))
        first = H.prompts(1, "a", n=2, new_tokens=20)
        H.feed_here(path, first)
        _wait_log("the held step to end", worker_err, "held step over")
        H.wait_for_output(head, len(first))
        stats = H.stats(router)
        assert stats.get("workers_lost", 0) == 0 and stats.get("migrations_dead", 0) == 0, stats
        assert stats.get("workers_joined") == 1, stats

        # 2. Stopped (SIGSTOP) while it holds a lease: lost, its sequences taken back; it rejoins.
        second = H.prompts(2, "b", n=2, new_tokens=20)
        H.wait_for("w1 to ask for work", lambda s: s.get("asking_w1", 0) > 0, router)
        H.pause(worker.pid)
        try:
            H.feed_here(path, second)
            H.wait_for("w1 to be lost", lambda s: s.get("workers_lost", 0) == 1, router)
        finally:
            H.resume(worker.pid)
        H.wait_for_output(head, len(first) + len(second))
        assert "worker w1 lost: silent for" in _log(head.err)
        assert H.stats(router).get("migrations_dead", 0) > 0

        # 3. Its loop stuck in one step past the lease timeout, its pulse going on: lost as hung.
        # The step is held until the router has said so (at most four lease timeouts), then let go.
        (tmp_path / "hold").write_text(str(4 * LEASE_TIMEOUT_S))
        third = H.prompts(3, "c", n=2, new_tokens=20)
        H.feed_here(path, third)
        H.wait_for("w1 to be lost as hung", lambda s: s.get("workers_hung", 0) == 1, router)
        assert _log(worker_err).count("held step over") == 1, "found hung only once its step was over"
        (tmp_path / "release").touch()
        H.wait_for_output(head, len(first) + len(second) + len(third))
        assert "worker w1 lost: its loop has been in one step for" in _log(head.err)
        stats = H.stats(router)
        assert stats.get("workers_lost") == 2 and stats.get("workers") == 1, stats
        assert worker.poll() is None
        return _log(head.out), first + second + third
    finally:
        H.resume(worker.pid)
        stop_group(worker)
        worker_err.close()
        nodes.stop_all()


@pytest.mark.early(scenario=_long_step_stopped_and_stuck, beside="test_families.py")
def test_a_long_step_is_no_death_and_a_stopped_or_stuck_worker_is(early_run, tiny_model_dir):
    out, prompts = early_run.result()
    check_outputs(out, prompts, tiny_model_dir)
