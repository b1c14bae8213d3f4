"""The whole pipeline as users run it: `qmigrate sim` with real processes and sockets."""

from __future__ import annotations

import json
import random
import re

import numpy as np
import pytest
import yaml

import helpers as H
import warm
from conftest import greedy_tokens_many
from qmigrate.detokenizer import EXIT_REQUESTS_FAILED

pytestmark = pytest.mark.timeout(300)


def _topology(tmp_path, model_dir, num_workers: int, max_seqs: int = 8, trace_dir=None, **router) -> str:
    data = {
        "transport": "ipc",
        "trace_dir": None if trace_dir is None else str(trace_dir),
        "model": {"path": str(model_dir)},
        "nodes": [{"name": "local"}],
        "router": {"node": "local", **router},
        "ingest": {"node": "local", "input": "jsonl"},
        "detokenizer": {"node": "local", "output": "jsonl"},
        "workers": [{"name": f"w{i}", "node": "local", "device": "cpu", "max_num_seqs": max_seqs}
                    for i in range(1, num_workers + 1)],
    }
    path = tmp_path / f"topo-{num_workers}.yaml"
    path.write_text(yaml.safe_dump(data))
    return str(path)


def _prompts(n: int, seed: int = 0) -> list[dict]:
    r = random.Random(seed)
    return [{"id": f"p{i}", "prompt_ids": [1] + [r.randint(3, 1400) for _ in range(r.randint(1, 60))],
             "max_new_tokens": r.randint(6, 24)} for i in range(n)]


def _summary(stderr: str) -> dict[str, int]:
    """The node's last line: migrations by cause and mechanism, and KV imports."""
    line = re.search(r"(\d+) resumed from shipped KV; migrations: (.*)", stderr)
    assert line, stderr[-2000:]
    return {"kv_imported": int(line.group(1)), **{k: int(v) for k, v in re.findall(r"(\w+) (\d+)", line.group(2))}}


def _run_with_a_drain(tmp_path, ipc_dir, model_dir, num_workers: int, prompts: list[dict], worker=None,
                      **router) -> tuple:
    """A node over ipc:// with its prompts on stdin; w1 is drained holding sequences it has
    not run (see helpers.migrate_by_drain). Returns (final records, summary)."""
    path = tmp_path / "topo.yaml"
    address = H.fleet_topology(path, model_dir, num_workers, ipc_dir=ipc_dir, worker={
        "max_num_seqs": 4, "transfer_wait_s": 60.0, **(worker or {})}, router={
        "heartbeat_timeout_s": 30.0, "lease_timeout_s": 60.0, "max_lease_steps": MAX_LEASE_STEPS, **router})
    nodes = H.Nodes(tmp_path)
    try:
        head = nodes.start(path, "head", keep_stdin=True)

        def write():
            head.stdin.write(H.jsonl(prompts))
            head.stdin.close()

        H.wait_for("every worker", lambda st: st.get("workers") == num_workers, address)
        H.migrate_by_drain(head, address, "w1", write)
        out, err = H.finish(head, address)
    finally:
        nodes.stop_all()
    assert head.returncode == 0, err[-3000:]
    finals = {r["id"]: r for r in map(json.loads, out.splitlines()) if r.get("done")}
    assert sorted(finals) == sorted(p["id"] for p in prompts)
    return finals, _summary(err)


MAX_LEASE_STEPS = 4


@pytest.fixture(scope="module")
def reference(tiny_model_dir):
    from conftest import greedy_reference
    return greedy_reference(tiny_model_dir)


# Seeded sampling: the same draws on any worker, in any batch, whether a sequence moved or not.
SEEDED = [{**p, "id": f"s{i}", "temperature": 0.9, "top_k": 40, "top_p": 0.95, "seed": 1000 + i}
          for i, p in enumerate(_prompts(10, seed=7))]

# Sampling controls, greedy and seeded: their counts are rebuilt from the ids that travel, so
# a moved sequence's tokens are the same as on one worker.
CONTROLLED = [{**p, "id": f"c{i}", "presence_penalty": 0.8, "frequency_penalty": 0.5, "repetition_penalty": 1.3,
               "logit_bias": {str(100 + i): 20.0}, "min_p": 0.05 * (i % 2),
               **({"temperature": 0.9, "seed": 50 + i} if i % 2 else {})}
              for i, p in enumerate(_prompts(8, seed=11))]

# Logprobs (a sampled token's, its alternatives', a prompt's): computed where each token is
# sampled, so a moved sequence's are those it had on one worker.
LOGPROBS = [{**p, "id": f"l{i}", "logprobs": 3, "repetition_penalty": 1.2,
             **({"temperature": 0.8, "seed": 90 + i} if i % 2 else {}), **({"prompt_logprobs": 2} if i < 2 else {})}
            for i, p in enumerate(_prompts(6, seed=13))]

# Structured output, greedy and seeded: the grammar's state is rebuilt from the ids that travel.
STRUCTURED_SCHEMA = {"type": "object", "additionalProperties": False, "required": ["n", "flag"],
                     "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 999},
                                    "flag": {"type": "boolean"}}}
STRUCTURED = [{**p, "id": f"j{i}", "max_new_tokens": 40,
               **({"response_format": {"type": "json_schema", "json_schema": {
                   "name": "t", "schema": STRUCTURED_SCHEMA, "strict": True}}} if i < 2
                  else {"structured_outputs": {"regex": "[a-f]{3,6}( [0-9]{2,4}){2}"}}),
               **({"temperature": 0.9, "seed": 70 + i} if i % 2 else {})}
              for i, p in enumerate(_prompts(4, seed=13))]
# Malformed and invalid requests, each to get an error record while the others stream.
BAD_LINES = ['{"id": "ok1", "prompt": "Hello", "max_new_tokens": 5}',
             '{"id": "empty", "prompt": ""}',
             '{"id": "long", "prompt_ids": [' + ",".join(["5"] * 600) + "]}",
             "this is not json",
             '{"id": "bad", "prompt": "x", "temperature": -1}',
             '{"id": "ok2", "prompt": "World", "max_new_tokens": 5}',
             '{"id": "a", "prompt": "Hello there", "max_new_tokens": 20}',
             '{"id": "b", "prompt": "東京 🦀 café", "max_new_tokens": 20}']


@pytest.fixture(scope="module")
def on_one_worker(tmp_path_factory, tiny_model_dir):
    """One `qmigrate sim` on one worker (nothing can move): the bad lines, then the seeded requests."""
    from conftest import run_qmigrate
    tmp = tmp_path_factory.mktemp("one-worker")
    stdin = "\n".join(BAD_LINES) + "\n" + "".join(json.dumps(p) + "\n" for p in SEEDED + CONTROLLED + LOGPROBS + STRUCTURED)
    trace_dir = tmp_path_factory.getbasetemp() / "one-worker-trace"
    run = run_qmigrate("sim", _topology(tmp, tiny_model_dir, 1, trace_dir=trace_dir), stdin=stdin)
    assert run.returncode == EXIT_REQUESTS_FAILED, run.stderr[-3000:]   # the bad lines failed
    return run


DRAINED_RUNS = {2: {"policy": "affinity", "migration": "recompute"}, 3: {"policy": "any", "migration": "transfer"}}
# the 3-worker run's workers keep structured output's matchers in a process of their own (a GPU
# worker's default): its outputs must equal the one-worker run's, whose matchers are on a thread
PROCESS_MASKS = {3: {"grammar_masks": "process"}}


@pytest.fixture(scope="module")
def drained_runs(tmp_path_factory, tiny_model_dir, on_one_worker):
    """The drained runs of the test below, all at the same time (each in a thread of its own,
    which mostly waits on its fleet): num_workers -> (greedy prompts, seeded prompts, the
    future of _run_with_a_drain's result)."""
    import shutil
    import tempfile
    from concurrent.futures import ThreadPoolExecutor
    from pathlib import Path
    alone = on_one_worker.finals()
    # Each sequence outlasts a lease (generate() runs each greedy one to its end; a seeded one
    # makes the same draws everywhere), so the ones w1 holds when it is drained must move.
    greedy = {}
    for num_workers in DRAINED_RUNS:
        candidates = _prompts(12, seed=num_workers)
        expected = greedy_tokens_many(tiny_model_dir, [(p["prompt_ids"], p["max_new_tokens"]) for p in candidates])
        greedy[num_workers] = [p for p, tokens in zip(candidates, expected) if len(tokens) > MAX_LEASE_STEPS]
    seeded = [p for p in SEEDED + CONTROLLED + LOGPROBS + STRUCTURED if len(alone[p["id"]]["token_ids"]) > MAX_LEASE_STEPS]
    ipc_dirs, runs = [], {}
    pool = ThreadPoolExecutor(len(DRAINED_RUNS))
    try:
        for num_workers, router in DRAINED_RUNS.items():
            tmp = tmp_path_factory.mktemp(f"drained-{num_workers}")
            ipc_dirs.append(Path(tempfile.mkdtemp(prefix="qm-")))   # short: a socket path is at most 107 bytes
            run = pool.submit(_run_with_a_drain, tmp, ipc_dirs[-1], tiny_model_dir, num_workers,
                              greedy[num_workers] + seeded, worker=PROCESS_MASKS.get(num_workers), **router)
            runs[num_workers] = (greedy[num_workers], seeded, run)
        yield runs
    finally:
        pool.shutdown(wait=True)
        for path in ipc_dirs:
            shutil.rmtree(path, ignore_errors=True)


@pytest.mark.parametrize("num_workers,router", list(DRAINED_RUNS.items()))
def test_greedy_equals_generate_and_seeded_sampling_is_unchanged_while_sequences_migrate(
        reference, on_one_worker, drained_runs, num_workers, router):
    """One drained run of greedy and seeded requests: each greedy output is generate()'s,
    each seeded one what it was on one worker."""
    greedy, seeded, run = drained_runs[num_workers]
    assert len(greedy) >= 8
    assert len(seeded) >= 6 and sum(p["id"].startswith("c") for p in seeded) >= 5
    alone = on_one_worker.finals()
    finals, moves = run.result()
    for p in greedy:
        reference(p["prompt_ids"], p["max_new_tokens"], finals[p["id"]]["token_ids"], p["id"])
    assert {p["id"]: alone[p["id"]]["token_ids"] for p in seeded} == {p["id"]: finals[p["id"]]["token_ids"]
                                                                     for p in seeded}
    assert moves.get("drain", 0) > 0, moves
    if router["migration"] == "transfer":
        # Every move shipped the KV, and the receiving worker used it: a fallback to
        # recompute (a late or refused shipment) would leave kv_imported short.
        assert moves.get("by_recompute", 0) == 0 and moves["kv_imported"] == moves["by_transfer"] > 0, moves
    else:
        assert moves.get("by_recompute", 0) > 0 and moves["kv_imported"] == 0, moves


@pytest.mark.parametrize("num_workers", list(DRAINED_RUNS))
def test_logprobs_are_the_same_after_a_move_and_equal_transformers(tiny_model_dir, on_one_worker, drained_runs,
                                                                   num_workers):
    """Requests with logprobs in the drained runs (moved by recompute, or by KV transfer): each
    token's logprob and alternatives are what they were on one worker, which are transformers'
    log-softmax of the (repetition-penalized) logits over the temperature; prompt logprobs too."""
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    alone = on_one_worker.finals()
    _, _, run = drained_runs[num_workers]
    finals, _ = run.result()
    for p in LOGPROBS:
        one, moved = alone[p["id"]], finals[p["id"]]
        assert one["token_ids"] == moved["token_ids"] and len(one["logprobs"]) == len(one["token_ids"])
        for i, (a, b) in enumerate(zip(one["logprobs"], moved["logprobs"])):
            assert a is not None and b is not None, (p["id"], i, a, b)
            assert a["token_id"] == b["token_id"] and abs(a["logprob"] - b["logprob"]) < 1e-4, (p["id"], i, a, b)
            values = [v for _, v in a["top_logprobs"]]
            assert np.allclose(values, [v for _, v in b["top_logprobs"]], atol=1e-4), (p["id"], i, a, b)
            # the same alternatives, but where two are a numerical tie (either order is right)
            tied = {k for k in range(len(values)) for j in (k - 1, k + 1)
                    if 0 <= j < len(values) and abs(values[k] - values[j]) < 1e-4}
            assert all(a["top_logprobs"][k][0] == b["top_logprobs"][k][0] for k in range(len(values))
                       if k not in tied), (p["id"], i, a, b)
        ids = p["prompt_ids"] + one["token_ids"]
        with torch.no_grad():
            logits = model(torch.tensor([ids])).logits[0].float()
        raw = logits.log_softmax(-1)
        for i, entry in enumerate(one["logprobs"]):
            at = len(p["prompt_ids"]) - 1 + i
            x = logits[at].clone()
            seen = torch.tensor(sorted(set(ids[:at + 1])))
            x[seen] = torch.where(x[seen] < 0, x[seen] * 1.2, x[seen] / 1.2)
            want = (x / p.get("temperature", 1.0)).log_softmax(-1)
            assert abs(entry["logprob"] - float(want[entry["token_id"]])) < 1e-4
            assert all(abs(v - float(want[t])) < 1e-4 for t, v in entry["top_logprobs"])
        if "prompt_logprobs" in p:
            got = moved["prompt_logprobs"]
            assert got[0] is None and len(got) == len(p["prompt_ids"])
            for i, entry in enumerate(got[1:], start=1):
                assert abs(entry["logprob"] - float(raw[i - 1, p["prompt_ids"][i]])) < 1e-4
                assert len(entry["top_logprobs"]) == 2


@pytest.mark.parametrize("num_workers", list(DRAINED_RUNS))
def test_structured_outputs_follow_their_grammar_on_one_worker_and_after_a_migration(
        on_one_worker, drained_runs, num_workers):
    """The same structured outputs on one worker and in a drained run (the equality is the
    test above's), and each a document of its schema or a match of its regex."""
    import jsonschema
    alone = on_one_worker.finals()
    finals, _ = drained_runs[num_workers][2].result()
    assert len([p for p in STRUCTURED if p in drained_runs[num_workers][1]]) >= 3
    for p in STRUCTURED:
        for got in (alone[p["id"]], finals[p["id"]]):
            assert got["finish_reason"] == "eos", got
            if "response_format" in p:
                jsonschema.validate(json.loads(got["text"]), STRUCTURED_SCHEMA)
            else:
                assert re.fullmatch("[a-f]{3,6}( [0-9]{2,4}){2}", got["text"]), got["text"]


def test_seeded_sampling_is_not_greedy(tiny_model_dir, on_one_worker):
    alone = on_one_worker.finals()
    expected = greedy_tokens_many(tiny_model_dir, [(p["prompt_ids"], p["max_new_tokens"]) for p in SEEDED])
    differs = [p["id"] for p, tokens in zip(SEEDED, expected) if tokens != alone[p["id"]]["token_ids"]]
    assert differs, "sampling at temperature 0.9 gave exactly the greedy output everywhere"


def test_bad_requests_get_an_error_record_and_deltas_join_to_the_final_text(on_one_worker):
    """One run: malformed and invalid requests each get an error record while the others
    stream, and every request's deltas (multi-byte characters split across tokens too)
    join to its final text."""
    run = on_one_worker
    finals = run.finals()
    assert len(finals["ok1"]["token_ids"]) == 5 and len(finals["ok2"]["token_ids"]) == 5
    assert "'prompt' is empty" in finals["empty"]["error"]
    assert "context" in finals["long"]["error"]
    assert "temperature" in finals["bad"]["error"]
    assert "invalid JSON" in finals["4"]["error"]
    assert "Traceback" not in run.stderr
    deltas: dict[str, str] = {}
    for r in run.records():
        if not r["done"]:
            deltas[r["id"]] = deltas.get(r["id"], "") + r["delta"]
    for rid in ("ok1", "ok2", "a", "b", *(p["id"] for p in SEEDED)):
        final = finals[rid]
        assert final["text"] == deltas.get(rid, "")
    for rid in ("ok1", "ok2", "a", "b"):
        final = finals[rid]
        assert len(final["token_ids"]) == (5 if rid.startswith("ok") else 20) or final["finish_reason"] == "eos"


def test_a_traced_run_times_every_hop_of_the_token_path(on_one_worker, tmp_path_factory):
    from qmigrate.ops import trace
    trace_dir = tmp_path_factory.getbasetemp() / "one-worker-trace"
    # (ingest leaves once stdin's requests are handed on: only an HTTP ingest hears replies)
    roles = sorted(p.name.rsplit("-", 1)[0] for p in trace_dir.glob("*.jsonl"))
    assert roles == ["detokenizer", "router", "worker-w1"], roles
    text = "\n".join(trace.summarize(trace_dir))
    assert " steps in " in text and "  tokens of w1 forwarded: " in text
    assert re.search(r"detokenizer-\d+: messages in: \d+, gaps p50 ", text), text


def test_text_mode_streams_every_request_and_status_looks_inside(tiny_model_dir):
    """At a terminal, the simulation names its temporary topology, and `qmigrate status` on it
    shows the running fleet; stdout stays the streamed output alone."""
    import os
    import pty
    import select
    import subprocess
    import time

    from typer.testing import CliRunner

    from qmigrate.cli import app
    master, slave = pty.openpty()
    proc = warm.popen(["sim", "--workers", "1", "--model", str(tiny_model_dir),
                      "--max-new-tokens", "8"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                      stderr=slave, text=True, start_new_session=True)
    os.close(slave)
    terminal = b""
    try:
        proc.stdin.write("Hello\nTell me a story\n\n")
        proc.stdin.flush()  # left open: the simulation runs until stdin ends
        deadline = time.monotonic() + 120
        while not (found := re.search(rb"live view: qmigrate status (\S+)", terminal)):
            assert time.monotonic() < deadline and proc.poll() is None, terminal.decode(errors="replace")
            if select.select([master], [], [], 0.2)[0]:
                terminal += os.read(master, 65536)
        snap = None
        while time.monotonic() < deadline:  # the worker joins after loading the model
            status = CliRunner().invoke(app, ["status", found.group(1).decode(), "--once", "--json"])
            snap = json.loads(status.output) if status.exit_code == 0 else None
            if snap and [w["name"] for w in snap["workers"]] == ["w1"]:
                break
            time.sleep(0.5)
        assert snap and [w["name"] for w in snap["workers"]] == ["w1"], status.output
        out, _ = proc.communicate("", timeout=120)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
        os.close(master)
    assert proc.returncode == EXIT_REQUESTS_FAILED   # [3] failed
    assert re.search(r"^\[1\] <done: length, 8 tokens>$", out, re.M), out
    assert re.search(r"^\[2\] <done: length, 8 tokens>$", out, re.M), out
    assert re.search(r"^\[3\] error: empty prompt$", out, re.M), out
    assert "live view" not in out


def test_no_stdin_exits_cleanly(tiny_model_dir, qmigrate):
    run = qmigrate("sim", "--workers", "1", "--model", str(tiny_model_dir), stdin="")
    assert run.returncode == 0, run.stderr[-3000:]
    assert run.stdout == ""
    assert "0 sequences finished" in run.stderr  # at once: no worker needs to load for no input


def test_sampling_controls_change_the_output_on_stdin_jsonl(tiny_model_dir, on_one_worker):
    """The penalties and bias of CONTROLLED reach the sampler (the migration test above
    would pass if they were dropped everywhere)."""
    alone = on_one_worker.finals()
    plain = [p for p in CONTROLLED if "seed" not in p]
    expected = greedy_tokens_many(tiny_model_dir, [(p["prompt_ids"], p["max_new_tokens"]) for p in plain])
    same = [(p["id"], tokens) for p, tokens in zip(plain, expected) if tokens == alone[p["id"]]["token_ids"]]
    assert not same, same
