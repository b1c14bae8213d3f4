"""Admission and migration follow each GPU's free memory, through the public Scheduler API.

Two watermarks: below `admit_free_vram_fraction` a worker takes no new prefills (it still
steps the sequences whose KV it holds); below `min_free_vram_fraction` its sequences migrate
off with cause "memory" to any worker that may take them.
"""

from __future__ import annotations

import pytest

from qmigrate.wire.protocol import Finish, SeqSpec, pack_i32
from qmigrate.config import RouterConfig
from qmigrate.router.scheduler import Scheduler, WorkerState


def spec(seq_id: int) -> SeqSpec:
    return SeqSpec(seq_id, pack_i32([1, 5, 6, 7]), 4, 64, eos_ids=[2])


def fleet(**config) -> Scheduler:
    # spread_new_work off: each test places the work on the worker it names
    s = Scheduler(RouterConfig(heartbeat_timeout_s=1e9, chain_leases=False, migrate_on_load=False, spread_new_work=False,
                                  min_free_vram_fraction=0.05, admit_free_vram_fraction=0.10, **config))
    for name in ("w0", "w1"):
        s.register(WorkerState(name, max_seqs=8, max_tokens=4096, gpu_uuid=f"GPU-{name}"), 0.0)
    return s


def step(s: Scheduler, name: str):
    """Ask for a batch as `name` and complete it with one token a row; the rows' ids."""
    grant = s.schedule(name, 64, 1 << 20, 0.0)
    if grant is None:
        return []
    ids = [r.seq_id for r in grant.rows]
    s.complete(grant.lease_id, name, ids, [1] * len(ids), [9] * len(ids), [int(Finish.NONE)] * len(ids), 0.0)
    return ids


def test_below_the_admission_watermark_a_worker_takes_no_new_prefills_but_keeps_decoding():
    s = fleet()
    s.admit([spec(1), spec(2)])
    assert step(s, "w0") == [1, 2]
    s.set_free_vram("GPU-w0", 0.08)
    assert not s.workers["w0"].may_prefill and not s.workers["w0"].is_memory_short
    s.admit([spec(3)])
    assert step(s, "w0") == [1, 2]           # its own sequences only
    assert step(s, "w1") == [3]              # the new one goes where memory is
    s.set_free_vram("GPU-w0", 0.5)
    s.admit([spec(4)])
    assert step(s, "w0") == [1, 2, 4]        # admission resumes when memory comes back
    assert not any(k.startswith("migrations_") for k in s.counters)


def test_below_the_migration_watermark_sequences_move_off_with_cause_memory():
    s = fleet()
    s.admit([spec(1), spec(2)])
    step(s, "w0")
    s.set_free_vram("GPU-w0", 0.01)
    assert s.workers["w0"].is_memory_short
    assert step(s, "w0") == []               # it asks first, yet leaves them to w1
    assert sorted(step(s, "w1")) == [1, 2]
    assert s.counters["migrations_memory"] == 2
    assert step(s, "w1") == [1, 2]           # and they stay there


def test_a_short_worker_keeps_its_sequences_when_no_other_worker_may_take_them():
    s = fleet()
    s.admit([spec(1)])
    step(s, "w0")
    s.set_free_vram("GPU-w0", 0.01)
    s.set_free_vram("GPU-w1", 0.02)          # both short: moving would only add a prefill
    assert step(s, "w1") == []
    assert step(s, "w0") == [1]
    assert s.counters["migrations_memory"] == 0


def test_memory_rules_switched_off_leave_sequences_in_place():
    s = fleet(migrate_on_memory=False)
    s.admit([spec(1)])
    step(s, "w0")
    s.set_free_vram("GPU-w0", 0.0)
    assert step(s, "w1") == [] and step(s, "w0") == [1]


def test_the_admission_watermark_is_never_below_the_migration_one():
    config = RouterConfig(min_free_vram_fraction=0.2, admit_free_vram_fraction=0.1)
    assert config.admit_free_vram_fraction == 0.2


# --- the fleet's own memory is not pressure --------------------------------------------------
GiB = 1 << 30


def test_a_worker_whose_pool_fills_its_gpu_is_still_handed_work():
    s = fleet()
    s.workers["w0"].held_bytes = 72 * GiB            # weights, KV pool and graphs: 90% of the GPU
    s.set_vram("GPU-w0", 80 * GiB, 7 * GiB)          # NVML: under 9% free
    assert s.free_vram_fraction("GPU-w0") == 7 / 8
    assert s.workers["w0"].may_prefill and not s.workers["w0"].is_memory_short
    s.admit([spec(1), spec(2)])
    assert step(s, "w0") == [1, 2]


def test_memory_another_process_takes_is_still_pressure():
    s = fleet()
    s.workers["w0"].held_bytes = 40 * GiB
    s.set_vram("GPU-w0", 80 * GiB, 1 * GiB)          # another process holds 39 GiB
    assert s.workers["w0"].is_memory_short and not s.workers["w0"].may_prefill
    s.admit([spec(1)])
    assert step(s, "w0") == [] and step(s, "w1") == [1]


def test_several_workers_on_one_gpu_count_together():
    s = Scheduler(RouterConfig(heartbeat_timeout_s=1e9, chain_leases=False, spread_new_work=False))
    for name in ("a", "b"):
        s.register(WorkerState(name, max_seqs=8, max_tokens=4096, gpu_uuid="GPU-0", held_bytes=38 * GiB), 0.0)
    s.set_vram("GPU-0", 80 * GiB, 2 * GiB)           # 76 GiB held by the two: 2 of 4 free
    assert s.workers["a"].may_prefill and s.workers["b"].may_prefill
    s.retire("b")                                    # b's memory no longer belongs to the fleet
    s.set_vram("GPU-0", 80 * GiB, 2 * GiB)
    assert not s.workers["a"].may_prefill


def test_a_report_that_came_before_the_worker_joined_is_applied_with_its_holdings():
    s = Scheduler(RouterConfig(heartbeat_timeout_s=1e9))
    s.set_vram("GPU-0", 80 * GiB, 2 * GiB)
    s.register(WorkerState("a", max_seqs=8, max_tokens=4096, gpu_uuid="GPU-0", held_bytes=76 * GiB), 0.0)
    assert s.workers["a"].may_prefill
    s.register(WorkerState("c", max_seqs=8, max_tokens=4096, gpu_uuid="GPU-1"), 0.0)
    s.set_vram("GPU-1", 80 * GiB, 2 * GiB)
    assert not s.workers["c"].may_prefill            # holds nothing it reported: all pressure
    s.set_held("c", 76 * GiB)                        # its heartbeat says what it holds
    assert s.workers["c"].may_prefill
    s.set_held("c", -1)                              # unknown (an older worker): kept as it was
    assert s.workers["c"].held_bytes == 76 * GiB


def test_the_router_reads_holdings_from_hello_and_heartbeat(tmp_path):
    from qmigrate.config import parse_topology
    from qmigrate.router.loop import Router
    from qmigrate.wire import protocol as P
    from qmigrate.wire import codec
    topo = parse_topology({
        "transport": "ipc", "ipc_dir": str(tmp_path / "ipc"), "nodes": [{"name": "n1"}],
        "router": {"node": "n1"}, "ingest": {"node": "n1"}, "detokenizer": {"node": "n1"},
        "workers": [{"name": "w1", "node": "n1"}]})
    r = Router(topo)
    r.reply = lambda to, msg: None
    try:
        info = {"device": "cuda:0", "kv_tokens": 1024, "block_size": 16, "gpu_uuid": "GPU-x",
                "held_bytes": 70 * GiB}
        r.on_hello(b"w1", P.Hello("worker", "w1", info=info))
        r.on_vram(codec.decode(codec.encode(P.VramReport("n1", [["GPU-x", 0, 80 * GiB, 79 * GiB, 1 * GiB, 99]]))))
        w = r.sched.workers["w1"]
        assert w.may_prefill and w.free_vram_fraction == 0.1
        beat = codec.decode(codec.encode(P.Heartbeat("w1", 0, 10, 0, 0, b"", 75 * GiB)))
        r.on_heartbeat(b"w1", beat)
        assert w.free_vram_fraction == 0.2
        r.on_vram(P.VramReport("n1", [["GPU-x", 0, 80 * GiB, 80 * GiB, 0, 100]]))  # none free: a report still
        assert w.is_memory_short and r.errors["malformed"] == 0
    finally:
        r.work.close(linger=0)
        r.telemetry.close(linger=0)


def test_a_heartbeat_from_an_older_worker_decodes_with_holdings_unknown():
    import msgpack
    from qmigrate.wire import protocol as P
    from qmigrate.wire import codec
    old = msgpack.packb([int(P.MsgType.HEARTBEAT), "w1", 0, 10, 0, 0, b""])
    assert codec.decode(old).held_bytes == -1
    assert codec.decode(codec.encode(P.Heartbeat("w1", held_bytes=5))).held_bytes == 5


@pytest.mark.parametrize("path", ["configs/gpu-node.yaml", "configs/h100-bench.yaml"])
def test_the_shipped_gpu_topologies_admit_work_with_their_default_watermarks(path):
    """As shipped: a monitor on the GPU node, the default watermarks, and workers that fill
    their share of the GPU; the router must still hand them work."""
    from pathlib import Path
    from qmigrate.config import load_topology
    topo = load_topology(Path(__file__).parent.parent / path)
    gpu_nodes = {w.node for w in topo.workers if w.device.startswith("cuda")}
    assert gpu_nodes and all(topo.node(n).monitor for n in gpu_nodes)
    rc = topo.router
    s = Scheduler(RouterConfig(heartbeat_timeout_s=1e9, min_free_vram_fraction=rc.min_free_vram_fraction,
                               admit_free_vram_fraction=rc.admit_free_vram_fraction))
    total = 80 * GiB
    for i, w in enumerate(topo.workers):
        held = int(w.gpu_memory_utilization * total)
        s.register(WorkerState(w.name, max_seqs=w.max_num_seqs, max_tokens=w.max_num_batched_tokens,
                               gpu_uuid=f"GPU-{i}", held_bytes=held), 0.0)
        # besides: the CUDA context and kernel images, outside the allocator (NVML: under 7% free)
        s.set_vram(f"GPU-{i}", total, total - held - 3 * GiB)
    s.admit([spec(i) for i in range(1, 5)])
    assert all(s.schedule(w.name, 64, 1 << 20, 0.0) is not None for w in topo.workers[:1])
    assert all(w.may_prefill and not w.is_memory_short for w in s.workers.values())
