"""Tensor parallelism on the CPU (gloo): layouts, a sharded engine against one rank, KV moves
between world sizes, and a migration between a 2-rank worker and a 1-rank worker."""

from __future__ import annotations

import json
import multiprocessing as mp
import random
import re

import pytest
import torch
import yaml

from qmigrate.engine import parallel
from qmigrate.engine.parallel import LayoutError, check_layout

import tp_ranks

# --- layouts -------------------------------------------------------------------------------


def test_kv_heads_split_or_replicated():
    four = check_layout(4, 8, 4, 64)
    assert [four.kv_heads(r) for r in range(4)] == [range(0, 1), range(1, 2), range(2, 3), range(3, 4)]
    two = check_layout(4, 8, 2, 64)    # fewer KV heads than ranks: each on two ranks
    assert [two.kv_heads(r) for r in range(4)] == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert [two.kv_owner(h) for h in range(2)] == [0, 2]
    # every rank's query heads use only the KV heads it holds
    for layout in (four, two, check_layout(2, 8, 2, 64), check_layout(8, 8, 1, 64)):
        group = layout.num_heads // layout.num_kv_heads
        for r in range(layout.world):
            assert {h // group for h in layout.heads(r)} <= set(layout.kv_heads(r))


@pytest.mark.parametrize("world,heads,kv,inter,words", [
    (3, 4, 2, 64, "4 attention heads"), (4, 8, 6, 64, "6 KV heads"), (4, 8, 3, 64, "3 KV heads"),
    (2, 4, 2, 63, "MLP width of 63"), (0, 4, 2, 64, ">= 1")])
def test_a_layout_that_does_not_divide_says_what(world, heads, kv, inter, words):
    with pytest.raises(LayoutError, match=words):
        check_layout(world, heads, kv, inter)


def test_shards_put_back_together_are_the_weight():
    w = torch.arange(7 * 6, dtype=torch.float32).reshape(7, 6)
    shards = [parallel.split_vocab(w, r, 2) for r in range(2)]
    assert all(s.shape == (4, 6) for s in shards)
    assert torch.equal(torch.cat(shards)[:7], w) and not shards[1][3].any()
    assert torch.equal(torch.cat([parallel.split_cols(w, r, 3) for r in range(3)], 1), w)
    fused = torch.arange(12.0)[:, None]   # parts of 8 and 4 rows
    halves = [parallel.split_parts(fused, [8, 4], parallel.even_ranges([8, 4], r, 2)) for r in range(2)]
    assert halves[0].flatten().tolist() == [0, 1, 2, 3, 8, 9]
    assert halves[1].flatten().tolist() == [4, 5, 6, 7, 10, 11]


# --- a sharded engine, ranks in processes --------------------------------------------------


def run_world(world: int, tiny_dir, tmp_path) -> dict:
    ctx = mp.get_context("spawn")
    out = tmp_path / f"world{world}.json"
    init = f"file://{tmp_path}/rendezvous{world}"
    procs = [ctx.Process(target=tp_ranks.run_rank, args=(r, world, init, str(tiny_dir), str(out)), daemon=True)
             for r in range(world)]
    try:
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=240)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join()
    result = json.loads(out.read_text())
    assert "error" not in result, result["error"]
    return result


@pytest.mark.parametrize("world", [2, 4])
def test_sharded_engine_matches_one_rank_and_generate(world, tiny_model_dir, tmp_path):
    result = run_world(world, tiny_model_dir, tmp_path)
    assert set(result) == {"tiny", *tp_ranks.FAMILIES}
    for name, case in result.items():
        assert case["steps"] == tp_ranks.NUM_NEW, name
        # fp32 sums in another order (row-parallel partial sums): within 1e-5 of the logits' scale
        assert case["max_logit_diff"] <= 1e-5 * max(1.0, case["logit_scale"]), (name, case)
        assert case["got"] == case["ref"] == case["expected"], name
        moved = case["moved"]
        assert moved["kv_diff"] <= 1e-5 * max(1.0, moved["kv_scale"]), name   # gathered: the one-rank KV
        assert moved["to_one"] == moved["to_ranks"] == case["moved_expected"], name


# --- a 2-rank worker in a fleet ----------------------------------------------------------------


def _fleet(tmp_path, model_dir, migration: str) -> str:
    data = {
        "transport": "ipc", "model": {"path": str(model_dir)}, "nodes": [{"name": "local"}],
        # sequences go back to the queue after every step, and any worker with room takes them;
        # w2 has room for half of them, so both workers run some and take others' in turn
        "router": {"node": "local", "policy": "any", "migration": migration, "max_lease_steps": 1},
        "ingest": {"node": "local", "input": "jsonl"}, "detokenizer": {"node": "local", "output": "jsonl"},
        "workers": [{"name": "w1", "node": "local", "device": "cpu", "max_seqs": 8, "tensor_parallel": 2,
                     "max_kv_tokens": 1024},
                    {"name": "w2", "node": "local", "device": "cpu", "max_seqs": 4, "max_kv_tokens": 1024}],
    }
    path = tmp_path / f"fleet-{migration}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("migration", ["recompute", "transfer"])
def test_sequences_migrate_between_a_two_rank_and_a_one_rank_worker(migration, tmp_path, tiny_model_dir, qmigrate):
    from conftest import greedy_reference
    r = random.Random(4)
    prompts = [{"id": f"p{i}", "prompt_ids": [1] + [r.randint(3, 1400) for _ in range(r.randint(2, 20))],
                "max_new_tokens": r.randint(6, 16)} for i in range(8)]
    run = qmigrate("sim", _fleet(tmp_path, tiny_model_dir, migration),
                   stdin="".join(json.dumps(p) + "\n" for p in prompts))
    assert run.returncode == 0, run.stderr[-3000:]
    finals = run.finals()
    check = greedy_reference(tiny_model_dir)
    for p in prompts:
        check(p["prompt_ids"], p["max_new_tokens"], finals[p["id"]]["token_ids"], p["id"])
    moves = dict(re.findall(r"(\w+) (\d+)", re.search(r"migrations: (.*)", run.stderr).group(1)))
    assert int(moves.get(f"by_{migration}", 0)) > 0, run.stderr[-2000:]
