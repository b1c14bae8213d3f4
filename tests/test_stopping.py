"""Stopping cleanly: SIGTERM to `qmigrate bench` leaves no temp directory and no role behind;
Ctrl-C in the first seconds of a run prints no traceback from roles still importing; HTTP
streams cut by a shutdown end with an error event and `data: [DONE]`."""

from __future__ import annotations

import http.client
import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from conftest import reserve_ports  # noqa: E402
import helpers as H  # noqa: E402
from test_signals import _alive, _kill_session, _wait

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def _spawn(args: list[str], tmp, **kw) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "qmigrate", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "TMPDIR": str(tmp)},
                            start_new_session=True, **kw)


def test_sigterm_to_bench_stops_its_roles_and_removes_its_temp_dirs(tmp_path, tiny_model_dir):
    tmp = tmp_path / "tmp"
    tmp.mkdir()
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


def test_ctrl_c_while_roles_import_prints_no_traceback(tmp_path, tiny_model_dir):
    """Ctrl-C at a terminal reaches every process of the foreground group at once."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    sim = _spawn(["sim", "--workers", "2", "--model", str(tiny_model_dir)], tmp, stdin=subprocess.PIPE)
    try:
        assert _wait(lambda: len(H.roles_of(sim)) >= 4), H.roles_of(sim)  # started, still importing
        roles = [pid for pid in H.roles_of(sim).values() if pid != sim.pid]
        os.killpg(sim.pid, signal.SIGINT)  # the group: this test's own session
        _, err = sim.communicate(timeout=60)
        assert sim.returncode == 128 + signal.SIGINT, err
        assert "Traceback" not in err and "KeyboardInterrupt" not in err, err
        assert _wait(lambda: not _alive(roles), 10), f"roles left running: {_alive(roles)}"
        assert list(tmp.iterdir()) == [], "the temp directory was left behind"
    finally:
        _kill_session(sim)


def _stream(port: int, results: list, started: threading.Event) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    body = {"model": "tiny", "prompt": [5, 6, 7], "max_tokens": 500, "ignore_eos": True, "stream": True}
    conn.request("POST", "/v1/completions", json.dumps(body), {"Content-Type": "application/json"})
    resp = conn.getresponse()
    events = [resp.readline()]
    started.set()
    events += resp.read().split(b"\n")
    conn.close()
    results.append([e for e in events if e.startswith(b"data: ")])


def test_sigterm_to_serve_ends_open_streams_with_an_error_event_and_done(tmp_path, tiny_model_dir):
    (port,) = reserve_ports(1)
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    serve = _spawn(["serve", str(tiny_model_dir), "--port", str(port), "--cpu-workers", "1",
                    "--served-model-name", "tiny"], tmp, stdin=subprocess.DEVNULL)
    try:
        assert serve.stdout.readline().startswith("ready: ")
        results: list = []
        started = [threading.Event() for _ in range(16)]  # 8,000 tokens: they are still running
        clients = [threading.Thread(target=_stream, args=(port, results, e)) for e in started]
        for c in clients:
            c.start()
        assert all(e.wait(60) for e in started)
        serve.send_signal(signal.SIGTERM)
        for c in clients:
            c.join(60)
        _, err = serve.communicate(timeout=60)
        assert "Traceback" not in err, err
        assert len(results) == 16 and all(r[-1] == b"data: [DONE]" for r in results), results
        cut = [json.loads(r[-2].removeprefix(b"data: ")) for r in results if b'"error"' in r[-2]]
        assert cut and all(e["error"]["code"] == "shutdown" for e in cut)
    finally:
        _kill_session(serve)
