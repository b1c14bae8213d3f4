"""Stopping cleanly: SIGTERM to `qmigrate bench` leaves no temp directory and no role behind;
Ctrl-C in the first seconds of a run prints no traceback from roles still importing. (HTTP
streams cut by a shutdown: test_serve.py, on the server it starts anyway.)"""

from __future__ import annotations

import os
import signal
import subprocess
import sys

import pytest

import helpers as H  # noqa: E402
from test_signals import _alive, _kill_session, _wait

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _spawn(args: list[str], tmp, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "qmigrate", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp)},
                            start_new_session=True, **kw)


def test_sigterm_to_bench_stops_its_roles_and_removes_its_temp_dirs(node_tmp, tiny_model_dir):
    tmp = node_tmp
    bench = _spawn(["bench", "--model", str(tiny_model_dir), "--paths", "pipeline", "--requests", "8",
                    "--output-len", "400:400"], tmp, stdin=subprocess.DEVNULL)
    try:
        assert _wait(lambda: any(d.name.startswith("qm-bench-") for d in tmp.iterdir())), "no run started"
        assert _wait(lambda: len(H.roles_of(bench)) >= 3), H.roles_of(bench)  # bench, router, a worker
        roles = [pid for pid in H.roles_of(bench).values() if pid != bench.pid]
        bench.send_signal(signal.SIGTERM)
        _, err = bench.communicate(timeout=60)
        assert bench.returncode == 128 + signal.SIGTERM, err
        assert "Traceback" not in err and "stopped by signal 15" in err, err
        assert _wait(lambda: not _alive(roles), 10), f"roles left running: {_alive(roles)}"
        assert list(tmp.iterdir()) == [], "the temp directory was left behind"
    finally:
        _kill_session(bench)


def test_ctrl_c_while_roles_import_prints_no_traceback(node_tmp, tiny_model_dir):
    tmp = node_tmp
    """Ctrl-C at a terminal reaches every process of the foreground group at once."""
    sim = _spawn(["sim", "--workers", "2", "--model", str(tiny_model_dir)], tmp, stdin=subprocess.PIPE)
    try:
        assert _wait(lambda: len(H.roles_of(sim)) >= 4), H.roles_of(sim)  # started, still importing
        assert any(d.name.startswith("qm-") for d in tmp.iterdir()), "the node's directory is not in TMPDIR"
        roles = [pid for pid in H.roles_of(sim).values() if pid != sim.pid]
        os.killpg(sim.pid, signal.SIGINT)  # the group: this test's own session
        _, err = sim.communicate(timeout=60)
        assert sim.returncode == 128 + signal.SIGINT, err
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        assert _wait(lambda: not _alive(roles), 10), f"roles left running: {_alive(roles)}"
        assert list(tmp.iterdir()) == [], "the temp directory was left behind"
    finally:
        _kill_session(sim)
