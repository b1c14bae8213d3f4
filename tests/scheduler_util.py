"""What the scheduler's tests share: specs, a scheduler, workers that join, ask and report as
a worker would, and the bookkeeping's invariants (one place at a time)."""

from __future__ import annotations

from qmigrate.config import RouterConfig
from qmigrate.router.scheduler import Grant, Scheduler, WorkerState
from qmigrate.wire.protocol import Finish, SeqSpec, pack_i32

TOKEN = 77  # what the fake workers below "sample"


def spec(seq_id: int, prompt_len: int = 4, max_new_tokens: int = 64) -> SeqSpec:
    ids = [1] + [3 + (seq_id * 31 + i) % 1000 for i in range(prompt_len - 1)]
    return SeqSpec(seq_id, pack_i32(ids), prompt_len, max_new_tokens, temperature=0.5, seed=seq_id,
                   stop_ids=[[9, 9]], eos_ids=[2])


def make_sched(**config) -> Scheduler:
    config.setdefault("heartbeat_timeout_s", 1e9)  # tests about death set it themselves
    config.setdefault("chain_leases", False)  # chained leases have tests of their own below
    # so that a test can place work on the worker it names; spreading has tests of its own
    config.setdefault("spread_new_work", False)
    return Scheduler(RouterConfig(**config))


def join(s: Scheduler, name: str, now: float = 0.0, **kw) -> WorkerState:
    kw = {"max_seqs": 8, "max_tokens": 4096, **kw}
    w = WorkerState(name, **kw)
    s.register(w, now)
    return w


def ask(s: Scheduler, name: str, now: float = 0.0, max_seqs: int = 64, max_tokens: int = 1 << 20,
        free_kv_tokens: int | None = None) -> Grant | None:
    return s.schedule(name, max_seqs, max_tokens, now, free_kv_tokens)


def report(s: Scheduler, grant: Grant, now: float = 0.0, codes: dict[int, Finish] | None = None,
           name: str | None = None, skip: tuple[int, ...] = ()):
    """Complete a grant the way a worker would: one token per row unless NEED_IDS."""
    codes = codes or {}
    seq_ids, counts, tokens, status = [], [], [], []
    for row in grant.rows:
        if row.seq_id in skip:
            continue
        code = codes.get(row.seq_id, Finish.NONE)
        seq_ids.append(row.seq_id)
        counts.append(0 if code == Finish.NEED_IDS else 1)
        tokens += [] if code == Finish.NEED_IDS else [TOKEN]
        status.append(int(code))
    return s.complete(grant.lease_id, name or grant.worker, seq_ids, counts, tokens, status, now)


def row_ids(grant: Grant | None) -> list[int]:
    return [] if grant is None else [r.seq_id for r in grant.rows]


def diff_ids(grant: Grant) -> list[int]:
    return [r.seq_id for r in grant.rows if r.spec is None]


def full_ids(grant: Grant) -> list[int]:
    return [r.seq_id for r in grant.rows if r.spec is not None]


def give(s: Scheduler, name: str, seq_ids: list[int], now: float = 0.0, prompt_len: int = 4) -> None:
    """Admit seq_ids and run one step of each on `name` (with whatever it already owns), in
    as many leases as its max_seqs needs."""
    s.admit([spec(i, prompt_len) for i in seq_ids])
    grants = []
    while (grant := ask(s, name, now)) is not None:
        grants.append(grant)
    assert {sid for g in grants for sid in row_ids(g)} >= set(seq_ids)
    for grant in grants:
        assert report(s, grant, now).accepted
    assert s.workers[name].owned >= set(seq_ids)


def dead_fleet() -> Scheduler:
    """Two workers that can ship KV, and timeouts a test can pass."""
    s = make_sched(heartbeat_timeout_s=5.0, lease_timeout_s=10.0, migration="transfer")
    for name in ("w0", "w1"):
        join(s, name, kv_endpoint=f"tcp://{name}:1", kv_bytes_per_token=1000, num_params=10**9)
    return s


def migrations(s: Scheduler) -> dict[str, int]:
    return {k: v for k, v in s.counters.items() if k.startswith("migrations_") and v}


def check_invariants(s: Scheduler) -> None:
    """One place at a time, and the owner bookkeeping agrees with itself.

    A lease record may still list a sequence it no longer holds (taken back, finished);
    only the current lease and a chained next lease, both at one worker, hold it."""
    assert set(s.queue) <= set(s.seqs)
    for sid, seq in s.seqs.items():
        holders = [i for i, lease in s.leases.items() if sid in lease.seq_ids
                   and i in (seq.lease_id, seq.next_lease)]
        if seq.lease_id is None:
            assert sid in s.queue and not holders and seq.next_lease is None, f"seq {sid} is lost"
        else:
            assert sid not in s.queue, f"seq {sid} is leased and queued"
            assert seq.lease_id in holders, f"seq {sid}'s lease is gone"
            if seq.next_lease is not None:
                assert seq.next_lease in holders and len(holders) == 2
                assert s.leases[seq.next_lease].worker == s.leases[seq.lease_id].worker
            else:
                assert len(holders) == 1
        if seq.owner is not None:
            assert sid in s.workers[seq.owner].owned
    for name, w in s.workers.items():
        assert all(s.seqs[sid].owner == name for sid in w.owned)
        mine = [lease for lease in s.leases.values() if lease.worker == name]
        assert w.num_leased == sum(len(lease.seq_ids) for lease in mine)
        assert w.num_arriving == sum(lease.num_arriving for lease in mine) >= 0
        assert w.alive or not mine
