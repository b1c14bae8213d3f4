"""What an operator sees and steers, end to end: simulated monitor reports drive admission and
migration while Prometheus metrics and `qmigrate status` follow the fleet."""

from __future__ import annotations

import json
import random
import re
import subprocess
import threading
import time
import urllib.request

import pytest
import yaml
from typer.testing import CliRunner

import warm

from qmigrate.cli import app
from conftest import reserve_ports, stop_group

pytestmark = pytest.mark.timeout(300)


def _scrape(port: int) -> dict[str, float]:
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    return {m.group(1): float(m.group(2)) for m in re.finditer(r"^(qmigrate_\S+) (\S+)$", text, re.M)}


def _metric(port: int, name: str, value: float):
    """A check for _wait_for: the scraped metrics once `name` has reached `value`."""
    def check():
        check.last = _scrape(port)
        return check.last.get(name) == value and check.last
    return check


class FakeMonitor:
    """Publishes VramReports for the CPU workers' pseudo-GPUs ("CPU-<worker>"), as a node's
    monitor publishes NVML readings: repeatedly, since PUB drops what is sent before a connect."""

    TOTAL = 8 << 30

    def __init__(self, endpoint: str):
        import zmq
        self.sock = zmq.Context.instance().socket(zmq.PUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self.free = {"CPU-w1": 0.06, "CPU-w2": 0.5}   # w1 below the admission watermark
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self.run, daemon=True)
        self.thread.start()

    def run(self) -> None:
        from qmigrate.wire import protocol as P
        from qmigrate.wire import codec
        while not self.stop.is_set():
            gpus = [[uuid, i, self.TOTAL, self.TOTAL - int(f * self.TOTAL), int(f * self.TOTAL), 0]
                    for i, (uuid, f) in enumerate(sorted(self.free.items()))]
            self.sock.send(codec.encode(P.VramReport("local", gpus)))
            self.stop.wait(0.05)

    def close(self) -> None:
        self.stop.set()
        self.thread.join()
        self.sock.close()


@pytest.fixture
def node(tmp_path, tiny_model_dir):
    """A one-node fleet of two CPU workers reading prompts from a pipe; stopped afterwards."""
    router_metrics, detok_metrics = reserve_ports(2)
    topo = {"transport": "ipc", "ipc_dir": str(tmp_path / "ipc"), "model": {"path": str(tiny_model_dir)},
            "nodes": [{"name": "local"}],
            "router": {"node": "local", "metrics_port": router_metrics, "migration": "recompute",
                       "migrate_on_load": False, "min_free_vram_fraction": 0.05, "admit_free_vram_fraction": 0.07},
            "ingest": {"node": "local", "input": "jsonl"},
            "detokenizer": {"node": "local", "output": "jsonl", "metrics_port": detok_metrics},
            # w2 steps two sequences at a time, so some wait for it in the queue
            "workers": [{"name": "w1", "node": "local", "max_num_seqs": 8}, {"name": "w2", "node": "local", "max_num_seqs": 2}]}
    path = tmp_path / "topo.yaml"
    path.write_text(yaml.safe_dump(topo))
    proc = warm.popen(["node", str(path), "--node", "local", "--stdin"],
                      stdin=subprocess.PIPE, stdout=(tmp_path / "out.jsonl").open("w"),
                      stderr=(tmp_path / "err.txt").open("w"), text=True,
                      start_new_session=True)
    # output goes to files: a pipe nobody reads until the end would block the detokenizer
    proc.out_path, proc.err_path = tmp_path / "out.jsonl", tmp_path / "err.txt"
    yield proc, path, router_metrics, detok_metrics
    stop_group(proc)


def _wait_for(what: str, check, proc, timeout_s: float = 60.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            pytest.fail(f"the node exited ({proc.returncode}) while waiting for {what}: {proc.err_path.read_text()[-3000:]}")
        if (got := check()):
            return got
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}; last seen: {getattr(check, 'last', None)}")


@pytest.mark.slow
def test_memory_reports_steer_work_and_operators_see_it(node, tiny_model_dir):
    from conftest import greedy_reference, greedy_tokens_many
    from qmigrate.config import load_topology
    from qmigrate.ops.status import fetch
    from qmigrate.wire.transport import Unreachable
    proc, path, router_port, detok_port = node
    topo = load_topology(path)
    router = topo.endpoint("router").connect
    monitor = FakeMonitor(topo.endpoint("telemetry").connect)
    try:
        def workers():
            try:
                snap = fetch(router, 1.0)
            except Unreachable as exc:  # the router is still starting
                workers.last = exc
                return None
            workers.last = snap
            by_name = {w["name"]: w for w in snap["workers"]}
            return (snap, by_name) if len(by_name) == 2 and all(
                w["vram_free_fraction"] >= 0 for w in by_name.values()) else None
        _wait_for("both workers and their memory reports", workers, proc, timeout_s=180)
        before = _scrape(router_port)

        r = random.Random(3)
        prompts = [{"id": f"p{i}", "prompt_ids": [1] + [r.randint(3, 1400) for _ in range(r.randint(2, 20))],
                    "max_new_tokens": 240} for i in range(4)]
        proc.stdin.write("".join(json.dumps(p) + "\n" for p in prompts))
        proc.stdin.flush()
        # w1 is below the admission watermark: it takes nothing, though work waits for w2.
        snap, by_name = _wait_for("w2 to run some", lambda: (got := workers()) and
                                  got[1]["w2"]["owned"] > 0 and got, proc)
        assert by_name["w1"]["tokens_total"] == 0 and by_name["w1"]["state"] == "no-prefill"
        assert snap["router"]["queued"] + snap["router"]["open_leases"] > 0
        assert snap["router"].get("finished", 0) < len(prompts) - 2, "too fast to see migration"

        monitor.free = {"CPU-w1": 0.5, "CPU-w2": 0.01}   # now w2 runs short: its work moves to w1
        _wait_for("every request to finish", lambda: (got := workers()) and
                  got[0]["router"].get("finished") == len(prompts), proc)
        # the router refreshes its metrics once a second; the detokenizer prints a moment later
        after = _wait_for("the router's metrics", _metric(router_port, "qmigrate_requests_finished_total",
                                                          len(prompts)), proc)
        latency = _wait_for("the latency metrics", _metric(detok_port, "qmigrate_e2e_request_latency_seconds_count",
                                                           len(prompts)), proc)
        status = CliRunner().invoke(app, ["status", str(path), "--json"])
        proc.communicate(timeout=90)
        out, err = proc.out_path.read_text(), proc.err_path.read_text()
        assert proc.returncode == 0, err[-3000:]
    finally:
        monitor.close()

    finals = {rec["id"]: rec for rec in map(json.loads, out.splitlines()) if rec.get("done")}
    assert sorted(finals) == sorted(p["id"] for p in prompts)
    greedy_tokens_many(tiny_model_dir, [(p["prompt_ids"], p["max_new_tokens"]) for p in prompts])
    check = greedy_reference(tiny_model_dir)
    for p in prompts:
        check(p["prompt_ids"], p["max_new_tokens"], finals[p["id"]]["token_ids"], p["id"])
    assert re.search(r"migrations: .*memory \d+", err), err[-2000:]
    assert "Traceback" not in err

    moved = after['qmigrate_migrations_total{cause="memory"}']
    assert moved > 0 and before.get('qmigrate_migrations_total{cause="memory"}', 0) == 0
    assert after['qmigrate_generated_tokens_total{worker="w1"}'] > 0
    assert after['qmigrate_generated_tokens_total{worker="w2"}'] > 0
    assert before["qmigrate_requests_finished_total"] == 0
    assert after['qmigrate_gpu_memory_free_bytes{gpu="CPU-w2",node="local"}'] < FakeMonitor.TOTAL * 0.02
    assert after["qmigrate_queue_depth"] == 0 and after["qmigrate_sequences_live"] == 0
    assert latency["qmigrate_time_to_first_token_seconds_count"] == len(prompts)
    assert latency["qmigrate_e2e_request_latency_seconds_sum"] > latency["qmigrate_time_to_first_token_seconds_sum"]
    assert latency["qmigrate_time_per_output_token_seconds_count"] == len(prompts)

    assert status.exit_code == 0, status.output
    snap = json.loads(status.output)
    assert {w["name"]: w["state"] for w in snap["workers"]} == {"w1": "up", "w2": "memory-short"}
    assert snap["router"]["migrations_memory"] == moved
    assert sorted(g["uuid"] for g in snap["gpus"]) == ["CPU-w1", "CPU-w2"]
