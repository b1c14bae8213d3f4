"""Roles killed, frozen and restarted mid-run: every accepted request completes with its
no-fault tokens, and every token prints once. A real `qmigrate node --stdin` on loopback TCP
with journals in the test's directory; victims are found among the node's own processes."""

from __future__ import annotations

import collections
import json
import os
import re
import signal
import subprocess
import time

import pytest
import yaml

from conftest import reserve_ports  # noqa: E402
import helpers as H
import warm

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


def _topology(tmp_path, model_dir, ports) -> dict:
    return {
        "transport": "tcp", "model": {"path": str(model_dir)},
        "nodes": [{"name": "head", "address": "127.0.0.1", "bind": "127.0.0.1", "max_restarts": 2}],
        "router": {"node": "head", "port": ports[0], "telemetry_port": ports[1], "heartbeat_interval_s": 0.2,
                   "heartbeat_timeout_s": 1.5, "lease_timeout_s": 3.0, "journal": str(tmp_path / "router.journal")},
        "ingest": {"node": "head", "port": ports[2], "reply_port": ports[6], "input": "jsonl"},
        "detokenizer": {"node": "head", "port": ports[3], "output": "jsonl",
                        "journal": str(tmp_path / "detok.journal")},
        # One sequence a worker: the run lasts long enough for every fault, and a worker
        # always holds a sequence while more wait.
        "workers": [{"name": f"w{i}", "node": "head", "device": "cpu", "kv_port": ports[3 + i], "max_num_seqs": 1}
                    for i in (1, 2)],
    }


def _wait(what: str, predicate, timeout: float = 120.0, err=None):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if (got := predicate()):
            return got
        time.sleep(0.05)
    detail = ""
    if err is not None:
        err.seek(0)
        detail = err.read()[-3000:]
    pytest.fail(f"timed out waiting for {what}\n{detail}")


def _holds_work(router: str, name: str) -> bool:
    from qmigrate.ops.status import fetch
    from qmigrate.wire.transport import Unreachable
    try:
        workers = fetch(router, 1.0)["workers"]
    except Unreachable:
        return False
    return any(w["name"] == name and w["state"] == "up" and (w["owned"] or w["leased"]) for w in workers)


def _freeze_while_holding(router: str, node, names: tuple[str, ...], err) -> tuple[str, int]:
    """SIGSTOP a worker of `names` while the router counts a sequence on it, checked after the
    stop: a reply the worker sent just before it stopped may still have been on its way, and a
    worker frozen idle lets the others end the run before the router notices anything. Which
    worker holds work is the router's choice (a few requests may all fit one worker's batch),
    so the one frozen is whichever holds some. Returns its name and pid."""
    for _ in range(10):
        name = _wait("a worker to hold a sequence",
                     lambda: next((n for n in names if _holds_work(router, n)), None), err=err)
        pid = H.pid_of(node, f"qmigrate worker {name}")
        H.pause(pid)
        time.sleep(0.3)
        if _holds_work(router, name):
            return name, pid
        H.resume(pid)
    pytest.fail("no worker was frozen while holding a sequence")


def _restarts(tmp_path, tiny_model_dir) -> None:
    """The test below, run beside other tests (conftest's `early` lane): one node of two CPU
    workers, mostly waiting out a heartbeat timeout and restarts."""
    from conftest import greedy_reference, greedy_tokens_many
    ports = reserve_ports(7)
    path = tmp_path / "topo.yaml"
    path.write_text(yaml.safe_dump(_topology(tmp_path, tiny_model_dir, ports)))
    router = f"tcp://127.0.0.1:{ports[0]}"
    prompts = H.prompts(5, "r", n=8, new_tokens=450)  # fits 512 positions
    # Append mode: the test reads with seek(), which must not move where the node writes.
    out, err = open(tmp_path / "out", "a+"), open(tmp_path / "err", "a+")
    node = warm.popen(["node", str(path), "--node", "head", "--stdin"],
                      stdin=subprocess.PIPE, stdout=out, stderr=err, text=True, start_new_session=True)

    def feed(batch: list[dict]) -> None:
        node.stdin.write("".join(json.dumps(p) + "\n" for p in batch))
        node.stdin.flush()

    def printed() -> str:
        out.seek(0)
        return out.read()

    def stderr() -> str:
        err.seek(0)
        return err.read()

    def streaming() -> bool:
        """A request has printed three tokens and is not done: hundreds of tokens remain to it."""
        complete = printed().rpartition("\n")[0]  # a line being written is not read yet
        records = [json.loads(line) for line in complete.splitlines()]
        done = {r["id"] for r in records if r["done"]}
        deltas = collections.Counter(r["id"] for r in records if not r["done"])
        return any(n >= 3 and rid not in done for rid, n in deltas.items())

    # Each fault comes while the run provably has work: the prompts arrive in four parts on the
    # node's open stdin, and a loaded machine cannot end the run between a check and a fault.
    try:
        feed(prompts[:2])
        _wait("output to start", streaming, err=err)
        os.kill(H.pid_of(node, "qmigrate router"), signal.SIGKILL)
        feed(prompts[2:4])  # while the router is down: ingest keeps them until it is back
        _wait("the router to be started again", lambda: "router exited with status -9; starting" in stderr())
        _wait("both workers to rejoin the new router", lambda: H.stats(router).get("workers") == 2)
        recovered = re.search(r"recovered (\d+) unfinished requests", stderr())
        assert recovered and int(recovered[1]) > 0, "nothing was under way at the kill; the test proves nothing"

        feed(prompts[4:6])
        frozen, pid = _freeze_while_holding(router, node, ("w1", "w2"), err)
        try:  # the router's log, not its stats: those go when the run ends
            _wait("the router to notice the frozen worker",
                  lambda: f"worker {frozen} lost: silent for" in stderr(), err=err)
        finally:
            H.resume(pid)
        _wait("the frozen worker to rejoin", lambda: H.stats(router).get("workers") == 2)

        feed(prompts[6:])  # just fed, 450 tokens each: they are still to be printed at the kill
        os.kill(H.pid_of(node, "qmigrate detokenizer"), signal.SIGKILL)
        _wait("the detokenizer to be started again", lambda: "detokenizer exited with status -9; starting" in stderr())
        node.stdin.close()
        node.wait(timeout=180)
    finally:
        if node.poll() is None:
            os.killpg(node.pid, signal.SIGKILL)
            node.wait()
    assert node.returncode == 0, stderr()[-3000:]
    assert not [t for t in H.roles_of(node).values()], "a role outlived its node"
    finals, deltas = {}, {}
    for line in printed().splitlines():
        record = json.loads(line)
        if record["done"]:
            assert record["id"] not in finals, f"{record['id']} finished twice"
            finals[record["id"]] = record
        else:
            deltas[record["id"]] = deltas.get(record["id"], "") + record["delta"]
    assert sorted(finals) == sorted(p["id"] for p in prompts)
    for rid, final in finals.items():
        assert deltas.get(rid, "") == final["text"], f"{rid}: a delta printed twice or lost"
    greedy_tokens_many(tiny_model_dir, [(p["prompt_ids"], p["max_new_tokens"]) for p in prompts])
    check = greedy_reference(tiny_model_dir)
    for p in prompts:
        check(p["prompt_ids"], p["max_new_tokens"], finals[p["id"]]["token_ids"], p["id"])


@pytest.mark.early(scenario=_restarts, beside="test_http_fronts.py")
def test_router_detokenizer_and_worker_restarts_lose_nothing(early_run):
    early_run.result()


def test_a_killed_stdin_ingest_stops_the_node_and_says_what_is_lost(tmp_path, tiny_model_dir):
    """An ingest that reads the node's stdin is not started again (the input it read is gone
    with it): the node stops with status 1, naming it; what was printed before is printed
    once, and every request not yet printed is lost (docs/reliability.md, Limits)."""
    ports = reserve_ports(7)
    path = tmp_path / "topo.yaml"
    path.write_text(yaml.safe_dump(_topology(tmp_path, tiny_model_dir, ports)))
    router = f"tcp://127.0.0.1:{ports[0]}"
    prompts = H.prompts(7, "k", n=12, new_tokens=300)
    out, err = open(tmp_path / "out", "a+"), open(tmp_path / "err", "a+")
    node = warm.popen(["node", str(path), "--node", "head", "--stdin"],
                      stdin=subprocess.PIPE, stdout=out, stderr=err, text=True, start_new_session=True)
    try:
        node.stdin.write("".join(json.dumps(p) + "\n" for p in prompts))
        node.stdin.flush()   # left open: ingest is still reading when it is killed
        H.wait_for("accepted requests under way", lambda s: s.get("leased_rows", 0) > 0, router, timeout=150)
        os.kill(H.pid_of(node, "qmigrate ingest"), signal.SIGKILL)
        assert node.wait(timeout=60) == 1
    finally:
        if node.stdin and not node.stdin.closed:
            node.stdin.close()
        from conftest import stop_group
        stop_group(node)
    err.seek(0)
    assert "ingest exited with status -9; stopping the node" in err.read()
    out.seek(0)
    finals = [json.loads(line)["id"] for line in out.read().splitlines() if line.strip() and json.loads(line).get("done")]
    assert len(finals) == len(set(finals)) < len(prompts)   # once each, and the rest lost
