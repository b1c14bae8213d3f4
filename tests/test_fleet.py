"""A running fleet changes under load: a worker joins, one is drained, one is killed.

Real `qmigrate node` processes on loopback TCP; nothing may be lost or printed twice. The
drain and the kill each land on a worker that holds sequences it has not run yet (it is
paused until then), so they must move."""

from __future__ import annotations

import os
import re
import signal
import time

import pytest

import helpers as H
from conftest import check_outputs, greedy_tokens_many, reserve_ports

pytestmark = pytest.mark.timeout(300)


def _fleet_changes(tmp_path, tiny_model_dir) -> None:
    """The test below, run beside in-process tests (conftest's `early` lane)."""
    path = tmp_path / "fleet.yaml"
    router = H.fleet_topology(path, tiny_model_dir, 3, reserve_ports(8), late=1, worker={"max_num_seqs": 1}, router={
        "heartbeat_interval_s": 0.2, "heartbeat_timeout_s": 6.0, "lease_timeout_s": 30.0,
        # One-step leases: with one row a worker, a multi-step lease would run each
        # sequence to its end, and a worker would never hold several for the drain.
        "rebalance_threshold": 2, "max_lease_steps": 1})
    nodes = H.Nodes(tmp_path)
    try:
        _join_drain_and_kill((path, nodes, router), tiny_model_dir)
    finally:
        nodes.stop_all()


_WAVE = H.prompts(100, "a", n=16, new_tokens=100)


def _keep_busy_until_w3_joins(path, router, timeout: float = 120.0) -> list[dict]:
    """Feed waves of long requests so the fleet is working when w3 joins, however slowly
    it starts; returns every prompt fed."""
    fed: list[dict] = []
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        stats = H.stats(router)
        if stats.get("workers") == 3:
            assert stats.get("live", 0) > 0, f"w3 joined an idle fleet: {stats}"
            return fed
        # refilled well before it runs dry: between two polls the fleet must not finish
        # everything it holds, or w3 could join an idle fleet
        if stats and stats.get("live", 0) < 16:
            # Every wave has the same prompts under new ids: how many waves run depends on how
            # long w3 takes to start, and generate() checks each distinct prompt once. From
            # this process, so that no interpreter starting per wave slows w3's own start.
            wave = [{**p, "id": f"a{len(fed)}-{i}"} for i, p in enumerate(_WAVE)]
            H.feed_here(path, wave)
            fed += wave
        time.sleep(0.1)
    pytest.fail(f"w3 did not join within {timeout:g} s; last stats {H.stats(router)}")


@pytest.mark.early(scenario=_fleet_changes, beside="test_engine.py")   # in-process tests on one core
def test_join_drain_and_kill_under_load_lose_nothing(early_run):
    """One run of a fleet that changes three times: w3 joins while the others work, w1 is
    drained, and w2 is killed. Prompts arrive on ingest's socket, by `qmigrate feed` and from
    this process, and at the end on the head's stdin, whose end the node then runs to."""
    early_run.result()   # raises what the scenario's checks raised


def _join_drain_and_kill(fleet, tiny_model_dir) -> None:
    path, nodes, router = fleet
    second = H.prompts(12, "b", n=8, new_tokens=80)
    head = nodes.start(path, "head", keep_stdin=True, cold=True)   # started as a user's: its roles' parents below
    H.wait_for("the first two workers", lambda s: s.get("workers") == 2, router)
    late = nodes.start(path, "late")  # loads its model while the fleet works
    first = _keep_busy_until_w3_joins(path, router)
    for node, title in ((head, "qmigrate router"), (head, "qmigrate worker w1"), (head, "qmigrate worker w2"),
                        (head, "qmigrate ingest"), (head, "qmigrate detokenizer"), (late, "qmigrate worker w3")):
        assert H.pid_of(node, title), (title, H.roles_of(node))
    # the head's CPU workers and its detokenizer are forks of its zygote; the router, and an
    # ingest that reads the node's stdin, are processes the node started itself
    zygote = H.pid_of(head, "qmigrate zygote")
    assert zygote and H.parent_of(zygote) == head.pid, H.roles_of(head)
    for title in ("qmigrate worker w1", "qmigrate worker w2", "qmigrate detokenizer"):
        assert H.parent_of(H.pid_of(head, title)) == zygote, (title, H.roles_of(head))
    for title in ("qmigrate router", "qmigrate ingest"):
        assert H.parent_of(H.pid_of(head, title)) == head.pid, (title, H.roles_of(head))
    H.feed(path, second)
    H.wait_for("w3 to own sequences", lambda s: s.get("owned_w3", 0) > 0, router)
    H.wait_for("the requests so far to finish", lambda s: s.get("live", 1) == 0, router)

    # w1 is paused and given a sequence it has not run; the drain then moves it whatever the
    # timing: a one-step lease leaves each of these far from its end.
    third = H.prompts(24, "c", n=8, new_tokens=40)
    assert all(len(tokens) > 1 for tokens in greedy_tokens_many(tiny_model_dir, [(p["prompt_ids"], 40) for p in third]))
    H.migrate_by_drain(head, router, "w1", lambda: H.feed_here(path, third))
    H.wait_for("w1 to be drained and released", lambda s: s.get("workers") == 2 and s.get("owned_w1", 1) == 0,
               router)
    deadline = time.monotonic() + 30
    while H.pid_of(head, "qmigrate worker w1") and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not H.pid_of(head, "qmigrate worker w1"), "the drained worker did not exit"
    H.wait_for_output(head, len(first) + len(second) + len(third))
    stats = H.stats(router)
    moves = {k: v for k, v in stats.items() if k.startswith(("migrations", "owned")) or k in ("finished", "live")}
    assert stats.get("migrations_drain", 0) > 0, f"the drain moved nothing: {moves}"

    # w2 holds a sequence it has not run when it is killed: the router must move it.
    fourth = H.prompts(n=8, new_tokens=30)

    def write():
        head.stdin.write(H.jsonl(fourth))
        head.stdin.close()

    dead_before = stats.get("migrations_dead", 0)
    victim = H.hold_work(head, router, "w2", write)
    os.kill(victim, signal.SIGKILL)
    H.resume(victim)
    # no wait on the router's counters here: with the tiny model the run can end (and the
    # router with it) before a poll sees them; the node's summary says what moved
    out, err = H.finish(head, router)
    assert head.returncode == 0, err[-3000:]
    assert "w2 exited" in err  # the node says which role died, then carries on
    moves = dict(re.findall(r"(\w+) (\d+)", re.search(r"migrations: (.*)", err).group(1)))
    assert int(moves.get("dead", 0)) > dead_before, err[-2000:]
    check_outputs(out, first + second + third + fourth, tiny_model_dir)
