"""The prefix cache of a worker's pool, on the CPU in fp32.

Greedy output with the cache on must equal `generate()` for each prompt alone through full
and partial hits, evictions, salts, and migration by KV transfer or recompute; the
allocator's invariants hold under random operations.
"""

from __future__ import annotations

import inspect
import random

import numpy as np
import pytest
import torch

from qmigrate.engine.kv.pool import BlockPool
from qmigrate.engine.kv.prefix_cache import BasePrefixCache, NoPrefixCache, PrefixCache
from qmigrate.engine.rows import StepRow
from qmigrate.engine.engine import Engine
from qmigrate.wire import protocol as P
from qmigrate.wire.prefix_keys import block_key, block_keys, seed_key
from qmigrate.worker.core import WorkerCore

from test_engine import make_engine, make_lease, run, spec_of  # noqa: F401 (fixtures below)
from test_engine import greedy, model, tiny  # noqa: F401

BS = 16
rng = random.Random(11)
SYSTEM = [1] + [rng.randrange(3, 1500) for _ in range(40)]           # 2 full blocks and a bit
QUESTIONS = [[rng.randrange(3, 1500) for _ in range(n)] for n in (5, 9, 23)]


def generate(engine: Engine, seq_id: int, prompt: list[int], n: int, salt: str = "") -> tuple[list[int], int]:
    """n greedy tokens of `prompt` run alone on the engine; and the positions found cached."""
    pending = engine.launch([StepRow(seq_id, list(prompt), 0, 0, cache_salt=salt)])
    out = [engine.collect(pending)[0]]
    cached = pending.cached.get(seq_id, 0)
    while len(out) < n:
        out.append(engine.step([StepRow(seq_id, [out[-1]], len(prompt) + len(out) - 1, len(out))])[0])
    engine.pool.check()
    return out, cached


@pytest.mark.parametrize("runner", ["hf", "fast"])
def test_full_and_partial_hits_give_generate_output(model, greedy, runner):
    engine = make_engine(model, runner=runner)
    first = SYSTEM + QUESTIONS[0]
    out, cached = generate(engine, 1, first, 8)
    assert (out, cached) == (greedy(first, 8), 0)
    engine.release(1)
    # the same prompt: every full block but the one holding its last token is reused
    out, cached = generate(engine, 2, first, 8)
    assert (out, cached) == (greedy(first, 8), (len(first) - 1) // BS * BS)
    # the same system prompt, another question: the system prompt's full blocks
    for sid, q in enumerate(QUESTIONS[1:], start=3):
        prompt = SYSTEM + q
        out, cached = generate(engine, sid, prompt, 8)
        assert out == greedy(prompt, 8)
        assert cached == len(SYSTEM) // BS * BS
    stats = engine.prefix_stats()
    assert stats["cached_tokens"] == 32 + 32 + 32 and stats["prompt_tokens"] > 3 * len(SYSTEM)
    for sid in (2, 3, 4):
        engine.release(sid)
    engine.pool.check()
    assert not engine.pool.prefix.refs.any()   # every count back to zero


@pytest.mark.parametrize("runner", ["hf", "fast"])
def test_a_second_turn_reuses_the_blocks_the_first_decoded(model, greedy, runner):
    engine = make_engine(model, runner=runner)
    prompt = SYSTEM[:20]
    out, _ = generate(engine, 1, prompt, 24)
    assert out == greedy(prompt, 24)
    engine.release(1)
    # the next turn: the conversation so far and a new message
    turn = prompt + out + QUESTIONS[0]
    out2, cached = generate(engine, 2, turn, 10)
    assert cached == (len(prompt) + len(out) - 1) // BS * BS == 32   # a block written by decode
    assert out2 == greedy(turn, 10)


def test_rows_sharing_a_prefix_decode_together_reading_it_once(model, greedy):
    """Four prompts under one 5-block system prompt, decoded in the same steps on the fast
    runner: the step groups them (the shared blocks are read once per group) and every row
    still gives generate()'s tokens; a row of another prefix in the same steps is plain."""
    engine = make_engine(model, runner="fast")
    if not engine.runner.share_prefixes:
        pytest.skip("the fast runner has no Triton kernels here")

    def check(prompt, n, out, what):
        assert out == greedy(prompt, n), what
    decode_sharing(engine, check)


SHARED_SYSTEM = [1] + [rng.randrange(3, 1500) for _ in range(84)]          # 5 full blocks and a bit


def decode_sharing(engine: Engine, check, steps: int = 8) -> None:
    prompts = [SHARED_SYSTEM + q for q in QUESTIONS] + [SHARED_SYSTEM + QUESTIONS[0][::-1]]
    loner = [1] + [rng.randrange(3, 1500) for _ in range(30)]
    generate(engine, 1, prompts[0], 1)                                  # fills the cache
    engine.release(1)
    runner = engine.runner
    grouped, real = [], runner._groups

    def spy(batch):
        out = real(batch)
        grouped.append(out)
        return out
    runner._groups = spy
    try:
        seqs = list(range(10, 10 + len(prompts))) + [20]
        rows = [StepRow(sid, list(p), 0, 0) for sid, p in zip(seqs, prompts + [loner])]
        pending = engine.launch(rows)
        outs = [[t] for t in engine.collect(pending)]
        assert all(pending.cached[sid] == 80 for sid in seqs[:-1])
        lengths = [len(p) for p in prompts + [loner]]
        for i in range(1, steps):
            tokens = engine.step([StepRow(sid, [o[-1]], n + i - 1, i) for sid, o, n in zip(seqs, outs, lengths)])
            for o, t in zip(outs, tokens):
                o.append(t)
    finally:
        del runner._groups
    decode = [g for g in grouped if g is not None]
    assert len(decode) == steps - 1                  # every decode step found the group
    row_start, group_rows, group_len = decode[-1]
    assert group_len.tolist() == [80] and row_start.tolist() == [80] * 4 + [0]
    for i, (o, p) in enumerate(zip(outs, prompts + [loner])):
        check(p, steps, o, f"row {i}")
    for sid in seqs:
        engine.release(sid)
    engine.pool.check()


def test_a_salt_shares_only_with_its_own_salt(model, greedy):
    engine = make_engine(model)
    prompt = SYSTEM + QUESTIONS[1]
    assert generate(engine, 1, prompt, 4, salt="tenant-a") == (greedy(prompt, 4), 0)
    assert generate(engine, 2, prompt, 4, salt="tenant-b")[1] == 0
    assert generate(engine, 3, prompt, 4)[1] == 0
    out, cached = generate(engine, 4, prompt, 4, salt="tenant-a")
    assert (out, cached) == (greedy(prompt, 4), 48)


def test_the_cache_can_be_turned_off(model, greedy):
    engine = make_engine(model, enable_prefix_caching=False)
    prompt = SYSTEM + QUESTIONS[2]
    for sid in (1, 2):
        assert generate(engine, sid, prompt, 4) == (greedy(prompt, 4), 0)
    assert engine.prefix_stats()["cached_blocks"] == 0 and engine.take_prefix_events() == []


@pytest.mark.parametrize("runner", ["hf", "fast"])
def test_evictions_keep_outputs_exact(model, greedy, runner):
    """A pool of 8 blocks: prompts of 3-4 blocks each evict cached blocks (least recently used
    first) and whole idle sequences, and still give generate()'s tokens."""
    engine = make_engine(model, kv_tokens=8 * BS, max_len=96, runner=runner)
    prompts = [SYSTEM + q for q in QUESTIONS] + [[1] + [rng.randrange(3, 1500) for _ in range(50)]]
    seen_evictions = 0
    for round_ in range(2):
        for i, prompt in enumerate(prompts):
            sid = 10 * round_ + i
            out, cached = generate(engine, sid, prompt, 6)
            assert out == greedy(prompt, 6)
            seen_evictions += sum(1 for k in engine.take_prefix_events() if k < 0)
            if i % 2:
                engine.release(sid)   # the others stay until evicted for room
    assert seen_evictions > 0
    engine.pool.check()


def test_shared_last_block_is_copied_before_it_is_written(model, greedy):
    """A sequence cut back into a block that is cached (a rollback) writes a copy of it."""
    engine = make_engine(model)
    prompt = SYSTEM + QUESTIONS[2]          # 64 tokens: 3 blocks cached after the prompt
    out, _ = generate(engine, 1, prompt, 3)
    block = engine.pool.blocks[1][1]
    assert block in engine.pool.prefix.key_of
    kv_before = engine.pool.kv[:, :, block].clone()
    # run it again from position 20 with other ids: positions 20.. of block 1 are rewritten
    other = [7] * 12
    engine.step([StepRow(1, other, 20, 0)])
    assert engine.pool.blocks[1][1] != block
    assert torch.equal(engine.pool.kv[:, :, block], kv_before)
    engine.pool.check()
    engine.release(1)
    assert generate(engine, 2, prompt, 3) == (greedy(prompt, 3), 48)


# --- migration -----------------------------------------------------------------------------

@pytest.mark.parametrize("runner", ["hf", "fast"])
def test_kv_transfer_ships_only_what_the_receiver_lacks(model, greedy, runner):
    prompt = SYSTEM + QUESTIONS[1]
    src, dst = make_engine(model, runner=runner), make_engine(model, runner="hf" if runner == "fast" else "fast")
    out, _ = generate(src, 1, prompt, 5)
    # the receiver has the system prompt cached (another request ran there)
    generate(dst, 9, SYSTEM + QUESTIONS[0], 2)
    dst.release(9)
    ids = prompt + out[:-1]                      # the KV the source holds (the last token is unfed)
    start = dst.admit(1, ids)
    assert start == len(SYSTEM) // BS * BS
    kv = src.export_kv(1, None, start)
    assert kv.shape[2] == len(ids) - start
    assert dst.import_kv(1, kv.clone(), set(), start=start)
    assert dst.cached_len(1) == len(ids)
    rest = [out[-1]]
    for i in range(5, 12):
        rest.append(dst.step([StepRow(1, [rest[-1]], len(prompt) + i - 1, i)])[0])
    assert out + rest[1:] == greedy(prompt, 12)
    dst.pool.check()
    # the shipped blocks stay the sequence's own: only the receiver's own prefix is cached
    dst.release(1)
    assert generate(dst, 2, ids + [5], 1)[1] == start


def test_recompute_reuses_the_receivers_cache(model, greedy):
    prompt = SYSTEM + QUESTIONS[0]
    src, dst = make_engine(model), make_engine(model)
    out, _ = generate(src, 1, prompt, 6)
    generate(dst, 7, SYSTEM + QUESTIONS[2], 2)     # the receiver holds the system prompt
    # the full form (prompt and tokens so far) prefills only past the cached blocks
    full = prompt + out[:-1]
    rest, cached = generate(dst, 1, full, 8)
    assert cached == 32
    assert out[:-1] + rest == greedy(prompt, 13)


def test_worker_core_recompute_and_transfer_with_the_cache(model, greedy):
    """Through WorkerCore (the leases a router sends): a sequence moved to a worker that holds
    its prefix, by recompute (full form) and by KV transfer, continues as generate() does."""
    a, b = WorkerCore(make_engine(model)), WorkerCore(make_engine(model, runner="fast"))
    prompt = SYSTEM + QUESTIONS[1]
    ref = greedy(prompt, 12)
    ids = {1: list(prompt)}
    ran = run(a, make_lease(ids, [spec_of(1, prompt, len(prompt))], num_steps=4))
    assert ran.tokens[1] == ref[:4]
    ids[1] += ran.tokens[1]
    # b runs another request with the same system prompt first
    other = SYSTEM + QUESTIONS[0]
    run(b, make_lease({2: other}, [spec_of(2, other, len(other), max_new_tokens=1)], lease_id=2))
    # recompute on b: the full form; the system prompt's blocks are b's already
    ran = run(b, make_lease(ids, [spec_of(1, ids[1], len(prompt))], lease_id=3, num_steps=4))
    assert ran.tokens[1] == ref[4:8]
    assert b.engine.prefix_stats()["cached_tokens"] >= 32
    ids[1] += ran.tokens[1]
    # and by KV transfer back to a, only what a lacks (its cache holds the first 3 blocks)
    kv = b.export(1, len(ids[1]) - 1, start=48)
    assert kv.shape[2] == len(ids[1]) - 1 - 48
    a.receive_transfer(5, 1, kv, start=48)
    spec = spec_of(1, ids[1], len(prompt), kv_from="tcp://b", transfer_id=5)
    ran = run(a, make_lease(ids, [spec], lease_id=4, num_steps=4))
    assert ran.tokens[1] == ref[8:12]
    assert a.engine.cached_len(1) == len(ids[1]) + 3
    a.engine.pool.check()
    b.engine.pool.check()


@pytest.mark.parametrize("start", [0, 32])
def test_garbage_kv_shipped_in_never_reaches_another_request(model, greedy, start):
    """A worker with a stolen key ships garbage KV for a sequence leased to it. The sequence
    that imports it may go wrong (it was the sender's), but no other request on the receiver
    starts on those blocks, or on blocks computed on top of them: the same prompt sent again
    by another client equals generate()."""
    a, b = WorkerCore(make_engine(model)), WorkerCore(make_engine(model))
    prompt = SYSTEM + QUESTIONS[2]
    ids = {1: list(prompt)}
    ran = run(a, make_lease(ids, [spec_of(1, prompt, len(prompt))], num_steps=2))
    ids[1] += ran.tokens[1]
    if start:   # the receiver holds the system prompt's first blocks itself
        run(b, make_lease({3: SYSTEM[:40]}, [spec_of(3, SYSTEM[:40], 40, max_new_tokens=1)], lease_id=3))
    kv = a.export(1, len(ids[1]) - 1, start=start)
    b.receive_transfer(9, 1, torch.full_like(kv, 3.0), start=start)   # the rogue's shipment
    spec = spec_of(1, ids[1], len(prompt), kv_from="tcp://a", transfer_id=9)
    run(b, make_lease(ids, [spec], lease_id=4, num_steps=20))
    assert b.num_kv_imported == 1
    b.engine.pool.check()
    for sid in (1, 3):
        b.engine.release(sid)
    # other clients, the same prompts: the first starts on no shipped block (only the receiver's
    # own system prompt), the second on the blocks the first computed here
    for sid, asked in ((5, prompt + ids[1][len(prompt):]), (6, prompt)):
        out, cached = generate(b.engine, sid, asked, 6)
        assert out == greedy(asked, 6)
        assert cached <= start if sid == 5 else cached == (len(prompt) - 1) // BS * BS
    b.engine.pool.check()


def test_a_partial_shipment_to_a_worker_that_lost_the_prefix_is_recomputed(model, greedy):
    a, b = WorkerCore(make_engine(model)), WorkerCore(make_engine(model))
    prompt = SYSTEM + QUESTIONS[1]
    ref = greedy(prompt, 8)
    ids = {1: list(prompt)}
    ran = run(a, make_lease(ids, [spec_of(1, prompt, len(prompt))], num_steps=4))
    ids[1] += ran.tokens[1]
    a.receive_transfer(1, 1, None)   # (nothing)
    kv = a.export(1, len(ids[1]) - 1, start=32)     # the router believed b held 2 blocks
    b.receive_transfer(7, 1, kv, start=32)
    spec = spec_of(1, ids[1], len(prompt), kv_from="tcp://a", transfer_id=7)
    ran = run(b, make_lease(ids, [spec], lease_id=2, num_steps=4))
    assert ids[1][len(prompt):] + ran.tokens[1] == ref
    b.engine.pool.check()


# --- the allocator under random operations ---------------------------------------------------

def test_allocator_invariants_under_random_operations():
    """A pool whose 'KV' is the token id itself (one layer, one head of width one): after any
    mix of admissions, prefills, decodes, rollbacks, releases and evictions, every sequence
    reads its own ids back, every cached block holds the ids its key was made from, and every
    reference count returns to zero."""
    r = random.Random(3)
    bs, num_blocks = 4, 24
    pool = BlockPool(1, 1, 1, num_blocks, bs, torch.float32, torch.device("cpu"))
    made: dict[int, tuple] = {}                    # key -> the ids it was made from
    stems = [[r.randrange(1, 9) for _ in range(12)] for _ in range(3)]
    live: dict[int, list[int]] = {}                # seq_id -> ids written

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
            ids = live[sid]
            for b, key in enumerate(keys):
                made.setdefault(key, tuple(ids[:(b + 1) * bs]))
                assert made[key] == tuple(ids[:(b + 1) * bs]), "one key for two prefixes"
        for block, key in pool.prefix.key_of.items():
            parent_ids = made.get(key)
            assert parent_ids is not None
            assert pool.kv.view(-1)[block * bs:(block + 1) * bs].tolist() == [float(t) for t in parent_ids[-bs:]]

    next_id = 0
    for _ in range(600):
        op = r.random()
        if op < 0.3 or not live:
            next_id += 1
            sid = next_id
            ids = r.choice(stems)[:r.randrange(1, 13)] + [r.randrange(1, 9) for _ in range(r.randrange(0, 10))]
            start = pool.admit(sid, ids, salt=r.choice(["", "", "s"]))
            assert start % bs == 0 and start < len(ids)
            assert pool.make_room(pool.blocks_for(len(ids)) - len(pool.blocks[sid]), set(live) | {sid}) or True
            if pool.num_free_blocks < pool.blocks_for(len(ids)) - len(pool.blocks[sid]):
                pool.release(sid)
            else:
                pool.grow(sid, len(ids))
                live[sid] = list(ids)
                write(sid, start, ids[start:])
        elif op < 0.7:
            sid = r.choice(list(live))
            ids = live[sid]
            if not pool.make_room(1, set(live)):
                continue
            pool.grow(sid, len(ids) + 1)
            token = r.randrange(1, 9)
            write(sid, len(ids), [token])
            ids.append(token)
        elif op < 0.8:
            sid = r.choice(list(live))
            cut = r.randrange(1, len(live[sid]) + 1)
            if not pool.truncate(sid, cut):
                del live[sid]
                continue
            new = [r.randrange(1, 9) for _ in range(r.randrange(1, 4))]
            if not pool.make_room(pool.blocks_for(cut + len(new)) - len(pool.blocks[sid]), set(live)):
                continue
            pool.grow(sid, cut + len(new))
            live[sid] = live[sid][:cut] + new
            write(sid, cut, new)
        else:
            sid = r.choice(list(live))
            pool.release(sid)
            del live[sid]
        live = {s: ids for s, ids in live.items() if s in pool.blocks}   # evicted for room
        check()
    for sid in list(live):
        pool.release(sid)
    pool.check()
    assert not pool.prefix.refs.any()
    events = pool.prefix.take_events()
    assert any(k < 0 for k in events) and any(k >= 0 for k in events)


def test_keys_chain_and_salt():
    ids = list(range(40))
    keys = block_keys(ids, 16)
    assert len(keys) == 2 and all(0 <= k < 1 << 63 for k in keys)
    assert keys[1] == block_key(keys[0], ids[16:32])
    assert block_keys(ids, 16, "x") != keys and block_keys(ids, 16, "x")[0] == block_key(seed_key("x"), ids[:16])
    assert block_keys(ids[:32] + [0] * 8, 16) == keys
    assert block_keys([7] + ids[1:], 16)[1] != keys[1]   # a different first block changes every key after it
    assert block_keys(np.asarray(ids, dtype=np.int64), 16) == keys
    assert block_keys(P.pack_i32(ids), 16) == keys   # the packed ids a SeqSpec carries
    assert P.SeqSpec(1, P.pack_i32(ids), 40, 4, cache_salt="t").cache_salt == "t"


def test_known_keys_are_remembered_within_a_bound(monkeypatch):
    from qmigrate.wire import prefix_keys
    monkeypatch.setattr(prefix_keys, "MAX_KNOWN", 8)
    monkeypatch.setattr(prefix_keys, "_known", {})
    ids = list(range(1, 161))   # 10 blocks
    first = block_keys(ids, 16)
    assert len(prefix_keys._known) <= 8   # emptied when full
    assert block_keys(ids, 16) == first == block_keys(ids, 16, parent=0)
    assert block_keys(ids, 16, "t") != first   # a salt's chain is its own
    other = [7] + ids[1:]
    assert block_keys(other, 16)[0] != first[0] and block_keys(other, 16)[1:] != first[1:]


def test_keys_are_the_blake2b_chain_the_router_and_workers_share():
    """Router and workers must key a prompt alike: the definition, written out here, against
    the one-pass chain for lists and arrays, every start block, bound and parent."""
    import hashlib

    def reference(ids, bs, parent, first, n):   # parent: the key of block first - 1
        keys, key = [], parent
        for b in range(first, n):
            data = key.to_bytes(8, "little") + b"".join(int(t).to_bytes(4, "little") for t in ids[b * bs:(b + 1) * bs])
            key = int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") & ((1 << 63) - 1)
            keys.append(key)
        return keys

    r = random.Random(3)
    for _ in range(40):
        bs = r.choice([1, 4, 16])
        ids = [r.randrange(0, 200_000) for _ in range(r.randrange(0, 90))]
        first, parent = r.randrange(0, 3), r.choice([0, r.randrange(1 << 63)])
        bound = r.choice([None, r.randrange(0, 8)])
        n = len(ids) // bs if bound is None else min(len(ids) // bs, bound)
        want = reference(ids, bs, parent, first, n)
        assert block_keys(ids, bs, max_blocks=bound, parent=parent, first=first) == want
        assert block_keys(np.asarray(ids, dtype=np.int64), bs, max_blocks=bound, parent=parent, first=first) == want


def test_the_worker_section_sets_the_cache():
    from qmigrate.config import ConfigError, WorkerConfig
    assert WorkerConfig().engine_config().enable_prefix_caching is True
    assert WorkerConfig(enable_prefix_caching=False).engine_config().enable_prefix_caching is False
    with pytest.raises(ConfigError):
        WorkerConfig(enable_prefix_caching="maybe")


def test_a_fleet_reports_cached_tokens_per_request(tmp_path, tiny_model_dir, qmigrate):
    """Real processes: one worker taking one sequence at a time, three prompts of one 50-token
    system prompt. The first prefills it all, the others find its 3 full blocks cached; the
    JSONL output says so, and the tokens are generate()'s."""
    import json

    import yaml

    from conftest import greedy_reference
    system = SYSTEM + [5] * 9
    prompts = [{"id": f"p{i}", "prompt_ids": system + q, "max_new_tokens": 5} for i, q in enumerate(QUESTIONS)]
    topo = tmp_path / "topo.yaml"
    topo.write_text(yaml.safe_dump({
        "transport": "ipc", "model": {"path": str(tiny_model_dir)}, "nodes": [{"name": "local"}],
        "router": {"node": "local"}, "ingest": {"node": "local", "input": "jsonl"},
        "detokenizer": {"node": "local", "output": "jsonl"},
        "workers": [{"name": "w1", "node": "local", "device": "cpu", "max_num_seqs": 1}]}))
    run = qmigrate("sim", str(topo), stdin="".join(json.dumps(p) + "\n" for p in prompts))
    assert run.returncode == 0, run.stderr[-3000:]
    finals = run.finals()
    assert sorted(f["cached_tokens"] for f in finals.values()) == [0, 48, 48]
    check = greedy_reference(tiny_model_dir)
    for p in prompts:
        check(p["prompt_ids"], 5, finals[p["id"]]["token_ids"], p["id"])


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("runner", ["hf", "fast"])
def test_hits_on_a_gpu_give_generate_output(tiny_model_dir, runner):
    """On a GPU in fp32: prompts of one system prompt, run one after another, reuse its blocks
    and give generate()'s tokens (a numerical tie may part them, as conftest allows)."""
    from conftest import greedy_reference
    from qmigrate.hub.loading import load_model
    model, _ = load_model(tiny_model_dir, "cuda:0", "float32")
    engine = Engine(model, runner=runner, max_kv_tokens=1 << 14, max_num_seqs=16)
    check = greedy_reference(tiny_model_dir)
    for sid, q in enumerate(QUESTIONS):
        prompt = SYSTEM + q
        out, cached = generate(engine, sid, prompt, 8)
        assert cached == (0 if sid == 0 else len(SYSTEM) // BS * BS)
        check(prompt, 8, out, f"{runner} {sid}")
        engine.release(sid)
    engine.pool.check()


@pytest.mark.gpu
@pytest.mark.timeout(600)
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_rows_sharing_a_prefix_on_a_gpu_replay_the_shared_prefix_graph(tiny_model_dir):
    """The same on a GPU in fp32, decode steps replayed from the CUDA graphs that read the
    shared prefix once per group."""
    from conftest import greedy_reference
    from qmigrate.hub.loading import load_model
    model, _ = load_model(tiny_model_dir, "cuda:0", "float32")
    engine = Engine(model, runner="fast", max_kv_tokens=1 << 14, max_num_seqs=16)
    assert engine.runner.share_prefixes and engine.runner.shared_graphs
    replayed = []
    for bucket, graph in engine.runner.shared_graphs.items():
        real = graph.replay
        graph.replay = lambda real=real, bucket=bucket: (replayed.append(bucket), real())[1]
    decode_sharing(engine, greedy_reference(tiny_model_dir), steps=12)
    assert replayed and set(replayed) == {8}                            # 5 rows: the 8-row bucket


@pytest.mark.parametrize("cls", [PrefixCache, NoPrefixCache], ids=lambda c: c.__name__)
def test_both_forms_of_the_cache_are_the_whole_interface(cls):
    assert not cls.__abstractmethods__
    for name in BasePrefixCache.__abstractmethods__:
        want, got = getattr(BasePrefixCache, name), getattr(cls, name)
        if isinstance(want, property):
            assert isinstance(got, property), f"{cls.__name__}.{name}"
        else:
            assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters), name
    assert isinstance(cls.is_enabled, bool)


def test_without_a_cache_a_pool_shares_nothing_and_keeps_a_cut_sequences_blocks():
    """The null form under random prefills, decodes, rollbacks, releases and evictions: every
    sequence reads its own ids back, no block is ever shared, a sequence cut back keeps its
    blocks (it writes over them), and nothing is cached or reported."""
    r = random.Random(4)
    bs = 4
    pool = BlockPool(1, 1, 1, 24, bs, torch.float32, torch.device("cpu"), prefix_cache=False)
    assert isinstance(pool.prefix, NoPrefixCache) and not pool.is_caching
    live: dict[int, list[int]] = {}

    def write(sid, start, new):
        slots = torch.from_numpy(pool.slots(sid, start, start + len(new)))
        pool.kv.view(-1)[slots] = torch.tensor(new, dtype=torch.float32)
        pool.mark_written([sid], [start + len(new)], [StepRow(sid, new, start, 0)])

    for sid in range(1, 400):
        op = r.random()
        if op < 0.35 or not live:
            ids = [r.randrange(1, 9) for _ in range(r.randrange(1, 14))]
            if pool.make_room(pool.blocks_for(len(ids)), {sid}):   # evicting others if it must
                pool.grow(sid, len(ids))
                write(sid, 0, ids)
                live[sid] = ids
        elif op < 0.7:
            s = r.choice(list(live))
            if pool.make_room(pool.blocks_for(len(live[s]) + 1) - len(pool.blocks[s]), {s}):
                pool.grow(s, len(live[s]) + 1)
                token = r.randrange(1, 9)
                write(s, len(live[s]), [token])
                live[s].append(token)
        elif op < 0.85:
            s = r.choice(list(live))
            held = list(pool.blocks[s])
            cut = r.randrange(1, len(live[s]) + 1)
            assert pool.truncate(s, cut)
            assert pool.blocks[s] == held and pool.cached_len(s) == cut
            live[s] = live[s][:cut]
        else:
            s = r.choice(list(live))
            pool.release(s)
            del live[s]
        live = {s: ids for s, ids in live.items() if s in pool.blocks}   # evicted for room
        pool.check()
        owners = [b for blocks in pool.blocks.values() for b in blocks]
        assert len(owners) == len(set(owners)) and pool.num_free_blocks == len(pool.free)
        for s, ids in live.items():
            got = pool.kv.view(-1)[torch.from_numpy(pool.slots(s, 0, len(ids)))]
            assert got.tolist() == [float(t) for t in ids]
    assert pool.take_evicted()
    assert pool.prefix.take_events() == [] and set(pool.prefix.stats().values()) == {0}


def test_an_engine_without_a_cache_reports_no_cached_prompt_positions(model):
    """With the cache off a prompt's cached positions are unknown (no entry, -1 on the wire),
    not 0; with it on, a miss is 0."""
    prompt = SYSTEM + QUESTIONS[0]
    off, on = make_engine(model, enable_prefix_caching=False), make_engine(model)
    pending = off.launch([StepRow(1, list(prompt), 0, 0)])
    assert off.collect(pending)[0] >= 0 and pending.cached == {}
    pending = on.launch([StepRow(1, list(prompt), 0, 0)])
    assert on.collect(pending)[0] >= 0 and pending.cached == {1: 0}


def test_a_lazy_pool_cleans_blocks_handed_out_elsewhere_once():
    pool = BlockPool(1, 2, 2, 8, 4, torch.float32, torch.device("cpu"))
    pool.kv.fill_(float("nan"))   # what an untouched page may hold
    pool.clean(np.array([[3, 5], [5, 0]]))
    assert pool.kv[:, :, [3, 5]].eq(0).all() and pool.kv[:, :, 4].isnan().all()
    pool.kv[:, :, 3] = 7.0
    pool.clean([3])               # zeroed once only: KV written since stays
    assert pool.kv[:, :, 3].eq(7.0).all()
