"""One place at a time under random admissions, leases, results, expiries, deaths, restarts
and drains; what a vanished worker's sequences resend.

Times are plain floats; nothing here sleeps.
"""

from __future__ import annotations

import random
from collections import Counter

import pytest

from qmigrate.config import RouterConfig
from qmigrate.router.scheduler import Grant, Scheduler, WorkerState
from qmigrate.wire.protocol import CONTINUE, Finish
from scheduler_util import (
    ask, check_invariants, dead_fleet, diff_ids, full_ids, give, join, make_sched, migrations,
    report, row_ids, spec,
)


# --- one place at a time, under random operations ---------------------------------------

NAMES = ("w0", "w1", "w2")


class FleetSim:
    """Random admissions, leases, results, expiries, deaths, restarts and drains."""

    def __init__(self, seed: int, **config):
        self.rng = random.Random(seed)
        config.setdefault("chain_leases", False)
        self.s = Scheduler(RouterConfig(max_queued=24, lease_timeout_s=10.0, heartbeat_timeout_s=5.0,
                                           rebalance_threshold=3, link_gbps=10.0, prefill_tflops=100.0,
                                           **config))
        self.now = 0.0
        self.next_id = 1
        self.live: set[int] = set()
        self.grants: dict[int, Grant] = {}
        self.frozen: set[str] = set()
        for name in NAMES:
            self.restart(name)

    def restart(self, name: str) -> None:
        r = self.rng
        self.s.register(WorkerState(name, max_seqs=r.randint(1, 6), max_tokens=r.choice([8, 64, 4096]),
                                    inflight=r.randint(1, 2), kv_endpoint=f"tcp://{name}:1",
                                    gpu_uuid=f"GPU-{name}", kv_bytes_per_token=10_000,
                                    num_params=10**9, kv_tokens=2000, block_size=16), self.now)
        self.frozen.discard(name)

    def op_admit(self) -> None:
        specs = []
        for _ in range(self.rng.randint(1, 3)):
            specs.append(spec(self.next_id, prompt_len=self.rng.randint(2, 150)))
            self.next_id += 1
        room = self.s.num_free
        taken = self.s.admit(specs)
        assert taken == min(room, len(specs))
        self.live |= {sp.seq_id for sp in specs[:taken]}

    def op_schedule(self) -> None:
        name = self.rng.choice(NAMES)
        if name in self.frozen:
            return
        w = self.s.workers[name]
        owners = {sid: seq.owner for sid, seq in self.s.seqs.items()}
        lengths = {sid: len(seq.token_ids) for sid, seq in self.s.seqs.items()}
        free = self.rng.choice([None, None, 60, 400])
        grant = ask(self.s, name, self.now, max_seqs=self.rng.randint(1, 8),
                    max_tokens=self.rng.choice([1, 16, 200, 10_000]), free_kv_tokens=free)
        if not w.alive or w.draining:
            assert grant is None
            return
        if grant is None:
            return
        ids = row_ids(grant)
        assert len(ids) == len(set(ids))
        assert len(ids) <= w.max_seqs
        if free is not None:  # new sequences fit the free KV tokens, a block of headroom each
            assert sum(lengths[i] + w.block_size for i in full_ids(grant)) <= free
        assert not set(grant.drop_ids) & set(diff_ids(grant))
        for row in grant.rows:
            if row.length == CONTINUE:  # the next step of a batch this worker is running
                seq = self.s.seqs[row.seq_id]
                assert row.spec is None and seq.next_lease == grant.lease_id
                assert self.s.leases[seq.lease_id].worker == name
                continue
            assert row.length == lengths[row.seq_id]
            # a diff goes only to the worker that holds the KV
            assert (row.spec is None) == (owners[row.seq_id] == name)
            if row.spec is not None:
                assert row.spec.ids.tolist() == self.s.seqs[row.seq_id].token_ids
        shipped = {sid: (owner, dest, tid, n) for owner, sid, dest, tid, n, _, _ in grant.shipments}
        for row in grant.rows:
            if row.length == CONTINUE:
                continue
            if row.seq_id in shipped:
                owner, dest, tid, n = shipped[row.seq_id]
                assert owner == owners[row.seq_id] and owner != name
                assert (dest, n) == (w.kv_endpoint, lengths[row.seq_id] - 1)
                assert (row.spec.kv_from, row.spec.transfer_id) == (f"tcp://{owner}:1", tid)
            elif row.spec is not None:
                assert (row.spec.kv_from, row.spec.transfer_id) == ("", 0)
        self.grants[grant.lease_id] = grant

    def op_report(self) -> None:
        if not self.grants:
            return
        if self.s.config.chain_leases:
            # Chained batches are reported in the order they were given, as one socket delivers them.
            name = self.rng.choice(sorted({g.worker for g in self.grants.values()}))
            lease_id = min(i for i, g in self.grants.items() if g.worker == name)
        else:
            lease_id = self.rng.choice(sorted(self.grants))
        grant = self.grants.pop(lease_id)
        expected = lease_id in self.s.leases
        held = {r.seq_id for r in grant.rows if r.seq_id in self.s.seqs
                and self.s.seqs[r.seq_id].lease_id == lease_id}
        before = {sid: len(seq.token_ids) for sid, seq in self.s.seqs.items()}
        num_stale = self.s.counters["stale_results"]
        queue = list(self.s.queue)
        codes = {r.seq_id: self.rng.choices(
            [Finish.NONE, Finish.NEED_IDS, Finish.EOS, Finish.LENGTH], [88, 6, 3, 3])[0] for r in grant.rows}
        skip = tuple(r.seq_id for r in grant.rows if self.rng.random() < 0.05)
        out = report(self.s, grant, self.now, codes=codes, skip=skip)
        assert out.accepted == expected
        if not expected:
            assert self.s.counters["stale_results"] == num_stale + 1
            assert list(self.s.queue) == queue
            assert {sid: len(seq.token_ids) for sid, seq in self.s.seqs.items()} == before
            return
        finished = {sid for sid, _ in out.finished}
        assert finished == {sid for sid, c in codes.items() if c.is_finished and sid not in skip
                            and sid in held}
        self.live -= finished
        for sid, code in codes.items():
            if code == Finish.NONE and sid not in skip and sid in held:
                assert len(self.s.seqs[sid].token_ids) == before[sid] + 1
            elif sid not in held and sid in self.s.seqs:
                assert len(self.s.seqs[sid].token_ids) == before[sid]  # not its lease: ignored

    def op_tick(self) -> None:
        self.now += self.rng.uniform(0.2, 3.0)
        for name in NAMES:
            if name not in self.frozen:
                self.s.touch(name, self.now)
        for lease_id in self.s.expire(self.now):
            assert lease_id not in self.s.leases

    def op_freeze(self) -> None:
        self.frozen.add(self.rng.choice(NAMES))  # stops talking: will be declared dead

    def op_restart(self) -> None:
        name = self.rng.choice(NAMES)
        if name in self.frozen or not self.s.workers[name].alive:
            self.restart(name)

    def op_drain(self) -> None:
        self.s.drain(self.rng.choice(NAMES))

    def op_retire(self) -> None:
        for name, w in self.s.workers.items():
            if w.alive and w.draining and self.s.is_drained(name):
                self.s.retire(name)

    def op_vram(self) -> None:
        self.s.set_free_vram(f"GPU-{self.rng.choice(NAMES)}", self.rng.uniform(0.0, 0.3))

    OPS = ("admit", "schedule", "report", "tick", "freeze", "restart", "drain", "retire", "vram")
    WEIGHTS = (10, 35, 30, 12, 1, 3, 1, 3, 4)

    def run(self, num_steps: int) -> None:
        for _ in range(num_steps):
            op = self.rng.choices(self.OPS, self.WEIGHTS)[0]
            getattr(self, f"op_{op}")()
            check_invariants(self.s)
            assert set(self.s.seqs) == self.live

    def finish_everything(self) -> None:
        """Bring every worker back and run to completion: nothing was lost on the way."""
        self.now += 100.0
        self.s.expire(self.now)
        for name in NAMES:
            self.restart(name)
        for _ in range(500):
            if not self.live:
                break
            for name in NAMES:
                grant = ask(self.s, name, self.now)
                if grant is not None:
                    out = report(self.s, grant, self.now, codes={r.seq_id: Finish.EOS for r in grant.rows})
                    self.live -= {sid for sid, _ in out.finished}
                check_invariants(self.s)
        assert not self.live and not self.s.seqs and not self.s.queue and not self.s.leases


@pytest.mark.parametrize("seed, config", [
    (1, {}), (10, {}), (3, {"policy": "any"}), (4, {"migration": "transfer"}),
    (5, {"migration": "recompute", "migrate_on_load": False}), (6, {"min_free_vram_fraction": 0.2}),
    (7, {"chain_leases": True}), (8, {"chain_leases": True, "migration": "transfer"}),
    (9, {"chain_leases": True, "migrate_on_load": False}),
    (10, {"chain_leases": True, "max_lease_steps": 4}), (11, {"max_lease_steps": 1}),
    (12, {"spread_new_work": False}), (13, {"spread_new_work": False, "chain_leases": True, "migration": "transfer"}),
])
def test_one_place_at_a_time_under_random_operations(seed, config):
    sim = FleetSim(seed, **config)
    sim.run(400)
    c = sim.s.counters
    assert c["leases"] > 20 and c["finished"] > 0
    assert c["leases_expired"] + c["workers_lost"] + c["stale_results"] > 0
    sim.finish_everything()


def test_the_random_operations_reach_every_event():
    totals = Counter()
    for seed in range(1, 7):
        sim = FleetSim(seed)
        sim.run(400)
        totals += sim.s.counters
    for key in ("leases_expired", "workers_lost", "stale_results", "resends", "migrations_dead",
                "migrations_drain", "migrations_load", "migrations_memory", "migrations_by_transfer"):
        assert totals[key] > 0, key


def test_sequences_of_a_vanished_worker_are_resent_to_the_detokenizer():
    s = dead_fleet()
    give(s, "w0", [1, 2])
    s.admit([spec(3)])
    held = ask(s, "w0", now=1.0)          # sequence 3's first step, leased when w0 vanishes
    assert 3 in row_ids(held)
    s.touch("w1", 7.0)
    s.expire(7.0)
    g = ask(s, "w1", now=7.0)
    assert sorted(full_ids(g)) == [1, 2, 3]
    assert all(r.spec.resend_from == 0 for r in g.rows)  # tokens w0 reported may be unseen
    assert migrations(s)["migrations_dead"] == 3


def test_an_orderly_migration_does_not_resend():
    s = make_sched(rebalance_threshold=2)
    join(s, "w0", max_seqs=2, inflight=4)
    join(s, "w1")
    give(s, "w0", [1, 2, 3, 4])
    g = ask(s, "w1")
    assert full_ids(g) and all(r.spec.resend_from == -1 for r in g.rows)
