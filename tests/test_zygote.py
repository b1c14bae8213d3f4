"""The zygote a node forks its CPU workers from (qmigrate/ops/zygote.py), on its own: what a
forked role is, how its end is told, and what happens when the zygote itself dies."""

from __future__ import annotations

import os
import signal
import time

import pytest
import yaml

import helpers as H
from qmigrate.launch import _spawn
from qmigrate.ops.zygote import Zygote

pytestmark = pytest.mark.timeout(240)


def _gone(pid: int, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if H._state(pid) in ("", "Z"):
            return True
        time.sleep(0.05)
    return False


def _ignored(pid: int) -> int:
    with open(f"/proc/{pid}/status") as f:
        return int(next(line for line in f if line.startswith("SigIgn:")).split()[1], 16)


def _roles_and_their_zygote(tmp_path, tiny_model_dir) -> None:
    """A zygote's forks exit as processes do, and die with it (cold: two zygotes import
    everything; run beside in-process tests, on the core they leave idle)."""
    import shutil
    import tempfile
    ipc_dir = tempfile.mkdtemp(prefix="qm-")   # short: an ipc:// socket path is at most 107 bytes
    try:
        _forked_roles(tmp_path, ipc_dir, tiny_model_dir)
    finally:
        shutil.rmtree(ipc_dir, ignore_errors=True)


def _forked_roles(tmp_path, ipc_dir, tiny_model_dir) -> None:
    # a worker whose router never answers: it loads its model and keeps saying hello
    topo = tmp_path / "topo.yaml"
    topo.write_text(yaml.safe_dump({
        "transport": "ipc", "ipc_dir": str(ipc_dir), "model": {"path": str(tiny_model_dir)},
        "nodes": [{"name": "local"}], "router": {"node": "local"}, "ingest": {"node": "local"},
        "detokenizer": {"node": "local"}, "workers": [{"name": "w1", "node": "local", "device": "cpu"}]}))
    zygote = Zygote(_spawn)
    try:
        assert zygote.fork(["--version"]).wait(120) == 0
        assert zygote.fork(["role", "no-such-role", "x", "--config", str(topo)]).wait(60) == 2   # a usage error
        worker = zygote.fork(["role", "worker", "w1", "--config", str(topo)])
        assert worker.poll() is None
        first = zygote.proc.pid
        assert H.parent_of(worker.pid) == first and H.parent_of(first) == os.getpid()
        deadline = time.monotonic() + 60
        while H._title(worker.pid) != "qmigrate worker w1":
            assert time.monotonic() < deadline, H._title(worker.pid)
            time.sleep(0.05)
        assert _ignored(worker.pid) & (1 << (signal.SIGINT - 1)), "Ctrl-C is the node's to handle"
        assert not _ignored(worker.pid) & (1 << (signal.SIGTERM - 1))

        os.kill(first, signal.SIGKILL)   # the worker goes with its zygote
        assert worker.wait(30) == -signal.SIGTERM
        assert _gone(worker.pid), "a forked role outlived its zygote"

        again = zygote.fork(["--version"])   # a new zygote, as a node's restart of a worker needs
        assert zygote.proc.pid != first and again.wait(120) == 0
    finally:
        zygote.close()


@pytest.mark.early(scenario=_roles_and_their_zygote, beside="test_paged_attention.py")
def test_forked_roles_exit_as_processes_do_and_die_with_their_zygote(early_run):
    early_run.result()   # raises what the scenario's checks raised


def test_a_node_that_holds_the_imports_forks_its_zygote_and_every_core_role(tiny_model_dir):
    """A node forked from a process that made the roles' imports (tests/warm.py) does not import
    them again: its zygote is a fork of the node, and forks the router and the ingest that reads
    the node's stdin as well as the workers and the detokenizer."""
    import subprocess

    import warm
    if os.environ.get("QMIGRATE_TEST_COLD"):
        pytest.skip("QMIGRATE_TEST_COLD: every node starts cold")
    node = warm.popen(["sim", "--workers", "2", "--model", str(tiny_model_dir), "--max-new-tokens", "4"],
                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                      start_new_session=True)
    try:
        assert isinstance(node, warm.WarmProcess)
        titles = ("qmigrate router", "qmigrate ingest", "qmigrate detokenizer", "qmigrate worker w1",
                  "qmigrate worker w2")
        deadline = time.monotonic() + 60
        while not all(H.pid_of(node, t) for t in titles):
            assert time.monotonic() < deadline and node.poll() is None, H.roles_of(node)
            time.sleep(0.05)
        zygote = H.pid_of(node, "qmigrate zygote")
        assert zygote and H.parent_of(zygote) == node.pid, H.roles_of(node)
        for title in titles:
            assert H.parent_of(H.pid_of(node, title)) == zygote, (title, H.roles_of(node))
        assert os.readlink(f"/proc/{zygote}/fd/0") == os.devnull
        assert os.readlink(f"/proc/{H.pid_of(node, 'qmigrate ingest')}/fd/0") == os.readlink(f"/proc/{node.pid}/fd/0")
        out, err = node.communicate("Hello\nName three colours.\n", timeout=120)
        assert node.returncode == 0, err[-3000:]
        assert "[1]" in out and "[2]" in out, out
        assert "2 sequences finished" in err
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait(30)
