"""Signals and exit codes of the supervisor: SIGTERM at startup stops every role and removes
the temp directory; a supervisor killed by SIGKILL takes its roles with it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import yaml

from conftest import node_tmpdir, reserve_ports  # noqa: E402
import helpers as H

pytestmark = [pytest.mark.slow, pytest.mark.timeout(120)]


def _wait(predicate, timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] != "Z":
                    alive.append(pid)
        except OSError:
            pass
    return alive


def _kill_session(proc) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    for pid in H.roles_of(proc).values():  # roles left behind by a failed test
        os.kill(pid, signal.SIGKILL)


def _sigterm_during_startup(tmp_path, tiny_model_dir) -> None:
    """The test below, run beside other tests (conftest's `early` lane): a cold start is mostly
    one process importing, on one core."""
    with node_tmpdir() as tmp:
        sim = subprocess.Popen([sys.executable, "-m", "qmigrate", "sim", "--workers", "2",
                                "--model", str(tiny_model_dir)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                               stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp)},
                               start_new_session=True)
        try:
            # Roles started, workers still loading: the supervisor waits for the fleet.
            assert _wait(lambda: any(t.startswith("qmigrate worker") for t in H.roles_of(sim))), "no role started"
            assert any(d.name.startswith("qm-") for d in tmp.iterdir()), "the node's directory is not in TMPDIR"
            roles = list(H.roles_of(sim).values())
            sim.send_signal(signal.SIGTERM)
            _, err = sim.communicate(timeout=30)
            assert sim.returncode == 128 + signal.SIGTERM, err
            assert _wait(lambda: not _alive(roles), 10), f"roles left running: {_alive(roles)}"
            assert list(tmp.iterdir()) == [], "the temp directory was left behind"
        finally:
            _kill_session(sim)


@pytest.mark.early(scenario=_sigterm_during_startup, beside="test_real_model.py")
def test_sigterm_during_startup_stops_every_role_and_leaves_no_temp_dir(early_run):
    early_run.result()


def _supervisor_killed(tmp_path, tiny_model_dir) -> None:
    """A cold node (run beside in-process tests, on the core they leave idle)."""
    ports = reserve_ports(6)
    data = {"transport": "tcp", "model": {"path": str(tiny_model_dir)},
            "nodes": [{"name": "head", "address": "127.0.0.1", "bind": "127.0.0.1"}],
            "router": {"node": "head", "port": ports[0], "telemetry_port": ports[1]},
            "ingest": {"node": "head", "port": ports[2], "reply_port": ports[5]}, "detokenizer": {"node": "head", "port": ports[3]},
            "workers": [{"name": "w1", "node": "head", "kv_port": ports[4]}]}
    path = tmp_path / "topo.yaml"
    path.write_text(yaml.safe_dump(data))
    node = subprocess.Popen([sys.executable, "-m", "qmigrate", "node", str(path), "--node", "head"],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            env=dict(os.environ), start_new_session=True)
    try:
        assert _wait(lambda: len(H.roles_of(node)) >= 5), H.roles_of(node)  # the node and its 4 roles
        roles = [pid for pid in H.roles_of(node).values() if pid != node.pid]
        os.kill(node.pid, signal.SIGKILL)
        node.wait()
        assert _wait(lambda: not _alive(roles), 15), f"roles outlived their supervisor: {_alive(roles)}"
    finally:
        _kill_session(node)


@pytest.mark.early(scenario=_supervisor_killed, beside="test_moe.py")
def test_roles_exit_when_their_supervisor_is_killed(early_run):
    early_run.result()


def test_a_second_sigterm_does_not_cut_a_roles_clean_up_short(tmp_path):
    """A node stopping sends SIGTERM to its group and then to each role: what a role registered
    to run at SIGTERM finishes, and the role still ends by the signal."""
    done = tmp_path / "done"
    program = f"""
import os, signal, time
from qmigrate.ops.process import before_sigterm
def tidy():
    os.kill(os.getpid(), signal.SIGTERM)   # the second, while the first's clean-up runs
    time.sleep(0.3)
    open({str(done)!r}, "w").close()
before_sigterm(tidy)
print("ready", flush=True)
time.sleep(60)
"""
    proc = subprocess.Popen([sys.executable, "-c", program], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(30) == -signal.SIGTERM
        assert done.exists(), "the clean-up was cut short"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
