"""The host KV tier (engine/kv/host_tier.py), on the CPU in fp32: the pool's evicted cached
blocks go to the tier under their keys and come back by copy.

The CPU worker's default is no tier (its pool is host memory); these tests set
kv_offloading_size explicitly, which builds the tier on the CPU too. Greedy output must equal
`generate()` through tier hits, evictions from both tiers and migration both ways; the
allocator's invariants hold with two tiers under random operations.
"""

from __future__ import annotations

import random

import pytest
import torch

from qmigrate.engine.config import EngineConfig
from qmigrate.engine.kv.host_tier import HostTier, tier_bytes
from qmigrate.engine.kv.pool import BlockPool
from qmigrate.engine.rows import StepRow
from qmigrate.config_rules import ConfigError
from qmigrate.wire import protocol as P
from qmigrate.wire.prefix_keys import block_keys
from qmigrate.worker.core import WorkerCore

from test_engine import make_engine, make_lease, run, spec_of  # noqa: F401
from test_engine import greedy, model, tiny  # noqa: F401
from test_prefix_cache import generate

BS = 16
rng = random.Random(41)
# conversations whose prompts fill most of a pool of 8 blocks
CONVS = [[1] + [rng.randrange(3, 1500) for _ in range(98)] for _ in range(3)]


def tier_engine(model, gib=0.01, **kw):
    engine = make_engine(model, kv_tokens=128, max_len=128, kv_offloading_size=gib, **kw)
    assert engine.pool.tier is not None
    return engine


def test_the_setting():
    assert EngineConfig().kv_offloading_size == -1                 # sized from host memory on a GPU, off on the CPU
    with pytest.raises(ConfigError, match="kv_offloading_size"):
        EngineConfig(kv_offloading_size=-2)
    assert tier_bytes(0.5, on_gpu=False) == 1 << 29                  # explicit: on the CPU too
    assert tier_bytes(-1, on_gpu=False) == 0 and tier_bytes(0, on_gpu=True) == 0
    auto = tier_bytes(-1, on_gpu=True, devices_here=2)
    assert 0 < auto <= 64 << 30


def test_no_tier_by_default_on_the_cpu(model):
    assert make_engine(model).pool.tier is None
    assert make_engine(model, kv_offloading_size=-1).pool.tier is None


@pytest.mark.parametrize("runner", ["hf", "fast"])
def test_evicted_blocks_come_back_from_the_tier(model, greedy, runner):
    engine = tier_engine(model, runner=runner)
    tier = engine.pool.tier
    a, b = CONVS[0], CONVS[1]
    out, cached = generate(engine, 1, a, 6)
    assert (out, cached) == (greedy(a, 6), 0)
    engine.release(1)
    # b's prompt needs the whole pool: a's cached blocks are evicted into the tier
    out, _ = generate(engine, 2, b, 6)
    assert out == greedy(b, 6)
    engine.release(2)
    assert len(tier) >= 4 and tier.stats()["bytes_in"] == len(tier) * tier.block_bytes
    # a again: the GPU chain is gone, the tier has it; copied back, not prefilled
    before = engine.prefix_stats()["cached_tokens"]
    keys = block_keys(a, BS)[:(len(a) - 1) // BS]
    on_gpu = sum(k in engine.pool.prefix.by_key for k in keys)
    assert on_gpu < len(keys) and all(k in tier for k in keys[on_gpu:])
    out, cached = generate(engine, 3, a, 6)
    assert out == greedy(a, 6)
    assert cached == (len(a) - 1) // BS * BS
    assert engine.prefix_stats()["cached_tokens"] - before == cached   # usage counts tier hits
    assert tier.num_hits == len(keys) - on_gpu and tier.bytes_out == tier.num_hits * tier.block_bytes
    # the next turn of a (its answer and a new question) starts on the blocks brought back
    turn = a + out + [7, 8, 9]
    engine.release(3)
    out2, cached2 = generate(engine, 4, turn, 4)
    assert out2 == greedy(turn, 4) and cached2 >= cached
    engine.pool.check()


def test_a_block_dropped_from_both_tiers_is_recomputed(model, greedy):
    three = 3 * tier_block_bytes(make_engine(model, kv_tokens=128, max_len=128).pool)
    engine = tier_engine(model, gib=three / 2**30)
    tier = engine.pool.tier
    assert tier.capacity == 3
    for sid, prompt in enumerate(CONVS, start=1):
        out, _ = generate(engine, sid, prompt, 3)
        assert out == greedy(prompt, 3)
        engine.release(sid)
    assert len(tier) == 3 and any(k < 0 for k in tier.take_events())
    # the first conversation's blocks left both tiers: recomputed (at most a tail of it found)
    out, cached = generate(engine, 9, CONVS[0], 5)
    assert out == greedy(CONVS[0], 5)
    assert cached == 0
    engine.pool.check()


def test_tier_hits_survive_migration_both_ways(model, greedy):
    """A conversation computed on a, its blocks evicted to a's tier; its next turn moves to b
    by KV transfer and back to a by recompute, where it starts on the tier's blocks."""
    a, b = WorkerCore(tier_engine(model)), WorkerCore(tier_engine(model, runner="fast"))
    prompt = CONVS[0]
    ref = greedy(prompt, 12)
    ids = {1: list(prompt)}
    ran = run(a, make_lease(ids, [spec_of(1, prompt, len(prompt))], num_steps=4))
    assert ran.tokens[1] == ref[:4]
    ids[1] += ran.tokens[1]
    # KV transfer to b, which continues
    kv = a.export(1, len(ids[1]) - 1)
    b.receive_transfer(5, 1, kv)
    spec = spec_of(1, ids[1], len(prompt), kv_from="tcp://a", transfer_id=5)
    ran = run(b, make_lease(ids, [spec], lease_id=2, num_steps=4))
    assert ran.tokens[1] == ref[4:8]
    ids[1] += ran.tokens[1]
    a.engine.release(1)
    # a's cached blocks go to its tier while another prompt runs there
    other = CONVS[1]
    run(a, make_lease({2: other}, [spec_of(2, other, len(other), max_new_tokens=1)], lease_id=3))
    a.engine.release(2)
    assert len(a.engine.pool.tier)
    # back to a by recompute (the full form): the prompt's blocks come from the tier
    ran = run(a, make_lease(ids, [spec_of(1, ids[1], len(prompt))], lease_id=4, num_steps=4))
    assert ran.tokens[1] == ref[8:12]
    assert a.engine.pool.tier.num_hits >= 3
    a.engine.pool.check()
    b.engine.pool.check()


def test_tier_blocks_hold_raw_bytes_of_any_dtype():
    """The tier copies blocks as bytes: a bf16 pool's block comes back bit for bit."""
    pool = BlockPool(2, 1, 4, 6, 2, torch.bfloat16, torch.device("cpu"))
    tier = HostTier(pool.kv, 1 << 20)
    pool.kv.copy_(torch.randn(pool.kv.shape))
    want = pool.kv[:, :, 3].clone()
    tier.save(pool.kv, [3], [42])
    assert tier.read(42).shape == (2, 2, 2, 1, 8)
    pool.kv[:, :, 5] = 0
    tier.restore(pool.kv, [5], [42])
    assert torch.equal(pool.kv[:, :, 5], want)
    tier.check()


def test_the_tier_fills_in_and_out_of_inference_mode():
    """A step evicts under inference mode, a shipment placed between steps outside it: the
    tier's host memory takes both."""
    pool = BlockPool(1, 1, 1, 8, 2, torch.float32, torch.device("cpu"))
    tier = HostTier(pool.kv, 4 * tier_block_bytes(pool))
    with torch.inference_mode():
        tier.save(pool.kv, [1], [10])
    tier.save(pool.kv, [2], [20])
    with torch.inference_mode():
        tier.restore(pool.kv, [3], [20])
    tier.restore(pool.kv, [4], [10])
    assert len(tier) == 2 and tier.num_hits == 2


def test_host_memory_grows_by_chunks_up_to_the_capacity(monkeypatch):
    from qmigrate.engine.kv import host_tier
    pool = BlockPool(1, 1, 1, 8, 2, torch.float32, torch.device("cpu"))
    monkeypatch.setattr(host_tier, "CHUNK_BYTES", 2 * tier_block_bytes(pool))
    tier = HostTier(pool.kv, 5 * tier_block_bytes(pool))
    pool.kv.view(-1).copy_(torch.arange(pool.kv.numel(), dtype=torch.float32))
    tier.save(pool.kv, [1], [10])
    assert [len(c) for c in tier.chunks] == [2]
    tier.save(pool.kv, [2, 3, 4, 5, 6, 7], [20, 30, 40, 50, 60, 70])
    assert [len(c) for c in tier.chunks] == [2, 2, 1] and len(tier) == 5 and 10 not in tier
    tier.check()
    for b, key in zip([3, 4, 5, 6, 7], [30, 40, 50, 60, 70]):
        assert torch.equal(tier.read(key), pool.kv[:, :, b].view(torch.uint8))


def test_a_tier_that_grows_while_idle_holds_only_what_its_chunks_hold(monkeypatch):
    """A GPU's pinned tier: one chunk when made, the others only from `grow` (the worker calls
    it while it has nothing to run), never from a save inside a step."""
    from qmigrate.engine.kv import host_tier
    pool = BlockPool(1, 1, 1, 8, 2, torch.float32, torch.device("cpu"))
    monkeypatch.setattr(host_tier, "PINNED_CHUNK_BYTES", 2 * tier_block_bytes(pool))
    tier = HostTier(pool.kv, 5 * tier_block_bytes(pool), pin=False, grows_idle=True)
    assert tier.allocated() == 2 and tier.capacity == 5
    tier.save(pool.kv, [1, 2, 3], [10, 20, 30])        # the last two fit; no chunk added
    assert tier.allocated() == 2 and 10 not in tier and 20 in tier and 30 in tier
    tier.save(pool.kv, [4], [40])                      # the LRU (20) makes room
    assert 20 not in tier and [len(c) for c in tier.chunks] == [2]
    tier.check()
    assert tier.grow() and tier.grow() and not tier.grow()
    assert [len(c) for c in tier.chunks] == [2, 2, 1] and tier.allocated() == 5
    tier.save(pool.kv, [5, 6, 7], [50, 60, 70])
    assert len(tier) == 5 and {30, 40, 50, 60, 70} <= set(tier.slots)
    for b, key in zip([5, 6, 7], [50, 60, 70]):
        assert torch.equal(tier.read(key), pool.kv[:, :, b].view(torch.uint8))
    tier.check()
    assert not HostTier(pool.kv, 5 * tier_block_bytes(pool)).grow()   # grows as it fills instead


def test_tier_lru_and_events():
    pool = BlockPool(1, 1, 1, 8, 2, torch.float32, torch.device("cpu"))
    tier = HostTier(pool.kv, 3 * tier_block_bytes(pool))
    pool.kv.view(-1).copy_(torch.arange(pool.kv.numel(), dtype=torch.float32))
    tier.save(pool.kv, [1, 2, 3], [10, 20, 30])
    tier.save(pool.kv, [1], [10])          # held: touched, not copied again
    assert tier.bytes_in == 3 * tier.block_bytes
    tier.save(pool.kv, [4], [40])          # full: the least recently used (20) goes
    assert 20 not in tier and 10 in tier and 40 in tier
    assert tier.take_events() == [10, 20, 30, ~20, 40]
    assert tier.read(40).view(torch.float32).flatten().tolist() == [8.0, 9.0, 24.0, 25.0]   # its keys, its values
    tier.check()


def tier_block_bytes(pool: BlockPool) -> int:
    return pool.kv[:, :, 0].numel() * pool.kv.element_size()


def test_allocator_invariants_with_two_tiers_under_random_operations():
    """A pool whose 'KV' is the token id itself, with a host tier smaller than the pool:
    after any mix of admissions (some continuing in the tier), decodes, rollbacks, releases
    and evictions from both tiers, every sequence reads its own ids back, every block either
    tier holds under a key holds the ids that key was made from, and every count returns to
    zero."""
    r = random.Random(4)
    bs, num_blocks = 4, 16
    pool = BlockPool(1, 1, 1, num_blocks, bs, torch.float32, torch.device("cpu"))
    pool.attach_tier(HostTier(pool.kv, 10 * tier_block_bytes(pool)))
    tier = pool.tier
    made: dict[int, tuple] = {}
    stems = [[r.randrange(1, 9) for _ in range(16)] for _ in range(4)]
    live: dict[int, list[int]] = {}
    hits = 0

    def write(sid, start, new):
        slots = torch.from_numpy(pool.slots(sid, start, start + len(new)))
        pool.kv.view(-1)[slots] = torch.tensor(new, dtype=torch.float32)
        pool.mark_written([sid], [start + len(new)], [StepRow(sid, new, start, 0)])

    def check():
        pool.check()
        for sid, ids in live.items():
            got = pool.kv.view(-1)[torch.from_numpy(pool.slots(sid, 0, len(ids)))]
            assert got.tolist() == [float(t) for t in ids], f"sequence {sid} was overwritten"
        for sid, keys in pool.prefix.keys.items():
            for b, key in enumerate(keys):
                made.setdefault(key, tuple(live[sid][:(b + 1) * bs]))
                assert made[key] == tuple(live[sid][:(b + 1) * bs]), "one key for two prefixes"
        for block, key in pool.prefix.key_of.items():
            assert pool.kv.view(-1)[block * bs:(block + 1) * bs].tolist() == [float(t) for t in made[key][-bs:]]
        for key in tier.slots:
            assert tier.read(key).view(torch.float32).flatten()[:bs].tolist() == [float(t) for t in made[key][-bs:]]

    next_id = 0
    for _ in range(800):
        op = r.random()
        if op < 0.35 or not live:
            next_id += 1
            sid = next_id
            ids = r.choice(stems)[:r.randrange(1, 17)] + [r.randrange(1, 9) for _ in range(r.randrange(0, 6))]
            before = tier.num_hits
            start = pool.admit(sid, ids, salt=r.choice(["", "", "s"]))
            hits += tier.num_hits - before
            assert start % bs == 0 and start < len(ids)
            live[sid] = list(ids[:start])
            check()
            if not pool.make_room(pool.blocks_for(len(ids)) - len(pool.blocks[sid]), set(live)):
                pool.release(sid)
                del live[sid]
            else:
                pool.grow(sid, len(ids))
                live[sid] = list(ids)
                write(sid, start, ids[start:])
        elif op < 0.65:
            sid = r.choice(list(live))
            if not pool.make_room(1, set(live)):
                continue
            pool.grow(sid, len(live[sid]) + 1)
            token = r.randrange(1, 9)
            write(sid, len(live[sid]), [token])
            live[sid].append(token)
        elif op < 0.75:
            sid = r.choice(list(live))
            cut = r.randrange(1, len(live[sid]) + 1)
            if not pool.truncate(sid, cut):
                del live[sid]
                continue
            live[sid] = live[sid][:cut]
        else:
            sid = r.choice(list(live))
            pool.release(sid)
            del live[sid]
        live = {s: ids for s, ids in live.items() if s in pool.blocks}
        check()
    for sid in list(live):
        pool.release(sid)
    pool.check()
    assert not pool.prefix.refs.any()
    assert hits > 10, "the walk never hit the host tier"
    assert any(k < 0 for k in tier.take_events()), "the tier never dropped a block"


def test_the_worker_reports_its_tier(model):
    """Step results carry the tier's key events and totals; a worker without a tier sends none."""
    core = WorkerCore(tier_engine(model))
    result, seen = None, []
    for lease_id, prompt in enumerate(CONVS[:2], start=1):
        result, _ = core.run(make_lease({lease_id: prompt}, [spec_of(lease_id, prompt, len(prompt), max_new_tokens=1)],
                                        lease_id=lease_id))
        seen += P.unpack_i64(result.tier_events).tolist()
        core.engine.release(lease_id)
    stats = dict(zip(P.TIER_STATS, P.unpack_i64(result.tier_stats).tolist()))
    tier = core.engine.pool.tier
    assert stats["host_blocks"] == len(tier) > 0 and stats["host_bytes_in"] == tier.bytes_in
    assert sorted(k for k in seen if k >= 0) == sorted(tier.slots)
    plain = WorkerCore(make_engine(model))
    result, _ = plain.run(make_lease({1: CONVS[0]}, [spec_of(1, CONVS[0], len(CONVS[0]), max_new_tokens=1)]))
    assert result.tier_events == b"" and result.tier_stats == b""


# --- pulling a prefix from another worker -------------------------------------------------------

def _pull_into(b: WorkerCore, a: WorkerCore, sid: int, ids: list[int], start: int = 0, transfer_id: int = 9):
    """What a prefix pull does: a ships the blocks of ids past `start` that it holds cached."""
    keys = block_keys(ids, BS, max_blocks=(len(ids) - 1) // BS)[start // BS:]
    kv, copied = a.export_prefix_started(keys)
    assert copied is None
    b.receive_transfer(transfer_id, sid, kv, start=start)
    return kv


@pytest.mark.parametrize("where", ["gpu", "host"])
def test_a_pulled_prefix_gives_generate_output(model, greedy, where):
    """b starts a conversation's next turn on the blocks a holds, on a's GPU or host tier,
    pulled over the KV link; it prefills only the rest."""
    a, b = WorkerCore(tier_engine(model)), WorkerCore(tier_engine(model, runner="fast"))
    first = CONVS[0]
    run(a, make_lease({1: first}, [spec_of(1, first, len(first), max_new_tokens=2)]))
    a.engine.release(1)
    if where == "host":   # another prompt pushes a's blocks to its host tier
        run(a, make_lease({2: CONVS[1]}, [spec_of(2, CONVS[1], len(CONVS[1]), max_new_tokens=1)], lease_id=2))
        a.engine.release(2)
        assert block_keys(first, BS)[3] not in a.engine.pool.prefix.by_key
    turn = first + [5, 6, 7, 8]
    kv = _pull_into(b, a, 3, turn)
    assert kv.shape[2] == (len(first) - 1) // BS * BS
    spec = spec_of(3, turn, len(turn), kv_from="tcp://a", transfer_id=9)
    result, _ = b.run(make_lease({3: turn}, [spec], lease_id=3, num_steps=5))
    assert P.unpack_i32(result.tokens).tolist() == greedy(turn, 5)
    assert P.unpack_i32(result.cached_tokens).tolist() == [kv.shape[2]]   # usage counts the pulled prefix
    assert b.num_kv_imported == 1
    a.engine.pool.check()
    b.engine.pool.check()
    # the pulled blocks are the sender's word: they never join b's cache
    b.engine.release(3)
    assert generate(b.engine, 4, turn, 1)[1] == 0


def test_a_pull_onto_blocks_the_receiver_holds(model, greedy):
    """b holds the first blocks itself: only the rest is shipped, placed after them."""
    a, b = WorkerCore(tier_engine(model)), WorkerCore(tier_engine(model))
    turn = CONVS[2] + [9, 9, 9]
    run(a, make_lease({1: CONVS[2]}, [spec_of(1, CONVS[2], len(CONVS[2]), max_new_tokens=1)]))
    run(b, make_lease({2: CONVS[2][:40]}, [spec_of(2, CONVS[2][:40], 40, max_new_tokens=1)], lease_id=2))
    a.engine.release(1)
    b.engine.release(2)
    kv = _pull_into(b, a, 5, turn, start=32)
    assert kv.shape[2] == len(CONVS[2]) // BS * BS - 32
    ran = run(b, make_lease({5: turn}, [spec_of(5, turn, len(turn), kv_from="tcp://a", transfer_id=9)],
                            lease_id=3, num_steps=4))
    assert ran.tokens[5] == greedy(turn, 4)
    b.engine.pool.check()


def test_a_holder_killed_mid_pull_leaves_a_recompute(model, greedy):
    """The holder died before its shipment came (or sent a piece of nothing): the lease runs
    once its wait is over, prefilling the whole prompt, and equals generate()."""
    b = WorkerCore(tier_engine(model))
    turn = CONVS[1] + [4, 4]
    spec = spec_of(7, turn, len(turn), kv_from="tcp://dead", transfer_id=11)
    ran = run(b, make_lease({7: turn}, [spec], num_steps=4))
    assert ran.tokens[7] == greedy(turn, 4) and b.num_kv_imported == 0
    b.receive_transfer(12, 8, None, start=0)          # an empty shipment: the holder lost the blocks
    spec = spec_of(8, turn, len(turn), kv_from="tcp://a", transfer_id=12)
    ran = run(b, make_lease({8: turn}, [spec], lease_id=2, num_steps=4))
    assert ran.tokens[8] == greedy(turn, 4) and b.num_kv_imported == 0
    b.engine.pool.check()


def test_nothing_held_ships_nothing(model):
    a = WorkerCore(tier_engine(model))
    assert a.export_prefix_started(block_keys(CONVS[0], BS)) == (None, None)


def test_a_prefix_pull_over_the_kv_link(model, greedy, ipc_dir):
    """The holder's worker loop takes a ShipKV naming block keys (a prefix pull): it ships
    what it holds cached over a real socket without dropping anything, and the receiver's
    lease starts on it."""
    import zmq

    from qmigrate.wire import transport
    from qmigrate.worker.leases import KVOutbox
    from qmigrate.worker.loop import Worker
    endpoint = f"ipc://{ipc_dir}/kv.sock"
    holder, receiver = Worker.__new__(Worker), Worker.__new__(Worker)
    holder.peers, holder.outbox, holder.core = {}, KVOutbox(), WorkerCore(tier_engine(model))
    receiver.kv_in = transport.socket(zmq.PULL, bind=endpoint, max_bytes=transport.KV_MAX_MESSAGE_BYTES, hwm=64)
    receiver.core = WorkerCore(tier_engine(model))
    try:
        first = CONVS[1]
        run(holder.core, make_lease({1: first}, [spec_of(1, first, len(first), max_new_tokens=4)]))
        assert holder.core.engine.cached_len(1) == len(first)   # it runs on: the pull must not drop it
        held = dict(holder.core.engine.pool.prefix.by_key)
        turn = first + [3, 1, 4]
        keys = block_keys(turn, BS, max_blocks=(len(turn) - 1) // BS)
        holder.ship(P.ShipKV(2, endpoint, 99, len(keys) * BS, 0, P.pack_i64(keys)))
        assert holder.core.engine.cached_len(1) == len(first) and holder.core.engine.pool.prefix.by_key == held
        for _ in range(200):
            receiver.kv_in.poll(50)
            receiver.receive_kv()
            if 99 in receiver.core.transfers:
                break
        assert receiver.core.transfers[99].kv.shape[2] == (len(first) - 1) // BS * BS
        spec = spec_of(2, turn, len(turn), kv_from="ipc://holder", transfer_id=99)
        ran = run(receiver.core, make_lease({2: turn}, [spec], lease_id=2, num_steps=4))
        assert ran.tokens[2] == greedy(turn, 4) and receiver.core.num_kv_imported == 1
    finally:
        for sock in holder.peers.values():
            sock.close(linger=0)
        receiver.kv_in.close(linger=0)
