"""The journals and the router's output log, in-process: what survives a kill, what a
restart replays, and that a replayed detokenizer prints only what is new."""

from __future__ import annotations

import json

import pytest

from qmigrate.wire import protocol as P
from qmigrate.wire import codec
from qmigrate.config import local_topology
from qmigrate.router.journal import Journal, OutputLog


def spec(seq_id: int, prompt=(1, 5, 9), max_new_tokens: int = 4) -> P.SeqSpec:
    return P.SeqSpec(seq_id, P.pack_i32(list(prompt)), len(prompt), max_new_tokens)


def test_a_record_torn_by_a_kill_is_ignored_and_rewrite_replaces(tmp_path):
    path = str(tmp_path / "j")
    journal = Journal(path)
    for record in (b"one", b"", b"three"):
        journal.append(record)
    with open(path, "ab") as f:
        f.write(b"\x09\x00\x00\x00par")  # a kill in the middle of a write
    assert Journal(path).read() == [b"one", b"", b"three"]
    journal.rewrite([b"snapshot"])
    journal.append(b"after")
    assert Journal(path).read() == [b"snapshot", b"after"]


def test_output_log_keeps_each_request_once_until_printed():
    log = OutputLog()
    new = log.add(P.Submit([spec(1), spec(2), spec(3)], ["a", "b", "c"], [["e", "empty prompt"]]), 2)
    assert [s.seq_id for s in new.seqs] == [1, 2] and new.req_ids == ["a", "b"] and new.errors == [["e", "empty prompt"]]
    assert log.add(P.Submit([spec(1), spec(2)], ["a", "b"], [["e", "empty prompt"]]), 2) is None  # a resend
    closed = log.add(P.Submit([spec(3)], ["c"], [], 4), 1)
    assert [s.seq_id for s in closed.seqs] == [3] and closed.num_requests == 4
    assert log.meta(2) == P.RequestMeta(2, "b", P.pack_i32([1, 5, 9]))
    assert log.printed([1, 99]) and not log.printed([99])
    assert sorted(log.specs) == [2, 3]
    bad = log.add(P.Submit([P.SeqSpec(7, b"", 1, 4)], ["z"]), 1)  # the scheduler refuses it too
    assert bad.seqs == [] and bad.errors == [["z", "invalid request"]]


def test_output_log_keeps_errors_apart_by_number_until_printed():
    """Two requests refused under one request id are two records (before, the second was
    lost, and a run waiting for every request's end never ended); a resend of either is not."""
    log = OutputLog()
    first = log.add(P.Submit([], [], [["x", "empty prompt"]], error_ids=P.pack_i64([11])), 0)
    second = log.add(P.Submit([], [], [["x", "empty prompt"], ["x", "empty prompt"]],
                              error_ids=P.pack_i64([11, 12])), 0)
    assert P.unpack_i64(first.error_ids).tolist() == [11] and P.unpack_i64(second.error_ids).tolist() == [12]
    assert [e.seq_id for e in log.error_messages()] == [11, 12]
    records = [codec.encode(log.snapshot())]
    assert log.printed([11]) and list(log.errors) == [12]
    assert log.add(P.Submit([], [], [["y", "bad"]]), 0).errors == [["y", "bad"]]  # no number: by req_id
    again = OutputLog()
    again.replay(records)
    assert again.errors == {11: ["x", "empty prompt"], 12: ["x", "empty prompt"]}


def test_the_scheduler_readmits_past_its_limit_and_only_once():
    from qmigrate.config import RouterConfig
    from qmigrate.router.scheduler import Scheduler, WorkerState
    sched = Scheduler(RouterConfig(max_queued=1))
    assert sched.admit([spec(1), spec(2)]) == 1
    for _ in range(2):
        sched.readmit(spec(2))
    sched.readmit(spec(1))  # still here: left alone
    assert sorted(sched.seqs) == [1, 2] and len(sched.queue) == 2 and sched.counters["readmitted"] == 1
    sched.start_ids_at(1 << 40)
    sched.register(WorkerState("w1", max_seqs=4, max_tokens=64), 0.0)
    grant = sched.schedule("w1", 4, 64, 0.0)
    assert grant.lease_id >= 1 << 40 and sorted(r.seq_id for r in grant.rows) == [1, 2]


def test_output_log_trims_the_oldest_finished_requests():
    log = OutputLog()
    log.add(P.Submit([spec(i) for i in range(1, 7)], [f"r{i}" for i in range(1, 7)]), 6)
    assert log.trim(3, live={1, 2}) == 3  # 1 and 2 still run: 3, 4 and 5 go
    assert sorted(log.specs) == [1, 2, 6] and log.trim(3, live=set()) == 0


def test_output_log_replays_its_records_and_its_snapshot():
    log = OutputLog()
    records = [codec.encode(log.add(P.Submit([spec(1), spec(2)], ["a", "b"], [["e", "bad"]]), 2))]
    log.printed([1])
    records.append(codec.encode(P.Printed(P.pack_i64([1]))))
    records.append(codec.encode(log.add(P.Submit([], [], [], 3), 0)))
    for source in (records, [codec.encode(log.snapshot())]):
        again = OutputLog()
        again.replay(source)
        assert again.specs == log.specs and again.req_ids == log.req_ids
        assert again.errors == {"e": ["e", "bad"]} and again.num_requests == 3


@pytest.fixture
def topo(tmp_path, tiny_model_dir):
    topo = local_topology(1, str(tiny_model_dir), str(tmp_path), output="jsonl")
    topo.detokenizer.journal = str(tmp_path / "detok.journal")
    return topo


def test_a_restarted_detokenizer_prints_only_what_is_new(topo, capsys):
    from qmigrate.detokenizer.loop import Detokenizer

    def tokens(start: int, ids: list[int], finish: int = 0) -> bytes:
        return codec.encode(P.Tokens(P.pack_i64([1]), P.pack_i32([start]), P.pack_i32([len(ids)]), P.pack_i32(ids),
                                 P.pack_u8([finish])))

    meta = codec.encode(P.RequestMeta(1, "r1", P.pack_i32([1, 42])))
    first = Detokenizer(topo)
    first.recover()
    for frame in (meta, codec.encode(P.RequestError("r0", "empty prompt")), tokens(0, [71, 78, 85])):
        first.receive(frame)
    before = capsys.readouterr().out
    for sock in (first.pull, first.router):  # killed: nothing more of it runs
        sock.close(linger=0)

    second = Detokenizer(topo)
    try:
        second.recover()
        assert capsys.readouterr().out == "", "the replay printed"
        assert second.sink.num_done == 1 and second.sink.num_started == 1
        # What the router sends again after a Resync, then the rest of the request.
        for frame in (meta, codec.encode(P.RequestError("r0", "empty prompt")), tokens(0, [71, 78, 85]),
                      tokens(3, [90, 91], finish=int(P.Finish.LENGTH)), codec.encode(P.InputClosed(2))):
            second.receive(frame)
        after = capsys.readouterr().out
    finally:
        for sock in (second.pull, second.router):
            sock.close(linger=0)
    records = [json.loads(line) for line in (before + after).splitlines()]
    assert [r for r in records if r.get("error")] == [{"id": "r0", "error": "empty prompt", "done": True}]
    final = [r for r in records if r["done"] and r["id"] == "r1"]
    assert len(final) == 1 and final[0]["token_ids"] == [71, 78, 85, 90, 91]
    assert "".join(r["delta"] for r in records if not r["done"]) == final[0]["text"]
    assert second.sink.num_done == 2 and second.sink.num_started == 0 and 1 in second.sink.newly_done


class _Killed(BaseException):
    """The process dying in the middle of handling a message (the role's handlers catch
    Exception, as they must, but not this)."""


def test_a_kill_in_the_middle_of_a_message_loses_none_of_its_text(topo, capsys):
    """Killed after printing one request's text of a two-request message: the message was
    journaled before its handling began, so the restart took all of it as printed and the
    other request's text was lost (a flaky failure of the restart test under load). Text is
    now made in memory, journaled, then printed; a kill before the journal prints nothing."""
    from qmigrate.detokenizer.loop import Detokenizer

    metas = [codec.encode(P.RequestMeta(s, f"r{s}", P.pack_i32([1, 42]))) for s in (1, 2)]
    both = codec.encode(P.Tokens(P.pack_i64([1, 2]), P.pack_i32([0, 0]), P.pack_i32([2, 2]),
                             P.pack_i32([71, 78, 85, 90]), P.pack_u8([0, 0])))
    first = Detokenizer(topo)
    first.recover()
    for frame in metas:
        first.receive(frame)
    deltas = []
    write = first.sink._write

    def dies_on_the_second(text: str) -> None:
        deltas.append(text)
        if len(deltas) == 2:
            raise _Killed
        write(text)

    first.sink._write = dies_on_the_second
    with pytest.raises(_Killed):
        first.receive(both)
    before = capsys.readouterr().out
    for sock in (first.pull, first.router):
        sock.close(linger=0)

    second = Detokenizer(topo)
    try:
        second.recover()
        for frame in metas + [both]:  # what the router sends again after the Resync
            second.receive(frame)
        after = capsys.readouterr().out
    finally:
        for sock in (second.pull, second.router):
            sock.close(linger=0)
    printed = [json.loads(line) for line in (before + after).splitlines()]
    assert sorted(r["id"] for r in printed) == ["r1", "r2"], printed
