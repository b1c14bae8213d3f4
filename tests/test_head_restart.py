"""The head node (router, ingest, detokenizer) stopped and started again while a worker node
runs on: the worker says hello to the new router and serves it, and its node never restarts
it. Two real `qmigrate node` processes on loopback TCP, as services fed by `qmigrate feed`.
The run is in a thread beside the in-process tests of test_engine (conftest's `early` marker)."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest
import yaml

from conftest import check_outputs, reserve_ports, stop_group
import helpers as H
import warm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _wait(what: str, predicate, timeout: float = 120.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := predicate()):
            return got
        time.sleep(0.1)
    pytest.fail(f"timed out waiting for {what}")


def _restarted_head(tmp_path, tiny_model_dir) -> list[tuple[str, list[dict]]]:
    """The run: each head's output with the prompts fed to it, for the test to check against
    generate()."""
    ports = reserve_ports(6)
    path = tmp_path / "topo.yaml"
    path.write_text(yaml.safe_dump({
        "transport": "tcp", "model": {"path": str(tiny_model_dir)},
        "nodes": [{"name": "head", "address": "127.0.0.1", "bind": "127.0.0.1"},
                  {"name": "gpu", "address": "127.0.0.1", "bind": "127.0.0.1"}],
        "router": {"node": "head", "port": ports[0], "telemetry_port": ports[1], "heartbeat_interval_s": 0.2},
        "ingest": {"node": "head", "port": ports[2], "reply_port": ports[5], "input": "jsonl"},
        "detokenizer": {"node": "head", "port": ports[3], "output": "jsonl"},
        "workers": [{"name": "w1", "node": "gpu", "device": "cpu", "kv_port": ports[4]}],
    }))
    router = f"tcp://127.0.0.1:{ports[0]}"
    procs: list[subprocess.Popen] = []

    def start(node: str, run: int) -> subprocess.Popen:
        # Append mode: the test reads with seek(), which must not move where the node writes.
        out, err = open(tmp_path / f"{node}{run}.out", "a+"), open(tmp_path / f"{node}{run}.err", "a+")
        proc = warm.popen(["node", str(path), "--node", node],
                          stdin=subprocess.DEVNULL, stdout=out, stderr=err, start_new_session=True)
        proc.out, proc.err = out, err
        procs.append(proc)
        return proc

    try:
        gpu = start("gpu", 1)
        head = start("head", 1)
        _wait("w1 to join", lambda: H.stats(router).get("workers") == 1)
        worker = H.pid_of(gpu, "qmigrate worker w1")
        first = H.prompts(21, "a", n=4, new_tokens=20)
        H.feed(path, first)
        outputs = [(H.wait_for_output(head, len(first)), first)]

        os.killpg(head.pid, signal.SIGTERM)  # the whole head node stops, as an operator's restart does
        head.wait(30)
        assert H.stats(router) == {}, "the old router still answers"
        head = start("head", 2)
        _wait("w1 to join the new router", lambda: H.stats(router).get("workers") == 1)
        second = H.prompts(22, "b", n=4, new_tokens=20)
        H.feed(path, second)
        outputs.append((H.wait_for_output(head, len(second)), second))

        assert gpu.poll() is None, "the worker node exited"
        assert H.pid_of(gpu, "qmigrate worker w1") == worker, "the worker was restarted instead of rejoining"
        gpu.err.seek(0)
        assert "Traceback" not in gpu.err.read()
        return outputs
    finally:
        for proc in procs:
            stop_group(proc)


@pytest.mark.early(scenario=_restarted_head, beside="test_engine.py")
def test_a_restarted_head_node_is_rejoined_by_the_running_workers(early_run, tiny_model_dir):
    for out, prompts in early_run.result():
        check_outputs(out, prompts, tiny_model_dir)
