"""Admission and migration follow each GPU's free memory, through the public Scheduler API.

Two watermarks: below `admit_free_vram_fraction` a worker takes no new prefills (it still
steps the sequences whose KV it holds); below `min_free_vram_fraction` its sequences migrate
off with cause "memory" to any worker that may take them.
"""

from __future__ import annotations

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
