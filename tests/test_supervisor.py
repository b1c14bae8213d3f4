"""The node supervisor's restart budget: a role that dies is started again unless it has been
max_restarts times within restart_window_s (systemd's StartLimitBurst and StartLimitIntervalSec),
so a role that fails now and then always comes back and one that keeps failing stops the node."""

from __future__ import annotations

import types

import pytest

from qmigrate import launch


class Exited:
    """A role's process that has exited with `rc`."""

    def __init__(self, rc: int):
        self.rc = rc

    def poll(self) -> int:
        return self.rc


class Enough(Exception):
    pass


def run(monkeypatch, *, seconds_between_deaths: float, rounds: int, role: str = "router") -> tuple[int | None, list]:
    """Supervise one role that dies at every look, on a clock that moves
    seconds_between_deaths a round; returns (supervise's status or None if it was still
    going after `rounds` rounds, the times the role was started again)."""
    clock = types.SimpleNamespace(now=1000.0)
    starts = []

    def sleep(_):
        clock.now += seconds_between_deaths
    monkeypatch.setattr(launch, "time", types.SimpleNamespace(monotonic=lambda: clock.now, sleep=sleep))

    def start(child, *, restarted=False):
        assert restarted
        starts.append(clock.now)
        return Exited(1)
    monkeypatch.setattr(launch, "_start", start)

    def tick():
        if len(starts) >= rounds:
            raise Enough
    child = launch.Child(role, role, Exited(1), stdin=None if role == "ingest" else object())
    try:
        return launch.supervise([child], until_done=False, max_restarts=3, restart_window_s=600.0, tick=tick), starts
    except Enough:
        return None, starts


def test_a_role_that_keeps_dying_stops_the_node_after_max_restarts_within_the_window(monkeypatch, capsys):
    rc, starts = run(monkeypatch, seconds_between_deaths=100.0, rounds=10)
    assert rc == 1 and starts == [1000.0, 1100.0, 1200.0]
    err = capsys.readouterr().err
    assert "router exited with status 1; starting it again (3 of 3 in 600 s)" in err
    assert "router exited with status 1; stopping the node" in err


def test_a_role_that_dies_now_and_then_is_always_started_again(monkeypatch, capsys):
    """Three deaths within 600 s at most: the fourth finds the first out of the window."""
    rc, starts = run(monkeypatch, seconds_between_deaths=250.0, rounds=12)
    assert rc is None and len(starts) == 12
    assert "stopping the node" not in capsys.readouterr().err


def test_with_no_restarts_the_first_death_of_a_core_role_stops_the_node(monkeypatch, capsys):
    monkeypatch.setattr(launch, "_start", lambda *a, **k: pytest.fail("started again"))
    child = launch.Child("detokenizer", "detokenizer", Exited(3), stdin=object())
    assert launch.supervise([child], until_done=False, max_restarts=0) == 1
    assert "detokenizer exited with status 3; stopping the node" in capsys.readouterr().err
