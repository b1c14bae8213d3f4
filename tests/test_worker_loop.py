"""The worker's own loop as a pure core: what to ask the router for, which lease to start or
finish next, deadlines, KV waits, heartbeats and revokes; no sockets, no model. (Multi-step
leases and revokes on the engine are tested with the other WorkerCore tests, in test_engine.)"""

from __future__ import annotations

import contextlib

import pytest

from qmigrate.wire import protocol as P
from qmigrate.config import WorkerConfig
from qmigrate.worker.leases import FINISH, START, WAIT, KVOutbox, Leases

NOTHING = lambda lease: set()  # noqa: E731 -- no KV shipments awaited


def lease(lease_id: int, num_steps: int = 1, timeout_s: float = 10.0) -> P.Lease:
    return P.Lease(lease_id, lease_id, timeout_s, P.pack_i64([lease_id]), P.pack_i32([5]), P.pack_i32([1]),
                   num_steps=num_steps)


def start_next(loop: Leases, now: float, awaited=NOTHING) -> P.Lease:
    action, got = loop.next_action(now, awaited)
    assert action == START, (action, got)
    loop.started(got, f"handle-{got.lease_id}", now)
    return got


# --- Leases ---------------------------------------------------------------------------

def test_requests_keep_inflight_batches_asked_for_here_or_on_the_device():
    loop = Leases(WorkerConfig(inflight=2, max_num_seqs=8, max_num_batched_tokens=100))
    reqs = loop.requests(0.0, free_tokens=640)
    assert [(r.request_no, r.max_seqs, r.max_tokens, r.free_kv_tokens) for r in reqs] == [(1, 8, 100, 640),
                                                                                     (2, 8, 100, 640)]
    assert loop.requests(0.1, 640) == []
    loop.on_lease(lease(1), 0.1)
    assert loop.requests(0.1, 640) == []          # received counts as in flight
    start_next(loop, 0.1)
    assert loop.requests(0.1, 640) == []          # so does running
    assert loop.next_action(0.2, NOTHING) == (FINISH, "handle-1")
    assert loop.finished() == 1
    assert [r.request_no for r in loop.requests(0.2, 640)] == [3]


def test_requests_the_router_forgot_are_sent_again():
    loop = Leases(WorkerConfig(inflight=2), heartbeat_s=0.5)
    assert len(loop.requests(0.0, 0)) == 2
    assert loop.requests(4.9, 0) == []             # no lease for less than 10 heartbeats: keep waiting
    assert [r.request_no for r in loop.requests(5.1, 0)] == [3, 4]
    loop.on_reset()                                # a new hello: the router holds none of them
    assert [r.request_no for r in loop.requests(5.2, 0)] == [5, 6]


def test_a_lease_past_its_deadline_is_dropped_unstarted():
    loop = Leases(WorkerConfig())
    loop.on_lease(lease(1, timeout_s=1.0), 0.0)
    loop.on_lease(lease(2, timeout_s=5.0), 0.0)
    assert loop.held_lease_ids() == [1, 2]
    assert start_next(loop, 2.0).lease_id == 2     # lease 1 is the router's again by now
    assert loop.num_expired == 1 and loop.held_lease_ids() == [2]


def test_two_leases_on_the_device_the_older_finished_first():
    loop = Leases(WorkerConfig(chain_wait_s=0.002))
    for i in (1, 2, 3):
        loop.on_lease(lease(i), 0.0)
    start_next(loop, 0.0)
    start_next(loop, 0.0)                          # launched before lease 1 is collected
    assert loop.next_action(0.0, NOTHING) == (FINISH, "handle-1")  # never three on the device
    loop.finished()
    start_next(loop, 0.0)
    assert loop.next_action(0.0, NOTHING) == (FINISH, "handle-2")
    loop.finished()
    # A lone lease waits a moment for the next one (it usually chains on it), then finishes.
    action, wait = loop.next_action(0.001, NOTHING)
    assert action == WAIT and wait == pytest.approx(0.001) and loop.wait_s(0.001) == pytest.approx(0.001)
    assert loop.next_action(0.0025, NOTHING) == (FINISH, "handle-3")
    loop.finished()
    assert loop.next_action(0.003, NOTHING) == (WAIT, loop.heartbeat_s)


def test_a_multi_step_lease_runs_alone_and_steps_per_dispatch_forces_steps():
    loop = Leases(WorkerConfig())
    loop.on_lease(lease(1, num_steps=4), 0.0)
    loop.on_lease(lease(2), 0.0)
    assert start_next(loop, 0.0).num_steps == 4
    assert loop.next_action(0.0, NOTHING) == (FINISH, "handle-1")  # lease 2 may not queue behind it
    forced = Leases(WorkerConfig(steps_per_dispatch=3))
    forced.on_lease(lease(1), 0.0)
    forced.on_lease(lease(2, num_steps=5), 0.0)
    assert start_next(forced, 0.0).num_steps == 3
    forced.finished()
    assert start_next(forced, 0.0).num_steps == 5


def test_a_lease_waits_for_its_kv_shipments_then_gives_up():
    loop = Leases(WorkerConfig(transfer_wait_s=2.0))
    awaited = {1: set(), 2: {7}, 3: {9}}
    check = lambda l: awaited[l.lease_id]          # noqa: E731
    for i in (1, 2, 3):
        loop.on_lease(lease(i), 0.0)
    start_next(loop, 0.0, check)
    # Lease 2 waits for KV: lease 1, on the device, is finished meanwhile rather than held back.
    assert loop.next_action(0.0, check) == (FINISH, "handle-1")
    loop.finished()
    action, wait = loop.next_action(0.1, check)
    assert action == WAIT and 0 < wait <= 0.02
    awaited[2] = set()                             # the shipment landed
    assert start_next(loop, 0.5, check).lease_id == 2
    loop.finished()
    assert loop.next_action(0.6, check)[0] == WAIT  # lease 3 waits from now on
    assert loop.next_action(2.5, check)[0] == WAIT
    assert start_next(loop, 2.6, check).lease_id == 3  # given up: the missing KV is recomputed


def test_the_wait_for_kv_never_outlasts_the_lease():
    loop = Leases(WorkerConfig(transfer_wait_s=2.0))
    loop.on_lease(lease(1, timeout_s=0.5), 0.0)
    assert loop.next_action(0.0, lambda l: {3})[0] == WAIT
    assert loop.queued[0].wait_until == pytest.approx(0.5)


def test_a_heartbeat_renews_a_lease_waiting_for_kv_which_starts_when_its_wait_is_over():
    """The router pushes a held lease's deadline on at each heartbeat that names it, and so
    does the worker: a lease whose shipment never comes starts (recomputing) when its wait is
    over, rather than expiring unstarted while the router still counts it as running."""
    loop = Leases(WorkerConfig(transfer_wait_s=2.0))
    never = lambda l: {3}                          # noqa: E731
    loop.on_lease(lease(1, timeout_s=0.5), 0.0)
    assert loop.next_action(0.0, never)[0] == WAIT   # waits until 0.5, its deadline then
    loop.renewed(0.4)                              # a heartbeat named it: due at 0.9 now
    assert start_next(loop, 0.6, never).lease_id == 1
    loop.finished()
    # Without a heartbeat the router takes it back at its deadline, and so does the worker.
    loop.on_lease(lease(2, timeout_s=0.5), 1.0)
    assert loop.next_action(1.0, never)[0] == WAIT
    assert loop.drop_expired(1.6) == [2] and not loop.queued


def test_heartbeats_name_held_leases_and_revokes_apply_only_to_them():
    loop = Leases(WorkerConfig(), heartbeat_s=0.5)
    assert loop.heartbeat_due(0.0) and not loop.heartbeat_due(0.4) and loop.heartbeat_due(0.6)
    loop.on_lease(lease(1, num_steps=4), 0.0)
    loop.on_lease(lease(2), 0.0)
    action, first = loop.next_action(0.0, NOTHING)
    assert loop.held_lease_ids() == [2, 1]         # lease 1 is being started: a long prefill
    loop.started(first, "h1", 0.0)
    assert loop.held_lease_ids() == [2, 1]
    assert not loop.on_revoke(P.Revoke(99)) and loop.num_revokes_ignored == 1
    assert loop.revoked_rows(1) == frozenset()
    assert loop.on_revoke(P.Revoke(1, P.pack_i64([5, 6])))  # rows named: the whole lease ends
    assert loop.revoked_rows(1) is None
    assert loop.on_revoke(P.Revoke(2))             # queued: every row stops after its first step
    assert loop.revoked_rows(2) is None
    assert loop.finished() == 1
    assert not loop.on_revoke(P.Revoke(1))         # answered already: ignored
    assert loop.revoked_rows(1) == frozenset()


def chain(lease_id: int, seq_ids=(1, 2), num_steps: int = 8, **kw) -> P.Lease:
    n = len(seq_ids)
    return P.Lease(lease_id, lease_id, 10.0, P.pack_i64(list(seq_ids)), P.pack_i32([P.CONTINUE] * n),
                   P.pack_i32([0] * n), num_steps=num_steps, **kw)


def test_a_revoked_chain_not_yet_started_is_withdrawn_and_its_place_asked_for_again():
    loop = Leases(WorkerConfig(inflight=2))
    assert len(loop.requests(0.0, 100)) == 2
    loop.on_lease(lease(1, num_steps=8), 0.0)
    start_next(loop, 0.0)
    loop.on_lease(chain(2), 0.0)
    assert loop.requests(0.0, 100) == []
    assert loop.on_revoke(P.Revoke(1)) and loop.on_revoke(P.Revoke(2))
    assert [w.lease_id for w in loop.take_withdrawn()] == [2] and loop.take_withdrawn() == []
    assert loop.held_lease_ids() == [1] and loop.revoked_rows(1) is None and 2 not in loop.revoked
    assert [r.request_no for r in loop.requests(0.0, 100)] == [3]   # its place, asked again
    # a chain that carries drops, or started already, is revoked as any lease: it runs a step
    loop.on_lease(chain(4, drop_ids=P.pack_i64([9])), 0.0)
    assert loop.on_revoke(P.Revoke(4)) and loop.take_withdrawn() == [] and loop.revoked_rows(4) is None
    loop2 = Leases(WorkerConfig(inflight=2))
    loop2.on_lease(chain(5), 0.0)
    start_next(loop2, 0.0)
    assert loop2.on_revoke(P.Revoke(5)) and loop2.take_withdrawn() == [] and loop2.revoked_rows(5) is None


# --- the socket loop around it, in this process, with this test as its router ---------------

@contextlib.contextmanager
def worker_under_test(tmp_path, model_dir, inflight: int):
    """A Worker's socket loop in a thread of this process, this test its router: yields
    (router socket, worker, the worker's identity) once it is welcomed; the revoked lease
    named last is taken at a step boundary before the lease runs on (the Revoke is on its way)."""
    import threading

    import zmq

    from qmigrate.wire import transport
    from qmigrate.config import parse_topology
    from qmigrate.worker.loop import Worker
    topo = parse_topology({
        "transport": "ipc", "ipc_dir": str(tmp_path), "model": {"path": str(model_dir)},
        "nodes": [{"name": "local"}], "router": {"node": "local"}, "ingest": {"node": "local"},
        "detokenizer": {"node": "local"}, "workers": [{"name": "w1", "node": "local", "inflight": inflight}]})
    router = transport.socket(zmq.ROUTER, bind=topo.endpoint("router").bind)
    worker = Worker(topo, "w1")
    worker.awaited_revoke = None
    between = worker.between_steps

    def revoke_seen_first(lease_id, tokens):
        if worker.awaited_revoke == lease_id and lease_id not in worker.leases.revoked:
            worker.router.poll(10_000)
        return between(lease_id, tokens)

    worker.between_steps = revoke_seen_first
    thread = threading.Thread(target=worker.serve_forever, daemon=True)
    thread.start()
    sender = None
    try:
        sender, hello = transport.recv(router, 30.0)
        assert isinstance(hello, P.Hello)
        transport.send(router, P.Welcome(P.PROTOCOL_VERSION, 0.5, 10.0), to=sender)
        yield router, worker, sender
    finally:
        if sender is not None:
            transport.send(router, P.Exit("test over"), to=sender)
        thread.join(30.0)
        router.close(linger=0)
    assert not thread.is_alive()


def next_of(router, kinds):
    """The next message of one of these types from the worker (heartbeats and the rest skipped)."""
    from qmigrate.wire import transport
    while not isinstance(msg := transport.recv(router, 30.0)[1], kinds):
        pass
    return msg


def stream_until_result(router, streamed: dict[int, list[int]]) -> P.StepResult:
    """Tokens in order, each once, until a StepResult; returns it."""
    while not isinstance(msg := next_of(router, (P.Tokens, P.StepResult)), P.StepResult):
        sids, starts = P.unpack_i64(msg.seq_ids).tolist(), P.unpack_i32(msg.start).tolist()
        counts, flat = P.unpack_i32(msg.counts).tolist(), P.unpack_i32(msg.tokens).tolist()
        for sid, start, n in zip(sids, starts, counts):
            assert start == len(streamed[sid])   # in order, each token once
            streamed[sid] += flat[:n]
            flat = flat[n:]
    return msg


PROMPT = [1, 50, 9, 140, 20, 33]


def test_the_worker_streams_a_multi_step_lease_and_takes_a_revoke_between_steps(tmp_path, tiny_model_dir):
    from qmigrate.wire import transport
    with worker_under_test(tmp_path, tiny_model_dir, inflight=1) as (router, worker, sender):
        req = next_of(router, P.WorkRequest)
        full = [P.SeqSpec(sid, P.pack_i32(PROMPT), len(PROMPT), 64) for sid in (1, 2)]
        worker.awaited_revoke = 7
        transport.send(router, P.Revoke(99), to=sender)  # a lease it never had: ignored
        transport.send(router, P.Lease(7, req.request_no, 10.0, P.pack_i64([1, 2]), P.pack_i32([6, 6]),
                                       P.pack_i32([20, 20]), full, num_steps=6), to=sender)
        transport.send(router, P.Revoke(7, P.pack_i64([1])), to=sender)
        streamed = {1: [], 2: []}
        # Each step's tokens come on the router's socket, all of them before the result.
        result = stream_until_result(router, streamed)
        assert sum(map(len, streamed.values())) == len(P.unpack_i32(result.tokens))
    counts = P.unpack_i32(result.counts).tolist()
    # The Revoke named row 1; the whole lease stopped at a step boundary (the answer is one
    # per lease), after the step it was running and at most the one already launched.
    assert result.lease_id == 7 and counts[0] == counts[1] and counts[0] in (1, 2)
    assert streamed[1] == streamed[2] and len(streamed[1]) == counts[0]  # same prompt, greedy
    assert worker.leases.num_revokes_ignored == 1


def test_a_withdrawn_chain_is_answered_at_once_and_its_rows_go_on_in_the_next_lease(tmp_path, tiny_model_dir):
    from qmigrate.wire import transport
    with worker_under_test(tmp_path, tiny_model_dir, inflight=2) as (router, worker, sender):
        first, second = next_of(router, P.WorkRequest), next_of(router, P.WorkRequest)
        full = [P.SeqSpec(sid, P.pack_i32(PROMPT), len(PROMPT), 64) for sid in (1, 2)]
        worker.awaited_revoke = 7
        transport.send(router, P.Lease(7, first.request_no, 10.0, P.pack_i64([1, 2]), P.pack_i32([6, 6]),
                                       P.pack_i32([20, 20]), full, num_steps=16), to=sender)
        transport.send(router, P.Lease(8, second.request_no, 10.0, P.pack_i64([1, 2]),
                                       P.pack_i32([P.CONTINUE] * 2), P.pack_i32([0, 0]), num_steps=16), to=sender)
        transport.send(router, P.Revoke(8), to=sender)
        transport.send(router, P.Revoke(7), to=sender)
        streamed = {1: [], 2: []}
        unrun = stream_until_result(router, streamed)   # the chain, before the lease it follows
        assert unrun.lease_id == 8 and P.unpack_i32(unrun.counts).tolist() == [0, 0] and not unrun.tokens
        again = next_of(router, (P.WorkRequest, P.StepResult))
        assert isinstance(again, P.WorkRequest) and again.request_no == 3   # its place, asked again
        transport.send(router, P.Lease(9, again.request_no, 10.0, P.pack_i64([1, 2]), P.pack_i32([P.CONTINUE] * 2),
                                       P.pack_i32([0, 0]), num_steps=3), to=sender)
        ended = stream_until_result(router, streamed)
        assert ended.lease_id == 7 and P.unpack_u8(ended.status).tolist() == [0, 0]
        last = stream_until_result(router, streamed)
        assert last.lease_id == 9 and P.unpack_i32(last.counts).tolist() == [3, 3]
    made = P.unpack_i32(ended.counts).tolist()[0] + 3
    assert streamed[1] == streamed[2] and len(streamed[1]) == made   # each token once, none missed
    assert worker.leases.num_revokes_ignored == 0


def test_bench_timeline_reports_the_longest_request_as_a_floor_of_the_run():
    from qmigrate.bench.timeline import Timeline
    t = Timeline([3, 1, 3], t0=10.0)
    t.add(0, 1, 10.5)
    t.add(1, 1, 10.6)
    t.add(2, 1, 10.7)
    t.add(0, 2, 11.0)   # request 0 (3 tokens) ends at 1.0 s
    t.add(2, 2, 12.5)   # request 2 (3 tokens) ends at 2.5 s: the later of the two longest
    r = t.result("pipeline", end=12.6)
    assert r.longest_request_s == pytest.approx(2.5)
    assert r.summary()["longest_request_s"] == pytest.approx(2.5)
    assert r.ttft_s == pytest.approx([0.5, 0.6, 0.7])
    assert r.tpot_s == pytest.approx([0.25, 0.9])


class _Copy:
    """A stand-in for the CUDA event of a queued device-to-host copy."""

    def __init__(self, done: bool = False):
        self.done = done
        self.waited = False

    def query(self) -> bool:
        return self.done

    def synchronize(self) -> None:
        self.waited, self.done = True, True


def test_kv_shipments_go_once_their_copy_has_landed_and_in_order():
    sent = []
    box = KVOutbox()
    box.add(None, lambda: sent.append("now"))          # nothing on the device: at once
    first, second = _Copy(), _Copy(done=True)
    box.add(first, lambda: sent.append("first"))
    box.add(second, lambda: sent.append("second"))     # ready, but behind one that is not
    assert sent == ["now"] and len(box) == 2
    assert box.flush() == 0 and sent == ["now"]
    first.done = True
    assert box.flush() == 2 and sent == ["now", "first", "second"] and len(box) == 0
    last = _Copy()
    box.add(last, lambda: sent.append("last"))
    assert box.flush(wait=True) == 1 and last.waited and sent[-1] == "last"   # leaving: wait for it


def test_the_host_tier_grows_only_after_half_a_second_without_a_lease():
    """A GPU worker page-locks its host tier a piece at a time in its loop, never between a busy
    run's leases: only once it has had none queued or on the device for GROW_TIER_IDLE_S."""
    from types import SimpleNamespace

    from qmigrate.worker.loop import GROW_TIER_IDLE_S, Worker
    grown = []
    worker = Worker.__new__(Worker)
    worker.leases = SimpleNamespace(queued=["lease"], on_device=[])
    worker.core = SimpleNamespace(engine=SimpleNamespace(grow_tier=lambda: grown.append(1) or True))
    worker.last_busy = 0.0
    worker.note_busy(100.0)
    worker.leases.queued = []
    assert not worker.grow_while_idle(100.0 + GROW_TIER_IDLE_S / 2) and not grown
    worker.note_busy(100.0 + GROW_TIER_IDLE_S / 2)                  # nothing queued: still idle since 100
    assert worker.grow_while_idle(100.0 + GROW_TIER_IDLE_S) and grown == [1]
    worker.leases.on_device = ["lease"]
    worker.note_busy(101.0)
    worker.leases.on_device = []
    assert not worker.grow_while_idle(101.0 + GROW_TIER_IDLE_S / 2) and grown == [1]
    worker.core.engine.grow_tier = lambda: False                    # the tier is whole, or there is none
    assert not worker.grow_while_idle(103.0)
