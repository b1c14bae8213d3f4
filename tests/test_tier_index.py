"""The router's side of the host KV tier: the index of which worker holds which block on which
tier, placement that weighs a tier's copy cost, the tier report's wire form, and the per-tier
figures in Prometheus and `qmigrate status`. Pure bookkeeping."""

from __future__ import annotations

import io

import pytest

from qmigrate.ops.observe import GPU_COLUMNS, WORKER_COLUMNS, FleetObserver, as_dicts
from qmigrate.router.prefix_index import HOST_COPY_COST, PrefixIndex, score
from qmigrate.router.records import Seq
from qmigrate.wire import codec
from qmigrate.wire import protocol as P
from qmigrate.wire.prefix_keys import block_keys

from test_prefix_placement import BS, SYSTEMS, ask, ids_of, join, make_sched, prompt, spec


def test_the_index_counts_a_chain_across_both_tiers():
    index = PrefixIndex()
    keys = block_keys(SYSTEMS[0], BS)
    index.apply("a", keys[:1])           # a: the first block on its GPU, the rest on its host tier
    index.apply_tier("a", keys[1:])
    index.apply("b", keys[:2])
    host: dict[str, int] = {}
    assert index.match(keys, host) == {"a": 4, "b": 2}
    assert host == {"a": 3}
    index.apply_tier("a", [~keys[2]])    # dropped from the host tier: the chain ends before it
    host.clear()
    assert index.match(keys, host) == {"a": 2, "b": 2} and host == {"a": 1}
    index.apply("a", keys[1:2])          # copied back to the GPU: held on both, counted as GPU
    host.clear()
    assert index.match(keys, host) == {"a": 2, "b": 2} and host == {}
    index.forget("a")
    assert index.match(keys) == {"b": 2} and not index.host


def test_a_host_hit_scores_below_a_gpu_hit_and_above_none():
    s = make_sched()
    a, b, c = join(s, "a"), join(s, "b"), join(s, "c")
    seq = Seq(spec(1, prompt(0, 1)), prompt(0, 1))
    hits, host = {"a": 3, "b": 3}, {"b": 3}
    assert score(seq, a, hits, host) > score(seq, b, hits, host) > score(seq, c, hits, host)
    assert score(seq, a, hits, host) - score(seq, b, hits, host) == 3 * BS * HOST_COPY_COST


def test_a_sequence_waits_for_the_worker_holding_its_prefix_on_the_host_tier():
    s = make_sched(spread_new_work=False)
    join(s, "a")
    join(s, "b")
    s.tier_report("b", block_keys(SYSTEMS[0], BS), [0, 0, 4, 0, 0, 0])
    s.admit([spec(i, prompt(0, i)) for i in range(4)])
    assert ids_of(ask(s, "a")) == []                 # b holds them (on its host tier) and has room
    assert sorted(ids_of(ask(s, "b"))) == [0, 1, 2, 3]
    assert s.tier_stats["b"] == [0, 0, 4, 0, 0, 0]


def test_the_tier_report_travels_and_is_checked():
    msg = P.StepResult(1, P.pack_i64([5]), P.pack_i32([1]), P.pack_i32([9]), P.pack_u8([0]),
                       tier_events=P.pack_i64([7, ~7]), tier_stats=P.pack_i64([1, 2, 3, 4, 5, 6]))
    assert codec.decode(codec.encode(msg)) == msg
    old = P.StepResult(1, P.pack_i64([5]), P.pack_i32([1]), P.pack_i32([9]), P.pack_u8([0]))
    assert codec.decode(codec.encode(old)).tier_stats == b""
    for bad in (P.pack_i64([1, 2]), P.pack_i64([1, 2, 3, 4, 5, -6])):
        with pytest.raises(P.ProtocolError, match="tier_stats"):
            codec.decode(codec.encode(P.StepResult(1, P.pack_i64([5]), P.pack_i32([1]), P.pack_i32([9]),
                                                   P.pack_u8([0]), tier_stats=bad)))
    with pytest.raises(P.ProtocolError, match="tier_events"):
        codec.decode(codec.encode(P.StepResult(1, P.pack_i64([5]), P.pack_i32([1]), P.pack_i32([9]),
                                               P.pack_u8([0]), tier_events=b"abc")))


def _fleet():
    s = make_sched()
    join(s, "w1", kv_tokens=1600, gpu_uuid="GPU-a")
    join(s, "w2", kv_tokens=1600)
    obs = FleetObserver()
    obs.joined("w1", "n1", "cuda:0", 0.0)
    obs.joined("w2", "n1", "cuda:1", 0.0)
    s.tier_report("w1", [], [40, 10, 300, 25, 3 << 30, 1 << 30])
    return s, obs


def test_tier_metrics_per_worker_and_tier():
    from prometheus_client import generate_latest

    from qmigrate.ops.metrics import RouterMetrics
    s, obs = _fleet()
    m = RouterMetrics()
    m.update(s, obs, {})
    s.tier_report("w1", [], [40, 12, 300, 30, 3 << 30, 2 << 30])
    m.update(s, obs, {})
    text = generate_latest(m.registry).decode()
    for line in ('qmigrate_kv_tier_blocks{tier="host",worker="w1"} 300.0',
                 'qmigrate_kv_tier_blocks{tier="gpu",worker="w1"} 40.0',
                 'qmigrate_kv_tier_hits_total{tier="host",worker="w1"} 30.0',
                 'qmigrate_kv_tier_hits_total{tier="gpu",worker="w1"} 12.0',
                 'qmigrate_kv_tier_bytes_total{direction="out",tier="host",worker="w1"} 2.147483648e+09'):
        assert line in text, line
    assert 'worker="w2"' not in text.split("qmigrate_kv_tier_blocks")[1].split("# HELP")[0]   # no tier


def test_status_shows_the_tiers_of_workers_that_have_one():
    from rich.console import Console

    from qmigrate.ops.status import render
    s, obs = _fleet()
    workers, gpus = obs.snapshot(s)
    snap = {"router": {}, "workers": as_dicts(WORKER_COLUMNS, workers), "gpus": as_dicts(GPU_COLUMNS, gpus)}
    out = io.StringIO()
    Console(file=out, width=80).print(render(snap, "tcp://head:5550"))
    text = out.getvalue()
    assert "  w1 gpu 40/10, host 300/25, 3.0/1.0\n" in text, text
    assert "w2 gpu" not in text


# --- pulls ---------------------------------------------------------------------------------------

def _pull_fleet(pull: str, **holder):
    """b holds group 1's system prompt (on its host tier) but is full; a takes the sequences."""
    s = make_sched(spread_new_work=False, prefix_pull=pull)
    join(s, "a", kv_endpoint="tcp://a:1")
    b = join(s, "b", max_seqs=2, inflight=1, kv_endpoint="tcp://b:1", **holder)
    s.tier_report("b", block_keys(SYSTEMS[1], BS), None)
    s.admit([spec(100 + i, [200 + i] * 40) for i in range(2)])
    assert len(ids_of(ask(s, "b"))) == 2 and b.load >= b.capacity
    s.admit([spec(1, prompt(1, 1))])
    return s, ask(s, "a")


def test_a_worker_pulls_a_prefix_another_holds():
    s, grant = _pull_fleet("always")
    assert grant is None   # the sequence waits for its prefix, leased to nobody; a runs on meanwhile
    (owner, sid, dest, transfer_id, num_tokens, start, keys), = s.take_shipments()
    assert (owner, sid, dest, start) == ("b", 1, "tcp://a:1", 0)
    assert num_tokens == 4 * BS and keys == block_keys(SYSTEMS[1], BS)
    assert s.counters["prefix_pulls"] == 1
    assert ask(s, "a", now=0.5) is None and s.take_shipments() == []   # not there yet, not pulled twice
    s.kv_arrived("b", [transfer_id])   # only the taker's word counts
    assert ask(s, "a", now=0.6) is None
    s.kv_arrived("a", [transfer_id])
    grant = ask(s, "a", now=0.7)
    assert ids_of(grant) == [1] and grant.shipments == []
    row = grant.rows[0]
    assert row.spec.kv_from == "tcp://b:1" and row.spec.transfer_id == transfer_id


def test_a_pull_that_does_not_arrive_in_time_is_prefilled():
    from qmigrate.router.leasing import PULL_WAIT_S
    s, _ = _pull_fleet("always")
    (_, _, _, transfer_id, *_), = s.take_shipments()
    join(s, "c", kv_endpoint="tcp://c:1")
    assert ask(s, "c", now=1.0) is None   # on its way to a: nobody else takes it meanwhile
    grant = ask(s, "c", now=PULL_WAIT_S + 0.1)   # given up: prefilled where it goes, never pulled again
    assert ids_of(grant) == [1] and grant.shipments == [] and not grant.rows[0].spec.kv_from
    assert s.counters["prefix_pulls_given_up"] == 1 and s.take_shipments() == []
    s.kv_arrived("a", [transfer_id])   # too late: nothing changes
    assert s.seqs[1].pull is None


def test_a_pull_whose_taker_dies_is_prefilled_elsewhere():
    s, _ = _pull_fleet("always")
    assert len(s.take_shipments()) == 1
    join(s, "c", kv_endpoint="tcp://c:1")
    s.workers["a"].alive = False
    grant = ask(s, "c", now=0.1)
    assert ids_of(grant) == [1] and not grant.rows[0].spec.kv_from


def test_a_pull_that_costs_more_than_prefill_is_not_made():
    # a model so small that 64 tokens prefill faster than their KV crosses a 10 Gb/s link
    s, grant = _pull_fleet("auto", kv_bytes_per_token=1 << 20, num_params=1000)
    assert ids_of(grant) == [1] and grant.shipments == [] and not grant.rows[0].spec.kv_from
    assert s.take_shipments() == []
    # an 8B model: shipping 64 tokens of KV beats computing them
    s, grant = _pull_fleet("auto", kv_bytes_per_token=128 << 10, num_params=8 << 30)
    assert grant is None and len(s.take_shipments()) == 1
    s, grant = _pull_fleet("never", kv_bytes_per_token=128 << 10, num_params=8 << 30)
    assert ids_of(grant) == [1] and grant.shipments == [] and s.take_shipments() == []


def test_a_prefix_pull_request_travels_and_is_checked():
    msg = P.ShipKV(1, "tcp://a:1", 77, 64, 16, keys=P.pack_i64([3, 4, 5]))
    assert codec.decode(codec.encode(msg)) == msg
    with pytest.raises(P.ProtocolError, match="prefix pull"):
        codec.decode(codec.encode(P.ShipKV(1, "tcp://a:1", 77, 16, 16, keys=P.pack_i64([3]))))


def test_a_pull_is_costed_at_the_prefill_rate_the_worker_measured():
    # an 8B model: at the prefill_tflops setting (100 TFLOP/s) shipping 64 tokens of KV over a
    # 10 Gb/s link looks cheaper than prefilling them (the case above); a taker that measured
    # 40,000 prompt tokens a second at its start prefills them in 1.6 ms, a fifth of the shipment
    kw = {"kv_bytes_per_token": 128 << 10, "num_params": 8 << 30}
    s = make_sched(spread_new_work=False, prefix_pull="auto")
    join(s, "a", kv_endpoint="tcp://a:1", prefill_tokens_per_s=40_000, **kw)
    b = join(s, "b", max_seqs=2, inflight=1, kv_endpoint="tcp://b:1", **kw)
    s.tier_report("b", block_keys(SYSTEMS[1], BS), None)
    s.admit([spec(100 + i, [200 + i] * 40) for i in range(2)])
    assert len(ids_of(ask(s, "b"))) == 2 and b.load >= b.capacity
    s.admit([spec(1, prompt(1, 1))])
    grant = ask(s, "a")
    assert ids_of(grant) == [1] and grant.shipments == [] and not grant.rows[0].spec.kv_from
    assert s.counters["prefix_pulls"] == 0


def test_a_workers_measured_prefill_rate_comes_with_its_hello():
    from qmigrate.router.messages import worker_state
    hello = P.Hello("worker", "w0", info={"max_seqs": 8, "prefill_tokens_per_s": 52_000})
    state, _, _ = worker_state(hello, 1024, 10 ** 9)
    assert state.prefill_tokens_per_s == 52_000
    assert worker_state(P.Hello("worker", "w0", info={}), 1024, 10 ** 9)[0].prefill_tokens_per_s == 0
    for bad in (-1, 1.5, "fast"):
        with pytest.raises(P.ProtocolError, match="prefill_tokens_per_s"):
            worker_state(P.Hello("worker", "w0", info={"prefill_tokens_per_s": bad}), 1024, 10 ** 9)


def test_a_workers_heartbeat_says_which_shipments_reached_it():
    from qmigrate.worker.core import WorkerCore
    core = WorkerCore.__new__(WorkerCore)
    core.transfers, core.arrived = {}, []
    core.receive_transfer(77, 1, None)
    core.receive_transfer(78, 2, None)
    assert core.arrived == [77, 78]
    beat = P.Heartbeat("a", kv_arrived=P.pack_i64(core.arrived))
    assert P.unpack_i64(codec.decode(codec.encode(beat)).kv_arrived, "kv_arrived").tolist() == [77, 78]
