"""A worker with a stolen key ships garbage KV (tests/rogue_worker.py: the real worker code,
its shipments replaced) to honest workers, which import it. Afterwards other clients send
the same prompts: every answer equals generate(), under either placement policy. Shipped KV
never joins a prefix cache (BlockPool.load), and the router, not the worker, prices a move."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
import yaml

import warm
from conftest import check_outputs, reserve_ports, stop_group
from helpers import Nodes, drain, feed_here, fleet_topology, pause, resume, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

HERE = Path(__file__).resolve().parent


def _prompts(prefix: str, n: int = 10) -> list[dict]:
    system = [1] + [(37 * k) % 1300 + 3 for k in range(40)]   # two full blocks and more, shared
    return [{"id": f"{prefix}{i}", "prompt_ids": system + [5 + i, 600 + 7 * i], "max_new_tokens": 10}
            for i in range(n)]


@pytest.mark.parametrize("policy", ["any", "affinity"])
def test_a_rogue_workers_kv_changes_no_other_clients_answer(tmp_path, tiny_model_dir, policy):
    path = tmp_path / "topology.yaml"
    router = fleet_topology(path, tiny_model_dir, 3, reserve_ports(8), late=3,
                            # the rogue is paused while the honest workers' node starts (seconds,
                            # when it starts cold): it must not be taken for dead meanwhile
                            router={"policy": policy, "migration": "transfer", "heartbeat_timeout_s": 120,
                                    "lease_timeout_s": 120},
                            worker={"max_seqs": 4})
    data = yaml.safe_load(path.read_text())   # w3 on a node of its own, which only the rogue plays
    data["nodes"].append({"name": "rogue", "address": "127.0.0.1", "bind": "127.0.0.1"})
    data["workers"][2]["node"] = "rogue"
    path.write_text(yaml.safe_dump(data))
    nodes = Nodes(tmp_path)
    err = open(tmp_path / "rogue.err", "a+")
    rogue = warm.popen_python([str(HERE / "rogue_worker.py"), str(path), "w3"], stdin=subprocess.DEVNULL,
                              stdout=subprocess.DEVNULL, stderr=err, start_new_session=True)
    try:
        head = nodes.start(path, "head")
        # The rogue first holds every sequence, paused before it has run one: the honest
        # workers join, and they take the sequences over with the rogue's KV (its drain moves
        # them under affinity; under "any" they move at every step)
        wait_for("the rogue to ask for work", lambda s: s.get("asking_w3", 0) > 0, router, timeout=150)
        pause(rogue.pid)
        try:
            first = _prompts("a")
            feed_here(path, first)
            wait_for("a lease to the rogue", lambda s: s.get("leased_w3", 0) > 0, router)
            nodes.start(path, "late")   # w1 and w2
            wait_for("three workers", lambda s: s.get("workers", 0) == 3, router, timeout=150)
            if policy == "affinity":
                drain(router, "w3")
        finally:
            resume(rogue.pid)
        _wait_done(head, {p["id"] for p in first})
        got = wait_for("imports", lambda s: s.get("kv_imported", 0) > 0, router, timeout=10)
        assert got.get("kv_imported_w1", 0) + got.get("kv_imported_w2", 0) > 0, got
        if policy == "any":
            drain(router, "w3")
        if rogue.poll() is None:   # a drained rogue ends on its own
            with contextlib.suppress(ProcessLookupError):   # just ended (started warm, none waits for it here)
                os.killpg(rogue.pid, signal.SIGKILL)
        rogue.wait(30)
        second = _prompts("b")   # other clients, the same prompts
        feed_here(path, second)
        records = _wait_done(head, {p["id"] for p in second})
        check_outputs("\n".join(r for r in records if json.loads(r)["id"].startswith("b")), second, tiny_model_dir)
    finally:
        if rogue.poll() is None:
            resume(rogue.pid)
        stop_group(rogue)
        nodes.stop_all()
        err.close()


def _wait_done(head, ids: set[str], timeout_s: float = 150) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        head.out.seek(0)
        lines = [line for line in head.out.read().splitlines() if line.strip()]
        if ids <= {json.loads(line)["id"] for line in lines if json.loads(line).get("done")}:
            return lines
        assert head.poll() is None, "the head node died"
        time.sleep(0.2)
    pytest.fail(f"not every request of {sorted(ids)[:3]}... finished")
