"""Moves for KV pressure end to end: `qmigrate sim` on two CPU workers, one with a KV pool
too small for the sequences it starts. Under policy pinned it preempts them: it evicts those
outside its step, or refuses rows of the step (they come back for their ids: resends); by
default they move to the other worker as the pool fills, and greedy output is unchanged."""

from __future__ import annotations

import json
import random
import re

import pytest
import yaml

from conftest import greedy_tokens_many, run_qmigrate

pytestmark = pytest.mark.timeout(600)

POOL = 320   # w1's KV pool in tokens: 20 blocks of 16, three of the sequences below at their end
MAX_LEN = 128   # positions a sequence may have (a pool holds at least one such sequence)


def _topology(tmp_path, model_dir, policy: str) -> str:
    data = {
        "transport": "ipc",
        "model": {"path": str(model_dir)},
        "nodes": [{"name": "local"}],
        "router": {"node": "local", "policy": policy, "max_lease_steps": 1},
        "ingest": {"node": "local", "input": "jsonl"},
        "detokenizer": {"node": "local", "output": "jsonl"},
        "workers": [{"name": "w1", "node": "local", "device": "cpu", "max_num_seqs": 8, "max_kv_tokens": POOL,
                     "max_model_len": MAX_LEN},
                    {"name": "w2", "node": "local", "device": "cpu", "max_num_seqs": 8, "max_model_len": MAX_LEN}],
    }
    path = tmp_path / f"topo-{policy}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _summary(stderr: str) -> dict[str, int]:
    line = re.search(r"resumed from shipped KV; migrations: (.*)", stderr)
    assert line, stderr[-2000:]
    counts = {k: int(v) for k, v in re.findall(r"(\w+) (\d+)", line.group(1))}
    counts["preempted"] = counts["evictions"] + counts["resends"]
    return counts


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    """Prompts whose greedy outputs run long (the tiny model's EOS ends some early): eight
    of them outgrow w1's pool together, and fit the two pools."""
    r = random.Random(5)
    candidates = [{"id": f"k{i}", "prompt_ids": [1] + [r.randint(3, 1400) for _ in range(r.randint(12, 30))],
                   "max_new_tokens": 72} for i in range(40)]
    expected = greedy_tokens_many(tiny_model_dir, [(p["prompt_ids"], p["max_new_tokens"]) for p in candidates])
    chosen = [(p, e) for p, e in zip(candidates, expected) if len(e) == p["max_new_tokens"]][:16]
    assert len(chosen) >= 10, [len(e) for e in expected]
    return chosen


def _run(tmp_path, model_dir, policy: str, prompts) -> tuple[dict, dict]:
    stdin = "".join(json.dumps(p) + "\n" for p, _ in prompts)
    run = run_qmigrate("sim", _topology(tmp_path, model_dir, policy), stdin=stdin, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    finals = {rec["id"]: rec for rec in map(json.loads, run.stdout.splitlines()) if rec.get("done")}
    return finals, _summary(run.stderr)


def test_a_short_pool_moves_its_sequences_instead_of_evicting_them(tmp_path, tiny_model_dir, prompts):
    from conftest import greedy_reference
    check = greedy_reference(tiny_model_dir)
    _, pinned = _run(tmp_path, tiny_model_dir, "pinned", prompts)
    assert pinned["preempted"] > 0 and not pinned.get("kv"), pinned
    finals, moved = _run(tmp_path, tiny_model_dir, "affinity", prompts)
    print(f"pinned: {pinned}; affinity: {moved}")
    assert moved.get("kv", 0) > 0, moved
    assert moved["preempted"] < pinned["preempted"], (moved, pinned)
    for p, expected in prompts:
        got = finals[p["id"]]["token_ids"]
        check(p["prompt_ids"], p["max_new_tokens"], got, p["id"])
