"""ShareGPT traffic (bench/sharegpt.py) from tiny files of the dataset's shape written here: a
file cut off mid-way read to its last whole conversation, vLLM's sampling rules, multi-turn
sessions that carry the server's replies (or the dataset's) with a think time, and the same workload on
`qmigrate bench`'s in-process path and through `bench serve` against a fake server."""

from __future__ import annotations

import json
import math
import time

import pytest
from transformers import AutoTokenizer

from qmigrate.bench import serve_data as D
from qmigrate.bench import sharegpt as S
from qmigrate.bench.serve import run_serve
from test_bench_serve import FakeServer

WORDS = "the old sailor carried a broken umbrella slowly before dawn and then every student counted apples".split()


def text(n: int, k: int = 0) -> str:
    return " ".join(WORDS[(k + i) % len(WORDS)] for i in range(n))


def conv(i: int, *turns: tuple[str, str]) -> dict:
    return {"id": f"c{i}", "conversations": [{"from": who, "value": value} for who, value in turns]}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def write(path, items, cut: bool = False):
    raw = json.dumps(items, indent=2)
    if cut:   # as the packaged file: cut inside the last conversation
        raw = raw[:raw.rindex('"value"') + 20]
    path.write_text(raw)
    return path


def test_a_file_cut_off_mid_way_is_read_to_its_last_whole_conversation(tmp_path):
    items = [conv(i, ("human", text(6, i)), ("gpt", text(9, i))) for i in range(5)]
    whole = S.read_conversations(write(tmp_path / "whole.json", items))
    cut = S.read_conversations(write(tmp_path / "cut.json", items, cut=True))
    assert len(whole) == 5 and len(cut) == 4
    assert cut == whole[:4] and cut[0] == [("human", text(6, 0)), ("gpt", text(9, 0))]
    with pytest.raises(ValueError, match="no ShareGPT conversations"):
        S.read_conversations(write(tmp_path / "empty.json", []))
    (tmp_path / "obj.json").write_text("{}")
    with pytest.raises(ValueError, match="JSON array"):
        S.read_conversations(tmp_path / "obj.json")


def test_pairs_follow_vllms_rules(tmp_path, tokenizer):
    n_tokens = lambda s: len(tokenizer(s).input_ids)   # noqa: E731
    items = [
        conv(0, ("human", text(8)), ("gpt", text(12))),                  # kept
        conv(1, ("human", "the"), ("gpt", text(12))),                    # prompt under 4 tokens
        conv(2, ("human", text(8)), ("gpt", "a")),                       # output under 4 tokens
        conv(3, ("human", text(1100)), ("gpt", text(12))),               # prompt over 1,024
        conv(4, ("human", text(900)), ("gpt", text(1300))),              # pair over 2,048
        conv(5, ("system", "be brief"), ("human", text(7, 3)), ("gpt", text(20, 2))),   # first human turn
        conv(6, ("gpt", text(5)),),                                      # no human turn
    ]
    convs = S.read_conversations(write(tmp_path / "s.json", items))
    assert n_tokens(text(1100)) > 1024 and n_tokens(text(900)) <= 1024 and n_tokens(text(900) + text(1300)) > 2048
    pairs = S.sample_pairs(convs, tokenizer, 2, seed=0)
    assert sorted(p.prompt for p in pairs) == sorted([text(8), text(7, 3)])
    for p in pairs:
        assert p.prompt_ids == tokenizer(p.prompt).input_ids
        assert p.output_len == n_tokens(text(12) if p.prompt == text(8) else text(20, 2))
    again = S.sample_pairs(convs, tokenizer, 2, seed=0)
    assert [p.prompt for p in again] == [p.prompt for p in pairs]
    with pytest.raises(ValueError, match="give 2 prompts"):
        S.sample_pairs(convs, tokenizer, 3)


def test_the_seed_shuffles_which_conversations_are_taken(tmp_path, tokenizer):
    items = [conv(i, ("human", text(6, i)), ("gpt", text(8, i))) for i in range(12)]
    convs = S.read_conversations(write(tmp_path / "s.json", items))
    orders = {tuple(p.prompt for p in S.sample_pairs(convs, tokenizer, 5, seed)) for seed in range(4)}
    assert len(orders) > 1


def test_sessions_carry_the_datasets_replies_with_a_think_time(tmp_path, tokenizer):
    items = [conv(i, *[(who, text(6 + j, i + j)) for j in range(3) for who in ("human", "gpt")]) for i in range(3)]
    items.append(conv(9, ("human", text(6)), ("gpt", text(6))))      # one turn: not a session
    path = write(tmp_path / "m.json", items)
    reqs = D.sharegpt_sessions(3, tokenizer, max_turns=2, think_time_s=0.2, path=path, replies="dataset")
    assert [len(r.turns) for r in reqs] == [2, 2, 2]
    for r in reqs:
        assert r.turn_output_lens == [len(tokenizer(a).input_ids) for a in r.answers]
    with pytest.raises(ValueError, match="fewer than the 4"):
        D.sharegpt_sessions(4, tokenizer, path=path)
    server = FakeServer()
    try:
        t0 = time.monotonic()
        [(_, s)] = run_serve(base_url=server.url, model="fake", requests=reqs, rates=[math.inf], warmup=0)
        took = time.monotonic() - t0
    finally:
        server.close()
    assert s["completed"] == 6 and s["output_tokens"] == sum(sum(r.turn_output_lens) for r in reqs)
    assert s["later_turns"]["calls"] == 3
    assert took >= 0.2   # each session waited before its second turn
    for r in reqs:
        second = next(b for b in server.bodies if len(b["messages"]) == 3 and b["messages"][0]["content"] == r.turns[0])
        assert [m["content"] for m in second["messages"]] == [r.turns[0], r.answers[0], r.turns[1]]
        assert second["max_tokens"] == r.turn_output_lens[1]


def fake_reply(n: int) -> str:   # what FakeServer streams for n tokens
    return "".join(f"t{i} " for i in range(n))


@pytest.mark.parametrize("chat", [True, False])
def test_sessions_carry_the_servers_replies_by_default(tmp_path, tokenizer, chat):
    items = [conv(i, *[(who, text(6 + j, i + j)) for j in range(3) for who in ("human", "gpt")]) for i in range(2)]
    reqs = D.sharegpt_sessions(2, tokenizer, max_turns=3, path=write(tmp_path / "m.json", items))
    assert all(len(r.turns) == 3 and not r.answers for r in reqs)
    dataset = D.sharegpt_sessions(2, tokenizer, max_turns=3, path=tmp_path / "m.json", replies="dataset")
    assert [r.turn_output_lens for r in reqs] == [r.turn_output_lens for r in dataset]   # the same work
    with pytest.raises(ValueError, match="replies"):
        D.sharegpt_sessions(2, tokenizer, path=tmp_path / "m.json", replies="gpt")
    server = FakeServer(has_chat_template=chat)
    try:
        [(_, s)] = run_serve(base_url=server.url, model="fake", requests=reqs, rates=[math.inf], warmup=0)
    finally:
        server.close()
    assert s["completed"] == 6 and s["output_tokens"] == sum(sum(r.turn_output_lens) for r in reqs)
    for r, d in zip(reqs, dataset):
        replies = [fake_reply(n) for n in r.turn_output_lens[:2]]
        assert replies != d.answers[:2]
        if chat:
            [third] = [b for b in server.bodies if len(b.get("messages", [])) == 5
                       and b["messages"][0]["content"] == r.turns[0]]
            assert [m["content"] for m in third["messages"]] == [r.turns[0], replies[0], r.turns[1], replies[1],
                                                                 r.turns[2]]
            assert [m["role"] for m in third["messages"]] == ["user", "assistant"] * 2 + ["user"]
        else:
            [third] = [b for b in server.bodies if b.get("prompt") == D.transcript(r.turns, replies)]
        assert third["max_tokens"] == r.turn_output_lens[2] and third["ignore_eos"]


def test_bench_serve_takes_dataset_replies_only_for_sharegpt_sessions(qmigrate):
    run = qmigrate("bench", "serve", "--base-url", "http://127.0.0.1:9", "--dataset", "multi-turn",
                   "--session-replies", "dataset")
    assert run.returncode != 0 and "--session-replies dataset needs --dataset sharegpt-multi-turn" in run.stderr
    run = qmigrate("bench", "serve", "--base-url", "http://127.0.0.1:9", "--dataset", "sharegpt-multi-turn",
                   "--session-replies", "echo")
    assert run.returncode != 0 and "--session-replies must be one of model, dataset" in run.stderr


def test_the_same_workload_runs_in_process_and_names_its_size(tmp_path, tiny_model_dir):
    from qmigrate.bench.core import run_bench
    items = [conv(i, ("human", text(5 + i, i)), ("gpt", text(4 + i % 3, i))) for i in range(6)]
    work = S.ShareGPTWorkload(str(tiny_model_dir), 4, 0, str(write(tmp_path / "s.json", items, cut=True)))
    requests = work.requests()
    assert len(requests) == 4 and all(n >= 4 for _, n in requests)
    [result] = run_bench(model_path=str(tiny_model_dir), devices=["cpu"], dtype="auto", workload=work,
                         paths=["in-process"], max_seqs=4, max_tokens=256, hf_batch=4, router_overrides={},
                         json_path=tmp_path / "r.json")
    assert result.useful_tokens == sum(n for _, n in requests)
    report = json.loads((tmp_path / "r.json").read_text())
    assert report["workload"]["name"] == "sharegpt" and report["workload"]["requests"] == 4


def test_bench_serve_needs_a_tokenizer_for_sharegpt(qmigrate, tmp_path):
    run = qmigrate("bench", "serve", "--base-url", "http://127.0.0.1:9", "--dataset", "sharegpt")
    assert run.returncode != 0 and "--tokenizer" in run.stderr


def test_the_physical_limit_counts_bytes_and_flops_of_the_steps():
    from qmigrate.bench.limits import Shape, workload_limit
    dense = Shape(hidden=8, layers=2, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10)
    # attention 8*4*(2*2 + 2*1) = 192, MLP 3*8*16 = 384 a layer; the head 80
    assert dense.active_params() == 2 * (192 + 384) + 80 == dense.step_weight_bytes(5) / 2
    assert dense.kv_bytes_per_token == 2 * 2 * 1 * 4 * 2
    # two requests (prompt, output): (3, 4) and (1, 2); two rows at a time: 4 steps (the longest)
    out = workload_limit(dense, [(3, 4), (1, 2)], max_seqs=2, copy_bytes_per_s=1.0, peak_flops=1.0)
    contexts = (3 + 4 + 5 + 6) + (1 + 2)
    assert out["steps"] == 4 and out["kv_bytes"] == contexts * 32
    assert out["weight_bytes"] == 4 * 2 * 1232
    assert out["flops"] == 2 * 1232 * 10 + 4 * 2 * 2 * 4 * (contexts + 3)
    # one row at a time: the steps are the total output
    assert workload_limit(dense, [(3, 4), (1, 2)], max_seqs=1)["steps"] == 6
    moe = Shape(hidden=8, layers=1, heads=2, kv_heads=1, head_dim=4, intermediate=16, vocab=10, num_experts=4,
                top_k=1, expert_intermediate=2)
    # one row reads its one expert; many rows nearly all four
    assert moe.step_weight_bytes(1) == 2 * (moe.dense_params() + 48)
    assert moe.step_weight_bytes(1000) == pytest.approx(2 * (moe.dense_params() + 4 * 48))


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_transformers_continuous_batching_runs_the_same_workload(tmp_path, tiny_model_dir):
    """The installed peer beside the in-process engine: every request gets its own length
    (EOS off), and the run reports both."""
    from qmigrate.bench.core import run_bench
    items = [conv(i, ("human", text(5 + i, i)), ("gpt", text(4 + 2 * i, i))) for i in range(3)]
    work = S.ShareGPTWorkload(str(tiny_model_dir), 3, 0, str(write(tmp_path / "s.json", items)))
    asked = sum(n for _, n in work.requests())
    results = run_bench(model_path=str(tiny_model_dir), devices=["cpu"], dtype="auto", workload=work,
                        paths=["in-process", "transformers-cb"], max_seqs=4, max_tokens=256, hf_batch=4,
                        router_overrides={}, json_path=tmp_path / "r.json")
    assert [r.name for r in results] == ["in-process", "transformers-cb"]
    assert [r.useful_tokens for r in results] == [asked, asked]
    assert [r["path"] for r in json.loads((tmp_path / "r.json").read_text())["runs"]] == ["in-process",
                                                                                          "transformers-cb"]


def test_sessions_end_before_the_turn_that_would_pass_the_model_length(tmp_path, tokenizer):
    items = [conv(i, *[(who, text(40, i + j)) for j in range(6) for who in ("human", "gpt")]) for i in range(4)]
    path = write(tmp_path / "long.json", items)
    full = D.sharegpt_sessions(4, tokenizer, max_turns=6, path=path)
    assert {len(r.turns) for r in full} == {6}
    n_tokens = max(len(tokenizer(text(40, k)).input_ids) for k in range(12))
    limit = 6 * D.TRANSCRIPT_LABEL_TOKENS + 4 * n_tokens + 2   # room for two exchanges, not three
    cut = D.sharegpt_sessions(4, tokenizer, max_turns=6, path=path, max_model_len=limit)
    assert {len(r.turns) for r in cut} == {2}
    for r in cut:
        whole = D.transcript(r.turns, r.answers[:-1])
        assert len(tokenizer(whole).input_ids) + r.turn_output_lens[-1] <= limit
    with pytest.raises(ValueError, match="leaves no room"):
        D.sharegpt_sessions(4, tokenizer, max_turns=6, path=path, max_model_len=6 * D.TRANSCRIPT_LABEL_TOKENS)
