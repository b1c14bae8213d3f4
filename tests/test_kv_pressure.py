"""Moves for KV pressure end to end: a `qmigrate node` with two CPU workers, one with a KV pool
too small for the sequences it starts. Under policy pinned it preempts them: it evicts those
outside its step, or refuses rows of the step (they come back for their ids: resends); by
default they move to the other worker as the pool fills, and greedy output is unchanged."""

from __future__ import annotations

import json
import random
import re
import shutil
import tempfile
from pathlib import Path

import pytest
import yaml

import helpers as H
from conftest import greedy_tokens_many

pytestmark = pytest.mark.timeout(600)

POOL = 320   # w1's KV pool in tokens: 20 blocks of 16, three of the sequences below at their end
MAX_LEN = 128   # positions a sequence may have (a pool holds at least one such sequence)


def _topology(path, ipc_dir, model_dir, router: dict) -> str:
    """A node with w1 (a pool of POOL tokens, a batch of 8) and w2 (the CPU's default pool, a
    batch of 16); the router's address."""
    address = H.fleet_topology(path, model_dir, 2, ipc_dir=ipc_dir, router={"max_lease_steps": 1, **router},
                               worker={"max_num_seqs": 8, "max_model_len": MAX_LEN})
    data = yaml.safe_load(path.read_text())
    data["workers"][0]["max_kv_tokens"] = POOL
    data["workers"][1]["max_num_seqs"] = 16   # room in its batch for what w1 gives up
    path.write_text(yaml.safe_dump(data))
    return address


def _summary(stderr: str) -> dict[str, int]:
    line = re.search(r"resumed from shipped KV; migrations: (.*)", stderr)
    assert line, stderr[-2000:]
    counts = {k: int(v) for k, v in re.findall(r"(\w+) (\d+)", line.group(1))}
    counts["preempted"] = counts["evictions"] + counts["resends"]
    return counts


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    """Short prompts whose greedy outputs run long (the tiny model's EOS ends some early):
    w1 takes its share at once, and they outgrow its pool together as they grow."""
    r = random.Random(5)
    candidates = [{"id": f"k{i}", "prompt_ids": [1] + [r.randint(3, 1400) for _ in range(r.randint(2, 6))],
                   "max_new_tokens": 100} for i in range(40)]
    expected = greedy_tokens_many(tiny_model_dir, [(p["prompt_ids"], p["max_new_tokens"]) for p in candidates])
    chosen = [(p, e) for p, e in zip(candidates, expected) if len(e) == p["max_new_tokens"]][:16]
    assert len(chosen) >= 10, [len(e) for e in expected]
    return chosen


def _run(tmp_path, model_dir, prompts, **router) -> tuple[dict, dict]:
    """The prompts, once both workers have joined (a worker that joins late would find the
    other holding everything, which load balancing, not KV pressure, then evens out). Each
    run has a folder of its own: the node's output files are opened for appending, and a
    second run's summary must not be read from the first's."""
    ipc_dir = Path(tempfile.mkdtemp(prefix="qm-"))   # short: a socket path is at most 107 bytes
    run_dir = Path(tempfile.mkdtemp(prefix="run-", dir=tmp_path))
    path = run_dir / "topo.yaml"
    nodes = H.Nodes(run_dir)
    try:
        address = _topology(path, ipc_dir, model_dir, router)
        head = nodes.start(path, "head", keep_stdin=True)
        H.wait_for("both workers", lambda st: st.get("workers") == 2, address)
        head.stdin.write(H.jsonl([p for p, _ in prompts]))
        head.stdin.close()
        out, err = H.finish(head, address, timeout=400)
    finally:
        nodes.stop_all()
        shutil.rmtree(ipc_dir, ignore_errors=True)
    assert head.returncode == 0, err[-3000:]
    finals = {rec["id"]: rec for rec in map(json.loads, out.splitlines()) if rec.get("done")}
    assert sorted(finals) == sorted(p["id"] for p, _ in prompts)
    return finals, _summary(err)


def test_a_short_pool_moves_its_sequences_instead_of_evicting_them(tmp_path, tiny_model_dir, prompts):
    from conftest import greedy_reference
    check = greedy_reference(tiny_model_dir)
    _, pinned = _run(tmp_path, tiny_model_dir, prompts, policy="pinned")
    assert pinned["preempted"] > 0 and not pinned.get("kv"), pinned
    finals, moved = _run(tmp_path, tiny_model_dir, prompts, policy="affinity")
    print(f"pinned: {pinned}; affinity: {moved}")
    assert moved.get("kv", 0) > 0, moved
    assert moved["preempted"] < pinned["preempted"], (moved, pinned)
    for p, expected in prompts:
        got = finals[p["id"]]["token_ids"]
        check(p["prompt_ids"], p["max_new_tokens"], got, p["id"])
